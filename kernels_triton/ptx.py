"""Inline-PTX helpers, each with a twin that the Triton interpreter can run.

Every helper takes ``ON_GPU: tl.constexpr``: True compiles the PTX (the path that ships), False
selects plain Triton ops that ``TRITON_INTERPRET=1`` executes on host buffers, so the simulated TP
group runs the same kernel bodies. Nothing outside this module writes inline assembly.
"""

import triton
import triton.language as tl


@triton.jit
def fma_rn(a, b, c, ON_GPU: tl.constexpr):
    """fp32 a*b+c with one rounding. On GPU ``fma.rn.f32``; the interpreter's ``tl.fma`` rounds
    twice, so its twin rounds the exact f64 sum to odd and then once to fp32 (exact: 53 >= 24+2)."""
    if ON_GPU:
        return tl.fma(a, b, c)
    else:
        p = a.to(tl.float64) * b.to(tl.float64)  # exact: 24+24 bits
        c64 = c.to(tl.float64)
        s = p + c64
        # TwoSum: err is the exact rounding error of s.
        bp = s - c64
        err = (c64 - (s - bp)) + (p - bp)
        bits = s.to(tl.int64, bitcast=True)
        finite = (bits & 0x7FF0000000000000) != 0x7FF0000000000000
        grow = (err > 0) == (s > 0)
        odd = tl.where(grow, bits + 1, bits - 1)
        bits = tl.where(finite & (err != 0) & ((bits & 1) == 0), odd, bits)
        return bits.to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def bf16x2_rn(x):
    """bf16 bits (int16) of fp32 ``x``, round to nearest even, NaN as 0x7FC0: ``cvt.rn.bf16x2.f32``
    packs two values (its NaN is 0x7FFF, the one result above 0x7FC0 as a signed half), then
    ``min.s16x2`` against 0x7FC0 turns exactly that NaN into the contract's. GPU only:
    ``numerics.f32_to_bf16`` holds the interpreter's integer twin."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 nan; cvt.rn.bf16x2.f32 $0, $2, $1; mov.b32 nan, 0x7FC07FC0; min.s16x2 $0, $0, nan; }",
        "=r,r,r", args=[x], dtype=tl.int16, is_pure=True, pack=2)


@triton.jit
def bf16x2_rn_raw(x):
    """bf16 bits (int16) of fp32 ``x``, round to nearest even, two values a ``cvt.rn.bf16x2.f32``
    (Triton's own cast converts one value an instruction); a NaN comes out as the hardware gives it.
    For values no output takes as they are (``numerics.f32_to_bf16``'s ``ANY_NAN``) and kernels
    outside the bit contract (the benchmark's baselines). GPU only."""
    return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", args=[x], dtype=tl.int16,
                                     is_pure=True, pack=2)


@triton.jit
def bf16x2_to_f32(bits):
    """fp32 values of bf16 bits (int16), two a register: a shift for the low half, a mask for the
    high one. GPU only: ``numerics.bf16_to_f32`` holds the interpreter's twin."""
    return tl.inline_asm_elementwise("shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;", "=r,=r,r",
                                     args=[bits], dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def load_volatile(ptr, mask, ON_GPU: tl.constexpr):
    """Poll load that the compiler may neither cache nor hoist: ``ld.volatile.global`` (16 bytes per
    8 x bf16 fragment once the pointer is known to be 16-byte aligned)."""
    return tl.load(ptr, mask=mask, other=0, volatile=True)


@triton.jit
def grid_dependency_wait(USE_PDL: tl.constexpr, ON_GPU: tl.constexpr):
    """PDL: wait until the preceding kernel of the stream completed and its stores are visible."""
    if ON_GPU and USE_PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr, ON_GPU: tl.constexpr):
    """PDL: let the next kernel of the stream start its prologue (it still waits for our completion)."""
    if ON_GPU and USE_PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def global_timer_ns(ON_GPU: tl.constexpr):
    """Nanosecond clock for the optional spin bound; the interpreter counts polls instead (0 here)."""
    if ON_GPU:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)
    else:
        return tl.zeros([], tl.int64)


@triton.jit
def e4m3_rn(v):
    """float8_e4m3fn bits (uint8) of fp32 values within +-448: ``cvt.rn.satfinite.e4m3x2``, as
    FlashInfer converts, four values (two conversions) to a register. GPU only:
    ``numerics.f32_to_e4m3`` holds the interpreter's integer twin."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r", args=[v], dtype=tl.uint8, is_pure=True, pack=4)


# The benchmark's looped strong tail parks its prenormalized row at the end of the CTA's dynamic
# shared memory: the launcher adds its bytes to what Triton's own code takes (at the start, from
# ``global_smem``), and the offsets here count back from the end (``%dynamic_smem_size``).
_END_OF_SHARED = ("{ .reg .b32 a, b; mov.u32 a, %dynamic_smem_size; mov.u32 b, global_smem; add.u32 a, a, b; "
                  "add.u32 a, a, $4; ")
STORE_SHARED_ASM = tl.constexpr(_END_OF_SHARED + "st.shared.v4.b32 [a], {$12, $13, $14, $15}; "
                                "mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }")
LOAD_SHARED_ASM = tl.constexpr(_END_OF_SHARED + "ld.shared.v4.b32 {$0, $1, $2, $3}, [a]; }")


@triton.jit
def store_shared_16b(offset_from_end, bits):
    """One ``st.shared.v4`` per thread and 8 consecutive int16 ``bits`` (operands $12-$15), at the
    byte ``offset_from_end`` (int32, negative) of the first of them ($4). GPU only."""
    tl.inline_asm_elementwise(STORE_SHARED_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
                              args=[offset_from_end, bits], dtype=tl.int16, is_pure=False, pack=8)


@triton.jit
def load_shared_16b(offset_from_end):
    """The int16 values ``store_shared_16b`` left at ``offset_from_end``: one ``ld.shared.v4`` per
    8. GPU only."""
    return tl.inline_asm_elementwise(LOAD_SHARED_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", args=[offset_from_end],
                                     dtype=tl.int16, is_pure=False, pack=8)


# The streaming consumers park their row in an area of their own: a static shared array declared
# once (``parked_area``), addressed through the register it returns, so it needs neither Triton's
# own shared window (``global_smem``, declared only where Triton's code takes shared memory) nor
# bytes added at launch. In the local forms the area also holds, past the row, the roots table: each
# chunk's part of the row's sum of squares by warp (``[chunk][part]`` fp32 slots), stored by one
# lane of each warp as the chunk is done (no barrier in the chunks' loop) and read back after the
# barrier before the second pass, where the contract's tree joins it within a warp (the slots of a
# chunk are its subtrees, in order). The tree of the [parts, roots] block across warps that it
# replaced took six CTA barriers a row.
@triton.constexpr_function
def _parked_area_asm(nbytes):
    return f"{{ .shared .align 16 .b8 parked_area[{nbytes}]; mov.u32 $0, parked_area; }}"


@triton.jit
def parked_area(BYTES: tl.constexpr):
    """The shared address of this CTA's parking area of BYTES bytes. Call it once a kernel: each call
    declares an array of its own. GPU only."""
    return tl.inline_asm_elementwise(_parked_area_asm(BYTES), "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_area_16b(address, bits):
    """``store_shared_16b`` at the shared ``address`` of the first of 8 consecutive int16 ``bits``."""
    tl.inline_asm_elementwise("st.shared.v4.b32 [$4], {$12, $13, $14, $15}; mov.b32 $0, 0; mov.b32 $1, 0; "
                              "mov.b32 $2, 0; mov.b32 $3, 0;", "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
                              args=[address, bits], dtype=tl.int16, is_pure=False, pack=8)


@triton.jit
def load_area_16b(address):
    """The int16 values ``store_area_16b`` left at ``address``: one ``ld.shared.v4`` per 8."""
    return tl.inline_asm_elementwise("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r,r,r,r,r,r,r,r",
                                     args=[address], dtype=tl.int16, is_pure=False, pack=8)


def _leader_asm(part: str) -> str:
    """PTX setting the predicate ``leader`` (registers ``lane``, ``holders``, ``lowest`` declared
    around it) in the lane that stores a warp's ``part``: the lowest of the lanes that hold it
    (Triton replicates a warp's value over its lanes)."""
    return (f"mov.u32 lane, %laneid; match.any.sync.b32 holders, {part}, 0xffffffff; brev.b32 holders, holders; "
            "bfind.shiftamt.u32 lowest, holders; setp.eq.u32 leader, lane, lowest; ")


TABLE_LEADER_ASM = tl.constexpr("{ .reg .pred leader; .reg .b32 lane, holders, lowest; " + _leader_asm("$1")
                                + "selp.u32 $0, 1, 0, leader; }")


@triton.jit
def table_leaders(part):
    """1 where this lane stores its warp's ``part`` (one per part, a part per warp) into the roots
    table (``table_part``), else 0. The lanes hold the same parts at every chunk: computed once a
    row, not at every store. GPU only."""
    return tl.inline_asm_elementwise(TABLE_LEADER_ASM, "=r,r", args=[part], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def table_part(value, leader, address):
    """Store each warp's fp32 part ``value`` at its shared ``address`` from the lane ``table_leaders``
    named (``leader`` non-zero). GPU only."""
    tl.inline_asm_elementwise("{ .reg .pred leader; setp.ne.u32 leader, $2, 0; @leader st.shared.b32 [$3], $1; "
                              "mov.b32 $0, 0; }", "=r,r,r,r", args=[value, leader, address], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.constexpr_function
def _table_sum_asm(slots, width):
    words = -(-slots // 4)  # the table is whole 16-byte words (plan.roots_table_bytes)
    values = [f"v{i}" for i in range(max(width, 4 * words))]
    loads = "".join(f"ld.shared.v4.f32 {{{', '.join(values[4 * w:4 * w + 4])}}}, [$1+{16 * w}]; " for w in range(words))
    padding = "".join(f"mov.f32 {value}, 0f00000000; " for value in values[slots:width])
    levels, n = "", width
    while n > 1:  # v_i = v_2i + v_2i+1 in place: each level's pairs, in order
        n //= 2
        levels += "".join(f"add.rn.f32 v{i}, v{2 * i}, v{2 * i + 1}; " for i in range(n))
    return f"{{ .reg .f32 v<{len(values)}>; {loads}{padding}{levels}mov.b32 $0, v0; }}"


@triton.jit
def table_sum(table, SLOTS: tl.constexpr, WIDTH: tl.constexpr):
    """The contract's tree of adjacent pairs over the roots table's SLOTS fp32 slots at the shared
    address ``table`` (16-byte aligned, behind a CTA barrier), padded with +0.0 to WIDTH (a power of
    two, at most 32), in every thread's registers: the table's words loaded at once (a
    broadcast: every lane reads the same words), then the tree's levels in order, where a butterfly of
    shuffles paid a shuffle's latency a level: one H100, tp = 1, us butterfly / registers / butterfly
    (two rounds each), H 5120 plain M = 100 wide twin (hinted) 4.23-4.24 / 3.94-3.95 / 4.11-4.23,
    H 4096 quant 512 13.71-13.75 / 13.46-13.47 / 13.58, no slower at the other rows. GPU only."""
    tl.static_assert(WIDTH <= 32, "the table is joined in one thread's registers")
    return tl.inline_asm_elementwise(_table_sum_asm(SLOTS, WIDTH), "=r,r", args=[table], dtype=tl.float32,
                                     is_pure=False, pack=1)


@triton.jit
def load_area_f32(address):
    """The fp32 values ``table_part`` stored at ``address`` (behind a CTA barrier). GPU only."""
    return tl.inline_asm_elementwise("ld.shared.b32 $0, [$1];", "=r,r", args=[address], dtype=tl.float32,
                                     is_pure=False, pack=1)


# A token's cooperative programs are one cluster of at most this many CTAs (the portable cluster size).
MAX_CLUSTER = tl.constexpr(8)


@triton.jit
def cluster_arrive(ON_GPU: tl.constexpr):
    """Every thread: ``barrier.cluster.arrive.relaxed``, this CTA has started. A CTA may store into
    another's shared memory only once that one has started: ``exchange_parts_in_cluster`` first waits
    for this arrival of the whole cluster (by then long past)."""
    if ON_GPU:
        tl.inline_asm_elementwise("barrier.cluster.arrive.relaxed; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


# A chunk's sum of squares comes in a part per warp (``numerics.subtree_roots``): at most this many.
MAX_PARTS = tl.constexpr(4)


def _exchange_parts_asm(ranks: int, parts: int, on_mbarrier: bool = False) -> str:
    """``exchange_parts_in_cluster``'s PTX: outputs $0..$(ranks * parts - 1) (the slots, read as
    16-byte words), inputs value, part, rank, size after them. ``on_mbarrier``
    (``exchange_parts_in_cluster_async``): each store completes its bytes on the target CTA's
    mbarrier (a fifth input, this CTA's own) and the CTA waits on its own, where the plain exchange
    passes a release / acquire cluster barrier."""
    slots = ranks * parts
    assert slots % 4 == 0, "the slots are read back as ld.shared.v4"
    value, part, rank, size, mbar = (f"${slots + i}" for i in range(5))
    # One lane per warp and part pushes it (the lowest of the lanes that hold that part).
    store = (f"@q mapa.shared::cluster.u32 rbar, {mbar}, {{target}}; "
             f"@q st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [remote], {value}, [rbar]; "
             if on_mbarrier else f"@q st.shared::cluster.b32 [remote], {value}; ")
    pushes = "".join(f"setp.gt.and.u32 q, {size}, {target}, leader; @q mapa.shared::cluster.u32 remote, own, {target}; "
                     + store.format(target=target) for target in range(ranks))
    arrived = (f"WAIT_PARTS: mbarrier.try_wait.parity.shared::cta.b64 done, [{mbar}], 0; @!done bra WAIT_PARTS; "
               if on_mbarrier else "barrier.cluster.arrive.release; barrier.cluster.wait.acquire; ")
    reads = "".join(f"ld.shared.v4.b32 {{${i}, ${i + 1}, ${i + 2}, ${i + 3}}}, [cluster_parts+{4 * i}]; "
                    for i in range(0, slots, 4))
    return (f"{{ .shared .align 16 .b32 cluster_parts[{slots}]; .reg .pred leader, q, done; "
            ".reg .b32 own, remote, rbar, lane, holders, lowest; " + _leader_asm(part) +
            f"mad.lo.u32 own, {rank}, {parts}, {part}; shl.b32 own, own, 2; mov.u32 remote, cluster_parts; "
            "add.u32 own, own, remote; "
            "barrier.cluster.wait; " + pushes + arrived + reads + "}")


EXCHANGE_PARTS_ASM = tl.constexpr(_exchange_parts_asm(MAX_CLUSTER.value, MAX_PARTS.value))
EXCHANGE_PARTS_ASYNC_ASM = tl.constexpr(_exchange_parts_asm(MAX_CLUSTER.value, MAX_PARTS.value, on_mbarrier=True))
EXCHANGE_PARTS_CONSTRAINTS = tl.constexpr(",".join(["=r"] * (MAX_CLUSTER.value * MAX_PARTS.value) + ["r"] * 4))


@triton.jit
def exchange_parts_in_cluster(value, part, rank, size):
    """Every thread of every CTA of a cluster of ``size`` (<= MAX_CLUSTER, after ``cluster_arrive``):
    the fp32 parts ``value`` (one per ``part`` < MAX_PARTS, a part per warp) of each CTA, as a tuple
    of MAX_CLUSTER * MAX_PARTS by (cluster rank, part). One lane of the warps that hold a part stores
    it into its slot of every CTA's shared array (distributed shared memory), then the cluster barrier
    (release / acquire) makes every slot visible and each thread reads its own CTA's array: no CTA
    barrier joins the warps' parts first. Slots of ranks from ``size`` on, or of parts a CTA does
    not have, are undefined. GPU only: the simulated group parks the chunk roots in a buffer instead."""
    return tl.inline_asm_elementwise(
        EXCHANGE_PARTS_ASM, EXCHANGE_PARTS_CONSTRAINTS, [value, part, rank, size],
        dtype=[tl.float32] * (MAX_CLUSTER * MAX_PARTS), is_pure=False, pack=1)


# Thread 0 sets up this CTA's mbarrier (a shared variable of this block, whose address is $0) for $1
# bytes of parts, then every thread arrives.
CLUSTER_ARRIVE_EXPECTING_ASM = tl.constexpr(
    "{ .shared .align 8 .b64 parts_arrived; .reg .pred first; .reg .b32 tid; .reg .b64 state; "
    "mov.u32 $0, parts_arrived; mov.u32 tid, %tid.x; setp.eq.u32 first, tid, 0; "
    "@first mbarrier.init.shared::cta.b64 [parts_arrived], 1; "
    "@first mbarrier.arrive.expect_tx.shared::cta.b64 state, [parts_arrived], $1; "
    "@first fence.mbarrier_init.release.cluster; "
    "barrier.cluster.arrive.relaxed; }")


@triton.jit
def cluster_arrive_expecting(RECEIVED_BYTES: tl.constexpr):
    """``cluster_arrive`` for ``exchange_parts_in_cluster_async``: thread 0 first sets up this CTA's
    mbarrier to complete once RECEIVED_BYTES have been stored into the CTA's slots (the fence makes
    that visible to the cluster before the arrival). Returns the mbarrier's shared address."""
    return tl.inline_asm_elementwise(CLUSTER_ARRIVE_EXPECTING_ASM, "=r,r", [tl.full([], RECEIVED_BYTES, tl.int32)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def exchange_parts_in_cluster_async(value, part, rank, size, mbarrier):
    """``exchange_parts_in_cluster`` without the cluster barrier after the stores (after
    ``cluster_arrive_expecting``, whose ``mbarrier`` it takes): each store completes its bytes on the
    target CTA's mbarrier, and each CTA waits for its own. No release fence (a MEMBAR.GPU) waits for
    the CTA's earlier global stores. Every CTA waits for every part stored into it, so none exits
    while another may still store into its shared memory."""
    return tl.inline_asm_elementwise(
        EXCHANGE_PARTS_ASYNC_ASM, EXCHANGE_PARTS_CONSTRAINTS + ",r", [value, part, rank, size, mbarrier],
        dtype=[tl.float32] * (MAX_CLUSTER * MAX_PARTS), is_pure=False, pack=1)


@triton.jit
def store_record_system(address, source, generation, token, ON_GPU: tl.constexpr):
    """Write a spin-timeout record [flag, source, generation, token] (int32 words) at ``address``
    (int64: the host mirror in pinned memory) so that whoever sees the flag sees the rest: the three
    words, ``fence.sc.sys``, then the flag, in one asm block that nothing can reorder. Plain
    stores: PCIe hosts may lack the atomics to host memory. Every thread of the program runs it
    (the values are the same); the interpreter twin stores the words in the same order."""
    if ON_GPU:
        tl.inline_asm_elementwise(
            "st.global.b32 [$1+4], $2; st.global.b32 [$1+8], $3; st.global.b32 [$1+12], $4; "
            "fence.sc.sys; st.relaxed.sys.global.b32 [$1], $5; mov.u32 $0, 0;",
            "=r,l,r,r,r,r", args=[address, source, generation, token, tl.full([], 1, tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        words = address.to(tl.pointer_type(tl.int32))
        tl.store(words + 1, source)
        tl.store(words + 2, generation)
        tl.store(words + 3, token)
        tl.store(words, 1)


@triton.jit
def multicast_store_16b(addr, w0, w1, w2, w3, stored):
    """One ``multimem.st`` of 16 bytes per element of ``addr`` (int64 multicast addresses) where
    ``stored`` is non-zero. GPU only: the simulated group has no multicast transport."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $6, 0; "
        "@p multimem.st.relaxed.sys.global.v4.f32 [$1], {$2, $3, $4, $5}; mov.u32 $0, 0; }",
        "=r,l,r,r,r,r,r",
        args=[addr, w0, w1, w2, w3, stored],
        dtype=tl.int32, is_pure=False, pack=1)
