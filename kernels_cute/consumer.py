"""The mHC consumer, as ``kernels_triton.consumer`` (same layouts, state words and bits): per token,
wait for the call's all-reduced sublayer output, post-mix the hc residual streams, collapse them
with the pre-mix, RMS-normalize, and optionally write the layer input as MXFP8.

This is the cluster form, for calls of few rows, where latency matters: a token spans several CTAs.
``streaming`` holds the form for many rows (a CTA per token); both write the same outputs, slots
and state words, so consecutive calls may take either.

Specialized at construction:
- ``protocol``: "bt": the mailbox holds the owners' sums ``[gen][t]`` (one 16-byte poll per
  fragment); "ll": every rank's contribution ``[gen][rank][t]``, polled and summed in rank order
  with ``add.rn`` from +0, rounded to bf16, -0.0 -> +0.0. Either way the slots read are re-armed
  with the sentinel; LL advances the generation (BT's owner reduce already did). "local" (a group
  of one): no mailbox, no poll, no generation state: each thread computes its fragment of the
  contribution and reduces it as the contract's sum of one rank.
- ``variant``: "plain", "quant" (also MXFP8 values and swizzled 128x4 UE8M0 scales, zeroing the
  scales of the padding rows up to a multiple of 128), "residual" (writes only the streams).
- ``contribution``: "x" or "finalize" (the MoE finalize of the publish kernel): what the local form
  consumes, or (LL) the one-kernel form, whose CTAs first store their fragments of the token's
  contribution into every rank's mailbox at the generation NEXT, count themselves in STATE_ARRIVED,
  and then consume; the last CTA to arrive resets the count and advances NEXT. Every CTA must be
  resident at once (each waits for its twins on the other ranks). None (LL, BT): the publish kernel
  ran before.

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

from lamport_mhc import layout

from . import lamport, primitives
from .mhc import (WARP, fragment_node, inverse_rms, layer_words, local_reduced, mix, ordered_butterfly_sum,
                  pow2_at_least, reduced_from_mailbox, store_mxfp8, tree_sum)
from .numerics import LANES, canonical_zero_word
from .publish import finalize_fragment, launch_shape

VARIANTS = ("plain", "quant", "residual")
PROTOCOLS = ("ll", "bt", "local")
MAX_CLUSTER = 8  # portable thread-block cluster size


def check_consumer(hidden: int, variant: str, protocol: str, contribution: str | None) -> None:
    """The constraints both consumer forms share."""
    if hidden % LANES:
        raise ValueError(f"hidden must be a multiple of {LANES}, got {hidden}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "quant" and hidden % layout.HIDDEN_MULTIPLE_MXFP8:
        raise ValueError(f"the quant consumer needs hidden % {layout.HIDDEN_MULTIPLE_MXFP8} == 0, got {hidden}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if contribution not in (None, "x", "finalize"):
        raise ValueError(f"contribution must be None, 'x' or 'finalize', got {contribution!r}")
    if protocol == "bt" and contribution is not None:
        raise ValueError("only LL calls run as one kernel")
    if protocol == "local" and contribution is None:
        raise ValueError("the local form computes its contribution: 'x' or 'finalize'")


class ConsumerKernel:
    """The cluster-form mHC consumer of one protocol and variant; ``cute.compile(ConsumerKernel(...),
    *args)`` with the arguments of ``__call__`` (``LocalConsumerKernel`` for the local form)."""

    def __init__(self, *, hidden: int, hc: int, tp: int, variant: str, protocol: str, use_pdl: bool,
                 contribution: str | None = None, rank: int = 0, top_k: int = 1, multicast: bool = False):
        check_consumer(hidden, variant, protocol, contribution)
        if protocol == "local" and tp != 1:
            raise ValueError(f"the local form is a group of one's, got tp={tp}")
        self.hidden, self.hc, self.tp, self.variant, self.protocol = hidden, hc, tp, variant, protocol
        self.bt, self.local, self.use_pdl = protocol == "bt", protocol == "local", use_pdl
        self.contribution, self.rank, self.top_k, self.multicast = contribution, rank, top_k, multicast
        self.publish = contribution if protocol == "ll" else None  # LL's one-kernel form
        self.fragments = hidden // LANES
        self.threads, self.ctas = launch_shape(hidden)
        self.norm = variant != "residual"
        self.quant = variant == "quant"
        if self.norm and self.ctas > MAX_CLUSTER:
            raise ValueError(f"the {variant} consumer spreads a token over one cluster of at most {MAX_CLUSTER} CTAs "
                             f"of {self.threads} threads: hidden <= {MAX_CLUSTER * self.threads * LANES}, got {hidden}")
        self.warps = self.threads // WARP
        self.slots = self.ctas * self.warps  # one per warp of the token, in element order
        self.tree_slots = pow2_at_least(self.slots)

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
        self.launch(mailbox, residual, post, comb, pre, gamma, residual_out, layer_out, values, scales, state,
                    error, eps, num_tokens, timeout_ns, capacity, x, gemm2, weights, indices, peer_table,
                    multicast_address, stream)

    @cute.jit
    def launch(self, mailbox: cute.Tensor, residual: cute.Tensor, post: cute.Tensor, comb: cute.Tensor,
               pre: cute.Tensor, gamma: cute.Tensor, residual_out: cute.Tensor, layer_out: cute.Tensor,
               values: cute.Tensor, scales: cute.Tensor, state: cute.Tensor, error: cute.Tensor, eps: Float32,
               num_tokens: Int32, timeout_ns: Int64, capacity: Int32, x: cute.Tensor, gemm2: cute.Tensor,
               weights: cute.Tensor, indices: cute.Tensor, peer_table: cute.Tensor, multicast_address: Int64,
               stream: cuda.CUstream):
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
        if cutlass.const_expr(self.publish is not None or self.local):
            # Nothing of this call ran before this kernel: it waits before its first load.
            if cutlass.const_expr(self.use_pdl):
                primitives.grid_dependency_wait()
                if cutlass.const_expr(self.local):
                    primitives.launch_dependents()  # (see streaming.py)
        if cutlass.const_expr(self.publish is not None):
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
        gamma_words = [Uint32(0) for _ in range(4)]
        if cutlass.const_expr(self.norm):
            pre_mix = [Float32(pre[token * Int32(hc) + Int32(j)]) for j in range(hc)]
            gamma_words = list(primitives.load_v4(lamport.element_address(gamma, Int64(column)), Int32(in_row)))

        if cutlass.const_expr(self.publish is None and not self.local):
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
            if cutlass.const_expr(self.local):
                r0, r1, r2, r3 = local_reduced(x, gemm2, weights, indices, token, column, hidden, self.top_k,
                                               self.contribution == "finalize")
            else:
                r0, r1, r2, r3 = reduced_from_mailbox(mailbox, gen, generation, token, column, timeout_ns, error,
                                                      capacity, self.tp, hidden, self.bt)
        reduced = [r0, r1, r2, r3]
        if cutlass.const_expr(self.protocol == "ll" and self.publish is None):
            if (token == Int32(0)) & (chunk == Int32(0)) & (tidx == Int32(0)):
                primitives.store_b32(lamport.element_address(state, Int64(lamport.STATE_NEXT)),
                                     lamport.next_generation(generation))

        out_words, prenorm = mix(reduced, streams, post_mix, comb_mix, pre_mix, hc, self.norm)
        if in_row:
            for j in cutlass.range_constexpr(hc):
                primitives.store_v4(lamport.element_address(
                    residual_out, (Int64(token) * Int64(hc) + Int64(j)) * Int64(hidden) + Int64(column)),
                    out_words[j])

        if cutlass.const_expr(self.norm):
            sum_squares = self.row_sum_of_squares(prenorm, in_row, tidx, chunk)
            layer = layer_words(prenorm, inverse_rms(sum_squares, hidden, eps), gamma_words)
            if in_row:
                primitives.store_v4(lamport.element_address(layer_out, Int64(token) * Int64(hidden) + Int64(column)),
                                    layer)
            if cutlass.const_expr(self.quant):
                store_mxfp8(layer, values, scales, token, num_tokens, fragment, column, in_row, tidx, hidden,
                            spread_padding=True)
        if cutlass.const_expr(self.publish is not None):
            if (tidx == Int32(0)) & (arrived == num_tokens * Int32(self.ctas) - Int32(1)):
                primitives.store_b32(lamport.element_address(state, Int64(layout.STATE_ARRIVED)), Int32(0))
                primitives.store_b32(lamport.element_address(state, Int64(lamport.STATE_NEXT)),
                                     lamport.next_generation(generation))
        if cutlass.const_expr(self.use_pdl and not self.local):
            primitives.launch_dependents()

    @cute.jit
    def row_sum_of_squares(self, prenorm, in_row: Boolean, tidx: Int32, chunk: Int32) -> Float32:
        """The contract's pairwise sum of the row's rounded squares, in every thread of the cluster."""
        lane = tidx % Int32(WARP)
        warp = tidx // Int32(WARP)
        node = ordered_butterfly_sum(fragment_node(prenorm, in_row), lane)  # the warp's aligned 256 elements

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


class LocalConsumerKernel(ConsumerKernel):
    """The cluster form of a group of one (``protocol="local"``): one kernel per call, no mailbox,
    no state; its runtime arguments are ``plan.LOCAL_SIGNATURE``."""

    def __init__(self, *, hidden: int, hc: int, variant: str, contribution: str, use_pdl: bool, top_k: int = 1):
        super().__init__(hidden=hidden, hc=hc, tp=1, variant=variant, protocol="local", use_pdl=use_pdl,
                         contribution=contribution, top_k=top_k)

    @cute.jit
    def __call__(self, residual: cute.Tensor, post: cute.Tensor, comb: cute.Tensor, pre: cute.Tensor,
                 gamma: cute.Tensor, residual_out: cute.Tensor, layer_out: cute.Tensor, values: cute.Tensor,
                 scales: cute.Tensor, eps: Float32, num_tokens: Int32, x: cute.Tensor, gemm2: cute.Tensor,
                 weights: cute.Tensor, indices: cute.Tensor, streamed: Int32, stream: cuda.CUstream):
        """As ``ConsumerKernel``, ``x`` the contribution (or the shared expert output, finalize); the
        kernel's mailbox, state, error and table parameters are never read (given ``residual``), nor
        is ``streamed`` (the streaming form's cache hints: a call of few rows moves little)."""
        self.launch(residual, residual, post, comb, pre, gamma, residual_out, layer_out, values, scales, residual,
                    residual, eps, num_tokens, Int64(0), Int32(0), x, gemm2, weights, indices, residual, Int64(0),
                    stream)
