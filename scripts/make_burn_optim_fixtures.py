#!/usr/bin/env python3
"""Write burn 0.22 optimizer records for the optimizers beyond the Adam family: Adafactor, LAMB,
Lion, Muon (alone, and Muon for the matrices + AdamW for the rest in one record, burn's
``ModuleOptimizer::with_group``), Adan and L-BFGS, under ``fixtures/burn-optim/``.

The model, data and ids are ``make_fixtures.py``'s (burn's MLP 4 → 16 → 1, weights ``[d_in,
d_out]``); each record is what ``ModuleOptimizer::to_record`` (``LBFGS::to_record``) writes after
``STEPS`` steps, in the record layout of ``shared/docs/optimizers-burn-torch.md`` §1 and
``burn-formats.md`` §2. The arithmetic below follows each optimizer's source in float32, one
rounding per tensor op, scalars narrowed to f32 where the op takes them; reductions (sum, mean,
matmul) are float64 accumulations rounded once to float32. ``tests/test_burn_optimizers.py``
checks every value against its own line-by-line transcription of burn's source.

Run from the repository root: ``python scripts/make_burn_optim_fixtures.py`` (idempotent).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack  # noqa: E402
from statekit.tensor import TensorRef  # noqa: E402

_spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(ROOT, "scripts", "make_fixtures.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

OUT = os.path.join(ROOT, "fixtures", "burn-optim")
F = np.float32
STEPS = 7
MATRICES = ("l1.weight", "l2.weight")


def f32(x) -> np.float32:
    return np.float32(x)


def total(x) -> np.float32:
    return f32(np.sum(x, dtype=np.float64))


def mean_dim(x, axis) -> np.ndarray:
    return (np.sum(x, axis=axis, keepdims=True, dtype=np.float64) / x.shape[axis]).astype(F)


def matmul(a, b) -> np.ndarray:
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(F)


def powi(base_: float, exp: int) -> np.float32:
    a, n, r = f32(base_), exp, f32(1)
    while True:
        if n & 1:
            r = f32(r * a)
        n >>= 1
        if n == 0:
            return r
        a = f32(a * a)


def rms(x) -> np.float32:
    return f32(np.sqrt(f32(total(x * x) / f32(x.size))))


# ----------------------------------------------------------------- burn 0.22 steps, float32


def adafactor(theta, g, st, lr, eps1=1e-30, eps2=1e-3, clip=1.0, decay_rate=-0.8, wd=0.0):
    sq = g * g + f32(eps1)
    if theta.ndim >= 2:
        row, col = mean_dim(sq, -1), mean_dim(sq, -2)
    else:
        row, col = sq, None
    if st:
        t = st["time"] + 1
        w = float(t) ** decay_rate
        R = st["second_moment"] * f32(1.0 - w) + row * f32(w)
        C = None if col is None else st["column_second_moment"] * f32(1.0 - w) + col * f32(w)
    else:
        t, R, C = 1, row, col
    if C is not None:
        u = g / np.sqrt(R / mean_dim(R, -2)) / np.sqrt(C)
    else:
        u = g / np.sqrt(R)
    u = u / max(f32(rms(u) / f32(clip)), f32(1))
    step = min(lr, 1.0 / float(t) ** 0.5)
    u = u * max(rms(theta), f32(eps2))
    u = u * f32(step)
    if wd:
        theta = theta * f32(1.0 - lr * float(f32(wd)))
    new = {"time": t, "second_moment": R}
    if C is not None:
        new["column_second_moment"] = C
    return (theta - u).astype(F), new


def lamb(theta, g, st, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.01):
    b1, b2 = f32(b1), f32(b2)
    if st:
        m = st["moment_1"] * b1 + g * f32(1 - b1)
        v = st["moment_2"] * b2 + (g * g) * f32(1 - b2)
        t = st["time"] + 1
    else:
        m, v, t = g * f32(1 - b1), (g * g) * f32(1 - b2), 1
    mh = m / f32(f32(1) - powi(b1, t))
    vh = v / f32(f32(1) - powi(b2, t))
    u = mh / (np.sqrt(vh) + f32(eps))
    if wd:
        u = u + theta * f32(wd)
    pn, un = f32(np.sqrt(total(theta * theta))), f32(np.sqrt(total(u * u)))
    trust = pn / max(un, np.finfo(F).tiny) if pn > 0 and un > 0 else f32(1)
    u = u * f32(trust)
    return (theta - u * f32(lr)).astype(F), {"time": t, "moment_1": m, "moment_2": v}


def lion(theta, g, st, lr, b1=0.9, b2=0.99, wd=0.1):
    b1, b2 = f32(b1), f32(b2)
    if st:
        u = np.sign(st["momentum"] * b1 + g * f32(1 - b1))
        m = st["momentum"] * b2 + g * f32(1 - b2)
    else:
        u, m = np.sign(g * f32(1 - b1)), g * f32(1 - b2)
    decay = 1.0 - lr * float(f32(wd))
    if decay != 1.0:
        theta = theta * f32(decay)
    return (theta - u * f32(lr)).astype(F), {"momentum": m.astype(F)}


NS = (3.4445, -4.775, 2.0315)


def muon(theta, g, st, lr, momentum=0.95, dampening=0.0, nesterov=True, eps=1e-7, wd=0.01):
    mu = f32(momentum)
    v = g * f32(1.0 - dampening) + st["velocity"] * mu if st else g
    x = v * mu + g if nesterov else v
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = np.ascontiguousarray(x.T)
    x = x / max(f32(np.sqrt(total(x * x))), f32(eps))
    a, b, c = (f32(k) for k in NS)
    for _ in range(5):
        A = matmul(x, x.T)
        B = A * b + matmul(A, A) * c
        x = x * a + matmul(B, x)
    if tall:
        x = np.ascontiguousarray(x.T)
    ratio = max(1.0, theta.shape[0] / theta.shape[1]) ** 0.5
    if wd:
        theta = theta * f32(1.0 - lr * float(f32(wd)))
    return (theta - x * f32(lr * ratio)).astype(F), {"velocity": v.astype(F)}


def adamw(theta, g, st, lr, b1=0.9, b2=0.999, eps=1e-5, wd=1e-4):
    b1, b2 = f32(b1), f32(b2)
    if st:
        m, v, t = st["moment_1"] * b1 + g * f32(1 - b1), st["moment_2"] * b2 + (g * g) * f32(1 - b2), st["time"] + 1
    else:
        m, v, t = g * f32(1 - b1), (g * g) * f32(1 - b2), 1
    u = (m / f32(f32(1) - powi(b1, t))) / (np.sqrt(v / f32(f32(1) - powi(b2, t))) + f32(eps))
    theta = theta * f32(1.0 - lr * float(f32(wd)))
    return (theta - u * f32(lr)).astype(F), {"time": t, "moment_1": m, "moment_2": v}


def adan(theta, g, st, lr, b1=0.98, b2=0.92, b3=0.99, eps=1e-8):
    b1, b2, b3 = f32(b1), f32(b2), f32(b3)
    if st:
        diff = st["neg_pre_grad"] + g
        q = (diff * b2 + g) * (diff * b2 + g)
        m = st["exp_avg"] * b1 + g * f32(1 - b1)
        d = st["exp_avg_diff"] * b2 + diff * f32(1 - b2)
        n = st["exp_avg_sq"] * b3 + q * f32(1 - b3)
        t = st["time"] + 1
    else:
        m, n, d, t = g * f32(1 - b1), (g * g) * f32(1 - b3), np.zeros_like(g), 1
    denom = np.sqrt(n) / f32(np.sqrt(f32(f32(1) - powi(b3, t)))) + f32(eps)
    u = (m / f32(f32(1) - powi(b1, t))) / denom + (d * b2 / f32(f32(1) - powi(b2, t))) / denom
    return (theta - u * f32(lr)).astype(F), {"time": t, "exp_avg": m, "exp_avg_sq": n, "exp_avg_diff": d,
                                             "neg_pre_grad": -g}


def train(rules, steps=STEPS, order=base.ORDER):
    """``rules``: path → (step function, lr)."""
    w = base.init_model()
    state = {p: {} for p in order}
    data = base.batches()
    for _ in range(steps):
        x, y = next(data)
        grads = base.gradients(w, x, y)
        for p in order:
            rule, lr = rules[p]
            w[p], state[p] = rule(w[p], grads[p], state[p], lr)
    return w, state


def record(state, weights, fields, order=base.ORDER):
    """Tensors/scalars/metadata as ModuleOptimizer::to_record writes them: ``fields`` maps a
    path to [(record field, state key)] and a step field (or None)."""
    tensors, scalars, meta = [], {}, {}
    for path in order:
        pid = base.IDS[path]
        names, step = fields[path]
        for native, key in names:
            if key in state[path]:
                tensors.append(PackTensor(f"{pid}.{native}", TensorRef.from_array(state[path][key].astype(F)),
                                          param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", weights[path].ndim)
        if step:
            scalars[f"{pid}.{step}"] = Scalar("UInt", int(state[path]["time"]))
        meta[str(pid)] = path
    return tensors, meta, scalars


def write(name, tensors, meta=None, scalars=None):
    path = os.path.join(OUT, name)
    write_burnpack(path, tensors, meta, scalars)
    print(f"{os.path.relpath(path, ROOT)}: {os.path.getsize(path)} bytes")


ADAFACTOR = ([("second_moment", "second_moment"), ("column_second_moment", "column_second_moment")], "time")
LAMB = ([("moment_1", "moment_1"), ("moment_2", "moment_2")], "time")
LION = ([("momentum", "momentum")], None)
MUON = ([("momentum.velocity", "velocity")], None)
ADAMW = ([("momentum.moment_1", "moment_1"), ("momentum.moment_2", "moment_2")], "momentum.time")
ADAN = ([("momentum.exp_avg", "exp_avg"), ("momentum.exp_avg_sq", "exp_avg_sq"),
         ("momentum.exp_avg_diff", "exp_avg_diff"), ("momentum.neg_pre_grad", "neg_pre_grad")], "momentum.time")


def lbfgs(steps=2, lr=1.0, max_iter=4, history_size=100, tol_grad=1e-7, tol_change=1e-9):
    """burn's LBFGS::step without line search (lbfgs.rs), ``steps`` calls on one fixed batch; the
    flat vectors concatenate the parameters in module-visit order (l1.weight, l1.bias, …)."""
    w = base.init_model()
    x, y = next(base.batches())
    sizes = [w[p].size for p in base.ORDER]

    def flat(d):
        return np.concatenate([d[p].reshape(-1) for p in base.ORDER]).astype(F)

    def unflat(v):
        out, at = {}, 0
        for p, n in zip(base.ORDER, sizes, strict=True):
            out[p] = v[at:at + n].reshape(w[p].shape)
            at += n
        return out

    def closure(params):
        h = np.maximum(x @ params["l1.weight"] + params["l1.bias"], F(0))
        out = h @ params["l2.weight"] + params["l2.bias"]
        loss = float(np.mean((out - y) ** 2, dtype=np.float64))
        return loss, flat(base.gradients(params, x, y))

    st = {"history_s": [], "history_y": [], "d": None, "t": 1.0, "prev_flat_grad": None, "prev_loss": None,
          "g_iter": 0}
    for _ in range(steps):
        loss, g = closure(w)
        if float(np.max(np.abs(g))) <= tol_grad:
            continue
        d = st["d"] if st["d"] is not None else -g
        t = st["t"] if st["t"] is not None else lr
        prev_g, prev_loss = st["prev_flat_grad"], st["prev_loss"]
        n_iter = 0
        while n_iter < max_iter:
            n_iter += 1
            st["g_iter"] += 1
            if st["g_iter"] == 1:
                d = -g
                st["history_s"], st["history_y"] = [], []
            else:
                yv = (g - prev_g).astype(F)
                s = (d * f32(t)).astype(F)
                ys = float(total(yv * s))
                if ys > 1e-10:
                    if len(st["history_s"]) >= history_size:
                        st["history_s"].pop(0)
                        st["history_y"].pop(0)
                    st["history_s"].append(s)
                    st["history_y"].append(yv)
                q = -g
                alphas = []
                for sk, yk in zip(reversed(st["history_s"]), reversed(st["history_y"]), strict=True):
                    rho = f32(total(yk * sk)) ** f32(-1.0)
                    alpha = f32(rho * total(sk * q))
                    q = (q - yk * alpha).astype(F)
                    alphas.append(alpha)
                if st["history_s"]:
                    ys_last, yy = total(st["history_y"][-1] * st["history_s"][-1]), total(st["history_y"][-1] ** 2)
                    r = q * f32(ys_last / yy)
                    for (sk, yk), alpha in zip(zip(st["history_s"], st["history_y"], strict=True),
                                               reversed(alphas), strict=True):
                        rho = f32(total(yk * sk)) ** f32(-1.0)
                        beta = f32(rho * total(yk * r))
                        r = (r + sk * f32(alpha - beta)).astype(F)
                    d = r
                else:
                    d = q
            prev_g = g.copy()
            prev_loss_iter = loss
            t = min(1.0, 1.0 / float(total(np.abs(g)))) * lr if st["g_iter"] == 1 else lr
            gtd = float(total(g * d))
            if gtd > -tol_change:
                break
            w = unflat((flat(w) + d * f32(t)).astype(F))
            loss, g = closure(w)
            if (n_iter >= max_iter or float(np.max(np.abs(g))) <= tol_grad
                    or float(np.max(np.abs(d * f32(t)))) <= tol_change or abs(loss - prev_loss_iter) < tol_change):
                break
        st.update(d=d, t=t, prev_flat_grad=prev_g, prev_loss=loss)
        del prev_loss
    tensors, scalars = [], {}
    for name in ("history_s", "history_y"):
        scalars[f"{name}.len"] = Scalar("UInt", len(st[name]))
        tensors += [PackTensor(f"{name}.{i}", TensorRef.from_array(v.astype(F))) for i, v in enumerate(st[name])]
    tensors += [PackTensor("d", TensorRef.from_array(st["d"].astype(F))),
                PackTensor("prev_flat_grad", TensorRef.from_array(st["prev_flat_grad"].astype(F)))]
    scalars.update({"t": Scalar("Float", float(st["t"])), "prev_loss": Scalar("Float", float(st["prev_loss"])),
                    "g_iter": Scalar("UInt", st["g_iter"])})
    return tensors, None, scalars


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    every = base.ORDER
    for name, rule, lr, layout in (("adafactor", adafactor, 1e-2, ADAFACTOR), ("lamb", lamb, 1e-2, LAMB),
                                   ("lion", lion, 1e-3, LION), ("adan", adan, 1e-2, ADAN)):
        w, st = train({p: (rule, lr) for p in every})
        write(f"{name}.bpk", *record(st, w, {p: layout for p in every}))
    # Muon alone: a model without biases (Muon's step panics on anything but a matrix)
    w, st = train({p: (muon, 2e-2) for p in MATRICES}, order=MATRICES)
    write("muon.bpk", *record(st, w, {p: MUON for p in MATRICES}, order=MATRICES))
    # AdamW as the catch-all group, Muon as a group over the matrices (burn's with_group)
    rules = {p: ((muon, 2e-2) if p in MATRICES else (adamw, 1e-2)) for p in every}
    w, st = train(rules)
    write("muon-adamw.bpk", *record(st, w, {p: MUON if p in MATRICES else ADAMW for p in every}))
    write("lbfgs.bpk", *lbfgs())


if __name__ == "__main__":
    main()
