"""MXFP8 reference: FlashInfer's CuTe DSL kernel semantics, bit for bit, in torch ops.

Per 32-element block of a bf16 row (one UE8M0 scale byte per block, scales in the swizzled 128x4
layout):

1. ``amax = max |x|`` over the block. A NaN element is ignored when any element of the block is a
   number (``max`` returns the non-NaN operand); an all-NaN block has amax NaN. +-Inf propagates.
2. ``s = fp32(amax) * fp32(1/448)``: one fp32 RN multiply by the constant 0x3B124925.
3. ``u = float_to_ue8m0_fast(s)`` (``ue8m0_from_amax``): ``s <= 0`` -> 0; else with
   ``e = (bits >> 23) & 255`` and ``m = bits & 0x7FFFFF``, ``u = e + (m != 0)``, except no bump
   when ``e == 0 and m <= 0x400000`` (s <= 2^-127 -> 0); then ``u = min(u, 254)`` (NaN s -> 254).
4. ``inv = 2^(127 - u)`` from bits, biased exponent ``max(254 - u, 0)``, and 0 when ``u == 0``
   (``inverse_scale``; u == 254 also gives 0.0).
5. ``q = e4m3_RNE(clamp(f32(x) * inv, -448, 448))`` where a NaN product becomes +448 (0x7E):
   ``min.f32``/``max.f32`` return the non-NaN operand. So Inf * 0 -> 0x7E, and signed zeros keep
   their sign (-0.0 -> 0x80).
6. Scale byte = u at ``scale_offset(row, block)``; bytes of padded rows ``[M, roundup(M, 128))``
   and padded scale columns are 0.
"""

from __future__ import annotations

import torch

from .bits import bf16_to_f32
from .layout import MXFP8_BLOCK, SCALE_TILE_COLS, SCALE_TILE_ROWS

__all__ = [
    "E4M3_MAX",
    "E4M3_MAX_BITS",
    "E4M3_NAN_BITS",
    "INV_E4M3_MAX_BITS",
    "UE8M0_MAX",
    "mxfp8_scale_bytes",
    "scale_offset",
    "ue8m0_from_amax",
    "inverse_scale",
    "e4m3_bits",
    "quantize_values",
    "mxfp8_quantize_reference",
]

E4M3_MAX = 448.0
E4M3_MAX_BITS = 0x7E  # +448
E4M3_NAN_BITS = 0x7F
# fp32 round-to-nearest of 1/448, the constant the kernel multiplies amax by.
INV_E4M3_MAX_BITS = 0x3B124925
# The largest scale byte the kernel writes (255 would be the UE8M0 NaN).
UE8M0_MAX = 254

_MIN_NORMAL_E4M3 = 2.0**-6


def _roundup(v: int, m: int) -> int:
    return -(-v // m) * m


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_hidden(hidden, where: str) -> None:
    if not _is_int(hidden) or hidden <= 0 or hidden % MXFP8_BLOCK != 0:
        raise ValueError(
            f"{where}: hidden must be a positive multiple of {MXFP8_BLOCK} (one scale per "
            f"{MXFP8_BLOCK} values), got {hidden!r}"
        )


def _padded_scale_cols(hidden: int) -> int:
    return _roundup(hidden // MXFP8_BLOCK, SCALE_TILE_COLS)


def mxfp8_scale_bytes(m: int, hidden: int) -> int:
    """Size in bytes of the swizzled scale buffer: ``roundup(m, 128) * roundup(hidden // 32, 4)``."""
    if not _is_int(m) or m < 1:
        raise ValueError(f"mxfp8_scale_bytes: m (rows) must be an int >= 1, got {m!r}")
    _check_hidden(hidden, "mxfp8_scale_bytes")
    return _roundup(m, SCALE_TILE_ROWS) * _padded_scale_cols(hidden)


def scale_offset(row, col, hidden: int):
    """Byte offset of the scale of (row, block column ``col``) in the swizzled 128x4 layout.

    ``(c % 4) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (r // 128) * (128 * padded_cols)``
    with ``padded_cols = roundup(hidden // 32, 4)``: the buffer viewed as
    ``[padded_M / 128, padded_cols / 4, 32, 4, 4]`` indexed ``[r // 128, c // 4, r % 32, (r % 128) // 32, c % 4]``.
    ``row`` and ``col`` are non-negative ints or integer tensors (broadcast together).
    """
    _check_hidden(hidden, "scale_offset")
    padded_cols = _padded_scale_cols(hidden)
    r, c = row, col
    return (
        (c % 4)
        + (c // 4) * 512
        + (r % 32) * 16
        + ((r % 128) // 32) * 4
        + (r // 128) * (SCALE_TILE_ROWS * padded_cols)
    )


def _f32_const(bits: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, bits, dtype=torch.int32).view(torch.float32)


def ue8m0_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Block amax (fp32) -> UE8M0 scale byte (uint8), FlashInfer's ``float_to_ue8m0_fast``.

    ``s = amax * fp32(1/448)`` (one RN multiply); ``s <= 0`` -> 0; otherwise ``u = e + (m != 0)``
    without the bump when ``e == 0 and m <= 0x400000``; ``u = min(u, 254)``, so NaN and Inf -> 254.
    """
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32:
        raise ValueError(f"ue8m0_from_amax: expected an fp32 tensor, got {getattr(amax, 'dtype', type(amax))}")
    s = amax * _f32_const(INV_E4M3_MAX_BITS, amax)
    bits = s.view(torch.int32)
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    bump = (m != 0) & ~((e == 0) & (m <= 0x400000))
    u = torch.clamp(e + bump.to(torch.int32), max=UE8M0_MAX)
    u = torch.where(s <= 0, torch.zeros_like(u), u)  # false for NaN s: NaN -> 254
    return u.to(torch.uint8)


def inverse_scale(u: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte -> fp32 ``2^(127 - u)`` built from bits (``ue8m0_to_inv_scale_fast``).

    Biased exponent ``max(254 - u, 0)`` (so u == 254 gives 0.0), and 0.0 when ``u == 0``.
    """
    if not isinstance(u, torch.Tensor) or u.dtype.is_floating_point or u.dtype == torch.bool:
        raise ValueError("inverse_scale: expected an integer tensor of scale bytes")
    ui = u.to(torch.int32)
    e = torch.clamp(254 - ui, min=0)
    inv = (e << 23).view(torch.float32)
    return torch.where(ui == 0, torch.zeros_like(inv), inv)


def e4m3_bits(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn bit pattern (uint8), round-to-nearest-even (``cvt.rn.satfinite``).

    Normal range (|v| >= 2^-6): RNE of the fp32 pattern to 3 mantissa bits, a carry rolling into
    the exponent. Below 2^-6: RNE of ``|v| * 2^9`` to an integer (exact scaling, then the 2^23
    magic add) is the subnormal code, 8 being the smallest normal. The sign is kept (-0.0 -> 0x80).
    Meant for |v| <= 448 (after the clamp); beyond it the result saturates to +-448, and NaN gives
    0x7F.
    """
    if not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
        raise ValueError(f"e4m3_bits: expected an fp32 tensor, got {getattr(v, 'dtype', type(v))}")
    bits = v.view(torch.int32)
    sign = (bits >> 31) & 1
    abits = bits & 0x7FFFFFFF
    a = abits.view(torch.float32)
    # Normal: drop 20 mantissa bits with RNE; rebias the exponent from 127 to 7.
    finite = torch.clamp(abits, max=0x7F800000)  # keeps the adds below inside int32 for Inf/NaN
    rounded = (finite + 0x7FFFF + ((finite >> 20) & 1)) >> 20
    normal_code = rounded - ((127 - 7) << 3)
    # Subnormal: |v| * 2^9 < 8 is exact; adding and removing 2^23 rounds it to an integer (RNE).
    magic = torch.full_like(a, 2.0**23)
    sub = ((a * torch.full_like(a, 2.0**9)) + magic) - magic
    sub_code = sub.to(torch.int32)
    code = torch.where(a < _MIN_NORMAL_E4M3, sub_code, normal_code)
    code = torch.where(a > E4M3_MAX, torch.full_like(code, E4M3_MAX_BITS), code)
    code = code | (sign << 7)
    code = torch.where(torch.isnan(v), torch.full_like(code, E4M3_NAN_BITS), code)
    return code.to(torch.uint8)


def quantize_values(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Step 5: ``e4m3_RNE(clamp(x * inv, -448, 448))`` as uint8 bits, a NaN product -> +448 (0x7E).

    ``x`` and ``inv`` are fp32 and broadcast together; the product is one fp32 multiply.
    """
    if x.dtype != torch.float32 or inv.dtype != torch.float32:
        raise ValueError("quantize_values: expected fp32 tensors")
    p = x * inv
    p = torch.where(torch.isnan(p), torch.full_like(p, E4M3_MAX), p)
    p = torch.clamp(p, -E4M3_MAX, E4M3_MAX)
    return e4m3_bits(p)


def mxfp8_quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[M, H]`` -> ``(values float8_e4m3fn [M, H], scales uint8 [mxfp8_scale_bytes(M, H)])``.

    FlashInfer's kernel semantics (see the module docstring), NaN and Inf included: values byte i is
    element i; scales are UE8M0 bytes in the swizzled 128x4 layout with padding bytes 0.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise ValueError(f"mxfp8_quantize_reference: expected a bf16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != 2:
        raise ValueError(f"mxfp8_quantize_reference: expected a 2-D [M, H] tensor, got shape {tuple(x.shape)}")
    m, hidden = x.shape
    _check_hidden(hidden, "mxfp8_quantize_reference")
    n_bytes = mxfp8_scale_bytes(m, hidden)
    cols = hidden // MXFP8_BLOCK

    xf = bf16_to_f32(x).reshape(m, cols, MXFP8_BLOCK)
    mag = xf.abs()
    nan = torch.isnan(mag)
    amax = torch.where(nan, torch.zeros_like(mag), mag).amax(dim=-1)
    amax = torch.where(nan.all(dim=-1), torch.full_like(amax, float("nan")), amax)

    u = ue8m0_from_amax(amax)  # [M, cols]
    inv = inverse_scale(u)
    values = quantize_values(xf, inv.unsqueeze(-1)).reshape(m, hidden).view(torch.float8_e4m3fn)

    rows = torch.arange(m, device=x.device, dtype=torch.int64).unsqueeze(1)
    bcols = torch.arange(cols, device=x.device, dtype=torch.int64).unsqueeze(0)
    offsets = scale_offset(rows, bcols, hidden).reshape(-1)
    scales = torch.zeros(n_bytes, dtype=torch.uint8, device=x.device)
    scales[offsets] = u.reshape(-1)
    return values, scales
