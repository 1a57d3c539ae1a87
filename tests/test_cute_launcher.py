"""The CuTe DSL launcher's host side without a GPU: every Kernels method assembles exactly the
runtime arguments its kernel was compiled for (same count, order and types as the signature's fake
arguments), with stand-ins for what a specialization never reads. The compiled functions are
replaced by recorders; the kernels themselves run in tests/gpu."""

import pytest
import torch

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed (extra cute-compile)")
pytest.importorskip("flashinfer.quantization.quantization_cute_dsl_utils",
                    reason="flashinfer-python is not installed (extra cute-compile)")

from cutlass import cute  # noqa: E402

from kernels_cute import launcher  # noqa: E402
from lamport_mhc import mxfp8_scale_bytes, validate  # noqa: E402
from lamport_mhc.backend import BuildSpec  # noqa: E402
from lamport_mhc.testing import random_inputs  # noqa: E402
from lamport_mhc.workspace import allocate_host_group  # noqa: E402

H, HC, CAPACITY, TOP_K, TP, EPS = 256, 4, 8, 3, 2, 1e-20


class Recorder:
    """Stands in for a compiled kernel: keeps the fake arguments it was compiled with and the
    arguments of every launch."""

    def __init__(self, kernel, *fake_arguments, options):
        self.fake, self.options, self.launches = fake_arguments, options, []

    def __call__(self, *arguments):
        self.launches.append(arguments)


def _kind(argument):
    """What must match between a compile-time and a run-time argument (a fake stream compiles for
    any CUDA stream)."""
    if isinstance(argument, cute.Tensor):
        return "tensor", argument.element_type
    name = type(argument).__name__
    return "stream" if name in ("CUstream", "_FakeStream") else name


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(launcher.cute, "compile", Recorder)
    monkeypatch.setattr(launcher, "one_kernel_rows", lambda spec, device: spec.ll_one_kernel_rows)
    monkeypatch.setattr(launcher, "current_stream", lambda: launcher.cuda.CUstream(0))
    spec = BuildSpec(hidden=H, hc=HC, capacity=CAPACITY, top_k=TOP_K, tp=TP, rank=0, quantize=True,
                     residual_only=True, bt=True, ll_one_kernel_rows=2)
    workspace = allocate_host_group([spec, BuildSpec(**{**spec.__dict__, "rank": 1})])[0]
    return launcher.CuteKernels(spec, workspace, arch="sm_90a")


def _calls(spec, m):
    """Validated calls of every kind (plain, finalize) with every consumer variant."""
    inputs = random_inputs(TP, m, H, HC, seed=m, top_k=TOP_K)
    cpu = torch.device("cpu")
    mxfp8 = (torch.empty((m, H), dtype=torch.float8_e4m3fn), torch.empty(mxfp8_scale_bytes(m, H), dtype=torch.uint8))
    streams = (inputs["residual"], inputs["post"], inputs["comb"])
    consumers = {"plain": (*streams, inputs["pre"], inputs["norm_weight"], EPS, None),
                 "quant": (*streams, inputs["pre"], inputs["norm_weight"], EPS, mxfp8),
                 "residual": (*streams, None, None, EPS, None)}
    calls = []
    for consumer in consumers.values():
        calls.append(validate.plain_call(spec, cpu, inputs["xs"][0], *consumer))
        calls.append(validate.finalize_call(spec, cpu, inputs["gemm2s"][0], inputs["weights"][0], inputs["idxs"][0],
                                            inputs["shareds"][0], *consumer, check_index_range=True))
    return calls


def test_every_launch_matches_its_compiled_signature(kernels):
    assert all(r.options == "--gpu-arch sm_90a" for r in kernels.compiled.values())
    for m in (1, 5):
        for call in _calls(kernels.spec, m):
            for protocol in ("ll", "bt"):
                if call.kind == "finalize":
                    kernels.finalize_publish(protocol, call.gemm2, call.weights, call.indices, call.shared)
                else:
                    kernels.publish(protocol, call.x)
                kernels.consume(protocol, call.consumer)
            kernels.owner_reduce(m)
            kernels.publish_and_consume(call)
    for name, recorder in kernels.compiled.items():
        assert recorder.launches, f"{name} never launched"
        for arguments in recorder.launches:
            assert [_kind(a) for a in arguments] == [_kind(f) for f in recorder.fake], name


def test_launch_rejects_unknown_arguments_and_interpreted_halves(kernels):
    with pytest.raises(TypeError, match="no argument"):
        kernels._launch("publish_ll", residual=torch.zeros(8, dtype=torch.int16))
    call = _calls(kernels.spec, 1)[0]
    with pytest.raises(ValueError, match="runs whole on a GPU"):
        kernels.publish_and_consume(call, "publish")


def test_one_kernel_rows_count_ctas_not_rows(monkeypatch):
    class Properties:
        multi_processor_count = 132

    monkeypatch.setattr(launcher.torch.cuda, "get_device_properties", lambda device: Properties)
    spec = BuildSpec(hidden=5120, hc=HC, capacity=1024, top_k=TOP_K, tp=TP, rank=0, ll_one_kernel_rows=132)
    assert launcher.one_kernel_rows(spec, torch.device("cuda", 0)) == 26  # 5 CTAs per token
    assert launcher.one_kernel_rows(BuildSpec(**{**spec.__dict__, "hidden": 1024}), None) == 132
    assert launcher.one_kernel_rows(BuildSpec(**{**spec.__dict__, "ll_one_kernel_rows": 0}), None) == 0
