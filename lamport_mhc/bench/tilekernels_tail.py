"""DeepSeek's tile-kernels (TileLang) as the benchmark's ``tilekernels-tail`` path: the mHC tail as an
engine runs it without this project.

One call, captured in one CUDA graph with what comes before it (tp > 1: the fastest all-reduce of
the run, as ``unfused-best``):

- finalize only: tile-kernels' MoE reduce ``moe.reduce_fused`` with the shared expert's output as
  one more route of weight 1 (the layout of engines that fuse the shared expert into the routed
  ones): one kernel and one bf16 rounding, as this library's contract. It needs H % 256 == 0; other
  sizes take the strong tail's MoE finalize.
- ``mhc_post`` (the post-mix; its ``comb`` is indexed [token, source, target], as here), then
  ``mhc_pre_apply_mix`` (the collapse with the carried pre): fp32 inside, one bf16 rounding each.
- the RMSNorm, which tile-kernels 1.0.0 does not have: the strong tail's norm pass
  (``strong_tail_kernels._norm_piece``, which for quant also writes the MXFP8 copy by FlashInfer's
  rules, as the strong tail does), one program a row or one a (row, piece), the faster timed, as
  the strong tail picks its forms by M.

tile_kernels is imported lazily, once per sweep, and only at hc = 4 (the one its docs guarantee).
Once per shape, before it is timed, ``TileKernelsCall.check`` compares one call's outputs with the
reference (``lamport_mhc.reference``), each stage on the inputs it was given, so a difference of
convention (comb transposed, post or pre on the wrong axis) shows as thousands of ulps.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
import triton.language as tl

from .collective import agree, attempt
from .strong_tail import StrongFinalize, _chunk, _launch
from .strong_tail_kernels import (_dependent_launch, _norm_piece, _parked_piece, _widen,
                                  _zero_scales_of_padded_row)

TILEKERNELS_HC = 4
NORM_FORMS = ("split", "row")
# The row form holds the whole row in registers: twice the warps, as the strong tail's held form.
ROW_WARPS, SPLIT_WARPS = 8, 4
REDUCE_FUSED_MULTIPLE = 256  # moe.reduce_fused asserts H % 256 == 0
CHECK_ROWS = 512  # rows compared at a time: the reference's fp64 temporaries stay small
# The agreement bound: one bf16 ulp of the larger value, plus what any fp32 evaluation order of a
# sum of at most 8 products can lose (under 8 * 2^-24 of the sum of the terms' magnitudes; the
# post-mix sums hc + 1 = 5, the finalize top-k + 1 = 7 at top-k 6: where a sum cancels far below its
# terms that is more than an ulp), plus a subnormal that a kernel flushed to zero.
TERMS_SLACK = 2.0 ** -20
SUBNORMAL_SLACK = 2.0 ** -126
INSTALL_HINT = "pip install 'lamport-mhc[tilekernels]'"


# -- tile-kernels, imported once ---------------------------------------------------------------------
@dataclass(frozen=True)
class TileKernelsAPI:
    """The functions of tile-kernels this path calls."""

    mhc_post: object
    mhc_pre_apply_mix: object
    reduce_fused: object


def tvm_ffi_mismatch() -> str | None:
    """Why importing TileLang here would abort the process, or None. Its libraries load the
    libtvm_ffi installed beside them; with another tvm_ffi already loaded (or first on sys.path) the
    import ends in a C++ terminate that no except clause sees."""
    tilelang = importlib.util.find_spec("tilelang")
    if tilelang is None or tilelang.origin is None:
        return None  # the import says what is missing
    beside = Path(tilelang.origin).parent.parent / "tvm_ffi"
    loaded = sys.modules.get("tvm_ffi")
    if getattr(loaded, "__file__", None):
        found = Path(loaded.__file__).parent
    else:
        spec = importlib.util.find_spec("tvm_ffi")
        if spec is None or spec.origin is None:
            return None
        found = Path(spec.origin).parent
    if found.resolve() == beside.resolve():
        return None
    return (f"TileLang links the apache-tvm-ffi installed beside it ({beside}) but Python's tvm_ffi is "
            f"{found}: together they abort the process; run this path in a process whose tvm_ffi is TileLang's")


def import_api() -> TileKernelsAPI:
    mismatch = tvm_ffi_mismatch()
    if mismatch is not None:
        raise ImportError(mismatch)
    from tile_kernels.modeling.mhc.ops import mhc_post, mhc_pre_apply_mix
    from tile_kernels.moe import reduce_fused

    return TileKernelsAPI(mhc_post, mhc_pre_apply_mix, reduce_fused)


class TileKernels:
    """Decides once per sweep whether tile-kernels can run (the same answer on every rank) and makes
    the path per hidden size."""

    def __init__(self, coll, hc: int, api_factory=import_api):
        self.coll, self.hc, self.api_factory = coll, hc, api_factory
        self.api: TileKernelsAPI | None = None
        self._reason: str | None = None
        self._decided = False

    def reason(self) -> str | None:
        """Why the path cannot run in this sweep, or None. The first call imports tile-kernels
        (collective: every rank must ask)."""
        if self.hc != TILEKERNELS_HC:
            return f"tile-kernels' mHC kernels are for hc = {TILEKERNELS_HC} only (hc = {self.hc} here)"
        if not self._decided:
            self._decided = True
            holder: dict = {}
            failed = agree(self.coll, attempt(lambda: holder.update(api=self.api_factory())))
            if failed is None:
                self.api = holder["api"]
            else:
                self._reason = f"tile-kernels cannot be imported ({failed}): {INSTALL_HINT}"
        return self._reason

    def tail(self, hidden: int, top_k: int, interpret: bool = False) -> TileKernelsTail:
        if self.reason() is not None:
            raise RuntimeError(f"tilekernels-tail cannot run here: {self.reason()}")
        return TileKernelsTail(self.api, hidden, top_k, interpret)


# -- the RMSNorm after the collapse ------------------------------------------------------------------
@triton.jit
def tail_norm_kernel(prenorm_ptr, weight_ptr, layer_ptr, values_ptr, scales_ptr, m, eps,
                     HIDDEN: tl.constexpr, CHUNK: tl.constexpr, QUANT: tl.constexpr, SCALE_COLS_P2: tl.constexpr,
                     SPLIT: tl.constexpr, INTERPRETED: tl.constexpr = False, PDL: tl.constexpr = False):
    """RMSNorm of the bf16 rows at ``prenorm_ptr`` into ``layer_ptr`` (QUANT: and the MXFP8 copy).
    ``SPLIT``: program (row, c) sums the whole row's squares (a row read from L2 at the small M it is
    for) and normalizes piece c; else one program a row, the row held in registers between passes.
    With QUANT the grid covers the padded rows up to a multiple of 128, whose scale bytes are zeroed."""
    PIECES: tl.constexpr = HIDDEN // CHUNK
    _dependent_launch(PDL)
    row = tl.program_id(0)
    if row < m:
        row64 = row.to(tl.int64)
        squares = tl.zeros([CHUNK // 32, 32], tl.float32)
        held = ()
        for c in tl.static_range(PIECES):
            bits = _parked_piece(prenorm_ptr, row64, c, HIDDEN, CHUNK)
            p = _widen(bits, INTERPRETED)
            squares += p * p
            held = held + (bits,)
        inv = tl.math.rsqrt(tl.sum(tl.sum(squares, axis=1), axis=0) / HIDDEN + eps)
        if SPLIT:
            c = tl.program_id(1)
            _norm_piece(layer_ptr, weight_ptr, values_ptr, scales_ptr, row64, c, inv,
                        _parked_piece(prenorm_ptr, row64, c, HIDDEN, CHUNK), HIDDEN, CHUNK, QUANT, INTERPRETED)
        else:
            for c in tl.static_range(PIECES):
                _norm_piece(layer_ptr, weight_ptr, values_ptr, scales_ptr, row64, c, inv, held[c], HIDDEN, CHUNK,
                            QUANT, INTERPRETED)
    elif QUANT:
        if tl.program_id(1) == 0:
            _zero_scales_of_padded_row(scales_ptr, row, HIDDEN, SCALE_COLS_P2)


class TailNorm:
    """Launches ``tail_norm_kernel`` in one ``form`` ("split" or "row") over caller-allocated outputs."""

    def __init__(self, hidden: int, quantize: bool, form: str, interpret: bool = False):
        if hidden % (128 if quantize else 32):
            raise ValueError(f"hidden must be a multiple of {128 if quantize else 32}, got {hidden}")
        if form not in NORM_FORMS:
            raise ValueError(f"form must be one of {NORM_FORMS}, got {form!r}")
        self.hidden, self.quantize, self.form, self.interpret = hidden, quantize, form, interpret
        self.chunk = _chunk(hidden)
        self.scale_cols_p2 = 1 << max(0, (hidden // 32 - 1).bit_length())

    def __call__(self, prenorm, weight, eps: float, layer_input, mxfp8=None) -> None:
        m = prenorm.shape[0]
        if (mxfp8 is not None) != self.quantize:
            raise ValueError("mxfp8 buffers are given exactly when the norm was built with quantize=True")
        if mxfp8 is None:
            values = scales = layer_input  # unused pointers
            rows = m
        else:
            values, scales = mxfp8
            values = values.view(torch.uint8) if self.interpret else values
            rows = -(-m // 128) * 128
        split = self.form == "split"
        grid = (rows, self.hidden // self.chunk) if split else (rows,)
        _launch(tail_norm_kernel, grid, self.interpret, SPLIT_WARPS if split else ROW_WARPS,
                prenorm, weight, layer_input, values, scales, m, eps, HIDDEN=self.hidden, CHUNK=self.chunk,
                QUANT=self.quantize, SCALE_COLS_P2=self.scale_cols_p2, SPLIT=split, INTERPRETED=self.interpret)


# -- the path ------------------------------------------------------------------------------------------
def shared_expert_as_route(gemm2, weights, indices, shared):
    """The finalize's inputs with the shared expert's output as route ``top_k`` of every token
    (weight 1, rows after the GEMM2 rows): ``(rows [held + M, H], weights [M, top_k + 1],
    indices [M, top_k + 1])``. Its weighted sum is ``acc + shared`` rounded once, the contract's."""
    m = shared.shape[0]
    slots = torch.arange(gemm2.shape[0], gemm2.shape[0] + m, dtype=indices.dtype, device=indices.device)
    return (torch.cat([gemm2, shared]), torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1),
            torch.cat([indices, slots.unsqueeze(1)], dim=1).contiguous())


class TileKernelsTail:
    """The path at one hidden size: which finalize runs, the norms per form; ``bind`` takes a shape's
    inputs."""

    def __init__(self, api: TileKernelsAPI, hidden: int, top_k: int, interpret: bool = False):
        self.api, self.hidden, self.interpret = api, hidden, interpret
        self.reduce_fused = hidden % REDUCE_FUSED_MULTIPLE == 0
        self.strong_finalize = None if self.reduce_fused else StrongFinalize(hidden, top_k, interpret=interpret)
        self._norms: dict[tuple, TailNorm] = {}

    def norm(self, quantize: bool, form: str) -> TailNorm:
        if (quantize, form) not in self._norms:
            self._norms[quantize, form] = TailNorm(self.hidden, quantize, form, self.interpret)
        return self._norms[quantize, form]

    def bind(self, x, consumer, finalize_inputs=None, mxfp8=None) -> TileKernelsCall:
        """A shape's inputs (``consumer``: residual, post, comb, pre, norm weight, eps; the finalize's
        when given) and the output buffers every call of it writes."""
        return TileKernelsCall(self, x, consumer, finalize_inputs, mxfp8)


class TileKernelsCall:
    """One shape of the sweep: ``contribution`` (x, or the MoE finalize of this rank), then
    ``tail(reduced, form)``; ``check`` compares what one call wrote with the reference."""

    def __init__(self, tail: TileKernelsTail, x, consumer, finalize_inputs, mxfp8):
        self.path = tail
        self.residual, self.post, self.comb, self.pre, self.weight, self.eps = consumer
        m, hc, hidden = self.residual.shape
        self.x, self.m, self.mxfp8, self.finalize_inputs = x, m, mxfp8, finalize_inputs
        # tile-kernels' layout: a batch axis in front, post and pre as [..., hc, 1]; views, no copies.
        self.post4 = self.post.reshape(1, m, hc, 1)
        self.pre3 = self.pre.reshape(m, hc, 1)
        self.residual_out = torch.empty_like(self.residual)
        self.prenorm = torch.empty_like(x)
        self.layer_input = torch.empty_like(x)
        self.norms = {form: tail.norm(mxfp8 is not None, form) for form in NORM_FORMS}
        self.contribution_out = torch.empty_like(x) if finalize_inputs is not None else None
        if finalize_inputs is not None and tail.reduce_fused:
            self.routes = shared_expert_as_route(*finalize_inputs)

    def contribution(self):
        if self.finalize_inputs is None:
            return self.x
        if self.path.reduce_fused:
            rows, weights, indices = self.routes
            return self.path.api.reduce_fused(rows, weights, indices, out=self.contribution_out)
        return self.path.strong_finalize(*self.finalize_inputs, self.contribution_out)

    def tail(self, reduced, form: str) -> None:
        api = self.path.api
        api.mhc_post(reduced.unsqueeze(0), self.residual.unsqueeze(0), self.post4, self.comb.unsqueeze(0),
                     out=self.residual_out.unsqueeze(0))
        api.mhc_pre_apply_mix(self.residual_out, self.pre3, out=self.prenorm)
        self.norms[form](self.prenorm, self.weight, self.eps, self.layer_input, self.mxfp8)

    def check(self, reduced) -> Agreement:
        """What the last call wrote against the reference, each stage on the inputs it was given
        (its own earlier outputs): the finalize, the post-mix, the collapse and the RMSNorm within
        ``agree_bf16``'s bound, the MXFP8 copy exactly (FlashInfer's rules on its own layer input)."""
        from .. import reference
        from ..mxfp8 import mxfp8_quantize_reference

        agreement = Agreement()
        for rows in _row_blocks(self.m):
            if self.finalize_inputs is not None:
                agreement.add("contribution", *_finalize_stage(self.finalize_inputs, rows, self.contribution_out))
            res, out = self.residual[rows], self.residual_out[rows]
            post = self.post.reshape(self.m, -1)[rows]
            agreement.add("residual_out", out, reference.post_mix(reduced[rows], res, post, self.comb[rows]),
                          _post_magnitude(reduced[rows], res, post, self.comb[rows]), rows.start)
            pre = self.pre[rows]
            agreement.add("prenorm", self.prenorm[rows], reference.pre_mix(out, pre),
                          (out.float().abs() * pre.abs().unsqueeze(-1)).sum(1), rows.start)
            agreement.add("layer_input", self.layer_input[rows],
                          reference.rms_norm(self.prenorm[rows], self.weight, self.eps), None, rows.start)
        if self.mxfp8 is not None:
            values, scales = mxfp8_quantize_reference(self.layer_input)
            agreement.exact("MXFP8 values", self.mxfp8[0].view(torch.uint8), values.view(torch.uint8))
            agreement.exact("MXFP8 scales", self.mxfp8[1], scales)
        return agreement


def _row_blocks(m: int):
    return [slice(start, min(m, start + CHECK_ROWS)) for start in range(0, m, CHECK_ROWS)]


def _finalize_stage(finalize_inputs, rows: slice, contribution):
    from .. import reference

    gemm2, weights, indices, shared = finalize_inputs
    weights, indices, shared = weights[rows], indices[rows], shared[rows]
    held = indices >= 0
    magnitude = shared.float().abs()
    for k in range(indices.shape[1]):
        picked = gemm2[indices[:, k].clamp(min=0).long()].float().abs()
        magnitude = magnitude + picked * torch.where(held[:, k], weights[:, k].abs(), 0.0).unsqueeze(1)
    expected = reference.finalize_contribution(gemm2, weights, indices, shared)
    return contribution[rows], expected, magnitude, rows.start


def _post_magnitude(reduced, residual, post, comb):
    """|x| |post[j]| + sum over s of |res[s]| |comb[s, j]|: [M, hc (target), H]."""
    magnitude = reduced.float().abs().unsqueeze(1) * post.abs().unsqueeze(-1)
    for s in range(residual.shape[1]):
        magnitude = magnitude + residual[:, s:s + 1].float().abs() * comb[:, s].abs().unsqueeze(-1)
    return magnitude


# -- agreement within bf16 rounding ----------------------------------------------------------------------
def _ordinal(values):
    """bf16 values as integers in value order (-0.0 and +0.0 both 0): neighbours differ by 1."""
    bits = values.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def _ulp(values):
    """The spacing of bf16 values at each value's magnitude (subnormals: the smallest)."""
    exponent = (values.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    return torch.exp2((exponent.clamp(min=1) - 134).float())


def agree_bf16(actual, expected, magnitude=None):
    """``(passed [same shape], ulps [same shape])``: ``passed`` where both are NaN, equal, or within
    one ulp of the larger plus ``TERMS_SLACK * magnitude`` (the sum of the terms' magnitudes that made
    the value; None: no cancellation) plus ``SUBNORMAL_SLACK``; ``ulps``: the distance in bf16 ulps
    (-1 where exactly one is NaN)."""
    a, e = actual.float(), expected.float()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    allowed = torch.maximum(_ulp(actual), _ulp(expected)) + SUBNORMAL_SLACK
    if magnitude is not None:
        allowed = allowed + TERMS_SLACK * magnitude
    close = (a == e) | (~nan_a & ~nan_e & ((a - e).abs() <= allowed))
    passed = (nan_a & nan_e) | close
    ulps = (_ordinal(actual) - _ordinal(expected)).abs()
    ulps = torch.where(nan_a & nan_e, 0, torch.where(nan_a | nan_e, -1, ulps))
    return passed, ulps


@dataclass
class Agreement:
    """The largest distance in bf16 ulps per output, and the first output off the bound."""

    worst: dict[str, int] = field(default_factory=dict)
    exact_outputs: list[str] = field(default_factory=list)
    failure: str | None = None

    def add(self, name: str, actual, expected, magnitude, first_row: int) -> None:
        passed, ulps = agree_bf16(actual, expected, magnitude)
        self.worst[name] = max(self.worst.get(name, 0), int(ulps.max()) if ulps.numel() else 0)
        if self.failure is None and not bool(passed.all()):
            index = tuple(int(i) for i in torch.nonzero(~passed)[0])
            distance = int(ulps[index])
            off = "a NaN against a number" if distance < 0 else f"{distance} ulps off"
            where = ", ".join(map(str, (index[0] + first_row,) + index[1:]))
            self.failure = (f"{name}[{where}] is {float(actual[index]):.6g}, the reference's "
                            f"{float(expected[index]):.6g} ({off})")

    def exact(self, name: str, actual, expected) -> None:
        differing = int((actual != expected).sum())
        if differing == 0:
            self.exact_outputs.append(name)
        elif self.failure is None:
            self.failure = f"{name}: {differing} bytes differ from the reference's"

    @staticmethod
    def merged(agreements) -> Agreement:
        """The largest distances over several passed checks, and the outputs checked exactly."""
        worst: dict[str, int] = {}
        for agreement in agreements:
            for name, ulps in agreement.worst.items():
                worst[name] = max(worst.get(name, 0), ulps)
        return Agreement(worst, sorted({name for a in agreements for name in a.exact_outputs}))

    def summary(self) -> str:
        text = ", ".join(f"{name} {ulps}" for name, ulps in self.worst.items())
        exact = f"; {' and '.join(self.exact_outputs)} exact" if self.exact_outputs else ""
        return f"largest distance in bf16 ulps: {text}{exact}"
