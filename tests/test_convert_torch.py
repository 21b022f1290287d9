"""convert between burn .bpk and PyTorch .pt, checked against real torch 2.13."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import ROOT  # noqa: E402

from statekit import io  # noqa: E402
from statekit.formats.burnpack import BurnpackFile  # noqa: E402
from statekit.ops.build import Options  # noqa: E402
from statekit.ops.convert import convert  # noqa: E402

HAND_NAMES = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]


def mlp(seed=0, d=4, h=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.ReLU(), torch.nn.Linear(h, 1))


def batches(n, seed=1, d=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, d, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3, eps=1e-6),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=3e-3, amsgrad=True, weight_decay=0.05),
    "adam-l2": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.1),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=1e-3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_pt_to_bpk_to_pt_resumes_bit_identically(name, tmp_path, cli):
    data = batches(15)
    model = mlp()
    opt = OPTIMIZERS[name](model.parameters())
    train(model, opt, data[:5])
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    names = tmp_path / "names.txt"
    names.write_text("\n".join(n for n, _ in model.named_parameters()))
    # the uninterrupted run
    train(model, opt, data[5:])
    expected = [p.detach().clone() for p in model.parameters()]

    r = cli("convert", tmp_path / "opt.pt", tmp_path / "opt.bpk", "--names", names, "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr
    r = cli("convert", tmp_path / "opt.bpk", tmp_path / "back.pt", "--names", names, "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr

    resumed = mlp()
    resumed.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    opt2 = OPTIMIZERS[name](resumed.parameters())
    opt2.load_state_dict(torch.load(tmp_path / "back.pt", weights_only=True))
    train(resumed, opt2, data[5:])
    for a, b in zip(expected, resumed.parameters(), strict=True):
        assert torch.equal(a, b.detach())


def test_burn_weights_are_transposed_not_reshaped(tmp_path, cli):
    (tmp_path / "names.txt").write_text("\n".join(HAND_NAMES))
    out = tmp_path / "hand.pt"
    r = cli("convert", "fixtures/hand-optim.bpk", out, "--optimizer", "adam", "--names", tmp_path / "names.txt",
            "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr
    assert "eps=1e-05*" in r.stdout and "assumed" in r.stderr
    sd = torch.load(out, weights_only=True)
    with BurnpackFile(ROOT / "fixtures/hand-optim.bpk") as pack:
        m1 = pack.tensor("18402649998147242804.momentum.moment_1").numpy()
        m2 = pack.tensor("708128169117982014.momentum.moment_2").numpy()
    assert np.array_equal(sd["state"][0]["exp_avg"].numpy(), m1.T)
    assert np.array_equal(sd["state"][2]["exp_avg_sq"].numpy(), m2.T)
    assert sd["state"][0]["step"].dtype == torch.float32 and sd["state"][0]["step"].item() == 21.0
    assert sd["state"][0]["step"].dim() == 0
    group = sd["param_groups"][0]
    assert group["eps"] == 1e-5 and group["betas"] == (0.9, 0.999) and group["param_names"] == HAND_NAMES
    # torch loads it and steps
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(torch.load(out, weights_only=True, mmap=True))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert opt.state_dict()["state"][0]["step"].item() == 22.0


def test_transposes_decided_by_a_target_model(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    sd = {n.replace("0.", "l1.").replace("2.", "l2."): p for n, p in model.state_dict().items()}
    torch.save(sd, tmp_path / "model.pt")
    from statekit.ops.convert import load_model

    res = convert(str(ROOT / "fixtures/hand-optim.bpk"), str(tmp_path / "o.pt"),
                  Options(optimizer="adamw", model=load_model(str(tmp_path / "model.pt"))))
    assert [a.transpose for a in res.plan.params] == [True, False, True, False]
    assert [a.dst_index for a in res.plan.params] == [0, 1, 2, 3]
    got = torch.load(tmp_path / "o.pt", weights_only=True)
    assert got["param_groups"][0]["weight_decay"] == 1e-4 and got["param_groups"][0]["decoupled_weight_decay"]


def test_square_weight_without_a_rule_is_refused(tmp_path, cli):
    model = mlp(d=16)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, batches(2, d=16))
    torch.save(opt.state_dict(), tmp_path / "sq.pt")
    names = tmp_path / "n.txt"
    names.write_text("\n".join(n for n, _ in model.named_parameters()))
    torch.save({k.replace(".", "_x."): v for k, v in model.state_dict().items()}, tmp_path / "m.pt")
    r = cli("convert", tmp_path / "sq.pt", tmp_path / "sq.bpk", "--names", names)
    assert r.returncode == 1 and "0.weight [16, 16]" in r.stderr and "--transpose" in r.stderr
    assert not (tmp_path / "sq.bpk").exists()


def test_burn_to_torch_needs_an_order(tmp_path, cli):
    r = cli("convert", "fixtures/hand-optim.bpk", tmp_path / "o.pt", "--optimizer", "adam", "--transpose", "*.weight")
    assert r.returncode == 1 and "by position" in r.stderr and not (tmp_path / "o.pt").exists()


def test_ambiguous_family_is_asked_for(tmp_path, cli):
    r = cli("convert", "fixtures/hand-optim.bpk", tmp_path / "o.pt", "--names", "/dev/null")
    assert r.returncode == 2 and "--optimizer adam|adamw" in r.stderr


def test_field_without_counterpart_is_refused_by_name(tmp_path, cli):
    model = mlp()
    opt = torch.optim.NAdam(model.parameters())
    train(model, opt, batches(2))
    torch.save(opt.state_dict(), tmp_path / "nadam.pt")
    names = tmp_path / "n.txt"
    names.write_text("\n".join(n for n, _ in model.named_parameters()))
    r = cli("convert", tmp_path / "nadam.pt", tmp_path / "o.bpk", "--names", names, "--transpose", "*.weight")
    assert r.returncode == 1 and "nadam" in r.stderr and not (tmp_path / "o.bpk").exists()


def test_names_in_the_wrong_order_are_refused_with_both_names(tmp_path, cli):
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, batches(1))
    # a training checkpoint: its model state_dict names the optimizer's positions
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    names = tmp_path / "n.txt"
    names.write_text("0.weight\n2.weight\n0.bias\n2.bias\n")
    r = cli("convert", tmp_path / "ckpt.pt", tmp_path / "o.bpk", "--names", names, "--transpose", "*.weight")
    assert r.returncode == 1 and "'0.bias'" in r.stderr and "'2.weight'" in r.stderr
    assert not (tmp_path / "o.bpk").exists()


def test_names_checked_against_shapes():
    from statekit.errors import MappingError
    from statekit.frameworks.torch_names import from_names, name_state
    from statekit.state import OptimizerState, ParamState
    from statekit.tensor import TensorRef

    state = OptimizerState("adam", params=[
        ParamState(key=str(i), index=i, slots={"exp_avg": TensorRef.from_array(np.zeros(s, np.float32))})
        for i, s in enumerate([(16, 4), (16,)])])
    with pytest.raises(MappingError, match=r"#0.*\[16, 4\].*'b'.*\[16\]"):
        name_state(state, from_names(["b", "w"], [(16,), (16, 4)], source="names.txt"), "x.pt")


def test_step_beyond_float32_integers_is_refused(tmp_path):
    state = io.open_checkpoint(ROOT / "fixtures/hand-optim.bpk").optimizer
    for p in state.params:
        p.step = 2**24 + 1
    from statekit.errors import MappingError
    from statekit.frameworks.torch_io import save_optimizer
    from statekit.hyper import torch_group

    with pytest.raises(MappingError, match="2\\^24"):
        save_optimizer(state, str(tmp_path / "o.pt"), family="adam", groups=[torch_group("adam", {})])
    assert not (tmp_path / "o.pt").exists()


def test_training_checkpoint_and_key(tmp_path, cli):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, batches(2))
    torch.save({"model": model.state_dict(), "optimizer_state_dict": opt.state_dict(),
                "ema_optimizer": opt.state_dict(), "epoch": 7}, tmp_path / "ckpt.pt")
    r = cli("inspect", tmp_path / "ckpt.pt", "--json")
    assert r.returncode == 1 and "--key" in r.stderr
    d = json.loads(cli("inspect", tmp_path / "ckpt.pt", "--json", "--key", "optimizer_state_dict").stdout)
    assert d["family"] == "sgd" and [p["path"] for p in d["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert d["scalar_values"]["epoch"] == 7


def test_dry_run_and_plan_roundtrip(tmp_path, cli):
    (tmp_path / "n.txt").write_text("\n".join(HAND_NAMES))
    args = ["fixtures/hand-optim.bpk", tmp_path / "a.pt", "--optimizer", "adam", "--names", tmp_path / "n.txt",
            "--transpose", "l*.weight", "--lr", "3e-4"]
    r = cli("convert", *args, "--dry-run", "--plan-out", tmp_path / "plan.json")
    assert r.returncode == 0 and not (tmp_path / "a.pt").exists() and "transpose" in r.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["hyperparams"][0]["lr"] == 3e-4 and "lr" not in plan["assumed"]
    assert cli("convert", *args).returncode == 0
    r = cli("convert", "fixtures/hand-optim.bpk", tmp_path / "b.pt", "--plan", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    b = torch.load(tmp_path / "b.pt", weights_only=True)
    assert a["param_groups"] == b["param_groups"]
    for k in a["state"]:
        for f in a["state"][k]:
            assert torch.equal(a["state"][k][f], b["state"][k][f])


@pytest.mark.parametrize("path", sorted((ROOT / "fixtures/torch").glob("*")), ids=lambda p: p.name)
def test_every_real_torch_fixture_inspects_or_fails_cleanly(path, cli):
    r = cli("inspect", path, "--json")
    if r.returncode == 0:
        json.loads(r.stdout)
    else:
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_two_param_groups_survive_a_round_trip_through_burn(tmp_path, cli):
    data = batches(12)
    model = mlp()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]

    def make(m):
        ps = dict(m.named_parameters())
        return torch.optim.AdamW([{"params": [ps["0.weight"], ps["2.weight"]], "weight_decay": 0.1},
                                  {"params": [ps["0.bias"], ps["2.bias"]], "weight_decay": 0.0, "lr": 1e-2}], lr=3e-3)

    assert decay and no_decay
    opt = make(model)
    train(model, opt, data[:4])
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    names = tmp_path / "names.txt"  # the optimizer's own order: group 0, then group 1
    names.write_text("0.weight\n2.weight\n0.bias\n2.bias\n")
    train(model, opt, data[4:])
    expected = [p.detach().clone() for p in model.parameters()]

    assert cli("convert", tmp_path / "ckpt.pt", tmp_path / "o.bpk", "--names", names, "--names-order", "optimizer",
               "--transpose", "*.weight").returncode == 0
    d = json.loads(cli("inspect", tmp_path / "o.bpk", "--json").stdout)
    assert [g["params"] for g in d["groups"]] == [2, 2]
    r = cli("convert", tmp_path / "o.bpk", tmp_path / "back.pt", "--names", names, "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert [g["weight_decay"] for g in back["param_groups"]] == [0.1, 0.0]
    assert [g["lr"] for g in back["param_groups"]] == [3e-3, 1e-2]

    resumed = mlp()
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"])
    opt2 = make(resumed)
    opt2.load_state_dict(back)
    train(resumed, opt2, data[4:])
    for a, b in zip(expected, resumed.parameters(), strict=True):
        assert torch.equal(a, b.detach())


TORCH_FAMILIES = {
    "adam": (lambda p: torch.optim.Adam(p), {"exp_avg", "exp_avg_sq"}),
    "adamw": (lambda p: torch.optim.AdamW(p, amsgrad=True), {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), {"momentum_buffer"}),
    "rmsprop": (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), {"square_avg", "grad_avg", "momentum_buffer"}),
    "adagrad": (lambda p: torch.optim.Adagrad(p), {"sum"}),
    "nadam": (lambda p: torch.optim.NAdam(p), {"exp_avg", "exp_avg_sq", "mu_product"}),
    "radam": (lambda p: torch.optim.RAdam(p), {"exp_avg", "exp_avg_sq"}),
    "adamax": (lambda p: torch.optim.Adamax(p), {"exp_avg", "exp_inf"}),
    "adafactor": (lambda p: torch.optim.Adafactor(p), {"row_var", "col_var"}),
    "adadelta": (lambda p: torch.optim.Adadelta(p), {"square_avg", "acc_delta"}),
}


@pytest.mark.parametrize("family", list(TORCH_FAMILIES))
def test_inspect_every_torch_optimizer(tmp_path, cli, family):
    make, fields = TORCH_FAMILIES[family]
    model = mlp()
    opt = make(model.parameters())
    train(model, opt, batches(2))
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    r = cli("inspect", tmp_path / "o.pt", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["family"] == family and d["hyperparameters_stored"]
    assert set(d["params"][0]["fields"]) == fields  # weights of a Linear (rank 2)
    assert d["params"][0]["step"] == (None if family == "sgd" else 2.0)


def test_a_frozen_parameter_without_state_converts(tmp_path, cli):
    model = mlp()
    model[0].weight.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, batches(2))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    r = cli("convert", tmp_path / "ckpt.pt", tmp_path / "o.bpk", "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr
    d = json.loads(cli("inspect", tmp_path / "o.bpk", "--json").stdout)
    assert sorted(p["path"] for p in d["params"]) == ["0.bias", "2.bias", "2.weight"]
    (tmp_path / "n.txt").write_text("0.weight\n0.bias\n2.weight\n2.bias\n")
    r = cli("convert", tmp_path / "o.bpk", tmp_path / "back.pt", "--names", tmp_path / "n.txt", "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert sorted(back["state"]) == [1, 2, 3] and back["param_groups"][0]["params"] == [0, 1, 2, 3]
    opt2 = torch.optim.Adam(mlp().parameters())
    opt2.load_state_dict(back)
