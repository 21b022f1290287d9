"""torch's ``capturable`` and ``differentiable`` group flags in replay and verify-resume.

What torch 2.13 does with them (torch/optim/*.py, and real torch in this run):

* ``capturable=True``: every optimizer that has the flag refuses to step on a CPU; elsewhere it steps
  on tensors (Adam's bias corrections in float32 …). statekit does not model it: refused, naming
  the param group.
* ``differentiable=True``: Adam, AdamW and NAdam take that same tensor path ("if capturable or
  differentiable") and land on other bits: refused. SGD, RMSprop, Adagrad, RAdam, Adamax, Adadelta,
  ASGD and Rprop only clone a tensor or go out of place (``avg.add(eps)`` for ``avg.add_(eps)``,
  ``amax`` of a stack for ``maximum``): the same values, so replayed, and checked here bit for bit
  against real torch stepping with the flag on.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

SHAPES = {"w": (12, 5), "b": (5,)}
SAME = {  # replayed with differentiable=True: torch's values do not change
    "SGD": dict(lr=1e-2, momentum=0.9, dampening=0.1, nesterov=False, weight_decay=0.01),
    "RMSprop": dict(lr=1e-2, momentum=0.5, centered=True, weight_decay=0.01),
    "Adagrad": dict(lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1),
    "RAdam": dict(lr=1e-2, weight_decay=0.01),
    "Adamax": dict(lr=1e-2, weight_decay=0.01),
    "Adadelta": dict(lr=1.0, weight_decay=0.01),
    "ASGD": dict(lr=1e-2, lambd=1e-2, t0=2.0),
    "Rprop": dict(lr=1e-2),
}
DIFFER = {"Adam": dict(lr=1e-2), "AdamW": dict(lr=1e-2), "NAdam": dict(lr=1e-2)}
CAPTURABLE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop", "RMSprop")


def _grads(seed: int, n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)]


def _run(cls: str, kw: dict, flags: dict, grads: list[dict], start: dict[str, np.ndarray], state=None):
    """Real torch (the for-loop path) from ``start``, stepping ``grads``: (params, optimizer)."""
    # plain tensors: differentiable=True keeps autograd on, and in-place steps on leaves that require grad fail
    params = {k: torch.from_numpy(v.copy()) for k, v in start.items()}
    opt = getattr(torch.optim, cls)(list(params.items()), foreach=False, **kw, **flags)
    if state is not None:  # a copy: torch loads same-dtype tensors as they are, and steps them in place
        opt.load_state_dict(copy.deepcopy(state))
    for g in grads:
        for k, p in params.items():
            p.grad = torch.from_numpy(g[k])
        opt.step()
    return {k: p.detach().numpy().copy() for k, p in params.items()}, opt


def _state_file(tmp_path, cls: str, kw: dict, flags: dict):
    """A torch state after 3 steps with ``flags`` (its param groups keep them), the parameters
    then, and 4 more gradients as files."""
    rng = np.random.default_rng(0)
    p0 = {k: rng.normal(0, 0.5, s).astype(np.float32) for k, s in SHAPES.items()}
    p3, opt = _run(cls, kw, flags, _grads(1, 3), p0)
    torch.save(opt.state_dict(), tmp_path / "state.pt")
    save_file(p3, str(tmp_path / "p3.safetensors"))
    later = _grads(2, 4)
    files = []
    for i, g in enumerate(later):
        save_file(g, str(tmp_path / f"g{i}.safetensors"))
        files.append(tmp_path / f"g{i}.safetensors")
    return p3, opt.state_dict(), later, files


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("cls", sorted(SAME))
def test_differentiable_groups_that_step_the_same_are_replayed_bit_for_bit(cli, tmp_path, cls):
    kw = SAME[cls]
    p3, state, later, files = _state_file(tmp_path, cls, kw, {"differentiable": True})
    assert state["param_groups"][0]["differentiable"] is True
    want, _ = _run(cls, kw, {"differentiable": True}, later, p3, state)  # real torch, the flag on
    plain_state = copy.deepcopy(state)
    for g in plain_state["param_groups"]:
        g["differentiable"] = False
    plain, _ = _run(cls, kw, {}, later, p3, plain_state)
    r = cli("replay", "--state", tmp_path / "state.pt", "--params", tmp_path / "p3.safetensors", "--grads", *files,
            "--out-params", tmp_path / "out.safetensors", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["optimizer"] == cls.lower()
    got = load_file(str(tmp_path / "out.safetensors"))
    for k in SHAPES:
        assert np.array_equal(_bits(got[k]), _bits(want[k])), k
        assert np.array_equal(_bits(want[k]), _bits(plain[k])), k  # torch itself: the flag changes no bit


@pytest.mark.parametrize("cls", sorted(DIFFER))
def test_differentiable_adam_adamw_nadam_are_refused_by_group(cli, tmp_path, cls):
    kw = DIFFER[cls]
    p3, state, later, files = _state_file(tmp_path, cls, kw, {"differentiable": True})
    on, _ = _run(cls, kw, {"differentiable": True}, later, p3, state)
    off_state = copy.deepcopy(state)
    for g in off_state["param_groups"]:
        g["differentiable"] = False
    off, _ = _run(cls, kw, {}, later, p3, off_state)
    assert any(not np.array_equal(_bits(on[k]), _bits(off[k])) for k in SHAPES)  # torch: other bits with the flag
    out = tmp_path / "out.safetensors"
    r = cli("replay", "--state", tmp_path / "state.pt", "--params", tmp_path / "p3.safetensors", "--grads", *files,
            "--out-params", out)
    assert r.returncode != 0 and "Traceback" not in r.stderr and not out.exists()
    assert "param group 0 has differentiable=True" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("cls", CAPTURABLE)
def test_capturable_groups_are_refused_by_group(cli, tmp_path, cls):
    """torch will not step them on a CPU, and statekit does not model that step: refused, never run as
    if the flag were off. Group 1 holds it here; group 0 does not."""
    kw = dict(SAME.get(cls) or DIFFER.get(cls))
    with pytest.raises(AssertionError, match="capturable=True"):
        _run(cls, kw, {"capturable": True}, _grads(1, 1), {k: np.zeros(s, np.float32) for k, s in SHAPES.items()})
    p3, state, _, files = _state_file(tmp_path, cls, kw, {})
    second = dict(state["param_groups"][0], params=[1], param_names=["b"], capturable=True)
    state["param_groups"] = [dict(state["param_groups"][0], params=[0], param_names=["w"]), second]
    torch.save(state, tmp_path / "capturable.pt")
    out = tmp_path / "out.safetensors"
    r = cli("replay", "--state", tmp_path / "capturable.pt", "--params", tmp_path / "p3.safetensors", "--grads",
            *files, "--out-params", out)
    assert r.returncode != 0 and "Traceback" not in r.stderr and not out.exists()
    assert "param group 1 has capturable=True" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("verify-resume", tmp_path / "state.pt", tmp_path / "capturable.pt")
    assert r.returncode != 0 and "param group 1 has capturable=True" in r.stderr and "Traceback" not in r.stderr


def test_a_state_stepped_as_another_optimizer_names_its_file_and_parameter(cli, tmp_path):
    """--optimizer sgd on an RMSprop state: refused by the step's own check of the slots, in one
    line that names the state file, the parameter and the flag to look at; nothing written."""
    _, _, _, files = _state_file(tmp_path, "RMSprop", SAME["RMSprop"], {})
    out = tmp_path / "out.safetensors"
    r = cli("replay", "--state", tmp_path / "state.pt", "--params", tmp_path / "p3.safetensors", "--grads", *files,
            "--out-params", out, "--optimizer", "sgd")
    assert r.returncode == 2 and "Traceback" not in r.stderr and not out.exists()
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1
    assert f"{tmp_path / 'state.pt'}: w: unexpected optimizer state slots" in line or \
        f"{tmp_path / 'state.pt'}: b: unexpected optimizer state slots" in line
    assert "square_avg" in line and "check --optimizer" in line


def test_verify_resume_as_another_optimizer_names_the_side(cli):
    r = cli("verify-resume", "fixtures/hand-optim-rmsprop.bpk", "fixtures/hand-optim-rmsprop.bpk", "--optimizer", "sgd",
            "--steps", "2")
    line = r.stderr.strip()
    assert r.returncode == 2 and len(line.splitlines()) == 1 and "Traceback" not in line
    assert line.startswith("statekit: error: fixtures/hand-optim-rmsprop.bpk: l")  # the first parameter: l1.*/l2.*
    assert "square_avg" in line and "check --optimizer" in line
