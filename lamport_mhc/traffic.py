"""The bytes a call of the op must move, whatever implements it: through NVLink to the peers and
through its own HBM (the contributions, the mHC inputs and outputs, the mailbox traffic). The
benchmark turns them into byte floors; the Triton backend sizes its calls against L2 with them."""

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
