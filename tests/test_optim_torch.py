"""statekit.optim replays against real torch 2.13 optimizers on CPU.

Every test states what it asserts: ``bit-exact`` (float32 bit patterns equal after every step)
or ``tolerance`` (within :mod:`statekit.optim.tolerance`).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

import statekit.optim as so
from statekit.optim import backend, registry, tolerance
from statekit.optim.fp import fma64

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """torch on one thread: results do not depend on it (fused chunks are multiples of 16
    floats, the other kernels are element-wise), and a busy 2-core runner spends seconds
    waking OpenMP workers for tensors this small."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# sizes not divisible by 8 or 16 (torch's fused tail), tiny and multi-dimensional ones
SHAPES = [(1,), (7,), (13,), (16, 4), (3, 5, 7), (1000,), (4099,)]
STEPS = 50


def bits(array) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(array, dtype=np.float32)).view(np.int32)


def make_problem(seed: int, steps: int = STEPS, zeros: float = 0.02):
    """Initial parameters and a gradient stream: scales 1e-3..10, some exact zeros."""
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
    grads = []
    for _ in range(steps):
        scale = np.float32(10 ** rng.uniform(-3, 1))
        grads.append(
            [
                (rng.standard_normal(p.shape) * scale * (rng.random(p.shape) > zeros)).astype(np.float32)
                for p in params
            ]
        )
    return params, grads


def compare_run(torch_cls, torch_kwargs, name, hp, flavor, seed=0, xp=None, steps=STEPS):
    """Run torch and statekit side by side; return the worst mismatch count seen at any step."""
    params, grads = make_problem(seed, steps)
    tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
    opt = torch_cls(tparams, **torch_kwargs)
    convert = (lambda a: torch.from_numpy(a.copy())) if xp == "torch" else (lambda a: a)
    ours = [(convert(p), {}, 0) for p in params]
    for step_grads in grads:
        for tp, g in zip(tparams, step_grads, strict=True):
            tp.grad = torch.from_numpy(g.copy())
        opt.step()
        ours = [
            so.step(name, p, convert(g), s, k, hp, flavor, xp)
            for (p, s, k), g in zip(ours, step_grads, strict=True)
        ]
        for (p, slots, _), tp in zip(ours, tparams, strict=True):
            assert np.array_equal(bits(p), bits(tp.detach())), f"param differs after step {ours[0][2]}"
            state = opt.state[tp]
            assert set(slots) <= set(state)
            for slot, value in slots.items():
                assert np.array_equal(bits(value), bits(state[slot])), (
                    f"{slot} differs after step {ours[0][2]}"
                )


ADAM_CONFIGS = {
    "adam": (torch.optim.Adam, {}, "adam", {}),
    "adam-l2": (
        torch.optim.Adam,
        {"lr": 3e-2, "weight_decay": 0.1},
        "adam",
        {"lr": 3e-2, "weight_decay": 0.1},
    ),
    "adamw": (torch.optim.AdamW, {}, "adamw", {}),
    "adamw-betas": (
        torch.optim.AdamW,
        {"lr": 3e-2, "weight_decay": 0.1, "betas": (0.8, 0.99), "eps": 1e-6},
        "adamw",
        {"lr": 3e-2, "weight_decay": 0.1, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6},
    ),
    "adam-amsgrad": (torch.optim.Adam, {"amsgrad": True}, "adam", {"amsgrad": True}),
    "adamw-amsgrad-maximize": (
        torch.optim.AdamW,
        {"amsgrad": True, "maximize": True},
        "adamw",
        {"amsgrad": True, "maximize": True},
    ),
    "adam-maximize-l2": (
        torch.optim.Adam,
        {"maximize": True, "weight_decay": 0.05},
        "adam",
        {"maximize": True, "weight_decay": 0.05},
    ),
    # 1 - beta1 >= 0.5: torch's lerp takes its other branch
    "adam-small-beta1": (torch.optim.Adam, {"betas": (0.3, 0.999)}, "adam", {"beta1": 0.3}),
}


@pytest.mark.parametrize("config", ADAM_CONFIGS)
def test_fused_adam_bit_exact(config):
    """bit-exact: torch-fused (pure numpy) == torch.optim.Adam/AdamW(fused=True), 50 steps."""
    cls, kwargs, name, hp = ADAM_CONFIGS[config]
    assert so.exactness("torch-fused", np, name) == so.BIT_EXACT
    compare_run(cls, kwargs | {"fused": True}, name, hp, "torch-fused")


@pytest.mark.parametrize("config", ADAM_CONFIGS)
def test_torch_adam_bit_exact_with_torch_sqrt(config):
    """bit-exact: torch flavor (numpy + torch's CPU sqrt) == Adam/AdamW(foreach=False), 50 steps."""
    cls, kwargs, name, hp = ADAM_CONFIGS[config]
    assert so.exactness("torch", np, name) == so.BIT_EXACT
    compare_run(cls, kwargs | {"foreach": False}, name, hp, "torch")


def test_torch_adam_foreach_is_the_same_reference():
    """bit-exact: the torch flavor also equals foreach=True (identical to foreach=False on CPU)."""
    cls, kwargs, name, hp = ADAM_CONFIGS["adamw-betas"]
    compare_run(cls, kwargs | {"foreach": True}, name, hp, "torch", steps=10)


def test_torch_adam_without_torch_sqrt_is_within_tolerance(monkeypatch):
    """tolerance: with the IEEE root (torch absent) the torch flavor stays within the bound."""
    monkeypatch.setattr(backend, "torch_available", lambda: False)
    monkeypatch.setattr(registry, "torch_available", lambda: False)
    assert so.exactness("torch", np, "adam") == so.TOLERANCE
    assert so.exactness("torch", np, "sgd") == so.BIT_EXACT
    params, grads = make_problem(1)
    lr = 3e-2
    tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
    opt = torch.optim.Adam(tparams, lr=lr, foreach=False)
    ours = [(p, {}, 0) for p in params]
    differs = 0
    for step_grads in grads:
        for tp, g in zip(tparams, step_grads, strict=True):
            tp.grad = torch.from_numpy(g.copy())
        opt.step()
        ours = [
            so.step("adam", p, g, s, k, {"lr": lr}, "torch")
            for (p, s, k), g in zip(ours, step_grads, strict=True)
        ]
    for (p, slots, n), tp in zip(ours, tparams, strict=True):
        ref = tp.detach().numpy()
        differs += int((bits(p) != bits(ref)).sum())
        assert tolerance.worst_ratio(p, ref, tolerance.param_bound(ref, lr, n)) <= 1
        state = opt.state[tp]
        assert (
            tolerance.worst_ratio(
                slots["exp_avg"], state["exp_avg"], tolerance.exp_avg_bound(state["exp_avg"])
            )
            <= 1
        )
        assert (
            tolerance.worst_ratio(
                slots["exp_avg_sq"], state["exp_avg_sq"], tolerance.exp_avg_sq_bound(state["exp_avg_sq"])
            )
            <= 1
        )
    assert differs > 0  # MKL's root really is different: the test exercises the tolerance


def test_fused_adamw_decay_factor_is_contracted():
    """bit-exact: fused AdamW rounds fma(-lr, wd, 1) to float32; the for-loop rounds 1 - lr*wd.

    The lr below is chosen so that the two differ after rounding to float32.
    """
    lr, wd = _decay_split()
    for flavor, kwargs in [("torch-fused", {"fused": True}), ("torch", {"foreach": False})]:
        param = torch.nn.Parameter(torch.ones(13))
        opt = torch.optim.AdamW([param], lr=lr, weight_decay=wd, **kwargs)
        param.grad = torch.zeros(13)
        opt.step()
        ours, _, _ = so.step(
            "adamw",
            np.ones(13, np.float32),
            np.zeros(13, np.float32),
            {},
            0,
            {"lr": lr, "weight_decay": wd},
            flavor,
        )
        assert np.array_equal(bits(ours), bits(param.detach())), flavor
    assert np.float32(1 - lr * wd) != np.float32(fma64(-lr, wd, 1.0))


def _decay_split():
    """(lr, wd) with f32(1 - lr*wd) != f32(fma(-lr, wd, 1)): lr*wd just past a double tie."""
    wd = 0.1
    target = Fraction(2 * 100 + 1, 2**25) + Fraction(1, 2**54)  # 1 - target: a float32 tie, nudged
    lr0 = float(target / Fraction(wd))
    for i in range(-200, 200):
        lr = lr0 + i * math.ulp(lr0)
        if np.float32(1 - lr * wd) != np.float32(fma64(-lr, wd, 1.0)):
            return lr, wd
    raise AssertionError("no lr found")


SGD_CONFIGS = {
    "plain": {"lr": 0.05},
    "momentum": {"lr": 0.1, "momentum": 0.9},
    "dampening": {"lr": 0.1, "momentum": 0.9, "dampening": 0.3},
    "nesterov-wd": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
    "maximize-wd": {"lr": 0.05, "momentum": 0.5, "dampening": 0.25, "maximize": True, "weight_decay": 0.2},
}


@pytest.mark.parametrize("config", SGD_CONFIGS)
@pytest.mark.parametrize(
    ("flavor", "kwargs"), [("torch", {"foreach": False}), ("torch-fused", {"fused": True})]
)
def test_sgd_bit_exact(config, flavor, kwargs):
    """bit-exact: SGD torch flavor == foreach=False, torch-fused == fused=True (no sqrt: always)."""
    hp = SGD_CONFIGS[config]
    assert so.exactness(flavor, np, "sgd") == so.BIT_EXACT
    compare_run(torch.optim.SGD, hp | kwargs, "sgd", hp, flavor, steps=30)


RMSPROP_CONFIGS = {
    "plain": {"lr": 1e-2},
    "centered-momentum-wd": {"lr": 1e-2, "centered": True, "momentum": 0.9, "weight_decay": 0.1},
    "maximize-momentum": {"lr": 1e-3, "momentum": 0.5, "maximize": True},
    # 1 - alpha >= 0.5: the centered grad_avg lerp takes torch's other branch
    "centered-small-alpha": {"lr": 1e-3, "centered": True, "alpha": 0.3},
}


@pytest.mark.parametrize("config", RMSPROP_CONFIGS)
def test_rmsprop_bit_exact_with_torch_sqrt(config):
    """bit-exact: RMSprop torch flavor (torch's CPU sqrt) == foreach=False, 30 steps."""
    hp = RMSPROP_CONFIGS[config]
    assert so.exactness("torch", np, "rmsprop") == so.BIT_EXACT
    compare_run(torch.optim.RMSprop, hp | {"foreach": False}, "rmsprop", hp, "torch", steps=30)


ADAGRAD_CONFIGS = {
    "plain": {"lr": 0.1},
    "decay-wd-init": {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1, "initial_accumulator_value": 0.1},
    "maximize": {"lr": 0.05, "maximize": True, "eps": 1e-6},
}


@pytest.mark.parametrize("config", ADAGRAD_CONFIGS)
@pytest.mark.parametrize(
    ("flavor", "kwargs"), [("torch", {"foreach": False}), ("torch-fused", {"fused": True})]
)
def test_adagrad_bit_exact(config, flavor, kwargs):
    """bit-exact: Adagrad torch flavor (torch's sqrt) == foreach=False; torch-fused == fused=True."""
    hp = ADAGRAD_CONFIGS[config]
    assert so.exactness(flavor, np, "adagrad") == so.BIT_EXACT
    compare_run(torch.optim.Adagrad, hp | kwargs, "adagrad", hp, flavor, steps=30)


@pytest.mark.parametrize(
    ("name", "hp", "flavor"),
    [
        ("adamw", {"amsgrad": True, "weight_decay": 0.1, "maximize": True}, "torch-fused"),
        ("adam", {"weight_decay": 0.1, "beta1": 0.3}, "torch"),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}, "torch-fused"),
        ("rmsprop", {"centered": True, "momentum": 0.9}, "torch"),
        ("adagrad", {"lr_decay": 0.01, "initial_accumulator_value": 0.1}, "torch-fused"),
        ("adamw", {"lr": 1e-3, "amsgrad": True}, "burn"),
        ("adamw", {}, "candle"),
        ("adan", {"lr": 1e-2, "weight_decay": 0.02}, "burn"),
    ],
)
def test_torch_namespace_gives_numpy_bits(name, hp, flavor):
    """bit-exact: the same replay on torch CPU tensors and on numpy arrays, 10 steps."""
    params, grads = make_problem(3, steps=10)
    run_np = [(p, {}, 0) for p in params]
    run_t = [(torch.from_numpy(p.copy()), {}, 0) for p in params]
    for step_grads in grads:
        run_np = [
            so.step(name, p, g, s, k, hp, flavor) for (p, s, k), g in zip(run_np, step_grads, strict=True)
        ]
        run_t = [
            so.step(name, p, torch.from_numpy(g), s, k, hp, flavor, torch)
            for (p, s, k), g in zip(run_t, step_grads, strict=True)
        ]
    for (p, s, _), (pt, st, _) in zip(run_np, run_t, strict=True):
        assert isinstance(pt, torch.Tensor)
        assert np.array_equal(bits(p), bits(pt))
        for slot in s:
            assert np.array_equal(bits(s[slot]), bits(st[slot]))
    assert so.exactness(flavor, torch, name) == so.BIT_EXACT


def test_torch_namespace_matches_real_fused_adam():
    """bit-exact: torch-fused on torch CPU tensors == torch fused Adam (amsgrad, L2), 50 steps."""
    cls, kwargs, name, hp = ADAM_CONFIGS["adam-amsgrad"]
    compare_run(
        cls,
        kwargs | {"fused": True, "weight_decay": 0.1},
        name,
        hp | {"weight_decay": 0.1},
        "torch-fused",
        xp="torch",
    )
