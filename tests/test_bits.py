"""Exactness tests of lamport_mhc.bits: bf16 RNE, single-rounding fma, the adjacent-pair sum tree.

Expected values are bit patterns worked out by hand (comments give the arithmetic), or exact
rational arithmetic with an RNE written out in Python.
"""

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from lamport_mhc.bits import (
    bf16_bits,
    bf16_round,
    bf16_to_f32,
    canonical_zero,
    fma_f32,
    pairwise_sum,
)

from exact_rounding import round_to_nearest_even


def f32(*bits):
    """fp32 tensor from unsigned 32-bit patterns."""
    b = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in bits], dtype=torch.int32)
    return b.view(torch.float32)


def u32(t):
    """Unsigned 32-bit patterns of an fp32 tensor, as Python ints."""
    return [v & 0xFFFFFFFF for v in t.reshape(-1).view(torch.int32).tolist()]


def u16(t):
    return [v & 0xFFFF for v in t.reshape(-1).view(torch.int16).tolist()]


# ----------------------------------------------------------------------------- bf16


@pytest.mark.parametrize(
    "fp32_bits, bf16",
    [
        (0x3F800000, 0x3F80),  # 1.0 exact
        (0x3F808000, 0x3F80),  # 1 + 2^-8: tie between 0x3F80 (even) and 0x3F81 -> down
        (0x3F818000, 0x3F82),  # 1 + 3*2^-8: tie between 0x3F81 (odd) and 0x3F82 -> up to 1 + 2^-6
        (0x3F808001, 0x3F81),  # just past the tie -> up
        (0x3F807FFF, 0x3F80),  # just below the tie -> down
        (0x3F81FFFF, 0x3F82),  # more than half -> up
        (0xBF808000, 0xBF80),  # -(1 + 2^-8) -> -1.0 (ties to even, sign kept)
        (0xBF818000, 0xBF82),  # -(1 + 3*2^-8) -> -(1 + 2^-6)
        (0x3FFF8000, 0x4000),  # 1.99609375 tie, odd 0x3FFF -> carry into the exponent: 2.0
        (0x7F7F7FFF, 0x7F7F),  # below the halfway point above bf16 max -> max finite
        (0x7F7F8000, 0x7F80),  # halfway above bf16 max, odd -> +inf (IEEE overflow)
        (0x7F7FFFFF, 0x7F80),  # fp32 max -> +inf
        (0xFF7FFFFF, 0xFF80),  # -fp32 max -> -inf
        (0x7F800000, 0x7F80),  # +inf
        (0xFF800000, 0xFF80),  # -inf
        (0x7FC00000, 0x7FC0),  # quiet NaN
        (0xFFC00000, 0x7FC0),  # negative NaN -> the one canonical NaN
        (0x7F800001, 0x7FC0),  # signalling NaN, payload in the low bits (would round to inf)
        (0x7FFFFFFF, 0x7FC0),  # all-ones payload (would carry out of 16 bits)
        (0xFFFFFFFF, 0x7FC0),
        (0x00000000, 0x0000),  # +0
        (0x80000000, 0x8000),  # -0 kept
        (0x00000001, 0x0000),  # smallest fp32 subnormal -> +0
        (0x80000001, 0x8000),  # -> -0
        (0x00008000, 0x0000),  # tie between 0 and the smallest bf16 subnormal -> 0 (even)
        (0x00018000, 0x0002),  # tie between 0x0001 (odd) and 0x0002 -> 0x0002
        (0x00008001, 0x0001),  # just past the tie -> the smallest bf16 subnormal
        (0x80008001, 0x8001),
        (0x007FFFFF, 0x0080),  # largest fp32 subnormal rounds up to the smallest bf16 normal
        (0x00400000, 0x0040),  # 2^-127, an exact bf16 subnormal
    ],
)
def test_bf16_bits_hand_cases(fp32_bits, bf16):
    assert u16(bf16_bits(f32(fp32_bits))) == [bf16]


def test_bf16_bits_matches_torch_cpu_on_random_finite():
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(-(1 << 31), 1 << 31, (100_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = raw.view(torch.float32)
    x = x[torch.isfinite(x)]
    # plus 20k subnormals and 20k values near the bf16 max
    sub = torch.randint(-(1 << 23) + 1, 1 << 23, (20_000,), generator=g, dtype=torch.int32)
    sub = torch.where(sub < 0, (-sub) | torch.tensor(-(1 << 31), dtype=torch.int32), sub)
    big = torch.randint(0x7F700000, 0x7F800000, (20_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat([x, sub.view(torch.float32), big.view(torch.float32), -big.view(torch.float32)])
    assert x.numel() > 100_000
    assert torch.equal(bf16_bits(x), x.to(torch.bfloat16).view(torch.int16))


def test_bf16_bits_any_shape_and_strides():
    x = torch.randn(3, 4, 5).transpose(0, 2)
    assert bf16_bits(x).shape == (5, 4, 3)
    assert torch.equal(bf16_bits(x), x.to(torch.bfloat16).view(torch.int16))
    assert bf16_bits(torch.tensor(1.5)).shape == ()


def test_bf16_round_and_to_f32():
    x = f32(0x3F818000, 0x80000000, 0x7F7FFFFF, 0x7FC00001)
    r = bf16_round(x)
    assert r.dtype == torch.float32
    assert u32(r) == [0x3F820000, 0x80000000, 0x7F800000, 0x7FC00000]
    # exact widening of every pattern, from int16 bits or from a bf16 tensor, NaN payload kept
    bits = torch.tensor([0x3F80, -32768, 0x7FC1, -1, 0x0001], dtype=torch.int16)
    want = [0x3F800000, 0x80000000, 0x7FC10000, 0xFFFF0000, 0x00010000]
    assert u32(bf16_to_f32(bits)) == want
    assert u32(bf16_to_f32(bits.view(torch.bfloat16))) == want
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    widened = bf16_to_f32(every).view(torch.int32)
    assert torch.equal(widened, every.to(torch.int32) * 65536)


def test_canonical_zero():
    bits = torch.tensor([-32768, 0, 1, -1, 0x7FC0, -32767], dtype=torch.int16)
    assert canonical_zero(bits).tolist() == [0, 0, 1, -1, 0x7FC0, -32767]
    as_bf16 = canonical_zero(bits.view(torch.bfloat16))
    assert as_bf16.dtype == torch.bfloat16
    assert as_bf16.view(torch.int16).tolist() == [0, 0, 1, -1, 0x7FC0, -32767]


def test_dtype_validation():
    with pytest.raises(ValueError):
        bf16_bits(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError):
        bf16_to_f32(torch.zeros(2, dtype=torch.float32))
    with pytest.raises(ValueError):
        canonical_zero(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError):
        fma_f32(torch.zeros(2, dtype=torch.float64), 1.0, 0.0)
    with pytest.raises(ValueError):
        pairwise_sum(torch.zeros(2, 0))
    with pytest.raises(ValueError):
        pairwise_sum(torch.zeros(2, dtype=torch.float64))


# ----------------------------------------------------------------------------- exact fp32 RNE


def _bits_to_float(b):
    return struct.unpack("<f", struct.pack("<I", b))[0]


def rne_f32_bits(q: Fraction, negative_zero: bool = False) -> int:
    """Correct IEEE RNE of an exact rational to an fp32 bit pattern (subnormals, overflow)."""
    if q == 0:
        return 0x80000000 if negative_zero else 0
    value = math.copysign(float(round_to_nearest_even(q, 23)), q)  # underflow keeps its sign
    return struct.unpack("<I", struct.pack("<f", value))[0]


def test_rne_helper_itself():
    assert rne_f32_bits(Fraction(1) + Fraction(1, 2**24)) == 0x3F800000  # tie -> even
    assert rne_f32_bits(Fraction(1) + Fraction(3, 2**24)) == 0x3F800002  # tie -> even (up)
    assert rne_f32_bits(Fraction(1, 2**150)) == 0  # half the smallest subnormal -> 0
    assert rne_f32_bits(Fraction(3, 2**151)) == 1
    assert rne_f32_bits(-Fraction(2) ** 128) == 0xFF800000
    assert rne_f32_bits(Fraction(2) ** 128 - Fraction(2) ** 104) == 0x7F7FFFFF  # fp32 max exactly
    assert rne_f32_bits(Fraction(2) ** 128 - Fraction(2) ** 103) == 0x7F800000  # halfway -> inf


# ----------------------------------------------------------------------------- fma


def fma_bits(a_bits, b_bits, c_bits):
    return u32(fma_f32(f32(a_bits), f32(b_bits), f32(c_bits)))[0]


def naive_double_rounding_bits(a_bits, b_bits, c_bits):
    a, b, c = (f32(v).to(torch.float64) for v in (a_bits, b_bits, c_bits))
    return u32((a * b + c).to(torch.float32))[0]


@pytest.mark.parametrize(
    "a, b, c, want",
    [
        # (1 - 2^-24)(1 + 2^-23) = 1 + 2^-24 - 2^-47; + (2^-47 + 2^-60) = 1 + 2^-24 + 2^-60, just above
        # the fp32 halfway point 1 + 2^-24. fp64 rounds the sum onto the halfway point, and RNE from
        # there goes to the even 1.0; the single rounding goes up to 1 + 2^-23.
        (0x3F7FFFFF, 0x3F800001, 0x28000400, 0x3F800001),
        # the mirror image: -(exact) -> -(1 + 2^-23)
        (0xBF7FFFFF, 0x3F800001, 0xA8000400, 0xBF800001),
        # (2^-24 + 2^-44)(1 - 2^-20) = 2^-24 - 2^-64; + (1 + 2^-23) = 1 + 3*2^-24 - 2^-64, just below
        # the halfway point between 1 + 2^-23 (odd) and 1 + 2^-22 (even): fp64 lands on the halfway
        # point and RNE would go up to the even 1 + 2^-22; the single rounding goes down.
        (0x33800008, 0x3F7FFFF0, 0x3F800001, 0x3F800001),
        (0xB3800008, 0x3F7FFFF0, 0xBF800001, 0xBF800001),
    ],
)
def test_fma_double_rounding_traps(a, b, c, want):
    assert fma_bits(a, b, c) == want
    assert naive_double_rounding_bits(a, b, c) != want  # the case really is a trap
    exact = Fraction(_bits_to_float(a)) * Fraction(_bits_to_float(b)) + Fraction(_bits_to_float(c))
    assert rne_f32_bits(exact) == want


@pytest.mark.parametrize(
    "a, b, c, want",
    [
        # (1 + 2^-23)(1 - 2^-23) - 1 = -2^-46 exactly (a*b rounded first would give 0)
        (0x3F800001, 0x3F7FFFFE, 0xBF800000, 0xA8800000),
        # subnormal results: 2^-75 * 2^-75 = 2^-150, a tie between 0 and 2^-149 -> +0 (even)
        (0x1A000000, 0x1A000000, 0x00000000, 0x00000000),
        # 2^-75 * 1.5*2^-75 = 0.75 * 2^-149 -> 2^-149
        (0x1A000000, 0x1A400000, 0x00000000, 0x00000001),
        # 1.5*2^-75 * 2^-74 = 1.5 * 2^-149, a tie between 1 (odd) and 2 units -> 2 units
        (0x1A400000, 0x1A800000, 0x00000000, 0x00000002),
        # 2^-150 + 2^-149 = 1.5 units -> 2 units
        (0x1A000000, 0x1A000000, 0x00000001, 0x00000002),
        # 2^-150 - 2^-149 = -0.5 unit, a tie -> -0 (sign of the exact result)
        (0x1A000000, 0x1A000000, 0x80000001, 0x80000000),
        # 2^-126 (1 + 2^-23) - 2^-126 = 2^-149: normal operands, subnormal result, no flush
        (0x00800000, 0x3F800001, 0x80800000, 0x00000001),
        # 2^127 * 2 - 2^127 = 2^127: the product alone would overflow
        (0x7F000000, 0x40000000, 0xFF000000, 0x7F000000),
        # fp32 max + fp32 max -> +inf
        (0x7F7FFFFF, 0x3F800000, 0x7F7FFFFF, 0x7F800000),
        # signed zeros: -0 * 1 + -0 = -0; -1 * 0 + 0 = +0; 1 * 1 - 1 = +0
        (0x80000000, 0x3F800000, 0x80000000, 0x80000000),
        (0xBF800000, 0x00000000, 0x00000000, 0x00000000),
        (0x3F800000, 0x3F800000, 0xBF800000, 0x00000000),
        # infinities
        (0x7F800000, 0x40000000, 0x40A00000, 0x7F800000),  # inf * 2 + 5
        (0x3F800000, 0x3F800000, 0xFF800000, 0xFF800000),  # 1 + -inf
        (0xFF800000, 0xBF800000, 0x7F800000, 0x7F800000),  # -inf * -1 + inf
    ],
)
def test_fma_hand_cases(a, b, c, want):
    assert fma_bits(a, b, c) == want


@pytest.mark.parametrize(
    "a, b, c",
    [
        (0x7F800000, 0x00000000, 0x3F800000),  # inf * 0
        (0x7F800000, 0x3F800000, 0xFF800000),  # inf - inf
        (0x7FC00000, 0x00000000, 0x00000000),  # NaN operand
        (0x3F800000, 0x3F800000, 0x7FC00000),
    ],
)
def test_fma_nan(a, b, c):
    assert math.isnan(fma_f32(f32(a), f32(b), f32(c)).item())


def test_fma_broadcasting_and_scalars():
    a = torch.arange(3, dtype=torch.float32).reshape(3, 1)
    b = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = fma_f32(a, b, 0.5)
    assert out.shape == (3, 4) and out.dtype == torch.float32
    assert torch.equal(out, a * b + 0.5)  # all exact here


def _random_f32_bits(rng, n, exp_lo, exp_hi):
    sign = rng.integers(0, 2, n, dtype=np.int64) << 31
    exp = rng.integers(exp_lo, exp_hi + 1, n, dtype=np.int64) << 23
    mant = rng.integers(0, 1 << 23, n, dtype=np.int64)
    return (sign | exp | mant).astype(np.uint32)


def test_fma_against_exact_rationals():
    rng = np.random.default_rng(7)
    n = 800
    groups = []
    # any finite exponents (results overflow, underflow, everything between)
    groups.append(tuple(_random_f32_bits(rng, n, 0, 254) for _ in range(3)))
    # products and addends of similar size: heavy cancellation
    a = _random_f32_bits(rng, n, 120, 134)
    b = _random_f32_bits(rng, n, 120, 134)
    prod = (a.view(np.float32).astype(np.float64) * b.view(np.float32).astype(np.float64)).astype(np.float32)
    nudge = rng.integers(-3, 4, n).astype(np.int64)
    c = ((-prod).view(np.uint32).astype(np.int64) + nudge).astype(np.uint32)
    groups.append((a, b, c))
    # subnormal and tiny results: products near 2^-150, addends subnormal
    groups.append((_random_f32_bits(rng, n, 40, 80), _random_f32_bits(rng, n, 40, 80), _random_f32_bits(rng, n, 0, 2)))
    # addend far larger than the product (sticky bits far below the addend's ulp)
    small = (_random_f32_bits(rng, n, 90, 110), _random_f32_bits(rng, n, 90, 110))
    groups.append(small + (_random_f32_bits(rng, n, 126, 130),))
    total = 0
    for a, b, c in groups:
        av = torch.from_numpy(a.view(np.int32).copy()).view(torch.float32)
        bv = torch.from_numpy(b.view(np.int32).copy()).view(torch.float32)
        cv = torch.from_numpy(c.view(np.int32).copy()).view(torch.float32)
        got = u32(fma_f32(av, bv, cv))
        for ai, bi, ci, g in zip(av.tolist(), bv.tolist(), cv.tolist(), got):
            p = Fraction(ai) * Fraction(bi)
            exact = p + Fraction(ci)
            neg_zero = (math.copysign(1.0, ai) * math.copysign(1.0, bi) < 0) and math.copysign(1.0, ci) < 0
            want = rne_f32_bits(exact, negative_zero=(p == 0 and ci == 0 and neg_zero))
            assert g == want, (ai, bi, ci, hex(g), hex(want))
            total += 1
    assert total == 4 * n


# ----------------------------------------------------------------------------- pairwise sum


def test_pairwise_sum_differs_from_left_to_right_and_torch_sum():
    x = torch.tensor([1e8, 1.0, -1e8, 1.0], dtype=torch.float32)
    # (1e8 + 1) rounds to 1e8 (ulp 8), (-1e8 + 1) to -1e8: the tree gives 0
    assert pairwise_sum(x).item() == 0.0
    left_to_right = ((x[0] + x[1]) + x[2]) + x[3]
    assert left_to_right.item() == 1.0
    assert torch.sum(x).item() == 1.0


def test_pairwise_sum_padding_non_power_of_two():
    # [2^24, 1, 1, 1, 1] -> ((2^24 + 1) + (1 + 1)) + ((1 + 0) + (0 + 0))
    #  = (2^24 + 2) + 1 = 2^24 + 3, a tie between 2^24 + 2 (odd) and 2^24 + 4 -> 2^24 + 4.
    x = torch.tensor([2.0**24, 1, 1, 1, 1], dtype=torch.float32)
    assert pairwise_sum(x).item() == 16777220.0
    acc = torch.tensor(0.0)
    for v in x:
        acc = acc + v
    assert acc.item() == 16777216.0  # left to right loses every 1


def test_pairwise_sum_signed_zero_padding():
    def bits(v):
        return u32(pairwise_sum(torch.tensor(v, dtype=torch.float32)))

    assert bits([-0.0]) == [0x80000000]  # length 1: the value itself
    assert bits([-0.0, -0.0]) == [0x80000000]
    assert bits([-0.0, -0.0, -0.0]) == [0x00000000]  # (-0 + -0) + (-0 + +0 pad) = +0


def test_pairwise_sum_batched_against_numpy_tree():
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 7, 8, 33, 100):
        x = torch.randn(4, 3, n, generator=g) * torch.exp2(torch.randint(-5, 20, (4, 3, n), generator=g).float())
        got = pairwise_sum(x)
        assert got.shape == (4, 3)
        xs = x.numpy().reshape(-1, n)
        width = 1 << (n - 1).bit_length()
        want = []
        for row in xs:
            level = list(row) + [np.float32(0.0)] * (width - n)
            while len(level) > 1:
                level = [np.float32(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
            want.append(level[0])
        want = torch.from_numpy(np.array(want, dtype=np.float32)).reshape(4, 3)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
