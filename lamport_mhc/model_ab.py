"""A/B runs of the small mHC model: the same weights and tokens through two boundary backends, and the
first differing bit of every stream, layer input and logit, per rank.

- ``simulated_ab``: every rank in this CPU process (``SimulatedMHCBoundary``), e.g. torch vs the
  Triton kernels under the interpreter.
- ``distributed_ab``: this process's rank of a group (under ``torchrun`` or a test harness); each
  side eagerly, or replayed from a CUDA graph (``cuda_graph``).

Both build every boundary strictly: a backend that cannot run raises instead of quietly turning the
A/B into torch against torch, and so does an environment override that makes both sides the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .model import MHCModelConfig, MHCSmallModel, RankRun, build_shards
from .selector import first_difference


@dataclass
class ABResult:
    backends: tuple[str, str]                   # the backends that ran
    runs: tuple[list[RankRun], list[RankRun]]
    rows: list[tuple[int, str, str | None]]     # (rank, output, first difference or None)
    models: tuple[MHCSmallModel, MHCSmallModel]

    @property
    def differences(self) -> list[str]:
        return [message for _, _, message in self.rows if message is not None]

    def report(self) -> list[str]:
        a, b = self.backends
        return [f"rank {rank} {name:30s} {a} vs {b}: {'identical' if message is None else message}"
                for rank, name, message in self.rows]


def random_tokens(config: MHCModelConfig, m: int, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (m,), generator=g).to(device)


def compare_runs(a: list[RankRun], b: list[RankRun]) -> list[tuple[int, str, str | None]]:
    """(rank, output, None or the first differing bit) for every output, compared as integer views."""
    rows = []
    for run_a, run_b in zip(a, b, strict=True):
        tensors_b = run_b.tensors()
        for name, tensor in run_a.tensors().items():
            other = tensors_b[name]
            if tensor.shape != other.shape:
                message = f"rank {run_a.rank} {name}: shape {list(tensor.shape)} vs {list(other.shape)}"
            else:
                message = first_difference(f"rank {run_a.rank} {name}", tensor.cpu(), other.cpu())
            rows.append((run_a.rank, name, message))
    return rows


def _check_sides(backends: tuple[str, str], ran: tuple[str, str]) -> None:
    if backends[0] != backends[1] and ran[0] == ran[1]:
        raise RuntimeError(f"A/B of {backends} ran {ran[0]!r} on both sides (is LAMPORT_MHC_BACKEND set?)")


def simulated_ab(config: MHCModelConfig, tp: int, m: int, seed: int,
                 backends: tuple[str, str] = ("torch", "triton")) -> ABResult:
    """Both backends over every rank in this process, on one set of weights and ``m`` random tokens."""
    shards = build_shards(config, tp, range(tp))
    tokens = random_tokens(config, m, seed)
    models = [MHCSmallModel.simulated(replace(config, all_reduce_mhc_backend=name, all_reduce_mhc_strict=True), tp,
                                      shards) for name in backends]
    ran = (models[0].backend, models[1].backend)
    _check_sides(backends, ran)
    runs = (models[0](tokens), models[1](tokens))
    return ABResult(ran, runs, compare_runs(*runs), tuple(models))


def run_cuda_graph(model: MHCSmallModel, batches: list[torch.Tensor]) -> list[list[RankRun]]:
    """``model`` captured once into a CUDA graph (after one eager warm-up call on the first batch) and
    replayed for every batch of tokens (same M), copied into the captured input in place."""
    static = batches[0].clone()
    side = torch.cuda.Stream()  # warm up off the default stream, as capture expects
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model(static)
    results = []
    for tokens in batches:
        static.copy_(tokens)
        graph.replay()
        torch.cuda.synchronize()
        results.append([_detached_copy(run) for run in captured])
    return results


def _detached_copy(run: RankRun) -> RankRun:
    """A copy of a run whose tensors the next replay does not overwrite."""
    return RankRun(run.rank, list(run.sites), [t.clone() for t in run.streams], [t.clone() for t in run.layer_inputs],
                   run.logits.clone())


def distributed_ab(config: MHCModelConfig, m: int, seed: int, backends: tuple[str, str], device, *, group=None,
                   cuda_graph: tuple[bool, bool] = (False, False)) -> ABResult:
    """Both backends on this rank of ``group`` (collective: every rank calls it with the same arguments).
    ``cuda_graph`` replays a side from a CUDA graph instead of running it eagerly."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    shards = build_shards(config, dist.get_world_size(group), [dist.get_rank(group)], device)
    models = [MHCSmallModel.distributed(replace(config, all_reduce_mhc_backend=name, all_reduce_mhc_strict=True),
                                        device, group=group, shards=shards) for name in backends]
    ran = (models[0].backend, models[1].backend)
    _check_sides(backends, ran)
    tokens = random_tokens(config, m, seed, device)
    runs = tuple(run_cuda_graph(model, [tokens])[0] if graphed else model(tokens)
                 for model, graphed in zip(models, cuda_graph))
    return ABResult(ran, runs, compare_runs(*runs), tuple(models))
