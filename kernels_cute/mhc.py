"""The mHC math of one 16-byte fragment (8 bf16 columns of a token), shared by both consumer forms
(``consumer``: a token over a cluster of CTAs; ``streaming``: a token per CTA, looping over the row).
Every fp32 operation is the contract's (``primitives``' explicit ``.rn`` instructions), every bf16
rounding ``primitives.bf16x2_rn`` (two lanes a word); see ``lamport_mhc.reference`` for the steps.

- ``reduced_from_mailbox``: the all-reduced fragment from the Lamport mailbox (LL: every source's
  slot, summed in rank order; BT: the owner's sum), re-arming what it read;
- ``local_reduced``: the same for a group of one, from the contribution this thread computes
  itself (``x`` or the MoE finalize): ``bf16(0 + c)``, -0.0 -> +0.0;
- ``mix``: post-mix of the hc streams and (norm variants) the collapse with the pre-mix, word by
  word in program order where ``ordered_after`` ties them;
- ``fragment_node``, ``ordered_butterfly_sum``, ``tree_sum``: the norm's adjacent-pair tree;
- ``inverse_rms``, ``layer_words``: RMSNorm; ``store_mxfp8``: the layer input as MXFP8 (the block
  scale through FlashInfer's helpers, the conversion as Triton's: one ``min.f32`` a value).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32
from flashinfer.quantization.quantization_cute_dsl_utils import (INV_FLOAT8_E4M3_MAX, bfloat2_hmax_reduce_to_f32,
                                                                bfloat2_max_abs_4,
                                                                compute_sf_index_swizzled_128x4_gpu,
                                                                float_to_ue8m0_fast, reduce_max_4threads,
                                                                ue8m0_to_inv_scale_fast)

from lamport_mhc import layout

from . import lamport, primitives
from .numerics import LANES, WORDS, canonical_zero_word, high_f32, low_f32, pack
from .publish import finalize_fragment

WARP = 32
WARP_ELEMENTS = WARP * LANES                                # 256 columns: one warp's aligned subtree
FRAGMENTS_PER_SCALE = layout.MXFP8_BLOCK // LANES            # 4 threads share one scale
FRAGMENTS_PER_SCALE_WORD = FRAGMENTS_PER_SCALE * layout.SCALE_TILE_COLS  # 16 threads: 4 scale bytes


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_scale_cols(hidden: int) -> int:
    return -(-(hidden // layout.MXFP8_BLOCK) // layout.SCALE_TILE_COLS) * layout.SCALE_TILE_COLS


def tree_sum(values):
    """Adjacent-pair tree of a power-of-two-long list of fp32 values, every add ``add.rn``. ``None``
    stands for a padding +0.0: a node of two padding subtrees is +0.0 + +0.0 = +0.0 exactly, so it
    is folded here; every other node, ``x + 0.0`` included, is one ``add.rn``."""
    while len(values) > 1:
        pairs = [(values[i], values[i + 1]) for i in range(0, len(values), 2)]
        values = [None if a is None and b is None else
                  primitives.add_rn(Float32(0.0) if a is None else a, Float32(0.0) if b is None else b)
                  for a, b in pairs]
    return Float32(0.0) if values[0] is None else values[0]


def tree_adds(leaves: int, width: int) -> int:
    """``add.rn`` count of ``tree_sum`` over ``leaves`` values padded to ``width``."""
    adds = 0
    while width > 1:
        leaves, width = -(-leaves // 2), width // 2
        adds += leaves
    return adds


def lane_f32(words, lane: int) -> Float32:
    word = words[lane // 2]
    return low_f32(word) if lane % 2 == 0 else high_f32(word)


def lanes_f32(words) -> list:
    return [lane_f32(words, lane) for lane in range(LANES)]


# -- the all-reduced fragment ----------------------------------------------------------------------

@cute.jit
def reduced_from_mailbox(mailbox: cute.Tensor, gen: Int64, generation: Int32, token: Int32, column: Int32,
                         timeout_ns: Int64, error: cute.Tensor, capacity: Int32, tp: cutlass.Constexpr[int],
                         hidden: cutlass.Constexpr[int], bt: cutlass.Constexpr[bool]):
    """bf16 words of the all-reduced fragment, once every source has landed; re-arms what it read."""
    if cutlass.const_expr(bt):
        slot = lamport.element_address(mailbox, (gen * Int64(capacity) + Int64(token)) * Int64(hidden)
                                       + Int64(column))
        words = lamport.poll([slot], timeout_ns, error, [-1], generation, token)[0]
        primitives.store_sentinel_v4(slot)
        out = list(words)
    else:
        slots = [lamport.element_address(mailbox, ((gen * Int64(tp) + Int64(source)) * Int64(capacity)
                                                   + Int64(token)) * Int64(hidden) + Int64(column))
                 for source in range(tp)]
        acc = lamport.sum_sources(slots, timeout_ns, error, generation, token)
        for source in cutlass.range_constexpr(tp):
            primitives.store_sentinel_v4(slots[source])
        out = [canonical_zero_word(primitives.bf16x2_rn(acc[2 * i], acc[2 * i + 1])) for i in range(WORDS)]
    return out[0], out[1], out[2], out[3]


@cute.jit
def local_reduced(x: cute.Tensor, gemm2: cute.Tensor, weights: cute.Tensor, indices: cute.Tensor, token: Int32,
                  column: Int32, hidden: cutlass.Constexpr[int], top_k: cutlass.Constexpr[int],
                  finalize: cutlass.Constexpr[bool], policy=None):
    """bf16 words of a group of one's reduced fragment: its own contribution (``x``, or the MoE
    finalize with ``x`` the shared expert output), then the contract's sum of one rank,
    ``bf16(0 + c)`` with ``add.rn`` (which also turns a NaN into 0x7FC0). For a bf16 ``c``,
    ``0 + c`` is exact but for -0.0, which it makes +0.0: so neither ``x`` nor the finalize needs
    canonicalization before it, and no sum needs one after it. ``policy``: the loads' L2 cache
    policy."""
    if cutlass.const_expr(finalize):
        words = finalize_fragment(x, gemm2, weights, indices, token, column, hidden, top_k, False, policy)
    else:
        words = primitives.load_v4(lamport.element_address(x, Int64(token) * Int64(hidden) + Int64(column)), None,
                                   policy)
    out = [primitives.bf16x2_rn(primitives.add_rn(Float32(0.0), low_f32(words[i])),
                                primitives.add_rn(Float32(0.0), high_f32(words[i]))) for i in range(WORDS)]
    return out[0], out[1], out[2], out[3]


# -- post-mix and collapse -------------------------------------------------------------------------

@cute.jit
def ordered_after(word: Uint32, earlier: Uint32, zero: Uint32) -> Uint32:
    """``word``, made to depend on ``earlier`` through ``zero``: a runtime 0 that ptxas cannot prove
    0 (one LOP3). Once a fragment's inputs are in, ptxas interleaves every independent chain
    breadth-first (a streaming fragment's 32 mix chains, the next iteration's address arithmetic),
    and the values that keeps live spilled under the launch bound; the dependency keeps each word's
    (each iteration's) work after the one before it, as written."""
    return word | (earlier & zero)


@cute.jit
def mix(reduced, streams, post_mix, comb_mix, pre_mix, hc: cutlass.Constexpr[int], norm: cutlass.Constexpr[bool],
        zero=None):
    """Per lane: ``m[j] = reduced * post[j]``, then ``m[j] = fma(res[s], comb[s, j], m[j])`` in
    source order, ``out[j] = bf16(m[j])``; with the norm, ``prenorm = bf16(fma(out[j], pre[j], .))``
    over j in target order from +0. Returns (the hc output fragments as words, the prenorm fragment
    as words or None). Lanes are independent, so each lane's collapse follows its own mix; the two
    lanes of a word are rounded together. With ``zero`` (``ordered_after``), each word is mixed
    after the one before it."""
    out_words = [[None] * WORDS for _ in range(hc)]   # [target][word]
    prenorm_words = [None] * WORDS if cutlass.const_expr(norm) else None
    for i in cutlass.range_constexpr(WORDS):
        word = reduced[i]
        if cutlass.const_expr(zero is not None and i > 0):
            word = ordered_after(word, last_word(out_words, prenorm_words, i - 1), zero)
        values = (low_f32(word), high_f32(word))
        acc = [Float32(0.0), Float32(0.0)]
        for j in cutlass.range_constexpr(hc):
            m = [primitives.mul_rn(value, post_mix[j]) for value in values]
            for s in cutlass.range_constexpr(hc):
                m = [primitives.fma_rn(lane_f32(streams[s], lane), comb_mix[s][j], m[k])
                     for k, lane in enumerate((2 * i, 2 * i + 1))]
            out_words[j][i] = primitives.bf16x2_rn(m[0], m[1])
            if cutlass.const_expr(norm):
                acc = [primitives.fma_rn(low_f32(out_words[j][i]), pre_mix[j], acc[0]),
                       primitives.fma_rn(high_f32(out_words[j][i]), pre_mix[j], acc[1])]
        if cutlass.const_expr(norm):
            prenorm_words[i] = primitives.bf16x2_rn(acc[0], acc[1])
    return out_words, prenorm_words


def last_word(out_words, prenorm_words, i: int):
    """The last value ``mix`` computes for word ``i``: its prenorm word, or without the norm the
    last target's."""
    return out_words[-1][i] if prenorm_words is None else prenorm_words[i]


# -- the norm's sum of squares ---------------------------------------------------------------------

@cute.jit
def fragment_node(prenorm_words, in_row) -> Float32:
    """The 3-level tree of a fragment's 8 rounded squares: an aligned 8-element subtree of the row
    (+0.0 for a fragment past H, as the contract's padding)."""
    squares = []
    for lane in cutlass.range_constexpr(LANES):
        value = lane_f32(prenorm_words, lane)
        squares.append(primitives.mul_rn(value, value))
    node = tree_sum(squares)
    if cutlass.const_expr(in_row is not None):
        node = Float32(cutlass.select_(in_row, node, Float32(0.0)))
    return node


@cute.jit
def ordered_butterfly_sum(value: Float32, lane: Int32) -> Float32:
    """Sum of a warp's 32 values by the adjacent-pair tree: at level ``d`` lane ``i`` joins its
    aligned group with that of lane ``i ^ d``, the lower-addressed group as the first operand, so
    every lane computes the same rounded node."""
    for level in cutlass.range_constexpr(5):
        distance = 1 << level
        other = cute.arch.shuffle_sync_bfly(value, offset=distance)
        upper = (lane & Int32(distance)) != Int32(0)
        first = Float32(cutlass.select_(upper, other, value))
        second = Float32(cutlass.select_(upper, value, other))
        value = primitives.add_rn(first, second)
    return value


@cute.jit
def inverse_rms(sum_squares: Float32, hidden: cutlass.Constexpr[int], eps: Float32) -> Float32:
    """``1 / sqrt(ss / H + eps)`` with IEEE ``div.rn``, ``add.rn``, ``sqrt.rn``, ``div.rn``."""
    mean = primitives.add_rn(primitives.div_rn(sum_squares, Float32(float(hidden))), eps)
    return primitives.div_rn(Float32(1.0), primitives.sqrt_rn(mean))


@cute.jit
def layer_words(prenorm_words, inv_rms: Float32, gamma_words):
    """``bf16((prenorm * inv_rms) * gamma)`` of a fragment, as words."""
    layer = [primitives.mul_rn(primitives.mul_rn(lane_f32(prenorm_words, lane), inv_rms), lane_f32(gamma_words, lane))
             for lane in range(LANES)]
    return [primitives.bf16x2_rn(layer[2 * i], layer[2 * i + 1]) for i in range(WORDS)]


# -- MXFP8 -----------------------------------------------------------------------------------------

@cute.jit
def scale_address(scales: cute.Tensor, row: Int32, col: Int32, padded_cols: cutlass.Constexpr[int]) -> Int64:
    """Byte of scale (row, col) in FlashInfer's swizzled 128x4 layout."""
    return lamport.element_address(scales, Int64(compute_sf_index_swizzled_128x4_gpu(row, col, Int32(padded_cols))))


@cute.jit
def store_mxfp8(layer, values: cute.Tensor, scales: cute.Tensor, token: Int32, num_tokens: Int32, fragment: Int32,
                column: Int32, in_row: Boolean, tidx: Int32, hidden: cutlass.Constexpr[int],
                spread_padding: cutlass.Constexpr[bool] = False):
    """The layer input as MXFP8 (``lamport_mhc.mxfp8`` states the rules): 4 consecutive threads
    (consecutive fragments of the row) hold one 32-element block. The block max and its UE8M0 scale
    are FlashInfer's helpers, as its MXFP8 kernel calls them; each value times the inverse scale is
    ``primitives.e4m3x2_rn``'s, whose single clamp gives the bits of FlashInfer's two. Every thread
    of the warp takes part in the shuffles; only those in the row store."""
    padded_cols = padded_scale_cols(hidden)
    block_max = reduce_max_4threads(bfloat2_hmax_reduce_to_f32(bfloat2_max_abs_4(*layer)))
    u = float_to_ue8m0_fast(primitives.mul_rn(block_max, Float32(INV_FLOAT8_E4M3_MAX)))
    inv_scale = ue8m0_to_inv_scale_fast(u)
    scaled = [primitives.mul_rn(lane_f32(layer, lane), inv_scale) for lane in range(LANES)]
    codes = [primitives.e4m3x2_rn(scaled[2 * i], scaled[2 * i + 1]) for i in range(WORDS)]
    if in_row:
        primitives.store_v2(lamport.element_address(values, Int64(token) * Int64(hidden) + Int64(column)),
                            pack(codes[0], codes[1]), pack(codes[2], codes[3]))

    # Scale columns 4k..4k+3 are 4 consecutive bytes of the swizzled layout: the 16 threads of
    # those blocks gather them into one word, stored by the first.
    col = fragment // Int32(FRAGMENTS_PER_SCALE)
    word = u << (Uint32(8) * Uint32(col % Int32(4)))
    for level in cutlass.range_constexpr(2):
        word = word | Uint32(cute.arch.shuffle_sync_bfly(word, offset=FRAGMENTS_PER_SCALE << level))
    lane = tidx % Int32(FRAGMENTS_PER_SCALE_WORD)
    leader = in_row & (lane == Int32(0))
    if leader:
        primitives.store_b32(scale_address(scales, token, col, padded_cols), Int32(word))
    # Rows [M, roundup(M, 128)) of the last scale tile are zero: fewer than 128 rows, split into one
    # contiguous run per token. ``spread_padding`` (few tokens, long runs: 127 rows at M = 1) spreads
    # a run over the 16 threads of the word's group; otherwise the word's first thread stores it.
    zeroing, first_row, row_step = leader, Int32(0), 1
    if cutlass.const_expr(spread_padding):
        zeroing, first_row, row_step = in_row, lane, FRAGMENTS_PER_SCALE_WORD
    # No padding rows (M a multiple of 128, as at every large M): no division.
    padding = (num_tokens + Int32(127)) // Int32(128) * Int32(128) - num_tokens
    if zeroing & (padding > Int32(0)):
        run = (padding + num_tokens - Int32(1)) // num_tokens
        first = num_tokens + token * run
        word_col = col - col % Int32(4)
        for i in cutlass.range(first_row, run, row_step):
            row = first + i
            if row < num_tokens + padding:
                primitives.store_b32(scale_address(scales, row, word_col, padded_cols), Int32(0))
