"""statekit replays torch 2.13's NAdam, RAdam, Adamax, Adadelta, Adafactor, ASGD, Rprop and Muon
bit for bit, on the inputs of torch's own ``optim_db`` (``torch.testing._internal.common_optimizers``
of the installed torch): every CPU float32 configuration, for-loop and foreach, 20 steps, torch
running beside statekit in the test. Then the same through the command line (``statekit replay``
from a state torch wrote) and ``verify-resume`` (a copy tracks, a swapped same-shape state
diverges), one torch-written state per optimizer.

Every assertion is on float32 bit patterns, after every step, for the parameter and every state
slot torch keeps.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
import unittest

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import statekit.optim as so
from statekit import hyper
from statekit.optim import kernels

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch

CLASSES = {"NAdam": "nadam", "RAdam": "radam", "Adamax": "adamax", "Adadelta": "adadelta",
           "Adafactor": "adafactor", "ASGD": "asgd", "Rprop": "rprop", "Muon": "muon"}
STEPS = 20
# odd sizes, a matrix, a 3-D tensor, one over a vector's width; Muon takes matrices only
SHAPES = [(1,), (7,), (13,), (16, 4), (3, 5, 7), (1000,), (37, 53)]
MATRICES = [(16, 4), (4, 16), (37, 53), (5, 5)]


def _optim_db():
    """torch's own optimizer test database. Its module imports ``expecttest`` only for a
    ``TestCase`` base class; where that package is absent a stand-in with ``unittest``'s is used
    (nothing of it runs here: only the configurations are read)."""
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stand_in = types.ModuleType("expecttest")
            stand_in.TestCase = unittest.TestCase
            sys.modules["expecttest"] = stand_in
    from torch.testing._internal.common_optimizers import optim_db

    return optim_db


def _configs():
    out = []
    for info in _optim_db():
        name = info.optim_cls.__name__
        if name not in CLASSES:
            continue
        impls = [False] + ([True] if "foreach" in info.supported_impls else [])
        for inp in info.optim_inputs_func(device="cpu", dtype=torch.float32):
            for foreach in impls:
                out.append(pytest.param(info.optim_cls, inp.kwargs, foreach,
                                        id=f"{name}-{inp.desc}-{'foreach' if foreach else 'for-loop'}"))
    return out


CONFIGS = _configs()


def bits(array) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(array, dtype=np.float32)).view(np.int32)


def core_hp(kwargs: dict) -> dict:
    """statekit's hyperparameters for torch constructor arguments: a tensor lr is its value
    (torch's ``_to_scalar``), ``betas`` split."""
    return hyper.split_betas({k: v.item() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})


def flavor_of(name: str, foreach: bool) -> str:
    return "torch-foreach" if foreach and "torch-foreach" in so.ALGORITHMS[name].flavors else "torch"


def problem(name: str, seed: int = 0, steps: int = STEPS):
    rng = np.random.default_rng(seed)
    shapes = MATRICES if name == "muon" else SHAPES
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = []
    for _ in range(steps):
        scale = np.float32(10 ** rng.uniform(-3, 1))
        grads.append([(rng.standard_normal(p.shape) * scale * (rng.random(p.shape) > 0.02)).astype(np.float32)
                      for p in params])
    return params, grads


def test_the_database_has_every_optimizer():
    """torch's optim_db names all 8 optimizers, each with several configurations."""
    seen = {p.values[0].__name__ for p in CONFIGS}
    assert seen == set(CLASSES)
    assert len(CONFIGS) >= 80


@pytest.mark.parametrize("kernel", ["reference", "torch"])
@pytest.mark.parametrize(("cls", "kwargs", "foreach"), CONFIGS)
def test_replay_matches_torch_bit_for_bit(cls, kwargs, foreach, kernel):
    """bit-exact: statekit's step (the reference, and the torch kernel: torch's own code on
    statekit's arrays) == torch.optim.<cls>(**optim_db kwargs), every slot, after each of 20
    steps, on 7 shapes (Muon: 4 matrices)."""
    name = CLASSES[cls.__name__]
    params, grads = problem(name)
    tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
    opt = cls(tparams, **kwargs, **({} if name == "muon" else {"foreach": foreach}))
    hp, flavor = core_hp(kwargs), flavor_of(name, foreach)
    ours = [(p, {}, 0) for p in params]
    for step, step_grads in enumerate(grads, 1):
        for tp, g in zip(tparams, step_grads, strict=True):
            tp.grad = torch.from_numpy(g.copy())
        opt.step()
        ours = [so.step(name, p, g, s, k, hp, flavor, kernel=kernel)
                for (p, s, k), g in zip(ours, step_grads, strict=True)]
        for (p, slots, k), tp in zip(ours, tparams, strict=True):
            assert np.array_equal(bits(p), bits(tp.detach())), f"param {tuple(tp.shape)} differs after step {step}"
            state = opt.state[tp]
            assert set(slots) == {key for key in state if key != "step"}
            for slot, value in slots.items():
                assert np.array_equal(bits(value), bits(state[slot])), f"{slot} differs after step {step}"
            if "step" in state:
                assert state["step"].item() == k
    assert so.exactness(flavor, algorithm=name) == so.BIT_EXACT


@pytest.fixture
def ieee_root(monkeypatch):
    """torch's float32 square root made the IEEE one (the float64 root rounded once: correctly
    rounded), the root statekit's numba kernels and its reference take without torch."""
    sqrt = torch.sqrt

    def ieee(x):
        return sqrt(x.double()).to(x.dtype)

    monkeypatch.setattr(torch, "sqrt", ieee)
    monkeypatch.setattr(torch.Tensor, "sqrt", ieee)
    monkeypatch.setattr(torch.Tensor, "sqrt_", lambda x: x.copy_(ieee(x)))
    monkeypatch.setattr(torch, "_foreach_sqrt", lambda xs: [ieee(x) for x in xs])
    monkeypatch.setattr(torch, "_foreach_sqrt_", lambda xs: [x.copy_(ieee(x)) for x in xs])


# the element-wise ones (numba's Adafactor sums its norms in numpy's float64 order: tolerance, as without torch)
NUMBA_CONFIGS = [c for c in CONFIGS if CLASSES[c.values[0].__name__] != "adafactor" and (
    CLASSES[c.values[0].__name__], flavor_of(CLASSES[c.values[0].__name__], c.values[2])) in kernels.NUMBA_SUPPORTS]


@pytest.mark.skipif(not kernels.numba_available(), reason="numba (statekit[fast]) is not installed")
@pytest.mark.usefixtures("ieee_root")
@pytest.mark.parametrize(("cls", "kwargs", "foreach"), NUMBA_CONFIGS)
def test_numba_kernels_match_torch_with_the_ieee_root(cls, kwargs, foreach):
    """bit-exact: statekit's numba kernel == torch.optim.<cls>(**optim_db kwargs) with torch's
    square root made the IEEE one (the numba kernels take it: no MKL without torch), every slot
    after each of 20 steps, on 7 shapes. The optimizers without a root (Adamax, ASGD, Rprop) are
    thus checked against torch's unchanged arithmetic."""
    name = CLASSES[cls.__name__]
    params, grads = problem(name)
    tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
    opt = cls(tparams, **kwargs, foreach=foreach)
    hp, flavor = core_hp(kwargs), flavor_of(name, foreach)
    ours = [(p, {}, 0) for p in params]
    for step, step_grads in enumerate(grads, 1):
        for tp, g in zip(tparams, step_grads, strict=True):
            tp.grad = torch.from_numpy(g.copy())
        opt.step()
        ours = [so.step(name, p, g, s, k, hp, flavor, kernel="numba")
                for (p, s, k), g in zip(ours, step_grads, strict=True)]
        for (p, slots, _), tp in zip(ours, tparams, strict=True):
            assert np.array_equal(bits(p), bits(tp.detach())), f"param {tuple(tp.shape)} differs after step {step}"
            for slot, value in slots.items():
                assert np.array_equal(bits(value), bits(opt.state[tp][slot])), f"{slot} differs after step {step}"


@pytest.mark.parametrize("cls", [torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Adafactor])
def test_foreach_rounds_differently_and_has_its_own_flavor(cls):
    """torch's foreach and for-loop paths give different bits for these optimizers (so one replica
    cannot be both), and statekit's two flavors differ where torch's do."""
    name = CLASSES[cls.__name__]
    params, grads = problem(name, seed=1)
    runs = {}
    for foreach in (False, True):
        tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
        opt = cls(tparams, foreach=foreach)
        for step_grads in grads:
            for tp, g in zip(tparams, step_grads, strict=True):
                tp.grad = torch.from_numpy(g.copy())
            opt.step()
        runs[foreach] = np.concatenate([bits(tp.detach()).ravel() for tp in tparams])
    assert not np.array_equal(runs[False], runs[True])
    ours = {}
    for flavor in ("torch", "torch-foreach"):
        state = [(p, {}, 0) for p in params]
        for step_grads in grads:
            state = [so.step(name, p, g, s, k, {}, flavor) for (p, s, k), g in zip(state, step_grads, strict=True)]
        ours[flavor] = np.concatenate([bits(p).ravel() for p, _, _ in state])
    assert np.array_equal(ours["torch"], runs[False]) and np.array_equal(ours["torch-foreach"], runs[True])


@pytest.mark.parametrize("cls", [torch.optim.Adamax, torch.optim.Adadelta, torch.optim.Rprop])
def test_foreach_rounds_alike_for_the_others(cls):
    """torch's foreach and for-loop paths give the same bits for these (so one ``torch`` flavor
    replays both, as the configurations above check)."""
    name = CLASSES[cls.__name__]
    params, grads = problem(name, seed=2)
    runs = []
    for foreach in (False, True):
        tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
        opt = cls(tparams, foreach=foreach)
        for step_grads in grads:
            for tp, g in zip(tparams, step_grads, strict=True):
                tp.grad = torch.from_numpy(g.copy())
            opt.step()
        runs.append(np.concatenate([bits(tp.detach()).ravel() for tp in tparams]))
    assert np.array_equal(*runs)
    assert "torch-foreach" not in so.ALGORITHMS[name].flavors


@pytest.mark.parametrize(("name", "hp"), [("nadam", {"weight_decay": 0.1}), ("asgd", {"t0": 3}),
                                          ("adafactor", {}), ("muon", {"lr": 1e-2}), ("rprop", {})])
def test_torch_tensors_give_the_numpy_bits(name, hp):
    """bit-exact: the same replay on torch CPU tensors as on numpy arrays (0-dim slots come back as
    0-dim tensors), 10 steps."""
    params, grads = problem(name, seed=3, steps=10)
    run_np = [(p, {}, 0) for p in params]
    run_t = [(torch.from_numpy(p.copy()), {}, 0) for p in params]
    for step_grads in grads:
        run_np = [so.step(name, p, g, s, k, hp) for (p, s, k), g in zip(run_np, step_grads, strict=True)]
        run_t = [so.step(name, p, torch.from_numpy(g), s, k, hp, "torch", torch)
                 for (p, s, k), g in zip(run_t, step_grads, strict=True)]
    for (p, s, _), (pt, st, _) in zip(run_np, run_t, strict=True):
        assert isinstance(pt, torch.Tensor) and np.array_equal(bits(p), bits(pt))
        assert set(s) == set(st)
        for slot in s:
            assert isinstance(st[slot], torch.Tensor) and np.array_equal(bits(s[slot]), bits(st[slot]))


def test_muon_refuses_a_parameter_that_is_not_a_matrix():
    """torch's Muon takes matrices only; statekit says so by name rather than guessing."""
    from statekit.errors import UsageError

    with pytest.raises(UsageError, match=r"Muon steps matrices only; this parameter has shape \[4\]"):
        so.step("muon", np.ones(4, np.float32), np.ones(4, np.float32), {}, 0, {})


# ------------------------------------------------------------------ the command line


CLI_KWARGS = {"nadam": {"weight_decay": 0.1}, "radam": {}, "adamax": {}, "adadelta": {"weight_decay": 0.1},
              "adafactor": {"lr": 1e-2}, "asgd": {"t0": 0}, "rprop": {}, "muon": {"lr": 1e-2}}
CLI_SHAPES = {"a.weight": (8, 6), "b.weight": (8, 6), "a.bias": (8,), "c.weight": (6, 8)}


def _torch_run(name: str, tmp_path, foreach: bool = False, first: int = 3, then: int = 4):
    """A real torch run: ``first`` steps, its state and parameters saved, then ``then`` more;
    returns (state file, params file, gradient files, torch's final params and state)."""
    rng = np.random.default_rng(7)
    shapes = {k: s for k, s in CLI_SHAPES.items() if name != "muon" or len(s) == 2}
    module = torch.nn.Module()
    for key, shape in shapes.items():
        module.register_parameter(key.replace(".", "_"), torch.nn.Parameter(torch.from_numpy(
            rng.standard_normal(shape).astype(np.float32))))
    named = [(key, getattr(module, key.replace(".", "_"))) for key in shapes]
    cls = getattr(torch.optim, next(c for c, n in CLASSES.items() if n == name))
    kwargs = dict(CLI_KWARGS[name], **({} if name == "muon" else {"foreach": foreach}))
    opt = cls(named, **kwargs)
    grads = []
    for i in range(first + then):
        g = {key: (rng.standard_normal(shape) * 0.1).astype(np.float32) for key, shape in shapes.items()}
        if i == first:
            torch.save({"optimizer": opt.state_dict()}, tmp_path / "state.pt")
            save_file({key: p.detach().numpy().copy() for key, p in named}, str(tmp_path / "params.safetensors"))
        if i >= first:
            save_file(g, str(tmp_path / f"g{i}.safetensors"))
            grads.append(tmp_path / f"g{i}.safetensors")
        for key, p in named:
            p.grad = torch.from_numpy(g[key])
        opt.step()
    final = {key: p.detach().numpy().copy() for key, p in named}
    return tmp_path / "state.pt", tmp_path / "params.safetensors", grads, final, opt.state_dict()


@pytest.mark.parametrize("name", sorted(CLI_KWARGS))
def test_statekit_replay_continues_a_torch_state_bit_for_bit(tmp_path, cli, name):
    """bit-exact: ``statekit replay --state <torch .pt>`` continues torch's run: parameters and
    every state tensor (0-dim ones included) equal torch's after 4 more steps."""
    state, params, grads, final, sd = _torch_run(name, tmp_path)
    r = cli("replay", "--state", state, "--params", params, "--grads", *grads, "--out-params",
            tmp_path / "out.safetensors", "--out-state", tmp_path / "out.pt", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["optimizer"] == name and report["flavor"] == "torch" and report["exactness"] == "bit-exact"
    got = load_file(str(tmp_path / "out.safetensors"))
    for key, value in final.items():
        assert np.array_equal(bits(got[key]), bits(value)), key
    ours = torch.load(tmp_path / "out.pt", weights_only=True)
    for i, entry in sd["state"].items():
        for slot, value in entry.items():
            if slot == "step":
                assert float(ours["state"][i]["step"]) == value.item()
            else:
                assert np.array_equal(bits(ours["state"][i][slot]), bits(value)), (i, slot)


@pytest.mark.parametrize("name", ["nadam", "radam"])
def test_a_foreach_state_replays_with_the_foreach_arithmetic(tmp_path, cli, name):
    """bit-exact: a state saved with ``foreach=True`` is replayed with torch's foreach path."""
    state, params, grads, final, _ = _torch_run(name, tmp_path, foreach=True)
    r = cli("replay", "--state", state, "--params", params, "--grads", *grads, "--out-params",
            tmp_path / "out.safetensors", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["flavor"] == "torch-foreach"
    got = load_file(str(tmp_path / "out.safetensors"))
    for key, value in final.items():
        assert np.array_equal(bits(got[key]), bits(value)), key


def _swap(sd: dict, slot: str) -> dict:
    """The state with ``slot`` exchanged between the two same-shape parameters (positions 0 and 1)."""
    state = sd["state"]
    state[0][slot], state[1][slot] = state[1][slot], state[0][slot]
    assert state[0][slot].shape == state[1][slot].shape
    return sd


SWAPPED = {"nadam": "exp_avg", "radam": "exp_avg_sq", "adamax": "exp_inf", "adadelta": "acc_delta",
           "adafactor": "row_var", "asgd": "ax", "rprop": "step_size", "muon": "momentum_buffer"}


@pytest.mark.parametrize("name", sorted(SWAPPED))
def test_verify_resume_passes_a_copy_and_catches_a_swapped_moment(tmp_path, cli, name):
    """``verify-resume`` exits 0 on a byte copy of a torch state (bit-exact criterion) and 1 when
    one state tensor is swapped between two same-shape parameters (nothing else notices)."""
    state, *_ = _torch_run(name, tmp_path)
    shutil.copy(state, tmp_path / "copy.pt")
    r = cli("verify-resume", state, tmp_path / "copy.pt", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["optimizer"] == name and report["criterion"] == "bit-exact" and report["tracks"]
    sd = torch.load(state, weights_only=True)
    torch.save({"optimizer": _swap(sd["optimizer"], SWAPPED[name])}, tmp_path / "swapped.pt")
    r = cli("verify-resume", state, tmp_path / "swapped.pt")
    assert r.returncode == 1 and "DIVERGES" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(("cls", "reason"), [("LBFGS", "loss closure"), ("SparseAdam", "sparse gradient")])
def test_lbfgs_and_sparseadam_are_refused_by_name(tmp_path, cli, cls, reason):
    """A real LBFGS / SparseAdam state inspects, and replay refuses it in one line naming the
    optimizer and why."""
    torch.manual_seed(0)
    if cls == "LBFGS":
        w = torch.nn.Parameter(torch.randn(4))
        opt = torch.optim.LBFGS([w], max_iter=3)
        opt.step(lambda: (opt.zero_grad(), (w ** 2).sum().backward(), (w ** 2).sum())[-1])
    else:
        emb = torch.nn.Embedding(6, 3, sparse=True)
        opt = torch.optim.SparseAdam(emb.parameters())
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "s.pt")
    save_file({"x": np.zeros(4, np.float32)}, str(tmp_path / "p.safetensors"))
    assert cli("inspect", tmp_path / "s.pt").returncode == 0
    r = cli("replay", "--state", tmp_path / "s.pt", "--params", tmp_path / "p.safetensors", "--grads",
            tmp_path / "p.safetensors", "--out-params", tmp_path / "o.safetensors")
    assert r.returncode != 0
    assert cls.lower() in r.stderr and reason in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("cls", [torch.optim.Adafactor, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta])
def test_without_torch_the_replay_is_within_tolerance(monkeypatch, cls):
    """tolerance: with torch's kernels hidden (IEEE root, float64 reductions), 20 steps of what a
    torch-free install runs (``kernel=auto``: numba where installed, else the reference) stay
    within |Δp| ≤ 4·ulp(p) + 2e-5·lr·n of real torch, and ``exactness`` says ``tolerance``."""
    from statekit.optim import backend, registry, tensorwise, tolerance

    name = CLASSES[cls.__name__]
    params, grads = problem(name, seed=4)
    tparams = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params]
    opt = cls(tparams)
    lr = opt.param_groups[0]["lr"]
    for module in (backend, registry, tensorwise, kernels):
        monkeypatch.setattr(module, "torch_available", lambda: False)
    assert so.exactness("torch", np, name) == so.TOLERANCE
    assert so.choose_kernel(name, "torch") == ("numba" if kernels.numba_available() else "reference")
    ours = [(p, {}, 0) for p in params]
    for step_grads in grads:
        for tp, g in zip(tparams, step_grads, strict=True):
            tp.grad = torch.from_numpy(g.copy())
        opt.step()
        ours = [so.step(name, p, g, s, k, {}, kernel="auto") for (p, s, k), g in zip(ours, step_grads, strict=True)]
    for (p, _, n), tp in zip(ours, tparams, strict=True):
        ref = tp.detach().numpy()
        assert tolerance.worst_ratio(p, ref, tolerance.param_bound(ref, lr, n)) <= 1


def test_without_torch_muon_is_refused(monkeypatch, tmp_path, cli):
    """Without torch, torch's Muon is refused in one line saying why (its bfloat16 products sum in
    a CPU- and kernel-dependent order), from the API and from ``replay``, nothing written."""
    from statekit.errors import UsageError
    from statekit.optim import backend

    state, params, grads, _, _ = _torch_run("muon", tmp_path)
    monkeypatch.setattr(backend, "torch_available", lambda: False)
    with pytest.raises(UsageError, match="Muon is replayed with torch's own bfloat16 matrix products"):
        so.step("muon", np.ones((4, 3), np.float32), np.ones((4, 3), np.float32), {}, 0, {})
    r = cli("replay", "--state", state, "--params", params, "--grads", *grads, "--out-params",
            tmp_path / "out.safetensors")
    assert r.returncode != 0 and "pip install torch" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()


MUON_SCRIPT = r"""
import hashlib, json, sys
import numpy as np, torch
import statekit.optim as so
rng = np.random.default_rng(0)
out = {"capability": torch.backends.cpu.get_cpu_capability()}
torch_bits, same = hashlib.sha256(), True
for shape in [(64, 48), (37, 53)]:
    p0 = rng.standard_normal(shape).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.Muon([param], lr=1e-2)
    ours = (p0.copy(), {}, 0)
    for _ in range(3):
        g = rng.standard_normal(shape).astype(np.float32)
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        ours = so.step("muon", ours[0], g, ours[1], ours[2], {"lr": 1e-2}, "torch", kernel="auto")
        same &= np.array_equal(ours[0].view(np.int32), param.detach().numpy().view(np.int32))
    torch_bits.update(param.detach().numpy().tobytes())
out["torch"], out["same"] = torch_bits.hexdigest(), bool(same)
print(json.dumps(out))
"""


def test_muon_follows_torch_whichever_kernel_torch_picks():
    """bit-exact whatever the CPU: statekit's Muon is torch's own Newton–Schulz, so it equals
    torch.optim.Muon under each of torch's kernel choices, pinned in a subprocess (ATen's CPU
    capability, oneDNN's ISA). torch's own bits differ between those choices, which is why a
    torch-free emulation cannot promise them (and is refused: the test above)."""
    import os
    import subprocess

    runs = []
    for capability, isa in (("default", "AVX2"), ("avx2", "AVX2"), ("avx2", "SSE41"), (None, None)):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for key, value in (("ATEN_CPU_CAPABILITY", capability), ("ONEDNN_MAX_CPU_ISA", isa)):
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        done = subprocess.run([sys.executable, "-c", MUON_SCRIPT], env=env, capture_output=True, text=True,
                              check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert all(run["same"] for run in runs), runs
    assert len({run["torch"] for run in runs}) > 1, "torch's kernel choices should round differently"
