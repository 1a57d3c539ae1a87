"""Bit-exact scalar building blocks of the bit contract, in torch ops only.

Every function here is elementwise (or a fixed reduction tree), runs on CPU and CUDA tensors of any
shape and gives the same bits on both: nothing depends on a device's conversion instructions,
fused kernels or reduction order.

* ``bf16_bits``: fp32 -> bf16 round-to-nearest-even on the fp32 bit pattern; NaN -> 0x7FC0.
* ``fma_f32``: fp32 fused multiply-add with one rounding, emulated exactly in fp64.
* ``pairwise_sum``: the adjacent-pair tree over the last dim, padded with +0.0 to a power of two.
"""

from __future__ import annotations

import torch

__all__ = [
    "BF16_NAN_BITS",
    "bf16_bits",
    "bf16_round",
    "bf16_to_f32",
    "canonical_zero",
    "fma_f32",
    "pairwise_sum",
]

# The one bf16 NaN the contract produces, whatever the sign or payload of the fp32 NaN.
BF16_NAN_BITS = 0x7FC0

_U32 = 0xFFFFFFFF
_SIGN_MASK_F32 = 0x7FFFFFFF
_INF_BITS_F32 = 0x7F800000


def _require_dtype(x: torch.Tensor, dtypes: tuple, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected dtype {want}, got {x.dtype}")


def _u16_to_i16(r: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 0xFFFF] -> the int16 with the same 16-bit pattern."""
    return torch.where(r >= 0x8000, r - 0x10000, r).to(torch.int16)


def _u32_to_i32(r: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 0xFFFFFFFF] -> the int32 with the same 32-bit pattern."""
    return torch.where(r >= 0x80000000, r - 0x100000000, r).to(torch.int32)


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 bit pattern (int16), round-to-nearest-even by integer arithmetic.

    ``bits = (u + 0x7FFF + ((u >> 16) & 1)) >> 16`` on the unsigned fp32 pattern ``u``: ties go to
    the even bf16, values at or past the halfway point above the largest finite bf16 become
    infinity (IEEE overflow), infinities stay infinities, subnormals round like any other value,
    and the sign of zero is kept (-0.0 -> 0x8000). Every NaN (any sign, any payload) -> 0x7FC0.
    """
    _require_dtype(x, (torch.float32,), "bf16_bits")
    u = x.view(torch.int32).to(torch.int64) & _U32
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    is_nan = (u & _SIGN_MASK_F32) > _INF_BITS_F32
    r = torch.where(is_nan, torch.full_like(r, BF16_NAN_BITS), r)
    return _u16_to_i16(r)


def bf16_to_f32(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensor, or int16 bf16 bit patterns -> the exact fp32 value (bits shifted left by 16).

    Exact for every pattern, NaN payloads included.
    """
    _require_dtype(t, (torch.bfloat16, torch.int16), "bf16_to_f32")
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    u = (t.to(torch.int64) & 0xFFFF) << 16
    return _u32_to_i32(u).view(torch.float32)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp32 holding the value of ``bf16_bits(x)`` (the bf16 RNE rounding of x)."""
    return bf16_to_f32(bf16_bits(x))


def canonical_zero(bits: torch.Tensor) -> torch.Tensor:
    """bf16 negative zero -> positive zero (0x8000 -> 0x0000); every other pattern unchanged.

    Takes int16 bit patterns (or a bf16 tensor) and returns the same dtype. Contributions and the
    reduced sum go through this, so the Lamport sentinel (bf16 -0.0) never enters a mailbox.
    """
    _require_dtype(bits, (torch.int16, torch.bfloat16), "canonical_zero")
    as_bf16 = bits.dtype == torch.bfloat16
    b = bits.view(torch.int16) if as_bf16 else bits
    out = torch.where(b == -32768, torch.zeros_like(b), b)
    return out.view(torch.bfloat16) if as_bf16 else out


def _as_f32(v, device) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        _require_dtype(v, (torch.float32,), "fma_f32")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"fma_f32: expected fp32 tensors or Python numbers, got {type(v).__name__}")
    return torch.tensor(float(v), dtype=torch.float32, device=device)


def fma_f32(a, b, c) -> torch.Tensor:
    """fp32 ``a * b + c`` with exactly one rounding (RNE), elementwise with broadcasting.

    The product of two fp32 values is exact in fp64. The fp64 sum ``s = p + c`` is made
    round-to-odd: TwoSum gives its exact error ``e``; when ``e != 0`` and the fp64 pattern of ``s``
    is even, ``s`` steps one ulp toward the exact value. Round-to-odd to 53 bits followed by RNE to
    24 bits equals a single RNE (53 >= 24 + 2), subnormal fp32 results and overflow included.
    Non-finite sums (infinite or NaN operands) are left as IEEE fma gives them.
    """
    device = next((v.device for v in (a, b, c) if isinstance(v, torch.Tensor)), torch.device("cpu"))
    a64 = _as_f32(a, device).to(torch.float64)
    b64 = _as_f32(b, device).to(torch.float64)
    c64 = _as_f32(c, device).to(torch.float64)
    p = a64 * b64  # exact: 24 + 24 significant bits, exponents far inside the fp64 range
    p, c64 = torch.broadcast_tensors(p, c64)
    s = p + c64
    # TwoSum (Knuth): s + e == p + c exactly.
    bv = s - p
    av = s - bv
    e = (p - av) + (c64 - bv)
    sb = s.view(torch.int64)
    inexact_even = (e != 0) & ((sb & 1) == 0) & torch.isfinite(s)
    step = torch.where((e > 0) == (s > 0), torch.ones_like(sb), -torch.ones_like(sb))
    s_odd = torch.where(inexact_even, sb + step, sb).view(torch.float64)
    return s_odd.to(torch.float32)


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 sum over the last dim by a tree of adjacent pairs, every add rounded to fp32.

    The row is padded with +0.0 to a power of two ``n``; level 1 adds ``(x0+x1), (x2+x3), ...``,
    level 2 adds adjacent pairs of those, and so on until one value is left. A row of length 1
    is its own sum (no padding add). The padding is observable: three -0.0 sum to +0.0.
    """
    _require_dtype(x, (torch.float32,), "pairwise_sum")
    if x.dim() == 0:
        raise ValueError("pairwise_sum: expected at least one dimension")
    n = x.shape[-1]
    if n == 0:
        raise ValueError("pairwise_sum: the last dimension is empty")
    width = 1 << (n - 1).bit_length()
    if width != n:
        pad = torch.zeros(*x.shape[:-1], width - n, dtype=x.dtype, device=x.device)
        x = torch.cat([x, pad], dim=-1)
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]
