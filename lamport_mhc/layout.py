"""Constants shared by the reference, the workspace and every kernel backend.

The mailbox layouts and the generation state are part of the protocol: every backend reads and writes
them the same way, so they live here rather than in any one backend.
"""

# Three rotating generations: a fast rank may publish call N+1 while a slow one still reads call N,
# and the slot of call N is re-armed (sentinel refilled) before call N+3 reuses it.
GENERATIONS = 3

# Lamport sentinel: bf16 negative zero (0x8000, as int16). Contributions are canonicalized
# (-0.0 -> +0.0) before they are published, so a slot holding this bit pattern has not been written yet.
SENTINEL_INT16 = -32768

# Generation state: int32 [3] per protocol in device memory, advanced by the kernels.
# NEXT: the generation the next publish writes. ACTIVE: the generation the current call reads.
# ARRIVED: programs of a one-kernel LL call that have read NEXT; the last one resets it and
# advances NEXT (no program may advance it before every program has read it).
STATE_NEXT = 0
STATE_ACTIVE = 1
STATE_ARRIVED = 2
STATE_WORDS = 3

# Spin-timeout record (spin_timeout_ms): [flag (1 = timed out), source rank waited for (-1: the
# reduced sum), generation, token]. The first poll of a rank to give up claims the device error
# buffer's flag with an atomic CAS (device memory: no host atomics needed) and writes the record
# there and to the host mirror, a pinned host copy the host reads with no device copy and no
# synchronization (inside CUDA graphs too). Into the mirror it stores the record, a system-scope
# fence, then the flag: a host that sees the flag sees the record.
RECORD_WORDS = 4
# The device error buffer: the record, then (words 4-5, int64, 8-byte aligned) the address through
# which kernels reach the host mirror (0: no mirror). Stored in the buffer, not passed to the
# kernels, so their signatures do not depend on it.
ERROR_WORDS = 6
ERROR_MIRROR_ADDRESS = 2  # index of the mirror address in the buffer viewed as int64

# MXFP8: one UE8M0 scale per 32 values, scales in FlashInfer's swizzled 128x4 tiles.
MXFP8_BLOCK = 32
SCALE_TILE_ROWS = 128
SCALE_TILE_COLS = 4

# Hidden sizes must split into 16-byte (8 x bf16) fragments; MXFP8 needs whole 128-column scale tiles.
HIDDEN_MULTIPLE = 8
HIDDEN_MULTIPLE_MXFP8 = MXFP8_BLOCK * SCALE_TILE_COLS


def owner_capacity(capacity: int, tp: int) -> int:
    """Rows one rank owns at most under BT (token t belongs to rank t % tp)."""
    return -(-capacity // tp)
