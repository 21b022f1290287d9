"""The numpy reference's fast paths give the bits of its plain forms.

* blocks and threads (:mod:`statekit.optim.driver`): any block size and thread count gives the
  bits of one block on one thread, on sizes around the block (1, block - 1, block, block + 1,
  not a multiple of it) and with torch-fused's scalar tail;
* the exact FMA (:meth:`Backend.fma32`) writing into one of its own operands, and the sums just
  under float32's smallest normal number (hand-derived cases, checked with rationals);
* candle's AdamW without the ``+ 0.0`` / ``* 1.0`` that cannot change a bit, against the
  literal formulas on signed zeros, subnormals, infinities and NaNs;
* the torch flavor's square root: torch held at one thread for the step, and given back.
"""

from __future__ import annotations

import types
from fractions import Fraction

import numpy as np
import pytest

import statekit.optim as so
from statekit.errors import UsageError
from statekit.optim import adam, backend, cupy_kernels, driver

NP = so.get_backend(np)
FLAVORS = [("torch-fused", "adamw", {"weight_decay": 0.1, "amsgrad": True}), ("torch-fused", "adam", {}),
           ("torch", "adam", {"weight_decay": 0.1}), ("burn", "adam", {"lr": 1e-3}),
           ("burn", "adamw", {"lr": 1e-2, "weight_decay": 0.1}), ("candle", "adamw", {}),
           ("candle", "adamw", {"lr": 3e-2, "weight_decay": 0.1})]


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.int32)


def _steps(name, flavor, hp, n, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n, dtype=np.float32)
    slots, k = {}, 0
    for _ in range(steps):
        g = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2)
        g[rng.random(n) < 0.05] = 0
        p, slots, k = so.step(name, p, g, slots, k, hp, flavor)
    return p, slots


@pytest.mark.parametrize(("flavor", "name", "hp"), FLAVORS)
@pytest.mark.parametrize("workers", [2, 3])
def test_blocks_and_threads_do_not_change_bits(monkeypatch, flavor, name, hp, workers):
    block = 64
    sizes = [1, block - 1, block, block + 1, 5 * block - 3, 7 * block + 5, 13 * block]
    for n in sizes:
        monkeypatch.setattr(backend.Backend, "block", 1 << 20)  # one block, one thread
        monkeypatch.setenv("STATEKIT_THREADS", "1")
        expected, expected_slots = _steps(name, flavor, hp, n)
        monkeypatch.setattr(backend.Backend, "block", block)
        monkeypatch.setenv("STATEKIT_THREADS", str(workers))
        got, slots = _steps(name, flavor, hp, n)
        assert np.array_equal(bits(got), bits(expected)), (flavor, name, n)
        for slot in expected_slots:
            assert np.array_equal(bits(slots[slot]), bits(expected_slots[slot])), (flavor, name, n, slot)


def test_every_block_runs_once_on_the_workers(monkeypatch):
    """Blocks taken from the shared counter: each start exactly once, the last one short."""
    monkeypatch.setenv("STATEKIT_THREADS", "3")
    monkeypatch.setattr(backend.Backend, "block", 10)
    seen = []

    def kernel(p, g, s, tail):
        seen.append((int(p[0]), p.shape[0], tail))

    p = np.arange(95, dtype=np.float32)
    driver.run(NP, kernel, p, p, {}, tail=3)
    body = sorted(x for x in seen if not x[2])
    assert body == [(i, 10, False) for i in range(0, 90, 10)] + [(90, 2, False)]
    assert [x for x in seen if x[2]] == [(92, 3, True)]


def test_a_failing_block_fails_the_step(monkeypatch):
    monkeypatch.setenv("STATEKIT_THREADS", "2")
    monkeypatch.setattr(backend.Backend, "block", 4)

    def kernel(p, g, s, tail):
        if p[0] == 40:
            raise ValueError("block 40")

    p = np.arange(100, dtype=np.float32)
    with pytest.raises(ValueError, match="block 40"):
        driver.run(NP, kernel, p, p, {})


# ------------------------------------------------------------------------------ exact FMA


def nearest_float32(exact: Fraction) -> np.float32:
    """``exact`` rounded to float32, ties to even (checked against both neighbours)."""
    guess = np.float32(float(exact))
    around = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(around, key=lambda r: (abs(Fraction(float(r)) - exact), int(np.float32(r).view(np.int32)) & 1))


def test_fma32_just_under_the_smallest_normal():
    """x*y + z lands, in float64, exactly on the midpoint between float32's largest subnormal
    and 2**-126 while the exact value is below it: the float32 result is the subnormal.

    x = (1 + 2**-23) 2**-75, y = (1 - 2**-23) 2**-75: x*y = 2**-150 - 2**-196 (exact in
    float64); z = 2**-126 - 2**-149. The exact sum 2**-126 - 2**-150 - 2**-196 rounds in
    float64 (ulp 2**-179) to the midpoint 2**-126 - 2**-150, whose float32 rounding (to even)
    would be 2**-126; the nearest float32 to the exact sum is 2**-126 - 2**-149.
    """
    x = np.array([(1 + 2**-23) * 2.0**-75], np.float32)
    y = np.array([(1 - 2**-23) * 2.0**-75], np.float32)
    z = np.array([2.0**-126 - 2.0**-149], np.float32)
    exact = Fraction(float(x[0])) * Fraction(float(y[0])) + Fraction(float(z[0]))
    assert exact == Fraction(2) ** -126 - Fraction(2) ** -150 - Fraction(2) ** -196
    assert float(np.float64(x[0]) * np.float64(y[0]) + np.float64(z[0])) == 2.0**-126 - 2.0**-150
    want = np.float32(2.0**-126 - 2.0**-149)
    assert nearest_float32(exact) == want
    for sign in (1, -1):
        got = NP.fma32(x * np.float32(sign), y, z * np.float32(sign))
        assert bits(got)[0] == bits(want * np.float32(sign)), sign


def test_fma32_tiny_candidate_beside_a_nan():
    """A NaN in the block does not hide the subnormal candidate next to it."""
    x = np.array([(1 + 2**-23) * 2.0**-75, 1.0, 2.0], np.float32)
    y = np.array([(1 - 2**-23) * 2.0**-75, 1.0, 3.0], np.float32)
    z = np.array([2.0**-126 - 2.0**-149, np.nan, 1.0], np.float32)
    got = NP.fma32(x, y, z)
    assert bits(got)[0] == bits(np.float32(2.0**-126 - 2.0**-149)) and np.isnan(got[1]) and got[2] == 7.0


@pytest.mark.parametrize("into", ["x", "y", "z", "fresh"])
def test_fma32_into_an_operand(into):
    """``out`` may be any operand: ties and subnormal sums (the exact path) included."""
    rng = np.random.default_rng(3)
    n = 2000
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    z = rng.standard_normal(n).astype(np.float32)
    # ties: 1 + a tiny product lands on a float32 midpoint; subnormal results; zeros
    x[:100], y[:100], z[:100] = 2.0**-12, ((1 + rng.integers(0, 2**10, 100) * 2.0**-23) * 2.0**-12), 1.0
    x[100:200] *= np.float32(1e-20)
    y[100:200] *= np.float32(1e-20)
    z[100:200] = (rng.standard_normal(100) * 1e-39).astype(np.float32)
    x[200:220] = 0
    z[210:220] = 0
    expected = np.array([nearest_float32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))
                         for a, b, c in zip(x, y, z, strict=True)], np.float32)
    operands = {"x": x.copy(), "y": y.copy(), "z": z.copy()}
    out = operands[into] if into != "fresh" else np.empty(n, np.float32)
    got = NP.fma32(operands["x"], operands["y"], operands["z"], out=out)
    assert got is out
    assert np.array_equal(bits(out), bits(expected))
    w = np.float32(0.1)  # a scalar operand, the result into z (torch's lerp)
    zz = z.copy()
    NP.fma32(w, y, zz, out=zz)
    want = np.array([nearest_float32(Fraction(float(w)) * Fraction(float(b)) + Fraction(float(c)))
                     for b, c in zip(y, z, strict=True)], np.float32)
    assert np.array_equal(bits(zz), bits(want))


@pytest.mark.parametrize("case", ["positive", "one negative", "one tiny", "nan beside tiny", "all nan", "tie"])
def test_fma32_positive_hint_never_changes_a_bit(case):
    """``positive=True`` (Adam's second moment) only reorders the tiny test: a block with a
    negative, a subnormal, a NaN next to a subnormal, only NaNs or a float64 tie gives the
    correctly rounded result, bit for bit the same as without the hint."""
    rng = np.random.default_rng(5)
    n = 300
    x = np.abs(rng.standard_normal(n)).astype(np.float32)
    y = np.abs(rng.standard_normal(n)).astype(np.float32)
    z = np.abs(rng.standard_normal(n)).astype(np.float32)
    if case == "one negative":
        z[7] = -50.0
    if case in ("one tiny", "nan beside tiny"):  # the hand-derived case just under 2**-126
        x[7], y[7], z[7] = (1 + 2**-23) * 2.0**-75, (1 - 2**-23) * 2.0**-75, 2.0**-126 - 2.0**-149
    if case == "nan beside tiny":
        z[8] = np.nan
    if case == "all nan":
        z[:] = np.nan
    if case == "tie":  # the float64 sum 1 + 2**-23 + 2**-24 - 2**-70 rounds onto a float32 midpoint
        x[7], y[7], z[7] = 1 + 2.0**-23, (1 - 2.0**-23) * 2.0**-24, 1 + 2.0**-23
    expected = np.array([nearest_float32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))
                         if np.isfinite(c) else np.nan for a, b, c in zip(x, y, z, strict=True)], np.float32)
    plain = NP.fma32(x, y, z)
    hinted = NP.fma32(x, y, z, positive=True)
    assert np.array_equal(bits(hinted), bits(plain))
    assert np.array_equal(np.isnan(hinted), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert np.array_equal(bits(hinted[finite]), bits(expected[finite]))
    if case in ("one tiny", "nan beside tiny"):
        assert bits(hinted)[7] == bits(np.float32(2.0**-126 - 2.0**-149))
    if case == "tie":  # the exact sum is under the midpoint: not the even neighbour 1 + 2**-22
        assert float(np.float64(x[7]) * np.float64(y[7]) + np.float64(z[7])) == 1 + 2.0**-23 + 2.0**-24
        assert hinted[7] == np.float32(1 + 2.0**-23)


# ------------------------------------------------------------------------------ candle


def _special(rng, n):
    """float32 values with signed zeros, subnormals, tiny normals, infinities and NaNs mixed in."""
    a = rng.standard_normal(n).astype(np.float32) * np.float32(10.0) ** rng.integers(-40, 3, n).astype(np.float32)
    pick = rng.random(n)
    a[pick < 0.10] = -0.0
    a[(pick >= 0.10) & (pick < 0.20)] = 0.0
    a[(pick >= 0.20) & (pick < 0.25)] = np.float32(-1e-45)
    a[(pick >= 0.25) & (pick < 0.27)] = np.inf
    a[(pick >= 0.27) & (pick < 0.29)] = -np.inf
    a[(pick >= 0.29) & (pick < 0.31)] = np.nan
    return a


@pytest.mark.parametrize(
    "hp",
    [{}, {"lr": 3e-2, "weight_decay": 0.1, "beta2": 0.99}, {"weight_decay": 0.0, "eps": 0.0},
     {"beta1": 0.0, "beta2": 0.5, "eps": 1e-30}, {"beta2": 1.5}, {"lr": 1e-40, "weight_decay": 1e-3}],
)
def test_candle_short_form_is_the_literal_form(monkeypatch, hp):
    rng = np.random.default_rng(11)
    n = 20000
    p0 = _special(rng, n)
    grads = [_special(rng, n) for _ in range(4)]
    m0, v0 = _special(rng, n), np.abs(_special(rng, n))
    v0[rng.random(n) < 0.1] = -0.0  # a negative-zero second moment, as a file may hold

    def run():
        p, slots, k = p0.copy(), {"exp_avg": m0.copy(), "exp_avg_sq": v0.copy()}, 0
        out = []
        for g in grads:
            p, slots, k = so.step("adamw", p, g, slots, k, hp, "candle")
            out.append((p.copy(), {name: s.copy() for name, s in slots.items()}))
        return out

    with np.errstate(all="ignore"):
        short = run()
        monkeypatch.setattr(adam, "_candle_short", lambda b, k, unit_decay: adam._candle_literal(b, k))
        literal = run()
    for (p, slots), (lp, lslots) in zip(short, literal, strict=True):
        assert np.array_equal(bits(p), bits(lp))
        for name in slots:
            assert np.array_equal(bits(slots[name]), bits(lslots[name])), name


def test_candle_negative_zero_eps_takes_the_literal_form(monkeypatch):
    """With eps = -0.0 a zero root's sign survives ``+ eps``: the short form is not used."""
    used = []
    monkeypatch.setattr(adam, "_candle_literal", lambda b, k: used.append("literal") or (lambda *a: None))
    monkeypatch.setattr(adam, "_candle_short", lambda b, k, unit_decay: used.append("short") or (lambda *a: None))
    p = np.ones(4, np.float32)
    so.step("adamw", p, p, {}, 0, {"eps": -0.0}, "candle")
    so.step("adamw", p, p, {}, 0, {"eps": 1e-8}, "candle")
    assert used == ["literal", "short"]


# ------------------------------------------------------------------------------ torch's root


@pytest.mark.skipif(not backend.torch_available(), reason="torch is not installed")
def test_torch_flavor_holds_torch_at_one_thread_for_the_step_only(monkeypatch):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    seen = []
    sqrt, around = NP.torch_root()
    x = np.abs(np.random.default_rng(0).standard_normal(5000, dtype=np.float32))
    with around():
        seen.append(torch.get_num_threads())
        assert np.array_equal(bits(sqrt(x)), bits(NP.sqrt_torch(x)))
    assert seen == [1] and torch.get_num_threads() == before
    monkeypatch.setenv("STATEKIT_THREADS", "2")
    monkeypatch.setattr(backend.Backend, "block", 1000)
    one, slots = _steps("adam", "torch", {}, 4099)
    monkeypatch.setattr(backend.Backend, "block", 1 << 20)
    monkeypatch.setenv("STATEKIT_THREADS", "1")
    ref, ref_slots = _steps("adam", "torch", {}, 4099)
    assert np.array_equal(bits(one), bits(ref)) and torch.get_num_threads() == before


# ------------------------------------------------------------------------------ CuPy kernels


class EmulatedElementwiseKernel:
    """``cupy.ElementwiseKernel`` on the CPU: the same signature, the body run by
    :func:`statekit.optim.cupy_kernels.emulate` (each intrinsic as numpy's float32 operation)."""

    made: list = []

    def __init__(self, in_params, out_params, operation, name="kernel", *, preamble="", no_return=False,
                 options=()):
        self.inputs = [param.split()[1] for param in in_params.split(",")]
        self.outputs = [param.split()[1] for param in out_params.split(",")]
        assert all(param.split()[0] == "float32" for param in (*in_params.split(","), *out_params.split(",")))
        self.operation, self.preamble, self.options, self.no_return = operation, preamble, options, no_return
        EmulatedElementwiseKernel.made.append(self)

    def __call__(self, *args):
        assert len(args) == len(self.inputs) + len(self.outputs)
        names = [*self.inputs, *self.outputs]
        variables = {}
        for name, value in zip(names, args, strict=True):
            if np.ndim(value) == 0:
                assert isinstance(value, np.float32) and name in self.inputs
                variables[name] = value
            else:
                assert value.dtype == np.float32
                variables[name] = value if name in self.outputs else value.copy()
        cupy_kernels.emulate(self.operation, variables)


@pytest.fixture
def fake_cupy():
    """A CuPy namespace made of numpy's functions and the emulated ElementwiseKernel."""
    module = types.ModuleType("cupy")
    module.__dict__.update({name: getattr(np, name) for name in dir(np) if not name.startswith("__")})
    module.ElementwiseKernel = EmulatedElementwiseKernel
    EmulatedElementwiseKernel.made = []
    return backend.CupyBackend(module)


CUPY_CASES = [
    ("burn", "adam", {"lr": 1e-3}), ("burn", "adam", {"lr": 3e-2, "weight_decay": 0.1, "amsgrad": True}),
    ("burn", "adamw", {"lr": 1e-3}),
    ("burn", "adamw", {"lr": 3e-2, "weight_decay": 0.1, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "amsgrad": True}),
    ("candle", "adamw", {}), ("candle", "adamw", {"lr": 3e-2, "weight_decay": 0.1, "beta2": 0.99}),
    ("candle", "adamw", {"eps": -0.0}),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # eps = -0.0: zero denominators
@pytest.mark.parametrize(("flavor", "name", "hp"), CUPY_CASES)
def test_cupy_kernel_source_gives_the_reference_bits(fake_cupy, flavor, name, hp):
    """The CUDA source, run by the CPU emulation through the CuPy code path, over 20 steps on
    sizes around nothing in particular (one launch covers the tensor) and special values."""
    assert so.choose_kernel(name, flavor, fake_cupy) == "cupy"
    for n in (1, 7, 4099):
        rng = np.random.default_rng(n)
        p0 = rng.standard_normal(n, dtype=np.float32)
        p0[: n // 10] = -0.0
        # a state read from a file, with negative zeros, resumed at step 3; and a fresh one
        slots = {name: np.abs(rng.standard_normal(n, dtype=np.float32)) for name in so.slot_names(name, flavor, hp)}
        for value in slots.values():
            value[rng.random(n) < 0.2] = -0.0
        slots["exp_avg"] *= np.where(rng.random(n) < 0.5, np.float32(-1), np.float32(1))
        start = (p0.copy(), slots, 3) if n != 7 else (p0.copy(), {}, 0)
        ref, fast = start, (start[0].copy(), {name: a.copy() for name, a in start[1].items()}, start[2])
        for k in range(20):
            g = rng.standard_normal(n, dtype=np.float32) * np.float32(10.0 ** rng.uniform(-3, 1))
            g[rng.random(n) < 0.05] = -0.0
            g[rng.random(n) < 0.05] = 0.0
            g[rng.random(n) < 0.02] = np.float32(1e-42)
            ref = so.step(name, ref[0], g, ref[1], ref[2], hp, flavor, kernel="reference")
            fast = so.step(name, fast[0], g, fast[1], fast[2], hp, flavor, fake_cupy, kernel="cupy",
                           inplace=k > 0)
            assert np.array_equal(bits(fast[0]), bits(ref[0])), (n, k)
            for slot in ref[1]:
                assert np.array_equal(bits(fast[1][slot]), bits(ref[1][slot])), (n, k, slot)
    made = EmulatedElementwiseKernel.made
    assert made and all(k.no_return and "--fmad=false" in k.options and "--ftz=false" in k.options for k in made)


def test_cupy_kernel_np_maximum_is_numpys():
    """The preamble's ``np_maximum`` (first NaN, else a if a > b, else b) is numpy's maximum,
    signed zeros and NaN payloads included."""
    assert "(a != a) ? a : ((b != b) ? b : ((a > b) ? a : b))" in cupy_kernels.PREAMBLE

    def c_np_maximum(a, b):
        return a if a != a else (b if b != b else (a if a > b else b))

    nans = np.array([0x7FC00001, 0x7FC00002], np.int32).view(np.float32)
    values = np.array([-0.0, 0.0, 1.0, -1.0, np.inf, *nans], np.float32)
    a, b = np.meshgrid(values, values)
    a, b = np.repeat(a.ravel(), 5), np.repeat(b.ravel(), 5)  # long enough for numpy's SIMD loop
    expected = np.array([c_np_maximum(x, y) for x, y in zip(a, b, strict=True)], np.float32)
    assert np.array_equal(bits(np.maximum(a, b)), bits(expected))


def test_cupy_bodies_stay_in_the_emulated_subset():
    with pytest.raises(ValueError, match="subset"):
        cupy_kernels.emulate("p = __fmul_rn(p, 2.0);", {"p": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="subset"):
        cupy_kernels.emulate("p = p * q;", {"p": np.ones(2, np.float32), "q": np.float32(2)})
    with pytest.raises(ValueError, match="unknown name"):
        cupy_kernels.emulate("float x = __fsqrt_rn(y);", {})
    with pytest.raises(ValueError, match="arguments"):
        cupy_kernels.emulate("p = __fadd_rn(p);", {"p": np.ones(2, np.float32)})


def test_cupy_kernel_is_refused_where_it_cannot_run(fake_cupy):
    with pytest.raises(UsageError, match="CuPy arrays"):
        so.choose_kernel("adamw", "candle", kernel="cupy")
    with pytest.raises(UsageError, match="no CuPy torch-fused adam kernel"):
        so.choose_kernel("adam", "torch-fused", fake_cupy, kernel="cupy")
    assert so.choose_kernel("adam", "torch-fused", fake_cupy) == "reference"


@pytest.mark.parametrize(("flavor", "name", "hp"), FLAVORS)
def test_real_block_size_boundaries(monkeypatch, flavor, name, hp):
    """Around the real HOST_BLOCK, on two threads: the bits of one block on one thread."""
    size = backend.HOST_BLOCK
    for n in (size - 1, size + 1, 2 * size + 3):
        monkeypatch.setattr(backend.Backend, "block", 4 * size)
        monkeypatch.setenv("STATEKIT_THREADS", "1")
        expected, expected_slots = _steps(name, flavor, hp, n, steps=2)
        monkeypatch.setattr(backend.Backend, "block", size)
        monkeypatch.setenv("STATEKIT_THREADS", "2")
        got, slots = _steps(name, flavor, hp, n, steps=2)
        assert np.array_equal(bits(got), bits(expected)), (flavor, name, n)
        for slot in expected_slots:
            assert np.array_equal(bits(slots[slot]), bits(expected_slots[slot])), (flavor, name, n, slot)
