"""Latency of every path at every M, as ratios against peers measured in the same run.

Run one process per GPU: ``torchrun --nproc-per-node 2 -m lamport_mhc bench`` (or
``torchrun --nproc-per-node 2 bench/run.py``). Every path runs ``--calls`` times inside one CUDA
graph; a replay's time / calls is one sample, the max over ranks of each replay is taken, and the
median (min, max) over ``--replays`` is reported. In the same run: the fused paths (LL and BT forced
for each of ``--backends``, and ``auto``), the unfused path as engines run it (NCCL all-reduce, or PyTorch
symmetric-memory ``one_shot_all_reduce``, then the mHC tail in compiled torch ops), both all-reduces
alone, the simplest one-kernel Lamport all-reduce (``lamport-ar-floor``) and two ceilings (peer copy
over NVLink, device copy in HBM) from which every fused row gets its byte floor.

Outputs under ``--out`` (default bench/results): ``<gpu>_tp<N>.csv``, a PNG per (tp, hidden, variant)
when matplotlib is installed (``pip install 'lamport-mhc[bench]'``), ``<gpu>_tp<N>.md`` and the notes as
``<gpu>_tp<N>_notes.json``. ``--paths`` times a subset of the paths; ``--merge CSV`` extends an earlier
run: its rows and notes are kept except those this run measured again.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from .backend import FUSED_BACKENDS, PROTOCOLS
from .testing import random_inputs

HC = 4
VARIANTS = ("plain", "finalize", "quant")
COLUMNS = ("tp", "hidden", "variant", "m", "path", "us_median", "us_min", "us_max", "floor_us", "ratio_to_floor",
           "speedup_vs_unfused")
INT_COLUMNS = ("tp", "hidden", "m")
FLOAT_COLUMNS = ("us_median", "us_min", "us_max", "floor_us", "ratio_to_floor", "speedup_vs_unfused")
PATHS = (("auto",) + tuple(f"{backend}-{protocol}" for backend in FUSED_BACKENDS for protocol in PROTOCOLS)
         + ("unfused-nccl", "unfused-one-shot", "nccl_all_reduce", "one_shot_all_reduce", "lamport-ar-floor"))
DEFAULT_ROWS = [2 ** i for i in range(14)] + [3, 100, 1000]


# -- byte floors -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ceilings:
    peer_gbps: float   # one rank storing into one peer over NVLink
    hbm_gbps: float    # device-to-device copy (read + write counted)


def fused_bytes(protocol: str, variant: str, tp: int, m: int, hidden: int, hc: int = HC,
                top_k: int = 6) -> tuple[float, float]:
    """(bytes one rank sends over NVLink, bytes through its HBM) that any fused implementation of a
    call must move: contributions to the peers, the mHC inputs and outputs, the mailbox traffic."""
    row = hidden * 2  # one bf16 row
    if protocol == "ll":
        nvlink = (tp - 1) * m * row                                  # every token to every peer
        mailbox = 2 * tp * m * row                                   # written by all, read + re-armed here
    else:
        nvlink = (tp - 1) / tp * m * row + (tp - 1) * (m / tp) * row  # to owners, sums broadcast
        mailbox = 2 * tp * (m / tp) * row + 2 * m * row
    contribution = m * row * (top_k + 1) if variant == "finalize" else m * row
    hbm = contribution + mailbox + 2 * m * hc * row + m * row        # residual in and out, layer input
    if variant == "quant":
        hbm += m * hidden + m * hidden // 32
    return nvlink, hbm


def floor_us(protocol: str, variant: str, tp: int, m: int, hidden: int, ceilings: Ceilings) -> float:
    nvlink, hbm = fused_bytes(protocol, variant, tp, m, hidden)
    return max(nvlink / (ceilings.peer_gbps * 1e3), hbm / (ceilings.hbm_gbps * 1e3))


# -- timing ------------------------------------------------------------------------------------------
def time_graph(fn, calls: int, replays: int) -> list[float]:
    """Per-replay microseconds per call, each the max over ranks."""
    import torch.distributed as dist

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    samples = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        us = torch.tensor(start.elapsed_time(end) * 1e3 / calls, device="cuda")
        dist.all_reduce(us, op=dist.ReduceOp.MAX)
        samples.append(us.item())
    del graph
    return samples


def measure_ceilings(group, device, nbytes: int = 1 << 28) -> Ceilings:
    """Peer-store bandwidth into the next rank's symmetric buffer, and device copy bandwidth."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    local = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    target = symm_mem.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(target, group)
    peer = handle.get_remote_tensor((rank + 1) % tp, target.shape, target.dtype)
    dst = torch.empty_like(local)
    peer_us = statistics.median(time_graph(lambda: peer.copy_(local), 5, 5))
    hbm_us = statistics.median(time_graph(lambda: dst.copy_(local), 5, 5))
    return Ceilings(peer_gbps=nbytes / peer_us / 1e3, hbm_gbps=2 * nbytes / hbm_us / 1e3)


# -- unfused paths -----------------------------------------------------------------------------------
def mhc_tail(reduced, residual, post, comb, pre, weight, eps: float):
    """The mHC post-mix, collapse and RMSNorm as a careful engine writes them for torch.compile: fp32
    math, bf16 at the boundaries, the hc x hc mix unrolled into broadcasts (a [M, hc, hc, H]
    intermediate reduced over a middle axis compiles into a slow reduction kernel)."""
    hc = residual.shape[1]
    streams = residual.float()
    mixed = reduced.float().unsqueeze(1) * post.unsqueeze(-1)
    for j in range(hc):  # stream j feeds every output stream i with comb[:, j, i]
        mixed = mixed + streams[:, j].unsqueeze(1) * comb[:, j].unsqueeze(-1)
    residual_out = mixed.to(torch.bfloat16)
    collapsed = residual_out[:, 0].float() * pre[:, 0:1]
    for i in range(1, hc):
        collapsed = collapsed + residual_out[:, i].float() * pre[:, i:i + 1]
    prenorm = collapsed.to(torch.bfloat16).float()
    inv = torch.rsqrt(prenorm.square().mean(-1, keepdim=True) + eps)
    return residual_out, (prenorm * inv * weight.float()).to(torch.bfloat16)


def moe_finalize(gemm2, weights, indices, shared):
    """top-k weighted sum of the permuted GEMM2 rows (-1: not held here) plus the shared expert."""
    held = indices >= 0
    rows = gemm2[indices.clamp(min=0).long()].float()
    return ((rows * (weights * held).unsqueeze(-1)).sum(1) + shared.float()).to(torch.bfloat16)


def mxfp8_tail(layer_input):
    from .mxfp8 import mxfp8_quantize_reference
    return mxfp8_quantize_reference(layer_input)


# -- the Lamport all-reduce floor ---------------------------------------------------------------------
class LamportFloor:
    """The simplest one-kernel Lamport all-reduce over peer stores (no mHC, no norm): each program
    stores its slice of the row to every rank, polls its own mailbox until every rank's slice landed,
    sums in rank order and re-arms. The latency any LL design pays."""

    def __init__(self, group, device, capacity: int, hidden: int):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        from . import layout

        self.tp, self.rank, self.hidden = dist.get_world_size(group), dist.get_rank(group), hidden
        self.capacity = capacity
        buffer = symm_mem.empty((layout.GENERATIONS, self.tp, capacity, hidden), dtype=torch.bfloat16,
                                device=device)
        buffer.view(torch.int16).fill_(layout.SENTINEL_INT16)
        handle = symm_mem.rendezvous(buffer, group)
        self.buffer, self.handle = buffer, handle
        self.peers = torch.tensor([handle.get_remote_tensor(p, buffer.shape, buffer.dtype).data_ptr()
                                   for p in range(self.tp)], dtype=torch.int64, device=device)
        self.state = torch.zeros(2, dtype=torch.int32, device=device)
        torch.cuda.synchronize()
        dist.barrier(group=group)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        from kernels_triton.floor import lamport_floor_kernel

        m = x.shape[0]
        block = min(self.hidden & -self.hidden, 1024)
        lamport_floor_kernel[(m, self.hidden // block)](
            x.view(torch.int16), out.view(torch.int16), self.buffer.view(torch.int16), self.peers, self.state,
            self.capacity, HIDDEN=self.hidden, TP=self.tp, RANK=self.rank, BLOCK=block, num_warps=4)


# -- the sweep ---------------------------------------------------------------------------------------
FLOOR_MAX_ROWS = 512  # one kernel that both publishes and polls relies on in-order block dispatch


class Sweep:
    """Builds every path once per hidden size, then times them over the rows."""

    def __init__(self, args, group, device):
        import torch.distributed as dist

        self.args, self.group, self.device = args, group, device
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.rows: list[dict] = []
        self.notes: list[dict] = []  # {"hidden": int | None, "text": str}
        self.tail = torch.compile(mhc_tail, dynamic=True) if args.compile_tail else mhc_tail
        self.finalize = torch.compile(moe_finalize, dynamic=True) if args.compile_tail else moe_finalize
        self.quantize = torch.compile(mxfp8_tail, dynamic=True) if args.compile_tail else mxfp8_tail

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def record(self, hidden, variant, m, path, samples, floor=None):
        median = statistics.median(samples)
        self.rows.append(dict(tp=self.tp, hidden=hidden, variant=variant, m=m, path=path, us_median=median,
                              us_min=min(samples), us_max=max(samples), floor_us=floor,
                              ratio_to_floor=None if floor is None else median / floor, speedup_vs_unfused=None))
        self.log(f"tp={self.tp} H={hidden} {variant:8s} M={m:5d} {path:20s} {median:9.1f} us"
                 + ("" if floor is None else f"  ({median / floor:5.2f}x floor)"))

    def note(self, hidden: int, text: str) -> None:
        self.notes.append({"hidden": hidden, "text": text})

    def guarded(self, hidden, label, fn):
        """Time one path; a path that fails here is reported, not fatal for the others."""
        try:
            return fn()
        except Exception as error:  # noqa: BLE001 - reported in the summary
            text = f"{label}: {type(error).__name__}: {error}"
            self.note(hidden, text)
            self.log("FAILED " + text)
            return None

    def run_hidden(self, hidden: int, ceilings: Ceilings) -> None:
        from . import AllReduceMHC, AllReduceMHCConfig, mxfp8_scale_bytes

        args, capacity = self.args, max(self.args.rows)
        quantize = "quant" in args.variants
        build = dict(quantize_layer_input=quantize)
        fused = {}
        if self.wanted("auto"):
            fused["auto"] = AllReduceMHC(hidden, HC, capacity, args.top_k, self.device, **build)
            self.note(hidden, f"auto at H={hidden} runs {fused['auto'].backend}")
        for backend in args.backends:
            for protocol, threshold in (("ll", capacity + 1), ("bt", 1)):
                if not self.wanted(f"{backend}-{protocol}"):
                    continue
                config = AllReduceMHCConfig(backend=backend, bt_min_rows=threshold, bt_min_finalize_rows=threshold)
                op = self.guarded(hidden, f"build {backend}-{protocol} H={hidden}",
                                  lambda c=config: AllReduceMHC(hidden, HC, capacity, args.top_k, self.device,
                                                                **build, config=c))
                if op is not None:
                    fused[f"{backend}-{protocol}"] = op
        floor = LamportFloor(self.group, self.device, min(capacity, FLOOR_MAX_ROWS), hidden)
        symmetric = self._symmetric_input(capacity, hidden)

        for variant in args.variants:
            for m in sorted(args.rows):
                inputs = random_inputs(self.tp, m, hidden, HC, seed=m, top_k=args.top_k if variant == "finalize"
                                       else 0, zero_row=False, device=self.device)
                x = inputs["xs"][self.rank]
                consumer = (inputs["residual"], inputs["post"], inputs["comb"], inputs["pre"], inputs["norm_weight"],
                            1e-6)
                mxfp8 = None
                if variant == "quant":
                    mxfp8 = (torch.empty((m, hidden), dtype=torch.float8_e4m3fn, device=self.device),
                             torch.empty(mxfp8_scale_bytes(m, hidden), dtype=torch.uint8, device=self.device))
                for path, op in fused.items():
                    if variant == "finalize":
                        args_f = (inputs["gemm2s"][self.rank], inputs["weights"][self.rank],
                                  inputs["idxs"][self.rank], inputs["shareds"][self.rank])
                        call = (lambda op=op, a=args_f: op.finalize(*a, *consumer))
                    else:
                        call = (lambda op=op: op(x, *consumer, mxfp8_out=mxfp8))
                    protocol = op.protocol(m, variant == "finalize")
                    samples = self.guarded(hidden, f"{path} {variant} H={hidden} M={m}",
                                           lambda c=call: time_graph(c, args.calls, args.replays))
                    if samples:
                        self.record(hidden, variant, m, path, samples,
                                    floor_us(protocol, variant, self.tp, m, hidden, ceilings))
                self._unfused(hidden, variant, m, inputs, x, consumer, symmetric)
                if variant == "plain" and m <= FLOOR_MAX_ROWS and self.wanted("lamport-ar-floor"):
                    out = torch.empty_like(x)
                    samples = self.guarded(hidden, f"lamport-ar-floor H={hidden} M={m}",
                                           lambda: time_graph(lambda: floor(x, out), args.calls, args.replays))
                    if samples:
                        self.record(hidden, variant, m, "lamport-ar-floor", samples,
                                    floor_us("ll", variant, self.tp, m, hidden, ceilings))

    def _symmetric_input(self, capacity, hidden):
        import torch.distributed._symmetric_memory as symm_mem

        buffer = symm_mem.empty((capacity, hidden), dtype=torch.bfloat16, device=self.device)
        symm_mem.rendezvous(buffer, self.group)
        return buffer

    def _unfused(self, hidden, variant, m, inputs, x, consumer, symmetric):
        import torch.distributed as dist

        args, group_name = self.args, self.group.group_name
        reduced = torch.empty_like(x)
        staged = symmetric[:m]

        def contribution():
            if variant == "finalize":
                r = self.rank
                return self.finalize(inputs["gemm2s"][r], inputs["weights"][r], inputs["idxs"][r],
                                     inputs["shareds"][r])
            return x

        def tail(values):
            residual_out, layer_input = self.tail(values, *consumer)
            if variant == "quant":
                self.quantize(layer_input)

        def nccl():
            reduced.copy_(contribution())
            dist.all_reduce(reduced, group=self.group)
            return reduced

        def one_shot():
            staged.copy_(contribution())
            return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group_name)

        paths = {"unfused-nccl": lambda: tail(nccl()), "unfused-one-shot": lambda: tail(one_shot())}
        if variant == "plain":
            paths.update({"nccl_all_reduce": nccl, "one_shot_all_reduce": one_shot})
        for path, fn in paths.items():
            if not self.wanted(path):
                continue
            samples = self.guarded(hidden, f"{path} {variant} H={hidden} M={m}",
                                   lambda f=fn: time_graph(f, args.calls, args.replays))
            if samples:
                self.record(hidden, variant, m, path, samples)
        if variant == "plain" and self.wanted("unfused-nccl"):  # the tail alone, for its achieved HBM bandwidth
            samples = self.guarded(hidden, f"tail H={hidden} M={m}",
                                   lambda: time_graph(lambda: tail(x), args.calls, args.replays))
            if samples:
                row = hidden * 2
                gbps = (m * row + 2 * m * HC * row + m * row) / statistics.median(samples) / 1e3
                self.note(hidden, f"torch tail alone H={hidden} M={m}: {statistics.median(samples):.1f} us, "
                          f"{gbps:.0f} GB/s of HBM traffic")

    def wanted(self, path: str) -> bool:
        return self.args.paths is None or path in self.args.paths

    def finish(self, out: Path, gpu: str, ceilings: Ceilings) -> None:
        if self.rank == 0:
            write_results(self.rows, self.notes, out, gpu, self.tp, ceilings, self.args, self.args.merge)


def read_rows(path) -> list[dict]:
    """The rows of a bench CSV with the types the sweep records (empty cells: None)."""
    def convert(key, value):
        if value == "":
            return None
        return int(value) if key in INT_COLUMNS else float(value) if key in FLOAT_COLUMNS else value
    with open(path, newline="") as f:
        return [{k: convert(k, v) for k, v in row.items()} for row in csv.DictReader(f)]


def notes_path(csv_path) -> Path:
    csv_path = Path(csv_path)
    return csv_path.with_name(f"{csv_path.stem}_notes.json")


def _row_key(row: dict) -> tuple:
    return row["tp"], row["hidden"], row["variant"], row["m"], row["path"]


def _note_key(note: dict) -> tuple:
    """What a note is about: its hidden size and the text before its first colon."""
    return note["hidden"], note["text"].split(":", 1)[0]


def write_results(rows, notes, out: Path, gpu: str, tp: int, ceilings: Ceilings, args, merge=None) -> None:
    """CSV, notes sidecar, plots and summary; with ``merge``, the earlier run's rows and notes are kept
    except those this run measured again (same hidden, variant, M and path; same note subject). Every
    row's speedup is taken against the unfused NCCL row of its shape, whichever run measured it."""
    notes = [{"hidden": h, "text": f"ceilings for H={h}: peer {ceilings.peer_gbps:.0f} GB/s, device copy "
                                   f"{ceilings.hbm_gbps:.0f} GB/s"} for h in args.hidden] + list(notes)
    if merge:
        measured = {_row_key(r) for r in rows}
        rows = [r for r in read_rows(merge) if _row_key(r) not in measured] + list(rows)
        old_notes = notes_path(merge)
        if old_notes.exists():
            subjects = {_note_key(n) for n in notes}
            notes = [n for n in json.loads(old_notes.read_text()) if _note_key(n) not in subjects] + notes
    unfused = {_row_key(r)[:4]: r["us_median"] for r in rows if r["path"] == "unfused-nccl"}
    for r in rows:
        base = unfused.get(_row_key(r)[:4])
        r["speedup_vs_unfused"] = None if base is None else base / r["us_median"]
    rows = sorted(rows, key=lambda r: (r["hidden"], r["variant"], r["m"], r["path"]))
    notes = sorted(notes, key=lambda n: (n["hidden"] is not None, n["hidden"] or 0))  # stable within a size
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{gpu}_tp{tp}"
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.3f}" if isinstance(v, float) else ("" if v is None else v))
                             for k, v in r.items()})
    notes_path(out / f"{stem}.csv").write_text(json.dumps(notes, indent=1) + "\n")
    plots = write_plots(rows, out, stem)
    write_summary(rows, notes, out / f"{stem}.md", gpu, tp, ceilings, args, plots, merged=bool(merge))
    print(f"wrote {out / stem}.csv, .md, _notes.json and {len(plots)} plots", flush=True)


def write_plots(rows: list[dict], out: Path, stem: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = []
    for hidden, variant in sorted({(r["hidden"], r["variant"]) for r in rows}):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        subset = [r for r in rows if r["hidden"] == hidden and r["variant"] == variant]
        for path in sorted({r["path"] for r in subset}):
            points = sorted((r["m"], r["us_median"]) for r in subset if r["path"] == path)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=path)
        ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="us per call (median, max over ranks)",
               title=f"{stem} H={hidden} {variant}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        name = f"{stem}_h{hidden}_{variant}.png"
        fig.savefig(out / name, dpi=120, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def write_summary(rows, notes, path: Path, gpu: str, tp: int, ceilings: Ceilings, args, plots,
                  merged: bool = False) -> None:
    source = ("of the latest run (each hidden size's own in the notes)" if merged
              else "measured in the same run")
    lines = [f"# {gpu}, tp={tp}", "",
             f"CUDA graphs of {args.calls} calls, median of {args.replays} replays, max over ranks. Ceilings "
             f"{source}: peer copy {ceilings.peer_gbps:.0f} GB/s, device copy {ceilings.hbm_gbps:.0f} GB/s.", "",
             "| H | variant | M | fastest fused | us | auto us | unfused-nccl us | speedup | x floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    fused_paths = lambda r: r["path"] not in ("unfused-nccl", "unfused-one-shot", "nccl_all_reduce",  # noqa: E731
                                              "one_shot_all_reduce", "lamport-ar-floor", "auto")
    for key in sorted({(r["hidden"], r["variant"], r["m"]) for r in rows}):
        group = [r for r in rows if (r["hidden"], r["variant"], r["m"]) == key]
        fused = [r for r in group if fused_paths(r)]
        if not fused:
            continue
        best = min(fused, key=lambda r: r["us_median"])
        base = next((r["us_median"] for r in group if r["path"] == "unfused-nccl"), math.nan)
        auto = next((r["us_median"] for r in group if r["path"] == "auto"), math.nan)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {best['path']} | {best['us_median']:.1f} | {auto:.1f} | "
                     f"{base:.1f} | "
                     f"{base / best['us_median']:.2f} | {best['ratio_to_floor'] or math.nan:.2f} |")
    lines += ["", "Plots: " + (", ".join(plots) or "none (matplotlib missing)"), ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n['text']}" for n in notes]
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="lamport_mhc bench", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120, 7168])
    parser.add_argument("--rows", type=int, nargs="+", default=DEFAULT_ROWS)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--backends", nargs="+", choices=FUSED_BACKENDS, default=list(FUSED_BACKENDS),
                        help="fused backends timed per protocol")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--no-compile-tail", dest="compile_tail", action="store_false")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--paths", nargs="+", default=None, choices=PATHS,
                        help="time only these paths (default: all); with --merge, the others keep their rows")
    parser.add_argument("--merge", metavar="CSV", default=None,
                        help="an earlier run's CSV: its rows (and notes) for hidden sizes not in --hidden are kept")
    args = parser.parse_args(argv)
    if args.calls < 50 or args.replays < 5:
        parser.error("--calls must be >= 50 and --replays >= 5")
    return args


def main(argv=None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run one process per GPU: torchrun --nproc-per-node N -m lamport_mhc bench ...")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    sweep = Sweep(args, group, device)
    ceilings = measure_ceilings(group, device)
    sweep.log(f"ceilings: peer {ceilings.peer_gbps:.0f} GB/s, device copy {ceilings.hbm_gbps:.0f} GB/s")
    for hidden in args.hidden:
        sweep.run_hidden(hidden, ceilings)
    gpu = torch.cuda.get_device_name(device).replace("NVIDIA ", "").replace(" ", "-").lower()
    sweep.finish(Path(args.out), gpu, ceilings)
    dist.destroy_process_group()
    return 0
