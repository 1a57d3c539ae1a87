"""Ranks that run at once on one GPU (``ConcurrentGroup``: the ranks as streams of one process):
every backend, protocol, consumer form and variant at tp 2, 3, 4 and 8 under skew, eager and from
CUDA graphs, every output compared bit for bit, two boundaries sharing every rank's workspace, calls
in parts at every tp; a missing peer; the shape that stalled while each kernel's shared-memory split
was the driver's choice; and the negative control, a build whose polls do not wait, which protocol
order passes and the concurrent group must fail.

Each case runs in a spawned process (``run_ranks`` with one rank: a hard timeout, and the module
loader and the hardware queues set before CUDA starts). The cases build at once under
``pytest -n``, and run their ranks one case at a time (``GpuTurn`` on one lock file), so that no two
share the SMs; the hard timeouts include the wait for a turn."""

import os
import tempfile
import time

import pytest
import torch

from .bodies import BACKENDS, require_backend
from .harness import require_gpus, run_ranks

# Before CUDA starts in the spawned process: every module loaded at once, a hardware queue per rank.
EAGER_LOADING = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}
CALLS = 1000
ONE_GPU_LOCK = os.path.join(tempfile.gettempdir(), "lamport-mhc-one-gpu.lock")


def _take_the_gpu():
    from lamport_mhc.soak import GpuTurn

    GpuTurn(ONE_GPU_LOCK).acquire()  # held until the spawned process exits


def _soak_body(rank, world, tp, backend, hidden, graphs, seed):
    from lamport_mhc.soak import soak_one_gpu

    result = soak_one_gpu(tp, CALLS, backend, hidden, graphs=graphs, seed=seed, before_run=_take_the_gpu,
                          log=lambda *_: None)
    return result.summary(), result.ok, result.messages[:10], result.calls


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("tp,hidden", [(2, 5120), (3, 1408), (4, 1408), (8, 1408)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_at_once_with_skew_match_the_reference(backend, tp, hidden, graphs):
    require_gpus(1)
    require_backend(backend)
    [(summary, ok, messages, calls)] = run_ranks(_soak_body, 1, args=(tp, backend, hidden, graphs, tp + graphs),
                                                 timeout_s=1800, env=EAGER_LOADING)
    assert ok, summary + "\n" + "\n".join(messages)
    assert calls >= CALLS


@pytest.mark.parametrize("backend,tp,hidden", [("auto", 2, 4096), ("mixed", 4, 1408)])
def test_ranks_at_once_across_backends(backend, tp, hidden):
    """auto's routes (tp 2, H 4096 routes M ranges to CuTe and to Triton) and ranks of one call on
    different backends, over one set of mailboxes."""
    require_gpus(1)
    for name in BACKENDS:
        require_backend(name)
    [(summary, ok, messages, _)] = run_ranks(_soak_body, 1, args=(tp, backend, hidden, True, 7), timeout_s=1800,
                                             env=EAGER_LOADING)
    assert ok, summary + "\n" + "\n".join(messages)


def _chunked_body(rank, world, tp, backend, chunk_rows):
    from lamport_mhc.soak import soak_one_gpu

    # H 1400 takes no MXFP8 copy, so parts need not start on 128-row scale tiles: parts of 40 rows
    # are BT (plain from 37 rows) and the rest LL, and every emulated capacity holds several.
    result = soak_one_gpu(tp, CALLS, backend, 1400, graphs=True, seed=20 + tp, chunk_rows=chunk_rows,
                          before_run=_take_the_gpu, log=lambda *_: None)
    return result.summary(), result.ok, result.messages[:10]


@pytest.mark.parametrize("tp", [2, 3, 4, 8])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_at_once_with_calls_in_parts_match_the_reference(backend, tp):
    require_gpus(1)
    require_backend(backend)
    [(summary, ok, messages)] = run_ranks(_chunked_body, 1, args=(tp, backend, 40), timeout_s=1800,
                                          env=EAGER_LOADING)
    assert ok, summary + "\n" + "\n".join(messages)


def _ordered_after_the_caller_body(rank, world, backend):
    from lamport_mhc.concurrent import ConcurrentGroup, sleep_us
    from lamport_mhc.soak_calls import POISON_BYTE, Draw, Pool, RankBuffers, rank_call

    tp, hidden, capacity = 2, 1408, 32
    group = ConcurrentGroup(tp, hidden_size=hidden, max_num_tokens=capacity, backend=backend, ll_one_kernel_rows=8)
    _take_the_gpu()
    device = group.device
    pool = Pool(tp, capacity, hidden, 4, 6, 9, 1e-6, device)
    buffers = [RankBuffers.allocate(capacity, hidden, 4, True, device) for _ in range(tp)]
    draw = Draw("plain", 4, 0)  # LL's one-kernel form: issued on the ranks' own streams
    prepared = [rank_call(draw, r, pool, buffers[r], hidden, 4) for r in range(tp)]
    group.run_in_protocol_order([call for call, _ in prepared])
    sleep_us(50_000)  # the caller's work on its stream (a check that reads and poisons) comes late
    for b in buffers:
        b.residual_out.view(torch.uint8).fill_(POISON_BYTE)
    group.run_in_protocol_order([call for call, _ in prepared])
    torch.cuda.synchronize()
    return [torch.equal(outputs[0].view(torch.int16), expected[0][:draw.m].view(torch.int16))
            for _, (outputs, expected) in prepared]


@pytest.mark.parametrize("backend", BACKENDS)
def test_protocol_order_runs_after_what_the_caller_enqueued(backend):
    """The warm-up's one-kernel calls run on the ranks' non-blocking streams: unless they wait for
    the caller's stream, the poison of the previous call's check lands on their outputs (seen as
    warm-up mismatches without a timeout while other processes slowed the GPU)."""
    require_gpus(1)
    require_backend(backend)
    [same] = run_ranks(_ordered_after_the_caller_body, 1, args=(backend,), timeout_s=900, env=EAGER_LOADING)
    assert same == [True, True]


def _parts_of_one_call_body(rank, world, backend):
    from lamport_mhc.concurrent import ConcurrentGroup
    from lamport_mhc.soak_calls import Draw, Pool, RankBuffers, rank_call

    tp, hidden, capacity = 2, 1400, 48
    group = ConcurrentGroup(tp, hidden_size=hidden, max_num_tokens=capacity, backend=backend, chunk_rows=40,
                            bt_min_rows=24, bt_min_finalize_rows=24, ll_one_kernel_rows=8)
    _take_the_gpu()
    device = group.device
    pool = Pool(tp, capacity, hidden, 4, 6, 9, 1e-6, device)
    buffers = [RankBuffers.allocate(capacity, hidden, 4, group.specs[0].quantize, device) for _ in range(tp)]
    # Parts of 40 rows (BT) and 8 (LL's one-kernel form): both run while the warm-up checks residency.
    draw = Draw("plain", capacity, 0)
    prepared = [rank_call(draw, r, pool, buffers[r], hidden, 4) for r in range(tp)]
    group.run_in_protocol_order([call for call, _ in prepared])
    torch.cuda.synchronize()
    return group.residency.worst_launches


@pytest.mark.parametrize("backend", BACKENDS)
def test_protocol_order_counts_a_calls_parts_together(backend):
    """Residency is settled per call, as a concurrent issue settles it: counted per part, the
    warm-up passed a capacity whose parts, issued at once, took more than the check allows (CuTe
    tp 8, parts of 40 rows: refused only after the run)."""
    require_gpus(1)
    require_backend(backend)
    [launches] = run_ranks(_parts_of_one_call_body, 1, args=(backend,), timeout_s=900, env=EAGER_LOADING)
    assert any("_bt" in text for text in launches) and any("_ll" in text for text in launches), launches


def _issue_shape_body(rank, world, backend, pin_carveout):
    from lamport_mhc.soak import soak_one_gpu

    # The shape in which ranks first lost a peer's contribution: LL in the cluster form to 64 rows,
    # no one-kernel form, the ranks' waiting programs near three quarters of the GPU.
    result = soak_one_gpu(4, 3000, backend, 1408, graphs=False, seed=0, capacity=96, split_rows=64,
                          ll_one_kernel_rows=0, spin_timeout_ms=1000, pin_carveout=pin_carveout, before_run=_take_the_gpu,
                          log=lambda *_: None)
    return result.summary(), result.ok, result.messages[:10], result.timeouts


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_sharing_sms_run_when_every_kernel_asks_for_one_carveout(backend):
    """With each kernel's L1 / shared-memory split left to the driver, this run stalled on one H200
    in every try for both backends (a kernel waiting for an SM whose split matched, while other ranks
    spun on all of them, until the spin gave up); the pin of ``lamport_mhc.carveout`` is what lets
    it pass."""
    require_gpus(1)
    require_backend(backend)
    [(summary, ok, messages, _)] = run_ranks(_issue_shape_body, 1, args=(backend, True), timeout_s=1800,
                                             env=EAGER_LOADING)
    assert ok, summary + "\n" + "\n".join(messages)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_carveout_left_to_the_driver_stalls_ranks_that_share_sms(backend):
    """The other half of the evidence for the test above: the same run, the carveout not pinned,
    meets spin timeouts (a property of the GPU's block scheduler, seen on H200; a GPU whose
    scheduler could re-split a busy SM would fail this test, and then the pin would be moot)."""
    require_gpus(1)
    require_backend(backend)
    [(summary, _, _, timeouts)] = run_ranks(_issue_shape_body, 1, args=(backend, False), timeout_s=1800,
                                            env=EAGER_LOADING)
    assert timeouts > 0, summary


def _missing_peer_body(rank, world, backend, timeout_ms):
    from lamport_mhc.concurrent import ConcurrentGroup, RankCall
    from lamport_mhc.soak import soak_one_gpu
    from lamport_mhc.soak_calls import Draw, Pool, RankBuffers, rank_call

    tp, hidden, capacity, absent = 4, 1408, 64, 2
    group = ConcurrentGroup(tp, hidden_size=hidden, max_num_tokens=capacity, backend=backend, bt_min_rows=32,
                            bt_min_finalize_rows=32, ll_one_kernel_rows=4, spin_timeout_ms=timeout_ms)
    _take_the_gpu()
    device = group.device
    pool = Pool(tp, capacity, hidden, 4, 6, 5, 1e-20, device)
    buffers = [RankBuffers.allocate(capacity, hidden, 4, True, device) for _ in range(tp)]
    calls = [Draw("plain", 8, 0), Draw("quant", 3, 0), Draw("plain", 16, 0)]  # LL: every poll names its source
    for draw in calls[:2]:  # every rank
        group.run_in_protocol_order([rank_call(draw, r, pool, buffers[r], hidden, 4)[0] for r in range(tp)])
    assert group.timeouts() == []
    started = time.monotonic()
    for r in range(tp):
        if r != absent:
            group.issue(r, RankCall(rank_call(calls[2], r, pool, buffers[r], hidden, 4)[0]))
    group.synchronize()
    waited = time.monotonic() - started
    errors = {}
    for r, path in enumerate(group.paths):
        try:
            path.raise_on_timeout()
        except RuntimeError as error:
            errors[r] = str(error)
    reports = group.timeouts()
    rebuilt = soak_one_gpu(tp, 200, backend, hidden, graphs=False, seed=3, capacity=capacity, log=lambda *_: None)
    return errors, reports, waited, rebuilt.summary(), rebuilt.ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_missing_peer_is_named_by_every_other_rank(backend):
    require_gpus(1)
    require_backend(backend)
    timeout_ms = 500
    [(errors, reports, waited, rebuilt, rebuilt_ok)] = run_ranks(_missing_peer_body, 1, args=(backend, timeout_ms),
                                                                 timeout_s=1800, env=EAGER_LOADING)
    assert sorted(errors) == [0, 1, 3], errors
    for r, message in errors.items():
        assert "rank 2's contribution" in message, message
    assert len(reports) == 3 and all("rank 2 at token" in r and "holds the sentinel in every lane" in r
                                     for r in reports), reports
    assert waited < 10 * timeout_ms / 1000 + 5, f"the ranks gave up after {waited:.1f} s"
    assert rebuilt_ok, rebuilt


def _negative_control_body(rank, world):
    from lamport_mhc import SimulatedGroup
    from lamport_mhc.soak import soak_one_gpu
    from lamport_mhc.testing import assert_outputs_match, call_simulated, expected_outputs, random_inputs

    _take_the_gpu()
    device = torch.device("cuda", torch.cuda.current_device())
    group = SimulatedGroup(4, hidden_size=1408, hc_mult=4, max_num_tokens=64, top_k=6, backend="triton",
                           ll_one_kernel_rows=0, device=device)
    for m in (1, 7, 33):  # protocol order: every slot is written before it is polled
        inputs = random_inputs(4, m, 1408, 4, seed=m, top_k=6, device=device)
        for outputs in call_simulated(group, inputs, "plain", 1e-6):
            assert_outputs_match(outputs, expected_outputs(inputs, "plain", 1e-6, device=device))
    result = soak_one_gpu(4, 300, "triton", 1408, graphs=False, seed=11, log=lambda *_: None)
    return result.summary(), result.mismatches, result.timeouts


def test_the_concurrent_group_fails_a_build_whose_polls_do_not_wait():
    """Negative control: LAMPORT_MHC_DEBUG_NO_WAIT=1 builds polls that read their slot once. Protocol
    order cannot tell (every slot is written before it is polled); ranks that run at once must."""
    require_gpus(1)
    [(summary, mismatches, timeouts)] = run_ranks(
        _negative_control_body, 1, timeout_s=1800, env={**EAGER_LOADING, "LAMPORT_MHC_DEBUG_NO_WAIT": "1"})
    assert mismatches > 0, summary
