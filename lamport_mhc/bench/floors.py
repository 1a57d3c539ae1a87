"""Byte floors: the bytes a call must move, and the ceilings (peer copy over NVLink, device copy in
HBM) measured in the same run that turn them into microseconds."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..mxfp8 import mxfp8_scale_bytes
from ..traffic import HC, finalize_read_bytes, fused_bytes


@dataclass(frozen=True)
class Ceilings:
    peer_gbps: float | None  # one rank storing into one peer over NVLink (None: a group of one)
    hbm_gbps: float          # device-to-device copy (read + write counted)


def _quant_bytes(m: int, hidden: int) -> int:
    return m * hidden + mxfp8_scale_bytes(m, hidden)  # e4m3 values, UE8M0 scales (padded rows too)


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
        total += finalize_read_bytes(m, row, top_k, held_routes) + m * row  # and the contribution written
    return total


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
