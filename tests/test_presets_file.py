"""Presets derived where the benchmark ran: tp = 1 rows (``<backend>-local``), the presets file
written, read back and looked up (its rows override the built-in table), and ``auto``'s lookup and
``info`` using it."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lamport_mhc import presets

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _no_user_presets(monkeypatch, tmp_path):
    """Tests never see the presets of the machine they run on."""
    monkeypatch.delenv(presets.PRESETS_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _write_csv(path, series, tp=1, hidden=5120, hc=None):
    columns = ["tp", "hidden", "variant", "m", "path", "us_median"] + (["hc"] if hc is not None else [])
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for (variant, path_name), points in series.items():
            for m, us in points.items():
                row = dict(tp=tp, hidden=hidden, variant=variant, m=m, path=path_name, us_median=us)
                if hc is not None:
                    row["hc"] = hc
                writer.writerow(row)
    return path


TP1 = {("plain", "triton-local"): {1: 9.0, 64: 12.0, 4096: 330.0},
       ("plain", "cute-local"): {1: 3.6, 64: 6.0, 4096: 210.0},
       ("plain", "strong-tail"): {1: 5.0, 64: 7.0, 4096: 114.0},
       ("quant", "triton-local"): {1: 5.0, 64: 8.0, 4096: 300.0},
       ("quant", "cute-local"): {1: 6.0, 64: 9.0, 4096: 250.0}}


def test_one_gpu_rows_route_by_backend_and_never_take_bt(tmp_path):
    rows = list(csv.DictReader(open(_write_csv(tmp_path / "h200_tp1.csv", TP1))))
    preset = presets.derive(rows, 1, 5120, "h200_tp1.csv")
    assert preset.routes == {"plain": ((4096, "cute"),), "quant": ((64, "triton"), (4096, "cute"))}
    assert preset.bt_min_rows == preset.bt_min_finalize_rows == presets.NEVER
    assert preset.backends == ("cute", "triton")
    # Rows of another hc are not this model's: an hc = 1 CSV derives nothing at hc = 4.
    other = list(csv.DictReader(open(_write_csv(tmp_path / "hc1.csv", TP1, hc=1))))
    assert presets.derive(other, 1, 5120, "x").routes == {}
    assert presets.derive(other, 1, 5120, "x", hc=1).routes == preset.routes


def test_presets_file_round_trip_and_override(tmp_path, monkeypatch):
    csv_path = _write_csv(tmp_path / "h200_tp1.csv", TP1)
    derived = presets.derive_all(csv_path, "hopper", source=str(csv_path))
    assert list(derived) == [("hopper", 1, 5120)]
    file = tmp_path / "presets.json"
    presets.write_file(file, derived)
    built_in = presets.PRESETS[("hopper", 2, 5120)]
    mine = presets.Preset(3, 5, ("triton", "cute"), "mine.csv", routes={"plain": ((8192, "triton"),)})
    held = presets.write_file(file, {("hopper", 2, 5120): mine})  # added beside the row already there
    assert set(held) == {("hopper", 1, 5120), ("hopper", 2, 5120)}
    assert presets.read_file(file) == held and held[("hopper", 1, 5120)] == derived[("hopper", 1, 5120)]

    assert presets.lookup("hopper", 2, 5120) == built_in          # no file in force yet
    monkeypatch.setenv(presets.PRESETS_ENV, str(file))
    assert presets.lookup("hopper", 2, 5120) == mine             # the file's row wins over the table's
    assert presets.lookup("hopper", 2, 4096) == presets.PRESETS[("hopper", 2, 4096)]
    assert presets.lookup("hopper", 1, 4096) == presets.PRESETS[("hopper", 1, 4096)]  # a key the file lacks
    assert presets.lookup("hopper", 4, 4096) == presets.FALLBACK
    preset, where = presets.resolve("hopper", 1, 5120)
    assert preset.source == str(csv_path) and where == f"file {file} ({presets.PRESETS_ENV})"
    assert presets.resolve("hopper", 2, 4096)[1] == "built-in table"

    monkeypatch.delenv(presets.PRESETS_ENV)
    default = presets.default_file()
    assert default == tmp_path / "cache" / "lamport_mhc" / "presets.json"
    presets.write_file(default, {("hopper", 2, 5120): mine})
    assert presets.resolve("hopper", 2, 5120) == (mine, f"file {default} (the default location)")
    assert presets.lookup("hopper", 2, 5120, path=file) == mine and presets.lookup("hopper", 1, 5120, file).routes

    with pytest.raises(ValueError, match="does not exist"):
        presets.lookup("hopper", 2, 5120, path=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="cannot be read"):
        presets.lookup("hopper", 2, 5120, path=tmp_path / "bad.json")


def test_a_gpu_takes_its_models_rows_before_its_familys(tmp_path):
    """An H100 is looked up as ("h100", "hopper"): the rows measured on it where there are some (tp = 1),
    else the family's (tp = 2, measured on an H200); a presets file's row for either key wins over both."""
    h100 = presets.gpu_keys((9, 0), "NVIDIA H100 80GB HBM3")
    assert h100 == ("h100", "hopper") and presets.gpu_keys((9, 0), "NVIDIA H200") == ("h200", "hopper")
    assert presets.gpu_keys((9, 0), "NVIDIA GH200 480GB")[0] == "gh200" and presets.gpu_keys(None) == ("cpu",)
    assert presets.gpu_keys((10, 0), "NVIDIA H100") == ("blackwell",)  # a name that is not of its family
    assert presets.resolve(h100, 1, 5120) == (presets.PRESETS[("h100", 1, 5120)], "built-in table, h100")
    assert presets.PRESETS[("h100", 1, 5120)] != presets.PRESETS[("hopper", 1, 5120)]
    assert presets.resolve(h100, 2, 5120) == (presets.PRESETS[("hopper", 2, 5120)], "built-in table, hopper")
    assert presets.lookup(("h200", "hopper"), 1, 5120) == presets.lookup("hopper", 1, 5120)
    mine = presets.Preset(3, 5, ("cute", "triton"), "mine.csv", routes={"plain": ((8192, "cute"),)})
    file = tmp_path / "presets.json"
    presets.write_file(file, {("hopper", 1, 5120): mine})
    assert presets.resolve(h100, 1, 5120, file) == (mine, f"file {file} (AllReduceMHCConfig.presets_file), hopper")
    assert "preset for h100/hopper tp=1 H=4096: built-in table, h100" in presets.describe(h100, 1, 4096)


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "lamport_mhc", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_presets_command_writes_a_file_that_info_reports(tmp_path):
    csv_path = _write_csv(tmp_path / "h200_tp1.csv", TP1)
    target = tmp_path / "mine.json"
    result = _cli("presets", str(csv_path), "--write", str(target))
    assert result.returncode == 0, result.stderr
    assert "wrote hopper tp=1 H=5120" in result.stdout and target.is_file()
    assert presets.read_file(target)[("hopper", 1, 5120)].source == str(csv_path.resolve())
    printed = "\n".join(presets.suggest(str(csv_path), "hopper"))
    assert '("hopper", 1, 5120): Preset(' in printed and "bt_min_rows=1073741824" in printed
    # The default location, written without a path, is what auto reads with nothing set.
    assert _cli("presets", str(csv_path), "--write", env={"XDG_CACHE_HOME": str(tmp_path / "c")}).returncode == 0
    assert (tmp_path / "c" / "lamport_mhc" / "presets.json").is_file()
    assert presets.family_of_csv(csv_path) == "hopper" and presets.family_of_csv("results.csv") is None
    info = _cli("info", env={presets.PRESETS_ENV: str(target), "XDG_CACHE_HOME": str(tmp_path / "none")})
    assert info.returncode == 0, info.stderr
    assert f"presets: file {target} ({presets.PRESETS_ENV}) with rows hopper tp=1 H=5120" in info.stdout
    assert "preset for cpu tp=2 H=5120: fallback" in info.stdout


def _auto_body(rank, tp, file):
    from lamport_mhc import AllReduceMHC, AllReduceMHCConfig

    from_config = AllReduceMHC(256, 4, 8, 2, "cpu", config=AllReduceMHCConfig(presets_file=file)).preset
    os.environ[presets.PRESETS_ENV] = file
    from_env = AllReduceMHC(256, 4, 8, 2, "cpu").preset
    return from_config, from_env


def test_auto_looks_its_preset_up_in_the_file(tmp_path):
    from gpu.harness import run_ranks

    mine = presets.Preset(9, 11, ("cute", "triton"), "here.csv", routes={"plain": ((64, "cute"), (8192, "triton"))})
    file = tmp_path / "presets.json"
    presets.write_file(file, {("cpu", 1, 256): mine})  # a CPU process is family "cpu"
    (from_config, from_env), = run_ranks(_auto_body, 1, args=(str(file),), backend="gloo", timeout_s=120)
    assert from_config == from_env == mine
