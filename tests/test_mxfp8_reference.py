"""MXFP8 reference: scale rule, inverse scale, e4m3 RNE, NaN/Inf handling, swizzle, padding."""

from fractions import Fraction

import pytest
import torch

from lamport_mhc.bits import bf16_to_f32
from lamport_mhc.mxfp8 import (
    INV_E4M3_MAX_BITS,
    e4m3_bits,
    inverse_scale,
    mxfp8_quantize_reference,
    mxfp8_scale_bytes,
    quantize_values,
    scale_offset,
    ue8m0_from_amax,
)

NAN = float("nan")
INF = float("inf")


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


def u8(t):
    return t.reshape(-1).view(torch.uint8).tolist()


# ----------------------------------------------------------------------------- sizes and swizzle


def test_scale_bytes_formula():
    assert mxfp8_scale_bytes(1, 32) == 128 * 4  # rows padded to 128, scale columns to 4
    assert mxfp8_scale_bytes(128, 128) == 128 * 4
    assert mxfp8_scale_bytes(129, 4096) == 256 * 128
    assert mxfp8_scale_bytes(3, 160) == 128 * 8  # 5 scale columns -> 8
    assert mxfp8_scale_bytes(300, 7168) == 384 * 224


@pytest.mark.parametrize("m, hidden", [(0, 32), (-1, 32), (1, 0), (1, 48), (1, -32), (1.0, 32), (1, 32.0), (True, 32)])
def test_scale_bytes_rejects(m, hidden):
    with pytest.raises(ValueError):
        mxfp8_scale_bytes(m, hidden)


def test_inv_constant_is_fp32_of_one_over_448():
    c = torch.tensor(INV_E4M3_MAX_BITS, dtype=torch.int32).view(torch.float32).item()
    assert c == float(torch.tensor(1 / 448, dtype=torch.float32))
    # the nearest fp32: 1/448 lies in [2^-9, 2^-8) where the ulp is 2^-32
    assert abs(Fraction(c) - Fraction(1, 448)) <= Fraction(1, 2**33)


@pytest.mark.parametrize(
    "row, col, hidden, want",
    [
        (0, 0, 256, 0),
        (0, 1, 256, 1),
        (0, 3, 256, 3),
        (0, 4, 256, 512),  # next 4-column group: 32*4*4 bytes further
        (1, 0, 256, 16),
        (31, 0, 256, 496),
        (32, 0, 256, 4),  # second 32-row slab: 4 bytes further
        (96, 2, 256, 14),  # 2 + 3*4
        (127, 7, 256, 1023),  # 3 + 512 + 31*16 + 3*4: the last byte of the first 128-row tile
        (128, 0, 256, 1024),  # next 128-row tile: 128 * padded_cols (8)
        (130, 5, 256, 1569),  # 1 + 512 + 2*16 + 0 + 1024
        (1, 0, 32, 16),
        (128, 0, 32, 512),  # 1 scale column pads to 4
        (200, 2, 96, 512 + 2 + 8 * 16 + 2 * 4),  # 96/32 = 3 -> 4 padded columns
    ],
)
def test_scale_offset_hand_values(row, col, hidden, want):
    assert scale_offset(row, col, hidden) == want
    t = scale_offset(torch.tensor([row]), torch.tensor([col]), hidden)
    assert t.tolist() == [want]


def test_scale_offset_is_a_permutation_of_the_buffer():
    m, hidden = 256, 256
    rows = torch.arange(m).unsqueeze(1)
    cols = torch.arange(8).unsqueeze(0)
    offs = scale_offset(rows, cols, hidden).reshape(-1)
    assert torch.equal(torch.sort(offs).values, torch.arange(mxfp8_scale_bytes(m, hidden)))


def test_scale_offset_rejects_bad_hidden():
    with pytest.raises(ValueError):
        scale_offset(0, 0, 40)


# ----------------------------------------------------------------------------- UE8M0 scale


@pytest.mark.parametrize(
    "amax, u",
    [
        (448.0, 127),  # 448 * fp32(1/448) rounds to exactly 1.0: no bump
        (448.0 * 2**5, 132),
        (448.0 * 2**-10, 117),
        (448.0 * 2**100, 227),
        (224.0, 126),
        (450.0, 128),  # the bf16 just above 448: s = 1.0045 -> e 127 + bump
        (446.0, 127),  # just below: s = 0.9955 -> e 126 + bump
        (0.0, 0),  # all-zero block
        (1.75 * 2**-119, 0),  # = 448 * 2^-127: s = 2^-127 (subnormal m = 0x400000): no bump
        (1.7578125 * 2**-119, 1),  # next bf16: s just above 2^-127 -> bump
        (2.0**-119, 0),
        (2.0**-133, 0),  # the smallest bf16 subnormal
        (3.3895313892515355e38, 247),  # bf16 max: u <= 247 for every bf16
        (INF, 254),
        (NAN, 254),
    ],
)
def test_ue8m0_hand_values(amax, u):
    assert u8(ue8m0_from_amax(f32([amax]))) == [u]


def test_ue8m0_fp32_raw_rule():
    # fp32 amax values whose product s = amax * 0x3B124925 lands exactly on the edges of the rule:
    # s = 2^-127 (subnormal m = 0x400000: no bump), one ulp above (bump), the smallest subnormal
    # (no bump), 1.0 (e 127, m 0: no bump) and one ulp above 1.0 (bump)
    targets = [0x00400000, 0x00400001, 0x00000001, 0x3F800000, 0x3F800001]
    want = [0, 1, 0, 127, 128]
    c = torch.tensor(INV_E4M3_MAX_BITS, dtype=torch.int32).view(torch.float32)
    for target, u in zip(targets, want):
        start = (torch.tensor(target, dtype=torch.int32).view(torch.float32).double() / c.double()).float()
        cands = start.view(torch.int32) + torch.arange(-4, 5, dtype=torch.int32)
        amax = cands.view(torch.float32)
        hit = (amax * c).view(torch.int32) == target
        assert hit.any(), hex(target)
        assert u8(ue8m0_from_amax(amax[hit])) == [u] * int(hit.sum())
    assert u8(ue8m0_from_amax(f32([-1.0, -0.0]))) == [0, 0]  # s <= 0 -> 0


def test_ue8m0_all_bf16_amax_equals_exact_ceil_log2():
    # every positive finite bf16: u = clamp(ceil(log2(amax / 448)), -127, 127) + 127
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)
    amax = bf16_to_f32(bits)
    got = ue8m0_from_amax(amax).tolist()
    for a, g in zip(amax.tolist(), got):
        q = Fraction(a) / 448
        k = q.numerator.bit_length() - q.denominator.bit_length() - 1
        while Fraction(2) ** k < q:  # smallest k with q <= 2^k
            k += 1
        while Fraction(2) ** (k - 1) >= q:
            k -= 1
        assert g == max(-127, min(127, k)) + 127, a


def test_inverse_scale():
    u = torch.tensor([0, 1, 126, 127, 128, 200, 253, 254, 255], dtype=torch.uint8)
    inv = inverse_scale(u)
    assert inv.dtype == torch.float32
    want = [0.0, 2.0**126, 2.0, 1.0, 0.5, 2.0**-73, 2.0**-126, 0.0, 0.0]
    assert inv.tolist() == want
    assert inv.view(torch.int32).tolist()[6] == 0x00800000


# ----------------------------------------------------------------------------- e4m3


@pytest.mark.parametrize(
    "v, code",
    [
        (0.0, 0x00),
        (-0.0, 0x80),
        (1.0, 0x38),
        (1.0625, 0x38),  # halfway 1.0 (m=000) / 1.125 (m=001) -> even, down
        (1.0625 + 2**-20, 0x39),  # past the tie -> up
        (1.1875, 0x3A),  # halfway 1.125 (001) / 1.25 (010) -> even, up
        (-1.0625, 0xB8),
        (-1.1875, 0xBA),
        (1.9375, 0x40),  # halfway 1.875 (111) / 2.0 -> up into the next binade
        (15.5, 0x58),  # halfway 15 (0x57) / 16 (0x58) -> 16
        (448.0, 0x7E),
        (-448.0, 0xFE),
        (440.0, 0x7E),  # halfway 416 (0x7D) / 448 (0x7E, even) -> 448
        (2.0**-6, 0x08),  # smallest normal
        (2.0**-9, 0x01),  # smallest subnormal
        (2.0**-10, 0x00),  # halfway 0 / 2^-9 -> 0
        (-(2.0**-10), 0x80),  # -> -0
        (2.0**-10 + 2**-30, 0x01),
        (1.5 * 2**-9, 0x02),  # halfway 1 / 2 units -> 2
        (2.5 * 2**-9, 0x02),  # halfway 2 / 3 units -> 2
        (7.5 * 2**-9, 0x08),  # halfway 7 units (0x07) / 2^-6 (0x08) -> subnormal rounds up to normal
        (7.25 * 2**-9, 0x07),
        (2.0**-6 - 2**-12, 0x08),  # just below the smallest normal, nearer to it
        (2.0**-126, 0x00),  # fp32 tiny normal
        (float.fromhex("0x1p-149"), 0x00),  # fp32 subnormal
        (float.fromhex("-0x1p-149"), 0x80),
    ],
)
def test_e4m3_hand_values(v, code):
    assert u8(e4m3_bits(f32([v]))) == [code]


def test_e4m3_saturation_and_nan():
    assert u8(e4m3_bits(f32([460.0, 464.0, 1e6, INF, -INF, NAN]))) == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F]


def test_e4m3_every_code_and_midpoint_exhaustive():
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # all non-negative finite codes
    vals = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3_bits(vals), codes)
    assert torch.equal(e4m3_bits(-vals), codes | 0x80)
    mids = (vals[:-1] + vals[1:]) / 2  # exact in fp32
    got = e4m3_bits(mids).tolist()
    for i, g in enumerate(got):  # RNE: the neighbour with an even code
        assert g == (i if i % 2 == 0 else i + 1)


def test_e4m3_matches_torch_cast_in_range():
    g = torch.Generator().manual_seed(5)
    v = (torch.rand(50_000, generator=g) * 2 - 1) * torch.exp2(torch.randint(-16, 9, (50_000,), generator=g).float())
    v = v.clamp(-448, 448)
    assert torch.equal(e4m3_bits(v), v.to(torch.float8_e4m3fn).view(torch.uint8))


def test_quantize_values_clamp_and_nan():
    x = f32([500.0, -1e9, NAN, -NAN, INF, -INF, 1.0, -0.0])
    inv = f32([1.0])
    assert u8(quantize_values(x, inv)) == [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0xFE, 0x38, 0x80]
    # Inf * 0 is NaN -> +448, whatever the sign of the Inf
    assert u8(quantize_values(f32([INF, -INF, 3.0, -3.0]), f32([0.0]))) == [0x7E, 0x7E, 0x00, 0x80]


# ----------------------------------------------------------------------------- whole quantizer


def bf16(values, m=None):
    t = torch.tensor(values, dtype=torch.bfloat16)
    return t.reshape(m, -1) if m is not None else t.reshape(1, -1)


def block(values, fill=0.0):
    return list(values) + [fill] * (32 - len(values))


def test_block_at_448_and_ties():
    # amax 448 -> u 127, inv 1: values go through e4m3 RNE unchanged
    vals = block([448.0, -448.0, 1.0, 0.5, -0.0, 1.0625, 1.1875, 15.5, 2.0**-10, 1.5 * 2**-9, 7.5 * 2**-9, 440.0])
    q, s = mxfp8_quantize_reference(bf16(vals))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (1, 32)
    assert s.dtype == torch.uint8 and s.shape == (512,)
    assert u8(q)[:12] == [0x7E, 0xFE, 0x38, 0x30, 0x80, 0x38, 0x3A, 0x58, 0x00, 0x02, 0x08, 0x7E]
    assert u8(q)[12:] == [0] * 20
    assert s[0].item() == 127
    assert s[1:].sum().item() == 0


def test_block_just_above_448():
    # amax 450 -> u 128, inv 0.5: 450 -> 225 -> 224 (0x76), 1 -> 0.5 (0x30), -3 -> -1.5 (0xBC)
    q, s = mxfp8_quantize_reference(bf16(block([450.0, 1.0, -3.0])))
    assert s[0].item() == 128
    assert u8(q)[:3] == [0x76, 0x30, 0xBC]


def test_zero_and_tiny_blocks():
    # all-zero block: scale 0, inv 0, zeros keep their sign
    q, s = mxfp8_quantize_reference(bf16(block([0.0, -0.0, -0.0, 0.0])))
    assert s[0].item() == 0
    assert u8(q)[:4] == [0x00, 0x80, 0x80, 0x00]
    # amax <= 448 * 2^-127: scale 0, every value flushed to a signed zero
    q, s = mxfp8_quantize_reference(bf16(block([2.0**-119, -(2.0**-120), 1.75 * 2**-119, -(2.0**-133)])))
    assert s[0].item() == 0
    assert u8(q)[:4] == [0x00, 0x80, 0x00, 0x80]
    # next bf16 up: scale 1, inv 2^126
    q, s = mxfp8_quantize_reference(bf16(block([1.7578125 * 2**-119])))
    assert s[0].item() == 1
    # 1.7578125 * 2^-119 * 2^126 = 225: e4m3 steps by 16 in [128, 256): 224 -> 0x76
    assert u8(q)[0] == 0x76


def test_nan_and_inf_blocks():
    # a NaN element is ignored by amax and becomes +448; the rest of the block is normal
    q, s = mxfp8_quantize_reference(bf16(block([NAN, 448.0, -1.0, -NAN])))
    assert s[0].item() == 127
    assert u8(q)[:4] == [0x7E, 0x7E, 0xB8, 0x7E]
    # all-NaN block: amax NaN -> scale 254 (inv 0), NaN * 0 -> +448
    q, s = mxfp8_quantize_reference(bf16(block([], fill=NAN)))
    assert s[0].item() == 254
    assert u8(q) == [0x7E] * 32
    # an Inf element: scale 254, inv 0; Inf * 0 = NaN -> +448, finite values -> signed zero
    q, s = mxfp8_quantize_reference(bf16(block([INF, 1.0, -1.0, -INF, NAN])))
    assert s[0].item() == 254
    assert u8(q)[:5] == [0x7E, 0x00, 0x80, 0x7E, 0x7E]
    assert u8(q)[5:] == [0x00] * 27


def test_blocks_are_independent_and_scales_swizzled():
    # row 0: block 0 amax 448 (u 127), block 1 amax 1 (u 119 = 127 + ceil(log2(1/448)) = 127 - 8)
    # row 1: block 0 zeros (u 0), block 1 amax 896 (u 128)
    x = bf16(block([448.0]) + block([1.0]) + block([0.0]) + block([-896.0]), m=2)
    q, s = mxfp8_quantize_reference(x)
    assert s.shape == (mxfp8_scale_bytes(2, 64),) == (512,)
    assert s[0].item() == 127  # (0, 0)
    assert s[1].item() == 119  # (0, 1)
    assert s[16].item() == 0  # (1, 0)
    assert s[17].item() == 128  # (1, 1)
    nonzero = torch.nonzero(s).reshape(-1).tolist()
    assert nonzero == [0, 1, 17]
    # block 1 of row 0: 1.0 * 2^8 = 256 = 2^(15 - 7) -> exponent field 15, mantissa 0: 0x78
    assert u8(q[0, 32:33]) == [0x78]
    assert u8(q[1, 32:33]) == [0xFE]  # -896 * 0.5 = -448


def test_padding_rows_and_columns_are_zero():
    m, hidden = 3, 96  # 3 scale columns (1 padded), rows padded to 128
    x = torch.full((m, hidden), 3.0, dtype=torch.bfloat16)
    _, s = mxfp8_quantize_reference(x)
    assert s.numel() == 128 * 4
    rows = torch.arange(m).unsqueeze(1)
    cols = torch.arange(3).unsqueeze(0)
    live = scale_offset(rows, cols, hidden).reshape(-1)
    mask = torch.zeros(s.numel(), dtype=torch.bool)
    mask[live] = True
    assert (s[mask] == 120).all()  # 3 / 448 = 2^-7.2 -> ceil -7 -> u 120
    assert (s[~mask] == 0).all()


def test_rejects_bad_inputs():
    with pytest.raises(ValueError):
        mxfp8_quantize_reference(torch.zeros(2, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        mxfp8_quantize_reference(torch.zeros(2, 32, dtype=torch.float32))
    with pytest.raises(ValueError):
        mxfp8_quantize_reference(torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        mxfp8_quantize_reference(torch.zeros(0, 32, dtype=torch.bfloat16))


def flashinfer_torch_reference(x):
    """FlashInfer's simple torch formulation (tests/utils_fp8.py style): exact on finite inputs."""
    m, hidden = x.shape
    blocks = x.float().reshape(m, hidden // 32, 32)
    block_scale = blocks.abs().amax(-1) / 448.0
    bits = block_scale.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    round_up = (mant != 0) & ((exp != 0) | (mant > 0x400000))
    exp = torch.clamp(exp + round_up.to(torch.int32), max=254)
    scale = torch.where(block_scale > 0, exp, torch.zeros_like(exp))
    inv = torch.ldexp(torch.ones_like(block_scale), (127 - scale).float())
    inv[scale == 0] = 0
    q = (blocks * inv.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(m, hidden)
    return q, scale.to(torch.uint8)


def unswizzle(s, m, hidden):
    mt = -(-m // 128)
    kt = -(-(hidden // 32) // 4)
    return s.reshape(mt, kt, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(mt * 128, kt * 4)


@pytest.mark.parametrize("m, hidden", [(1, 32), (3, 96), (300, 160), (128, 256)])
def test_matches_flashinfer_torch_reference_on_finite(m, hidden):
    g = torch.Generator().manual_seed(m * 1000 + hidden)
    mag = torch.exp2(torch.randint(-140, 120, (m, hidden // 32, 1), generator=g).float())
    x = torch.randn(m, hidden // 32, 32, generator=g) * mag
    x = x.reshape(m, hidden).to(torch.bfloat16)
    x[0, :32] = 0.0  # a zero block
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    q, s = mxfp8_quantize_reference(x)
    q_ref, u_ref = flashinfer_torch_reference(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    full = unswizzle(s, m, hidden)
    assert torch.equal(full[:m, : hidden // 32], u_ref)
    assert (full[m:] == 0).all() and (full[:, hidden // 32 :] == 0).all()
