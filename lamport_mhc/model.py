"""A small TP-sharded mHC model in the DeepSeek-V4.1 layout, with an ``MHCBoundary`` after every sublayer.

Per layer: an attention stand-in (causal attention, heads split over the TP ranks, row-parallel
output projection) and a MoE stand-in (softmax top-k routing over experts split over the ranks, whose
routes held elsewhere are -1, plus a shared expert whose intermediate is split), each producing a
TP-partial output. The hc mixes follow DeepSeek's released inference code (``hc_mixes``), and the
collapse is V4.1's delayed one: a sublayer's input is collapsed with the pre-mix computed before the
previous sublayer (attention: the one carried in, identity for the first layer; MoE: this layer's
attention pre-mix), which is what lets one boundary op do all-reduce, post-mix, collapse and norm.
The last boundary normalizes with the final norm; the logits come from a replicated LM head.

Weights are drawn on the CPU from ``config.seed`` in a fixed order, so every rank holds the same
replicated weights, and each rank keeps its slice of the sharded ones. A model hosts one rank (one
process per rank, ``distributed``) or all of them in lockstep (``simulated``: one CPU process, the
boundary over ``SimulatedMHCBoundary``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import reference
from .integration import MHCBoundary, SimulatedMHCBoundary


@dataclass(frozen=True)
class MHCModelConfig:
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 2
    hc_mult: int = 4
    num_heads: int = 8
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_intermediate_size: int = 128
    routed_scaling_factor: float = 1.5
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    max_num_tokens: int = 16
    seed: int = 0
    all_reduce_mhc_backend: str = "auto"  # "auto" | "triton" | "cute" | "torch"; LAMPORT_MHC_BACKEND overrides
    all_reduce_mhc_strict: bool = False   # raise instead of falling back to "torch"

    @property
    def hc_mix_size(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult  # pre, post and comb mixes: 24 for hc = 4

    def check_tp(self, tp: int) -> None:
        for name in ("num_heads", "num_experts", "shared_intermediate_size"):
            if getattr(self, name) % tp:
                raise ValueError(f"{name}={getattr(self, name)} is not divisible by tp={tp}")


def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, norm_eps: float,
             hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [M, hc], post [M, hc], comb [M, hc, hc] as [source, target]), fp32, from streams [M, hc, H]:
    pre = sigmoid + hc_eps, post = 2 sigmoid, comb = softmax over targets then Sinkhorn normalization
    ending on the sources (so each target's column sums to about 1), as DeepSeek's inference code."""
    hc = streams.shape[1]
    flat = streams.flatten(1).float()
    mixes = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(mixes[:, 2 * hc:].reshape(-1, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1)
    comb = comb + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre.contiguous(), post.contiguous(), comb.contiguous()


def full_weights(config: MHCModelConfig) -> dict[str, torch.Tensor]:
    """Every weight, unsharded, drawn on the CPU from ``config.seed`` in a fixed order."""
    g = torch.Generator().manual_seed(config.seed)
    h, hc, e = config.hidden_size, config.hc_mult, config.num_experts
    qkv, inter, shared = config.num_heads * config.head_dim, config.moe_intermediate_size, \
        config.shared_intermediate_size

    def randn(*shape, std=1.0, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=g) * std).to(dtype)

    def norm():
        return (1 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16)

    w = {"embed": randn(config.vocab_size, h), "lm_head": randn(config.vocab_size, h, std=h ** -0.5),
         "final_norm": norm()}
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        w[p + "attn_norm"], w[p + "ffn_norm"] = norm(), norm()
        for site in ("attn", "ffn"):
            w[p + f"hc_{site}_fn"] = randn(config.hc_mix_size, hc * h, std=(hc * h) ** -0.5, dtype=torch.float32)
            w[p + f"hc_{site}_base"] = randn(config.hc_mix_size, std=0.5, dtype=torch.float32)
            w[p + f"hc_{site}_scale"] = 0.5 + torch.rand(3, generator=g)
        for name in ("wq", "wk", "wv"):
            w[p + name] = randn(qkv, h, std=h ** -0.5)
        w[p + "wo"] = randn(h, qkv, std=qkv ** -0.5)
        w[p + "router"] = randn(e, h, std=h ** -0.5, dtype=torch.float32)
        w[p + "experts_gate"], w[p + "experts_up"] = randn(e, inter, h, std=h ** -0.5), randn(e, inter, h, std=h ** -0.5)
        w[p + "experts_down"] = randn(e, h, inter, std=inter ** -0.5)
        w[p + "shared_gate"], w[p + "shared_up"] = randn(shared, h, std=h ** -0.5), randn(shared, h, std=h ** -0.5)
        w[p + "shared_down"] = randn(h, shared, std=shared ** -0.5)
    return w


def shard_weights(weights: dict[str, torch.Tensor], config: MHCModelConfig, tp: int, rank: int) -> dict:
    """Rank ``rank``'s weights: heads, experts and the shared intermediate split in contiguous blocks;
    everything else replicated."""
    config.check_tp(tp)
    qkv = config.num_heads * config.head_dim // tp
    experts = config.num_experts // tp
    shared = config.shared_intermediate_size // tp
    rows = {"wq": qkv, "wk": qkv, "wv": qkv, "experts_gate": experts, "experts_up": experts,
            "experts_down": experts, "shared_gate": shared, "shared_up": shared}
    cols = {"wo": qkv, "shared_down": shared}
    out = {}
    for name, tensor in weights.items():
        kind = name.rsplit(".", 1)[-1]
        if kind in rows:
            tensor = tensor[rank * rows[kind]:(rank + 1) * rows[kind]]
        elif kind in cols:
            tensor = tensor[:, rank * cols[kind]:(rank + 1) * cols[kind]]
        out[name] = tensor.contiguous()
    return out


def _swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


@dataclass
class MoEPartial:
    """One rank's unfinalized MoE output, as ``MHCBoundary.finalize`` takes it."""

    gemm2_permuted: torch.Tensor                # [M * top_k, H] bf16, this rank's routes first, by expert
    expert_weights: torch.Tensor                # [M, top_k] fp32
    expanded_idx_to_permuted_idx: torch.Tensor  # [M, top_k] int32, -1 where another rank holds the expert
    shared_output: torch.Tensor                 # [M, H] bf16, this rank's slice of the shared expert


class RankShard(torch.nn.Module):
    """One TP rank's weights and its sublayer computations (no communication)."""

    def __init__(self, config: MHCModelConfig, tp: int, rank: int, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.config, self.tp, self.rank = config, tp, rank
        for name, tensor in weights.items():
            self.register_buffer(name.replace(".", "_"), tensor)

    def weight(self, layer: int, name: str) -> torch.Tensor:
        return getattr(self, f"layers_{layer}_{name}")

    def mixes(self, layer: int, site: str, streams: torch.Tensor):
        c = self.config
        return hc_mixes(streams, self.weight(layer, f"hc_{site}_fn"), self.weight(layer, f"hc_{site}_base"),
                        self.weight(layer, f"hc_{site}_scale"), norm_eps=c.rms_norm_eps, hc_eps=c.hc_eps,
                        sinkhorn_iters=c.hc_sinkhorn_iters)

    def attention(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """TP-partial attention output [M, H] bf16 (this rank's heads through its slice of wo)."""
        m, hd = x.shape[0], self.config.head_dim
        q, k, v = (torch.matmul(x, self.weight(layer, name).T).view(m, -1, hd).transpose(0, 1)
                   for name in ("wq", "wk", "wv"))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(m, -1)
        return (o @ self.weight(layer, "wo").T).contiguous()

    def moe(self, layer: int, x: torch.Tensor) -> MoEPartial:
        """Route every token, run this rank's experts on the routes they hold (fixed shapes, no host
        synchronization: graph-capturable) and this rank's slice of the shared expert."""
        c = self.config
        m, top_k = x.shape[0], c.num_experts_per_tok
        local_experts = c.num_experts // self.tp
        scores = torch.softmax(x.float() @ self.weight(layer, "router").T, dim=-1)
        weights, experts = scores.topk(top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True) * c.routed_scaling_factor).contiguous()

        flat = experts.flatten()
        first = self.rank * local_experts
        held = (flat >= first) & (flat < first + local_experts)
        key = torch.where(held, flat - first, torch.full_like(flat, local_experts))  # routes held elsewhere last
        order = torch.argsort(key, stable=True)  # permuted row p serves route order[p]
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        indices = torch.where(held, position, torch.full_like(position, -1)).view(m, top_k).to(torch.int32)

        rows = x[order // top_k]
        row_expert = key[order]
        gemm2 = torch.zeros_like(rows)
        for e in range(local_experts):
            y = _swiglu(rows, self.weight(layer, "experts_gate")[e], self.weight(layer, "experts_up")[e],
                        self.weight(layer, "experts_down")[e])
            gemm2 = torch.where((row_expert == e).unsqueeze(1), y, gemm2)
        shared = _swiglu(x, self.weight(layer, "shared_gate"), self.weight(layer, "shared_up"),
                         self.weight(layer, "shared_down")).contiguous()
        return MoEPartial(gemm2.contiguous(), weights, indices.contiguous(), shared)


@dataclass
class RankRun:
    """What one rank computed in a forward: the streams and layer input after every boundary, the logits."""

    rank: int
    sites: list[str] = field(default_factory=list)
    streams: list[torch.Tensor] = field(default_factory=list)
    layer_inputs: list[torch.Tensor] = field(default_factory=list)
    logits: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every output by name (for bit comparisons)."""
        out = {}
        for site, streams, layer_input in zip(self.sites, self.streams, self.layer_inputs):
            out[f"{site} streams"] = streams
            out[f"{site} layer_input"] = layer_input
        out["logits"] = self.logits
        return out


class _OneRank:
    """An ``MHCBoundary`` behind the per-rank list interface the model drives its ranks with."""

    def __init__(self, boundary: MHCBoundary):
        self.boundary = boundary

    @property
    def backend(self) -> str:
        return self.boundary.backend

    def __call__(self, xs, residual, post, comb, pre, norm_weight, norm_eps):
        return [self.boundary(xs[0], residual[0], post[0], comb[0], pre[0], norm_weight[0], norm_eps)]

    def finalize(self, gemm2s, weights, idxs, shareds, residual, post, comb, pre, norm_weight, norm_eps):
        return [self.boundary.finalize(gemm2s[0], weights[0], idxs[0], shareds[0], residual[0], post[0], comb[0],
                                       pre[0], norm_weight[0], norm_eps)]


def build_shards(config: MHCModelConfig, tp: int, ranks, device="cpu") -> list[RankShard]:
    weights = full_weights(config)
    return [RankShard(config, tp, rank, shard_weights(weights, config, tp, rank)).to(device) for rank in ranks]


class MHCSmallModel(torch.nn.Module):
    """The model over the ranks it hosts; ``forward(token_ids [M])`` returns one ``RankRun`` per hosted rank.

    ``boundary`` takes per-rank lists (``SimulatedMHCBoundary``, or one ``MHCBoundary`` wrapped by
    ``distributed``)."""

    def __init__(self, config: MHCModelConfig, shards: list[RankShard], boundary):
        super().__init__()
        self.config = config
        self.shards = torch.nn.ModuleList(shards)
        self.boundary = boundary

    @classmethod
    def simulated(cls, config: MHCModelConfig, tp: int, shards: list[RankShard] | None = None) -> MHCSmallModel:
        """Every rank in this process (CPU); the boundary runs ``config.all_reduce_mhc_backend``."""
        boundary = SimulatedMHCBoundary(tp, config.hidden_size, config.hc_mult, config.max_num_tokens,
                                        config.num_experts_per_tok, backend=config.all_reduce_mhc_backend,
                                        strict=config.all_reduce_mhc_strict)
        return cls(config, shards if shards is not None else build_shards(config, tp, range(tp)), boundary)

    @classmethod
    def distributed(cls, config: MHCModelConfig, device, group=None, shards: list[RankShard] | None = None,
                    **boundary_options) -> MHCSmallModel:
        """This process's rank of ``group`` (default: the world); construction is collective."""
        import torch.distributed as dist

        group = group if group is not None else dist.group.WORLD
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        boundary = MHCBoundary.from_model_config(config, max_num_tokens=config.max_num_tokens, device=device,
                                                 group=group, **boundary_options)
        shards = shards if shards is not None else build_shards(config, tp, [rank], device)
        return cls(config, shards, _OneRank(boundary))

    @property
    def backend(self) -> str:
        return self.boundary.backend

    def forward(self, token_ids: torch.Tensor) -> list[RankRun]:
        c = self.config
        shards, eps = list(self.shards), c.rms_norm_eps
        runs = [RankRun(shard.rank) for shard in shards]
        embedded = [shard.embed[token_ids] for shard in shards]
        streams = [x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous() for x in embedded]
        # The first layer's carried pre-mix is the identity: its input is the embedding, normalized.
        layer_input = [reference.rms_norm(x, shard.layers_0_attn_norm, eps) for x, shard in zip(embedded, shards)]

        for layer in range(c.num_layers):
            mixes = [shard.mixes(layer, "attn", s) for shard, s in zip(shards, streams)]
            partials = [shard.attention(layer, x) for shard, x in zip(shards, layer_input)]
            out = self.boundary(partials, streams, *self._mix_lists(mixes),
                                [shard.weight(layer, "ffn_norm") for shard in shards], eps)
            streams, layer_input = self._record(runs, f"layer {layer} attention", out)

            mixes = [shard.mixes(layer, "ffn", s) for shard, s in zip(shards, streams)]
            moe = [shard.moe(layer, x) for shard, x in zip(shards, layer_input)]
            norm = [shard.weight(layer + 1, "attn_norm") if layer + 1 < c.num_layers else shard.final_norm
                    for shard in shards]
            out = self.boundary.finalize([p.gemm2_permuted for p in moe], [p.expert_weights for p in moe],
                                         [p.expanded_idx_to_permuted_idx for p in moe],
                                         [p.shared_output for p in moe], streams, *self._mix_lists(mixes), norm, eps)
            streams, layer_input = self._record(runs, f"layer {layer} moe", out)

        for run, shard, x in zip(runs, shards, layer_input):
            run.logits = x.float() @ shard.lm_head.float().T
        return runs

    @staticmethod
    def _mix_lists(mixes):
        """Per-rank (pre, post, comb) -> the boundary's (post, comb, pre) lists."""
        pre, post, comb = (list(t) for t in zip(*mixes))
        return post, comb, pre

    @staticmethod
    def _record(runs: list[RankRun], site: str, outputs):
        for run, (streams, layer_input) in zip(runs, outputs):
            run.sites.append(site)
            run.streams.append(streams)
            run.layer_inputs.append(layer_input)
        return [o[0] for o in outputs], [o[1] for o in outputs]
