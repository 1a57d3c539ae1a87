"""FlashInfer's Hopper all-reduce kernels (flashinfer-python 0.7.2) as benchmark peers.

- ``flashinfer_all_reduce``: the TRT-LLM Lamport all-reduce ``trtllm_allreduce_fusion`` with the
  kAllReduce pattern (one-shot or two-shot by FlashInfer's own heuristic), fp32 accumulation.
- ``flashinfer-fusion-oneshot`` / ``-twoshot``: the same kernels fused with residual add and
  RMSNorm (kARResidualRMSNorm), which is this library's op at hc = 1 with post = comb = pre = 1;
  for finalize, ``trtllm_moe_finalize_allreduce_fusion`` (kMoEFinalizeARResidualRMSNorm), one-shot
  only.
- ``vllm_custom_all_reduce``: vLLM's custom all-reduce (``flashinfer.comm.vllm_ar``) as vLLM runs it
  in CUDA graphs: eager calls go through its registered buffer, captured calls read the input in
  place and the buffers a graph captured are registered on every rank before its first replay.

Their kernels are JIT-built from ``flashinfer/data`` on first use (``trtllm_comm`` takes minutes):
rank 0 builds, the others wait and load the built module. FlashInfer keeps built modules under
``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`` (``bench --flashinfer-cache DIR`` sets it), so a
folder carried from one run to the next saves the build. Workspaces are created once per hidden
size, sized for the sweep's largest M, and reused for every M. A peer that cannot run here (not
installed, a group size it refuses, a failed build) is reported with its reason, never raised.
"""

from __future__ import annotations

import ctypes
import os

import torch

from .collective import agree, attempt

TRTLLM_TP = (2, 4, 8, 16)
VLLM_TP = (2, 4, 6, 8)
VLLM_NUM_CTAS = 36  # the most its kernels take (vLLM's default block limit)
VLLM_RANK_DATA_BYTES = 8 << 20
TRTLLM_PATHS = ("flashinfer_all_reduce", "flashinfer-fusion-oneshot", "flashinfer-fusion-twoshot")
VLLM_PATHS = ("vllm_custom_all_reduce",)
PATHS = TRTLLM_PATHS + VLLM_PATHS


class FlashInferAPI:
    """The functions of flashinfer-python this module calls, imported once."""

    def __init__(self):
        import flashinfer.comm as comm
        from flashinfer.comm import cuda_ipc, trtllm_ar, vllm_ar

        self.comm, self.trtllm_ar, self.vllm_ar, self.cudart = comm, trtllm_ar, vllm_ar, cuda_ipc.cudart

    def build(self, kind: str) -> None:
        """Build (or find built) and load one JIT module: "trtllm" (trtllm_comm) or "vllm" (vllm_comm)."""
        os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))  # ninja's parallelism for the build
        if kind == "trtllm":
            self.trtllm_ar.get_trtllm_comm_module()
        else:
            self.vllm_ar.get_vllm_comm_module()

    def zero(self, pointer: int, nbytes: int) -> None:
        self.cudart.cudaMemset(ctypes.c_void_p(pointer), 0, nbytes)


class FlashInferPeers:
    """Decides once per sweep whether each FlashInfer peer can run, and makes them per hidden size."""

    def __init__(self, coll, log=print, api_factory=FlashInferAPI):
        self.coll, self.log, self.api_factory = coll, log, api_factory
        self.api: FlashInferAPI | None = None
        self._import_reason: str | None = None
        self._imported = False
        self._built: dict[str, str | None] = {}

    @staticmethod
    def kind(path: str) -> str:
        if path in TRTLLM_PATHS:
            return "trtllm"
        if path in VLLM_PATHS:
            return "vllm"
        raise ValueError(f"not a FlashInfer peer: {path!r}")

    def reason(self, path: str) -> str | None:
        """Why ``path`` cannot run in this sweep, or None. The first question about a kind imports
        FlashInfer and builds that kind's module (collective: every rank must ask the same)."""
        kind, tp = self.kind(path), self.coll.tp
        if kind == "trtllm" and tp not in TRTLLM_TP:
            return (f"trtllm_allreduce_fusion refuses a group of {tp} (it runs with tp in "
                    f"{', '.join(map(str, TRTLLM_TP))})")
        if kind == "vllm" and tp not in VLLM_TP:
            return f"vLLM's custom all-reduce runs with tp in {', '.join(map(str, VLLM_TP))}, not {tp}"
        if not self._imported:
            self._imported = True
            holder: dict = {}
            error = attempt(lambda: holder.update(api=self.api_factory()))
            self._import_reason = agree(self.coll, error)
            if self._import_reason is None:
                self.api = holder["api"]
            else:
                self._import_reason = f"flashinfer-python cannot be imported ({self._import_reason})"
        if self._import_reason is not None:
            return self._import_reason
        if kind not in self._built:
            self._built[kind] = self._build(kind)
        return self._built[kind]

    def _build(self, kind: str) -> str | None:
        label = {"trtllm": "trtllm_comm", "vllm": "vllm_comm"}[kind]
        if self.coll.rank == 0:
            self.log(f"FlashInfer {label}: building or loading the JIT module (the first build takes minutes)")
        failed = agree(self.coll, attempt(lambda: self.api.build(kind)) if self.coll.rank == 0 else None)
        if failed is not None:
            return f"building FlashInfer's {label} module failed ({failed})"
        failed = agree(self.coll, attempt(lambda: self.api.build(kind)) if self.coll.rank != 0 else None)
        if failed is not None:
            return f"loading FlashInfer's {label} module failed ({failed})"
        return None

    def make(self, path: str, capacity: int, hidden: int, device):
        """The peer for ``path`` at this hidden size (its workspace created now, collectively)."""
        if self.reason(path) is not None:
            raise RuntimeError(f"{path} cannot run here: {self.reason(path)}")
        if path == "flashinfer_all_reduce":
            return TrtllmAllReduce(self.api, self.coll, capacity, hidden, device)
        if path in TRTLLM_PATHS:
            return TrtllmFusion(self.api, self.coll, capacity, hidden, oneshot=path.endswith("oneshot"))
        return VllmCustomAllReduce(self.api, self.coll, capacity, hidden, device)


class TrtllmWorkspace:
    """TRT-LLM's Lamport workspace (torch symmetric memory, peer stores only) for up to ``capacity``
    rows of ``hidden``."""

    def __init__(self, api: FlashInferAPI, coll, capacity: int, hidden: int):
        self.api, self.coll = api, coll
        self.ipc_handles, self.tensor, self.metadata = api.comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            coll.rank, coll.tp, capacity, hidden, group=coll.group, create_metadata=True, use_symm_dev_mem=False)

    def close(self) -> None:
        self.api.comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self.ipc_handles, self.coll.group)


class TrtllmAllReduce:
    """``flashinfer_all_reduce``: kAllReduce into a buffer this peer owns."""

    name = "flashinfer_all_reduce"

    def __init__(self, api: FlashInferAPI, coll, capacity: int, hidden: int, device):
        self.api, self.coll, self.hidden = api, coll, hidden
        self.workspace = TrtllmWorkspace(api, coll, capacity, hidden)
        self.out = torch.empty((capacity, hidden), dtype=torch.bfloat16, device=device)

    def skip_reason(self, m: int) -> str | None:
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        out = self.out[:m]
        self.api.comm.trtllm_allreduce_fusion(
            allreduce_in=x, world_size=self.coll.tp, world_rank=self.coll.rank, token_num=m, hidden_dim=self.hidden,
            workspace_ptrs=self.workspace.tensor, launch_with_pdl=True, trigger_completion_at_end=True, fp32_acc=True,
            pattern_code=self.api.comm.AllReduceFusionPattern.kAllReduce, use_oneshot=None, allreduce_out=out,
            residual_in=None, residual_out=None, norm_out=None, quant_out=None, scale_out=None, rms_gamma=None,
            rms_eps=None, scale_factor=None, layout_code=None, metadata=self.workspace.metadata)
        return out

    def after_capture(self) -> None:
        pass

    def close(self) -> None:
        self.workspace.close()


class TrtllmFusion:
    """``flashinfer-fusion-oneshot`` / ``-twoshot``: all-reduce + residual add + RMSNorm in one kernel
    (the op at hc = 1), and the MoE-finalize fusion for finalize calls."""

    def __init__(self, api: FlashInferAPI, coll, capacity: int, hidden: int, oneshot: bool):
        self.api, self.coll, self.hidden, self.oneshot = api, coll, hidden, oneshot
        self.name = f"flashinfer-fusion-{'oneshot' if oneshot else 'twoshot'}"
        self.workspace = TrtllmWorkspace(api, coll, capacity, hidden)

    def skip_reason(self, variant: str, m: int) -> str | None:
        if variant == "quant":
            return "FlashInfer's all-reduce fusion has no MXFP8 output pattern"
        if variant == "finalize" and not self.oneshot:
            return "FlashInfer's MoE-finalize fusion is one-shot only"
        if variant == "plain" and not self.oneshot and m <= self.coll.tp:
            return f"two-shot needs more rows than ranks (M > {self.coll.tp})"
        return None

    def plain(self, x, residual_in, gamma, eps: float, residual_out, norm_out) -> None:
        m = x.shape[0]
        self.api.comm.trtllm_allreduce_fusion(
            allreduce_in=x, world_size=self.coll.tp, world_rank=self.coll.rank, token_num=m, hidden_dim=self.hidden,
            workspace_ptrs=self.workspace.tensor, launch_with_pdl=True, trigger_completion_at_end=True, fp32_acc=True,
            pattern_code=self.api.comm.AllReduceFusionPattern.kARResidualRMSNorm, use_oneshot=self.oneshot,
            allreduce_out=None, residual_in=residual_in, residual_out=residual_out, norm_out=norm_out, quant_out=None,
            scale_out=None, rms_gamma=gamma, rms_eps=eps, scale_factor=None, layout_code=None,
            metadata=self.workspace.metadata)

    def finalize(self, gemm2, expert_scales, indices, shared, residual_in, gamma, eps: float, residual_out,
                 norm_out) -> None:
        """``expert_scales``: the router weights in bf16 (the kernel reads them as the activation type)."""
        self.api.comm.trtllm_moe_finalize_allreduce_fusion(
            allreduce_in=gemm2, residual_in=residual_in, norm_weight=gamma, expanded_idx_to_permuted_idx=indices,
            norm_out=norm_out, residual_out=residual_out, quant_out=None, scale_out=None,
            workspace_ptrs=self.workspace.tensor, launch_with_pdl=True, world_rank=self.coll.rank,
            world_size=self.coll.tp, eps=eps, shared_expert_output=shared, expert_scale_factor=expert_scales,
            routed_scaling_factor=None)

    def after_capture(self) -> None:
        pass

    def close(self) -> None:
        self.workspace.close()


class VllmCustomAllReduce:
    """``vllm_custom_all_reduce``: IPC buffers (signals + scratch, and the registered input buffer)
    for up to ``capacity`` rows of ``hidden``; every rank's handle opened once."""

    name = "vllm_custom_all_reduce"

    def __init__(self, api: FlashInferAPI, coll, capacity: int, hidden: int, device):
        comm = api.comm
        self.api, self.coll, self.device = api, coll, torch.device(device)
        self.max_bytes = capacity * hidden * 2
        meta_bytes = comm.vllm_meta_size() + self.max_bytes
        self.meta_ptrs = comm.create_shared_buffer(meta_bytes, group=coll.group)
        api.zero(self.meta_ptrs[coll.rank], meta_bytes)  # the signal flags must start at 0 on every rank
        self.buffer_ptrs = comm.create_shared_buffer(self.max_bytes, group=coll.group)
        self.rank_data = torch.empty(VLLM_RANK_DATA_BYTES, dtype=torch.uint8, device=device)
        self._synchronize()
        coll.barrier()
        self.handle = comm.vllm_init_custom_ar(self.meta_ptrs, self.rank_data, coll.rank, True)
        comm.vllm_register_buffer(self.handle, self.buffer_ptrs)
        self.out = torch.empty((capacity, hidden), dtype=torch.bfloat16, device=device)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def skip_reason(self, m: int) -> str | None:
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.out[:x.shape[0]]
        # Captured: x itself (registered after capture); eager: copied into the registered buffer.
        staged = 0 if torch.cuda.is_current_stream_capturing() else self.buffer_ptrs[self.coll.rank]
        self.api.comm.vllm_all_reduce(self.handle, x, out, staged, self.max_bytes, VLLM_NUM_CTAS)
        return out

    def after_capture(self) -> None:
        """Register, on every rank, the input buffers the graph just captured."""
        comm = self.api.comm
        handles, offsets = comm.vllm_get_graph_buffer_ipc_meta(self.handle)
        everyone = self.coll.all_gather_object((handles, offsets))
        comm.vllm_register_graph_buffers(self.handle, [h for h, _ in everyone], [o for _, o in everyone])

    def close(self) -> None:
        comm = self.api.comm
        self._synchronize()
        comm.vllm_dispose(self.handle)
        comm.free_shared_buffer(self.buffer_ptrs, self.coll.group)
        comm.free_shared_buffer(self.meta_ptrs, self.coll.group)
