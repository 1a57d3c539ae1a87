"""Rank bodies shared by the GPU suites: build an op, run a variant on fresh inputs, check bits.

Every rank rebuilds the whole group's inputs from the call's seed, so it checks its own outputs
against the CPU reference with no extra communication; a body returns the failures it saw.
"""

from __future__ import annotations

import os

import pytest
import torch

from lamport_mhc import AllReduceMHC, AllReduceMHCConfig, mxfp8_scale_bytes
from lamport_mhc.testing import assert_outputs_match, expected_outputs, random_inputs

# The TP size of the multi-GPU suites: 2 unless LAMPORT_MHC_TEST_TP says otherwise (4 and 8 on the
# machines that have them): ``LAMPORT_MHC_TEST_TP=4 pytest tests/gpu``.
TP = int(os.environ.get("LAMPORT_MHC_TEST_TP", "2"))
HC = 4
TOP_K = 6
EPS = 1e-20
VARIANTS = ("plain", "finalize", "quant", "residual")
BACKENDS = ["triton", "cute"]


def require_backend(backend: str) -> None:
    """Skip when ``backend`` is not installed here (the CuTe DSL kit is brought to the GPU machine)."""
    from lamport_mhc.backend import Support, load_backend

    loaded = load_backend(backend)
    if isinstance(loaded, Support):
        pytest.skip(loaded.reason)


def build(hidden: int, capacity: int, backend: str, bt_min_rows: int | None, **config) -> AllReduceMHC:
    """An op for the GPU suites; ``bt_min_rows`` None takes the preset's thresholds."""
    return AllReduceMHC(hidden, HC, capacity, TOP_K, torch.device("cuda", torch.cuda.current_device()),
                        quantize_layer_input=hidden % 128 == 0, residual_only=True,
                        config=AllReduceMHCConfig(backend=backend, transport="peer", bt_min_rows=bt_min_rows,
                                                  bt_min_finalize_rows=bt_min_rows, **config))


def poison_allocator(nbytes: int) -> None:
    """Fill the caching allocator's free blocks with a pattern, so an output element a kernel
    forgets to write shows up as a wrong bit instead of a stale right one."""
    torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(0xA5)


def run_variant(op: AllReduceMHC, inputs: dict, variant: str, rank: int):
    """One call of ``variant``; returns (residual_out, layer_input, mxfp8 pair or None)."""
    device = inputs["residual"].device
    m, hidden = inputs["residual"].shape[0], inputs["residual"].shape[2]
    residual_only = variant == "residual"
    consumer = (inputs["residual"], inputs["post"], inputs["comb"], None if residual_only else inputs["pre"],
                None if residual_only else inputs["norm_weight"], EPS)
    mxfp8 = None
    if variant == "quant":
        mxfp8 = (torch.full((m, hidden), 0xA5, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn),
                 torch.full((mxfp8_scale_bytes(m, hidden),), 0xA5, dtype=torch.uint8, device=device))
    if variant == "finalize":
        out = op.finalize(inputs["gemm2s"][rank], inputs["weights"][rank], inputs["idxs"][rank],
                          inputs["shareds"][rank], *consumer)
    else:
        out = op(inputs["xs"][rank], *consumer, mxfp8_out=mxfp8)
    return out[0], out[1], mxfp8


def check(ops, tp, rank, m, hidden, variant, seed, edit=None) -> list[str]:
    """One call of ``variant`` on each op with the same fresh inputs (changed in place by ``edit``,
    the same on every rank), against one reference.

    The reference runs on the GPU: tests/gpu/test_reference_cuda.py pins its bits to the CPU's, and
    on the CPU a sweep to M = 1024 at H = 7168 would take minutes per rank.
    """
    inputs = random_inputs(tp, m, hidden, HC, seed=seed, top_k=TOP_K, device="cuda")
    if edit is not None:
        edit(inputs)
    expected = expected_outputs(inputs, variant, EPS, device="cuda")
    failures = []
    for op in ops:
        poison_allocator(64 << 20)
        outputs = run_variant(op, inputs, variant, rank)
        try:
            assert_outputs_match(outputs, expected)
        except AssertionError as error:
            failures.append(f"rank {rank}: {op.backend} {op.protocol(m, variant == 'finalize')} {variant} "
                            f"H={hidden} M={m}: {error}")
    return failures


def special_values(inputs):
    """Row 1 with an Inf among its inputs (its layer input: NaN where the prenorm is infinite, zeros
    elsewhere), row 2 with a NaN (all NaN), and NaN, Inf and -0.0 in single lanes of every input,
    post, comb, pre and norm_weight included."""
    nan, inf = float("nan"), float("inf")
    for x in inputs["xs"] + inputs["shareds"]:
        x[1, 40] = inf
        x[2, 7] = nan
        x[0, :4] = torch.tensor([-0.0, -0.0, -inf, -0.0])
    inputs["residual"][0, 3, 100:104] = torch.tensor([-0.0, inf, -0.0, 3e38])
    # The mix and norm weights too: data, not misuse; the contract says what they give.
    inputs["post"][2, 1] = nan
    inputs["comb"][1, 2, 3] = -inf
    inputs["pre"][0, 1] = nan
    inputs["norm_weight"][9] = inf


def sweep(rank: int, tp: int, backend: str, hidden: int, capacity: int, sizes: list[int], **config) -> list[str]:
    """Every variant over ``sizes`` on two ops: LL only (no BT state) and BT from 1 row."""
    ops = [build(hidden, capacity, backend, bt_min_rows, **config) for bt_min_rows in (capacity + 1, 1)]
    failures = []
    for m in sizes:
        for variant in VARIANTS:
            failures += check(ops, tp, rank, m, hidden, variant, seed=hidden * 10_000 + m * 10 + VARIANTS.index(variant))
    torch.cuda.synchronize()
    return failures


def capture(calls):
    """A CUDA graph of ``calls()`` (warmed up once on a side stream, identically on every rank) and
    what the captured calls returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = calls()
    return graph, outputs


def refill(static: dict, fresh: dict) -> None:
    """Copy new inputs into a graph's static input tensors (per-rank lists too)."""
    for key, value in static.items():
        for dst, src in zip(value if isinstance(value, list) else [value],
                            fresh[key] if isinstance(value, list) else [fresh[key]]):
            dst.copy_(src)


def poison(outputs) -> None:
    """Fill a call's outputs with a pattern, so a replay that skips an element shows it."""
    for tensor in outputs:
        for t in tensor if isinstance(tensor, tuple) else (tensor,):
            if t is not None:
                t.view(torch.uint8).fill_(0xA5)


def graph_replays(rank: int, tp: int, backend: str, calls: int, replays: int, hidden: int = 5120,
                  **config) -> list[str]:
    """Capture ``calls`` calls (LL and BT, every variant) in one CUDA graph, then replay it
    ``replays`` times with new inputs, every output checked against the reference."""
    m_values = [16, 40]
    op = build(hidden, 64, backend, 32, **config)
    plan = [(m_values[i % 2], VARIANTS[i % 4]) for i in range(calls)]
    static = [random_inputs(tp, m, hidden, HC, seed=i, top_k=TOP_K, device="cuda") for i, (m, _) in enumerate(plan)]
    graph, outputs = capture(lambda: [run_variant(op, inputs, variant, rank)
                                      for (_, variant), inputs in zip(plan, static)])
    failures = []
    for replay in range(replays):
        for i, ((m, variant), inputs) in enumerate(zip(plan, static)):
            refill(inputs, random_inputs(tp, m, hidden, HC, seed=1000 * (replay + 1) + i, top_k=TOP_K, device="cuda"))
            poison(outputs[i])
        graph.replay()
        torch.cuda.synchronize()
        for i, ((m, variant), inputs) in enumerate(zip(plan, static)):
            try:
                assert_outputs_match(outputs[i], expected_outputs(inputs, variant, EPS, device="cuda"))
            except AssertionError as error:
                failures.append(f"replay {replay} call {i} ({variant}, M={m}): {error}")
    op.check()  # synchronizes; raises if a replayed kernel gave up waiting
    return failures
