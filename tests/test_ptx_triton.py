"""Tier 2: every Triton kernel of peer and multicast builds compiles offline to sm_90a PTX, and the
PTX shows what the protocol and the bit contract need."""

import re
from types import SimpleNamespace

import pytest
import torch

from lamport_mhc.backend import BuildSpec
from lamport_mhc.bits import pairwise_sum
from kernels_triton import plan
from kernels_triton.launch_shape import set_launch_shape, set_launch_shared_bytes
from kernels_triton.offline import compile_ptx

# The module's builds are shared fixtures: its tests run on one xdist worker (``--dist loadgroup``),
# which builds them once.
pytestmark = pytest.mark.xdist_group("ptx_triton")

TP, H = 2, 1024
VARIANTS = ("plain", "quant", "residual")
ONE_KERNEL = tuple(f"one_kernel{f}_ll_{v}" for f in ("", "_finalize") for v in VARIANTS)


@pytest.fixture(scope="module", params=["peer", "multicast"])
def build(request):
    spec = BuildSpec(hidden=H, hc=4, capacity=64, top_k=6, tp=TP, rank=1, quantize=True, residual_only=True,
                     bt=True, transport=request.param, ll_one_kernel_rows=64)
    return request.param, compile_ptx(spec, "sm_90a")


def _ops(ptx: str, pattern: str) -> list[str]:
    return re.findall(pattern, ptx)


def test_every_kernel_is_built(build):
    _, ptx = build
    assert sorted(ptx) == sorted([
        "publish_ll", "finalize_publish_ll", "publish_bt", "finalize_publish_bt", "owner_reduce_bt",
        *(f"consumer_{p}_{v}" for p in ("ll", "bt") for v in VARIANTS), *ONE_KERNEL])
    for text in ptx.values():
        assert ".target sm_90a" in text


def test_multicast_stores_only_in_multicast_builds(build):
    transport, ptx = build
    for name, text in ptx.items():
        multimem = _ops(text, r"multimem\.st\.[\w.]+")
        # LL publishes and the BT owners' broadcast use multicast; BT publishes go to one owner.
        expected = transport == "multicast" and name in ("publish_ll", "finalize_publish_ll", "owner_reduce_bt",
                                                         *ONE_KERNEL)
        assert bool(multimem) == expected, name
        if multimem:
            assert set(multimem) == {"multimem.st.relaxed.sys.global.v4.f32"}


def test_peer_stores_are_16_bytes(build):
    transport, ptx = build
    for name in ("publish_bt", "finalize_publish_bt") + (("publish_ll", "finalize_publish_ll", "owner_reduce_bt")
                                                          if transport == "peer" else ()):
        text = ptx[name]
        assert _ops(text, r"st\.global\.v4\.b32"), name
        # one 16-byte store per fragment and destination: no narrower data stores besides the state word
        assert not _ops(text, r"st\.global\.b16|st\.global\.b8"), name
    if transport == "peer":
        for name in ONE_KERNEL:  # the consumer's stores plus one 16-byte store per peer
            split = "consumer_ll_" + name.rsplit("_", 1)[1]
            stores = len(_ops(ptx[name], r"st\.global\.v4\.b32"))
            assert stores >= len(_ops(ptx[split], r"st\.global\.v4\.b32")) + TP, name


def test_spin_loops_poll_16_bytes_volatile(build):
    _, ptx = build
    for name, text in ptx.items():
        if name.startswith(("consumer", "one_kernel", "owner_reduce")):
            assert _ops(text, r"ld\.volatile\.global\.v4\.b32"), name
            assert not _ops(text, r"ld\.volatile\.global\.b16"), name


# The spin-timeout record into the host mirror: the three words, a system fence, then the flag.
MIRROR_RECORD = re.compile(r"st\.global\.b32 \[(%rd\d+)\+4\], %r\d+; st\.global\.b32 \[\1\+8\], %r\d+; "
                           r"st\.global\.b32 \[\1\+12\], %r\d+; fence\.sc\.sys; "
                           r"st\.relaxed\.sys\.global\.b32 \[\1\], %r\d+;")


def test_spin_timeouts_reach_the_host_mirror_flag_last(build):
    """Every kernel that polls claims the device flag with a CAS, then writes the host mirror's
    record with plain stores and the flag after ``fence.sc.sys``; kernels that never wait have none."""
    _, ptx = build
    for name, text in ptx.items():
        records = MIRROR_RECORD.findall(text)
        if name.startswith(("consumer", "one_kernel", "owner_reduce")):
            assert records and text.count("fence.sc.sys") == len(records), name
            cas = text.find("atom.global.acq_rel.gpu.cas.b32")
            assert 0 <= cas < text.find("fence.sc.sys"), name
            assert not _ops(text, r"atom\.[\w.]*\.sys|red\.[\w.]*\.sys"), name  # no atomics to host memory
        else:
            assert not records and "fence.sc.sys" not in text, name


def test_contract_rounding(build):
    _, ptx = build
    for name, text in ptx.items():
        assert not _ops(text, r"rsqrt\.approx|sqrt\.approx|div\.full|div\.approx|ex2\.approx|\.ftz\."), name
        if name.startswith(("consumer", "one_kernel")) and not name.endswith("residual"):
            for op in ("fma.rn.f32", "sqrt.rn.f32", "div.rn.f32", "mul.rn.f32", "add.rn.f32"):
                assert op in text, f"{name} lacks {op}"
        if name.startswith(("finalize_publish", "one_kernel_finalize")):
            assert "fma.rn.f32" in text and "add.rn.f32" in text, name
        if name.startswith(("publish", "owner_reduce")):
            assert "fma.rn.f32" not in text, f"{name}: contraction where the contract has none"


def test_no_kernel_divides_integers_at_run_time(build):
    """Integer division by a runtime value is a long sequence in sm_90a SASS (about 30 instructions);
    the quant consumers once took one a program, for the length of a token's run of padding rows of
    the scales (now strided over the tokens, ``consumer._zero_padding_scales``)."""
    _, ptx = build
    for name, text in ptx.items():
        assert not _ops(text, r"\b(?:div|rem)\.[su](?:32|64)\b"), name


def test_pdl(build):
    _, ptx = build
    for name, text in ptx.items():
        assert "griddepcontrol.wait" in text and "griddepcontrol.launch_dependents" in text, name


def test_local_forms_let_the_next_kernel_launch_after_their_wait(chunked):
    """A group of one's call is its consumer alone: it triggers the next kernel's launch right after
    its own PDL wait, before its first load (the next kernel still waits for its completion)."""
    tp, _, ptx = chunked
    for name, text in ptx.items():
        if tp == 1:
            wait, trigger = text.index("griddepcontrol.wait"), text.index("griddepcontrol.launch_dependents")
            first_load = re.search(r"ld\.global", text)
            assert text.count("griddepcontrol.launch_dependents") == 1, name
            assert wait < trigger < first_load.start(), name
        else:
            assert text.index("griddepcontrol.launch_dependents") > text.rindex("st.global"), name


def test_no_pdl_build_has_no_griddepcontrol():
    spec = BuildSpec(hidden=256, hc=4, capacity=8, top_k=2, tp=2, rank=0, use_pdl=False)
    for name, text in compile_ptx(spec).items():
        assert "griddepcontrol" not in text, name


# Name suffixes of a consumer's twins (plan.kernel_plan).
TWINS = ("_split", "_capped", "_streamed", "_held", "_wide", "_broad", "_broad_held")


def _chunked_spec(tp: int, hidden: int) -> BuildSpec:
    return BuildSpec(hidden=hidden, hc=4, capacity=64, top_k=6, tp=tp, rank=0, bt=tp > 1,
                     ll_one_kernel_rows=64 if tp > 1 else 0)


@pytest.fixture(scope="module", params=[(2, 384), (2, 1408), (3, 5120), (1, 4096), (1, 7168), (1, 9216)],
                ids=lambda p: f"tp{p[0]}-h{p[1]}")
def chunked(request):
    tp, hidden = request.param
    return tp, hidden, compile_ptx(_chunked_spec(tp, hidden), "sm_90a")


def test_every_access_moves_16_bytes_at_any_hidden_size(chunked):
    """Rows walked in chunks whatever H (384 = a 512 chunk, 1408 = 3 x 512, 5120 = 5 x 1024, 7168 =
    7 x 1024, 9216 = 9 x 1024): polls, loads and stores of bf16 data are 16 bytes; nothing moves a
    single bf16."""
    tp, hidden, ptx = chunked
    _, chunks = plan.row_chunks(hidden)
    names = set(ptx)
    for name, text in ptx.items():
        assert _ops(text, r"st\.global\.v4\.b32"), name
        assert not _ops(text, r"(?:ld|st)\.(?:volatile\.)?global(?:\.\w+)*\.b16"), name
        if name.startswith(("consumer", "one_kernel", "owner_reduce")):
            assert _ops(text, r"ld\.volatile\.global\.v4\.b32"), name
        if name.startswith("local"):
            assert not _ops(text, r"ld\.volatile"), f"{name}: the local form polls nothing"
            assert "griddepcontrol.wait" in text, name
    # Rows of 2-8 chunks also build the latency form of every consumer.
    consumers = {n for n in names
                 if n.startswith(("consumer", "one_kernel", "local")) and not n.endswith(TWINS)}
    cooperative = 1 < chunks <= 8  # a token's programs are one cluster
    assert {n.removesuffix("_split") for n in names if n.endswith("_split")} == (consumers if cooperative else set())
    if tp == 1:
        wide_takes_many = plan.wide_takes_many_rows(hidden, "plain")
        assert names == {f"local{f}_plain{form}{twin}" for f in ("", "_finalize") for form in ("", "_wide")
                         for twin in ("", "_streamed")} | (
            {f"local{f}_plain_split{twin}" for f in ("", "_finalize") for twin in ("", "_capped")}
            if cooperative else set()) | (
            {"local_plain_held"} if chunks <= plan.HELD_MAX_CHUNKS and not wide_takes_many else set()) | (
            {"local_plain_broad"} if plan.broad_chunk(hidden, "plain") else set()) | (
            {"local_plain_broad_held", "local_plain_broad_held_streamed"} if plan.broad_held_chunk(hidden, "plain")
            else set())


def test_cooperative_forms_exchange_roots_in_their_cluster(chunked):
    """Every cooperative consumer that normalizes (rows of 2-8 chunks) is launched as a cluster of a
    CTA per chunk, arrives at the cluster barrier first thing and exchanges its chunk root once
    through the cluster's shared memory: the mailbox consumers by a store into each CTA and a
    release / acquire barrier; the local ones (tp = 1) by a store into each CTA that completes on
    its mbarrier (set up for every part before the arrival) and a wait on their own, with no release
    fence. No other kernel touches a cluster barrier, and none polls for roots in global memory."""
    tp, hidden, ptx = chunked
    _, chunks = plan.row_chunks(hidden)
    instances = plan.kernel_plan(_chunked_spec(tp, hidden))
    assert any("_split" in n for n in ptx) == (1 < chunks <= 8)
    for name, text in ptx.items():
        exchanges = "_split" in name and "_residual" not in name
        assert instances[name].cluster == (chunks if exchanges else 1), name
        assert not _ops(text, r"ld\.relaxed"), name
        if not exchanges:
            assert "barrier.cluster" not in text, name
            continue
        assert text.index("barrier.cluster.arrive.relaxed;") < text.index("griddepcontrol.wait"), name
        assert text.count("barrier.cluster.wait;") == 1, name
        if name.startswith("local"):
            parts = plan.row_warps(plan.row_chunks(hidden)[0])
            # The mbarrier expects a part (4 bytes) of every warp of every CTA.
            count = re.search(r"expect_tx\.shared::cta\.b64 state, \[parts_arrived\], (%r\d+);", text)
            assert count and re.search(rf"mov\.b32\s+{count.group(1)}, {4 * parts * chunks};", text), name
            assert (text.index("mbarrier.init") < text.index("fence.mbarrier_init.release.cluster")
                    < text.index("barrier.cluster.arrive.relaxed;")), name
            stores = _ops(text, r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.b32")
            assert len(stores) == 8 and len(_ops(text, r"mapa\.shared::cluster")) == 16, name
            assert "barrier.cluster.arrive.release" not in text and "barrier.cluster.wait.acquire" not in text, name
            assert (text.index("barrier.cluster.wait;") < text.index("st.async")
                    < text.index("mbarrier.try_wait.parity")), name
            continue
        assert len(_ops(text, r"st\.shared::cluster\.b32")) == 8 == len(_ops(text, r"mapa\.shared::cluster")), name
        assert text.count("barrier.cluster.arrive.release;") == 1 == text.count("barrier.cluster.wait.acquire;"), name
        assert (text.index("barrier.cluster.wait;") < text.index("st.shared::cluster")
                < text.index("barrier.cluster.arrive.release;")), name


def test_streaming_consumers_park_their_row_in_shared_memory(chunked):
    """Every consumer that parks its prenormalized row between its passes (one program a token, the
    row not held, not residual-only) declares one parking area of its own (a static shared array of
    the row's bytes, and for the local ones their roots table's past it) and stores the row there and
    reads it back, 16 bytes at a time; the local ones leave each warp's part of a chunk's sum of
    squares in the table and join it after the one CTA barrier before the second pass, as the broad
    held twin does, whose area is its table alone. No kernel reads a parked row back from global
    memory, none adds shared memory at launch."""
    tp, hidden, ptx = chunked
    instances = plan.kernel_plan(_chunked_spec(tp, hidden))
    parking = []
    for name, text in ptx.items():
        constexprs = instances[name].constexprs
        parks = constexprs.get("SPLIT") == 1 and not constexprs["HOLD"] and "_residual" not in name
        if parks:
            parking.append(name)
        chunks, warps = constexprs.get("CHUNKS", 0), plan.row_warps(constexprs.get("CHUNK", 0))
        tabled = (parks and constexprs["LOCAL"]) or "_broad_held" in name
        table_bytes = -(-4 * chunks * warps // 16) * 16 if tabled else 0
        assert constexprs.get("ROOTS_TABLE_BYTES", 0) == table_bytes, name
        area_bytes = (2 * constexprs.get("CHUNK", 0) * chunks if parks else 0) + table_bytes
        assert constexprs.get("PARKED_BYTES", 0) == area_bytes, name
        areas = re.findall(r"\.shared \.align 16 \.b8 parked_area\[(\d+)\]", text)
        assert areas == ([str(area_bytes)] if tabled or parks else []), name
        assert bool(_ops(text, r"st\.shared\.v4\.b32 \[%r\d+\]")) == parks, name
        assert bool(_ops(text, r"ld\.shared\.v4\.b32 \{[^}]+\}, \[%r\d+\]")) == parks, name
        if constexprs.get("SPLIT", 1) == 1:  # (the cooperative forms' cluster exchange matches parts too)
            assert bool(_ops(text, r"match\.any\.sync\.b32")) == tabled, name
        assert "%dynamic_smem_size" not in text, name
        assert not _ops(text, r"ld\.global\.cg"), name
        # Where the table fits 32 slots (H <= 8192): one barrier a row (spread weights are gathered
        # through barriers of their own), then every thread loads the table's words and adds the tree
        # in its registers (``test_the_roots_tables_join_is_the_pairwise_tree``), no shuffle.
        if tabled and constexprs["ROOTS"] * warps <= 32:
            if constexprs["PER_THREAD_WEIGHTS"]:
                assert text.count("bar.sync") == 1, name
            words = -(-chunks * warps // 4)
            assert len(re.findall(r"ld\.shared\.v4\.f32 \{v", text)) == words, name
            assert len(re.findall(r"add\.rn\.f32 v\d+, v", text)) == constexprs["ROOTS"] * warps - 1, name
            assert not _ops(text, r"shfl\.sync\.bfly\.b32 other"), name
    assert parking, "every build has a streaming consumer that parks"


@pytest.mark.parametrize("slots,width", [(1, 1), (2, 2), (4, 4), (5, 8), (16, 16), (20, 32), (28, 32), (32, 32)])
def test_the_roots_tables_join_is_the_pairwise_tree(slots, width):
    """``ptx.table_sum``'s PTX, run statement by statement over fp32 values: the table's words
    loaded (the slots past ``slots`` in its last word discarded), +0.0 to ``width``, each level's
    adjacent pairs added in place. Every thread ends with the contract's tree, bit for bit (a NaN's
    sign aside: the CPU's inf - inf has one)."""
    from kernels_triton.ptx import _table_sum_asm

    asm = _table_sum_asm(slots, width)
    gen = torch.Generator().manual_seed(slots * 131 + width)
    trials = 300
    values = torch.randn(trials, slots, generator=gen) * torch.exp2(
        torch.randint(-140, 60, (trials, slots), generator=gen).float())
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, -3.4e38])
    pick = torch.rand(trials, slots, generator=gen) < 0.3
    values = torch.where(pick, specials[torch.randint(0, 8, (trials, slots), generator=gen)], values)
    values[::7] = -0.0  # every slot -0.0: the padding's +0.0 decides the sign
    words = -(-slots // 4)
    junk = torch.full((trials, 4 * words - slots), float("nan"))  # what the last word holds past the slots
    table = torch.cat([values, junk], dim=1)
    registers, result = {}, None
    for statement in filter(None, (part.strip() for part in asm.strip("{} ").split(";"))):
        op, _, operands = statement.partition(" ")
        if op.startswith(".reg"):
            continue
        if op == "ld.shared.v4.f32":
            targets, offset = re.fullmatch(r"\{([^}]+)\}, \[\$1\+(\d+)\]", operands).groups()
            for i, target in enumerate(targets.split(", ")):
                registers[target] = table[:, int(offset) // 4 + i]
        elif op == "mov.f32":
            target, value = operands.split(", ")
            assert value == "0f00000000", statement
            registers[target] = torch.zeros(trials)
        elif op == "add.rn.f32":
            target, a, b = operands.split(", ")
            registers[target] = registers[a] + registers[b]
        else:
            assert (op, operands) == ("mov.b32", "$0, v0"), statement
            result = registers["v0"]
    expected = pairwise_sum(values)
    same = result.view(torch.int32) == expected.view(torch.int32)
    assert bool((same | (torch.isnan(result) & torch.isnan(expected))).all())
    assert len(re.findall("add.rn.f32", asm)) == width - 1


def test_rows_park_in_shared_memory_on_the_gpu_only_up_to_its_bound():
    assert plan.parked_row_bytes(1024, 7, on_gpu=True) == 14336
    assert plan.parked_row_bytes(1024, 16, on_gpu=True) == plan.SHARED_PARK_MAX_BYTES
    assert plan.parked_row_bytes(1024, 17, on_gpu=True) == 0  # parked in layer_out
    assert plan.parked_row_bytes(1024, 7, on_gpu=False) == 0  # the interpreter parks in layer_out
    spec = BuildSpec(hidden=7168, hc=4, capacity=64, top_k=6, tp=1, rank=0, quantize=True)
    assert all(instance.constexprs["PARKED_BYTES"] == instance.constexprs["ROOTS_TABLE_BYTES"] == 0
               for instance in plan.kernel_plan(spec, on_gpu=False).values())


@pytest.mark.parametrize("hidden", [4096, 5120, 7168])
def test_only_parked_consumers_of_x_of_the_prefetching_variants_prefetch(hidden):
    """The parked streaming consumers of x and their wide and broad twins (hinted or not), and the
    broad held twins, of the prefetching variants; each also holds every mix weight in every thread.
    Nothing else prefetches."""
    spec = BuildSpec(hidden=hidden, hc=4, capacity=64, top_k=6, tp=1, rank=0, quantize=True)
    instances = plan.kernel_plan(spec)
    prefetching = {name for name, instance in instances.items() if instance.constexprs.get("PREFETCH")}
    assert prefetching == {name for variant in plan.PARKED_PREFETCH_VARIANTS
                           for form in ("", "_wide", "_broad", "_broad_held")
                           for twin in ("", "_streamed") if (name := f"local_{variant}{form}{twin}") in instances}
    assert {"local_plain", "local_plain_wide", "local_quant"} <= prefetching
    assert all(instances[name].constexprs["PER_THREAD_WEIGHTS"] for name in prefetching)


def test_launch_shape_adds_the_parked_row_to_the_kernels_shared_memory():
    def compiled(shared):
        metadata = SimpleNamespace(name="consumer_kernel", num_warps=4, num_ctas=1, shared=shared)
        return SimpleNamespace(metadata=metadata, packed_metadata=(4, 1, shared))

    kernel = compiled(1040)
    set_launch_shape(kernel, 1, 14336)
    assert kernel.packed_metadata == (4, 1, 1040 + 14336)
    kernel = compiled(0)
    set_launch_shape(kernel, 7, 0)
    assert kernel.packed_metadata == (4, 7, 0)
    set_launch_shared_bytes(kernel, 45056)  # a spread launch: the cluster stays
    assert kernel.packed_metadata == (4, 7, 45056)
    with pytest.raises(RuntimeError, match="opt-in"):
        set_launch_shape(compiled(20000), 1, plan.SHARED_PARK_MAX_BYTES)
    stale = compiled(0)
    stale.packed_metadata = (4, 1, 0, 0)
    with pytest.raises(RuntimeError, match="packs its launch metadata"):
        set_launch_shape(stale, 2, 0)


def test_streamed_twins_hint_what_passes_once(chunked):
    """Each local streaming consumer (but the held and broad twins; the broad held one has it) has a
    ``_streamed`` twin, the same kernel but for its loads of x (or GEMM2 and the shared expert) and
    the streams (evict_first, through an L2 policy) and its stores of the streams (.cs); no other
    kernel hints anything."""
    tp, _, ptx = chunked
    for name, text in ptx.items():
        streamed = name.endswith("_streamed")
        assert bool(_ops(text, r"ld\.global\.L1::evict_first\.L2::cache_hint\.v4\.b32")) == streamed, name
        assert bool(_ops(text, r"createpolicy\.fractional\.L2::evict_first")) == streamed, name
        assert bool(_ops(text, r"st\.global\.cs\.v4\.b32")) == streamed, name
        if streamed:
            assert name.removesuffix("_streamed") in ptx, name
    assert {n.removesuffix("_streamed") for n in ptx if n.endswith("_streamed")} == (
        {n for n in ptx if n.startswith("local") and (n.endswith("_broad_held") or not n.endswith(
            ("_split", "_capped", "_streamed", "_held", "_broad")))}
        if tp == 1
        else set())


def test_quant_converts_with_flashinfers_instruction(build):
    """The saturating conversion, after one min.f32 with 448 per value (NaN -> 448; below -448 the
    conversion saturates itself), and no other fp32 min or max (the block max is on integer bits)."""
    _, ptx = build
    for name, text in ptx.items():
        conversions = _ops(text, r"cvt\.rn\.satfinite\.e4m3x2\.f32")
        assert bool(conversions) == ("_quant" in name), name
        if conversions:
            assert len(_ops(text, r"\bmin\.f32")) == 2 * len(conversions), name
            assert not _ops(text, r"\bmax(?:\.\w+)*\.f32"), name


def test_only_local_streaming_consumers_cap_registers(chunked):
    """Parking the row: 64 registers, but the broad twin (the compiler's choice); the held twin of the
    consumer of x (rows of up to seven chunks whose calls of many rows the wide twin does not take):
    64 for rows of up to four chunks, else 96; the broad held twin: the compiler's choice; the capped
    twin of a local cooperative form: 64. The held twins hold and nothing else does."""
    tp, hidden, ptx = chunked
    _, chunks = plan.row_chunks(hidden)
    instances = plan.kernel_plan(_chunked_spec(tp, hidden))
    narrow = chunks <= plan.HELD_NARROW_CHUNKS
    for name, text in ptx.items():
        streaming = name.startswith("local") and "_split" not in name
        held_twin = name.endswith("_held") and "_broad" not in name
        broad_held = "_broad_held" in name
        assert held_twin == (name == "local_plain_held" and chunks <= plan.HELD_MAX_CHUNKS
                             and not plan.wide_takes_many_rows(hidden, "plain")), name
        assert instances[name].constexprs.get("HOLD", False) == (held_twin or broad_held), name
        if name.endswith("_capped"):
            assert tp == 1 and name.startswith("local") and "_split" in name, name
        assert (".maxnreg 64" in text) == ((streaming and not (held_twin and not narrow) and "_broad" not in name)
                                          or name.endswith("_capped")), name
        if "_broad" in name:  # (the broad held twin too)
            assert ".maxnreg" not in text, name
        assert (".maxnreg 96" in text) == (held_twin and not narrow), name


def test_wide_twins_walk_the_row_in_chunks_twice_as_wide(chunked):
    """Each local streaming consumer of rows of two or more chunks has a ``_wide`` twin (and its
    hinted one): chunks twice as wide, twice the warps, 16-byte accesses still; the quant variant's
    only where they tile the row, else (its consumer of x) chunks four times as wide where the row
    leaves at most one chunk of its last masked (H = 7168: 4096 + 3072, 16 warps), and no held twin."""
    tp, hidden, ptx = chunked
    chunk, chunks = plan.row_chunks(hidden)
    instances = plan.kernel_plan(_chunked_spec(tp, hidden))
    wide = {n for n in ptx if "_wide" in n}
    assert wide == ({n.replace("_plain", "_plain_wide") for n in ptx if n in ("local_plain", "local_plain_streamed",
                                                                            "local_finalize_plain",
                                                                            "local_finalize_plain_streamed")}
                    if tp == 1 and chunks > 1 else set())
    for name in wide:
        narrow = instances[name.replace("_wide", "")]
        assert instances[name].constexprs["CHUNK"] == 2 * chunk and instances[name].num_warps == 2 * narrow.num_warps
        assert instances[name].constexprs["CHUNKS"] == -(-hidden // (2 * chunk)), name
    quant = plan.kernel_plan(BuildSpec(hidden=hidden, hc=4, capacity=64, top_k=6, tp=1, rank=0, quantize=True))
    four_chunks = hidden == 7168
    assert ("local_quant_wide" in quant) == (plan.wide_tiles_row(hidden) or four_chunks)
    assert ("local_finalize_quant_wide" in quant) == plan.wide_tiles_row(hidden)
    if four_chunks:
        for name in ("local_quant_wide", "local_quant_wide_streamed"):
            assert quant[name].constexprs["CHUNK"] == 4 * chunk and quant[name].num_warps == 16
            assert quant[name].constexprs["CHUNKS"] == 2 and quant[name].max_registers == 64, name
        assert "local_quant_held" not in quant and "local_plain_held" not in quant


def test_broad_twins_walk_the_row_in_chunks_four_times_as_wide():
    """The local consumer of x of the plain variant has a ``_broad`` twin (no hinted one) where
    chunks four times the row's span two or more of them with at most one row chunk masked: 16 warps,
    parked, prefetching, the registers the compiler's choice."""
    assert [plan.broad_chunk(h, "plain") for h in (1408, 4096, 5120, 7168, 8192, 9216, 11264)] == [
        None, None, None, 4096, 4096, None, 4096]
    assert plan.broad_chunk(7168, "quant") is None and plan.broad_chunk(7168, "residual") is None
    instances = plan.kernel_plan(BuildSpec(hidden=7168, hc=4, capacity=64, top_k=6, tp=1, rank=0, quantize=True))
    broad = {name for name in instances if name.endswith("_broad")}
    assert broad == {"local_plain_broad"}
    for name in broad:
        instance = instances[name]
        assert instance.num_warps == 16 and instance.max_registers is None, name
        assert (instance.constexprs["CHUNK"], instance.constexprs["CHUNKS"]) == (4096, 2), name
        assert instance.constexprs["PARKED_BYTES"] == 2 * 8192 + plan.roots_table_bytes(2, 4096), name
        assert not instance.constexprs["STREAMED"], name


def test_four_chunk_wide_twins_leave_at_most_one_chunk_masked():
    assert [plan.wide_chunk(h, "quant") for h in (1408, 3072, 3584, 4096, 5120, 7168, 11264)] == [
        None, None, 2048, 2048, None, 4096, 4096]
    assert plan.wide_chunk(7168, "quant", of_x=False) is None and plan.wide_chunk(7168, "plain") == 2048
    assert [plan.wide_takes_many_rows(h, v) for h, v in ((4096, "plain"), (5120, "plain"), (7168, "plain"),
                                                         (7168, "quant"), (5120, "quant"))] == [
        True, True, True, True, False]
    # the finalize's wide twin: only where it tiles the row
    assert [plan.wide_takes_many_rows(h, "plain", of_x=False) for h in (4096, 5120, 7168)] == [True, False, False]


def test_bf16_rounding_is_one_conversion_a_pair(build):
    """The contract's fp32 -> bf16 rounding is cvt.rn.bf16x2.f32 on the GPU, two values at once, its
    NaN then made 0x7FC0 by min.s16x2: every conversion of the publishes and the owner reduce; in the
    consumers all but the prenormalized row's (no output takes it as it is): at most one for every
    four that are canonicalized, and none where they do not normalize."""
    _, ptx = build
    for name, text in ptx.items():
        if name.startswith(("consumer", "one_kernel", "owner_reduce", "finalize_publish")):
            conversions = len(_ops(text, r"cvt\.rn\.bf16x2\.f32"))
            canonical = len(_ops(text, r"min\.s16x2"))
            assert canonical and not _ops(text, r"cvt\.rn\.bf16\.f32"), name
            if name.startswith(("owner_reduce", "finalize_publish")) or name.endswith("_residual"):
                assert conversions == canonical, name
            else:
                assert canonical < conversions <= canonical + canonical // 4, name


def test_broad_held_twins_hold_the_row_in_chunks_four_times_as_wide():
    """The local consumer of x of the plain and quant variants has a ``_broad_held`` twin (and its
    hinted one) where the row fills a chunk four times its own and spans at most two: 16 warps, the
    row held, the second chunk's loads issued before the first is mixed, every mix weight in every
    thread, the registers the compiler's choice. Its
    only shared array is the roots table: a lane of each warp stores the warp's part of each chunk's
    sum of squares there, and one CTA barrier later every thread joins them."""
    assert [plan.broad_held_chunk(h, "plain") for h in (1408, 2048, 4096, 5120, 7168, 8192, 9216)] == [
        None, None, 4096, 4096, 4096, 4096, None]
    assert plan.broad_held_chunk(4096, "quant") == 4096 and plan.broad_held_chunk(4096, "residual") is None
    for hidden, chunks in ((4096, 1), (5120, 2), (7168, 2)):
        spec = BuildSpec(hidden=hidden, hc=4, capacity=64, top_k=6, tp=1, rank=0, quantize=True)
        instances = plan.kernel_plan(spec)
        names = {name for name in instances if "_broad_held" in name}
        assert names == {f"local_{v}_broad_held{t}" for v in ("plain", "quant") for t in ("", "_streamed")}, hidden
        for name in names:
            instance, constexprs = instances[name], instances[name].constexprs
            assert instance.num_warps == 16 and instance.max_registers is None, name
            assert (constexprs["CHUNK"], constexprs["CHUNKS"], constexprs["HOLD"]) == (4096, chunks, True), name
            assert constexprs["PARKED_BYTES"] == constexprs["ROOTS_TABLE_BYTES"] == plan.roots_table_bytes(chunks, 4096)
            assert constexprs["PER_THREAD_WEIGHTS"] and constexprs["PREFETCH"], name
            assert constexprs["STREAMED"] == name.endswith("_streamed"), name
        # The interpreter's held forms join their roots as they go: no table.
        interpreted = plan.kernel_plan(spec, on_gpu=False)
        assert all(interpreted[name].constexprs["ROOTS_TABLE_BYTES"] == 0 for name in names)
    ptx = compile_ptx(BuildSpec(hidden=5120, hc=4, capacity=64, top_k=6, tp=1, rank=0, quantize=True))
    for name in ("local_plain_broad_held", "local_quant_broad_held_streamed"):
        text = ptx[name]
        assert ".maxnreg" not in text, name
        if "_plain" in name:  # (the MXFP8 scales pass through shared memory behind barriers of their own)
            assert text.count("bar.sync") == 1, name
        assert re.findall(r"\.shared \.align 16 \.b8 parked_area\[(\d+)\]", text) == ["128"], name
        assert text.count("@leader st.shared.b32") == 2, name  # a table part a chunk
        assert not _ops(text, r"st\.shared\.v4\.b32"), f"{name}: the row is held, not parked"


@pytest.mark.parametrize("tp", [1, 2])
def test_only_pointers_a_call_may_pass_unaligned_leave_the_specialization_as_it_is(tp):
    """One compiled kernel serves every call: Triton's launcher keys its compiled kernels on each
    pointer's 16-byte alignment, except for those a call may pass 4-byte aligned
    (``lamport_mhc.validate``: expert weights and indices, the MXFP8 scales), so no call compiles a
    second kernel (which would start without the launch shape set on the first, and fail in a graph
    capture). The key of every kernel, with each pointer misaligned in turn, by the launcher's own
    binder for sm_90."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from kernels_triton.publish import FOUR_BYTE_ALIGNED

    backend = make_backend(GPUTarget("cuda", 90, 32))
    dtypes = {"*i16": torch.int16, "*fp32": torch.float32, "*i32": torch.int32, "*u8": torch.uint8,
              "*i64": torch.int64}
    spec = BuildSpec(hidden=1024, hc=4, capacity=64, top_k=6, tp=tp, rank=0, quantize=True, bt=tp > 1)
    for name, instance in plan.kernel_plan(spec).items():
        bind = create_function_from_signature(instance.fn.signature, instance.fn.params, backend)

        def key(misaligned=None):
            args = []
            for arg, kind in instance.signature.items():
                if kind in dtypes:
                    buffer = torch.zeros(64, dtype=dtypes[kind])
                    offset = max(1, 4 // buffer.element_size())  # 4 or 8 bytes past a 16-byte boundary
                    args.append(buffer[offset:] if arg == misaligned else buffer)
                else:
                    args.append({"fp32": 1e-6}.get(kind, 2))
            return bind(*args, **instance.constexprs, **instance.options, debug=False)[1]

        aligned = key()
        for arg, kind in instance.signature.items():
            if kind in dtypes:
                assert (key(arg) == aligned) == (arg in FOUR_BYTE_ALIGNED), (name, arg)


@pytest.mark.parametrize("hidden", [4096, 7168])
def test_local_forms_assemble_without_spills(hidden):
    """Every kernel of a group of one, plain and quant, keeps its values in registers (ptxas, sm_90a):
    the forms that carry the next chunk's inputs through the chunks' loop are where spills appeared
    (the wide twins of two chunks with their last chunk peeled off the loop: 80-104 stack bytes at
    H 4096, 16-24 at 7168 quant; one H100 ran H 4096 quant M = 512 in 22.0 us against 13.4)."""
    from lamport_mhc.bench.sass import assemble, disassemble

    spec = BuildSpec(hidden=hidden, hc=4, capacity=64, top_k=6, tp=1, rank=0, quantize=True, bt=False)
    for name, text in compile_ptx(spec, "sm_90a").items():
        assert disassemble(assemble(text))[1].stack_bytes == 0, name
