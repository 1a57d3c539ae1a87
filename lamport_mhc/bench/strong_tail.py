"""Launchers of the strong unfused kernels (``strong_tail_kernels``) over caller-allocated
outputs, on the GPU or, for tests, under the Triton interpreter on host tensors."""

from __future__ import annotations

import torch

from kernels_triton.launch_shape import set_launch_shape

from ..mxfp8 import mxfp8_scale_bytes


def _chunk(hidden: int, widest: int = 1024) -> int:
    """The widest power-of-two piece of at most ``widest`` columns that tiles the row exactly (no
    padding lanes: H = 5120 and 7168 run five and seven pieces of 1024)."""
    chunk = widest
    while hidden % chunk:
        chunk //= 2
    return chunk


def _launch(kernel, grid, interpret: bool, num_warps: int, *args, extra_shared: int = 0, max_registers: int = 0,
            pdl: bool = True, **constexprs) -> None:
    """On the GPU every kernel is a programmatic dependent launch (``PDL``), as the fused kernels are,
    unless ``pdl`` is off (as the fused kernels' ``use_pdl``); ``extra_shared``: bytes of dynamic
    shared memory past Triton's own (the looped form's parked row); ``max_registers``: ptxas's cap
    per thread (0: the compiler's choice)."""
    if interpret:
        from kernels_triton.interpret import launch_interpreted
        launch_interpreted(kernel, grid, *args, **constexprs)
        return
    options = dict(**constexprs, PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
    if max_registers:
        options["maxnreg"] = max_registers
    if extra_shared:  # the compiled kernel of this call's specialization, before it launches
        set_launch_shape(kernel.warmup(*args, grid=grid, **options), 1, extra_shared)
    kernel[grid](*args, **options)


STRATEGIES = ("row", "held", "split", "held-streamed", "split-streamed", "wide-streamed", "looped", "looped-streamed")
# The looped form: pieces of up to this many columns (8 a thread: 16-byte accesses), at most this
# many registers (4 warps: 8 programs per SM, as the fused kernels' parked forms). One H200, quant
# streamed, us at M = 1024 / 2048, pieces of 1024 against 2048 (8 warps) at H = 4096: 25.6 / 48.9
# against 24.1 / 47.9 (plain 21.9 / 45.0 against 22.0 / 44.1); 4096-wide pieces of 16 warps: 28.0 / 51.2.
LOOPED_MAX_CHUNK = 2048
LOOPED_MAX_REGISTERS = 64
# Its second pass loads the next piece's weights while normalizing one. One H200, quant M = 1024 /
# 2048, us with / without, streamed: H 5120 31.0 / 60.6 against 31.2 / 60.6, H 7168 43.5 / 86.2
# against 43.6 / 86.3; without the hints (which lose at M = 1024 and win at 2048): 31.6 / 59.4
# against 31.8 / 59.7, 44.8 / 82.6 against 44.9 / 83.0. Pieces of 512 (2 warps) lost, streamed: 33.6 / 63.4
# at H 5120, 61.5 / 102.4 at 7168.
# Its bf16 conversions take two values an instruction (``cvt.rn.bf16x2``, widened by a shift or a
# mask) and its fp8 clamp one ``min`` (the conversion saturates): 514 instructions a piece where it
# took 603 (H 7168 quant, sm_90a SASS). One H200, us at M = 1024 / 2048, after / before, streamed:
# H 7168 quant 41.8 / 85.5 against 43.3 / 86.8, H 5120 quant 30.1 / 59.6 against 31.2 / 60.6;
# unhinted 42.8 / 81.2 against 44.4 / 83.1 and 30.3 / 58.0 against 32.0 / 59.5; plain (streamed,
# M = 1024) H 7168 38.5 against 38.7, H 5120 27.2 against 27.7.
# It replaced the parked form (the row form with its prenorm in shared memory, its pieces unrolled:
# 96-115 registers, uncapped): one H200, streamed, us, looped / parked / held (the held form's 8
# warps), M = 1024 and 2048: H 7168 quant 43.5 / 45.3 / 46.9 and 86.5 / 89.7 / 92.3, plain 38.9 / 41.6
# / 41.3 and 78.8 / 85.1 / 82.4; H 5120 quant 31.0 / 32.6 / 31.3 and 61.2 / 64.0 / 61.7.
# The wide form's warps: the held form with pieces of 8 columns a thread (16-byte accesses), the last
# piece masked where it overhangs the row. On one H200 (streamed hints) the bench took it at
# M = 32-128 at H 4096 and 100-128 at 5120; 16 warps capped at 64 registers (2 programs per SM,
# spills) took 31.0 / 53.8 / 63.7 us at H 4096 / 5120 / 7168 quant M = 1024 against 29.0 / 43.1 / 50.5
# uncapped, 8 warps capped at 80 registers 25.7 / 35.7 / 54.3.
WIDE_WARPS = 16
# The held form's warps per program, against ``num_warps`` for the others: on one H200 (H = 5120,
# plain, prenorm held) 8 warps took 29.9 us at M = 1024 and 107.0 at 4096, 4 warps 34.7 and 120.1,
# the row form parking in shared memory 33.3 and 114.8. Slower than the held form at M = 1024 / 4096
# (every H, plain and quant): a persistent kernel that Triton software-pipelines (cp.async of the
# next pieces into shared memory), by 4-16%; 16 warps, by 9-26%. Register caps (ptxas maxnreg) spill
# the held form (4 warps at 96 registers: 76 / 264 bytes at H 5120 / 7168; 34.8 / 53.9 us at quant
# M = 1024 against 31.3 / 46.8 uncapped with 8 warps). The mix written source-outer (each stream
# widened once and folded into every target's sum) was slower: H 7168 quant M = 1024 held-streamed
# 60.2 against 46.6 us.
HELD_WARPS_FACTOR = 2
# The MXFP8 scales are converted to a store's layout through shared memory (two barriers a piece).
# Stored in place from the threads that computed them (one st.global.b8 each) they lost, one H200,
# us in place / converted: held-streamed H = 4096 M = 1024 / 2048 26.3 / 25.9, 50.2 / 49.6, H = 5120
# 32.3 / 31.2, 62.3 / 61.5; looped H 4096 / 5120 / 7168 M = 1024 25.7 / 25.2, 31.7 / 31.0, 44.6 /
# 43.5. Gathered into 4-byte words by warp shuffles and stored by one lane of 16 they lost too, by
# 1-4% (held-streamed H 5120 M = 1024 32.6 us against 31.4).


class StrongTail:
    """post-mix, collapse, RMSNorm (and with ``quantize`` the MXFP8 copy) of ``hidden``-wide rows
    with ``hc`` streams. ``strategy`` "row": one program per token, one kernel; "held": the same
    with the prenorm row in registers between the passes; "split": one program per (token,
    1024-wide piece), two kernels (the mix, then the norm over the row's partial sums of squares),
    for M too small to fill the GPU with rows; "looped": one program per token walking its row in a
    loop, the next piece's loads in flight, in 64 registers; "-streamed": with cache hints for what
    passes once. ``pdl``: the kernels are programmatic dependent launches (off: plain launches)."""

    def __init__(self, hidden: int, hc: int, quantize: bool = False, interpret: bool = False, num_warps: int = 4,
                 strategy: str = "row", pdl: bool = True):
        if hc not in (1, 2, 4):
            raise ValueError(f"the strong tail is written for hc in 1, 2, 4, got {hc}")
        if hidden % (128 if quantize else 32):
            raise ValueError(f"hidden must be a multiple of {128 if quantize else 32}"
                             f"{' (whole MXFP8 scale tiles)' if quantize else ''}, got {hidden}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.hidden, self.hc, self.quantize, self.interpret, self.num_warps = hidden, hc, quantize, interpret, num_warps
        self.pdl = pdl
        self.form, _, hints = strategy.partition("-")
        self.streamed = hints == "streamed"
        self.chunk = _chunk(hidden)
        self.pieces = hidden // self.chunk
        self.warps = num_warps * (HELD_WARPS_FACTOR if self.form == "held" else 1)  # the row forms' warps
        if self.form == "wide":
            self.warps, self.chunk = WIDE_WARPS, 8 * 32 * WIDE_WARPS
        if self.form == "looped":
            self.chunk = _chunk(hidden, LOOPED_MAX_CHUNK)
            self.warps = max(1, self.chunk // (8 * 32))
        # The looped form parks its prenorm in shared memory on the GPU, in the layer-input buffer
        # under the interpreter.
        self.parked_bytes = 2 * hidden if self.form == "looped" and not interpret else 0
        self.scale_cols_p2 = 1 << max(0, (hidden // 32 - 1).bit_length())

    def kernels(self) -> list[tuple[object, int, dict, int]]:
        """(kernel, warps, constexprs, register cap; 0: the compiler's) of each kernel a call
        launches, in order (the split form: the mix, then the norm)."""
        from .strong_tail_kernels import looped_tail_kernel, strong_tail_kernel, tail_mix_kernel, tail_norm_kernel

        row = dict(HIDDEN=self.hidden, HC=self.hc, CHUNK=self.chunk, QUANT=self.quantize,
                   SCALE_COLS_P2=self.scale_cols_p2, STREAMED=self.streamed, INTERPRETED=self.interpret)
        if self.form == "looped":
            return [(looped_tail_kernel, self.warps, dict(row, PARKED_BYTES=self.parked_bytes, NUM_WARPS=self.warps),
                     LOOPED_MAX_REGISTERS)]
        if self.form in ("row", "held", "wide"):
            return [(strong_tail_kernel, self.warps, dict(row, HOLD=self.form in ("held", "wide")), 0)]
        return [(tail_mix_kernel, self.num_warps,
                 dict(HIDDEN=self.hidden, HC=self.hc, CHUNK=self.chunk, STREAMED=self.streamed), 0),
                (tail_norm_kernel, self.num_warps,
                 dict(HIDDEN=self.hidden, CHUNK=self.chunk, QUANT=self.quantize,
                      PIECES_P2=1 << max(0, (self.pieces - 1).bit_length()), INTERPRETED=self.interpret), 0)]

    def __call__(self, reduced, residual, post, comb, pre, weight, eps, residual_out, layer_input, mxfp8=None):
        m = reduced.shape[0]
        if (mxfp8 is not None) != self.quantize:
            raise ValueError("mxfp8 buffers are given exactly when the tail was built with quantize=True")
        if mxfp8 is not None:
            values, scales = mxfp8
            if scales.numel() != mxfp8_scale_bytes(m, self.hidden):
                raise ValueError(f"scales must hold mxfp8_scale_bytes({m}, {self.hidden}) bytes, got {scales.numel()}")
            if self.interpret:
                values = values.view(torch.uint8)
            rows = -(-m // 128) * 128  # padded rows zero their scale bytes
        else:
            values = scales = layer_input  # unused pointers
            rows = m
        launches = self.kernels()
        if self.form in ("looped", "row", "held", "wide"):
            (kernel, warps, constexprs, max_registers), = launches
            _launch(kernel, (rows,), self.interpret, warps,
                    reduced, residual, post, comb, pre, weight, residual_out, layer_input, values, scales, m, eps,
                    extra_shared=self.parked_bytes, max_registers=max_registers, pdl=self.pdl, **constexprs)
            return
        (mix, mix_warps, mix_constexprs, _), (norm, norm_warps, norm_constexprs, _) = launches
        partial = torch.empty(m * self.pieces, dtype=torch.float32, device=reduced.device)
        _launch(mix, (m, self.pieces), self.interpret, mix_warps,
                reduced, residual, post, comb, pre, residual_out, layer_input, partial, pdl=self.pdl, **mix_constexprs)
        _launch(norm, (rows, self.pieces), self.interpret, norm_warps,
                layer_input, weight, partial, values, scales, m, eps, pdl=self.pdl, **norm_constexprs)

    def compile_offline(self, arch: str = "sm_90a") -> dict[str, str]:
        """PTX of each kernel a call launches on the GPU (PDL as ``_launch`` runs them), keyed
        ``strong_{strategy}_{plain|quant}`` (the split form: ``_mix`` and ``_norm``), for comparing
        what each side runs without a GPU (``python -m lamport_mhc ptx --strong``)."""
        from kernels_triton.offline import compile_kernel

        if self.interpret:
            raise ValueError("compile a tail built for the GPU (interpret=False)")
        variant = "quant" if self.quantize else "plain"
        strategy = self.form + ("-streamed" if self.streamed else "")
        types = dict(reduced_ptr="*bf16", residual_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", pre_ptr="*fp32",
                     weight_ptr="*bf16", residual_out_ptr="*bf16", layer_ptr="*bf16", partial_ptr="*fp32",
                     values_ptr="*fp8e4nv" if self.quantize else "*bf16",
                     scales_ptr="*u8" if self.quantize else "*bf16",
                     m="i32", eps="fp32")
        launches = self.kernels()
        ptx = {}
        for kernel, warps, constexprs, max_registers in launches:
            suffix = "" if len(launches) == 1 else "_mix" if kernel is launches[0][0] else "_norm"
            signature = {arg: types[arg] for arg in kernel.arg_names if arg in types}
            options = dict(num_warps=warps, **({"maxnreg": max_registers} if max_registers else {}))
            ptx[f"strong_{strategy.replace('-', '_')}_{variant}{suffix}"] = compile_kernel(
                kernel, signature, dict(constexprs, PDL=self.pdl), options, arch, launch_pdl=self.pdl)
        return ptx


class StrongFinalize:
    """The MoE finalize as engines' finalize kernels do it: per token the top-k weighted sum of the
    permuted GEMM2 rows (-1: not held here, not read) plus the shared expert, into ``out``; ``pdl`` as
    ``StrongTail``'s."""

    def __init__(self, hidden: int, top_k: int, interpret: bool = False, num_warps: int = 4, pdl: bool = True):
        if hidden % 32:
            raise ValueError(f"hidden must be a multiple of 32, got {hidden}")
        self.hidden, self.top_k, self.interpret, self.num_warps, self.pdl = hidden, top_k, interpret, num_warps, pdl
        self.chunk = _chunk(hidden)

    def __call__(self, gemm2, weights, indices, shared, out) -> torch.Tensor:
        from .strong_tail_kernels import moe_finalize_kernel

        if indices.shape[-1] != self.top_k or weights.shape != indices.shape:
            raise ValueError(f"weights and indices must be [M, {self.top_k}], got {list(weights.shape)} and "
                             f"{list(indices.shape)}")
        m = indices.shape[0]
        _launch(moe_finalize_kernel, (m, self.hidden // self.chunk), self.interpret, self.num_warps,
                gemm2, weights, indices, shared, out, pdl=self.pdl, HIDDEN=self.hidden, TOP_K=self.top_k,
                CHUNK=self.chunk)
        return out
