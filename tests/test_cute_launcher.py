"""The CuTe DSL launcher's host side without a GPU: every Kernels method assembles exactly the
runtime arguments its kernel was compiled for (same count, order and types as the signature's fake
arguments), with stand-ins for what a specialization never reads, and each consumer launch takes
the form its rows call for (cluster up to ``split_rows``, streaming above). The compiled functions
are replaced by recorders; the kernels themselves run in tests/gpu."""

import pytest
import torch

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed (extra cute-compile)")
pytest.importorskip("flashinfer.quantization.quantization_cute_dsl_utils",
                    reason="flashinfer-python is not installed (extra cute-compile)")

from cutlass import cute  # noqa: E402

from kernels_cute import launcher  # noqa: E402
from kernels_cute.plan import LOCAL_SIGNATURE  # noqa: E402
from lamport_mhc import mxfp8_scale_bytes, validate  # noqa: E402
from lamport_mhc.backend import BuildSpec  # noqa: E402
from lamport_mhc.testing import random_inputs  # noqa: E402
from lamport_mhc.traffic import STREAMED_ROWS  # noqa: E402
from lamport_mhc.workspace import allocate_host_group  # noqa: E402

H, HC, CAPACITY, TOP_K, TP, EPS = 256, 4, 8, 3, 2, 1e-20
SPLIT = 2  # rows up to which the consumers take the cluster form in these builds (SIZES cross it)
SIZES = (1, SPLIT, SPLIT + 1, CAPACITY)


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


def _build(monkeypatch, tp, **kwargs):
    monkeypatch.setattr(launcher.cute, "compile", Recorder)
    monkeypatch.setattr(launcher, "_COMPILED", {})  # a Recorder per build, not one compiled earlier
    monkeypatch.setattr(launcher, "one_kernel_rows", lambda spec, device: spec.ll_one_kernel_rows)
    monkeypatch.setattr(launcher, "current_stream", lambda: launcher.cuda.CUstream(0))
    spec = BuildSpec(hidden=H, hc=HC, capacity=CAPACITY, top_k=TOP_K, tp=tp, rank=0, quantize=True,
                     residual_only=True, bt=tp > 1, **kwargs)
    workspace = allocate_host_group([BuildSpec(**{**spec.__dict__, "rank": rank}) for rank in range(tp)])[0]
    return launcher.CuteKernels(spec, workspace, arch="sm_90a")


@pytest.fixture
def kernels(monkeypatch):
    return _build(monkeypatch, TP, ll_one_kernel_rows=2, split_rows=SPLIT)


@pytest.fixture
def local_kernels(monkeypatch):
    return _build(monkeypatch, 1, split_rows=SPLIT)


def _calls(spec, m):
    """Validated calls of every kind (plain, finalize) with every consumer variant."""
    inputs = random_inputs(spec.tp, m, H, HC, seed=m, top_k=TOP_K)
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


def _check_signatures(kernels):
    assert all(r.options == "--gpu-arch sm_90a" for r in kernels.compiled.values())
    for name, recorder in kernels.compiled.items():
        assert recorder.launches, f"{name} never launched"
        for arguments in recorder.launches:
            assert [_kind(a) for a in arguments] == [_kind(f) for f in recorder.fake], name


def _launched(kernels) -> dict[str, int]:
    """Launches so far per kernel name; resets the recorders."""
    counts = {name: len(recorder.launches) for name, recorder in kernels.compiled.items() if recorder.launches}
    for recorder in kernels.compiled.values():
        recorder.launches.clear()
    return counts


def test_every_launch_matches_its_compiled_signature(kernels):
    for m in SIZES:
        for call in _calls(kernels.spec, m):
            for protocol in ("ll", "bt"):
                if call.kind == "finalize":
                    kernels.finalize_publish(protocol, call.gemm2, call.weights, call.indices, call.shared)
                else:
                    kernels.publish(protocol, call.x)
                kernels.consume(protocol, call.consumer)
            kernels.owner_reduce(m)
            if m <= kernels.spec.ll_one_kernel_rows:
                kernels.publish_and_consume(call)
    _check_signatures(kernels)


def test_every_local_launch_matches_its_compiled_signature(local_kernels):
    """A group of one builds only the local forms (no publish, no mailbox), and launches one kernel
    per call."""
    assert local_kernels.workspace.ll is None
    assert sorted(local_kernels.compiled) == sorted(f"{form}{kind}_{variant}" for form in ("", "streaming_")
                                                    for kind in ("local", "local_finalize")
                                                    for variant in ("plain", "quant", "residual"))
    for m in SIZES:
        for call in _calls(local_kernels.spec, m):
            local_kernels.local(call)
    _check_signatures(local_kernels)


def test_each_consumer_takes_the_form_of_its_rows(kernels, local_kernels, monkeypatch):
    assert [kernels.form(m) for m in SIZES] == ["", "", "streaming_", "streaming_"]
    for m in SIZES:
        form = "" if m <= SPLIT else "streaming_"
        for call in _calls(kernels.spec, m):
            variant = call.consumer.variant
            kernels.consume("bt", call.consumer)
            assert _launched(kernels) == {f"{form}consumer_bt_{variant}": 1}, (m, variant)
            local_kernels.local(call)
            local = f"{form}local{'_finalize' if call.kind == 'finalize' else ''}_{variant}"
            assert _launched(local_kernels) == {local: 1}, (m, call.kind, variant)
    # without split_rows in the build, the backend's own bound
    default = _build(monkeypatch, 1)
    assert default.split_rows == launcher.SPLIT_ROWS
    assert default.form(launcher.SPLIT_ROWS) == "" and default.form(launcher.SPLIT_ROWS + 1) == "streaming_"


def test_local_calls_in_the_streamed_window_pass_the_cache_hint_flag(local_kernels):
    """Local calls of lo < M <= hi rows that move at least the L2's bytes pass ``streamed`` = 1 to
    their kernel, every other call 0 (no L2 known: never)."""
    assert local_kernels.l2_bytes is None and local_kernels.streamed_rows == STREAMED_ROWS
    streamed_index = [argument for argument, _ in LOCAL_SIGNATURE].index("streamed")

    def flags(m):
        out = []
        for call in _calls(local_kernels.spec, m):
            local_kernels.local(call)
            out += [int(arguments[streamed_index]) for recorder in local_kernels.compiled.values()
                    for arguments in recorder.launches]
            _launched(local_kernels)
        return out

    assert set(flags(CAPACITY)) == {0}
    local_kernels.streamed_rows = (SPLIT, CAPACITY)
    row = 2 * H
    local_kernels.l2_bytes = (SPLIT + 1) * (row + 2 * HC * row + row)  # what SPLIT + 1 plain rows move
    assert set(flags(SPLIT + 1)) == {1}  # plain, quant (more bytes) and the finalize (more still)
    assert set(flags(SPLIT)) == {0}  # below the window
    local_kernels.l2_bytes *= 1000
    assert set(flags(SPLIT + 1)) == {0}  # fits in L2


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
