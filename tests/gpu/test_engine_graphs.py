"""Engine-style CUDA graphs: one instance, one graph captured per batch size (as engines capture
decode), replayed in random order with eager calls of other sizes between them (prefill between
decode steps). Every output of every replay and every eager call is compared bit for bit with the
reference, with new inputs copied into the graphs' static buffers and poisoned outputs each time."""

import random

import pytest
import torch

from lamport_mhc.testing import assert_outputs_match, expected_outputs, random_inputs

from .bodies import EPS, HC, TOP_K, TP, VARIANTS, build, capture, poison, poison_allocator, refill, run_variant
from .harness import require_gpus, run_ranks
from .test_fused_backends import BACKENDS, require_backend

HIDDEN, CAPACITY = 5120, 1024
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)    # decode batch sizes, one graph each
EAGER_SIZES = (3, 100, 257, 1000)         # prefill between replays
STEPS = 60


def _engine_body(rank, tp, backend):
    op = build(HIDDEN, CAPACITY, backend, None)
    rng = random.Random(77)  # the same schedule on every rank
    graphs = {}
    for m in GRAPH_SIZES:
        variant = VARIANTS[m % len(VARIANTS)]
        static = random_inputs(tp, m, HIDDEN, HC, seed=m, top_k=TOP_K, device="cuda")
        graph, outputs = capture(lambda: run_variant(op, static, variant, rank))
        graphs[m] = (graph, variant, static, outputs)
    failures = []
    for step in range(STEPS):
        m = rng.choice(GRAPH_SIZES)
        graph, variant, static, outputs = graphs[m]
        refill(static, random_inputs(tp, m, HIDDEN, HC, seed=10_000 + step, top_k=TOP_K, device="cuda"))
        poison(outputs)
        graph.replay()
        try:
            assert_outputs_match(outputs, expected_outputs(static, variant, EPS, device="cuda"))
        except AssertionError as error:
            failures.append(f"step {step}: replay M={m} {variant}: {error}")
        if rng.random() < 0.5:
            m, variant = rng.choice(EAGER_SIZES), rng.choice(VARIANTS)
            inputs = random_inputs(tp, m, HIDDEN, HC, seed=20_000 + step, top_k=TOP_K, device="cuda")
            poison_allocator(64 << 20)
            try:
                assert_outputs_match(run_variant(op, inputs, variant, rank),
                                     expected_outputs(inputs, variant, EPS, device="cuda"))
            except AssertionError as error:
                failures.append(f"step {step}: eager M={m} {variant}: {error}")
    torch.cuda.synchronize()
    return failures


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphs_per_batch_size_replayed_in_random_order_between_eager_calls(backend):
    require_gpus(TP)
    require_backend(backend)
    for failures in run_ranks(_engine_body, TP, args=(backend,), timeout_s=300):
        assert failures == [], "\n".join(failures)
