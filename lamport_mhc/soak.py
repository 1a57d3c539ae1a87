"""``python -m lamport_mhc soak``: many calls of a TP group with skew, every output of every rank
compared bit for bit with the contract.

Where it runs decides what it runs:
- on one GPU (``one-gpu``): a ``ConcurrentGroup``, the ranks as streams of one process, each issuing
  its own calls with skew (below), eager and (``--graphs``) from CUDA graphs it captured itself;
- under ``torchrun`` on N GPUs (``gpus``): the real group, ``AllReduceMHC`` on every rank, with the
  same skew;
- on a CPU (``simulated``): a ``SimulatedGroup`` running the Triton kernels under the interpreter
  in protocol order (no concurrency: it checks the command and the contract, not the ordering).

Skew: every call's ranks are issued in random order, most of their calls preceded by a device-side
delay of up to ``MAX_DELAY_US``, and nothing synchronizes the ranks between calls, so they drift
whole calls apart (the host also lets a rank run up to ``MAX_LEAD`` calls ahead of the slowest).
Each call draws its variant (plain, quant, finalize, finalize into MXFP8, residual only) and M
(1 to capacity) anew, and reads one of ``POOLS`` input pools, never one of the three before it (a
slot re-armed late would otherwise hold the right bits). Outputs are poisoned before every call and
compared on the device, in the rank's stream order, against the reference of the pool's rows.
"""

from __future__ import annotations

import csv
import fcntl
import gc
import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import layout
from .mxfp8 import mxfp8_scale_bytes
from .soak_calls import (POOLS, Draw, OutputChecker, RankBuffers, draw_calls, draw_pools, rank_call, scale_rows,
                         variants_of)

DELAYED_SHARE = 0.7       # of rank-calls, those delayed first
MAX_DELAY_US = 100.0
MAX_LEAD = 3              # calls a rank's host issue may run ahead of the slowest rank's
# Calls the host may run ahead of a rank's GPU work. One thread issues every rank's calls: with no
# bound it fills a stream's launch queue, blocks in the driver on the next launch, and the rank it
# would have issued next leaves its peers spinning (a stall no real group has). Waiting for a call
# this many calls back cannot deadlock: every rank has issued it (MAX_LEAD < HOST_AHEAD).
HOST_AHEAD = 16
GRAPH_CALLS = (5, 6)      # calls per captured graph: odd and even, so replays start at every generation
# Calls of more rows go through in parts (AllReduceMHCConfig.chunk_rows). Builds with MXFP8 take
# parts of whole 128-row scale tiles, more than the emulated groups keep resident; builds without
# (H not a multiple of 128) may take smaller ones (--chunk-rows), so that every tp crosses them.
CHUNK_ROWS = 128
# Boundaries of the emulated model: paths with kernels of their own over every rank's one workspace
# (the attention and MoE boundaries share it), each call on one drawn at random.
BOUNDARIES = 2
CSV_COLUMNS = ("gpu", "where", "backend", "tp", "hidden", "calls", "graph_replays", "mismatches", "timeouts",
               "seconds")


def draw_delay(rng: random.Random, share: float = DELAYED_SHARE) -> float:
    """A rank-call's device-side delay in microseconds: up to MAX_DELAY_US for ``share`` of them."""
    return rng.uniform(0, MAX_DELAY_US) if rng.random() < share else 0.0


@dataclass
class SoakResult:
    where: str
    backend: str
    tp: int
    hidden: int
    gpu: str = "cpu"
    capacity: int = 0          # the largest M a call drew
    calls: int = 0
    graph_replays: int = 0     # calls among ``calls`` that ran from replayed CUDA graphs
    outputs_compared: int = 0
    mismatches: int = 0        # outputs (of one rank-call) with at least one wrong bit
    timeouts: int = 0
    seconds: float = 0.0
    messages: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.timeouts

    def summary(self) -> str:
        return (f"soak {self.where} {self.backend} tp={self.tp} H={self.hidden} M<={self.capacity}: {self.calls} calls "
                f"({self.graph_replays} from graph replays), {self.outputs_compared} outputs compared, "
                f"{self.mismatches} mismatches, {self.timeouts} timeouts, {self.seconds:.1f} s")

    def csv_row(self) -> dict:
        return {"gpu": self.gpu, "where": self.where, "backend": self.backend, "tp": self.tp, "hidden": self.hidden,
                "calls": self.calls, "graph_replays": self.graph_replays, "mismatches": self.mismatches,
                "timeouts": self.timeouts, "seconds": f"{self.seconds:.1f}"}


def append_csv(path, result: SoakResult) -> None:
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerow(result.csv_row())


# -- one GPU: the ranks as streams ------------------------------------------------------------------------

# What the emulated ranks keep resident together (one GPU's SMs shared by tp ranks), per tp: the
# largest M of a call, the cooperative (latency) forms' rows and LL's one-kernel rows. Each build
# is still checked (``ConcurrentGroup.check_residency``), which refuses with the reason, and a
# default it refuses is fitted down (below). Set by Triton's BT at H 5120 on 132 SMs: a call at
# capacity keeps (capacity / tp) x 5 owner-reduce programs (1584 resident at once) and capacity
# consumer programs (792) waiting on each rank; these rows keep all ranks' share near 0.65 of the
# 0.75 allowed. Forms that hold fewer CTAs per SM (CuTe's streaming consumers) get fewer rows.
EMULATED_ROWS = {2: (112, 24, 32), 3: (96, 16, 20), 4: (80, 12, 16), 8: (48, 6, 8)}


# A default capacity the residency check refuses is fitted instead: scaled by what the check
# allows over what the worst call took (with this margin), the group rebuilt, up to FIT_TRIES
# builds in all and never below FIT_MIN_ROWS. Some forms hold fewer CTAs per SM than others (CuTe's
# streaming LL consumer at tp 8 and H >= 2560: one, so 8 ranks' LL calls fit 12 rows, not 42).
FIT_MARGIN = 0.9
FIT_TRIES = 4
FIT_MIN_ROWS = 4


def emulated_rows(tp: int) -> tuple[int, int, int]:
    """(capacity, split rows, one-kernel rows) of an emulated group of ``tp`` ranks."""
    return EMULATED_ROWS.get(tp, EMULATED_ROWS[8])


def emulated_thresholds(preset_rows: tuple[int, int], capacity: int) -> tuple[int, int]:
    """BT thresholds (plain, finalize) of an emulated group: the preset's, each lowered to half the
    capacity where the emulated group's rows (fewer than production's) would never reach it, so
    that both protocols run."""
    half = max(2, capacity // 2)
    return min(preset_rows[0], half), min(preset_rows[1], half)


def fitted_capacity(capacity: int, share: float, allowed: float) -> int:
    """A capacity whose worst call should take at most ``allowed`` of the GPU, from ``capacity``,
    whose worst took ``share`` (all ranks' waiting programs scale with a call's rows)."""
    return min(capacity - 1, int(capacity * allowed * FIT_MARGIN / share))


def soak_one_gpu(tp: int, calls: int, backend: str, hidden: int, *, graphs: bool, seed: int = 0,
                 capacity: int | None = None, spin_timeout_ms: float = 2000.0, bt_min_rows: int | None = None,
                 ll_one_kernel_rows: int | None = None, split_rows: int | None = None, host_gc: bool = False,
                 max_lead: int = MAX_LEAD, delayed_share: float = DELAYED_SHARE, pooled_streams: bool = False,
                 chunk_rows: int = CHUNK_ROWS, pin_carveout: bool = True, before_run=None,
                 log=print) -> SoakResult:
    from . import presets
    from .concurrent import RESIDENT_SHARE, ConcurrentGroup, EmulationError, RankCall

    if not 1 <= max_lead < HOST_AHEAD:
        raise ValueError(f"max_lead must lie in [1, {HOST_AHEAD}), got {max_lead}")
    started = time.monotonic()
    default_capacity, default_split_rows, one_kernel_rows = emulated_rows(tp)
    fit = capacity is None  # a capacity the caller chose is refused, not fitted
    capacity = capacity or default_capacity
    split_rows = default_split_rows if split_rows is None else split_rows
    one_kernel_rows = one_kernel_rows if ll_one_kernel_rows is None else ll_one_kernel_rows
    device = torch.device("cuda", torch.cuda.current_device())
    preset = presets.lookup(presets.device_keys(device), tp, hidden)
    result = SoakResult("one-gpu", backend, tp, hidden, gpu=torch.cuda.get_device_name(device))

    def build(rows: int):
        bt_rows = ((bt_min_rows, bt_min_rows) if bt_min_rows is not None else
                   emulated_thresholds((preset.bt_min_rows, preset.bt_min_finalize_rows), rows))
        log(f"building {tp} ranks of {backend} at H={hidden}, capacity {rows}")
        return ConcurrentGroup(tp, hidden_size=hidden, max_num_tokens=rows, backend=backend, bt_min_rows=bt_rows[0],
                               bt_min_finalize_rows=bt_rows[1], ll_one_kernel_rows=one_kernel_rows,
                               split_rows=split_rows, chunk_rows=chunk_rows, spin_timeout_ms=spin_timeout_ms,
                               boundaries=BOUNDARIES, pooled_streams=pooled_streams, pin_carveout=pin_carveout)

    group = build(capacity)
    hc, top_k = group.specs[0].hc, group.specs[0].top_k
    quant = group.specs[0].quantize
    # Drawn at the first capacity, the largest: a fitted group's calls read prefixes of them.
    pools = draw_pools(tp, capacity, hidden, hc, top_k, seed, device)
    checker = OutputChecker(tp, device, scale_rows(capacity, hidden, device) if quant else None)
    buffers = [RankBuffers.allocate(capacity, hidden, hc, quant, device) for _ in range(tp)]
    rng = random.Random(seed)
    log(f"built and pools drawn in {time.monotonic() - started:.1f} s; backends {group.backends}")

    def prepared(draw: Draw, rank: int):
        return rank_call(draw, rank, pools[draw.pool], buffers[rank], hidden, hc)

    if before_run is not None:  # e.g. GpuTurn.acquire: built; the GPU to itself from here
        before_run()
    run_started = time.monotonic()  # ``seconds`` is the run's: neither the build nor a wait for the GPU
    for tries in range(1, FIT_TRIES + 1):
        # Every form once in protocol order, with the largest M of each (the residency check's worst).
        warm = warm_up_draws(group, capacity, hidden)
        for name in group.backends if backend == "mixed" else (None,):
            for call_id, draw in enumerate(warm):
                prepared_calls = [prepared(draw, rank) for rank in range(tp)]
                group.run_in_protocol_order([c for c, _ in prepared_calls], name)
                for rank, (_, check) in enumerate(prepared_calls):
                    checker.check(rank, -1 - call_id, draw.m, *check)
        group.synchronize()
        try:
            group.check_residency()
            break
        except EmulationError as refusal:
            fitted = fitted_capacity(capacity, tp * group.residency.worst, RESIDENT_SHARE)
            if not fit or tries == FIT_TRIES or fitted < FIT_MIN_ROWS:
                raise
            log(f"capacity {capacity} refused, fitted to {fitted}: {refusal}")
            del group
            gc.collect()
            capacity = fitted
            group = build(capacity)
    result.capacity = capacity
    log(f"warm-up: {len(warm)} calls in protocol order; BT from {group.thresholds.bt_min_rows} / "
        f"{group.thresholds.bt_min_finalize_rows} rows, one-kernel LL up to {group.ll_one_kernel_rows} rows; "
        f"residency: each rank's worst call takes {group.residency.worst:.3f} of the GPU "
        f"({tp} ranks: {tp * group.residency.worst:.2f})")

    eager_calls = calls if not graphs else max(calls // 4, 1)
    draws = draw_calls(rng, eager_calls, capacity, hidden)
    boundary_of = [rng.randrange(BOUNDARIES) for _ in draws]  # every rank's call k on the same boundary
    mixed = backend == "mixed"
    # One process issues every rank's calls: a pause of its host thread (the collector walking
    # every compiled kernel's objects, a compile) delays some rank's issue while its peers spin,
    # which no real group has. The collector stays off while the ranks run (unless host_gc), and
    # the longest gap between two issues is reported beside any timeout.
    ahead = HostAhead(tp)
    watch = TimeoutWatch(group)
    gaps = HostGaps(on_tick=watch.timed_out)
    collecting = gc.isenabled()
    if not host_gc:
        gc.collect()
        gc.disable()
    try:
        # Host issue order with drift: each step advances a random rank, at most MAX_LEAD calls ahead.
        issued = [0] * tp
        while min(issued) < len(draws) and not (sum(issued) % 64 == 0 and watch.timed_out()):
            rank = rng.choice([r for r in range(tp) if issued[r] < len(draws) and issued[r] < min(issued) + max_lead])
            k = issued[rank]
            call, check = prepared(draws[k], rank)
            delay = draw_delay(rng, delayed_share)
            ahead.wait(rank, k)
            gaps.issued(rank, k)
            group.issue(rank, RankCall(call, delay, rng.choice(group.backends) if mixed else None, boundary_of[k]))
            with torch.cuda.stream(group.streams[rank]):
                checker.check(rank, k, draws[k].m, *check)
                ahead.record(rank, k)
            issued[rank] += 1
        result.calls += min(issued)

        if graphs and not watch.timed_out():
            result.graph_replays = replay_graphs(group, calls - eager_calls, rng, prepared, checker, capacity,
                                                 hidden, mixed, gaps, HostAhead(tp), watch)
            result.calls += result.graph_replays
        watch.timed_out()
        group.synchronize()
    finally:
        gaps.stop()
        if collecting:
            gc.enable()
    group.check_residency()
    timeouts = group.timeouts()
    result.timeouts = len(timeouts)
    if timeouts:
        result.messages += [f"when the first timeout was seen: {text}" for text in watch.reports]
        result.messages += [f"at the end: {text}" for text in timeouts]
        result.messages += [gaps.describe(), "when the first timeout was seen, eager rank-calls issued / started / "
                            f"finished: {watch.progress or group.describe_progress() + ' (after it)'}"]
    log(gaps.describe())
    result.mismatches, messages = checker.read()
    result.messages += messages
    result.outputs_compared = checker.compared
    result.seconds = time.monotonic() - run_started
    return result


class GpuTurn:
    """Soaks of one GPU taking turns: each builds when it likes (compiles are CPU-bound, so several
    overlap) and runs its ranks only while it holds an exclusive lock on a file, so none shares the
    SMs with another. Released by ``release`` or when the process exits."""

    def __init__(self, path):
        self.path = Path(path)
        self._file = None

    def acquire(self) -> None:
        self._file = self.path.open("a")
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


class HostAhead:
    """Keeps the host at most HOST_AHEAD calls ahead of each rank's GPU work (see HOST_AHEAD)."""

    def __init__(self, tp: int):
        self.events = [dict() for _ in range(tp)]

    def record(self, rank: int, call: int) -> None:
        event = torch.cuda.Event()
        event.record()
        self.events[rank][call] = event

    def wait(self, rank: int, call: int) -> None:
        for earlier in [c for c in self.events[rank] if c <= call - HOST_AHEAD]:
            self.events[rank].pop(earlier).synchronize()


class HostGaps:
    """The longest pause of the host between two issues of the one-GPU group (a rank whose call
    comes that late leaves its peers spinning that long), and where the host was while it paused:
    a watcher thread takes the issuing thread's stack whenever no issue came for ``STALL_MS``."""

    STALL_MS = 200.0
    STACKS_KEPT = 3

    def __init__(self, on_tick=None):
        self.on_tick = on_tick  # also called by the watcher on every tick (a timeout seen early)
        self.last = None
        self.longest = (0.0, None, None)
        self.stalls: list[str] = []
        self._issuer = threading.get_ident()
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="soak-host-gaps", daemon=True)
        self._watcher.start()

    def issued(self, rank: int, call: int) -> None:
        now = time.monotonic()
        if self.last is not None and now - self.last > self.longest[0]:
            self.longest = (now - self.last, rank, call)
        self.last = now

    def stop(self) -> None:
        self._done.set()
        self._watcher.join()

    def _watch(self) -> None:
        seen = None
        while not self._done.wait(self.STALL_MS / 4e3):
            if self.on_tick is not None:
                self.on_tick()
            last = self.last
            if last is None or last == seen or time.monotonic() - last < self.STALL_MS / 1e3:
                continue
            seen = last
            frame = sys._current_frames().get(self._issuer)
            stack = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(no frame)\n"
            if stack not in self.stalls and len(self.stalls) < self.STACKS_KEPT:
                self.stalls.append(stack)

    def describe(self) -> str:
        gap, rank, call = self.longest
        text = f"longest host gap between two issues: {gap * 1e3:.1f} ms (before rank {rank}'s call {call})"
        for stack in self.stalls:
            text += f"\nthe issuing thread, {self.STALL_MS:.0f} ms after its last issue, was in:\n{stack.rstrip()}"
        return text


class TimeoutWatch:
    """Whether a rank has recorded a spin timeout, as far as the host mirrors show (no
    synchronization); the group's progress and the timeouts' explanations are kept from the moment
    one is first seen. After a timeout the group's state is broken, so the soak stops issuing."""

    def __init__(self, group):
        self.group = group
        self.progress: str | None = None
        self.reports: list[str] = []

    def timed_out(self) -> bool:
        if self.progress is None and any(ws.read_error() is not None for ws in self.group.workspaces):
            self.progress = self.group.describe_progress()
            self.reports = self.group.timeouts()
        return self.progress is not None


def warm_up_draws(group, capacity: int, hidden: int) -> list[Draw]:
    """A call of every variant at every M where the forms change (the largest of each form)."""
    sizes = {1, capacity, group.ll_one_kernel_rows, group.ll_one_kernel_rows + 1,
             group.thresholds.bt_min_rows - 1, group.thresholds.bt_min_rows,
             group.thresholds.bt_min_finalize_rows - 1, group.thresholds.bt_min_finalize_rows}
    for kernels in group.paths[0].kernels.values():
        split = getattr(kernels, "split_rows", None)
        if split:
            sizes |= {split, split + 1}
    sizes = sorted(m for m in sizes if 1 <= m <= capacity)
    return [Draw(variant, m, i % POOLS) for i, (variant, m) in
            enumerate((v, m) for m in sizes for v in variants_of(hidden))]


def replay_graphs(group, calls: int, rng: random.Random, prepared, checker, capacity: int, hidden: int,
                  mixed: bool, gaps: HostGaps, ahead: HostAhead, watch: TimeoutWatch) -> int:
    """Each rank captures its own graphs of GRAPH_CALLS calls (the checks inside), then the ranks
    replay them concurrently with skew, every round the same graph on every rank. Returns the
    calls replayed."""
    from .concurrent import RankCall, sleep_us

    graphs = []
    for index, length in enumerate(GRAPH_CALLS):
        draws = draw_calls(rng, length, capacity, hidden)
        boundary_of = [rng.randrange(BOUNDARIES) for _ in draws]
        per_rank = []
        for rank in range(group.tp):
            graph = torch.cuda.CUDAGraph()
            stream = group.streams[rank]
            stream.synchronize()
            # Each rank its own delays inside its sequence: skew within a replay.
            delays = [draw_delay(rng) for _ in draws]
            backends = [rng.choice(group.backends) if mixed else None for _ in draws]
            with torch.cuda.graph(graph, stream=stream):
                for k, draw in enumerate(draws):
                    call, check = prepared(draw, rank)
                    group.issue(rank, RankCall(call, delays[k], backends[k], boundary_of[k]))
                    checker.check(rank, -(1000 * (index + 1) + k), draw.m, *check)
            per_rank.append(graph)
        graphs.append((length, per_rank))
    replayed, rounds = 0, 0
    while replayed < calls and not watch.timed_out():
        length, per_rank = graphs[rng.randrange(len(graphs))]
        order = list(range(group.tp))
        rng.shuffle(order)
        for rank in order:
            ahead.wait(rank, rounds * GRAPH_CALLS[0])
            gaps.issued(rank, -replayed)
            with torch.cuda.stream(group.streams[rank]):
                sleep_us(draw_delay(rng))
                per_rank[rank].replay()
                ahead.record(rank, rounds * GRAPH_CALLS[0])
        replayed += length
        rounds += 1
    return replayed


# -- N GPUs under torchrun: the real group ------------------------------------------------------------------

def soak_gpus(calls: int, backend: str, hidden: int, *, graphs: bool, seed: int = 0, capacity: int = 1024,
              spin_timeout_ms: float = 2000.0, log=print) -> SoakResult:
    """Every rank of the torchrun group builds ``AllReduceMHC`` and issues the same calls (drawn
    from ``seed``), each rank with its own delays; counts are summed over the ranks. The ranks may
    share a GPU (``lamport_mhc.launch``: where 'processes-one-gpu'). Without GPUs they are CPU
    processes on gloo (the torch backend; no delays, no graphs). Joins the group if this process
    has not yet."""
    import torch.distributed as dist

    from .api import AllReduceMHC
    from .concurrent import sleep_us
    from .config import AllReduceMHCConfig
    from .launch import join_torchrun_group, joined_place

    started = time.monotonic()
    place = joined_place() if dist.is_initialized() else join_torchrun_group()
    device, on_gpu = place.device, place.device.type == "cuda"
    if graphs and not on_gpu:
        raise ValueError("CUDA graphs need GPUs")
    tp, rank = place.world_size, place.rank
    result = SoakResult(place.where, backend, tp, hidden,
                        gpu=torch.cuda.get_device_name(device) if on_gpu else "cpu", capacity=capacity)
    quant = hidden % layout.HIDDEN_MULTIPLE_MXFP8 == 0
    op = AllReduceMHC(hidden, 4, capacity, 6, device, quantize_layer_input=quant, residual_only=True,
                      config=AllReduceMHCConfig(backend=backend, spin_timeout_ms=spin_timeout_ms))
    pools = draw_pools(tp, capacity, hidden, 4, 6, seed, device)
    checker = OutputChecker(tp, device, scale_rows(capacity, hidden, device) if quant else None)
    buffers = RankBuffers.allocate(capacity, hidden, 4, quant, device)
    shared_rng, own_rng = random.Random(seed), random.Random(seed * 7919 + rank + 1)

    def one_call(draw: Draw, call_id: int) -> None:
        call, (outputs, expected) = rank_call(draw, rank, pools[draw.pool], buffers, hidden, 4)
        c = call.consumer
        mxfp8 = None if c.mxfp8_values is None else (c.mxfp8_values, c.mxfp8_scales)
        consumer = (c.residual, c.post, c.comb, c.pre, c.norm_weight, c.norm_eps)
        if call.kind == "finalize":
            residual_out, layer = op.finalize(call.gemm2, call.weights, call.indices, call.shared, *consumer,
                                              mxfp8_out=mxfp8)
        else:
            residual_out, layer = op(call.x, *consumer, mxfp8_out=mxfp8)
        checker.check(rank, call_id, draw.m, (residual_out, layer, outputs[2]), expected)

    def delay() -> None:
        if on_gpu:
            sleep_us(draw_delay(own_rng))

    eager = calls if not graphs else max(calls // 4, 1)
    try:
        for k, draw in enumerate(draw_calls(shared_rng, eager, capacity, hidden)):
            delay()
            one_call(draw, k)
        result.calls = eager
        if graphs:
            captured = []
            for index, length in enumerate(GRAPH_CALLS):
                draws = draw_calls(shared_rng, length, capacity, hidden)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for k, draw in enumerate(draws):
                        delay()
                        one_call(draw, -(1000 * (index + 1) + k))
                captured.append((length, graph))
            while result.graph_replays < calls - eager:
                length, graph = captured[shared_rng.randrange(len(captured))]
                delay()
                graph.replay()
                result.graph_replays += length
            result.calls += result.graph_replays
        op.check()
    except RuntimeError as error:
        result.timeouts, result.messages = 1, [str(error)]
    if on_gpu:
        torch.cuda.synchronize()
    mismatches, messages = checker.read()
    totals = torch.tensor([mismatches, result.timeouts, checker.compared], dtype=torch.int64, device=device)
    dist.all_reduce(totals)
    result.mismatches, result.timeouts, result.outputs_compared = (int(v) for v in totals.tolist())
    result.messages += messages
    result.seconds = time.monotonic() - started
    return result


# -- a CPU: the simulated group, protocol order -----------------------------------------------------------

def soak_simulated(tp: int, calls: int, hidden: int, *, seed: int = 0, capacity: int = 12, log=print) -> SoakResult:
    """The Triton kernels under the interpreter, every call in protocol order: LL's one-kernel form
    (as its halves), LL and BT, every variant, checked against the reference bit for bit."""
    from .simulate import SimulatedGroup
    from .testing import assert_same_bits

    started = time.monotonic()
    result = SoakResult("simulated", "triton", tp, hidden, capacity=capacity)
    quant = hidden % layout.HIDDEN_MULTIPLE_MXFP8 == 0
    bt_min = max(2, capacity // 2)
    group = SimulatedGroup(tp, hidden_size=hidden, hc_mult=4, max_num_tokens=capacity, top_k=6, backend="triton",
                           quantize_layer_input=quant, residual_only=True, bt_min_rows=bt_min,
                           bt_min_finalize_rows=bt_min, ll_one_kernel_rows=max(1, capacity // 4))
    device = torch.device("cpu")
    pools = draw_pools(tp, capacity, hidden, 4, 6, seed, device)
    row_of = scale_rows(capacity, hidden, device) if quant else None
    rng = random.Random(seed)
    for k, draw in enumerate(draw_calls(rng, calls, capacity, hidden)):
        pool, m = pools[draw.pool], draw.m
        i = pool.inputs
        residual_only, quantized = draw.variant == "residual", "quant" in draw.variant
        consumer = (i["residual"][:m], i["post"][:m], i["comb"][:m], None if residual_only else i["pre"][:m],
                    None if residual_only else i["norm_weight"], pool.eps)
        try:
            if draw.variant.startswith("finalize"):
                outputs = group.finalize(i["gemm2s"], [w[:m] for w in i["weights"]], [x[:m] for x in i["idxs"]],
                                         [s[:m] for s in i["shareds"]], *consumer, mxfp8=quantized)
                expected = pool.expected["finalize"]
            else:
                outputs = group.all_reduce_mhc([x[:m] for x in i["xs"]], *consumer, mxfp8=quantized)
                expected = pool.expected["plain"]
        except RuntimeError as error:  # a slot still empty when polled: the interpreter's timeout
            result.timeouts += 1
            result.messages.append(f"call {k} ({draw.variant}, M={m}): {error}")
            break
        for rank, (residual_out, layer, mxfp8) in enumerate(outputs):
            checks = [("residual_out", expected[0][:m], residual_out)]
            if not residual_only:
                checks.append(("layer_input", expected[1][:m], layer))
            if quantized:
                size = mxfp8_scale_bytes(m, hidden)
                scales = torch.where(row_of[:size] < m, expected[2][1][:size], 0).to(torch.uint8)
                checks += [("mxfp8 values", expected[2][0][:m].view(torch.uint8), mxfp8[0].view(torch.uint8)),
                           ("mxfp8 scales", scales, mxfp8[1])]
            for name, want, got in checks:
                result.outputs_compared += 1
                try:
                    assert_same_bits(name, want, got)
                except AssertionError as error:
                    result.mismatches += 1
                    result.messages.append(f"call {k} rank {rank} ({draw.variant}, M={m}): {error}")
        result.calls += 1
    result.seconds = time.monotonic() - started
    return result
