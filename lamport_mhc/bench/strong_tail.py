"""Launchers of the strong unfused kernels (``strong_tail_kernels``) over caller-allocated
outputs, on the GPU or, for tests, under the Triton interpreter on host tensors."""

from __future__ import annotations

import torch

from kernels_triton.launch_shape import set_launch_shape

from ..mxfp8 import mxfp8_scale_bytes


def _chunk(hidden: int) -> int:
    """The widest power-of-two piece of at most 1024 columns that tiles the row exactly (no padding
    lanes: H = 5120 and 7168 run five and seven pieces of 1024)."""
    chunk = 1024
    while hidden % chunk:
        chunk //= 2
    return chunk


def _launch(kernel, grid, interpret: bool, num_warps: int, *args, extra_shared: int = 0, **constexprs) -> None:
    """On the GPU every kernel is a programmatic dependent launch (``PDL``), as the fused kernels are;
    ``extra_shared``: bytes of dynamic shared memory past Triton's own (the parked form's row)."""
    if interpret:
        from kernels_triton.interpret import launch_interpreted
        launch_interpreted(kernel, grid, *args, **constexprs)
        return
    options = dict(**constexprs, PDL=True, num_warps=num_warps, launch_pdl=True)
    if extra_shared:  # the compiled kernel of this call's specialization, before it launches
        set_launch_shape(kernel.warmup(*args, grid=grid, **options), 1, extra_shared)
    kernel[grid](*args, **options)


STRATEGIES = ("row", "held", "split", "held-streamed", "split-streamed", "wide-streamed", "parked-streamed")
# The wide form's warps: the held form with pieces of 8 columns a thread (16-byte accesses), the last
# piece masked where it overhangs the row. On one H200 (streamed hints) the bench took it at
# M = 32-128 at H 4096 and 100-128 at 5120; 16 warps capped at 64 registers (2 programs per SM,
# spills) took 31.0 / 53.8 / 63.7 us at H 4096 / 5120 / 7168 quant M = 1024 against 29.0 / 43.1 / 50.5
# uncapped, 8 warps capped at 80 registers 25.7 / 35.7 / 54.3.
WIDE_WARPS = 16
# The held form's warps per program, against ``num_warps`` for the others: on one H200 (H = 5120,
# plain, prenorm held) 8 warps took 29.9 us at M = 1024 and 107.0 at 4096, 4 warps 34.7 and 120.1,
# the parked row form 33.3 and 114.8. With the streaming hints the held form took 28.5 us at
# M = 1024 (23.3 against 25.0 at H = 4096, 42.3 against 44.4 at 7168) but 111.1 at 4096. Slower
# than the held form at M = 1024 / 4096 (every H, plain and quant): a persistent kernel that Triton
# software-pipelines (cp.async of the next pieces into shared memory, the row parked), by 4-16%; 16
# warps, by 9-26%. Issuing the next piece's loads before this piece's mix changed nothing. The parked
# form in pieces of 2048 with 8 warps (as the fused kernels' wide twins) took 23.0 / 45.0 us at
# H 4096 plain M = 1024 / 2048 (the rows' forms 23.0 / 44.6) and 29.8 / 63.4 quant (25.6 / 49.4).
# Register caps as the fused kernels' (ptxas maxnreg) spill here (ptxas, quant streamed: the held
# form with 4 warps at 96 registers 76 / 264 bytes at H 5120 / 7168, the parked form at 64 registers
# 660 bytes at H 4096, uncapped 96): they took 34.8 / 53.9 us at H 5120 / 7168 quant M = 1024 (the
# held form's 8 warps uncapped: 31.3 / 46.8) and 45.7 at H 4096 (uncapped: 26.7).
# The mix written source-outer (each stream widened once and folded into every target's sum: 94-96
# registers instead of 109-114 for the parked form) was slower on one H200: H 7168 quant M = 1024
# held-streamed 60.2 against 46.6 us, parked-streamed 53.4 against 45.2. With that mix, the parked
# form walking its pieces in loops, each piece's inputs loaded while the one before is mixed, at 80
# registers (64 spill 132-140 bytes) took 48.8 / 88.6 us at M = 1024 / 2048 (parked-streamed 45.2 / 89.7).
HELD_WARPS_FACTOR = 2
# Which forms store the MXFP8 scales from the threads that computed them (``ptx.store_byte``) instead
# of converting them to a store's layout through shared memory (two barriers a piece). One H200,
# quant, held-streamed, us in place / converted: H = 4096 M = 1024 / 2048 26.3 / 25.9, 50.2 / 49.6;
# H = 5120 32.3 / 31.2, 62.3 / 61.5. The parked form stores in place (as in the bench run where it
# was the fastest at H = 7168, M = 512-2048). Scales gathered into 4-byte words by warp shuffles and
# stored by one lane of 16 lost to both: 1-4% (held-streamed H 5120 M = 1024 32.6 us, parked H 7168
# 45.8, against 31.4 and 45.3).
SCALES_IN_PLACE_FORMS = ("parked",)


class StrongTail:
    """post-mix, collapse, RMSNorm (and with ``quantize`` the MXFP8 copy) of ``hidden``-wide rows
    with ``hc`` streams. ``strategy`` "row": one program per token, one kernel; "held": the same
    with the prenorm row in registers between the passes; "split": one program per (token,
    1024-wide piece), two kernels (the mix, then the norm over the row's partial sums of squares),
    for M too small to fill the GPU with rows; "-streamed": with cache hints for what passes once."""

    def __init__(self, hidden: int, hc: int, quantize: bool = False, interpret: bool = False, num_warps: int = 4,
                 strategy: str = "row"):
        if hc not in (1, 2, 4):
            raise ValueError(f"the strong tail is written for hc in 1, 2, 4, got {hc}")
        if hidden % (128 if quantize else 32):
            raise ValueError(f"hidden must be a multiple of {128 if quantize else 32}"
                             f"{' (whole MXFP8 scale tiles)' if quantize else ''}, got {hidden}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.hidden, self.hc, self.quantize, self.interpret, self.num_warps = hidden, hc, quantize, interpret, num_warps
        self.form, _, hints = strategy.partition("-")
        self.streamed = hints == "streamed"
        self.chunk = _chunk(hidden)
        self.pieces = hidden // self.chunk
        self.warps = num_warps * (HELD_WARPS_FACTOR if self.form == "held" else 1)  # the row forms' warps
        if self.form == "wide":
            self.warps, self.chunk = WIDE_WARPS, 8 * 32 * WIDE_WARPS
        # The parked form: the row form with its prenorm in shared memory (on the GPU), not in the
        # layer-input buffer.
        self.parked_bytes = 2 * hidden if self.form == "parked" and not interpret else 0
        self.scale_cols_p2 = 1 << max(0, (hidden // 32 - 1).bit_length())
        self.scales_in_place = self.form in SCALES_IN_PLACE_FORMS

    def __call__(self, reduced, residual, post, comb, pre, weight, eps, residual_out, layer_input, mxfp8=None):
        from .strong_tail_kernels import strong_tail_kernel, tail_mix_kernel, tail_norm_kernel

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
        if self.form in ("row", "held", "wide", "parked"):
            hold = self.form in ("held", "wide")
            _launch(strong_tail_kernel, (rows,), self.interpret, self.warps,
                    reduced, residual, post, comb, pre, weight, residual_out, layer_input, values, scales, m, eps,
                    HIDDEN=self.hidden, HC=self.hc, CHUNK=self.chunk, QUANT=self.quantize,
                    SCALE_COLS_P2=self.scale_cols_p2, HOLD=hold, STREAMED=self.streamed, INTERPRETED=self.interpret,
                    PARKED_BYTES=self.parked_bytes, SCALES_IN_PLACE=self.scales_in_place, extra_shared=self.parked_bytes)
            return
        partial = torch.empty(m * self.pieces, dtype=torch.float32, device=reduced.device)
        _launch(tail_mix_kernel, (m, self.pieces), self.interpret, self.num_warps,
                reduced, residual, post, comb, pre, residual_out, layer_input, partial,
                HIDDEN=self.hidden, HC=self.hc, CHUNK=self.chunk, STREAMED=self.streamed)
        _launch(tail_norm_kernel, (rows, self.pieces), self.interpret, self.num_warps,
                layer_input, weight, partial, values, scales, m, eps, HIDDEN=self.hidden, CHUNK=self.chunk,
                QUANT=self.quantize, PIECES_P2=1 << max(0, (self.pieces - 1).bit_length()),
                INTERPRETED=self.interpret)


class StrongFinalize:
    """The MoE finalize as engines' finalize kernels do it: per token the top-k weighted sum of the
    permuted GEMM2 rows (-1: not held here, not read) plus the shared expert, into ``out``."""

    def __init__(self, hidden: int, top_k: int, interpret: bool = False, num_warps: int = 4):
        if hidden % 32:
            raise ValueError(f"hidden must be a multiple of 32, got {hidden}")
        self.hidden, self.top_k, self.interpret, self.num_warps = hidden, top_k, interpret, num_warps
        self.chunk = _chunk(hidden)

    def __call__(self, gemm2, weights, indices, shared, out) -> torch.Tensor:
        from .strong_tail_kernels import moe_finalize_kernel

        if indices.shape[-1] != self.top_k or weights.shape != indices.shape:
            raise ValueError(f"weights and indices must be [M, {self.top_k}], got {list(weights.shape)} and "
                             f"{list(indices.shape)}")
        m = indices.shape[0]
        _launch(moe_finalize_kernel, (m, self.hidden // self.chunk), self.interpret, self.num_warps,
                gemm2, weights, indices, shared, out, HIDDEN=self.hidden, TOP_K=self.top_k, CHUNK=self.chunk)
        return out
