"""How widely a cooperative launch spreads its clusters over the SMs, chosen per call.

A cooperative (split) launch of ``m`` tokens is ``m`` clusters of one CTA per chunk. Left alone, the
block scheduler packs an SM with as many CTAs as its registers allow (8 at 64 registers), so a
token's CTAs can share one SM's load pipes while other SMs idle. Dynamic shared memory that the
kernel never touches caps the CTAs per SM: each call takes the tightest cap under which all its
clusters are still resident at once (the driver's ``cuOccupancyMaxActiveClusters``), the widest
spread that costs no second wave. On one H200 (tp = 1, us spread / not, one run): H 5120 quant M 100
5.5 / 6.3 and 128 5.4 / 6.3, finalize 100 5.9 / 6.8; H 7168 plain 64 4.1 / 5.2, finalize 100 6.1 /
7.1; H 4096 quant 128 5.5 / 6.1; it lost 0.2-0.4 us at H 4096, M 64-100, and changed nothing at
M <= 16. One fixed cap instead (5 CTAs per SM) ran a second wave where the call's clusters exceed
it (H 7168 plain M 100: 7.6 against 5.2).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    ctas_per_sm: int   # the cap
    clusters: int      # clusters resident at once under it (the driver's count)
    shared_bytes: int  # dynamic shared memory per CTA that sets it


def capped_shared_bytes(ctas_per_sm: int, shared_per_sm: int, reserved_per_block: int, max_per_block: int) -> int:
    """The most dynamic shared memory a CTA may take with ``ctas_per_sm`` CTAs still fitting an SM."""
    return min(max_per_block, shared_per_sm // ctas_per_sm - reserved_per_block)


def choose(spreads: tuple[Spread, ...], clusters: int) -> Spread | None:
    """The widest spread (fewest CTAs per SM) that keeps ``clusters`` resident at once; None: none
    does (the launch keeps its own shared memory)."""
    fitting = [spread for spread in spreads if spread.clusters >= clusters]
    return min(fitting, key=lambda spread: spread.ctas_per_sm, default=None)


def measure_spreads(function: int, device_index: int, cluster: int, threads: int, own_shared_bytes: int,
                    min_ctas_per_sm: int = 1, max_ctas_per_sm: int = 8) -> tuple[Spread, ...]:
    """Each cap from ``min_ctas_per_sm`` to ``max_ctas_per_sm`` CTAs per SM that shared memory can
    set above the kernel's own ``own_shared_bytes``, with the clusters the driver says stay resident
    under it. Opts ``function`` in to the largest of those shared-memory sizes."""
    from cuda.bindings import driver

    def checked(result):
        error, *values = result
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {error}")
        return values[0] if values else None

    attribute = driver.CUdevice_attribute
    cu_device = checked(driver.cuDeviceGet(device_index))
    shared_per_sm, reserved, max_per_block = (
        checked(driver.cuDeviceGetAttribute(getattr(attribute, name), cu_device))
        for name in ("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
                     "CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK",
                     "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"))
    static = checked(driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                               function))
    sizes = {ctas: capped_shared_bytes(ctas, shared_per_sm, reserved + static, max_per_block - static)
             for ctas in range(min_ctas_per_sm, max_ctas_per_sm + 1)}
    sizes = {ctas: size for ctas, size in sizes.items() if size > own_shared_bytes}
    if not sizes:
        return ()
    # Raised, never lowered: builds with the same constexprs share the compiled function.
    opt_in = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if max(sizes.values()) > checked(driver.cuFuncGetAttribute(opt_in, function)):
        checked(driver.cuFuncSetAttribute(function, opt_in, max(sizes.values())))
    spreads = []
    for ctas, size in sizes.items():
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes = size
        dims = driver.CUlaunchAttribute()
        dims.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        dims.value.clusterDim.x, dims.value.clusterDim.y, dims.value.clusterDim.z = cluster, 1, 1
        config.attrs, config.numAttrs = [dims], 1
        spreads.append(Spread(ctas, checked(driver.cuOccupancyMaxActiveClusters(function, config)), size))
    return tuple(spreads)
