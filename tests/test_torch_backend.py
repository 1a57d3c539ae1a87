"""The unfused torch backend of ``AllReduceMHC`` on two gloo processes: bit-exact with the reference
for every variant, and the API's validation before any communication."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu.harness import run_ranks  # noqa: E402

H, HC, CAP, TOP_K, EPS = 256, 4, 16, 3, 1e-20


def _body(rank, tp):
    from lamport_mhc import AllReduceMHC, AllReduceMHCConfig, mxfp8_scale_bytes
    from lamport_mhc.testing import assert_outputs_match, expected_outputs, random_inputs

    op = AllReduceMHC(H, HC, CAP, TOP_K, "cpu", quantize_layer_input=True, residual_only=True,
                      config=AllReduceMHCConfig(backend="auto", cross_check=False))
    seen = []
    for call, m in enumerate((1, 5, 16, 2)):
        for variant in ("plain", "finalize", "quant", "residual"):
            inputs = random_inputs(tp, m, H, HC, seed=10 * call + len(variant), top_k=TOP_K)
            residual_only = variant == "residual"
            consumer = (inputs["residual"], inputs["post"], inputs["comb"], None if residual_only else inputs["pre"],
                        None if residual_only else inputs["norm_weight"], EPS)
            mxfp8 = None
            if variant == "quant":
                mxfp8 = (torch.full((m, H), 0xA5, dtype=torch.uint8).view(torch.float8_e4m3fn),
                         torch.full((mxfp8_scale_bytes(m, H),), 0xA5, dtype=torch.uint8))
            if variant == "finalize":
                out = op.finalize(inputs["gemm2s"][rank], inputs["weights"][rank], inputs["idxs"][rank],
                                  inputs["shareds"][rank], *consumer)
            else:
                out = op(inputs["xs"][rank], *consumer, mxfp8_out=mxfp8)
            assert_outputs_match((out[0], out[1], mxfp8), expected_outputs(inputs, variant, EPS))
            seen.append((op.backend, op.protocol(m)))
    with pytest.raises(ValueError, match="x must be torch.bfloat16"):
        op(inputs["xs"][rank].float(), *consumer)
    return sorted(set(seen))


def test_torch_backend_two_gloo_ranks():
    for seen in run_ranks(_body, 2, backend="gloo", timeout_s=240):
        assert seen == [("torch", "gather")]


def test_api_needs_a_process_group():
    from lamport_mhc import AllReduceMHC
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        AllReduceMHC(H, HC, CAP, TOP_K, "cpu")
