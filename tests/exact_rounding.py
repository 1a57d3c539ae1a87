"""Exact round-to-nearest-even of a rational, the independent oracle the contract tests check the
bit-level helpers and the reference against."""

from fractions import Fraction

INF = float("inf")


def round_to_nearest_even(q: Fraction, mant_bits: int) -> Fraction | float:
    """RNE of an exact rational to a binary format with fp32's exponent range and ``mant_bits``
    fraction bits (23: fp32, 7: bf16). Returns the exact rounded value, or +-inf as a float."""
    if q == 0:
        return q
    neg = q < 0
    a = -q if neg else q
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    quantum = Fraction(2) ** (max(e, -126) - mant_bits)
    n = a / quantum
    fl = n.numerator // n.denominator
    rem = n - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    v = fl * quantum
    if v >= Fraction(2) ** 128:
        return -INF if neg else INF
    return -v if neg else v
