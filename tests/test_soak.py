"""The soak command on a CPU (the simulated group), and the pieces the one-GPU soak relies on that
run without a GPU: its call draws, the scale prefix its checks assume, its device-side checker
(under the interpreter), the residency arithmetic and the host-stall watcher."""

import csv
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lamport_mhc.__main__ import main
from lamport_mhc.concurrent import RESIDENT_SHARE, ConcurrentGroup, EmulationError, Residency, waits_for_peers
from lamport_mhc.mxfp8 import mxfp8_quantize_reference, mxfp8_scale_bytes
from lamport_mhc.soak import CSV_COLUMNS, HostGaps
from lamport_mhc.soak_calls import POOLS, VARIANTS, draw_calls, scale_rows


def test_soak_on_a_cpu_runs_every_variant_through_the_simulated_group(tmp_path, capsys):
    out = tmp_path / "soak.csv"
    assert main(["soak", "--tp", "3", "--hidden", "256", "--calls", "30", "--out", str(out)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("soak simulated triton tp=3 H=256 M<=12: 30 calls (0 from graph replays), ")
    assert summary.count(" 0 mismatches, 0 timeouts") == 1
    compared = int(summary.split("), ")[1].split(" outputs")[0])
    assert compared >= 30 * 3 * 2  # every rank's streams and at least one more output a call
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert [(r["where"], r["backend"], r["tp"], r["hidden"], r["calls"], r["mismatches"], r["timeouts"])
            for r in rows] == [("simulated", "triton", "3", "256", "30", "0", "0")]


@pytest.mark.parametrize("args", [["--graphs"], ["--backend", "cute"], ["--backend", "mixed"], ["--backend", "torch"]])
def test_soak_on_a_cpu_refuses_what_needs_a_gpu(args, capsys):
    assert main(["soak", "--tp", "2", "--hidden", "256", "--calls", "1", *args]) == 2
    assert "GPU" in capsys.readouterr().err


def test_draws_vary_and_never_read_one_of_the_three_pools_before():
    draws = draw_calls(random.Random(5), 2000, 96, 1408)
    for before, draw in zip(range(len(draws)), draws[3:]):
        assert draw.pool not in {d.pool for d in draws[before:before + 3]}
    assert {d.variant for d in draws} == set(VARIANTS)
    assert {d.pool for d in draws} == set(range(POOLS))
    assert min(d.m for d in draws) == 1 and max(d.m for d in draws) == 96
    assert {d.variant for d in draw_calls(random.Random(5), 500, 8, 264)} == {"plain", "finalize", "residual"}


@pytest.mark.parametrize("m", [1, 31, 127, 128, 129, 200])
def test_the_scales_of_m_rows_are_the_capacity_scales_zeroed_past_row_m(m):
    """The one-GPU checker compares a call's scales with the reference's at capacity rows, zero
    where a byte belongs to row M or past: the swizzled layout of M rows must be that prefix."""
    capacity, hidden = 200, 256
    generator = torch.Generator().manual_seed(m)
    layer = (torch.randn((capacity, hidden), generator=generator) * 4).to(torch.bfloat16)
    full = mxfp8_quantize_reference(layer)[1]
    size = mxfp8_scale_bytes(m, hidden)
    rows = scale_rows(capacity, hidden, "cpu")
    expected = torch.where(rows[:size] < m, full[:size], torch.zeros_like(full[:size]))
    assert torch.equal(mxfp8_quantize_reference(layer[:m])[1], expected)


def _interpreted_check(out, ref, row_of, m, counts, first, call_id):
    from lamport_mhc.check_kernel import BLOCK, POISON, _check_and_poison
    from kernels_triton.interpret import launch_interpreted

    dtype = torch.uint8 if row_of is not None else torch.int32
    words, ref_words = out.view(-1).view(dtype), ref.view(-1).view(dtype)
    launch_interpreted(_check_and_poison, (-(-words.numel() // BLOCK),), words, ref_words,
                       words if row_of is None else row_of, words.numel(), m, counts, first, call_id,
                       POISON_VALUE=POISON[dtype], BY_ROW=row_of is not None, BLOCK=BLOCK)


def test_the_device_checker_counts_wrong_words_keeps_the_first_call_and_poisons():
    ref = torch.randn(3000).to(torch.bfloat16)
    counts, first = torch.zeros(1, dtype=torch.int64), torch.full((1,), 1 << 62, dtype=torch.int64)
    out = ref.clone()
    _interpreted_check(out, ref, None, 1, counts, first, 7)
    assert counts.item() == 0 and first.item() == 1 << 62
    assert bool((out.view(torch.uint8) == 0xA5).all())  # poisoned for the next call
    out = ref.clone()
    out.view(torch.int16)[[4, 5, 2999]] ^= 1  # one bit in three values, two of one word
    _interpreted_check(out, ref, None, 1, counts, first, 9)
    _interpreted_check(ref.clone(), ref, None, 1, counts, first, 3)
    assert counts.item() == 2 and first.item() == 9
    # Scales: bytes of rows past M must be zero, whatever the reference held there.
    scales = torch.randint(1, 255, (2048,), dtype=torch.uint8)
    rows = scale_rows(200, 256, "cpu")
    out = torch.where(rows < 100, scales, torch.zeros_like(scales))
    counts.zero_()
    _interpreted_check(out, scales, rows, 100, counts, first, 11)
    assert counts.item() == 0
    out = scales.clone()  # rows 100..199 not zeroed
    _interpreted_check(out, scales, rows, 100, counts, first, 12)
    assert counts.item() == int((rows >= 100).sum())


def test_residency_keeps_the_worst_waiting_share_and_refuses_past_it():
    resident = {"consumer_ll_plain": 264, "owner_reduce_bt": 528, "publish_bt": 132}
    residency = Residency(132, lambda backend, name: resident[name])
    residency.settle([("triton", "publish_bt", 500), ("triton", "owner_reduce_bt", 132)])
    assert residency.worst == pytest.approx(0.25)  # a publish waits for no one
    residency.settle([("cute", "consumer_ll_plain", 66)])
    assert residency.worst == pytest.approx(0.25)
    group = SimpleNamespace(tp=3, sms=132, residency=residency)
    ConcurrentGroup.check_residency(group)  # 0.75 of the GPU: just fits
    group.tp = 4
    with pytest.raises(EmulationError, match="owner_reduce_bt: 132 programs, 528 resident"):
        ConcurrentGroup.check_residency(group)
    assert 4 * 0.25 > RESIDENT_SHARE >= 3 * 0.25


@pytest.mark.parametrize("backend", ["triton", "cute"])
@pytest.mark.parametrize("tp", [2, 8])
def test_the_residency_check_counts_every_form_of_every_polling_kernel(backend, tp):
    """Every kernel of a TP build but its publishes waits for other ranks, whatever its form's
    name adds (CuTe's streaming consumers once went uncounted: at tp 8, H >= 2560 their one CTA
    per SM let 8 ranks' LL calls of 36 rows ask for 288 resident CTAs of 132, and ranks stalled
    in a build the check had passed)."""
    from lamport_mhc.backend import BuildSpec

    if backend == "cute":
        pytest.importorskip("cutlass")
        from kernels_cute.plan import kernel_plan
    else:
        from kernels_triton.plan import kernel_plan
    spec = BuildSpec(hidden=5120, hc=4, capacity=48, top_k=6, tp=tp, rank=0, quantize=True, residual_only=True,
                     bt=True, ll_one_kernel_rows=8, ll_rows=42, bt_rows=48)
    plan = kernel_plan(spec) if backend == "cute" else kernel_plan(spec, on_gpu=False)
    publishes = {name for name in plan if name.startswith(("publish_", "finalize_publish_"))}
    assert publishes == {"publish_ll", "publish_bt", "finalize_publish_ll", "finalize_publish_bt"}
    assert {name for name in plan if not waits_for_peers(name)} == publishes
    assert any(name.startswith("streaming_") for name in plan) == (backend == "cute")


def test_an_emulated_group_runs_both_protocols_and_fits_its_rows_to_the_residency_check():
    from lamport_mhc.soak import FIT_MARGIN, emulated_thresholds, fitted_capacity

    assert emulated_thresholds((37, 43), 48) == (24, 24)   # BT reached within the emulated rows
    assert emulated_thresholds((37, 43), 96) == (37, 43)   # the preset's where they are reached
    assert emulated_thresholds((128, 128), 3) == (2, 2)
    # CuTe tp 8, H 5120: all ranks' LL calls took 2.5 of the GPU at 48 rows.
    fitted = fitted_capacity(48, 2.5, RESIDENT_SHARE)
    assert fitted == int(48 * RESIDENT_SHARE * FIT_MARGIN / 2.5) and fitted * 2.5 / 48 <= RESIDENT_SHARE
    assert fitted_capacity(48, 0.76, RESIDENT_SHARE) == 42  # never the same capacity again
    assert fitted_capacity(48, 0.7501, 0.75) < 48


def _torchrun_body(rank, world):
    from lamport_mhc.soak import soak_gpus

    result = soak_gpus(12, "torch", 256, graphs=False, seed=4, capacity=16)
    return result.where, result.calls, result.outputs_compared, result.mismatches, result.timeouts


def test_soak_under_torchrun_runs_the_real_group_on_cpu_ranks():
    """What ``torchrun -m lamport_mhc soak`` runs, on two gloo processes (the torch backend): every
    rank's outputs checked, the counts summed over the ranks."""
    from gpu.harness import run_ranks

    for where, calls, compared, mismatches, timeouts in run_ranks(_torchrun_body, 2, backend="gloo", timeout_s=300):
        assert (where, calls, mismatches, timeouts) == ("processes", 12, 0, 0)
        assert compared >= 2 * 12 * 2


def test_protocol_order_cannot_see_polls_that_do_not_wait():
    """The first half of the negative control: with LAMPORT_MHC_DEBUG_NO_WAIT=1 the simulated group
    (protocol order: every slot written before it is polled) still passes; only ranks that run at
    once fail it (tests/gpu/test_concurrent_group.py)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LAMPORT_MHC_DEBUG_NO_WAIT": "1"}
    run = subprocess.run([sys.executable, "-m", "lamport_mhc", "soak", "--tp", "2", "--hidden", "256", "--calls", "6"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 mismatches, 0 timeouts" in run.stdout


def test_a_host_stall_is_reported_with_where_the_issuing_thread_was():
    """The one-GPU soak's watcher: a pause of the issuing thread longer than STALL_MS is reported
    with that thread's stack (here: a sleep), and every tick also runs the timeout check."""
    ticks = []
    gaps = HostGaps(on_tick=lambda: ticks.append(1))
    gaps.issued(0, 0)
    time.sleep(3 * HostGaps.STALL_MS / 1000)
    gaps.issued(1, 0)
    gaps.stop()
    text = gaps.describe()
    assert "before rank 1's call 0" in text
    assert "time.sleep(3 * HostGaps.STALL_MS / 1000)" in text, text
    assert len(gaps.stalls) == 1 and ticks


def test_soaks_of_one_gpu_take_turns(tmp_path):
    """--gpu-lock: a second soak's run waits until the first has released the GPU."""
    from lamport_mhc.soak import GpuTurn

    first, second = GpuTurn(tmp_path / "gpu.lock"), GpuTurn(tmp_path / "gpu.lock")
    first.acquire()
    entered = threading.Event()
    waiter = threading.Thread(target=lambda: (second.acquire(), entered.set()))
    waiter.start()
    assert not entered.wait(0.3)
    first.release()
    assert entered.wait(5)
    waiter.join()
    second.release()
