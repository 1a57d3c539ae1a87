"""Inputs and bit comparisons for correctness tests of any backend (A/B tests, the demo, the suites).

Inputs are drawn from one seed for the whole TP group, so every rank can build every rank's
contribution and compute the reference locally. They mix ordinary values with the contract's edge
cases: -0.0, bf16 subnormals, huge values, an all-zero row, and (finalize) -1 routes.
"""

from __future__ import annotations

import torch

from . import reference
from .selector import first_difference


def _bf16(shape, generator, scale=1.0, specials=True) -> torch.Tensor:
    device = generator.device
    values = torch.randn(shape, generator=generator, device=device) * scale
    if specials and values.numel() >= 8:
        flat = values.view(-1)
        # Distinct positions: with repeated ones, which special value lands would depend on the
        # order of a (multi-threaded) scatter, and ranks rebuilding each other's inputs would disagree.
        picks = torch.randint(0, flat.numel(), (max(4, flat.numel() // 64),), generator=generator,
                              device=device).unique()
        kinds = torch.randint(0, 4, picks.shape, generator=generator, device=device)
        special = torch.tensor([-0.0, 3e-39, -2.5e38, -1e-40], device=device)  # -0, subnormal, huge, smallest subnormal
        flat[picks] = special[kinds]
    return values.to(torch.bfloat16)


HELD_ROUTE_FRACTION = 0.67  # of a token's top-k routes, the ones this EP rank holds


def permuted_routes(m: int, top_k: int, generator: torch.Generator, device=None) -> torch.Tensor:
    """int32 [m, top_k] GEMM2 row indices as an engine's MoE permutation lays them out: about a third
    of the routes held by another EP rank (-1), every held route its own row, rows 0..held-1 in a
    random order."""
    held = torch.rand((m, top_k), generator=generator, device=device) < HELD_ROUTE_FRACTION
    indices = torch.full((m, top_k), -1, dtype=torch.int32, device=device)
    indices[held] = torch.randperm(int(held.sum()), generator=generator, device=device, dtype=torch.int32)
    return indices


def random_inputs(tp: int, m: int, hidden: int, hc: int, *, seed: int, top_k: int = 0, gemm2_rows: int = 0,
                  permuted: bool = False, zero_row: bool = True, specials: bool = True, device="cpu",
                  drawn_on_device: bool = False) -> dict:
    """Per-rank ``xs`` (and, with top_k, finalize inputs ``gemm2s, weights, idxs, shareds``) plus the
    shared consumer inputs of one call. Row 0 is all zero in every input when ``zero_row``. The
    finalize's routes pick GEMM2 rows at random (repeats included: a test of the gather), or with
    ``permuted`` as an engine's permutation does (``permuted_routes``: what a benchmark should read).
    ``specials``: a 64th of the activations' values (x, the streams, GEMM2 rows, the shared expert)
    are edge cases (-0.0, subnormals, -2.5e38), for the tests. A benchmark draws without them: with
    them every row's sum of squares overflows, which sends the contract's exact division and square
    root down their slow paths in every row, where a model's finite activations never go.
    ``drawn_on_device``: drawn by ``device``'s generator (fast for large pools; other values than
    the CPU's for the same seed)."""
    if permuted and gemm2_rows:
        raise ValueError("gemm2_rows is for random routes; permuted routes have a row per held route")
    where = torch.device(device) if drawn_on_device else torch.device("cpu")
    g = torch.Generator(device=where).manual_seed(seed)
    xs = [_bf16((m, hidden), g, specials=specials) for _ in range(tp)]
    residual = _bf16((m, hc, hidden), g, specials=specials)
    post = torch.rand((m, hc), generator=g, device=where) * 2
    comb = torch.rand((m, hc, hc), generator=g, device=where)
    pre = torch.rand((m, hc), generator=g, device=where)
    norm_weight = _bf16((hidden,), g, specials=False)
    inputs = dict(xs=xs, residual=residual, post=post, comb=comb, pre=pre, norm_weight=norm_weight)
    if top_k and permuted:
        idxs = [permuted_routes(m, top_k, g, where) for _ in range(tp)]
        inputs["gemm2s"] = [_bf16((max(1, int((idx >= 0).sum())), hidden), g, specials=specials) for idx in idxs]
        inputs["weights"] = [torch.rand((m, top_k), generator=g, device=where) for _ in range(tp)]
        inputs["idxs"] = idxs
    elif top_k:
        rows = gemm2_rows or max(1, m * top_k // 2)
        inputs["gemm2s"] = [_bf16((rows, hidden), g, specials=specials) for _ in range(tp)]
        inputs["weights"] = [torch.rand((m, top_k), generator=g, device=where) for _ in range(tp)]
        idxs = [torch.randint(0, rows, (m, top_k), generator=g, dtype=torch.int32, device=where) for _ in range(tp)]
        for idx in idxs:  # the routes another EP rank holds
            idx[torch.rand((m, top_k), generator=g, device=where) >= HELD_ROUTE_FRACTION] = -1
        inputs["idxs"] = idxs
    if top_k:
        inputs["shareds"] = [_bf16((m, hidden), g, specials=specials) for _ in range(tp)]
    if zero_row:
        for name, value in inputs.items():
            if name in ("xs", "shareds"):
                for t in value:
                    t[0] = 0.0
            elif name == "residual":
                value[0] = 0.0
            elif name == "idxs":
                for t in value:
                    t[0] = -1
    return {k: ([t.to(device) for t in v] if isinstance(v, list) else v.to(device)) for k, v in inputs.items()}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's storage, for exact comparison."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def assert_same_bits(name: str, expected: torch.Tensor, actual: torch.Tensor) -> None:
    expected, actual = expected.cpu(), actual.cpu()
    if expected.shape != actual.shape:
        raise AssertionError(f"{name}: shape {list(actual.shape)} != expected {list(expected.shape)}")
    message = first_difference(name, expected, actual)
    if message is not None:
        raise AssertionError(message)


def expected_outputs(inputs: dict, variant: str, eps: float, device: str | torch.device = "cpu"):
    """The reference's (residual_out, layer_input, mxfp8) for ``random_inputs`` and a variant
    ("plain", "finalize", "quant", "residual"), computed on ``device`` (the CPU unless a suite has
    pinned the reference on that device to the CPU's bits)."""
    moved = {k: ([t.to(device) for t in v] if isinstance(v, list) else v.to(device)) for k, v in inputs.items()}
    if variant == "finalize":
        contributions = [reference.finalize_contribution(*args) for args in
                         zip(moved["gemm2s"], moved["weights"], moved["idxs"], moved["shareds"])]
    else:
        contributions = moved["xs"]
    residual_only = variant == "residual"
    return reference.all_reduce_mhc(contributions, moved["residual"], moved["post"], moved["comb"],
                                    None if residual_only else moved["pre"],
                                    None if residual_only else moved["norm_weight"], eps,
                                    quantize=variant == "quant")


def assert_outputs_match(outputs, expected) -> None:
    """``outputs`` = (residual_out, layer_input, mxfp8 pair or None) against ``expected_outputs``."""
    (residual_out, layer_input, mxfp8), (ref_residual, ref_layer, ref_mxfp8) = outputs, expected
    assert_same_bits("residual_out", ref_residual, residual_out)
    if ref_layer is not None:
        assert_same_bits("layer_input", ref_layer, layer_input)
    elif layer_input is not None:
        raise AssertionError("layer_input returned by a residual-only call")
    if ref_mxfp8 is not None:
        assert_same_bits("mxfp8 values", ref_mxfp8[0], mxfp8[0])
        assert_same_bits("mxfp8 scales", ref_mxfp8[1], mxfp8[1])


def call_simulated(group, inputs: dict, variant: str, eps: float):
    """One call of ``variant`` on a ``SimulatedGroup`` with ``random_inputs``; per-rank outputs."""
    residual_only = variant == "residual"
    consumer = (inputs["residual"], inputs["post"], inputs["comb"], None if residual_only else inputs["pre"],
                None if residual_only else inputs["norm_weight"], eps)
    if variant == "finalize":
        return group.finalize(inputs["gemm2s"], inputs["weights"], inputs["idxs"], inputs["shareds"], *consumer)
    return group.all_reduce_mhc(inputs["xs"], *consumer, mxfp8=variant == "quant")


def check_simulated(group, inputs: dict, variant: str, eps: float):
    """``call_simulated``, asserting every rank's outputs are the reference's bits; returns them."""
    expected = expected_outputs(inputs, variant, eps)
    outputs = call_simulated(group, inputs, variant, eps)
    for rank, rank_outputs in enumerate(outputs):
        try:
            assert_outputs_match(rank_outputs, expected)
        except AssertionError as error:
            raise AssertionError(f"rank {rank}, {variant}, M={inputs['residual'].shape[0]}: {error}") from None
    return outputs
