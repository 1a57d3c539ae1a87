"""One GPU, for Nsight Compute: one eager call of each named Triton local form and strong-tail form at
given rows, each inside its own profiler range, so that ``ncu --profile-from-start off`` profiles
exactly those calls. Each profiled call follows ``--calls-before`` calls of the same kernel on the
same inputs, which leave L2 as the benchmark's CUDA graphs do (warm: profile with ``--cache-control
none``; ncu's default flushes L2 before each kernel, which measures a cold call instead).

    ncu --clock-control none --profile-from-start off --set full -o cold \\
        python bench/profile_forms.py --rows 5120:quant:1024 4096:plain:128 --fused auto,wide-hinted --strong looped
    ncu --clock-control none --profile-from-start off --cache-control none --replay-mode application \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \\
        python bench/profile_forms.py --rows ...          (warm, every pass a run of its own: see below)

Under ncu's default kernel replay a profile of several passes is not warm: each further pass runs
over the L2 that the pass before and ncu's memory restore left. These four metrics took three passes
on one H100, and at H 4096 M = 512 both tails read 21.05 MB from DRAM, every byte of x and the
streams, as a cold call does; with nine metrics, every input byte was read from DRAM under
``--cache-control none`` as under ``all`` (H 5120 plain M = 100: 5.15 MB). ``--replay-mode
application`` makes every pass a run of its own, the profiled call after its ``--calls-before``
calls: the same four metrics on the same H100 then read 14.0-18.9 MB at H 4096 M = 512 (plain and
quant, fused wide and strong looped; L2 hit rates 58-66%).

It prints the profiled calls in order (ncu's IDs), each fused form with the kernel it launched.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamport_mhc.bench.local_forms import parse_fused, parse_strong, row_parser  # noqa: E402

parse_row = row_parser(("plain", "quant"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=parse_row, nargs="+", required=True, help="HIDDEN:VARIANT:M ...")
    parser.add_argument("--fused", type=parse_fused, default=["auto"], help="fused forms, comma-separated")
    parser.add_argument("--strong", type=parse_strong, default=["looped"], help="strong tail forms, comma-separated")
    parser.add_argument("--calls-before", type=int, default=4, help="calls of the same kernel before the profiled one")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from lamport_mhc.bench.local_forms import HC, FormForcer, force_label, kernel_launched, probe_op, row_inputs
    from lamport_mhc.bench.strong_tail import StrongTail

    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29513").items():
        os.environ.setdefault(key, value)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)

    def profiled(fn):
        for _ in range(args.calls_before):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()

    ops, order = {}, []
    for hidden, variant, m in args.rows:
        if hidden not in ops:
            ops[hidden] = probe_op(hidden, args.rows, device)
        op = ops[hidden]
        kernels = op.path.kernels["triton"]
        forcer = FormForcer(kernels)
        x, consumer, mxfp8, _ = row_inputs(hidden, variant, m, device)
        for form in args.fused:
            force_label(forcer, form)
            _, kernel = kernel_launched(kernels, lambda: profiled(lambda: op(x, *consumer, mxfp8_out=mxfp8)))
            order.append(f"H={hidden} {variant} M={m} fused {form}: {kernel}")
        forcer.reset()
        residual_out, layer_input = torch.empty_like(consumer[0]), torch.empty_like(x)
        for strategy in args.strong:
            tail = StrongTail(hidden, HC, quantize=variant == "quant", strategy=strategy)
            profiled(lambda: tail(x, *consumer, residual_out, layer_input, mxfp8))
            order.append(f"H={hidden} {variant} M={m} strong {strategy}")
    for index, line in enumerate(order):
        print(f"[{index}] {line}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
