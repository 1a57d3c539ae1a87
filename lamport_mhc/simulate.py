"""A TP group in one process: the backend's real kernels over shared host mailboxes.

Each simulated rank has its own workspace (host twins of the symmetric buffers, with tables of host
addresses) and its own compiled-for-the-interpreter kernels. A call launches in protocol order,
every rank's publish, then (BT) every rank's owner reduce, then every rank's consumer, so every spin
loop finds its data; a kernel that still finds a slot empty records a timeout, raised here as
RuntimeError instead of hanging. Generations persist across calls, as on the GPU.

With ``device="cuda"`` the same group lives in one GPU's memory and runs the compiled kernels
(Triton or CuTe DSL) in the same order on one stream: every protocol of a tp-rank group, checked on
a machine with one GPU. There LL's one-kernel form is off (its halves launch separately only under
the interpreter) and every spin loop is bounded, so a protocol bug is an error, not a hang.
"""

from __future__ import annotations

import torch

from . import validate
from .backend import BuildSpec, load_backend
from .call import Call
from .mxfp8 import mxfp8_scale_bytes
from .paths import FusedPath, TorchPath
from .selector import Thresholds, mailbox_rows
from .workspace import allocate_host_group

SIMULATED_BACKENDS = ("triton", "torch")
GPU_BACKENDS = ("triton", "cute", "torch")
GPU_SPIN_TIMEOUT_NS = 1_000_000_000  # every slot a kernel polls was written before it launched


class SimulatedGroup:
    def __init__(self, tp: int, *, hidden_size: int, hc_mult: int, max_num_tokens: int, top_k: int,
                 backend: str = "triton", quantize_layer_input: bool = False, residual_only: bool = False,
                 bt_min_rows: int | None = None, bt_min_finalize_rows: int | None = None,
                 ll_one_kernel_rows: int | None = None, split_rows: int | None = None, chunk_rows: int | None = None,
                 share_workspaces_with: SimulatedGroup | None = None, device="cpu"):
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp must be a positive int, got {tp!r}")
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        if on_gpu and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if backend not in (GPU_BACKENDS if on_gpu else SIMULATED_BACKENDS):
            raise ValueError(f"the simulated group runs {SIMULATED_BACKENDS} on the CPU (CuTe DSL kernels need a GPU) "
                             f"and {GPU_BACKENDS} on a GPU, got {backend!r}")
        if on_gpu and ll_one_kernel_rows:
            raise ValueError("on a GPU the simulated group cannot run LL's one-kernel form (its publish and consume "
                             "halves launch separately only under the interpreter): pass ll_one_kernel_rows=0")
        validate.check_build(hidden_size, hc_mult, max_num_tokens, top_k, quantize_layer_input)
        for name, value in (("bt_min_rows", bt_min_rows), ("bt_min_finalize_rows", bt_min_finalize_rows)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        # ll_one_kernel_rows: LL calls of at most this many rows take the one-kernel form, launched
        # as its publish and consume halves (None: every LL call; 0: none).
        if ll_one_kernel_rows is not None and (not isinstance(ll_one_kernel_rows, int) or ll_one_kernel_rows < 0):
            raise ValueError(f"ll_one_kernel_rows must be an int >= 0 or None, got {ll_one_kernel_rows!r}")
        # split_rows: calls of at most this many rows take the kernels' latency forms (a token spread
        # over several programs, for rows of several chunks); None: never.
        if split_rows is not None and (not isinstance(split_rows, int) or split_rows < 0):
            raise ValueError(f"split_rows must be an int >= 0 or None, got {split_rows!r}")
        # Without thresholds the simulated group runs LL only (there is no machine to measure).
        never = max_num_tokens + 1
        self.thresholds = Thresholds(bt_min_rows or never, bt_min_finalize_rows or never)
        self.tp = tp
        self.backend = backend
        if on_gpu:
            ll_one_kernel_rows = 0
        # chunk_rows: calls of more rows go through in parts (AllReduceMHCConfig.chunk_rows).
        rows = mailbox_rows(tp, max_num_tokens, self.thresholds, chunk_rows, quantize_layer_input)
        largest_ll = rows.get("ll_rows") or max_num_tokens
        self.specs = [BuildSpec(hidden=hidden_size, hc=hc_mult, capacity=max_num_tokens, top_k=top_k, tp=tp,
                                rank=rank, quantize=quantize_layer_input, residual_only=residual_only, **rows,
                                ll_one_kernel_rows=largest_ll if ll_one_kernel_rows is None
                                else min(largest_ll, ll_one_kernel_rows),
                                split_rows=split_rows, spin_timeout_ns=GPU_SPIN_TIMEOUT_NS if on_gpu else 0)
                      for rank in range(tp)]
        # share_workspaces_with: another group of the same ranks whose calls this one's interleave with
        # (AllReduceMHC's share_workspace_with): one set of mailboxes and generation words.
        if share_workspaces_with is not None:
            theirs, mine = share_workspaces_with.specs[0].mailbox_layout(), self.specs[0].mailbox_layout()
            if theirs != mine or share_workspaces_with.device != self.device:
                raise ValueError(f"cannot share the workspaces of a group with mailboxes {theirs} on "
                                 f"{share_workspaces_with.device}: this one needs {mine} on {self.device}")
            self.workspaces = share_workspaces_with.workspaces
        else:
            self.workspaces = allocate_host_group(self.specs, self.device)
        if backend == "torch":
            self.paths = None
        else:
            kernel_backend = load_backend(backend)
            self.paths = [FusedPath(f"simulated {backend}",
                                    {backend: kernel_backend.build(spec, ws, interpret=not on_gpu)}, ws,
                                    self.thresholds)
                          for spec, ws in zip(self.specs, self.workspaces)]

    # -- calls -------------------------------------------------------------------------------------
    def all_reduce_mhc(self, xs, residual, post, comb, pre, norm_weight, norm_eps, mxfp8=False):
        """Per-rank lists in (``xs`` and every per-token input may be one tensor shared by all
        ranks or a list of tp tensors); a list of per-rank (residual_out, layer_input, mxfp8) out."""
        self._check_list("xs", xs)
        calls = [validate.plain_call(spec, self.device, xs[r], *self._consumer_inputs(
                 r, residual, post, comb, pre, norm_weight, norm_eps, mxfp8, xs[r].shape[0]))
                 for r, spec in enumerate(self.specs)]
        return self._run(calls)

    def finalize(self, gemm2s, weights, idxs, shareds, residual, post, comb, pre, norm_weight, norm_eps,
                 mxfp8=False):
        for name, value in (("gemm2s", gemm2s), ("weights", weights), ("idxs", idxs), ("shareds", shareds)):
            self._check_list(name, value)
        calls = [validate.finalize_call(spec, self.device, gemm2s[r], weights[r], idxs[r], shareds[r],
                                        *self._consumer_inputs(r, residual, post, comb, pre, norm_weight,
                                                               norm_eps, mxfp8, shareds[r].shape[0]),
                                        check_index_range=True)
                 for r, spec in enumerate(self.specs)]
        return self._run(calls)

    # -- internals ---------------------------------------------------------------------------------
    def _check_list(self, name, value) -> None:
        if not isinstance(value, (list, tuple)) or len(value) != self.tp:
            raise ValueError(f"{name} must be a list of {self.tp} per-rank tensors")

    def _consumer_inputs(self, rank, residual, post, comb, pre, norm_weight, norm_eps, mxfp8, m):
        def per_rank(value):
            return value[rank] if isinstance(value, (list, tuple)) else value
        mxfp8_out = None
        if mxfp8:
            h = self.specs[0].hidden
            mxfp8_out = (torch.empty((m, h), dtype=torch.float8_e4m3fn, device=self.device),
                         torch.empty(mxfp8_scale_bytes(m, h), dtype=torch.uint8, device=self.device))
            # Poison: every byte the consumer must write is overwritten.
            mxfp8_out[0].view(torch.uint8).fill_(0xA5)
            mxfp8_out[1].fill_(0xA5)
        return (per_rank(residual), per_rank(post), per_rank(comb), per_rank(pre), per_rank(norm_weight),
                norm_eps, mxfp8_out)

    def _run(self, calls: list[Call]):
        if self.paths is None:
            contributions = [TorchPath(spec, None).contribution(call) for spec, call in zip(self.specs, calls)]
            for call in calls:
                TorchPath.apply(contributions, call)
            return [call.outputs for call in calls]
        for parts in zip(*(path.parts(call) for path, call in zip(self.paths, calls))):
            protocol = self.paths[0].protocol(parts[0])
            for step in ("publish", "reduce", "consume"):
                for path, part in zip(self.paths, parts):
                    getattr(path, step)(part, protocol)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the timeout records are the kernels' to write
                for path in self.paths:
                    path.raise_on_timeout()
        return [call.outputs for call in calls]

    def generation_state(self) -> list[dict[str, list[int]]]:
        """Each rank's [next, active, arrived] per protocol (for tests of the generation rotation)."""
        return [{"ll": ws.ll_state.tolist(), **({"bt": ws.bt_state.tolist()} if ws.bt_state is not None else {})}
                for ws in self.workspaces]
