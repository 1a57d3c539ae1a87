"""What a soak's calls read and how their outputs are checked: the calls drawn (variant, M, input
pool), the pools of inputs at capacity rows with their references, each rank's reusable output
buffers, and the device-side checker that compares them in stream order and poisons them after.

A call of M rows reads rows [0, M) of its pool; rows are independent, so its outputs must be the
references' rows [0, M) (the swizzled MXFP8 scales: their prefix, zero past row M)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from . import layout, reference
from .backend import ConsumerArgs
from .call import Call
from .mxfp8 import mxfp8_scale_bytes, scale_offset

VARIANTS = ("plain", "quant", "finalize", "finalize-quant", "residual")
POOLS = 5
EPS = (1e-20, 1e-6)  # the pools' norm_eps, alternating
POISON_BYTE = 0xA5


def variants_of(hidden: int) -> tuple[str, ...]:
    quant = hidden % layout.HIDDEN_MULTIPLE_MXFP8 == 0
    return tuple(v for v in VARIANTS if quant or "quant" not in v)


@dataclass
class Draw:
    """One call's choices, the same on every rank."""

    variant: str
    m: int
    pool: int


def draw_calls(rng: random.Random, count: int, capacity: int, hidden: int) -> list[Draw]:
    """Calls of random variants and M; each reads a pool none of the three calls before it read."""
    variants = variants_of(hidden)
    recent: list[int] = []
    draws = []
    for _ in range(count):
        pool = rng.choice([p for p in range(POOLS) if p not in recent[-3:]])
        recent.append(pool)
        draws.append(Draw(rng.choice(variants), rng.randint(1, capacity), pool))
    return draws


class Pool:
    """One set of inputs at capacity rows for every rank, and the reference outputs of its rows
    (rows are independent: a call of M rows reads rows [0, M) and must give the references' rows)."""

    def __init__(self, tp: int, capacity: int, hidden: int, hc: int, top_k: int, seed: int, eps: float, device):
        from .testing import random_inputs

        self.eps = eps
        self.inputs = random_inputs(tp, capacity, hidden, hc, seed=seed, top_k=top_k, gemm2_rows=capacity,
                                    device=device, drawn_on_device=device.type == "cuda")
        quantize = hidden % layout.HIDDEN_MULTIPLE_MXFP8 == 0
        i = self.inputs
        finalized = [reference.finalize_contribution(*args)
                     for args in zip(i["gemm2s"], i["weights"], i["idxs"], i["shareds"])]
        self.expected = {}
        for kind, contributions in (("plain", i["xs"]), ("finalize", finalized)):
            residual_out, layer, mxfp8 = reference.all_reduce_mhc(
                contributions, i["residual"], i["post"], i["comb"], i["pre"], i["norm_weight"], eps,
                quantize=quantize)
            self.expected[kind] = (residual_out, layer, mxfp8)


def draw_pools(tp: int, capacity: int, hidden: int, hc: int, top_k: int, seed: int, device) -> list[Pool]:
    return [Pool(tp, capacity, hidden, hc, top_k, seed * 1000 + p, EPS[p % len(EPS)], device) for p in range(POOLS)]


def scale_rows(capacity: int, hidden: int, device) -> torch.Tensor:
    """int32 [mxfp8_scale_bytes(capacity, hidden)]: the row of every byte of the swizzled scales
    (a call of M rows has the first mxfp8_scale_bytes(M) bytes, zero where the row is M or past)."""
    rows = -(-capacity // layout.SCALE_TILE_ROWS) * layout.SCALE_TILE_ROWS
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(hidden // layout.MXFP8_BLOCK).view(1, -1)
    owner = torch.empty(mxfp8_scale_bytes(capacity, hidden), dtype=torch.int32)
    owner[scale_offset(r, c, hidden).reshape(-1)] = r.expand(-1, c.shape[1]).reshape(-1).to(torch.int32)
    return owner.to(device)


class OutputChecker:
    """Compares each rank-call's outputs with the reference on the device, in the rank's stream order,
    then poisons them for the next call: mismatched words counted per (rank, output), and the first
    mismatching call of each rank kept. No host synchronization until ``read``."""

    OUTPUTS = ("residual_out", "layer_input", "mxfp8 values", "mxfp8 scales")

    def __init__(self, tp: int, device, scale_row_of: torch.Tensor):
        self.counts = torch.zeros(tp, len(self.OUTPUTS), dtype=torch.int64, device=device)
        self.first_bad = torch.full((tp,), 1 << 62, dtype=torch.int64, device=device)
        self.scale_row_of = scale_row_of
        self.compared = 0

    def check(self, rank: int, call_id: int, m: int, outputs, expected) -> None:
        """``outputs``/``expected``: (residual_out, layer_input or None, mxfp8 pair or None), the
        expected at capacity rows."""
        from .check_kernel import check_and_poison

        residual_out, layer, mxfp8 = outputs
        ref_residual, ref_layer, ref_mxfp8 = expected
        pairs = [(0, residual_out, ref_residual), (1, layer, ref_layer)]
        if mxfp8 is not None:
            pairs += [(2, mxfp8[0], ref_mxfp8[0]), (3, mxfp8[1], ref_mxfp8[1])]
        for index, out, ref in pairs:
            if out is None:
                continue
            check_and_poison(out, ref, self.scale_row_of if index == 3 else None, m,
                             self.counts[rank, index:], self.first_bad[rank:], call_id)
            self.compared += 1

    def read(self) -> tuple[int, list[str]]:
        """(rank-outputs with wrong bits, messages); synchronizes."""
        counts, first = self.counts.cpu(), self.first_bad.cpu()
        messages = [f"rank {rank}: {int(counts[rank, i])} wrong words of {name} (first wrong call {int(first[rank])})"
                    for rank in range(counts.shape[0]) for i, name in enumerate(self.OUTPUTS) if counts[rank, i]]
        return int((counts > 0).sum()), messages


@dataclass
class RankBuffers:
    """One rank's outputs at capacity rows, reused every call (the checker poisons them after reading)."""

    residual_out: torch.Tensor
    layer_input: torch.Tensor
    values: torch.Tensor | None
    scales: torch.Tensor | None

    @classmethod
    def allocate(cls, capacity: int, hidden: int, hc: int, quant: bool, device) -> RankBuffers:
        def poisoned(n, dtype=torch.uint8):
            return torch.full((n,), POISON_BYTE, dtype=torch.uint8, device=device).view(dtype)
        return cls(poisoned(capacity * hc * hidden * 2, torch.bfloat16), poisoned(capacity * hidden * 2, torch.bfloat16),
                   poisoned(capacity * hidden) if quant else None,
                   poisoned(mxfp8_scale_bytes(capacity, hidden)) if quant else None)


def rank_call(draw: Draw, rank: int, pool: Pool, buffers: RankBuffers, hidden: int, hc: int) -> tuple[Call, tuple]:
    """The call of ``draw`` for one rank over its buffers, and its (outputs, expected) to check."""
    i, m = pool.inputs, draw.m
    quant, finalize, residual_only = "quant" in draw.variant, draw.variant.startswith("finalize"), \
        draw.variant == "residual"
    residual_out = buffers.residual_out[:m * hc * hidden].view(m, hc, hidden)
    layer = None if residual_only else buffers.layer_input[:m * hidden].view(m, hidden)
    values = buffers.values[:m * hidden].view(m, hidden).view(torch.float8_e4m3fn) if quant else None
    scales = buffers.scales[:mxfp8_scale_bytes(m, hidden)] if quant else None
    consumer = ConsumerArgs(
        variant="residual" if residual_only else "quant" if quant else "plain", residual=i["residual"][:m],
        post=i["post"][:m], comb=i["comb"][:m], pre=None if residual_only else i["pre"][:m],
        norm_weight=None if residual_only else i["norm_weight"], norm_eps=pool.eps, residual_out=residual_out,
        layer_input=layer, mxfp8_values=values, mxfp8_scales=scales)
    if finalize:
        call = Call("finalize", m, consumer, gemm2=i["gemm2s"][rank], weights=i["weights"][rank][:m],
                    indices=i["idxs"][rank][:m], shared=i["shareds"][rank][:m])
    else:
        call = Call("plain", m, consumer, x=i["xs"][rank][:m])
    expected_residual, expected_layer, expected_mxfp8 = pool.expected["finalize" if finalize else "plain"]
    outputs = (residual_out, layer, None if not quant else (values.view(torch.uint8), scales))
    expected = (expected_residual, None if residual_only else expected_layer,
                None if not quant else (expected_mxfp8[0].view(torch.uint8), expected_mxfp8[1]))
    return call, (outputs, expected)
