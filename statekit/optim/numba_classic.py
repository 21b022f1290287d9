"""Compiled kernels (numba) for SGD, Adagrad and RMSprop in every flavor statekit replays them:
torch's for-loop and fused kernels, burn 0.22, candle (SGD).

As :mod:`statekit.optim.numba_more`: each loop is its module's reference formula element by
element, with the reference's float32 constants (the builder's ``constants``), ``fma32`` exactly
where the reference has an FMA, one float32 rounding per other operation, the IEEE root, IEEE
division. The ``torch-fused`` SGD keeps the fused kernel's scalar-tail rule for the last
``numel % 8`` elements (Adagrad's tail agrees with its body).

Imported only when a numba kernel runs (the ``statekit[fast]`` extra).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from statekit.optim.fp import f32
from statekit.optim.numba_base import fma32, pick, serial_twin

F = np.float32
OPTIONS = dict(parallel=True, cache=True, error_model="numpy")


@njit(**OPTIONS)
def _sgd_torch(p, g, buf, maximize, l2, has_momentum, first, nesterov, body, wd, momentum, damp, neg_lr):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = g[i]
        if maximize:
            gi = -gi
        if l2:
            gi = fma32(pi, wd, gi)
        if has_momentum:
            if first:
                bi = gi
            elif i >= body:  # the fused kernel's scalar tail
                bi = fma32(buf[i], momentum, gi * damp)
            else:
                bi = fma32(gi, damp, buf[i] * momentum)
            buf[i] = bi
            gi = fma32(bi, momentum, gi) if nesterov else bi
        p[i] = fma32(gi, neg_lr, pi)


@njit(**OPTIONS)
def _sgd_burn(p, g, buf, decayed, has_momentum, first, nesterov, wd, momentum, damp, lr):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = g[i]
        if decayed:
            gi = pi * wd + gi
        if has_momentum:
            vi = gi if first else gi * damp + buf[i] * momentum
            buf[i] = vi
            gi = vi * momentum + gi if nesterov else vi
        p[i] = pi - gi * lr


@njit(**OPTIONS)
def _sgd_candle(p, g, lr, zero):
    for i in prange(p.shape[0]):
        p[i] = p[i] - (g[i] * lr + zero)


@njit(**OPTIONS)
def _adagrad_torch(p, g, total, maximize, l2, wd, eps, neg_clr):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = g[i]
        if maximize:
            gi = -gi
        if l2:
            gi = fma32(pi, wd, gi)
        ti = fma32(gi, gi, total[i])
        total[i] = ti
        p[i] = pi + (neg_clr * gi) / (math.sqrt(ti) + eps)


@njit(**OPTIONS)
def _adagrad_burn(p, g, total, decayed, first, wd, eps, lr):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = g[i]
        if decayed:
            gi = pi * wd + gi
        gg = gi * gi
        ti = gg if first else total[i] + gg
        total[i] = ti
        p[i] = pi - (gi / (math.sqrt(ti) + eps)) * lr


@njit(**OPTIONS)
def _rmsprop_torch(p, g, sq, ga, buf, maximize, l2, centered, has_momentum, low, w, wd, alpha, c, eps, momentum,
                   neg_lr):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = g[i]
        if maximize:
            gi = -gi
        if l2:
            gi = fma32(pi, wd, gi)
        si = fma32(c * gi, gi, sq[i] * alpha)
        sq[i] = si
        if centered:
            start = ga[i]
            diff = gi - start
            gai = fma32(w, diff, start) if low else fma32(w, diff, gi)
            ga[i] = gai
            si = fma32(-gai, gai, si)
        avg = math.sqrt(si) + eps
        if has_momentum:
            bi = buf[i] * momentum + gi / avg
            buf[i] = bi
            p[i] = fma32(bi, neg_lr, pi)
        else:
            p[i] = pi + (neg_lr * gi) / avg


@njit(**OPTIONS)
def _rmsprop_burn(p, g, sq, avg_out, ga, buf, decayed, first, centered, first_ga, has_momentum, first_buf, wd, alpha,
                  c, eps, momentum, lr):
    for i in prange(p.shape[0]):
        pi = p[i]
        gi = g[i]
        if decayed:
            gi = pi * wd + gi
        gg = (gi * gi) * c
        si = gg if first else sq[i] * alpha + gg
        sq[i] = si
        avg = si
        if centered:
            gai = gi * c if first_ga else ga[i] * alpha + gi * c
            ga[i] = gai
            avg = si - gai * gai
        avg_out[i] = avg
        update = gi / (math.sqrt(avg) + eps)
        if has_momentum:
            if not first_buf:
                update = buf[i] * momentum + update
            buf[i] = update
        p[i] = pi - update * lr


for _kernel in (_sgd_torch, _sgd_burn, _sgd_candle, _adagrad_torch, _adagrad_burn, _rmsprop_torch, _rmsprop_burn):
    serial_twin(_kernel)


def _flat(array):
    return array.reshape(-1)


def run(name: str, flavor: str, p, g, s: dict, step: int, hp, present, k: dict) -> dict:
    """One SGD / Adagrad / RMSprop step in place on float32 C-contiguous numpy ``p`` and slots
    ``s``, with the reference builder's constants ``k``."""
    pf, gf = _flat(p), _flat(g)
    n = pf.shape[0]
    empty = pf[:0]
    if name == "sgd":
        momentum = hp["momentum"]
        buf = _flat(s["momentum_buffer"]) if momentum != 0 else empty
        if flavor in ("torch", "torch-fused"):
            body = n - (n % 8) if flavor == "torch-fused" else n
            pick(_sgd_torch, n)(pf, gf, buf, bool(hp["maximize"]), k["wd"] != 0, momentum != 0,
                                "momentum_buffer" not in present, bool(hp["nesterov"]), body,
                                *(F(k[x]) for x in ("wd", "momentum", "damp", "neg_lr")))
        elif flavor == "burn":
            first = step == 0 or "momentum_buffer" not in present
            pick(_sgd_burn, n)(pf, gf, buf, k["wd"] != 0, momentum != 0, first, bool(hp["nesterov"]),
                               *(F(k[x]) for x in ("wd", "momentum", "damp", "lr")))
        else:
            pick(_sgd_candle, n)(pf, gf, F(k["lr"]), F(k["zero"]))
        return {}
    if name == "adagrad":
        if flavor == "burn":
            pick(_adagrad_burn, n)(pf, gf, _flat(s["sum"]), k["wd"] != 0, step == 0,
                                   *(F(k[x]) for x in ("wd", "eps", "lr")))
        else:
            pick(_adagrad_torch, n)(pf, gf, _flat(s["sum"]), bool(hp["maximize"]), k["wd"] != 0,
                                    *(F(k[x]) for x in ("wd", "eps", "neg_clr")))
        return {}
    centered, has_momentum = bool(hp["centered"]), hp["momentum"] > 0
    ga = _flat(s["grad_avg"]) if centered else empty
    buf = _flat(s["momentum_buffer"]) if has_momentum else empty
    if flavor == "burn":
        first = step == 0
        pick(_rmsprop_burn, n)(pf, gf, _flat(s["square_avg"]), _flat(s["avg"]), ga, buf, k["wd"] != 0, first, centered,
                               first or "grad_avg" not in present, has_momentum,
                               first or "momentum_buffer" not in present,
                               *(F(k[x]) for x in ("wd", "alpha", "c", "eps", "momentum", "lr")))
        return {}
    w = f32(1.0 - hp["alpha"])
    low = abs(w) < 0.5
    pick(_rmsprop_torch, n)(pf, gf, _flat(s["square_avg"]), ga, buf, bool(hp["maximize"]), k["wd"] != 0, centered,
                            has_momentum, low, F(w if low else f32(w - 1.0)),
                            *(F(k[x]) for x in ("wd", "alpha", "c", "eps", "momentum", "neg_lr")))
    return {}
