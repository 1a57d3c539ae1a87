"""BT owner reduce: each rank sums, for the tokens it owns (t % TP == RANK), every rank's
contribution in rank order (fp32 from +0, rounded to bf16, -0.0 -> +0.0: the same bits as the LL
consumer's sum) and stores the sum into every rank's ``sums[gen][t]``. It then advances the BT
generation and re-arms the contribution slots it read.
Grid: (max(1, ceil(M / TP)), CHUNKS), chunks as the publish's; at least one program runs so the
generation advances on a rank that owns no token of a small call.
"""

import triton
import triton.language as tl

from . import lamport, ptx

from .numerics import bf16_to_f32, canonical_zero, f32_to_bf16


# Runtime scalars are not specialized: one compiled kernel serves every call (and graph capture).
@triton.jit(do_not_specialize=["sums_multicast_address", "num_tokens", "timeout_ns", "slots", "capacity"])
def owner_reduce_kernel(
    mailbox_ptr,      # int16 [3][TP][slots][H]: this rank's BT mailbox
    sums_table_ptr,   # int64 [TP]: every rank's sums buffer [3][capacity][H]
    sums_multicast_address,  # int64 (MULTICAST)
    state_ptr,        # int32 [2]: BT [next, active]
    error_ptr,        # int32 [6] (layout.ERROR_WORDS)
    num_tokens,       # M of the call
    timeout_ns,       # int64, 0 = wait forever
    slots,            # ceil(capacity / TP)
    capacity,
    HIDDEN: tl.constexpr, TP: tl.constexpr, RANK: tl.constexpr, BLOCK: tl.constexpr, MULTICAST: tl.constexpr,
    ON_GPU: tl.constexpr, USE_PDL: tl.constexpr,
):
    local = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    token = local * TP + RANK
    h = chunk * BLOCK + tl.arange(0, BLOCK)
    in_row = h < HIDDEN

    ptx.grid_dependency_wait(USE_PDL, ON_GPU)
    generation = tl.load(state_ptr + lamport.STATE_ACTIVE, volatile=True)
    gen = generation.to(tl.int64)
    if token < num_tokens:
        acc = tl.zeros([BLOCK], tl.float32)
        for source in tl.static_range(TP):
            slot = mailbox_ptr + ((gen * TP + source) * slots + local) * HIDDEN + h
            values = lamport.poll(slot, in_row, timeout_ns, error_ptr, source, generation, token, ON_GPU)
            acc = acc + bf16_to_f32(values, ON_GPU)
        reduced = canonical_zero(f32_to_bf16(acc, ON_GPU))
        offset = (gen * capacity + token) * HIDDEN + chunk * BLOCK
        lamport.broadcast(reduced, offset, in_row, sums_table_ptr, sums_multicast_address, TP, BLOCK, MULTICAST)
        for source in tl.static_range(TP):
            lamport.rearm(mailbox_ptr + ((gen * TP + source) * slots + local) * HIDDEN + h, in_row)

    if (local == 0) & (chunk == 0):
        lamport.advance_generation(state_ptr, generation)
    ptx.launch_dependents(USE_PDL, ON_GPU)
