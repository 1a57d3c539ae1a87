"""Argument validation, done in full before a call's first launch: a bad call raises ValueError
with the mailboxes and generation state untouched, and the next good call is still correct."""

from __future__ import annotations

import math
import numbers

import torch

from . import layout
from .backend import BuildSpec, ConsumerArgs
from .call import Call
from .mxfp8 import mxfp8_scale_bytes


def check_build(hidden_size, hc_mult, max_num_tokens, top_k, quantize_layer_input) -> None:
    for name, value in (("hidden_size", hidden_size), ("hc_mult", hc_mult), ("max_num_tokens", max_num_tokens),
                        ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    multiple = layout.HIDDEN_MULTIPLE_MXFP8 if quantize_layer_input else layout.HIDDEN_MULTIPLE
    if hidden_size % multiple:
        raise ValueError(f"hidden_size must be a multiple of {multiple}"
                         f"{' (MXFP8 output: whole 128-column scale tiles)' if quantize_layer_input else ' (16-byte fragments)'}, "
                         f"got {hidden_size}")


def _tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device, align: int = 16) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned (data_ptr % {align} == {t.data_ptr() % align})")


def _rows(name: str, t, capacity: int) -> int:
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        raise ValueError(f"{name} must be a tensor with a token dimension")
    m = t.shape[0]
    if not 1 <= m <= capacity:
        raise ValueError(f"{name} has {m} rows; expected 1 <= M <= max_num_tokens ({capacity})")
    return m


def consumer_args(spec: BuildSpec, device: torch.device, m: int, residual, post, comb, pre, norm_weight,
                  norm_eps, mxfp8_out) -> ConsumerArgs:
    """Validate the consumer inputs of a call and allocate its outputs."""
    hc, h = spec.hc, spec.hidden
    _tensor("residual", residual, torch.bfloat16, (m, hc, h), device)
    # The mix weights 16-byte aligned, as the bf16 rows: the Triton kernels load a token's post and
    # each comb row 16 bytes at a time, and are specialized on these pointers' alignment (one compiled
    # kernel serves every call: kernels_triton.publish.FOUR_BYTE_ALIGNED names the exceptions).
    if isinstance(post, torch.Tensor) and post.dim() == 3:
        _tensor("post", post, torch.float32, (m, hc, 1), device)
    else:
        _tensor("post", post, torch.float32, (m, hc), device)
    _tensor("comb", comb, torch.float32, (m, hc, hc), device)
    if (pre is None) != (norm_weight is None):
        raise ValueError("pre and norm_weight must both be given, or both be None (residual-only)")
    residual_only = pre is None
    if residual_only:
        if not spec.residual_only:
            raise ValueError("pre=None and norm_weight=None need an instance built with residual_only=True")
        if mxfp8_out is not None:
            raise ValueError("a residual-only call has no layer input to quantize: mxfp8_out must be None")
    else:
        _tensor("pre", pre, torch.float32, (m, hc), device)
        _tensor("norm_weight", norm_weight, torch.bfloat16, (h,), device)
        if not isinstance(norm_eps, numbers.Real) or isinstance(norm_eps, bool) or not math.isfinite(norm_eps) \
                or norm_eps < 0:
            raise ValueError(f"norm_eps must be a finite non-negative float, got {norm_eps!r}")
    values = scales = None
    if mxfp8_out is not None:
        if not spec.quantize:
            raise ValueError("mxfp8_out needs an instance built with quantize_layer_input=True")
        if not isinstance(mxfp8_out, (tuple, list)) or len(mxfp8_out) != 2:
            raise ValueError("mxfp8_out must be a (values, scales) pair")
        values, scales = mxfp8_out
        _tensor("mxfp8_out values", values, torch.float8_e4m3fn, (m, h), device)
        _scales(scales, m, h, device)
    residual_out = torch.empty_like(residual)
    layer_input = None if residual_only else torch.empty((m, h), dtype=torch.bfloat16, device=device)
    return ConsumerArgs(variant="residual" if residual_only else "quant" if values is not None else "plain",
                        residual=residual, post=post, comb=comb, pre=pre, norm_weight=norm_weight,
                        norm_eps=float(norm_eps), residual_out=residual_out, layer_input=layer_input,
                        mxfp8_values=values, mxfp8_scales=scales)


def _scales(scales, m: int, h: int, device) -> None:
    """Scales: any contiguous uint8 tensor of mxfp8_scale_bytes(M, H) bytes (the swizzled layout)."""
    expected = mxfp8_scale_bytes(m, h)
    if not isinstance(scales, torch.Tensor) or scales.numel() != expected:
        got = f"{scales.numel()} bytes" if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise ValueError(f"mxfp8_out scales must hold mxfp8_scale_bytes({m}, {h}) = {expected} bytes, got {got}")
    _tensor("mxfp8_out scales", scales, torch.uint8, tuple(scales.shape), device, align=4)


def plain_call(spec: BuildSpec, device: torch.device, x, residual, post, comb, pre, norm_weight, norm_eps,
               mxfp8_out) -> Call:
    m = _rows("x", x, spec.capacity)
    _tensor("x", x, torch.bfloat16, (m, spec.hidden), device)
    consumer = consumer_args(spec, device, m, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out)
    return Call(kind="plain", m=m, consumer=consumer, x=x)


def finalize_call(spec: BuildSpec, device: torch.device, gemm2, weights, indices, shared, residual, post, comb,
                  pre, norm_weight, norm_eps, mxfp8_out, check_index_range: bool) -> Call:
    m = _rows("shared_output", shared, spec.capacity)
    _tensor("shared_output", shared, torch.bfloat16, (m, spec.hidden), device)
    if not isinstance(gemm2, torch.Tensor) or gemm2.dim() != 2:
        raise ValueError("gemm2_permuted must be a 2-D tensor [rows, hidden]")
    _tensor("gemm2_permuted", gemm2, torch.bfloat16, (gemm2.shape[0], spec.hidden), device)
    _tensor("expert_weights", weights, torch.float32, (m, spec.top_k), device, align=4)
    _tensor("expanded_idx_to_permuted_idx", indices, torch.int32, (m, spec.top_k), device, align=4)
    if check_index_range:
        low, high = int(indices.min()), int(indices.max())
        if low < -1 or high >= gemm2.shape[0]:
            raise ValueError(f"expanded_idx_to_permuted_idx must lie in [-1, {gemm2.shape[0]}) "
                             f"(gemm2_permuted rows), got values in [{low}, {high}]")
    consumer = consumer_args(spec, device, m, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out)
    return Call(kind="finalize", m=m, consumer=consumer, gemm2=gemm2, weights=weights, indices=indices,
                shared=shared)
