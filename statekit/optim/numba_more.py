"""Compiled kernels (numba) for the element-wise optimizers beyond Adam: torch 2.13's NAdam,
RAdam, Adamax, Adadelta, ASGD and Rprop (for-loop and foreach), burn 0.22's Adan and Lion.

Each loop is its algorithm module's reference formula, element by element, with the reference's
float32 constants (the module's ``constants``) and its roundings: ``fma32`` (``llvm.fma.f32``)
exactly where the reference has an FMA, every other operation one float32 rounding, the IEEE
square root (``llvm.sqrt.f32``), no ``fastmath``, IEEE division (``error_model="numpy"``: a
division by zero is an infinity or a NaN, as in numpy). Without torch the reference takes the
IEEE root too, so these give its bits (``tests/test_kernels.py``); with torch installed, the
``torch`` kernel runs torch's own code instead (:func:`statekit.optim.kernels.choose`).

Imported only when a numba kernel runs (the ``statekit[fast]`` extra).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from statekit.optim.fp import f32
from statekit.optim.numba_base import _maximum, fma32, pick, serial_twin

F = np.float32
OPTIONS = dict(parallel=True, cache=True, error_model="numpy")


@njit(inline="always")
def _lerp(start, end, w, low):
    """torch's float32 ``lerp`` (``common.lerp``): ``w`` is the weight, or the weight - 1 when
    ``low`` is false."""
    diff = end - start
    return fma32(w, diff, start) if low else fma32(w, diff, end)


@njit(inline="always")
def _sign(x, one, zero):
    """``np.sign`` of a float32: +0.0 for both zeros, NaN for NaN."""
    if x > zero:
        return one
    if x < zero:
        return -one
    if x == zero:
        return zero
    return x


@njit(inline="always")
def _grad(gi, pi, maximize, l2, wd):
    """torch's gradient preparation (``common.torch_grad``)."""
    if maximize:
        gi = -gi
    if l2:
        gi = fma32(pi, wd, gi)
    return gi


# ------------------------------------------------------------------------------------ torch


@njit(**OPTIONS)
def _nadam(p, g, m, v, maximize, decoupled, l2, low, foreach, w, decay, wd, beta2, c2, bc2, bc2_sqrt, eps,
           c_grad, c_avg):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = _grad(g[i], pi, maximize, l2, wd)
        if decoupled:
            pi = pi * decay
        mi = _lerp(m[i], gi, w, low)
        vi = fma32(c2 * gi, gi, v[i] * beta2)
        m[i] = mi
        v[i] = vi
        if foreach:
            denom = math.sqrt(vi) / bc2_sqrt + eps
        else:
            denom = math.sqrt(vi / bc2) + eps
        pi = pi + (c_grad * gi) / denom
        p[i] = pi + (c_avg * mi) / denom


@njit(**OPTIONS)
def _radam(p, g, m, v, maximize, decoupled, l2, low, foreach, rectified, w, decay, wd, beta2, c2, eps, bc1, lr,
           bc2_sqrt, rect, one, unrect, coef):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = _grad(g[i], pi, maximize, l2, wd)
        if decoupled:
            pi = pi * decay
        mi = _lerp(m[i], gi, w, low)
        vi = fma32(c2 * gi, gi, v[i] * beta2)
        m[i] = mi
        v[i] = vi
        if foreach:
            buffer = one / ((math.sqrt(vi) + eps) / coef) + unrect
            p[i] = fma32(mi, buffer, pi)
        elif rectified:
            adaptive = (one / (math.sqrt(vi) + eps)) * bc2_sqrt
            p[i] = pi - ((mi / bc1) * lr) * adaptive * rect
        else:
            p[i] = pi - (mi / bc1) * lr


@njit(**OPTIONS)
def _adamax(p, g, m, u, maximize, l2, low, w, wd, beta2, eps, neg_clr):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = _grad(g[i], pi, maximize, l2, wd)
        mi = _lerp(m[i], gi, w, low)
        ui = _maximum(u[i] * beta2, abs(gi) + eps)
        m[i] = mi
        u[i] = ui
        p[i] = pi + (neg_clr * mi) / ui


@njit(**OPTIONS)
def _adadelta(p, g, sq, acc, maximize, l2, wd, rho, c, eps, neg_lr):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = _grad(g[i], pi, maximize, l2, wd)
        sqi = fma32(c * gi, gi, sq[i] * rho)
        sq[i] = sqi
        ai = acc[i]
        delta = (math.sqrt(ai + eps) / math.sqrt(sqi + eps)) * gi
        acc[i] = fma32(c * delta, delta, ai * rho)
        p[i] = fma32(delta, neg_lr, pi)


@njit(**OPTIONS)
def _asgd(p, g, ax, maximize, l2, foreach, average, wd, lambd, eta, mu, decay, neg_eta):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = _grad(g[i], pi, maximize, l2, wd)
        axi = ax[i]
        if foreach:
            step = fma32(pi, lambd, gi)
            pi = fma32(-step, eta, pi)
            ax[i] = fma32(pi - axi, mu, axi)
        else:
            pi = fma32(gi, neg_eta, pi * decay)
            ax[i] = axi + (pi - axi) * mu if average else pi
        p[i] = pi


@njit(**OPTIONS)
def _rprop(p, g, prev, size, maximize, minus, plus, one, zero, smin, smax):
    for i in prange(p.shape[0]):
        gi = g[i]
        if maximize:
            gi = -gi
        sign = _sign(gi * prev[i], one, zero)
        if sign > zero:
            factor = plus
        elif sign < zero:
            factor = minus
        elif sign == zero:
            factor = one
        else:
            factor = sign
        si = size[i] * factor
        # clamp: minimum(maximum(x, min), max), a NaN staying NaN
        si = _maximum(si, smin)
        si = smax if (smax <= si or smax != smax) else si
        size[i] = si
        if factor == minus:
            gi = zero
        p[i] = p[i] - _sign(gi, one, zero) * si
        prev[i] = gi


# ------------------------------------------------------------------------------------- burn


@njit(**OPTIONS)
def _adan(p, g, m, n, dm, npg, first, mode, beta1, beta2, beta3, c1, c2, c3, bc1, bc2, bc3_sqrt, eps, lr, shrink,
          grow, minus_one, zero):
    for i in prange(p.shape[0]):
        gi = g[i]
        if first:
            mi = gi * c1
            ni = (gi * gi) * c3
            dmi = zero
        else:
            diff = npg[i] + gi
            q = diff * beta2 + gi
            mi = m[i] * beta1 + gi * c1
            ni = n[i] * beta3 + (q * q) * c3
            dmi = dm[i] * beta2 + diff * c2
        m[i] = mi
        n[i] = ni
        dm[i] = dmi
        npg[i] = gi * minus_one
        denom = math.sqrt(ni) / bc3_sqrt + eps
        delta = ((mi / bc1) / denom + ((dmi * beta2) / bc2) / denom) * lr
        pi = p[i]
        if mode == 0:
            p[i] = pi - delta
        elif mode == 1:
            p[i] = pi * shrink - delta
        else:
            p[i] = (pi - delta) / grow


@njit(**OPTIONS)
def _lion(p, g, m, first, decayed, beta1, c1, beta2, c2, decay, lr, one, zero):
    for i in prange(p.shape[0]):
        gi = g[i]
        if first:
            u = _sign(gi * c1, one, zero)
            mi = gi * c2
        else:
            u = _sign(m[i] * beta1 + gi * c1, one, zero)
            mi = m[i] * beta2 + gi * c2
        m[i] = mi
        pi = p[i]
        if decayed:
            pi = pi * decay
        p[i] = pi - u * lr


KERNELS = (_nadam, _radam, _adamax, _adadelta, _asgd, _rprop, _adan, _lion)
for _kernel in KERNELS:
    serial_twin(_kernel)


def _lerp_args(beta1: float):
    """``(w, low)`` of :func:`_lerp` for ``lerp(m, g, 1 - beta1)``."""
    w = f32(1.0 - beta1)
    low = abs(w) < 0.5
    return F(w if low else f32(w - 1.0)), low


def _flat(array):
    return array.reshape(-1)


def run(name: str, flavor: str, p, g, s: dict, step: int, hp, present, k=None) -> dict:
    """One step in place on float32 C-contiguous numpy ``p`` and the full-size slots ``s``, with
    the step's scalars ``k`` (the algorithm module's ``constants``, which its reference builder
    hands over); returns the 0-dim slots' new values (NAdam, ASGD)."""
    pf, gf = _flat(p), _flat(g)
    n = pf.shape[0]
    if name in ("nadam", "radam"):
        wd, decoupled = hp["weight_decay"], bool(hp["decoupled_weight_decay"])
        w, low = _lerp_args(hp["beta1"])
        common = (pf, gf, _flat(s["exp_avg"]), _flat(s["exp_avg_sq"]), bool(hp["maximize"]), decoupled and wd != 0,
                  not decoupled and wd != 0, low, flavor == "torch-foreach")
        if name == "nadam":
            pick(_nadam, n)(*common, w, *(F(k[x]) for x in ("decay", "wd", "beta2", "c2", "bc2", "bc2_sqrt", "eps",
                                                            "c_grad", "c_avg")))
            return {"mu_product": k["mu_product"]}
        pick(_radam, n)(*common, bool(k["rectified"]), w, *(F(k[x]) for x in (
            "decay", "wd", "beta2", "c2", "eps", "bc1", "lr", "bc2_sqrt", "rect", "one", "unrect", "coef")))
        return {}
    if name == "adamax":
        w, low = _lerp_args(hp["beta1"])
        pick(_adamax, n)(pf, gf, _flat(s["exp_avg"]), _flat(s["exp_inf"]), bool(hp["maximize"]), k["wd"] != 0, low,
                         w, F(k["wd"]), F(k["beta2"]), F(k["eps"]), F(k["neg_clr"]))
        return {}
    if name == "adadelta":
        pick(_adadelta, n)(pf, gf, _flat(s["square_avg"]), _flat(s["acc_delta"]), bool(hp["maximize"]), k["wd"] != 0,
                           *(F(k[x]) for x in ("wd", "rho", "c", "eps", "neg_lr")))
        return {}
    if name == "asgd":
        pick(_asgd, n)(pf, gf, _flat(s["ax"]), bool(hp["maximize"]), k["wd"] != 0, flavor == "torch-foreach",
                       k["mu"] != 1, *(F(k[x]) for x in ("wd", "lambd", "eta", "mu", "decay", "neg_eta")))
        return {"eta": k["new_eta"], "mu": k["new_mu"]}
    if name == "rprop":
        pick(_rprop, n)(pf, gf, _flat(s["prev"]), _flat(s["step_size"]), bool(hp["maximize"]),
                        *(F(k[x]) for x in ("minus", "plus", "one", "zero", "min", "max")))
        return {}
    if name == "adan":
        decay = k["decay"]
        mode = 0 if decay == 0 else (1 if hp["no_prox"] else 2)
        pick(_adan, n)(pf, gf, _flat(s["exp_avg"]), _flat(s["exp_avg_sq"]), _flat(s["exp_avg_diff"]),
                       _flat(s["neg_pre_grad"]), step == 0, mode, *(F(k[x]) for x in (
                           "beta1", "beta2", "beta3", "c1", "c2", "c3", "bc1", "bc2", "bc3_sqrt", "eps", "lr", "shrink",
                           "grow", "minus_one")), F(0.0))
        return {}
    if name == "lion":
        one = F(1.0)
        b1, b2 = F(hp["beta1"]), F(hp["beta2"])
        lr = hp["lr"]
        decay = 1.0 - lr * float(F(hp["weight_decay"]))
        pick(_lion, n)(pf, gf, _flat(s["exp_avg"]), "exp_avg" not in present, decay != 1.0, b1, one - b1, b2, one - b2,
                       F(decay), F(lr), one, F(0.0))
        return {}
    raise ValueError(f"no numba {flavor} {name} kernel")  # pragma: no cover - kernels.choose refuses these
