"""``lamport-ar-floor``: the simplest one-kernel Lamport all-reduce over peer stores, for the
benchmark only (no mHC, no norm, no PDL). Each program stores its slice of a token's row into every
rank's mailbox, polls its own mailbox until all ranks' slices landed, sums them in rank order,
writes the bf16 sum and re-arms the slots. The last program to finish advances the generation."""

import triton
import triton.language as tl

from . import lamport
from .numerics import SENTINEL, bf16_to_f32, canonical_zero, f32_to_bf16


@triton.jit(do_not_specialize=["capacity"])
def lamport_floor_kernel(x_ptr, out_ptr, mailbox_ptr, peer_table_ptr, state_ptr, capacity,
                         HIDDEN: tl.constexpr, TP: tl.constexpr, RANK: tl.constexpr, BLOCK: tl.constexpr,
                         ON_GPU: tl.constexpr = True):
    token = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    h = chunk * BLOCK + tl.arange(0, BLOCK)
    generation = tl.load(state_ptr, volatile=True)  # state: [generation, programs arrived]
    gen = generation.to(tl.int64)
    values = canonical_zero(tl.load(x_ptr + token * HIDDEN + h))
    lamport.broadcast(values, ((gen * TP + RANK) * capacity + token) * HIDDEN + chunk * BLOCK, h < HIDDEN,
                      peer_table_ptr, 0, TP, BLOCK, False)
    acc = tl.zeros([BLOCK], tl.float32)
    for source in tl.static_range(TP):
        slot = mailbox_ptr + ((gen * TP + source) * capacity + token) * HIDDEN + h
        arrived = tl.load(slot, volatile=True)
        while tl.max((arrived == SENTINEL).to(tl.int32), axis=0) != 0:
            arrived = tl.load(slot, volatile=True)
        acc = acc + bf16_to_f32(arrived, ON_GPU)
        lamport.rearm(slot, h < HIDDEN)
    tl.store(out_ptr + token * HIDDEN + h, canonical_zero(f32_to_bf16(acc, ON_GPU)))
    programs = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel") == programs - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, (generation + 1) % lamport.GENERATIONS)
