"""What a model puts at each sublayer boundary (after attention and after the MoE) of an mHC model.

``MHCBoundary`` takes the sublayer's TP-partial output (``forward``) or the unfinalized MoE output
(``finalize``), the hc residual streams and the mixing tensors, and returns ``(new streams, next layer
input)``. Its backend comes from the model config field ``all_reduce_mhc_backend`` ("auto" | "triton"
| "cute" | "torch", normalized like vLLM's kernel options: case-insensitive, "-" or "_"), overridden by
the environment variable ``LAMPORT_MHC_BACKEND``. A named fused backend that cannot run here (on some
rank of the group) is logged once per process and reason and replaced by "torch"; with
``all_reduce_mhc_strict`` it raises ``RuntimeError`` with the same reason. "auto" never logs: it takes
the preferred supported backend, else "torch", by definition.

``SimulatedMHCBoundary`` is the same boundary for all ranks of a group in one CPU process (per-rank
lists in and out, over ``SimulatedGroup``), for A/B tests of a whole model without GPUs.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from dataclasses import replace

import torch

from . import ops
from .api import AllReduceMHC
from .arrival import check_in
from .backend import ALL_BACKENDS, FUSED_BACKENDS, BuildSpec, Support
from .config import BACKEND_CHOICES, AllReduceMHCConfig
from .selector import support_table
from .simulate import SIMULATED_BACKENDS, SimulatedGroup

logger = logging.getLogger(__name__)

_LOGGED: set[str] = set()  # fallback messages already logged by this process


def normalize_backend(name: str) -> str:
    """``name`` as a config value: stripped, lower case, "-" read as "_" (as vLLM normalizes its options)."""
    return str(name).strip().lower().replace("-", "_")


def requested_backend(configured: str) -> str:
    """The configured backend with LAMPORT_MHC_BACKEND applied; an invalid value raises ValueError."""
    return AllReduceMHCConfig(backend=normalize_backend(configured)).with_environment().backend


def resolve_backend(requested: str, support: Mapping[str, Support], *, strict: bool) -> str:
    """The backend to build: "auto" and "torch" as they are (the op resolves "auto"), a fused backend
    when ``support`` says it can run, else "torch" after one log line, or RuntimeError when ``strict``."""
    if requested not in FUSED_BACKENDS:
        return requested
    answer = support.get(requested, Support.no(f"no support answer for {requested!r}"))
    if answer.ok:
        return requested
    reason = f"all_reduce_mhc_backend={requested!r} cannot run here: {answer.reason}"
    if strict:
        raise RuntimeError(reason)
    message = f"{reason}; falling back to the torch backend"
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning(message)
    return "torch"


def group_support(spec: BuildSpec, device: torch.device, group,
                  timeout_s: float | None = AllReduceMHCConfig.construction_timeout_s) -> dict[str, Support]:
    """Every fused backend's support on every rank of ``group`` (collective, so every rank checks in
    first, waiting at most ``timeout_s`` for the others): yes where all ranks say yes, else the first
    refusing rank's reason (so every rank decides the same)."""
    import torch.distributed as dist

    check_in(group, f"backend support of H={spec.hidden}, hc={spec.hc}, max_num_tokens={spec.capacity}", timeout_s)
    local = {name: (answer.ok, answer.reason) for name, answer in support_table(spec, device).items()}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    agreed = {}
    for name in local:
        refusals = [(rank, answers[name][1]) for rank, answers in enumerate(everyone) if not answers[name][0]]
        if not refusals:
            agreed[name] = Support.yes()
        else:
            rank, reason = refusals[0]
            agreed[name] = Support.no(reason if len(everyone) == 1 else f"rank {rank}: {reason}")
    return agreed


# The first boundary built for each (group, device, hidden size, capacity, config): later ones share
# its workspace (held weakly: a model that drops its boundaries frees the mailboxes).
_WORKSPACE_OWNERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class MHCBoundary(torch.nn.Module):
    """One rank's boundary (one process per rank, collective construction over ``group``).

    ``forward(x, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out=None)`` and
    ``finalize(gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output, residual,
    post, comb, pre, norm_weight, norm_eps, mxfp8_out=None)`` return ``(residual_out [M, hc, H],
    layer_input [M, H])`` with the shapes and dtypes of ``AllReduceMHC``. With ``use_custom_op`` (the
    default) they go through ``torch.ops.lamport_mhc.*`` so the model compiles and graph-captures.
    ``op_config`` sets the op's other options; its ``backend`` is replaced by the resolved one.
    ``pre`` and ``norm_weight`` are required: residual-only builds are not exposed here.
    """

    def __init__(self, hidden_size: int, hc_mult: int, max_num_tokens: int, top_k: int, device, *,
                 backend: str = "auto", strict: bool = False, group=None, quantize_layer_input: bool = False,
                 op_config: AllReduceMHCConfig | None = None, use_custom_op: bool = True,
                 share_workspace: bool = True):
        super().__init__()
        import torch.distributed as dist

        self.requested = requested_backend(backend)
        support: dict[str, Support] = {}
        if self.requested in FUSED_BACKENDS:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("MHCBoundary needs an initialized torch.distributed process group "
                                   "(on one CPU process, SimulatedMHCBoundary runs all ranks instead)")
            group = group if group is not None else dist.group.WORLD
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            spec = BuildSpec(hidden=hidden_size, hc=hc_mult, capacity=max_num_tokens, top_k=top_k,
                             tp=dist.get_world_size(group), rank=dist.get_rank(group), quantize=quantize_layer_input)
            support = group_support(spec, device, group, (op_config or AllReduceMHCConfig()).construction_timeout_s)
        resolved = resolve_backend(self.requested, support, strict=strict)
        config = replace(op_config or AllReduceMHCConfig(), backend=resolved)
        # The boundaries of one model issue their calls in one stream order on every rank: by default
        # they share one workspace (mailboxes and generation words), where their builds allow it.
        key = (id(group), str(device), hidden_size, max_num_tokens, replace(config, backend="auto"))
        owner = _WORKSPACE_OWNERS.get(key) if share_workspace and resolved in FUSED_BACKENDS else None
        build = dict(group=group, quantize_layer_input=quantize_layer_input, config=config, apply_environment=False)
        try:
            self.op = AllReduceMHC(hidden_size, hc_mult, max_num_tokens, top_k, device, share_workspace_with=owner,
                                   **build)
        except ValueError as refusal:  # raised on every rank alike, before anything collective
            if owner is None or "cannot share the workspace" not in str(refusal):
                raise
            self.op = AllReduceMHC(hidden_size, hc_mult, max_num_tokens, top_k, device, **build)
        if share_workspace and owner is None and resolved in FUSED_BACKENDS:
            _WORKSPACE_OWNERS[key] = self.op
        self.handle = ops.register(self.op)
        self.use_custom_op = use_custom_op

    @classmethod
    def from_model_config(cls, model_config, *, max_num_tokens: int, device, group=None, **kwargs) -> MHCBoundary:
        """Built from a model config with ``hidden_size``, ``hc_mult``, ``num_experts_per_tok`` and
        optionally ``all_reduce_mhc_backend`` (default "auto") and ``all_reduce_mhc_strict`` (False)."""
        return cls(model_config.hidden_size, model_config.hc_mult, max_num_tokens, model_config.num_experts_per_tok,
                   device, backend=getattr(model_config, "all_reduce_mhc_backend", "auto"),
                   strict=getattr(model_config, "all_reduce_mhc_strict", False), group=group, **kwargs)

    @property
    def backend(self) -> str:
        """The backend that runs ("triton", "cute" or "torch")."""
        return self.op.backend

    def forward(self, x, residual, post, comb, pre, norm_weight, norm_eps: float, mxfp8_out=None):
        if not self.use_custom_op:
            return self.op(x, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out=mxfp8_out)
        if mxfp8_out is None:
            return torch.ops.lamport_mhc.all_reduce_mhc(self.handle, x, residual, post, comb, pre, norm_weight,
                                                        norm_eps)
        return torch.ops.lamport_mhc.all_reduce_mhc_quant(self.handle, x, residual, post, comb, pre, norm_weight,
                                                          norm_eps, *mxfp8_out)

    def finalize(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output, residual,
                 post, comb, pre, norm_weight, norm_eps: float, mxfp8_out=None):
        if not self.use_custom_op:
            return self.op.finalize(gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output,
                                    residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out=mxfp8_out)
        args = (self.handle, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output, residual,
                post, comb, pre, norm_weight, norm_eps)
        if mxfp8_out is None:
            return torch.ops.lamport_mhc.all_reduce_mhc_finalize(*args)
        return torch.ops.lamport_mhc.all_reduce_mhc_finalize_quant(*args, *mxfp8_out)


# What the simulated group can run; "cute" has a reason, for the same fallback rule as on GPUs.
SIMULATED_SUPPORT = {name: Support.yes() if name in SIMULATED_BACKENDS else
                     Support.no(f"the simulated group runs {SIMULATED_BACKENDS} (CuTe DSL kernels need a GPU)")
                     for name in FUSED_BACKENDS}


class SimulatedMHCBoundary:
    """All ``tp`` ranks of a boundary in one process, over ``SimulatedGroup`` (the Triton kernels under
    the interpreter, or the torch path). Every argument is a list of per-rank tensors (or one tensor
    shared by all ranks); the result is a list of per-rank ``(residual_out, layer_input)``.

    The backend is exactly the one named ("auto" means "triton"): no environment override, since this
    is an A/B tool whose two sides must differ. "cute" falls back (or raises when ``strict``)."""

    def __init__(self, tp: int, hidden_size: int, hc_mult: int, max_num_tokens: int, top_k: int, *,
                 backend: str = "triton", strict: bool = False, bt_min_rows: int | None = None,
                 bt_min_finalize_rows: int | None = None):
        requested = normalize_backend(backend)
        if requested == "auto":
            requested = "triton"
        if requested not in ALL_BACKENDS:
            raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
        self.requested = requested
        self.backend = resolve_backend(requested, SIMULATED_SUPPORT, strict=strict)
        self.group = SimulatedGroup(tp, hidden_size=hidden_size, hc_mult=hc_mult, max_num_tokens=max_num_tokens,
                                    top_k=top_k, backend=self.backend, bt_min_rows=bt_min_rows,
                                    bt_min_finalize_rows=bt_min_finalize_rows)
        self.tp = tp

    def __call__(self, xs, residual, post, comb, pre, norm_weight, norm_eps: float):
        outputs = self.group.all_reduce_mhc(xs, residual, post, comb, pre, norm_weight, norm_eps)
        return [(residual_out, layer_input) for residual_out, layer_input, _ in outputs]

    def finalize(self, gemm2s, weights, idxs, shareds, residual, post, comb, pre, norm_weight, norm_eps: float):
        outputs = self.group.finalize(gemm2s, weights, idxs, shareds, residual, post, comb, pre, norm_weight,
                                      norm_eps)
        return [(residual_out, layer_input) for residual_out, layer_input, _ in outputs]
