"""The CuTe DSL consumer's two forms on the GPU (bodies.TP GPUs; at ``LAMPORT_MHC_TEST_TP=1`` a group
of one, whose every call is the local form): every variant over M across the form threshold (the
cluster form up to ``launcher.SPLIT_ROWS`` rows, the streaming form above), at the model sizes,
bit-exact with the reference and cross-checked against Triton on every call; each launch is
recorded, so the test also fails if a call took another form than its rows call for. Then CUDA
graphs of both forms over one instance (graphs of many rows too, which test_engine_graphs.py's decode
sizes leave out), replayed in random order with eager calls between them.

    LAMPORT_MHC_TEST_TP=1 timeout 500 python -m pytest -q tests/gpu -k cute
"""

import random

import pytest
import torch

from lamport_mhc.testing import assert_outputs_match, expected_outputs, random_inputs

from .bodies import EPS, HC, TOP_K, TP, VARIANTS, build, capture, check, poison, refill, require_backend, run_variant
from .harness import require_gpus, run_ranks

CAPACITY = 2048


def _sizes():
    from kernels_cute.launcher import SPLIT_ROWS

    return sorted({1, 7, 255, SPLIT_ROWS, SPLIT_ROWS + 1, 1024, CAPACITY})


def _record_launches(op) -> list[str]:
    """The names of the CuTe kernels ``op`` launches from now on, in order."""
    kernels = op.path.kernels["cute"]
    names, launch = [], kernels._launch

    def recording(name, **values):
        names.append(name)
        launch(name, **values)

    kernels._launch = recording
    return names


def _expected_consumer(op, m: int, variant: str) -> str:
    """The consumer kernel a call of ``m`` rows must launch: its form, then protocol and variant."""
    from kernels_cute.launcher import SPLIT_ROWS

    form = "" if m <= SPLIT_ROWS else "streaming_"
    consumer = "residual" if variant == "residual" else "quant" if variant == "quant" else "plain"
    protocol = op.protocol(m, variant == "finalize")
    if protocol == "local":
        return f"{form}local{'_finalize' if variant == 'finalize' else ''}_{consumer}"
    if protocol == "ll" and m <= op.path.kernels["cute"].spec.ll_one_kernel_rows:
        return f"one_kernel{'_finalize' if variant == 'finalize' else ''}_ll_{consumer}"
    return f"{form}consumer_{protocol}_{consumer}"


def _forms_body(rank, tp, hidden):
    ops = [build(hidden, CAPACITY, "cute", bt_min_rows, cross_check=True, cross_check_backend="triton")
           for bt_min_rows in ((CAPACITY + 1, 1) if tp > 1 else (None,))]
    launched = [_record_launches(op) for op in ops]
    failures = []
    for m in _sizes():
        for variant in VARIANTS:
            for names in launched:
                names.clear()
            failures += check(ops, tp, rank, m, hidden, variant, seed=hidden * 10_000 + m * 10 + VARIANTS.index(variant))
            for op, names in zip(ops, launched):
                if tp == 1 and op.protocol(m) != "local":
                    failures.append(f"tp=1 M={m} {variant}: protocol {op.protocol(m)!r}, expected 'local'")
                expected = _expected_consumer(op, m, variant)
                if not names or names[-1] != expected or (tp == 1 and len(names) != 1):
                    failures.append(f"rank {rank} H={hidden} M={m} {variant}: launched {names}, expected ... {expected}")
    torch.cuda.synchronize()
    return failures


@pytest.mark.parametrize("hidden", [4096, 5120, 7168])
def test_cute_forms_across_the_threshold(hidden):
    require_gpus(TP)
    for backend in ("cute", "triton"):
        require_backend(backend)
    failures = [f for rank_failures in run_ranks(_forms_body, TP, args=(hidden,), timeout_s=400)
                for f in rank_failures]
    assert not failures, f"{len(failures)} wrong calls:\n" + "\n".join(failures[:40])


def _graphs_body(rank, tp, replays):
    """One instance, a CUDA graph per M (as engines capture one per batch size) on both sides of the
    form threshold, replayed in random order (the same on every rank) with eager calls of other M
    between them; every output of every replay and eager call bit-checked against the reference."""
    from kernels_cute.launcher import SPLIT_ROWS

    hidden = 5120
    op = build(hidden, CAPACITY, "cute", None)
    graph_rows = (3, SPLIT_ROWS, SPLIT_ROWS + 1, 1024)
    captured = {}
    for i, m in enumerate(graph_rows):
        variant = VARIANTS[i % len(VARIANTS)]
        inputs = random_inputs(tp, m, hidden, HC, seed=m, top_k=TOP_K, device="cuda")
        captured[m] = (*capture(lambda: run_variant(op, inputs, variant, rank)), variant, inputs)
    rng = random.Random(14)
    failures = []
    for replay in range(replays):
        m = rng.choice(graph_rows)
        graph, outputs, variant, inputs = captured[m]
        refill(inputs, random_inputs(tp, m, hidden, HC, seed=10_000 + replay, top_k=TOP_K, device="cuda"))
        poison(outputs)
        graph.replay()
        try:
            assert_outputs_match(outputs, expected_outputs(inputs, variant, EPS, device="cuda"))
        except AssertionError as error:
            failures.append(f"replay {replay} (graph M={m}, {variant}): {error}")
        eager = rng.choice((1, 7, SPLIT_ROWS + 100, CAPACITY))  # prefill between decode steps
        failures += check([op], tp, rank, eager, hidden, VARIANTS[replay % len(VARIANTS)], seed=20_000 + replay)
    torch.cuda.synchronize()
    return failures


def test_cute_graphs_of_both_forms_with_eager_calls_between():
    require_gpus(TP)
    require_backend("cute")
    for failures in run_ranks(_graphs_body, TP, args=(24,), timeout_s=300):
        assert failures == [], "\n".join(failures[:20])
