"""Every torch 2.13 optimizer is reported as its own family or as unknown, never as another; converting
its state either resumes bit-identically in real torch or is refused by name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from statekit import io  # noqa: E402
from statekit.errors import StatekitError  # noqa: E402
from statekit.frameworks import torch_families  # noqa: E402
from statekit.ops.convert import convert, load_model  # noqa: E402
from statekit.ops.options import Options  # noqa: E402

# torch.optim class → statekit family (None: statekit must say "unknown")
EXPECTED = {
    "Adam": "adam", "AdamW": "adamw", "SGD": "sgd", "RMSprop": "rmsprop", "Adagrad": "adagrad", "NAdam": "nadam",
    "RAdam": "radam", "Adamax": "adamax", "Adadelta": "adadelta", "Adafactor": "adafactor", "ASGD": "asgd",
    "Rprop": "rprop", "SparseAdam": "sparseadam", "Muon": "muon", "LBFGS": "lbfgs",
}
KWARGS = {"SGD": {"momentum": 0.9}, "RMSprop": {"momentum": 0.5, "centered": True}}


def optimizers() -> list[str]:
    return sorted(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                  and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer")


def test_every_torch_optimizer_is_in_the_table():
    assert set(optimizers()) == set(EXPECTED), "a torch.optim class is missing from the test table"
    assert {f.cls for f in torch_families.FAMILIES} == set(EXPECTED)


def build(name: str, seed: int = 0, **extra):
    torch.manual_seed(seed)
    if name == "SparseAdam":
        model = torch.nn.Embedding(6, 3, sparse=True)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = [p for p in model.parameters() if name != "Muon" or p.ndim == 2]
    opt = getattr(torch.optim, name)(params, **{**KWARGS.get(name, {}), **extra})
    return model, opt


def run(name: str, model, opt, steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(100 + i)

        def closure(g=g):
            opt.zero_grad()
            if name == "SparseAdam":
                loss = model(torch.randint(0, 6, (4,), generator=g)).pow(2).sum()
            else:
                loss = model(torch.randn(5, 4, generator=g)).pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    root = tmp_path_factory.mktemp("families")
    for name in EXPECTED:
        model, opt = build(name)
        run(name, model, opt, range(3))
        path = root / f"{name}.pt"
        torch.save(opt.state_dict(), path)
        torch.save(model.state_dict(), root / f"{name}-model.pt")
        out[name] = path
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_keys_match_the_table(name, saved):
    sd = torch.load(saved[name])
    group = sd["param_groups"][0]
    fam = torch_families.BY_NAME[EXPECTED[name]]
    assert set(group) - {"params"} == fam.keys
    for entry in sd["state"].values():
        assert fam.required <= set(entry) <= fam.required | fam.optional


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_family_is_its_own(name, saved):
    with io.open_checkpoint(saved[name]) as ckpt:
        assert ckpt.optimizer.family == EXPECTED[name]


def resumes_identically(name: str, original, converted) -> bool:
    results = []
    for path in (original, converted):
        model, opt = build(name)
        run(name, model, opt, range(3))  # the same weights as when the state was saved
        opt.load_state_dict(torch.load(path))
        run(name, model, opt, range(3, 6))
        results.append([p.detach().clone() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


# what statekit does with each (measured by the test below): torch → torch resumes bit-identically
# for every family it converts; burn has Adam, AdamW, SGD, RMSprop, Adagrad, Adafactor and Muon of
# these, and L-BFGS; torch → burn → torch Muon comes back within a
# float32 unit of the buffer and tracks (tests/test_convert_crossing.py), not bit for bit
CONVERTED = {"adam", "adamw", "sgd", "rmsprop", "adagrad", "nadam", "radam", "adamax", "adadelta", "adafactor",
             "muon", "lbfgs"}
IN_BURN = {"adam", "adamw", "sgd", "rmsprop", "adagrad", "adafactor", "muon", "lbfgs"}
TRACKS_THROUGH_BURN = {"muon"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_convert_resumes_bit_identically_or_is_refused_by_name(name, saved, tmp_path):
    src = saved[name]
    family = EXPECTED[name]
    model = load_model(str(src.with_name(f"{name}-model.pt")))  # names the positions (torch → burn needs them)
    for first, back in ((tmp_path / "same.pt", None), (tmp_path / "via.bpk", tmp_path / "back.pt")):
        expect_ok = family in CONVERTED and (back is None or family in IN_BURN)
        try:
            convert(str(src), str(first), Options(no_transpose=["*"], model=model))
            if back is not None:
                convert(str(first), str(back), Options(no_transpose=["*"], optimizer=family))
        except StatekitError as exc:
            assert not expect_ok, f"{name} → {first.suffix}: {exc}"
            assert (cls := torch_families.class_name(family)) in exc.message or f"no {family} optimizer" in exc.message, \
                (cls, exc.message)
            assert "\n" not in exc.message
            continue
        assert expect_ok, f"{name} → {first.suffix} was converted"
        if back is not None and family in TRACKS_THROUGH_BURN:
            continue
        assert resumes_identically(name, src, back or first), f"{name}: {first} does not resume identically"


def test_older_torch_adam_group_is_not_guessed(tmp_path, saved):
    sd = torch.load(saved["AdamW"])
    for g in sd["param_groups"]:
        del g["decoupled_weight_decay"]  # torch < 2.6 wrote Adam and AdamW groups with identical keys
    torch.save(sd, tmp_path / "old.pt")
    with io.open_checkpoint(tmp_path / "old.pt") as ckpt:
        assert ckpt.optimizer.family is None
        assert set(ckpt.optimizer.candidates) >= {"adam", "adamw"}
        assert "unknown (fields" in ckpt.optimizer.family_label
    with pytest.raises(StatekitError, match="unknown"):
        convert(str(tmp_path / "old.pt"), str(tmp_path / "o.pt"))
    convert(str(tmp_path / "old.pt"), str(tmp_path / "o.pt"), Options(optimizer="adamw"))
    assert torch.load(tmp_path / "o.pt")["param_groups"][0]["decoupled_weight_decay"] is True


def test_foreign_key_makes_a_group_unknown(tmp_path, saved):
    sd = torch.load(saved["SGD"])
    sd["param_groups"][0]["ns_steps"] = 5  # a Muon hyperparameter in an SGD group: not SGD, not Muon
    torch.save(sd, tmp_path / "odd.pt")
    with io.open_checkpoint(tmp_path / "odd.pt") as ckpt:
        assert ckpt.optimizer.family is None and "ns_steps" in ckpt.optimizer.family_label


def test_burn_has_no_such_optimizer_said_once(saved, tmp_path):
    with io.open_checkpoint(saved["NAdam"]) as ckpt:
        notes = [n for n in ckpt.optimizer.notes if "burn has no" in n]
        assert notes == ["burn has no NAdam optimizer: this state can move to other torch files, not to burn"]
    with pytest.raises(StatekitError) as info:
        convert(str(saved["NAdam"]), str(tmp_path / "o.bpk"), Options(no_transpose=["*"]))
    assert str(info.value).count("nadam") == 1
