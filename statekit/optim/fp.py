"""Floating-point primitives the replicas need beyond ``+ - * /``: exact FMA, ``powi``, f32 scalars.

* :func:`fma32` is a float32 fused multiply-add with a single rounding, emulated exactly in
  float64 (numpy has no FMA; torch's CPU kernels contract ``a*b + c`` into one), written
  against a :class:`~statekit.optim.backend.Backend` (which has a faster numpy path using the
  same tie test, :meth:`~statekit.optim.backend.Backend.fma32`).
* :func:`powi` is Rust's ``powi`` (compiler-builtins ``__powisf2``/``__powidf2``): repeated
  squaring with every product rounded in the given precision, as burn (f32) and candle (f64)
  compute ``beta.powi(t)``.
* :func:`fma64` is a float64 FMA on Python floats (C++ ``a*b + c`` compiled with contraction,
  as in the scalar set-up of torch's fused kernels).
* :func:`f32` rounds a Python float to the nearest float32 and returns it as a Python float, so
  that a constant is exactly representable on every namespace.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

#: The 29 float64 significand bits below float32's last place, and their pattern at a tie.
LOW29 = (1 << 29) - 1
TIE29 = 1 << 28
#: float64 magnitudes (as bit patterns) below this lie under float32's normal range, 2**-126.
F32_NORMAL_MIN_BITS = 0x3810000000000000
ABS = 0x7FFFFFFFFFFFFFFF


def f32(x: float) -> float:
    """``x`` rounded to float32 (round to nearest even), as a Python float."""
    return float(np.float32(x))


def fma64(a: float, b: float, c: float) -> float:
    """``a*b + c`` with a single rounding to float64 (exact rational arithmetic, then one division)."""
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def powi(base: float, exp: int, dtype=np.float32) -> float:
    """Rust's ``base.powi(exp)`` in ``dtype`` (float32 for burn, float64 for candle).

    compiler-builtins' algorithm: walk the exponent's bits from the lowest, multiplying the
    result by the running square for each set bit; each product is rounded in ``dtype``.
    Negative exponents take the reciprocal at the end.
    """
    a = dtype(base)
    n = abs(int(exp))
    result = dtype(1.0)
    while True:
        if n & 1:
            result = dtype(result * a)
        n >>= 1
        if n == 0:
            break
        a = dtype(a * a)
    if exp < 0:
        result = dtype(dtype(1.0) / result)
    return float(result)


def fma32(b, x, y, z):
    """``x*y + z`` for float32 operands, rounded once to float32 (what a hardware FMA returns).

    ``x*y`` is exact in float64 (24 + 24 significant bits <= 53). ``s = x*y + z`` in float64 is
    then rounded once more, and rounding ``s`` to float32 gives the correctly rounded result
    unless ``s`` sits exactly on a float32 rounding boundary (a tie) after an inexact addition:
    double rounding can only go wrong there. Such ties are detected from ``s``'s bit pattern
    (the 29 bits below float32's last place read ``1000…0``; results under float32's normal
    range are all treated as candidates). Only when a block has a candidate is the exact error
    of the addition computed (Knuth's TwoSum) and ``s`` nudged one float64 ulp towards the exact
    value (rounding to odd), which makes the final rounding exact. Any operand may be a scalar.
    """
    p = b.f64(x) * b.f64(y)
    zz = b.f64(z)
    s = p + zz
    bits = b.bits64(s)
    magnitude = bits & ABS
    # s == 0 needs no check: a float64 sum is zero only when it is exact.
    candidate = ((bits & LOW29) == TIE29) | ((magnitude < F32_NORMAL_MIN_BITS) & (magnitude != 0))
    if b.any(candidate):
        s = _round_to_odd(b, s, p, zz, candidate)
    return b.f32(s)


def _round_to_odd(b, s, p, z, candidate):
    """``s = p + z`` (float64, round to nearest) adjusted to round-to-odd where ``candidate``."""
    zv = s - p
    err = (p - (s - zv)) + (z - zv)  # TwoSum: p + z == s + err exactly
    bits = b.bits64(s)
    even = (bits & 1) == 0
    fix = candidate & (err != 0) & even
    # s is even and inexact: step to the odd neighbour on the side of the exact sum.
    away = (err > 0) == (s > 0)
    moved = b.where(away, bits + 1, bits - 1)
    return b.from_bits64(b.where(fix, moved, bits))
