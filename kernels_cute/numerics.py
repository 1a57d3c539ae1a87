"""The bit contract's bf16 handling on integer bits, as in ``kernels_triton.numerics``.

A 16-byte fragment is four 32-bit words, bf16 ``2i`` in the low half of word ``i``. bf16 -> fp32 is
exact (a shift, or a mask); fp32 -> bf16 is ``primitives.bf16x2_rn``, two lanes a word (every NaN
becomes 0x7FC0); -0.0 (0x8000, the Lamport sentinel) becomes +0.0 before a value is published.
Integer operations are exact whatever the compiler does with them; fp32 arithmetic lives in
``primitives`` as explicit ``.rn`` instructions.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from lamport_mhc import layout

SENTINEL_BITS = layout.SENTINEL_INT16 & 0xFFFF  # 0x8000, bf16 -0.0
LANES = 8   # bf16 per 16-byte fragment
WORDS = 4   # 32-bit words per fragment


@dsl_user_op
def as_f32(bits: Uint32, *, loc=None, ip=None) -> Float32:
    """The fp32 whose bit pattern is ``bits``."""
    return Float32(llvm.bitcast(T.f32(), Uint32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@cute.jit
def select(condition: Boolean, if_true: Uint32, if_false: Uint32) -> Uint32:
    return Uint32(cutlass.select_(condition, Uint32(if_true), Uint32(if_false)))


@cute.jit
def low_f32(word: Uint32) -> Float32:
    """Exact fp32 of the bf16 in the low half of ``word``."""
    return as_f32(word << Uint32(16))


@cute.jit
def high_f32(word: Uint32) -> Float32:
    """Exact fp32 of the bf16 in the high half of ``word``."""
    return as_f32(word & Uint32(0xFFFF0000))


@cute.jit
def canonical_zero(bits: Uint32) -> Uint32:
    """-0.0 -> +0.0 on bf16 bits (low 16 bits), so a published value never equals the sentinel."""
    return select(bits == Uint32(SENTINEL_BITS), Uint32(0), bits)


@cute.jit
def pack(low: Uint32, high: Uint32) -> Uint32:
    """One word of two 16-bit patterns (bf16, or a pair of e4m3 codes), each in the low 16 bits of
    its argument."""
    return low | (high << Uint32(16))


@cute.jit
def canonical_zero_word(word: Uint32) -> Uint32:
    """``canonical_zero`` of both bf16 halves of a word."""
    return pack(canonical_zero(word & Uint32(0xFFFF)), canonical_zero(word >> Uint32(16)))


@cute.jit
def word_has_sentinel(word: Uint32) -> Boolean:
    """Whether either half of ``word`` is the sentinel (compared as bits, never as floats)."""
    return ((word & Uint32(0xFFFF)) == Uint32(SENTINEL_BITS)) | ((word >> Uint32(16)) == Uint32(SENTINEL_BITS))


@cute.jit
def fragment_has_sentinel(w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32) -> Boolean:
    """Whether any of the 8 lanes of a fragment still holds the sentinel: the slot is not written yet."""
    return word_has_sentinel(w0) | word_has_sentinel(w1) | word_has_sentinel(w2) | word_has_sentinel(w3)
