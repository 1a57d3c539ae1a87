"""The benchmark's byte floors and report writing (the timing itself needs GPUs)."""

import json
from types import SimpleNamespace

import pytest

from lamport_mhc.bench import (COLUMNS, DEFAULT_ROWS, Ceilings, floor_us, fused_bytes, parse_args, read_rows,
                               write_results, write_summary)


def test_ll_traffic_grows_with_tp_and_bt_caps_it():
    ll2, _ = fused_bytes("ll", "plain", 2, 1024, 5120)
    ll8, _ = fused_bytes("ll", "plain", 8, 1024, 5120)
    bt8, _ = fused_bytes("bt", "plain", 8, 1024, 5120)
    assert ll2 == 1024 * 5120 * 2 and ll8 == 7 * ll2
    assert bt8 < ll8 / 3
    _, hbm_plain = fused_bytes("ll", "plain", 2, 64, 5120)
    _, hbm_quant = fused_bytes("ll", "quant", 2, 64, 5120)
    _, hbm_finalize = fused_bytes("ll", "finalize", 2, 64, 5120)
    assert hbm_plain < hbm_quant and hbm_plain < hbm_finalize


def test_floor_is_the_slower_of_nvlink_and_hbm():
    nvlink, hbm = fused_bytes("ll", "plain", 2, 256, 4096)
    slow_link = Ceilings(peer_gbps=1.0, hbm_gbps=1e6)
    slow_hbm = Ceilings(peer_gbps=1e6, hbm_gbps=1.0)
    assert floor_us("ll", "plain", 2, 256, 4096, slow_link) == pytest.approx(nvlink / 1e3)
    assert floor_us("ll", "plain", 2, 256, 4096, slow_hbm) == pytest.approx(hbm / 1e3)


def test_summary_lists_the_fastest_fused_path(tmp_path):
    rows = [dict(tp=2, hc=4, hidden=5120, variant="plain", m=16, path=p, us_median=us, us_min=us, us_max=us,
                 floor_us=2.0, ratio_to_floor=us / 2.0, speedup_vs_unfused=None, speedup_vs_best=None)
            for p, us in (("triton-ll", 11.0), ("triton-bt", 14.0), ("unfused-nccl", 60.0), ("auto", 10.5))]
    path = tmp_path / "h200_tp2.md"
    write_summary(rows, [{"hidden": 5120, "text": "a note"}], path, "h200", 2, Ceilings(700.0, 4000.0), SimpleNamespace(calls=50, replays=5), [])
    text = path.read_text()
    assert "| 5120 | plain | 16 | triton-ll | 11.0 | 10.5 | 60.0 | 5.45 | 5.50 |" in text and "- a note" in text
    assert set(rows[0]) == set(COLUMNS)


def _run_rows(hidden, us, paths=("triton-ll", "unfused-nccl")):
    return [dict(tp=2, hidden=hidden, variant="plain", m=m, path=p, us_median=us, us_min=us - 0.5, us_max=us + 0.5,
                 floor_us=None if p == "unfused-nccl" else 2.0, ratio_to_floor=None if p == "unfused-nccl" else us / 2,
                 speedup_vs_unfused=1.5) for m in (16, 1) for p in paths]


def test_merge_replaces_only_what_the_new_run_measured(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    args = SimpleNamespace(calls=50, replays=5, hidden=[4096, 5120])
    notes = [{"hidden": 4096, "text": "old 4096 note"}, {"hidden": 5120, "text": "tail H=5120: old"},
             {"hidden": 5120, "text": "time budget H=5120: stopped before M=16; not measured: 16"}]
    write_results(_run_rows(4096, 10.0) + _run_rows(5120, 20.0), notes, first, "h200", 2, Ceilings(700.0, 4000.0),
                  args)
    assert json.loads((first / "h200_tp2_notes.json").read_text())[0] == {
        "hidden": 4096, "text": "ceilings for H=4096: peer 700 GB/s, device copy 4000 GB/s"}

    # The second run measures one more path at H=5120 and one path again.
    args = SimpleNamespace(calls=50, replays=5, hidden=[5120], merge=str(first / "h200_tp2.csv"))
    write_results(_run_rows(5120, 40.0, paths=("triton-bt", "triton-ll")), [{"hidden": 5120, "text": "tail H=5120: new"}],
                  second, "h200", 2, Ceilings(800.0, 4500.0), args, merge=args.merge)
    rows = read_rows(second / "h200_tp2.csv")
    assert [(r["hidden"], r["m"], r["path"]) for r in rows] == [
        (h, m, p) for h in (4096, 5120) for m in (1, 16)
        for p in (("triton-ll", "unfused-nccl") if h == 4096 else ("triton-bt", "triton-ll", "unfused-nccl"))]
    assert rows[0] == dict(tp=2, hc=4, hidden=4096, variant="plain", m=1, path="triton-ll", us_median=10.0, us_min=9.5,
                           us_max=10.5, floor_us=2.0, ratio_to_floor=5.0, speedup_vs_unfused=1.0, speedup_vs_best=1.0)
    assert rows[1]["floor_us"] is None and rows[1]["ratio_to_floor"] is None
    new = {r["path"]: r for r in rows if r["hidden"] == 5120 and r["m"] == 1}
    assert new["triton-ll"]["us_median"] == new["triton-bt"]["us_median"] == 40.0
    assert new["unfused-nccl"]["us_median"] == 20.0 and new["triton-bt"]["speedup_vs_unfused"] == 0.5

    texts = [(n["hidden"], n["text"]) for n in json.loads((second / "h200_tp2_notes.json").read_text())]
    assert texts == [(4096, "ceilings for H=4096: peer 700 GB/s, device copy 4000 GB/s"), (4096, "old 4096 note"),
                     (5120, "ceilings for H=5120: peer 800 GB/s, device copy 4500 GB/s"), (5120, "tail H=5120: new")]
    summary = (second / "h200_tp2.md").read_text()
    assert "Ceilings of the latest run" in summary and "peer copy 800 GB/s" in summary
    assert "| 4096 | plain | 16 | triton-ll | 10.0 | nan | 10.0 | 1.00 | 5.00 |" in summary
    assert "| 5120 | plain | 16 | triton-bt | 40.0 |" in summary and "- old 4096 note" in summary
    assert "tail H=5120: old" not in summary
    assert "time budget" not in summary  # the second run measured H=5120 again


def test_a_run_of_some_paths_keeps_the_main_runs_ceilings(tmp_path):
    """A path timed in a process of its own and merged (tilekernels-tail, say) adds its ceilings
    beside the main run's, whose ceilings the other rows' floors came from."""
    main, merged = tmp_path / "main", tmp_path / "merged"
    write_results(_run_rows(4096, 10.0), [], main, "h200", 2, Ceilings(700.0, 4000.0),
                  SimpleNamespace(calls=50, replays=5, hidden=[4096], paths=None))
    args = SimpleNamespace(calls=50, replays=5, hidden=[4096], paths=["tilekernels-tail"],
                           merge=str(main / "h200_tp2.csv"))
    write_results(_run_rows(4096, 30.0, paths=("tilekernels-tail",)), [], merged, "h200", 2, Ceilings(800.0, 4500.0),
                  args, merge=args.merge)
    texts = [n["text"] for n in json.loads((merged / "h200_tp2_notes.json").read_text())]
    assert texts == ["ceilings for H=4096: peer 700 GB/s, device copy 4000 GB/s",
                     "ceilings for H=4096 (tilekernels-tail): peer 800 GB/s, device copy 4500 GB/s"]


def test_a_main_run_drops_the_ceilings_of_the_runs_of_paths_it_measured_again(tmp_path):
    """A probe of one path (triton-ll) and a path timed alone (tilekernels-tail) are merged into a table,
    then the main run again over it: the probe's ceilings went with its rows, the other path's stay."""
    out, table = tmp_path / "0", None
    runs = [(None, _run_rows(4096, 10.0), 700.0), (["triton-ll"], _run_rows(4096, 9.0, paths=("triton-ll",)), 710.0),
            (["tilekernels-tail"], _run_rows(4096, 30.0, paths=("tilekernels-tail",)), 800.0),
            (None, _run_rows(4096, 11.0), 720.0)]
    for i, (paths, rows, peer) in enumerate(runs):
        out = tmp_path / str(i)
        args = SimpleNamespace(calls=50, replays=5, hidden=[4096], paths=paths, merge=table)
        write_results(rows, [], out, "h200", 2, Ceilings(peer, 4000.0), args, merge=table)
        table = str(out / "h200_tp2.csv")
        texts = [n["text"] for n in json.loads((out / "h200_tp2_notes.json").read_text())]
        if i == 1:
            assert "ceilings for H=4096 (triton-ll): peer 710 GB/s, device copy 4000 GB/s" in texts
    assert texts == ["ceilings for H=4096 (tilekernels-tail): peer 800 GB/s, device copy 4000 GB/s",
                     "ceilings for H=4096: peer 720 GB/s, device copy 4000 GB/s"]


def test_method_minimums_are_enforced():
    with pytest.raises(SystemExit):
        parse_args(["--calls", "10"])
    assert parse_args(["--hidden", "5120", "--rows", "1", "16"]).rows == [1, 16]
    assert parse_args([]).merge is None and parse_args(["--merge", "old.csv"]).merge == "old.csv"
    assert parse_args([]).paths is None and parse_args(["--paths", "auto", "cute-bt"]).paths == ["auto", "cute-bt"]
    with pytest.raises(SystemExit):
        parse_args(["--paths", "fastest"])


def test_crossover_and_routes_from_measurements(tmp_path):
    from lamport_mhc.presets import crossover, derive, routes, suggest

    def rows(variant, series):
        return [dict(tp=2, hidden=5120, variant=variant, m=m, path=p, us_median=us)
                for p, points in series.items() for m, us in points.items()]

    # BT wins once at 16, loses clearly at 32 (LL within 5% counts as level), then wins from 64 on.
    plain = rows("plain", {"triton-ll": {1: 10, 16: 12, 32: 14, 64: 30, 128: 60},
                           "triton-bt": {1: 14, 16: 11, 32: 15, 64: 20, 128: 30}})
    assert crossover(plain, 5120, "plain") == 64
    assert crossover(rows("finalize", {"triton-ll": {1: 10, 64: 20}, "triton-bt": {1: 12, 64: 25}}),
                     5120, "finalize") is None
    # cute is fastest up to 16, triton at 32 by far, cute again from 64 (at 128 by 0.3%).
    both = plain + rows("plain", {"cute-ll": {1: 5, 16: 6, 32: 20, 64: 10, 128: 29.9},
                                  "cute-bt": {1: 6, 16: 7, 32: 21, 64: 10.4, 128: 30.5}})
    route = routes(both, 5120, "plain")
    assert route == ((16, "cute"), (32, "triton"), (128, "cute"))
    assert crossover(both, 5120, "plain", route) == 64  # cute-bt within 5% of cute-ll from 64; triton-ll at 32
    # A route keeps its backend while it is within 2% of the fastest at tp = 1 (one protocol), 5% at
    # tp >= 2 (where the route also names the backend of the BT crossover).
    series = {"triton": {256: 10.0, 512: 20.0, 1024: 40.0, 2048: 79.0},
              "cute": {256: 10.5, 512: 19.7, 1024: 38.8, 2048: 80.0}}
    for tp, protocol, expected in ((1, "local", ((512, "triton"), (2048, "cute"))), (2, "ll", ((2048, "triton"),))):
        measured = [dict(row, tp=tp) for backend, points in series.items()
                    for row in rows("plain", {f"{backend}-{protocol}": points})]
        assert derive(measured, tp, 5120, "r.csv").routes == {"plain": expected}
    path = tmp_path / "r.csv"
    with open(path, "w", newline="") as f:
        import csv
        writer = csv.DictWriter(f, fieldnames=["tp", "hidden", "variant", "m", "path", "us_median"])
        writer.writeheader()
        writer.writerows(both)
    text = "\n".join(suggest(str(path), "hopper"))
    assert '("hopper", 2, 5120): Preset(' in text and "bt_min_rows=64, bt_min_finalize_rows=1073741824" in text
    assert '"plain": ((16, "cute"), (32, "triton"), (128, "cute"),)' in text



def test_local_floor_is_the_hbm_bytes_alone():
    """tp = 1: x (finalize: the held routes' GEMM2 rows, the shared row and the router's weights and
    indices), residual in and out, the layer input and the MXFP8 output, at the device-copy ceiling;
    no mailbox, nothing over NVLink."""
    m, hidden, row = 64, 5120, 5120 * 2
    assert fused_bytes("local", "plain", 1, m, hidden) == (0.0, m * row + 2 * m * 4 * row + m * row)
    router = m * 6 * 8
    assert fused_bytes("local", "finalize", 1, m, hidden, top_k=6)[1] == 7 * m * row + router + 8 * m * row + m * row
    assert (fused_bytes("local", "finalize", 1, m, hidden, top_k=6, held_routes=100)[1]
            == (100 + m) * row + router + 8 * m * row + m * row)
    assert fused_bytes("local", "quant", 1, m, hidden)[1] == 10 * m * row + m * hidden + m * hidden // 32
    assert fused_bytes("local", "plain", 1, m, hidden, hc=1)[1] == 4 * m * row
    _, ll_hbm = fused_bytes("ll", "plain", 2, m, hidden)
    assert ll_hbm > fused_bytes("local", "plain", 1, m, hidden)[1]  # the mailbox is what tp = 1 saves
    one_gpu = Ceilings(peer_gbps=None, hbm_gbps=4000.0)
    assert floor_us("local", "plain", 1, m, hidden, one_gpu) == pytest.approx(10 * m * row / 4e6)
    with pytest.raises(ValueError, match="tp = 1 protocol"):
        fused_bytes("local", "plain", 2, m, hidden)
    with pytest.raises(ValueError, match="protocol must be one of"):
        fused_bytes("gather", "plain", 2, m, hidden)


def test_strong_tail_bytes():
    from lamport_mhc.bench import tail_bytes
    from lamport_mhc.mxfp8 import mxfp8_scale_bytes

    m, hidden, row = 100, 4096, 8192
    assert tail_bytes("plain", m, hidden) == 10 * m * row
    assert tail_bytes("quant", m, hidden) == 10 * m * row + m * hidden + mxfp8_scale_bytes(m, hidden)
    # finalize: the MoE-finalize kernel (held GEMM2 rows, shared, router inputs, contribution) before the tail
    assert tail_bytes("finalize", m, hidden, held_routes=250, top_k=6) == 10 * m * row + 250 * row + 2 * m * row + m * 48


def _row(path, us, hc=4, m=16, variant="plain", hidden=5120, tp=2):
    return dict(tp=tp, hc=hc, hidden=hidden, variant=variant, m=m, path=path, us_median=us, us_min=us, us_max=us,
                floor_us=None, ratio_to_floor=None, speedup_vs_unfused=None, speedup_vs_best=None)


def test_speedup_against_the_best_alternative():
    from lamport_mhc.bench import with_speedups

    rows = [_row("triton-ll", 10.0), _row("unfused-nccl", 60.0), _row("unfused-best", 30.0),
            _row("unfused-one-shot", 45.0), _row("nccl_all_reduce", 5.0), _row("strong-tail", 4.0),
            _row("flashinfer-fusion-oneshot", 8.0),          # not the same op at hc = 4
            _row("triton-ll", 10.0, hc=1), _row("unfused-best", 30.0, hc=1), _row("flashinfer-fusion-oneshot", 20.0, hc=1),
            _row("flashinfer-fusion-twoshot", 25.0, hc=1), _row("triton-ll", 10.0, m=32)]
    by = {(r["hc"], r["m"], r["path"]): r for r in with_speedups(rows)}
    assert by[(4, 16, "triton-ll")]["speedup_vs_best"] == 3.0 and by[(4, 16, "triton-ll")]["speedup_vs_unfused"] == 6.0
    assert by[(4, 16, "unfused-best")]["speedup_vs_best"] == 1.0 and by[(4, 16, "unfused-nccl")]["speedup_vs_best"] == 0.5
    assert by[(1, 16, "triton-ll")]["speedup_vs_best"] == 2.0  # FlashInfer's fusion is the best alternative at hc = 1
    assert by[(1, 16, "triton-ll")]["speedup_vs_unfused"] is None
    assert by[(4, 32, "triton-ll")]["speedup_vs_best"] is None  # no alternative measured at that shape


def test_reports_show_the_best_alternative(tmp_path):
    rows = [_row("triton-local", 12.0, tp=1), _row("auto", 11.0, tp=1), _row("unfused-best", 24.0, tp=1),
            _row("strong-tail", 24.0, tp=1)]
    rows[0]["floor_us"], rows[0]["ratio_to_floor"] = 10.0, 1.2
    rows[3]["floor_us"], rows[3]["ratio_to_floor"] = 20.0, 1.2
    big = [dict(r, m=1024, us_median=r["us_median"] * 50) for r in rows]
    big[3]["floor_us"], big[3]["ratio_to_floor"] = 1000.0, 1.2  # the strong tail at 83% of the copy ceiling
    args = SimpleNamespace(calls=50, replays=5, hidden=[5120])
    write_results(rows + big, [], tmp_path, "h200", 1, Ceilings(None, 4000.0), args)
    written = read_rows(tmp_path / "h200_tp1.csv")
    assert {r["path"]: r["speedup_vs_best"] for r in written if r["m"] == 16} == {
        "auto": 2.182, "strong-tail": 1.0, "triton-local": 2.0, "unfused-best": 1.0}  # CSV: 3 decimals
    assert all(r["hc"] == 4 for r in written) and list(written[0]) == list(COLUMNS)
    summary = (tmp_path / "h200_tp1.md").read_text()
    assert "no peer copy (a group of one), device copy 4000 GB/s" in summary and "## hc = 4" in summary
    assert "| 5120 | plain | 16 | triton-local | 12.0 | 11.0 | nan | nan | 1.20 | unfused-best | 24.0 | 2.00 | 2.18 |" in summary
    assert "| 5120 | plain | 1024 | 1200.0 | 1000.0 | 83% |" in summary
    assert "From M = 1024: lowest 83.3% of the device copy (H=5120 plain M=1024): MISSES the 85% bar" in summary
    notes = json.loads((tmp_path / "h200_tp1_notes.json").read_text())
    assert notes[0]["text"] == "ceilings for H=5120: no peers (a group of one), device copy 4000 GB/s"


def test_old_csvs_without_hc_still_merge(tmp_path):
    import csv

    old = tmp_path / "h200_tp2.csv"
    with open(old, "w", newline="") as f:  # the columns of results written before hc and speedup_vs_best
        writer = csv.writer(f)
        writer.writerow(["tp", "hidden", "variant", "m", "path", "us_median", "us_min", "us_max", "floor_us",
                         "ratio_to_floor", "speedup_vs_unfused"])
        writer.writerow([2, 5120, "plain", 16, "cute-ll", "7.000", "6.5", "7.5", "1.0", "7.0", "3.0"])
        writer.writerow([2, 5120, "plain", 16, "unfused-nccl", "21.000", "20", "22", "", "", "1.0"])
    assert read_rows(old)[0]["hc"] == 4 and read_rows(old)[0]["speedup_vs_best"] is None
    args = SimpleNamespace(calls=50, replays=5, hidden=[5120])
    new = [_row("unfused-best", 14.0), _row("cute-ll", 6.0, hc=1)]
    write_results(new, [], tmp_path / "out", "h200", 2, Ceilings(700.0, 4000.0), args, merge=str(old))
    rows = {(r["hc"], r["path"]): r for r in read_rows(tmp_path / "out" / "h200_tp2.csv")}
    assert set(rows) == {(4, "cute-ll"), (4, "unfused-nccl"), (4, "unfused-best"), (1, "cute-ll")}
    assert rows[(4, "cute-ll")]["speedup_vs_best"] == 2.0 and rows[(4, "cute-ll")]["speedup_vs_unfused"] == 3.0
    summary = (tmp_path / "out" / "h200_tp2.md").read_text()
    assert "## hc = 1" in summary and "## hc = 4" in summary


def test_new_options():
    args = parse_args(["--hc", "1", "--paths", "strong-tail", "unfused-best", "two_shot_all_reduce",
                       "flashinfer_all_reduce", "vllm_custom_all_reduce", "flashinfer-fusion-oneshot",
                       "flashinfer-fusion-twoshot", "triton-local", "--flashinfer-cache", "/tmp/fi"])
    assert args.hc == 1 and len(args.paths) == 8 and args.flashinfer_cache == "/tmp/fi"
    assert parse_args([]).hc == 4
    with pytest.raises(SystemExit):
        parse_args(["--hc", "3"])


def test_a_merge_leaves_the_rows_it_keeps_as_they_were_written(tmp_path):
    """Speedups are taken from the medians as the CSV holds them, so a merge, which reads them back,
    derives the same ones: the kept rows' lines do not change in their last digit."""
    first, second = tmp_path / "first", tmp_path / "second"
    rows = [dict(tp=1, hidden=7168, variant="finalize", m=1, path=p, us_median=us, us_min=us, us_max=us, floor_us=0.072,
                 ratio_to_floor=us / 0.072) for p, us in (("auto", 2.5612), ("strong-tail", 4.4236),
                                                         ("unfused-nccl", 11.4784))]
    args = SimpleNamespace(calls=50, replays=9, hidden=[7168])
    write_results(rows, [], first, "h100", 1, Ceilings(None, 3000.0), args)
    args = SimpleNamespace(calls=50, replays=9, hidden=[5120], merge=str(first / "h100_tp1.csv"))
    write_results(_run_rows(5120, 20.0), [], second, "h100", 1, Ceilings(None, 3000.0), args, merge=args.merge)
    kept = [line for line in (second / "h100_tp1.csv").read_text().splitlines() if ",7168," in line]
    assert kept == (first / "h100_tp1.csv").read_text().splitlines()[1:]


def test_a_run_of_some_rows_merged_keeps_the_full_runs_notes_beside_its_own(tmp_path):
    """A re-timing of two Ms scopes its notes to them: the full run's notes of the same subject (the
    strong tail's forms over every M, its ceilings) stay beside them, and the next full run drops
    both."""
    full, retimed, again = tmp_path / "full", tmp_path / "retimed", tmp_path / "again"

    def forms(text):
        return [{"hidden": 5120, "text": f"strong tail form plain H=5120: {text}"}]

    full_args = SimpleNamespace(calls=50, replays=9, hidden=[5120], rows=DEFAULT_ROWS)
    write_results(_run_rows(5120, 20.0), forms("looped at M=1-8192"),
                  full, "h100", 1, Ceilings(None, 3000.0), full_args)
    args = SimpleNamespace(calls=50, replays=9, hidden=[5120], rows=[16, 1], merge=str(full / "h100_tp1.csv"))
    write_results(_run_rows(5120, 30.0), forms("held at M=1, 16"),
                  retimed, "h100", 1, Ceilings(None, 3100.0), args, merge=args.merge)
    texts = [n["text"] for n in json.loads((retimed / "h100_tp1_notes.json").read_text())]
    assert texts == ["ceilings for H=5120: no peers (a group of one), device copy 3000 GB/s",
                     "strong tail form plain H=5120: looped at M=1-8192",
                     "ceilings for H=5120 (M=1, 16): no peers (a group of one), device copy 3100 GB/s",
                     "strong tail form plain H=5120 (M=1, 16): held at M=1, 16"]
    # The same re-timing again replaces its own notes only.
    write_results(_run_rows(5120, 30.0), forms("held at M=1, 16"),
                  retimed, "h100", 1, Ceilings(None, 3100.0), args, merge=str(retimed / "h100_tp1.csv"))
    assert [n["text"] for n in json.loads((retimed / "h100_tp1_notes.json").read_text())] == texts

    full_args.merge = str(retimed / "h100_tp1.csv")
    write_results(_run_rows(5120, 25.0), forms("split at M=1-8192"),
                  again, "h100", 1, Ceilings(None, 3200.0), full_args, merge=full_args.merge)
    assert [n["text"] for n in json.loads((again / "h100_tp1_notes.json").read_text())] == [
        "ceilings for H=5120: no peers (a group of one), device copy 3200 GB/s",
        "strong tail form plain H=5120: split at M=1-8192"]


def test_a_run_out_of_time_says_that_the_earlier_rows_of_what_it_left_are_kept(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    args = SimpleNamespace(calls=50, replays=9, hidden=[4096, 5120])
    write_results(_run_rows(4096, 10.0) + _run_rows(5120, 20.0), [], first, "h200", 1, Ceilings(None, 4000.0), args)
    args = SimpleNamespace(calls=50, replays=9, hidden=[4096, 5120], merge=str(first / "h200_tp1.csv"))
    left = [{"hidden": h, "text": f"time budget H={h}: stopped before M=16; not measured: 16"} for h in (4096, 5120)]
    # Every M of H = 4096 measured again (nothing earlier stays there), only M = 1 of 5120.
    rows = _run_rows(4096, 12.0) + [r for r in _run_rows(5120, 22.0) if r["m"] == 1]
    write_results(rows, left, second, "h200", 1, Ceilings(None, 4000.0), args, merge=args.merge)
    texts = [n["text"] for n in json.loads((second / "h200_tp1_notes.json").read_text()) if "time budget" in n["text"]]
    assert texts == ["time budget H=4096: stopped before M=16; not measured: 16",
                     "time budget H=5120: stopped before M=16; not measured: 16 (rows of h200_tp1.csv kept there)"]
    assert {r["us_median"] for r in read_rows(second / "h200_tp1.csv") if r["hidden"] == 5120 and r["m"] == 16} == {20.0}
