"""MHCBoundary: the backend from the model config and the environment, the one-line fallback and strict
mode, the custom ops (opcheck, torch.compile), and the simulated boundary's choice of backend.
The process-group tests run the torch backend over a gloo group of one in this process."""

import logging
import re
from dataclasses import dataclass

import pytest
import torch

from lamport_mhc import integration, ops
from lamport_mhc.backend import BuildSpec, Support
from lamport_mhc.config import BACKEND_ENV
from lamport_mhc.integration import MHCBoundary, SimulatedMHCBoundary, resolve_backend
from lamport_mhc.selector import support_table
from lamport_mhc.testing import assert_same_bits, expected_outputs

H, HC, CAP, TOP_K, EPS = 256, 4, 8, 3, 1e-6
LOGGER = "lamport_mhc.integration"


@dataclass(frozen=True)
class ModelConfig:  # the fields an engine's model config carries
    hidden_size: int = H
    hc_mult: int = HC
    num_experts_per_tok: int = TOP_K
    all_reduce_mhc_backend: str = "auto"
    all_reduce_mhc_strict: bool = False


@pytest.fixture
def world_of_one(monkeypatch):
    import torch.distributed as dist

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(integration, "_LOGGED", set())  # "once per process" starts afresh per test
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _reason(name: str) -> str:
    """The support query's own reason for ``name`` on this CPU (the boundary must not re-derive it)."""
    answer = support_table(BuildSpec(hidden=H, hc=HC, capacity=CAP, top_k=TOP_K, tp=1, rank=0),
                           torch.device("cpu"))[name]
    assert not answer.ok
    return answer.reason


def _inputs(seed: int, m: int, finalize: bool = False) -> dict:
    """Random inputs with no Inf/NaN outputs (opcheck compares outputs with assert_close)."""
    g = torch.Generator().manual_seed(seed)
    inputs = {"xs": [torch.randn(m, H, generator=g).bfloat16()],
              "residual": torch.randn(m, HC, H, generator=g).bfloat16(),
              "post": 2 * torch.rand(m, HC, generator=g), "comb": torch.rand(m, HC, HC, generator=g),
              "pre": torch.rand(m, HC, generator=g), "norm_weight": (1 + torch.randn(H, generator=g) / 10).bfloat16()}
    if finalize:
        rows = m * TOP_K
        idx = torch.randperm(rows, generator=g)[:m * TOP_K].view(m, TOP_K).int()
        idx[torch.rand(m, TOP_K, generator=g) < 0.3] = -1
        inputs.update(gemm2s=[torch.randn(rows, H, generator=g).bfloat16()], weights=[torch.rand(m, TOP_K, generator=g)],
                      idxs=[idx], shareds=[torch.randn(m, H, generator=g).bfloat16()])
    return inputs


def _consumer(inputs):
    return inputs["residual"], inputs["post"], inputs["comb"], inputs["pre"], inputs["norm_weight"], EPS


# -- backend choice ------------------------------------------------------------------------------------

def test_model_config_field_picks_the_backend(world_of_one, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        boundary = MHCBoundary.from_model_config(ModelConfig(all_reduce_mhc_backend=" Torch"), max_num_tokens=CAP,
                                                 device="cpu")
        auto = MHCBoundary.from_model_config(ModelConfig(), max_num_tokens=CAP, device="cpu")
    assert (boundary.requested, boundary.backend) == ("torch", "torch")
    assert (auto.requested, auto.backend) == ("auto", "torch")  # nothing fused runs on CPU; auto says nothing
    assert caplog.records == []
    inputs = _inputs(11, 5)
    out = boundary(inputs["xs"][0], *_consumer(inputs))
    ref = expected_outputs(inputs, "plain", EPS)
    assert_same_bits("residual_out", ref[0], out[0])
    assert_same_bits("layer_input", ref[1], out[1])


def test_unrunnable_backend_logs_one_line_once_and_falls_back(world_of_one, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = MHCBoundary.from_model_config(ModelConfig(all_reduce_mhc_backend="triton"), max_num_tokens=CAP,
                                              device="cpu")
        again = MHCBoundary.from_model_config(ModelConfig(all_reduce_mhc_backend="triton"), max_num_tokens=CAP,
                                              device="cpu")
        cute = MHCBoundary.from_model_config(ModelConfig(all_reduce_mhc_backend="CuTe"), max_num_tokens=CAP,
                                             device="cpu")
    assert (first.backend, again.backend, cute.backend) == ("torch", "torch", "torch")
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages  # one per reason, not one per boundary
    assert all(record.levelno == logging.WARNING and "\n" not in record.getMessage() for record in caplog.records)
    assert messages[0] == (f"all_reduce_mhc_backend='triton' cannot run here: {_reason('triton')}; "
                           "falling back to the torch backend")
    assert messages[1].startswith(f"all_reduce_mhc_backend='cute' cannot run here: {_reason('cute')}")
    inputs = _inputs(12, 4, finalize=True)
    out = first.finalize(inputs["gemm2s"][0], inputs["weights"][0], inputs["idxs"][0], inputs["shareds"][0],
                         *_consumer(inputs))
    assert_same_bits("residual_out", expected_outputs(inputs, "finalize", EPS)[0], out[0])


def test_strict_raises_with_the_same_reason(world_of_one, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(RuntimeError, match=re.escape(f"all_reduce_mhc_backend='triton' cannot run here: "
                                                         f"{_reason('triton')}")):
            MHCBoundary.from_model_config(ModelConfig(all_reduce_mhc_backend="triton", all_reduce_mhc_strict=True),
                                          max_num_tokens=CAP, device="cpu")
        strict_torch = MHCBoundary(H, HC, CAP, TOP_K, "cpu", backend="torch", strict=True)
    assert strict_torch.backend == "torch"
    assert caplog.records == []


def test_environment_overrides_the_config(world_of_one, monkeypatch, caplog):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        # The config asks for triton strictly; the environment says torch: no fallback, no raise.
        boundary = MHCBoundary.from_model_config(ModelConfig(all_reduce_mhc_backend="triton",
                                                             all_reduce_mhc_strict=True),
                                                 max_num_tokens=CAP, device="cpu")
    assert (boundary.requested, boundary.backend) == ("torch", "torch") and caplog.records == []

    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(RuntimeError, match=re.escape(_reason("triton"))):
        MHCBoundary.from_model_config(ModelConfig(all_reduce_mhc_backend="torch", all_reduce_mhc_strict=True),
                                      max_num_tokens=CAP, device="cpu")

    monkeypatch.setenv(BACKEND_ENV, "fused")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        MHCBoundary(H, HC, CAP, TOP_K, "cpu")


def test_invalid_config_value_raises(world_of_one):
    with pytest.raises(ValueError, match="backend must be one of"):
        MHCBoundary(H, HC, CAP, TOP_K, "cpu", backend="nccl")


def test_resolve_backend_keeps_a_supported_backend(monkeypatch, caplog):
    monkeypatch.setattr(integration, "_LOGGED", set())
    support = {"triton": Support.yes(), "cute": Support.no("no GPU of sm_100")}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert resolve_backend("triton", support, strict=True) == "triton"
        assert resolve_backend("auto", support, strict=True) == "auto"
        assert resolve_backend("cute", support, strict=False) == "torch"
    assert [r.getMessage() for r in caplog.records] == [
        "all_reduce_mhc_backend='cute' cannot run here: no GPU of sm_100; falling back to the torch backend"]


def test_simulated_boundary_runs_exactly_the_named_backend(monkeypatch, caplog):
    monkeypatch.setattr(integration, "_LOGGED", set())
    monkeypatch.setenv(BACKEND_ENV, "torch")  # ignored: an A/B tool names both sides itself
    kwargs = {"tp": 2, "hidden_size": H, "hc_mult": HC, "max_num_tokens": CAP, "top_k": TOP_K}
    assert SimulatedMHCBoundary(**kwargs, backend="triton").backend == "triton"
    assert SimulatedMHCBoundary(**kwargs, backend="auto").backend == "triton"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert SimulatedMHCBoundary(**kwargs, backend="cute").backend == "torch"
    assert len(caplog.records) == 1 and "CuTe DSL kernels need a GPU" in caplog.records[0].getMessage()
    with pytest.raises(RuntimeError, match="CuTe DSL kernels need a GPU"):
        SimulatedMHCBoundary(**kwargs, backend="cute", strict=True)


# -- custom ops ----------------------------------------------------------------------------------------

def test_opcheck_plain_and_finalize(world_of_one):
    from lamport_mhc.mxfp8 import mxfp8_scale_bytes

    boundary = MHCBoundary(H, HC, CAP, TOP_K, "cpu", backend="torch", quantize_layer_input=True)
    m = 5
    plain, moe = _inputs(21, m), _inputs(22, m, finalize=True)
    mxfp8 = (torch.empty(m, H, dtype=torch.float8_e4m3fn), torch.empty(mxfp8_scale_bytes(m, H), dtype=torch.uint8))
    plain_args = (boundary.handle, plain["xs"][0], *_consumer(plain))
    finalize_args = (boundary.handle, moe["gemm2s"][0], moe["weights"][0], moe["idxs"][0], moe["shareds"][0],
                     *_consumer(moe))
    lib = torch.ops.lamport_mhc
    torch.library.opcheck(lib.all_reduce_mhc.default, plain_args)
    torch.library.opcheck(lib.all_reduce_mhc_finalize.default, finalize_args)
    # test_schema cannot compare float8 buffers before and after a call (torch's allclose has no
    # float8 kernel): the quant ops run the other checks, and their declared mutation is checked below.
    without_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(lib.all_reduce_mhc_quant.default, plain_args + mxfp8, test_utils=without_schema)
    torch.library.opcheck(lib.all_reduce_mhc_finalize_quant.default, finalize_args + mxfp8, test_utils=without_schema)
    for op in ops.OPS:
        written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == ({"mxfp8_values", "mxfp8_scales"} if "quant" in op.__name__ else set()), op

    # The mutation is real: the MXFP8 buffers receive the reference's bits, through the boundary.
    values = torch.full((m, H), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.full((mxfp8_scale_bytes(m, H),), 0xA5, dtype=torch.uint8)
    boundary(plain["xs"][0], *_consumer(plain), mxfp8_out=(values, scales))
    ref = expected_outputs(plain, "quant", EPS)[2]
    assert_same_bits("mxfp8 values", ref[0], values)
    assert_same_bits("mxfp8 scales", ref[1], scales)


class _CountingOp:
    """Stands in for an AllReduceMHC behind a handle, counting calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, residual, *args, mxfp8_out=None):
        self.calls += 1
        return residual.clone(), x.clone()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_graph_keeps_a_call_whose_outputs_are_unused(compiler):
    stub = _CountingOp()
    handle = ops.register(stub)
    inputs = _inputs(41, 3)

    def step(x, residual, post, comb, pre, norm_weight):
        torch.ops.lamport_mhc.all_reduce_mhc(handle, x, residual, post, comb, pre, norm_weight, EPS)
        return x + 1  # a rank that ignores the result must still take part in the collective

    compiled = torch.compile(step, backend=compiler, fullgraph=True)
    compiled(inputs["xs"][0], *_consumer(inputs)[:-1])
    compiled(inputs["xs"][0], *_consumer(inputs)[:-1])
    assert stub.calls == 2


def test_ops_compile_without_graph_breaks(world_of_one):
    boundary = MHCBoundary(H, HC, CAP, TOP_K, "cpu", backend="torch")

    def boundaries(x, gemm2, weights, idx, shared, residual, post, comb, pre, norm_weight):
        streams, _ = boundary(x, residual, post, comb, pre, norm_weight, EPS)
        return boundary.finalize(gemm2, weights, idx, shared, streams, post, comb, pre, norm_weight, EPS)

    compiled = torch.compile(boundaries, backend="aot_eager", fullgraph=True)
    for seed, m in ((31, 3), (32, 6)):
        inputs = _inputs(seed, m, finalize=True)
        args = (inputs["xs"][0], inputs["gemm2s"][0], inputs["weights"][0], inputs["idxs"][0], inputs["shareds"][0],
                *_consumer(inputs)[:-1])
        eager, traced = boundaries(*args), compiled(*args)
        for name, a, b in zip(("residual_out", "layer_input"), eager, traced):
            assert_same_bits(name, a, b)
        # and the eager chain is the reference's: plain, then finalize on its streams
        first = expected_outputs(inputs, "plain", EPS)
        second = expected_outputs({**inputs, "residual": first[0]}, "finalize", EPS)
        assert_same_bits("residual_out", second[0], eager[0])
        assert_same_bits("layer_input", second[1], eager[1])


def test_dropped_instance_handle_raises():
    with pytest.raises(RuntimeError, match="handle 987654 is not registered"):
        ops.lookup(987654)
