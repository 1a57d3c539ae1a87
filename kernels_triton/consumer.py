"""The mHC consumer: per token, wait for the call's reduced sublayer output, post-mix the hc residual
streams, collapse them with the pre-mix, RMS-normalize, and optionally write the layer input as MXFP8.

The row is walked in ``CHUNKS`` aligned chunks of ``CHUNK`` columns (a power of two; the last chunk
is masked where CHUNK does not divide HIDDEN), 16 bytes per thread and access, so no program holds
the whole row and none pads it to a power of two. A token is taken by ``SPLIT`` programs, adjacent
in the 1-D grid: SPLIT = 1 streams (a program walks the row twice: bandwidth, large M); SPLIT =
CHUNKS is the cooperative form (a program per chunk: latency, small M).

The norm's sum of squares stays the contract's adjacent-pair tree over the row padded with +0 to a
power of two: every chunk is an aligned subtree of it, so each chunk's own tree, and the chunk roots
joined by the same tree (padded with +0 roots), give its bits; a taller tree only adds +0.0 at its
root, which is exact for every sum of squares.
- Streaming: between the two passes the prenormalized row (its bf16 bits: the contract rounds it
  there anyway) is held in registers (``HOLD``) or parked: on the GPU in a shared array of the CTA
  (``PARKED_BYTES``, ``ptx.parked_area``), under the interpreter in ``layer_out``. Parked in
  ``layer_out``, a row waited there long enough (one program takes a token's whole row) to be
  written back to HBM and read again: 10% more HBM bytes for the finalize at H = 7168. The local
  parked forms (and the held twin of 16 warps, ``plan.broad_held_chunk``) keep each warp's part of
  each chunk's sum of squares in a table past the row (``ROOTS_TABLE_BYTES``, ``ptx.table_part``),
  joined once the row is done; the others join them across warps through Triton's own shared memory.
- Cooperative: a program keeps its prenormalized chunk in registers and exchanges its chunk's sum
  of squares with the token's other programs, which are one cluster of CTAs
  (``plan.KernelInstance.cluster``): each warp stores its part (the root of its subtree) into every
  CTA's shared memory, one cluster barrier, then every thread joins the parts by the tree and each
  program normalizes its own chunk. The cluster is scheduled at once, so no program waits for one
  that has not started. The simulated group parks the chunk roots in ``parked_roots`` (fp32
  [capacity, CHUNKS]) instead.

Specialized by constexprs:
- ``PUBLISH`` (LL only): 0, the publish kernel ran before; otherwise the call is one kernel, whose
  programs first store their chunks of the token's contribution (1: ``x``, 2: the MoE finalize) into
  every rank's mailbox and then consume them. Every program must be resident at once, as each waits
  for its twins on the other ranks.
- ``PHASES``: which of publish / mix / normalize a launch runs (bits; the GPU runs all in one). The
  simulated group, which runs ranks and programs one after another, launches them separately: the
  one-kernel form's publish before any rank consumes, and the cooperative form's normalize after
  all of the rank's programs have parked their roots (its prenormalized chunks parked in ``layer_out``).
- ``LOCAL`` (a group of one, with ``PUBLISH`` naming the contribution): the contribution is the
  reduced row (the contract's sum of one contribution); no mailbox, no poll, no generation.
- ``REDUCED`` (BT): the mailbox holds the owners' sums ``[gen][t]``; otherwise (LL) it holds every
  rank's contribution ``[gen][rank][t]``, summed here in rank order. LL advances the generation
  (BT's owner reduce already did).
- ``VARIANT``: 0 plain, 1 quant (also MXFP8 values and swizzled 128x4 UE8M0 scales, zeroing the
  scales of the padding rows), 2 residual-only (writes only the residual streams).
- ``STREAMED``: cache hints for the bytes a call moves once: the contribution's inputs and the
  streams are loaded ``evict_first``, the streams out stored ``.cs`` (the layer input, which the
  next GEMM reads, is stored plainly). Which calls take them: ``traffic.STREAMED_ROWS``.
- ``PREFETCH`` (the parked streaming form of x, the broad held twin): each chunk's inputs are loaded
  while the chunk before is mixed (nothing past the last chunk in rows of three or more: the loop
  leaves it off), and (parked) gamma a chunk ahead in the second pass, the first chunk's before the
  barrier that ends the first pass (``plan.PARKED_PREFETCH_VARIANTS``).
- ``PER_THREAD_WEIGHTS``: every thread holds all of the token's mix weights (``_mix_weights``);
  otherwise they are spread over the program's threads. With it, the local cooperative form of x
  (the latency form) stores the mixed streams after the exchange in calls of few rows
  (``LATE_STORE_MAX_ROWS``).
- ``ROOTS_TABLE_BYTES`` (the local parked forms, the broad held twin): the bytes of the roots table
  past the parked row, or all of ``PARKED_BYTES`` where the row is held (``plan.roots_table_bytes``;
  0: none).
Every step follows the bit contract of ``lamport_mhc.reference``; see DESIGN.md.
"""

import triton
import triton.language as tl

from . import lamport, ptx

from .publish import FOUR_BYTE_ALIGNED, contribution_chunk
from .numerics import (bf16_to_f32, canonical_zero, f32_to_bf16, f32_to_e4m3, inverse_scale,
                       pairwise_columns, pairwise_of, pairwise_sum, row_of, scale_offset, subtree_roots, ue8m0_scale,
                       widened_pairs, widened_row)

PLAIN, QUANT, RESIDUAL_ONLY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
NO_PUBLISH, PUBLISH_X, PUBLISH_FINALIZE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# PHASES bits.
PUBLISH_PHASE, MIX_PHASE, NORMALIZE_PHASE = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4)
ALL_PHASES = tl.constexpr(7)
# Calls of at most this many rows store the latency form's mixed streams after the cluster exchange
# (``LATE_STORES``). One H200, tp = 1, H = 7168, us late / early: plain M = 1 / 4 / 8 / 16 2.16 /
# 2.27, 2.17 / 2.26, 2.28 / 2.25, 2.51 / 2.53; quant M = 16 2.86 / 2.78.
LATE_STORE_MAX_ROWS = tl.constexpr(8)


@triton.jit
def _reduced_chunk(mailbox_ptr, gen, token, h, in_row, timeout_ns, error_ptr, generation, capacity,
                   TP: tl.constexpr, HIDDEN: tl.constexpr,
                   REDUCED: tl.constexpr, ON_GPU: tl.constexpr):
    """bf16 bits of the all-reduced chunk, once every source has landed; re-arms what it read."""
    if REDUCED:
        slot = mailbox_ptr + (gen * capacity + token) * HIDDEN + h
        reduced = lamport.poll(slot, in_row, timeout_ns, error_ptr, -1, generation, token, ON_GPU)
        lamport.rearm(slot, in_row)
    else:
        acc = tl.zeros(h.shape, tl.float32)
        for source in tl.static_range(TP):
            slot = mailbox_ptr + ((gen * TP + source) * capacity + token) * HIDDEN + h
            values = lamport.poll(slot, in_row, timeout_ns, error_ptr, source, generation, token, ON_GPU)
            acc = acc + bf16_to_f32(values, ON_GPU)
        for source in tl.static_range(TP):
            lamport.rearm(mailbox_ptr + ((gen * TP + source) * capacity + token) * HIDDEN + h, in_row)
        reduced = canonical_zero(f32_to_bf16(acc, ON_GPU))
    return reduced


@triton.jit
def _mix_chunk(reduced, residual, post, comb, pre, streams, token, h, in_row, residual_out_ptr,
               layer_out_ptr, HIDDEN: tl.constexpr, HC: tl.constexpr, BLOCK_HC: tl.constexpr,
               CHUNK: tl.constexpr, VARIANT: tl.constexpr, PARK: tl.constexpr, PARKED_BYTES: tl.constexpr,
               STREAMED: tl.constexpr, ON_GPU: tl.constexpr, PER_THREAD_WEIGHTS: tl.constexpr,
               STORE_STREAMS: tl.constexpr, area=None):
    """The first pass over one chunk (``reduced``: its fp32 values): post-mix the streams (and store
    them, if ``STORE_STREAMS``); then (with the norm) collapse and return the roots of the squares'
    tree's subtrees of a warp each (``subtree_roots``: the chunk's tree goes on across warps later),
    the prenormalized chunk's bf16 bits and the mixed streams' (for ``_store_streams``), having
    parked the chunk (``_park``) if ``PARK``.
    The streams come as one tile (``_load_streams``' words), each thread holding all its rows, and the
    mix runs on the tile: as HC separate vectors with scalar weights, ptxas issued two of the streams'
    loads only when the mix reached them (a second memory latency), 1.3-1.5 us slower at M = 64-128
    on one H200. The weights come as ``_mix_weights`` loaded them."""
    # Post-mix, all targets at once: m[j] = reduced * post[j], then m[j] = fma(res[s], comb[s, j], m[j]).
    mixed = reduced[None, :] * post[:, None]
    # Widened here, where used: held across a wait or a loop, words take half the registers.
    residual = widened_pairs(residual, BLOCK_HC, CHUNK // 2)
    for source in tl.static_range(HC):
        stream = row_of(residual, streams, source).to(tl.float32, bitcast=True)
        if PER_THREAD_WEIGHTS:
            weights = comb[source]
        else:
            weights = row_of(comb, streams, source).to(tl.float32, bitcast=True)
        mixed = ptx.fma_rn(tl.broadcast_to(stream[None, :], (BLOCK_HC, CHUNK)),
                           tl.broadcast_to(weights[:, None], (BLOCK_HC, CHUNK)), mixed, ON_GPU)
    residual_out = f32_to_bf16(mixed, ON_GPU)
    if STORE_STREAMS:
        _store_streams(residual_out, token, h, in_row, streams, residual_out_ptr, HIDDEN, HC, STREAMED)
    PARTS: tl.constexpr = CHUNK // 256  # a part per warp (plan.row_warps)
    roots = tl.zeros([PARTS], tl.float32)
    prenorm_bits = tl.zeros([CHUNK], tl.int16)
    if VARIANT != RESIDUAL_ONLY:
        # Collapse with the pre-mix, in target order.
        collapsed = tl.zeros([CHUNK], tl.float32)
        for target in tl.static_range(HC):
            if PER_THREAD_WEIGHTS:
                weight = pre[target]
            else:
                weight = tl.sum(tl.where(streams == target, pre, 0)).to(tl.float32, bitcast=True)
            stream = bf16_to_f32(row_of(residual_out.to(tl.int32), streams, target).to(tl.int16), ON_GPU)
            collapsed = ptx.fma_rn(stream, tl.broadcast_to(weight, (CHUNK,)), collapsed, ON_GPU)
        prenorm_bits = f32_to_bf16(collapsed, ON_GPU, ANY_NAN=True)  # not an output: the norm's is
        if PARK:
            _park(prenorm_bits, token, h, in_row, layer_out_ptr, HIDDEN, PARKED_BYTES, area)
        prenorm = bf16_to_f32(prenorm_bits, ON_GPU)
        roots = subtree_roots(tl.where(in_row, prenorm * prenorm, 0.0), CHUNK, PARTS)
    return roots, prenorm_bits, residual_out


@triton.jit
def _store_streams(residual_out, token, h, in_row, streams, residual_out_ptr, HIDDEN: tl.constexpr,
                   HC: tl.constexpr, STREAMED: tl.constexpr):
    """Store the mixed streams of columns ``h`` (``_mix_chunk``'s [BLOCK_HC, CHUNK] bf16 bits)."""
    tile = (token * HC + streams[:, None]) * HIDDEN + h[None, :]
    # (Stored under an L2 evict_first cache policy instead, as the CuTe kernel stores them, the
    # quant calls at M = 1024 took 1% longer on one H200: H 4096 / 5120 / 7168 24.8 / 31.8 / 44.8 us
    # against 24.5 / 31.5 / 44.4; at M = 2048 the same.)
    STORE_CACHE: tl.constexpr = ".cs" if STREAMED else ""
    tl.store(residual_out_ptr + tile, residual_out, mask=(streams < HC)[:, None] & in_row[None, :],
             cache_modifier=STORE_CACHE)


@triton.jit
def _park(prenorm_bits, token, h, in_row, layer_out_ptr, HIDDEN: tl.constexpr, PARKED_BYTES: tl.constexpr, area):
    """Park a prenormalized chunk for the second pass: in the CTA's parking area (``ptx.parked_area``,
    at ``area``) where the plan gives the row ``PARKED_BYTES`` there, else in ``layer_out``."""
    if PARKED_BYTES > 0:
        ptx.store_area_16b(area + 2 * h, prenorm_bits)
    else:
        tl.store(layer_out_ptr + token * HIDDEN + h, prenorm_bits, mask=in_row)


@triton.jit
def _parked(token, h, in_row, layer_out_ptr, HIDDEN: tl.constexpr, PARKED_BYTES: tl.constexpr, area):
    """The chunk ``_park`` left (behind a barrier: other threads of the program may have stored it)."""
    if PARKED_BYTES > 0:
        return ptx.load_area_16b(area + 2 * h)
    # Written by other threads of this program: read from L2, past this SM's L1.
    return tl.load(layer_out_ptr + token * HIDDEN + h, mask=in_row, other=0, cache_modifier=".cg")


@triton.jit
def _store_mxfp8(layer, token, chunk, h, values_ptr, scales_ptr, HIDDEN: tl.constexpr,
                 CHUNK: tl.constexpr, ON_GPU: tl.constexpr):
    """FlashInfer's MXFP8 rules on one chunk of the bf16 layer input (see lamport_mhc.mxfp8); the
    scales of the padding rows are the callers' (``_zero_padding_scales``)."""
    COLS: tl.constexpr = HIDDEN // 32
    PADDED_COLS: tl.constexpr = (COLS + 3) // 4 * 4
    # Ordered as integers, bf16 magnitudes compare like the values; a NaN lane only counts when the
    # whole block is NaN (max.bf16x2 / max.f32 return the number). Keyed as magnitude + 0x7F in 16
    # bits, exactly the NaN magnitudes (above 0x7F80) wrap negative.
    keyed = ((layer.to(tl.int32) & 0x7FFF) + 0x7F).to(tl.int16)
    block_max = tl.max(tl.reshape(keyed, (CHUNK // 32, 32)), axis=1).to(tl.int32)
    nan = tl.full([CHUNK // 32], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    amax = tl.where(block_max < 0, nan, ((block_max - 0x7F) << 16).to(tl.float32, bitcast=True))
    scale = ue8m0_scale(amax)
    scaled = tl.reshape(bf16_to_f32(layer, ON_GPU), (CHUNK // 32, 32)) * inverse_scale(scale)[:, None]
    codes = tl.reshape(f32_to_e4m3(scaled, ON_GPU), (CHUNK,))
    tl.store(values_ptr + token * HIDDEN + h, codes, mask=h < HIDDEN)
    # (Stored by the threads that reduced them, one st.global.b8 each, with no shared-memory round trip,
    # the quant calls took up to 1.5% longer on one H200 at M = 512-2048: every thread of a block
    # stores its scale byte. Gathered into 4-byte words by two butterfly shuffles, as the CuTe kernel
    # stores them, and stored by one lane of 16 (no barrier left): H 4096 / 5120 / 7168 M = 1024
    # 23.9 / 31.9 / 44.6 us against 24.3 / 31.4 / 43.7, no better at M = 512-4096 either.)
    cols = chunk * (CHUNK // 32) + tl.arange(0, CHUNK // 32)
    tl.store(scales_ptr + scale_offset(token, cols, PADDED_COLS), scale.to(tl.uint8), mask=cols < COLS)


@triton.jit
def _zero_padding_scales(token, num_tokens, scales_ptr, first_word, WORDS: tl.constexpr, ROWS: tl.constexpr,
                         HIDDEN: tl.constexpr):
    """Zero the scales of the padding rows [M, roundup(M, 128)) of the last scale tile that this
    token takes: rows M + token + k M, k = 0, 1, ... (from M = 64 one at most; none where the token
    is past the padding, as most are), ``ROWS`` a step, the 4-byte words [first_word, first_word +
    WORDS) of each (a row's four scales of a 128-column group are one word of the layout). Strided
    over the tokens, the rows need no division: as one contiguous run a token, the run's length (an
    integer division by M) took about 30 sm_90a instructions a program."""
    PADDED_COLS: tl.constexpr = (HIDDEN // 32 + 3) // 4 * 4
    first_row = num_tokens % 128  # in the last tile
    padding = (128 - first_row) % 128
    if token < padding:
        # The tile's words, [row // 128][word][row % 32][(row % 128) // 32] (lamport_mhc.mxfp8.scale_offset).
        tile = scales_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (num_tokens // 128).to(tl.int64) * (
            32 * PADDED_COLS)
        words = first_word + tl.arange(0, WORDS)
        k = tl.zeros([], tl.int32)
        while token + k * num_tokens < padding:
            rows = first_row + token.to(tl.int32) + (k + tl.arange(0, ROWS)) * num_tokens
            offsets = (rows % 32) * 4 + rows // 32
            tl.store(tile + offsets[:, None] + 128 * words[None, :], tl.zeros([ROWS, WORDS], tl.int32),
                     mask=(rows < 128)[:, None] & (words < PADDED_COLS // 4)[None, :])
            k += ROWS


@triton.jit
def _zero_padding_scales_of_row(token, num_tokens, scales_ptr, HIDDEN: tl.constexpr, CHUNK: tl.constexpr):
    """``_zero_padding_scales`` over whole rows, once a token, after the row (the forms that walk
    it: zeroed a chunk at a time in their chunks' loop, a token that took a padding row ran 45 sm_90a
    instructions a chunk for it): a row's words in one tile, as many rows a step as the program has
    threads for (CHUNK // 8)."""
    WORDS: tl.constexpr = triton.next_power_of_2((HIDDEN // 32 + 3) // 4)
    ROWS: tl.constexpr = (CHUNK // 8 + WORDS - 1) // WORDS
    _zero_padding_scales(token, num_tokens, scales_ptr, 0, WORDS, ROWS, HIDDEN)


@triton.jit
def _normalize_chunk(prenorm_bits, gamma, inv_rms, token, chunk, h, in_row, layer_out_ptr,
                     values_ptr, scales_ptr, HIDDEN: tl.constexpr, CHUNK: tl.constexpr, VARIANT: tl.constexpr,
                     ON_GPU: tl.constexpr, PER_WARP: tl.constexpr = False):
    """Normalize one chunk (``gamma``: its fp32 values) and store it (and its MXFP8 copy). ``inv_rms``:
    a scalar, or with ``PER_WARP`` a copy per warp (``_exchanged_inverse_rms``), each scaling the
    warp's columns."""
    prenorm = bf16_to_f32(prenorm_bits, ON_GPU)
    if PER_WARP:
        PARTS: tl.constexpr = CHUNK // 256
        scaled = tl.reshape(tl.reshape(prenorm, (PARTS, CHUNK // PARTS)) * inv_rms[:, None], (CHUNK,))
    else:
        scaled = prenorm * inv_rms
    layer = f32_to_bf16(scaled * gamma, ON_GPU)
    tl.store(layer_out_ptr + token * HIDDEN + h, layer, mask=in_row)
    if VARIANT == QUANT:
        _store_mxfp8(layer, token, chunk, h, values_ptr, scales_ptr, HIDDEN, CHUNK, ON_GPU)


@triton.jit
def _inverse_rms(roots, eps, HIDDEN: tl.constexpr, ROOTS: tl.constexpr):
    """1 / sqrt(mean of squares + eps) from the chunk roots: their tree, IEEE division and square root."""
    return _inverse_rms_of(pairwise_sum(roots, ROOTS), eps, HIDDEN)


@triton.jit
def _inverse_rms_of(total, eps, HIDDEN: tl.constexpr):
    if (HIDDEN & (HIDDEN - 1)) == 0:  # scaled by 2^-k exactly: the IEEE quotient's bits, without the division
        mean = total * tl.full([], 1.0 / HIDDEN, tl.float32) + eps
    else:
        mean = tl.math.div_rn(total, tl.full([], HIDDEN, tl.float32)) + eps
    return tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.math.sqrt_rn(mean))


@triton.jit
def _exchanged_inverse_rms(parts, part, eps, HIDDEN: tl.constexpr, CHUNKS: tl.constexpr, ROOTS: tl.constexpr,
                           PARTS: tl.constexpr, mbarrier=None):
    """The cooperative form's ``_inverse_rms``, on the GPU: each warp's part of its chunk's sum of
    squares (``parts``, [PARTS], a part per warp) goes into the cluster as it is
    (``ptx.exchange_parts_in_cluster``; given the ``mbarrier`` that ``ptx.cluster_arrive_expecting``
    set up, its twin on it), and every thread joins the token's parts by the
    contract's tree, parts into chunk roots, roots (padded with +0) into the sum. No CTA barrier
    joins a CTA's warps first (a cross-warp tree of the parts took five), so the result comes as
    ``parts`` does: a copy per warp, [PARTS]."""
    if mbarrier is not None:
        exchanged = ptx.exchange_parts_in_cluster_async(parts, tl.arange(0, PARTS), part, CHUNKS, mbarrier)
    else:
        exchanged = ptx.exchange_parts_in_cluster(parts, tl.arange(0, PARTS), part, CHUNKS)
    roots = ()
    for chunk in tl.static_range(ROOTS):
        if chunk < CHUNKS:
            roots = roots + (pairwise_of(exchanged, chunk * ptx.MAX_PARTS, PARTS),)
        else:
            roots = roots + (tl.zeros_like(parts),)
    return _inverse_rms_of(pairwise_of(roots, 0, ROOTS), eps, HIDDEN)


@triton.jit
def _normalize_row(inv_rms, token, num_tokens, gamma_ptr, layer_out_ptr, values_ptr, scales_ptr,
                   HIDDEN: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, VARIANT: tl.constexpr,
                   PARKED_BYTES: tl.constexpr, ON_GPU: tl.constexpr, PREFETCH: tl.constexpr,
                   GAMMA_WORDS: tl.constexpr, area, first_gamma=None):
    """The streaming form's second pass over the whole parked row, chunk by chunk (the other
    programs on the SM hide the latency; with ``PREFETCH`` the next chunk's gamma is in flight too,
    the first chunk's ``first_gamma``, loaded by ``_chunk_ahead`` before the pass).
    ``GAMMA_WORDS`` (the plain variant): gamma is carried to the next chunk as words of two bf16 (as
    int16 it took a PRMT a pair); the quant one carries int16, whose layout the MXFP8 blocks share
    (the words' layout took a shared-memory conversion a chunk there)."""
    c = tl.arange(0, CHUNK)
    next_gamma = first_gamma
    for chunk in range(CHUNKS):
        h = chunk * CHUNK + c
        in_row = h < HIDDEN
        if GAMMA_WORDS:
            gamma = widened_row(next_gamma, CHUNK // 2)
        elif PREFETCH:
            gamma = bf16_to_f32(next_gamma, ON_GPU)
        if PREFETCH:
            next_gamma = _chunk_ahead(gamma_ptr, chunk + 1, HIDDEN, CHUNK, CHUNKS, GAMMA_WORDS, "")
        else:
            gamma = bf16_to_f32(tl.load(gamma_ptr + h, mask=in_row, other=0), ON_GPU)
        _normalize_chunk(_parked(token, h, in_row, layer_out_ptr, HIDDEN, PARKED_BYTES, area), gamma, inv_rms, token,
                         chunk, h, in_row, layer_out_ptr, values_ptr, scales_ptr, HIDDEN, CHUNK, VARIANT,
                         ON_GPU)
    if VARIANT == QUANT:
        _zero_padding_scales_of_row(token, num_tokens, scales_ptr, HIDDEN, CHUNK)


@triton.jit
def _chunk_ahead(row_ptr, chunk, HIDDEN: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                 WORDS: tl.constexpr, LOAD_POLICY: tl.constexpr):
    """Chunk ``chunk`` of the bf16 row at ``row_ptr``, issued ahead of its use: bf16 bits or
    (``WORDS``) words of two, +0 past the row. Where the chunks tile the row the load is not masked
    (a masked load zeroes its registers first: 10 instructions a chunk) and the chunk past the last
    loads the last again instead: gamma's prefetch, whose lines every row reads, and x's in rows of
    two chunks (``consumer_kernel``'s ``PEELED``)."""
    PER: tl.constexpr = 2 if WORDS else 1  # values a load's element
    if WORDS:
        base = row_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    else:
        base = row_ptr
    if HIDDEN % CHUNK == 0:
        return tl.load(base + tl.minimum(chunk, CHUNKS - 1) * (CHUNK // PER) + tl.arange(0, CHUNK // PER),
                       eviction_policy=LOAD_POLICY)
    e = chunk * (CHUNK // PER) + tl.arange(0, CHUNK // PER)
    return tl.load(base + e, mask=e < HIDDEN // PER, other=0, eviction_policy=LOAD_POLICY)


@triton.jit
def _tabled_sum_of_squares(table, CHUNKS: tl.constexpr, ROOTS: tl.constexpr, PARTS: tl.constexpr):
    """The row's sum of squares from its roots table at ``table`` (``ptx.table_part``, behind a CTA
    barrier): the slots, [chunk][part], are the subtrees of the contract's tree in order, the chunks
    past the row's +0 roots."""
    SLOTS: tl.constexpr = CHUNKS * PARTS
    if ROOTS * PARTS <= 32:  # in every thread's registers: the table's words, then the tree, no shuffles
        return ptx.table_sum(table, SLOTS, ROOTS * PARTS)
    slots = tl.arange(0, ROOTS * PARTS)
    parts = ptx.load_area_f32(table + 4 * tl.minimum(slots, SLOTS - 1))
    return pairwise_sum(tl.where(slots < SLOTS, parts, 0.0), ROOTS * PARTS)


@triton.jit
def _keep_chunk_parts(parts, chunk, part_roots, table, leaders, PARTS: tl.constexpr, ROOTS: tl.constexpr,
                      ROOTS_TABLE_BYTES: tl.constexpr):
    """Keep chunk ``chunk``'s parts (a warp's subtree root each) for the join once the row is done: in
    the roots table at ``table`` where the plan gives one (``ptx.table_part``), else in ``part_roots``
    ([PARTS, ROOTS]), which it returns."""
    if ROOTS_TABLE_BYTES > 0:
        ptx.table_part(parts, leaders, table + 4 * (chunk * PARTS + tl.arange(0, PARTS)))
    else:
        part_roots = tl.where(tl.arange(0, ROOTS)[None, :] == chunk, parts[:, None], part_roots)
    return part_roots


@triton.jit
def _mix_weights(post_ptr, comb_ptr, pre_ptr, token, streams, in_streams, HC: tl.constexpr, NORM: tl.constexpr,
                 PER_THREAD_WEIGHTS: tl.constexpr):
    """The token's mix weights (post, comb, pre), as ``_mix_chunk`` takes them.
    With ``PER_THREAD_WEIGHTS`` every thread holds all of them: post as a column of the streams'
    tile, comb as one column per source (its weights by target), pre as a scalar per target.
    Otherwise they are tiles spread over the program's threads (comb [source, target]), fewer
    registers, but each use gathers a source's weights across warps: a shared-memory round trip and
    two barriers."""
    if PER_THREAD_WEIGHTS:
        # A token's post and each source's comb row are HC consecutive floats: one 16-byte load each
        # at hc = 4 (as 20 scalar loads they took 15 instructions more a row). pre stays a scalar load
        # a target: loaded as a vector, its split into scalars took warp shuffles.
        post = tl.load(post_ptr + token * HC + streams, mask=in_streams, other=0.0)
        comb = ()
        for source in tl.static_range(HC):
            comb = comb + (tl.load(comb_ptr + (token * HC + source) * HC + streams, mask=in_streams, other=0.0),)
        pre = ()
        for target in tl.static_range(HC):
            pre = pre + (tl.load(pre_ptr + token * HC + target) if NORM else 0.0,)
    else:
        post = tl.load(post_ptr + token * HC + streams, mask=in_streams, other=0.0)
        comb = tl.load(comb_ptr + (token * HC + streams[:, None]) * HC + streams[None, :],
                       mask=in_streams[:, None] & in_streams[None, :], other=0.0).to(tl.int32, bitcast=True)
        pre = tl.zeros(streams.shape, tl.int32)
        if NORM:
            pre = tl.load(pre_ptr + token * HC + streams, mask=in_streams, other=0.0).to(tl.int32, bitcast=True)
    return post, comb, pre


@triton.jit
def _load_streams(residual_ptr, stream_words, chunk, in_streams, HIDDEN: tl.constexpr, HC: tl.constexpr,
                  BLOCK_HC: tl.constexpr, CHUNK: tl.constexpr, STREAMED: tl.constexpr):
    """The token's streams at chunk ``chunk``: one [BLOCK_HC, CHUNK // 2] tile of words of two bf16
    (``stream_words``: where each stream's row starts, in words), which ``_mix_chunk`` widens
    (``widened_pairs``). Loaded as bf16, the tile's int32 view sign-extended every value and the
    widening repacked each pair, a PRMT a pair where the tile is carried to the next chunk (the
    prefetch): sm_90a SASS, instructions a chunk of the parked forms of x at H = 4096 / 5120 / 7168
    plain 405 / 397 / 397 against 378 / 374 / 374 now, the wide twins at 4096 plain / quant 404 / 409
    against 376 / 379 (and 5120 plain's spill gone). The words past the row are masked off (H even:
    a word is in the row or past it); where the chunks tile the row and the tile has no padding rows,
    nothing is masked (a masked load zeroes its registers first)."""
    LOAD_POLICY: tl.constexpr = "evict_first" if STREAMED else ""
    w = chunk * (CHUNK // 2) + tl.arange(0, CHUNK // 2)
    words_ptr = residual_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + stream_words + w[None, :]
    if (HIDDEN % CHUNK == 0) & (HC == BLOCK_HC):
        words = tl.load(words_ptr, eviction_policy=LOAD_POLICY)
    else:
        words = tl.load(words_ptr, mask=in_streams[:, None] & (w < HIDDEN // 2)[None, :], other=0,
                        eviction_policy=LOAD_POLICY)
    return words


@triton.jit
def _chunk_inputs(chunk, token, stream_words, in_streams, residual_ptr, x_ptr, HIDDEN: tl.constexpr,
                  HC: tl.constexpr, BLOCK_HC: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                  STREAMED: tl.constexpr, PAST_LAST: tl.constexpr = False):
    """The streams and ``x`` of chunk ``chunk`` (``_take_chunk``'s loads), issued ahead of their use,
    both as words of two bf16 (carried to the next chunk as int16, x took a PRMT a pair there).
    ``PAST_LAST``: ``chunk`` may be the one past the row's last (a loop's last prefetch); there every
    lane is masked off, or where the chunks tile the row, nothing is masked and the last chunk is
    loaded again (``_chunk_ahead``)."""
    LOAD_POLICY: tl.constexpr = "evict_first" if STREAMED else ""
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + token * (HIDDEN // 2)  # the token's row
    x = _chunk_ahead(x_words, chunk, HIDDEN, CHUNK, CHUNKS, True, LOAD_POLICY)
    if PAST_LAST and HIDDEN % CHUNK == 0:
        chunk = tl.minimum(chunk, CHUNKS - 1)
    residual = _load_streams(residual_ptr, stream_words, chunk, in_streams, HIDDEN, HC, BLOCK_HC, CHUNK, STREAMED)
    return residual, x


@triton.jit
def _take_chunk(residual, chunk, token, stream_words, in_streams, post, comb, pre, streams, gen, generation,
                mailbox_ptr, residual_ptr, residual_out_ptr, layer_out_ptr, x_ptr, gemm2_ptr, weights_ptr,
                indices_ptr, timeout_ns, error_ptr, capacity, HIDDEN: tl.constexpr, HC: tl.constexpr,
                TP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_HC: tl.constexpr, CHUNK: tl.constexpr,
                REDUCED: tl.constexpr, VARIANT: tl.constexpr, PUBLISH: tl.constexpr, LOCAL: tl.constexpr,
                PARK: tl.constexpr, PARKED_BYTES: tl.constexpr, STREAMED: tl.constexpr, ON_GPU: tl.constexpr,
                PER_THREAD_WEIGHTS: tl.constexpr, x=None, STORE_STREAMS: tl.constexpr = True, area=None):
    """The first pass over chunk ``chunk`` of the token: its reduced row (the contribution itself, or
    the mailbox's) and its streams (``residual``, unless loaded already), mixed by ``_mix_chunk``;
    ``x``: the contribution's words, where loaded already (``_chunk_inputs``)."""
    h = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = h < HIDDEN
    if residual is None:
        residual = _load_streams(residual_ptr, stream_words, chunk, in_streams, HIDDEN, HC, BLOCK_HC, CHUNK, STREAMED)
    if x is not None:
        reduced = widened_row(x, CHUNK // 2)
    else:
        if LOCAL:
            x = contribution_chunk(x_ptr, gemm2_ptr, weights_ptr, indices_ptr, token, h, HIDDEN, TOP_K,
                                   PUBLISH == PUBLISH_FINALIZE, ON_GPU, STREAMED,
                                   ZERO_CANONICAL=PUBLISH == PUBLISH_FINALIZE)
        else:
            x = _reduced_chunk(mailbox_ptr, gen, token, h, in_row, timeout_ns, error_ptr, generation, capacity, TP,
                               HIDDEN, REDUCED, ON_GPU)
        reduced = bf16_to_f32(x, ON_GPU)
    if LOCAL:
        if PUBLISH == PUBLISH_X:
            # x's -0.0 becomes +0.0 in fp32, adding +0.0 (exact for every other value): one add a value
            # on the FMA pipe, where the integer forms took 1.5 (in pairs) or 2 integer instructions.
            reduced = reduced + 0.0
    return _mix_chunk(reduced, residual, post, comb, pre, streams, token, h, in_row, residual_out_ptr,
                      layer_out_ptr, HIDDEN, HC, BLOCK_HC, CHUNK, VARIANT, PARK, PARKED_BYTES, STREAMED, ON_GPU,
                      PER_THREAD_WEIGHTS, STORE_STREAMS, area)


# Runtime scalars are not specialized, nor the pointers a call may pass 4-byte aligned: one compiled
# kernel serves every call (and graph capture).
@triton.jit(do_not_specialize=["eps", "num_tokens", "timeout_ns", "capacity", "multicast_address"],
            do_not_specialize_on_alignment=FOUR_BYTE_ALIGNED)
def consumer_kernel(
    mailbox_ptr,      # int16: LL [3][TP][capacity][H] contributions, or BT [3][capacity][H] sums  (not LOCAL)
    residual_ptr,     # int16 [M, HC, H]
    post_ptr,         # fp32 [M, HC]
    comb_ptr,         # fp32 [M, HC (source), HC (target)]
    pre_ptr,          # fp32 [M, HC]          (not RESIDUAL_ONLY)
    gamma_ptr,        # int16 [H]             (not RESIDUAL_ONLY)
    residual_out_ptr,  # int16 [M, HC, H]
    layer_out_ptr,    # int16 [M, H]          (not RESIDUAL_ONLY)
    values_ptr,       # uint8 [M, H]          (QUANT)
    scales_ptr,       # uint8 swizzled scales (QUANT)
    state_ptr,        # int32 [3]: this protocol's generation state (lamport_mhc.layout)
    error_ptr,        # int32 [ERROR_WORDS]: the spin-timeout record and its host mirror's address
    eps,              # fp32
    num_tokens,       # M of the call
    timeout_ns,       # int64, 0 = wait forever
    capacity,         # max_num_tokens of the build
    parked_roots_ptr,  # fp32 [capacity, CHUNKS]: the chunk roots (SPLIT > 1, simulated group only)
    x_ptr,            # int16 [M, H]: x, or the shared expert output          (PUBLISH)
    gemm2_ptr,        # int16 [rows, H]                                       (PUBLISH_FINALIZE)
    weights_ptr,      # fp32 [M, TOP_K]                                       (PUBLISH_FINALIZE)
    indices_ptr,      # int32 [M, TOP_K]                                      (PUBLISH_FINALIZE)
    peer_table_ptr,   # int64 [TP]: every rank's LL mailbox address           (PUBLISH, not LOCAL)
    multicast_address,  # int64: the LL mailbox's multicast address           (PUBLISH, MULTICAST)
    HIDDEN: tl.constexpr, HC: tl.constexpr, TP: tl.constexpr, RANK: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_HC: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, ROOTS: tl.constexpr,
    SPLIT: tl.constexpr, HOLD: tl.constexpr, REDUCED: tl.constexpr, VARIANT: tl.constexpr,
    PUBLISH: tl.constexpr, LOCAL: tl.constexpr, PHASES: tl.constexpr, MULTICAST: tl.constexpr,
    STREAMED: tl.constexpr, PARKED_BYTES: tl.constexpr, ON_GPU: tl.constexpr, USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr, PER_THREAD_WEIGHTS: tl.constexpr, ROOTS_TABLE_BYTES: tl.constexpr,
):
    tl.static_assert((SPLIT == 1) | (SPLIT == CHUNKS), "a token takes one program, or one per chunk")
    tl.static_assert(SPLIT <= ptx.MAX_CLUSTER, "a token's programs are one cluster")
    # (A flag computed from a plain constexpr is a bool under the interpreter, which has no bool & constexpr:
    # such flags come last in the conditions.)
    COOPERATIVE: tl.constexpr = SPLIT > 1
    MIX: tl.constexpr = (MIX_PHASE & PHASES) != 0
    NORMALIZE: tl.constexpr = ((NORMALIZE_PHASE & PHASES) != 0) & (VARIANT != RESIDUAL_ONLY)
    EXCHANGE: tl.constexpr = NORMALIZE & COOPERATIVE & ON_GPU  # the chunk roots, through the cluster
    # The local form exchanges them with stores that complete on each CTA's mbarrier: no release fence
    # waits for the streams stored before. One H200, tp = 1, us against the cluster barrier: H = 4096
    # plain M = 1 / 8 / 64 / 100 1.82 / 2.08 / 2.98 / 3.40 against 1.99 / 2.23 / 3.19 / 3.56, quant
    # 2.01 / 2.24 / 3.35 / 3.73 against 2.22 / 2.39 / 3.85 / 4.25; H = 7168 plain 2.03 / 2.34 / 3.67 /
    # 4.75 against 2.15 / 2.55 / 3.84 / 4.72, quant 2.14 / 2.54 / 4.16 / 5.21 against 2.33 / 2.72 / 4.33
    # / 5.64. (The mailbox consumers keep the barrier until it is measured with ranks at once.)
    ASYNC_EXCHANGE: tl.constexpr = EXCHANGE & LOCAL
    # The latency form stores the mixed streams after the exchange in calls of few rows: the barrier
    # exchange's release (a MEMBAR.GPU) waited for every store issued before it to complete, a round
    # trip on the way to the norm (measured so; whether it still pays with the mbarrier exchange,
    # which has no release, is not measured). In calls of more rows the stores would then end the kernel instead
    # of draining during the exchange (H = 7168, stored late at every M: plain M = 64 / 100 4.7 / 6.1
    # us against 4.2 / 5.0 stored early).
    LATE_STORES: tl.constexpr = EXCHANGE & PER_THREAD_WEIGHTS
    ONE_KERNEL: tl.constexpr = (PUBLISH != NO_PUBLISH) & (not LOCAL)
    GAMMA_WORDS: tl.constexpr = (VARIANT != QUANT) & PREFETCH  # (_normalize_row)
    program = tl.program_id(0)
    token = (program // SPLIT).to(tl.int64)
    part = program % SPLIT  # the chunk of a cooperative program
    c = tl.arange(0, CHUNK)
    streams = tl.arange(0, BLOCK_HC)
    in_streams = streams < HC
    stream_words = (token * HC + streams[:, None]) * (HIDDEN // 2)  # where each stream's row starts, in words
    root_index = tl.arange(0, ROOTS)
    PARTS: tl.constexpr = CHUNK // 256  # a chunk's squares are summed in a part per warp (plan.row_warps)
    token_roots = parked_roots_ptr + token * CHUNKS
    mbarrier = None  # the local form's (ASYNC_EXCHANGE)
    area = None  # where a streaming form parks its row (and keeps its roots table), on the GPU
    table = None
    if PARKED_BYTES > 0:
        area = ptx.parked_area(PARKED_BYTES)
        table = area + (PARKED_BYTES - ROOTS_TABLE_BYTES)
    if EXCHANGE:
        if ASYNC_EXCHANGE:
            mbarrier = ptx.cluster_arrive_expecting(CHUNKS * PARTS * 4)
        else:
            ptx.cluster_arrive(ON_GPU)

    if PHASES == NORMALIZE_PHASE:
        # The simulated group's second launch of the cooperative form: this program's chunk and root
        # were parked by the first.
        h = part * CHUNK + c
        prenorm = tl.load(layer_out_ptr + token * HIDDEN + h, mask=h < HIDDEN, other=0)
    else:
        # A kernel that starts the call waits for the previous kernel before it reads anything. After a
        # publish kernel (which waited for it) the inputs may be read before this kernel's wait, so their
        # latencies overlap the wait for the peers.
        if (PUBLISH != NO_PUBLISH) | LOCAL:
            ptx.grid_dependency_wait(USE_PDL, ON_GPU)
        if LOCAL:
            # A group of one's call is this kernel alone, and nothing below is waited for: the next
            # kernel may launch now, its CTAs taking the SMs this grid's last wave leaves free (it
            # still waits for this kernel's completion before it reads anything).
            ptx.launch_dependents(USE_PDL, ON_GPU)
        post, comb, pre = _mix_weights(post_ptr, comb_ptr, pre_ptr, token, streams, in_streams, HC,
                                       VARIANT != RESIDUAL_ONLY, PER_THREAD_WEIGHTS)
        if LOCAL:
            generation = tl.zeros([], tl.int32)  # no mailbox, no generation
        elif PUBLISH != NO_PUBLISH:
            generation = tl.load(state_ptr + lamport.STATE_NEXT, volatile=True)
        residual0 = None
        if (PUBLISH == NO_PUBLISH) & COOPERATIVE:  # the one chunk's streams, before the wait
            residual0 = _load_streams(residual_ptr, stream_words, part, in_streams, HIDDEN, HC, BLOCK_HC, CHUNK, False)
        if PUBLISH == NO_PUBLISH:
            ptx.grid_dependency_wait(USE_PDL, ON_GPU)
            generation = tl.load(state_ptr + lamport.STATE_ACTIVE, volatile=True)
        gen = generation.to(tl.int64)

        if ONE_KERNEL & ((PUBLISH_PHASE & PHASES) != 0):
            for i in range(CHUNKS // SPLIT):
                chunk = part + i
                h = chunk * CHUNK + c
                contribution = contribution_chunk(x_ptr, gemm2_ptr, weights_ptr, indices_ptr, token, h,
                                                  HIDDEN, TOP_K, PUBLISH == PUBLISH_FINALIZE, ON_GPU)
                slot = ((gen * TP + RANK) * capacity + token) * HIDDEN + chunk * CHUNK
                lamport.broadcast(contribution, slot, h < HIDDEN, peer_table_ptr, multicast_address, TP, CHUNK,
                                  MULTICAST)
    if MIX:
        if ONE_KERNEL:
            # Every program has read the generation; the last to arrive advances it (at the end of the
            # kernel, so the atomic's round trip overlaps the wait for the peers).
            arrived = tl.atomic_add(state_ptr + lamport.STATE_ARRIVED, 1, sem="acq_rel")
        if COOPERATIVE:
            # Its one chunk, kept in registers, except when the simulated group runs the normalize
            # as a second launch.
            parts, prenorm, mixed_streams = _take_chunk(
                residual0, part, token, stream_words, in_streams, post, comb,
                pre, streams, gen, generation, mailbox_ptr, residual_ptr, residual_out_ptr, layer_out_ptr,
                x_ptr, gemm2_ptr, weights_ptr, indices_ptr, timeout_ns, error_ptr, capacity, HIDDEN, HC, TP,
                TOP_K, BLOCK_HC, CHUNK, REDUCED, VARIANT, PUBLISH, LOCAL, (NORMALIZE_PHASE & PHASES) == 0,
                PARKED_BYTES, STREAMED, ON_GPU, PER_THREAD_WEIGHTS, None, not LATE_STORES)
            if LATE_STORES:
                if num_tokens > LATE_STORE_MAX_ROWS:
                    _store_streams(mixed_streams, token, part * CHUNK + c, part * CHUNK + c < HIDDEN, streams,
                                   residual_out_ptr, HIDDEN, HC, STREAMED)
        else:
            roots = tl.zeros([ROOTS], tl.float32)
            part_index = tl.arange(0, PARTS)
            leaders = None
            if ROOTS_TABLE_BYTES > 0:
                leaders = ptx.table_leaders(part_index)
            if HOLD:
                held = ()
                if PREFETCH:
                    next_residual, next_x = _chunk_inputs(0, token, stream_words, in_streams, residual_ptr, x_ptr,
                                                          HIDDEN, HC, BLOCK_HC, CHUNK, CHUNKS, STREAMED)
                for chunk in tl.static_range(CHUNKS):  # the prenormalized row stays in registers
                    residual, x = None, None
                    if PREFETCH:  # the next chunk's loads in flight while this one is mixed
                        residual, x = next_residual, next_x
                        if chunk + 1 < CHUNKS:
                            next_residual, next_x = _chunk_inputs(chunk + 1, token, stream_words, in_streams,
                                                                  residual_ptr, x_ptr, HIDDEN, HC, BLOCK_HC, CHUNK,
                                                                  CHUNKS, STREAMED)
                    parts, prenorm, _ = _take_chunk(
                        residual, chunk, token, stream_words, in_streams, post, comb, pre, streams, gen,
                        generation, mailbox_ptr, residual_ptr, residual_out_ptr, layer_out_ptr, x_ptr, gemm2_ptr,
                        weights_ptr, indices_ptr, timeout_ns, error_ptr, capacity, HIDDEN, HC, TP, TOP_K, BLOCK_HC,
                        CHUNK, REDUCED, VARIANT, PUBLISH, LOCAL, False, PARKED_BYTES, STREAMED, ON_GPU,
                        PER_THREAD_WEIGHTS, x)
                    held = held + (prenorm,)
                    if ROOTS_TABLE_BYTES > 0:  # joined once the row is done, as the parked forms do
                        ptx.table_part(parts, leaders, table + 4 * (chunk * PARTS + part_index))
                    else:
                        # (Joined across warps now: deferred, ptxas hoists the next chunk's loads and
                        # the held row spills.)
                        roots = tl.where(root_index == chunk, pairwise_sum(parts, PARTS), roots)
            else:
                # Each chunk's subtrees of a warp, joined across warps once the row is done (the
                # local forms through their roots table): the chunks' loop has no barrier, so the
                # program's warps need not wait for each other.
                part_roots = tl.zeros([PARTS, ROOTS], tl.float32)
                # With PREFETCH the last chunk of a row of three or more is peeled off the loop, as it
                # prefetches nothing: where the chunks tile the row, the loop's last prefetch loaded the
                # last chunk again, and its evict-first lines came back from HBM (one H100, H 5120 quant
                # M = 1000 under ncu: 3.4 MB more read than the strong tail's 51.2, 41.7 us against
                # 39.8; in the benchmark, auto's speedup_vs_best there went from 0.971 to 0.981-0.986).
                # Skipped by a branch in the loop instead, the loop-carried tile spilled; peeled off a
                # row of two chunks (the wide twins at H 4096, 7168 quant's), both chunks' code spilled
                # (one H100, H 4096 quant M = 512: 22.0 us against 13.4). Predicated off in rows of two chunks
                # (a masked load: 24-33 instructions more a chunk, its registers zeroed), the wide twins at
                # H 4096 gained where hinted from 1024 rows (one H100, quant M = 1024 / 4096 31.0 / 128.6 us
                # against 32.3 / 138.6) and lost at 256 rows, hinted or not (quant 5.48 against 5.27 unhinted).
                # Loaded from one address a warp instead (offsets times a live flag, contiguity hinted:
                # LDG.128 kept, no spill), it measured within the noise of the reload (one H100, H 4096
                # wide, medians of two rounds: quant M = 256 / 512 5.47 / 13.46 us against 5.40 / 13.47).
                PEELED: tl.constexpr = PREFETCH and CHUNKS > 2
                LOOPED: tl.constexpr = CHUNKS - 1 if PEELED else CHUNKS
                if PREFETCH:
                    next_residual, next_x = _chunk_inputs(0, token, stream_words, in_streams, residual_ptr, x_ptr,
                                                          HIDDEN, HC, BLOCK_HC, CHUNK, CHUNKS, STREAMED)
                for chunk in range(LOOPED):  # parked for the second pass
                    residual, x = None, None
                    if PREFETCH:  # the next chunk's loads in flight while this one is mixed
                        residual, x = next_residual, next_x
                        next_residual, next_x = _chunk_inputs(chunk + 1, token, stream_words, in_streams,
                                                              residual_ptr, x_ptr, HIDDEN, HC, BLOCK_HC, CHUNK,
                                                              CHUNKS, STREAMED, not PEELED)
                    parts, _, _ = _take_chunk(
                        residual, chunk, token, stream_words, in_streams, post, comb, pre, streams, gen,
                        generation, mailbox_ptr, residual_ptr, residual_out_ptr, layer_out_ptr, x_ptr, gemm2_ptr,
                        weights_ptr, indices_ptr, timeout_ns, error_ptr, capacity, HIDDEN, HC, TP, TOP_K, BLOCK_HC,
                        CHUNK, REDUCED, VARIANT, PUBLISH, LOCAL, True, PARKED_BYTES, STREAMED, ON_GPU,
                        PER_THREAD_WEIGHTS, x, area=area)
                    part_roots = _keep_chunk_parts(parts, chunk, part_roots, table, leaders, PARTS, ROOTS,
                                                   ROOTS_TABLE_BYTES)
                if PEELED:
                    parts, _, _ = _take_chunk(
                        next_residual, CHUNKS - 1, token, stream_words, in_streams, post, comb, pre, streams, gen,
                        generation, mailbox_ptr, residual_ptr, residual_out_ptr, layer_out_ptr, x_ptr, gemm2_ptr,
                        weights_ptr, indices_ptr, timeout_ns, error_ptr, capacity, HIDDEN, HC, TP, TOP_K, BLOCK_HC,
                        CHUNK, REDUCED, VARIANT, PUBLISH, LOCAL, True, PARKED_BYTES, STREAMED, ON_GPU,
                        PER_THREAD_WEIGHTS, next_x, area=area)
                    part_roots = _keep_chunk_parts(parts, CHUNKS - 1, part_roots, table, leaders, PARTS, ROOTS,
                                                   ROOTS_TABLE_BYTES)
                if ROOTS_TABLE_BYTES == 0:
                    roots = pairwise_columns(part_roots, PARTS, ROOTS)
        if (PUBLISH == NO_PUBLISH) & (not REDUCED):
            if program == 0:
                lamport.advance_generation(state_ptr, generation)
        if (VARIANT != RESIDUAL_ONLY) & COOPERATIVE & (not ON_GPU):
            tl.store(token_roots + part, pairwise_sum(parts, PARTS))
        if NORMALIZE & (not COOPERATIVE):
            # The first chunk's gamma is loaded before the barrier: where a program has the SM to
            # itself (about a row per SM), its latency would follow the barrier and the norm's join.
            if HOLD:
                first_gamma = tl.load(gamma_ptr + c, mask=c < HIDDEN, other=0)
            elif PREFETCH:
                first_gamma = _chunk_ahead(gamma_ptr, 0, HIDDEN, CHUNK, CHUNKS, GAMMA_WORDS, "")
            else:
                first_gamma = None
            # The parked row and the roots table (a lane of every warp's parts) are read by every thread.
            if (ROOTS_TABLE_BYTES > 0) | (not HOLD):
                tl.debug_barrier()
            if ROOTS_TABLE_BYTES > 0:
                total = _tabled_sum_of_squares(table, CHUNKS, ROOTS, PARTS)
            else:
                total = pairwise_sum(roots, ROOTS)
            inv_rms = _inverse_rms_of(total, eps, HIDDEN)
            if HOLD:
                for chunk in tl.static_range(CHUNKS):
                    h = chunk * CHUNK + c
                    if chunk == 0:
                        gamma = bf16_to_f32(first_gamma, ON_GPU)
                    else:
                        gamma = bf16_to_f32(tl.load(gamma_ptr + h, mask=h < HIDDEN, other=0), ON_GPU)
                    _normalize_chunk(held[chunk], gamma, inv_rms, token,
                                     chunk, h, h < HIDDEN, layer_out_ptr, values_ptr, scales_ptr, HIDDEN,
                                     CHUNK, VARIANT, ON_GPU)
                if VARIANT == QUANT:
                    _zero_padding_scales_of_row(token, num_tokens, scales_ptr, HIDDEN, CHUNK)
            else:
                _normalize_row(inv_rms, token, num_tokens, gamma_ptr, layer_out_ptr, values_ptr, scales_ptr, HIDDEN,
                               CHUNK, CHUNKS, VARIANT, PARKED_BYTES, ON_GPU, PREFETCH, GAMMA_WORDS, area,
                               first_gamma)

    if NORMALIZE & COOPERATIVE:
        h = part * CHUNK + c
        gamma = tl.load(gamma_ptr + h, mask=h < HIDDEN, other=0)  # in flight during the exchange
        if ON_GPU:
            inv_rms = _exchanged_inverse_rms(parts, part, eps, HIDDEN, CHUNKS, ROOTS, PARTS, mbarrier)
            if LATE_STORES:
                if num_tokens <= LATE_STORE_MAX_ROWS:
                    _store_streams(mixed_streams, token, h, h < HIDDEN, streams, residual_out_ptr, HIDDEN, HC,
                                   STREAMED)
        else:
            inv_rms = _inverse_rms(tl.load(token_roots + root_index, mask=root_index < CHUNKS, other=0.0), eps,
                                   HIDDEN, ROOTS)
        _normalize_chunk(prenorm, bf16_to_f32(gamma, ON_GPU), inv_rms, token, part, h, h < HIDDEN,
                         layer_out_ptr, values_ptr, scales_ptr, HIDDEN, CHUNK, VARIANT, ON_GPU, PER_WARP=ON_GPU)
        if VARIANT == QUANT:  # its chunk's words of the padding rows the token takes
            _zero_padding_scales(token, num_tokens, scales_ptr, part * (CHUNK // 128), CHUNK // 128, 128, HIDDEN)
    if ONE_KERNEL & MIX:
        if arrived == tl.num_programs(0) - 1:
            lamport.reset_arrivals_and_advance(state_ptr, generation)
    if (PHASES != NORMALIZE_PHASE) & (not LOCAL):
        ptx.launch_dependents(USE_PDL, ON_GPU)
