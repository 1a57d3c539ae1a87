"""The sweep: every path built once per hidden size, then timed at every M and variant."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..testing import random_inputs
from ..traffic import PROTOCOLS as FLOOR_PROTOCOLS
from .allreduce_peers import NcclAllReduce, OneShotAllReduce, SymmetricStage, TwoShotAllReduce
from .collective import Collective, agree, attempt
from .flashinfer_peers import FlashInferPeers
from .floors import Ceilings, floor_us, tail_bytes
from .lamport_floor import FLOOR_MAX_ROWS, LamportFloor
from .names import ALLREDUCE_ALONE, FLASHINFER_FUSED, LAMPORT_FLOOR, STRONG_TAIL, TILEKERNELS_TAIL
from .report import TAIL_BAR_FROM_M, skip_note, time_budget_subject, write_results
from .strong_tail import STRATEGIES, StrongFinalize, StrongTail
from .tilekernels_tail import NORM_FORMS, Agreement, TileKernels
from .timing import GraphTimer

EPS = 1e-6


class Sweep:
    """Builds every path once per hidden size, then times them over the rows."""

    def __init__(self, args, group, device):
        self.args, self.group, self.device = args, group, device
        self.coll = Collective(group)
        self.tp, self.rank, self.hc = self.coll.tp, self.coll.rank, args.hc
        self.rows_m = sorted(set(args.rows))
        self.rows: list[dict] = []
        self.notes: list[dict] = []  # {"hidden": int | None, "text": str}
        self.skips: dict[tuple, set] = {}  # (hidden, variant, path, reason) -> the Ms (empty: every M)
        self.flashinfer = FlashInferPeers(self.coll, log=self.log)
        self.tilekernels = TileKernels(self.coll, self.hc)
        self.deadline: float | None = None  # time.monotonic() after which no new M is started
        self.stopped = False
        if args.compile_tail and (self.wanted("unfused-nccl") or self.wanted("unfused-one-shot")):
            from .torch_tail import mhc_tail, moe_finalize, mxfp8_tail
            self.torch_tail = torch.compile(mhc_tail, dynamic=True)
            self.torch_finalize = torch.compile(moe_finalize, dynamic=True)
            self.torch_quantize = torch.compile(mxfp8_tail, dynamic=True)
        else:
            from .torch_tail import mhc_tail as tail, moe_finalize as fin, mxfp8_tail as quant
            self.torch_tail, self.torch_finalize, self.torch_quantize = tail, fin, quant

    # -- bookkeeping ---------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def wanted(self, path: str) -> bool:
        return self.args.paths is None or path in self.args.paths

    def record(self, hidden, variant, m, path, samples, floor=None):
        median = statistics.median(samples)
        self.rows.append(dict(tp=self.tp, hc=self.hc, hidden=hidden, variant=variant, m=m, path=path,
                              us_median=median, us_min=min(samples), us_max=max(samples), floor_us=floor,
                              ratio_to_floor=None if floor is None else median / floor, speedup_vs_unfused=None,
                              speedup_vs_best=None))
        self.log(f"tp={self.tp} hc={self.hc} H={hidden} {variant:8s} M={m:5d} {path:26s} {median:9.1f} us"
                 + ("" if floor is None else f"  ({median / floor:5.2f}x floor)"))

    def recorder(self, shape, path, samples, floor=None):
        """What records ``path``'s row of ``shape`` once the row's replays have filled ``samples``."""
        return lambda: self.record(shape.hidden, shape.variant, shape.m, path, samples, floor)

    def note(self, hidden: int, text: str) -> None:
        self.notes.append({"hidden": hidden, "text": text})

    def skip(self, hidden: int, variant: str, path: str, reason: str, m: int | None = None) -> None:
        """A path that cannot run here: reported once per (hidden, variant, path, reason) with the Ms."""
        key = (hidden, variant, path, reason)
        if key not in self.skips:
            self.log(f"skipped {path} ({variant}, H={hidden}): {reason}")
        self.skips.setdefault(key, set())
        if m is not None:
            self.skips[key].add(m)

    def guarded(self, hidden, label, fn):
        """Time one fused path; a failure here is reported, not fatal for the others."""
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - reported in the summary
            text = f"{label}: {type(error).__name__}: {error}"
            self.note(hidden, text)
            self.log("FAILED " + text)
            return None

    def timer(self) -> GraphTimer:
        """The timer of one row's paths: their graphs replayed in turns (``GraphTimer``)."""
        return GraphTimer(self.args.calls, self.args.replays)

    def captured_peer(self, timer, hidden, variant, m, path, fn, after_capture=None):
        """A peer's path captured into ``timer``: the list its samples go to, or None where it fails
        (a skipped row, never an error)."""
        try:
            return timer.add(fn, after_capture)
        except Exception as error:  # noqa: BLE001 - reported as skipped
            self.skip(hidden, variant, path, f"{type(error).__name__}: {error}".splitlines()[0], m)
            return None

    # -- construction, once per hidden size ------------------------------------------------------
    def _fused_ops(self, hidden: int, capacity: int) -> dict:
        from .. import AllReduceMHC, AllReduceMHCConfig

        args, build = self.args, dict(quantize_layer_input="quant" in self.args.variants)
        ops = {}
        if self.wanted("auto"):
            op = self.guarded(hidden, f"build auto H={hidden}", lambda: AllReduceMHC(
                hidden, self.hc, capacity, args.top_k, self.device, **build))
            if op is not None:
                ops["auto"] = op
                self.note(hidden, f"auto at H={hidden}: runs {op.backend} (preset measured in {op.preset.source})")
        for backend in args.backends:
            if self.tp == 1:  # a group of one has one protocol, "local": no mailbox, nothing to force
                configs = {f"{backend}-local": AllReduceMHCConfig(backend=backend)}
            else:
                configs = {f"{backend}-{protocol}": AllReduceMHCConfig(backend=backend, bt_min_rows=threshold,
                                                                       bt_min_finalize_rows=threshold)
                           for protocol, threshold in (("ll", capacity + 1), ("bt", 1))}
            for path, config in configs.items():
                if not self.wanted(path):
                    continue
                op = self.guarded(hidden, f"build {path} H={hidden}", lambda c=config: AllReduceMHC(
                    hidden, self.hc, capacity, args.top_k, self.device, **build, config=c))
                if op is not None:
                    ops[path] = op
        return ops

    def _allreduce_peers(self, hidden: int, capacity: int) -> dict:
        """The all-reduces alone that are wanted, or needed as candidates of unfused-best or
        tilekernels-tail. A candidate only tilekernels-tail asked for is not reported when it cannot
        run (that path's note names the all-reduces it chose from): it may run in a process of its
        own, where a skip would contradict the rows of the main run it is merged into."""
        best = self.wanted("unfused-best") and self.tp > 1
        reported = {p: self.wanted(p) or best for p in ALLREDUCE_ALONE}
        reported["nccl_all_reduce"] |= self.wanted("unfused-nccl")
        reported["one_shot_all_reduce"] |= self.wanted("unfused-one-shot")
        candidates = self.wanted(TILEKERNELS_TAIL) and self.tp > 1
        need = {p: reported[p] or candidates for p in ALLREDUCE_ALONE}
        peers = {}
        if need["nccl_all_reduce"]:
            peers["nccl_all_reduce"] = NcclAllReduce(self.coll, capacity, hidden, self.device)
        if need["one_shot_all_reduce"] or need["two_shot_all_reduce"]:
            holder: dict = {}
            failed = agree(self.coll, attempt(lambda: holder.update(
                stage=SymmetricStage(self.coll, capacity, hidden, self.device))))
            for path, kind in (("one_shot_all_reduce", OneShotAllReduce), ("two_shot_all_reduce", TwoShotAllReduce)):
                if not need[path]:
                    continue
                if failed is None:
                    peers[path] = kind(holder["stage"])
                elif reported[path]:
                    self.skip(hidden, "plain", path, f"symmetric memory is unavailable ({failed})")
        for path in ("flashinfer_all_reduce", "vllm_custom_all_reduce"):
            if need[path]:
                peer = self._flashinfer_peer(hidden, "plain", path, capacity, report=reported[path])
                if peer is not None:
                    peers[path] = peer
        return peers

    def _built_on_every_rank(self, reason: str | None, make, failure: str):
        """``make()`` on every rank unless ``reason`` says why not: (what it made, None), or (None,
        why not), the same answer on every rank."""
        if reason is not None:
            return None, reason
        holder: dict = {}
        failed = agree(self.coll, attempt(lambda: holder.update(made=make())))
        return (holder["made"], None) if failed is None else (None, f"{failure} ({failed})")

    def _flashinfer_peer(self, hidden: int, variant: str, path: str, capacity: int, report: bool = True):
        peer, reason = self._built_on_every_rank(self.flashinfer.reason(path), lambda: self.flashinfer.make(
            path, capacity, hidden, self.device), "creating its workspace failed")
        if reason is not None and report:
            self.skip(hidden, variant, path, reason)
        return peer

    def _fusion_peers(self, hidden: int, capacity: int) -> dict:
        """FlashInfer's fused kernels, the same op as this library's only at hc = 1."""
        if self.hc != 1:
            return {}
        peers = {}
        for path in FLASHINFER_FUSED:
            if self.wanted(path):
                peer = self._flashinfer_peer(hidden, "all", path, capacity)
                if peer is not None:
                    peers[path] = peer
        return peers

    def _tilekernels_tail(self, hidden: int):
        """DeepSeek's tile-kernels at this hidden size, or None (not wanted, or skipped with why)."""
        if not self.wanted(TILEKERNELS_TAIL):
            return None
        tail, reason = self._built_on_every_rank(self.tilekernels.reason(), lambda: self.tilekernels.tail(
            hidden, self.args.top_k), "building it failed")
        if reason is not None:
            for variant in self.args.variants:
                self.skip(hidden, variant, TILEKERNELS_TAIL, reason)
            return None
        if not tail.reduce_fused and "finalize" in self.args.variants:
            self.note(hidden, f"{TILEKERNELS_TAIL} finalize H={hidden}: the strong tail's MoE finalize (tile-kernels' "
                              f"reduce_fused needs H % 256 == 0)")
        return tail

    # -- the sweep -------------------------------------------------------------------------------
    def out_of_time(self) -> bool:
        """Rank 0's clock against ``deadline`` (time.monotonic()), the same answer on every rank."""
        late = self.deadline is not None and time.monotonic() > self.deadline
        return bool(self.coll.all_gather_object(late)[0])

    def run_hidden(self, hidden: int, ceilings: Ceilings) -> None:
        if self.stopped:
            self.note(hidden, f"{time_budget_subject(hidden)}: not measured, the budget ran out before it")
            return
        capacity = self.rows_m[-1]
        fused = self._fused_ops(hidden, capacity)
        peers = self._allreduce_peers(hidden, capacity)
        fusion = self._fusion_peers(hidden, capacity)
        tails = {variant: {strategy: StrongTail(hidden, self.hc, quantize=variant == "quant", strategy=strategy)
                           for strategy in STRATEGIES} for variant in self.args.variants}
        finalize = StrongFinalize(hidden, self.args.top_k)
        tilekernels = self._tilekernels_tail(hidden)
        tilekernels_runs: dict = {"forms": {}, "allreduces": {}, "agreement": []}
        floor = None
        if self.wanted(LAMPORT_FLOOR):
            if self.tp == 1:
                self.skip(hidden, "plain", LAMPORT_FLOOR, "a group of one has no all-reduce to bound")
            else:
                holder: dict = {}
                failed = agree(self.coll, attempt(lambda: holder.update(floor=LamportFloor(
                    self.group, self.device, min(capacity, FLOOR_MAX_ROWS), hidden))))
                if failed is None:
                    floor = holder["floor"]
                else:
                    self.note(hidden, f"build {LAMPORT_FLOOR} H={hidden}: {failed}")
        chosen: dict[int, str] = {}  # M -> the all-reduce of unfused-best
        kernels: dict[tuple, str] = {}  # (variant, M) -> the strong tail's form
        try:
            for m in self.rows_m:
                if self.out_of_time():  # stop cleanly, so what was measured is written
                    self.stopped = True
                    left = [n for n in self.rows_m if n >= m]
                    self.note(hidden, f"{time_budget_subject(hidden)}: stopped before M={m}; not measured: "
                                      f"{', '.join(map(str, left))}")
                    self.log(f"time budget spent: H={hidden} stops before M={m}")
                    break
                allreduce_us = self._time_allreduces(hidden, m, peers)
                for variant in self.args.variants:
                    # Every path of the row is captured first, then all are replayed in turns; each
                    # path's rows are recorded from its samples after that (``then``). The unfused
                    # paths' torch tails get turns of their own, after the others': among them they
                    # slowed the fused paths and not the strong tail (``timing``'s docstring).
                    shape, timer, then = _Shape(self, hidden, variant, m), self.timer(), []
                    torch_tails = self.timer()
                    then += self._fused_rows(shape, fused, ceilings, timer)
                    then += self._strong_rows(shape, tails[variant], finalize, peers, allreduce_us, ceilings,
                                              chosen, kernels, timer)
                    then += self._torch_tail_rows(shape, peers, torch_tails)
                    then += self._tilekernels_rows(shape, tilekernels, peers, allreduce_us, ceilings,
                                                   tilekernels_runs, timer)
                    then += self._fusion_rows(shape, fusion, ceilings, timer)
                    if variant == "plain" and floor is not None and m <= FLOOR_MAX_ROWS:
                        then += self._floor_row(shape, floor, ceilings, timer)
                    timer.replay()
                    torch_tails.replay()
                    for record in then:
                        record()
        finally:
            for peer in list(peers.values()) + list(fusion.values()):
                error = attempt(peer.close)
                if error:
                    self.note(hidden, f"closing {peer.name} H={hidden}: {error}")
        self._summary_notes(hidden, ceilings, chosen, kernels)
        self._tilekernels_notes(hidden, tilekernels_runs, peers)

    def _time_allreduces(self, hidden: int, m: int, peers: dict) -> dict[str, float]:
        """Each all-reduce alone at M rows, replayed in turns (recorded under plain); their medians
        for unfused-best."""
        x = torch.randn((m, hidden), device=self.device).to(torch.bfloat16)
        timer, captured = self.timer(), {}
        for path, peer in peers.items():
            reason = peer.skip_reason(m)
            if reason is not None:
                self.skip(hidden, "plain", path, reason, m)
                continue
            samples = self.captured_peer(timer, hidden, "plain", m, path, lambda p=peer: p(x), peer.after_capture)
            if samples is not None:
                captured[path] = samples
        timer.replay()
        times = {}
        for path, samples in captured.items():
            times[path] = statistics.median(samples)
            if self.wanted(path) and "plain" in self.args.variants:
                self.record(hidden, "plain", m, path, samples)
        return times

    def _fused_rows(self, shape, fused: dict, ceilings: Ceilings, timer: GraphTimer) -> list:
        then = []
        for path, op in fused.items():
            if shape.variant == "finalize":
                call = (lambda op=op: op.finalize(*shape.finalize_inputs, *shape.consumer))
            else:
                call = (lambda op=op: op(shape.x, *shape.consumer, mxfp8_out=shape.mxfp8))
            protocol = op.protocol(shape.m, shape.variant == "finalize")
            samples = self.guarded(shape.hidden, f"{path} {shape.variant} H={shape.hidden} M={shape.m}",
                                   lambda c=call: timer.add(c))
            if samples is not None:  # auto on the unfused torch path ("gather") has no fused floor
                floor = shape.floor(protocol, ceilings) if protocol in FLOOR_PROTOCOLS else None
                then.append(self.recorder(shape, path, samples, floor))
        return then

    def _strong_rows(self, shape, tails: dict, finalize: StrongFinalize, peers: dict, allreduce_us: dict,
                     ceilings: Ceilings, chosen: dict, kernels: dict, timer: GraphTimer) -> list:
        """strong-tail (the local kernels alone, in whichever of the tail's forms is faster at this M, as
        an engine picks by M) and unfused-best (the fastest all-reduce between them; at tp > 1 captured
        after each form, the chosen form's recorded)."""
        residual_out = torch.empty_like(shape.inputs["residual"])
        layer_input = torch.empty_like(shape.x)
        contribution = torch.empty_like(shape.x)

        def local():
            if shape.variant == "finalize":
                return finalize(*shape.finalize_inputs, contribution)
            return shape.x

        def tail_of(reduced, tail):
            tail(reduced, *shape.consumer, residual_out, layer_input, shape.mxfp8)

        hidden, variant, m = shape.hidden, shape.variant, shape.m
        if not (self.wanted(STRONG_TAIL) or self.wanted("unfused-best")):
            return []
        best = None  # the all-reduce of unfused-best at tp > 1
        if self.wanted("unfused-best") and self.tp > 1:
            if allreduce_us:
                best = min(allreduce_us, key=allreduce_us.get)
            else:
                self.skip(hidden, variant, "unfused-best", "no all-reduce ran at this M", m)
        timings, chained = {}, {}
        for strategy, tail in tails.items():
            samples = self.guarded(hidden, f"{STRONG_TAIL} ({strategy}) {variant} H={hidden} M={m}",
                                   lambda t=tail: timer.add(lambda: tail_of(local(), t)))
            if samples is None:
                continue
            timings[strategy] = samples
            if best is not None:
                chained[strategy] = self.captured_peer(timer, hidden, variant, m, "unfused-best",
                                                       lambda t=tail: tail_of(peers[best](local()), t),
                                                       peers[best].after_capture)

        def record():
            if not timings:
                return
            form = min(timings, key=lambda k: statistics.median(timings[k]))
            kernels[(variant, m)], tail_samples = form, timings[form]
            if self.wanted(STRONG_TAIL):
                nbytes = tail_bytes(variant, m, hidden, self.hc, shape.held_routes, self.args.top_k)
                self.record(hidden, variant, m, STRONG_TAIL, tail_samples, nbytes / (ceilings.hbm_gbps * 1e3))
            if not self.wanted("unfused-best"):
                return
            if self.tp == 1:  # a group of one needs no all-reduce: the strong kernels are the whole unfused op
                chosen[m] = "none"
                self.record(hidden, variant, m, "unfused-best", tail_samples)
            elif chained.get(form):
                chosen[m] = best
                self.record(hidden, variant, m, "unfused-best", chained[form])
        return [record]

    def _torch_tail_rows(self, shape, peers: dict, timer: GraphTimer) -> list:
        """The unfused paths of earlier results: NCCL or one-shot, then the tail in compiled torch ops."""
        def contribution():
            if shape.variant == "finalize":
                return self.torch_finalize(*shape.finalize_inputs)
            return shape.x

        def tail(values):
            _, layer_input = self.torch_tail(values, *shape.consumer)
            if shape.variant == "quant":
                self.torch_quantize(layer_input)

        then = []
        for path, peer_name in (("unfused-nccl", "nccl_all_reduce"), ("unfused-one-shot", "one_shot_all_reduce")):
            if not self.wanted(path):
                continue
            peer = peers.get(peer_name)
            if peer is None:
                self.skip(shape.hidden, shape.variant, path, f"{peer_name} cannot run here")
                continue
            samples = self.captured_peer(timer, shape.hidden, shape.variant, shape.m, path,
                                         lambda p=peer: tail(p(contribution())), peer.after_capture)
            if samples is not None:
                then.append(self.recorder(shape, path, samples))
        return then

    def _tilekernels_rows(self, shape, tail, peers: dict, allreduce_us: dict, ceilings: Ceilings, runs: dict,
                          timer: GraphTimer) -> list:
        """tilekernels-tail: its kernels after the fastest all-reduce (tp > 1, as unfused-best), the
        norm in whichever form is faster at this M; one call checked against the reference first, the
        verdict the same on every rank (a call that disagrees is skipped, not timed)."""
        if tail is None:
            return []
        hidden, variant, m = shape.hidden, shape.variant, shape.m
        peer = None
        if self.tp > 1:
            if not allreduce_us:
                self.skip(hidden, variant, TILEKERNELS_TAIL, "no all-reduce ran at this M", m)
                return []
            runs["allreduces"][m] = min(allreduce_us, key=allreduce_us.get)
            peer = peers[runs["allreduces"][m]]
        holder: dict = {}

        def run(form):
            reduced = holder["call"].contribution()
            if peer is not None:
                reduced = peer(reduced)
            holder["call"].tail(reduced, form)
            return reduced

        def check():
            holder["call"] = tail.bind(shape.x, shape.consumer, shape.finalize_inputs, shape.mxfp8)
            holder["agreement"] = holder["call"].check(run(NORM_FORMS[0]))

        problem = attempt(check)
        if problem is None and holder["agreement"].failure is not None:
            problem = f"outputs disagree with the reference: {holder['agreement'].failure}"
        problem = agree(self.coll, problem)
        if problem is not None:
            self.skip(hidden, variant, TILEKERNELS_TAIL, problem, m)
            return []
        runs["agreement"].append(holder["agreement"])
        timings, failures = {}, []
        for form in NORM_FORMS:
            try:
                timings[form] = timer.add(lambda f=form: run(f), None if peer is None else peer.after_capture)
            except Exception as error:  # noqa: BLE001 - a form that fails is noted; all failing, skipped
                failures.append(f"{form} form: {type(error).__name__}: {error}".splitlines()[0])
        if not timings:
            self.skip(hidden, variant, TILEKERNELS_TAIL, failures[0], m)
            return []
        for failure in failures:
            self.note(hidden, f"{TILEKERNELS_TAIL} {variant} H={hidden} M={m}: {failure}")

        def record():
            form = min(timings, key=lambda f: statistics.median(timings[f]))
            runs["forms"][(variant, m)] = form
            floor = None
            if self.tp == 1:  # the whole op is the tail: the strong tail's floor, its bytes at the device copy
                nbytes = tail_bytes(variant, m, hidden, self.hc, shape.held_routes, self.args.top_k)
                floor = nbytes / (ceilings.hbm_gbps * 1e3)
            self.record(hidden, variant, m, TILEKERNELS_TAIL, timings[form], floor)
        return [record]

    def _fusion_rows(self, shape, fusion: dict, ceilings: Ceilings, timer: GraphTimer) -> list:
        if not fusion:
            return []
        residual_in = shape.inputs["residual"].view(shape.m, shape.hidden)  # hc = 1
        gamma = shape.inputs["norm_weight"]
        residual_out, norm_out = torch.empty_like(residual_in), torch.empty_like(residual_in)
        then = []
        for path, peer in fusion.items():
            reason = peer.skip_reason(shape.variant, shape.m)
            if reason is not None:
                self.skip(shape.hidden, shape.variant, path, reason,
                          shape.m if shape.variant == "plain" else None)
                continue
            if shape.variant == "finalize":
                gemm2, weights, indices, shared = shape.finalize_inputs
                scales = weights.to(torch.bfloat16)  # the kernel reads router weights as the activation type
                call = (lambda p=peer: p.finalize(gemm2, scales, indices, shared, residual_in, gamma, EPS,
                                                  residual_out, norm_out))
            else:
                call = (lambda p=peer: p.plain(shape.x, residual_in, gamma, EPS, residual_out, norm_out))
            samples = self.captured_peer(timer, shape.hidden, shape.variant, shape.m, path, call, peer.after_capture)
            if samples is not None:
                floor = shape.floor("ll" if path.endswith("oneshot") else "bt", ceilings)
                then.append(self.recorder(shape, path, samples, floor))
        return then

    def _floor_row(self, shape, floor: LamportFloor, ceilings: Ceilings, timer: GraphTimer) -> list:
        """The Lamport all-reduce floor kernel at this M (plain)."""
        out = torch.empty_like(shape.x)
        samples = self.guarded(shape.hidden, f"{LAMPORT_FLOOR} H={shape.hidden} M={shape.m}",
                               lambda: timer.add(lambda: floor(shape.x, out)))
        if samples is None:
            return []
        bound = floor_us("ll", "plain", self.tp, shape.m, shape.hidden, ceilings, self.hc)
        return [self.recorder(shape, LAMPORT_FLOOR, samples, bound)]

    # -- notes -----------------------------------------------------------------------------------
    def _summary_notes(self, hidden: int, ceilings: Ceilings, chosen: dict, kernels: dict) -> None:
        if chosen:
            if set(chosen.values()) == {"none"}:
                self.note(hidden, f"unfused-best at H={hidden}: no all-reduce (a group of one), the strong "
                                  f"kernels alone")
            else:
                self.note(hidden, f"unfused-best at H={hidden}: {self._runs(chosen)}")
        tails = [r for r in self.rows if r["hidden"] == hidden and r["path"] == STRONG_TAIL
                 and r["m"] >= TAIL_BAR_FROM_M]
        for variant in self.args.variants:
            forms = {m: form for (v, m), form in kernels.items() if v == variant}
            if forms:
                self.note(hidden, f"strong tail form {variant} H={hidden}: {self._runs(forms)}")
            fractions = [r["floor_us"] / r["us_median"] for r in tails if r["variant"] == variant]
            if fractions:
                self.note(hidden, f"strong tail {variant} H={hidden}: {min(fractions):.1%}-{max(fractions):.1%} "
                                  f"of the device copy ({ceilings.hbm_gbps:.0f} GB/s) from M = {TAIL_BAR_FROM_M}")

    def _tilekernels_notes(self, hidden: int, runs: dict, peers: dict) -> None:
        for variant in self.args.variants:
            forms = {m: form for (v, m), form in runs["forms"].items() if v == variant}
            if forms:
                self.note(hidden, f"{TILEKERNELS_TAIL} norm form {variant} H={hidden}: {self._runs(forms)}")
        if runs["allreduces"]:
            self.note(hidden, f"{TILEKERNELS_TAIL} at H={hidden}: {self._runs(runs['allreduces'])} (of "
                              f"{', '.join(peers)})")
        if runs["agreement"]:
            self.note(hidden, f"{TILEKERNELS_TAIL} check H={hidden}: every M timed is within one bf16 ulp of the "
                              f"reference (or the fp32 rounding of a sum's terms); "
                              f"{Agreement.merged(runs['agreement']).summary()}")

    def _runs(self, choices: dict) -> str:
        """{M: name} as "a at M=1-64, b at M=100-8192" over the sweep's Ms in order."""
        runs: list[list] = []
        for m in (m for m in self.rows_m if m in choices):
            if runs and runs[-1][2] == choices[m]:
                runs[-1][1] = m
            else:
                runs.append([m, m, choices[m]])
        return ", ".join(f"{name} at M={a}" + (f"-{b}" if b != a else "") for a, b, name in runs)

    def measure(self, hidden: int, ceilings: Ceilings, out: Path, gpu: str) -> None:
        """``run_hidden``, then the results written (``finish``), also when it fails: the rows
        measured before the failure are kept (a GPU fault is sticky, the host's rows are not), and a
        note says where it stopped."""
        try:
            self.run_hidden(hidden, ceilings)
        except Exception as error:
            first_line = (str(error).splitlines() or [""])[0]
            self.note(hidden, f"failed H={hidden}: {type(error).__name__}: {first_line}; the rows measured "
                              f"before it are kept")
            raise
        finally:
            self.finish(out, gpu, ceilings)

    def finish(self, out: Path, gpu: str, ceilings: Ceilings) -> None:
        skipped = [skip_note(hidden, self.hc, variant, path, reason, sorted(ms))
                   for (hidden, variant, path, reason), ms in self.skips.items()]
        if self.rank == 0:
            write_results(self.rows, self.notes + skipped, out, gpu, self.tp, ceilings, self.args, self.args.merge)


class _Shape:
    """One (hidden, variant, M) of the sweep: its inputs on the device and its byte floors."""

    def __init__(self, sweep: Sweep, hidden: int, variant: str, m: int):
        from ..mxfp8 import mxfp8_scale_bytes

        self.sweep, self.hidden, self.variant, self.m = sweep, hidden, variant, m
        args, device, rank = sweep.args, sweep.device, sweep.rank
        # The finalize reads GEMM2 rows as an engine lays them out: one per held route, none twice; the
        # values are a model's, finite (``random_inputs``' specials send the exact norm down slow paths).
        inputs = random_inputs(sweep.tp, m, hidden, sweep.hc, seed=m, top_k=args.top_k if variant == "finalize" else 0,
                               permuted=True, zero_row=False, specials=False, device=device)
        if sweep.hc == 1:  # the op is then all-reduce + residual add + RMSNorm, FlashInfer's fusion
            for name in ("post", "comb", "pre"):
                inputs[name].fill_(1.0)
        self.inputs = inputs
        self.x = inputs["xs"][rank]
        self.consumer = (inputs["residual"], inputs["post"], inputs["comb"], inputs["pre"], inputs["norm_weight"], EPS)
        self.finalize_inputs, self.held_routes = None, 0
        if variant == "finalize":
            self.finalize_inputs = (inputs["gemm2s"][rank], inputs["weights"][rank], inputs["idxs"][rank],
                                    inputs["shareds"][rank])
            self.held_routes = int((inputs["idxs"][rank] >= 0).sum())
        self.mxfp8 = None
        if variant == "quant":
            self.mxfp8 = (torch.empty((m, hidden), dtype=torch.float8_e4m3fn, device=device),
                          torch.empty(mxfp8_scale_bytes(m, hidden), dtype=torch.uint8, device=device))

    def floor(self, protocol: str, ceilings: Ceilings) -> float:
        s = self.sweep
        return floor_us(protocol, self.variant, s.tp, self.m, self.hidden, ceilings, s.hc, s.args.top_k,
                        self.held_routes)
