"""A TP group in one GPU's memory (``SimulatedGroup(device="cuda")``): the compiled kernels of every
rank, launched in protocol order on one stream, so the LL and BT mailbox kernels (publish, owner
reduce, consumer, both consumer forms) are checked bit for bit at tp > 1 on a machine with one GPU.
LL's one-kernel form, whose programs wait for their twins, needs real ranks (test_fused_backends)."""

import pytest
import torch

from lamport_mhc import SimulatedGroup
from lamport_mhc.testing import assert_outputs_match, call_simulated, expected_outputs, random_inputs

from .bodies import BACKENDS, EPS, HC, TOP_K, VARIANTS, require_backend
from .harness import require_gpus, run_ranks

CAPACITY = 320
SIZES = (1, 7, 33, 300)


def _mismatch(group, inputs, variant, device) -> str | None:
    """What differed from the reference in any rank's outputs of one call (None: every bit alike)."""
    # The reference on the GPU (tests/gpu/test_reference_cuda.py pins it to the CPU's bits).
    expected = expected_outputs(inputs, variant, EPS, device=device)
    try:
        for outputs in call_simulated(group, inputs, variant, EPS):
            assert_outputs_match(outputs, expected)
    except (AssertionError, RuntimeError) as error:
        return str(error)
    return None


def _group_body(rank, world, backend, tp, hidden):
    device = torch.device("cuda", torch.cuda.current_device())
    failures = []
    for bt_min_rows in (None, 1):  # LL only, then BT from one row
        group = SimulatedGroup(tp, hidden_size=hidden, hc_mult=HC, max_num_tokens=CAPACITY, top_k=TOP_K,
                               backend=backend, quantize_layer_input=True, residual_only=True,
                               bt_min_rows=bt_min_rows, bt_min_finalize_rows=bt_min_rows, ll_one_kernel_rows=0,
                               device=device)
        for m in SIZES:
            for variant in VARIANTS:
                inputs = random_inputs(tp, m, hidden, HC, seed=hidden + 10 * m + VARIANTS.index(variant),
                                       top_k=TOP_K, device=device)
                error = _mismatch(group, inputs, variant, device)
                if error:
                    failures.append(f"{backend} tp={tp} H={hidden} bt_min_rows={bt_min_rows} {variant} M={m}: {error}")
    return failures


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tp,hidden", [(2, 5120), (3, 1408)])
def test_every_rank_of_a_group_on_one_gpu_matches_the_reference(backend, tp, hidden):
    require_gpus(1)
    require_backend(backend)
    for failures in run_ranks(_group_body, 1, args=(backend, tp, hidden), timeout_s=400):
        assert failures == [], "\n".join(failures)


CHUNK = 128


def _parts_body(rank, world, backend, tp, hidden, device=None):
    """Calls in parts of CHUNK rows (a short last part LL), then two groups on one set of workspaces
    alternating calls and variants: every output the reference's bits."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    c = CHUNK
    args = dict(hidden_size=hidden, hc_mult=HC, max_num_tokens=3 * c, top_k=TOP_K, backend=backend,
                quantize_layer_input=True, residual_only=True, bt_min_rows=c // 2, bt_min_finalize_rows=c // 2,
                ll_one_kernel_rows=0, chunk_rows=c, device=device)
    first = SimulatedGroup(tp, **args)
    second = SimulatedGroup(tp, **args, share_workspaces_with=first)
    # One part, one, two (the last of 1 row, LL), three (the last LL); then the two groups in turn.
    calls = [(first, m, variant) for m in (c - 1, c, c + 1, 2 * c + c // 3) for variant in VARIANTS]
    calls += [(second if i % 2 else first, m, variant) for i, (m, variant) in
              enumerate(zip((3 * c, 5, c + 1, c // 2, 1, c + c // 2 + 1), VARIANTS * 2))]
    failures = []
    for i, (group, m, variant) in enumerate(calls):
        inputs = random_inputs(tp, m, hidden, HC, seed=1000 + i, top_k=TOP_K, device=device)
        error = _mismatch(group, inputs, variant, device)
        if error:
            failures.append(f"{backend} tp={tp} {'first' if group is first else 'second'} group, {variant} M={m}: "
                            f"{error}")
    return failures


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tp", [2, 4])
def test_calls_in_parts_and_groups_sharing_workspaces_match_the_reference(backend, tp):
    require_gpus(1)
    require_backend(backend)
    for failures in run_ranks(_parts_body, 1, args=(backend, tp, 1408), timeout_s=600):
        assert failures == [], "\n".join(failures)
