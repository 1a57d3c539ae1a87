"""The mHC consumer: per token, wait for the call's reduced sublayer output, post-mix the hc residual
streams, collapse them with the pre-mix, RMS-normalize, and optionally write the layer input as MXFP8.

The row is walked in ``CHUNKS`` aligned chunks of ``CHUNK`` columns (a power of two; the last chunk
is masked where CHUNK does not divide HIDDEN), 16 bytes per thread and access, so no program holds
the whole row and none pads it to a power of two. A token is spread over ``SPLIT`` programs (grid
``(M, SPLIT)``), each taking ``CHUNKS // SPLIT`` consecutive chunks: SPLIT = 1 streams (bandwidth,
large M), SPLIT = CHUNKS spreads a token over the GPU (latency, small M).

The norm's sum of squares stays the contract's adjacent-pair tree over the row padded with +0 to a
power of two: every chunk is an aligned subtree of it, so each chunk's own tree, and the chunk roots
joined by the same tree (padded with +0 roots), give its bits; a taller tree only adds +0.0 at its
root, which is exact for every sum of squares. Between the two passes the prenormalized row waits
in ``layer_out`` (its bf16 bits: the contract rounds it there anyway). With SPLIT > 1 a program
stores its chunk roots into the token's row of ``roots``, counts itself in the token's ``arrivals``
word, and the last to arrive resets the count and normalizes the whole row; nothing waits.

Specialized by constexprs:
- ``PUBLISH`` (LL only): 0, the publish kernel ran before; otherwise the call is one kernel, whose
  programs first store their chunks of the token's contribution (1: ``x``, 2: the MoE finalize) into
  every rank's mailbox and then consume them. Every program must be resident at once, as each waits
  for its twins on the other ranks. ``PHASES`` (publish only, consume only, both) lets the simulated
  group, which runs ranks one after another, launch the two halves separately.
- ``LOCAL`` (a group of one, with ``PUBLISH`` naming the contribution): the contribution is the
  reduced row (the contract's sum of one contribution); no mailbox, no poll, no generation.
- ``REDUCED`` (BT): the mailbox holds the owners' sums ``[gen][t]``; otherwise (LL) it holds every
  rank's contribution ``[gen][rank][t]``, summed here in rank order. LL advances the generation
  (BT's owner reduce already did).
- ``VARIANT``: 0 plain, 1 quant (also MXFP8 values and swizzled 128x4 UE8M0 scales, zeroing the
  scales of the padding rows), 2 residual-only (writes only the residual streams).
Every step follows the bit contract of ``lamport_mhc.reference``; see DESIGN.md.
"""

import triton
import triton.language as tl

from . import lamport, ptx

from .publish import contribution_chunk
from .numerics import (bf16_to_f32, canonical_zero, f32_to_bf16, f32_to_e4m3, inverse_scale,
                       pairwise_sum, row_of, scale_offset, ue8m0_scale)

PLAIN, QUANT, RESIDUAL_ONLY = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
NO_PUBLISH, PUBLISH_X, PUBLISH_FINALIZE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
PUBLISH_ONLY, CONSUME_ONLY, BOTH_PHASES = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)


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
            acc = acc + bf16_to_f32(values)
        for source in tl.static_range(TP):
            lamport.rearm(mailbox_ptr + ((gen * TP + source) * capacity + token) * HIDDEN + h, in_row)
        reduced = canonical_zero(f32_to_bf16(acc, ON_GPU))
    return reduced


@triton.jit
def _mix_chunk(reduced, residual, post, comb_bits, pre_bits, streams, token, h, in_row, residual_out_ptr,
               layer_out_ptr, HIDDEN: tl.constexpr, HC: tl.constexpr, BLOCK_HC: tl.constexpr,
               CHUNK: tl.constexpr, VARIANT: tl.constexpr, ON_GPU: tl.constexpr):
    """The first pass over one chunk: post-mix and store the streams; then (with the norm) collapse,
    park the prenormalized chunk in ``layer_out`` and return the root of its squares' tree."""
    # Post-mix, all targets at once: m[j] = reduced * post[j], then m[j] = fma(res[s], comb[s, j], m[j]).
    mixed = bf16_to_f32(reduced)[None, :] * post[:, None]
    for source in tl.static_range(HC):
        stream = bf16_to_f32(row_of(residual, streams, source).to(tl.int16))
        comb = row_of(comb_bits, streams, source).to(tl.float32, bitcast=True)
        mixed = ptx.fma_rn(tl.broadcast_to(stream[None, :], (BLOCK_HC, CHUNK)),
                           tl.broadcast_to(comb[:, None], (BLOCK_HC, CHUNK)), mixed, ON_GPU)
    residual_out = f32_to_bf16(mixed, ON_GPU)
    tile = (token * HC + streams[:, None]) * HIDDEN + h[None, :]
    tl.store(residual_out_ptr + tile, residual_out, mask=(streams < HC)[:, None] & in_row[None, :])
    root = tl.zeros([], tl.float32)
    if VARIANT != RESIDUAL_ONLY:
        # Collapse with the pre-mix, in target order.
        collapsed = tl.zeros([CHUNK], tl.float32)
        residual_out = residual_out.to(tl.int32)
        for target in tl.static_range(HC):
            weight = tl.sum(tl.where(streams == target, pre_bits, 0)).to(tl.float32, bitcast=True)
            stream = bf16_to_f32(row_of(residual_out, streams, target).to(tl.int16))
            collapsed = ptx.fma_rn(stream, tl.broadcast_to(weight, (CHUNK,)), collapsed, ON_GPU)
        prenorm_bits = f32_to_bf16(collapsed, ON_GPU)
        tl.store(layer_out_ptr + token * HIDDEN + h, prenorm_bits, mask=in_row)
        prenorm = bf16_to_f32(prenorm_bits)
        root = pairwise_sum(tl.where(in_row, prenorm * prenorm, 0.0), CHUNK)
    return root


@triton.jit
def _store_mxfp8(layer, token, num_tokens, chunk, h, values_ptr, scales_ptr, HIDDEN: tl.constexpr,
                 CHUNK: tl.constexpr, ON_GPU: tl.constexpr):
    """FlashInfer's MXFP8 rules on one chunk of the bf16 layer input (see lamport_mhc.mxfp8)."""
    COLS: tl.constexpr = HIDDEN // 32
    PADDED_COLS: tl.constexpr = (COLS + 3) // 4 * 4
    magnitude = layer.to(tl.int32) & 0x7FFF
    # Ordered as integers, bf16 magnitudes compare like the values; a NaN lane only counts when the
    # whole block is NaN (max.bf16x2 / max.f32 return the number).
    keyed = tl.where(magnitude > 0x7F80, -1, magnitude)
    block_max = tl.max(tl.reshape(keyed, (CHUNK // 32, 32)), axis=1)
    nan = tl.full([CHUNK // 32], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    amax = tl.where(block_max < 0, nan, (block_max << 16).to(tl.float32, bitcast=True))
    scale = ue8m0_scale(amax)
    scaled = tl.reshape(bf16_to_f32(layer), (CHUNK // 32, 32)) * inverse_scale(scale)[:, None]
    codes = tl.reshape(f32_to_e4m3(scaled, ON_GPU), (CHUNK,))
    tl.store(values_ptr + token * HIDDEN + h, codes.to(tl.uint8), mask=h < HIDDEN)
    cols = chunk * (CHUNK // 32) + tl.arange(0, CHUNK // 32)
    tl.store(scales_ptr + scale_offset(token, cols, PADDED_COLS), scale.to(tl.uint8), mask=cols < COLS)
    # Rows [M, roundup(M, 128)) of the last scale tile are zero: fewer than 128 rows, split into
    # one contiguous run per token.
    padding = (num_tokens + 127) // 128 * 128 - num_tokens
    run = (padding + num_tokens - 1) // num_tokens
    if token * run < padding:  # most tokens have no run
        offsets = tl.arange(0, 128)
        rows = num_tokens + token * run + offsets
        in_run = (offsets < run) & (rows < num_tokens + padding)
        tl.store(scales_ptr + scale_offset(rows[:, None], cols[None, :], PADDED_COLS),
                 tl.zeros([128, CHUNK // 32], tl.uint8), mask=in_run[:, None] & (cols < COLS)[None, :])


@triton.jit
def _normalize_chunk(prenorm_bits, gamma_bits, inv_rms, token, num_tokens, chunk, h, in_row, layer_out_ptr,
                     values_ptr, scales_ptr, HIDDEN: tl.constexpr, CHUNK: tl.constexpr, VARIANT: tl.constexpr,
                     ON_GPU: tl.constexpr):
    layer = f32_to_bf16((bf16_to_f32(prenorm_bits) * inv_rms) * bf16_to_f32(gamma_bits), ON_GPU)
    tl.store(layer_out_ptr + token * HIDDEN + h, layer, mask=in_row)
    if VARIANT == QUANT:
        _store_mxfp8(layer, token, num_tokens, chunk, h, values_ptr, scales_ptr, HIDDEN, CHUNK, ON_GPU)


@triton.jit
def _normalize_row(roots, token, num_tokens, eps, gamma_ptr, layer_out_ptr, values_ptr, scales_ptr,
                   HIDDEN: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, ROOTS: tl.constexpr,
                   VARIANT: tl.constexpr, LOADS_FIRST: tl.constexpr, ON_GPU: tl.constexpr):
    """The second pass over the whole row: RMSNorm of the parked prenormalized row (the chunk roots'
    tree, then IEEE division and square root), times gamma, and the MXFP8 copy. ``LOADS_FIRST``
    (one program finishing a token alone) issues every chunk's loads before the first store, so
    their latencies overlap; otherwise chunk by chunk (other programs hide the latency)."""
    sum_squares = pairwise_sum(roots, ROOTS)
    mean = tl.math.div_rn(sum_squares, tl.full([], HIDDEN, tl.float32)) + eps
    inv_rms = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.math.sqrt_rn(mean))
    row = layer_out_ptr + token * HIDDEN
    # The parked row was written by other threads (or programs) of this token: read from L2, past
    # this SM's L1.
    if LOADS_FIRST:
        parked = ()
        gammas = ()
        for chunk in tl.static_range(CHUNKS):
            h = chunk * CHUNK + tl.arange(0, CHUNK)
            parked = parked + (tl.load(row + h, mask=h < HIDDEN, other=0, cache_modifier=".cg"),)
            gammas = gammas + (tl.load(gamma_ptr + h, mask=h < HIDDEN, other=0),)
        for chunk in tl.static_range(CHUNKS):
            h = chunk * CHUNK + tl.arange(0, CHUNK)
            _normalize_chunk(parked[chunk], gammas[chunk], inv_rms, token, num_tokens, chunk, h, h < HIDDEN,
                             layer_out_ptr, values_ptr, scales_ptr, HIDDEN, CHUNK, VARIANT, ON_GPU)
    else:
        for chunk in range(CHUNKS):
            h = chunk * CHUNK + tl.arange(0, CHUNK)
            in_row = h < HIDDEN
            _normalize_chunk(tl.load(row + h, mask=in_row, other=0, cache_modifier=".cg"),
                             tl.load(gamma_ptr + h, mask=in_row, other=0), inv_rms, token, num_tokens, chunk, h,
                             in_row, layer_out_ptr, values_ptr, scales_ptr, HIDDEN, CHUNK, VARIANT, ON_GPU)


# Runtime scalars are not specialized: one compiled kernel serves every call (and graph capture).
@triton.jit(do_not_specialize=["eps", "num_tokens", "timeout_ns", "capacity", "multicast_address"])
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
    roots_ptr,        # fp32 [capacity, CHUNKS]: chunk roots of the norm's tree          (SPLIT > 1)
    arrivals_ptr,     # int32 [capacity]: programs of a token done with their chunks, 0 between calls
    x_ptr,            # int16 [M, H]: x, or the shared expert output          (PUBLISH)
    gemm2_ptr,        # int16 [rows, H]                                       (PUBLISH_FINALIZE)
    weights_ptr,      # fp32 [M, TOP_K]                                       (PUBLISH_FINALIZE)
    indices_ptr,      # int32 [M, TOP_K]                                      (PUBLISH_FINALIZE)
    peer_table_ptr,   # int64 [TP]: every rank's LL mailbox address           (PUBLISH, not LOCAL)
    multicast_address,  # int64: the LL mailbox's multicast address           (PUBLISH, MULTICAST)
    HIDDEN: tl.constexpr, HC: tl.constexpr, TP: tl.constexpr, RANK: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_HC: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, ROOTS: tl.constexpr,
    SPLIT: tl.constexpr, REDUCED: tl.constexpr, VARIANT: tl.constexpr, PUBLISH: tl.constexpr,
    LOCAL: tl.constexpr, PHASES: tl.constexpr, MULTICAST: tl.constexpr,
    ON_GPU: tl.constexpr, USE_PDL: tl.constexpr,
):
    PER: tl.constexpr = CHUNKS // SPLIT  # chunks per program
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    c = tl.arange(0, CHUNK)
    streams = tl.arange(0, BLOCK_HC)
    in_streams = streams < HC
    tile_rows = (token * HC + streams[:, None]) * HIDDEN

    # A kernel that starts the call waits for the previous kernel before it reads anything. After a
    # publish kernel (which waited for it) the inputs may be read before this kernel's wait, so their
    # latencies overlap the wait for the peers.
    if (PUBLISH != NO_PUBLISH) | LOCAL:
        ptx.grid_dependency_wait(USE_PDL, ON_GPU)
    post = tl.load(post_ptr + token * HC + streams, mask=in_streams, other=0.0)
    comb_bits = tl.load(comb_ptr + (token * HC + streams[:, None]) * HC + streams[None, :],
                        mask=in_streams[:, None] & in_streams[None, :], other=0.0).to(tl.int32, bitcast=True)
    pre_bits = tl.zeros([BLOCK_HC], tl.int32)
    if VARIANT != RESIDUAL_ONLY:
        pre_bits = tl.load(pre_ptr + token * HC + streams, mask=in_streams, other=0.0).to(tl.int32, bitcast=True)
    if LOCAL:
        generation = tl.zeros([], tl.int32)  # no mailbox, no generation
    elif PUBLISH != NO_PUBLISH:
        generation = tl.load(state_ptr + lamport.STATE_NEXT, volatile=True)
    if (PUBLISH == NO_PUBLISH) & (PER == 1):  # the one chunk's streams, before the wait
        h0 = part * CHUNK + c
        residual0 = tl.load(residual_ptr + tile_rows + h0[None, :],
                            mask=in_streams[:, None] & (h0 < HIDDEN)[None, :], other=0).to(tl.int32)
    if PUBLISH == NO_PUBLISH:
        ptx.grid_dependency_wait(USE_PDL, ON_GPU)
        generation = tl.load(state_ptr + lamport.STATE_ACTIVE, volatile=True)
    gen = generation.to(tl.int64)

    if (PUBLISH != NO_PUBLISH) & (not LOCAL) & (PHASES != CONSUME_ONLY):
        for i in range(PER):
            h = (part * PER + i) * CHUNK + c
            contribution = contribution_chunk(x_ptr, gemm2_ptr, weights_ptr, indices_ptr, token, h,
                                              HIDDEN, TOP_K, PUBLISH == PUBLISH_FINALIZE, ON_GPU)
            slot = ((gen * TP + RANK) * capacity + token) * HIDDEN + (part * PER + i) * CHUNK
            lamport.broadcast(contribution, slot, h < HIDDEN, peer_table_ptr, multicast_address, TP, CHUNK,
                              MULTICAST)
    if PHASES == PUBLISH_ONLY:
        return
    if (PUBLISH != NO_PUBLISH) & (not LOCAL):
        # Every program has read the generation; the last to arrive advances it (at the end of the
        # kernel, so the atomic's round trip overlaps the wait for the peers).
        arrived = tl.atomic_add(state_ptr + lamport.STATE_ARRIVED, 1, sem="acq_rel")

    roots = tl.zeros([ROOTS], tl.float32)
    root_index = tl.arange(0, ROOTS)
    for i in range(PER):
        chunk = part * PER + i
        h = chunk * CHUNK + c
        in_row = h < HIDDEN
        if (PUBLISH == NO_PUBLISH) & (PER == 1):
            residual = residual0
        else:
            residual = tl.load(residual_ptr + tile_rows + h[None, :], mask=in_streams[:, None] & in_row[None, :],
                               other=0).to(tl.int32)
        if LOCAL:
            reduced = contribution_chunk(x_ptr, gemm2_ptr, weights_ptr, indices_ptr, token, h,
                                         HIDDEN, TOP_K, PUBLISH == PUBLISH_FINALIZE, ON_GPU)
        else:
            reduced = _reduced_chunk(mailbox_ptr, gen, token, h, in_row, timeout_ns, error_ptr, generation,
                                     capacity, TP, HIDDEN, REDUCED, ON_GPU)
        root = _mix_chunk(reduced, residual, post, comb_bits, pre_bits, streams, token, h, in_row,
                          residual_out_ptr, layer_out_ptr, HIDDEN, HC, BLOCK_HC, CHUNK, VARIANT, ON_GPU)
        roots = tl.where(root_index == chunk, root, roots)
    if (PUBLISH == NO_PUBLISH) & (not REDUCED):
        if (token == 0) & (part == 0):
            lamport.advance_generation(state_ptr, generation)

    if VARIANT != RESIDUAL_ONLY:
        if SPLIT == 1:
            tl.debug_barrier()  # the parked row, written by every thread, is read by every thread
            _normalize_row(roots, token, num_tokens, eps, gamma_ptr, layer_out_ptr, values_ptr, scales_ptr,
                           HIDDEN, CHUNK, CHUNKS, ROOTS, VARIANT, False, ON_GPU)
        else:
            mine = (root_index >= part * PER) & (root_index < part * PER + PER)
            tl.store(roots_ptr + token * CHUNKS + root_index, roots, mask=mine)
            ptx.fence_acq_rel_gpu(ON_GPU)  # this thread's chunk and roots, before the count
            tl.debug_barrier()
            done = tl.atomic_add(arrivals_ptr + token, 1, sem="acq_rel")
            if done == SPLIT - 1:
                tl.store(arrivals_ptr + token, 0)
                roots = tl.load(roots_ptr + token * CHUNKS + root_index, mask=root_index < CHUNKS, other=0.0,
                                cache_modifier=".cg")
                _normalize_row(roots, token, num_tokens, eps, gamma_ptr, layer_out_ptr, values_ptr, scales_ptr,
                               HIDDEN, CHUNK, CHUNKS, ROOTS, VARIANT, True, ON_GPU)
    if (PUBLISH != NO_PUBLISH) & (not LOCAL):
        if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
            lamport.reset_arrivals_and_advance(state_ptr, generation)
    ptx.launch_dependents(USE_PDL, ON_GPU)
