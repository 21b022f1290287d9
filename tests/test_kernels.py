"""Every fast kernel gives the reference's bits: torch's own kernels and the numba kernels.

bit-exact: float32 bit patterns of the parameter and every slot equal after every one of 50
steps, on sizes 1 … 4099 (around torch's 8-float vectors and 16-float chunks) and, marked
slow, a 10M-element tensor. Where torch is the reference (torch's own kernels) the reference
emulation was itself tested against torch.optim (tests/test_optim_torch.py); here the torch
kernel is also compared with a real ``torch.optim`` optimizer stepping the same tensor.
"""

from __future__ import annotations

import numpy as np
import pytest

import statekit.optim as so
from statekit.errors import UsageError
from statekit.optim import backend, kernels, registry

SIZES = [1, 7, 8, 9, 16, 17, 100, 4095, 4099]
STEPS = 50
BIG = 10_000_000

ADAM = [
    ("adam", {}),
    ("adam", {"lr": 3e-2, "weight_decay": 0.1}),
    ("adam", {"amsgrad": True}),
    ("adam", {"maximize": True}),
    ("adamw", {}),
    ("adamw", {"lr": 3e-2, "weight_decay": 0.1, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6}),
]
TORCH_ONLY = [
    ("sgd", {"momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd", {"lr": 0.1}),
    ("sgd", {"momentum": 0.5, "dampening": 0.3, "maximize": True}),
    ("adagrad", {"lr_decay": 0.01, "weight_decay": 0.1}),
    ("adagrad", {"initial_accumulator_value": 0.1, "maximize": True}),
    ("rmsprop", {"momentum": 0.9, "centered": True}),
    ("rmsprop", {"weight_decay": 0.1, "maximize": True}),
]
BURN_ADAM = [
    ("adam", {"lr": 1e-3}),
    ("adam", {"lr": 3e-2, "weight_decay": 0.1, "amsgrad": True}),
    ("adamw", {"lr": 1e-3}),
    ("adamw", {"lr": 3e-2, "weight_decay": 0.1, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6}),
]
CANDLE_ADAMW = [("adamw", {}), ("adamw", {"lr": 3e-2, "weight_decay": 0.1, "beta2": 0.99})]
#: torch 2.13's other element-wise optimizers: every branch of their arithmetic (L2 and decoupled
#: decay, maximize, a lerp weight over 0.5, rectification, ASGD's averaging from t0, Rprop's etas)
TORCH_MORE = [
    ("nadam", {}),
    ("nadam", {"weight_decay": 0.1, "beta1": 0.3}),
    ("nadam", {"weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True, "momentum_decay": 0.01}),
    ("radam", {}),
    ("radam", {"weight_decay": 0.1, "maximize": True, "beta2": 0.9}),
    ("radam", {"weight_decay": 0.1, "decoupled_weight_decay": True, "lr": 1e-2}),
    ("adamax", {}),
    ("adamax", {"weight_decay": 0.1, "maximize": True, "beta1": 0.2}),
    ("adadelta", {}),
    ("adadelta", {"weight_decay": 0.1, "maximize": True, "rho": 0.5, "lr": 0.1}),
    ("asgd", {}),
    ("asgd", {"t0": 3}),
    ("asgd", {"weight_decay": 0.1, "maximize": True, "t0": 10, "lambd": 0.01, "alpha": 0.5}),
    ("rprop", {}),
    ("rprop", {"maximize": True, "etas": (0.3, 1.5), "step_sizes": (1e-4, 0.5), "lr": 0.1}),
]
FOREACH = {"nadam", "radam", "asgd", "adafactor"}
#: whole-tensor steps: a shape each, vectors and matrices (Adafactor factors two dimensions or more)
TENSOR_SHAPES = {"adafactor": [(1,), (7,), (1000,), (16, 4), (3, 5, 7), (37, 53)],
                 "muon": [(16, 4), (4, 16), (37, 53), (5, 5)]}
TORCH_TENSOR = [
    ("adafactor", {}),
    ("adafactor", {"weight_decay": 0.1, "maximize": True, "lr": 0.05, "d": 0.5}),
    ("muon", {}),
    ("muon", {"nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.01, "lr": 1e-2}),
]
BURN_CLASSIC = [
    ("sgd", {"lr": 1e-2}),
    ("sgd", {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd", {"lr": 1e-2, "momentum": 0.5, "dampening": 0.3}),
    ("adagrad", {"lr": 1e-2}),
    ("adagrad", {"lr": 1e-2, "weight_decay": 0.1, "lr_decay": 0.01}),
    ("rmsprop", {"lr": 1e-3}),
    ("rmsprop", {"lr": 1e-3, "centered": True, "weight_decay": 0.1}),
    ("rmsprop", {"lr": 1e-3, "momentum": 0.0}),
]
BURN_MORE = [
    ("adan", {"lr": 1e-3}),
    ("adan", {"lr": 1e-2, "weight_decay": 0.1}),
    ("adan", {"lr": 1e-2, "weight_decay": 0.1, "no_prox": True}),
    ("lion", {"lr": 1e-3}),
    ("lion", {"lr": 1e-2, "weight_decay": 0.1, "beta1": 0.5}),
]


def bits(array) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(array, dtype=np.float32)).view(np.int32)


def gradients(rng, n: int, steps: int = STEPS):
    """A gradient per step: scales 1e-3 … 10, 2 % exact zeros, read-only (a memory-mapped file's)."""
    for _ in range(steps):
        g = rng.standard_normal(n, dtype=np.float32) * np.float32(10 ** rng.uniform(-3, 1))
        g[rng.random(n) < 0.02] = 0
        g.flags.writeable = False
        yield g


def same_bits(name, hp, flavor, kernel, n, seed=0, steps=STEPS, inplace=False):
    """Run the reference and ``kernel`` side by side for ``steps`` steps, asserting equal bits
    (``n``: a size or a shape)."""
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(n, dtype=np.float32)
    ref, fast = (p0.copy(), {}, 0), (p0.copy(), {}, 0)
    for k, g in enumerate(gradients(rng, n, steps)):
        before = g.copy()
        ref = so.step(name, ref[0], g, ref[1], ref[2], hp, flavor, kernel="reference", inplace=inplace and k > 0)
        fast = so.step(name, fast[0], g, fast[1], fast[2], hp, flavor, kernel=kernel, inplace=inplace and k > 0)
        assert np.array_equal(g, before), "the kernel wrote to the gradient"
        assert fast[2] == ref[2]
        assert type(fast[0]) is type(ref[0]) and fast[0].shape == ref[0].shape
        assert np.array_equal(bits(fast[0]), bits(ref[0])), f"param differs after step {k + 1} (n={n})"
        assert set(fast[1]) == set(ref[1])
        for slot in ref[1]:
            assert np.array_equal(bits(fast[1][slot]), bits(ref[1][slot])), f"{slot} differs after step {k + 1}"


# ------------------------------------------------------------------------------ choice


def test_reference_is_the_default_and_auto_prefers_fast_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "torch_available", lambda: False)
    monkeypatch.setattr(kernels, "numba_available", lambda: False)
    assert so.choose_kernel("adam", "torch-fused") == "reference"
    monkeypatch.setattr(kernels, "numba_available", lambda: True)
    assert so.choose_kernel("adam", "burn") == "numba"
    assert so.choose_kernel("adan", "burn") == "numba"
    assert so.choose_kernel("lamb", "burn") == "reference"  # whole-tensor: no numba LAMB
    monkeypatch.setattr(kernels, "torch_available", lambda: True)
    assert so.choose_kernel("adam", "torch-fused") == "torch"
    assert so.choose_kernel("adamw", "candle") == "numba"  # torch cannot run candle's arithmetic
    assert so.choose_kernel("sgd", "burn") == "numba"


def test_an_impossible_kernel_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(kernels, "numba_available", lambda: False)
    with pytest.raises(UsageError, match="numba is not installed"):
        so.choose_kernel("adam", "torch", kernel="numba")
    with pytest.raises(UsageError, match="unknown kernel"):
        so.choose_kernel("adam", "torch", kernel="fortran")
    monkeypatch.setattr(kernels, "torch_available", lambda: True)
    with pytest.raises(UsageError, match="torch has no burn adam kernel"):
        so.choose_kernel("adam", "burn", kernel="torch")
    with pytest.raises(UsageError, match="8-float"):
        so.choose_kernel("adam", "torch-fused", kernel="torch", vector_width=4)


# ------------------------------------------------------------------------------ torch

torch_needed = pytest.mark.skipif(not backend.torch_available(), reason="torch is not installed")


@pytest.fixture
def one_torch_thread():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@torch_needed
@pytest.mark.torch
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("name", "hp", "flavor"), [
    (name, hp, flavor) for name, hp in ADAM + TORCH_ONLY + TORCH_MORE + TORCH_TENSOR
    for flavor in ("torch-fused", "torch", "torch-foreach") if (name, flavor) in kernels.TORCH_SUPPORTS])
def test_torch_kernels_give_the_reference_bits(name, hp, flavor):
    for i, n in enumerate(TENSOR_SHAPES.get(name, SIZES)):
        same_bits(name, hp, flavor, "torch", n, seed=i, steps=STEPS if name not in TENSOR_SHAPES else 20)


@torch_needed
@pytest.mark.torch
@pytest.mark.parametrize(("name", "hp"), TORCH_MORE + TORCH_TENSOR[:2])
def test_torch_kernel_in_place_and_on_torch_tensors(name, hp):
    """bit-exact: the torch kernel stepping in place (the caller's arrays, as replay does) and
    on torch CPU tensors gives the reference's bits; missing 0-dim slots start at torch's values."""
    import torch

    shape = TENSOR_SHAPES.get(name, [(37, 53)])[-1]
    same_bits(name, hp, "torch", "torch", shape, seed=5, steps=10, inplace=True)
    rng = np.random.default_rng(6)
    p0 = rng.standard_normal(shape, dtype=np.float32)
    ref, ours = (p0.copy(), {}, 0), (torch.from_numpy(p0.copy()), {}, 0)
    for g in gradients(rng, shape, 10):
        ref = so.step(name, ref[0], g, ref[1], ref[2], hp, "torch", kernel="reference")
        ours = so.step(name, ours[0], torch.from_numpy(g.copy()), ours[1], ours[2], hp, "torch", torch, kernel="torch")
    assert isinstance(ours[0], torch.Tensor) and np.array_equal(bits(ours[0]), bits(ref[0]))
    for slot, value in ref[1].items():
        assert isinstance(ours[1][slot], torch.Tensor) and np.array_equal(bits(ours[1][slot]), bits(value)), slot


WRITTEN_CLASSES = {"nadam": "NAdam", "radam": "RAdam", "adamax": "Adamax", "adadelta": "Adadelta", "asgd": "ASGD",
                   "rprop": "Rprop"}


@torch_needed
@pytest.mark.torch
@pytest.mark.parametrize(("name", "hp"), TORCH_MORE)
def test_written_out_for_loops_are_torch_optim(name, hp, monkeypatch):
    """The torch kernel's written-out single-tensor functions (temporaries in reused buffers) step
    exactly like a real ``torch.optim`` optimizer with ``foreach=False`` at torch's own thread
    count, every slot after every step, sizes around the vector widths and one over torch's
    2048-element parallel grain; and they are what ran."""
    import torch

    from statekit.optim import torch_kernels

    ran = []
    written = torch_kernels.WRITTEN_OUT[name]
    monkeypatch.setitem(torch_kernels.WRITTEN_OUT, name, lambda *a: ran.append(1) or written(*a))
    kwargs = {k: v for k, v in hp.items() if k not in ("beta1", "beta2")}
    if "beta1" in hp or "beta2" in hp:
        kwargs["betas"] = (hp.get("beta1", 0.9), hp.get("beta2", 0.999))
    for i, n in enumerate([1, 17, 4099, 100_003]):
        rng = np.random.default_rng(20 + i)
        p = rng.standard_normal(n, dtype=np.float32)
        param = torch.nn.Parameter(torch.from_numpy(p.copy()))
        opt = getattr(torch.optim, WRITTEN_CLASSES[name])([param], foreach=False, **kwargs)
        ours = (p.copy(), {}, 0)
        for k, g in enumerate(gradients(rng, n, 12)):
            param.grad = torch.from_numpy(g.copy())
            opt.step()
            ours = so.step(name, ours[0], g, ours[1], ours[2], hp, "torch", kernel="torch", inplace=k > 0)
            assert np.array_equal(bits(ours[0]), bits(param.detach())), f"param differs after step {k + 1} (n={n})"
            for slot, value in ours[1].items():
                assert np.array_equal(bits(value), bits(opt.state[param][slot])), (slot, k + 1, n)
    assert len(ran) == 4 * 12, "the written-out path was not the one that ran"


ADAFACTOR_HP = [{}, {"weight_decay": 0.1, "maximize": True, "lr": 0.05, "d": 1.5},
                {"eps": (1e-3, 1e-3), "lr": 0.3, "beta2_decay": -0.5}]


def _torch_adafactor_kwargs(hp: dict) -> dict:
    kwargs = {k: v for k, v in hp.items() if k in ("lr", "weight_decay", "maximize", "d", "beta2_decay")}
    if "eps" in hp:
        kwargs["eps"] = hp["eps"]
    return kwargs


@torch_needed
@pytest.mark.torch
@pytest.mark.skipif(not kernels.numba_available(), reason="numba (statekit[fast]) is not installed")
@pytest.mark.parametrize("hp", ADAFACTOR_HP)
def test_adafactor_matrix_step_is_torch_optim(hp, monkeypatch):
    """Issue 38: the torch kernel's Adafactor for-loop on a matrix (its column norms and update
    computed by numba in torch's order, the rest torch's own) steps exactly like a real
    ``torch.optim.Adafactor(foreach=False)`` at torch's own thread count: every parameter and
    factor after every step, on shapes with a side of 1, odd sides, a batch of matrices and one
    over numba's 256-column chunks and torch's grain; and that path is the one that ran."""
    import torch

    from statekit.optim import torch_kernels

    assert torch_kernels._adafactor_fast_ok(torch)
    ran = []
    fast = torch_kernels._adafactor_matrix
    monkeypatch.setattr(torch_kernels, "_adafactor_matrix", lambda *a: ran.append(1) or fast(*a))
    shapes = [(1, 1), (1, 9), (9, 1), (37, 53), (3, 5, 7), (300, 517)]
    for i, shape in enumerate(shapes):
        rng = np.random.default_rng(40 + i)
        p = rng.standard_normal(shape, dtype=np.float32)
        param = torch.nn.Parameter(torch.from_numpy(p.copy()))
        opt = torch.optim.Adafactor([param], foreach=False, **_torch_adafactor_kwargs(hp))
        ours = (p.copy(), {}, 0)
        for k, g in enumerate(gradients(rng, shape, 8)):
            param.grad = torch.from_numpy(g.copy())
            opt.step()
            ours = so.step("adafactor", ours[0], g, ours[1], ours[2], hp, "torch", kernel="torch", inplace=k > 0)
            assert np.array_equal(bits(ours[0]), bits(param.detach())), f"param differs after step {k + 1} {shape}"
            for slot in ("row_var", "col_var"):
                assert np.array_equal(bits(ours[1][slot]), bits(opt.state[param][slot])), (slot, k + 1, shape)
    assert len(ran) == len(shapes) * 8, "the fast matrix path was not the one that ran"


@torch_needed
@pytest.mark.torch
@pytest.mark.skipif(not kernels.numba_available(), reason="numba (statekit[fast]) is not installed")
def test_adafactor_fast_path_is_checked_against_torch_and_declined_when_its_bits_differ(monkeypatch):
    """The probe that admits the fast path compares it with torch's own for-loop bit for bit: a
    column norm summed with an FMA (as another build of torch might) fails it, and the step is
    then torch's own function, still torch's bits."""
    import torch

    from statekit.optim import numba_adafactor, torch_kernels

    def col_norms_with_fma(g, out):
        acc = np.zeros(out.shape, np.float64)
        for i in range(g.shape[1]):  # float32 fma(x, x, acc): one rounding of the exact x*x + acc
            acc = (acc + g[:, i, :].astype(np.float64) ** 2).astype(np.float32).astype(np.float64)
        out[...] = np.sqrt(acc.astype(np.float32))

    monkeypatch.setattr(numba_adafactor, "torch_col_norms", col_norms_with_fma)
    assert torch_kernels._adafactor_probe(torch) is False
    monkeypatch.setattr(torch_kernels, "_ADAFACTOR_FAST", [False])
    ran = []
    monkeypatch.setattr(torch_kernels, "_adafactor_matrix", lambda *a: ran.append(1))
    rng = np.random.default_rng(9)
    p = rng.standard_normal((37, 53), dtype=np.float32)
    param = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch.optim.Adafactor([param], foreach=False)
    ours = (p.copy(), {}, 0)
    for g in gradients(rng, (37, 53), 4):
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        ours = so.step("adafactor", ours[0], g, ours[1], ours[2], {}, "torch", kernel="torch")
    assert not ran and np.array_equal(bits(ours[0]), bits(param.detach()))


@torch_needed
@pytest.mark.torch
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(("flavor", "kwargs"), [("torch-fused", {"fused": True}), ("torch", {"foreach": False})])
def test_torch_kernel_is_torch_optim(flavor, kwargs):
    """The torch kernel (in place on numpy memory) steps exactly like a real torch.optim.AdamW."""
    import torch

    rng = np.random.default_rng(3)
    p = rng.standard_normal(4099, dtype=np.float32)
    param = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch.optim.AdamW([param], lr=3e-2, weight_decay=0.1, amsgrad=True, **kwargs)
    ours = (p.copy(), {}, 0)
    hp = {"lr": 3e-2, "weight_decay": 0.1, "amsgrad": True}
    for g in gradients(rng, p.size):
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        ours = so.step("adamw", ours[0], g, ours[1], ours[2], hp, flavor, kernel="torch")
    assert np.array_equal(bits(ours[0]), bits(param.detach()))
    for slot, value in ours[1].items():
        assert np.array_equal(bits(value), bits(opt.state[param][slot]))


TORCH_NAMES = {"lr": "lr", "weight_decay": "weight_decay", "amsgrad": "amsgrad", "maximize": "maximize", "eps": "eps"}


@torch_needed
@pytest.mark.torch
@pytest.mark.parametrize(("name", "hp"), ADAM)
def test_torch_flavor_adam_without_temporaries_is_torch_optim(name, hp, monkeypatch):
    """The torch flavor's Adam/AdamW (torch's single-tensor code with its temporaries in reused
    buffers) steps exactly like a real torch.optim optimizer with ``foreach=False``, at torch's
    own thread count, on sizes around the vector widths."""
    import torch

    from statekit.optim import torch_kernels

    ran = []
    buffered = torch_kernels.single_tensor_adam
    monkeypatch.setattr(torch_kernels, "single_tensor_adam", lambda *a, **k: ran.append(1) or buffered(*a, **k))
    kwargs = {TORCH_NAMES[k]: v for k, v in hp.items() if k in TORCH_NAMES}
    if "beta1" in hp:
        kwargs["betas"] = (hp["beta1"], hp["beta2"])
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    for i, n in enumerate([1, 17, 4099]):
        rng = np.random.default_rng(10 + i)
        p = rng.standard_normal(n, dtype=np.float32)
        param = torch.nn.Parameter(torch.from_numpy(p.copy()))
        opt = cls([param], foreach=False, **({"weight_decay": 0.0} if name == "adam" and "weight_decay" not in hp
                                              else {}), **kwargs)
        ours = (p.copy(), {}, 0)
        for k, g in enumerate(gradients(rng, n)):
            param.grad = torch.from_numpy(g.copy())
            opt.step()
            ours = so.step(name, ours[0], g, ours[1], ours[2], hp, "torch", kernel="torch", inplace=k > 0)
            assert np.array_equal(bits(ours[0]), bits(param.detach())), f"param differs after step {k + 1} (n={n})"
        for slot, value in ours[1].items():
            assert np.array_equal(bits(value), bits(opt.state[param][slot])), slot
    assert len(ran) == 3 * STEPS, "the buffered path was not the one that ran"


@torch_needed
@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["torch-fused", "torch"])
def test_torch_kernel_on_10m_elements(flavor):
    """10M elements (a multiple of neither 8 nor 16 plus 3), in place, 3 steps: the reference's bits."""
    same_bits("adamw", {"lr": 3e-2, "weight_decay": 0.1}, flavor, "torch", BIG + 3, steps=3, inplace=True)


# ------------------------------------------------------------------------------ numba

numba_needed = pytest.mark.skipif(not kernels.numba_available(), reason="numba (statekit[fast]) is not installed")


@pytest.fixture
def ieee_reference(monkeypatch):
    """The reference's torch flavor with the IEEE root, as without torch (what numba computes)."""
    monkeypatch.setattr(backend, "torch_available", lambda: False)


@numba_needed
@pytest.mark.parametrize(
    ("flavor", "name", "hp"),
    [("torch-fused", *c) for c in ADAM] + [("torch", *c) for c in ADAM] + [("burn", *c) for c in BURN_ADAM]
    + [("candle", *c) for c in CANDLE_ADAMW] + [("torch", *c) for c in TORCH_MORE]
    + [("torch-foreach", *c) for c in TORCH_MORE if c[0] in FOREACH] + [("burn", *c) for c in BURN_MORE]
    + [(f, *c) for c in TORCH_ONLY for f in ("torch", "torch-fused") if (c[0], f) in kernels.NUMBA_SUPPORTS]
    + [("burn", *c) for c in BURN_CLASSIC] + [("candle", "sgd", {"lr": 1e-2})],
)
def test_numba_kernels_give_the_reference_bits(flavor, name, hp, ieee_reference):
    assert (name, flavor) in kernels.NUMBA_SUPPORTS
    for i, n in enumerate(SIZES):
        same_bits(name, hp, flavor, "numba", n, seed=i, steps=STEPS)
    same_bits(name, hp, flavor, "numba", (300, 301), seed=99, steps=3, inplace=True)  # over the parallel threshold


@numba_needed
@pytest.mark.slow
@pytest.mark.parametrize(("flavor", "hp"), [("torch-fused", {"lr": 3e-2, "weight_decay": 0.1}), ("burn", {"lr": 1e-3}),
                                            ("candle", {}), ("torch", {"amsgrad": True})])
def test_numba_kernel_on_10m_elements(flavor, hp, ieee_reference):
    same_bits("adamw", hp, flavor, "numba", BIG + 3, steps=3, inplace=True)


def test_registry_step_accepts_every_kernel_name():
    assert set(kernels.CHOICES) == {"auto", "reference", "torch", "numba", "cupy"}
    assert registry.step("adam", np.ones(3, np.float32), np.ones(3, np.float32), kernel="reference")[2] == 1


@numba_needed
@pytest.mark.parametrize("flavor", ["torch", "torch-foreach"])
@pytest.mark.parametrize("hp", [c[1] for c in TORCH_TENSOR if c[0] == "adafactor"] + [{"eps": (1e-3, 1e-3), "lr": 0.3}])
def test_numba_adafactor_gives_the_reference_bits(flavor, hp, monkeypatch):
    """bit-exact: the numba Adafactor == the reference without torch (numpy's float64 reductions
    in numpy's order, pairwise along a row and over the tensor, in order down the rows), 20 steps
    on vectors, matrices and a 3-D tensor, and 3 steps on tensors whose whole-tensor sums split
    over several threads' leaves."""
    from statekit.optim import tensorwise

    monkeypatch.setattr(backend, "torch_available", lambda: False)
    monkeypatch.setattr(tensorwise, "torch_available", lambda: False)
    assert ("adafactor", flavor) in kernels.NUMBA_SUPPORTS
    for i, shape in enumerate(TENSOR_SHAPES["adafactor"]):
        same_bits("adafactor", hp, flavor, "numba", shape, seed=i, steps=20)
    for shape in [(300, 1001), (2, 150, 700), (200_003,)]:
        same_bits("adafactor", hp, flavor, "numba", shape, seed=7, steps=3, inplace=True)
