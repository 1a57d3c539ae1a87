"""``python -m lamport_mhc {info,demo,ptx}`` as a user runs them (``ptx --sass`` too)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "lamport_mhc", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_info_lists_backends_and_reasons():
    result = _run("info")
    assert result.returncode == 0, result.stderr
    assert "triton  no: the Triton kernels need a CUDA device" in result.stdout
    assert "torch   yes" in result.stdout and "LL -> BT from" in result.stdout


def test_demo_runs_the_simulated_group_bit_exact():
    result = _run("demo", "--tp", "3", "--hidden", "128", "--capacity", "5", "--top-k", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.split()[:1] and line.split()[0] in
            ("plain", "finalize", "quant", "residual")]
    assert len(rows) == 16 and all("identical" in row for row in rows)
    assert {row.split()[2] for row in rows} == {"ll", "bt"}


def test_ptx_writes_one_named_file_per_kernel(tmp_path):
    result = _run("ptx", "--backend", "triton", "--arch", "sm_90a", "--tp", "2", "--hidden", "256", "--hc", "4",
                  "--top-k", "2", "--capacity", "16", "--transport", "multicast", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 17  # 4 publishes, owner reduce, 6 consumers, 6 one-kernel LL forms
    assert "triton_consumer_bt_quant_multicast_tp2_rank0_sm_90a.ptx" in names
    assert "triton_one_kernel_finalize_ll_quant_multicast_tp2_rank0_sm_90a.ptx" in names
    assert "triton_owner_reduce_bt_multicast_tp2_rank0_sm_90a.ptx" in names
    assert "multimem.st" in (tmp_path / "triton_publish_ll_multicast_tp2_rank0_sm_90a.ptx").read_text()


def test_ptx_sass_summarizes_what_each_kernel_runs(tmp_path):
    """With --sass every kernel is also assembled and disassembled: a .sass beside its .ptx, and a line
    with its registers, stack bytes, instructions and loop bodies; with --strong the benchmark's strong
    tail too, every form, plain and quant. H = 2048: the parked local consumer walks its two chunks of
    1024 in one loop; it and the strong tail's looped form (one piece of 2048, no loop) take 64
    registers at most and spill nothing."""
    result = _run("ptx", "--backend", "triton", "--tp", "1", "--hidden", "2048", "--hc", "4", "--top-k", "2",
                  "--capacity", "16", "--transport", "peer", "--out", str(tmp_path), "--sass", "--strong")
    assert result.returncode == 0, result.stderr
    lines = {Path(line.split(":")[0]).stem: line for line in result.stdout.splitlines()}
    assert {p.stem for p in tmp_path.glob("*.sass")} == {p.stem for p in tmp_path.glob("*.ptx")} == set(lines)
    from lamport_mhc.bench.strong_tail import STRATEGIES

    strong = {stem for stem in lines if stem.startswith("strong_")}
    assert len(strong) == 2 * (len(STRATEGIES) + sum(s.startswith("split") for s in STRATEGIES))  # split: mix + norm
    for stem, loops in (("triton_local_plain_peer_tp1_rank0_sm_90a", r"\[(\d+)\]"),
                        ("strong_looped_streamed_quant_sm_90a", r"\[\]()")):
        found = re.search(r": (\d+) registers, (\d+) stack bytes, (\d+) instructions, loop bodies " + loops + "$",
                          lines[stem])
        assert found, lines[stem]
        registers, stack, instructions = map(int, found.groups()[:3])
        assert registers <= 64 and stack == 0 and instructions > 400, stem
        assert not found.group(4) or 200 < int(found.group(4)) < instructions, stem
        assert "FFMA" in (tmp_path / f"{stem}.sass").read_text()


def test_loop_bodies_run_from_a_label_to_the_branch_back():
    from lamport_mhc.bench.sass import count_instructions

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   FADD R2, R2, R3 ;
        /*0020*/                   NOP ;
        /*0030*/              @P0 BRA `(.L_x_0) ;
        /*0040*/              @P1 BRA `(.L_x_1) ;
        /*0050*/                   EXIT ;
.L_x_1:
        /*0060*/                   BRA `(.L_x_1);
"""
    assert count_instructions(sass) == (6, (2,))  # the trailing self-branch is no loop body


# The CuTe toolchain: the DSL compiler and FlashInfer (the quant consumer calls its MXFP8 helpers).
CUTE_DSL = all(importlib.util.find_spec(name) is not None for name in ("cutlass", "flashinfer"))


def _cute_ptx(tmp_path):
    return _run("ptx", "--backend", "cute", "--tp", "2", "--hidden", "256", "--hc", "4", "--top-k", "2",
                "--capacity", "16", "--transport", "peer", "--out", str(tmp_path))


@pytest.mark.skipif(CUTE_DSL, reason="nvidia-cutlass-dsl and flashinfer-python are installed")
def test_ptx_for_a_missing_backend_says_why(tmp_path):
    result = _cute_ptx(tmp_path)
    assert result.returncode == 2 and "cannot compile the cute backend" in result.stderr


@pytest.mark.skipif(not CUTE_DSL, reason="needs nvidia-cutlass-dsl and flashinfer-python "
                                          "(pip install 'lamport-mhc[cute-compile]')")
def test_ptx_of_the_cute_backend(tmp_path):
    result = _cute_ptx(tmp_path)
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    for kernel in ("publish_ll", "finalize_publish_bt", "owner_reduce_bt"):
        assert f"cute_{kernel}_peer_tp2_rank0_sm_90a.ptx" in names
    assert ".target sm_90a" in (tmp_path / "cute_publish_ll_peer_tp2_rank0_sm_90a.ptx").read_text()
