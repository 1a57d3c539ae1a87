"""Choices: which backends an instance builds (from the config, the presets and what this machine
supports, never a guess), which protocol a call takes (its backend comes from the preset's routes),
and the cross-check comparison."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import FUSED_BACKENDS, LOCAL, BuildSpec, Support, load_backend
from .presets import Preset


@dataclass(frozen=True)
class Thresholds:
    bt_min_rows: int
    bt_min_finalize_rows: int

    def bt_reachable(self, capacity: int) -> bool:
        """Whether a build of this capacity ever takes BT (else it allocates no BT state)."""
        return min(self.bt_min_rows, self.bt_min_finalize_rows) <= capacity


# The most rows one protocol round takes unless configured (``AllReduceMHCConfig.chunk_rows``): the
# BT mailboxes hold this many rows, whatever max_num_tokens is. At TP8, H 7168: 88 MiB of BT sums
# and as much of BT contributions per GPU.
CHUNK_ROWS = 2048


def check_chunk_rows(rows, quantize: bool) -> None:
    """A part of a chunked call must start on a 128-row tile of the MXFP8 scales."""
    from .layout import SCALE_TILE_ROWS

    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {rows!r}")
    if quantize and rows % SCALE_TILE_ROWS:
        raise ValueError(f"chunk_rows must be a multiple of {SCALE_TILE_ROWS} (the MXFP8 scales' row tiles), got {rows}")


def mailbox_rows(tp: int, capacity: int, thresholds: Thresholds, chunk_rows: int | None = None,
                 quantize: bool = False) -> dict:
    """The ``BuildSpec`` fields that size a group's mailboxes: whether BT state exists, and the rows
    one call of each protocol takes. Calls of more than ``chunk_rows`` rows go through in parts of
    that many (``FusedPath.parts``), each taking the protocol of its own size: so BT never takes more
    rows than a part, and LL never more than the largest BT threshold less one. A group of one has
    no mailbox (and no parts)."""
    if chunk_rows is not None:
        check_chunk_rows(chunk_rows, quantize)
    if tp == 1:
        return dict(bt=False)
    chunk = min(capacity, chunk_rows or CHUNK_ROWS)
    if not thresholds.bt_reachable(chunk):
        return dict(bt=False, ll_rows=chunk, bt_rows=None)
    largest_ll = max(thresholds.bt_min_rows, thresholds.bt_min_finalize_rows) - 1
    return dict(bt=True, ll_rows=max(1, min(chunk, largest_ll)), bt_rows=chunk)


def choose_protocol(kind: str, m: int, thresholds: Thresholds, protocols: tuple[str, ...]) -> str:
    """Of a build's ``protocols`` (``BuildSpec.protocols``): "local" for a group of one; else BT
    from the threshold of the call's kind on (when the build has BT state), else LL."""
    if protocols == (LOCAL,):
        return LOCAL
    limit = thresholds.bt_min_finalize_rows if kind == "finalize" else thresholds.bt_min_rows
    return "bt" if "bt" in protocols and m >= limit else "ll"


def support_table(spec: BuildSpec, device: torch.device) -> dict[str, Support]:
    """Every fused backend's answer for this build here."""
    table = {}
    for name in FUSED_BACKENDS:
        backend = load_backend(name)
        table[name] = backend if isinstance(backend, Support) else backend.support(spec, device)
    return table


def pick_backends(requested: str, preset: Preset, supported: set[str]) -> tuple[str, ...]:
    """The backends an instance builds, given the fused backends every rank supports: ``requested``
    itself (which must be supported); for "auto", every backend the preset's routes name when all of
    them are supported (each call then runs on its route's backend), else the first of the preset's
    measured preference that is supported, else the unfused "torch" path. "auto" never guesses."""
    if requested == "torch":
        return ("torch",)
    if requested == "auto":
        routed = preset.routed_backends()
        if routed and set(routed) <= supported:
            return routed
        return (next((name for name in preset.backends if name in supported), "torch"),)
    if requested not in supported:
        raise RuntimeError(f"backend {requested!r} is not supported on every rank")
    return (requested,)


def first_difference(name: str, expected: torch.Tensor, actual: torch.Tensor) -> str | None:
    """None when the bits are identical, else a message naming the output and the first index."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    a = expected.view(as_int[expected.element_size()])
    b = actual.view(as_int[actual.element_size()])
    if torch.equal(a, b):
        return None
    flat = (a != b).flatten().nonzero()[0, 0].item()
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
    return (f"{name} differs first at index {index}: 0x{int(a.flatten()[flat]) & 0xFFFFFFFF:x} vs "
            f"0x{int(b.flatten()[flat]) & 0xFFFFFFFF:x}")


def cross_check(primary: str, secondary: str, expected: dict[str, torch.Tensor],
                actual: dict[str, torch.Tensor]) -> None:
    """Raise on the first output of ``primary`` whose bits differ from ``secondary``'s."""
    for name, tensor in expected.items():
        message = first_difference(name, tensor, actual[name])
        if message is not None:
            raise RuntimeError(f"cross-check {primary} vs {secondary}: {message}")
