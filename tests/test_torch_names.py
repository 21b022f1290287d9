"""Names for a torch state's positions are solved from order and shapes, or refused — never guessed.

The Trainer-like fixture (fixtures/trainer_like/, scripts/make_trainer_like_fixture.py) has two
param groups, decay then no-decay, each in named_parameters() order: a flat named_parameters()
list is NOT its order, and 18 of 28 parameters were mislabelled before the resolver.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from statekit import io
from statekit.errors import MappingError, UsageError
from statekit.frameworks.torch_names import ModelEntry, ModelOrder, NamesError, read_names_file, resolve
from statekit.ops.convert import convert, load_model, read_names
from statekit.ops.doctor import doctor_files
from statekit.ops.options import Options

ROOT = Path(__file__).resolve().parent.parent
TL = ROOT / "fixtures" / "trainer_like"


def order(entries, ordered=True, name="m.pt"):
    return ModelOrder([ModelEntry(n, s) for n, s in entries], ordered, name)


# ----------------------------------------------------------------------------- the solver


def test_two_groups_placed_in_model_order_by_shape():
    model = [("emb", (10, 4)), ("ln.w", (4,)), ("ln.b", (4,)), ("fc.w", (4, 12)), ("fc.b", (12,)),
             ("out.w", (12, 4)), ("out.b", (4,))]
    decay = [s for _, s in model if len(s) == 2]
    rest = [s for _, s in model if len(s) == 1]
    res = resolve([decay, rest], order(model))
    assert res.names == [["emb", "fc.w", "out.w"], ["ln.w", "ln.b", "fc.b", "out.b"]]


def test_ambiguous_group_order_is_refused_naming_both():
    # two same-shape parameters, one per group: either could be in either group
    with pytest.raises(NamesError) as info:
        resolve([[(4,)], [(4,)]], order([("a.weight", (4,)), ("b.weight", (4,))]))
    msg = info.value.message
    assert info.value.ambiguous
    assert "group 0 position 0" in msg and "group 1 position 0" in msg
    assert "a.weight" in msg and "b.weight" in msg and "--names-order optimizer" in msg


def test_extra_model_parameters_make_a_same_shape_choice_ambiguous():
    with pytest.raises(NamesError, match=r"#0 \[4\]: one of a, b"):
        resolve([[(4,), (3,)]], order([("a", (4,)), ("b", (4,)), ("c", (3,))]))
    # a frozen parameter of another shape does not
    assert resolve([[(4,), (3,)]], order([("a", (4,)), ("f", (7,)), ("c", (3,))])).names == [["a", "c"]]


def test_no_solution_names_the_first_conflict():
    with pytest.raises(NamesError, match=r"position #1 holds \[5\] state but 'b'") as info:
        resolve([[(4,), (5,)]], order([("a", (4,)), ("b", (6,))]))
    assert not info.value.ambiguous


def test_positions_without_state_fit_anything_but_are_not_guessed():
    assert resolve([[(4,), None]], order([("a", (4,)), ("b", (9,))])).names == [["a", "b"]]
    with pytest.raises(NamesError):
        resolve([[None], [None]], order([("a", (4,)), ("b", (9,))]))


def test_unordered_source_uses_shapes_only():
    model = [("z.w", (3, 4)), ("a.b", (4,)), ("m.w", (5,))]
    assert resolve([[(5,), (3, 4)], [(4,)]], order(model, ordered=False)).names == [["m.w", "z.w"], ["a.b"]]
    with pytest.raises(NamesError, match="keeps no named_parameters"):
        resolve([[(4,)], [(4,)]], order([("a", (4,)), ("b", (4,))], ordered=False))


def test_names_files(tmp_path):
    (tmp_path / "n.txt").write_text("fc.weight [16, 4]\nfc.bias 16\n")
    src = read_names_file(str(tmp_path / "n.txt"))
    assert [(e.name, e.shape) for e in src.entries] == [("fc.weight", (16, 4)), ("fc.bias", (16,))]
    (tmp_path / "n.json").write_text(json.dumps([["fc.weight", [16, 4]], ["fc.bias", [16]]]))
    assert [e.shape for e in read_names_file(str(tmp_path / "n.json")).entries] == [(16, 4), (16,)]
    with pytest.raises(UsageError, match="is a model or state file, not a names list; give a model file with --model"):
        read_names(str(TL / "pytorch_model.bin"))
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UsageError, match="not a UTF-8 text names list"):
        read_names(str(tmp_path / "bin"))


# ----------------------------------------------------------------------------- the Trainer-like fixture


def _fixture_script():
    spec = importlib.util.spec_from_file_location("tl", ROOT / "scripts" / "make_trainer_like_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def true_names() -> list[str]:
    """The optimizer's order, from Trainer's grouping rule applied to the model (not from statekit)."""
    pytest.importorskip("torch")
    mod = _fixture_script()
    model = mod.TinyGPT()
    decay = set(mod.decay_parameter_names(model))
    names = [n for n, _ in model.named_parameters()]
    return [n for n in names if n in decay] + [n for n in names if n not in decay]


def named(path, **opts) -> list[str | None]:
    from statekit.ops.convert import name_source_params

    with io.open_checkpoint(path) as ckpt:
        name_source_params(ckpt.optimizer, Options(**opts), str(path))
        by_key = {p.key: p for p in ckpt.optimizer.params}
        return [by_key[k].path for g in ckpt.optimizer.groups for k in g.keys]


def test_trainer_state_named_from_the_state_dict():
    assert named(TL / "optimizer.pt", model=load_model(str(TL / "pytorch_model.bin"))) == true_names()


def test_trainer_state_with_safetensors_needs_the_order():
    with pytest.raises(NamesError) as info:
        named(TL / "optimizer.pt", model=load_model(str(TL / "model.safetensors")))
    assert info.value.ambiguous and "named_parameters() order beside this model file" in info.value.message
    names = read_names(str(TL / "names.txt"), "model")
    got = named(TL / "optimizer.pt", names=names, names_order="model", model=load_model(str(TL / "model.safetensors")))
    assert got == true_names()


def test_flat_names_list_for_two_groups_is_refused(cli):
    r = cli("inspect", TL / "optimizer.pt", "--names", TL / "names.txt")
    assert r.returncode == 1 and r.stdout == ""
    assert "--names-order optimizer|model" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("inspect", TL / "optimizer.pt", "--names", TL / "pytorch_model.bin")
    assert r.returncode == 2 and "give a model file with --model" in r.stderr and "Unicode" not in r.stderr


def test_trainer_state_to_burn_and_back_resumes_bit_identically(tmp_path):
    torch = pytest.importorskip("torch")
    mod = _fixture_script()
    model_opts = dict(model=load_model(str(TL / "pytorch_model.bin")), no_transpose=["*"])
    res = convert(str(TL / "optimizer.pt"), str(tmp_path / "o.bpk"), Options(**model_opts), no_schedule=True)
    assert "parameter names from" in res.plan.names_from and "pytorch_model.bin" in res.plan.names_from
    with io.open_checkpoint(tmp_path / "o.bpk") as ckpt:  # every burn entry carries its true name and shape
        shapes = {n: tuple(t.shape) for n, t in torch.load(TL / "pytorch_model.bin").items()}
        paths = [p.path for p in ckpt.optimizer.params]
        assert sorted(paths) == sorted(true_names())
        for p in ckpt.optimizer.params:
            assert tuple(p.shape) == shapes[p.path]
    convert(str(tmp_path / "o.bpk"), str(tmp_path / "back.pt"), Options(no_transpose=["*"], optimizer="adamw"))
    back = torch.load(tmp_path / "back.pt")
    orig = torch.load(TL / "optimizer.pt")
    assert [g["initial_lr"] for g in back["param_groups"]] == [g["initial_lr"] for g in orig["param_groups"]]
    # optimizer.pt kept no param_names (statekit solved them from the model): the copy keeps none either,
    # group for group as Trainer wrote it
    assert [dict(g) for g in back["param_groups"]] == [dict(g) for g in orig["param_groups"]]

    def resume(opt_path):
        torch.manual_seed(123)
        model = mod.TinyGPT()
        model.load_state_dict(torch.load(TL / "pytorch_model.bin"))
        opt = mod.trainer_optimizer(model)
        opt.load_state_dict(torch.load(opt_path))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, mod.lr_lambda, last_epoch=2)  # needs initial_lr
        for i in range(3, 8):
            mod.train_step(model, opt, sched, i)
        return [p.detach().clone() for p in model.parameters()], opt.param_groups[0]["lr"]

    (pa, lra), (pb, lrb) = resume(TL / "optimizer.pt"), resume(tmp_path / "back.pt")
    assert lra == lrb and all(torch.equal(a, b) for a, b in zip(pa, pb, strict=True))


def test_safetensors_model_for_a_burn_target_is_accepted_or_refused_for_ambiguity(tmp_path):
    # the state names itself (param_names) → the safetensors model gives shapes; ids are generated
    pytest.importorskip("torch")
    import torch

    sd = torch.load(TL / "optimizer.pt")
    names = true_names()
    k = len(sd["param_groups"][0]["params"])
    sd["param_groups"][0]["param_names"], sd["param_groups"][1]["param_names"] = names[:k], names[k:]
    torch.save(sd, tmp_path / "named.pt")
    res = convert(str(tmp_path / "named.pt"), str(tmp_path / "o.bpk"),
                  Options(model=load_model(str(TL / "model.safetensors")), no_transpose=["*"]))
    assert res.written and any("generated ParamIds" in w for w in res.plan.warnings)
    with pytest.raises(MappingError, match="without guessing"):
        convert(str(TL / "optimizer.pt"), str(tmp_path / "o2.bpk"),
                Options(model=load_model(str(TL / "model.safetensors")), no_transpose=["*"]))


def test_doctor_with_a_safetensors_model_reports_no_false_shape_errors():
    d = doctor_files(TL / "optimizer.pt", TL / "model.safetensors")
    assert not [f for f in d["findings"] if f["check"] in ("shape", "transposed")]
    assert [f["check"] for f in d["findings"]] == ["names"]
    d = doctor_files(TL / "optimizer.pt", TL / "pytorch_model.bin")
    assert d["clean"] and d["matched_by"] == "path"


def test_missing_names_said_once(cli, tmp_path):
    r = cli("convert", TL / "optimizer.pt", tmp_path / "o.bpk", "--no-transpose", "*")
    assert r.returncode == 1 and not (tmp_path / "o.bpk").exists()
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.count("--names") == 1 and r.stderr.count("--model") == 1
    assert r.stderr.count("neither a path nor an id") <= 1


def test_optimizer_names_order(tmp_path):
    (tmp_path / "opt-order.txt").write_text("\n".join(true_names()) + "\n")
    got = named(TL / "optimizer.pt", names=read_names(str(tmp_path / "opt-order.txt"), "optimizer"),
                names_order="optimizer")
    assert got == true_names()


# ----------------------------------------------------------------------------- errors that teach


def test_unknown_optimizer_lists_the_known_ones(cli, tmp_path):
    r = cli("convert", "fixtures/hand-optim.bpk", tmp_path / "o.pt", "--optimizer", "adamm", "--names", "/dev/null")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "not an optimizer statekit knows" in r.stderr and "adamw" in r.stderr and "rmsprop" in r.stderr


def test_wrong_key_lists_the_keys_present(cli):
    r = cli("inspect", "fixtures/torch/checkpoint.pt", "--key", "nope")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "keys present: model_state_dict, optimizer_state_dict, epoch, loss" in r.stderr
    r = cli("inspect", "fixtures/torch/checkpoint.pt", "--key", "epoch")
    assert "'epoch' is an int, not an optimizer state_dict" in r.stderr


def test_misfits_are_listed_once_with_one_hint(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.named_parameters())  # param_names in the state
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    torch.save(other.state_dict(), tmp_path / "m.pt")
    from statekit.ops.remap import remap

    with pytest.raises(MappingError) as info:
        remap(str(tmp_path / "o.pt"), str(tmp_path / "x.pt"), Options(model=load_model(str(tmp_path / "m.pt"))))
    msg = info.value.message
    assert msg.count("--resize") == 1 and "0.weight (state [3, 4], model [5, 4])" in msg


def test_diff_and_doctor_name_torch_positions(cli, tmp_path):
    r = cli("convert", TL / "optimizer.pt", tmp_path / "o.bpk", "--no-schedule", "--model", TL / "pytorch_model.bin",
            "--no-transpose", "*")
    assert r.returncode == 0, r.stderr
    # the burn file knows paths (statekit.param_names); the torch file only positions
    r = cli("diff", TL / "optimizer.pt", tmp_path / "o.bpk", "--model", TL / "pytorch_model.bin", "--json")
    d = json.loads(r.stdout)
    assert d["summary"]["params_compared"] == 28 and d["summary"]["params_differing"] == 0
    assert d["summary"]["only_in_a"] == d["summary"]["only_in_b"] == 0
    r = cli("doctor", TL / "optimizer.pt", "--model", TL / "model.safetensors", "--names", TL / "names.txt",
            "--names-order", "model", "--json")
    d = json.loads(r.stdout)
    assert not [f for f in d["findings"] if f["check"] in ("shape", "transposed", "names")], d["findings"]
