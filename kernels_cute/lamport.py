"""Device-side pieces of the Lamport protocol shared by the CuTe DSL kernels, as in
``kernels_triton.lamport``: polling a mailbox fragment until no lane holds the sentinel (with the
optional spin bound), re-arming, broadcasting a fragment to every rank, generations.

Every helper works on one 16-byte fragment per thread: four 32-bit words at a raw byte address.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64

from lamport_mhc import layout

from . import primitives
from .numerics import LANES, fragment_has_sentinel, high_f32, low_f32

STATE_NEXT = layout.STATE_NEXT
STATE_ACTIVE = layout.STATE_ACTIVE
GENERATIONS = layout.GENERATIONS
BF16_BYTES = 2
WORD_BYTES = 4
MIRROR_ADDRESS_BYTE = layout.ERROR_MIRROR_ADDRESS * 8  # the int64 address of the host mirror


@cute.jit
def element_address(tensor: cute.Tensor, element: Int64) -> Int64:
    """Byte address of element ``element`` of a tensor whose elements are ``dtype.width`` bits."""
    return tensor.iterator.toint() + element * Int64(tensor.element_type.width // 8)


@cute.jit
def record_timeout(error: cute.Tensor, source: Int32, generation: Int32, token: Int32):
    """The first timed-out poll of a rank claims the device error buffer's flag (a CAS from 0 to 1
    in device memory) and writes the record [flag, source, generation, token] there and, flag last
    after a system fence, to the host mirror whose address the buffer holds (0: none)."""
    base = error.iterator.toint()
    if primitives.atomic_cas_b32(base, Int32(0), Int32(1)) == Int32(0):
        primitives.store_b32(base + Int64(1 * WORD_BYTES), source)
        primitives.store_b32(base + Int64(2 * WORD_BYTES), generation)
        primitives.store_b32(base + Int64(3 * WORD_BYTES), token)
        mirror = primitives.load_b64(base + Int64(MIRROR_ADDRESS_BYTE))
        if mirror != Int64(0):
            primitives.store_record_system(mirror, source, generation, token)


@cute.jit
def poll(addresses, timeout_ns: Int64, error: cute.Tensor, sources, generation: Int32, token: Int32):
    """Words of the fragments at ``addresses`` (of the sources ``sources``: ranks, -1 for the owners'
    sum), by 16-byte volatile loads, all in flight together, repeated until no lane of any holds the
    sentinel; one spin loop for all, which re-polls only the slots still pending (a landed slot keeps
    its data until this reader re-arms it). ``timeout_ns > 0`` bounds the wait: on expiry the error word names
    the first source still awaited and the (incomplete) words are returned, as the Triton kernels do."""
    words = [primitives.load_volatile_v4(address) for address in addresses]
    pending = any_pending(words)
    start = primitives.global_timer_ns()
    while pending:
        if cutlass.const_expr(len(addresses) == 1):
            words = [primitives.load_volatile_v4(addresses[0])]
        else:  # only the slots still pending
            words = [primitives.reload_volatile_v4(address, Int32(fragment_has_sentinel(*w)), w)
                     for address, w in zip(addresses, words)]
        pending = any_pending(words)
        if pending & (timeout_ns > Int64(0)):
            if primitives.global_timer_ns() - start > timeout_ns:
                record_timeout(error, first_pending(words, sources), generation, token)
                pending = Boolean(False)
    return words


@cute.jit
def any_pending(words) -> Boolean:
    pending = fragment_has_sentinel(*words[0])
    for i in cutlass.range_constexpr(1, len(words)):
        pending = pending | fragment_has_sentinel(*words[i])
    return pending


@cute.jit
def first_pending(words, sources) -> Int32:
    """The first of ``sources`` whose fragment still holds the sentinel (the last if none does)."""
    source = Int32(sources[-1])
    for i in cutlass.range_constexpr(len(words) - 2, -1, -1):
        source = Int32(cutlass.select_(fragment_has_sentinel(*words[i]), Int32(sources[i]), source))
    return source


@cute.jit
def sum_sources(slots, timeout_ns: Int64, error: cute.Tensor, generation: Int32, token: Int32):
    """The rank-order sum of every source's fragment (``slots``: their addresses, source order):
    8 fp32 lanes, each ``((0 + c_0) + c_1) + ...`` with ``add.rn``, once all have landed."""
    landed = poll(slots, timeout_ns, error, list(range(len(slots))), generation, token)
    acc = [Float32(0.0) for _ in range(LANES)]
    for source in cutlass.range_constexpr(len(slots)):
        for lane in cutlass.range_constexpr(LANES):
            word = landed[source][lane // 2]
            acc[lane] = primitives.add_rn(acc[lane], low_f32(word) if lane % 2 == 0 else high_f32(word))
    return acc


@cute.jit
def broadcast(words, element: Int64, table: cute.Tensor, multicast_address: Int64,
              tp: cutlass.Constexpr[int], multicast: cutlass.Constexpr[bool]):
    """Store one fragment at element ``element`` of every rank's copy of a buffer: once through its
    multicast mapping, or once per rank through the table of peer addresses (int64 [tp])."""
    offset = element * Int64(BF16_BYTES)
    if cutlass.const_expr(multicast):
        primitives.multicast_store_v4(multicast_address + offset, words)
    else:
        # Every destination's address first: the table loads overlap instead of each waiting for
        # the previous store.
        bases = [Int64(table[peer]) for peer in range(tp)]
        for peer in cutlass.range_constexpr(tp):
            primitives.store_v4(bases[peer] + offset, words)


@cute.jit
def next_generation(generation: Int32) -> Int32:
    return (generation + Int32(1)) % Int32(GENERATIONS)
