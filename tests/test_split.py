"""statekit split: merge of the parts gives back the input (burn byte for byte, torch equal by diff), parts
load into real torch optimizers and step as the unsplit one does, groups per part, refusals, atomicity."""

import hashlib
import json
from pathlib import Path

import pytest
from conftest import ROOT

from statekit import io, paramid
from statekit.errors import MappingError, StatekitError, UsageError
from statekit.ops import split as split_mod
from statekit.ops.diff import diff_files
from statekit.ops.merge import merge_files
from statekit.ops.split import split_files

FIX = ROOT / "fixtures"
HAND = FIX / "hand-optim.bpk"
LM = FIX / "lm-optim.bpk"
TRAINER = FIX / "trainer_like"
TNAMES = TRAINER / "names.txt"
TOPT = FIX / "torch_optim"


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def name_with(names, order=None, model=None):
    from statekit.ops.convert import name_checkpoint
    from statekit.ops.options import make_options

    def name(ckpt):
        name_checkpoint(ckpt, make_options(names=names, names_order=order, model=model), ckpt.path)
    return name


# ----------------------------------------------------------------------------- burn: byte for byte


@pytest.mark.parametrize("src, parts", [
    (HAND, ["a=l1.*", "b=l2.*"]),
    (LM, ["emb=embed.weight", "ff=ff.*", "head=out.weight"]),
])
def test_burn_split_then_merge_is_byte_identical(tmp_path, src, parts):
    before = sha(src)
    d = split_files(src, parts, tmp_path / "parts")
    assert d["written"] and d["format"] == "burnpack"
    outs = [Path(p["output"]) for p in d["parts"]]
    assert [o.name for o in outs] == [s.split("=")[0] + ".bpk" for s in parts]
    assert files(tmp_path / "parts") == sorted(o.name for o in outs)  # no temporary folder left
    with io.open_checkpoint(src) as ckpt:
        all_paths = [p.path for p in ckpt.optimizer.params]
    got = []
    for o in outs:
        with io.open_checkpoint(o) as ckpt:
            got += [p.path for p in ckpt.optimizer.params]
    assert got == all_paths  # each parameter in exactly one part, in the input's order
    merge_files(outs, tmp_path / "merged.bpk")
    assert sha(tmp_path / "merged.bpk") == before == sha(src)


def test_burn_by_paramid_and_rest(tmp_path):
    with io.open_checkpoint(HAND) as ckpt:
        ids = {p.path: p.id for p in ckpt.optimizer.params}
    spelled = paramid.to_display(ids["l2.bias"])  # burn's 13-character spelling; the other part by decimal
    d = split_files(HAND, [f"b2={spelled}", f"w1={ids['l1.weight']}"], tmp_path / "p", rest="others")
    assert [(p["name"], p["params"]) for p in d["parts"]] == [("b2", 1), ("w1", 1), ("others", 2)]
    with io.open_checkpoint(tmp_path / "p" / "others.bpk") as ckpt:
        assert [p.path for p in ckpt.optimizer.params] == ["l1.bias", "l2.weight"]
    parts = [tmp_path / "p" / f"{n}.bpk" for n in ("b2", "w1", "others")]
    merge_files(parts, tmp_path / "m.bpk")
    assert sha(tmp_path / "m.bpk") != sha(HAND)  # burn's data order follows the parts
    assert diff_files(HAND, tmp_path / "m.bpk")["equal"]


def test_burn_part_holds_the_inputs_fields(tmp_path):
    split_files(HAND, ["a=l1.*", "b=l2.*"], tmp_path / "p")
    with io.open_checkpoint(tmp_path / "p" / "b.bpk") as part, io.open_checkpoint(HAND) as whole:
        by_id = {p.id: p for p in whole.optimizer.params}
        for p in part.optimizer.params:
            w = by_id[p.id]
            assert p.path == w.path and p.step == w.step and set(p.slots) == set(w.slots)
            for s, ref in p.slots.items():
                assert (ref.numpy() == w.slots[s].numpy()).all()


# ----------------------------------------------------------------------------- torch: a Trainer folder


TRAINER_PARTS = ["embed=transformer.wte.*,transformer.wpe.*", "h0=transformer.h.0.*"]


def test_trainer_folder_split_merge_equal_by_diff(tmp_path):
    d = split_files(TRAINER, TRAINER_PARTS, tmp_path / "p", rest="rest", name_with=name_with(TNAMES))
    assert [(p["name"], p["params"], p["groups"]) for p in d["parts"]] == [
        ("embed", 2, 1), ("h0", 12, 2), ("rest", 14, 2)]  # embed holds no bias/ln: its no-decay group is dropped
    outs = [Path(p["output"]) for p in d["parts"]]
    assert all(o.suffix == ".pt" for o in outs)
    m = tmp_path / "merged.pt"
    merge_files(outs, m)
    r = diff_files(TRAINER / "optimizer.pt", m, names=str(TNAMES), names_order="model",
                   model=str(TRAINER / "model.safetensors"))
    assert r["equal"], r
    import torch

    a = torch.load(TRAINER / "optimizer.pt", weights_only=True)
    b = torch.load(m, weights_only=True)
    strip = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in a["param_groups"]]
    assert strip == [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in b["param_groups"]]
    assert [len(g["params"]) for g in a["param_groups"]] == [len(g["params"]) for g in b["param_groups"]]


def _named_state(path, names_file, order=None, model=None):
    """torch's state_dict of ``path`` and its positions' names as statekit solves them."""
    import torch

    with io.open_checkpoint(path) as ckpt:
        name_with(names_file, order, model)(ckpt)
        names = {p.index: p.path for p in ckpt.optimizer.params}
    sd = torch.load(path if Path(path).is_file() else Path(path) / "optimizer.pt", weights_only=True)
    return sd, names


def _step_all(opt, params: dict):
    """One step with a gradient that depends on the parameter's name only (the same in whole and part)."""
    import zlib

    import torch

    for n, p in params.items():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())), dtype=p.dtype)
    opt.step()


@pytest.mark.torch
@pytest.mark.parametrize("source, names_file, order, model, parts, family", [
    (TRAINER, TNAMES, None, None,  # AdamW → Muon + AdamW (speculators #1066): the 2-D block weights apart
     ["muon=transformer.h.*.attn.*.weight,transformer.h.*.mlp.*.weight", "adamw=*"], "AdamW"),
    (TOPT / "muon.pt", TOPT / "muon_names.txt", None, None, ["a=0.weight", "b=#1"], "Muon"),
    (TOPT / "adamw.pt", TOPT / "muon_names.txt", None, None, ["a=0.bias", "b=2.bias"], "AdamW"),
])
def test_each_part_loads_into_torch_and_steps_like_the_whole(tmp_path, source, names_file, order, model, parts,
                                                             family):
    import torch

    whole_sd, names = _named_state(source, names_file, order, model)
    shapes = {names[i]: next(v for v in s.values() if torch.is_tensor(v) and v.dim() > 0).shape
              for i, s in whole_sd["state"].items()}
    torch.manual_seed(0)
    init = {n: torch.randn(shape) for n, shape in shapes.items()}
    cls = getattr(torch.optim, family)

    def build(sd, order_names, values):
        ps = {n: torch.nn.Parameter(values[n].clone()) for n in order_names}
        it = iter(order_names)
        groups = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                   "params": [ps[next(it)] for _ in g["params"]]} for g in sd["param_groups"]]
        opt = cls(groups)
        opt.load_state_dict(sd)
        return opt, ps

    whole_order = [names[i] for g in whole_sd["param_groups"] for i in g["params"]]
    whole, wparams = build(whole_sd, whole_order, init)
    _step_all(whole, wparams)
    d = split_files(source, parts, tmp_path / "p", name_with=name_with(names_file, order, model))
    seen = []
    for part in d["parts"]:
        sd = torch.load(part["output"], weights_only=True)
        part_names = [n for g in sd["param_groups"] for n in g["param_names"]]
        seen += part_names
        opt, ps = build(sd, part_names, init)  # torch.optim.<Family>(selected params).load_state_dict(...)
        assert len(opt.state) == len(part_names)
        _step_all(opt, ps)
        for n in part_names:
            assert torch.equal(ps[n].detach(), wparams[n].detach()), n
            for k, v in opt.state[ps[n]].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(whole.state[wparams[n]][k])), (n, k)
    assert sorted(seen) == sorted(whole_order)


# ----------------------------------------------------------------------------- refusals, plan, atomicity


def test_unselected_parameter_refused_naming_it_nothing_written(tmp_path):
    with pytest.raises(MappingError) as exc:
        split_files(HAND, ["a=l1.*"], tmp_path / "p")
    assert "2 parameters are selected by no --into part" in str(exc.value)
    assert "l2.weight" in str(exc.value) and "l2.bias" in str(exc.value)
    assert not (tmp_path / "p").exists()


def test_unnamed_torch_state_says_why_globs_select_nothing(tmp_path):
    with pytest.raises(MappingError) as exc:
        split_files(TOPT / "adamw.pt", ["a=*.bias"], tmp_path / "p")
    assert "no paths" in str(exc.value) and "#index" in str(exc.value)


def test_part_selecting_nothing_refused(tmp_path):
    with pytest.raises(MappingError) as exc:
        split_files(HAND, ["a=*", "b=l9.*"], tmp_path / "p")
    assert "--into b=l9.* selects no parameter" in str(exc.value)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("specs, rest", [([], None), (["a"], None), (["a="], None), (["../x=*"], None),
                                         (["a=*", "a=l1.*"], None), (["a=l1.*"], "../r")])
def test_bad_part_specs(tmp_path, specs, rest):
    with pytest.raises(UsageError):
        split_files(HAND, specs, tmp_path / "p", rest=rest)


def test_other_framework_refused(tmp_path):
    with pytest.raises(StatekitError) as exc:
        split_files(HAND, ["a=*"], tmp_path / "p", to="torch")
    assert "convert" in str(exc.value)
    assert not (tmp_path / "p").exists()


def test_failure_midway_leaves_nothing(tmp_path, monkeypatch):
    calls = []
    real = split_mod.save_state

    def failing(state, path, metadata, fmt, progress=None):
        calls.append(path)
        if len(calls) == 2:
            raise MappingError("disk full", path)
        return real(state, path, metadata, fmt, progress=progress)

    monkeypatch.setattr(split_mod, "save_state", failing)
    out = tmp_path / "p"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(MappingError):
        split_files(HAND, ["a=l1.*", "b=l2.*"], out)
    assert len(calls) == 2 and files(out) == ["keep.txt"]  # the first part written is not left behind


def test_dry_run_writes_nothing_and_plans(tmp_path):
    d = split_files(HAND, ["a=l1.weight", "b=l1.*"], tmp_path / "p", rest="c", dry_run=True)
    assert not d["written"] and not (tmp_path / "p").exists()
    assert [[m["by"] for m in p["members"]] for p in d["parts"]] == [["l1.weight"], ["l1.*"], ["--rest", "--rest"]]


def test_cli_split(cli, tmp_path):
    out = tmp_path / "p"
    r = cli("split", HAND, "--into", "a=l1.*", "--into", "b=l2.*", "-o", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.index("writing 4") < r.stdout.index("wrote 2 files")  # the plan comes first
    r = cli("merge", out / "a.bpk", out / "b.bpk", "-o", tmp_path / "m.bpk")
    assert r.returncode == 0 and sha(tmp_path / "m.bpk") == sha(HAND)
    r = cli("split", HAND, "--into", "a=l1.*", "-o", tmp_path / "q")
    assert r.returncode == 1 and not (tmp_path / "q").exists()
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("statekit: error: ")
    assert "l2.weight" in r.stderr
    r = cli("split", HAND, "--into", "a=l1.*", "--rest", "z", "-o", tmp_path / "j", "--json", "--dry-run")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [p["name"] for p in d["parts"]] == ["a", "z"] and not (tmp_path / "j").exists()
    r = cli("split", TRAINER, "--names", TNAMES, "--into", TRAINER_PARTS[0], "--rest", "rest", "-o", tmp_path / "t",
            "--format", "tsv")
    assert r.returncode == 0, r.stderr
    assert "embed\ttransformer.wte.weight\ttransformer.wte.*" in r.stdout
    assert files(tmp_path / "t") == ["embed.pt", "rest.pt"]


def test_python_api_split(tmp_path):
    import statekit

    d = statekit.split(HAND, ["a=l1.*"], tmp_path / "p", rest="b")
    assert d["written"] and files(tmp_path / "p") == ["a.bpk", "b.bpk"]
    statekit.merge([tmp_path / "p" / "a.bpk", tmp_path / "p" / "b.bpk"], tmp_path / "m.bpk")
    assert sha(tmp_path / "m.bpk") == sha(HAND)


def test_third_party_and_bitsandbytes_states_refused_by_name(cli, tmp_path):
    r = cli("split", FIX / "thirdparty" / "lion-pytorch.pt", "--into", "a=#0", "--rest", "b", "-o", tmp_path / "t")
    assert r.returncode == 1 and "lion-pytorch Lion" in r.stderr and "convert it first" in r.stderr
    for name in ("sgd8bit.pt", "adamw8bit.pt"):
        r = cli("split", FIX / "bnb" / name, "--into", "a=#0", "--rest", "b", "-o", tmp_path / "b")
        assert r.returncode == 1 and "bitsandbytes state" in r.stderr and "--to bnb" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and files(tmp_path) == []


def test_muon_adamw_record_by_key_splits_as_its_state_alone(cli, tmp_path):
    """fixtures/torch_optim/muon_adamw.pt holds both optimizers; --key picks one, as muon.pt holds it alone."""
    for src, out in ((TOPT / "muon_adamw.pt", "k"), (TOPT / "muon.pt", "alone")):
        extra = ["--key", "muon"] if out == "k" else []
        r = cli("split", src, *extra, "--names", TOPT / "muon_names.txt", "--into", "a=0.weight", "--rest", "b",
                "-o", tmp_path / out)
        assert r.returncode == 0, r.stderr
    assert files(tmp_path / "k") == files(tmp_path / "alone") == ["a.pt", "b.pt"]
    for name in ("a.pt", "b.pt"):
        assert sha(tmp_path / "k" / name) == sha(tmp_path / "alone" / name)
