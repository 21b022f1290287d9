"""torch's Adafactor (for-loop and foreach) without torch, compiled (numba): the reference's
bits (:mod:`statekit.optim.adafactor` with :class:`~statekit.optim.tensorwise.TorchOps`' numpy
reductions) in four passes over memory instead of some fifteen.

The reference's reductions are float64 sums of exact float32 squares, in numpy's order: a sum
over a whole tensor or along its last axis is numpy's pairwise summation (blocks of at most 128
elements on eight accumulators, halves split at multiples of 8: :func:`_pairwise_sq`), a sum over
the next-to-last axis runs down the rows in order. These kernels sum in exactly those orders (:func:`_pairwise_sq`; a
whole-tensor sum splits at the same halves, its leaves on numba's threads, combined in the same
tree), so every bit agrees; the element-wise parts are the reference's float32 operations (its
lerp's FMA as ``fma32``). The small factored moments (a row and a column per matrix) are
updated with the reference's own numpy code.

Imported only when a numba kernel runs (the ``statekit[fast]`` extra).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from statekit.optim.backend import Backend
from statekit.optim.common import lerp
from statekit.optim.fp import f32
from statekit.optim.numba_base import fma32

F = np.float32
F32_EPS = float(np.finfo(np.float32).eps)
OPTIONS = dict(cache=True, error_model="numpy")
_NP = Backend(np)
#: elements per leaf of a whole-tensor sum run on one thread (the tree above them is numpy's)
LEAF = 1 << 16


@njit(inline="always")
def _sq(x):
    v = np.float64(x)
    return v * v


@njit(**OPTIONS)
def _block_sq(a, lo, n):
    """numpy's pairwise sum of at most 128 float64 squares: below 8 one by one, else eight
    accumulators, combined as ((0+1)+(2+3))+((4+5)+(6+7)), then the rest one by one."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += _sq(a[i])
        return res
    r0, r1, r2, r3 = _sq(a[lo]), _sq(a[lo + 1]), _sq(a[lo + 2]), _sq(a[lo + 3])
    r4, r5, r6, r7 = _sq(a[lo + 4]), _sq(a[lo + 5]), _sq(a[lo + 6]), _sq(a[lo + 7])
    i = 8
    end = n - (n % 8)
    while i < end:
        j = lo + i
        r0 += _sq(a[j])
        r1 += _sq(a[j + 1])
        r2 += _sq(a[j + 2])
        r3 += _sq(a[j + 3])
        r4 += _sq(a[j + 4])
        r5 += _sq(a[j + 5])
        r6 += _sq(a[j + 6])
        r7 += _sq(a[j + 7])
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += _sq(a[lo + i])
        i += 1
    return res


@njit(**OPTIONS)
def _pairwise_sq(a, lo, n):
    """numpy's pairwise sum (``np.add.reduce``) of the float64 squares of float32 ``a[lo:lo + n]``:
    blocks of at most 128 (:func:`_block_sq`), longer runs halved at a multiple of 8 and the two
    halves' sums added. Walked with an explicit stack (numba's cache cannot reload a recursive
    function)."""
    if n <= 128:
        return _block_sq(a, lo, n)
    los = np.empty(64, np.int64)
    ns = np.empty(64, np.int64)
    stage = np.empty(64, np.int64)
    values = np.empty(64, np.float64)
    top, count = 0, 0
    los[0], ns[0], stage[0] = lo, n, 0
    while top >= 0:
        size = ns[top]
        if size <= 128:
            values[count] = _block_sq(a, los[top], size)
            count += 1
            top -= 1
            continue
        half = size // 2
        half -= half % 8
        if stage[top] == 0:  # the left half next
            stage[top] = 1
            los[top + 1], ns[top + 1], stage[top + 1] = los[top], half, 0
            top += 1
        elif stage[top] == 1:  # then the right half
            stage[top] = 2
            los[top + 1], ns[top + 1], stage[top + 1] = los[top] + half, size - half, 0
            top += 1
        else:  # both done: left + right
            count -= 1
            values[count - 1] = values[count - 1] + values[count]
            top -= 1
    return values[0]


@njit(parallel=True, **OPTIONS)
def _leaf_sums(a, starts, sizes, out):
    for k in prange(starts.shape[0]):
        out[k] = _pairwise_sq(a, starts[k], sizes[k])


def _split(lo: int, n: int) -> list:
    """numpy's pairwise tree over ``[lo, lo + n)`` down to :data:`LEAF`: a leaf ``(lo, n)`` or a pair."""
    if n <= max(LEAF, 128):
        return [lo, n]
    n2 = n // 2
    n2 -= n2 % 8
    return [_split(lo, n2), _split(lo + n2, n - n2)]


def _leaves(tree, out: list) -> None:
    if isinstance(tree[0], int):
        out.append(tree)
    else:
        _leaves(tree[0], out)
        _leaves(tree[1], out)


def _combine(tree, sums) -> float:
    if isinstance(tree[0], int):
        return float(next(sums))
    left = _combine(tree[0], sums)
    return left + _combine(tree[1], sums)


def sum_of_squares(a: np.ndarray) -> float:
    """``np.sum(np.square(a, dtype=np.float64))`` of a flat float32 array, bit for bit, its
    leaves on numba's threads."""
    n = a.shape[0]
    tree = _split(0, n)
    leaves: list = []
    _leaves(tree, leaves)
    starts = np.array([lo for lo, _ in leaves], np.int64)
    sizes = np.array([size for _, size in leaves], np.int64)
    out = np.empty(len(leaves), np.float64)
    _leaf_sums(a, starts, sizes, out)
    return _combine(tree, iter(out))


def norm(a: np.ndarray) -> float:
    """:meth:`TorchOps.norm` without torch: ``float(f32(sqrt(sum of float64 squares)))``."""
    return float(np.float32(np.sqrt(sum_of_squares(a.reshape(-1)))))


@njit(parallel=True, **OPTIONS)
def _row_sums(g, out):
    """Per row of a [rows, m] float32 array: the pairwise float64 sum of its squares."""
    for r in prange(g.shape[0]):
        out[r] = _pairwise_sq(g[r], 0, g.shape[1])


@njit(parallel=True, **OPTIONS)
def _col_sums(g, out):
    """Per (batch, column) of a [batch, n, m] float32 array: its squares summed down the rows in order."""
    batch, n, m = g.shape
    chunk = 256
    for task in prange(batch * ((m + chunk - 1) // chunk)):
        b = task // ((m + chunk - 1) // chunk)
        lo = (task % ((m + chunk - 1) // chunk)) * chunk
        hi = min(lo + chunk, m)
        for j in range(lo, hi):
            out[b, j] = _sq(g[b, 0, j])
        for i in range(1, n):
            for j in range(lo, hi):
                out[b, j] += _sq(g[b, i, j])


@njit(parallel=True, **OPTIONS)
def torch_col_norms(g, out):
    """``torch.norm(g, dim=-2)`` of a [batch, n, m] float32 array into ``out`` [batch, m], in
    torch's own arithmetic: ATen reduces a dimension other than the last with ``NormTwoOps``
    serially per output, a float32 ``acc + x * x`` (the square rounded, then the sum, no FMA)
    down the rows in order, then the float32 root (:func:`statekit.optim.torch_kernels`
    checks these bits against torch's before using them). Columns in chunks on numba's threads."""
    batch, n, m = g.shape
    chunk = 256
    per = (m + chunk - 1) // chunk
    for task in prange(batch * per):
        b = task // per
        lo = (task % per) * chunk
        hi = min(lo + chunk, m)
        acc = np.zeros(hi - lo, np.float32)
        for i in range(n):
            for j in range(lo, hi):
                x = g[b, i, j]
                acc[j - lo] = acc[j - lo] + x * x
        for j in range(lo, hi):
            out[b, j] = np.sqrt(acc[j - lo])


@njit(parallel=True, **OPTIONS)
def _matrix_update(g, row_var, col_var, denom, floor, one, negate, u):
    """u = rsqrt(max((row_var * col_var) / denom, floor)) * g for a [batch, n, m] gradient."""
    batch, n, m = g.shape
    for r in prange(batch * n):
        b = r // n
        i = r % n
        rv = row_var[b, i]
        d = denom[b]
        for j in range(m):
            var = max_(rv * col_var[b, j] / d, floor)
            gi = -g[b, i, j] if negate else g[b, i, j]
            u[b, i, j] = (one / math.sqrt(var)) * gi


@njit(inline="always")
def max_(a, b):
    """``np.maximum`` (b when equal, NaN when either is NaN)."""
    return b if (b >= a or b != b) else a


@njit(parallel=True, **OPTIONS)
def _vector_update(g, variance, w, low, floor, one, negate, u):
    """variance = lerp(variance, g*g, w); u = rsqrt(max(variance, floor)) * g."""
    for i in prange(g.shape[0]):
        gi = -g[i] if negate else g[i]
        start = variance[i]
        end = gi * gi
        diff = end - start
        v = fma32(w, diff, start) if low else fma32(w, diff, end)
        variance[i] = v
        u[i] = (one / math.sqrt(max_(v, floor))) * gi


@njit(parallel=True, **OPTIONS)
def _apply(p, u, decay, decayed, c, foreach):
    """p = p * decay (when decayed); p = fma(u, c, p) (for-loop) or p + u*c (foreach)."""
    for i in prange(p.shape[0]):
        pi = p[i] * decay if decayed else p[i]
        p[i] = pi + u[i] * c if foreach else fma32(u[i], c, pi)


def _lerp_small(start: np.ndarray, end: np.ndarray, weight: float) -> np.ndarray:
    flat = lerp(_NP, np.ascontiguousarray(start).reshape(-1), np.ascontiguousarray(end, F).reshape(-1), weight, None)
    return np.asarray(flat, F).reshape(start.shape)


def run(p, g, slots: dict, step: int, hp, foreach: bool) -> dict:
    """One torch Adafactor step in place on float32 C-contiguous ``p``; returns the new slots
    (``row_var``/``col_var`` or ``variance``), as the reference's ``adafactor._run``."""
    t = f32(step + 1)
    lr, wd, d = hp["lr"], hp["weight_decay"], hp["d"]
    eps1, eps2 = hp["eps"]
    eps1 = F32_EPS if eps1 is None else eps1
    negate = bool(hp["maximize"])
    w = t ** hp["beta2_decay"]
    rho = min(lr, 1 / (t**0.5))
    numel = p.size
    alpha = max(eps2, norm(p) / (numel**0.5)) * rho
    u = np.empty(p.shape, F)
    one, floor = F(1.0), F(eps1 * eps1)
    if g.ndim > 1:
        m, n = g.shape[-1], g.shape[-2]
        g3 = g.reshape(-1, n, m)
        rows = np.empty(g3.shape[0] * n, np.float64)
        _row_sums(g3.reshape(-1, m), rows)
        cols = np.empty((g3.shape[0], m), np.float64)
        _col_sums(g3, cols)
        row_var = slots.get("row_var", np.zeros(g.shape[:-1] + (1,), F))
        col_var = slots.get("col_var", np.zeros(g.shape[:-2] + (1, m), F))
        row_mean = np.sqrt(rows).astype(F).reshape(row_var.shape)
        row_var = _lerp_small(row_var, (row_mean * row_mean) / F(m), w)
        col_mean = np.sqrt(cols).astype(F).reshape(col_var.shape)
        col_var = _lerp_small(col_var, (col_mean * col_mean) / F(n), w)
        denom = np.maximum(np.mean(row_var, axis=-2, keepdims=True, dtype=np.float64).astype(F), F(eps1))
        _matrix_update(g3, np.ascontiguousarray(row_var.reshape(-1, n)), np.ascontiguousarray(col_var.reshape(-1, m)),
                       np.ascontiguousarray(denom.reshape(-1)), floor, one, negate, u.reshape(g3.shape))
        out = {"row_var": row_var, "col_var": col_var}
    else:
        variance = np.array(slots["variance"], F, order="C", copy=True) if "variance" in slots \
            else np.zeros(g.shape, F)
        wf = f32(w)
        low = abs(wf) < 0.5
        _vector_update(g.reshape(-1), variance.reshape(-1), F(wf if low else f32(wf - 1.0)), low, floor, one, negate,
                       u.reshape(-1))
        out = {"variance": variance}
    denom = max(1.0, norm(u) / ((numel**0.5) * d))
    c = F(-alpha / denom)
    decay = F(1 - lr * wd)
    _apply(p.reshape(-1), u.reshape(-1), decay, wd != 0, c, foreach)
    return out
