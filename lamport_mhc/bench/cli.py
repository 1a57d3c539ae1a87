"""``python -m lamport_mhc bench``: options, the process group, one sweep per hidden size."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from ..backend import FUSED_BACKENDS
from .names import DEFAULT_ROWS, HC, PATHS, VARIANTS
FLASHINFER_CACHE_ENV = "FLASHINFER_WORKSPACE_BASE"


def parse_args(argv=None):
    from . import __doc__ as doc

    parser = argparse.ArgumentParser(prog="lamport_mhc bench", description=doc.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 5120, 7168])
    parser.add_argument("--rows", type=int, nargs="+", default=DEFAULT_ROWS)
    parser.add_argument("--hc", type=int, default=HC, choices=(1, 2, 4),
                        help="residual streams (the strong tail is written for 1, 2, 4); at 1 (post = comb = pre "
                             "= 1) the op is all-reduce + residual add + RMSNorm and FlashInfer's fused kernels "
                             "are timed beside it")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--backends", nargs="+", choices=FUSED_BACKENDS, default=list(FUSED_BACKENDS),
                        help="fused backends timed per protocol")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--no-compile-tail", dest="compile_tail", action="store_false",
                        help="run the torch tail of unfused-nccl / unfused-one-shot eagerly")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--paths", nargs="+", default=None, choices=PATHS,
                        help="time only these paths (default: all); with --merge, the others keep their rows")
    parser.add_argument("--merge", metavar="CSV", default=None,
                        help="an earlier run's CSV: its rows (and notes) that this run does not measure again "
                             "are kept")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no new M after this many seconds from launch; what was measured is written "
                             "(a wall-clock limit around the run then never loses the results)")
    parser.add_argument("--flashinfer-cache", metavar="DIR", default=None,
                        help=f"where FlashInfer keeps its built JIT modules ({FLASHINFER_CACHE_ENV}): carry the "
                             "folder to the next run to skip the build")
    args = parser.parse_args(argv)
    if args.calls < 50 or args.replays < 5:
        parser.error("--calls must be >= 50 and --replays >= 5")
    if min(args.rows) < 1:
        parser.error("--rows must be positive")
    return args


def main(argv=None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("run one process per GPU: torchrun --nproc-per-node N -m lamport_mhc bench ...")
    if args.flashinfer_cache:  # read when flashinfer is first imported: set before anything imports it
        os.environ[FLASHINFER_CACHE_ENV] = str(Path(args.flashinfer_cache).resolve())

    import torch
    import torch.distributed as dist

    from .floors import measure_ceilings
    from .report import gpu_slug
    from .sweep import Sweep

    from ..launch import join_torchrun_group

    if not torch.cuda.is_available():
        raise SystemExit("the benchmark times GPU kernels: no CUDA GPU is visible here")
    device = join_torchrun_group(allow_shared_gpu=False).device
    group = dist.group.WORLD
    sweep = Sweep(args, group, device)
    if args.time_budget is not None:
        sweep.deadline = started + args.time_budget
    ceilings = measure_ceilings(group, device)
    peer = "none (a group of one)" if ceilings.peer_gbps is None else f"{ceilings.peer_gbps:.0f} GB/s"
    sweep.log(f"ceilings: peer {peer}, device copy {ceilings.hbm_gbps:.0f} GB/s")
    gpu = gpu_slug(torch.cuda.get_device_name(device))
    for hidden in args.hidden:  # written after every hidden size: a run cut short or failing keeps its results
        sweep.measure(hidden, ceilings, Path(args.out), gpu)
    dist.destroy_process_group()
    return 0
