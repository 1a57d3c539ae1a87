"""Collective construction on a real group (two gloo processes): a rank that builds alone, or
builds something else than its peers, gets an error naming the ranks, not a hang. And where a
torchrun rank runs when the ranks outnumber the GPUs."""

import time

from gpu.harness import run_ranks

H, HC, CAP, TOP_K = 256, 4, 8, 2


def _build(hidden, timeout_s):
    import torch

    from lamport_mhc import AllReduceMHC, AllReduceMHCConfig

    return AllReduceMHC(hidden, HC, CAP, TOP_K, torch.device("cpu"),
                        config=AllReduceMHCConfig(backend="torch", construction_timeout_s=timeout_s))


def _alone_body(rank, world):
    if rank == 1:  # builds nothing, but stays in the group while rank 0 waits
        time.sleep(8)
        return None
    started = time.monotonic()
    try:
        _build(H, 2.0)
    except RuntimeError as error:
        return str(error), time.monotonic() - started
    return "built", 0.0


def test_a_rank_that_builds_alone_is_told_which_ranks_did_not():
    message, waited = run_ranks(_alone_body, 2, backend="gloo", timeout_s=120)[0]
    assert "ranks [1] did not begin it within 2 s" in message, message
    assert "every rank of the group must build the same instances in the same order" in message
    assert 2.0 <= waited < 10


def _different_body(rank, world):
    try:
        _build(H * (rank + 1), 60.0)
    except RuntimeError as error:
        time.sleep(1)  # rank 0 hosts the group's store here (under torchrun the agent does): let rank 1 read it
        return str(error)
    return "built"


def test_ranks_that_build_different_instances_are_told_what_each_built():
    first, second = run_ranks(_different_body, 2, backend="gloo", timeout_s=120)
    assert "builds AllReduceMHC(H=256" in first and "rank 1: AllReduceMHC(H=512" in first, first
    assert "builds AllReduceMHC(H=512" in second and "rank 0: AllReduceMHC(H=256" in second, second


def _same_body(rank, world):
    ops = [_build(H, 60.0), _build(2 * H, 60.0)]  # two constructions in the same order: both build
    return [op.backend for op in ops]


def test_ranks_that_build_the_same_instances_in_order_build_them():
    assert run_ranks(_same_body, 2, backend="gloo", timeout_s=120) == [["torch", "torch"]] * 2


def test_ranks_that_outnumber_the_gpus_share_them_round_robin():
    from lamport_mhc.launch import placement

    assert placement(0, 1, 0) == (None, False)           # CPU ranks
    assert placement(1, 2, 2) == (1, False)              # one process per GPU
    assert [placement(r, 4, 1) for r in range(4)] == [(0, True)] * 4
    assert [placement(r, 8, 2)[0] for r in range(8)] == [0, 1] * 4
