"""Compile a build's CuTe DSL kernels to PTX without a GPU: fake tensors stand in for the buffers,
the target comes from the compile options (not the machine), and the PTX is read back from the
artifact the compiler keeps. ptxas also runs, so an invalid instruction fails here, not on the GPU."""

from __future__ import annotations

import tempfile

from lamport_mhc.backend import BuildSpec

MIN_SM = 90  # griddepcontrol (PDL) and multimem.st


def parse_arch(arch: str) -> str:
    """"sm_90a" / "sm_90" / "90" -> "sm_90a"; "sm_100a" -> "sm_100a". The kernels target the
    architecture-specific variant of sm_90 or newer."""
    digits = arch.lower().removeprefix("sm_").rstrip("af")
    if not digits.isdigit() or int(digits) < MIN_SM:
        raise ValueError(f"arch must be sm_90a or newer (e.g. sm_90a, sm_100a), got {arch!r}")
    return f"sm_{int(digits)}a"


# kind -> (element type name, assumed alignment in bytes, divisibility of the element count)
BUFFER_KINDS = {"*i16": ("Int16", 16, 8), "*fp32": ("Float32", 4, 1), "*i32": ("Int32", 4, 1),
                "*u8": ("Uint8", 16, 16)}


def fake_argument(kind: str, spec: BuildSpec):
    """A stand-in for one runtime argument of a kernel's signature (see ``plan``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if kind in BUFFER_KINDS:
        dtype, align, divisibility = BUFFER_KINDS[kind]
        return make_fake_compact_tensor(getattr(cutlass, dtype), (cute.sym_int(divisibility=divisibility),),
                                        assumed_align=align)
    if kind == "state":
        from lamport_mhc.layout import STATE_WORDS
        return make_fake_compact_tensor(Int32, (STATE_WORDS,), assumed_align=4)
    if kind == "error":
        from lamport_mhc.layout import ERROR_WORDS
        return make_fake_compact_tensor(Int32, (ERROR_WORDS,), assumed_align=4)
    if kind == "table":
        return make_fake_compact_tensor(Int64, (spec.tp,), assumed_align=8)
    if kind == "i32":
        return Int32(1)
    if kind == "i64":
        return Int64(0)
    if kind == "f32":
        return Float32(1e-6)
    if kind == "stream":
        return make_fake_stream()
    raise ValueError(f"unknown argument kind {kind!r}")


def compile_ptx(spec: BuildSpec, arch: str = "sm_90a") -> dict[str, str]:
    """PTX of every CuTe DSL kernel of the build, keyed by the plan's names. Needs
    nvidia-cutlass-dsl (``pip install 'lamport-mhc[cute]'``), no GPU."""
    try:
        import cuda.bindings.driver  # noqa: F401  (the kernels' stream type)
        import cutlass.cute as cute
    except ImportError as error:
        raise ImportError(f"compiling the CuTe DSL kernels needs nvidia-cutlass-dsl and cuda-python ({error}): "
                          "pip install 'lamport-mhc[cute]'") from error

    from .plan import kernel_plan

    target = parse_arch(arch)
    ptx = {}
    for name, instance in kernel_plan(spec).items():
        args = [fake_argument(kind, spec) for _, kind in instance.signature]
        # The compiler writes the PTX it keeps into the dump directory and reads it back.
        with tempfile.TemporaryDirectory(prefix="lamport_mhc_cute_") as dump:
            compiled = cute.compile(instance.kernel, *args,
                                    options=f"--gpu-arch {target} --keep-ptx --dump-dir {dump}")
            text = compiled.__ptx__
        if not text or f".target {target}" not in text:
            raise RuntimeError(f"CuTe DSL kept no {target} PTX for {name}")
        ptx[name] = text
    return ptx
