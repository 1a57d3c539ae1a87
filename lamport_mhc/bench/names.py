"""The benchmark's path names and what each kind of path is, and the rows a full sweep times."""

from __future__ import annotations

from ..backend import FUSED_BACKENDS
from ..traffic import HC

VARIANTS = ("plain", "finalize", "quant")
# The Ms of a full sweep (a run of other rows scopes its notes to them).
DEFAULT_ROWS = [2 ** i for i in range(14)] + [3, 100, 1000]
# The fused paths: auto, and each backend with its protocol forced (tp > 1) or local (tp = 1).
FORCED_PROTOCOLS = ("ll", "bt")
BACKEND_PATHS = tuple(f"{b}-{p}" for b in FUSED_BACKENDS for p in FORCED_PROTOCOLS + ("local",))
FUSED = ("auto",) + BACKEND_PATHS
# Alternatives that do the whole op: the unfused paths (an all-reduce, then the tail) ...
UNFUSED = ("unfused-nccl", "unfused-one-shot", "unfused-best")
# ... and, at hc = 1 only (where the op is all-reduce + residual add + RMSNorm), FlashInfer's fusion.
FLASHINFER_FUSED = ("flashinfer-fusion-oneshot", "flashinfer-fusion-twoshot")
# Plain all-reduces alone, the candidates of unfused-best.
ALLREDUCE_ALONE = ("nccl_all_reduce", "one_shot_all_reduce", "two_shot_all_reduce", "flashinfer_all_reduce",
                   "vllm_custom_all_reduce")
STRONG_TAIL = "strong-tail"
# DeepSeek's own mHC kernels (tile-kernels), what an engine runs without this project: after the
# fastest all-reduce (tp > 1), the whole op like unfused-best.
TILEKERNELS_TAIL = "tilekernels-tail"
LAMPORT_FLOOR = "lamport-ar-floor"
PATHS = (FUSED + UNFUSED + (STRONG_TAIL, TILEKERNELS_TAIL) + ALLREDUCE_ALONE + FLASHINFER_FUSED
         + (LAMPORT_FLOOR,))


def whole_op_alternatives(hc: int) -> tuple[str, ...]:
    """The paths whose fastest row is a fused row's ``speedup_vs_best`` baseline."""
    return UNFUSED + (TILEKERNELS_TAIL,) + (FLASHINFER_FUSED if hc == 1 else ())

