"""What a chunked call costs, estimated from a measured table: ``python -m lamport_mhc.bench.chunk_cost
CSV [--chunk-rows R]``.

A call of M rows in parts of R rows (``AllReduceMHCConfig.chunk_rows``) runs M / R protocol rounds
of R rows back to back. A bench table times each M as one of many calls in a CUDA graph, back to
back too, so M / R times the time of R rows estimates the parts; against the time of M rows (both
from the table's ``auto`` path, M a multiple of R) that is the cost of chunking.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

from ..selector import CHUNK_ROWS


def chunk_costs(rows, chunk_rows: int = CHUNK_ROWS, path: str = "auto") -> list[dict]:
    """Per (tp, hidden, variant, M > chunk_rows with M % chunk_rows == 0): the whole call's time, the
    parts' and the parts' cost over the whole call (0.03: 3% slower)."""
    times: dict[tuple, dict[int, float]] = defaultdict(dict)
    for row in rows:
        if row["path"] == path:
            times[(int(row["tp"]), int(row["hidden"]), row["variant"])][int(row["m"])] = float(row["us_median"])
    costs = []
    for (tp, hidden, variant), by_m in sorted(times.items()):
        if chunk_rows not in by_m:
            continue
        for m in sorted(m for m in by_m if m > chunk_rows and m % chunk_rows == 0):
            parts = m // chunk_rows * by_m[chunk_rows]
            costs.append({"tp": tp, "hidden": hidden, "variant": variant, "m": m, "whole_us": by_m[m],
                          "parts_us": parts, "cost": parts / by_m[m] - 1})
    return costs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lamport_mhc.bench.chunk_cost", description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="a bench CSV (e.g. bench/results/h200_tp2.csv)")
    parser.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS)
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as f:
        costs = chunk_costs(csv.DictReader(f), args.chunk_rows)
    if not costs:
        print(f"no auto rows at M = {args.chunk_rows} and a multiple of it above in {args.csv}")
        return 1
    print("| tp | H | variant | M | whole us | in parts us | cost |\n|---|---|---|---|---|---|---|")
    for c in costs:
        print(f"| {c['tp']} | {c['hidden']} | {c['variant']} | {c['m']} | {c['whole_us']:.1f} | {c['parts_us']:.1f} "
              f"| {100 * c['cost']:+.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
