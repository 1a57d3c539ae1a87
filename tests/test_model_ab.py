"""The small mHC model: its hc mixes and TP sharding, and A/B runs through two boundary backends that must
give identical bits for every stream, layer input and logit: torch vs the Triton kernels (simulated
group, interpreter), and the real MHCBoundary over two gloo processes vs the same simulated run."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu.harness import run_ranks

from lamport_mhc.config import BACKEND_ENV
from lamport_mhc.model import MHCModelConfig, MHCSmallModel, build_shards, hc_mixes
from lamport_mhc.model_ab import compare_runs, random_tokens, simulated_ab

ROOT = Path(__file__).resolve().parents[1]
TP, M, SEED = 2, 5, 20260
CONFIG = MHCModelConfig(hidden_size=256, num_layers=2, seed=SEED, rms_norm_eps=1e-20)
SITES = ["layer 0 attention", "layer 0 moe", "layer 1 attention", "layer 1 moe"]


@pytest.fixture(scope="module")
def torch_vs_triton():
    return simulated_ab(CONFIG, TP, M, seed=SEED + 1)


def _tensors(run) -> dict:
    return {name: t.clone() for name, t in run.tensors().items()}


def test_torch_and_simulated_triton_give_identical_bits(torch_vs_triton):
    result = torch_vs_triton
    assert result.backends == ("torch", "triton")
    assert result.differences == [], "\n".join(result.differences)
    assert len(result.rows) == TP * (2 * len(SITES) + 1)
    # The Triton side really ran its kernels: one LL generation per boundary call on every rank.
    states = result.models[1].boundary.group.generation_state()
    assert [s["ll"][0] for s in states] == [len(SITES) % 3] * TP
    runs = result.runs[1]
    assert runs[0].sites == SITES
    for run in runs:  # outputs are live values, not zeros or copies of each other
        assert run.logits.std() > 0.1 and all(s.float().abs().mean() > 0.1 for s in run.streams)
        assert not torch.equal(run.streams[0], run.streams[-1])
    # Every rank holds the same replicated state after each boundary.
    for name, tensor in runs[0].tensors().items():
        assert torch.equal(tensor, runs[1].tensors()[name]), name


def test_comparison_catches_one_flipped_bit(torch_vs_triton):
    a, b = torch_vs_triton.runs
    flipped = [replace(run, streams=list(run.streams)) for run in b]
    bits = flipped[1].streams[2].clone().view(torch.int16)
    bits[3, 1, 17] ^= 1
    flipped[1].streams[2] = bits.view(torch.bfloat16)
    differences = [message for _, _, message in compare_runs(a, flipped) if message is not None]
    assert len(differences) == 1
    assert differences[0].startswith("rank 1 layer 1 attention streams differs first at index (3, 1, 17)")


def _gloo_body(rank, tp, config, tokens):
    from lamport_mhc.model import MHCSmallModel

    model = MHCSmallModel.distributed(replace(config, all_reduce_mhc_backend="torch", all_reduce_mhc_strict=True),
                                      "cpu")
    assert model.backend == "torch" and model.boundary.boundary.use_custom_op
    (run,) = model(tokens)
    return {name: t.clone() for name, t in run.tensors().items()}


def test_gloo_processes_match_the_simulated_triton_run(torch_vs_triton):
    """The real MHCBoundary (custom ops, torch backend) on two gloo ranks, one process per rank."""
    tokens = random_tokens(CONFIG, M, SEED + 1)
    results = run_ranks(_gloo_body, TP, backend="gloo", args=(CONFIG, tokens), timeout_s=120,
                        env={BACKEND_ENV: None})
    for rank, tensors in enumerate(results):
        expected = torch_vs_triton.runs[1][rank].tensors()
        assert tensors.keys() == expected.keys()
        for name, tensor in tensors.items():
            assert torch.equal(tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32),
                               expected[name].view(torch.int16 if tensor.element_size() == 2 else torch.int32)), \
                f"rank {rank} {name}"


def test_tp_shards_add_up_to_the_unsharded_model():
    """tp = 2 against tp = 1 on the same weights: equal up to bf16 rounding of the partial sums, and each
    route is held by exactly one rank."""
    config = replace(CONFIG, seed=SEED + 7, all_reduce_mhc_backend="torch")
    tokens = random_tokens(config, 6, SEED + 8)
    one, two = MHCSmallModel.simulated(config, 1)(tokens)[0], MHCSmallModel.simulated(config, 2)(tokens)[0]
    for name, a in one.tensors().items():
        b = two.tensors()[name].float()
        assert (a.float() - b).abs().max() <= 0.05 * b.abs().max(), name
    shards = build_shards(config, 2, range(2))
    x = one.layer_inputs[0]
    partials = [shard.moe(0, x) for shard in shards]
    held = sum((p.expanded_idx_to_permuted_idx >= 0).int() for p in partials)
    assert torch.equal(held, torch.ones_like(held))
    for p in partials:
        assert torch.equal(p.expert_weights, partials[0].expert_weights)


def test_hc_mixes_follow_deepseek():
    g = torch.Generator().manual_seed(SEED + 3)
    hc, h, m = 4, 64, 7
    streams = torch.randn(m, hc, h, generator=g).bfloat16()
    fn = torch.randn(24, hc * h, generator=g) / (hc * h) ** 0.5
    base, scale = torch.randn(24, generator=g), 0.5 + torch.rand(3, generator=g)
    pre, post, comb = hc_mixes(streams, fn, base, scale, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    assert pre.shape == post.shape == (m, hc) and comb.shape == (m, hc, hc)
    assert ((pre > 1e-6) & (pre < 1 + 1e-6)).all() and ((post > 0) & (post < 2)).all()
    assert pre.std() > 0.01 and post.std() > 0.01
    # Sinkhorn ends on the sources: every target's column sums to 1 (rows to nearly 1).
    assert torch.allclose(comb.sum(-2), torch.ones(m, hc), atol=1e-5)
    assert torch.allclose(comb.sum(-1), torch.ones(m, hc), atol=1e-2)
    one_step = hc_mixes(streams, fn, base, scale, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=1)[2]
    assert not torch.allclose(one_step.sum(-1), torch.ones(m, hc), atol=1e-2)  # the iterations do the work


def test_config_rejects_a_tp_that_does_not_divide_the_shards():
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by tp=4"):
        build_shards(replace(CONFIG, num_heads=6), 4, range(4))


def test_cli_model_ab_prints_identical_rows():
    result = subprocess.run([sys.executable, "-m", "lamport_mhc", "model-ab", "--tp", "2", "--tokens", "2",
                             "--layers", "1", "--seed", str(SEED + 5)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(rows) == 2 * 5 and all(line.endswith("torch vs triton: identical") for line in rows)
