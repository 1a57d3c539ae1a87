"""The compiled kernels of one build: which kernel, with which constexprs, signature and launch
options. The launcher and the offline PTX compiler both read this, so what ``ptx`` writes is what
the GPU runs."""

from __future__ import annotations

from dataclasses import dataclass

from lamport_mhc.backend import LOCAL, BuildSpec

from . import ptx
from .consumer import (ALL_PHASES, NO_PUBLISH, PLAIN, PUBLISH_FINALIZE, PUBLISH_X, QUANT, RESIDUAL_ONLY,
                       consumer_kernel)
from .owner_reduce import owner_reduce_kernel
from .publish import publish_kernel

VARIANT_CODES = {"plain": PLAIN.value, "quant": QUANT.value, "residual": RESIDUAL_ONLY.value}

PUBLISH_SIGNATURE = {"x_ptr": "*i16", "gemm2_ptr": "*i16", "weights_ptr": "*fp32", "indices_ptr": "*i32",
                     "state_ptr": "*i32", "peer_table_ptr": "*i64", "multicast_address": "i64", "slots": "i32"}
OWNER_REDUCE_SIGNATURE = {"mailbox_ptr": "*i16", "sums_table_ptr": "*i64", "sums_multicast_address": "i64",
                          "state_ptr": "*i32", "error_ptr": "*i32", "num_tokens": "i32", "timeout_ns": "i64",
                          "slots": "i32", "capacity": "i32"}
CONSUMER_SIGNATURE = {"mailbox_ptr": "*i16", "residual_ptr": "*i16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
                      "pre_ptr": "*fp32", "gamma_ptr": "*i16", "residual_out_ptr": "*i16",
                      "layer_out_ptr": "*i16", "values_ptr": "*u8", "scales_ptr": "*u8", "state_ptr": "*i32",
                      "error_ptr": "*i32", "eps": "fp32", "num_tokens": "i32", "timeout_ns": "i64",
                      "capacity": "i32", "parked_roots_ptr": "*fp32", "x_ptr": "*i16",
                      "gemm2_ptr": "*i16", "weights_ptr": "*fp32", "indices_ptr": "*i32", "peer_table_ptr": "*i64",
                      "multicast_address": "i64"}


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Chunk widths a row is walked in: with CHUNK // 256 warps every thread moves 8 bf16 (16 bytes) per
# access; wider chunks would only add warps, narrower ones could not give each thread 16 bytes.
CHUNK_WIDTHS = (1024, 512, 256)


def row_chunks(hidden: int) -> tuple[int, int]:
    """(CHUNK, CHUNKS): the chunk width that pads the row least (the widest among equals) and the
    chunk count. H = 4096 / 5120 / 7168: 4 / 5 / 7 chunks of 1024, no lane of padding; H = 1408:
    3 of 512."""
    chunk = min(CHUNK_WIDTHS, key=lambda width: (-(-hidden // width) * width, -width))
    return chunk, -(-hidden // chunk)


def row_warps(chunk: int) -> int:
    return chunk // 256


def cooperative_split(chunks: int) -> int | None:
    """Programs per token of the cooperative form (one per chunk, one cluster of CTAs), or None
    where a row has one chunk or more chunks than a cluster may hold (``ptx.MAX_CLUSTER``)."""
    return chunks if 1 < chunks <= ptx.MAX_CLUSTER.value else None


# The register cap of the local streaming consumers that park the row: 64 x 128 threads lets 8
# programs share an SM (4 warps each) where the compiler takes 72-95, spilling nothing (the
# finalize: 12 bytes) at H = 4096-7168 (ptxas -v). The mailbox consumers, which hold more across
# their spin, would spill; the cooperative forms run a wave or less. Both keep the compiler's choice
# (but the local cooperative forms' ``_capped`` twins, for calls past the wave the uncapped one holds).
LOCAL_STREAMING_MAX_REGISTERS = 64

# The latency form, the local cooperative consumers of x (not their ``_capped`` twins), holds every
# mix weight in every thread (``consumer._mix_weights``: no CTA barrier before the cluster exchange)
# and is capped at this many registers: 80 x 128 threads leave 6 programs per SM, and ptxas still
# issues every load of the chunk (x, the streams) before the mix; at 72 it issued some of the
# streams' only when the mix reached them (sm_90a SASS). One H200, tp = 1, H = 7168, us at 80 / at
# ptxas's own 91 (5 programs per SM): plain M = 1 / 64 / 100 2.16 / 2.26, 3.63 / 3.71, 4.48 / 4.77;
# quant M = 100 5.45 / 5.87.
LOCAL_COOPERATIVE_MAX_REGISTERS = 80


# The local streaming consumers of x (not the finalize, whose gather bounds it) have a twin that
# holds the prenormalized row in registers instead of parking it: rows of up to HELD_MAX_CHUNKS
# chunks, capped at HELD_MAX_REGISTERS (5 programs per SM), or at the parked cap for rows of at most
# HELD_NARROW_CHUNKS chunks (8 programs per SM); no spill at H = 4096, 5120, 7168 (ptxas -v). One
# H200, tp = 1, M = 1024 / 4096, against the row parked in layer_out: plain 42.4 / 150.8 us against
# 45.0 / 170.6 at H = 7168, quant 166.7 against 188.7 at 4096; at H = 4096, 64 registers 24.7 / 87.5
# against 27.8 / 92.7 at 96 (at 5120, 80 instead of 96 won nothing). The finalize lost (180 against
# 159 us at 4096, H = 5120), and so did 8 warps per 1024-wide chunk (8-byte accesses).
HELD_MAX_CHUNKS = 7
HELD_NARROW_CHUNKS = 4
HELD_MAX_REGISTERS = 96

# Rows park in shared memory at 64 registers (8 programs per SM) below HELD_MIN_ROWS rows and are held
# by the ``_held`` twin from there: the held form runs fewer instructions a row, but in few waves its
# last one leaves SMs idle. One H200, tp = 1, CUDA graphs, parked against held, us: H = 5120 plain
# M = 512 / 2048 / 4096 / 6144 / 8192: 14.6 / 55.5 / 106.6 / 157.5 / 208.7 against 15.2 / 58.4 /
# 107.6 / 156.7 / 206.1; quant 2048 / 8192: 61.1 / 225.5 against 63.1 / 223.2; H = 7168 plain 2048 /
# 4096 / 8192: 77.1 / 148.8 / 294.6 against 82.0 / 150.7 / 289.3. H = 4096 (held at 64 registers),
# M = 256 / 512 / 1024 / 2048: quant 6.4 / 12.3 / 25.6 / 49.8 against 8.1 / 13.2 / 25.7 / 50.5, plain
# 6.3 / 10.5 / 23.2 / 45.0 against 7.1 / 11.3 / 23.2 / 45.3 (CuTe: quant 7.5 / 11.7 / 24.1 / 46.8).
# Where the wide twins take the calls of many rows (``wide_takes_many_rows``: the plain variant, and
# the quant variant at H = 4096 and 7168) they take those calls instead
# (``backend.TritonKernels._wide_window``): the held twin remains for quant at 5120.
HELD_MIN_ROWS = 5120

# The variants whose parked streaming consumers of x (and their wide twins) load the next chunk's
# inputs while mixing one (``PREFETCH``), at the same 64 registers. One H200, tp = 1, CUDA graphs, us
# with / without: quant H = 5120 M = 256 / 512 / 1024 / 2048 / 4096: 7.1 / 16.1 / 31.9 / 60.7 / 115.1
# against 8.4 / 16.2 / 32.2 / 61.3 / 115.6; H = 7168: 10.5 / 22.4 / 44.2 / 83.3 / 160.7 against 12.2 /
# 22.4 / 44.4 / 84.3 / 161.8. Plain, with every mix weight in every thread as well (no spill at 64
# registers), wide twin: H = 4096 M = 64 / 128 / 512 / 2048 / 8192 3.5 / 3.7 / 9.2 / 43.8 / 163.1
# against 4.2 / 4.4 / 9.9 / 45.1 / 165.1, H = 5120 4.4 / 4.7 / 13.8 / 55.7 / 204.8 against 5.0 / 5.3 /
# 14.4 / 57.1 / 206.3, H = 7168 5.3 / 5.6 / 21.1 / 76.3 / 286.5 against 6.0 / 6.6 / 21.3 / 78.0 /
# 288.3; the parked form H = 5120 M = 128 / 256 4.8 / 6.0 against 6.2 / 7.4, H = 7168 6.2 / 8.9
# against 7.8 / 10.2 (from 512 rows, where plain takes the wide twin, 1-2% slower). Earlier, with the
# weights spread over the threads, 64 registers spilled the plain prefetch and it lost from M = 512.
PARKED_PREFETCH_VARIANTS = ("plain", "quant")

# The variants whose parked streaming consumers of x (and their wide twins) hold every mix weight in
# every thread, as the latency form does (``LOCAL_COOPERATIVE_MAX_REGISTERS``): a token's prologue
# then gathers no weights across warps (8 CTA barriers fewer at 64 registers; no spill at H = 4096
# and 5120, 4 bytes a chunk at 7168). One H200, tp = 1, quant, us with / without: M = 1024 H = 5120
# / 7168 31.24 / 31.46, 43.14 / 43.69; M = 512 15.49 / 16.10, 22.11 / 22.05; but H = 7168 M = 256
# (the parked form that spills) 10.81 / 10.55. Plain: with the prefetch (above).
PER_THREAD_WEIGHTS_VARIANTS = ("plain", "quant")

# The variants whose wide twin of x takes the calls of many rows even where its chunks overhang the
# row (``wide_takes_many_rows``; H = 5120: three chunks of 2048, the last half masked). One H200,
# tp = 1, plain, us, the wide twin against the parked form or the held one (every twin prefetching):
# H = 5120 M = 2048 / 4096 / 8192 55.7 / 105.4 / 204.8 against 56.2 / 108.1 / 206.0 (held), H = 7168
# 76.3 / 146.2 / 286.5 against 78.6 / 151.9 / 289.9 (held); streamed M = 1000: 28.3 against 28.1 at
# 5120, 38.9 against 40.1 at 7168.
WIDE_MANY_ROWS_VARIANTS = ("plain",)


# The streaming consumers that do not hold their row park it between the two passes in a static
# shared array of the CTA on the GPU (``ptx.parked_area``), up to this many bytes a row (H = 16384),
# and otherwise in ``layer_out``, where it may be written back to HBM and read again before its
# second pass (the interpreter always parks there). With the roots table, within the 48 KB of static
# shared memory a CTA may declare.
SHARED_PARK_MAX_BYTES = 32 * 1024


def parked_row_bytes(chunk: int, chunks: int, on_gpu: bool) -> int:
    """Shared-memory bytes a streaming consumer parks its row in (0: it parks in ``layer_out``)."""
    row_bytes = 2 * chunk * chunks
    return row_bytes if on_gpu and row_bytes <= SHARED_PARK_MAX_BYTES else 0


def roots_table_bytes(chunks: int, chunk: int) -> int:
    """Shared-memory bytes of the roots table (``ptx.table_part``) of a local streaming consumer that
    parks its row there: an fp32 slot per chunk and warp, in whole 16-byte words (the row's stores
    below it stay aligned). The mailbox consumers join their roots across warps as before, until the
    table is measured with ranks at once."""
    return -(-4 * chunks * row_warps(chunk) // 16) * 16


def wide_tiles_row(hidden: int) -> bool:
    """Whether chunks twice as wide as the row's tile it exactly (H = 4096: 2 x 2048)."""
    chunk, chunks = row_chunks(hidden)
    return chunks > 1 and hidden % (2 * chunk) == 0


def wide_chunk(hidden: int, variant: str, of_x: bool = True) -> int | None:
    """The chunk width of a local streaming consumer's ``_wide`` twin (None: it has none): twice the
    row's chunk for rows of two or more chunks, for the quant variant only where those tile the row;
    else (quant, the consumer of x: ``of_x``) four times the row's chunk where the row spans two or
    more of those and leaves at most one chunk of the last masked (H = 7168: 4096 + 3072, 16 warps).
    One H200, tp = 1, H = 7168 quant, us four-chunk twin / parked (held from 5120 rows): M = 576 /
    640 / 768 / 1024 / 2048 / 4096 / 8192 27.3 / 30.6, 28.4 / 32.8, 33.5 / 36.8, 43.5 / 44.2, 82.1 /
    83.5, 157.8 / 160.4, 309.6 / 313.5; it lost at 264 / 300 / 384 / 512 / 528 (11.2 / 9.7, 15.4 /
    13.5, 18.3 / 17.7, 23.2 / 21.9, 24.0 / 23.0), as did (M = 1024 / 2048) the twin twice as wide
    (44.8 / 91.2), the four-chunk twin at H = 5120 (39.7 / 70.9 against 31.4 / 60.4) and, holding
    the row instead of parking it, at H = 4096 and 7168 (47.0 / 89.3 at 7168)."""
    chunk, chunks = row_chunks(hidden)
    if chunks < 2:
        return None
    if variant != "quant" or wide_tiles_row(hidden):
        return 2 * chunk
    if not of_x:  # (the finalize's is unmeasured)
        return None
    return four_chunk_width(hidden)


def four_chunk_width(hidden: int) -> int | None:
    """Four times the row's chunk where the row spans two or more of those and leaves at most one of
    its chunks masked (H = 7168: 4096 + 3072, 16 warps; not 4096: one of them; not 5120: 4096 + 1024
    of 4096), else None."""
    chunk = row_chunks(hidden)[0]
    width = 4 * chunk
    pieces = -(-hidden // width)
    return width if pieces >= 2 and pieces * width - hidden <= chunk else None


# The local streaming consumers of x of these variants have a ``_broad`` twin (``broad_chunk``): the
# parked form in chunks four times the row's (16 warps), its registers the compiler's choice (one
# program an SM), without cache hints, for the calls ``backend.LOCAL_X_BROAD_ROWS_PER_SM`` gives it.
# (The quant variant's four-chunk ``_wide`` twin is the same form at 64 registers.)
BROAD_VARIANTS = ("plain",)


def broad_chunk(hidden: int, variant: str) -> int | None:
    """The chunk width of the ``_broad`` twin of the local streaming consumer of x (None: it has
    none): ``four_chunk_width``, for ``BROAD_VARIANTS``."""
    return four_chunk_width(hidden) if variant in BROAD_VARIANTS else None


# The local streaming consumers of x of these variants have a ``_broad_held`` twin
# (``broad_held_chunk``): the row held in registers, in chunks four times the row's (16 warps) where
# it spans at most BROAD_HELD_MAX_CHUNKS of them, each warp's part of a chunk's sum of squares joined
# through a roots table (one CTA barrier a row), every mix weight in every thread, the registers the
# compiler's choice, hinted and not: the shape of the strong tail's wide form (one program an SM, a
# chunk's loads all in flight at once), which the benchmark's strong tail took at M = 100-128 at
# H = 7168 (and quant at 4096 and 5120 M = 100) on one H200, where the fused forms were 5-10%
# slower. Unlike that form it issues the second chunk's loads before it mixes the first (``PREFETCH``,
# sm_90a SASS at H = 7168: the strong form issues them after the first chunk's stores). The calls it
# takes: ``backend.LOCAL_X_BROAD_HELD_ROWS_PER_SM``. Not ptxas's ceiling on registers: at 255 (128
# used, the stream loads issued earlier in SASS) the hinted twin was 11-12% slower on one H200, H = 7168
# quant, A / B / A, us at 255 / the compiler's choice / 255: M = 112 6.06-6.09 / 5.46-5.42 / 6.10-6.11,
# M = 128 (the calls' own) 5.96 / 5.32 / 5.96.
BROAD_HELD_VARIANTS = ("plain", "quant")
BROAD_HELD_MAX_CHUNKS = 2


def broad_held_chunk(hidden: int, variant: str) -> int | None:
    """The chunk width of the ``_broad_held`` twin of the local streaming consumer of x (None: it has
    none): four times the row's chunk, for ``BROAD_HELD_VARIANTS``, where the row fills at least one
    such chunk and spans at most ``BROAD_HELD_MAX_CHUNKS`` (H = 4096: one; 5120 and 7168: two)."""
    width = 4 * row_chunks(hidden)[0]
    if variant not in BROAD_HELD_VARIANTS or hidden < width or -(-hidden // width) > BROAD_HELD_MAX_CHUNKS:
        return None
    return width


def four_chunk_wide(hidden: int, variant: str) -> bool:
    """Whether ``variant``'s wide twin (that of its consumer of x) walks chunks four times as wide."""
    return wide_chunk(hidden, variant) == 4 * row_chunks(hidden)[0]


def wide_takes_many_rows(hidden: int, variant: str, of_x: bool = True) -> bool:
    """Whether the ``_wide`` twin takes the calls of many rows (``backend.TritonKernels._wide_window``),
    where the held twin then is not built: where its chunks tile the row, the quant variant's
    four-chunk twin, and the consumers of x of ``WIDE_MANY_ROWS_VARIANTS``."""
    width = wide_chunk(hidden, variant, of_x)
    return width is not None and (hidden % width == 0 or width == 4 * row_chunks(hidden)[0]
                                  or (of_x and variant in WIDE_MANY_ROWS_VARIANTS))


def _row_forms(may_hold: bool, wide: int | None, wide_takes_many: bool, chunk: int, chunks: int,
               hidden: int, broad: int | None = None, broad_held: int | None = None) -> tuple[tuple, ...]:
    """(HOLD, CHUNK, CHUNKS, name suffix) of each form a streaming consumer is built in: parked; a
    ``_wide`` twin parked in chunks ``wide`` wide (more warps, the last chunk masked where they
    overhang the row); where it may hold the row, a ``_held`` twin, but where the wide twin takes
    the calls of many rows; a ``_broad`` twin parked in chunks ``broad`` wide; a ``_broad_held`` twin
    holding the row in chunks ``broad_held`` wide."""
    forms = [(False, chunk, chunks, "")]
    if may_hold and chunks <= HELD_MAX_CHUNKS and not wide_takes_many:
        forms.append((True, chunk, chunks, "_held"))
    if wide is not None:
        forms.append((False, wide, -(-hidden // wide), "_wide"))
    if broad is not None:
        forms.append((False, broad, -(-hidden // broad), "_broad"))
    if broad_held is not None:
        forms.append((True, broad_held, -(-hidden // broad_held), "_broad_held"))
    return tuple(forms)


def held_registers(chunks: int) -> int:
    """The register cap of a ``_held`` twin of a row of ``chunks`` chunks."""
    return LOCAL_STREAMING_MAX_REGISTERS if chunks <= HELD_NARROW_CHUNKS else HELD_MAX_REGISTERS


@dataclass(frozen=True)
class KernelInstance:
    name: str            # file-name friendly: kernel, protocol and variant
    fn: object           # the DualFunction
    constexprs: dict
    signature: dict      # runtime arguments, in order
    num_warps: int
    max_registers: int | None = None  # per thread (ptxas's maxnreg); None: the compiler's choice
    cluster: int = 1     # CTAs per cluster of the GPU launch (a program per CTA, consecutive ranks)

    @property
    def options(self) -> dict:
        """Compile options besides the constexprs (every kernel: no fp fusion, the contract's FMAs
        are explicit)."""
        options = dict(num_warps=self.num_warps, enable_fp_fusion=False)
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options


def kernel_plan(spec: BuildSpec, on_gpu: bool = True) -> dict[str, KernelInstance]:
    """Every kernel a build launches, keyed by name (e.g. ``publish_ll``, ``consumer_bt_quant``,
    ``local_finalize_plain``). Each consumer whose row has 2 to ``ptx.MAX_CLUSTER`` chunks also has
    a ``_split`` twin that spreads a token over a cluster of one program per chunk (the cooperative
    form), the local ones a ``_capped`` twin of it at 64 registers for calls of more tokens than the
    GPU holds clusters of it at once; each local streaming consumer a ``_streamed`` twin with cache
    hints (``traffic.STREAMED_ROWS``), a ``_wide`` one for rows of two or more chunks (``wide_chunk``)
    and those of x with rows of up to 7 chunks a ``_held`` twin for calls of at least ``HELD_MIN_ROWS``
    rows where the wide twin does not take those calls (``_row_forms``: quant at H = 5120); the plain
    one of x a ``_broad`` twin where ``broad_chunk`` gives it one (H = 7168), and the plain and quant
    ones of x a ``_broad_held`` twin where ``broad_held_chunk`` does (H = 4096, 5120, 7168)."""
    multicast = spec.transport == "multicast"
    common = dict(HIDDEN=spec.hidden, TP=spec.tp, ON_GPU=on_gpu, USE_PDL=spec.use_pdl and on_gpu)
    chunk, chunks = row_chunks(spec.hidden)
    warps = row_warps(chunk)
    plan = {}
    for protocol in spec.protocols:
        bt = protocol == "bt"
        if protocol == LOCAL:
            consumers = {"local": PUBLISH_X, "local_finalize": PUBLISH_FINALIZE}
        else:
            for finalize in (False, True):
                name = f"{'finalize_' if finalize else ''}publish_{protocol}"
                plan[name] = KernelInstance(name, publish_kernel, dict(
                    common, RANK=spec.rank, TOP_K=spec.top_k, BLOCK=chunk, FINALIZE=finalize, BT=bt,
                    MULTICAST=multicast and not bt), PUBLISH_SIGNATURE, warps)
            if bt:
                plan["owner_reduce_bt"] = KernelInstance("owner_reduce_bt", owner_reduce_kernel, dict(
                    common, RANK=spec.rank, BLOCK=chunk, MULTICAST=multicast), OWNER_REDUCE_SIGNATURE, warps)
            consumers = {f"consumer_{protocol}": NO_PUBLISH}
            if not bt and spec.ll_one_kernel_rows > 0:
                consumers.update({"one_kernel_ll": PUBLISH_X, "one_kernel_finalize_ll": PUBLISH_FINALIZE})
        for prefix, publish in consumers.items():
            for variant in spec.variants:
                for split in sorted({1, cooperative_split(chunks) or 1}):
                    local_streaming = split == 1 and protocol == LOCAL
                    normalizes = variant != "residual"
                    of_x = publish.value == PUBLISH_X.value
                    if split > 1:  # the cooperative form; a local one that normalizes has a capped twin
                        forms = ((False, chunk, chunks, ""),) + (
                            ((False, chunk, chunks, "_capped"),) if protocol == LOCAL and normalizes else ())
                    else:
                        wide = wide_chunk(spec.hidden, variant, of_x) if local_streaming and normalizes else None
                        broad = broad_chunk(spec.hidden, variant) if local_streaming and of_x else None
                        broad_held = broad_held_chunk(spec.hidden, variant) if local_streaming and of_x else None
                        forms = _row_forms(local_streaming and of_x and normalizes, wide,
                                           wide is not None and wide_takes_many_rows(spec.hidden, variant, of_x),
                                           chunk, chunks, spec.hidden, broad, broad_held)
                    for hold, form_chunk, form_chunks, twin in forms:
                        latency_form = split > 1 and protocol == LOCAL and twin == "" and normalizes and of_x
                        parks = split == 1 and not hold and normalizes
                        parked_bytes = parked_row_bytes(form_chunk, form_chunks, on_gpu) if parks else 0
                        broad_held_form = twin == "_broad_held"
                        # The roots table lies past the parked row, or is the broad held twin's only
                        # shared array (the interpreter's held forms join their roots as they go).
                        tabled = local_streaming and (parked_bytes > 0 or (broad_held_form and on_gpu))
                        table_bytes = roots_table_bytes(form_chunks, form_chunk) if tabled else 0
                        parks_x = parks and local_streaming and of_x  # the parked streaming consumer of x
                        prefetch = (parks_x or broad_held_form) and variant in PARKED_PREFETCH_VARIANTS
                        per_thread_weights = latency_form or broad_held_form or (
                            parks_x and variant in PER_THREAD_WEIGHTS_VARIANTS)
                        # The held twin runs from HELD_MIN_ROWS rows, past the hinted window; the broad
                        # twin lost with hints (backend.LOCAL_X_BROAD_ROWS_PER_SM).
                        for streamed in (False, True) if local_streaming and twin not in ("_held", "_broad") else (False,):
                            name = (f"{prefix}_{variant}" + ("_split" if split > 1 else "") + twin
                                    + ("_streamed" if streamed else ""))
                            # Only a one-kernel form publishes, so only it depends on the rank.
                            plan[name] = KernelInstance(name, consumer_kernel, dict(
                                common, HC=spec.hc, RANK=spec.rank if publish.value != NO_PUBLISH.value else 0,
                                TOP_K=spec.top_k,
                                BLOCK_HC=_pow2_at_least(spec.hc), CHUNK=form_chunk, CHUNKS=form_chunks,
                                ROOTS=_pow2_at_least(form_chunks), SPLIT=split, HOLD=hold, REDUCED=bt,
                                VARIANT=VARIANT_CODES[variant], PUBLISH=publish.value, LOCAL=protocol == LOCAL,
                                PHASES=ALL_PHASES.value, MULTICAST=multicast, STREAMED=streamed,
                                PARKED_BYTES=parked_bytes + table_bytes, PREFETCH=prefetch,
                                PER_THREAD_WEIGHTS=per_thread_weights, ROOTS_TABLE_BYTES=table_bytes),
                                CONSUMER_SIGNATURE, row_warps(form_chunk),
                                None if twin == "_broad" or broad_held_form else held_registers(chunks) if hold else
                                LOCAL_STREAMING_MAX_REGISTERS if local_streaming or twin == "_capped" else
                                LOCAL_COOPERATIVE_MAX_REGISTERS if latency_form else None,
                                # Only a cooperative form that normalizes exchanges chunk roots.
                                split if split > 1 and normalizes else 1)
    return plan
