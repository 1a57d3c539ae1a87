"""The repo's MXFP8 reference rules give the bits of FlashInfer's own MXFP8 helpers: FlashInfer's
CuTe DSL MXFP8 kernel (built from ``quantization_cute_dsl_utils``, the helpers the CuTe DSL quant
consumer calls) against ``lamport_mhc.mxfp8.mxfp8_quantize_reference``, on one GPU, over every
exponent a bf16 block can have and every special value."""

import pytest
import torch

from lamport_mhc.mxfp8 import mxfp8_quantize_reference

from .harness import require_gpus

NAN, INF = float("nan"), float("inf")
# Whole 32-element blocks with an edge of their own: zero, signed zeros, all NaN, one NaN, infinities,
# the smallest and largest bf16 magnitudes, amax at e4m3's 448 (exact scale and one ulp above).
SPECIAL_BLOCKS = [
    [0.0] * 32,
    [-0.0] * 32,
    [NAN] * 32,
    [NAN] + [1.5] * 31,
    [INF] + [1.0] * 31,
    [-INF, INF] + [-3.0] * 30,
    [9.2e-41] * 16 + [-9.2e-41] * 16,   # the smallest bf16 subnormal
    [1e-38, -2e-39] * 16,               # normals and subnormals around 2^-127
    [3.38e38] * 32,                     # near the largest bf16
    [448.0] + [1.0] * 31,
    [449.0, -0.001] * 16,
]


def blocks_input(m: int, hidden: int, seed: int) -> torch.Tensor:
    """bf16 [m, hidden]: every 32-element block with its own binary exponent (2^-140 .. 2^127), and
    the special blocks at random block positions."""
    g = torch.Generator().manual_seed(seed)
    blocks = hidden // 32
    exponents = torch.randint(-140, 128, (m, blocks, 1), generator=g).float()
    x = torch.randn((m, blocks, 32), generator=g) * torch.exp2(exponents)
    flat = x.view(-1, 32)
    picks = torch.randperm(flat.shape[0], generator=g)[:len(SPECIAL_BLOCKS)]
    for pick, block in zip(picks.tolist(), SPECIAL_BLOCKS):
        flat[pick] = torch.tensor(block)
    return x.reshape(m, hidden).to(torch.bfloat16)


@pytest.mark.parametrize("m,hidden", [(1, 512), (7, 7168), (130, 5120), (256, 4096)])
def test_reference_matches_flashinfer_mxfp8_kernel(m, hidden):
    require_gpus(1)
    kernels = pytest.importorskip("flashinfer.quantization.kernels.mxfp8_quantize",
                                  reason="flashinfer-python is not installed here")
    x = blocks_input(m, hidden, seed=m * 7 + hidden)
    want_values, want_scales = mxfp8_quantize_reference(x)
    values, scales = kernels.mxfp8_quantize_cute_dsl(x.cuda(), is_sf_swizzled_layout=True)
    torch.cuda.synchronize()
    assert values.shape == (m, hidden)
    assert torch.equal(values.view(torch.uint8).cpu(), want_values.view(torch.uint8))
    got_scales = scales.view(torch.uint8).reshape(-1).cpu()
    assert got_scales.numel() == want_scales.numel()
    assert torch.equal(got_scales, want_scales)
