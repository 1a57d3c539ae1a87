"""The bit contract, as literal torch ops (runs on any device, gives the same bits on each).

Every output is a pure function of the inputs, defined in IEEE fp32 with round-to-nearest-even;
``fma`` is one rounding (``bits.fma_f32``), ``bf16(v)`` is RNE with NaN -> 0x7FC0
(``bits.bf16_bits``). Every kernel backend and protocol must reproduce these bits exactly.

1. Contribution of a rank: plain ``c = x``; MoE finalize (``finalize_contribution``)
   ``acc = 0; for k in order: if idx[t,k] != -1: acc = fma(f32(gemm2[idx[t,k]]), w[t,k], acc)``,
   ``c = bf16(acc + f32(shared[t]))``. Then ``-0.0 -> +0.0``.
2. ``reduced = bf16(((0 + c_0) + c_1) + ... + c_{tp-1})`` in fp32, rank order, each ``c_r``
   canonicalized first; then ``-0.0 -> +0.0`` (``reduce_contributions``).
3. Per target stream j: ``m = f32(reduced) * post[j]``; ``for s in order: m = fma(f32(res[s]), comb[s, j], m)``;
   ``residual_out[j] = bf16(m)``, with no zero canonicalization (``post_mix``).
4. ``acc = 0; for j in order: acc = fma(f32(residual_out[j]), pre[j], acc)``; ``prenorm = bf16(acc)``
   (``pre_mix``).
5. ``ss = pairwise_sum(f32(prenorm)^2)`` (each square rounded); ``inv = 1 / sqrt(ss / H + eps)``,
   every operation one IEEE rounding, ``H`` and ``eps`` as fp32;
   ``layer_input = bf16((f32(prenorm) * inv) * f32(norm_weight))`` (``rms_norm``).
6. Optionally ``mxfp8_quantize_reference(layer_input)``.

``comb`` is indexed ``[token, source, target]``. Scalars (H, eps) enter as full fp32 tensors on the
data's device so no backend turns a division into a multiply by a reciprocal.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .bits import bf16_bits, bf16_to_f32, canonical_zero, fma_f32, pairwise_sum
from .layout import MXFP8_BLOCK
from .mxfp8 import mxfp8_quantize_reference

__all__ = [
    "finalize_contribution",
    "reduce_contributions",
    "post_mix",
    "pre_mix",
    "rms_norm",
    "all_reduce_mhc",
]


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return bf16_bits(v).view(torch.bfloat16)


def _check_tensor(t, name: str, dtype: torch.dtype, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")


def _check_shape(t: torch.Tensor, name: str, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_device(tensors: dict, device: torch.device) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device} like the other inputs")


# ----------------------------------------------------------------------------- step 1 (finalize)


def finalize_contribution(
    gemm2_permuted: torch.Tensor,
    expert_weights: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    shared_output: torch.Tensor,
) -> torch.Tensor:
    """MoE finalize contribution, bf16 ``[M, H]`` (contract step 1).

    ``acc = +0.0`` (fp32); for k = 0..top_k-1 in order: ``row = idx[t, k]``; if ``row != -1``:
    ``acc = fma(f32(gemm2[row]), w[t, k], acc)``. A skipped slot leaves acc untouched (it is not a
    multiply by 0: an Inf/NaN row or weight behind -1 has no effect). Then
    ``c = bf16(acc + f32(shared[t]))`` (fp32 add, then RNE) and ``-0.0 -> +0.0``.

    gemm2_permuted bf16 ``[rows, H]``; expert_weights fp32 ``[M, K]``; expanded_idx_to_permuted_idx
    int32 ``[M, K]`` with values in ``[-1, rows)``; shared_output bf16 ``[M, H]``.
    """
    _check_tensor(gemm2_permuted, "gemm2_permuted", torch.bfloat16, 2)
    _check_tensor(expert_weights, "expert_weights", torch.float32, 2)
    _check_tensor(expanded_idx_to_permuted_idx, "expanded_idx_to_permuted_idx", torch.int32, 2)
    _check_tensor(shared_output, "shared_output", torch.bfloat16, 2)
    rows, hidden = gemm2_permuted.shape
    m, top_k = expert_weights.shape
    _check_shape(expanded_idx_to_permuted_idx, "expanded_idx_to_permuted_idx", (m, top_k))
    _check_shape(shared_output, "shared_output", (m, hidden))
    device = gemm2_permuted.device
    _check_device(
        {
            "expert_weights": expert_weights,
            "expanded_idx_to_permuted_idx": expanded_idx_to_permuted_idx,
            "shared_output": shared_output,
        },
        device,
    )
    idx = expanded_idx_to_permuted_idx.to(torch.int64)
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= rows):
        raise ValueError(
            f"expanded_idx_to_permuted_idx: values must be -1 (skip) or in [0, {rows}), "
            f"got min {int(idx.min())} max {int(idx.max())}"
        )

    g = bf16_to_f32(gemm2_permuted)
    acc = torch.zeros(m, hidden, dtype=torch.float32, device=device)
    for k in range(top_k):
        row = idx[:, k]
        take = row != -1
        if rows > 0:
            src = g[torch.where(take, row, torch.zeros_like(row))]
        else:
            src = torch.zeros_like(acc)
        new = fma_f32(src, expert_weights[:, k : k + 1], acc)
        acc = torch.where(take.unsqueeze(1), new, acc)
    c = bf16_bits(acc + bf16_to_f32(shared_output))
    return canonical_zero(c).view(torch.bfloat16)


# ----------------------------------------------------------------------------- steps 2-5


def reduce_contributions(contributions: Sequence[torch.Tensor]) -> torch.Tensor:
    """Contract step 2: ``bf16(((0 + c_0) + c_1) + ...)`` in fp32, rank order, then ``-0.0 -> +0.0``.

    Each contribution is canonicalized (``-0.0 -> +0.0``) before it is added, as it is before it is
    published. Inputs: bf16 ``[M, H]`` tensors of one shape, in rank order.
    """
    first = contributions[0]
    acc = torch.zeros(first.shape, dtype=torch.float32, device=first.device)
    for c in contributions:
        acc = acc + bf16_to_f32(canonical_zero(c.view(torch.int16)))
    return canonical_zero(bf16_bits(acc)).view(torch.bfloat16)


def post_mix(reduced: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Contract step 3, bf16 ``[M, hc, H]``.

    For each target j: ``m = f32(reduced) * post[:, j]`` (one fp32 multiply); for s = 0..hc-1 in
    order: ``m = fma(f32(residual[:, s]), comb[:, s, j], m)``; ``residual_out[:, j] = bf16(m)``.
    No zero canonicalization: -0.0 stays -0.0. ``post`` is fp32 ``[M, hc]`` (or ``[M, hc, 1]``),
    ``comb`` fp32 ``[M, hc, hc]`` indexed ``[token, source, target]``.
    """
    if post.dim() == 3:
        post = post.squeeze(-1)
    hc = residual.shape[1]
    res = bf16_to_f32(residual)
    m = bf16_to_f32(reduced).unsqueeze(1) * post.unsqueeze(-1)  # [M, hc(target), H]
    for s in range(hc):
        m = fma_f32(res[:, s : s + 1, :], comb[:, s, :].unsqueeze(-1), m)
    return _bf16(m)


def pre_mix(residual_out: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Contract step 4: ``acc = +0.0; for j in order: acc = fma(f32(residual_out[:, j]), pre[:, j], acc)``;
    ``prenorm = bf16(acc)``, bf16 ``[M, H]`` (no zero canonicalization)."""
    res = bf16_to_f32(residual_out)
    acc = torch.zeros(res.shape[0], res.shape[2], dtype=torch.float32, device=res.device)
    for j in range(res.shape[1]):
        acc = fma_f32(res[:, j, :], pre[:, j : j + 1], acc)
    return _bf16(acc)


def rms_norm(prenorm: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Contract step 5, bf16 ``[M, H]``.

    ``p = f32(prenorm)``; ``ss = pairwise_sum(p * p)`` (each square rounded to fp32, adjacent-pair
    tree over the row padded with +0.0); ``inv = 1 / sqrt(ss / H + eps)`` with an IEEE fp32
    division, add, sqrt and division (``H`` and ``eps`` rounded to fp32 first);
    ``layer_input = bf16((p * inv) * f32(norm_weight))``.
    """
    p = bf16_to_f32(prenorm)
    hidden = p.shape[-1]
    ss = pairwise_sum(p * p)
    h = torch.full_like(ss, float(hidden))
    eps = torch.full_like(ss, float(norm_eps))  # fp32 RNE of eps
    inv = torch.div(torch.ones_like(ss), torch.sqrt(torch.div(ss, h) + eps))
    gamma = bf16_to_f32(norm_weight)
    return _bf16((p * inv.unsqueeze(-1)) * gamma)


# ----------------------------------------------------------------------------- the whole op


def all_reduce_mhc(
    contributions: Sequence[torch.Tensor],
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    pre: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    norm_eps: Optional[float],
    quantize: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """The fused op's outputs for one call: ``(residual_out, layer_input, mxfp8)``.

    contributions: the per-rank bf16 ``[M, H]`` contributions in rank order (step 1 already
    applied; plain contributions are the TP-partial ``x``). residual bf16 ``[M, hc, H]``; post fp32
    ``[M, hc]`` or ``[M, hc, 1]``; comb fp32 ``[M, hc, hc]`` as ``[token, source, target]``; pre
    fp32 ``[M, hc]``; norm_weight bf16 ``[H]``; norm_eps a finite real >= 0 (rounded to fp32).

    Steps 2-5 of the contract, then step 6 when ``quantize``: ``mxfp8 = (values float8_e4m3fn
    [M, H], scales uint8 [mxfp8_scale_bytes(M, H)])``. ``pre`` and ``norm_weight`` are both given
    or both None; with both None only ``residual_out`` is computed (layer_input None) and
    ``quantize`` must be False.
    """
    # --- validation, all before any arithmetic
    if not isinstance(contributions, (list, tuple)) or len(contributions) == 0:
        raise ValueError("contributions: expected a non-empty list of per-rank bf16 [M, H] tensors")
    for r, c in enumerate(contributions):
        _check_tensor(c, f"contributions[{r}]", torch.bfloat16, 2)
    m, hidden = contributions[0].shape
    if hidden < 1:
        raise ValueError(f"contributions: hidden size must be >= 1, got {hidden}")
    for r, c in enumerate(contributions):
        _check_shape(c, f"contributions[{r}]", (m, hidden))
    _check_tensor(residual, "residual", torch.bfloat16, 3)
    hc = residual.shape[1]
    if hc < 1:
        raise ValueError("residual: expected at least one stream (hc >= 1)")
    _check_shape(residual, "residual", (m, hc, hidden))
    if not isinstance(post, torch.Tensor) or post.dim() not in (2, 3):
        raise ValueError("post: expected an fp32 tensor [M, hc] or [M, hc, 1]")
    _check_tensor(post, "post", torch.float32, post.dim())
    _check_shape(post, "post", (m, hc) if post.dim() == 2 else (m, hc, 1))
    _check_tensor(comb, "comb", torch.float32, 3)
    _check_shape(comb, "comb", (m, hc, hc))

    if (pre is None) != (norm_weight is None):
        raise ValueError("pre and norm_weight: give both (full op) or neither (residual-only)")
    has_norm = pre is not None
    if not isinstance(quantize, bool):
        raise ValueError(f"quantize: expected a bool, got {type(quantize).__name__}")
    if has_norm:
        _check_tensor(pre, "pre", torch.float32, 2)
        _check_shape(pre, "pre", (m, hc))
        _check_tensor(norm_weight, "norm_weight", torch.bfloat16, 1)
        _check_shape(norm_weight, "norm_weight", (hidden,))
        if (
            isinstance(norm_eps, bool)
            or not isinstance(norm_eps, (int, float))
            or not math.isfinite(norm_eps)
            or norm_eps < 0
        ):
            raise ValueError(f"norm_eps: expected a finite real number >= 0, got {norm_eps!r}")
    elif quantize:
        raise ValueError("quantize=True needs the layer input: pass pre and norm_weight")
    if quantize:
        if hidden % MXFP8_BLOCK != 0:
            raise ValueError(f"quantize=True: hidden must be a multiple of {MXFP8_BLOCK}, got {hidden}")
        if m < 1:
            raise ValueError("quantize=True: needs at least one token (M >= 1)")
    device = residual.device
    _check_device(
        {
            **{f"contributions[{r}]": c for r, c in enumerate(contributions)},
            "post": post,
            "comb": comb,
            "pre": pre,
            "norm_weight": norm_weight,
        },
        device,
    )

    # --- steps 2-6
    reduced = reduce_contributions(contributions)
    residual_out = post_mix(reduced, residual, post, comb)
    if not has_norm:
        return residual_out, None, None
    prenorm = pre_mix(residual_out, pre)
    layer_input = rms_norm(prenorm, norm_weight, norm_eps)
    mxfp8 = mxfp8_quantize_reference(layer_input) if quantize else None
    return residual_out, layer_input, mxfp8
