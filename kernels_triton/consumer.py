"""The mHC consumer: one program per token waits for the call's reduced sublayer output, post-mixes
the hc residual streams, collapses them with the pre-mix, RMS-normalizes, and optionally writes the
layer input as MXFP8.

Specialized by constexprs:
- ``PUBLISH`` (LL only): 0, the publish kernel ran before; otherwise the call is one kernel, whose
  program ``t`` first stores token ``t``'s contribution (1: ``x``, 2: the MoE finalize) into every
  rank's mailbox and then consumes it. Every program must be resident at once (M <= SM count), as
  each waits for its twins on the other ranks. ``PHASES`` (publish only, consume only, both) lets the
  simulated group, which runs ranks one after another, launch the two halves separately.
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
def _reduced_row(mailbox_ptr, gen, token, h, in_row, timeout_ns, error_ptr, generation, capacity,
                 TP: tl.constexpr, HIDDEN: tl.constexpr,
                 REDUCED: tl.constexpr, ON_GPU: tl.constexpr):
    """bf16 bits of the all-reduced row, once every source has landed; re-arms what it read."""
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
        reduced = canonical_zero(f32_to_bf16(acc))
    return reduced


@triton.jit
def _store_mxfp8(layer, token, num_tokens, h, values_ptr, scales_ptr,
                 HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    """FlashInfer's MXFP8 rules on the bf16 layer input (see lamport_mhc.mxfp8)."""
    COLS: tl.constexpr = HIDDEN // 32
    PADDED_COLS: tl.constexpr = (COLS + 3) // 4 * 4
    magnitude = layer.to(tl.int32) & 0x7FFF
    # Ordered as integers, bf16 magnitudes compare like the values; a NaN lane only counts when the
    # whole block is NaN (max.bf16x2 / max.f32 return the number).
    keyed = tl.where(magnitude > 0x7F80, -1, magnitude)
    block_max = tl.max(tl.reshape(keyed, (BLOCK_H // 32, 32)), axis=1)
    nan = tl.full([BLOCK_H // 32], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    amax = tl.where(block_max < 0, nan, (block_max << 16).to(tl.float32, bitcast=True))
    scale = ue8m0_scale(amax)
    scaled = tl.reshape(bf16_to_f32(layer), (BLOCK_H // 32, 32)) * inverse_scale(scale)[:, None]
    codes = tl.reshape(f32_to_e4m3(scaled), (BLOCK_H,))
    tl.store(values_ptr + token * HIDDEN + h, codes.to(tl.uint8), mask=h < HIDDEN)
    cols = tl.arange(0, BLOCK_H // 32)
    tl.store(scales_ptr + scale_offset(token, cols, PADDED_COLS), scale.to(tl.uint8), mask=cols < COLS)
    # Rows [M, roundup(M, 128)) of the last scale tile are zero: fewer than 128 rows, split into
    # one contiguous run per program.
    padding = (num_tokens + 127) // 128 * 128 - num_tokens
    run = (padding + num_tokens - 1) // num_tokens
    offsets = tl.arange(0, 128)
    rows = num_tokens + token * run + offsets
    in_run = (offsets < run) & (rows < num_tokens + padding)
    tl.store(scales_ptr + scale_offset(rows[:, None], cols[None, :], PADDED_COLS),
             tl.zeros([128, BLOCK_H // 32], tl.uint8), mask=in_run[:, None] & (cols < COLS)[None, :])


# Runtime scalars are not specialized: one compiled kernel serves every call (and graph capture).
@triton.jit(do_not_specialize=["eps", "num_tokens", "timeout_ns", "capacity", "multicast_address"])
def consumer_kernel(
    mailbox_ptr,      # int16: LL [3][TP][capacity][H] contributions, or BT [3][capacity][H] sums
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
    error_ptr,        # int32 [4]
    eps,              # fp32
    num_tokens,       # M of the call
    timeout_ns,       # int64, 0 = wait forever
    capacity,         # max_num_tokens of the build
    x_ptr,            # int16 [M, H]: x, or the shared expert output          (PUBLISH)
    gemm2_ptr,        # int16 [rows, H]                                       (PUBLISH_FINALIZE)
    weights_ptr,      # fp32 [M, TOP_K]                                       (PUBLISH_FINALIZE)
    indices_ptr,      # int32 [M, TOP_K]                                      (PUBLISH_FINALIZE)
    peer_table_ptr,   # int64 [TP]: every rank's LL mailbox address           (PUBLISH)
    multicast_address,  # int64: the LL mailbox's multicast address           (PUBLISH, MULTICAST)
    HIDDEN: tl.constexpr, HC: tl.constexpr, TP: tl.constexpr, RANK: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HC: tl.constexpr, CHUNK: tl.constexpr, REDUCED: tl.constexpr,
    VARIANT: tl.constexpr, PUBLISH: tl.constexpr, PHASES: tl.constexpr, MULTICAST: tl.constexpr,
    ON_GPU: tl.constexpr, USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    in_row = h < HIDDEN
    streams = tl.arange(0, BLOCK_HC)
    in_streams = streams < HC

    # Every input is loaded up front, so their memory latencies overlap each other and the wait for
    # the peers instead of adding up after it. After a publish kernel (which waited for the previous
    # kernel) they may be read before this kernel's wait; a one-kernel call waits first.
    if PUBLISH != NO_PUBLISH:
        ptx.grid_dependency_wait(USE_PDL, ON_GPU)
        generation = tl.load(state_ptr + lamport.STATE_NEXT, volatile=True)
    tile = (token * HC + streams[:, None]) * HIDDEN + h[None, :]
    tile_mask = in_streams[:, None] & in_row[None, :]
    residual = tl.load(residual_ptr + tile, mask=tile_mask, other=0).to(tl.int32)
    post = tl.load(post_ptr + token * HC + streams, mask=in_streams, other=0.0)
    comb_bits = tl.load(comb_ptr + (token * HC + streams[:, None]) * HC + streams[None, :],
                        mask=in_streams[:, None] & in_streams[None, :], other=0.0).to(tl.int32, bitcast=True)
    if VARIANT != RESIDUAL_ONLY:
        pre_bits = tl.load(pre_ptr + token * HC + streams, mask=in_streams, other=0.0).to(tl.int32, bitcast=True)
        gamma = bf16_to_f32(tl.load(gamma_ptr + h, mask=in_row, other=0))
    if PUBLISH == NO_PUBLISH:
        ptx.grid_dependency_wait(USE_PDL, ON_GPU)
        generation = tl.load(state_ptr + lamport.STATE_ACTIVE, volatile=True)
    gen = generation.to(tl.int64)

    if (PUBLISH != NO_PUBLISH) & (PHASES != CONSUME_ONLY):
        for chunk in tl.static_range(HIDDEN // CHUNK):
            columns = chunk * CHUNK + tl.arange(0, CHUNK)
            contribution = contribution_chunk(x_ptr, gemm2_ptr, weights_ptr, indices_ptr, token, columns, HIDDEN,
                                              TOP_K, PUBLISH == PUBLISH_FINALIZE, ON_GPU)
            lamport.broadcast(contribution, ((gen * TP + RANK) * capacity + token) * HIDDEN + chunk * CHUNK,
                              peer_table_ptr, multicast_address, TP, CHUNK, MULTICAST)
    if PHASES == PUBLISH_ONLY:
        return
    if PUBLISH != NO_PUBLISH:
        # Every program has read the generation; the last to arrive advances it (at the end of the
        # kernel, so the atomic's round trip overlaps the wait for the peers).
        arrived = tl.atomic_add(state_ptr + lamport.STATE_ARRIVED, 1, sem="acq_rel")
    reduced = _reduced_row(mailbox_ptr, gen, token, h, in_row, timeout_ns,
                           error_ptr, generation, capacity, TP, HIDDEN, REDUCED, ON_GPU)
    if (PUBLISH == NO_PUBLISH) & (not REDUCED):
        if token == 0:
            lamport.advance_generation(state_ptr, generation)

    # Post-mix, all targets at once: m[j] = reduced * post[j], then m[j] = fma(res[s], comb[s, j], m[j]).
    mixed = bf16_to_f32(reduced)[None, :] * post[:, None]
    for source in tl.static_range(HC):
        stream = bf16_to_f32(row_of(residual, streams, source).to(tl.int16))
        comb = row_of(comb_bits, streams, source).to(tl.float32, bitcast=True)
        mixed = ptx.fma_rn(tl.broadcast_to(stream[None, :], (BLOCK_HC, BLOCK_H)),
                           tl.broadcast_to(comb[:, None], (BLOCK_HC, BLOCK_H)), mixed, ON_GPU)
    residual_out = f32_to_bf16(mixed)
    tl.store(residual_out_ptr + tile, residual_out, mask=tile_mask)

    if VARIANT != RESIDUAL_ONLY:
        # Collapse with the pre-mix, in target order.
        collapsed = tl.zeros([BLOCK_H], tl.float32)
        residual_out = residual_out.to(tl.int32)
        for target in tl.static_range(HC):
            weight = tl.sum(tl.where(streams == target, pre_bits, 0)).to(tl.float32, bitcast=True)
            stream = bf16_to_f32(row_of(residual_out, streams, target).to(tl.int16))
            collapsed = ptx.fma_rn(stream, tl.broadcast_to(weight, (BLOCK_H,)), collapsed, ON_GPU)
        prenorm = bf16_to_f32(f32_to_bf16(collapsed))

        # RMSNorm: the pairwise tree of rounded squares, then IEEE division and square root.
        squares = tl.where(in_row, prenorm * prenorm, 0.0)
        sum_squares = pairwise_sum(squares, BLOCK_H)
        mean = tl.math.div_rn(sum_squares, tl.full([], HIDDEN, tl.float32)) + eps
        inv_rms = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.math.sqrt_rn(mean))
        layer = f32_to_bf16((prenorm * inv_rms) * gamma)
        tl.store(layer_out_ptr + token * HIDDEN + h, layer, mask=in_row)
        if VARIANT == QUANT:
            _store_mxfp8(layer, token, num_tokens, h, values_ptr, scales_ptr, HIDDEN, BLOCK_H)
    if PUBLISH != NO_PUBLISH:
        if arrived == tl.num_programs(0) - 1:
            lamport.reset_arrivals_and_advance(state_ptr, generation)
    ptx.launch_dependents(USE_PDL, ON_GPU)
