"""Every command the README shows, typed as a user types it, on this machine's GPUs: each in a
process session of its own under a timeout, its peak resident memory bounded, and what it prints
checked (the demo's rows all identical, the soak's zero mismatches). ``README_COMMANDS`` lists them
with the README text each one runs; a CPU test (tests/test_readme_commands.py) keeps the two in step.

Then the production path on however many GPUs there are: ``torchrun --nproc-per-node N`` with
N = 2, 4 and 8, ranks that outnumber the GPUs sharing them as processes (``lamport_mhc.launch``):
demo, soak (graphs, skew) and model-ab per backend.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from .bodies import require_backend
from .commands import run_command
from .harness import MULTICAST_OFF_ENV, require_gpus

ROOT = Path(__file__).resolve().parents[2]
PYTHON = [sys.executable, "-m", "lamport_mhc"]
# A rank of the op imports torch, Triton and (cute) the CuTe DSL and FlashInfer: a few GiB. The demo
# that drew a call of 2^30 rows took 128 GiB before the kernel killed it.
RANK_RSS_BOUND = 8 << 30


def torchrun(n: int, *argv: str) -> list[str]:
    """``torchrun --nproc-per-node n -m lamport_mhc argv...``: the torchrun of this Python's torch."""
    script = Path(sys.executable).with_name("torchrun")
    return [str(script) if script.exists() else "torchrun", "--nproc-per-node", str(n), "-m", "lamport_mhc", *argv]


def _environment() -> dict:
    env = {**os.environ, **MULTICAST_OFF_ENV, "PYTHONUNBUFFERED": "1"}
    for name in ("LAMPORT_MHC_BACKEND", "LAMPORT_MHC_PRESETS"):  # as a new user has them: unset
        env.pop(name, None)
    return env


def _run(argv: list[str], timeout_s: float, ranks: int = 1):
    run = run_command(argv, timeout_s, env=_environment(), cwd=ROOT)
    print(run.describe())
    assert not run.timed_out, f"{run.describe()}\n{run.output[-4000:]}"
    assert run.returncode == 0, f"{run.describe()}\n{run.output[-4000:]}"
    assert run.peak_process_bytes < RANK_RSS_BOUND, run.describe()
    assert run.peak_tree_bytes < (ranks + 1) * RANK_RSS_BOUND, run.describe()
    return run


def _demo_rows(output: str) -> list[str]:
    rows = [line for line in output.splitlines() if re.match(r"(plain|finalize|quant|residual)\s+\d+ ", line)]
    assert rows, output[-4000:]
    return rows


def _all_identical(output: str) -> None:
    rows = _demo_rows(output)
    assert all(" identical " in row for row in rows), "\n".join(rows)
    assert {row.split()[0] for row in rows} == {"plain", "finalize", "quant", "residual"}, "\n".join(rows)


def _no_mismatch(output: str) -> None:
    summary = [line for line in output.splitlines() if line.startswith("soak ")]
    assert summary and " 0 mismatches, 0 timeouts" in summary[-1], output[-4000:]


def _ab_identical(output: str) -> None:
    rows = [line for line in output.splitlines() if re.match(r"rank \d+ ", line)]
    assert rows and all(line.endswith(": identical") for line in rows), output[-4000:]


def _printed(*needles):
    def check(output: str) -> None:
        missing = [n for n in needles if n not in output]
        assert not missing, f"missing {missing}:\n{output[-4000:]}"
    return check


SOAK = "python -m lamport_mhc soak --tp N --calls K [--graphs] [--backend B] [--hidden H] [--out CSV]"
# (the README's text, argv, timeout in seconds, check of the output). "OUT" stands for a folder of the test's own.
README_COMMANDS = [
    ("torchrun --nproc-per-node N -m lamport_mhc demo", torchrun(1, "demo"), 420, _all_identical),
    ("python -m lamport_mhc info", PYTHON + ["info"], 600, _printed("backends for tp=", "build cost")),
    ("python -m lamport_mhc info --tp N --hidden H --capacity C",
     PYTHON + ["info", "--tp", "4", "--hidden", "7168", "--capacity", "16384"], 600,
     _printed("mailbox memory per GPU: 174.9 MiB")),
    ("python -m lamport_mhc model-ab", torchrun(1, "model-ab", "--cuda-graph"), 420, _ab_identical),
    (SOAK, PYTHON + ["soak", "--tp", "2", "--calls", "300",
                                                                          "--graphs"], 420, _no_mismatch),
    (SOAK,
     torchrun(1, "soak", "--tp", "1", "--calls", "300", "--graphs"), 420, _no_mismatch),
    ("python -m lamport_mhc presets CSV", PYTHON + ["presets", "bench/results/h100-80gb-hbm3_tp1.csv"], 120,
     _printed('("hopper", 1, 4096): Preset(')),
    ("python -m lamport_mhc ptx --backend triton --arch sm_90a --tp 2 --hidden 5120 --hc 4 --top-k 6 --capacity 2048 "
     "--transport peer --out ptx/",
     PYTHON + ["ptx", "--backend", "triton", "--arch", "sm_90a", "--tp", "2", "--hidden", "5120", "--hc", "4",
               "--top-k", "6", "--capacity", "2048", "--transport", "peer", "--out", "OUT"], 300,
     _printed("kernels written to")),
    ("python -m lamport_mhc.bench.chunk_cost bench/results/h200_tp2.csv",
     [sys.executable, "-m", "lamport_mhc.bench.chunk_cost", "bench/results/h200_tp2.csv"], 120,
     _printed("| 2 | 4096 | plain | 4096 |")),
    ("torchrun --nproc-per-node N -m lamport_mhc bench",
     torchrun(1, "bench", "--hidden", "4096", "--rows", "1", "128", "--variants", "plain", "--out", "OUT"), 600,
     _printed("ceilings: ")),
]


@pytest.mark.parametrize("text,argv,timeout_s,check", README_COMMANDS, ids=[
    f"{i}-{' '.join(argv[argv.index('lamport_mhc') + 1:][:1] if 'lamport_mhc' in argv else argv[2:3])}"
    for i, (_, argv, _, _) in enumerate(README_COMMANDS)])
def test_readme_command(text, argv, timeout_s, check, tmp_path):
    require_gpus(1)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    run = _run(argv, timeout_s)
    check(run.output)


def test_the_demo_after_its_first_build_prints_its_table_within_a_minute():
    require_gpus(1)
    _run(torchrun(1, "demo"), 420)  # builds (or finds the kernels in Triton's cache)
    run = _run(torchrun(1, "demo"), 120)
    _all_identical(run.output)
    assert run.seconds < 60, run.describe()


# -- the production path: a process per rank, symmetric-memory rendezvous, peer tables -------------------------

GROUP_SIZES = (2, 4, 8)
GROUP_BACKENDS = ("triton", "cute")


@pytest.mark.parametrize("backend", GROUP_BACKENDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_demo_of_a_group(n, backend):
    require_gpus(1)
    require_backend(backend)
    run = _run(torchrun(n, "demo", "--backend", backend, "--capacity", "256"), 600, ranks=n)
    _all_identical(run.output)
    assert f"backend={backend} transport=peer" in run.output, run.output[-2000:]


@pytest.mark.parametrize("backend", GROUP_BACKENDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_soak_of_a_group(n, backend, tmp_path):
    require_gpus(1)
    require_backend(backend)
    out = tmp_path / "soak.csv"
    run = _run(torchrun(n, "soak", "--tp", str(n), "--calls", "400", "--graphs", "--backend", backend,
                        "--capacity", "256", "--out", str(out)), 600, ranks=n)
    _no_mismatch(run.output)
    assert out.read_text().splitlines()[1].split(",")[2:4] == [backend, str(n)]


@pytest.mark.parametrize("backend", GROUP_BACKENDS)
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_model_ab_of_a_group(n, backend):
    require_gpus(1)
    require_backend(backend)
    run = _run(torchrun(n, "model-ab", "--backends", "torch", backend, "--cuda-graph", "--tokens", "40"), 600,
               ranks=n)
    _ab_identical(run.output)
