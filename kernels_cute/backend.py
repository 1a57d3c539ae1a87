"""The CuTe DSL backend (in progress): the publish, owner-reduce and mHC consumer kernels exist and
compile offline for sm_90a and sm_100a, but there is no host launcher yet and none of them has run on
a GPU (their bits are unverified), so no build can run and ``support`` says so.

Importing this module imports CuTe DSL's packages (not the kernels), so that
``lamport_mhc.backend.load_backend("cute")`` answers ``Support.no`` with what to install where they
are missing, and where an installed CuTe DSL fails to import (any exception becomes an ImportError).
"""

from __future__ import annotations

import logging

import torch

from lamport_mhc.backend import BuildSpec, Support, cuda_device_support

try:
    import cutlass  # noqa: F401, I001  (nvidia-cutlass-dsl, first: its absence is the usual reason)
    import cuda.bindings.driver  # noqa: F401  (the kernels' stream type; cuda-python)
except ModuleNotFoundError:
    raise
except Exception as error:  # a broken installation must not break the other backends' support queries
    raise ImportError(f"nvidia-cutlass-dsl failed to import ({type(error).__name__}: {error})") from error

MIN_CAPABILITY = (9, 0)  # griddepcontrol (PDL), multimem.st, thread-block clusters
NOT_IMPLEMENTED = ("the CuTe DSL kernels only compile offline: there is no host launcher yet and they are not "
                   "runnable until verified on a GPU")

logger = logging.getLogger(__name__)


class CuteBackend:
    name = "cute"

    def support(self, spec: BuildSpec, device: torch.device) -> Support:
        answer = cuda_device_support(device, MIN_CAPABILITY, "PDL, multimem, clusters", "CuTe DSL kernels need a "
                                     "CUDA device (without one, `python -m lamport_mhc ptx --backend cute` compiles "
                                     "them to PTX)")
        if not answer.ok:
            return answer
        return Support.no(f"{NOT_IMPLEMENTED}; use backend='triton' (or 'auto')")

    def build(self, spec: BuildSpec, workspace, interpret: bool = False):
        raise NotImplementedError(f"{NOT_IMPLEMENTED}: the cute backend cannot build a call yet (its kernels "
                                  "compile offline: CuteBackend().compile_offline(spec, arch))")

    def compile_offline(self, spec: BuildSpec, arch: str) -> dict[str, str]:
        """PTX of every CuTe DSL kernel of ``spec`` (publishes, owner reduce, consumers, LL's
        one-kernel forms)."""
        from .offline import compile_ptx
        ptx = compile_ptx(spec, arch)
        logger.info("%s: compiled %s", NOT_IMPLEMENTED, ", ".join(ptx))
        return ptx
