"""The unfused path's tail in compiled torch ops (``unfused-nccl``, ``unfused-one-shot``): how a
careful engine writes it for torch.compile. Slower than the strong Triton tail at large M; kept so
earlier results stay comparable."""

from __future__ import annotations

import torch


def mhc_tail(reduced, residual, post, comb, pre, weight, eps: float):
    """The mHC post-mix, collapse and RMSNorm: fp32 math, bf16 at the boundaries, the hc x hc mix
    unrolled into broadcasts (a [M, hc, hc, H] intermediate reduced over a middle axis compiles into
    a slow reduction kernel)."""
    hc = residual.shape[1]
    streams = residual.float()
    mixed = reduced.float().unsqueeze(1) * post.unsqueeze(-1)
    for j in range(hc):  # stream j feeds every output stream i with comb[:, j, i]
        mixed = mixed + streams[:, j].unsqueeze(1) * comb[:, j].unsqueeze(-1)
    residual_out = mixed.to(torch.bfloat16)
    collapsed = residual_out[:, 0].float() * pre[:, 0:1]
    for i in range(1, hc):
        collapsed = collapsed + residual_out[:, i].float() * pre[:, i:i + 1]
    prenorm = collapsed.to(torch.bfloat16).float()
    inv = torch.rsqrt(prenorm.square().mean(-1, keepdim=True) + eps)
    return residual_out, (prenorm * inv * weight.float()).to(torch.bfloat16)


def moe_finalize(gemm2, weights, indices, shared):
    """top-k weighted sum of the permuted GEMM2 rows (-1: not held here) plus the shared expert."""
    held = indices >= 0
    rows = gemm2[indices.clamp(min=0).long()].float()
    return ((rows * (weights * held).unsqueeze(-1)).sum(1) + shared.float()).to(torch.bfloat16)


def mxfp8_tail(layer_input):
    from ..mxfp8 import mxfp8_quantize_reference
    return mxfp8_quantize_reference(layer_input)
