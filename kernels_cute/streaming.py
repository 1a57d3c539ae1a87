"""The streaming form of the mHC consumer, for calls of many rows: one CTA owns a whole token and
loops over its row, so no cluster barrier, no distributed shared memory, and no cap on CTAs per SM
but registers and threads. Same protocols (LL, BT, local), variants, outputs, slots, state words
and bits as ``consumer`` (the cluster form, for few rows); the launcher picks the form per call.

Shape (``streaming_shape``): a CTA of ``threads`` threads (whole warps) takes the row in
``iterations`` chunks of ``threads`` 16-byte fragments, thread ``i`` fragment ``k * threads + i``
in iteration ``k`` (H = 5120: 2 x 320 threads, H = 7168: 2 x 448, H = 4096: 1 x 512). Per
iteration every input load is issued before the first use (the residual streams, then the
contribution: the mailbox polls or ``x``; the MoE finalize first reduces its top_k + 1 fragments,
then loads the streams), the residual streams are written, and the prenorm fragment stays in
registers (4 words per iteration) for the second pass. A launch bound keeps the registers at what
several CTAs per SM leave (``min_ctas_per_sm``).

The norm's sum of squares is the contract's adjacent-pair tree over the zero-padded row, from exact
tree nodes as in the cluster form: a thread's 8 lanes (3 levels), the warp's ordered butterfly (5
levels: the aligned 256 columns of the warp), then one slot per warp and iteration in shared
memory. Warp ``w`` of iteration ``k`` covers columns ``256 * (k * warps + w)`` on, so the slots in
that order are the row's 256-column subtrees in element order, whatever ``threads`` is; after one
CTA barrier every thread joins the ``ceil(H / 256)`` slots by the same tree, padded with +0.0 to a
power of two (a tree taller than the contract's only adds +0.0 to its root, which is exact for
every sum of squares). The second pass normalizes the kept prenorm (``inv_rms``, times gamma),
stores the layer input and, for quant, the MXFP8 values and scales.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32

from . import lamport, primitives
from .consumer import check_consumer
from .mhc import (WARP, WARP_ELEMENTS, fragment_node, inverse_rms, last_word, layer_words, local_reduced, mix,
                  ordered_after, ordered_butterfly_sum, pow2_at_least, reduced_from_mailbox, store_mxfp8, tree_sum)
from .numerics import LANES, WORDS

# Threads of a streaming CTA at most: up to H = 8192 a row takes at most 2 iterations (2 serialized
# load rounds per token). A starting point for measurement on the GPU (ncu: achieved occupancy, DRAM
# throughput), as is the launch bound below.
MAX_THREADS = 512
# Registers a thread needs without spills (read from the cubins of every variant, hc = 4, top_k <= 8,
# tp <= 8, by tests/test_ptx_cute.py): 64 for one pass over the row, 8 more for each further iteration
# (its kept prenorm and gamma) and for each LL source past the second (its fragment is polled with
# the others'). The launch bound (.minnctapersm) asks ptxas for as many CTAs per SM as leave that
# many registers, so while one CTA waits at its barrier or runs its second pass, others have loads in
# flight (tp <= 2: H = 4096 2 x 512 threads, 5120 2 x 320, 7168 2 x 448).
BASE_REGISTERS, REGISTERS_PER_ITERATION, REGISTERS_PER_SOURCE = 64, 8, 8
REGISTERS_PER_SM, THREADS_PER_SM, CTAS_PER_SM = 65536, 2048, 32  # sm_90 and sm_100
# A launch bound above one CTA needs a shared-memory carveout when compiled without a GPU: none
# preferred (CU_SHAREDMEM_CARVEOUT_DEFAULT); the kernel uses one float per warp and iteration.
SMEM_CARVEOUT_DEFAULT = -1


def min_ctas_per_sm(threads: int, iterations: int, sources: int = 1) -> int:
    """The launch bound: CTAs per SM that leave each thread the registers it needs (``sources``:
    the mailbox fragments polled together, tp for LL)."""
    registers = BASE_REGISTERS + REGISTERS_PER_ITERATION * (iterations - 1) \
        + REGISTERS_PER_SOURCE * max(0, sources - 2)
    return max(1, min(CTAS_PER_SM, THREADS_PER_SM // threads, REGISTERS_PER_SM // (threads * registers)))


def streaming_shape(hidden: int, max_threads: int = MAX_THREADS) -> tuple[int, int]:
    """(threads per CTA, iterations): the fewest iterations of at most ``max_threads`` threads,
    then the fewest whole warps that cover the row in that many (H = 5120: 320 x 2)."""
    fragments = hidden // LANES
    iterations = -(-fragments // max_threads)
    threads = -(-(-(-fragments // iterations)) // WARP) * WARP
    return threads, iterations


class StreamingConsumerKernel:
    """The streaming-form consumer of one protocol and variant; ``cute.compile(StreamingConsumerKernel(
    ...), *args)`` with the arguments of ``__call__`` (``plan.CONSUMER_SIGNATURE``; the local form,
    ``StreamingLocalConsumerKernel``, takes ``plan.LOCAL_SIGNATURE``)."""

    def __init__(self, *, hidden: int, hc: int, tp: int, variant: str, protocol: str, use_pdl: bool,
                 contribution: str | None = None, top_k: int = 1, max_threads: int = MAX_THREADS):
        check_consumer(hidden, variant, protocol, contribution)
        if protocol == "ll" and contribution is not None:
            raise ValueError("the streaming form has no one-kernel LL form (that form is for few rows)")
        if protocol == "local" and tp != 1:
            raise ValueError(f"the local form is a group of one's, got tp={tp}")
        if max_threads % WARP or not 0 < max_threads <= 1024:
            raise ValueError(f"max_threads must be whole warps, at most 1024, got {max_threads}")
        self.hidden, self.hc, self.tp, self.variant, self.protocol = hidden, hc, tp, variant, protocol
        self.bt, self.local, self.use_pdl = protocol == "bt", protocol == "local", use_pdl
        self.contribution, self.top_k = contribution, top_k
        self.fragments = hidden // LANES
        self.threads, self.iterations = streaming_shape(hidden, max_threads)
        self.warps = self.threads // WARP
        self.norm = variant != "residual"
        self.quant = variant == "quant"
        self.slots = -(-hidden // WARP_ELEMENTS)  # warp nodes that hold columns of the row, in element order
        self.tree_slots = pow2_at_least(self.slots)
        self.smem_slots = self.iterations * self.warps  # every warp of every iteration stores one
        # The MoE finalize loads top_k + 1 fragments per iteration: it reduces them before loading the
        # residual streams, so both sets are never live at once (no spills at the launch bound).
        self.streams_last = contribution == "finalize"
        self.min_ctas = min_ctas_per_sm(self.threads, self.iterations, tp if protocol == "ll" else 1)
        self.occupancy = {} if self.min_ctas == 1 else dict(min_blocks_per_mp=self.min_ctas,
                                                            preferred_smem_carveout=SMEM_CARVEOUT_DEFAULT)

    def active(self, iteration: int) -> int:
        """Threads of ``iteration`` that hold a fragment of the row."""
        return min(self.threads, self.fragments - iteration * self.threads)

    @cute.jit
    def __call__(self, mailbox: cute.Tensor, residual: cute.Tensor, post: cute.Tensor, comb: cute.Tensor,
                 pre: cute.Tensor, gamma: cute.Tensor, residual_out: cute.Tensor, layer_out: cute.Tensor,
                 values: cute.Tensor, scales: cute.Tensor, state: cute.Tensor, error: cute.Tensor, eps: Float32,
                 num_tokens: Int32, timeout_ns: Int64, capacity: Int32, x: cute.Tensor, gemm2: cute.Tensor,
                 weights: cute.Tensor, indices: cute.Tensor, peer_table: cute.Tensor, multicast_address: Int64,
                 stream: cuda.CUstream):
        """The arguments of ``consumer.ConsumerKernel`` (``x`` to ``multicast_address`` unread)."""
        self.launch(mailbox, residual, post, comb, pre, gamma, residual_out, layer_out, values, scales, state,
                    error, eps, num_tokens, timeout_ns, capacity, x, gemm2, weights, indices, Int32(0), stream)

    @cute.jit
    def launch(self, mailbox: cute.Tensor, residual: cute.Tensor, post: cute.Tensor, comb: cute.Tensor,
               pre: cute.Tensor, gamma: cute.Tensor, residual_out: cute.Tensor, layer_out: cute.Tensor,
               values: cute.Tensor, scales: cute.Tensor, state: cute.Tensor, error: cute.Tensor, eps: Float32,
               num_tokens: Int32, timeout_ns: Int64, capacity: Int32, x: cute.Tensor, gemm2: cute.Tensor,
               weights: cute.Tensor, indices: cute.Tensor, streamed: Int32, stream: cuda.CUstream):
        kernel = self.kernel(mailbox, residual, post, comb, pre, gamma, residual_out, layer_out, values, scales,
                             state, error, eps, num_tokens, timeout_ns, capacity, x, gemm2, weights, indices,
                             streamed)
        if cutlass.const_expr(self.norm):
            kernel.launch(grid=(num_tokens, 1, 1), block=(self.threads, 1, 1), smem=self.smem_slots * 4,
                          stream=stream, use_pdl=self.use_pdl, **self.occupancy)
        else:
            kernel.launch(grid=(num_tokens, 1, 1), block=(self.threads, 1, 1), stream=stream, use_pdl=self.use_pdl,
                          **self.occupancy)

    @cute.kernel
    def kernel(self, mailbox: cute.Tensor, residual: cute.Tensor, post: cute.Tensor, comb: cute.Tensor,
               pre: cute.Tensor, gamma: cute.Tensor, residual_out: cute.Tensor, layer_out: cute.Tensor,
               values: cute.Tensor, scales: cute.Tensor, state: cute.Tensor, error: cute.Tensor, eps: Float32,
               num_tokens: Int32, timeout_ns: Int64, capacity: Int32, x: cute.Tensor, gemm2: cute.Tensor,
               weights: cute.Tensor, indices: cute.Tensor, streamed: Int32):
        hidden, hc = self.hidden, self.hc
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        lane = tidx % Int32(WARP)
        warp = tidx // Int32(WARP)
        if cutlass.const_expr(self.local and self.use_pdl):
            # Nothing of this call ran before this kernel: it waits before its first load. A group of
            # one's call is this kernel alone, and nothing below is waited for: the next kernel may
            # launch now, its CTAs taking the SMs this grid's last wave leaves free (it still waits
            # for this kernel's completion before it reads anything).
            primitives.grid_dependency_wait()
            primitives.launch_dependents()
        policy = None
        if cutlass.const_expr(self.local):
            # What the call moves once (the contribution's inputs, the streams in and out) leaves L2
            # first in calls that the launcher marks ``streamed``.
            policy = primitives.streaming_policy(streamed)

        post_mix = [Float32(post[token * Int32(hc) + Int32(j)]) for j in range(hc)]
        comb_mix = [[Float32(comb[(token * Int32(hc) + Int32(s)) * Int32(hc) + Int32(j)]) for j in range(hc)]
                    for s in range(hc)]
        pre_mix = [Float32(0.0) for _ in range(hc)]
        if cutlass.const_expr(self.norm):
            pre_mix = [Float32(pre[token * Int32(hc) + Int32(j)]) for j in range(hc)]
        base = Int32(0)
        if cutlass.const_expr(self.norm):
            smem = cutlass.memory.SmemAllocator()
            base = Int32(smem.allocate_array(Float32, self.smem_slots).toint())

        generation = Int32(0)
        gen = Int64(0)
        prenorms = []  # per iteration: the prenorm fragment (4 words), kept for the second pass
        zero = Uint32(num_tokens) >> Uint32(31)  # 0 (num_tokens > 0), for ordered_after
        previous = Uint32(0)  # the last word the previous iteration mixed
        for k in cutlass.range_constexpr(self.iterations):
            full = self.active(k) == self.threads
            thread = tidx
            if cutlass.const_expr(k > 0):
                thread = Int32(ordered_after(Uint32(tidx), previous, zero))
            fragment = Int32(k * self.threads) + thread
            column = fragment * Int32(LANES)
            in_row = Boolean(True) if full else tidx < Int32(self.active(k))
            predicate = None if full else Int32(in_row)
            streams = None
            if cutlass.const_expr(not self.streams_last):
                streams = [primitives.load_v4(lamport.element_address(
                    residual, (Int64(token) * Int64(hc) + Int64(s)) * Int64(hidden) + Int64(column)), predicate,
                    policy) for s in range(hc)]
            if cutlass.const_expr(k == 0 and not self.local):
                # The residual streams of the first chunk are inputs (complete before the publish let
                # this kernel start), loaded before the wait; the state and the mailbox after it.
                if cutlass.const_expr(self.use_pdl):
                    primitives.grid_dependency_wait()
                generation = primitives.load_volatile_b32(
                    lamport.element_address(state, Int64(lamport.STATE_ACTIVE)))
                gen = Int64(generation)

            r0, r1, r2, r3 = Uint32(0), Uint32(0), Uint32(0), Uint32(0)
            if in_row:
                if cutlass.const_expr(self.local):
                    r0, r1, r2, r3 = local_reduced(x, gemm2, weights, indices, token, column, hidden, self.top_k,
                                                   self.contribution == "finalize", policy)
                else:
                    r0, r1, r2, r3 = reduced_from_mailbox(mailbox, gen, generation, token, column, timeout_ns,
                                                          error, capacity, self.tp, hidden, self.bt)
            if cutlass.const_expr(self.streams_last):
                streams = [primitives.load_v4(lamport.element_address(
                    residual, (Int64(token) * Int64(hc) + Int64(s)) * Int64(hidden) + Int64(column)), predicate,
                    policy) for s in range(hc)]
            if cutlass.const_expr(k == 0 and self.protocol == "ll"):
                if (token == Int32(0)) & (tidx == Int32(0)):
                    primitives.store_b32(lamport.element_address(state, Int64(lamport.STATE_NEXT)),
                                         lamport.next_generation(generation))

            out_words, prenorm = mix([r0, r1, r2, r3], streams, post_mix, comb_mix, pre_mix, hc, self.norm, zero)
            previous = last_word(out_words, prenorm, WORDS - 1)
            if in_row:
                for j in cutlass.range_constexpr(hc):
                    primitives.store_v4(lamport.element_address(
                        residual_out, (Int64(token) * Int64(hc) + Int64(j)) * Int64(hidden) + Int64(column)),
                        out_words[j], policy)
            if cutlass.const_expr(self.norm):
                prenorms.append(prenorm)
                node = ordered_butterfly_sum(fragment_node(prenorm, None if full else in_row), lane)
                if lane == Int32(0):
                    primitives.store_shared_f32(base + (Int32(k * self.warps) + warp) * Int32(4), node)

        if cutlass.const_expr(self.norm):
            # gamma is the same for every token (cache-resident): loaded here, its latency overlaps
            # the barrier and the slots' tree.
            gammas = []
            for k in cutlass.range_constexpr(self.iterations):
                column = (Int32(k * self.threads) + tidx) * Int32(LANES)
                full = self.active(k) == self.threads
                gammas.append(primitives.load_v4(lamport.element_address(gamma, Int64(column)),
                                                 None if full else Int32(tidx < Int32(self.active(k)))))
            cute.arch.sync_threads()
            nodes = [primitives.load_shared_f32(base + Int32(4 * i)) for i in range(self.slots)]
            inv_rms = inverse_rms(tree_sum(nodes + [None] * (self.tree_slots - self.slots)), hidden, eps)
            for k in cutlass.range_constexpr(self.iterations):
                full = self.active(k) == self.threads
                fragment = Int32(k * self.threads) + tidx
                column = fragment * Int32(LANES)
                in_row = Boolean(True) if full else tidx < Int32(self.active(k))
                layer = layer_words(prenorms[k], inv_rms, gammas[k])
                if in_row:
                    primitives.store_v4(lamport.element_address(layer_out, Int64(token) * Int64(hidden)
                                                                + Int64(column)), layer)
                if cutlass.const_expr(self.quant):
                    store_mxfp8(layer, values, scales, token, num_tokens, fragment, column, in_row, tidx, hidden)
        if cutlass.const_expr(self.use_pdl and not self.local):
            primitives.launch_dependents()


class StreamingLocalConsumerKernel(StreamingConsumerKernel):
    """The streaming form of a group of one: no mailbox, no state; ``plan.LOCAL_SIGNATURE``."""

    def __init__(self, *, hidden: int, hc: int, variant: str, contribution: str, use_pdl: bool, top_k: int = 1,
                 max_threads: int = MAX_THREADS):
        super().__init__(hidden=hidden, hc=hc, tp=1, variant=variant, protocol="local", use_pdl=use_pdl,
                         contribution=contribution, top_k=top_k, max_threads=max_threads)

    @cute.jit
    def __call__(self, residual: cute.Tensor, post: cute.Tensor, comb: cute.Tensor, pre: cute.Tensor,
                 gamma: cute.Tensor, residual_out: cute.Tensor, layer_out: cute.Tensor, values: cute.Tensor,
                 scales: cute.Tensor, eps: Float32, num_tokens: Int32, x: cute.Tensor, gemm2: cute.Tensor,
                 weights: cute.Tensor, indices: cute.Tensor, streamed: Int32, stream: cuda.CUstream):
        """As ``consumer.LocalConsumerKernel``; the mailbox, state and error parameters are never read.
        ``streamed`` (nonzero): what the call moves once is accessed evict-first in L2."""
        self.launch(residual, residual, post, comb, pre, gamma, residual_out, layer_out, values, scales, residual,
                    residual, eps, num_tokens, Int64(0), Int32(0), x, gemm2, weights, indices, streamed, stream)
