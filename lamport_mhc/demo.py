"""``python -m lamport_mhc demo``: run every variant against the CPU reference and print a table.

On a CPU-only machine: a simulated TP group running the Triton kernels under the interpreter. Under
``torchrun`` (one process per GPU): the real collective; every rank rebuilds every rank's inputs from
one seed, so it checks its own outputs against the reference without extra communication.
"""

from __future__ import annotations

import os
import time

import torch

from .testing import assert_outputs_match, call_simulated, expected_outputs, random_inputs

EPS = 1e-20  # DeepSeek-V4.1's rms_norm_eps: the edge the contract must survive


def _cases(capacity: int, bt_min_rows: int):
    """Every variant at M = 1, 3, the first BT row (where the build has one) and the capacity."""
    sizes = sorted({m for m in (1, 3, bt_min_rows, capacity) if m <= capacity})
    for variant in ("plain", "finalize", "quant", "residual"):
        for m in sizes:
            yield variant, m


def _print_table(title: str, rows: list[tuple]) -> None:
    print(title)
    print(f"{'variant':9s} {'M':>5s} {'protocol':8s} {'ranks':>5s} {'bits vs reference':18s} {'ms':>8s}")
    for variant, m, protocol, ranks, verdict, ms in rows:
        print(f"{variant:9s} {m:5d} {protocol:8s} {ranks:5d} {verdict:18s} {ms:8.1f}")


def run_simulated(args) -> int:
    from .simulate import SimulatedGroup

    hidden, capacity = args.hidden or 256, args.capacity or 8
    bt_min_rows = max(2, capacity // 2)
    group = SimulatedGroup(args.tp, hidden_size=hidden, hc_mult=args.hc, max_num_tokens=capacity, top_k=args.top_k,
                           quantize_layer_input=hidden % 128 == 0, residual_only=True, bt_min_rows=bt_min_rows,
                           bt_min_finalize_rows=bt_min_rows)
    rows, failures = [], 0
    for seed, (variant, m) in enumerate(_cases(capacity, bt_min_rows)):
        if variant == "quant" and hidden % 128:
            continue
        inputs = random_inputs(args.tp, m, hidden, args.hc, seed=seed, top_k=args.top_k)
        start = time.perf_counter()
        outputs = call_simulated(group, inputs, variant, EPS)
        ms = (time.perf_counter() - start) * 1e3
        expected = expected_outputs(inputs, variant, EPS)
        try:
            for rank_outputs in outputs:
                assert_outputs_match(rank_outputs, expected)
            verdict = "identical"
        except AssertionError as error:
            verdict, failures = f"DIFFER: {error}", failures + 1
        protocol = "bt" if m >= bt_min_rows else "ll"
        rows.append((variant, m, protocol, args.tp, verdict, ms))
    _print_table(f"simulated TP group: tp={args.tp} H={hidden} hc={args.hc} top_k={args.top_k} capacity={capacity} "
                 f"(Triton kernels under the interpreter, eps={EPS:g})", rows)
    return 1 if failures else 0


def run_distributed(args) -> int:
    import torch.distributed as dist

    from . import AllReduceMHC, AllReduceMHCConfig
    from .launch import join_torchrun_group
    from .mxfp8 import mxfp8_scale_bytes

    place = join_torchrun_group()
    tp, rank, device = place.world_size, place.rank, place.device
    cuda = device.type == "cuda"
    hidden, capacity = args.hidden or 5120, args.capacity or 1024
    op = AllReduceMHC(hidden, args.hc, capacity, args.top_k, device, quantize_layer_input=hidden % 128 == 0,
                      residual_only=True, config=AllReduceMHCConfig(backend=args.backend))
    rows, failures = [], 0
    for seed, (variant, m) in enumerate(_cases(capacity, op.thresholds.bt_min_rows)):
        inputs = random_inputs(tp, m, hidden, args.hc, seed=seed, top_k=args.top_k, device=device)
        residual_only = variant == "residual"
        consumer = (inputs["residual"], inputs["post"], inputs["comb"], None if residual_only else inputs["pre"],
                    None if residual_only else inputs["norm_weight"], EPS)
        mxfp8 = None
        if variant == "quant":
            mxfp8 = (torch.empty((m, hidden), dtype=torch.float8_e4m3fn, device=device),
                     torch.empty(mxfp8_scale_bytes(m, hidden), dtype=torch.uint8, device=device))
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if variant == "finalize":
            residual_out, layer_input = op.finalize(inputs["gemm2s"][rank], inputs["weights"][rank],
                                                    inputs["idxs"][rank], inputs["shareds"][rank], *consumer)
        else:
            residual_out, layer_input = op(inputs["xs"][rank], *consumer, mxfp8_out=mxfp8)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        expected = expected_outputs(inputs, variant, EPS)
        try:
            assert_outputs_match((residual_out, layer_input, mxfp8), expected)
            verdict = "identical"
        except AssertionError as error:
            verdict = f"DIFFER: {error}"
        verdicts: list = [None] * tp
        dist.all_gather_object(verdicts, verdict)
        worst = next((v for v in verdicts if v != "identical"), "identical")
        failures += worst != "identical"
        rows.append((variant, m, op.protocol(m, variant == "finalize"), tp, worst, ms))
    if rank == 0:
        _print_table(f"{place.describe()}: backend={op.backend} transport={op.transport} H={hidden} "
                     f"hc={args.hc} top_k={args.top_k} capacity={capacity} (first-call ms include warm-up)", rows)
    dist.destroy_process_group()
    return 1 if failures else 0


def run(args) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_distributed(args)
    return run_simulated(args)
