"""BT owner reduce, as ``kernels_triton.owner_reduce``: each rank sums, for the tokens it owns
(t % tp == rank), every rank's contribution in rank order (fp32 ``add.rn`` from +0, rounded to bf16,
-0.0 -> +0.0: the same bits as the LL consumer's sum) and stores the sum into every rank's
``sums[gen][t]`` (peer stores or one ``multimem.st``). It re-arms the contribution slots it read and
advances the BT generation.

Grid: (max(1, ceil(M / tp)), ceil(H / 8 / threads)); at least one CTA runs so the generation
advances on a rank that owns no token of a small call. Each thread owns one 16-byte fragment.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from . import lamport, primitives
from .numerics import LANES, WORDS, canonical_zero_word
from .publish import launch_shape


class OwnerReduceKernel:
    """The owner reduce of a BT build; ``cute.compile(OwnerReduceKernel(...), *args)`` with the
    arguments of ``__call__``."""

    def __init__(self, *, hidden: int, tp: int, rank: int, multicast: bool, use_pdl: bool):
        if hidden % LANES:
            raise ValueError(f"hidden must be a multiple of {LANES}, got {hidden}")
        self.hidden, self.tp, self.rank, self.multicast, self.use_pdl = hidden, tp, rank, multicast, use_pdl
        self.fragments = hidden // LANES
        self.threads, self.ctas_per_token = launch_shape(hidden)

    @cute.jit
    def __call__(self, mailbox: cute.Tensor, sums_table: cute.Tensor, sums_multicast_address: Int64,
                 state: cute.Tensor, error: cute.Tensor, num_tokens: Int32, timeout_ns: Int64, slots: Int32,
                 capacity: Int32, stream: cuda.CUstream):
        """``mailbox``: int16 [3*tp*slots*H], this rank's BT contributions; ``sums_table`` int64 [tp]:
        every rank's sums buffer [3][capacity][H]; ``state`` int32 [3] (BT); ``error`` int32 [6];
        ``timeout_ns``: 0 waits forever; ``slots``: ceil(capacity / tp)."""
        owned = cutlass.max((num_tokens + Int32(self.tp - 1)) // Int32(self.tp), Int32(1))
        self.kernel(mailbox, sums_table, sums_multicast_address, state, error, num_tokens, timeout_ns, slots,
                    capacity).launch(grid=(owned, self.ctas_per_token, 1), block=(self.threads, 1, 1),
                                     stream=stream, use_pdl=self.use_pdl)

    @cute.kernel
    def kernel(self, mailbox: cute.Tensor, sums_table: cute.Tensor, sums_multicast_address: Int64,
               state: cute.Tensor, error: cute.Tensor, num_tokens: Int32, timeout_ns: Int64, slots: Int32,
               capacity: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        local, chunk, _ = cute.arch.block_idx()
        token = local * Int32(self.tp) + Int32(self.rank)
        fragment = chunk * Int32(self.threads) + tidx
        column = fragment * Int32(LANES)

        if cutlass.const_expr(self.use_pdl):
            primitives.grid_dependency_wait()
        generation = primitives.load_volatile_b32(
            lamport.element_address(state, Int64(lamport.STATE_ACTIVE)))
        gen = Int64(generation)
        if (token < num_tokens) & (fragment < Int32(self.fragments)):
            # Slot of source s: [gen][s][local] of this rank's mailbox, at this thread's fragment.
            slot = [((gen * Int64(self.tp) + Int64(source)) * Int64(slots) + Int64(local)) * Int64(self.hidden)
                    + Int64(column) for source in range(self.tp)]
            acc = lamport.sum_sources([lamport.element_address(mailbox, slot[source]) for source in range(self.tp)],
                                      timeout_ns, error, generation, token)
            reduced = [canonical_zero_word(primitives.bf16x2_rn(acc[2 * i], acc[2 * i + 1]))
                       for i in range(WORDS)]
            offset = (gen * Int64(capacity) + Int64(token)) * Int64(self.hidden) + Int64(column)
            lamport.broadcast(reduced, offset, sums_table, sums_multicast_address, self.tp, self.multicast)
            for source in cutlass.range_constexpr(self.tp):
                primitives.store_sentinel_v4(lamport.element_address(mailbox, slot[source]))

        if (local == Int32(0)) & (chunk == Int32(0)) & (tidx == Int32(0)):
            primitives.store_b32(lamport.element_address(state, Int64(lamport.STATE_NEXT)),
                                 lamport.next_generation(generation))
        if cutlass.const_expr(self.use_pdl):
            primitives.launch_dependents()
