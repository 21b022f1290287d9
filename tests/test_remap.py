"""remap: optimizer state onto a refactored model (rename, new head, grown vocabulary)."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from statekit.formats.burnpack import BurnpackFile, PackTensor, write_burnpack
from statekit.frameworks import burn
from statekit.tensor import TensorRef

OPTIM, V1, V2 = (str(ROOT / "fixtures" / n) for n in ("lm-optim.bpk", "lm-model.bpk", "lm-model-v2.bpk"))
RULE = r"^ff\.=blocks.0.ff."


def sha(p) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def state_of(path):
    pack = BurnpackFile(path)
    return {p.path: p for p in burn.read(pack).optimizer.params}


def model_ids(path):
    with BurnpackFile(path) as pack:
        return {n: e.param_id for n, e in pack.tensors.items()}


def test_rename_grow_and_new_head(tmp_path, cli):
    before = sha(OPTIM)
    out = tmp_path / "new.bpk"
    r = cli("remap", OPTIM, "--model", V2, "-o", out, "--rename", RULE, "--resize")
    assert r.returncode == 0, r.stderr
    assert "aux.weight" in r.stderr and "3.16" in r.stderr  # new head listed, padded-rows warning
    assert sha(OPTIM) == before
    old, new, ids = state_of(OPTIM), state_of(out), model_ids(V2)
    assert set(new) == {"embed.weight", "blocks.0.ff.weight", "blocks.0.ff.bias", "out.weight"}
    for path, p in new.items():
        assert p.id == ids[path] and p.step == 21
    # renamed: the same bytes per field under the new id
    for slot in ("exp_avg", "exp_avg_sq"):
        assert bytes(new["blocks.0.ff.weight"].slots[slot].raw()) == bytes(old["ff.weight"].slots[slot].raw())
    # grown vocabulary: old rows kept, new rows zero
    emb_new, emb_old = new["embed.weight"].slots["exp_avg"].numpy(), old["embed.weight"].slots["exp_avg"].numpy()
    assert emb_new.shape == (12, 8)
    assert np.array_equal(emb_new[:10], emb_old) and not emb_new[10:].any()
    out_new = new["out.weight"].slots["exp_avg_sq"].numpy()
    assert np.array_equal(out_new[:, :10], old["out.weight"].slots["exp_avg_sq"].numpy()) and not out_new[:, 10:].any()


def test_shape_change_without_resize_is_refused(tmp_path, cli):
    r = cli("remap", OPTIM, "--model", V2, "-o", tmp_path / "x.bpk", "--rename", RULE)
    assert r.returncode == 1 and "embed.weight" in r.stderr and "out.weight" in r.stderr and "--resize" in r.stderr
    assert not (tmp_path / "x.bpk").exists()


def test_removed_parameters_are_dropped_and_listed(tmp_path, cli):
    r = cli("remap", OPTIM, "--model", V2, "-o", tmp_path / "x.bpk", "--resize")
    assert r.returncode == 0, r.stderr
    assert "dropped" in r.stderr and "ff.weight" in r.stderr
    assert set(state_of(tmp_path / "x.bpk")) == {"embed.weight", "out.weight"}


def test_two_sources_onto_one_target_is_refused(tmp_path, cli):
    r = cli("remap", OPTIM, "--model", V2, "-o", tmp_path / "x.bpk", "--resize", "--rename", r"^ff\.(weight|bias)=blocks.0.ff.weight")
    assert r.returncode == 1 and "ff.weight and ff.bias both map to blocks.0.ff.weight" in r.stderr


def test_rule_that_matches_nothing_is_reported(tmp_path, cli):
    r = cli("remap", OPTIM, "--model", V2, "-o", tmp_path / "x.bpk", "--resize", "--rename", RULE,
            "--rename", r"^encoder\.=enc.", "--dry-run")
    assert r.returncode == 0 and "matched no parameter" in r.stderr and not (tmp_path / "x.bpk").exists()


@pytest.mark.parametrize(("rule", "why"), [(r"^ff\.(weight)=x.$2", "invalid group reference 2"),
                                         (r"^ff\.=\u", "bad escape \\u"), (r"^ff\.=\g<name>", "unknown group name")])
def test_a_replacement_python_cannot_use_is_a_usage_error(tmp_path, cli, rule, why):
    """A replacement's bad escape or missing group ended in "internal error: error: bad escape \\u"
    at the first matching path (found beside issue 29's faults); now refused as the rules are read."""
    r = cli("remap", OPTIM, "--model", V2, "-o", tmp_path / "x.bpk", "--resize", "--rename", rule)
    assert r.returncode == 2 and "internal error" not in r.stderr and "replacement" in r.stderr, r.stderr
    assert why in r.stderr and not (tmp_path / "x.bpk").exists()


def test_a_rules_file_that_is_not_utf8_is_a_usage_error(tmp_path, cli):
    (tmp_path / "rules.txt").write_bytes(b"^ff\\.=blocks.0.\xff\n")
    r = cli("remap", OPTIM, "--model", V2, "-o", tmp_path / "x.bpk", "--rules", tmp_path / "rules.txt")
    assert r.returncode == 2 and "rules are not UTF-8 text (byte 0xff at 15)" in r.stderr, r.stderr


def test_plan_out_then_plan_in_is_byte_identical(tmp_path, cli):
    args = ["--model", V2, "--rename", RULE, "--resize"]
    assert cli("remap", OPTIM, *args, "-o", tmp_path / "a.bpk", "--plan-out", tmp_path / "plan.json").returncode == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [p["action"] for p in plan["params"]] == ["keep", "rename", "rename", "keep", "new"]
    r = cli("remap", OPTIM, "--model", V2, "-o", tmp_path / "b.bpk", "--plan", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    assert sha(tmp_path / "a.bpk") == sha(tmp_path / "b.bpk")


def test_plan_for_another_file_is_refused(tmp_path, cli):
    assert cli("remap", OPTIM, "--model", V2, "--rename", RULE, "--resize", "-o", tmp_path / "a.bpk",
               "--plan-out", tmp_path / "plan.json", "--dry-run").returncode == 0
    r = cli("remap", "fixtures/hand-optim.bpk", "--model", V2, "-o", tmp_path / "b.bpk", "--plan", tmp_path / "plan.json")
    assert r.returncode == 1 and "does not have" in r.stderr and not (tmp_path / "b.bpk").exists()


def test_reset_step_restarts_a_resized_parameter(tmp_path, cli):
    r = cli("remap", OPTIM, "--model", V2, "-o", tmp_path / "x.bpk", "--rename", RULE, "--resize",
            "--reset-step", "embed.*")
    assert r.returncode == 0, r.stderr
    new = state_of(tmp_path / "x.bpk")
    assert "embed.weight" not in new and new["out.weight"].step == 21


def test_paths_from_the_old_model_when_the_state_has_none(tmp_path, cli):
    with BurnpackFile(OPTIM) as pack:
        tensors = [PackTensor(n, pack.tensor(n), pack.tensors[n].burn_dtype, pack.tensors[n].param_id)
                   for n in pack.data_order]
        write_burnpack(tmp_path / "nopaths.bpk", tensors, {}, pack.scalars)
    r = cli("remap", tmp_path / "nopaths.bpk", "--model", V2, "--old-model", V1, "-o", tmp_path / "x.bpk",
            "--rename", RULE, "--resize")
    assert r.returncode == 0, r.stderr
    assert set(state_of(tmp_path / "x.bpk")) == {"embed.weight", "blocks.0.ff.weight", "blocks.0.ff.bias", "out.weight"}


def test_remap_onto_the_same_model_is_an_identity(tmp_path, cli):
    assert cli("remap", OPTIM, "--model", V1, "-o", tmp_path / "same.bpk").returncode == 0
    assert sha(tmp_path / "same.bpk") == sha(OPTIM)


def test_torch_state_onto_a_model_with_a_new_layer(tmp_path, cli):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    old = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(old.parameters())
    old(torch.randn(3, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    (tmp_path / "names.txt").write_text("0.weight\n0.bias\n1.weight\n1.bias\n")
    new = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    torch.save(new.state_dict(), tmp_path / "new.pt")
    r = cli("remap", tmp_path / "opt.pt", "--names", tmp_path / "names.txt", "--model", tmp_path / "new.pt",
            "-o", tmp_path / "out.pt", "--rename", r"^1\.=2.")
    assert r.returncode == 0, r.stderr
    sd = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sd["param_groups"][0]["params"] == [0, 1, 2, 3, 4, 5] and sorted(sd["state"]) == [0, 1, 4, 5]
    assert torch.equal(sd["state"][4]["exp_avg"], opt.state_dict()["state"][2]["exp_avg"])
    opt2 = torch.optim.Adam(new.parameters())
    opt2.load_state_dict(sd)
    new(torch.randn(3, 4)).sum().backward()
    opt2.step()
    assert opt2.state_dict()["state"][2]["step"].item() == 1.0 and opt2.state_dict()["state"][4]["step"].item() == 2.0


def test_state_model_fields_keep_bytes_through_write(tmp_path):
    ref = TensorRef.from_array(np.arange(6, dtype=np.float32).reshape(2, 3))
    from statekit.ops.execute import transformed

    t = transformed(ref, transpose=True, shape=(3, 3))
    assert t.shape == (3, 3) and np.array_equal(t.numpy(), np.array([[0, 3, 0], [1, 4, 0], [2, 5, 0]], np.float32))
