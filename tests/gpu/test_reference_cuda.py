"""The reference on a GPU gives the CPU's bits, so the GPU suites may compute it on the GPU.

The CPU reference is the contract; the suites in this directory compute their expected outputs with
the same torch ops on CUDA (minutes faster at H = 7168, M = 1024). This pins the two together on
inputs with every special value, at the largest hidden size and a ragged M, for every variant.
"""

import pytest

from lamport_mhc.testing import assert_outputs_match, expected_outputs, random_inputs

from .bodies import EPS, HC, TOP_K, VARIANTS
from .harness import require_gpus


@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_reference_matches_cpu(variant):
    require_gpus(1)
    for tp, m, hidden, seed in ((2, 255, 7168, 11), (4, 33, 5120, 12), (8, 1, 4096, 13)):
        inputs = random_inputs(tp, m, hidden, HC, seed=seed, top_k=TOP_K, device="cuda")
        on_gpu = expected_outputs(inputs, variant, EPS, device="cuda")
        on_cpu = expected_outputs(inputs, variant, EPS)
        assert_outputs_match(on_gpu, on_cpu)
