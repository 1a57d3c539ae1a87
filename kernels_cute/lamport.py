"""Device-side pieces of the Lamport protocol shared by the CuTe DSL kernels, as in
``kernels_triton.lamport``: polling a mailbox fragment until no lane holds the sentinel (with the
optional spin bound), re-arming, broadcasting a fragment to every rank, generations.

Every helper works on one 16-byte fragment per thread: four 32-bit words at a raw byte address.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, Int64

from lamport_mhc import layout

from . import primitives
from .numerics import fragment_has_sentinel

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
def poll(address: Int64, timeout_ns: Int64, error: cute.Tensor, source: Int32, generation: Int32,
         token: Int32):
    """16-byte volatile loads of a fragment until no lane equals the sentinel. ``timeout_ns > 0``
    bounds the wait: on expiry the error word names what was awaited and the (incomplete) words are
    returned, as the Triton kernels do."""
    w0, w1, w2, w3 = primitives.load_volatile_v4(address)
    pending = fragment_has_sentinel(w0, w1, w2, w3)
    start = primitives.global_timer_ns()
    while pending:
        w0, w1, w2, w3 = primitives.load_volatile_v4(address)
        pending = fragment_has_sentinel(w0, w1, w2, w3)
        if pending & (timeout_ns > Int64(0)):
            if primitives.global_timer_ns() - start > timeout_ns:
                record_timeout(error, source, generation, token)
                pending = Boolean(False)
    return w0, w1, w2, w3


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
