"""Every inline-PTX helper of the CuTe DSL kernels, in one module.

Each helper is a ``@dsl_user_op`` emitting one ``llvm.inline_asm``, so the PTX instruction is exactly
the one written here: NVVM neither contracts it, nor approximates it, nor merges it with its
neighbours. Helpers that touch memory or order the kernel against other kernels are marked with
side effects (and clobber memory where ordinary loads and stores must not move across them).

Addresses are raw 64-bit byte addresses (``Int64``): mailboxes of other ranks are reached through a
table of peer addresses, and a 16-byte fragment is 8 bf16 values packed into four 32-bit words,
bf16 ``2i`` in the low half of word ``i``.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

SENTINEL_PAIR = 0x80008000  # two bf16 sentinels (-0.0) in one word


def _asm(result, operands, text, constraints, side_effects, loc, ip):
    return llvm.inline_asm(result, operands, text, constraints, has_side_effects=side_effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def _words(values, loc, ip):
    return [Uint32(v).ir_value(loc=loc, ip=ip) for v in values]


def _four_words(struct, loc, ip):
    return tuple(Uint32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(4))


# -- global memory -------------------------------------------------------------------------------

@dsl_user_op
def load_volatile_v4(address: Int64, *, loc=None, ip=None) -> tuple:
    """The Lamport poll: one 16-byte ``ld.volatile.global.v4.b32``, re-issued on every call (never
    cached, hoisted or merged), so all 8 lanes of a fragment are observed by one load."""
    struct = _asm(llvm.StructType.get_literal([T.i32()] * 4), [Int64(address).ir_value(loc=loc, ip=ip)],
                  "ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l,~{memory}", True, loc, ip)
    return _four_words(struct, loc, ip)


@dsl_user_op
def reload_volatile_v4(address: Int64, predicate: Int32, words, *, loc=None, ip=None) -> tuple:
    """``load_volatile_v4`` where ``predicate`` is nonzero, else ``words`` unchanged: a spin loop
    over several slots re-polls only those still pending."""
    struct = _asm(llvm.StructType.get_literal([T.i32()] * 4),
                  [Int64(address).ir_value(loc=loc, ip=ip), *_words(words, loc, ip),
                   Int32(predicate).ir_value(loc=loc, ip=ip)],
                  "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $9, 0;\n\t"
                  "@p ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$4];\n\t}",
                  "=r,=r,=r,=r,l,0,1,2,3,r,~{memory}", True, loc, ip)
    return _four_words(struct, loc, ip)


@dsl_user_op
def streaming_policy(streamed: Int32, *, loc=None, ip=None) -> Int64:
    """The L2 cache policy of what a call moves once: evict-first where ``streamed`` is nonzero, else
    evict-normal (what an access without a hint gets). Chosen per call, so one kernel serves both."""
    return Int64(_asm(T.i64(), [Int32(streamed).ir_value(loc=loc, ip=ip)],
                      "{\n\t.reg .pred p;\n\t.reg .b64 first, normal;\n\t"
                      "createpolicy.fractional.L2::evict_first.b64 first, 1.0;\n\t"
                      "createpolicy.fractional.L2::evict_normal.b64 normal, 1.0;\n\t"
                      "setp.ne.s32 p, $1, 0;\n\tselp.b64 $0, first, normal, p;\n\t}",
                      "=l,r", False, loc, ip))


@dsl_user_op
def load_v4(address: Int64, predicate: Int32 | None = None, policy: Int64 | None = None, *, loc=None,
            ip=None) -> tuple:
    """One 16-byte ``ld.global.v4.b32`` of an input fragment; with ``predicate``, zeros where it is 0
    (an unrouted top-k row is never dereferenced); with ``policy`` (``streaming_policy``), under that
    L2 cache policy. Kept in program order after the PDL wait."""
    result = llvm.StructType.get_literal([T.i32()] * 4)
    operands = [Int64(address).ir_value(loc=loc, ip=ip)]
    load, constraints = "ld.global.v4.b32 {$0, $1, $2, $3}, [$4]", "=r,=r,=r,=r,l"
    if policy is not None:
        operands.append(Int64(policy).ir_value(loc=loc, ip=ip))
        load, constraints = "ld.global.L2::cache_hint.v4.b32 {$0, $1, $2, $3}, [$4], $5", constraints + ",l"
    if predicate is None:
        struct = _asm(result, operands, load + ";", constraints + ",~{memory}", True, loc, ip)
    else:
        p = f"${len(operands) + 4}"
        struct = _asm(result, [*operands, Int32(predicate).ir_value(loc=loc, ip=ip)],
                      f"{{\n\t.reg .pred p;\n\tsetp.ne.s32 p, {p}, 0;\n\t"
                      "@!p mov.b32 $0, 0;\n\t@!p mov.b32 $1, 0;\n\t@!p mov.b32 $2, 0;\n\t@!p mov.b32 $3, 0;\n\t"
                      f"@p {load};\n\t}}", constraints + ",r,~{memory}", True, loc, ip)
    return _four_words(struct, loc, ip)


@dsl_user_op
def load_volatile_b32(address: Int64, *, loc=None, ip=None) -> Int32:
    """``ld.volatile.global.b32`` of a generation-state word, which other kernels of the stream
    (and, through PDL, kernels still running) update."""
    return Int32(_asm(T.i32(), [Int64(address).ir_value(loc=loc, ip=ip)], "ld.volatile.global.b32 $0, [$1];",
                      "=r,l,~{memory}", True, loc, ip))


@dsl_user_op
def store_v4(address: Int64, words, policy: Int64 | None = None, *, loc=None, ip=None) -> None:
    """One 16-byte ``st.global.v4.b32`` to a raw address: a peer store through the table of peer
    addresses (the mapping of another GPU's buffer), a re-arm, or a local output fragment; with
    ``policy`` (``streaming_policy``), under that L2 cache policy."""
    operands = [Int64(address).ir_value(loc=loc, ip=ip), *_words(words, loc, ip)]
    if policy is None:
        _asm(None, operands, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", True, loc, ip)
    else:
        _asm(None, [*operands, Int64(policy).ir_value(loc=loc, ip=ip)],
             "st.global.L2::cache_hint.v4.b32 [$0], {$1, $2, $3, $4}, $5;", "l,r,r,r,r,l,~{memory}", True, loc, ip)


@dsl_user_op
def store_v2(address: Int64, low: Uint32, high: Uint32, *, loc=None, ip=None) -> None:
    """One 8-byte ``st.global.v2.b32``: a fragment's eight MXFP8 codes."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), *_words((low, high), loc, ip)],
         "st.global.v2.b32 [$0], {$1, $2};", "l,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def store_sentinel_v4(address: Int64, *, loc=None, ip=None) -> None:
    """Re-arm one consumed 16-byte fragment with the sentinel (8 x bf16 -0.0): the data is its own
    ready flag, so a slot is empty again once its reader has written this."""
    pair = Uint32(SENTINEL_PAIR).ir_value(loc=loc, ip=ip)
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), pair, pair, pair, pair],
         "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def multicast_store_v4(address: Int64, words, *, loc=None, ip=None) -> None:
    """One 16-byte ``multimem.st`` to an NVLink multicast address: every rank's copy receives it.
    Relaxed is enough because readers poll the data itself; multicast addresses may only be
    written with ``multimem`` instructions. The .f32 type only names the 4-byte lanes (no math)."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), *_words(words, loc, ip)],
         "multimem.st.relaxed.sys.global.v4.f32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def atomic_cas_b32(address: Int64, compare: Int32, value: Int32, *, loc=None, ip=None) -> Int32:
    """``atom.acq_rel.gpu.global.cas.b32``: the first spin loop of a launch to time out claims the
    error word (returns the old flag)."""
    return Int32(_asm(T.i32(), [Int64(address).ir_value(loc=loc, ip=ip), Int32(compare).ir_value(loc=loc, ip=ip),
                                Int32(value).ir_value(loc=loc, ip=ip)],
                      "atom.acq_rel.gpu.global.cas.b32 $0, [$1], $2, $3;", "=r,l,r,r,~{memory}", True, loc, ip))


@dsl_user_op
def load_b64(address: Int64, *, loc=None, ip=None) -> Int64:
    """``ld.global.b64`` of a word the host wrote before any launch (the host mirror's address)."""
    return Int64(_asm(T.i64(), [Int64(address).ir_value(loc=loc, ip=ip)], "ld.global.b64 $0, [$1];",
                      "=l,l,~{memory}", True, loc, ip))


@dsl_user_op
def store_record_system(address: Int64, source: Int32, generation: Int32, token: Int32, *, loc=None,
                        ip=None) -> None:
    """Write a spin-timeout record [flag, source, generation, token] at ``address`` (the host mirror
    in pinned memory) so that whoever sees the flag sees the rest: the three words, ``fence.sc.sys``,
    then the flag, in one asm block. Plain stores: PCIe hosts may lack atomics to host memory."""
    operands = [Int64(address).ir_value(loc=loc, ip=ip)] + [Int32(v).ir_value(loc=loc, ip=ip)
                                                            for v in (source, generation, token, 1)]
    _asm(None, operands,
         "st.global.b32 [$0+4], $1; st.global.b32 [$0+8], $2; st.global.b32 [$0+12], $3; "
         "fence.sc.sys; st.relaxed.sys.global.b32 [$0], $4;", "l,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def store_b32(address: Int64, value: Int32, *, loc=None, ip=None) -> None:
    """``st.global.b32`` of one state or error word, in program order with the protocol's other
    memory operations."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
         "st.global.b32 [$0], $1;", "l,r,~{memory}", True, loc, ip)


# -- fp32 arithmetic of the bit contract ---------------------------------------------------------

def _f32_op(text, operands, loc, ip) -> Float32:
    values = [Float32(v).ir_value(loc=loc, ip=ip) for v in operands]
    constraints = ",".join(["=f"] + ["f"] * len(values))
    return Float32(_asm(T.f32(), values, text, constraints, False, loc, ip))


@dsl_user_op
def fma_rn(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """``fma.rn.f32``: a*b+c with one rounding, where the contract says fma."""
    return _f32_op("fma.rn.f32 $0, $1, $2, $3;", (a, b, c), loc, ip)


@dsl_user_op
def add_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """``add.rn.f32``: an add the contract rounds on its own, which NVVM may therefore not fuse
    with a preceding multiply (or flush to zero)."""
    return _f32_op("add.rn.f32 $0, $1, $2;", (a, b), loc, ip)


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """``mul.rn.f32``: a product the contract rounds on its own (never contracted into an fma)."""
    return _f32_op("mul.rn.f32 $0, $1, $2;", (a, b), loc, ip)


@dsl_user_op
def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """``div.rn.f32``: IEEE division (NVVM's default is ``div.full``/approximate under fast math)."""
    return _f32_op("div.rn.f32 $0, $1, $2;", (a, b), loc, ip)


@dsl_user_op
def sqrt_rn(a: Float32, *, loc=None, ip=None) -> Float32:
    """``sqrt.rn.f32``: IEEE square root (never ``sqrt.approx`` or ``rsqrt.approx``)."""
    return _f32_op("sqrt.rn.f32 $0, $1;", (a,), loc, ip)


@dsl_user_op
def bf16x2_rn(low: Float32, high: Float32, *, loc=None, ip=None) -> Uint32:
    """One word of the bf16 roundings to nearest even of ``low`` (low half) and ``high``, every NaN
    as 0x7FC0: ``cvt.rn.bf16x2.f32`` (its NaN is 0x7FFF, the one result above 0x7FC0 as a signed
    half), then ``min.s16x2`` against 0x7FC0 in both halves: the contract's rounding of two values
    in two instructions."""
    operands = [Float32(high).ir_value(loc=loc, ip=ip), Float32(low).ir_value(loc=loc, ip=ip)]
    return Uint32(_asm(T.i32(), operands, "{\n\t.reg .b32 nan;\n\tcvt.rn.bf16x2.f32 $0, $1, $2;\n\t"
                       "mov.b32 nan, 0x7FC07FC0;\n\tmin.s16x2 $0, $0, nan;\n\t}", "=r,f,f", False, loc, ip))


@dsl_user_op
def e4m3x2_rn(low: Float32, high: Float32, *, loc=None, ip=None) -> Uint32:
    """The e4m3 codes of ``low`` (bits 0-7) and ``high`` (bits 8-15), the MXFP8 rule's clamp to
    +-448 in one ``min.f32`` a value (a NaN becomes 448) ahead of ``cvt.rn.satfinite.e4m3x2.f32``,
    which saturates below -448 itself."""
    operands = [Float32(low).ir_value(loc=loc, ip=ip), Float32(high).ir_value(loc=loc, ip=ip)]
    return Uint32(_asm(T.i32(), operands, "{\n\t.reg .f32 lo, hi;\n\t.reg .b16 pair;\n\t"
                       "min.f32 lo, $1, 0f43E00000;\n\tmin.f32 hi, $2, 0f43E00000;\n\t"
                       "cvt.rn.satfinite.e4m3x2.f32 pair, hi, lo;\n\tcvt.u32.u16 $0, pair;\n\t}",
                       "=r,f,f", False, loc, ip))


# -- PDL and clocks ------------------------------------------------------------------------------

@dsl_user_op
def grid_dependency_wait(*, loc=None, ip=None) -> None:
    """PDL ``griddepcontrol.wait``: block until the preceding kernel of the stream completed and its
    stores are visible. No load of an input or of the generation state may move above it."""
    _asm(None, [], "griddepcontrol.wait;", "~{memory}", True, loc, ip)


@dsl_user_op
def launch_dependents(*, loc=None, ip=None) -> None:
    """PDL ``griddepcontrol.launch_dependents``: let the next kernel of the stream start its
    prologue early (it still waits for this kernel's completion before reading its results)."""
    _asm(None, [], "griddepcontrol.launch_dependents;", "~{memory}", True, loc, ip)


@dsl_user_op
def global_timer_ns(*, loc=None, ip=None) -> Int64:
    """``%globaltimer`` (ns), read anew each call: the clock of the optional spin bound."""
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", True, loc, ip))


# -- thread-block clusters (distributed shared memory) -------------------------------------------

@dsl_user_op
def map_shared_cluster(shared_address: Int32, cta_rank: Int32, *, loc=None, ip=None) -> Int32:
    """``mapa.shared::cluster.u32``: the address of the same shared-memory variable in CTA
    ``cta_rank`` of the cluster, for cluster-wide partial sums."""
    return Int32(_asm(T.i32(), [Int32(shared_address).ir_value(loc=loc, ip=ip),
                                Int32(cta_rank).ir_value(loc=loc, ip=ip)],
                      "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", False, loc, ip))


@dsl_user_op
def store_shared_cluster_f32(cluster_address: Int32, value: Float32, *, loc=None, ip=None) -> None:
    """``st.shared::cluster.f32``: store into another CTA's shared memory (an address from
    ``map_shared_cluster``); valid only once every CTA of the cluster has started."""
    _asm(None, [Int32(cluster_address).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
         "st.shared::cluster.f32 [$0], $1;", "r,f,~{memory}", True, loc, ip)


@dsl_user_op
def cluster_arrive(*, loc=None, ip=None) -> None:
    """``barrier.cluster.arrive.release.aligned``: this thread's shared-memory stores (local and
    remote) are released to the cluster; pair with ``cluster_wait``."""
    _asm(None, [], "barrier.cluster.arrive.release.aligned;", "~{memory}", True, loc, ip)


@dsl_user_op
def cluster_arrive_relaxed(*, loc=None, ip=None) -> None:
    """``barrier.cluster.arrive.relaxed.aligned``: announce that this CTA has started (no ordering),
    so peers may store into its shared memory after their ``cluster_wait``."""
    _asm(None, [], "barrier.cluster.arrive.relaxed.aligned;", "~{memory}", True, loc, ip)


@dsl_user_op
def cluster_wait(*, loc=None, ip=None) -> None:
    """``barrier.cluster.wait.acquire.aligned``: wait for every thread of the cluster to arrive and
    acquire what they released."""
    _asm(None, [], "barrier.cluster.wait.acquire.aligned;", "~{memory}", True, loc, ip)


@dsl_user_op
def store_shared_f32(shared_address: Int32, value: Float32, *, loc=None, ip=None) -> None:
    """``st.shared.f32`` of a warp's partial sum into this CTA's shared memory (the streaming
    consumer's slots, read after a CTA barrier)."""
    _asm(None, [Int32(shared_address).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
         "st.shared.f32 [$0], $1;", "r,f,~{memory}", True, loc, ip)


@dsl_user_op
def load_shared_f32(shared_address: Int32, *, loc=None, ip=None) -> Float32:
    """``ld.shared.f32`` of a partial sum, kept after the (cluster or CTA) barrier that made the
    other warps' stores visible."""
    return Float32(_asm(T.f32(), [Int32(shared_address).ir_value(loc=loc, ip=ip)], "ld.shared.f32 $0, [$1];",
                        "=f,r,~{memory}", True, loc, ip))


# -- atomics ---------------------------------------------------------------------------------------

@dsl_user_op
def atomic_add_b32(address: Int64, value: Int32, *, loc=None, ip=None) -> Int32:
    """``atom.acq_rel.gpu.global.add.u32``: a one-kernel LL call's CTAs count themselves in (returns
    the count before this one)."""
    return Int32(_asm(T.i32(), [Int64(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
                      "atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;", "=r,l,r,~{memory}", True, loc, ip))
