"""One GPU, a few minutes: every Triton local form (``lamport_mhc.bench.local_forms``), hinted and
not, against the strong tail's forms at the same rows, in one run; the data behind the windows of
``kernels_triton.backend`` (``LOCAL_X_*_ROWS_PER_SM``).

    torchrun --nproc-per-node 1 bench/local_forms.py --rows 4096:plain:128 7168:quant:256 [--rounds 2]
        [--fused auto,wide,wide-hinted] [--strong looped,looped-streamed,wide-streamed]
        [--strong-allocates] [--no-pdl] [--cold] [--special-values] [--out forms.json]

Each row prints every form's median us (50 calls a CUDA graph, 5 replays, the row's graphs replayed
in turns, each after an untimed replay of its own; a form the plan lacks is the form the call would
take, listed once) and the fastest of each side. Exits 1 when two forms' outputs differ in a bit:
every form gives the contract's bits. Two switches isolate what differs between the sides' graphs,
each compared with a run without it:
- ``--no-pdl`` launches both sides' kernels plainly: the graph's calls then run one after another,
  none overlapping the call before (what the overlap gives each side);
- ``--strong-allocates`` has every call of the strong tail allocate its outputs, from the graph's
  pool as the fused op's calls do, where they otherwise go to buffers allocated once (what the
  outputs' addresses give each side).
A third, ``--cold``, times both sides with the graph's calls reading copies of the row's inputs in
turn (``ColdRows``: three times the L2 in all), each from HBM, and allocating their outputs: what
the L2 gives each side, where the calls otherwise read the same inputs, from L2 once the row fits.
The rows' values are finite, as a model's are; ``--special-values`` draws them with the tests' edge
cases instead, whose sums of squares overflow in every row: what the exact norm's slow paths (IEEE
division and square root) cost the fused forms, where the strong tail's approximate rsqrt has none.
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

from lamport_mhc.bench.local_forms import (  # noqa: E402
    FORMS, HC, TOP_K, ColdRows, FormForcer, force_label, kernel_launched, parse_fused, parse_strong, probe_op,
    row_inputs, row_parser)
from lamport_mhc.bench.strong_tail import StrongFinalize, StrongTail  # noqa: E402
from lamport_mhc.bench.timing import GraphTimer  # noqa: E402

CALLS, REPLAYS = 50, 5
EVERY_FUSED_FORM = ",".join(["auto", *(form + hints for form in FORMS for hints in ("", "-hinted"))])


def digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def measure_row(op, forcer, hidden, variant, m, fused_forms, strong_forms, device, pdl=True,
                strong_allocates=False, cold=False, specials=False) -> dict:
    def draw():
        return row_inputs(hidden, variant, m, device, specials=specials)

    inputs = draw()
    x, consumer, _, _ = inputs
    kernels, row = forcer.kernels, dict(hidden=hidden, variant=variant, m=m, fused={}, kernel={}, strong={})
    copies = None
    if cold:
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        copies = ColdRows(inputs, ColdRows.cold_count(ColdRows.row_bytes(inputs), l2_bytes, CALLS), draw)
        row["copies"] = len(copies.rows)

    def next_inputs():
        return inputs if copies is None else copies.next()

    def fused():
        x, consumer, mxfp8, finalize = next_inputs()
        if finalize is not None:
            return op.finalize(*finalize, *consumer), mxfp8
        return op(x, *consumer, mxfp8_out=mxfp8), mxfp8

    hashes, timer, samples = set(), GraphTimer(CALLS, REPLAYS), {}
    for label in fused_forms:
        force_label(forcer, label)
        (outputs, mxfp8), kernel = kernel_launched(kernels, fused)
        hashes.add(digest([*outputs, *(mxfp8 or ())]))
        if label != "auto" and kernel in row["kernel"].values():
            continue  # the plan lacks the form: the call took one already timed
        row["kernel"][label] = kernel
        samples[("fused", label)] = timer.add(fused)  # the graph keeps the form forced now
    forcer.reset()
    residual_out, layer_input = torch.empty_like(consumer[0]), torch.empty_like(x)
    contribution = torch.empty_like(x)
    strong_finalize = StrongFinalize(hidden, TOP_K, pdl=pdl)
    for strategy in strong_forms:
        tail = StrongTail(hidden, HC, quantize=variant == "quant", strategy=strategy, pdl=pdl)

        def unfused(tail=tail):
            # Allocating, a call takes its buffers from the graph's pool, as the fused op's calls do.
            new = torch.empty_like if strong_allocates or cold else (lambda buffer: buffer)
            x, consumer, mxfp8, finalize = next_inputs()
            reduced = x if finalize is None else strong_finalize(*finalize, new(contribution))
            outputs = new(residual_out), new(layer_input)
            tail(reduced, *consumer, *outputs, mxfp8)
            return outputs
        samples[("strong", strategy)] = timer.add(unfused)
    timer.replay()
    for (side, label), times in samples.items():
        row[side][label] = statistics.median(times)
    row["same_bits"] = len(hashes) == 1
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=row_parser(("plain", "quant", "finalize")), nargs="+", required=True,
                        help="HIDDEN:VARIANT:M ...")
    parser.add_argument("--rounds", type=int, default=2, help="times every row is measured (in turn)")
    parser.add_argument("--fused", type=parse_fused, default=EVERY_FUSED_FORM,
                        help="the fused forms (auto, lamport_mhc.bench.local_forms.FORMS, each also -hinted); "
                             "default: all")
    parser.add_argument("--strong", type=parse_strong, default="looped,looped-streamed,wide-streamed",
                        help="the strong tail's forms (lamport_mhc.bench.strong_tail.STRATEGIES)")
    parser.add_argument("--strong-allocates", action="store_true",
                        help="the strong tail's outputs allocated by every call, as the fused op's are "
                             "(default: written into buffers allocated once)")
    parser.add_argument("--no-pdl", action="store_true", help="plain launches on both sides, no PDL")
    parser.add_argument("--cold", action="store_true",
                        help="the calls read copies of the row's inputs in turn (three times the L2 in all), "
                             "each from HBM, and both sides allocate their outputs (default: every call reads "
                             "the same inputs)")
    parser.add_argument("--special-values", action="store_true",
                        help="rows drawn with the tests' special values (testing.random_inputs), whose sums of "
                             "squares overflow: what the exact norm's slow paths cost (default: finite values)")
    parser.add_argument("--out", type=Path, help="every measurement as JSON")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    ops, forcers = {}, {}
    for hidden in sorted({h for h, _, _ in args.rows}):
        ops[hidden] = probe_op(hidden, args.rows, device, use_pdl=not args.no_pdl)
        forcers[hidden] = FormForcer(ops[hidden].path.kernels["triton"])
    results, ok = [], True
    for turn in range(args.rounds):
        for hidden, variant, m in args.rows:
            row = measure_row(ops[hidden], forcers[hidden], hidden, variant, m, args.fused, args.strong, device,
                              pdl=not args.no_pdl, strong_allocates=args.strong_allocates, cold=args.cold,
                              specials=args.special_values)
            row["round"], row["pdl"], row["strong_allocates"] = turn, not args.no_pdl, args.strong_allocates
            row["cold"], row["special_values"] = args.cold, args.special_values
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
