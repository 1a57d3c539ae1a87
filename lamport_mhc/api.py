"""The public op: ``AllReduceMHC``, built once per layer kind (collectively over the TP group) and
called every forward step, eagerly or inside a CUDA graph."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from . import presets, validate
from .arrival import check_in
from .backend import BuildSpec, load_backend
from .call import Call
from .config import AllReduceMHCConfig
from .paths import FusedPath, TorchPath
from .selector import Thresholds, choose_protocol, cross_check, mailbox_rows, pick_backends, support_table
from .workspace import allocate


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (a CPU device never is)."""
    if device.type != "cuda":
        return False
    if device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
    return torch.cuda.is_current_stream_capturing()


# Paths a CUDA graph captured calls of, by id: the graph holds the addresses of their mailboxes,
# state words and kernels, and may be replayed after the instance is gone (an engine drops a model
# before its graphs, or keeps graphs of several). They live as long as the process.
_CAPTURED_PATHS: dict[int, object] = {}


def _retain_for_graphs(*paths) -> None:
    for path in paths:
        if path is not None:
            _CAPTURED_PATHS.setdefault(id(path), path)


class AllReduceMHC:
    """Lamport TP all-reduce of a sublayer's partial output fused with the mHC post-mix of the hc
    residual streams, their pre-mix collapse and RMSNorm (optionally also an MXFP8 layer input).

    ``__call__`` / ``finalize`` return new tensors ``(residual_out [M, hc, H] bf16, layer_input
    [M, H] bf16 or None)``; ``mxfp8_out`` buffers, when given, are written in place. Every rank must
    issue the same sequence of calls. See DESIGN.md for the bit contract every backend meets.
    """

    def __init__(self, hidden_size: int, hc_mult: int, max_num_tokens: int, top_k: int, device, *,
                 group=None, quantize_layer_input: bool = False, residual_only: bool = False,
                 config: AllReduceMHCConfig | None = None, apply_environment: bool = True,
                 share_workspace_with: AllReduceMHC | None = None):
        import torch.distributed as dist

        config = config or AllReduceMHCConfig()
        # apply_environment=False: the caller (lamport_mhc.integration) already applied the override.
        self.config = config.with_environment() if apply_environment else config
        validate.check_build(hidden_size, hc_mult, max_num_tokens, top_k, quantize_layer_input)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("AllReduceMHC needs an initialized torch.distributed process group "
                               "(on one CPU process, lamport_mhc.SimulatedGroup runs the kernels instead)")
        self.group = group if group is not None else dist.group.WORLD
        tp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.device = device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            self.device = device = torch.device("cuda", torch.cuda.current_device())
        check_in(self.group, f"AllReduceMHC(H={hidden_size}, hc={hc_mult}, max_num_tokens={max_num_tokens}, "
                 f"top_k={top_k}, quantize={quantize_layer_input}, residual_only={residual_only}, "
                 f"backend={self.config.backend})", self.config.construction_timeout_s)

        self.preset = presets.lookup(presets.device_keys(device), tp, hidden_size, self.config.presets_file)
        self.thresholds = Thresholds(self.config.bt_min_rows or self.preset.bt_min_rows,
                                     self.config.bt_min_finalize_rows or self.preset.bt_min_finalize_rows)
        rows = mailbox_rows(tp, max_num_tokens, self.thresholds, self.config.chunk_rows, quantize_layer_input)
        self.spec = BuildSpec(
            hidden=hidden_size, hc=hc_mult, capacity=max_num_tokens, top_k=top_k, tp=tp, rank=rank,
            quantize=quantize_layer_input, residual_only=residual_only, **rows,
            use_pdl=self.config.use_pdl, spin_timeout_ns=self.config.spin_timeout_ns,
            ll_one_kernel_rows=self._ll_one_kernel_rows(rows.get("ll_rows") or max_num_tokens))

        # share_workspace_with: another instance of this group whose calls this one's interleave with
        # in one stream order on every rank (the attention and MoE boundaries of a model): one set of
        # mailboxes and generation words for both.
        self._shared = share_workspace_with
        if share_workspace_with is not None:
            reason = self.sharing_refused(share_workspace_with)
            if reason is not None:
                raise ValueError(f"cannot share the workspace of {share_workspace_with!r}: {reason}")
        # One backend, or (auto, where the preset routes M ranges to several) each call on its own.
        self.backends = self._agree_on_backends(self.config.backend)
        self.backend = "+".join(self.backends)
        self.path = self._build_path(self.backends)
        self.check_path = None
        if self.config.cross_check:
            if self.config.cross_check_backend in self.backends:
                raise ValueError(f"cross_check_backend must differ from the backend ({self.backend!r})")
            self.check_path = self._build_path((self.config.cross_check_backend,))
        self._broken: str | None = None

    # -- construction ------------------------------------------------------------------------------
    def _ll_one_kernel_rows(self, capacity: int) -> int:
        if self.device.type != "cuda":
            return 0
        resident = torch.cuda.get_device_properties(self.device).multi_processor_count
        rows = self.config.ll_one_kernel_max_rows
        if rows is not None and rows > resident:
            raise ValueError(f"ll_one_kernel_max_rows={rows} exceeds the {resident} SMs of {self.device}: "
                             f"programs that wait for each other must all be resident")
        return min(capacity, resident if rows is None else rows)

    def _agree_on_backends(self, requested: str) -> tuple[str, ...]:
        """Every rank builds the same backends: the fused backends all ranks support decide."""
        import torch.distributed as dist

        self.support = {} if requested == "torch" else support_table(self.spec, self.device)
        local = sorted(name for name, answer in self.support.items() if answer.ok)
        everyone: list = [None] * self.spec.tp
        dist.all_gather_object(everyone, local, group=self.group)
        supported = set.intersection(*(set(names) for names in everyone))
        if requested in self.support and not self.support[requested].ok:
            raise RuntimeError(f"backend {requested!r} cannot run here: {self.support[requested].reason}")
        return pick_backends(requested, self.preset, supported)

    def sharing_refused(self, other) -> str | None:
        """Why this instance may not use ``other``'s workspace (None: it may). Sharing needs the same
        process group, device, hidden size and mailbox rows (thresholds and chunk_rows alike)."""
        if not isinstance(other, AllReduceMHC):
            return f"it is a {type(other).__name__}, not an AllReduceMHC"
        if not isinstance(other.path, FusedPath):
            return "it runs the torch path, which has no workspace"
        if other.group is not self.group:
            return "it belongs to another process group"
        if other.device != self.device:
            return f"it is on {other.device}, this one on {self.device}"
        theirs, mine = other.spec.mailbox_layout(), self.spec.mailbox_layout()
        if theirs != mine:
            return f"its mailboxes are {theirs}, this build needs {mine}"
        if self.config.transport not in ("auto", other.transport):
            return f"its transport is {other.transport}, this build asks for {self.config.transport}"
        return None

    def _build_path(self, backends: tuple[str, ...]):
        if backends == ("torch",):
            return TorchPath(self.spec, self.group)
        if self._shared is not None and isinstance(self._shared.path, FusedPath):
            workspace = self._shared.path.workspace
        else:
            workspace = allocate(self.spec, self.group, self.device, self.config.transport)
        spec = replace(self.spec, transport=workspace.transport)
        with self._on_device():
            kernels = {name: load_backend(name).build(spec, workspace) for name in backends}
        route = None
        if len(backends) > 1:
            def route(call: Call) -> str:
                return self.preset.backend_for(call.variant, call.m) or backends[0]
        return FusedPath("+".join(backends), kernels, workspace, self.thresholds, route)

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # -- calls -------------------------------------------------------------------------------------
    @property
    def transport(self) -> str | None:
        return self.path.spec.transport if isinstance(self.path, FusedPath) else None

    def protocol(self, m: int, finalize: bool = False) -> str:
        """The protocol a call of ``m`` rows takes: "ll" or "bt", "local" in a group of one (no
        all-reduce: one kernel, no mailbox); "gather" on the torch path."""
        if isinstance(self.path, TorchPath):
            return "gather"
        return choose_protocol("finalize" if finalize else "plain", m, self.thresholds, self.spec.protocols)

    def __call__(self, x, residual, post, comb, pre, norm_weight, norm_eps, mxfp8_out=None):
        """Return (post-mixed residual streams, normalized layer input); see the class docstring.
        x [M, H] bf16 TP-partial; residual [M, hc, H] bf16; post [M, hc(, 1)] fp32; comb [M, hc, hc]
        fp32 indexed [source, target]; pre [M, hc] fp32; norm_weight [H] bf16 (both None: residual
        only); mxfp8_out (values [M, H] float8_e4m3fn, scales uint8 of mxfp8_scale_bytes(M, H))."""
        self._ready()
        call = validate.plain_call(self.spec, self.device, x, residual, post, comb, pre, norm_weight, norm_eps,
                                   mxfp8_out)
        return self._run(call)

    def finalize(self, gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx, shared_output, residual,
                 post, comb, pre, norm_weight, norm_eps, mxfp8_out=None):
        """``__call__`` for an unfinalized MoE output: gemm2_permuted [rows, H] bf16, expert_weights
        [M, top_k] fp32, expanded_idx_to_permuted_idx [M, top_k] int32 (-1: route not held here),
        shared_output [M, H] bf16 TP-partial."""
        self._ready()
        call = validate.finalize_call(self.spec, self.device, gemm2_permuted, expert_weights,
                                      expanded_idx_to_permuted_idx, shared_output, residual, post, comb, pre,
                                      norm_weight, norm_eps, mxfp8_out, self.config.check_index_range)
        return self._run(call)

    def check(self) -> None:
        """Raise RuntimeError if a spin loop of an earlier call (eager or replayed in a CUDA graph)
        gave up (spin_timeout_ms). Synchronizes with the device first, so every kernel launched so
        far is covered, except while a CUDA graph is being captured, where it only reads what the
        host sees already. After an error every call and check raises: rebuild on every rank."""
        if self._broken:
            raise RuntimeError(self._broken)
        if self.device.type == "cuda" and not stream_capturing(self.device):
            torch.cuda.synchronize(self.device)
        self._raise_recorded_timeout()

    def _ready(self) -> None:
        """Before a call: raise if the instance is broken or (with the spin bound) if a kernel has
        recorded a timeout the host can see: a read of pinned host memory, no synchronization. A
        call being captured into a CUDA graph looks at nothing (the check belongs to the replay's
        caller, at its next eager call or ``check()``); it keeps the paths the graph will hold alive."""
        if self._broken:
            raise RuntimeError(self._broken)
        if stream_capturing(self.device):
            _retain_for_graphs(self.path, self.check_path)
        elif self.spec.spin_timeout_ns:
            self._raise_recorded_timeout()

    def _raise_recorded_timeout(self) -> None:
        for path in (self.path, self.check_path):
            if isinstance(path, FusedPath):
                try:
                    path.raise_on_timeout()
                except RuntimeError as error:
                    self._broken = str(error)
                    raise

    def _run(self, call: Call):
        with self._on_device():
            self.path.run(call)
            if self.check_path is not None:
                self._cross_check(call)
        residual_out, layer_input, _ = call.outputs
        return residual_out, layer_input

    def _cross_check(self, call: Call) -> None:
        c = call.consumer
        twin = replace(call, consumer=replace(
            c, residual_out=torch.empty_like(c.residual_out),
            layer_input=None if c.layer_input is None else torch.empty_like(c.layer_input),
            mxfp8_values=None if c.mxfp8_values is None else torch.empty_like(c.mxfp8_values),
            mxfp8_scales=None if c.mxfp8_scales is None else torch.empty_like(c.mxfp8_scales)))
        self.check_path.run(twin)
        names = ("residual_out", "layer_input", "mxfp8 values", "mxfp8 scales")
        mine = dict(zip(names, (c.residual_out, c.layer_input, c.mxfp8_values, c.mxfp8_scales)))
        theirs = dict(zip(names, (twin.consumer.residual_out, twin.consumer.layer_input,
                                  twin.consumer.mxfp8_values, twin.consumer.mxfp8_scales)))
        cross_check(self.backend, self.config.cross_check_backend,
                    {k: v for k, v in mine.items() if v is not None}, theirs)
