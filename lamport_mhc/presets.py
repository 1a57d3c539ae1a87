"""Measured choices per machine: the LL -> BT crossovers, and the backend ``auto`` prefers.

Each row names the measurement that justifies it. Rows for this project's own GPU test machines are
added by the benchmark (``bench/``); until a machine has a row, the fallback is FlashInfer's own
measured crossover for H5120 TP4 (GB200, ``flashinfer/comm/mnnvl_cutedsl/presets.py`` 0.7.2: LL up
to 36 rows, finalize up to 42), which the selector reports as such.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    bt_min_rows: int
    bt_min_finalize_rows: int
    backends: tuple[str, ...]  # preference of ``auto``, fastest first
    source: str


# (gpu family, tp, hidden) -> Preset
PRESETS: dict[tuple[str, int, int], Preset] = {}

FALLBACK = Preset(bt_min_rows=37, bt_min_finalize_rows=43, backends=("triton", "cute"),
                  source="FlashInfer 0.7.2 mnnvl_cutedsl presets, H5120 TP4 (GB200); not measured here")


def gpu_family(capability: tuple[int, int] | None) -> str:
    if capability is None:
        return "cpu"
    return {9: "hopper", 10: "blackwell", 12: "blackwell-consumer"}.get(capability[0], f"sm{capability[0]}x")


def lookup(family: str, tp: int, hidden: int) -> Preset:
    return PRESETS.get((family, tp, hidden), FALLBACK)
