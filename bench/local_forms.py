"""One GPU, a few minutes: every Triton local form (``lamport_mhc.bench.local_forms``), hinted and
not, against the strong tail's forms at the same rows, in one run; the data behind the windows of
``kernels_triton.backend`` (``LOCAL_X_*_ROWS_PER_SM``).

    torchrun --nproc-per-node 1 bench/local_forms.py --rows 4096:plain:128 7168:quant:256 [--rounds 2]
        [--strong looped,looped-streamed,wide-streamed] [--no-pdl] [--out forms.json]

Each row prints every form's median us (50 calls a CUDA graph, 5 replays; a form the plan lacks is
the form the call would take, listed once) and the fastest of each side. Exits 1 when two forms'
outputs differ in a bit: every form gives the contract's bits. ``--no-pdl`` launches both sides'
kernels plainly: the graph's calls then run one after another, none overlapping the call before
(compared with a run with PDL, what the overlap gives each side).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lamport_mhc import AllReduceMHC, AllReduceMHCConfig  # noqa: E402
from lamport_mhc.bench.local_forms import FORMS, FormForcer, row_inputs  # noqa: E402
from lamport_mhc.bench.strong_tail import StrongFinalize, StrongTail  # noqa: E402
from lamport_mhc.bench.timing import time_graph  # noqa: E402

EPS, HC, TOP_K, CALLS, REPLAYS = 1e-6, 4, 6, 50, 5


def parse_row(text: str) -> tuple[int, str, int]:
    hidden, variant, m = text.split(":")
    if variant not in ("plain", "quant", "finalize"):
        raise argparse.ArgumentTypeError(f"variant must be plain, quant or finalize, got {variant!r}")
    return int(hidden), variant, int(m)


def digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def measure_row(op, forcer, hidden, variant, m, strong_forms, device, pdl=True) -> dict:
    x, consumer, mxfp8, finalize = row_inputs(hidden, variant, m, device, HC, TOP_K, EPS)

    def fused():
        if finalize is not None:
            return op.finalize(*finalize, *consumer)
        return op(x, *consumer, mxfp8_out=mxfp8)

    kernels, row = forcer.kernels, dict(hidden=hidden, variant=variant, m=m, fused={}, kernel={}, strong={})
    hashes = set()
    for form in [None, *FORMS]:
        for hinted in (None,) if form is None else (False, True):
            if form is None:
                forcer.reset()
            else:
                forcer.force(form, hinted)
            launched = []
            kernels.on_launch = lambda name, programs: launched.append(name)
            outputs = fused()
            kernels.on_launch = None
            hashes.add(digest([*outputs, *(mxfp8 or ())]))
            label = "auto" if form is None else form + ("-hinted" if hinted else "")
            if form is not None and launched[-1] in row["kernel"].values():
                continue  # the plan lacks the form: the call took one already timed
            row["kernel"][label] = launched[-1]
            row["fused"][label] = statistics.median(time_graph(fused, CALLS, REPLAYS))
    forcer.reset()
    residual_out, layer_input = torch.empty_like(consumer[0]), torch.empty_like(x)
    contribution = torch.empty_like(x)
    strong_finalize = StrongFinalize(hidden, TOP_K, pdl=pdl)
    for strategy in strong_forms:
        tail = StrongTail(hidden, HC, quantize=variant == "quant", strategy=strategy, pdl=pdl)

        def unfused(tail=tail):
            reduced = strong_finalize(*finalize, contribution) if finalize is not None else x
            tail(reduced, *consumer, residual_out, layer_input, mxfp8)
        row["strong"][strategy] = statistics.median(time_graph(unfused, CALLS, REPLAYS))
    row["same_bits"] = len(hashes) == 1
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=parse_row, nargs="+", required=True, help="HIDDEN:VARIANT:M ...")
    parser.add_argument("--rounds", type=int, default=2, help="times every row is measured (in turn)")
    parser.add_argument("--strong", default="looped,looped-streamed,wide-streamed",
                        help="the strong tail's forms (lamport_mhc.bench.strong_tail.STRATEGIES)")
    parser.add_argument("--no-pdl", action="store_true", help="plain launches on both sides, no PDL")
    parser.add_argument("--out", type=Path, help="every measurement as JSON")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    ops, forcers = {}, {}
    for hidden in sorted({h for h, _, _ in args.rows}):
        capacity = max(128, *(m for h, _, m in args.rows if h == hidden))
        ops[hidden] = AllReduceMHC(hidden, HC, capacity, TOP_K, device, quantize_layer_input=True,
                                   config=AllReduceMHCConfig(backend="triton", use_pdl=not args.no_pdl))
        forcers[hidden] = FormForcer(ops[hidden].path.kernels["triton"])
    results, ok = [], True
    for turn in range(args.rounds):
        for hidden, variant, m in args.rows:
            row = measure_row(ops[hidden], forcers[hidden], hidden, variant, m, args.strong.split(","), device,
                              pdl=not args.no_pdl)
            row["round"], row["pdl"] = turn, not args.no_pdl
            results.append(row)
            ok &= row["same_bits"]
            fused = min(row["fused"], key=row["fused"].get)
            strong = min(row["strong"], key=row["strong"].get)
            print(f"H={hidden} {variant:8s} M={m:5d} | "
                  + " ".join(f"{k}={v:.2f}" for k, v in row["fused"].items()) + " | "
                  + " ".join(f"{k}={v:.2f}" for k, v in row["strong"].items())
                  + f" | fastest {fused} ({row['kernel'][fused]}) {row['fused'][fused]:.2f}, strong {strong} "
                  f"{row['strong'][strong]:.2f}: {row['strong'][strong] / row['fused'][fused]:.3f}"
                  + ("" if row["same_bits"] else " | FORMS DIFFER IN BITS"), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
