"""Misuse on a real group (one process per rank; on a machine with one GPU the ranks share it as
processes, ``lamport_mhc.launch``): each answered by the right bits or by an error that says what
happened and how to recover, never by a hang or by wrong bits in silence. The README's misuse table
names each test here."""

import gc

import pytest
import torch

from lamport_mhc.testing import assert_outputs_match, expected_outputs, random_inputs

from .bodies import BACKENDS, EPS, HC, TOP_K, build, poison, poison_allocator, refill, require_backend, run_variant
from .harness import require_gpus, run_ranks

TP, HIDDEN, CAPACITY = 2, 1024, 64


def _graph_of_calls(op, rank, plan, seed):
    """Static inputs of ``plan`` [(m, variant)] and a graph of one call each (no warm-up: the first call
    of ``op`` may be the captured one), with the outputs the graph writes."""
    static = [random_inputs(TP, m, HIDDEN, HC, seed=seed + i, top_k=TOP_K, device="cuda") for i, (m, _) in
              enumerate(plan)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [run_variant(op, inputs, variant, rank) for (_, variant), inputs in zip(plan, static)]
    return graph, static, outputs


def _replay_and_check(graph, static, outputs, plan, seed) -> list[str]:
    for i, ((m, _), inputs) in enumerate(zip(plan, static)):
        refill(inputs, random_inputs(TP, m, HIDDEN, HC, seed=seed + i, top_k=TOP_K, device="cuda"))
        poison(outputs[i])
    graph.replay()
    torch.cuda.synchronize()
    failures = []
    for i, ((m, variant), inputs) in enumerate(zip(plan, static)):
        try:
            assert_outputs_match(outputs[i], expected_outputs(inputs, variant, EPS, device="cuda"))
        except AssertionError as error:
            failures.append(f"call {i} ({variant}, M={m}): {error}")
    return failures


PLAN = [(3, "plain"), (40, "finalize"), (17, "quant"), (64, "residual")]


def _every_rank_right(body, backend) -> None:
    """Run ``body`` on a group of TP processes (on one GPU, as processes sharing it); each returns
    its failures, which must be none."""
    require_gpus(1)
    require_backend(backend)
    for failures in run_ranks(body, TP, args=(backend,), timeout_s=400):
        assert failures == [], "\n".join(failures)


def _captured_first_body(rank, tp, backend):
    op = build(HIDDEN, CAPACITY, backend, 32, spin_timeout_ms=2000.0)
    graph, static, outputs = _graph_of_calls(op, rank, PLAN, seed=10)  # never called eagerly before
    failures = [f"replay {k} {f}" for k in range(3) for f in _replay_and_check(graph, static, outputs, PLAN, 100 * k)]
    op.check()
    return failures


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_captured_before_any_eager_call(backend):
    _every_rank_right(_captured_first_body, backend)


def _replay_after_destroy_body(rank, tp, backend):
    import torch.distributed as dist

    op = build(HIDDEN, CAPACITY, backend, 32, spin_timeout_ms=2000.0)
    run_variant(op, random_inputs(TP, 5, HIDDEN, HC, seed=1, top_k=TOP_K, device="cuda"), "plain", rank)
    graph, static, outputs = _graph_of_calls(op, rank, PLAN, seed=10)
    failures = [f"before: {f}" for f in _replay_and_check(graph, static, outputs, PLAN, 200)]
    del op
    gc.collect()
    torch.cuda.empty_cache()
    poison_allocator(1 << 30)  # whatever the instance freed would now hold the pattern
    dist.barrier()
    for k in range(3):
        failures += [f"after, replay {k}: {f}" for f in _replay_and_check(graph, static, outputs, PLAN, 300 + 10 * k)]
    return failures


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_graph_replayed_after_its_instance_is_gone(backend):
    _every_rank_right(_replay_after_destroy_body, backend)


def _different_rows_body(rank, tp, backend):
    import torch.distributed as dist

    op = build(HIDDEN, CAPACITY, backend, None, spin_timeout_ms=300.0)
    errors = []
    for m in (4 if rank == 0 else 8, 4, 4):  # the first call disagrees, the next two agree
        try:
            run_variant(op, random_inputs(TP, m, HIDDEN, HC, seed=m, top_k=TOP_K, device="cuda"), "plain", rank)
            torch.cuda.synchronize()
            op.check()
        except RuntimeError as error:
            errors.append(str(error))
    dist.barrier()
    return errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_ranks_that_call_with_different_row_counts(backend):
    """The rank whose rows a peer never publishes times out within the bound; its instance then
    refuses every call, so the peer's next call times out too: both end with the error that says
    to rebuild on every rank, and neither hangs."""
    require_gpus(1)
    require_backend(backend)
    for rank, errors in enumerate(run_ranks(_different_rows_body, TP, args=(backend,), timeout_s=300)):
        assert errors, f"rank {rank} saw no error"
        assert "spin timeout" in errors[0] and "rebuild it on every rank" in errors[0], errors[0]
        assert all("rebuild it on every rank" in e for e in errors), errors
