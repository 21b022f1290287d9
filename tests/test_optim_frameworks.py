"""burn and candle flavors against their formulas, computed here by hand.

The expected values follow burn-formats.md §2.5 (burn 0.22) and torch-candle-numerics.md §4.1
(candle-nn AdamW) line by line, one ``np.float32`` scalar operation at a time, element by
element, without calling statekit: ``f(x)`` marks every rounding to f32. Each test runs 3
steps on a handful of elements and asserts bit-exact equality of the parameter and every slot.
"""

from __future__ import annotations

import numpy as np
import pytest

import statekit.optim as so

f = np.float32
ONE = f(1.0)

P0 = np.array([0.5, -1.25, 0.0625, 2.0], dtype=np.float32)
GRADS = np.array(
    [[0.3, -0.02, 1.5, -0.7], [0.25, 0.01, -2.0, -0.6], [-0.4, 0.03, 1.0, 0.9]], dtype=np.float32
)


def bits(x):
    return np.asarray(x, dtype=np.float32).view(np.int32)


def powi_f32(beta, t):
    """Rust f32 powi for t = 1..3, written out (compiler-builtins: result·square per set bit)."""
    return {1: beta, 2: f(beta * beta), 3: f(beta * f(beta * beta))}[t]


def powi_f64(beta, t):
    """Rust f64 powi for t = 1..3, in Python floats."""
    return {1: beta, 2: beta * beta, 3: beta * (beta * beta)}[t]


def run(name, hp, flavor="burn", steps=3):
    """statekit's trajectory: [(param, slots)] after each step."""
    p, slots, k, out = P0.copy(), {}, 0, []
    for t in range(steps):
        p, slots, k = so.step(name, p, GRADS[t], slots, k, hp, flavor)
        out.append((p.copy(), {n: v.copy() for n, v in slots.items()}))
    return out


def assert_same(got, expected):
    """``got``: statekit's trajectory; ``expected``: per step (param list, {slot: list})."""
    for step, ((p, slots), (ep, eslots)) in enumerate(zip(got, expected, strict=True), 1):
        assert np.array_equal(bits(p), bits(ep)), f"param after step {step}: {p} != {ep}"
        assert set(slots) == set(eslots)
        for name in slots:
            assert np.array_equal(bits(slots[name]), bits(eslots[name])), f"{name} after step {step}"


@pytest.mark.parametrize("amsgrad", [False, True])
def test_burn_adam_l2(amsgrad):
    """burn Adam with L2 penalty: eps·sqrt(1-β2^t) in the denominator, f32 bias corrections."""
    lr, b1, b2, eps, lam = 0.01, f(0.9), f(0.999), f(1e-3), f(0.5)
    got = run("adam", {"lr": lr, "eps": 1e-3, "weight_decay": 0.5, "amsgrad": amsgrad})
    c1, c2 = f(ONE - b1), f(ONE - b2)
    p, m, v, vmax = list(P0), [None] * 4, [None] * 4, [None] * 4
    expected = []
    for t in (1, 2, 3):
        bc2_sqrt = f(np.sqrt(f(ONE - powi_f32(b2, t))))
        cf = f(bc2_sqrt / f(ONE - powi_f32(b1, t)))
        for i in range(4):
            g = f(f(p[i] * lam) + GRADS[t - 1][i])
            if t == 1:
                m[i], v[i] = f(g * c1), f(f(g * g) * c2)
                vmax[i] = v[i]
            else:
                m[i] = f(f(m[i] * b1) + f(g * c1))
                v[i] = f(f(v[i] * b2) + f(f(g * g) * c2))
                vmax[i] = max(vmax[i], v[i])
            used = vmax[i] if amsgrad else v[i]
            u = f(f(m[i] * cf) / f(f(np.sqrt(used)) + f(eps * bc2_sqrt)))
            p[i] = f(p[i] - f(u * f(lr)))
        slots = {"exp_avg": list(m), "exp_avg_sq": list(v)} | (
            {"max_exp_avg_sq": list(vmax)} if amsgrad else {}
        )
        expected.append((list(p), slots))
    assert_same(got, expected)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_burn_adamw(amsgrad):
    """burn AdamW: textbook bias correction, eps outside, p·(1 - lr·wd) with the factor from f64."""
    lr, b1, b2, eps, wd = 0.01, f(0.9), f(0.999), f(1e-3), f(0.5)
    got = run("adamw", {"lr": lr, "eps": 1e-3, "weight_decay": 0.5, "amsgrad": amsgrad})
    c1, c2 = f(ONE - b1), f(ONE - b2)
    decay = lr * float(wd)
    p, m, v, vmax = list(P0), [None] * 4, [None] * 4, [None] * 4
    expected = []
    for t in (1, 2, 3):
        bc1, bc2 = f(ONE - powi_f32(b1, t)), f(ONE - powi_f32(b2, t))
        for i in range(4):
            g = GRADS[t - 1][i]
            if t == 1:
                m[i], v[i] = f(g * c1), f(f(g * g) * c2)
                vmax[i] = v[i]
            else:
                m[i] = f(f(m[i] * b1) + f(g * c1))
                v[i] = f(f(v[i] * b2) + f(f(g * g) * c2))
                vmax[i] = max(vmax[i], v[i])
            m_hat = f(m[i] / bc1)
            v_hat = f((vmax[i] if amsgrad else v[i]) / bc2)
            u = f(m_hat / f(f(np.sqrt(v_hat)) + eps))
            p[i] = f(f(p[i] * f(1.0 - decay)) - f(u * f(lr)))
        slots = {"exp_avg": list(m), "exp_avg_sq": list(v)} | (
            {"max_exp_avg_sq": list(vmax)} if amsgrad else {}
        )
        expected.append((list(p), slots))
    assert_same(got, expected)


@pytest.mark.parametrize("nesterov", [False, True])
def test_burn_sgd_momentum_default_dampening(nesterov):
    """burn SGD + Momentum: dampening defaults to 0.1; first velocity = g; L2 penalty."""
    lr, mom, lam = 0.02, f(0.9), f(0.05)
    got = run("sgd", {"lr": lr, "momentum": 0.9, "weight_decay": 0.05, "nesterov": nesterov})
    damp = f(1.0 - 0.1)  # (1 - dampening) in f64, then f32
    p, vel = list(P0), [None] * 4
    expected = []
    for t in (1, 2, 3):
        for i in range(4):
            g = f(f(p[i] * lam) + GRADS[t - 1][i])
            vel[i] = g if t == 1 else f(f(g * damp) + f(vel[i] * mom))
            step = f(f(vel[i] * mom) + g) if nesterov else vel[i]
            p[i] = f(p[i] - f(step * f(lr)))
        expected.append((list(p), {"momentum_buffer": list(vel)}))
    assert_same(got, expected)


def test_burn_sgd_plain_has_no_state():
    """burn SGD without momentum: p - g·lr, no slots."""
    got = run("sgd", {"lr": 0.5})
    p, expected = list(P0), []
    for t in (1, 2, 3):
        p = [f(p[i] - f(GRADS[t - 1][i] * f(0.5))) for i in range(4)]
        expected.append((list(p), {}))
    assert_same(got, expected)


@pytest.mark.parametrize("centered", [False, True])
def test_burn_rmsprop_stores_avg(centered):
    """burn RMSProp (momentum 0.9 default, L2): ``avg`` is stored beside square_avg."""
    lr, alpha, eps, mom, lam = 0.01, f(0.99), f(1e-3), f(0.9), f(0.05)
    got = run("rmsprop", {"lr": lr, "eps": 1e-3, "weight_decay": 0.05, "centered": centered})
    c = f(ONE - alpha)
    p, sq, ga, avg, buf = list(P0), [None] * 4, [None] * 4, [None] * 4, [None] * 4
    expected = []
    for t in (1, 2, 3):
        for i in range(4):
            g = f(f(p[i] * lam) + GRADS[t - 1][i])
            sq[i] = f(f(g * g) * c) if t == 1 else f(f(sq[i] * alpha) + f(f(g * g) * c))
            if centered:
                ga[i] = f(g * c) if t == 1 else f(f(ga[i] * alpha) + f(g * c))
                avg[i] = f(sq[i] - f(ga[i] * ga[i]))
            else:
                avg[i] = sq[i]
            g_norm = f(g / f(f(np.sqrt(avg[i])) + eps))
            buf[i] = g_norm if t == 1 else f(f(buf[i] * mom) + g_norm)
            p[i] = f(p[i] - f(buf[i] * f(lr)))
        slots = {"square_avg": list(sq), "avg": list(avg), "momentum_buffer": list(buf)}
        expected.append((list(p), slots | ({"grad_avg": list(ga)} if centered else {})))
    assert_same(got, expected)


def test_burn_adagrad_lr_decay():
    """burn AdaGrad: sum starts at g², lr / (1 + (t-1)·lr_decay) in f64, L2 penalty."""
    lr, eps, lam, lr_decay = 0.01, f(1e-3), f(0.05), 0.5
    got = run("adagrad", {"lr": lr, "eps": 1e-3, "weight_decay": 0.05, "lr_decay": lr_decay})
    p, total = list(P0), [None] * 4
    expected = []
    for t in (1, 2, 3):
        new_lr = lr / (1.0 + (t - 1.0) * lr_decay)
        for i in range(4):
            g = f(f(p[i] * lam) + GRADS[t - 1][i])
            total[i] = f(g * g) if t == 1 else f(total[i] + f(g * g))
            p[i] = f(p[i] - f(f(g / f(f(np.sqrt(total[i])) + eps)) * f(new_lr)))
        expected.append((list(p), {"sum": list(total)}))
    assert_same(got, expected)


@pytest.mark.parametrize("no_prox", [False, True])
def test_burn_adan(no_prox):
    """burn Adan with weight decay 0.02: proximal (divide by 1 + lr·wd) or decoupled (no_prox)."""
    lr, b1, b2, b3, eps, wd = 0.01, f(0.98), f(0.92), f(0.99), f(1e-3), f(0.02)
    got = run("adan", {"lr": lr, "eps": 1e-3, "weight_decay": 0.02, "no_prox": no_prox})
    c1, c2, c3 = f(ONE - b1), f(ONE - b2), f(ONE - b3)
    decay = lr * float(wd)
    p, m, n, dm, npg = list(P0), [None] * 4, [None] * 4, [None] * 4, [None] * 4
    expected = []
    for t in (1, 2, 3):
        for i in range(4):
            g = GRADS[t - 1][i]
            if t == 1:
                m[i], n[i], dm[i] = f(g * c1), f(f(g * g) * c3), f(0.0)
            else:
                diff = f(npg[i] + g)
                q = f(f(diff * b2) + g)
                m[i] = f(f(m[i] * b1) + f(g * c1))
                dm[i] = f(f(dm[i] * b2) + f(diff * c2))
                n[i] = f(f(n[i] * b3) + f(f(q * q) * c3))
            npg[i] = f(g * f(-1.0))
            denom = f(f(f(np.sqrt(n[i])) / f(np.sqrt(f(ONE - powi_f32(b3, t))))) + eps)
            u = f(
                f(f(m[i] / f(ONE - powi_f32(b1, t))) / denom)
                + f(f(f(dm[i] * b2) / f(ONE - powi_f32(b2, t))) / denom)
            )
            delta = f(u * f(lr))
            if no_prox:
                p[i] = f(f(p[i] * f(1.0 - decay)) - delta)
            else:
                p[i] = f(f(p[i] - delta) / f(1.0 + decay))
        slots = {
            "exp_avg": list(m),
            "exp_avg_sq": list(n),
            "exp_avg_diff": list(dm),
            "neg_pre_grad": list(npg),
        }
        expected.append((list(p), slots))
    assert_same(got, expected)


def test_candle_adamw():
    """candle-nn AdamW: f64 scalars through affine (x·mul + add), global step, f64 powi."""
    lr, b1, b2, eps, wd = 0.004, 0.9, 0.999, 1e-8, 0.01
    p0 = P0.copy()
    p0[2] = -0.0  # with g = 0 below: candle's "+ 0.0" in every affine turns -0 into +0
    grads = GRADS.copy()
    grads[:, 2] = 0.0

    def affine(x, mul, add=0.0):
        return f(f(x * f(mul)) + f(add))

    p, m, v = list(p0), [f(0.0)] * 4, [f(0.0)] * 4
    expected = []
    for t in (1, 2, 3):
        scale_m = 1.0 / (1.0 - powi_f64(b1, t))
        scale_v = 1.0 / (1.0 - powi_f64(b2, t))
        for i in range(4):
            g = grads[t - 1][i]
            m[i] = f(affine(m[i], b1) + affine(g, 1.0 - b1))
            v[i] = f(affine(v[i], b2) + affine(f(g * g), 1.0 - b2))
            m_hat, v_hat = affine(m[i], scale_m), affine(v[i], scale_v)
            theta = affine(p[i], 1.0 - lr * wd)
            update = f(m_hat / affine(f(np.sqrt(v_hat)), 1.0, eps))
            p[i] = f(theta - affine(update, lr))
        expected.append((list(p), {"exp_avg": list(m), "exp_avg_sq": list(v)}))

    got, q, slots, k = [], p0.copy(), {}, 0
    for t in range(3):
        q, slots, k = so.step("adamw", q, grads[t], slots, k, {"lr": lr, "weight_decay": wd}, "candle")
        got.append((q.copy(), {n: s.copy() for n, s in slots.items()}))
    assert bits(got[0][0])[2] == 0  # +0.0, not -0.0
    assert_same(got, expected)


def test_candle_sgd():
    """candle-nn 0.11 SGD: ``var - grad * lr``, the product through affine (``g·f32(lr) + 0.0``)."""
    lr = 0.03
    p0 = P0.copy()
    p0[2] = -0.0  # with g = -0.0 below: candle's "+ 0.0" makes the update +0.0, and -0 - +0 stays -0
    grads = GRADS.copy()
    grads[:, 2] = -0.0

    def affine(x, mul, add=0.0):
        return f(f(x * f(mul)) + f(add))

    p, expected = list(p0), []
    for t in range(3):
        p = [f(p[i] - affine(grads[t][i], lr)) for i in range(4)]
        expected.append((list(p), {}))
    got, q, slots, k = [], p0.copy(), {}, 0
    for t in range(3):
        q, slots, k = so.step("sgd", q, grads[t], slots, k, {"lr": lr}, "candle")
        got.append((q.copy(), dict(slots)))
    assert bits(got[0][0])[2] == bits(f(-0.0))  # -0.0 - (+0.0); without the + 0.0 it would be +0.0
    assert_same(got, expected)
    for key, value in (("momentum", 0.9), ("weight_decay", 0.1), ("nesterov", True)):
        with pytest.raises(so.registry.UsageError, match=f"candle sgd cannot use {key}"):
            so.step("sgd", P0, GRADS[0], {}, 0, {"lr": lr, key: value}, "candle")


def test_burn_and_candle_report_bit_exact():
    assert so.exactness("burn", np, "adam") == so.BIT_EXACT
    assert so.exactness("candle") == so.BIT_EXACT
