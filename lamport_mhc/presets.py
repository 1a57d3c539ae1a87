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


def crossover(rows: list[dict], hidden: int, variant: str, ll_path: str = "triton-ll",
              bt_path: str = "triton-bt") -> int | None:
    """The smallest measured M from which BT is at least as fast as LL at every larger measured M
    (the BT threshold a preset row should carry), from benchmark rows; None when LL always wins."""
    times: dict[str, dict[int, float]] = {ll_path: {}, bt_path: {}}
    for row in rows:
        if int(row["hidden"]) == hidden and row["variant"] == variant and row["path"] in times:
            times[row["path"]][int(row["m"])] = float(row["us_median"])
    sizes = sorted(set(times[ll_path]) & set(times[bt_path]))
    threshold = None
    for m in reversed(sizes):
        if times[bt_path][m] > times[ll_path][m]:
            break
        threshold = m
    return threshold


def suggest(csv_path: str, family: str) -> list[str]:
    """PRESETS rows (as source lines) derived from a ``python -m lamport_mhc bench`` CSV."""
    import csv

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    lines = []
    for tp, hidden in sorted({(int(r["tp"]), int(r["hidden"])) for r in rows}):
        subset = [r for r in rows if int(r["tp"]) == tp]
        plain = crossover(subset, hidden, "plain")
        final = crossover(subset, hidden, "finalize")
        never = 1 << 30
        lines.append(f'    ("{family}", {tp}, {hidden}): Preset(bt_min_rows={plain or never}, '
                     f'bt_min_finalize_rows={final or never}, backends=("triton", "cute"), '
                     f'source="{csv_path}"),')
    return lines
