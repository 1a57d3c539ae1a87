"""The benchmark's strong unfused baselines (no bit contract): the mHC tail and the MoE finalize as
an inference engine writes them, bandwidth-bound, fp32 math, 16-byte accesses, the row walked in
CHUNK-wide pieces (H = 5120 and 7168: five and seven of 1024, no padding lanes).

The tail comes in these forms, as engines pick kernels by M:

- ``strong_tail_kernel``, one program per token (large M). Pass 1 over the pieces: post-mix of the
  hc streams, collapse with pre, the bf16 prenorm parked in the layer-input buffer, its squares
  summed. Pass 2 re-reads the prenorm the program just wrote (from L2), applies RMSNorm and, with
  QUANT, writes the MXFP8 copy.
- the same kernel with ``HOLD``: the row's prenorm held in registers between the passes (no park,
  no re-read; launched with twice the warps, so each thread holds half as much).
- the held kernel with a wide ``CHUNK`` (8 columns a thread of 16 warps), its last piece masked
  where it overhangs the row: each load round of a program is bigger.
- ``looped_tail_kernel``, one program per token walking its row in a loop with the next piece's
  loads in flight, the streams one tile, the prenorm parked in shared memory past Triton's own (the
  launch adds the row's bytes): what fits 64 registers (8 programs of 4 warps an SM).
- ``tail_mix_kernel`` then ``tail_norm_kernel``, one program per (token, piece) (small M, where one
  program's walk over the pieces is latency, not bandwidth): the mix writes each piece's sum of
  squares, the norm adds a row's partial sums before normalizing its piece.
- ``STREAMED`` (either form): cache hints for data that passes once (inputs evicted first, the
  streams stored ``.cs``), as engines' bandwidth-bound kernels give them.
- ``PDL`` (every kernel): launched as a programmatic dependent of the kernel before it, as the
  fused kernels are; it waits for that kernel, then at once lets the next one launch, so a launch
  overlaps the previous grid's last wave for both alike.

MXFP8 follows FlashInfer's rules (UE8M0 scale from amax * fp32(1/448), swizzled 128x4 scale layout,
values clamped to +-448 and converted by the hardware); with QUANT the grid also covers the padded
rows up to a multiple of 128, whose scale bytes are zeroed.

``moe_finalize_kernel``: one program per (token, piece): the top-k weighted sum of the permuted GEMM2
rows (index -1: the route is not held here, its row is not read) plus the shared expert's output,
rounded once to bf16.
"""

import triton
import triton.language as tl

from kernels_triton import numerics, ptx

INV_E4M3_MAX = tl.constexpr(1.0 / 448.0)  # rounded to fp32 where it meets an fp32 operand: 0x3B124925


@triton.jit
def _widen(bits, INTERPRETED: tl.constexpr):
    """fp32 of bf16 bits (int16): a shift or a mask a value on the GPU, where Triton's own cast
    takes two instructions for every other one."""
    return numerics.bf16_to_f32(bits, not INTERPRETED)


@triton.jit
def _bf16_bits(x, INTERPRETED: tl.constexpr):
    """bf16 bits (int16) of fp32 ``x``, round to nearest even: two values an instruction on the GPU."""
    if INTERPRETED:
        return x.to(tl.bfloat16).to(tl.int16, bitcast=True)
    return ptx.bf16x2_rn_raw(x)


@triton.jit
def _mix_piece(reduced_ptr, residual_ptr, post_ptr, comb_ptr, pre_ptr, residual_out_ptr, layer_ptr, row64, c,
               HIDDEN: tl.constexpr, HC: tl.constexpr, CHUNK: tl.constexpr, PARK: tl.constexpr = True,
               STREAMED: tl.constexpr = False):
    """Post-mix and collapse of piece ``c`` of a row: stores the streams and (``PARK``) the bf16
    prenorm in the layer-input buffer, returns the prenorm's squares and the prenorm. Every tensor is
    one [CHUNK] piece in one layout: no shuffles through shared memory between the loads, the mix
    and the stores. ``STREAMED``: the inputs are read once and the streams written once, so their
    lines leave L2 first (``evict_first`` loads, ``.cs`` stores)."""
    LOAD_POLICY: tl.constexpr = "evict_first" if STREAMED else ""
    STORE_CACHE: tl.constexpr = ".cs" if STREAMED else ""
    h = c * CHUNK + tl.arange(0, CHUNK)
    x = _load_piece(reduced_ptr + row64 * HIDDEN + h, h, HIDDEN, CHUNK, LOAD_POLICY)
    streams = residual_ptr + row64 * HC * HIDDEN + h
    s0 = _load_piece(streams, h, HIDDEN, CHUNK, LOAD_POLICY)
    s1 = s0
    s2 = s0
    s3 = s0
    if HC > 1:
        s1 = _load_piece(streams + HIDDEN, h, HIDDEN, CHUNK, LOAD_POLICY)
    if HC > 2:
        s2 = _load_piece(streams + 2 * HIDDEN, h, HIDDEN, CHUNK, LOAD_POLICY)
        s3 = _load_piece(streams + 3 * HIDDEN, h, HIDDEN, CHUNK, LOAD_POLICY)
    prenorm = tl.zeros([CHUNK], tl.float32)
    for j in tl.static_range(HC):  # target stream j: comb[s, j] weighs source stream s
        mixed = x * tl.load(post_ptr + row64 * HC + j)
        weights = comb_ptr + row64 * HC * HC + j
        mixed += s0 * tl.load(weights)
        if HC > 1:
            mixed += s1 * tl.load(weights + HC)
        if HC > 2:
            mixed += s2 * tl.load(weights + 2 * HC)
            mixed += s3 * tl.load(weights + 3 * HC)
        out = mixed.to(tl.bfloat16)
        _store_piece(residual_out_ptr + (row64 * HC + j) * HIDDEN + h, out, h, HIDDEN, CHUNK, STORE_CACHE)
        prenorm += out.to(tl.float32) * tl.load(pre_ptr + row64 * HC + j)
    prenorm = prenorm.to(tl.bfloat16)
    if PARK:
        _store_piece(layer_ptr + row64 * HIDDEN + h, prenorm, h, HIDDEN, CHUNK, "")
    p = prenorm.to(tl.float32)
    return p * p, prenorm


@triton.jit
def _load_piece(ptr, h, HIDDEN: tl.constexpr, CHUNK: tl.constexpr, LOAD_POLICY: tl.constexpr):
    """fp32 of the piece's columns ``h``, 0 past the row (masked only where pieces overhang it)."""
    if HIDDEN % CHUNK == 0:
        values = tl.load(ptr, eviction_policy=LOAD_POLICY)
    else:
        values = tl.load(ptr, mask=h < HIDDEN, other=0.0, eviction_policy=LOAD_POLICY)
    return values.to(tl.float32)


@triton.jit
def _store_piece(ptr, values, h, HIDDEN: tl.constexpr, CHUNK: tl.constexpr, STORE_CACHE: tl.constexpr):
    if HIDDEN % CHUNK == 0:
        tl.store(ptr, values, cache_modifier=STORE_CACHE)
    else:
        tl.store(ptr, values, mask=h < HIDDEN, cache_modifier=STORE_CACHE)


@triton.jit
def _dependent_launch(PDL: tl.constexpr):
    """PDL: wait for the kernel before (whose outputs this one reads), then let the next launch."""
    ptx.grid_dependency_wait(PDL, True)
    ptx.launch_dependents(PDL, True)


@triton.jit
def _piece_blocks(c, CHUNK: tl.constexpr):
    """Columns of piece ``c`` as [blocks, 32] (one MXFP8 block a row)."""
    return c * CHUNK + tl.arange(0, CHUNK // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]


@triton.jit
def _parked_piece(layer_ptr, row64, c, HIDDEN: tl.constexpr, CHUNK: tl.constexpr, PARKED_BYTES: tl.constexpr = 0):
    """The bf16 bits (int16) of the prenorm piece pass 1 parked: in the layer-input buffer, or in the
    ``PARKED_BYTES`` of dynamic shared memory the launch adds past Triton's own."""
    h = _piece_blocks(c, CHUNK)
    if PARKED_BYTES > 0:
        return ptx.load_shared_16b(2 * h - PARKED_BYTES)
    return tl.load((layer_ptr + row64 * HIDDEN + h).to(tl.pointer_type(tl.int16), bitcast=True), mask=h < HIDDEN,
                   other=0)


@triton.jit
def _norm_piece(layer_ptr, weight_ptr, values_ptr, scales_ptr, row64, c, inv, prenorm, HIDDEN: tl.constexpr,
                CHUNK: tl.constexpr, QUANT: tl.constexpr, INTERPRETED: tl.constexpr, gamma=None):
    """RMSNorm of piece ``c`` from its prenorm's bf16 bits [blocks, 32] (and its MXFP8 copy);
    ``gamma``: the piece's weights in fp32, where loaded already."""
    h = _piece_blocks(c, CHUNK)
    if gamma is None:
        gamma = _load_piece(weight_ptr + h, h, HIDDEN, CHUNK, "")
    y = _bf16_bits(_widen(prenorm, INTERPRETED) * inv * gamma, INTERPRETED)
    _store_piece(layer_ptr + row64 * HIDDEN + h, y.to(tl.bfloat16, bitcast=True), h, HIDDEN, CHUNK, "")
    if QUANT:
        yf = _widen(y, INTERPRETED)
        scale = tl.max(tl.abs(yf), axis=1) * INV_E4M3_MAX
        bits = scale.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        bump = (mantissa != 0) & ((exponent != 0) | (mantissa > 0x400000))
        u = tl.minimum(exponent + bump.to(tl.int32), 254)
        u = tl.where(scale <= 0, 0, u)  # a NaN amax (an all-NaN block) keeps 254
        inverse = ((254 - u) << 23).to(tl.float32, bitcast=True)
        inverse = tl.where(u == 0, 0.0, inverse)
        q = yf * inverse[:, None]
        if INTERPRETED:  # values_ptr is uint8 here: the interpreter's fp8 cast loses exponent carries
            q = tl.minimum(tl.maximum(tl.where(q != q, 448.0, q), -448.0), 448.0)
            _store_piece(values_ptr + row64 * HIDDEN + h, _e4m3_bits(q).to(tl.uint8), h, HIDDEN, CHUNK, "")
        else:  # min.f32 takes a NaN to 448 and the conversion saturates below -448: the same clamp
            q = tl.minimum(q, 448.0)
            _store_piece(values_ptr + row64 * HIDDEN + h, q.to(tl.float8e4nv), h, HIDDEN, CHUNK, "")
        col = c * (CHUNK // 32) + tl.arange(0, CHUNK // 32)
        _store_piece(scales_ptr + _scale_offset(row64, col, HIDDEN // 32), u.to(tl.uint8), col, HIDDEN // 32,
                     CHUNK // 32, "")


@triton.jit
def strong_tail_kernel(reduced_ptr, residual_ptr, post_ptr, comb_ptr, pre_ptr, weight_ptr,
                       residual_out_ptr, layer_ptr, values_ptr, scales_ptr, m, eps,
                       HIDDEN: tl.constexpr, HC: tl.constexpr, CHUNK: tl.constexpr, QUANT: tl.constexpr,
                       SCALE_COLS_P2: tl.constexpr, HOLD: tl.constexpr = False, STREAMED: tl.constexpr = False,
                       INTERPRETED: tl.constexpr = False, PDL: tl.constexpr = False):
    """One program per token; ``HOLD`` keeps the prenorm pieces in registers instead of parking them.
    The last piece is masked where CHUNK does not divide the row (the wide form)."""
    PIECES: tl.constexpr = (HIDDEN + CHUNK - 1) // CHUNK
    _dependent_launch(PDL)
    row = tl.program_id(0)
    if row < m:
        row64 = row.to(tl.int64)
        squares = tl.zeros([CHUNK], tl.float32)
        held = ()
        for c in tl.static_range(PIECES):
            piece_squares, prenorm = _mix_piece(reduced_ptr, residual_ptr, post_ptr, comb_ptr, pre_ptr,
                                                residual_out_ptr, layer_ptr, row64, c, HIDDEN, HC, CHUNK, not HOLD,
                                                STREAMED)
            squares += piece_squares
            held = held + (prenorm,)
        inv = tl.math.rsqrt(tl.sum(squares, axis=0) / HIDDEN + eps)
        if not HOLD:
            tl.debug_barrier()  # pass 2 reads what other threads of this program stored in pass 1
        for c in tl.static_range(PIECES):
            if HOLD:
                prenorm = tl.reshape(held[c], (CHUNK // 32, 32)).to(tl.int16, bitcast=True)
            else:
                prenorm = _parked_piece(layer_ptr, row64, c, HIDDEN, CHUNK)
            _norm_piece(layer_ptr, weight_ptr, values_ptr, scales_ptr, row64, c, inv, prenorm, HIDDEN, CHUNK, QUANT,
                        INTERPRETED)
    elif QUANT:
        _zero_scales_of_padded_row(scales_ptr, row, HIDDEN, SCALE_COLS_P2)


@triton.jit
def _piece_inputs(reduced_ptr, residual_ptr, row64, c, streams, HIDDEN: tl.constexpr, HC: tl.constexpr,
                  CHUNK: tl.constexpr, LOAD_POLICY: tl.constexpr):
    """Piece ``c``'s reduced row and its streams as one [HC_P2, CHUNK] tile, as loaded (bf16: widened
    where the mix uses them, so a piece in flight holds half the registers); past the row every lane
    is masked off."""
    h = c * CHUNK + tl.arange(0, CHUNK)
    in_row = h < HIDDEN
    x = tl.load(reduced_ptr + row64 * HIDDEN + h, mask=in_row, other=0.0, eviction_policy=LOAD_POLICY)
    tile = residual_ptr + (row64 * HC + streams[:, None]) * HIDDEN + h[None, :]
    s = tl.load(tile, mask=(streams < HC)[:, None] & in_row[None, :], other=0.0, eviction_policy=LOAD_POLICY)
    return x, s


@triton.jit
def _row_of(tile, streams, source):
    """Row ``source`` of the streams' tile of bf16 bits (int16), extracted exactly (-0.0 included)."""
    return tl.sum(tl.where(streams[:, None] == source, tile, 0), axis=0).to(tl.int16)


@triton.jit
def looped_tail_kernel(reduced_ptr, residual_ptr, post_ptr, comb_ptr, pre_ptr, weight_ptr,
                       residual_out_ptr, layer_ptr, values_ptr, scales_ptr, m, eps,
                       HIDDEN: tl.constexpr, HC: tl.constexpr, CHUNK: tl.constexpr, QUANT: tl.constexpr,
                       SCALE_COLS_P2: tl.constexpr, STREAMED: tl.constexpr = False, INTERPRETED: tl.constexpr = False,
                       PDL: tl.constexpr = False, PARKED_BYTES: tl.constexpr = 0, NUM_WARPS: tl.constexpr = 4):
    """One program per token walking its row in a loop of CHUNK-wide pieces, each piece's inputs
    loaded while the piece before is mixed (in the second pass, its weights while the piece before is
    normalized); the streams one [HC_P2, CHUNK] tile mixed for every target at once, one source
    stream widened at a time; the prenorm parked (shared memory on the GPU), its squares summed per
    warp (one cross-warp sum a row)."""
    PIECES: tl.constexpr = (HIDDEN + CHUNK - 1) // CHUNK
    HC_P2: tl.constexpr = 1 << (HC - 1).bit_length()
    LOAD_POLICY: tl.constexpr = "evict_first" if STREAMED else ""
    STORE_CACHE: tl.constexpr = ".cs" if STREAMED else ""
    _dependent_launch(PDL)
    row = tl.program_id(0)
    if row < m:
        row64 = row.to(tl.int64)
        streams = tl.arange(0, HC_P2)
        in_streams = streams < HC
        post = tl.load(post_ptr + row64 * HC + streams, mask=in_streams, other=0.0)
        pre = tl.load(pre_ptr + row64 * HC + streams, mask=in_streams, other=0.0)
        # comb[s, t] weighs source stream s into target t.
        comb = tl.load(comb_ptr + row64 * HC * HC + streams[:, None] * HC + streams[None, :],
                       mask=in_streams[:, None] & in_streams[None, :], other=0.0)
        squares = tl.zeros([NUM_WARPS], tl.float32)  # per warp: no barrier inside the loop
        next_x, next_s = _piece_inputs(reduced_ptr, residual_ptr, row64, 0, streams, HIDDEN, HC, CHUNK, LOAD_POLICY)
        for c in range(PIECES):
            x, s = next_x.to(tl.int16, bitcast=True), next_s.to(tl.int16, bitcast=True)
            next_x, next_s = _piece_inputs(reduced_ptr, residual_ptr, row64, c + 1, streams, HIDDEN, HC, CHUNK,
                                           LOAD_POLICY)
            h = c * CHUNK + tl.arange(0, CHUNK)
            in_row = h < HIDDEN
            mixed = _widen(x, INTERPRETED)[None, :] * post[:, None]  # [target, CHUNK]
            for source in tl.static_range(HC):
                stream = _widen(_row_of(s, streams, source), INTERPRETED)
                weights = tl.sum(tl.where(streams[:, None] == source, comb, 0.0), axis=0)  # over targets
                mixed += stream[None, :] * weights[:, None]
            out = _bf16_bits(mixed, INTERPRETED)
            tl.store(residual_out_ptr + (row64 * HC + streams[:, None]) * HIDDEN + h[None, :],
                     out.to(tl.bfloat16, bitcast=True), mask=in_streams[:, None] & in_row[None, :],
                     cache_modifier=STORE_CACHE)
            prenorm = _bf16_bits(tl.sum(_widen(out, INTERPRETED) * pre[:, None], axis=0), INTERPRETED)
            if PARKED_BYTES > 0:
                ptx.store_shared_16b(2 * h - PARKED_BYTES, prenorm)
            else:
                tl.store(layer_ptr + row64 * HIDDEN + h, prenorm.to(tl.bfloat16, bitcast=True), mask=in_row)
            p = _widen(prenorm, INTERPRETED)
            squares += tl.sum(tl.reshape(p * p, (NUM_WARPS, CHUNK // NUM_WARPS)), axis=1)
        inv = tl.math.rsqrt(tl.sum(squares, axis=0) / HIDDEN + eps)
        tl.debug_barrier()  # pass 2 reads what other threads of this program parked in pass 1
        next_gamma = tl.load(weight_ptr + _piece_blocks(0, CHUNK))
        for c in range(PIECES):  # the next piece's weights in flight while this one is normalized
            gamma = _widen(next_gamma.to(tl.int16, bitcast=True), INTERPRETED)
            ahead = _piece_blocks(c + 1, CHUNK)
            next_gamma = tl.load(weight_ptr + ahead, mask=ahead < HIDDEN, other=0.0)
            _norm_piece(layer_ptr, weight_ptr, values_ptr, scales_ptr, row64, c, inv,
                        _parked_piece(layer_ptr, row64, c, HIDDEN, CHUNK, PARKED_BYTES), HIDDEN, CHUNK, QUANT,
                        INTERPRETED, gamma)
    elif QUANT:
        _zero_scales_of_padded_row(scales_ptr, row, HIDDEN, SCALE_COLS_P2)


@triton.jit
def _zero_scales_of_padded_row(scales_ptr, row, HIDDEN: tl.constexpr, SCALE_COLS_P2: tl.constexpr):
    """A padded row of the 128-row scale tile: its scale bytes are 0."""
    padded = tl.arange(0, SCALE_COLS_P2)
    tl.store(scales_ptr + _scale_offset(row.to(tl.int64), padded, HIDDEN // 32),
             tl.zeros([SCALE_COLS_P2], tl.uint8), mask=padded < HIDDEN // 32)


@triton.jit
def tail_mix_kernel(reduced_ptr, residual_ptr, post_ptr, comb_ptr, pre_ptr, residual_out_ptr, layer_ptr,
                    partial_ptr, HIDDEN: tl.constexpr, HC: tl.constexpr, CHUNK: tl.constexpr,
                    STREAMED: tl.constexpr = False, PDL: tl.constexpr = False):
    _dependent_launch(PDL)
    row64 = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    squares, _ = _mix_piece(reduced_ptr, residual_ptr, post_ptr, comb_ptr, pre_ptr, residual_out_ptr, layer_ptr,
                            row64, c, HIDDEN, HC, CHUNK, True, STREAMED)
    tl.store(partial_ptr + row64 * (HIDDEN // CHUNK) + c, tl.sum(squares, axis=0))


@triton.jit
def tail_norm_kernel(layer_ptr, weight_ptr, partial_ptr, values_ptr, scales_ptr, m, eps,
                     HIDDEN: tl.constexpr, CHUNK: tl.constexpr, QUANT: tl.constexpr, PIECES_P2: tl.constexpr,
                     INTERPRETED: tl.constexpr = False, PDL: tl.constexpr = False):
    _dependent_launch(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    if row < m:
        row64 = row.to(tl.int64)
        pieces = tl.arange(0, PIECES_P2)
        partial = tl.load(partial_ptr + row64 * (HIDDEN // CHUNK) + pieces, mask=pieces < HIDDEN // CHUNK, other=0.0)
        inv = tl.math.rsqrt(tl.sum(partial, axis=0) / HIDDEN + eps)
        _norm_piece(layer_ptr, weight_ptr, values_ptr, scales_ptr, row64, c, inv,
                    _parked_piece(layer_ptr, row64, c, HIDDEN, CHUNK), HIDDEN, CHUNK, QUANT, INTERPRETED)
    else:
        if QUANT:  # a padded row: this piece's scale bytes are 0
            col = c * (CHUNK // 32) + tl.arange(0, CHUNK // 32)
            tl.store(scales_ptr + _scale_offset(row.to(tl.int64), col, HIDDEN // 32), tl.zeros([CHUNK // 32], tl.uint8))


@triton.jit
def _scale_offset(row, col, cols):
    """Byte of (row, scale column) in the swizzled 128x4 layout (``lamport_mhc.mxfp8.scale_offset``);
    ``cols`` is a multiple of 4 (hidden a multiple of 128)."""
    return ((col % 4) + (col // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4
            + (row // 128) * (128 * cols))


@triton.jit
def _e4m3_bits(q):
    """What ``cvt.rn.satfinite.e4m3x2.f32`` gives for |q| <= 448, in integers (the interpreter's
    twin of the hardware conversion): RNE to 3 mantissa bits, subnormals below 2^-6."""
    bits = q.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    scaled = tl.abs(q) * 512.0
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.int32)  # RNE to an integer
    code = tl.where(tl.abs(q) < 0.015625, subnormal, normal)
    return code | (((bits >> 31) & 1) << 7)


@triton.jit
def moe_finalize_kernel(gemm2_ptr, weights_ptr, index_ptr, shared_ptr, out_ptr,
                        HIDDEN: tl.constexpr, TOP_K: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    _dependent_launch(PDL)
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for k in tl.static_range(TOP_K):
        permuted = tl.load(index_ptr + token * TOP_K + k)
        weight = tl.load(weights_ptr + token * TOP_K + k)
        held = permuted >= 0  # a route held elsewhere: nothing read, its weight ignored (even NaN)
        values = tl.load(gemm2_ptr + tl.maximum(permuted, 0).to(tl.int64) * HIDDEN + h, mask=held & (h < HIDDEN),
                         other=0.0)
        acc += values.to(tl.float32) * tl.where(held, weight, 0.0)
    acc += tl.load(shared_ptr + token * HIDDEN + h).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + h, acc.to(tl.bfloat16))
