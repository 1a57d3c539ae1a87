"""The sweep's outputs: the CSV (and reading earlier ones back for ``--merge``), the notes sidecar,
the derived speedup columns, the markdown summary and the plots."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

from .floors import Ceilings
from .names import BACKEND_PATHS, DEFAULT_ROWS, HC, STRONG_TAIL, whole_op_alternatives

COLUMNS = ("tp", "hc", "hidden", "variant", "m", "path", "us_median", "us_min", "us_max", "floor_us", "ratio_to_floor",
           "speedup_vs_unfused", "speedup_vs_best")
INT_COLUMNS = ("tp", "hc", "hidden", "m")
FLOAT_COLUMNS = ("us_median", "us_min", "us_max", "floor_us", "ratio_to_floor", "speedup_vs_unfused",
                 "speedup_vs_best")
CSV_DIGITS = 3  # decimals of the CSV's float columns
# The strong tail must reach this fraction of the device-copy ceiling from this many rows on.
TAIL_BAR, TAIL_BAR_FROM_M = 0.85, 1024


def gpu_slug(device_name: str) -> str:
    """The GPU's part of a results file's name: "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    return device_name.replace("NVIDIA ", "").replace(" ", "-").lower()


def read_rows(path) -> list[dict]:
    """The rows of a bench CSV with the types the sweep records (empty cells: None). CSVs written
    before the hc column existed were measured at hc = 4."""
    def convert(key, value):
        if value == "" or value is None:
            return None
        return int(value) if key in INT_COLUMNS else float(value) if key in FLOAT_COLUMNS else value
    with open(path, newline="") as f:
        rows = [{k: convert(k, v) for k, v in row.items()} for row in csv.DictReader(f)]
    for row in rows:
        row["hc"] = HC if row.get("hc") is None else row["hc"]
        row.setdefault("speedup_vs_best", None)
    return [{k: row.get(k) for k in COLUMNS} for row in rows]


def notes_path(csv_path) -> Path:
    csv_path = Path(csv_path)
    return csv_path.with_name(f"{csv_path.stem}_notes.json")


def _row_key(row: dict) -> tuple:
    return row["tp"], row.get("hc", HC), row["hidden"], row["variant"], row["m"], row["path"]


def _shape(row: dict) -> tuple:
    return _row_key(row)[:5]


def time_budget_subject(hidden: int) -> str:
    """The subject of a run's note on what it had no time to measure at ``hidden``."""
    return f"time budget H={hidden}"


def _note_key(note: dict) -> tuple:
    """What a note is about: its hidden size and the text before its first colon."""
    return note["hidden"], note["text"].split(":", 1)[0]


def rows_scope(args) -> str:
    """What a run's notes are scoped to: nothing for a run of the sweep's rows; " (M=...)" for a run
    of other rows (a probe, a re-timing), whose notes then stand beside the full run's in a merge
    instead of replacing them."""
    rows = getattr(args, "rows", None)
    return "" if rows is None or sorted(rows) == sorted(DEFAULT_ROWS) else f" (M={_ranges(rows)})"


def _scoped(note: dict, scope: str) -> dict:
    """``note`` with ``scope`` after its subject; skip notes carry their Ms already."""
    if not scope or "skipped" in note:
        return note
    subject, colon, rest = note["text"].partition(":")
    return {**note, "text": f"{subject}{scope}{colon}{rest}"}


def _unscoped(note: dict) -> dict:
    """``note`` without the scope ``_scoped`` gave it."""
    subject, colon, rest = note["text"].partition(":")
    match = re.fullmatch(r"(.*) \(M=[0-9, -]+\)", subject)
    return note if match is None else {**note, "text": f"{match[1]}{colon}{rest}"}


def _is_time_budget(note: dict) -> bool:
    """Whether ``note`` is a run's note on what it had no time to measure (of any scope)."""
    return _note_key(_unscoped(note)) == (note["hidden"], time_budget_subject(note["hidden"]))


def skip_note(hidden: int, hc: int, variant: str, path: str, reason: str, ms: list[int]) -> dict:
    """A note for a path that could not run at these rows (``ms``; all of the sweep's: every M)."""
    where = "" if not ms else f" M={_ranges(ms)}"
    return {"hidden": hidden, "text": f"skipped {path} hc={hc} {variant} H={hidden}{where}: {reason}",
            "skipped": {"hc": hc, "variant": variant, "path": path, "m": _ranges(ms) if ms else "all",
                        "reason": reason}}


def _ranges(ms) -> str:
    """1, 2, 3, 4, 8, 16 -> "1-4, 8, 16": runs of consecutive integers joined."""
    groups: list[list[int]] = []
    for m in sorted(ms):
        if groups and m == groups[-1][1] + 1:
            groups[-1][1] = m
        else:
            groups.append([m, m])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in groups)


def _skipped_path(note: dict, field: str = "skipped") -> tuple | None:
    """(hidden, hc, variant, path) of a skip note (``field="kept"``: of a ``_kept_rows_note``), or None
    for another note."""
    of = note.get(field)
    return None if of is None else (note["hidden"], of["hc"], of["variant"], of["path"])


def _row_path(row: dict) -> tuple:
    """(hidden, hc, variant, path) of a row, as ``_skipped_path`` gives a skip note's."""
    return row["hidden"], row.get("hc", HC), row["variant"], row["path"]


def _skips_all_of(note: dict, paths: set) -> bool:
    """Whether ``note`` skips every M of one of ``paths`` ((hidden, hc, variant, path) each)."""
    return _skipped_path(note) in paths and note["skipped"]["m"] == "all"


def _kept_rows_note(note: dict, merged_name: str) -> dict:
    """A skip note of this run, where the rows of the merged table are kept for its path; it names
    the path (``kept``) so that a later run that measures it drops the note."""
    s = note["skipped"]
    return {"hidden": note["hidden"], "text": f"{s['path']} hc={s['hc']} {s['variant']} H={note['hidden']}: rows of "
                                              f"{merged_name} kept (not run here: {s['reason']})",
            "kept": {"hc": s["hc"], "variant": s["variant"], "path": s["path"]}}


def with_speedups(rows: list[dict]) -> list[dict]:
    """Every row's speedup against the unfused NCCL row of its shape (``speedup_vs_unfused``) and
    against the fastest alternative that does the whole op (``speedup_vs_best``: the unfused paths,
    and at hc = 1 FlashInfer's fused kernels), whichever run measured them."""
    unfused = {_shape(r): r["us_median"] for r in rows if r["path"] == "unfused-nccl"}
    best: dict[tuple, float] = {}
    for r in rows:
        if r["path"] in whole_op_alternatives(r["hc"]):
            best[_shape(r)] = min(best.get(_shape(r), math.inf), r["us_median"])
    for r in rows:
        base, alternative = unfused.get(_shape(r)), best.get(_shape(r))
        r["speedup_vs_unfused"] = None if base is None else base / r["us_median"]
        r["speedup_vs_best"] = None if alternative is None else alternative / r["us_median"]
    return rows


def best_alternative(group: list[dict]) -> dict | None:
    candidates = [r for r in group if r["path"] in whole_op_alternatives(r["hc"])]
    return min(candidates, key=lambda r: r["us_median"]) if candidates else None


def ceilings_subject(hidden: int, paths) -> str:
    """The subject of a run's ceilings note: a run of some paths only (``--paths``, say one merged
    from a process of its own) names them, so that it does not replace the main run's note, whose
    ceilings the other rows' floors came from."""
    return f"ceilings for H={hidden}" + (f" ({', '.join(paths)})" if paths else "")


def _ceilings_of_remeasured(note: dict, measured_paths: set) -> bool:
    """Whether ``note`` is the ceilings note of a run of some paths (``ceilings_subject``) that
    ``measured_paths`` ((hidden, hc, variant, path) each) all cover at its hidden size."""
    subject = _note_key(note)[1]
    prefix = f"{ceilings_subject(note['hidden'], None)} ("
    if not (subject.startswith(prefix) and subject.endswith(")")):
        return False
    measured = {path for hidden, _, _, path in measured_paths if hidden == note["hidden"]}
    return set(subject[len(prefix):-1].split(", ")) <= measured


def _ceiling_text(ceilings: Ceilings) -> str:
    peer = ("no peers (a group of one)" if ceilings.peer_gbps is None
            else f"peer {ceilings.peer_gbps:.0f} GB/s")
    return f"{peer}, device copy {ceilings.hbm_gbps:.0f} GB/s"


def _merged(rows: list[dict], notes: list[dict], merge, hiddens, scope: str) -> tuple[list[dict], list[dict]]:
    """This run's rows and notes (``scope``: ``rows_scope``) folded into the results at ``merge``: the
    earlier rows are kept but those measured again, and the earlier notes but those this run makes
    stale."""
    measured = {_row_key(r) for r in rows}
    measured_paths = {_row_path(r) for r in rows}
    kept = [r for r in read_rows(merge) if _row_key(r) not in measured]
    merged_name = Path(merge).name
    # A path this run could not run at all (tilekernels-tail where the main run cannot import it,
    # say) keeps the earlier run's rows: its skip is a note beside them, not a skip of the table.
    kept_paths = {_row_path(r) for r in kept} - measured_paths
    notes = [_kept_rows_note(n, merged_name) if _skips_all_of(n, kept_paths) else n for n in notes]
    # Where this run ran out of time, the earlier rows of the Ms it left stay: its note says so.
    measured_shapes = {(r["hidden"], r["m"]) for r in rows}
    left_with_rows = {r["hidden"] for r in kept if (r["hidden"], r["m"]) not in measured_shapes}
    notes = [{**n, "text": f"{n['text']} (rows of {merged_name} kept there)"}
             if _is_time_budget(n) and n["hidden"] in left_with_rows else n for n in notes]
    old_notes = notes_path(merge)
    if not old_notes.exists():
        print(f"--merge {merge}: no notes beside it ({old_notes.name}); the merged results keep only this "
              "run's notes", flush=True)
        return kept + list(rows), notes
    subjects = {_note_key(n) for n in notes} | {(h, time_budget_subject(h) + scope) for h in hiddens}

    def stale(note: dict) -> bool:
        # A note the new run gave again (with the same scope). And where the new run is of the
        # sweep's rows, a note of any scope whose subject it gave; what the earlier run left
        # unmeasured for lack of time, wherever this run measured that hidden size; an earlier skip of
        # a path wherever this run measured that path (at that hidden size and variant: a path timed
        # in a process of its own, say, which the main run could not import), or of every M of a path
        # whose rows are kept; an earlier run's note that it kept a path's rows, where this run
        # measured that path; the ceilings of an earlier run of some paths where this run measured
        # them all again.
        if _note_key(note) in subjects:
            return True
        note = _unscoped(note)
        return not scope and (_note_key(note) in subjects or _skipped_path(note) in measured_paths
                              or _skipped_path(note, "kept") in measured_paths or _skips_all_of(note, kept_paths)
                              or _ceilings_of_remeasured(note, measured_paths))

    return kept + list(rows), [n for n in json.loads(old_notes.read_text()) if not stale(n)] + notes


def _stored(value):
    return round(value, CSV_DIGITS) if isinstance(value, float) else value


def write_results(rows, notes, out: Path, gpu: str, tp: int, ceilings: Ceilings, args, merge=None) -> None:
    """CSV, notes sidecar, plots and summary; with ``merge``, the earlier run's rows and notes are kept
    except those this run measured again (same hc, hidden, variant, M and path; same note subject).
    The speedup columns are taken over the merged rows."""
    paths, scope = getattr(args, "paths", None), rows_scope(args)
    ceilings_notes = [{"hidden": h, "text": f"{ceilings_subject(h, paths)}: {_ceiling_text(ceilings)}"}
                      for h in args.hidden]
    notes = [_scoped(n, scope) for n in ceilings_notes + list(notes)]
    if merge:
        rows, notes = _merged(rows, notes, merge, args.hidden, scope)
    # At the CSV's precision before the speedups are taken, so that a merge, which reads them back,
    # derives the same speedups for the rows it keeps.
    rows = [{k: _stored(r.get(k, HC if k == "hc" else None)) for k in COLUMNS} for r in rows]
    rows = sorted(with_speedups(rows), key=lambda r: (r["hc"], r["hidden"], r["variant"], r["m"], r["path"]))
    notes = sorted(notes, key=lambda n: (n["hidden"] is not None, n["hidden"] or 0))  # stable within a size
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{gpu}_tp{tp}"
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.{CSV_DIGITS}f}" if isinstance(v, float) else ("" if v is None else v))
                             for k, v in r.items()})
    notes_path(out / f"{stem}.csv").write_text(json.dumps(notes, indent=1) + "\n")
    plots = write_plots(rows, out, stem)
    write_summary(rows, notes, out / f"{stem}.md", gpu, tp, ceilings, args, plots, merged=bool(merge))
    print(f"wrote {out / stem}.csv, .md, _notes.json and {len(plots)} plots", flush=True)


def plot_name(stem: str, hc: int, hidden: int, variant: str) -> str:
    return f"{stem}{'' if hc == HC else f'_hc{hc}'}_h{hidden}_{variant}.png"


def write_plots(rows: list[dict], out: Path, stem: str) -> list[str]:
    """Per (hc, hidden, variant): latency of every path over M, and the fused paths' speedup over the
    best alternative."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = []
    for hc, hidden, variant in sorted({(r["hc"], r["hidden"], r["variant"]) for r in rows}):
        fig, (latency, speedup) = plt.subplots(1, 2, figsize=(13, 4.8))
        subset = [r for r in rows if (r["hc"], r["hidden"], r["variant"]) == (hc, hidden, variant)]
        for path in sorted({r["path"] for r in subset}):
            points = sorted((r["m"], r["us_median"], r["speedup_vs_best"]) for r in subset if r["path"] == path)
            latency.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=path)
            if path == "auto" or path in BACKEND_PATHS:
                shown = [p for p in points if p[2] is not None]
                if shown:
                    speedup.plot([p[0] for p in shown], [p[2] for p in shown], marker="o", ms=3, label=path)
        latency.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="us per call (median, max over ranks)",
                    title=f"{stem} hc={hc} H={hidden} {variant}")
        speedup.axhline(1.0, color="gray", lw=0.8)
        speedup.set(xscale="log", xlabel="M (tokens)", ylabel="speedup over the best alternative",
                    title="fused paths vs the fastest whole-op alternative")
        for ax in (latency, speedup):
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        name = plot_name(stem, hc, hidden, variant)
        fig.savefig(out / name, dpi=120, bbox_inches="tight")
        plt.close(fig)
        names.append(name)
    return names


def _num(value, digits: int) -> str:
    return f"{math.nan if value is None else value:.{digits}f}"


def write_summary(rows, notes, path: Path, gpu: str, tp: int, ceilings: Ceilings, args, plots,
                  merged: bool = False) -> None:
    rows = [{**r, "hc": r.get("hc", HC)} for r in rows]
    source = ("of the latest run (each hidden size's own in the notes)" if merged
              else "measured in the same run")
    peer = ("no peer copy (a group of one)" if ceilings.peer_gbps is None
            else f"peer copy {ceilings.peer_gbps:.0f} GB/s")
    lines = [f"# {gpu}, tp={tp}", "",
             f"CUDA graphs of {args.calls} calls, median of {args.replays} replays, max over ranks; the paths "
             "of a row replayed in turns, each graph once a turn, after an untimed replay of its own (the "
             "unfused paths' torch tails in turns of their own). Ceilings "
             f"{source}: {peer}, device copy {ceilings.hbm_gbps:.0f} GB/s. Every call of a graph takes the "
             "same inputs: a call whose bytes fit in L2 finds part of them there (such rows can come out below "
             "their byte floor).", "",
             "Speedup columns: `speedup` is over `unfused-nccl` (NCCL, then the tail in compiled torch ops); "
             "`vs best` is over the fastest alternative that does the whole op: `unfused-best` (the fastest "
             "all-reduce of the run, then the strong Triton tail), the other unfused paths, "
             "`tilekernels-tail` (DeepSeek's tile-kernels for the tail) and, at hc = 1, FlashInfer's fused "
             "all-reduce + residual + RMSNorm kernels.", ""]
    for hc in sorted({r["hc"] for r in rows}):
        lines += _fused_table(rows, hc) + _tail_table(rows, hc)
    lines += ["Plots: " + (", ".join(plots) or "none (matplotlib missing)"), ""]
    skipped = [n for n in notes if "skipped" in n]
    if skipped:
        lines += ["## Skipped", "", "| hc | H | variant | path | M | reason |", "|---|---|---|---|---|---|"]
        lines += [f"| {s['hc']} | {n['hidden']} | {s['variant']} | {s['path']} | {s['m']} | {s['reason']} |"
                  for n in skipped for s in (n["skipped"],)]
        lines.append("")
    others = [n for n in notes if "skipped" not in n]
    if others:
        lines += ["## Notes", ""] + [f"- {n['text']}" for n in others]
    path.write_text("\n".join(lines) + "\n")


def _fused_table(rows, hc: int) -> list[str]:
    lines = [f"## hc = {hc}", "",
             "| H | variant | M | fastest fused | us | auto us | unfused-nccl us | speedup | x floor "
             "| best alternative | us | fastest vs best | auto vs best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    subset = [r for r in rows if r["hc"] == hc]
    for key in sorted({(r["hidden"], r["variant"], r["m"]) for r in subset}):
        group = [r for r in subset if (r["hidden"], r["variant"], r["m"]) == key]
        fused = [r for r in group if r["path"] in BACKEND_PATHS]
        if not fused:
            continue
        best = min(fused, key=lambda r: r["us_median"])
        base = next((r["us_median"] for r in group if r["path"] == "unfused-nccl"), math.nan)
        auto = next((r for r in group if r["path"] == "auto"), None)
        alternative = best_alternative(group)
        alt_us = math.nan if alternative is None else alternative["us_median"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {best['path']} | {best['us_median']:.1f} | "
                     f"{_num(auto and auto['us_median'], 1)} | {base:.1f} | {base / best['us_median']:.2f} | "
                     f"{_num(best['ratio_to_floor'], 2)} | {alternative['path'] if alternative else '-'} | "
                     f"{alt_us:.1f} | {alt_us / best['us_median']:.2f} | "
                     f"{_num(auto and alt_us / auto['us_median'], 2)} |")
    return lines + [""]


def _tail_table(rows, hc: int) -> list[str]:
    tails = sorted((r for r in rows if r["hc"] == hc and r["path"] == STRONG_TAIL and r["ratio_to_floor"]),
                   key=lambda r: (r["hidden"], r["variant"], r["m"]))
    if not tails:
        return []
    lines = [f"### Strong tail, hc = {hc}", "",
             "The unfused kernels alone on given inputs (finalize: the MoE finalize kernel, then the tail); "
             "floor: their bytes at the device-copy ceiling.", "",
             "| H | variant | M | us | floor us | of device copy |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['hidden']} | {r['variant']} | {r['m']} | {r['us_median']:.1f} | {r['floor_us']:.1f} | "
              f"{100 / r['ratio_to_floor']:.0f}% |" for r in tails]
    large = [r for r in tails if r["m"] >= TAIL_BAR_FROM_M]
    if large:
        worst = max(large, key=lambda r: r["ratio_to_floor"])
        verdict = "meets" if 1 / worst["ratio_to_floor"] >= TAIL_BAR else "MISSES"
        lines += ["", f"From M = {TAIL_BAR_FROM_M}: lowest {100 / worst['ratio_to_floor']:.1f}% of the device copy "
                      f"(H={worst['hidden']} {worst['variant']} M={worst['m']}): {verdict} the "
                      f"{TAIL_BAR:.0%} bar of a fair baseline."]
    return lines + [""]
