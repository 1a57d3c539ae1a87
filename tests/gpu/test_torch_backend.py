"""The unfused torch backend on two GPUs (NCCL): bit-exact with the CPU reference."""

from .bodies import sweep
from .harness import require_gpus, run_ranks


def _body(rank, tp):
    return sweep(rank, tp, "torch", 5120, 256, [1, 7, 256])


def test_torch_backend_matches_reference():
    require_gpus(2)
    for failures in run_ranks(_body, 2, timeout_s=300):
        assert failures == []
