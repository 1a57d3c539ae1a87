"""The unfused torch backend on TP GPUs (NCCL; bodies.TP): bit-exact with the CPU reference."""

from .bodies import TP, sweep
from .harness import require_gpus, run_ranks


def _body(rank, tp):
    return sweep(rank, tp, "torch", 5120, 256, [1, 7, 256])


def test_torch_backend_matches_reference():
    require_gpus(TP)
    for failures in run_ranks(_body, TP, timeout_s=300):
        assert failures == []
