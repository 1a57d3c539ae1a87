"""The CuTe DSL backend: builds a spec's kernels over a workspace (``launcher.CuteKernels``), or
compiles them to PTX without a GPU (``offline``).

Importing this module imports CuTe DSL's packages (not the kernels), so that
``lamport_mhc.backend.load_backend("cute")`` answers ``Support.no`` with what to install where they
are missing, and where an installed CuTe DSL fails to import (any exception becomes an ImportError).
"""

from __future__ import annotations

import torch

from lamport_mhc.backend import BuildSpec, Support, cuda_device_support, symmetric_memory_support

try:
    import cutlass  # noqa: F401, I001  (nvidia-cutlass-dsl, first: its absence is the usual reason)
    import cuda.bindings.driver  # noqa: F401  (the kernels' stream type; cuda-python)
    import flashinfer.quantization.quantization_cute_dsl_utils  # noqa: F401  (the quant consumer's MXFP8 helpers)
except ModuleNotFoundError:
    raise
except Exception as error:  # a broken installation must not break the other backends' support queries
    raise ImportError(f"nvidia-cutlass-dsl failed to import ({type(error).__name__}: {error})") from error

MIN_CAPABILITY = (9, 0)  # griddepcontrol (PDL), multimem.st, thread-block clusters
# The cluster form (calls of few rows) reduces the norm's sum of squares within one portable cluster
# of at most 8 CTAs of 128 threads x 8 lanes.
MAX_HIDDEN = 8 * 128 * 8


class CuteBackend:
    name = "cute"

    def support(self, spec: BuildSpec, device: torch.device) -> Support:
        answer = cuda_device_support(device, MIN_CAPABILITY, "PDL, multimem, clusters", "CuTe DSL kernels need a "
                                     "CUDA device (without one, `python -m lamport_mhc ptx --backend cute` compiles "
                                     "them to PTX)")
        if not answer.ok:
            return answer
        if spec.hidden > MAX_HIDDEN:
            return Support.no(f"the CuTe DSL consumer reduces a row within one 8-CTA cluster: hidden <= {MAX_HIDDEN}, "
                              f"got {spec.hidden}; use backend='triton'")
        return symmetric_memory_support(spec, device)

    def build(self, spec: BuildSpec, workspace, interpret: bool = False):
        if interpret:
            raise ValueError("the CuTe DSL backend has no interpreter: the simulated group runs the Triton kernels")
        from .launcher import CuteKernels
        return CuteKernels(spec, workspace)

    def compile_offline(self, spec: BuildSpec, arch: str) -> dict[str, str]:
        """PTX of every CuTe DSL kernel of ``spec`` (publishes, owner reduce, both forms of every
        consumer, LL's one-kernel forms; at tp = 1 the local forms only)."""
        from .offline import compile_ptx
        return compile_ptx(spec, arch)
