"""Latency of the fused op against NCCL all-reduce + the same math in torch ops, inside CUDA graphs.

    torchrun --nproc-per-node 2 bench/bench_fused.py --hidden 5120 --rows 1 16 128 1024 4096

Each path runs ``--calls`` times in one graph; a replay's time / calls is one sample; the max over
ranks of each replay is taken, then the median over ``--replays``. Results: one CSV row per path.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys

import torch
import torch.distributed as dist

from lamport_mhc import AllReduceMHC, AllReduceMHCConfig
from lamport_mhc.testing import random_inputs

HC = 4


def torch_tail(reduced, residual, post, comb, pre, weight, eps):
    """The unfused mHC post-mix, collapse and RMSNorm as broadcasts in fp32 (bf16 boundaries kept)."""
    mixed = reduced.float().unsqueeze(1) * post.unsqueeze(-1) + (
        residual.float().unsqueeze(2) * comb.unsqueeze(-1)).sum(1)
    residual_out = mixed.to(torch.bfloat16)
    prenorm = (residual_out.float() * pre.unsqueeze(-1)).sum(1).to(torch.bfloat16).float()
    inv = torch.rsqrt(prenorm.square().mean(-1, keepdim=True) + eps)
    return residual_out, (prenorm * inv * weight.float()).to(torch.bfloat16)


def time_graph(fn, calls: int, replays: int) -> float:
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
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128, 1024, 4096])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--replays", type=int, default=7)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--skip-nccl", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    tp, rank = dist.get_world_size(), dist.get_rank()
    op = AllReduceMHC(args.hidden, HC, max(args.rows), 1, torch.device("cuda", local_rank),
                      config=AllReduceMHCConfig(backend=args.backend))
    rows = []
    for m in args.rows:
        inputs = random_inputs(tp, m, args.hidden, HC, seed=m, device="cuda")
        x = inputs["xs"][rank]
        consumer = (inputs["residual"], inputs["post"], inputs["comb"], inputs["pre"], inputs["norm_weight"], 1e-6)
        fused = time_graph(lambda: op(x, *consumer), args.calls, args.replays)
        rows.append(dict(tp=tp, hidden=args.hidden, m=m, path=f"{op.backend}-{op.protocol(m)}", us=fused))
        if rank == 0:
            print(f"M={m:5d} {op.backend}-{op.protocol(m)}: {fused:8.1f} us", flush=True)
        if not args.skip_nccl:
            buffer = x.clone()

            def unfused():
                buffer.copy_(x)
                dist.all_reduce(buffer)
                torch_tail(buffer, *consumer)

            baseline = time_graph(unfused, args.calls, args.replays)
            rows.append(dict(tp=tp, hidden=args.hidden, m=m, path="unfused-nccl", us=baseline))
            if rank == 0:
                print(f"M={m:5d} unfused-nccl: {baseline:8.1f} us  (fused speedup {baseline / fused:.2f}x)", flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
