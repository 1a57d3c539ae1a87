"""Command line: ``python -m lamport_mhc {info,demo,ptx}``."""

from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    import torch

    from . import presets
    from .backend import BuildSpec
    from .machine import describe, probe
    from .selector import support_table

    info = probe()
    for line in describe(info):
        print(line)
    device = torch.device("cuda", 0) if info.gpus else torch.device("cpu")
    spec = BuildSpec(hidden=args.hidden, hc=args.hc, capacity=args.capacity, top_k=args.top_k,
                     tp=max(2, len(info.gpus)), rank=0)
    print(f"backends for tp={spec.tp} H={spec.hidden} hc={spec.hc} on {device}:")
    for name, answer in support_table(spec, device).items():
        print(f"  {name:7s} {'yes' if answer.ok else 'no: ' + answer.reason}")
    print("  torch   yes (unfused: gather + torch ops, any process group)")
    preset = presets.lookup(presets.gpu_family(info.capability), spec.tp, spec.hidden)
    print(f"LL -> BT from {preset.bt_min_rows} rows (finalize {preset.bt_min_finalize_rows}); "
          f"auto prefers {', '.join(preset.backends)}; source: {preset.source}")
    return 0


def _ptx(args) -> int:
    from pathlib import Path

    from .backend import BuildSpec, Support, load_backend

    backend = load_backend(args.backend)
    if isinstance(backend, Support):
        print(f"cannot compile the {args.backend} backend: {backend.reason}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for rank in range(args.tp) if args.all_ranks else (args.rank,):
        spec = BuildSpec(hidden=args.hidden, hc=args.hc, capacity=args.capacity, top_k=args.top_k, tp=args.tp,
                         rank=rank, quantize=args.hidden % 128 == 0, residual_only=True, bt=True,
                         transport=args.transport, use_pdl=not args.no_pdl)
        for name, text in backend.compile_offline(spec, args.arch).items():
            path = out / f"{args.backend}_{name}_{args.transport}_tp{args.tp}_rank{rank}_{args.arch}.ptx"
            path.write_text(text)
            written += 1
            print(path)
    print(f"{written} kernels written to {out}", file=sys.stderr)
    return 0


def _presets(args) -> int:
    from .presets import suggest
    for line in suggest(args.csv, args.family):
        print(line)
    return 0


def _bench(args) -> int:
    from .bench import main as bench_main
    return bench_main(args.rest)


def _demo(args) -> int:
    from .demo import run
    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lamport_mhc", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="GPUs, P2P, multicast, and which backends can run here (and why not)")
    info.add_argument("--hidden", type=int, default=5120)
    info.add_argument("--hc", type=int, default=4)
    info.add_argument("--top-k", type=int, default=6)
    info.add_argument("--capacity", type=int, default=2048)
    info.set_defaults(run=_info)

    demo = commands.add_parser("demo", help="run the op against the CPU reference and print a table "
                                            "(CPU: a simulated TP group; under torchrun: the real collective)")
    demo.add_argument("--tp", type=int, default=2, help="simulated ranks (CPU only)")
    demo.add_argument("--hidden", type=int, default=None, help="default: 256 simulated, 5120 on GPUs")
    demo.add_argument("--hc", type=int, default=4)
    demo.add_argument("--top-k", type=int, default=6)
    demo.add_argument("--capacity", type=int, default=None, help="default: 8 simulated, 1024 on GPUs")
    demo.add_argument("--backend", default="auto")
    demo.set_defaults(run=_demo)

    bench = commands.add_parser("bench", help="latency of every path at every M (under torchrun, one process per "
                                              "GPU); options: python -m lamport_mhc bench --help", add_help=False)
    bench.set_defaults(run=lambda args: _bench(args))

    suggest = commands.add_parser("presets", help="preset rows (LL -> BT thresholds) derived from a bench CSV")
    suggest.add_argument("csv")
    suggest.add_argument("--family", default="hopper", help="GPU family the CSV was measured on")
    suggest.set_defaults(run=_presets)

    ptx = commands.add_parser("ptx", help="compile every kernel of a build offline and write one .ptx per kernel")
    ptx.add_argument("--backend", choices=("triton", "cute"), required=True)
    ptx.add_argument("--arch", default="sm_90a")
    ptx.add_argument("--tp", type=int, required=True)
    ptx.add_argument("--rank", type=int, default=0)
    ptx.add_argument("--all-ranks", action="store_true", help="one file set per rank (RANK is a constexpr)")
    ptx.add_argument("--hidden", type=int, required=True)
    ptx.add_argument("--hc", type=int, required=True)
    ptx.add_argument("--top-k", type=int, required=True)
    ptx.add_argument("--capacity", type=int, required=True)
    ptx.add_argument("--transport", choices=("peer", "multicast"), required=True)
    ptx.add_argument("--no-pdl", action="store_true")
    ptx.add_argument("--out", required=True)
    ptx.set_defaults(run=_ptx)

    args, rest = parser.parse_known_args(argv)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
