"""Tier 2: every CuTe DSL kernel of peer and multicast builds compiles offline (no GPU) to sm_90a and
sm_100a PTX, and the PTX shows what the protocol and the bit contract need. Skipped where
nvidia-cutlass-dsl is not installed."""

import re

import pytest
import torch

pytest.importorskip("cutlass.cute")

from kernels_cute.backend import NOT_IMPLEMENTED, CuteBackend
from kernels_cute.offline import compile_ptx, parse_arch
from lamport_mhc.backend import BuildSpec, load_backend

TP, HC, TOP_K, RANK = 2, 4, 6, 1
LANES = 8  # bf16 per 16-byte fragment, one fragment per thread
KERNELS = ("publish_ll", "finalize_publish_ll", "publish_bt", "finalize_publish_bt", "owner_reduce_bt")
BROADCASTS = ("publish_ll", "finalize_publish_ll", "owner_reduce_bt")  # multicast where the build has it
BUILDS = [(transport, hidden, arch) for transport in ("peer", "multicast") for hidden in (1024, 5120)
          for arch in ("sm_90a", "sm_100a")]


@pytest.fixture(scope="module")
def compiled():
    """PTX of every build, compiled once for the module."""
    ptx = {}
    for transport, hidden, arch in BUILDS:
        spec = BuildSpec(hidden=hidden, hc=HC, capacity=64, top_k=TOP_K, tp=TP, rank=RANK, bt=True,
                         transport=transport)
        ptx[transport, hidden, arch] = compile_ptx(spec, arch)
    return ptx


def _ops(ptx: str, pattern: str) -> list[str]:
    return re.findall(pattern, ptx)


def _each(compiled):
    for (transport, hidden, arch), kernels in compiled.items():
        for name, text in kernels.items():
            yield transport, hidden, arch, name, text


def test_every_kernel_is_built_for_its_target(compiled):
    for (_, _, arch), kernels in compiled.items():
        assert sorted(kernels) == sorted(KERNELS)
        for text in kernels.values():
            assert f".target {arch}" in text


def test_multicast_stores_only_in_multicast_builds(compiled):
    for transport, _, _, name, text in _each(compiled):
        multimem = _ops(text, r"multimem\.st\.[\w.]+")
        # LL publishes and the BT owners' broadcast use multicast; BT publishes go to one owner.
        expected = transport == "multicast" and name in BROADCASTS
        assert len(multimem) == (1 if expected else 0), (transport, name)
        if multimem:
            assert multimem == ["multimem.st.relaxed.sys.global.v4.f32"]


def test_peer_stores_are_16_bytes_one_per_destination(compiled):
    for transport, _, _, name, text in _each(compiled):
        stores = len(_ops(text, r"st\.global\.v4\.b32"))
        if name.endswith("publish_bt"):
            assert stores == 1, (transport, name)  # the owner only
        elif name.endswith("publish_ll"):
            assert stores == (TP if transport == "peer" else 0), (transport, name)
        else:  # owner reduce: the sum to every rank (peer), then the tp re-arms of its own slots
            assert stores == (2 * TP if transport == "peer" else TP), (transport, name)
        # nothing narrower than 16 bytes leaves a thread, except the state and error words
        assert not _ops(text, r"st\.global\.(v2\.)?(b|u|s)(8|16|64)\b"), (transport, name)
        assert not _ops(text, r"st\.global\.v2"), (transport, name)


def test_owner_reduce_polls_16_bytes_volatile_and_rearms(compiled):
    for _, _, _, name, text in _each(compiled):
        polls = _ops(text, r"ld\.volatile\.global\.v4\.b32")
        if name == "owner_reduce_bt":
            assert len(polls) >= TP, name  # every source's fragment, re-loaded in its spin loop
            assert not _ops(text, r"ld\.volatile\.global\.(b|u|s)(8|16)\b"), name
            assert str(0x80008000 - (1 << 32)) in text, name  # the sentinel pair it re-arms with
            assert "atom.acq_rel.gpu.global.cas.b32" in text and "%globaltimer" in text, name  # spin bound
        else:
            assert not polls, name  # publishes never wait


def test_contract_rounding(compiled):
    for _, _, _, name, text in _each(compiled):
        assert not _ops(text, r"rsqrt\.approx|sqrt\.approx|div\.full|div\.approx|ex2\.approx|\.ftz"), name
        fmas = _ops(text, r"\bfma\.[\w.]+")
        adds = _ops(text, r"\badd\.rn\.f32")
        if name.startswith("finalize_publish"):
            # one fma per lane and route, in k order; one add of the shared expert per lane
            assert fmas == ["fma.rn.f32"] * (LANES * TOP_K), name
            assert len(adds) == LANES, name
        elif name.startswith("publish"):
            assert not fmas and not adds, name  # bits in, bits out
        else:
            assert not fmas, f"{name}: contraction where the contract has none"
            assert len(adds) == LANES * TP, name  # (0 + c_0) + c_1 ..., per lane
        # no fp32 arithmetic that the contract does not spell out
        arithmetic = set(_ops(text, r"\b(?:add|sub|mul|fma|mad|div|sqrt|rsqrt|rcp|neg|abs|min|max)(?:\.\w+)*\.f32\b"))
        assert arithmetic <= {"add.rn.f32", "fma.rn.f32"}, (name, arithmetic)


def test_pdl_waits_before_any_global_load(compiled):
    for _, _, _, name, text in _each(compiled):
        assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text, name
        first_load = re.search(r"ld\.(volatile\.)?global", text)
        assert first_load and text.index("griddepcontrol.wait") < first_load.start(), name


def test_no_pdl_build_has_no_griddepcontrol():
    spec = BuildSpec(hidden=256, hc=HC, capacity=8, top_k=2, tp=TP, rank=0, bt=True, use_pdl=False)
    for name, text in compile_ptx(spec, "sm_90a").items():
        assert "griddepcontrol" not in text, name


def test_arch_names():
    assert parse_arch("sm_90a") == parse_arch("sm_90") == parse_arch("90") == "sm_90a"
    assert parse_arch("sm_100a") == "sm_100a"
    with pytest.raises(ValueError, match="sm_90a or newer"):
        parse_arch("sm_80")


def test_backend_loads_and_says_it_cannot_run_yet():
    backend = load_backend("cute")
    assert isinstance(backend, CuteBackend)
    spec = BuildSpec(hidden=256, hc=HC, capacity=8, top_k=2, tp=TP, rank=0)
    answer = backend.support(spec, torch.device("cpu"))
    assert not answer.ok and "CUDA device" in answer.reason
    with pytest.raises(NotImplementedError, match=NOT_IMPLEMENTED):
        backend.build(spec, workspace=None)
