"""Publish kernels: a rank's contribution into the Lamport mailboxes of the call's generation.

One kernel source, specialized by constexprs into the four publishes of the protocol:
- ``FINALIZE``: the contribution is the MoE finalize (top-k weighted sum of permuted GEMM2 rows,
  ``-1`` rows skipped, plus the shared expert) instead of the given ``x``.
- ``BT``: each token goes only to its owner rank (t % TP), into ``[gen][RANK][t // TP]``; otherwise
  (LL) to every rank, into ``[gen][RANK][t]``.
- ``MULTICAST``: LL stores once to the multicast mapping; otherwise one store per destination
  through the table of peer addresses.
Grid: (tokens, CHUNKS): the row in aligned chunks of BLOCK columns (``plan.row_chunks``), the last
one masked where BLOCK does not divide HIDDEN; every store is a whole 16-byte fragment.
"""

import triton
import triton.language as tl

from . import lamport, ptx

from .numerics import bf16_to_f32, canonical_zero, f32_to_bf16


@triton.jit
def contribution_chunk(x_ptr, gemm2_ptr, weights_ptr, indices_ptr, token, h,
                       HIDDEN: tl.constexpr, TOP_K: tl.constexpr, FINALIZE: tl.constexpr, ON_GPU: tl.constexpr,
                       STREAMED: tl.constexpr = False, ZERO_CANONICAL: tl.constexpr = True):
    """bf16 bits of a rank's contribution to ``token`` at columns ``h`` (whole 16-byte fragments;
    columns past HIDDEN read as +0): ``x``, or the MoE finalize (then ``x_ptr`` is the shared expert
    output); zero canonicalized, but where not ``ZERO_CANONICAL`` (a caller that canonicalizes
    in fp32). ``STREAMED``: its inputs are loaded ``evict_first``."""
    LOAD_POLICY: tl.constexpr = "evict_first" if STREAMED else ""
    if FINALIZE:
        acc = tl.zeros(h.shape, tl.float32)
        for k in tl.static_range(TOP_K):
            row = tl.load(indices_ptr + token * TOP_K + k)
            weight = tl.load(weights_ptr + token * TOP_K + k)
            routed = row != -1
            values = tl.load(gemm2_ptr + row.to(tl.int64) * HIDDEN + h, mask=routed & (h < HIDDEN), other=0,
                             eviction_policy=LOAD_POLICY)
            # A route this rank does not hold is skipped, not multiplied by zero.
            acc = tl.where(routed, ptx.fma_rn(bf16_to_f32(values, ON_GPU), weight, acc, ON_GPU), acc)
        shared = tl.load(x_ptr + token * HIDDEN + h, mask=h < HIDDEN, other=0, eviction_policy=LOAD_POLICY)
        contribution = f32_to_bf16(acc + bf16_to_f32(shared, ON_GPU), ON_GPU)
    else:
        contribution = tl.load(x_ptr + token * HIDDEN + h, mask=h < HIDDEN, other=0, eviction_policy=LOAD_POLICY)
    if ZERO_CANONICAL:
        contribution = canonical_zero(contribution)
    return contribution


# The pointers a call may pass only 4-byte aligned (``lamport_mhc.validate``: the expert weights and
# indices, the MXFP8 scales). Not specialized on 16-byte alignment, as runtime scalars are not
# specialized: one compiled kernel serves every call. (A second specialization would compile during
# a call, or fail in a graph capture, and start without the launch shape set on the first.)
FOUR_BYTE_ALIGNED = ["weights_ptr", "indices_ptr", "scales_ptr"]


@triton.jit(do_not_specialize=["multicast_address", "slots"], do_not_specialize_on_alignment=FOUR_BYTE_ALIGNED)
def publish_kernel(
    x_ptr,            # int16 [M, H]: the contribution, or (FINALIZE) the shared expert output
    gemm2_ptr,        # int16 [rows, H]  (FINALIZE)
    weights_ptr,      # fp32 [M, TOP_K]  (FINALIZE)
    indices_ptr,      # int32 [M, TOP_K] (FINALIZE)
    state_ptr,        # int32 [3]: this protocol's generation state (lamport_mhc.layout)
    peer_table_ptr,   # int64 [TP]: every rank's mailbox address
    multicast_address,  # int64: the mailbox's multicast address (LL with MULTICAST)
    slots,            # tokens per [gen][rank] of the mailbox: capacity (LL), ceil(capacity / TP) (BT)
    HIDDEN: tl.constexpr, TP: tl.constexpr, RANK: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK: tl.constexpr, FINALIZE: tl.constexpr, BT: tl.constexpr,
    MULTICAST: tl.constexpr, ON_GPU: tl.constexpr, USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    h = chunk * BLOCK + tl.arange(0, BLOCK)

    ptx.grid_dependency_wait(USE_PDL, ON_GPU)
    contribution = contribution_chunk(x_ptr, gemm2_ptr, weights_ptr, indices_ptr, token, h, HIDDEN, TOP_K,
                                      FINALIZE, ON_GPU)

    generation = tl.load(state_ptr + lamport.STATE_NEXT, volatile=True)
    gen = generation.to(tl.int64)
    if BT:
        slot = ((gen * TP + RANK) * slots + token // TP) * HIDDEN
        owner = lamport.peer_pointer(peer_table_ptr, token % TP)
        tl.store(owner + slot + h, contribution, mask=h < HIDDEN)
    else:
        slot = ((gen * TP + RANK) * slots + token) * HIDDEN + chunk * BLOCK
        lamport.broadcast(contribution, slot, h < HIDDEN, peer_table_ptr, multicast_address, TP, BLOCK, MULTICAST)

    if (token == 0) & (chunk == 0):
        tl.store(state_ptr + lamport.STATE_ACTIVE, generation)
    ptx.launch_dependents(USE_PDL, ON_GPU)
