"""burn 0.22's LAMB, Lion, Adafactor and Muon, transcribed line by line from their Rust source into
numpy, independent of statekit's code (only numpy is imported).

Sources: ``crates/burn-optim/src/optim/lamb.rs`` @68b2be7f, ``lion.rs`` @6580731e,
``adafactor.rs`` @7a760b2c, ``muon.rs`` and ``momentum.rs`` (main 2c06be35 / 050c750d). Each
``step`` below follows the Rust ``fn step`` statement by statement; :class:`T` is a float32
``Tensor`` with the methods those statements call, each one IEEE float32 rounding, scalars
narrowed to float32 where the op takes them (``Scalar::new(x)`` carries an f64, the kernel
computes in the element type). Reductions (``sum``, ``mean``, ``mean_dim``, ``matmul``) follow
the model stated in ``statekit/optim/burn_extra.py`` (exact float32 terms summed in float64,
rounded once; ``mean = sum / n`` in float32), since a burn backend's own summation order is not
something numpy can reproduce. Rust scalar arithmetic (``1.0 - self.beta_1`` on f32, ``lr *
wd as f64`` on f64, ``f32::powi``) is done on numpy scalars of the same width.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32


def powi_f32(base: np.float32, n: int) -> np.float32:
    """Rust ``f32::powi`` (compiler-builtins ``__powisf2``: square-and-multiply from the low bit)."""
    r, a, recip = F32(1.0), F32(base), n < 0
    n = abs(n)
    while True:
        if n % 2:
            r = F32(r * a)
        n //= 2
        if n == 0:
            break
        a = F32(a * a)
    return F32(F32(1.0) / r) if recip else r


class T:
    """A float32 burn ``Tensor``."""

    def __init__(self, a):
        self.a = np.asarray(a, dtype=F32)

    # element-wise
    def mul_scalar(self, x):
        return T(self.a * F32(x))

    def add_scalar(self, x):
        return T(self.a + F32(x))

    def div_scalar(self, x):
        return T(self.a / F32(x))

    def clamp_min(self, x):
        return T(np.maximum(self.a, F32(x)))

    def add(self, o):
        return T(self.a + o.a)

    def sub(self, o):
        return T(self.a - o.a)

    def mul(self, o):
        return T(self.a * o.a)

    def div(self, o):
        return T(self.a / o.a)

    def square(self):
        return T(self.a * self.a)

    def powf_scalar(self, x):
        assert x == 2.0
        return T(self.a * self.a)  # powf(x, 2) is the correctly rounded x·x

    def sqrt(self):
        return T(np.sqrt(self.a))

    def sign(self):
        return T(np.sign(self.a))

    def greater_scalar(self, x):
        return self.a > F32(x)

    def ones_like(self):
        return T(np.ones_like(self.a))

    def mask_where(self, mask, value):
        return T(np.where(mask, value.a, self.a))

    def unsqueeze(self):
        return self  # a [1] tensor broadcast against the parameter

    # reductions
    def sum(self):
        return T(np.array([np.sum(self.a, dtype=np.float64)], dtype=F32))

    def mean(self):
        return T(self.sum().a / F32(self.a.size))

    def mean_dim(self, d):
        s = np.sum(self.a, axis=d, keepdims=True, dtype=np.float64).astype(F32)
        return T(s / F32(self.a.shape[d]))

    # matrices
    def swap_dims(self, i, j):
        return T(np.ascontiguousarray(np.swapaxes(self.a, i, j)))

    def matmul(self, o):
        return T((self.a.astype(np.float64) @ o.a.astype(np.float64)).astype(F32))

    @property
    def shape(self):
        return self.a.shape


# ------------------------------------------------------------------------------------- lamb.rs


def l2_norm(tensor):
    return tensor.square().sum().sqrt()


def lamb_step(cfg, lr, tensor, grad, state):
    """``impl Optimizer for Lamb { fn step }``; ``state``: None or dict(time, moment_1, moment_2)."""
    beta_1, beta_2, epsilon, weight_decay = F32(cfg["beta_1"]), F32(cfg["beta_2"]), F32(cfg["epsilon"]), F32(
        cfg["weight_decay"])
    factor_1 = F32(1.0) - beta_1
    factor_2 = F32(1.0) - beta_2
    if state is not None:
        state = dict(state)
        state["moment_1"] = state["moment_1"].mul_scalar(beta_1).add(grad.mul_scalar(factor_1))
        state["moment_2"] = state["moment_2"].mul_scalar(beta_2).add(grad.square().mul_scalar(factor_2))
        state["time"] += 1
    else:
        state = {"time": 1, "moment_1": grad.mul_scalar(factor_1), "moment_2": grad.square().mul_scalar(factor_2)}
    time = state["time"]
    moment_1 = state["moment_1"].div_scalar(F32(1.0) - powi_f32(beta_1, time))
    moment_2 = state["moment_2"].div_scalar(F32(1.0) - powi_f32(beta_2, time))
    update = moment_1.div(moment_2.sqrt().add_scalar(epsilon))
    if weight_decay != 0.0:
        update = update.add(tensor.mul_scalar(weight_decay))
    if cfg.get("use_trust_ratio", True):
        parameter_norm = l2_norm(tensor)
        update_norm = l2_norm(update)
        valid_norms = parameter_norm.greater_scalar(0.0) & update_norm.greater_scalar(0.0)
        min_positive = np.finfo(F32).tiny
        ratio = parameter_norm.div(update_norm.clamp_min(min_positive))
        trust_ratio = ratio.ones_like().mask_where(valid_norms, ratio)
        update = update.mul(trust_ratio.unsqueeze())
    tensor = tensor.sub(update.mul_scalar(lr))
    return tensor, state


# ------------------------------------------------------------------------------------- lion.rs


def lion_step(cfg, lr, tensor, grad, state):
    beta_1, beta_2, weight_decay = F32(cfg["beta_1"]), F32(cfg["beta_2"]), F32(cfg["weight_decay"])
    if state is not None:
        update = state["momentum"].mul_scalar(beta_1).add(grad.mul_scalar(F32(1.0) - beta_1)).sign()
        momentum = state["momentum"].mul_scalar(beta_2).add(grad.mul_scalar(F32(1.0) - beta_2))
    else:
        update = grad.mul_scalar(F32(1.0) - beta_1).sign()
        momentum = grad.mul_scalar(F32(1.0) - beta_2)
    decay = 1.0 - lr * float(weight_decay)
    tensor = tensor if decay == 1.0 else tensor.mul_scalar(decay)
    tensor = tensor.sub(update.mul_scalar(lr))
    return tensor, {"momentum": momentum}


# -------------------------------------------------------------------------------- adafactor.rs


def rms(tensor):
    return tensor.square().mean().sqrt()


def adafactor_step(cfg, lr, tensor, grad, state):
    epsilon_1, epsilon_2 = F32(cfg.get("epsilon_1", 1e-30)), F32(cfg.get("epsilon_2", 1e-3))
    clip_threshold = F32(cfg.get("clip_threshold", 1.0))
    decay_rate = float(cfg.get("decay_rate", -0.8))
    relative_step, scale_parameter = cfg.get("relative_step", True), cfg.get("scale_parameter", True)
    weight_decay = F32(cfg.get("weight_decay", 0.0))
    D = len(tensor.shape)
    squared_grad = grad.square().add_scalar(epsilon_1)
    if D >= 2:
        second_moment, column_second_moment = squared_grad.mean_dim(D - 1), squared_grad.mean_dim(D - 2)
    else:
        second_moment, column_second_moment = squared_grad, None
    if state is not None:
        state = dict(state)
        state["time"] += 1
        new_weight = float(state["time"]) ** decay_rate
        old_weight = 1.0 - new_weight
        state["second_moment"] = state["second_moment"].mul_scalar(old_weight).add(
            second_moment.mul_scalar(new_weight))
        if column_second_moment is not None:
            state["column_second_moment"] = state["column_second_moment"].mul_scalar(old_weight).add(
                column_second_moment.mul_scalar(new_weight))
    else:
        state = {"time": 1, "second_moment": second_moment, "column_second_moment": column_second_moment}
    column = state.get("column_second_moment")
    if column is not None:
        row = state["second_moment"]
        row_scale = row.div(row.mean_dim(D - 2)).sqrt()
        update = grad.div(row_scale).div(column.sqrt())
    else:
        update = grad.div(state["second_moment"].sqrt())
    clipping = rms(update).div_scalar(clip_threshold).clamp_min(1.0)
    update = update.div(clipping.unsqueeze())
    step_size = min(lr, 1.0 / math.sqrt(float(state["time"]))) if relative_step else lr
    if scale_parameter:
        scale = rms(tensor).clamp_min(epsilon_2)
        update = update.mul(scale.unsqueeze())
    update = update.mul_scalar(step_size)
    tensor = tensor if weight_decay == 0.0 else tensor.mul_scalar(1.0 - lr * float(weight_decay))
    tensor = tensor.sub(update)
    return tensor, state


# ------------------------------------------------------------------------ muon.rs, momentum.rs


def momentum_transform(cfg, grad, state):
    momentum = F32(cfg.get("momentum", 0.95))  # config.momentum.elem(): f64 → f32
    dampening = float(cfg.get("dampening", 0.0))
    if state is not None:
        velocity = grad.mul_scalar(1.0 - dampening).add(state["velocity"].mul_scalar(momentum))
    else:
        velocity = grad
    grad = velocity.mul_scalar(momentum).add(grad) if cfg.get("nesterov", True) else velocity
    return grad, {"velocity": velocity}


def zeropower_via_newtonschulz(cfg, g):
    D = 2
    dim_m2, dim_m1 = g.shape[D - 2], g.shape[D - 1]
    x, needs_transpose = (g.swap_dims(D - 2, D - 1), True) if dim_m2 > dim_m1 else (g, False)
    norm = x.powf_scalar(2.0).sum().sqrt().clamp_min(F32(cfg.get("epsilon", 1e-7))).unsqueeze()
    x = x.div(norm)
    a, b, c = (F32(k) for k in cfg.get("ns_coefficients", (3.4445, -4.775, 2.0315)))
    for _ in range(cfg.get("ns_steps", 5)):
        x_t = x.swap_dims(D - 2, D - 1)
        a_matrix = x.matmul(x_t)
        a_squared = a_matrix.matmul(a_matrix)
        b_matrix = a_matrix.mul_scalar(b).add(a_squared.mul_scalar(c))
        x = x.mul_scalar(a).add(b_matrix.matmul(x))
    if needs_transpose:
        x = x.swap_dims(D - 2, D - 1)
    return x


def adjustment_ratio(adjust_lr_fn, shape):
    a, b = float(shape[0]), float(shape[1])
    if adjust_lr_fn == "MatchRmsAdamW":
        return 0.2 * max(a, b) ** 0.5
    return max(a / b, 1.0) ** 0.5


def muon_step(cfg, lr, tensor, grad, state):
    assert len(tensor.shape) == 2, "Newton-Schulz iteration requires 2D tensors"
    grad, new_momentum_state = momentum_transform(cfg, grad, state)
    update = zeropower_via_newtonschulz(cfg, grad)
    adjusted_lr = lr * adjustment_ratio(cfg.get("adjust_lr_fn", "Original"), tensor.shape)
    penalty = cfg.get("weight_decay_penalty")
    if penalty is not None:
        tensor = tensor.mul_scalar(1.0 - lr * float(F32(penalty)))
    delta = update.mul_scalar(adjusted_lr)
    return tensor.sub(delta), new_momentum_state


STEPS = {"lamb": lamb_step, "lion": lion_step, "adafactor": adafactor_step, "muon": muon_step}
