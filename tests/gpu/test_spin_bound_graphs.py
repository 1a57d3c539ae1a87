"""The spin bound as production keeps it on (bodies.TP GPUs, 1 included; peer transport): calls
with ``spin_timeout_ms`` captured into a CUDA graph and replayed bit-exact; a timeout inside a
replayed graph surfacing at the next eager call with no synchronization, naming the rank, the
generation and the token; and the eager call time with the bound against without it (printed:
run with ``-s``; not asserted, timing on a shared machine is no pass/fail)."""

import re
import statistics
import time

import pytest
import torch

from lamport_mhc import layout, validate
from lamport_mhc.testing import random_inputs

from .bodies import BACKENDS, EPS, HC, TOP_K, TP, build, check, graph_replays, require_backend, run_variant
from .harness import require_gpus, run_ranks

SPIN_TIMEOUT_MS = 1000.0  # generous: a loaded machine must not time out a healthy call


def _graph_body(rank, tp, backend):
    return graph_replays(rank, tp, backend, 12, 3, hidden=1024, spin_timeout_ms=SPIN_TIMEOUT_MS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_capture_and_replay_with_the_bound(backend):
    """Calls with the bound record into a graph (no host copy of the error record during capture)
    and every replay is bit-exact; the final check() finds no timeout."""
    require_gpus(TP)
    require_backend(backend)
    for failures in run_ranks(_graph_body, TP, args=(backend,), timeout_s=300):
        assert failures == []


def _rank_of_a_pair_on_one_gpu(backend: str, hidden: int, capacity: int, timeout_ms: float):
    """An op over rank 0 of a group of two whose mailboxes both live in this GPU's memory (LL in two
    kernels): the real kernels and call path, with a peer that never publishes."""
    from lamport_mhc import AllReduceMHC, AllReduceMHCConfig
    from lamport_mhc.backend import BuildSpec, load_backend
    from lamport_mhc.paths import FusedPath
    from lamport_mhc.selector import Thresholds
    from lamport_mhc.workspace import allocate_host_group

    config = AllReduceMHCConfig(backend=backend, transport="peer", spin_timeout_ms=timeout_ms)
    specs = [BuildSpec(hidden=hidden, hc=HC, capacity=capacity, top_k=TOP_K, tp=2, rank=rank,
                       spin_timeout_ns=config.spin_timeout_ns) for rank in range(2)]
    workspace = allocate_host_group(specs, device=torch.device("cuda", torch.cuda.current_device()))[0]
    never = Thresholds(capacity + 1, capacity + 1)
    op = AllReduceMHC.__new__(AllReduceMHC)
    op.config, op.spec, op.device, op.backend = config, specs[0], workspace.error.device, backend
    op.path = FusedPath(backend, {backend: load_backend(backend).build(specs[0], workspace)}, workspace, never)
    op.check_path, op._broken, op.thresholds = None, None, never
    return op


def _timeout_in_graph_body(rank, tp, backend):
    """Capture a consumer launched over a generation no publish wrote (the real kernel, polling
    slots its last reader re-armed), replay it, keep the stream busy behind it, and make an eager
    call: it must raise from the host mirror while the stream is still busy (no synchronization)."""
    timeout_ms, hidden, m = 50.0, 1024, 4
    if tp == 1:  # a group of one polls nothing: rank 0 of a pair on this GPU, whose peer never runs
        op, failures = _rank_of_a_pair_on_one_gpu(backend, hidden, 16, timeout_ms), []
    else:
        # LL only, two kernels: the consumer launches on its own (the one-kernel form publishes too).
        op = build(hidden, 16, backend, 17, spin_timeout_ms=timeout_ms, ll_one_kernel_max_rows=0)
        failures = [f for seed in range(2) for f in check([op], tp, rank, m, hidden, "plain", seed=seed)]
    torch.cuda.synchronize()
    generation = int(op.path.workspace.ll_state[layout.STATE_ACTIVE])  # consumed, re-armed
    inputs = random_inputs(tp, m, hidden, HC, seed=7, top_k=TOP_K, device="cuda")
    call = validate.plain_call(op.spec, op.device, inputs["xs"][rank], inputs["residual"], inputs["post"],
                               inputs["comb"], inputs["pre"], inputs["norm_weight"], EPS, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.path.consume(call, "ll")
    graph.replay()
    torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU time queued behind the replay
    time.sleep(0.5)                   # the replayed consumer has given up by now
    try:
        run_variant(op, inputs, "plain", rank)
        first = None
    except RuntimeError as error:
        first = str(error)
    unsynchronized = not torch.cuda.current_stream().query()  # the sleep still runs: the raise waited for nothing
    torch.cuda.synchronize()
    later = []
    for ask in (lambda: run_variant(op, inputs, "plain", rank), op.check):  # unusable until rebuilt
        try:
            ask()
            later.append(None)
        except RuntimeError as error:
            later.append(str(error))
    return failures, generation, first, unsynchronized, later


@pytest.mark.parametrize("backend", BACKENDS)
def test_timeout_in_a_replayed_graph_raises_at_the_next_eager_call(backend):
    require_gpus(TP)
    require_backend(backend)
    for rank, (failures, generation, first, unsynchronized, later) in enumerate(
            run_ranks(_timeout_in_graph_body, TP, args=(backend,), timeout_s=300)):
        assert failures == []
        assert first is not None, f"rank {rank}: the eager call after the timed-out replay did not raise"
        # The consumer waits for source 0 first; any of the call's tokens may win the record.
        assert re.search(rf"rank {rank}: spin timeout waiting for rank 0's contribution to token [0-3] of "
                         rf"generation {generation}\b", first), first
        assert unsynchronized, f"rank {rank}: the eager call synchronized with the device before raising"
        assert later == [first, first]


def _timing_body(rank, tp, backend, sizes, calls, rounds):
    """Per-call time of eager calls (host launch and GPU together: a loop of ``calls`` calls, then
    one synchronize), alternating the op without and with the bound; medians over ``rounds``."""
    hidden = 5120
    ops = {"without": build(hidden, 256, backend, 257),
           "with": build(hidden, 256, backend, 257, spin_timeout_ms=SPIN_TIMEOUT_MS)}
    results = []
    for m in sizes:
        inputs = random_inputs(tp, m, hidden, HC, seed=m, top_k=TOP_K, device="cuda")
        for op in ops.values():
            for _ in range(50):
                run_variant(op, inputs, "plain", rank)
        times = {name: [] for name in ops}
        for _ in range(rounds):
            for name, op in ops.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    run_variant(op, inputs, "plain", rank)
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) / calls * 1e6)
        results.append((m, statistics.median(times["without"]), statistics.median(times["with"])))
    ready = {}
    for name, op in ops.items():  # the host check alone
        start = time.perf_counter()
        for _ in range(10_000):
            op._ready()
        ready[name] = (time.perf_counter() - start) / 10_000 * 1e6
    ops["with"].check()
    return results, ready


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_call_time_with_the_bound(backend):
    require_gpus(TP)
    require_backend(backend)
    per_rank = run_ranks(_timing_body, TP, args=(backend, (1, 16, 128), 500, 7), timeout_s=300)
    print(f"\n{backend}, tp={TP}, H=5120, plain, eager (us per call, max over ranks):")
    for i, (m, _, _) in enumerate(per_rank[0][0]):
        without = max(r[0][i][1] for r in per_rank)
        with_bound = max(r[0][i][2] for r in per_rank)
        print(f"  M={m:4d}: {without:7.2f} without the bound, {with_bound:7.2f} with ({with_bound / without - 1:+.1%})")
    for name in ("without", "with"):
        print(f"  the host check before a call, {name} the bound: {max(r[1][name] for r in per_rank):.3f} us")
