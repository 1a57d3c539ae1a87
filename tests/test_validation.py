"""Every kind of bad argument raises ValueError before any launch: the mailboxes and generation
state are untouched and the next good call is still right."""

import pytest
import torch

from lamport_mhc import SimulatedGroup, mxfp8_scale_bytes
from lamport_mhc.testing import check_simulated, random_inputs

H, HC, CAP, TOP_K, EPS = 256, 4, 8, 3, 1e-6


@pytest.fixture(scope="module")
def group():
    return SimulatedGroup(2, hidden_size=H, hc_mult=HC, max_num_tokens=CAP, top_k=TOP_K,
                          quantize_layer_input=True, bt_min_rows=4, bt_min_finalize_rows=4)


@pytest.fixture(scope="module")
def plain_group():
    """Built without quantize_layer_input and residual_only."""
    return SimulatedGroup(2, hidden_size=H, hc_mult=HC, max_num_tokens=CAP, top_k=TOP_K)


def _misaligned(t):
    """Same shape and dtype, contiguous, but one element off a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype)[1:1 + t.numel()]
    return flat.view(t.shape).copy_(t)


def _args(m=3, seed=0):
    inputs = random_inputs(2, m, H, HC, seed=seed, top_k=TOP_K)
    return inputs, dict(xs=inputs["xs"], residual=inputs["residual"], post=inputs["post"], comb=inputs["comb"],
                        pre=inputs["pre"], norm_weight=inputs["norm_weight"], norm_eps=EPS)


BAD_PLAIN = {
    "x dtype": (lambda a: a.update(xs=[x.float() for x in a["xs"]]), "x must be torch.bfloat16"),
    "x hidden": (lambda a: a.update(xs=[x[:, :128].contiguous() for x in a["xs"]]), "x must have shape"),
    "x not contiguous": (lambda a: a.update(xs=[torch.cat([x, x], 1)[:, ::2] for x in a["xs"]]), "contiguous"),
    "x misaligned": (lambda a: a.update(xs=[_misaligned(x) for x in a["xs"]]), "16-byte aligned"),
    "x on another device": (lambda a: a.update(xs=[x.to("meta") for x in a["xs"]]), "must be on cpu"),
    "M = 0": (lambda a: a.update(xs=[x[:0] for x in a["xs"]]), "1 <= M <= max_num_tokens"),
    "M > capacity": (lambda a: a.update(xs=[torch.zeros(CAP + 1, H, dtype=torch.bfloat16)] * 2),
                     "1 <= M <= max_num_tokens"),
    "residual rows": (lambda a: a.update(residual=a["residual"][:2].contiguous()), "residual must have shape"),
    "residual dtype": (lambda a: a.update(residual=a["residual"].half()), "residual must be torch.bfloat16"),
    "post dtype": (lambda a: a.update(post=a["post"].double()), "post must be torch.float32"),
    "post shape": (lambda a: a.update(post=a["post"][:, :2].contiguous()), "post must have shape"),
    "comb shape": (lambda a: a.update(comb=a["comb"].transpose(1, 2)), "comb must be contiguous"),
    "post misaligned": (lambda a: a.update(post=_misaligned(a["post"])), "post must be 16-byte aligned"),
    "comb misaligned": (lambda a: a.update(comb=_misaligned(a["comb"])), "comb must be 16-byte aligned"),
    "pre misaligned": (lambda a: a.update(pre=_misaligned(a["pre"])), "pre must be 16-byte aligned"),
    "pre shape": (lambda a: a.update(pre=a["pre"][:, :3].contiguous()), "pre must have shape"),
    "norm_weight dtype": (lambda a: a.update(norm_weight=a["norm_weight"].float()), "norm_weight must be"),
    "pre without norm_weight": (lambda a: a.update(norm_weight=None), "both be given, or both be None"),
    "eps NaN": (lambda a: a.update(norm_eps=float("nan")), "norm_eps must be a finite non-negative"),
    "eps negative": (lambda a: a.update(norm_eps=-1e-6), "norm_eps must be a finite non-negative"),
    "eps bool": (lambda a: a.update(norm_eps=True), "norm_eps must be a finite non-negative"),
    "xs not per rank": (lambda a: a.update(xs=a["xs"][:1]), "list of 2 per-rank tensors"),
}


def _snapshot(group):
    return [ws.snapshot() for ws in group.workspaces]


def _assert_untouched(group, before):
    for rank_before, ws in zip(before, group.workspaces):
        for name, tensor in ws.snapshot().items():
            assert torch.equal(tensor, rank_before[name]), f"{name} changed by a rejected call"


@pytest.mark.parametrize("case", sorted(BAD_PLAIN))
def test_bad_plain_argument(group, case):
    mutate, message = BAD_PLAIN[case]
    inputs, args = _args(m=5 if "M" not in case else 3, seed=len(case))
    mutate(args)
    before = _snapshot(group)
    with pytest.raises(ValueError, match=message):
        group.all_reduce_mhc(args["xs"], args["residual"], args["post"], args["comb"], args["pre"],
                             args["norm_weight"], args["norm_eps"])
    _assert_untouched(group, before)
    check_simulated(group, inputs, "plain", EPS)  # the next good call is still right


BAD_FINALIZE = {
    "weights dtype": (lambda f: f.update(weights=[w.half() for w in f["weights"]]), "expert_weights must be"),
    "indices dtype": (lambda f: f.update(idxs=[i.long() for i in f["idxs"]]), "expanded_idx_to_permuted_idx must be"),
    "indices shape": (lambda f: f.update(idxs=[i[:, :2].contiguous() for i in f["idxs"]]), "must have shape"),
    "index out of range": (lambda f: f["idxs"][1].__setitem__((1, 0), 10_000), r"must lie in \[-1, "),
    "index below -1": (lambda f: f["idxs"][0].__setitem__((0, 0), -2), r"must lie in \[-1, "),
    "gemm2 hidden": (lambda f: f.update(gemm2s=[g[:, :128].contiguous() for g in f["gemm2s"]]), "gemm2_permuted"),
    "gemm2 1-D": (lambda f: f.update(gemm2s=[g.flatten() for g in f["gemm2s"]]), "2-D tensor"),
    "shared rows": (lambda f: f.update(shareds=[s[:2].contiguous() for s in f["shareds"]]), "must have shape"),
}


@pytest.mark.parametrize("case", sorted(BAD_FINALIZE))
def test_bad_finalize_argument(group, case):
    mutate, message = BAD_FINALIZE[case]
    inputs = random_inputs(2, 5, H, HC, seed=len(case), top_k=TOP_K)
    bad = {k: [t.clone() for t in inputs[k]] for k in ("gemm2s", "weights", "idxs", "shareds")}
    mutate(bad)
    before = _snapshot(group)
    with pytest.raises(ValueError, match=message):
        group.finalize(bad["gemm2s"], bad["weights"], bad["idxs"], bad["shareds"], inputs["residual"],
                       inputs["post"], inputs["comb"], inputs["pre"], inputs["norm_weight"], EPS)
    _assert_untouched(group, before)
    check_simulated(group, inputs, "finalize", EPS)


def test_routing_tensors_may_be_4_byte_aligned(group):
    """expert_weights and expanded_idx_to_permuted_idx need only their element's alignment (the
    kernels are not specialized on theirs): one element off a 16-byte boundary, the bits are the
    reference's."""
    inputs = random_inputs(2, 5, H, HC, seed=11, top_k=TOP_K)
    inputs["weights"] = [_misaligned(w) for w in inputs["weights"]]
    inputs["idxs"] = [_misaligned(i) for i in inputs["idxs"]]
    assert all(t.data_ptr() % 16 for t in inputs["weights"] + inputs["idxs"])
    check_simulated(group, inputs, "finalize", EPS)


def test_variants_the_build_lacks(plain_group):
    inputs, args = _args()
    before = _snapshot(plain_group)
    with pytest.raises(ValueError, match="residual_only=True"):
        plain_group.all_reduce_mhc(args["xs"], args["residual"], args["post"], args["comb"], None, None, EPS)
    with pytest.raises(ValueError, match="quantize_layer_input=True"):
        plain_group.all_reduce_mhc(args["xs"], args["residual"], args["post"], args["comb"], args["pre"],
                                   args["norm_weight"], EPS, mxfp8=True)
    _assert_untouched(plain_group, before)
    check_simulated(plain_group, inputs, "plain", EPS)


def test_mxfp8_buffers_are_checked():
    from lamport_mhc import validate
    from lamport_mhc.backend import BuildSpec

    spec = BuildSpec(hidden=H, hc=HC, capacity=CAP, top_k=TOP_K, tp=1, rank=0, quantize=True)
    inputs, args = _args(m=3)
    cpu = torch.device("cpu")
    good = (torch.empty(3, H, dtype=torch.float8_e4m3fn), torch.empty(mxfp8_scale_bytes(3, H), dtype=torch.uint8))
    validate.plain_call(spec, cpu, args["xs"][0], args["residual"], args["post"], args["comb"], args["pre"],
                        args["norm_weight"], EPS, good)
    for bad, message in (((good[0].view(torch.uint8), good[1]), "values must be torch.float8_e4m3fn"),
                         ((good[0], good[1][:-4]), r"mxfp8_scale_bytes\(3, 256\) = 1024 bytes"),
                         ((good[0], good[1].view(torch.int32)), "scales must hold"),
                         ((good[0],), "a \\(values, scales\\) pair")):
        with pytest.raises(ValueError, match=message):
            validate.plain_call(spec, cpu, args["xs"][0], args["residual"], args["post"], args["comb"], args["pre"],
                                args["norm_weight"], EPS, bad)


@pytest.mark.parametrize("kwargs,message", [
    (dict(hidden_size=100), "multiple of 8"),
    (dict(hidden_size=264, quantize_layer_input=True), "multiple of 128"),
    (dict(max_num_tokens=0), "max_num_tokens must be a positive int"),
    (dict(hc_mult=0), "hc_mult must be a positive int"),
    (dict(top_k=1.5), "top_k must be a positive int"),
    (dict(backend="cute"), "CuTe DSL kernels need a GPU"),
    (dict(bt_min_rows=0), "bt_min_rows must be a positive int"),
])
def test_bad_build(kwargs, message):
    build = dict(hidden_size=H, hc_mult=HC, max_num_tokens=CAP, top_k=TOP_K) | kwargs
    with pytest.raises(ValueError, match=message):
        SimulatedGroup(2, **build)
