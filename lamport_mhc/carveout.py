"""The split of each SM's on-chip memory between L1 and shared memory that a kernel asks for.

An SM splits its memory as the kernels placed on it ask (each kernel's preferred carveout, else
what its shared memory needs), and changes the split only while it holds no CTA. Where programs
spin waiting for another kernel that runs on the same GPU, that kernel may find no SM it can use
until the spin gives up: every SM that has room is busy with a split too small for it. Ranks
emulated on one GPU meet this at once (on one H200 every tp = 4 and 8 soak stalled within a few
hundred calls, for both backends), and so would two instances issuing on two streams of each GPU
(each GPU's waiting consumer of one instance holding the SMs the other instance's publish needs).
So every kernel of a TP build asks for the same, largest shared split: any SM with room then
takes any of them. A group of one (the local form) never waits and keeps the driver's choice.
"""

from __future__ import annotations

import ctypes
import functools

# CU_SHAREDMEM_CARVEOUT_MAX_SHARED and CU_SHAREDMEM_CARVEOUT_DEFAULT (the driver's choice).
MAX_SHARED = 100
DRIVER_DEFAULT = -1
_PREFERRED_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def set_carveout(function, carveout: int = MAX_SHARED) -> None:
    """Set the preferred carveout of a loaded kernel (Triton's raw handle or a ``CUfunction``),
    through the driver library itself (no binding package needed)."""
    status = _driver().cuFuncSetAttribute(ctypes.c_void_p(int(function)), ctypes.c_int(_PREFERRED_CARVEOUT),
                                       ctypes.c_int(carveout))
    if status != 0:
        raise RuntimeError(f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT, {carveout}) returned {status}")


def pin_build(kernels, carveout: int = MAX_SHARED) -> None:
    """Load every kernel of a GPU build (``Kernels.plan`` names, ``footprint`` handles) and set its
    carveout: ``MAX_SHARED`` for a TP build, ``DRIVER_DEFAULT`` to undo it (for diagnosis). Loaded
    here, no kernel of the build loads its module at a first launch, which would wait for the GPU
    to go idle (never, while another instance's kernel spins on it)."""
    kernels.load_modules()
    for name in kernels.plan:
        set_carveout(kernels.footprint(name)[0], carveout)
