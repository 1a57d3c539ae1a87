"""The benchmark's FlashInfer and torch peers on CPU with stand-ins for flashinfer-python and the
process group: argument plumbing, one workspace per hidden size reused for every M, JIT modules
built once (rank 0 first), and peers that cannot run reported as skipped rows, never raised."""

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from lamport_mhc.bench import Ceilings
from lamport_mhc.bench.flashinfer_peers import FlashInferPeers
from lamport_mhc.bench.sweep import Sweep

H, CAP = 256, 16


class FakeColl:
    """A process group of ``tp`` ranks seen from ``rank``: every rank gathers the same objects."""

    def __init__(self, tp=2, rank=0):
        self.tp, self.rank, self.group = tp, rank, SimpleNamespace(group_name="fake")
        self.barriers = 0

    def all_gather_object(self, obj):
        return [obj] * self.tp

    def barrier(self):
        self.barriers += 1


class FakeFlashInfer:
    """flashinfer, flashinfer.comm (+ trtllm_ar, vllm_ar, cuda_ipc) recording every call."""

    def __init__(self, build_error=None):
        self.calls: list[tuple[str, tuple, dict]] = []
        self.build_error = build_error

        def recorder(name, result=None):
            def fn(*args, **kwargs):
                self.calls.append((name, args, kwargs))
                return result() if callable(result) else result
            return fn

        def build(name):
            def fn():
                self.calls.append((name, (), {}))
                if self.build_error:
                    raise RuntimeError(self.build_error)
            return fn

        comm = types.ModuleType("flashinfer.comm")
        comm.AllReduceFusionPattern = SimpleNamespace(kAllReduce=0, kARResidualRMSNorm=1, kMoEFinalizeARResidualRMSNorm=7)
        comm.trtllm_create_ipc_workspace_for_all_reduce_fusion = recorder(
            "create_workspace", lambda: ([[1, 2], [3, 4], [5, 6]], torch.arange(7), {"max_token_num": CAP}))
        comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion = recorder("destroy_workspace")
        comm.trtllm_allreduce_fusion = recorder("trtllm_allreduce_fusion")
        comm.trtllm_moe_finalize_allreduce_fusion = recorder("trtllm_moe_finalize_allreduce_fusion")
        comm.vllm_meta_size = lambda: 1000
        shared = iter(range(100, 1000, 10))
        comm.create_shared_buffer = recorder("create_shared_buffer", lambda: [next(shared), next(shared)])
        comm.free_shared_buffer = recorder("free_shared_buffer")
        comm.vllm_init_custom_ar = recorder("vllm_init_custom_ar", 77)
        comm.vllm_register_buffer = recorder("vllm_register_buffer")
        comm.vllm_all_reduce = recorder("vllm_all_reduce")
        comm.vllm_get_graph_buffer_ipc_meta = recorder("vllm_get_graph_buffer_ipc_meta", ([1, 2, 3], [0]))
        comm.vllm_register_graph_buffers = recorder("vllm_register_graph_buffers")
        comm.vllm_dispose = recorder("vllm_dispose")
        comm.trtllm_ar = types.ModuleType("flashinfer.comm.trtllm_ar")
        comm.trtllm_ar.get_trtllm_comm_module = build("build trtllm_comm")
        comm.vllm_ar = types.ModuleType("flashinfer.comm.vllm_ar")
        comm.vllm_ar.get_vllm_comm_module = build("build vllm_comm")
        comm.cuda_ipc = types.ModuleType("flashinfer.comm.cuda_ipc")
        comm.cuda_ipc.cudart = SimpleNamespace(cudaMemset=recorder("cudaMemset"))
        package = types.ModuleType("flashinfer")
        package.comm = comm
        self.modules = {"flashinfer": package, "flashinfer.comm": comm, "flashinfer.comm.trtllm_ar": comm.trtllm_ar,
                        "flashinfer.comm.vllm_ar": comm.vllm_ar, "flashinfer.comm.cuda_ipc": comm.cuda_ipc}

    def install(self, monkeypatch):
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return self

    def named(self, name):
        return [(args, kwargs) for n, args, kwargs in self.calls if n == name]


def test_trtllm_all_reduce_plumbing_and_one_workspace_per_hidden(monkeypatch):
    fake = FakeFlashInfer().install(monkeypatch)
    peers = FlashInferPeers(FakeColl(tp=2, rank=1), log=lambda _: None)
    assert peers.reason("flashinfer_all_reduce") is None
    peer = peers.make("flashinfer_all_reduce", CAP, H, "cpu")
    for m in (1, 5, CAP):
        x = torch.zeros(m, H, dtype=torch.bfloat16)
        out = peer(x)
        assert out.shape == (m, H)
        _, kwargs = fake.named("trtllm_allreduce_fusion")[-1]
        assert kwargs["allreduce_in"] is x and kwargs["allreduce_out"].data_ptr() == out.data_ptr()
        assert (kwargs["token_num"], kwargs["hidden_dim"], kwargs["world_size"], kwargs["world_rank"]) == (m, H, 2, 1)
        assert kwargs["pattern_code"] == 0 and kwargs["use_oneshot"] is None and kwargs["fp32_acc"] is True
        assert kwargs["residual_in"] is None and kwargs["norm_out"] is None
        assert torch.equal(kwargs["workspace_ptrs"], torch.arange(7)) and kwargs["metadata"] == {"max_token_num": CAP}
    (args, kwargs), = fake.named("create_workspace")  # one workspace for every M
    assert args == (1, 2, CAP, H) and kwargs["create_metadata"] and kwargs["use_symm_dev_mem"] is False
    # Built once, rank 0 first: this rank (1) builds after rank 0 reported, then both agree.
    assert len(fake.named("build trtllm_comm")) == 1 and peers.reason("flashinfer_all_reduce") is None
    assert len(fake.named("build trtllm_comm")) == 1
    peer.close()
    assert fake.named("destroy_workspace")[0][0][0] == [[1, 2], [3, 4], [5, 6]]


def test_trtllm_fusion_plain_and_finalize(monkeypatch):
    fake = FakeFlashInfer().install(monkeypatch)
    peers = FlashInferPeers(FakeColl(tp=2), log=lambda _: None)
    oneshot = peers.make("flashinfer-fusion-oneshot", CAP, H, "cpu")
    twoshot = peers.make("flashinfer-fusion-twoshot", CAP, H, "cpu")
    assert len(fake.named("create_workspace")) == 2 and len(fake.named("build trtllm_comm")) == 1
    x, residual, gamma = (torch.zeros(4, H, dtype=torch.bfloat16) for _ in range(3))
    out_residual, out_norm = torch.empty_like(x), torch.empty_like(x)
    oneshot.plain(x, residual, gamma[0], 1e-6, out_residual, out_norm)
    twoshot.plain(x, residual, gamma[0], 1e-6, out_residual, out_norm)
    (_, one), (_, two) = fake.named("trtllm_allreduce_fusion")
    assert one["pattern_code"] == two["pattern_code"] == 1
    assert one["use_oneshot"] is True and two["use_oneshot"] is False
    assert one["residual_in"] is residual and one["residual_out"] is out_residual and one["norm_out"] is out_norm
    assert one["rms_eps"] == 1e-6 and one["allreduce_out"] is None and one["quant_out"] is None
    gemm2, weights = torch.zeros(9, H, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.bfloat16)
    indices = torch.full((4, 3), -1, dtype=torch.int32)
    oneshot.finalize(gemm2, weights, indices, x, residual, gamma[0], 1e-6, out_residual, out_norm)
    (_, fin), = fake.named("trtllm_moe_finalize_allreduce_fusion")
    assert fin["allreduce_in"] is gemm2 and fin["expanded_idx_to_permuted_idx"] is indices
    assert fin["expert_scale_factor"] is weights and fin["shared_expert_output"] is x
    assert (fin["world_size"], fin["world_rank"], fin["eps"]) == (2, 0, 1e-6)
    assert oneshot.skip_reason("plain", 1) is None and oneshot.skip_reason("finalize", 1) is None
    assert "M > 2" in twoshot.skip_reason("plain", 2) and twoshot.skip_reason("plain", 3) is None
    assert "one-shot only" in twoshot.skip_reason("finalize", 64)
    assert "MXFP8" in oneshot.skip_reason("quant", 64)


def test_vllm_custom_all_reduce_registers_graph_buffers(monkeypatch):
    fake = FakeFlashInfer().install(monkeypatch)
    coll = FakeColl(tp=2, rank=1)
    peer = FlashInferPeers(coll, log=lambda _: None).make("vllm_custom_all_reduce", CAP, H, "cpu")
    meta, buffers = fake.named("create_shared_buffer")
    assert meta[0] == (1000 + CAP * H * 2,) and buffers[0] == (CAP * H * 2,)
    (memset_args, _), = fake.named("cudaMemset")
    assert memset_args[0].value == 110 and memset_args[2] == 1000 + CAP * H * 2  # this rank's meta buffer, zeroed
    (init_args, _), = fake.named("vllm_init_custom_ar")
    assert init_args[0] == [100, 110] and init_args[2:] == (1, True)
    assert fake.named("vllm_register_buffer")[0][0] == (77, [120, 130])
    x = torch.zeros(3, H, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    peer(x)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    peer(x)
    eager, captured = fake.named("vllm_all_reduce")
    assert eager[0][:2] == (77, x) and eager[0][3:] == (130, CAP * H * 2, 36)  # staged in the registered buffer
    assert captured[0][3] == 0  # captured: x in place, registered after capture
    peer.after_capture()
    (args, _), = fake.named("vllm_register_graph_buffers")
    assert args == (77, [[1, 2, 3], [1, 2, 3]], [[0], [0]])
    peer.close()
    assert fake.named("vllm_dispose")[0][0] == (77,) and len(fake.named("free_shared_buffer")) == 2


def test_peers_that_cannot_run_say_why(monkeypatch):
    fake = FakeFlashInfer().install(monkeypatch)
    alone = FlashInferPeers(FakeColl(tp=1), log=lambda _: None)
    assert "refuses a group of 1" in alone.reason("flashinfer-fusion-oneshot")
    assert "tp in 2, 4, 6, 8" in alone.reason("vllm_custom_all_reduce")
    assert fake.calls == []  # a group of one imports and builds nothing
    odd = FlashInferPeers(FakeColl(tp=3), log=lambda _: None)
    assert "refuses a group of 3" in odd.reason("flashinfer_all_reduce")

    broken = FakeFlashInfer(build_error="nvcc not found").install(monkeypatch)
    peers = FlashInferPeers(FakeColl(tp=2), log=lambda _: None)
    reason = peers.reason("flashinfer_all_reduce")
    assert reason == "building FlashInfer's trtllm_comm module failed (rank 0: RuntimeError: nvcc not found)"
    assert peers.reason("flashinfer-fusion-twoshot") == reason and len(broken.named("build trtllm_comm")) == 1
    with pytest.raises(RuntimeError, match="cannot run here"):
        peers.make("flashinfer_all_reduce", CAP, H, "cpu")

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed
    missing = FlashInferPeers(FakeColl(tp=2), log=lambda _: None)
    assert "flashinfer-python cannot be imported" in missing.reason("vllm_custom_all_reduce")


def _cpu_sweep(tmp_path, tp=2):
    """A Sweep over a stand-in group of ``tp`` ranks on the CPU: only its setup and reports run."""
    args = SimpleNamespace(paths=None, hc=4, rows=[1, 2, 4], variants=["plain"], calls=50, replays=5,
                           hidden=[H], merge=None, top_k=2, backends=["triton"], compile_tail=False)
    sweep = Sweep.__new__(Sweep)
    sweep.args, sweep.device, sweep.coll = args, torch.device("cpu"), FakeColl(tp=tp)
    sweep.tp, sweep.rank, sweep.hc, sweep.rows_m = tp, 0, 4, [1, 2, 4]
    sweep.rows, sweep.notes, sweep.skips = [], [], {}
    sweep.flashinfer = FlashInferPeers(sweep.coll, log=sweep.log)
    sweep.deadline, sweep.stopped = None, False
    return sweep


def test_sweep_reports_missing_peers_as_skipped_rows(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    sweep = _cpu_sweep(tmp_path)
    peers = sweep._allreduce_peers(H, 4)
    assert list(peers) == ["nccl_all_reduce"]  # no symmetric memory on a CPU, no FlashInfer
    sweep.skip(H, "plain", "two_shot_all_reduce", "needs more rows", 1)
    sweep.skip(H, "plain", "two_shot_all_reduce", "needs more rows", 2)
    sweep.finish(tmp_path, "cpu", Ceilings(None, 1000.0))
    summary = (tmp_path / "cpu_tp2.md").read_text()
    assert "## Skipped" in summary and "| 4 | 256 | plain | two_shot_all_reduce | 1-2 | needs more rows |" in summary
    for path in ("flashinfer_all_reduce", "vllm_custom_all_reduce", "one_shot_all_reduce"):
        assert f"| 4 | 256 | plain | {path} | all |" in summary
    assert "flashinfer-python cannot be imported" in summary and "symmetric memory is unavailable" in summary
    notes = json.loads((tmp_path / "cpu_tp2_notes.json").read_text())
    assert {n["skipped"]["path"] for n in notes if "skipped" in n} == {
        "flashinfer_all_reduce", "vllm_custom_all_reduce", "one_shot_all_reduce", "two_shot_all_reduce"}
    assert "no peer copy (a group of one), device copy 1000 GB/s" in summary


def test_sweep_on_one_gpu_skips_what_needs_peers(monkeypatch, tmp_path):
    fake = FakeFlashInfer().install(monkeypatch)
    sweep = _cpu_sweep(tmp_path, tp=1)
    sweep.args.paths = ["flashinfer_all_reduce", "vllm_custom_all_reduce", "unfused-best"]
    assert sweep._allreduce_peers(H, 4) == {}  # unfused-best needs no all-reduce in a group of one
    reasons = {key[2]: key[3] for key in sweep.skips}
    assert "refuses a group of 1" in reasons["flashinfer_all_reduce"] and fake.calls == []
    assert "tp in 2, 4, 6, 8" in reasons["vllm_custom_all_reduce"]
