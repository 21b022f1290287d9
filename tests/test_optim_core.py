"""statekit.optim without torch: exact FMA, powi, the registry, the block driver, the API."""

from __future__ import annotations

import importlib.util
from fractions import Fraction

import numpy as np
import pytest

import statekit.optim as so
from statekit.errors import UsageError
from statekit.optim import backend, fp, registry, tolerance

NP = so.get_backend(np)


def exact_fma32(x, y, z) -> np.ndarray:
    """Reference: x*y + z in rationals, rounded to float32 by picking the nearest neighbour."""
    out = []
    for a, b, c in zip(
        np.broadcast_to(x, np.shape(z)).tolist(),
        np.broadcast_to(y, np.shape(z)).tolist(),
        np.asarray(z).tolist(),
        strict=True,
    ):
        exact = Fraction(a) * Fraction(b) + Fraction(c)
        guess = np.float32(float(exact))
        candidates = [
            np.nextafter(guess, np.float32(-np.inf)),
            guess,
            np.nextafter(guess, np.float32(np.inf)),
        ]
        out.append(
            min(
                candidates,
                key=lambda r: (abs(Fraction(float(r)) - exact), int(np.float32(r).view(np.int32)) & 1),
            )
        )
    return np.array(out, dtype=np.float32)


def hard_fma_cases(n=3000, seed=7):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    cases = [
        (x, y, rng.standard_normal(n).astype(np.float32)),
        (x, y, -(x.astype(np.float64) * y).astype(np.float32)),  # cancellation
        # ties: 1 + (tiny product) lands on a float32 midpoint, the product's low bits decide
        (
            np.full(n, 2.0**-12, np.float32),
            ((1 + rng.integers(0, 2**10, n) * 2.0**-23) * 2.0**-12 * rng.choice([-1, 1], n)).astype(
                np.float32
            ),
            np.ones(n, np.float32),
        ),
        # results below float32's normal range
        (x * np.float32(1e-20), y * np.float32(1e-20), (rng.standard_normal(n) * 1e-39).astype(np.float32)),
    ]
    return cases


@pytest.mark.parametrize("case", range(4))
def test_fma32_is_correctly_rounded(case):
    x, y, z = hard_fma_cases()[case]
    expected = exact_fma32(x, y, z).view(np.int32)
    assert np.array_equal(NP.fma32(x, y, z).view(np.int32), expected)
    assert np.array_equal(fp.fma32(NP, x, y, z).view(np.int32), expected)


def test_fma32_with_scalar_operand():
    x, y, z = hard_fma_cases()[2]
    w = np.float32(0.1)
    expected = exact_fma32(np.full_like(y, w), y, z).view(np.int32)
    assert np.array_equal(NP.fma32(w, y, z).view(np.int32), expected)
    assert np.array_equal(NP.fma32(y, w, z).view(np.int32), expected)


def test_fma64():
    a, b = 1 + 2.0**-30, 1 - 2.0**-30
    assert a * b - 1.0 == 0.0
    assert fp.fma64(a, b, -1.0) == -(2.0**-60)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("beta", [0.9, 0.999, 0.98, 0.92])
def test_powi_is_rusts_repeated_squaring(dtype, beta):
    """libgcc's __powisf2 loop (the same products as compiler-builtins), written independently."""
    for n in range(1, 80):
        x, y, m = dtype(beta), dtype(beta) if n % 2 else dtype(1.0), n
        while m := m >> 1:
            x = dtype(x * x)
            if m % 2:
                y = dtype(y * x)
        assert fp.powi(beta, n, dtype) == float(y)
    assert fp.powi(2.0, -2, dtype) == 0.25


def test_powi_f32_differs_from_exact_power():
    """burn's 1 - 0.999^t in f32 is visibly off the f64 value (why burn ≠ torch by ~1e-5)."""
    t = 1000
    f32_value = 1 - np.float32(fp.powi(0.999, t))
    assert abs(f32_value - (1 - 0.999**t)) / (1 - 0.999**t) > 1e-6


def test_resolve_fills_framework_defaults():
    assert so.resolve("adam", "torch")["eps"] == 1e-8
    assert so.resolve("adam", "torch-fused")["eps"] == 1e-8
    assert so.resolve("adam", "burn", {"lr": 1e-3})["eps"] == 1e-5
    assert so.resolve("adamw", "torch")["weight_decay"] == 1e-2
    assert so.resolve("adamw", "burn", {"lr": 1e-3})["weight_decay"] == 1e-4
    assert so.resolve("sgd", "burn", {"lr": 1e-3})["dampening"] == 0.1
    assert so.resolve("rmsprop", "burn", {"lr": 1e-3})["momentum"] == 0.9
    assert so.resolve("adan", "burn", {"lr": 1e-3})["beta3"] == 0.99
    assert so.resolve("adamw", "candle")["decoupled_weight_decay"] is True


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("adam", "burn", {}), "needs lr"),
        (("adam", "torch", {"betas": (0.9, 0.99)}), "unknown adam hyperparameters"),
        (("adam", "burn", {"lr": 1.0, "maximize": True}), "cannot use maximize"),
        (("adamw", "candle", {"amsgrad": True}), "cannot use amsgrad"),
        (("adagrad", "burn", {"lr": 1.0, "initial_accumulator_value": 0.1}), "cannot use initial"),
        (("adan", "torch", {}), "no 'torch' flavor"),
        (("rmsprop", "torch-fused", {}), "no 'torch-fused' flavor"),
        (("lion", "torch", {}), "no 'torch' flavor"),
        (("prodigy", "torch", {}), "unknown optimizer"),
    ],
)
def test_resolve_refuses(args, message):
    with pytest.raises(UsageError, match=message):
        so.resolve(*args)


def test_registry_table():
    # other optimizers join the table (torch's NAdam, RAdam, … in tests/test_optim_torch_db.py)
    assert {"adam", "adamw", "sgd", "rmsprop", "adagrad", "adan", "nadam", "radam", "adamax",
            "lamb", "lion", "adafactor", "muon"} <= set(so.ALGORITHMS)
    assert so.ALGORITHMS["adamw"].flavors == ("torch-fused", "torch", "burn", "candle", "megatron")
    for algo in so.ALGORITHMS.values():
        assert {registry.FRAMEWORK_OF[fl] for fl in algo.flavors} == set(algo.frameworks)
        names = {fw: set(f.defaults) for fw, f in algo.frameworks.items()}
        # burn's Adafactor and Muon have switches torch's lack (epsilon_1 added to g², relative-step /
        # parameter-scaling, Muon's dampening): burn's column holds torch's names and those
        burn_only = {"adafactor": {"epsilon_1", "epsilon_2", "relative_step", "scale_parameter"},
                     "muon": {"dampening"}}.get(algo.name)
        if burn_only:
            assert names["burn"] == names["torch"] | burn_only, algo.name
            continue
        first = next(iter(names.values()))
        assert all(n == first for n in names.values()), f"{algo.name}: frameworks disagree on names"


@pytest.mark.parametrize(
    ("name", "flavor", "hp", "slots"),
    [
        ("adam", "torch", {}, ("exp_avg", "exp_avg_sq")),
        ("adamw", "torch-fused", {"amsgrad": True}, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
        ("sgd", "torch", {}, ()),
        ("sgd", "burn", {"lr": 1, "momentum": 0.9}, ("momentum_buffer",)),
        (
            "rmsprop",
            "torch",
            {"centered": True, "momentum": 0.5},
            ("square_avg", "grad_avg", "momentum_buffer"),
        ),
        ("rmsprop", "burn", {"lr": 1}, ("square_avg", "avg", "momentum_buffer")),
        ("adagrad", "torch", {}, ("sum",)),
        ("adan", "burn", {"lr": 1}, ("exp_avg", "exp_avg_sq", "exp_avg_diff", "neg_pre_grad")),
    ],
)
def test_slot_names(name, flavor, hp, slots):
    assert so.slot_names(name, flavor, hp) == slots


def _problem(n=4099, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n).astype(np.float32), (rng.standard_normal(n) * 1e-2).astype(np.float32)


@pytest.mark.parametrize("block", [24, 40, 4096])
@pytest.mark.parametrize("n", [13, 4099])
def test_block_size_does_not_change_results(monkeypatch, block, n):
    """torch-fused's scalar tail is the whole tensor's last numel % 8, whatever the blocking."""
    p, g = _problem(n)
    hp = {"amsgrad": True, "weight_decay": 0.1}
    reference, ref_slots, _ = so.step("adamw", p, g, {}, 0, hp, "torch-fused")
    reference, ref_slots, _ = so.step("adamw", reference, g, ref_slots, 1, hp, "torch-fused")
    monkeypatch.setattr(backend.Backend, "block", block)
    q, slots, _ = so.step("adamw", p, g, {}, 0, hp, "torch-fused")
    q, slots, _ = so.step("adamw", q, g, slots, 1, hp, "torch-fused")
    assert np.array_equal(q.view(np.int32), reference.view(np.int32))
    for name in slots:
        assert np.array_equal(slots[name].view(np.int32), ref_slots[name].view(np.int32))


def test_vector_width_moves_the_tail():
    """Only the last numel % width elements take the scalar tail's contraction."""
    n = 173  # 173 % 8 == 5, 173 % 16 == 13
    p, g = _problem(n)
    state = {"exp_avg": np.zeros(n, np.float32), "exp_avg_sq": np.full(n, 0.01, np.float32)}
    v = {
        w: so.step("adam", p, g, state, 5, None, "torch-fused", vector_width=w)[1]["exp_avg_sq"].view(
            np.int32
        )
        for w in (1, 8, 16)
    }
    assert np.array_equal(v[8][:168], v[1][:168])  # vector body in both
    assert np.array_equal(v[8][168:], v[16][168:])  # scalar tail in both
    assert not np.array_equal(v[8][160:168], v[16][160:168])  # body for 8, tail for 16
    assert not np.array_equal(v[8][168:], v[1][168:])  # tail for 8, body for 1
    with pytest.raises(UsageError, match="vector_width"):
        so.step("adam", p, g, {}, 0, None, "torch-fused", vector_width=12)


def test_not_inplace_leaves_inputs_alone():
    p, g = _problem(100)
    slots = {"exp_avg": np.ones(100, np.float32), "exp_avg_sq": np.ones(100, np.float32)}
    before = (p.copy(), {k: v.copy() for k, v in slots.items()})
    new_p, new_slots, new_step = so.step("adam", p, g, slots, 7)
    assert new_step == 8
    assert np.array_equal(p, before[0]) and all(np.array_equal(slots[k], before[1][k]) for k in slots)
    assert not np.array_equal(new_p, p)
    assert new_slots["exp_avg"] is not slots["exp_avg"]


def test_inplace_updates_the_callers_arrays():
    p, g = _problem(100)
    p2 = p.reshape(10, 10).copy()
    slots = {"exp_avg": np.zeros((10, 10), np.float32), "exp_avg_sq": np.zeros((10, 10), np.float32)}
    expected, expected_slots, _ = so.step("adam", p2, g.reshape(10, 10), {}, 0)
    out, out_slots, _ = so.step("adam", p2, g.reshape(10, 10), slots, 0, inplace=True)
    assert out.shape == (10, 10) and np.shares_memory(out, p2)
    assert np.array_equal(p2, expected) and np.array_equal(slots["exp_avg"], expected_slots["exp_avg"])
    with pytest.raises(UsageError, match="inplace"):
        so.step("adam", p.astype(np.float64), g, {}, 0, inplace=True)


def test_shapes_and_slots_are_checked():
    p, g = _problem(100)
    with pytest.raises(UsageError, match="gradient shape"):
        so.step("adam", p, g[:50], {}, 0)
    with pytest.raises(UsageError, match="exp_avg"):
        so.step("adam", p, g, {"exp_avg": np.zeros(99, np.float32)}, 0)
    with pytest.raises(UsageError, match="unexpected optimizer state"):
        so.step("adam", p, g, {"momentum_buffer": np.zeros(100, np.float32)}, 0)


def test_first_step_semantics():
    p, g = _problem(50)
    # torch SGD: a missing buffer becomes a copy of the gradient
    _, slots, _ = so.step("sgd", p, g, {}, 0, {"lr": 0.1, "momentum": 0.9})
    assert np.array_equal(slots["momentum_buffer"], g)
    # burn: step 0 is "no state"; whatever slots are given are not read
    junk = {"exp_avg": np.full(50, 9.0, np.float32), "exp_avg_sq": np.full(50, 9.0, np.float32)}
    a = so.step("adam", p, g, junk, 0, {"lr": 1e-3}, "burn")
    b = so.step("adam", p, g, {}, 0, {"lr": 1e-3}, "burn")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1]["exp_avg"], b[1]["exp_avg"])
    # torch Adagrad: a missing sum starts at initial_accumulator_value
    one = so.step("adagrad", p, np.zeros_like(g), {}, 0, {"initial_accumulator_value": 0.5})
    assert np.all(one[1]["sum"] == 0.5)


def test_exactness(monkeypatch):
    assert so.exactness("torch-fused") == so.BIT_EXACT
    assert so.exactness("burn", np, "adam") == so.BIT_EXACT
    assert so.exactness("torch", np, "sgd") == so.BIT_EXACT
    monkeypatch.setattr(registry, "torch_available", lambda: False)
    assert so.exactness("torch", np, "adam") == so.TOLERANCE
    with pytest.raises(UsageError, match="unknown flavor"):
        so.exactness("jax")


def test_get_backend():
    assert so.get_backend().name == "numpy"
    assert so.get_backend(like=np.zeros(3)).name == "numpy"
    assert so.get_backend("np").name == "numpy"
    with pytest.raises(UsageError, match="unknown array namespace"):
        so.get_backend("jax")
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(UsageError, match="not installed"):
            so.get_backend("cupy")


def test_tolerance_bounds():
    ref = np.array([1.0, -2.0, 0.0], np.float32)
    bound = tolerance.param_bound(ref, lr=1e-3, steps=10)
    assert np.allclose(bound, 4 * np.spacing(np.abs(ref)).astype(np.float64) + 2e-7)
    assert tolerance.worst_ratio(ref + bound / 2, ref, bound) <= 0.5 + 1e-9
    assert tolerance.exp_avg_bound(ref)[2] == pytest.approx(2e-5 + 4 * float(np.spacing(np.float32(0))))
    assert tolerance.exp_avg_sq_bound(ref)[0] == pytest.approx(5e-5 + 4 * 2.0**-23)
    assert tolerance.worst_ratio(np.zeros(0), np.zeros(0), np.zeros(0)) == 0.0


@pytest.mark.parametrize(
    ("name", "hp", "flavor"),
    [
        ("adamw", {"amsgrad": True, "weight_decay": 0.1}, "torch-fused"),
        ("rmsprop", {"centered": True, "momentum": 0.9}, "torch"),
        ("adan", {"lr": 1e-2}, "burn"),
    ],
)
def test_cupy_code_path_with_numpy_standing_in(name, hp, flavor):
    """The CuPy backend's generic arithmetic (float64 root, generic FMA) on numpy gives numpy's bits.

    (numpy has every function CuPy's backend calls; no GPU is needed to check the logic.)
    """
    standin = backend.CupyBackend(np)
    p, g = _problem(1000)
    ref, ref_slots, _ = so.step(name, p, g, {}, 0, hp, flavor)
    ref, ref_slots, _ = so.step(name, ref, g, ref_slots, 1, hp, flavor)
    out, slots, _ = so.step(name, p, g, {}, 0, hp, flavor, standin)
    out, slots, _ = so.step(name, out, g, slots, 1, hp, flavor, standin, inplace=True)
    same = np.array_equal(out.view(np.int32), ref.view(np.int32))
    # the torch flavor's root is the namespace's own there (not torch's MKL): tolerance only
    assert same or so.exactness(flavor, standin, name) == so.TOLERANCE
    if flavor != "torch":
        for slot in slots:
            assert np.array_equal(slots[slot].view(np.int32), ref_slots[slot].view(np.int32))
