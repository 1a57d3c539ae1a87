"""The bit contract reference: hand-computed examples for each step, the traps each rule closes,
validation, and an independent scalar formulation in exact rational arithmetic."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from lamport_mhc.mxfp8 import mxfp8_quantize_reference, mxfp8_scale_bytes
from lamport_mhc.reference import (
    all_reduce_mhc,
    finalize_contribution,
    post_mix,
    pre_mix,
    reduce_contributions,
    rms_norm,
)

from exact_rounding import round_to_nearest_even

NAN = float("nan")
INF = float("inf")


def bf(values):
    return torch.tensor(values, dtype=torch.bfloat16)


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


def bits16(t):
    return [v & 0xFFFF for v in t.reshape(-1).view(torch.int16).tolist()]


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


# ----------------------------------------------------------------------------- step 1: finalize


def test_finalize_hand_example():
    gemm2 = bf([[1.0] * 8, [2.0] * 8, [0.5] * 8, [-4.0] * 8])
    w = f32([[2.0, 100.0, 0.25], [0.5, 1.5, NAN]])
    idx = torch.tensor([[2, -1, 0], [3, 1, -1]], dtype=torch.int32)
    shared = bf([[0.5] * 8, [-1.0] * 8])
    c = finalize_contribution(gemm2, w, idx, shared)
    assert c.dtype == torch.bfloat16 and c.shape == (2, 8)
    # token 0: 0.5*2 = 1; slot 1 skipped; + 1*0.25 = 1.25; + 0.5 = 1.75 (0x3FE0)
    # token 1: -4*0.5 = -2; + 2*1.5 = 1; slot 2 skipped (its NaN weight unused); + -1 = +0
    assert bits16(c) == [0x3FE0] * 8 + [0x0000] * 8


def test_finalize_skip_is_not_a_multiply_by_zero():
    # row 0 (where a clamped -1 would point) is +Inf, row 1 NaN
    gemm2 = bf([[INF] * 8, [NAN] * 8, [3.0] * 8])
    shared = bf([[1.0] * 8, [1.0] * 8])
    idx = torch.tensor([[-1, 2, -1], [0, 2, -1]], dtype=torch.int32)
    w = f32([[0.0, 1.0, NAN], [0.0, 1.0, 0.0]])
    c = finalize_contribution(gemm2, w, idx, shared)
    # token 0: skipped slots leave acc alone: 3*1 + 1 = 4 (0x4080)
    # token 1: slot 0 is taken: fma(Inf, 0, 0) = NaN -> 0x7FC0
    assert bits16(c[0]) == [0x4080] * 8
    assert bits16(c[1]) == [0x7FC0] * 8


def test_finalize_top_k_order():
    gemm2 = bf([[2.0**24] * 8, [1.0] * 8, [-(2.0**24)] * 8])
    w = f32([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    shared = bf([[0.0] * 8, [0.0] * 8])
    idx = torch.tensor([[0, 1, 2], [0, 2, 1]], dtype=torch.int32)
    c = finalize_contribution(gemm2, w, idx, shared)
    # in slot order: (2^24 + 1) ties to 2^24, minus 2^24 = 0; the other order keeps the 1
    assert bits16(c[0]) == [0x0000] * 8
    assert bits16(c[1]) == [0x3F80] * 8


def test_finalize_fma_is_one_rounding():
    # acc = 1 * (1 + 2^-6 + 2^-14 + 2^-20) = 1 + 2^-6 + 2^-14 + 2^-20 (exact)
    # (1 + 2^-7) * -(1 + 2^-7 + 2^-20) = -(1 + 2^-6 + 2^-14 + 2^-20 + 2^-27): fma leaves -2^-27
    # (bf16 0xB200); rounding the product to fp32 first would drop the 2^-27 and give 0.
    gemm2 = bf([[1.0] * 8, [1.0 + 2**-7] * 8])
    w = f32([[1 + 2**-6 + 2**-14 + 2**-20, -(1 + 2**-7 + 2**-20)]])
    idx = torch.tensor([[0, 1]], dtype=torch.int32)
    c = finalize_contribution(gemm2, w, idx, bf([[0.0] * 8]))
    assert bits16(c) == [0xB200] * 8


def test_finalize_negative_zero_becomes_positive_zero():
    # 2^-100 * -2^-40 = -2^-140 (an fp32 subnormal); + 0 -> bf16 RNE gives -0.0 -> canonical +0.0
    gemm2 = bf([[2.0**-100] * 8])
    w = f32([[-(2.0**-40)], [-(2.0**-40)], [1.0]])
    idx = torch.tensor([[0], [0], [-1]], dtype=torch.int32)
    shared = bf([[0.0] * 8, [-0.0] * 8, [-0.0] * 8])
    c = finalize_contribution(gemm2, w, idx, shared)
    assert bits16(c) == [0x0000] * 24


def test_finalize_empty_top_k_and_no_rows():
    shared = bf([[1.5, -0.0, 2.0, -3.0]])
    c = finalize_contribution(
        torch.zeros(0, 4, dtype=torch.bfloat16),
        torch.zeros(1, 2, dtype=torch.float32),
        torch.full((1, 2), -1, dtype=torch.int32),
        shared,
    )
    assert bits16(c) == [0x3FC0, 0x0000, 0x4000, 0xC040]
    c = finalize_contribution(
        bf([[1.0] * 4]), torch.zeros(1, 0), torch.zeros(1, 0, dtype=torch.int32), shared
    )
    assert bits16(c) == [0x3FC0, 0x0000, 0x4000, 0xC040]


def test_finalize_validation():
    g = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.zeros(2, 3)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    s = torch.zeros(2, 8, dtype=torch.bfloat16)
    finalize_contribution(g, w, idx, s)
    bad = [
        (g.float(), w, idx, s),
        (g, w.double(), idx, s),
        (g, w, idx.long(), s),
        (g, w, idx, s.float()),
        (g, w, idx[:, :2], s),
        (g, w, idx, s[:, :4]),
        (g, w, idx, s[:1]),
        (g[0], w, idx, s),
        (g, w, torch.full((2, 3), 4, dtype=torch.int32), s),  # == rows
        (g, w, torch.full((2, 3), -2, dtype=torch.int32), s),
    ]
    for args in bad:
        with pytest.raises(ValueError):
            finalize_contribution(*args)


# ----------------------------------------------------------------------------- step 2: reduction


def test_reduce_rank_order_rounding_and_zeros():
    # columns: [rank order, tie down, tie up, all -0, cancel, 0 + -0, plain, plain]
    c0 = bf([2.0**24, 1.0, 1 + 2**-7, -0.0, 3.0, -0.0, 1.0, -2.0])
    c1 = bf([1.0, 2**-8, 2**-8, -0.0, -0.0, 0.0, 2.0, 0.5])
    c2 = bf([-(2.0**24), 0.0, 0.0, -0.0, -3.0, -0.0, 4.0, 0.25])
    r = reduce_contributions([c0.reshape(1, 8), c1.reshape(1, 8), c2.reshape(1, 8)])
    assert r.dtype == torch.bfloat16 and r.shape == (1, 8)
    # 2^24 + 1 ties to 2^24, - 2^24 = 0 (in rank order; 2^24 - 2^24 + 1 would be 1)
    # 1 + 2^-8: tie -> 1.0; 1 + 3*2^-8: tie -> 1 + 2^-6 (0x3F82); zeros -> +0; 1+2+4 = 7 (0x40E0);
    # -2 + 0.5 + 0.25 = -1.25 (0xBFA0)
    assert bits16(r) == [0x0000, 0x3F80, 0x3F82, 0x0000, 0x0000, 0x0000, 0x40E0, 0xBFA0]


# ----------------------------------------------------------------------------- the hand example


def hand_example(tiles=1):
    """tp=2, hc=2, H=8*tiles, M=1, numbers chosen so every step is exact and checkable by hand.

    reduced        = [+0, -1, 1, 0, 2, 2, -2, 2]      (c0 + c1, the -0 + -0 column gives +0)
    post           = [1, 2]; comb[source][target] = [[1, 0.5], [-1, 0]]
    residual s=0   = [0, 4, 4, 0, -8, 8, 8, 8]
    residual s=1   = [-2, 5, 5, 2, -12, 8, 12, 8]
    residual_out 0 = reduced*1 + res0*1 + res1*(-1)  = [2, -2, 0, -2, 6, 2, -6, 2]
    residual_out 1 = reduced*2 + res0*0.5 + res1*0   = [0, 0, 4, 0, 0, 8, 0, 8]
    pre            = [0.5, 0.25] -> prenorm = [1, -1, 1, -1, 3, 3, -3, 3]
    ss = 4*1 + 4*9 = 40 (per tile); ss/H = 5; + eps 11 = 16; sqrt 4; inv = 0.25
    gamma          = [1, 2, 4, 1, 1, 0.5, 2, -1]
    layer_input    = prenorm * 0.25 * gamma = [0.25, -0.5, 1, -0.25, 0.75, 0.375, -1.5, -0.75]
    """

    def row(v):
        return v * tiles

    c0 = bf([row([-0.0, -1.0, 0.5, 0.0, 1.0, 1.0, -1.0, 1.0])])
    c1 = bf([row([-0.0, 0.0, 0.5, 0.0, 1.0, 1.0, -1.0, 1.0])])
    residual = bf([[row([0, 4, 4, 0, -8, 8, 8, 8]), row([-2, 5, 5, 2, -12, 8, 12, 8])]])
    post = f32([[1.0, 2.0]])
    comb = f32([[[1.0, 0.5], [-1.0, 0.0]]])
    pre = f32([[0.5, 0.25]])
    gamma = bf(row([1.0, 2.0, 4.0, 1.0, 1.0, 0.5, 2.0, -1.0]))
    return [c0, c1], residual, post, comb, pre, gamma, 11.0


@pytest.mark.parametrize("tiles", [1, 4])
def test_hand_example_every_step(tiles):
    contributions, residual, post, comb, pre, gamma, eps = hand_example(tiles)
    reduced = reduce_contributions(contributions)
    assert bits16(reduced) == bits16(bf([0.0, -1, 1, 0, 2, 2, -2, 2] * tiles))
    ro = post_mix(reduced, residual, post, comb)
    assert ro.shape == (1, 2, 8 * tiles)
    assert bits16(ro[:, 0]) == bits16(bf([2.0, -2, 0, -2, 6, 2, -6, 2] * tiles))
    assert bits16(ro[:, 1]) == bits16(bf([0.0, 0, 4, 0, 0, 8, 0, 8] * tiles))
    prenorm = pre_mix(ro, pre)
    assert bits16(prenorm) == bits16(bf([1.0, -1, 1, -1, 3, 3, -3, 3] * tiles))
    layer = rms_norm(prenorm, gamma, eps)
    want_layer = bf([[0.25, -0.5, 1.0, -0.25, 0.75, 0.375, -1.5, -0.75] * tiles])
    assert same_bits(layer, want_layer)

    out_ro, out_layer, mx = all_reduce_mhc(contributions, residual, post, comb, pre, gamma, eps)
    assert same_bits(out_ro, ro) and same_bits(out_layer, want_layer) and mx is None

    if tiles == 4:  # H = 32: one MXFP8 block
        _, _, (q, s) = all_reduce_mhc(contributions, residual, post, comb, pre, gamma, eps, quantize=True)
        # amax 1.5: ceil(log2(1.5/448)) = -8 -> u 119, inv 2^8:
        # [64, -128, 256, -64, 192, 96, -384, -192] -> e4m3
        assert q.view(torch.uint8).tolist() == [[0x68, 0xF0, 0x78, 0xE8, 0x74, 0x6C, 0xFC, 0xF4] * 4]
        assert s.shape == (512,) and s[0].item() == 119 and int(s[1:].sum()) == 0


def test_comb_is_source_by_target():
    contributions, residual, post, comb, pre, gamma, eps = hand_example()
    ro, _, _ = all_reduce_mhc(contributions, residual, post, comb.transpose(1, 2).contiguous(), None, None, None)
    # transposed: target 0 takes res0*1 + res1*0.5: col 0 = 0 + 0 + -1 = -1
    assert bits16(ro[0, 0, :1]) == [0xBF80]


def test_residual_only_and_post_shapes():
    contributions, residual, post, comb, pre, gamma, eps = hand_example()
    ro_full, _, _ = all_reduce_mhc(contributions, residual, post, comb, pre, gamma, eps)
    ro, layer, mx = all_reduce_mhc(contributions, residual, post, comb, None, None, None)
    assert layer is None and mx is None and same_bits(ro, ro_full)
    ro3, layer3, _ = all_reduce_mhc(contributions, residual, post.unsqueeze(-1), comb, pre, gamma, eps)
    assert same_bits(ro3, ro_full)


# ----------------------------------------------------------------------------- step 3: post-mix


def test_post_mix_source_order():
    # m = 2^24 * 1; then s=0: + 1*1 -> 2^24 + 1 ties to 2^24; s=1: + 2^24 * -1 -> +0.
    # (s=1 first would leave 1.)
    reduced = bf([[2.0**24] * 8])
    residual = bf([[[1.0] * 8, [2.0**24] * 8]])
    post = f32([[1.0, 0.0]])
    comb = f32([[[1.0, 0.0], [-1.0, 0.0]]])
    ro = post_mix(reduced, residual, post, comb)
    assert bits16(ro[:, 0]) == [0x0000] * 8


def test_post_mix_fma_is_one_rounding():
    # m = 1 * (1 + 2^-6 + 2^-14 + 2^-20); fma((1 + 2^-7), -(1 + 2^-7 + 2^-20), m) = -2^-27 (0xB200)
    reduced = bf([[1.0] * 8])
    residual = bf([[[1 + 2**-7] * 8, [0.0] * 8]])
    post = f32([[1 + 2**-6 + 2**-14 + 2**-20, 0.0]])
    comb = f32([[[-(1 + 2**-7 + 2**-20), 0.0], [0.0, 0.0]]])
    ro = post_mix(reduced, residual, post, comb)
    assert bits16(ro[:, 0]) == [0xB200] * 8


def test_negative_zero_contributions_and_residual_out_keeps_negative_zero():
    # contributions -0.0 -> reduced +0; post -1: m = -0; fma(+0, -1, -0) = -0 + -0 = -0 -> 0x8000,
    # kept in residual_out (no canonicalization there)
    c = bf([[-0.0] * 8])
    residual = bf([[[0.0] * 8, [0.0] * 8]])
    post = f32([[-1.0, 1.0]])
    comb = f32([[[-1.0, -1.0], [-1.0, -1.0]]])
    ro, _, _ = all_reduce_mhc([c, c], residual, post, comb, None, None, None)
    assert bits16(ro[:, 0]) == [0x8000] * 8
    # target 1: m = +0 * 1 = +0; +0 + -0 = +0
    assert bits16(ro[:, 1]) == [0x0000] * 8
    # a tiny negative m rounds to bf16 -0 and stays -0: 2^-100 * -2^-40 = -2^-140
    c = bf([[2.0**-100] * 8])
    ro, _, _ = all_reduce_mhc(
        [c, bf([[0.0] * 8])], residual, f32([[-(2.0**-40), 1.0]]), torch.zeros(1, 2, 2), None, None, None
    )
    assert bits16(ro[:, 0]) == [0x8000] * 8


# ----------------------------------------------------------------------------- steps 4 and 5


def test_pre_mix_order_and_rounding():
    # acc = fma(2^24, 1, 0) = 2^24; fma(1, 1, acc) ties to 2^24; fma(2^24, -1, acc) = +0
    ro = bf([[[2.0**24] * 8, [1.0] * 8, [2.0**24] * 8]])
    prenorm = pre_mix(ro, f32([[1.0, 1.0, -1.0]]))
    assert bits16(prenorm) == [0x0000] * 8
    # bf16 rounding at the end: 1 + 3*2^-8 -> 1 + 2^-6
    prenorm = pre_mix(bf([[[1.0] * 8, [1.0] * 8]]), f32([[1.0, 3 * 2**-8]]))
    assert bits16(prenorm) == [0x3F82] * 8


def test_rms_norm_zero_row_and_tiny_eps():
    zero = torch.zeros(1, 8, dtype=torch.bfloat16)
    gamma = bf([1.0, 2.0, 0.5, 3.0, 1.0, 1.0, 1.0, 1.0])
    out = rms_norm(zero, gamma, 1e-20)  # 1 / sqrt(0 + 1e-20) = 1e10; 0 * 1e10 = +0
    assert bits16(out) == [0x0000] * 8
    # through the whole op
    c = torch.zeros(1, 8, dtype=torch.bfloat16)
    _, layer, _ = all_reduce_mhc(
        [c, c], torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.ones(1, 2), torch.ones(1, 2, 2),
        torch.ones(1, 2), gamma, 1e-20,
    )
    assert bits16(layer) == [0x0000] * 8
    # eps = 0 on a zero row is 0 * (1 / 0) = NaN: the contract does not special-case it
    assert bits16(rms_norm(zero, gamma, 0.0)) == [0x7FC0] * 8


def test_rms_norm_eps_is_rounded_to_fp32_first():
    g = torch.Generator().manual_seed(11)
    prenorm = (torch.randn(4, 64, generator=g) * 1e-3).to(torch.bfloat16)
    gamma = torch.randn(64, generator=g).to(torch.bfloat16)
    eps = 1e-6
    eps32 = float(np.float32(eps))
    assert eps32 != eps
    assert same_bits(rms_norm(prenorm, gamma, eps), rms_norm(prenorm, gamma, eps32))


def _numpy_rms_norm(prenorm, gamma, eps):
    """Independent fp32 formulation with numpy scalars and torch's CPU bf16 cast (finite)."""
    p = prenorm.float().numpy()
    gm = gamma.float().numpy()
    h = p.shape[1]
    out = np.empty_like(p)
    width = 1 << (h - 1).bit_length()
    for t in range(p.shape[0]):
        level = [np.float32(v * v) for v in p[t]] + [np.float32(0)] * (width - h)
        while len(level) > 1:
            level = [np.float32(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
        ms = np.float32(level[0] / np.float32(h))
        inv = np.float32(np.float32(1) / np.sqrt(np.float32(ms + np.float32(eps))))
        out[t] = (p[t] * inv).astype(np.float32) * gm
    return torch.from_numpy(out).to(torch.bfloat16)


@pytest.mark.parametrize("hidden", [8, 24, 64, 100])
def test_rms_norm_against_numpy(hidden):
    g = torch.Generator().manual_seed(hidden)
    prenorm = (torch.randn(5, hidden, generator=g) * torch.exp2(torch.randint(-8, 8, (5, 1), generator=g).float()))
    prenorm = prenorm.to(torch.bfloat16)
    gamma = torch.randn(hidden, generator=g).to(torch.bfloat16)
    assert same_bits(rms_norm(prenorm, gamma, 1e-5), _numpy_rms_norm(prenorm, gamma, 1e-5))


# A row found by search whose layer_input bits change if the sum of squares is taken left to
# right or by torch.sum instead of the adjacent-pair tree, or if (p * inv) * gamma is associated as
# p * (inv * gamma): the bf16 rounding hides those differences almost everywhere else.
_TRAP_ROW = (
    "3fb8 4005 401b c076 4093 c048 bc62 3ee0 be90 c0a0 3e49 bf89 3f7f 3f19 c043 3f1c 40fa 3ec8 c0b3 "
    "3f6a bed4 c074 be19 bcbf c067 c00b bdde bea3 3e7c 3c85 40be beab 3f9d 3f78 bf9c be1f 3fac c0e9 "
    "c025 403d bf09 bd53 3f29 3f25 3f06 3f2a c015 bcae bdc5 c050 4003 bfa2 bea5 be56 c010 be55 c0b1 "
    "3e3d bede 3e60 3e06 bedb beab 4108 3e09 bf3a 4007 40c7 3e1d 3db1 be98 3aac c01f bebb 4016 c197 "
    "40b5 c031 407e 3e9a 3ecd 4071 be37 3d56 bfad 40c4 3d92 3d16 3e05 402f bd8a bebf 3d1c 3f1b 4154 "
    "402c bf62 bdf0 3e44 bfd9 4039 409a 3c8a 3bd2 beff bea6 be5c be92 c0a9 4132 3f02 be2a be20 3e90 "
    "c1d7 3eb1 3d8d beaa 3f94 3f28 bc8e 3e56 c008 bd36 c058 be16 c0fa 3fbc"
)
_TRAP_GAMMA = (
    "3f0f bea9 3f3b 3fb2 bee9 be58 3fca bead 3f95 bf60 3f16 be4c 3f89 3fba beb9 3c6f 3f39 3d44 be48 "
    "c017 3fa2 bfbc 3f4b bf5a bfd9 bf9b bf8c 3ed4 bf70 be97 bf81 3f5f 3f8e 3f2d 3e39 bdae 3f9d 3f57 "
    "bfc3 3fc2 3f94 bf6c bf92 beb5 becf be7c 3f22 bf2a 3d54 3f3e 3ede 3e95 3f68 bf1e bf89 bf10 bfb0 "
    "3ed0 3ede 3e81 3cbf 3ed2 bf80 be37 bf98 3ec2 3f25 bfe9 bf37 400b bd7c bead be87 bd80 3f3f bf6e "
    "bec6 be77 bef2 bfa1 bf93 4001 3f89 3ea4 3ca1 bf41 bea4 3ffc 3f5e 3ef8 bdfc 3f04 bfa1 3f3a 3f12 "
    "3eed 3fa1 3f4e be4f bfa4 3d8a 3f89 bebd bf94 becd 3f4b 3f88 bf51 bfc3 bf99 3e9a 3d8b bfc7 3ff9 "
    "bf0a 3f8c 3fa3 3fab 3edb bcce be1e 3fbb 3f4d 3f6c bed2 3f17 3f8c be5c"
)


def _from_hex(text):
    vals = [int(w, 16) for w in text.split()]
    return torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in vals], dtype=torch.int16).view(torch.bfloat16)


def test_rms_norm_sum_order_and_association_trap():
    prenorm = _from_hex(_TRAP_ROW).reshape(1, 128)
    gamma = _from_hex(_TRAP_GAMMA)
    eps = 1e-6
    got = rms_norm(prenorm, gamma, eps)
    assert same_bits(got, _numpy_rms_norm(prenorm, gamma, eps))

    # the alternatives really give other bits on this row
    p = prenorm.float()
    g = gamma.float()
    sq = p * p

    def finish(ss, assoc_left=True):
        inv = 1.0 / torch.sqrt(ss / torch.full_like(ss, 128.0) + torch.full_like(ss, eps))
        y = (p * inv[:, None]) * g if assoc_left else p * (inv[:, None] * g)
        return y.to(torch.bfloat16)

    seq = torch.zeros(1)
    for h in range(128):
        seq = seq + sq[:, h]
    tree = sq
    while tree.shape[-1] > 1:
        tree = tree[..., 0::2] + tree[..., 1::2]
    assert same_bits(got, finish(tree[..., 0]))
    assert not same_bits(got, finish(seq))
    assert not same_bits(got, finish(sq.sum(-1)))
    assert not same_bits(got, finish(tree[..., 0], assoc_left=False))


# ----------------------------------------------------------------------------- independent scalar model


class Scalar:
    """fp32 scalar arithmetic on Python floats (exact doubles), every result rounded once.

    Signed zeros are tracked the IEEE way: an exact zero sum is +0 unless both addends are -0;
    a product zero takes the xor of the signs; a nonzero result that rounds to zero keeps its sign.
    """

    @staticmethod
    def _out(q, sign_if_zero_neg, mant_bits=23):
        if isinstance(q, Fraction) and q == 0:
            return -0.0 if sign_if_zero_neg else 0.0
        r = round_to_nearest_even(q, mant_bits)
        if isinstance(r, float):
            return r
        if r == 0:
            return -0.0 if q < 0 else 0.0
        return float(r)

    @staticmethod
    def neg(x):
        return math.copysign(1.0, x) < 0

    @classmethod
    def add(cls, a, b):
        return cls.fma(1.0, a, b)

    @classmethod
    def mul(cls, a, b):
        return cls.fma(a, b, -0.0)  # x * y + (-0) = x * y exactly, zero signs included

    @classmethod
    def fma(cls, a, b, c):
        p = Fraction(a) * Fraction(b)
        p_neg = cls.neg(a) != cls.neg(b)
        return cls._out(p + Fraction(c), p_neg and cls.neg(c))

    @classmethod
    def div(cls, a, b):
        return cls._out(Fraction(a) / Fraction(b), cls.neg(a) != cls.neg(b))

    @classmethod
    def sqrt(cls, a):
        # sqrt rounded to fp64 then to fp32 equals one rounding (53 >= 2*24 + 2)
        return cls._out(Fraction(math.sqrt(a)), False)

    @classmethod
    def bf16(cls, a):
        if math.isnan(a) or math.isinf(a):
            return a
        return cls._out(Fraction(a), cls.neg(a), mant_bits=7)


def scalar_model(contributions, residual, post, comb, pre, gamma, eps):
    S = Scalar
    cs = [c.float().tolist() for c in contributions]
    res = residual.float().tolist()
    post, comb, pre = post.tolist(), comb.tolist(), pre.tolist()
    gm = gamma.float().tolist()
    m, hc, hidden = residual.shape
    eps32 = float(np.float32(eps))
    ro_all, layer_all = [], []
    for t in range(m):
        reduced = []
        for h in range(hidden):
            acc = 0.0
            for c in cs:
                v = c[t][h]
                acc = S.add(acc, 0.0 if v == 0 else v)
            r = S.bf16(acc)
            reduced.append(0.0 if r == 0 else r)
        ro = [[0.0] * hidden for _ in range(hc)]
        for j in range(hc):
            for h in range(hidden):
                mm = S.mul(reduced[h], post[t][j])
                for s in range(hc):
                    mm = S.fma(res[t][s][h], comb[t][s][j], mm)
                ro[j][h] = S.bf16(mm)
        prenorm = []
        for h in range(hidden):
            acc = 0.0
            for j in range(hc):
                acc = S.fma(ro[j][h], pre[t][j], acc)
            prenorm.append(S.bf16(acc))
        width = 1 << (hidden - 1).bit_length()
        level = [S.mul(v, v) for v in prenorm] + [0.0] * (width - hidden)
        while len(level) > 1:
            level = [S.add(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        inv = S.div(1.0, S.sqrt(S.add(S.div(level[0], float(hidden)), eps32)))
        layer_all.append([S.bf16(S.mul(S.mul(prenorm[h], inv), gm[h])) for h in range(hidden)])
        ro_all.append(ro)
    to_bf16 = lambda x: torch.tensor(x, dtype=torch.float32).to(torch.bfloat16)  # exact: values are bf16
    return to_bf16(ro_all), to_bf16(layer_all)


@pytest.mark.parametrize("m, tp, hc, hidden", [(1, 2, 2, 8), (3, 3, 3, 32), (2, 1, 4, 12)])
def test_against_independent_scalar_model(m, tp, hc, hidden):
    g = torch.Generator().manual_seed(m * 100 + tp * 10 + hc)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    contributions = [rand(m, hidden).to(torch.bfloat16) for _ in range(tp)]
    contributions[0][0, 0] = -0.0
    residual = rand(m, hc, hidden, scale=4.0).to(torch.bfloat16)
    post = rand(m, hc)
    comb = rand(m, hc, hc)
    pre = rand(m, hc)
    gamma = rand(hidden).to(torch.bfloat16)
    ro, layer, mx = all_reduce_mhc(contributions, residual, post, comb, pre, gamma, 1e-6, quantize=hidden % 32 == 0)
    want_ro, want_layer = scalar_model(contributions, residual, post, comb, pre, gamma, 1e-6)
    assert same_bits(ro, want_ro)
    assert same_bits(layer, want_layer)
    if hidden % 32 == 0:
        q, s = mx
        q_ref, s_ref = mxfp8_quantize_reference(want_layer)
        assert same_bits(q, q_ref) and torch.equal(s, s_ref)
        assert s.numel() == mxfp8_scale_bytes(m, hidden)


def test_rows_are_independent_odd_m():
    g = torch.Generator().manual_seed(5)
    m, tp, hc, hidden = 5, 3, 2, 64
    contributions = [torch.randn(m, hidden, generator=g).to(torch.bfloat16) for _ in range(tp)]
    residual = torch.randn(m, hc, hidden, generator=g).to(torch.bfloat16)
    post = torch.randn(m, hc, generator=g)
    comb = torch.randn(m, hc, hc, generator=g)
    pre = torch.randn(m, hc, generator=g)
    gamma = torch.randn(hidden, generator=g).to(torch.bfloat16)
    ro, layer, (q, s) = all_reduce_mhc(contributions, residual, post, comb, pre, gamma, 1e-6, quantize=True)
    assert s.numel() == 128 * 4
    for t in range(m):
        sl = slice(t, t + 1)
        ro1, layer1, (q1, s1) = all_reduce_mhc(
            [c[sl] for c in contributions], residual[sl], post[sl], comb[sl], pre[sl], gamma, 1e-6, quantize=True
        )
        assert same_bits(ro1, ro[sl]) and same_bits(layer1, layer[sl]) and same_bits(q1, q[sl])
        assert s1[0].item() == s[16 * t].item() and s1[1].item() == s[16 * t + 1].item()


# ----------------------------------------------------------------------------- validation


def _good():
    contributions, residual, post, comb, pre, gamma, eps = hand_example(4)
    return dict(contributions=contributions, residual=residual, post=post, comb=comb, pre=pre,
                norm_weight=gamma, norm_eps=eps)


@pytest.mark.parametrize(
    "change",
    [
        dict(pre=None),  # exactly one of pre / norm_weight
        dict(norm_weight=None),
        dict(pre=None, norm_weight=None, quantize=True),  # quantize needs the layer input
        dict(contributions=[]),
        dict(contributions="x"),
        dict(contributions=[torch.zeros(1, 32)]),  # fp32
        dict(contributions=[torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(2, 32, dtype=torch.bfloat16)]),
        dict(residual=torch.zeros(1, 2, 16, dtype=torch.bfloat16)),
        dict(residual=torch.zeros(1, 2, 32)),
        dict(post=torch.zeros(1, 3)),
        dict(post=torch.zeros(1, 2, 2)),
        dict(post=torch.zeros(1, 2, dtype=torch.float64)),
        dict(comb=torch.zeros(1, 2, 3)),
        dict(comb=torch.zeros(2, 2, 2)),
        dict(pre=torch.zeros(1, 3)),
        dict(pre=torch.zeros(1, 2, dtype=torch.bfloat16)),
        dict(norm_weight=torch.zeros(16, dtype=torch.bfloat16)),
        dict(norm_weight=torch.zeros(32)),
        dict(norm_eps=None),
        dict(norm_eps=-1.0),
        dict(norm_eps=NAN),
        dict(norm_eps=INF),
        dict(norm_eps=True),
        dict(quantize=1),
    ],
)
def test_all_reduce_mhc_validation(change):
    kwargs = _good()
    all_reduce_mhc(**kwargs)
    kwargs.update(change)
    with pytest.raises(ValueError):
        all_reduce_mhc(**kwargs)


def test_quantize_needs_hidden_multiple_of_32():
    contributions, residual, post, comb, pre, gamma, eps = hand_example(1)  # H = 8
    with pytest.raises(ValueError):
        all_reduce_mhc(contributions, residual, post, comb, pre, gamma, eps, quantize=True)
