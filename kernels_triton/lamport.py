"""Device-side pieces of the Lamport protocol shared by the Triton kernels: polling a mailbox slot
until no lane holds the sentinel (with the optional spin bound), re-arming slots, generations."""

import os

import triton
import triton.language as tl

from lamport_mhc import layout

from . import ptx

from .numerics import SENTINEL

STATE_NEXT = tl.constexpr(layout.STATE_NEXT)
STATE_ACTIVE = tl.constexpr(layout.STATE_ACTIVE)
STATE_ARRIVED = tl.constexpr(layout.STATE_ARRIVED)
GENERATIONS = tl.constexpr(layout.GENERATIONS)
# Under the interpreter every publish ran before any consumer, so a slot still empty after this
# many polls is a protocol bug, reported like a GPU spin timeout instead of hanging the process.
INTERPRETER_POLLS = tl.constexpr(2)
# The negative control of the concurrent one-GPU group (never set in production): with
# LAMPORT_MHC_DEBUG_NO_WAIT=1 when this module is imported, a poll reads its slot once and goes on
# without waiting for it. Ranks launched in protocol order still pass (every slot is written before
# it is polled); ranks that run at once must not.
DEBUG_NO_WAIT = tl.constexpr(os.environ.get("LAMPORT_MHC_DEBUG_NO_WAIT") == "1")
# The int64 address of the host mirror of the spin-timeout record, in the device error buffer.
MIRROR_ADDRESS = tl.constexpr(layout.ERROR_MIRROR_ADDRESS)


@triton.jit
def record_timeout(error_ptr, source, generation, token, ON_GPU: tl.constexpr):
    """The first timed-out poll of a rank claims the device error buffer's flag (atomic CAS in
    device memory) and writes the record [flag, source, generation, token] there and, flag last
    after a system fence, to the host mirror whose address the buffer holds (0: none)."""
    if tl.atomic_cas(error_ptr, 0, 1) == 0:
        record = (source + tl.zeros([], tl.int32), generation.to(tl.int32), token.to(tl.int32))
        tl.store(error_ptr + 1, record[0])
        tl.store(error_ptr + 2, record[1])
        tl.store(error_ptr + 3, record[2])
        mirror = tl.load(error_ptr.to(tl.pointer_type(tl.int64)) + MIRROR_ADDRESS)
        if mirror != 0:
            ptx.store_record_system(mirror, record[0], record[1], record[2], ON_GPU)


@triton.jit
def _expired(start, polls, timeout_ns, ON_GPU: tl.constexpr):
    """Whether a spin that began at ``start`` (ns) and has polled ``polls`` times should give up."""
    if ON_GPU:
        return (timeout_ns > 0) & (ptx.global_timer_ns(ON_GPU) - start > timeout_ns)
    else:
        return polls >= INTERPRETER_POLLS


@triton.jit
def poll(ptrs, mask, timeout_ns, error_ptr, source, generation, token, ON_GPU: tl.constexpr):
    """Volatile loads of a slot until no lane equals the sentinel. ``timeout_ns > 0`` bounds the wait:
    on expiry the error word names what was awaited and the (incomplete) values are returned."""
    values = ptx.load_volatile(ptrs, mask, ON_GPU)
    pending = tl.max((values == SENTINEL).to(tl.int32), axis=0)
    start = ptx.global_timer_ns(ON_GPU)
    polls = 0
    if DEBUG_NO_WAIT:
        pending = 0
    while pending != 0:
        values = ptx.load_volatile(ptrs, mask, ON_GPU)
        pending = tl.max((values == SENTINEL).to(tl.int32), axis=0)
        polls += 1
        if _expired(start, polls, timeout_ns, ON_GPU) & (pending != 0):
            record_timeout(error_ptr, source, generation, token, ON_GPU)
            pending = 0
    return values


@triton.jit
def rearm(ptrs, mask):
    """Refill consumed slots with the sentinel (Lamport: the data is its own ready flag)."""
    tl.store(ptrs, tl.full(ptrs.shape, SENTINEL, tl.int16), mask=mask)


@triton.jit
def advance_generation(state_ptr, generation):
    tl.store(state_ptr + STATE_NEXT, (generation + 1) % GENERATIONS)


@triton.jit
def reset_arrivals_and_advance(state_ptr, generation):
    """One-kernel LL: called by the last program to count itself in STATE_ARRIVED (every program
    counts itself after reading ``generation`` from NEXT), for the next call."""
    tl.store(state_ptr + STATE_ARRIVED, 0)
    advance_generation(state_ptr, generation)


@triton.jit
def peer_pointer(table_ptr, rank):
    """int16 view of the buffer whose address is entry ``rank`` of an int64 address table; buffers
    are 16-byte aligned, which lets the compiler emit 16-byte stores."""
    address = tl.load(table_ptr + rank)
    return tl.multiple_of(address.to(tl.pointer_type(tl.int16)), 16)


@triton.jit
def broadcast(values, offset, mask, peer_table_ptr, multicast_address, TP: tl.constexpr, BLOCK: tl.constexpr,
              MULTICAST: tl.constexpr):
    """Store a contiguous run of BLOCK values (the lanes of ``mask``, whole 16-byte fragments) at
    element ``offset`` of every rank's copy of a buffer: once through its multicast mapping, or once
    per rank through the peer-address table."""
    if MULTICAST:
        store_multicast(multicast_address, offset, values, mask, BLOCK)
    else:
        for peer in tl.static_range(TP):
            tl.store(peer_pointer(peer_table_ptr, peer) + offset + tl.arange(0, BLOCK), values, mask=mask)


@triton.jit
def store_multicast(address, offsets, values, mask, BLOCK: tl.constexpr):
    """``multimem.st`` of a contiguous run of BLOCK bf16 (as int16) values starting at element
    ``offsets`` (scalar) of the multicast mapping at ``address``: 16 bytes per store, for the
    fragments whose lanes ``mask`` holds (a mask is whole fragments: HIDDEN is a multiple of 8)."""
    half = tl.reshape(values.to(tl.uint16, bitcast=True).to(tl.uint32), (BLOCK // 2, 2))
    lo, hi = tl.split(half)
    words = tl.reshape(lo | (hi << 16), (BLOCK // 8, 2, 2))
    even, odd = tl.split(words)  # words 4i+2j and 4i+2j+1
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    fragment = tl.arange(0, BLOCK // 8)
    # The fragment's first lane decides for all eight.
    stored = tl.max(tl.reshape(mask.to(tl.int32), (BLOCK // 8, 8)), axis=1)
    byte = address + (offsets + fragment.to(tl.int64) * 8) * 2
    ptx.multicast_store_16b(byte, w0.to(tl.int32, bitcast=True), w1.to(tl.int32, bitcast=True),
                            w2.to(tl.int32, bitcast=True), w3.to(tl.int32, bitcast=True), stored)
