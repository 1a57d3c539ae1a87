"""The benchmark's strong unfused kernels under the Triton interpreter: close to the reference (they
are written as an engine writes them, fp32 math without the bit contract), zero and NaN rows kept to
themselves, the MXFP8 copy by FlashInfer's rules, -1 routes never read."""

import pytest
import torch

from lamport_mhc import reference
from lamport_mhc.bench.strong_tail import StrongFinalize, StrongTail
from lamport_mhc.mxfp8 import mxfp8_quantize_reference, mxfp8_scale_bytes

pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")

H, EPS = 1536, 1e-6  # three 512-wide pieces: the row walk and the split's partial sums both run


def _inputs(m, hc, seed):
    g = torch.Generator().manual_seed(seed)
    reduced = torch.randn(m, H, generator=g).bfloat16()
    residual = torch.randn(m, hc, H, generator=g).bfloat16()
    post, comb = torch.rand(m, hc, generator=g) * 2, torch.rand(m, hc, hc, generator=g)
    pre = torch.rand(m, hc, generator=g)
    weight = torch.randn(H, generator=g).bfloat16()
    reduced[1], residual[1] = 0.0, 0.0  # an all-zero row
    reduced[2, 7] = float("nan")         # a row with a NaN
    return reduced, residual, post, comb, pre, weight


def _close(actual, expected, rows):
    """Within two bf16 ulps of the value or of the row's RMS (a collapse can cancel to near zero)."""
    a, e = actual[rows].float(), expected[rows].float()
    scale = e.abs() + e.pow(2).mean(-1, keepdim=True).sqrt()
    assert ((a - e).abs() <= 2 ** -6 * scale).all(), ((a - e).abs() / scale).max()


@pytest.mark.parametrize("hc,quantize,strategy", [(4, False, "row"), (4, True, "row"), (1, True, "row"),
                                                   (2, False, "row"), (4, True, "held"), (4, False, "held"),
                                                   (4, True, "split"), (4, False, "split"), (4, True, "held-streamed"),
                                                   (4, False, "split-streamed"), (4, True, "wide-streamed"),
                                                   (4, False, "wide-streamed"), (4, True, "looped-streamed"),
                                                   (4, False, "looped-streamed"), (2, True, "looped-streamed"),
                                                   (1, False, "looped")])
def test_tail_is_the_reference_within_bf16_error(hc, quantize, strategy):
    m = 6
    reduced, residual, post, comb, pre, weight = _inputs(m, hc, seed=hc * 10 + quantize)
    residual_out = torch.full_like(residual, 7.0)
    layer_input = torch.full_like(reduced, 7.0)
    mxfp8 = None
    if quantize:
        mxfp8 = (torch.full((m, H), 0x55, dtype=torch.uint8).view(torch.float8_e4m3fn),
                 torch.full((mxfp8_scale_bytes(m, H),), 0xA5, dtype=torch.uint8))
    tail = StrongTail(H, hc, quantize=quantize, interpret=True, strategy=strategy)
    tail(reduced, residual, post, comb, pre, weight, EPS, residual_out, layer_input, mxfp8)
    ref_residual, ref_layer, _ = reference.all_reduce_mhc([reduced], residual, post, comb, pre, weight, EPS)
    finite = [0, 1, 3, 4, 5]
    _close(residual_out.flatten(1), ref_residual.flatten(1), finite)
    _close(layer_input, ref_layer, finite)
    assert (residual_out[1] == 0).all() and (layer_input[1] == 0).all()
    # The NaN stays in its row: every stream it feeds and the whole normalized row.
    assert torch.isnan(layer_input[2]).all() and torch.isnan(residual_out[2, :, 7]).all()
    if quantize:
        # Its own layer input quantized by FlashInfer's rules, bit for bit, the NaN row (scale 254,
        # values 448) and the padded rows' zero scales included.
        values, scales = mxfp8_quantize_reference(layer_input)
        assert torch.equal(mxfp8[1], scales)
        assert torch.equal(mxfp8[0].view(torch.uint8), values.view(torch.uint8))
        assert (values.view(torch.uint8)[1] & 0x7F == 0).all() and (values.view(torch.uint8)[2] == 0x7E).all()

def test_finalize_reads_only_held_routes():
    m, top_k, rows = 5, 4, 7
    g = torch.Generator().manual_seed(3)
    gemm2 = torch.randn(rows, H, generator=g).bfloat16()
    weights = torch.rand(m, top_k, generator=g)
    indices = torch.randint(0, rows, (m, top_k), generator=g, dtype=torch.int32)
    shared = torch.randn(m, H, generator=g).bfloat16()
    indices[0] = -1          # nothing held: the shared expert alone
    indices[2, 1] = -1
    weights[2, 1] = float("nan")  # behind a -1: ignored
    out = torch.full_like(shared, 9.0)
    StrongFinalize(H, top_k, interpret=True)(gemm2, weights, indices, shared, out)
    expected = reference.finalize_contribution(gemm2, weights, indices, shared)
    _close(out, expected, list(range(m)))
    assert torch.equal(out[0], shared[0])


def test_launchers_refuse_what_they_do_not_cover():
    with pytest.raises(ValueError, match="hc in 1, 2, 4"):
        StrongTail(H, 3)
    with pytest.raises(ValueError, match="strategy must be one of"):
        StrongTail(H, 4, strategy="cluster")
    with pytest.raises(ValueError, match="multiple of 128"):
        StrongTail(96, 4, quantize=True)
    tail = StrongTail(H, 4, interpret=True)
    reduced, residual, post, comb, pre, weight = _inputs(3, 4, seed=0)
    with pytest.raises(ValueError, match="quantize=True"):
        tail(reduced, residual, post, comb, pre, weight, EPS, torch.empty_like(residual), torch.empty_like(reduced),
             (torch.empty(3, H, dtype=torch.float8_e4m3fn), torch.empty(mxfp8_scale_bytes(3, H), dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"\[M, 4\]"):
        StrongFinalize(H, 4)(torch.empty(3, H).bfloat16(), torch.empty(2, 3), torch.empty(2, 3, dtype=torch.int32),
                             torch.empty(2, H).bfloat16(), torch.empty(2, H).bfloat16())


def test_gpu_check_script_runs_under_the_interpreter():
    """bench/check_strong_tail.py as it runs on a GPU, here on the CPU (checks the script)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, str(root / "bench" / "check_strong_tail.py"), "--interpret", "--hidden",
                             "256", "--rows", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "H=256 finalize M=2" in result.stdout and "strong tail: meets the bar" in result.stdout


@pytest.mark.parametrize("strategy", ["looped", "split"])
def test_pdl_off_leaves_no_grid_dependency_control(strategy):
    """With ``pdl`` off (the forms probe's ``--no-pdl``, as the fused kernels' ``use_pdl``) no kernel of
    a call waits on or triggers a programmatic dependent launch; with it on every kernel does both."""
    for pdl in (True, False):
        ptx = StrongTail(H, 4, quantize=True, strategy=strategy, pdl=pdl).compile_offline()
        for name, text in ptx.items():
            if pdl:
                assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text, name
            else:
                assert "griddepcontrol" not in text, name
