"""A resized parameter's new elements start where a new parameter's state would (remap --resize):
zero for most slots, but torch creates Adagrad's ``sum`` filled with initial_accumulator_value
(torch/optim/adagrad.py), so its new rows hold that value, and real torch then steps them exactly
as it steps a new parameter. verify-resume's fresh lane agrees."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from statekit import hyper

NAMES = "0.weight\n0.bias\n"


def _trained(tmp_path, cls, **kw):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = cls(m.parameters(), **kw)
    for _ in range(3):
        m(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    torch.save(opt.state_dict(), tmp_path / "state.pt")
    torch.save(torch.nn.Sequential(torch.nn.Linear(4, 5)).state_dict(), tmp_path / "model2.pt")
    (tmp_path / "names.txt").write_text(NAMES)
    return m, opt


def _remap(cli, tmp_path):
    r = cli("remap", tmp_path / "state.pt", "--model", tmp_path / "model2.pt", "--names", tmp_path / "names.txt",
            "--resize", "-o", tmp_path / "out.pt", "--plan-out", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    return torch.load(tmp_path / "out.pt", weights_only=True)


def test_adagrad_new_rows_start_at_the_initial_accumulator_and_step_like_a_new_parameter(cli, tmp_path):
    _, opt = _trained(tmp_path, torch.optim.Adagrad, lr=0.02, initial_accumulator_value=0.1)
    before = opt.state_dict()["state"]
    out = _remap(cli, tmp_path)
    w, b = out["state"][0]["sum"], out["state"][1]["sum"]
    assert w.shape == (5, 4) and b.shape == (5,)
    assert torch.equal(w[:3], before[0]["sum"]) and torch.equal(b[:3], before[1]["sum"])
    assert torch.equal(w[3:], torch.full((2, 4), 0.1)) and torch.equal(b[3:], torch.full((2,), 0.1))

    # real torch: the migrated state loaded and stepped; the new rows move exactly as a new
    # parameter's do under a fresh Adagrad with the same settings and gradient
    new = torch.nn.Sequential(torch.nn.Linear(4, 5))
    migrated = torch.optim.Adagrad(new.parameters(), lr=0.02, initial_accumulator_value=0.1)
    migrated.load_state_dict(out)
    fresh_param = torch.nn.Parameter(new[0].weight.detach()[3:].clone())
    fresh = torch.optim.Adagrad([fresh_param], lr=0.02, initial_accumulator_value=0.1)
    g = torch.randn(5, 4)
    new[0].weight.grad, new[0].bias.grad = g.clone(), torch.zeros(5)
    fresh_param.grad = g[3:].clone()
    migrated.step()
    fresh.step()
    assert torch.equal(new[0].weight.detach()[3:], fresh_param.detach())


def test_verify_resume_takes_the_initial_accumulator_as_fresh(cli, tmp_path):
    """The migrated file tracks, new elements fresh; the same file with the new rows zeroed (what
    statekit wrote before) is reported as not fresh."""
    _trained(tmp_path, torch.optim.Adagrad, lr=0.02, initial_accumulator_value=0.1)
    out = _remap(cli, tmp_path)
    args = ["--names", tmp_path / "names.txt", "--plan", tmp_path / "plan.json", "--json", "--steps", "3"]
    r = cli("verify-resume", tmp_path / "state.pt", tmp_path / "out.pt", *args)
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["tracks"]
    assert all(row["new_elements_fresh"] for row in report["params"])
    for i in (0, 1):
        out["state"][i]["sum"][3:] = 0.0
    torch.save(out, tmp_path / "zeroed.pt")
    r = cli("verify-resume", tmp_path / "state.pt", tmp_path / "zeroed.pt", *args)
    report = json.loads(r.stdout)
    assert r.returncode == 1 and not any(row["new_elements_fresh"] for row in report["params"])


def test_adam_new_rows_stay_zero(cli, tmp_path):
    _, opt = _trained(tmp_path, torch.optim.Adam, lr=0.01)
    out = _remap(cli, tmp_path)
    for slot in ("exp_avg", "exp_avg_sq"):
        assert torch.count_nonzero(out["state"][0][slot][3:]) == 0
        assert torch.equal(out["state"][0][slot][:3], opt.state_dict()["state"][0][slot])


@pytest.mark.parametrize(("family", "slot", "group", "want"), [
    ("adagrad", "sum", {"initial_accumulator_value": 0.25}, 0.25),
    ("rprop", "step_size", {"lr": 0.01}, 0.01),
    ("adam", "exp_avg", {"lr": 0.01}, 0.0),
    ("adagrad", "sum", {}, None),
])
def test_fresh_values_come_from_torchs_initialisation(family, slot, group, want):
    assert hyper.fresh_value(family, slot, group) == want
    assert np.float32(0.1) == np.float32(hyper.fresh_value("adagrad", "sum", {"initial_accumulator_value": 0.1}))


def test_the_padded_rows_warning_speaks_of_the_family(cli, tmp_path):
    """Adam's bias correction (3.16×), SGD's dampened first update, Adagrad's step count: each
    family's own warning, and none for SGD without dampening, whose padded rows are new ones."""
    def warnings(cls, **kw):
        _trained(tmp_path, cls, **kw)
        r = cli("remap", tmp_path / "state.pt", "--model", tmp_path / "model2.pt", "--names", tmp_path / "names.txt",
                "--resize", "-o", tmp_path / "out.pt")
        assert r.returncode == 0, r.stderr
        return [line for line in r.stderr.splitlines() if "padded rows" in line]

    adam = warnings(torch.optim.Adam, lr=0.01)
    assert len(adam) == 1 and "3.16" in adam[0]
    adagrad = warnings(torch.optim.Adagrad, lr=0.01, lr_decay=0.01)
    assert len(adagrad) == 1 and "step count" in adagrad[0] and "3.16" not in adagrad[0]
    sgd = warnings(torch.optim.SGD, lr=0.01, momentum=0.9, dampening=0.1)
    assert len(sgd) == 1 and "dampening 0.1" in sgd[0] and "0.9×" in sgd[0]
    assert warnings(torch.optim.SGD, lr=0.01, momentum=0.9) == []


def test_sgd_padded_rows_first_update_is_one_minus_dampening_of_a_new_parameters(cli, tmp_path):
    """What the SGD warning says, in real torch: loaded and stepped once, a padded row moves
    (1 - dampening)× as far as a new parameter under a fresh SGD with the same gradient; with no
    dampening, exactly as far."""
    for damp in (0.1, 0.0):
        _trained(tmp_path, torch.optim.SGD, lr=0.01, momentum=0.9, dampening=damp)
        out = _remap(cli, tmp_path)
        new = torch.nn.Sequential(torch.nn.Linear(4, 5))
        opt = torch.optim.SGD(new.parameters(), lr=0.01, momentum=0.9, dampening=damp)
        opt.load_state_dict(out)
        fresh_param = torch.nn.Parameter(new[0].weight.detach()[3:].clone())
        fresh = torch.optim.SGD([fresh_param], lr=0.01, momentum=0.9, dampening=damp)
        start = new[0].weight.detach()[3:].clone()
        g = torch.randn(5, 4)
        new[0].weight.grad, new[0].bias.grad = g.clone(), torch.zeros(5)
        fresh_param.grad = g[3:].clone()
        opt.step()
        fresh.step()
        moved, moved_fresh = new[0].weight.detach()[3:] - start, fresh_param.detach() - start
        assert torch.allclose(moved, (1 - damp) * moved_fresh, rtol=1e-4, atol=1e-9)
