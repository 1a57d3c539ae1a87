"""Run a test body in one process per rank, with a hard timeout.

A GPU protocol bug usually shows up as a hang (a rank spinning on a mailbox that is never written),
so every multi-rank test runs through :func:`run_ranks`: it spawns one process per rank, sets up
``torch.distributed``, calls the body and collects each rank's return value. If a rank raises, dies
or does not finish in time, every rank is killed and the test fails with a message naming the rank
(and, for a hang, the Python stack where it was stuck).

Usage (the body must be a module-level function: the "spawn" start method pickles it by name)::

    def _body(rank, world_size, m):
        ...
        return out.cpu()            # CPU tensors or plain Python values

    def test_something():
        require_gpus(2)
        outs = run_ranks(_body, 2, args=(64,), timeout_s=120)

Children always run with NVLink multicast switched off (see ``MULTICAST_OFF_ENV``); a caller can
override single variables through ``env`` but never silently loses them.
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "MULTICAST_OFF_ENV",
    "RankError",
    "RankFailed",
    "RankTimeout",
    "free_port",
    "gpu_skip_reason",
    "require_gpus",
    "run_ranks",
]

# Multicast must stay off on the GPU test machines (it can put a shared host's GPUs out of service).
MULTICAST_OFF_ENV: dict[str, str] = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Seconds granted to ranks that already reported to exit on their own before they are terminated.
_EXIT_GRACE_S = 10.0
# Seconds between SIGTERM and SIGKILL.
_TERM_GRACE_S = 2.0
# Seconds a hung rank gets to write its stack after SIGUSR1.
_STACK_GRACE_S = 1.0


class RankError(AssertionError):
    """Base of the harness failures (an AssertionError, so pytest reports it as a test failure)."""


class RankTimeout(RankError):
    """Some ranks produced no result within the timeout; every rank was killed.

    ``ranks``: the ranks that did not finish; ``timeout_s``; ``results``: {rank: value} of those
    that did; ``stacks``: {rank: Python stack dump} of the hung ranks, where one could be taken.
    """

    def __init__(self, ranks: Sequence[int], timeout_s: float, results: Mapping[int, Any],
                 stacks: Mapping[int, str]):
        self.ranks = sorted(ranks)
        self.timeout_s = timeout_s
        self.results = dict(results)
        self.stacks = dict(stacks)
        names = ", ".join(str(r) for r in self.ranks)
        what = "rank" if len(self.ranks) == 1 else "ranks"
        lines = [f"{what} {names} hung: no result after {timeout_s:g} s"]
        if self.results:
            lines.append(f"finished: ranks {', '.join(str(r) for r in sorted(self.results))}")
        for r in self.ranks:
            if self.stacks.get(r):
                lines.append(f"--- rank {r} stack when killed ---\n{self.stacks[r].rstrip()}")
        super().__init__("\n".join(lines))


class RankFailed(RankError):
    """A rank raised (or died) before returning; every other rank was killed.

    ``rank``: the first failing rank; ``traceback``: its formatted traceback (or exit description);
    ``failures``: {rank: traceback} of every rank known to have failed.
    """

    def __init__(self, failures: Mapping[int, str]):
        self.failures = dict(sorted(failures.items()))
        self.rank = next(iter(self.failures))
        self.traceback = self.failures[self.rank]
        parts = [f"rank {r} failed:\n{tb.rstrip()}" for r, tb in self.failures.items()]
        super().__init__("\n".join(parts))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# LAMPORT_MHC_TEST_SHARE_GPUS=1: tests of n ranks run on fewer GPUs, the ranks sharing them as
# processes (gloo for the host's collectives; lamport_mhc.launch), as torchrun places ranks that
# outnumber a node's GPUs. Their kernels take turns in time slices: the production path, not speed.
SHARE_GPUS_ENV = "LAMPORT_MHC_TEST_SHARE_GPUS"


def sharing_gpus() -> bool:
    return os.environ.get(SHARE_GPUS_ENV, "") not in ("", "0")


@functools.lru_cache(maxsize=None)
def gpu_skip_reason(n: int) -> str | None:
    """Why a test needing ``n`` peer-connected CUDA GPUs cannot run here, or None if it can (with
    SHARE_GPUS_ENV set, one GPU serves any ``n``)."""
    import torch

    if not torch.cuda.is_available():
        return f"needs {n} CUDA GPU(s); found 0 (torch.cuda.is_available() is False)"
    count = torch.cuda.device_count()
    if count < n and not sharing_gpus():
        return f"needs {n} CUDA GPU(s); found {count} (or {SHARE_GPUS_ENV}=1: ranks as processes sharing them)"
    n = min(n, count)
    for i in range(n):
        for j in range(n):
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                return f"needs peer access between {n} GPUs; GPU {i} cannot access GPU {j}"
    return None


def require_gpus(n: int) -> None:
    """Skip the calling test (or module, if called at module level) unless ``n`` CUDA GPUs with
    peer access between every pair are present."""
    reason = gpu_skip_reason(n)
    if reason is not None:
        import pytest

        pytest.skip(reason, allow_module_level=True)


# ----------------------------------------------------------------------------------------------
# Child side


def _die_with_parent(parent_pid: int) -> None:
    """Make this process exit when the parent goes away (e.g. it was killed), so that no rank
    outlives its test run."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent_pid:  # the parent died before prctl took effect
                os._exit(3)
            return
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _rank_entry(body: Callable[..., Any], rank: int, world_size: int, args: tuple, backend: str,
                init_method: str, conn: multiprocessing.connection.Connection, parent_pid: int,
                stack_path: str) -> None:
    """Process entry of one rank: init the process group, run the body, send the result."""
    _die_with_parent(parent_pid)
    stack_file = open(stack_path, "w")  # kept open for the lifetime of the process
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    initialized = False
    try:
        import torch
        import torch.distributed as dist

        if backend == "nccl":
            from lamport_mhc.launch import OVERLAPPING_DEVICES_ENV, placement

            gpu, shared = placement(rank, world_size, torch.cuda.device_count())
            torch.cuda.set_device(gpu)
            if shared:  # ranks share GPUs (SHARE_GPUS_ENV): NCCL refuses them, gloo carries the host's part
                os.environ.setdefault(OVERLAPPING_DEVICES_ENV, "1")
                backend = "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(hours=1))  # the parent's timeout rules
        initialized = True
        value = body(rank, world_size, *args)
        try:
            payload = pickle.dumps(("ok", value))
        except Exception as exc:
            payload = pickle.dumps(
                ("err", f"rank {rank}: the body's return value is not picklable: {exc!r}\n"))
    except BaseException:
        payload = pickle.dumps(("err", traceback.format_exc()))
    conn.send_bytes(payload)
    conn.close()
    if initialized:
        try:
            import torch.distributed as dist

            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()


# ----------------------------------------------------------------------------------------------
# Parent side


def _child_env(env: Mapping[str, str | None] | None) -> dict[str, str | None]:
    merged: dict[str, str | None] = dict(MULTICAST_OFF_ENV)
    if env:
        merged.update(env)
    return merged


class _patched_environ:
    """Set (value) or unset (None) variables in os.environ while the children are spawned."""

    def __init__(self, changes: Mapping[str, str | None]):
        self.changes = changes
        self.saved: dict[str, str | None] = {}

    def __enter__(self):
        for k, v in self.changes.items():
            self.saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stop(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Terminate, then kill, every live process; reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _TERM_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5.0)


def _dump_stacks(procs, ranks, stack_paths) -> dict[int, str]:
    if not hasattr(signal, "SIGUSR1"):
        return {}
    for r in ranks:
        if procs[r].is_alive() and procs[r].pid is not None:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(_STACK_GRACE_S)
    stacks = {}
    for r in ranks:
        try:
            with open(stack_paths[r]) as f:
                text = f.read()
        except OSError:
            continue
        if text.strip():
            stacks[r] = text
    return stacks


def run_ranks(body: Callable[..., Any], world_size: int, *, backend: str = "nccl",
              timeout_s: float = 120, args: tuple = (),
              env: Mapping[str, str | None] | None = None) -> list[Any]:
    """Run ``body(rank, world_size, *args)`` in ``world_size`` spawned processes; return the
    results in rank order.

    Each rank initializes ``torch.distributed`` (``backend``, tcp://127.0.0.1:<free port>); for
    "nccl" it first sets its device, ``rank`` (or, where the ranks outnumber the GPUs, ``rank`` modulo
    their count, on gloo: ``lamport_mhc.launch``). Return values must be picklable; return
    CPU tensors, not CUDA ones. ``env`` adds variables to the children's environment (a value of
    None removes one); the multicast switches of ``MULTICAST_OFF_ENV`` are always set unless
    ``env`` names them.

    Raises ``RankTimeout`` when some rank has not reported after ``timeout_s`` seconds and
    ``RankFailed`` when a rank raised or died; in both cases every rank is killed first. No
    process outlives the call, whatever happens.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        pickle.dumps((body, tuple(args)))
    except Exception as exc:
        raise TypeError("run_ranks: body must be a module-level function and args picklable "
                        f"(the 'spawn' start method pickles them): {exc!r}") from exc

    ctx = multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    tmpdir = tempfile.mkdtemp(prefix="lamport_mhc_ranks_")
    stack_paths = [os.path.join(tmpdir, f"rank{r}.stack") for r in range(world_size)]
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: list[multiprocessing.connection.Connection] = []
    try:
        with _patched_environ(_child_env(env)):
            for rank in range(world_size):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_rank_entry,
                    args=(body, rank, world_size, tuple(args), backend, init_method, send,
                          os.getpid(), stack_paths[rank]),
                    name=f"rank{rank}",
                )
                p.start()
                send.close()  # the child holds the write end; EOF here means it is gone
                procs.append(p)
                conns.append(recv)

        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = set(range(world_size))
        deadline = time.monotonic() + timeout_s
        while pending and not failures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
            ready = set(multiprocessing.connection.wait(waitables, timeout=remaining))
            for r in sorted(pending):
                if conns[r] not in ready and procs[r].sentinel not in ready:
                    continue
                message = None
                if conns[r].poll():
                    try:
                        message = pickle.loads(conns[r].recv_bytes())
                    except EOFError:
                        message = None
                    except Exception as exc:
                        message = ("err", f"could not read the result of rank {r}: {exc!r}")
                if message is None:
                    procs[r].join(1.0)
                    failures[r] = (f"process exited with code {procs[r].exitcode} before "
                                   "reporting a result (see its stderr)")
                elif message[0] == "ok":
                    results[r] = message[1]
                else:
                    failures[r] = message[1]
                pending.discard(r)

        if failures:
            raise RankFailed(failures)
        if pending:
            stacks = _dump_stacks(procs, sorted(pending), stack_paths)
            raise RankTimeout(sorted(pending), timeout_s, results, stacks)

        # Every rank reported: let them tear down on their own for a moment.
        exit_deadline = time.monotonic() + _EXIT_GRACE_S
        for p in procs:
            p.join(max(0.0, exit_deadline - time.monotonic()))
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs)
        for c in conns:
            c.close()
        for p in procs:
            if p.exitcode is not None:
                p.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
