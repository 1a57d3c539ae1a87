"""Publish kernels: a rank's contribution into the Lamport mailboxes of the call's generation, as
``kernels_triton.publish`` does (same layouts, state words and arithmetic).

One kernel class, specialized at construction into the four publishes of the protocol:
- ``finalize``: the contribution is the MoE finalize (top-k weighted sum of permuted GEMM2 rows in
  k order with ``fma.rn``, ``-1`` rows skipped, then ``add.rn`` of the shared expert, rounded to
  bf16) instead of the given ``x``;
- ``bt``: each token goes only to its owner rank (t % tp), into ``[gen][rank][t // tp]``; otherwise
  (LL) to every rank, into ``[gen][rank][t]``;
- ``multicast`` (LL only): one ``multimem.st`` to the mailbox's multicast address instead of one
  16-byte store per destination through the table of peer addresses.
Every contribution is canonicalized (-0.0 -> +0.0) so the sentinel never enters a mailbox.

Grid: (tokens, ceil(H / 8 / threads)); each thread owns one 16-byte fragment (8 bf16) of its token.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from . import lamport, primitives
from .numerics import LANES, WORDS, canonical_zero_word, high_f32, low_f32


def launch_shape(hidden: int, max_threads: int = 128) -> tuple[int, int]:
    """(threads per CTA, CTAs per token): one thread per 16-byte fragment, whole warps, at most
    ``max_threads`` threads (H = 5120: 128 x 5)."""
    fragments = hidden // LANES
    threads = min(max_threads, -(-fragments // 32) * 32)
    return threads, -(-fragments // threads)


@cute.jit
def finalize_fragment(shared: cute.Tensor, gemm2: cute.Tensor, weights: cute.Tensor, indices: cute.Tensor,
                      token: Int32, column: Int32, hidden: cutlass.Constexpr[int],
                      top_k: cutlass.Constexpr[int], canonical: cutlass.Constexpr[bool] = True, policy=None):
    """bf16 words of ``bf16(sum_k fma(gemm2[idx[t, k]], w[t, k], .) + shared[t])`` at ``column``: the
    weighted sum in k order from +0, rows of -1 skipped (not multiplied by zero), then the shared
    expert added in fp32 and the result rounded to nearest even; ``canonical``: -0.0 made +0.0 (a
    mailbox's sentinel; the local form's sum of one rank does that itself). ``policy``: the loads'
    L2 cache policy."""
    # Every route's index and weight, then every routed row's fragment, then the arithmetic: the
    # loads are independent, so their latencies overlap.
    rows = [indices[token * top_k + k] for k in range(top_k)]
    scales = [Float32(weights[token * top_k + k]) for k in range(top_k)]
    routed_words = []
    for k in cutlass.range_constexpr(top_k):
        address = lamport.element_address(gemm2, Int64(rows[k]) * Int64(hidden) + Int64(column))
        routed_words.append(primitives.load_v4(address, Int32(rows[k] != Int32(-1)), policy))
    base = Int64(token) * Int64(hidden) + Int64(column)
    shared_words = primitives.load_v4(lamport.element_address(shared, base), None, policy)

    acc = [Float32(0.0) for _ in range(LANES)]
    for k in cutlass.range_constexpr(top_k):
        routed = rows[k] != Int32(-1)
        for lane in cutlass.range_constexpr(LANES):
            word = routed_words[k][lane // 2]
            value = low_f32(word) if lane % 2 == 0 else high_f32(word)
            fused = primitives.fma_rn(value, scales[k], acc[lane])
            acc[lane] = Float32(cutlass.select_(routed, fused, acc[lane]))
    out = [primitives.bf16x2_rn(primitives.add_rn(acc[2 * i], low_f32(shared_words[i])),
                                primitives.add_rn(acc[2 * i + 1], high_f32(shared_words[i]))) for i in range(WORDS)]
    return [canonical_zero_word(word) for word in out] if canonical else out


class PublishKernel:
    """One publish of a build; ``cute.compile(PublishKernel(...), *args)`` with the arguments of
    ``__call__``."""

    def __init__(self, *, hidden: int, tp: int, rank: int, top_k: int, finalize: bool, bt: bool,
                 multicast: bool, use_pdl: bool):
        if hidden % LANES:
            raise ValueError(f"hidden must be a multiple of {LANES}, got {hidden}")
        if multicast and bt:
            raise ValueError("BT publishes store to one owner each: there is no multicast BT publish")
        self.hidden, self.tp, self.rank, self.top_k = hidden, tp, rank, top_k
        self.finalize, self.bt, self.multicast, self.use_pdl = finalize, bt, multicast, use_pdl
        self.fragments = hidden // LANES
        self.threads, self.ctas_per_token = launch_shape(hidden)

    @cute.jit
    def __call__(self, x: cute.Tensor, gemm2: cute.Tensor, weights: cute.Tensor, indices: cute.Tensor,
                 state: cute.Tensor, peer_table: cute.Tensor, multicast_address: Int64, slots: Int32,
                 num_tokens: Int32, stream: cuda.CUstream):
        """``x``: int16 [M*H], the contribution or (finalize) the shared expert output; ``gemm2``
        int16 [rows*H], ``weights`` fp32 [M*top_k], ``indices`` int32 [M*top_k] (finalize);
        ``state`` int32 [3] of the protocol; ``peer_table`` int64 [tp] of the mailbox's addresses;
        ``slots``: tokens per [gen][rank] (LL: capacity, BT: ceil(capacity / tp))."""
        self.kernel(x, gemm2, weights, indices, state, peer_table, multicast_address, slots).launch(
            grid=(num_tokens, self.ctas_per_token, 1), block=(self.threads, 1, 1), stream=stream,
            use_pdl=self.use_pdl)

    @cute.kernel
    def kernel(self, x: cute.Tensor, gemm2: cute.Tensor, weights: cute.Tensor, indices: cute.Tensor,
               state: cute.Tensor, peer_table: cute.Tensor, multicast_address: Int64, slots: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        token, chunk, _ = cute.arch.block_idx()
        fragment = chunk * Int32(self.threads) + tidx
        column = fragment * Int32(LANES)

        if cutlass.const_expr(self.use_pdl):
            primitives.grid_dependency_wait()
        generation = primitives.load_volatile_b32(
            lamport.element_address(state, Int64(lamport.STATE_NEXT)))
        gen = Int64(generation)
        if fragment < Int32(self.fragments):
            if cutlass.const_expr(self.finalize):
                words = finalize_fragment(x, gemm2, weights, indices, token, column, self.hidden, self.top_k)
            else:
                loaded = primitives.load_v4(
                    lamport.element_address(x, Int64(token) * Int64(self.hidden) + Int64(column)))
                words = [canonical_zero_word(w) for w in loaded]
            if cutlass.const_expr(self.bt):
                owner = token % Int32(self.tp)
                slot = ((gen * Int64(self.tp) + Int64(self.rank)) * Int64(slots) + Int64(token // Int32(self.tp))) \
                    * Int64(self.hidden) + Int64(column)
                primitives.store_v4(Int64(peer_table[owner]) + slot * Int64(lamport.BF16_BYTES), words)
            else:
                slot = ((gen * Int64(self.tp) + Int64(self.rank)) * Int64(slots) + Int64(token)) \
                    * Int64(self.hidden) + Int64(column)
                lamport.broadcast(words, slot, peer_table, multicast_address, self.tp, self.multicast)

        if (token == Int32(0)) & (chunk == Int32(0)) & (tidx == Int32(0)):
            primitives.store_b32(lamport.element_address(state, Int64(lamport.STATE_ACTIVE)), generation)
        if cutlass.const_expr(self.use_pdl):
            primitives.launch_dependents()
