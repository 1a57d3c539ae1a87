"""The mHC consumer, as ``kernels_triton.consumer`` (same layouts, state words and bits): per token,
wait for the call's all-reduced sublayer output, post-mix the hc residual streams, collapse them
with the pre-mix, RMS-normalize, and optionally write the layer input as MXFP8.

Specialized at construction:
- ``bt``: the mailbox holds the owners' sums ``[gen][t]`` (one 16-byte poll per fragment);
  otherwise (LL) every rank's contribution ``[gen][rank][t]``, polled and summed in rank order
  with ``add.rn`` from +0, rounded to bf16, -0.0 -> +0.0. Either way the slots read are re-armed
  with the sentinel; LL advances the generation (BT's owner reduce already did).
- ``variant``: "plain", "quant" (also MXFP8 values and swizzled 128x4 UE8M0 scales, zeroing the
  scales of the padding rows up to a multiple of 128), "residual" (writes only the streams).
- ``publish`` (LL only): None, the publish kernel ran before; "x" or "finalize": the call is one
  kernel, whose CTAs first store their fragments of the token's contribution (``x`` or the MoE
  finalize) into every rank's mailbox at the generation NEXT, count themselves in STATE_ARRIVED, and
  then consume; the last CTA to arrive resets the count and advances NEXT. Every CTA must be
  resident at once (each waits for its twins on the other ranks).

Grid (M, ctas), block ``threads``: each thread owns one 16-byte fragment (8 bf16) of its token, so
a token spans ``ctas`` CTAs (H = 5120: 5 x 128 threads). Variants with the norm launch those CTAs as
one thread-block cluster (1, ctas, 1) and reduce the sum of squares through distributed shared
memory: every warp stores its partial into a slot of every CTA of the cluster. A portable cluster
has at most 8 CTAs, so these variants take H <= 8192.

The sum of squares is the contract's adjacent-pair tree, built from exact tree nodes: a thread's
8 lanes are an aligned 8-element subtree (3 levels); butterfly shuffle level ``d`` (1, 2, 4, 8, 16)
joins the aligned subtrees of threads ``i`` and ``i ^ d``, each thread adding the lower-addressed
operand first, so every thread of a warp holds the node of its aligned 256 elements; the slots
(CTA-major, warp-minor: element order) are then joined by the same tree, padded with +0.0 slots up
to a power of two. Lanes past H and padding slots are +0.0, as the contract's padding; a tree taller
than the contract's only adds +0.0 to its root, and ``x + 0.0 == x`` for every sum of squares (+0,
positive, +Inf or NaN).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32
from flashinfer.cute_dsl.fp4_common import st_global_u64
from flashinfer.quantization.quantization_cute_dsl_utils import (INV_FLOAT8_E4M3_MAX, bfloat2_hmax_reduce_to_f32,
                                                                bfloat2_max_abs_4, bfloat2x4_to_fp8x8_packed,
                                                                compute_sf_index_swizzled_128x4_gpu,
                                                                float_to_ue8m0_fast, reduce_max_4threads,
                                                                ue8m0_to_inv_scale_fast)

from lamport_mhc import layout

from . import lamport, primitives
from .numerics import (LANES, WORDS, as_f32, canonical_zero, canonical_zero_word, f32_to_bf16, high_f32, low_f32,
                       pack)
from .publish import finalize_fragment, launch_shape

VARIANTS = ("plain", "quant", "residual")
WARP = 32
MAX_CLUSTER = 8  # portable thread-block cluster size
FRAGMENTS_PER_SCALE = layout.MXFP8_BLOCK // LANES            # 4 threads share one scale
FRAGMENTS_PER_SCALE_WORD = FRAGMENTS_PER_SCALE * layout.SCALE_TILE_COLS  # 16 threads: 4 scale bytes


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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


@cute.jit
def reduced_fragment(mailbox: cute.Tensor, gen: Int64, generation: Int32, token: Int32, column: Int32,
                     timeout_ns: Int64, error: cute.Tensor, capacity: Int32, tp: cutlass.Constexpr[int],
                     hidden: cutlass.Constexpr[int], bt: cutlass.Constexpr[bool]):
    """bf16 words of the all-reduced fragment, once every source has landed; re-arms what it read."""
    if cutlass.const_expr(bt):
        slot = lamport.element_address(mailbox, (gen * Int64(capacity) + Int64(token)) * Int64(hidden)
                                       + Int64(column))
        words = lamport.poll(slot, timeout_ns, error, Int32(-1), generation, token)
        primitives.store_sentinel_v4(slot)
        out = list(words)
    else:
        slots = [lamport.element_address(mailbox, ((gen * Int64(tp) + Int64(source)) * Int64(capacity)
                                                   + Int64(token)) * Int64(hidden) + Int64(column))
                 for source in range(tp)]
        acc = [Float32(0.0) for _ in range(LANES)]
        for source in cutlass.range_constexpr(tp):
            words = lamport.poll(slots[source], timeout_ns, error, Int32(source), generation, token)
            for lane in cutlass.range_constexpr(LANES):
                acc[lane] = primitives.add_rn(acc[lane], lane_f32(words, lane))
        for source in cutlass.range_constexpr(tp):
            primitives.store_sentinel_v4(slots[source])
        out = [pack(canonical_zero(f32_to_bf16(acc[2 * i])), canonical_zero(f32_to_bf16(acc[2 * i + 1])))
               for i in range(WORDS)]
    return out[0], out[1], out[2], out[3]


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


class ConsumerKernel:
    """The mHC consumer of one protocol and variant; ``cute.compile(ConsumerKernel(...), *args)`` with
    the arguments of ``__call__``."""

    def __init__(self, *, hidden: int, hc: int, tp: int, variant: str, bt: bool, use_pdl: bool,
                 publish: str | None = None, rank: int = 0, top_k: int = 1, multicast: bool = False):
        if hidden % LANES:
            raise ValueError(f"hidden must be a multiple of {LANES}, got {hidden}")
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if variant == "quant" and hidden % layout.HIDDEN_MULTIPLE_MXFP8:
            raise ValueError(f"the quant consumer needs hidden % {layout.HIDDEN_MULTIPLE_MXFP8} == 0, got {hidden}")
        if publish not in (None, "x", "finalize"):
            raise ValueError(f"publish must be None, 'x' or 'finalize', got {publish!r}")
        if publish is not None and bt:
            raise ValueError("only LL calls run as one kernel")
        self.hidden, self.hc, self.tp, self.variant, self.bt, self.use_pdl = hidden, hc, tp, variant, bt, use_pdl
        self.publish, self.rank, self.top_k, self.multicast = publish, rank, top_k, multicast
        self.fragments = hidden // LANES
        self.threads, self.ctas = launch_shape(hidden)
        self.norm = variant != "residual"
        self.quant = variant == "quant"
        if self.norm and self.ctas > MAX_CLUSTER:
            raise ValueError(f"the {variant} consumer spreads a token over one cluster of at most {MAX_CLUSTER} CTAs "
                             f"of {self.threads} threads: hidden <= {MAX_CLUSTER * self.threads * LANES}, got {hidden}")
        self.warps = self.threads // WARP
        self.slots = self.ctas * self.warps  # one per warp of the token, in element order
        self.tree_slots = _pow2_at_least(self.slots)
        self.padded_scale_cols = -(-(hidden // layout.MXFP8_BLOCK) // layout.SCALE_TILE_COLS) * layout.SCALE_TILE_COLS

    @cute.jit
    def __call__(self, mailbox: cute.Tensor, residual: cute.Tensor, post: cute.Tensor, comb: cute.Tensor,
                 pre: cute.Tensor, gamma: cute.Tensor, residual_out: cute.Tensor, layer_out: cute.Tensor,
                 values: cute.Tensor, scales: cute.Tensor, state: cute.Tensor, error: cute.Tensor, eps: Float32,
                 num_tokens: Int32, timeout_ns: Int64, capacity: Int32, x: cute.Tensor, gemm2: cute.Tensor,
                 weights: cute.Tensor, indices: cute.Tensor, peer_table: cute.Tensor, multicast_address: Int64,
                 stream: cuda.CUstream):
        """``mailbox``: int16, LL [3][tp][capacity][H] contributions or BT [3][capacity][H] sums;
        ``residual``/``residual_out`` int16 [M*hc*H]; ``post``, ``pre`` fp32 [M*hc]; ``comb`` fp32
        [M*hc*hc] as [token, source, target]; ``gamma`` int16 [H]; ``layer_out`` int16 [M*H];
        ``values`` uint8 [M*H] and ``scales`` uint8 (swizzled) for quant; ``state`` int32 [3] of the
        protocol; ``error`` int32 [6]; ``timeout_ns``: 0 waits forever. One-kernel forms only (as the
        publish kernel): ``x`` int16 [M*H] (the contribution, or the shared expert output), ``gemm2``,
        ``weights``, ``indices`` (finalize), ``peer_table`` int64 [tp] of the LL mailbox's addresses and
        its ``multicast_address``."""
        kernel = self.kernel(mailbox, residual, post, comb, pre, gamma, residual_out, layer_out, values, scales,
                             state, error, eps, num_tokens, timeout_ns, capacity, x, gemm2, weights, indices,
                             peer_table, multicast_address)
        if cutlass.const_expr(self.norm):
            kernel.launch(grid=(num_tokens, self.ctas, 1), block=(self.threads, 1, 1), cluster=(1, self.ctas, 1),
                          smem=self.slots * 4, stream=stream, use_pdl=self.use_pdl)
        else:
            kernel.launch(grid=(num_tokens, self.ctas, 1), block=(self.threads, 1, 1), stream=stream,
                          use_pdl=self.use_pdl)

    @cute.kernel
    def kernel(self, mailbox: cute.Tensor, residual: cute.Tensor, post: cute.Tensor, comb: cute.Tensor,
               pre: cute.Tensor, gamma: cute.Tensor, residual_out: cute.Tensor, layer_out: cute.Tensor,
               values: cute.Tensor, scales: cute.Tensor, state: cute.Tensor, error: cute.Tensor, eps: Float32,
               num_tokens: Int32, timeout_ns: Int64, capacity: Int32, x: cute.Tensor, gemm2: cute.Tensor,
               weights: cute.Tensor, indices: cute.Tensor, peer_table: cute.Tensor, multicast_address: Int64):
        hidden, hc = self.hidden, self.hc
        tidx, _, _ = cute.arch.thread_idx()
        token, chunk, _ = cute.arch.block_idx()
        fragment = chunk * Int32(self.threads) + tidx
        column = fragment * Int32(LANES)
        in_row = fragment < Int32(self.fragments)
        if cutlass.const_expr(self.norm):
            # This CTA has started: peers may store into its shared memory after their cluster_wait.
            primitives.cluster_arrive_relaxed()

        generation = Int32(0)
        if cutlass.const_expr(self.publish is not None):
            # One kernel: nothing ran before it in this call, so it waits before its first load.
            if cutlass.const_expr(self.use_pdl):
                primitives.grid_dependency_wait()
            generation = primitives.load_volatile_b32(lamport.element_address(state, Int64(lamport.STATE_NEXT)))
        # Inputs first, so their latencies overlap the wait: after a publish kernel (which waited for
        # its predecessor before letting this kernel start) they are complete.
        streams = [primitives.load_v4(lamport.element_address(
            residual, (Int64(token) * Int64(hc) + Int64(s)) * Int64(hidden) + Int64(column)), Int32(in_row))
            for s in range(hc)]
        post_mix = [Float32(post[token * Int32(hc) + Int32(j)]) for j in range(hc)]
        comb_mix = [[Float32(comb[(token * Int32(hc) + Int32(s)) * Int32(hc) + Int32(j)]) for j in range(hc)]
                    for s in range(hc)]
        pre_mix = [Float32(0.0) for _ in range(hc)]
        gamma_words = [Uint32(0) for _ in range(WORDS)]
        if cutlass.const_expr(self.norm):
            pre_mix = [Float32(pre[token * Int32(hc) + Int32(j)]) for j in range(hc)]
            gamma_words = list(primitives.load_v4(lamport.element_address(gamma, Int64(column)), Int32(in_row)))

        if cutlass.const_expr(self.publish is None):
            if cutlass.const_expr(self.use_pdl):
                primitives.grid_dependency_wait()
            generation = primitives.load_volatile_b32(lamport.element_address(state, Int64(lamport.STATE_ACTIVE)))
        gen = Int64(generation)
        arrived = Int32(0)
        if cutlass.const_expr(self.publish is not None):
            if in_row:
                if cutlass.const_expr(self.publish == "finalize"):
                    words = finalize_fragment(x, gemm2, weights, indices, token, column, hidden, self.top_k)
                else:
                    words = [canonical_zero_word(w) for w in primitives.load_v4(
                        lamport.element_address(x, Int64(token) * Int64(hidden) + Int64(column)))]
                slot = ((gen * Int64(self.tp) + Int64(self.rank)) * Int64(capacity) + Int64(token)) * Int64(hidden) \
                    + Int64(column)
                lamport.broadcast(words, slot, peer_table, multicast_address, self.tp, self.multicast)
            # Every thread of the CTA has read NEXT; the CTA counts itself in, and the last of the
            # call's CTAs advances NEXT at the end (the atomic's round trip overlaps the wait).
            cute.arch.sync_threads()
            if tidx == Int32(0):
                arrived = primitives.atomic_add_b32(
                    lamport.element_address(state, Int64(layout.STATE_ARRIVED)), Int32(1))

        r0, r1, r2, r3 = Uint32(0), Uint32(0), Uint32(0), Uint32(0)
        if in_row:
            r0, r1, r2, r3 = reduced_fragment(mailbox, gen, generation, token, column, timeout_ns, error, capacity,
                                              self.tp, hidden, self.bt)
        reduced = [r0, r1, r2, r3]
        if cutlass.const_expr((not self.bt) and self.publish is None):
            if (token == Int32(0)) & (chunk == Int32(0)) & (tidx == Int32(0)):
                primitives.store_b32(lamport.element_address(state, Int64(lamport.STATE_NEXT)),
                                     lamport.next_generation(generation))

        # Post-mix: m[j] = reduced * post[j], then m[j] = fma(res[s], comb[s, j], m[j]) in source order.
        mixed = []  # [target][lane] bf16 bits
        for j in cutlass.range_constexpr(hc):
            lanes = []
            for lane in cutlass.range_constexpr(LANES):
                m = primitives.mul_rn(lane_f32(reduced, lane), post_mix[j])
                for s in cutlass.range_constexpr(hc):
                    m = primitives.fma_rn(lane_f32(streams[s], lane), comb_mix[s][j], m)
                lanes.append(f32_to_bf16(m))
            mixed.append(lanes)
        if in_row:
            for j in cutlass.range_constexpr(hc):
                primitives.store_v4(lamport.element_address(
                    residual_out, (Int64(token) * Int64(hc) + Int64(j)) * Int64(hidden) + Int64(column)),
                    [pack(mixed[j][2 * i], mixed[j][2 * i + 1]) for i in range(WORDS)])

        if cutlass.const_expr(self.norm):
            # Collapse with the pre-mix in target order, from +0.
            prenorm = []
            for lane in cutlass.range_constexpr(LANES):
                acc = Float32(0.0)
                for j in cutlass.range_constexpr(hc):
                    acc = primitives.fma_rn(as_f32(mixed[j][lane] << Uint32(16)), pre_mix[j], acc)
                prenorm.append(as_f32(f32_to_bf16(acc) << Uint32(16)))
            sum_squares = self.row_sum_of_squares(prenorm, in_row, tidx, chunk)
            mean = primitives.add_rn(primitives.div_rn(sum_squares, Float32(float(hidden))), eps)
            inv_rms = primitives.div_rn(Float32(1.0), primitives.sqrt_rn(mean))
            layer = [f32_to_bf16(primitives.mul_rn(primitives.mul_rn(prenorm[lane], inv_rms),
                                                   lane_f32(gamma_words, lane)))
                     for lane in range(LANES)]
            layer_words = [pack(layer[2 * i], layer[2 * i + 1]) for i in range(WORDS)]
            if in_row:
                primitives.store_v4(lamport.element_address(layer_out, Int64(token) * Int64(hidden) + Int64(column)),
                                    layer_words)
            if cutlass.const_expr(self.quant):
                self.store_mxfp8(layer_words, values, scales, token, num_tokens, fragment, column, in_row, tidx)
        if cutlass.const_expr(self.publish is not None):
            if (tidx == Int32(0)) & (arrived == num_tokens * Int32(self.ctas) - Int32(1)):
                primitives.store_b32(lamport.element_address(state, Int64(layout.STATE_ARRIVED)), Int32(0))
                primitives.store_b32(lamport.element_address(state, Int64(lamport.STATE_NEXT)),
                                     lamport.next_generation(generation))
        if cutlass.const_expr(self.use_pdl):
            primitives.launch_dependents()

    @cute.jit
    def row_sum_of_squares(self, prenorm, in_row: Boolean, tidx: Int32, chunk: Int32) -> Float32:
        """The contract's pairwise sum of the row's rounded squares, in every thread of the cluster."""
        squares = [primitives.mul_rn(prenorm[lane], prenorm[lane]) for lane in range(LANES)]
        node = Float32(cutlass.select_(in_row, tree_sum(squares), Float32(0.0)))  # lanes past H are +0.0
        lane = tidx % Int32(WARP)
        warp = tidx // Int32(WARP)
        node = ordered_butterfly_sum(node, lane)  # the warp's aligned 256 elements

        smem = cutlass.memory.SmemAllocator()
        slots = smem.allocate_array(Float32, self.slots)
        base = Int32(slots.toint())
        # Every CTA of the cluster has arrived before any stores into its shared memory.
        primitives.cluster_wait()
        if lane < Int32(self.ctas):
            slot = base + (chunk * Int32(self.warps) + warp) * Int32(4)
            primitives.store_shared_cluster_f32(primitives.map_shared_cluster(slot, lane), node)
        primitives.cluster_arrive()
        primitives.cluster_wait()
        nodes = [primitives.load_shared_f32(base + Int32(4 * i)) for i in range(self.slots)]
        nodes += [None] * (self.tree_slots - self.slots)
        return tree_sum(nodes)

    @cute.jit
    def store_mxfp8(self, layer_words, values: cute.Tensor, scales: cute.Tensor, token: Int32, num_tokens: Int32,
                    fragment: Int32, column: Int32, in_row: Boolean, tidx: Int32):
        """The layer input as MXFP8 through FlashInfer's own helpers, as its MXFP8 kernel calls them:
        4 consecutive threads hold one 32-element block (``lamport_mhc.mxfp8`` states the same rules)."""
        block_max = reduce_max_4threads(bfloat2_hmax_reduce_to_f32(bfloat2_max_abs_4(*layer_words)))
        u = float_to_ue8m0_fast(primitives.mul_rn(block_max, Float32(INV_FLOAT8_E4M3_MAX)))
        packed = bfloat2x4_to_fp8x8_packed(*layer_words, ue8m0_to_inv_scale_fast(u))
        if in_row:
            st_global_u64(lamport.element_address(values, Int64(token) * Int64(self.hidden) + Int64(column)), packed)

        # Scale columns 4k..4k+3 are 4 consecutive bytes of the swizzled layout: the 16 threads of
        # those blocks gather them into one word, stored by the first.
        col = fragment // Int32(FRAGMENTS_PER_SCALE)
        word = u << (Uint32(8) * Uint32(col % Int32(4)))
        for level in cutlass.range_constexpr(2):
            word = word | Uint32(cute.arch.shuffle_sync_bfly(word, offset=FRAGMENTS_PER_SCALE << level))
        leader = in_row & ((tidx % Int32(FRAGMENTS_PER_SCALE_WORD)) == Int32(0))
        if leader:
            primitives.store_b32(self.scale_address(scales, token, col), Int32(word))
            # Rows [M, roundup(M, 128)) of the last scale tile are zero: fewer than 128 rows, split
            # into one contiguous run per token.
            padding = (num_tokens + Int32(127)) // Int32(128) * Int32(128) - num_tokens
            run = (padding + num_tokens - Int32(1)) // num_tokens
            first = num_tokens + token * run
            for i in cutlass.range(run):
                row = first + i
                if row < num_tokens + padding:
                    primitives.store_b32(self.scale_address(scales, row, col), Int32(0))

    @cute.jit
    def scale_address(self, scales: cute.Tensor, row: Int32, col: Int32) -> Int64:
        """Byte of scale (row, col) in FlashInfer's swizzled 128x4 layout."""
        return lamport.element_address(scales, Int64(compute_sf_index_swizzled_128x4_gpu(
            row, col, Int32(self.padded_scale_cols))))
