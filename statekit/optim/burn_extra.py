"""burn 0.22's LAMB, Lion, Adafactor and Muon (``crates/burn-optim/src/optim/{lamb,lion,adafactor,
muon,momentum}.rs``), float32, in burn's order of tensor operations.

These steps are not element-wise: LAMB's trust ratio and Adafactor's clipping take norms of the
whole update, Adafactor's second moment is factored, Muon multiplies matrices. Each step gets the
whole parameter, gradient and slots as float32 numpy arrays.

Arithmetic model (``optimizers-burn-torch.md`` §1.8, burn's ndarray backend): one IEEE float32
rounding per tensor operation, no FMA; a scalar argument (``mul_scalar(x)``, ``add_scalar``,
``clamp_min`` …) is narrowed to float32 where the op takes it (an f32 hyperparameter exactly, an
f64 value such as ``lr``, Adafactor's ``t^decay`` weights or ``1 - lr·wd`` rounded once); Rust's
``f32::powi`` is :func:`~statekit.optim.fp.powi`. Reductions (``sum``, ``mean``, ``mean_dim``)
and matrix products (Muon's Newton–Schulz) are float64 accumulations of the exact float32 terms,
rounded once to float32, then ``mean = sum / n`` in float32: the summation order of a burn
backend's own reduction is not modelled (ndarray, wgpu and cuda each have theirs), so these agree
with a burn run to the last bit only where that order does not matter.

Slots (statekit's names, :data:`statekit.naming.BURN`): LAMB ``exp_avg exp_avg_sq`` (burn's
``moment_1 moment_2``), Lion ``exp_avg`` (``momentum``), Adafactor ``row_var col_var`` (a matrix's
``second_moment`` ``[..., rows, 1]`` and ``column_second_moment`` ``[..., 1, cols]``) or
``variance`` (a vector's ``second_moment``): burn's values, which hold ε₁ inside (the EMA of
``g² + ε₁``); Muon ``momentum_buffer`` (``momentum.velocity``). A missing slot is burn's missing
state: the first step.

LAMB (``use_trust_ratio``; ``c = 1 - beta`` in f32, ``t`` the new step)::

    m = m*beta1 + g*c1;  v = v*beta2 + (g*g)*c2          (first: m = g*c1, v = (g*g)*c2)
    u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps);  u = u + p*wd (wd != 0)
    pn = sqrt(sum(p*p));  un = sqrt(sum(u*u));  u = u * (pn / max(un, f32 min positive)) (both > 0)
    p = p - u*f32(lr)

Lion::

    c = m*beta1 + g*(1 - beta1);  u = sign(c);  m = m*beta2 + g*(1 - beta2)   (first: c = g*(1 - beta1), m = g*(1 - beta2))
    p = p*f32(1 - lr*wd) (when that is not 1);  p = p - u*f32(lr)

Adafactor (burn's ``epsilon_1 epsilon_2 d`` = clip_threshold, ``beta2_decay`` = decay_rate,
``relative_step scale_parameter weight_decay``)::

    sq = g*g + eps1;  matrix: r = mean(sq, -1), c = mean(sq, -2);  vector: r = sq
    t += 1;  w = t^decay (f64);  R = R*f32(1 - w) + r*f32(w);  C likewise    (first: t = 1, R = r, C = c)
    matrix: u = g / sqrt(R / mean(R, -2)) / sqrt(C);  vector: u = g / sqrt(R)
    u = u / max(rms(u) / d, 1);  step = min(lr, 1/sqrt(t)) if relative_step else lr   (f64)
    u = u * max(rms(p), eps2) (scale_parameter);  u = u * f32(step)
    p = p*f32(1 - lr*wd) (wd != 0);  p = p - u

Muon (``momentum`` μ held in f32, ``dampening`` f64; matrices only, as burn asserts)::

    v = g (first) else g*f32(1 - dampening) + v*μ;  x = v*μ + g (nesterov) else v
    X = x (transposed when rows > cols);  X = X / max(sqrt(sum(X*X)), eps)
    ns_steps times: A = X·Xᵀ;  B = A*b + (A·A)*c;  X = X*a + B·X
    ratio = sqrt(max(1, rows/cols)) (original) or 0.2*sqrt(max(rows, cols)) (match_rms_adamw)
    p = p*f32(1 - lr*wd) (wd != 0, the unadjusted lr);  p = p - X*f32(lr*ratio)
"""

from __future__ import annotations

import math

import numpy as np

from statekit.errors import UsageError
from statekit.optim import kernels
from statekit.optim.backend import get_backend
from statekit.optim.common import BURN, write_back
from statekit.optim.fp import powi

F = np.float32
ONE = F(1.0)
MIN_POSITIVE = np.finfo(F).tiny


def _f(x) -> np.float32:
    return F(x)


def total(x: np.ndarray) -> np.float32:
    """``sum()`` of a float32 tensor: the exact terms summed in float64, rounded once."""
    return F(np.sum(x, dtype=np.float64))


def mean_dim(x: np.ndarray, axis: int) -> np.ndarray:
    """``mean_dim(axis)`` (keepdim): the rounded sum divided by the count, in float32."""
    s = np.sum(x, axis=axis, keepdims=True, dtype=np.float64).astype(F)
    return s / F(x.shape[axis])


def rms(x: np.ndarray) -> np.float32:
    """``x.square().mean().sqrt()``."""
    return np.sqrt(total(x * x) / F(x.size))


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A float32 matrix product: each entry's exact products summed in float64, rounded once."""
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(F)


# --------------------------------------------------------------------------- the four steps


def lamb(p, g, s, step, hp):
    b1, b2 = _f(hp["beta1"]), _f(hp["beta2"])
    c1, c2 = ONE - b1, ONE - b2
    if "exp_avg" in s and "exp_avg_sq" in s:
        m = s["exp_avg"] * b1 + g * c1
        v = s["exp_avg_sq"] * b2 + (g * g) * c2
    else:
        m, v = g * c1, (g * g) * c2
    t = step + 1
    mh = m / (ONE - F(powi(b1, t)))
    vh = v / (ONE - F(powi(b2, t)))
    u = mh / (np.sqrt(vh) + _f(hp["eps"]))
    wd = _f(hp["weight_decay"])
    if wd != 0:
        u = u + p * wd
    if hp["use_trust_ratio"]:
        pn, un = np.sqrt(total(p * p)), np.sqrt(total(u * u))
        ratio = pn / max(un, MIN_POSITIVE)
        u = u * (ratio if pn > 0 and un > 0 else ONE)
    p[...] = p - u * _f(hp["lr"])
    return {"exp_avg": m, "exp_avg_sq": v}


def lion(p, g, s, step, hp):
    b1, b2 = _f(hp["beta1"]), _f(hp["beta2"])
    if "exp_avg" in s:
        u = np.sign(s["exp_avg"] * b1 + g * (ONE - b1))
        m = s["exp_avg"] * b2 + g * (ONE - b2)
    else:
        u = np.sign(g * (ONE - b1))
        m = g * (ONE - b2)
    lr = hp["lr"]
    decay = 1.0 - lr * float(_f(hp["weight_decay"]))
    if decay != 1.0:
        p[...] = p * _f(decay)
    p[...] = p - u * _f(lr)
    return {"exp_avg": m}


def _adafactor_check(shape, hp):
    for key, ok, say in (("epsilon_1", lambda v: v > 0, "positive"), ("epsilon_2", lambda v: v > 0, "positive"),
                         ("d", lambda v: v > 0, "positive"), ("beta2_decay", lambda v: v < 0, "negative"),
                         ("weight_decay", lambda v: v >= 0, "nonnegative")):
        value = float(hp[key])
        if not (math.isfinite(value) and ok(value)):
            raise UsageError(f"burn's Adafactor needs a {say} finite {key}, not {hp[key]!r} (burn panics on it)")


def adafactor_slots(shape) -> tuple[str, ...]:
    return ("row_var", "col_var") if len(shape) >= 2 else ("variance",)


def adafactor(p, g, s, step, hp):
    factored = p.ndim >= 2
    sq = g * g + _f(hp["epsilon_1"])
    r, c = (mean_dim(sq, -1), mean_dim(sq, -2)) if factored else (sq, None)
    names = adafactor_slots(p.shape)
    if all(n in s for n in names):
        t = step + 1
        w = float(t) ** float(hp["beta2_decay"])
        old, new = _f(1.0 - w), _f(w)
        R = s[names[0]] * old + r * new
        C = s["col_var"] * old + c * new if factored else None
    else:
        t, R, C = 1, r, c
    if factored:
        u = g / np.sqrt(R / mean_dim(R, -2)) / np.sqrt(C)
    else:
        u = g / np.sqrt(R)
    clipping = max(rms(u) / _f(hp["d"]), ONE)
    u = u / clipping
    lr = hp["lr"]
    size = min(lr, 1.0 / math.sqrt(float(t))) if hp["relative_step"] else lr
    if hp["scale_parameter"]:
        u = u * max(rms(p), _f(hp["epsilon_2"]))
    u = u * _f(size)
    wd = _f(hp["weight_decay"])
    if wd != 0:
        p[...] = p * _f(1.0 - lr * float(wd))
    p[...] = p - u
    return {names[0]: R, "col_var": C} if factored else {"variance": R}


def _muon_check(shape, hp):
    if len(shape) != 2:
        raise UsageError(f"burn's Muon steps matrices only; this parameter has shape {list(shape)} (burn panics: "
                         "'Newton-Schulz iteration requires 2D tensors'; give it to another optimizer)")


def newton_schulz(x: np.ndarray, coefficients, steps: int, eps) -> np.ndarray:
    """burn's ``zeropower_via_newtonschulz`` on a float32 matrix."""
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = np.ascontiguousarray(x.T)
    x = x / max(np.sqrt(total(x * x)), _f(eps))
    a, b, c = (_f(k) for k in coefficients)
    for _ in range(int(steps)):
        gram = matmul(x, x.T)
        update = gram * b + matmul(gram, gram) * c
        x = x * a + matmul(update, x)
    return np.ascontiguousarray(x.T) if tall else x


def adjust_ratio(adjust_lr_fn, shape) -> float:
    """burn's ``AdjustLrFn::adjustment_ratio`` (f64)."""
    a, b = float(shape[0]), float(shape[1])
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(a / b, 1.0))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    raise UsageError(f"burn's Muon has no adjust_lr_fn {adjust_lr_fn!r} (original or match_rms_adamw)")


def muon(p, g, s, step, hp):
    mu = _f(hp["momentum"])
    if "momentum_buffer" in s:
        v = g * _f(1.0 - float(hp["dampening"])) + s["momentum_buffer"] * mu
    else:
        v = g
    x = v * mu + g if hp["nesterov"] else v
    x = newton_schulz(x, hp["ns_coefficients"], hp["ns_steps"], hp["eps"])
    lr = hp["lr"]
    adjusted = lr * adjust_ratio(hp["adjust_lr_fn"], p.shape)
    wd = _f(hp["weight_decay"])
    if wd != 0:
        p[...] = p * _f(1.0 - lr * float(wd))
    p[...] = p - x * _f(adjusted)
    return {"momentum_buffer": np.array(v, dtype=F)}


# --------------------------------------------------------------------------- step entry points


def _step_of(run, names, algorithm: str, check=None):
    """The registry's ``step`` for a whole-tensor burn step ``run(p, g, slots, step, hp) -> slots``."""

    def step(param, grad, slots, step: int, hp, flavor, xp=None, *, inplace=False, vector_width=None,
             kernel=kernels.REFERENCE, name=algorithm):
        if flavor != BURN:
            raise UsageError(f"{algorithm} has no flavor {flavor!r} (has {BURN})")
        b = get_backend(xp, like=param)
        if b.name != "numpy":
            raise UsageError(f"burn's {algorithm} replays on numpy arrays (the reference path), not {b.name}")
        chosen = kernels.choose(name, flavor, b, kernel, vector_width)
        shape = tuple(param.shape)
        if tuple(grad.shape) != shape:
            raise UsageError(f"gradient shape {tuple(grad.shape)} does not match parameter shape {shape}")
        if check is not None:
            check(shape, hp)
        expected = names(shape)
        unknown = sorted(set(slots) - set(expected))
        if unknown:
            raise UsageError(f"unexpected optimizer state slots {unknown}; expected {list(expected)}")
        for k, v in slots.items():
            want = _slot_shape(k, shape)
            if tuple(v.shape) != want:
                raise UsageError(f"state {k!r} has shape {tuple(v.shape)}, burn's {algorithm} keeps {want} for a "
                                 f"parameter of shape {shape}")

        def own(array):  # the caller's array stepped in place with ``inplace``, else a copy
            if inplace and b.is_float32_contiguous(array):
                return array
            return np.array(array, dtype=F, order="C", copy=True)

        p = own(param)
        g = np.ascontiguousarray(grad, dtype=F)  # only read
        if chosen == kernels.NUMBA:
            from statekit.optim import numba_more

            s = {k: own(slots[k]) if k in slots else np.zeros(_slot_shape(k, shape), F) for k in expected}
            numba_more.run(name, flavor, p, g, s, int(step), hp, frozenset(slots))
            return p, s, int(step) + 1
        s = {k: np.ascontiguousarray(v, dtype=F) for k, v in slots.items()}  # only read
        with np.errstate(all="ignore"):
            new = run(p, g, s, int(step), hp)
        new = {k: np.ascontiguousarray(v, dtype=F) for k, v in new.items()}
        if inplace:
            p = write_back(param, p, slots, new)
        return p, new, int(step) + 1

    step.__name__ = f"burn_{algorithm}_step"
    return step


def _slot_shape(name: str, shape: tuple) -> tuple:
    if name == "row_var":
        return shape[:-1] + (1,)
    if name == "col_var":
        return shape[:-2] + (1,) + shape[-1:]
    return shape


def _names(*slots):
    return lambda shape: slots


STEPS = {
    "lamb": _step_of(lamb, _names("exp_avg", "exp_avg_sq"), "lamb"),
    "lion": _step_of(lion, _names("exp_avg"), "lion"),
    "adafactor": _step_of(adafactor, adafactor_slots, "adafactor", check=_adafactor_check),
    "muon": _step_of(muon, _names("momentum_buffer"), "muon", check=_muon_check),
}


def slot_names_of(algorithm: str):
    """The registry's ``slot_names(hp, flavor)`` (Adafactor's depend on the shape: both kinds listed)."""
    listed = {"lamb": ("exp_avg", "exp_avg_sq"), "lion": ("exp_avg",), "adafactor": ("row_var", "col_var", "variance"),
              "muon": ("momentum_buffer",)}[algorithm]
    return lambda hp, flavor: listed
