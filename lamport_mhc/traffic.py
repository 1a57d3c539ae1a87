"""The bytes a call of the op must move, whatever implements it: through NVLink to the peers and
through its own HBM (the contributions, the mHC inputs and outputs, the mailbox traffic). The
benchmark turns them into byte floors; the backends size their calls against L2 with them."""

from __future__ import annotations

PROTOCOLS = ("ll", "bt", "local")
HC = 4  # DeepSeek-V4.1's residual streams


def fused_bytes(protocol: str, variant: str, tp: int, m: int, hidden: int, hc: int = HC,
                top_k: int = 6, held_routes: int | None = None) -> tuple[float, float]:
    """(bytes one rank sends over NVLink, bytes through its HBM) that any fused implementation of a
    call must move: contributions to the peers, the mHC inputs and outputs, the mailbox traffic.
    "local" (a group of one) has no peers and no mailbox: its floor is the HBM bytes alone. The
    finalize's contribution reads the ``held_routes`` GEMM2 rows (default: every route held), the
    shared expert's row and the router's weights and indices."""
    row = hidden * 2  # one bf16 row
    if protocol == "local":
        if tp != 1:
            raise ValueError(f"protocol 'local' is the tp = 1 protocol, got tp={tp}")
        nvlink, mailbox = 0.0, 0.0
    elif protocol == "ll":
        nvlink = (tp - 1) * m * row                                  # every token to every peer
        mailbox = 2 * tp * m * row                                   # written by all, read + re-armed here
    elif protocol == "bt":
        nvlink = (tp - 1) / tp * m * row + (tp - 1) * (m / tp) * row  # to owners, sums broadcast
        mailbox = 2 * tp * (m / tp) * row + 2 * m * row
    else:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if variant == "finalize":
        contribution = finalize_read_bytes(m, row, top_k, m * top_k if held_routes is None else held_routes)
    else:
        contribution = m * row
    hbm = contribution + mailbox + 2 * m * hc * row + m * row        # residual in and out, layer input
    if variant == "quant":
        hbm += m * hidden + m * hidden // 32
    return nvlink, hbm


def finalize_read_bytes(m: int, row: int, top_k: int, held_routes: int) -> int:
    """What the MoE finalize reads: the held routes' GEMM2 rows, the shared expert's rows, and the
    router's fp32 weights and int32 indices."""
    return held_routes * row + m * row + m * top_k * 8


# Local calls of lo < M <= hi rows that move at least the GPU's L2 in bytes (at some widths, past
# STREAMED_FRACTION_ABOVE_ROWS rows, less: STREAMED_L2_FRACTION) access what they move once
# evict-first (the contribution's inputs, the streams in and out; the layer input, which the next
# GEMM reads, is stored plainly). One H200 (60 MiB of L2), tp = 1, H = 4096 / 5120 / 7168, plain,
# quant and finalize, Triton's hints against none: 768 rows 1.6-12.8% faster, 1024 2.2-4.8%, 1536 up
# to 6.2% (7168 quant 2.2% slower); 512 rows 2-12% faster where the call moves more than 60 MiB
# (H = 7168, the finalize at 4096 and 5120) and 7-9% at 5120 plain and quant (52-55 MB: taken at
# STREAMED_L2_FRACTION), 9-21% slower at 4096 plain and quant (42-44 MB: without hints the next call
# on the same inputs finds them in L2); 2048 up to 3.3% slower, 4096 3-5%. CuTe's streaming form,
# same run against none: 1024 rows 1.0-3.0% faster (H = 4096 / 5120, plain and quant), 1536 0-1.7%
# slower.
# Up to 256 rows only a call that moves the whole L2 takes them: one H100 (50 MiB), H = 7168
# finalize M = 256 (top-6, 1.12 x L2), the wide form hinted against not 16.8 / 20.4 us (the parked
# one 18.4 / 23.1), while H = 5120 finalize M = 256 (0.80 x L2) hinted lost 13.0 / 11.2.
STREAMED_ROWS = (128, 1536)

# By hidden size, where measured (else 1.0): the fraction of the L2 a call must move to take the
# hints. One H200 (Triton, 60 MiB of L2), bits unchanged, us at 0.8 / at 1.0 x L2: H = 5120 M = 512
# plain 13.00 / 13.61, quant 14.72 / 15.55, finalize M = 320 15.61 / 16.47; H = 7168 M = 384 plain
# 14.13 / 15.64 (and 14.0-14.2 / 15.5-15.9 in three more runs), quant 15.81 / 17.78; but H = 4096
# M = 640 plain 15.46 / 15.16, quant 16.56 / 16.60, finalize M = 384 13.88 / 13.45.
STREAMED_L2_FRACTION = {5120: 0.8, 7168: 0.8}
STREAMED_FRACTION_ABOVE_ROWS = 256


def streams_past_l2(variant: str, m: int, hidden: int, hc: int, top_k: int, l2_bytes: int | None,
                    rows: tuple[int, int] = STREAMED_ROWS) -> bool:
    """Whether a local call takes the cache hints: ``rows`` rows whose HBM bytes (every route held,
    for the finalize) are at least the L2's, or above STREAMED_FRACTION_ABOVE_ROWS rows
    ``STREAMED_L2_FRACTION`` of it (``None``: no L2 known, never)."""
    lo, hi = rows
    if l2_bytes is None or not lo < m <= hi:
        return False
    fraction = STREAMED_L2_FRACTION.get(hidden, 1.0) if m > STREAMED_FRACTION_ABOVE_ROWS else 1.0
    return fused_bytes("local", variant, 1, m, hidden, hc, top_k)[1] >= fraction * l2_bytes
