"""The bit contract's arithmetic as Triton functions that give the same bits on the GPU and under
the interpreter.

bf16 values travel as int16 bit patterns: the interpreter has no bf16 arithmetic and truncates
fp32 -> bf16 casts, so rounding is integer arithmetic here, which is exact on both. Kernels are
compiled with fp fusion off; every multiply-add the contract fuses goes through ``ptx.fma_rn``.
"""

import triton
import triton.language as tl



from lamport_mhc import layout

from . import ptx

SENTINEL = tl.constexpr(layout.SENTINEL_INT16)  # bf16 -0.0 as int16


@triton.jit
def bf16_to_f32(bits, ON_GPU: tl.constexpr):
    """int16 bf16 bit pattern -> exact fp32."""
    if ON_GPU:
        return ptx.bf16x2_to_f32(bits)
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def widened_pairs(words, ROWS: tl.constexpr, PAIRS: tl.constexpr):
    """fp32 bits (int32) of the bf16 values packed two to an int32 in ``words`` ([ROWS, PAIRS], column
    2k in the low half of word k), as [ROWS, 2 * PAIRS] in column order: a shift or a mask a value,
    interleaved in each thread's registers. The same integer arithmetic on the GPU and under the
    interpreter."""
    return tl.reshape(tl.join(words << 16, words & -65536), (ROWS, 2 * PAIRS))


@triton.jit
def widened_row(words, PAIRS: tl.constexpr):
    """fp32 values of a row of bf16 loaded as ``PAIRS`` words of two (``widened_pairs`` of one row)."""
    return tl.reshape(widened_pairs(words[None, :], 1, PAIRS), (2 * PAIRS,)).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16(x, ON_GPU: tl.constexpr, ANY_NAN: tl.constexpr = False):
    """fp32 -> bf16 bits (int16), round to nearest even; every NaN becomes 0x7FC0. On the GPU
    ``ptx.bf16x2_rn`` (two values an instruction); the interpreter's cast truncates, so its twin
    rounds in integers (the same bits). ``ANY_NAN``: for a value no output takes as it is (a NaN
    reaches an output only through arithmetic, and every output is canonicalized where it is made),
    a NaN may come out as the hardware's: one instruction fewer a pair on the GPU."""
    if ON_GPU:
        if ANY_NAN:
            return ptx.bf16x2_rn_raw(x)
        return ptx.bf16x2_rn(x)
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = tl.where(is_nan, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def canonical_zero(bits):
    """-0.0 -> +0.0 on bf16 bits, so a published value never equals the sentinel."""
    return tl.where(bits == SENTINEL, 0, bits).to(tl.int16)


@triton.jit
def pairwise_sum(x, N: tl.constexpr):
    """Sum of the power-of-two-long vector ``x`` by a tree of adjacent pairs (the contract's order).
    Each level sums an axis of two elements, which is exactly one rounded add whatever order the
    compiler picks (and compiles far faster than reshape + split)."""
    for _ in tl.static_range(N.bit_length() - 1):
        x = tl.sum(tl.reshape(x, (x.numel // 2, 2)), axis=1)
    return tl.sum(x, axis=0)


@triton.jit
def subtree_roots(x, N: tl.constexpr, PARTS: tl.constexpr):
    """The roots of the ``PARTS`` aligned subtrees of ``pairwise_sum``'s tree over the
    power-of-two-long ``x`` (``pairwise_columns`` of them gives its root). With a part per warp
    every level stays inside a warp: no barrier."""
    x = tl.reshape(x, (PARTS, N // PARTS))
    for level in tl.static_range((N // PARTS).bit_length() - 1):
        x = tl.sum(tl.reshape(x, (PARTS, N // PARTS >> (level + 1), 2)), axis=2)
    return tl.sum(x, axis=1)


@triton.jit
def pairwise_of(values, first: tl.constexpr, N: tl.constexpr):
    """``pairwise_sum``'s tree over the N (a power of two, at most 8) values ``values[first:first + N]``
    of a tuple."""
    tl.static_assert((N == 1) | (N == 2) | (N == 4) | (N == 8), "a tree of 1, 2, 4 or 8 values")
    if N == 1:
        total = values[first]
    elif N == 2:
        total = values[first] + values[first + 1]
    elif N == 4:
        total = (values[first] + values[first + 1]) + (values[first + 2] + values[first + 3])
    else:
        total = (((values[first] + values[first + 1]) + (values[first + 2] + values[first + 3]))
                 + ((values[first + 4] + values[first + 5]) + (values[first + 6] + values[first + 7])))
    return total


@triton.jit
def pairwise_columns(x, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """``pairwise_sum`` down each column of the [ROWS, COLUMNS] block ``x`` (ROWS a power of two)."""
    for level in tl.static_range(ROWS.bit_length() - 1):
        x = tl.sum(tl.reshape(x, (ROWS >> (level + 1), 2, COLUMNS)), axis=1)
    return tl.sum(x, axis=0)


@triton.jit
def row_of(bits2d, rows, r):
    """Row ``r`` of an integer 2-D block, extracted exactly (an integer sum of one value and zeros)."""
    return tl.sum(tl.where(rows[:, None] == r, bits2d, 0), axis=0)


@triton.jit
def ue8m0_scale(amax):
    """FlashInfer's float_to_ue8m0_fast of amax * fp32(1/448): exponent, +1 if any mantissa bit,
    no bump for values <= 2^-127, capped at 254 (NaN and Inf give 254), 0 for zero."""
    inv448 = tl.full([], 0x3B124925, tl.int32).to(tl.float32, bitcast=True)
    s = (amax * inv448).to(tl.int32, bitcast=True)
    e = (s >> 23) & 0xFF
    m = s & 0x7FFFFF
    bump = (m != 0) & ((e != 0) | (m > 0x400000))
    u = tl.minimum(e + bump.to(tl.int32), 254)
    return tl.where(s <= 0, 0, u)


@triton.jit
def inverse_scale(u):
    """2^(127-u) from its bits; 0 for u == 0 (and, as FlashInfer, for u == 254)."""
    bits = tl.maximum(254 - u, 0) << 23
    return tl.where(u == 0, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def f32_to_e4m3(v, ON_GPU: tl.constexpr):
    """fp32 -> float8_e4m3fn bits (uint8), round to nearest even, after FlashInfer's clamp to +-448
    (a NaN becomes +448, as min.f32/max.f32 return the number). On the GPU the conversion is
    FlashInfer's own instruction, which saturates below -448 itself: one ``min.f32`` with 448
    (NaN -> 448) does the rest of the clamp. The interpreter rounds in integers (the same bits)."""
    if ON_GPU:
        return ptx.e4m3_rn(tl.minimum(v, 448.0))
    v = tl.where(v != v, 448.0, v)
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    u = v.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # rebias 127 -> 7, 3 mantissa bits
    # Below 2^-6 e4m3 is subnormal, in steps of 2^-9: round |v| * 512 to an integer (exact scaling,
    # then the 2^23 trick rounds to nearest even).
    scaled = a.to(tl.float32, bitcast=True) * 512.0
    sub = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)
    return (sign | tl.where(a >= 0x3C800000, normal, sub)).to(tl.uint8)


@triton.jit
def scale_offset(row, col, PADDED_COLS: tl.constexpr):
    """Byte of scale (row, col) in FlashInfer's swizzled 128x4 layout."""
    return ((col % 4) + (col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4
            + (row // 128) * (128 * PADDED_COLS))
