"""Compiled Adam/AdamW kernels (numba): one pass over memory per step, the reference's bits.

Each kernel is the element-wise formula of its flavor (:mod:`statekit.optim.adam`) written as
one loop over float32 elements, compiled without ``fastmath`` so that LLVM neither reorders nor
contracts anything: every ``a*b + c`` rounds twice unless it is written :func:`fma32`, which is
LLVM's ``llvm.fma.f32`` (one rounding; a hardware FMA on x86-64 with FMA3). The square root is
``llvm.sqrt.f32``, correctly rounded. Scalars arrive as float32 arguments, rounded in Python
exactly as the reference rounds them, so no float64 operation happens per element.

``torch-fused`` is bit-exact to torch's fused CPU kernel (body and scalar tail); ``torch`` takes
the IEEE root where torch takes MKL's (the reference does the same without torch, hence the
``tolerance`` exactness; with torch installed :func:`statekit.optim.kernels.choose` prefers
torch's own code). ``burn`` and ``candle`` have no FMA. The loop runs on numba's thread pool
(``parallel=True``); results do not depend on the thread count, every element is independent.

This module imports numba; import it only when a numba kernel runs (the ``statekit[fast]``
extra).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from statekit.optim.fp import f32, fma64, powi
from statekit.optim.numba_base import _maximum, fma32, pick, serial_twin


@njit(parallel=True, cache=True, error_model="numpy")
def _adam_torch(p, g, m, v, vmax, body, maximize, l2, decoupled, amsgrad, lerp_low,
                w, decay, wd, beta2, c2, bc2_sqrt, eps, neg_step):
    """torch's element-wise Adam; elements from ``body`` on take the fused kernel's tail rule."""
    n = p.shape[0]
    for i in prange(n):
        gi = g[i]
        pi = p[i]
        if maximize:
            gi = -gi
        new_p = pi
        if l2:
            gi = fma32(pi, wd, gi)
        elif decoupled:
            new_p = pi * decay
        mi = m[i]
        diff = gi - mi
        mi = fma32(w, diff, mi) if lerp_low else fma32(w, diff, gi)
        cg = c2 * gi
        if i < body:
            vi = fma32(cg, gi, v[i] * beta2)
        else:
            vi = fma32(v[i], beta2, cg * gi)
        m[i] = mi
        v[i] = vi
        if amsgrad:
            vi = _maximum(vmax[i], vi)
            vmax[i] = vi
        p[i] = new_p + (neg_step * mi) / (math.sqrt(vi) / bc2_sqrt + eps)


@njit(parallel=True, cache=True, error_model="numpy")
def _adam_burn(p, g, m, v, vmax, first, keep_max, l2, decoupled, amsgrad,
               wd, beta1, beta2, c1, c2, bc1, bc2, eps, decay, cf, eps_b2, lr):
    """burn 0.22 Adam/AdamW: one rounding per tensor operation."""
    n = p.shape[0]
    for i in prange(n):
        gi = g[i]
        pi = p[i]
        if l2:
            gi = pi * wd + gi
        gg = gi * gi
        if first:
            mi = gi * c1
            vi = gg * c2
        else:
            mi = m[i] * beta1 + gi * c1
            vi = v[i] * beta2 + gg * c2
        m[i] = mi
        v[i] = vi
        if amsgrad:
            if keep_max:
                vi = _maximum(vmax[i], vi)
            vmax[i] = vi
        if decoupled:
            u = (mi / bc1) / (math.sqrt(vi / bc2) + eps)
            if decay:
                pi = pi * cf
        else:
            u = (mi * cf) / (math.sqrt(vi) + eps_b2)
        p[i] = pi - u * lr


@njit(parallel=True, cache=True, error_model="numpy")
def _adamw_candle(p, g, m, v, beta1, c1, beta2, c2, scale_m, scale_v, decay, eps, lr, one, zero):
    """candle-nn AdamW on the CPU backend: every scalar through ``affine(x, mul, add)``."""
    n = p.shape[0]
    for i in prange(n):
        gi = g[i]
        mi = (m[i] * beta1 + zero) + (gi * c1 + zero)
        vi = (v[i] * beta2 + zero) + ((gi * gi) * c2 + zero)
        m[i] = mi
        v[i] = vi
        update = (mi * scale_m + zero) / (math.sqrt(vi * scale_v + zero) * one + eps)
        p[i] = (p[i] * decay + zero) - (update * lr + zero)


for _kernel in (_adam_torch, _adam_burn, _adamw_candle):
    serial_twin(_kernel)
_pick = pick


def _f(value) -> np.float32:
    return np.float32(value)


def run(name: str, flavor: str, p, g, s: dict, step: int, hp, present, constants=None) -> dict:
    """One step in place on float32 C-contiguous numpy ``p`` and the full-size slots ``s``;
    returns the 0-dim slots' new values (:mod:`statekit.optim.numba_more` for the algorithms
    beyond Adam/AdamW, which take the step's ``constants`` from the reference's builder)."""
    if name in ("sgd", "adagrad", "rmsprop"):
        from statekit.optim import numba_classic

        return numba_classic.run(name, flavor, p, g, s, step, hp, present, constants)
    if name not in ("adam", "adamw"):
        from statekit.optim import numba_more

        return numba_more.run(name, flavor, p, g, s, step, hp, present, constants)
    _adam(flavor, p, g, s, step, hp, present)
    return {}


def _adam(flavor: str, p, g, s: dict, step: int, hp, present) -> None:
    """One Adam/AdamW step in place."""
    pf, gf = p.reshape(-1), g.reshape(-1)
    m, v = s["exp_avg"].reshape(-1), s["exp_avg_sq"].reshape(-1)
    amsgrad = bool(hp["amsgrad"])
    vmax = s["max_exp_avg_sq"].reshape(-1) if amsgrad else m[:0]
    wd, decoupled = hp["weight_decay"], bool(hp["decoupled_weight_decay"])
    if flavor in ("torch", "torch-fused"):
        fused = flavor == "torch-fused"
        t = f32(step + 1)
        if fused:
            bc1, bc2 = 1.0 - math.pow(hp["beta1"], t), 1.0 - math.pow(hp["beta2"], t)
            decay, bc2_sqrt = fma64(-hp["lr"], wd, 1.0), math.sqrt(bc2)
        else:
            bc1, bc2 = 1.0 - hp["beta1"] ** t, 1.0 - hp["beta2"] ** t
            decay, bc2_sqrt = 1.0 - hp["lr"] * wd, bc2**0.5
        w = f32(1.0 - hp["beta1"])
        lerp_low = abs(w) < 0.5
        body = pf.shape[0] - (pf.shape[0] % 8 if fused else 0)
        _pick(_adam_torch, pf.shape[0])(pf, gf, m, v, vmax, body, bool(hp["maximize"]), wd != 0 and not decoupled,
                    wd != 0 and decoupled, amsgrad, lerp_low, _f(w if lerp_low else f32(w - 1.0)), _f(decay),
                    _f(wd), _f(hp["beta2"]), _f(1.0 - hp["beta2"]), _f(bc2_sqrt), _f(hp["eps"]),
                    _f(-(hp["lr"] / bc1)))
    elif flavor == "burn":
        one = np.float32(1.0)
        beta1, beta2, eps, wd32 = _f(hp["beta1"]), _f(hp["beta2"]), _f(hp["eps"]), _f(wd)
        bc1 = one - np.float32(powi(beta1, step + 1))
        bc2 = one - np.float32(powi(beta2, step + 1))
        first = step == 0
        decay = hp["lr"] * float(wd32)
        b2 = np.sqrt(bc2)
        cf = _f(1.0 - decay) if decoupled else b2 / bc1
        _pick(_adam_burn, pf.shape[0])(pf, gf, m, v, vmax, first, not (first or "max_exp_avg_sq" not in present),
                   not decoupled and wd32 != 0, decoupled, amsgrad, wd32, beta1, beta2, one - beta1, one - beta2,
                   bc1, bc2, eps, decay != 0, cf, eps * b2, _f(hp["lr"]))
    elif flavor == "candle":
        t, beta1, beta2, lr = step + 1, hp["beta1"], hp["beta2"], hp["lr"]
        _pick(_adamw_candle, pf.shape[0])(pf, gf, m, v, _f(beta1), _f(1.0 - beta1), _f(beta2), _f(1.0 - beta2),
                      _f(1.0 / (1.0 - powi(beta1, t, np.float64))), _f(1.0 / (1.0 - powi(beta2, t, np.float64))),
                      _f(1.0 - lr * wd), _f(hp["eps"]), _f(lr), np.float32(1.0), np.float32(0.0))
    else:  # pragma: no cover - kernels.choose refuses these
        raise ValueError(f"no numba {flavor} kernel")
