"""The benchmark's byte floors and report writing (the timing itself needs GPUs)."""

from types import SimpleNamespace

import pytest

from lamport_mhc.bench import COLUMNS, Ceilings, floor_us, fused_bytes, parse_args, write_summary


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
    rows = [dict(tp=2, hidden=5120, variant="plain", m=16, path=p, us_median=us, us_min=us, us_max=us,
                 floor_us=2.0, ratio_to_floor=us / 2.0, speedup_vs_unfused=None)
            for p, us in (("triton-ll", 11.0), ("triton-bt", 14.0), ("unfused-nccl", 60.0), ("auto", 10.5))]
    path = tmp_path / "h200_tp2.md"
    write_summary(rows, ["a note"], path, "h200", 2, Ceilings(700.0, 4000.0), SimpleNamespace(calls=50, replays=5), [])
    text = path.read_text()
    assert "| 5120 | plain | 16 | triton-ll | 11.0 | 60.0 | 5.45 | 5.50 |" in text and "- a note" in text
    assert set(rows[0]) == set(COLUMNS)


def test_method_minimums_are_enforced():
    with pytest.raises(SystemExit):
        parse_args(["--calls", "10"])
    assert parse_args(["--hidden", "5120", "--rows", "1", "16"]).rows == [1, 16]


def test_crossover_is_where_bt_stays_ahead(tmp_path):
    from lamport_mhc.presets import crossover, suggest

    def rows(variant, ll, bt):
        return [dict(tp=2, hidden=5120, variant=variant, m=m, path=p, us_median=us)
                for p, series in (("triton-ll", ll), ("triton-bt", bt)) for m, us in series.items()]

    # BT wins once at 16 by noise, loses at 32, then wins from 64 on: the threshold is 64.
    data = rows("plain", {1: 10, 16: 12, 32: 14, 64: 30, 128: 60}, {1: 14, 16: 11, 32: 15, 64: 20, 128: 30})
    assert crossover(data, 5120, "plain") == 64
    assert crossover(rows("finalize", {1: 10, 64: 20}, {1: 12, 64: 25}), 5120, "finalize") is None
    path = tmp_path / "r.csv"
    with open(path, "w", newline="") as f:
        import csv
        writer = csv.DictWriter(f, fieldnames=["tp", "hidden", "variant", "m", "path", "us_median"])
        writer.writeheader()
        writer.writerows(data)
    (line,) = suggest(str(path), "hopper")
    assert '("hopper", 2, 5120): Preset(bt_min_rows=64, bt_min_finalize_rows=1073741824' in line
