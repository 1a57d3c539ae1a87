"""The small mHC model on TP GPUs (bodies.TP; NCCL): every fused backend that can run here, eagerly and replayed
from a CUDA graph (two token batches through one capture), against the torch backend run eagerly on
the same weights and tokens; every stream, layer input and logit must have identical bits. The torch
backend itself is compared eagerly only: its finalize checks the expert indices on the host.
M covers LL and BT (the preset's BT threshold is below the capacity)."""

import pytest

from .bodies import TP
from .harness import require_gpus, run_ranks

HIDDEN, CAPACITY, SEED = 5120, 64, 4242
SIZES = (1, 5, 48)


def _body(rank, tp, backend):
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from lamport_mhc.backend import BuildSpec
    from lamport_mhc.integration import group_support
    from lamport_mhc.model import MHCModelConfig, MHCSmallModel, build_shards
    from lamport_mhc.model_ab import compare_runs, random_tokens, run_cuda_graph

    device = torch.device("cuda", torch.cuda.current_device())
    config = MHCModelConfig(hidden_size=HIDDEN, seed=SEED, rms_norm_eps=1e-20, max_num_tokens=CAPACITY,
                            all_reduce_mhc_strict=True)
    spec = BuildSpec(hidden=HIDDEN, hc=config.hc_mult, capacity=CAPACITY, top_k=config.num_experts_per_tok, tp=tp,
                     rank=rank)
    support = group_support(spec, device, dist.group.WORLD)[backend]
    if not support.ok:
        return "skipped", support.reason

    shards = build_shards(config, tp, [rank], device)
    reference = MHCSmallModel.distributed(replace(config, all_reduce_mhc_backend="torch"), device, shards=shards)
    model = MHCSmallModel.distributed(replace(config, all_reduce_mhc_backend=backend), device, shards=shards)
    assert (reference.backend, model.backend) == ("torch", backend)
    failures = []
    for m in SIZES:
        batches = [random_tokens(config, m, SEED + 10 * m + i, device) for i in range(2)]
        expected = [reference(tokens) for tokens in batches]
        for mode, runs in (("eager", [model(tokens) for tokens in batches]),
                           ("cuda graph", run_cuda_graph(model, batches))):
            for i, (want, got) in enumerate(zip(expected, runs)):
                failures += [f"{backend} {mode} M={m} batch {i}: {message}"
                             for _, _, message in compare_runs(want, got) if message is not None]
    torch.cuda.synchronize()
    return "ran", failures


@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_model_ab_against_torch(backend):
    require_gpus(TP)
    results = run_ranks(_body, TP, args=(backend,), timeout_s=600)
    if results[0][0] == "skipped":
        pytest.skip(f"{backend} cannot run here: {results[0][1]}")
    for status, failures in results:
        assert status == "ran" and failures == [], "\n".join(failures)
