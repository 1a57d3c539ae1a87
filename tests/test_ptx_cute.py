"""Tier 2: every CuTe DSL kernel of peer and multicast builds compiles offline (no GPU) to sm_90a and
sm_100a PTX, and the PTX shows what the protocol and the bit contract need. Skipped where
nvidia-cutlass-dsl or flashinfer-python (whose MXFP8 helpers the quant consumer calls) is missing."""

import re

import pytest
import torch

pytest.importorskip("cutlass.cute")
pytest.importorskip("flashinfer.quantization.quantization_cute_dsl_utils")

from kernels_cute.backend import MAX_HIDDEN, CuteBackend
from kernels_cute.consumer import ConsumerKernel, tree_adds
from kernels_cute.offline import compile_ptx, parse_arch
from lamport_mhc.backend import BuildSpec, load_backend

TP, HC, TOP_K, RANK = 2, 4, 6, 1
LANES = 8  # bf16 per 16-byte fragment, one fragment per thread
CONSUMERS = tuple(f"consumer_{protocol}_{variant}" for protocol in ("ll", "bt")
                  for variant in ("plain", "quant", "residual"))
ONE_KERNEL = tuple(f"{prefix}_ll_{variant}" for prefix in ("one_kernel", "one_kernel_finalize")
                   for variant in ("plain", "quant", "residual"))
KERNELS = ("publish_ll", "finalize_publish_ll", "publish_bt", "finalize_publish_bt", "owner_reduce_bt") + CONSUMERS
BROADCASTS = ("publish_ll", "finalize_publish_ll", "owner_reduce_bt") + ONE_KERNEL  # multicast where the build has it
ONE_KERNEL_HIDDEN = 5120  # the builds with LL's one-kernel forms
# 1536: a token spans 2 CTAs, the second half empty (threads past H); 768: one CTA of 3 warps.
BUILDS = [(transport, hidden, arch) for transport in ("peer", "multicast") for hidden in (1024, 5120)
          for arch in ("sm_90a", "sm_100a")] + [("peer", 1536, "sm_90a"), ("peer", 768, "sm_100a")]


def _spec(hidden, transport="peer", **kwargs):
    return BuildSpec(hidden=hidden, hc=HC, capacity=64, top_k=TOP_K, tp=TP, rank=RANK, bt=True, quantize=True,
                     residual_only=True, transport=transport,
                     ll_one_kernel_rows=8 if hidden == ONE_KERNEL_HIDDEN else 0, **kwargs)


def _consumer(name):
    return name.startswith(("consumer", "one_kernel"))


@pytest.fixture(scope="module")
def compiled():
    """PTX of every build, compiled once for the module (about 75 s for all 10 builds)."""
    return {(transport, hidden, arch): compile_ptx(_spec(hidden, transport), arch)
            for transport, hidden, arch in BUILDS}


def _ops(ptx: str, pattern: str) -> list[str]:
    return re.findall(pattern, ptx)


def _each(compiled):
    for (transport, hidden, arch), kernels in compiled.items():
        for name, text in kernels.items():
            yield transport, hidden, arch, name, text


def test_every_kernel_is_built_for_its_target(compiled):
    for (_, hidden, arch), kernels in compiled.items():
        assert sorted(kernels) == sorted(KERNELS + (ONE_KERNEL if hidden == ONE_KERNEL_HIDDEN else ()))
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
        if _consumer(name):
            # hc residual streams (+ the layer input), then the re-arm of every slot read; a one-kernel
            # form publishes first, as publish_ll does
            rearms = TP if "_ll_" in name else 1
            published = (TP if transport == "peer" else 0) if name.startswith("one_kernel") else 0
            assert stores == HC + (0 if name.endswith("residual") else 1) + rearms + published, (transport, name)
            # the 8 MXFP8 values of a thread: one 8-byte store (FlashInfer's); scale words and state are b32
            assert len(_ops(text, r"st\.global\.u64")) == (1 if name.endswith("quant") else 0), name
            assert not _ops(text, r"st\.global\.(v2\.)?(b|u|s)(8|16)\b|st\.global\.v2"), (transport, name)
            continue
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
        if _consumer(name):
            # LL: every source's fragment, BT: the owners' sum; each loaded before and in its spin loop
            assert len(polls) == 2 * (TP if "_ll_" in name else 1), name
            assert not _ops(text, r"ld\.volatile\.global\.(b|u|s)(8|16)\b"), name
            assert str(0x80008000 - (1 << 32)) in text, name
            assert "atom.acq_rel.gpu.global.cas.b32" in text and "%globaltimer" in text, name
        elif name == "owner_reduce_bt":
            assert len(polls) >= TP, name  # every source's fragment, re-loaded in its spin loop
            assert not _ops(text, r"ld\.volatile\.global\.(b|u|s)(8|16)\b"), name
            assert str(0x80008000 - (1 << 32)) in text, name  # the sentinel pair it re-arms with
            assert "atom.acq_rel.gpu.global.cas.b32" in text and "%globaltimer" in text, name  # spin bound
        else:
            assert not polls, name  # publishes never wait


# The spin-timeout record into the host mirror: the three words, a system fence, then the flag.
MIRROR_RECORD = re.compile(r"st\.global\.b32 \[(%rd\d+)\+4\], %r\d+; st\.global\.b32 \[\1\+8\], %r\d+; "
                           r"st\.global\.b32 \[\1\+12\], %r\d+; fence\.sc\.sys; "
                           r"st\.relaxed\.sys\.global\.b32 \[\1\], %r\d+;")


def test_spin_timeouts_reach_the_host_mirror_flag_last(compiled):
    """Every kernel that polls claims the device flag with a CAS, then writes the host mirror's
    record with plain stores and the flag after ``fence.sc.sys``; kernels that never wait have none."""
    for _, _, _, name, text in _each(compiled):
        records = MIRROR_RECORD.findall(text)
        if _consumer(name) or name == "owner_reduce_bt":
            assert records and text.count("fence.sc.sys") == len(records), name
            assert 0 <= text.find("atom.acq_rel.gpu.global.cas.b32") < text.find("fence.sc.sys"), name
            assert "ld.global.b64" in text, name  # the mirror's address, from the error buffer
            assert not _ops(text, r"atom\.[\w.]*\.sys|red\.[\w.]*\.sys"), name  # no atomics to host memory
        else:
            assert not records and "fence.sc.sys" not in text, name


def _consumer_counts(name: str, hidden: int) -> dict[str, int]:
    """The contract's fp32 operations of one consumer thread, each an explicit ``.rn`` instruction."""
    ll, norm, quant = "_ll_" in name, not name.endswith("residual"), name.endswith("quant")
    finalize = name.startswith("one_kernel_finalize")  # + the MoE finalize, as finalize_publish_ll
    kernel = ConsumerKernel(hidden=hidden, hc=HC, tp=TP, variant=name.rsplit("_", 1)[1], bt=not ll, use_pdl=True)
    # the rank-order sum (LL); per cluster: 3 levels over a thread's lanes, 5 butterfly levels, the tree of
    # the warps' slots (padding folded), + eps
    adds = (TP * LANES if ll else 0) + (7 + 5 + tree_adds(kernel.slots, kernel.tree_slots) + 1 if norm else 0)
    adds += LANES if finalize else 0
    return {
        "fma.rn.f32": LANES * HC * HC + (LANES * HC if norm else 0) + (LANES * TOP_K if finalize else 0),
        "mul.rn.f32": LANES * HC + (3 * LANES if norm else 0) + (1 if quant else 0),  # quant: amax / 448
        "add.rn.f32": adds,
        "div.rn.f32": 2 if norm else 0,   # ss / H, 1 / sqrt
        "sqrt.rn.f32": 1 if norm else 0,
    }


def test_consumer_contract_arithmetic(compiled):
    for _, hidden, _, name, text in _each(compiled):
        if not _consumer(name):
            continue
        for op, count in _consumer_counts(name, hidden).items():
            assert len(_ops(text, re.escape(op) + r"\b")) == count, (name, hidden, op)
        arithmetic = set(_ops(text, r"\b(?:add|sub|mul|fma|mad|div|sqrt|rsqrt|rcp|neg|abs|min|max)(?:\.\w+)*\.f32\b"))
        allowed = {"add.rn.f32", "fma.rn.f32", "mul.rn.f32", "div.rn.f32", "sqrt.rn.f32"}
        bare_multiplies = 0
        if name.endswith("quant"):
            # FlashInfer's MXFP8 helpers: the block max (max.bf16x2, then max.f32 within the thread and
            # across its 4 threads), then per value a multiply by the inverse scale and the clamp to
            # +-448 before cvt.rn.satfinite.e4m3x2. Their multiply has no rounding suffix (it is
            # round-to-nearest) and only a clamp follows it, so nothing can contract it.
            allowed |= {"min.f32", "max.f32", "mul.f32"}
            bare_multiplies = LANES
            assert len(_ops(text, r"max\.bf16x2")) == 3, name
            assert len(_ops(text, r"cvt\.rn\.satfinite\.e4m3x2\.f32")) == LANES // 2, name
            assert len(_ops(text, r"\bmin\.f32")) == LANES, name
            assert len(_ops(text, r"\bmax\.f32")) == LANES + 3, name
        assert arithmetic <= allowed, (name, arithmetic)
        # no other fp32 arithmetic without an explicit rounding mode (which NVVM or ptxas could contract)
        assert not _ops(text, r"\b(?:add|sub|fma|div|sqrt)\.f32\b"), name
        assert len(_ops(text, r"\bmul\.f32\b")) == bare_multiplies, name


def test_consumer_cluster_reduction(compiled):
    """The norm variants reduce the sum of squares over the token's cluster through DSMEM: every CTA
    announces it started, waits for the others before the first remote store, and a second cluster
    barrier publishes the stores before any CTA reads its slots."""
    for _, hidden, _, name, text in _each(compiled):
        if not _consumer(name):
            continue
        cluster = _ops(text, r"mapa\.shared::cluster|st\.shared::cluster|barrier\.cluster\.[\w.]+|ld\.shared\.f32")
        if name.endswith("residual"):
            assert not cluster, name
            continue
        slots = ConsumerKernel(hidden=hidden, hc=HC, tp=TP, variant="plain", bt=False, use_pdl=True).slots
        assert cluster == (["barrier.cluster.arrive.relaxed.aligned", "barrier.cluster.wait.acquire.aligned",
                            "mapa.shared::cluster", "st.shared::cluster", "barrier.cluster.arrive.release.aligned",
                            "barrier.cluster.wait.acquire.aligned"] + ["ld.shared.f32"] * slots), (name, hidden)
        assert len(_ops(text, r"shfl\.sync\.bfly\.b32")) == 5 + (4 if name.endswith("quant") else 0), name


def test_contract_rounding(compiled):
    for _, _, _, name, text in _each(compiled):
        assert not _ops(text, r"rsqrt\.approx|sqrt\.approx|div\.full|div\.approx|ex2\.approx|\.ftz"), name
        if _consumer(name):
            continue  # test_consumer_contract_arithmetic
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
        wait = text.index("griddepcontrol.wait")
        if name.startswith("consumer"):
            # A consumer after a publish kernel reads its inputs (complete before the publish let it start) before the wait,
            # the generation state and the mailbox after it; it stores nothing before it.
            first_load = re.search(r"ld\.volatile\.global", text)
            first_store = re.search(r"\bst\.global|atom\.", text)
            assert first_store and wait < first_store.start(), name
        else:
            first_load = re.search(r"ld\.(volatile\.)?global", text)
        assert first_load and wait < first_load.start(), name
        assert text.index("griddepcontrol.launch_dependents") > text.rindex("st.global"), name


def test_no_pdl_build_has_no_griddepcontrol():
    spec = BuildSpec(hidden=256, hc=HC, capacity=8, top_k=2, tp=TP, rank=0, bt=True, quantize=True,
                     residual_only=True, ll_one_kernel_rows=8, use_pdl=False)
    kernels = compile_ptx(spec, "sm_90a")
    assert sorted(kernels) == sorted(KERNELS + ONE_KERNEL)
    for name, text in kernels.items():
        assert "griddepcontrol" not in text, name


def test_one_kernel_counts_its_ctas_and_advances_the_generation(compiled):
    for _, _, _, name, text in _each(compiled):
        adds = _ops(text, r"atom\.[\w.]*add[\w.]*")
        if not name.startswith("one_kernel"):
            assert not adds, name
            continue
        # every CTA counts itself in after a CTA barrier (all its threads read NEXT), then consumes;
        # the last one zeroes the count and advances NEXT: the final two state stores
        assert adds == ["atom.acq_rel.gpu.global.add.u32"], name
        assert text.index("bar.sync") < text.index("atom.acq_rel.gpu.global.add.u32") < text.index(
            "ld.volatile.global.v4.b32"), name
        assert len(_ops(text, r"st\.global\.b32")) >= 2, name


def test_consumer_shapes():
    # one thread per 16-byte fragment, 128 threads per CTA, one cluster per token
    assert [(k.threads, k.ctas, k.slots, k.tree_slots) for k in (
        ConsumerKernel(hidden=h, hc=HC, tp=TP, variant="plain", bt=False, use_pdl=True)
        for h in (256, 768, 4096, 5120, 7168, 8192))] == [
        (32, 1, 1, 1), (96, 1, 3, 4), (128, 4, 16, 16), (128, 5, 20, 32), (128, 7, 28, 32), (128, 8, 32, 32)]
    with pytest.raises(ValueError, match="cluster"):
        ConsumerKernel(hidden=8192 + 1024, hc=HC, tp=TP, variant="plain", bt=False, use_pdl=True)
    ConsumerKernel(hidden=8192 + 1024, hc=HC, tp=TP, variant="residual", bt=False, use_pdl=True)  # no norm
    with pytest.raises(ValueError, match="128"):
        ConsumerKernel(hidden=1088, hc=HC, tp=TP, variant="quant", bt=False, use_pdl=True)


def test_tree_adds_matches_the_padded_tree():
    # 20 slots padded to 32: 10 + 5 + 3 (x + 0 included) + 2 + 1 adds; 0 + 0 nodes are folded
    assert tree_adds(20, 32) == 21
    assert tree_adds(16, 16) == 15 and tree_adds(3, 4) == 3 and tree_adds(1, 1) == 0


def test_arch_names():
    assert parse_arch("sm_90a") == parse_arch("sm_90") == parse_arch("90") == "sm_90a"
    assert parse_arch("sm_100a") == "sm_100a"
    with pytest.raises(ValueError, match="sm_90a or newer"):
        parse_arch("sm_80")


def test_backend_loads_and_says_why_it_cannot_run_on_cpu():
    backend = load_backend("cute")
    assert isinstance(backend, CuteBackend)
    spec = BuildSpec(hidden=256, hc=HC, capacity=8, top_k=2, tp=TP, rank=0)
    answer = backend.support(spec, torch.device("cpu"))
    assert not answer.ok and "CUDA device" in answer.reason
    with pytest.raises(ValueError, match="no interpreter"):
        backend.build(spec, workspace=None, interpret=True)


def test_norm_consumer_rejects_rows_wider_than_one_cluster():
    with pytest.raises(ValueError, match="hidden <= 8192"):
        ConsumerKernel(hidden=MAX_HIDDEN + 1024, hc=HC, tp=TP, variant="plain", bt=False, use_pdl=True)
