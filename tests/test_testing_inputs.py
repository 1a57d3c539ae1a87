"""The GPU suites rebuild every rank's inputs from a seed in each process: the inputs must be the same
bits whatever the process and its thread count."""

import pytest
import torch

from lamport_mhc.testing import permuted_routes, random_inputs


def _flat_bits(inputs):
    out = []
    for value in inputs.values():
        for t in value if isinstance(value, list) else [value]:
            out.append(t.contiguous().view(torch.uint8).flatten())
    return torch.cat(out)


def test_inputs_do_not_depend_on_threads():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = _flat_bits(random_inputs(2, 256, 1024, 4, seed=7, top_k=6))
        torch.set_num_threads(max(2, threads))
        parallel = _flat_bits(random_inputs(2, 256, 1024, 4, seed=7, top_k=6))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, parallel)


def test_inputs_hold_the_edge_cases():
    inputs = random_inputs(2, 64, 512, 4, seed=1, top_k=6)
    x = inputs["xs"][0].view(torch.int16)
    assert (x == -32768).any()                       # -0.0
    assert ((x & 0x7F80) == 0).logical_and((x & 0x7F) != 0).any()  # subnormals
    assert (inputs["xs"][1].float().abs() > 1e38).any()  # huge
    assert (inputs["xs"][0][0] == 0).all() and (inputs["idxs"][0][0] == -1).all()  # the zero row
    assert (inputs["idxs"][1] == -1).any()


def test_permuted_routes_read_every_held_row_once():
    """An engine's MoE permutation: about a third of the routes held elsewhere (-1), each held route
    its own GEMM2 row, so no finalize reads a row twice (what the benchmark's floor counts)."""
    indices = permuted_routes(4096, 6, torch.Generator().manual_seed(3))
    held = indices[indices >= 0]
    assert torch.equal(held.sort().values, torch.arange(held.numel(), dtype=torch.int32))
    assert 0.30 < (indices < 0).float().mean() < 0.36
    inputs = random_inputs(2, 64, 256, 4, seed=1, top_k=6, permuted=True, zero_row=False)
    for gemm2, idx in zip(inputs["gemm2s"], inputs["idxs"]):
        assert gemm2.shape[0] == int((idx >= 0).sum()) and idx.unique().numel() == gemm2.shape[0] + 1
    with pytest.raises(ValueError, match="gemm2_rows"):
        random_inputs(1, 4, 256, 4, seed=1, top_k=6, permuted=True, gemm2_rows=8)


def test_benchmark_rows_keep_the_norm_on_its_fast_path():
    """The benchmarks time a model's finite activations: with the tests' special values every row's sum
    of squares overflows and the exact norm takes its slow paths, which such rows never do."""
    from lamport_mhc.bench.local_forms import row_inputs
    from lamport_mhc.reference import post_mix, pre_mix

    def sums_of_squares(inputs):
        prenorm = pre_mix(post_mix(inputs["xs"][0], inputs["residual"], inputs["post"], inputs["comb"]), inputs["pre"])
        return prenorm.float().square().sum(-1)

    drawn = dict(seed=5, top_k=6, permuted=True, zero_row=False)
    assert not torch.isfinite(sums_of_squares(random_inputs(1, 16, 1024, 4, **drawn))).any()
    finite = random_inputs(1, 16, 1024, 4, specials=False, **drawn)
    for name in ("xs", "residual", "gemm2s", "shareds"):
        for t in finite[name] if isinstance(finite[name], list) else [finite[name]]:
            assert torch.isfinite(t).all() and (t.view(torch.int16) & 0x7F80).ne(0).all(), name  # no subnormal
    assert torch.isfinite(sums_of_squares(finite)).all()
    x, (residual, *_), _, _ = row_inputs(1024, "plain", 16, torch.device("cpu"))
    assert torch.isfinite(x).all() and torch.isfinite(residual).all()
