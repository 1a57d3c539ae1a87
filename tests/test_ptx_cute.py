"""Tier 2: every CuTe DSL kernel of peer and multicast builds (and of a group of one's local builds)
compiles offline (no GPU) to sm_90a and sm_100a PTX, and the PTX shows what the protocol and the bit
contract need; the cubins ptxas writes show no spills and the streaming form's launch bound. Skipped
where nvidia-cutlass-dsl or flashinfer-python (whose MXFP8 helpers the quant consumer calls) is
missing."""

import re

import pytest
import torch

pytest.importorskip("cutlass.cute")
pytest.importorskip("flashinfer.quantization.quantization_cute_dsl_utils")

from kernels_cute.backend import MAX_HIDDEN, CuteBackend
from kernels_cute.consumer import ConsumerKernel
from kernels_cute.mhc import tree_adds
from kernels_cute.offline import compile_kernels, compile_ptx, parse_arch
from kernels_cute.plan import kernel_plan
from kernels_cute.streaming import StreamingConsumerKernel, min_ctas_per_sm, streaming_shape
from lamport_mhc.backend import BuildSpec, load_backend

# The module's builds are shared fixtures: its tests run on one xdist worker (``--dist loadgroup``),
# which builds them once.
pytestmark = pytest.mark.xdist_group("ptx_cute")

TP, HC, TOP_K, RANK = 2, 4, 6, 1
LANES = 8  # bf16 per 16-byte fragment, one fragment per thread
VARIANTS = ("plain", "quant", "residual")
CONSUMERS = tuple(f"{form}consumer_{protocol}_{variant}" for form in ("", "streaming_") for protocol in ("ll", "bt")
                  for variant in VARIANTS)
ONE_KERNEL = tuple(f"{prefix}_ll_{variant}" for prefix in ("one_kernel", "one_kernel_finalize") for variant in VARIANTS)
LOCAL = tuple(f"{form}{prefix}_{variant}" for form in ("", "streaming_") for prefix in ("local", "local_finalize")
              for variant in VARIANTS)
KERNELS = ("publish_ll", "finalize_publish_ll", "publish_bt", "finalize_publish_bt", "owner_reduce_bt") + CONSUMERS
BROADCASTS = ("publish_ll", "finalize_publish_ll", "owner_reduce_bt") + ONE_KERNEL  # multicast where the build has it
ONE_KERNEL_HIDDEN = 5120  # the builds with LL's one-kernel forms
# (tp, transport, hidden, arch). 5376: a token spans 6 CTAs, the last one 32 threads, and the
# streaming form's second iteration 320 of its 352 threads (threads and whole warps past H);
# 768: one CTA of 3 warps. tp = 1: a group of one, the local forms only (4352: the streaming form's
# second iteration 256 of 288 threads).
BUILDS = ([(TP, transport, hidden, arch) for transport in ("peer", "multicast") for hidden in (1024, 5120)
           for arch in ("sm_90a", "sm_100a")] + [(TP, "peer", 5376, "sm_90a"), (TP, "peer", 768, "sm_100a")]
          + [(1, "peer", 5120, "sm_90a"), (1, "peer", 4352, "sm_100a")])


def _spec(tp, hidden, transport="peer", **kwargs):
    return BuildSpec(hidden=hidden, hc=HC, capacity=64, top_k=TOP_K, tp=tp, rank=RANK if tp > 1 else 0, bt=tp > 1,
                     quantize=True, residual_only=True, transport=transport,
                     ll_one_kernel_rows=8 if hidden == ONE_KERNEL_HIDDEN else 0, **kwargs)


def _consumer(name):
    return name.startswith(("consumer", "one_kernel", "streaming", "local"))


def _local(name):
    return name.startswith(("local", "streaming_local"))


def _streaming(name):
    return name.startswith("streaming")


@pytest.fixture(scope="module")
def built():
    """Every build's kernels (PTX, registers, spills), compiled once for the module (about 100 s)."""
    return {build: compile_kernels(_spec(build[0], build[2], build[1]), build[3]) for build in BUILDS}


@pytest.fixture(scope="module")
def compiled(built):
    return {build: {name: kernel.ptx for name, kernel in kernels.items()} for build, kernels in built.items()}


def _ops(ptx: str, pattern: str) -> list[str]:
    return re.findall(pattern, ptx)


def _each(compiled):
    for (tp, transport, hidden, arch), kernels in compiled.items():
        for name, text in kernels.items():
            yield tp, transport, hidden, arch, name, text


def _kernel(tp, hidden, name):
    """The kernel object of ``name`` in the build (its shape: iterations, slots, threads)."""
    return kernel_plan(_spec(tp, hidden))[name].kernel


def _iterations(tp, hidden, name):
    return _kernel(tp, hidden, name).iterations if _streaming(name) else 1


def test_every_kernel_is_built_for_its_target(compiled):
    for (tp, _, hidden, arch), kernels in compiled.items():
        expected = LOCAL if tp == 1 else KERNELS + (ONE_KERNEL if hidden == ONE_KERNEL_HIDDEN else ())
        assert sorted(kernels) == sorted(expected), (tp, hidden)
        for text in kernels.values():
            assert f".target {arch}" in text


def test_multicast_stores_only_in_multicast_builds(compiled):
    for _, transport, _, _, name, text in _each(compiled):
        multimem = _ops(text, r"multimem\.st\.[\w.]+")
        # LL publishes and the BT owners' broadcast use multicast; BT publishes go to one owner.
        expected = transport == "multicast" and name in BROADCASTS
        assert len(multimem) == (1 if expected else 0), (transport, name)
        if multimem:
            assert multimem == ["multimem.st.relaxed.sys.global.v4.f32"]


def test_peer_stores_are_16_bytes_one_per_destination(compiled):
    for tp, transport, hidden, _, name, text in _each(compiled):
        stores = len(_ops(text, r"st\.global(?:\.L2::cache_hint)?\.v4\.b32"))
        if _consumer(name):
            # per iteration: hc residual streams (+ the layer input), then the re-arm of every slot read
            # (none in the local form); a one-kernel form publishes first, as publish_ll does
            rearms = 0 if _local(name) else TP if "_ll_" in name else 1
            published = (TP if transport == "peer" else 0) if name.startswith("one_kernel") else 0
            norm = 0 if name.endswith("residual") else 1
            iterations = _iterations(tp, hidden, name)
            assert stores == iterations * (HC + norm + rearms) + published, (transport, name)
            # the 8 MXFP8 values of a thread: one 8-byte store; scale words and state are b32
            assert len(_ops(text, r"st\.global\.v2\.b32")) == (iterations if name.endswith("quant") else 0), name
            assert not _ops(text, r"st\.global\.(v2\.)?(b|u|s)(8|16|64)\b"), (transport, name)
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


def test_streaming_local_forms_hint_what_the_call_moves_once(compiled):
    """The streaming local form loads the streams and the contribution's inputs and stores the
    streams under the call's L2 policy (evict-first or evict-normal, chosen per call); the layer
    input and every other kernel's accesses carry no hint."""
    for tp, _, hidden, _, name, text in _each(compiled):
        hinted_loads = _ops(text, r"ld\.global\.L2::cache_hint\.v4\.b32")
        hinted_stores = _ops(text, r"st\.global\.L2::cache_hint\.v4\.b32")
        if not (_streaming(name) and _local(name)):
            assert not hinted_loads and not hinted_stores and "createpolicy" not in text, name
            continue
        iterations = _iterations(tp, hidden, name)
        inputs = TOP_K + 1 if "finalize" in name else 1
        assert len(hinted_loads) == iterations * (HC + inputs), name
        assert len(hinted_stores) == iterations * HC, name
        assert len(_ops(text, r"st\.global\.v4\.b32")) == (0 if name.endswith("residual") else iterations), name
        assert _ops(text, r"createpolicy\.fractional\.L2::evict_first\.b64") and \
            _ops(text, r"createpolicy\.fractional\.L2::evict_normal\.b64"), name


def test_polls_are_16_bytes_volatile_and_the_local_form_has_none(compiled):
    for tp, _, hidden, _, name, text in _each(compiled):
        polls = _ops(text, r"ld\.volatile\.global\.v4\.b32")
        if _local(name):
            # a group of one: no mailbox, no poll, no spin bound, no generation state
            assert not _ops(text, r"ld\.volatile|atom\.|%globaltimer"), name
            assert str(0x80008000 - (1 << 32)) not in text, name
            continue
        if _consumer(name) or name == "owner_reduce_bt":
            # every slot read (LL and the owner reduce: one per source, BT: the owners' sum), all in
            # flight together, loaded before and in the one spin loop, per iteration of the row
            sources = TP if "_ll_" in name or name == "owner_reduce_bt" else 1
            assert len(polls) == 2 * sources * _iterations(tp, hidden, name), name
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
    record with plain stores and the flag after ``fence.sc.sys``; kernels that never wait (the local
    form included) have none."""
    for _, _, _, _, name, text in _each(compiled):
        records = MIRROR_RECORD.findall(text)
        if (_consumer(name) and not _local(name)) or name == "owner_reduce_bt":
            assert records and text.count("fence.sc.sys") == len(records), name
            assert 0 <= text.find("atom.acq_rel.gpu.global.cas.b32") < text.find("fence.sc.sys"), name
            assert "ld.global.b64" in text, name  # the mirror's address, from the error buffer
            assert not _ops(text, r"atom\.[\w.]*\.sys|red\.[\w.]*\.sys"), name  # no atomics to host memory
        else:
            assert not records and "fence.sc.sys" not in text, name


def _consumer_counts(tp: int, hidden: int, name: str) -> dict[str, int]:
    """The contract's fp32 operations of one consumer thread, each an explicit ``.rn`` instruction."""
    ll, norm, quant = "_ll_" in name, not name.endswith("residual"), name.endswith("quant")
    finalize = "finalize" in name  # + the MoE finalize, as finalize_publish_ll
    local = _local(name)
    kernel = _kernel(tp, hidden, name)
    iterations = _iterations(tp, hidden, name)
    # per iteration: the rank-order sum (LL; local: the sum of one rank, 0 + c), the finalize's shared
    # expert, 3 levels over a thread's lanes and 5 butterfly levels; once: the tree of the warps' slots
    # (padding folded), + eps
    adds = iterations * ((TP * LANES if ll else LANES if local else 0) + (LANES if finalize else 0)
                         + (7 + 5 if norm else 0))
    adds += tree_adds(kernel.slots, kernel.tree_slots) + 1 if norm else 0
    return {
        "fma.rn.f32": iterations * (LANES * HC * HC + (LANES * HC if norm else 0) + (LANES * TOP_K if finalize else 0)),
        # quant: amax / 448, and each value times the inverse scale
        "mul.rn.f32": iterations * (LANES * HC + (3 * LANES if norm else 0) + (1 + LANES if quant else 0)),
        "add.rn.f32": adds,
        "div.rn.f32": 2 if norm else 0,   # ss / H, 1 / sqrt
        "sqrt.rn.f32": 1 if norm else 0,
    }


def test_consumer_contract_arithmetic(compiled):
    for tp, _, hidden, _, name, text in _each(compiled):
        if not _consumer(name):
            continue
        for op, count in _consumer_counts(tp, hidden, name).items():
            assert len(_ops(text, re.escape(op) + r"\b")) == count, (name, hidden, op)
        arithmetic = set(_ops(text, r"\b(?:add|sub|mul|fma|mad|div|sqrt|rsqrt|rcp|neg|abs|min|max)(?:\.\w+)*\.f32\b"))
        allowed = {"add.rn.f32", "fma.rn.f32", "mul.rn.f32", "div.rn.f32", "sqrt.rn.f32"}
        if name.endswith("quant"):
            # MXFP8: the block max (FlashInfer's helpers: max.bf16x2, then max.f32 within the thread and
            # across its 4 threads), then per value the clamp to 448 as one min.f32 (NaN -> 448) before
            # cvt.rn.satfinite.e4m3x2, which saturates below -448 itself.
            allowed |= {"min.f32", "max.f32"}
            iterations = _iterations(tp, hidden, name)
            assert len(_ops(text, r"max\.bf16x2")) == 3 * iterations, name
            assert len(_ops(text, r"cvt\.rn\.satfinite\.e4m3x2\.f32")) == LANES // 2 * iterations, name
            assert len(_ops(text, r"\bmin\.f32")) == LANES * iterations, name
            assert len(_ops(text, r"\bmax\.f32")) == 3 * iterations, name
        assert arithmetic <= allowed, (name, arithmetic)
        # no other fp32 arithmetic without an explicit rounding mode (which NVVM or ptxas could contract)
        assert not _ops(text, r"\b(?:add|sub|fma|div|sqrt)\.f32\b"), name
        assert not _ops(text, r"\bmul\.f32\b"), name


CLUSTER_OPS = r"mapa\.shared::cluster|st\.shared::cluster|barrier\.cluster\.[\w.]+|ld\.shared\.f32|st\.shared\.f32"


def test_consumer_cluster_reduction(compiled):
    """The cluster form's norm variants reduce the sum of squares over the token's cluster through
    DSMEM: every CTA announces it started, waits for the others before the first remote store, and a
    second cluster barrier publishes the stores before any CTA reads its slots."""
    for tp, _, hidden, _, name, text in _each(compiled):
        if not _consumer(name) or _streaming(name):
            continue
        cluster = _ops(text, CLUSTER_OPS)
        if name.endswith("residual"):
            assert not cluster, name
            continue
        slots = _kernel(tp, hidden, name).slots
        assert cluster == (["barrier.cluster.arrive.relaxed.aligned", "barrier.cluster.wait.acquire.aligned",
                            "mapa.shared::cluster", "st.shared::cluster", "barrier.cluster.arrive.release.aligned",
                            "barrier.cluster.wait.acquire.aligned"] + ["ld.shared.f32"] * slots), (name, hidden)
        assert len(_ops(text, r"shfl\.sync\.bfly\.b32")) == 5 + (4 if name.endswith("quant") else 0), name


def test_streaming_reduction_has_no_cluster_ops(compiled):
    """The streaming form's CTA holds its token: per iteration every warp stores its node into its own
    shared-memory slot, one CTA barrier, then every thread reads the row's slots in element order."""
    for tp, _, hidden, _, name, text in _each(compiled):
        if not _streaming(name):
            continue
        kernel = _kernel(tp, hidden, name)
        assert not _ops(text, r"barrier\.cluster|mapa\.|shared::cluster|\.reqnctapercluster|\.explicitcluster"), name
        if name.endswith("residual"):
            assert not _ops(text, CLUSTER_OPS + r"|bar\.sync|barrier\.sync"), name
            continue
        assert _ops(text, CLUSTER_OPS) == ["st.shared.f32"] * kernel.iterations + ["ld.shared.f32"] * kernel.slots, name
        assert len(_ops(text, r"\bbar\.sync\b|\bbarrier\.sync\b")) == 1, name
        assert text.rindex("st.shared.f32") < re.search(r"\bbar\.sync\b|\bbarrier\.sync\b", text).start() \
            < text.index("ld.shared.f32"), name
        shuffles = kernel.iterations * (5 + (4 if name.endswith("quant") else 0))
        assert len(_ops(text, r"shfl\.sync\.bfly\.b32")) == shuffles, name


def test_streaming_launch_bound(compiled):
    """A CTA of ``threads`` per token, and the launch bound that keeps ptxas at what ``min_ctas`` CTAs
    per SM leave a thread."""
    for tp, _, hidden, _, name, text in _each(compiled):
        if not _streaming(name):
            continue
        kernel = _kernel(tp, hidden, name)
        assert _ops(text, r"\.reqntid [\d, ]+") == [f".reqntid {kernel.threads}, 1, 1"], name
        assert _ops(text, r"\.minnctapersm \d+") == ([f".minnctapersm {kernel.min_ctas}"] if kernel.min_ctas > 1
                                                     else []), name


def test_no_spills_and_the_launch_bound_holds(built):
    """No local memory in any PTX; on sm_90a (the H200 the kernels are tuned for) ptxas spills
    nothing either. (sm_100a's ptxas spills a few words around a spin loop in some shapes.)"""
    for (tp, _, hidden, arch), kernels in built.items():
        for name, kernel in kernels.items():
            assert not _ops(kernel.ptx, r"\.local\b"), name  # no local arrays in the PTX
            if arch != "sm_90a":
                continue
            assert kernel.stack_bytes == 0, (hidden, arch, name, kernel.registers)  # ptxas spilled nothing
            if _streaming(name):
                shape = _kernel(tp, hidden, name)
                assert kernel.registers * shape.threads * shape.min_ctas <= 65536, (hidden, name)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_streaming_form_at_the_model_sizes_spills_nothing(tp):
    """H = 4096 / 7168 (5120 is in the builds above) at tp 1, 2 and 8, and top_k 8 (DeepSeek's): the
    launch bound leaves every streaming kernel the registers it needs."""
    for hidden in (4096, 7168):
        spec = BuildSpec(hidden=hidden, hc=HC, capacity=64, top_k=8, tp=tp, rank=0, bt=tp > 1, quantize=True,
                         residual_only=True)
        kernels = compile_kernels(spec, "sm_90a", only=lambda name: _streaming(name))
        assert len(kernels) == 6  # local and local_finalize (tp = 1), or LL and BT, x 3 variants
        for name, kernel in kernels.items():
            assert kernel.stack_bytes == 0, (hidden, tp, name, kernel.registers)


def test_contract_rounding(compiled):
    for _, _, _, _, name, text in _each(compiled):
        assert not _ops(text, r"rsqrt\.approx|sqrt\.approx|div\.full|div\.approx|ex2\.approx|\.ftz"), name
        # fp32 -> bf16 two values at a time, each word's NaN (0x7FFF) turned into the contract's 0x7FC0
        roundings = _ops(text, r"cvt\.rn\.bf16x2\.f32")
        assert len(_ops(text, r"min\.s16x2")) == len(roundings), name
        assert bool(roundings) == (not name.startswith("publish")), name
        assert not _ops(text, r"cvt(?:\.\w+)*\.bf16\.f32"), name
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
    for _, _, _, _, name, text in _each(compiled):
        assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text, name
        assert text.count("griddepcontrol.wait") == 1, name
        wait = text.index("griddepcontrol.wait")
        first_store = re.search(r"\bst\.global|atom\.|multimem\.st", text)
        assert first_store and wait < first_store.start(), name
        if _consumer(name) and not _local(name) and not name.startswith("one_kernel"):
            # A consumer after a publish kernel reads its inputs (complete before the publish let it
            # start) before the wait, the generation state and the mailbox after it.
            first_load = re.search(r"ld\.volatile\.global", text)
        else:
            # publishes, the owner reduce, the one-kernel and local forms: nothing of the call ran before
            first_load = re.search(r"ld\.(volatile\.)?global", text)
        assert first_load and wait < first_load.start(), name
        trigger = text.index("griddepcontrol.launch_dependents")
        assert text.count("griddepcontrol.launch_dependents") == 1, name
        if _local(name):
            # A group of one's call is this kernel alone: the next kernel may launch as soon as this
            # one has waited for its predecessor (it still waits for this one's completion).
            assert wait < trigger < first_load.start(), name
        else:
            assert trigger > text.rindex("st.global"), name


def test_no_pdl_build_has_no_griddepcontrol():
    for tp in (TP, 1):
        spec = BuildSpec(hidden=256, hc=HC, capacity=8, top_k=2, tp=tp, rank=0, bt=tp > 1, quantize=True,
                         residual_only=True, ll_one_kernel_rows=8, use_pdl=False)
        kernels = compile_ptx(spec, "sm_90a")
        assert sorted(kernels) == sorted(LOCAL if tp == 1 else KERNELS + ONE_KERNEL)
        for name, text in kernels.items():
            assert "griddepcontrol" not in text, name


def test_one_kernel_counts_its_ctas_and_advances_the_generation(compiled):
    for _, _, _, _, name, text in _each(compiled):
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


def _cluster(hidden, variant="plain", protocol="ll"):
    return ConsumerKernel(hidden=hidden, hc=HC, tp=TP, variant=variant, protocol=protocol, use_pdl=True)


def test_consumer_shapes():
    # cluster form: one thread per 16-byte fragment, 128 threads per CTA, one cluster per token
    assert [(k.threads, k.ctas, k.slots, k.tree_slots) for k in map(_cluster, (256, 768, 4096, 5120, 7168, 8192))] == [
        (32, 1, 1, 1), (96, 1, 3, 4), (128, 4, 16, 16), (128, 5, 20, 32), (128, 7, 28, 32), (128, 8, 32, 32)]
    with pytest.raises(ValueError, match="cluster"):
        _cluster(8192 + 1024)
    _cluster(8192 + 1024, "residual")  # no norm
    with pytest.raises(ValueError, match="128"):
        _cluster(1088, "quant")
    with pytest.raises(ValueError, match="only LL calls run as one kernel"):
        ConsumerKernel(hidden=1024, hc=HC, tp=TP, variant="plain", protocol="bt", use_pdl=True, contribution="x")
    with pytest.raises(ValueError, match="computes its contribution"):
        ConsumerKernel(hidden=1024, hc=HC, tp=1, variant="plain", protocol="local", use_pdl=True)
    with pytest.raises(ValueError, match="group of one"):
        ConsumerKernel(hidden=1024, hc=HC, tp=TP, variant="plain", protocol="local", use_pdl=True, contribution="x")


def test_streaming_shapes():
    # (threads, iterations): the fewest iterations of at most 512 threads, then the fewest whole warps
    assert [streaming_shape(h) for h in (256, 768, 4096, 4352, 5120, 5376, 7168, 8192)] == [
        (32, 1), (96, 1), (512, 1), (288, 2), (320, 2), (352, 2), (448, 2), (512, 2)]
    assert streaming_shape(5120, 256) == (224, 3)
    # slots: the row's 256-column warp nodes (whatever the threads), the tree padded to a power of two
    kernels = [StreamingConsumerKernel(hidden=h, hc=HC, tp=TP, variant="plain", protocol="bt", use_pdl=True)
               for h in (256, 5120, 5376, 7168)]
    assert [(k.slots, k.tree_slots, k.smem_slots) for k in kernels] == [(1, 1, 1), (20, 32, 20), (21, 32, 22),
                                                                         (28, 32, 28)]
    # the launch bound: 64 registers for one pass, 8 more per further iteration and LL source past two
    assert [min_ctas_per_sm(*shape) for shape in ((512, 1), (320, 2), (448, 2), (512, 2), (128, 1), (32, 1))] == [
        2, 2, 2, 1, 8, 32]
    assert min_ctas_per_sm(320, 2, sources=8) == 1 and min_ctas_per_sm(128, 1, sources=4) == 6
    with pytest.raises(ValueError, match="one-kernel"):
        StreamingConsumerKernel(hidden=1024, hc=HC, tp=TP, variant="plain", protocol="ll", use_pdl=True,
                                contribution="x")
    with pytest.raises(ValueError, match="whole warps"):
        StreamingConsumerKernel(hidden=1024, hc=HC, tp=TP, variant="plain", protocol="bt", use_pdl=True,
                                max_threads=100)


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
        _cluster(MAX_HIDDEN + 1024)
