"""The multi-process GPU test harness, exercised on CPU with the gloo backend."""

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from gpu.harness import (  # noqa: E402
    MULTICAST_OFF_ENV,
    RankFailed,
    RankTimeout,
    run_ranks,
)

_ENV_NAMES = (*MULTICAST_OFF_ENV, "LAMPORT_MHC_HARNESS_PROBE")


# Bodies: module-level, so the spawned ranks can unpickle them.

def _record_pid(pid_dir, rank):
    """This rank's pid under ``pid_dir``, written whole or not at all: a rank killed while writing
    leaves no empty file behind."""
    partial = Path(pid_dir, f"rank{rank}.partial")
    partial.write_text(str(os.getpid()))
    partial.rename(Path(pid_dir, f"rank{rank}.pid"))


def _all_reduce_body(rank, world_size, scale):
    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)]) * scale
    dist.all_reduce(t)
    env = {name: os.environ.get(name) for name in _ENV_NAMES}
    return rank, world_size, t.tolist(), env


def _hang_body(rank, world_size, pid_dir):
    _record_pid(pid_dir, rank)
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
        while True:
            time.sleep(60)
    return "done"


def _raise_body(rank, world_size, pid_dir):
    _record_pid(pid_dir, rank)
    if rank == 0:
        raise ValueError("boom from rank 0")
    dist.barrier()  # waits for rank 0 forever: must be killed
    return "unreachable"


def _exit_body(rank, world_size):
    os._exit(7)


def _assert_all_gone(pid_dir):
    assert multiprocessing.active_children() == []
    pids = [int(p.read_text()) for p in Path(pid_dir).glob("rank*.pid")]
    assert pids, "the ranks never started"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_all_reduce_results_from_every_rank_and_multicast_off(monkeypatch):
    # The multicast switches reach the ranks even where the parent's environment says otherwise.
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    results = run_ranks(_all_reduce_body, 2, backend="gloo", timeout_s=60, args=(2.0,),
                        env={"LAMPORT_MHC_HARNESS_PROBE": "yes"})
    assert [r[:3] for r in results] == [(0, 2, [6.0, 60.0]), (1, 2, [6.0, 60.0])]
    for _, _, _, env in results:
        assert env == {**MULTICAST_OFF_ENV, "LAMPORT_MHC_HARNESS_PROBE": "yes"}
    # The parent's environment is left as it was.
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "0"
    assert "LAMPORT_MHC_HARNESS_PROBE" not in os.environ
    assert multiprocessing.active_children() == []


def test_explicit_env_overrides_multicast_defaults():
    [(_, _, _, env)] = run_ranks(_all_reduce_body, 1, backend="gloo", timeout_s=60, args=(1.0,),
                                 env={"NCCL_NVLS_ENABLE": "override",
                                      "TORCH_SYMM_MEM_DISABLE_MULTICAST": None})
    assert env["NCCL_NVLS_ENABLE"] == "override"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] is None
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_hung_rank_times_out_and_every_rank_is_killed(tmp_path):
    # The timeout leaves rank 0 room to start and join the group on a loaded 2-core machine.
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_hang_body, 2, backend="gloo", timeout_s=20, args=(str(tmp_path),))
    elapsed = time.monotonic() - start
    assert 20 <= elapsed < 40
    err = info.value
    assert isinstance(err, AssertionError)
    assert err.ranks == [1]
    assert err.results == {0: "done"}
    assert "rank 1 hung: no result after 20 s" in str(err)
    assert "_hang_body" in str(err)  # the stack where rank 1 was stuck
    _assert_all_gone(tmp_path)


def test_raising_rank_fails_fast_and_others_are_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_raise_body, 2, backend="gloo", timeout_s=60, args=(str(tmp_path),))
    assert time.monotonic() - start < 30
    err = info.value
    assert err.rank == 0
    assert "ValueError: boom from rank 0" in err.traceback
    assert "rank 0 failed" in str(err) and "boom from rank 0" in str(err)
    _assert_all_gone(tmp_path)


def test_rank_dying_without_result_is_a_failure():
    with pytest.raises(RankFailed) as info:
        run_ranks(_exit_body, 1, backend="gloo", timeout_s=60)
    assert info.value.rank == 0
    assert "exited with code 7" in str(info.value)
    assert multiprocessing.active_children() == []


def test_local_body_is_rejected_before_spawning():
    def local_body(rank, world_size):
        return rank

    with pytest.raises(TypeError, match="module-level"):
        run_ranks(local_body, 2, backend="gloo")
    assert multiprocessing.active_children() == []
