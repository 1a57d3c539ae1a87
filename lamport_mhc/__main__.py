"""Command line: ``python -m lamport_mhc {info,demo,model-ab,bench,presets,ptx,soak}``."""

from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    from dataclasses import replace

    import torch

    from . import presets
    from .backend import BuildSpec
    from .machine import describe, probe
    from .selector import Thresholds, mailbox_rows, support_table
    from .workspace import mailbox_bytes, mailbox_shapes

    info = probe()
    for line in describe(info):
        print(line)
    device = torch.device("cuda", 0) if info.gpus else torch.device("cpu")
    spec = BuildSpec(hidden=args.hidden, hc=args.hc, capacity=args.capacity, top_k=args.top_k,
                     tp=args.tp or max(2, len(info.gpus)), rank=0)
    print(f"backends for tp={spec.tp} H={spec.hidden} hc={spec.hc} on {device}:")
    supported = support_table(spec, device)
    for name, answer in supported.items():
        print(f"  {name:7s} {'yes' if answer.ok else 'no: ' + answer.reason}")
    print("  torch   yes (unfused: gather + torch ops, any process group)")
    gpu = presets.gpu_keys(info.capability, info.gpus[0] if info.gpus else None)
    for line in presets.describe(gpu, spec.tp, spec.hidden):
        print(line)
    preset = presets.lookup(gpu, spec.tp, spec.hidden)
    def rows(n):
        return "never" if n >= presets.NEVER else f"{n} rows"
    print(f"LL -> BT from {rows(preset.bt_min_rows)} (finalize {rows(preset.bt_min_finalize_rows)}); "
          f"auto prefers {', '.join(preset.backends)}; source: {preset.source}")
    sized = replace(spec, **mailbox_rows(spec.tp, spec.capacity, Thresholds(preset.bt_min_rows,
                                                                             preset.bt_min_finalize_rows),
                                         args.chunk_rows))
    shapes = ", ".join(f"{name} {list(shape)}" for name, shape in mailbox_shapes(sized).items()) or "none"
    print(f"mailboxes (bf16; calls of more than {sized.chunk_rows} rows go in parts): {shapes}; every "
          f"boundary of the group shares them")
    print(f"mailbox memory per GPU: {mailbox_bytes(sized) / 2**20:.1f} MiB")
    for variant, ranges in preset.routes.items():
        print(f"  auto {variant:8s} " + ", ".join(f"M <= {up_to}: {backend}" for up_to, backend in ranges[:-1])
              + (", " if len(ranges) > 1 else "") + f"beyond: {ranges[-1][1]}")
    if supported["triton"].ok:
        from kernels_triton.backend import describe_windows

        print(describe_windows(gpu[0]))
    buildable = [name for name, answer in supported.items() if answer.ok]
    if info.gpus and buildable and args.build_cost:
        from .build_cost import measure

        built = replace(sized, quantize=spec.hidden % 128 == 0, residual_only=True,
                        ll_one_kernel_rows=min(sized.rows("ll"), torch.cuda.get_device_properties(device)
                                               .multi_processor_count))
        print(f"build cost of one rank (tp={spec.tp} H={spec.hidden}, every kernel compiled or loaded from the "
              f"cache; --no-build-cost skips this):", flush=True)
        for name in buildable:
            try:
                print(measure(built, name, device).line(), flush=True)
            except Exception as error:  # a diagnostic: say what failed, and go on with the next backend
                print(f"  {name:7s} could not be built here: {type(error).__name__}: {error}", flush=True)
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
                         ll_one_kernel_rows=args.capacity,
                         transport=args.transport, use_pdl=not args.no_pdl)
        for name, text in backend.compile_offline(spec, args.arch).items():
            _write_kernel(out / f"{args.backend}_{name}_{args.transport}_tp{args.tp}_rank{rank}_{args.arch}.ptx", text,
                          args)
            written += 1
    if args.strong:
        from .bench.strong_tail import STRATEGIES, StrongTail

        for quantize in (False, True) if args.hidden % 128 == 0 else (False,):
            for strategy in STRATEGIES:
                for name, text in StrongTail(args.hidden, args.hc, quantize, strategy=strategy).compile_offline(
                        args.arch).items():
                    _write_kernel(out / f"{name}_{args.arch}.ptx", text, args)
                    written += 1
    print(f"{written} kernels written to {out}", file=sys.stderr)
    return 0


def _write_kernel(path, ptx: str, args) -> None:
    """Write a kernel's PTX (and with ``--sass`` its SASS) and print what was written."""
    from .bench.sass import assemble, disassemble

    path.write_text(ptx)
    if not args.sass:
        print(path)
        return
    sass, summary = disassemble(assemble(ptx, args.arch))
    path.with_suffix(".sass").write_text(sass)
    print(f"{path}: {summary.line()}")


def _presets(args) -> int:
    from pathlib import Path

    from . import presets

    family = args.family or presets.family_of_csv(args.csv)
    if family is None:
        print(f"cannot tell the GPU family from the name {args.csv!r} (<gpu>_tp<N>.csv): pass --family",
              file=sys.stderr)
        return 2
    if args.write is None:
        for line in presets.suggest(args.csv, family, args.hc):
            print(line)
        return 0
    rows = presets.derive_all(args.csv, family, source=str(Path(args.csv).resolve()), hc=args.hc)
    if not rows:
        print(f"{args.csv} has no fused rows at hc={args.hc}: nothing to write", file=sys.stderr)
        return 2
    target = Path(args.write) if args.write else presets.default_file()
    held = presets.write_file(target, rows)
    for family_, tp, hidden in rows:
        print(f"wrote {family_} tp={tp} H={hidden} from {args.csv}")
    print(f"{target}: {len(held)} rows; auto reads it "
          + ("from this default location" if not args.write else f"with {presets.PRESETS_ENV}={target} or "
             f"AllReduceMHCConfig(presets_file=...)"))
    return 0


def _bench(args) -> int:
    from .bench import main as bench_main
    return bench_main(args.rest)


def _demo(args) -> int:
    from .demo import run
    return run(args)


def _model_ab(args) -> int:
    import os

    from .model import MHCModelConfig
    from .model_ab import distributed_ab, simulated_ab

    distributed = "WORLD_SIZE" in os.environ
    hidden = args.hidden or (5120 if distributed else 256)
    config = MHCModelConfig(hidden_size=hidden, num_layers=args.layers, seed=args.seed, rms_norm_eps=args.eps,
                            max_num_tokens=max(16, args.tokens))
    backends = tuple(args.backends)
    if not distributed:
        result = simulated_ab(config, args.tp, args.tokens, args.seed, backends)
        print(f"simulated TP group: tp={args.tp} H={hidden} hc={config.hc_mult} layers={args.layers} "
              f"M={args.tokens} seed={args.seed}")
    else:
        import torch.distributed as dist

        from .launch import join_torchrun_group

        place = join_torchrun_group()
        try:
            result = distributed_ab(config, args.tokens, args.seed, backends, place.device,
                                    cuda_graph=(False, args.cuda_graph))
        finally:
            dist.destroy_process_group()
        print(place.describe())
    for line in result.report():
        print(line)
    return 1 if result.differences else 0


def _soak(args) -> int:
    import os

    # Before CUDA starts. A first launch that loads its module lazily waits for the GPU to go idle,
    # which it never does while an emulated rank spins: load every module when it is created. And
    # every emulated rank gets a hardware queue of its own (lamport_mhc.concurrent.rank_streams).
    from .concurrent import CONNECTIONS

    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(CONNECTIONS))
    import torch

    from . import soak

    if args.graphs and not torch.cuda.is_available():
        print("--graphs needs a GPU (CUDA graphs)", file=sys.stderr)
        return 2
    turn = soak.GpuTurn(args.gpu_lock) if args.gpu_lock else None
    try:
        return _soak_where(args, soak, turn)
    finally:
        if turn is not None:
            turn.release()


def _soak_where(args, soak, turn) -> int:
    """The soak where this process runs: a torchrun rank, one GPU, or a CPU."""
    import os

    import torch

    if "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != args.tp:
            print(f"--tp {args.tp} but torchrun started {os.environ['WORLD_SIZE']} ranks", file=sys.stderr)
            return 2
        if args.backend == "mixed":
            print("--backend mixed is for the one-GPU group (AllReduceMHC builds triton, cute or auto)",
                  file=sys.stderr)
            return 2
        result = soak.soak_gpus(args.calls, args.backend, args.hidden or 5120, graphs=args.graphs, seed=args.seed,
                                capacity=args.capacity or 1024, spin_timeout_ms=args.spin_timeout_ms)
        import torch.distributed as dist
        report = dist.get_rank() == 0
    elif torch.cuda.is_available():
        if args.backend == "torch":
            print("the one-GPU group runs the fused backends; --backend torch runs under torchrun", file=sys.stderr)
            return 2
        if args.tp < 2:
            print("the one-GPU group emulates tp >= 2 ranks (a group of one has no mailbox to soak)", file=sys.stderr)
            return 2
        result = soak.soak_one_gpu(args.tp, args.calls, args.backend, args.hidden or 5120, graphs=args.graphs,
                                   seed=args.seed, capacity=args.capacity, spin_timeout_ms=args.spin_timeout_ms,
                                   bt_min_rows=args.bt_min_rows, ll_one_kernel_rows=args.one_kernel_rows,
                                   split_rows=args.split_rows, host_gc=args.host_gc, max_lead=args.max_lead,
                                   delayed_share=args.delayed_share, pooled_streams=args.pooled_streams,
                                   chunk_rows=args.chunk_rows, pin_carveout=not args.default_carveout,
                                   before_run=turn.acquire if turn is not None else None)
        report = True
    else:
        if args.backend not in ("triton", "auto"):
            print(f"on a CPU the simulated group interprets the Triton kernels; --backend {args.backend} needs a GPU",
                  file=sys.stderr)
            return 2
        result = soak.soak_simulated(args.tp, args.calls, args.hidden or 256, seed=args.seed,
                                     capacity=args.capacity or 12)
        report = True
    if report:
        for message in result.messages[:20]:
            print(message)
        print(result.summary())
        if args.out:
            soak.append_csv(args.out, result)
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    from . import soak as soak_defaults

    parser = argparse.ArgumentParser(prog="python -m lamport_mhc", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="GPUs, P2P, multicast, and which backends can run here (and why not)")
    info.add_argument("--hidden", type=int, default=5120)
    info.add_argument("--hc", type=int, default=4)
    info.add_argument("--top-k", type=int, default=6)
    info.add_argument("--capacity", type=int, default=2048)
    info.add_argument("--tp", type=int, default=None, help="group size (default: the GPUs here, at least 2)")
    info.add_argument("--chunk-rows", type=int, default=None,
                      help="the most rows one protocol round takes (default: AllReduceMHCConfig's)")
    info.add_argument("--no-build-cost", dest="build_cost", action="store_false",
                      help="skip building one rank with each backend to measure its time and memory")
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

    ab = commands.add_parser("model-ab", help="the small mHC model through two backends on the same weights and "
                                             "tokens; every stream, layer input and logit compared bit for bit "
                                             "(CPU: a simulated TP group; under torchrun: the real collective)")
    ab.add_argument("--backends", nargs=2, default=["torch", "triton"], metavar=("A", "B"))
    ab.add_argument("--tp", type=int, default=2, help="simulated ranks (CPU only)")
    ab.add_argument("--hidden", type=int, default=None, help="default: 256 simulated, 5120 under torchrun")
    ab.add_argument("--layers", type=int, default=2)
    ab.add_argument("--tokens", type=int, default=4)
    ab.add_argument("--seed", type=int, default=0)
    ab.add_argument("--eps", type=float, default=1e-6, help="rms_norm_eps")
    ab.add_argument("--cuda-graph", action="store_true", help="replay side B from a CUDA graph (under torchrun)")
    ab.set_defaults(run=_model_ab)

    bench = commands.add_parser("bench", help="latency of every path at every M (under torchrun, one process per "
                                              "GPU); options: python -m lamport_mhc bench --help", add_help=False)
    bench.set_defaults(run=lambda args: _bench(args))

    suggest = commands.add_parser("presets", help="preset rows (routes, LL -> BT thresholds) derived from a bench "
                                                  "CSV: printed as table rows, or written to a presets file")
    suggest.add_argument("csv")
    suggest.add_argument("--family", default=None,
                         help="the key of its rows: the GPU family the CSV was measured on (default: from its "
                              "name, e.g. h200 -> hopper), or a model (h100) whose rows win over the family's")
    suggest.add_argument("--hc", type=int, default=4, help="the rows of this many residual streams")
    suggest.add_argument("--write", nargs="?", const="", default=None, metavar="PATH",
                         help="write the rows into a presets file (default: ~/.cache/lamport_mhc/presets.json), "
                              "keeping its rows for other keys")
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
    ptx.add_argument("--strong", action="store_true", help="also the benchmark's strong tail in every form "
                     "(lamport_mhc.bench.strong_tail), plain and quant, at the same H and hc: what the fused kernels "
                     "are measured against")
    ptx.add_argument("--sass", action="store_true", help="also assemble each kernel (ptxas, as Triton ships it) and "
                     "write its SASS; print its registers, stack bytes, instructions and loop bodies' instructions")
    ptx.set_defaults(run=_ptx)

    soak = commands.add_parser("soak", help="many calls with skew between the ranks, every output compared bit for bit "
                                            "(one GPU: ranks as streams; torchrun: the real group; CPU: the "
                                            "simulated group in protocol order); exit 1 on any mismatch or timeout")
    soak.add_argument("--tp", type=int, required=True)
    soak.add_argument("--calls", type=int, required=True)
    soak.add_argument("--graphs", action="store_true",
                      help="most calls from CUDA graphs each rank captured (of 5 and of 6 calls), replayed with skew")
    soak.add_argument("--backend", default="auto", choices=("auto", "triton", "cute", "torch", "mixed"),
                      help="mixed (one GPU): every rank-call on a backend drawn at random; torch: the unfused "
                           "path (torchrun)")
    soak.add_argument("--hidden", type=int, default=None, help="default: 5120 on GPUs, 256 simulated")
    soak.add_argument("--capacity", type=int, default=None,
                      help="max_num_tokens; calls draw M from 1 to it (default: what the emulated ranks keep resident)")
    soak.add_argument("--bt-min-rows", type=int, default=None, help="LL -> BT threshold (default: the preset's)")
    soak.add_argument("--one-kernel-rows", type=int, default=None, help="one GPU: LL's one-kernel bound (0: none)")
    soak.add_argument("--split-rows", type=int, default=None, help="one GPU: the latency forms' largest call")
    soak.add_argument("--host-gc", action="store_true",
                      help="one GPU: leave Python's collector on while the ranks run (its pauses stall every rank's "
                           "issue; for diagnosis)")
    soak.add_argument("--max-lead", type=int, default=soak_defaults.MAX_LEAD,
                      help="one GPU: calls the host may issue for a rank ahead of the slowest (1: call by call)")
    soak.add_argument("--delayed-share", type=float, default=soak_defaults.DELAYED_SHARE,
                      help="one GPU: of the eager rank-calls, those delayed on the device first (0: none)")
    soak.add_argument("--pooled-streams", action="store_true",
                      help="one GPU: the ranks on torch's pooled streams, which may share hardware queues (for "
                           "diagnosis; by default each rank gets a stream on a queue of its own)")
    soak.add_argument("--chunk-rows", type=int, default=soak_defaults.CHUNK_ROWS,
                      help="one GPU: rows of a call's parts (a multiple of 128 where H takes MXFP8)")
    soak.add_argument("--default-carveout", action="store_true",
                      help="one GPU: leave each kernel's L1 / shared-memory split to the driver (for diagnosis: "
                           "ranks sharing SMs then stall; by default every kernel asks for the largest shared split)")
    soak.add_argument("--gpu-lock", metavar="FILE",
                      help="one GPU: build, then run only while holding this file's lock, so that soaks started "
                           "together compile at once and run one at a time (bench/soak_h200.sh)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--spin-timeout-ms", type=float, default=2000.0)
    soak.add_argument("--out", default=None, help="append one CSV row (gpu, where, backend, tp, hidden, calls, "
                                                  "graph_replays, mismatches, timeouts, seconds)")
    soak.set_defaults(run=_soak)

    args, rest = parser.parse_known_args(argv)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
