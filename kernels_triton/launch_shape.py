"""What Triton's launcher starts a compiled kernel with, past what the compiler chose: clusters of
CTAs and dynamic shared memory (a parked row, or the spread of a cooperative launch)."""

# Dynamic shared memory a launch may take without the function's opt-in to more.
DEFAULT_MAX_SHARED_BYTES = 48 * 1024


def set_launch_shape(compiled, cluster: int, parked_bytes: int) -> None:
    """Have Triton's launcher start ``compiled`` in clusters of ``cluster`` consecutive CTAs, each
    with ``parked_bytes`` of dynamic shared memory past what the compiled code takes. The launcher
    reads both from the kernel's packed metadata (num_warps, num_ctas, shared) and multiplies the
    grid's x by the cluster size. The kernel is compiled with num_ctas = 1: compiled with more,
    Triton would spread each program's tensors over the cluster's CTAs."""
    metadata = compiled.metadata
    if len(compiled.packed_metadata) != 3 or metadata.num_ctas != 1:
        raise RuntimeError(f"{metadata.name}: this Triton packs its launch metadata as "
                           f"{compiled.packed_metadata}, not (num_warps, num_ctas, shared)")
    shared = metadata.shared + parked_bytes
    if parked_bytes and shared > DEFAULT_MAX_SHARED_BYTES:
        raise RuntimeError(f"{metadata.name}: {shared} bytes of dynamic shared memory exceed the "
                           f"{DEFAULT_MAX_SHARED_BYTES} a launch may take without an opt-in")
    compiled.packed_metadata = (metadata.num_warps, cluster, shared)


def set_launch_shared_bytes(compiled, shared: int) -> None:
    """The dynamic shared memory of ``compiled``'s next launches (``set_launch_shape`` packed the rest)."""
    warps, cluster, _ = compiled.packed_metadata
    compiled.packed_metadata = (warps, cluster, shared)
