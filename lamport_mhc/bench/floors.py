"""Byte floors: the bytes a call must move, and the ceilings (peer copy over NVLink, device copy in
HBM) measured in the same run that turn them into microseconds."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..mxfp8 import mxfp8_scale_bytes
from .names import HC

PROTOCOLS = ("ll", "bt", "local")


@dataclass(frozen=True)
class Ceilings:
    peer_gbps: float | None  # one rank storing into one peer over NVLink (None: a group of one)
    hbm_gbps: float          # device-to-device copy (read + write counted)


def _quant_bytes(m: int, hidden: int) -> int:
    return m * hidden + mxfp8_scale_bytes(m, hidden)  # e4m3 values, UE8M0 scales (padded rows too)


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
        contribution = _finalize_read_bytes(m, row, top_k, m * top_k if held_routes is None else held_routes)
    else:
        contribution = m * row
    hbm = contribution + mailbox + 2 * m * hc * row + m * row        # residual in and out, layer input
    if variant == "quant":
        hbm += m * hidden + m * hidden // 32
    return nvlink, hbm


def floor_us(protocol: str, variant: str, tp: int, m: int, hidden: int, ceilings: Ceilings, hc: int = HC,
             top_k: int = 6, held_routes: int | None = None) -> float:
    nvlink, hbm = fused_bytes(protocol, variant, tp, m, hidden, hc, top_k, held_routes)
    link_us = 0.0 if nvlink == 0 else nvlink / (ceilings.peer_gbps * 1e3)
    return max(link_us, hbm / (ceilings.hbm_gbps * 1e3))


def tail_bytes(variant: str, m: int, hidden: int, hc: int = HC, held_routes: int = 0, top_k: int = 6) -> int:
    """HBM bytes of the strong unfused kernels on their own (``strong-tail`` rows): the mHC tail reads
    the reduced row and the hc streams and writes the streams and the layer input (quant: also the
    MXFP8 values and scales); finalize adds the MoE finalize kernel before it (its ``held_routes``
    GEMM2 rows, the shared expert and the router inputs read, the contribution written)."""
    row = hidden * 2
    total = m * row + 2 * m * hc * row + m * row
    if variant == "quant":
        total += _quant_bytes(m, hidden)
    if variant == "finalize":
        total += _finalize_read_bytes(m, row, top_k, held_routes) + m * row  # and the contribution written
    return total


def _finalize_read_bytes(m: int, row: int, top_k: int, held_routes: int) -> int:
    """What the MoE finalize reads: the held routes' GEMM2 rows, the shared expert's rows, and the
    router's fp32 weights and int32 indices."""
    return held_routes * row + m * row + m * top_k * 8


def measure_ceilings(group, device, nbytes: int = 1 << 28) -> Ceilings:
    """Peer-store bandwidth into the next rank's symmetric buffer (none for a group of one), and
    device copy bandwidth."""
    import torch
    import torch.distributed as dist

    from .timing import time_graph

    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    local = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(local)
    hbm_us = statistics.median(time_graph(lambda: dst.copy_(local), 5, 5))
    peer_gbps = None
    if tp > 1:
        import torch.distributed._symmetric_memory as symm_mem

        target = symm_mem.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        handle = symm_mem.rendezvous(target, group)
        peer = handle.get_remote_tensor((rank + 1) % tp, target.shape, target.dtype)
        peer_gbps = nbytes / statistics.median(time_graph(lambda: peer.copy_(local), 5, 5)) / 1e3
    return Ceilings(peer_gbps=peer_gbps, hbm_gbps=2 * nbytes / hbm_us / 1e3)
