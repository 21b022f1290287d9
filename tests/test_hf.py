"""Trainer checkpoints named and laid out from the model's own definition (issue 20).

The fixtures (``fixtures/hf/<release>/<model>/``) were written by real ``transformers.Trainer`` runs
with transformers 5.23.0 and 4.46.3 (``scripts/make_hf_fixtures.py``); each ``truth.json`` holds what
the training process knew from its live objects: the names in each param group, every parameter's
owning module class and kind (``isinstance``), the TrainingArguments. Tests marked ``hf`` build the
model with transformers (installed in CI by the ``hf`` extra) and skip without it; the rest run
everywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, ROOT

import statekit
from statekit.errors import MappingError, StatekitError
from statekit.frameworks import hf_args
from statekit.ops.convert import convert
from statekit.ops.options import make_options

HF = FIXTURES / "hf"
CHECKPOINTS = sorted(p.parent for p in HF.glob("v*/*/truth.json"))
IDS = [f"{p.parent.name}-{p.name}" for p in CHECKPOINTS]
hf = pytest.mark.hf


def truth(folder):
    return json.loads((folder / "truth.json").read_text())


def ckpt_dir(folder):
    return folder / "checkpoint-2"


def torch_load(path):
    torch = pytest.importorskip("torch")
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def test_fixtures_cover_both_decay_rules_and_the_four_models():
    names = {(p.parent.name, p.name) for p in CHECKPOINTS}
    assert {("v5", "llama"), ("v5", "llama-tied"), ("v5", "gpt2"), ("v5", "qwen2"), ("v4", "llama-tied"),
            ("v4", "qwen2")} <= names
    # the same tiny Qwen2 splits differently under 4.46.3 and 5.23.0: its RMSNorm weights change groups
    v4, v5 = truth(HF / "v4" / "qwen2"), truth(HF / "v5" / "qwen2")
    assert "model.norm.weight" in v4["groups"][0] and "model.norm.weight" in v5["groups"][1]


# ----------------------------------------------------------------------------- names


@hf
@pytest.mark.parametrize("folder", CHECKPOINTS, ids=IDS)
def test_inspect_names_every_position_as_the_training_process_knew_it(folder, transformers, cli):
    t = truth(folder)
    with statekit.open(ckpt_dir(folder)) as ckpt:
        state = ckpt.optimizer
        got = [[next(p for p in state.params if p.key == k).path for k in g.keys] for g in state.groups]
        assert got == t["groups"]
        for p in state.params:  # each position's owning module class, as the live model had it
            assert p.module == t["params"][p.path]["module"]
        assert not [w for w in ckpt.warnings if "unnamed" in w]
    res = cli("inspect", ckpt_dir(folder), "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert sorted(p["path"] for p in report["params"]) == sorted(n for g in t["groups"] for n in g)
    assert not any(name in [p["path"] for p in report["params"]] for name in t["tied"])  # one position per tie


# ----------------------------------------------------------------------------- to burn and back


def _moments(state):
    return {p.path: {k: ref.numpy() for k, ref in p.slots.items()} for p in state.params}


@hf
@pytest.mark.parametrize("folder", CHECKPOINTS, ids=IDS)
def test_convert_with_no_flags_transposes_every_linear_moment_only(folder, transformers, cli, tmp_path):
    t = truth(folder)
    bpk, back = tmp_path / "optim.bpk", tmp_path / "back.pt"
    res = cli("convert", ckpt_dir(folder), bpk, "--no-schedule")
    assert res.returncode == 0, res.stderr
    saved = torch_load(ckpt_dir(folder) / "optimizer.pt")
    order = [n for g in t["groups"] for n in g]  # torch position -> name, as Trainer built the groups
    with statekit.open(bpk) as out:
        by_torch_name = {}
        for p in out.optimizer.params:
            name = p.path
            for burn, torch_leaf in ((".gamma", ".weight"), (".beta", ".bias")):
                if name.endswith(burn) and t["params"].get(name[: -len(burn)] + torch_leaf, {}).get("kind") == "norm":
                    name = name[: -len(burn)] + torch_leaf
            by_torch_name[name] = p
        assert sorted(by_torch_name) == sorted(order)
        for index, name in enumerate(order):
            kind = t["params"][name]["kind"]
            p = by_torch_name[name]
            for field, slot in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                want = saved["state"][index][field].numpy()
                got = p.slots[slot].numpy()
                if kind == "linear" and name.endswith(".weight"):
                    np.testing.assert_array_equal(got, want.T)  # nn.Linear [out, in] -> burn [in, out]
                else:
                    assert kind in ("conv1d", "embedding", "norm", "linear"), kind
                    np.testing.assert_array_equal(got, want)  # Conv1D, embedding, norm, bias: as they are
            if kind == "norm":
                assert p.path.endswith((".gamma", ".beta"))  # burn's names for a norm's affine parameters
        args = json.loads(out.metadata["statekit.training_args"])
        assert args["optim"] == t["optim"]
        assert {k: args[k] for k in t["hyperparams"]} == t["hyperparams"]
    # and back, with no flags: optimizer.pt tensor for tensor and group for group
    res = cli("convert", bpk, back)
    assert res.returncode == 0, res.stderr
    restored = torch_load(back)
    assert restored["param_groups"] == saved["param_groups"]
    assert restored["state"].keys() == saved["state"].keys()
    for index, fields in saved["state"].items():
        assert restored["state"][index].keys() == fields.keys()
        for field, tensor in fields.items():
            assert restored["state"][index][field].dtype == tensor.dtype
            assert np.array_equal(restored["state"][index][field].numpy(), tensor.numpy()), (index, field)
    res = cli("verify-resume", ckpt_dir(folder), bpk)
    assert res.returncode == 0, res.stdout + res.stderr


@hf
def test_a_square_weight_is_decided_by_its_module_class(transformers, tmp_path):
    """Llama's q_proj / o_proj and GPT-2's attn.c_proj are [16, 16]: nn.Linear is transposed, Conv1D not."""
    res_llama = convert(str(ckpt_dir(HF / "v5" / "llama")), str(tmp_path / "l.bpk"), dry_run=True, no_schedule=True)
    res_gpt2 = convert(str(ckpt_dir(HF / "v5" / "gpt2")), str(tmp_path / "g.bpk"), dry_run=True, no_schedule=True)
    rows = {a.src_path: a for a in res_llama.plan.params + res_gpt2.plan.params}
    assert rows["model.layers.0.self_attn.o_proj.weight"].transpose
    assert any("(module class)" in n for n in rows["model.layers.0.self_attn.o_proj.weight"].notes)
    assert not rows["transformer.h.0.attn.c_proj.weight"].transpose
    assert any("Conv1D" in n for n in rows["transformer.h.0.attn.c_proj.weight"].notes)
    assert "module classes" in res_llama.plan.layouts_from


@hf
def test_transpose_flags_still_override_the_module_class(transformers, tmp_path):
    res = convert(str(ckpt_dir(HF / "v5" / "gpt2")), str(tmp_path / "g.bpk"),
                  make_options(transpose=["transformer.h.0.attn.c_proj.weight"],
                               rename=[r"^transformer\.ln_f\.weight$=final_norm.scale"]), dry_run=True,
                  no_schedule=True)
    rows = {a.src_path: a for a in res.plan.params}
    assert rows["transformer.h.0.attn.c_proj.weight"].transpose
    assert rows["transformer.ln_f.weight"].dst_path == "final_norm.scale"  # --rename wins over the class rename
    assert rows["transformer.ln_f.bias"].dst_path == "transformer.ln_f.beta"


@hf
@pytest.mark.parametrize("model", ["llama", "llama-tied", "gpt2", "qwen2"])
def test_with_the_burn_model_the_param_ids_are_the_burn_models(model, transformers, cli, tmp_path):
    """fixtures/hf/v5/*/burn-model.bpk stands in for a burn program's model file (no burn binary here):
    written by statekit's burnpack model writer with burn's paths, layouts and random ParamIds."""
    folder = HF / "v5" / model
    bpk = tmp_path / "optim.bpk"
    res = cli("convert", ckpt_dir(folder), bpk, "--model", folder / "burn-model.bpk", "--no-schedule")
    assert res.returncode == 0, res.stderr
    with statekit.open(folder / "burn-model.bpk") as m:
        ids = {p.path: p.id for p in m.model.params}
    with statekit.open(bpk) as out:
        got = {p.path: p.id for p in out.optimizer.params}
        for p in out.optimizer.params:  # shapes are burn's too: nn.Linear weights [in, out]
            assert tuple(p.shape) == next(q.shape for q in m.model.params if q.path == p.path)
    assert got == ids
    res = cli("verify-resume", ckpt_dir(folder), bpk)
    assert res.returncode == 0, res.stdout + res.stderr


# ----------------------------------------------------------------------------- refusals


@hf
def test_a_definition_that_disagrees_with_the_state_is_refused_naming_the_position(transformers, tmp_path):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt_dir(HF / "v5" / "llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 20  # not the model that was trained
    (folder / "config.json").write_text(json.dumps(config))
    with statekit.open(folder) as ckpt:
        assert not any(p.path for p in ckpt.optimizer.params)
        (warning,) = [w for w in ckpt.warnings if "unnamed" in w]
        assert "position #5 (group 0 position 5) holds [24, 16] state but model.layers.0.mlp.gate_proj.weight is " \
               "[20, 16]" in warning
    with pytest.raises(MappingError, match="gate_proj"):
        convert(str(folder), str(tmp_path / "x.bpk"))


@hf
def test_hub_code_runs_only_with_trust_remote_code(transformers, tmp_path):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt_dir(HF / "v5" / "llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MyLlamaForCausalLM"]
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (folder / "modeling_my.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                           "from transformers import LlamaForCausalLM as MyLlamaForCausalLM\n")
    with statekit.open(folder) as ckpt:
        (warning,) = [w for w in ckpt.warnings if "unnamed" in w]
        assert "--trust-remote-code" in warning
    assert not marker.exists()


def test_without_transformers_one_line_names_the_extra_or_names(monkeypatch, tmp_path, cli):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    folder = ckpt_dir(HF / "v5" / "llama")
    res = cli("convert", folder, tmp_path / "x.bpk")
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert "pip install 'statekit[hf]'" in res.stderr and "--names" in res.stderr
    assert not (tmp_path / "x.bpk").exists()
    with statekit.open(folder) as ckpt:
        assert any("statekit[hf]" in w for w in ckpt.warnings)


# ----------------------------------------------------------------------------- training_args.bin


@pytest.mark.parametrize("folder", CHECKPOINTS, ids=IDS)
def test_training_args_are_read_without_running_anything(folder):
    t = truth(folder)
    args = hf_args.read(str(ckpt_dir(folder) / "training_args.bin"))
    assert args["optim"] == t["optim"]
    assert {k: args[k] for k in t["hyperparams"]} == t["hyperparams"]
    saved = torch_load(ckpt_dir(folder) / "optimizer.pt")
    assert hf_args.compare(args, saved["param_groups"]) == []  # Trainer built the groups from them


def test_reading_training_args_imports_neither_transformers_nor_accelerate():
    code = ("import sys; from statekit.frameworks import hf_args; "
            f"a = hf_args.read({str(ckpt_dir(HF / 'v5' / 'gpt2') / 'training_args.bin')!r}); "
            "assert a['optim'] == 'adamw_torch_fused', a; "
            "bad = [m for m in ('transformers', 'accelerate', 'torch') if m in sys.modules]; assert not bad, bad")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr


def test_training_args_that_disagree_with_the_param_groups_are_reported():
    args = {"optim": "adamw_torch", "learning_rate": 3e-3, "weight_decay": 0.2, "adam_beta1": 0.85,
            "adam_beta2": 0.95, "adam_epsilon": 1e-6}
    groups = [{"weight_decay": 0.1, "lr": 0.0, "initial_lr": 3e-3, "betas": (0.85, 0.95), "eps": 1e-6},
              {"weight_decay": 0.0, "lr": 0.0, "initial_lr": 3e-3, "betas": (0.85, 0.95), "eps": 1e-8}]
    assert hf_args.compare(args, groups) == [
        "param group 0 has weight_decay=0.1, TrainingArguments say 0.2",
        "param group 1 has eps=1e-08, TrainingArguments say 1e-06",
    ]
    # an optim the state contradicts is reported against the optimizer file's own state
    with statekit.open(ckpt_dir(HF / "v5" / "gpt2") / "optimizer.pt") as ckpt:
        said = hf_args.settle(ckpt.optimizer, {**args, "optim": "adafactor"})
    assert said and said[0].startswith("TrainingArguments.optim is 'adafactor' (transformers-adafactor), but the "
                                       "optimizer file holds adamw state"), said


def test_a_pickle_that_is_not_training_arguments_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"lr": 1.0}, tmp_path / "training_args.bin")
    with pytest.raises(StatekitError, match="not a pickled TrainingArguments"):
        hf_args.read(str(tmp_path / "training_args.bin"))
