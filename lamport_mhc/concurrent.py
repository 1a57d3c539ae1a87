"""Ranks that run at once: a TP group's ranks as CUDA streams of one process over one GPU's mailboxes.

``SimulatedGroup(device="cuda")`` launches every rank's kernels in protocol order on one stream, so
no consumer ever spins while a peer's data is in flight. Here each rank issues its own calls on its
own stream, in whatever order and with whatever skew the caller chooses, so publishes, owner
reduces and consumers of different ranks (and of different calls) overlap as on a real TP group.
The mailboxes, tables and state words are the production ones (``workspace.allocate_host_group``:
the same layouts, with every rank's buffers in this GPU's memory), and so are the kernels and the
path that sequences them (``FusedPath``, with ``auto``'s routes where the backend is "auto").

Sharing one GPU (and one host thread) brings artifacts no real TP group has, ruled out here by
construction:
- streams share the GPU's hardware work queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default;
  torch's pooled streams of one priority need not even take different ones). In a queue that two
  ranks share, a launch that waits for its own stream's previous kernel holds up every launch
  behind it: a rank's publish can wait behind a peer's work that waits for a spinning consumer,
  which waits for that publish. Each rank gets a stream of its own created for it, on a queue of
  its own (``rank_streams``), and a group needs ``tp`` queues to spare;
- a kernel's first (lazy) module load waits for the GPU to go idle, which never happens while a
  rank spins: every TP build loads its kernels when it is built (``carveout.pin_build``), and the
  caller runs every form once in protocol order (``run_in_protocol_order``) before the ranks run
  at once;
- an SM changes its L1 / shared-memory split only while it holds no CTA, and other ranks' programs
  spin on most SMs: a kernel asking for a larger split than theirs could not be placed until the
  spin gave up. Every TP build's kernels ask for the same, largest split (``lamport_mhc.carveout``);
  ``pin_carveout=False`` (diagnosis) gives the choice back to the driver;
- all ranks' waiting kernels share the SMs: ``Residency`` records what every call launches and
  ``check_residency`` refuses, with the reason, a build whose waiting programs could not all be
  resident together (a timeout would then say nothing about the protocol).
The soak (``lamport_mhc.soak``) adds what the one host thread that issues every rank's calls needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import layout, presets
from .backend import BuildSpec, load_backend
from .carveout import DRIVER_DEFAULT, pin_build
from .call import Call
from .paths import FusedPath
from .selector import Thresholds, mailbox_rows, pick_backends, support_table
from .workspace import allocate_host_group

# Backends a concurrent group runs: one of them, "auto" (the preset's routes, as AllReduceMHC
# builds them), or "mixed": every rank-call on a backend drawn at random (both write the same
# slots and state words, so the ranks of one call may differ).
GROUP_BACKENDS = ("triton", "cute", "auto", "mixed")
# Kernels whose programs wait for other ranks, by what their names contain (a form's name adds a
# prefix or suffix: CuTe's ``streaming_consumer_ll_plain``, Triton's ``consumer_ll_plain_split``);
# they must all be resident together.
WAITING_KERNELS = ("consumer_ll", "consumer_bt", "owner_reduce", "one_kernel")


def waits_for_peers(name: str) -> bool:
    """Whether the kernel named ``name`` polls for other ranks' stores (every form but publishes)."""
    return any(kind in name for kind in WAITING_KERNELS)

# Of the SMs' capacity, what all ranks' waiting programs of one call may take together: the
# driver's blocks per SM ignore where clusters may be placed, and a publish must still find room.
RESIDENT_SHARE = 0.75
# torch.cuda._sleep cycles per microsecond (H200 at its ~1.98 GHz boost clock).
CYCLES_PER_US = 1980
# The hardware work queues the driver spreads streams over: its default, and what a process that
# emulates ranks should ask for (the driver's most) before CUDA starts.
DEFAULT_CONNECTIONS = 8
CONNECTIONS = 32
# Rank-calls whose progress (started, finished) each rank keeps for explaining a timeout.
PROGRESS_KEPT = 64


def sleep_us(microseconds: float) -> None:
    """A device-side delay on the current stream (a rank's skew)."""
    if microseconds > 0:
        torch.cuda._sleep(int(microseconds * CYCLES_PER_US))


def rank_streams(tp: int, device: torch.device) -> list[torch.cuda.ExternalStream]:
    """``tp`` new non-blocking streams, created one after another so the driver puts each on a
    hardware queue of its own (it deals queues out in turn; torch's pool created its streams of
    every priority interleaved). Refuses where the queues cannot go round."""
    import os

    from cuda.bindings import runtime

    connections = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", DEFAULT_CONNECTIONS))
    if tp >= connections:
        raise EmulationError(
            f"{tp} emulated ranks need a hardware queue each and one for the rest of the process, but "
            f"CUDA_DEVICE_MAX_CONNECTIONS is {connections}: set it to {CONNECTIONS} before CUDA starts "
            f"(python -m lamport_mhc soak does)")
    streams = []
    with torch.cuda.device(device):
        for _ in range(tp):
            error, stream = runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking)
            if error != runtime.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaStreamCreateWithFlags: {error}")
            streams.append(torch.cuda.ExternalStream(int(stream), device=device))
    return streams


def blocks_per_sm(function, threads: int, shared_bytes: int) -> int:
    """The driver's count of CTAs of ``function`` an SM holds at once."""
    from cuda.bindings import driver

    error, count = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, shared_bytes)
    if error != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor: {error}")
    return count


class Residency:
    """What each rank-call launched, and the largest share of the GPU one rank's waiting programs
    took: the programs of every waiting kernel over what the SMs hold of it at once (the driver's
    blocks per SM). A group is emulated faithfully only while ``tp`` such shares fit
    ``RESIDENT_SHARE`` of the GPU."""

    def __init__(self, sms: int, resident_ctas: Callable[[str, str], int]):
        self.sms = sms
        self.resident_ctas = resident_ctas  # (backend, kernel name) -> CTAs the SMs hold at once
        self._resident: dict[tuple[str, str], int] = {}
        self.worst = 0.0
        self.worst_launches: list[str] = []

    def settle(self, launches: list[tuple[str, str, int]]) -> None:
        """Account one rank-call's launches: (backend, kernel name, programs)."""
        parts = []
        for backend, name, programs in launches:
            if waits_for_peers(name):
                key = (backend, name)
                if key not in self._resident:
                    self._resident[key] = self.resident_ctas(backend, name)
                parts.append((programs / self._resident[key],
                              f"{backend} {name}: {programs} programs, {self._resident[key]} resident at once"))
        share = sum(s for s, _ in parts)
        if share > self.worst:
            self.worst, self.worst_launches = share, [text for _, text in parts]


@dataclass
class RankCall:
    """One rank's call: what it runs and how long it waits first (device-side, in microseconds)."""

    call: Call
    delay_us: float = 0.0
    backend: str | None = None  # "mixed" groups: the backend of this rank-call
    boundary: int = 0           # which of the group's boundaries (paths sharing the workspace) runs it


class ConcurrentGroup:
    """``tp`` ranks as CUDA streams of one process, each with its own workspace and kernels over one
    GPU's mailboxes. ``issue(rank, rank_call)`` enqueues a rank's call on its stream and returns at
    once; nothing synchronizes the ranks but the protocol itself. With ``boundaries`` > 1 each rank
    has that many paths over its one workspace, and each call names the one it runs on."""

    def __init__(self, tp: int, *, hidden_size: int, max_num_tokens: int, hc_mult: int = 4, top_k: int = 6,
                 backend: str = "triton", bt_min_rows: int | None = None, bt_min_finalize_rows: int | None = None,
                 ll_one_kernel_rows: int | None = None, split_rows: int | None = None, chunk_rows: int | None = None,
                 spin_timeout_ms: float = 2000.0, boundaries: int = 1, pooled_streams: bool = False,
                 pin_carveout: bool = True, device=None):
        if not torch.cuda.is_available():
            raise RuntimeError("a concurrent group runs on a CUDA GPU (on a CPU, SimulatedGroup runs protocol order)")
        if not isinstance(tp, int) or tp < 2:
            raise ValueError(f"a concurrent group needs tp >= 2 ranks, got {tp!r}")
        if backend not in GROUP_BACKENDS:
            raise ValueError(f"backend must be one of {GROUP_BACKENDS}, got {backend!r}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else
                                   torch.device(device).index or 0)
        self.tp, self.hidden, self.capacity = tp, hidden_size, max_num_tokens
        properties = torch.cuda.get_device_properties(self.device)
        self.sms = properties.multi_processor_count
        preset = presets.lookup(presets.device_keys(self.device), tp, hidden_size)
        self.thresholds = Thresholds(bt_min_rows or preset.bt_min_rows, bt_min_finalize_rows or preset.bt_min_finalize_rows)
        quantize = hidden_size % layout.HIDDEN_MULTIPLE_MXFP8 == 0
        rows = mailbox_rows(tp, max_num_tokens, self.thresholds, chunk_rows, quantize)
        base = BuildSpec(hidden=hidden_size, hc=hc_mult, capacity=max_num_tokens, top_k=top_k, tp=tp, rank=0,
                         quantize=quantize, residual_only=True, **rows, spin_timeout_ns=int(spin_timeout_ms * 1e6),
                         ll_one_kernel_rows=min(rows["ll_rows"], self.sms if ll_one_kernel_rows is None
                                                else ll_one_kernel_rows),
                         split_rows=split_rows)
        supported = {name for name, answer in support_table(base, self.device).items() if answer.ok}
        if backend == "auto":
            self.backends = pick_backends("auto", preset, supported)
        else:
            self.backends = ("triton", "cute") if backend == "mixed" else (backend,)
        missing = [name for name in self.backends if name not in supported]
        if missing or self.backends == ("torch",):
            raise RuntimeError(f"backend {backend!r} cannot run here: {support_table(base, self.device)}")
        self.backend = backend
        self.specs = [BuildSpec(**{**base.__dict__, "rank": rank}) for rank in range(tp)]
        self.workspaces = allocate_host_group(self.specs, self.device)
        self.residency = Residency(self.sms, self._resident_ctas)
        self._launches: list[list] = [[] for _ in range(tp)]
        self._choice = ["" for _ in range(tp)]
        # Per boundary, every rank's path: kernels of its own over the rank's one workspace, as the
        # attention and MoE boundaries of a model share their mailboxes (MHCBoundary).
        if not isinstance(boundaries, int) or boundaries < 1:
            raise ValueError(f"boundaries must be a positive int, got {boundaries!r}")
        self.boundaries = [[self._rank_path(spec, workspace, preset) for spec, workspace in
                            zip(self.specs, self.workspaces)] for _ in range(boundaries)]
        self.paths = self.boundaries[0]
        # The one-kernel bound every backend holds (each may lower the build's).
        self.ll_one_kernel_rows = min(k.spec.ll_one_kernel_rows for paths in self.boundaries for p in paths
                                      for k in p.kernels.values())
        # pooled_streams (diagnosis only): torch's pooled streams, which may share hardware queues.
        self.streams = ([torch.cuda.Stream(self.device) for _ in range(tp)] if pooled_streams
                        else rank_streams(tp, self.device))
        # Per rank: (host issue count, started event, finished event) of its latest rank-calls.
        self.issued = [0] * tp
        self.progress: list[list] = [[] for _ in range(tp)]
        self._reader = torch.cuda.Stream(self.device)  # reads slots while ranks may spin (explain_timeout)
        if not pin_carveout:
            for path in (path for paths in self.boundaries for path in paths):
                for kernels in path.kernels.values():
                    pin_build(kernels, DRIVER_DEFAULT)
        torch.cuda.synchronize(self.device)

    # -- construction ------------------------------------------------------------------------------
    def _rank_path(self, spec: BuildSpec, workspace, preset) -> FusedPath:
        kernels = {name: load_backend(name).build(spec, workspace) for name in self.backends}
        for name, built in kernels.items():
            built.on_launch = self._recorder(spec.rank, name)
        return FusedPath(f"concurrent {self.backend}", kernels, workspace, self.thresholds,
                         self._router(spec.rank, preset))

    def _router(self, rank: int, preset):
        if self.backend == "mixed":
            return lambda call: self._choice[rank]
        if len(self.backends) > 1:
            return lambda call: preset.backend_for(call.variant, call.m) or self.backends[0]
        return None

    def _recorder(self, rank: int, backend: str):
        def record(name: str, programs: int) -> None:
            self._launches[rank].append((backend, name, programs))
        return record

    def _settle(self, ranks) -> None:
        for rank in ranks:
            self.residency.settle(self._launches[rank])
            self._launches[rank] = []

    def _resident_ctas(self, backend: str, name: str) -> int:
        kernels = self.paths[0].kernels[backend]
        function, threads, shared = kernels.footprint(name)
        return max(1, blocks_per_sm(function, threads, shared)) * self.sms

    # -- calls -------------------------------------------------------------------------------------
    def issue(self, rank: int, rank_call: RankCall) -> None:
        """Enqueue one rank's call on its stream (its delay first); returns without waiting."""
        self._enqueue(rank, rank_call)
        self._settle((rank,))

    def _enqueue(self, rank: int, rank_call: RankCall) -> None:
        with torch.cuda.stream(self.streams[rank]):
            sleep_us(rank_call.delay_us)
            self._choice[rank] = rank_call.backend or self.backends[0]
            tracked = not torch.cuda.is_current_stream_capturing()
            if tracked:
                started, finished = torch.cuda.Event(), torch.cuda.Event()
                started.record()
            self.boundaries[rank_call.boundary][rank].run(rank_call.call)
            if tracked:
                finished.record()
                self.progress[rank] = (self.progress[rank] + [(self.issued[rank], started, finished)])[-PROGRESS_KEPT:]
                self.issued[rank] += 1

    def run_in_protocol_order(self, calls: Sequence[Call], backend: str | None = None) -> None:
        """One call of every rank in protocol order (every publish, owner reduce, then consumer) on
        the current stream, then a synchronize: nothing waits for a launch still to come. An LL
        call that takes the one-kernel form (whose programs wait for their twins) is issued on the
        ranks' streams at once instead, which is safe once every module is loaded, after what the
        caller enqueued on the current stream (the checks of its previous call read and poison the
        buffers this call writes; the ranks' streams are non-blocking, nothing else orders them).
        ``backend``: a "mixed" group's backend for every rank (default: its first)."""
        self._choice = [backend or self.backends[0]] * self.tp
        paths = self.paths
        for parts in zip(*(path.parts(call) for path, call in zip(paths, calls))):
            protocol = paths[0].protocol(parts[0])
            if any(FusedPath._one_kernel(p.kernels[p.backend(c)], c, protocol) for p, c in zip(paths, parts)):
                current = torch.cuda.current_stream(self.device)
                for stream in self.streams:
                    stream.wait_stream(current)
                for rank, part in enumerate(parts):
                    self._enqueue(rank, RankCall(part, backend=self._choice[rank]))
            else:
                for step in ("publish", "reduce", "consume"):
                    for path, part in zip(paths, parts):
                        getattr(path, step)(part, protocol)
            self.synchronize()
        # Settled per call, as ``issue`` does: a call's parts follow each other on a rank's stream,
        # and with PDL a part's programs may be resident while the part before it still waits.
        self._settle(range(self.tp))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # -- what went wrong -----------------------------------------------------------------------------
    def timeouts(self) -> list[str]:
        """Every rank's spin-timeout record, explained (the host mirror; callable while ranks run)."""
        reports = []
        for rank, workspace in enumerate(self.workspaces):
            record = workspace.read_error()
            if record is not None:
                reports.append(self.explain_timeout(rank, *record))
        return reports

    def explain_timeout(self, rank: int, source: int, generation: int, token: int) -> str:
        """What the slot a timed-out poll waited for holds now: still the sentinel (the store never
        came, or it was re-armed away), or the data (the poll missed it); and every rank's state.
        The record does not say which protocol waited: for a source's contribution both its LL slot
        and (where this rank owns the token) its BT slot are shown."""
        ws = self.workspaces[rank]
        if source < 0:  # a BT consumer, waiting for the owner's sum
            slots = {f"bt_sums[{generation}][{token}]": ws.bt_sums.local[generation, token]}
        else:  # an LL consumer or a BT owner reduce, waiting for ``source``'s contribution
            slots = {}
            if token < ws.ll.local.shape[2]:
                slots[f"ll[{generation}][{source}][{token}]"] = ws.ll.local[generation, source, token]
            row = token // self.tp
            if ws.bt is not None and token % self.tp == rank and row < ws.bt.local.shape[2]:
                slots[f"bt[{generation}][{source}][{row}]"] = ws.bt.local[generation, source, row]
        # Read through a copy engine on a stream of its own: ranks may still be spinning.
        with torch.cuda.stream(self._reader):
            held = "; ".join(f"{where} holds {self._slot_state(slot.to('cpu'))}"
                             for where, slot in slots.items()) or "no slot of that token"
            states = "; ".join(f"rank {r} ll {w.ll_state.to('cpu').tolist()}" +
                               (f" bt {w.bt_state.to('cpu').tolist()}" if w.bt_state is not None else "")
                               for r, w in enumerate(self.workspaces))
        return (f"rank {rank}: spin timeout waiting for "
                f"{'the owners sum' if source < 0 else f'rank {source}'} at token {token} of generation "
                f"{generation}; {held}. States [next, active, arrived]: {states}")

    @staticmethod
    def _slot_state(slot: torch.Tensor) -> str:
        sentinels = int((slot == layout.SENTINEL_INT16).sum())
        if sentinels == slot.numel():
            return "the sentinel in every lane (the store never landed, or was re-armed away)"
        if sentinels == 0:
            return "data in every lane (the poll missed it, or a later store came)"
        return f"the sentinel in {sentinels} of {slot.numel()} lanes (a partial store)"

    def describe_progress(self) -> str:
        """Per rank: eager calls issued by the host, and the last of them whose kernels had started
        and finished on the GPU, as of now (no synchronization): taken when a timeout is first seen,
        it says whether the awaited peer's call had been issued, had started, or was held up before
        its first kernel."""
        parts = []
        for rank, kept in enumerate(self.progress):
            started = max((n for n, s, _ in kept if s.query()), default=-1)
            finished = max((n for n, _, f in kept if f.query()), default=-1)
            parts.append(f"rank {rank} {self.issued[rank]} / {started + 1} / {finished + 1}")
        return ", ".join(parts)

    # -- residency -----------------------------------------------------------------------------------
    def check_residency(self) -> None:
        """Raise ``EmulationError`` unless the worst rank-call issued so far, made by all ranks at
        once, leaves its waiting programs room to be resident together (and a publish room to run)."""
        worst = self.residency.worst
        if self.tp * worst > RESIDENT_SHARE:
            raise EmulationError(
                f"tp={self.tp} ranks on one GPU of {self.sms} SMs: one rank's waiting programs take {worst:.2f} of "
                f"it ({'; '.join(self.residency.worst_launches)}), all ranks' {self.tp * worst:.2f}, past the "
                f"{RESIDENT_SHARE} they may take; a timeout would say nothing about the protocol. Lower "
                f"max_num_tokens or the LL one-kernel rows, or emulate fewer ranks.")


class EmulationError(RuntimeError):
    """A group one GPU cannot emulate faithfully: its ranks' streams would share hardware queues,
    or their waiting programs could not all be resident at once."""
