"""Adafactor (factored second moment, relative step, update clipping): torch 2.13 for-loop and foreach.

Hyperparameters: ``lr beta2_decay eps d weight_decay maximize``; ``eps`` is torch's pair
``(eps1, eps2)``, ``eps1 = None`` meaning float32's machine epsilon. Slots: ``row_var``
``[..., n, 1]`` and ``col_var`` ``[..., 1, m]`` for a parameter of two dimensions or more,
``variance`` (the parameter's shape) otherwise; a missing one starts at zero. ``t`` is the
float32 step after the increment; scalars are Python float64::

    w = t**beta2_decay;  rho = min(lr, 1 / t**0.5)
    alpha = max(eps2, norm(p) / numel**0.5) * rho            (norm before the decay, as a float32 value)
    g = -g (maximize);  p = p * f32(1 - lr*wd) (wd != 0)
    matrix: row_var = lerp(row_var, norm(g, dim=-1)**2 / f32(m), w)
            col_var = lerp(col_var, norm(g, dim=-2)**2 / f32(n), w)
            var = (row_var * col_var) / max(mean(row_var, dim=-2), f32(eps1))
    vector: variance = lerp(variance, g*g, w);  var = variance
    u = rsqrt(max(var, f32(eps1*eps1))) * g
    c = -alpha / max(1, norm(u) / (numel**0.5 * d))
    torch:         p = fma(u, f32(c), p)
    torch-foreach: p = p + u * f32(c)

``norm``, ``mean`` and ``rsqrt`` are torch's own float32 CPU kernels when torch is installed
(their reductions' summation order decides the last bit; :class:`~statekit.optim.tensorwise.TorchOps`),
else float64 sums rounded once (within tolerance, not bit-exact).
"""

from __future__ import annotations

import importlib

import numpy as np

from statekit.optim.backend import Backend
from statekit.optim.common import TORCH, TORCH_FOREACH, lerp
from statekit.optim.fp import f32
from statekit.optim.tensorwise import make_tensor_step

_NP = Backend(np)
F32_EPS = float(np.finfo(np.float32).eps)


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``row_var`` and ``col_var`` (two or more dimensions) or ``variance`` (fewer)."""
    return ("row_var", "col_var", "variance")


def _lerp(start: np.ndarray, end: np.ndarray, weight: float) -> np.ndarray:
    start, end = np.broadcast_arrays(start, end)
    shape = start.shape
    flat = lerp(_NP, np.ascontiguousarray(start).reshape(-1), np.ascontiguousarray(end).reshape(-1), weight,
                None)
    return np.asarray(flat, dtype=np.float32).reshape(shape)


def _fma(x: np.ndarray, y, z: np.ndarray) -> np.ndarray:
    return np.asarray(_NP.fma32(x.reshape(-1), y, z.reshape(-1)), dtype=np.float32).reshape(z.shape)


def _run(foreach: bool):
    def run(p, g, slots, step, hp, ops):
        t = f32(step + 1)
        lr, wd, d = hp["lr"], hp["weight_decay"], hp["d"]
        eps1, eps2 = hp["eps"]
        eps1 = F32_EPS if eps1 is None else eps1
        if hp["maximize"]:
            g = -g
        w = t ** hp["beta2_decay"]
        rho = min(lr, 1 / (t**0.5))
        numel = p.size
        alpha = max(eps2, ops.norm(p) / (numel**0.5)) * rho
        if wd != 0:
            p *= np.float32(1 - lr * wd)
        out = {}
        if g.ndim > 1:
            rows, cols = g.shape[-1], g.shape[-2]
            row_var = slots.get("row_var", np.zeros(g.shape[:-1] + (1,), np.float32))
            col_var = slots.get("col_var", np.zeros(g.shape[:-2] + (1, g.shape[-1]), np.float32))
            row_mean = ops.norm_dim(g, -1)
            row_mean = (row_mean * row_mean) / np.float32(rows)
            row_var = _lerp(row_var, row_mean, w)
            col_mean = ops.norm_dim(g, -2)
            col_mean = (col_mean * col_mean) / np.float32(cols)
            col_var = _lerp(col_var, col_mean, w)
            var = (row_var * col_var) / np.maximum(ops.mean_dim(row_var, -2), np.float32(eps1))
            out = {"row_var": row_var, "col_var": col_var}
        else:
            variance = _lerp(slots.get("variance", np.zeros_like(g)), g * g, w)
            var = variance.copy()
            out = {"variance": variance}
        update = ops.rsqrt(np.maximum(var, np.float32(eps1 * eps1))) * g
        denom = max(1.0, ops.norm(update) / ((numel**0.5) * d))
        c = np.float32(-alpha / denom)
        if foreach:
            p[...] = p + update * c
        else:
            p[...] = _fma(update, c, p)
        return out

    return run


RUNS = {TORCH: _run(foreach=False), TORCH_FOREACH: _run(foreach=True)}

def fresh(shape) -> dict:
    """The slots a parameter of ``shape`` keeps, with their shapes (torch's ``_init_group``)."""
    if len(shape) > 1:
        return {"row_var": shape[:-1] + (1,), "col_var": shape[:-2] + (1,) + shape[-1:]}
    return {"variance": shape}


def _numba(p, g, slots, step, hp, flavor):
    """The numba kernel (statekit.optim.numba_adafactor): the reference's bits without torch."""
    return importlib.import_module("statekit.optim.numba_adafactor").run(p, g, slots, step, hp,
                                                                         flavor == TORCH_FOREACH)


step = make_tensor_step(RUNS, slot_names, "adafactor", fresh=fresh, numba=_numba)
