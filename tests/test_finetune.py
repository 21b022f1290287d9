"""Fine-tuning checkpoints: LoRA / QLoRA adapters, mixtures of experts, bitsandbytes named by
training_args.bin (issue 27).

The fixtures (``fixtures/finetune/<run>/``) were written by real ``transformers.Trainer`` runs with
transformers 5.24.0, peft 0.21.2 and bitsandbytes 0.50.2 on a CPU (``scripts/make_finetune_fixtures.py``);
each ``truth.json`` holds what the training process knew from its live objects: the names in each
param group (matched to ``named_parameters()`` by identity), each trainable parameter's shape, owning
module class and how that module's own code uses it (``isinstance``, an experts module's
``is_transposed``, a router run on a random input and compared with ``F.linear``, peft's merged
embedding rows). Tests that build a model need transformers (marked ``hf``) and, for adapters, peft
(marked ``peft``); CI installs both extras. The LoRA and DoRA runs loaded their base model by hub id
from a Hugging Face cache that ships with the fixtures (``hf-cache/``): the tests point
``HF_HUB_CACHE`` at it, as a user's environment does at theirs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import FIXTURES, ROOT

import statekit
from statekit.errors import MappingError
from statekit.frameworks import hf_args

FT = FIXTURES / "finetune"
CACHE = FT / "hf-cache" / "hub"
RUNS = {"lora": 4, "qlora": 4, "dora": 2, "mixtral": 2, "qwen2-moe": 2, "deepseek-v3": 2, "lion8bit": 2}
ADAPTERS = ("lora", "qlora", "dora")
hf = pytest.mark.hf
peft_mark = pytest.mark.peft


def ckpt(run: str):
    return FT / run / f"checkpoint-{RUNS[run]}"


def truth(run: str) -> dict:
    return json.loads((FT / run / "truth.json").read_text())


def marks(run: str):
    return [hf, peft_mark] if run in ADAPTERS else [hf]


ALL = [pytest.param(r, marks=marks(r)) for r in RUNS]


@pytest.fixture(autouse=True)
def hub_cache(monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(CACHE))


@pytest.fixture
def needs(request):
    """Skip where the run's libraries are missing (CI installs the hf and peft extras)."""
    def check(run: str):
        pytest.importorskip("transformers")
        if run in ADAPTERS:
            pytest.importorskip("peft")
    return check


def torch_load(path):
    torch = pytest.importorskip("torch")
    return torch.load(path, weights_only=True)


def test_the_fixtures_are_the_runs_the_issue_names():
    assert all(ckpt(r).is_dir() for r in RUNS)
    lora = truth("lora")
    assert lora["optim"] == "adamw_torch" and lora["optimizer_class"] == "torch.optim.adamw.AdamW"
    assert not (ckpt("lora") / "config.json").exists() and (ckpt("lora") / "adapter_config.json").exists()
    assert truth("qlora")["optim"] == "paged_adamw_8bit"
    assert truth("qlora")["optimizer_class"] == "bitsandbytes.optim.adamw.AdamW"
    assert truth("lion8bit")["optimizer_class"] == "bitsandbytes.optim.lion.Lion"
    for run in ("mixtral", "qwen2-moe", "deepseek-v3"):  # the router is no nn.Linear but its forward is F.linear
        kinds = {n: p["kind"] for n, p in truth(run)["params"].items()}
        assert [k for n, k in kinds.items() if n.endswith("mlp.gate.weight")] == ["linear-by-forward"]
        assert {k for n, k in kinds.items() if ".experts." in n} == {"experts-out-in"}
    dora = truth("dora")["params"]
    assert any(p["kind"] == "embedding-rows" for p in dora.values())
    assert any("lora_magnitude_vector" in n for n in dora)
    qwen = truth("qwen2-moe")["params"]
    assert "model.layers.0.mlp.shared_expert_gate.weight" in qwen


# ----------------------------------------------------------------------------- names


def positions(state) -> list[list[str]]:
    return [[next(p for p in state.params if p.key == k).path for k in g.keys] for g in state.groups]


@pytest.mark.parametrize("run", ALL)
def test_inspect_names_every_position_as_the_training_process_knew_it(run, needs, cli):
    needs(run)
    t = truth(run)
    with statekit.open(ckpt(run)) as c:
        assert positions(c.optimizer) == t["groups"]
        for p in c.optimizer.params:
            assert p.module == t["params"][p.path]["module"], p.path
        assert not [w for w in c.warnings if "unnamed" in w], c.warnings
    res = cli("inspect", ckpt(run), "--json", env={"HF_HUB_CACHE": str(CACHE)})
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert [p["path"] for p in report["params"]] == [n for g in t["groups"] for n in g]


LAYOUT_OF_KIND = {"linear": "out_in", "linear-by-forward": "out_in", "experts-out-in": "experts",
                  "embedding": "embedding", "embedding-rows": "embedding", "norm": "norm"}


@pytest.mark.parametrize("run", ALL)
def test_every_layout_is_how_the_module_uses_the_weight(run, needs):
    needs(run)
    with statekit.open(ckpt(run)) as c:
        for p in c.optimizer.params:
            kind = truth(run)["params"][p.path]["kind"]
            want = "norm" if kind == "norm" else "vector" if len(p.shape) <= 1 else LAYOUT_OF_KIND.get(kind)
            assert p.layout == want, (p.path, kind, p.layout, p.layout_problem)
            if kind in ("linear-by-forward", "embedding-rows"):  # no class says it: the forward did
                assert p.layout_from == "forward", p.path


@hf
def test_the_forward_confirms_the_class_table_on_every_model_of_the_fixtures():
    """The trace, run where the class table alone would do, agrees with it on every weight it reaches."""
    pytest.importorskip("transformers")
    from statekit.frameworks import hf_model

    configs = sorted((FIXTURES / "hf").glob("v5/*/checkpoint-2/config.json")) + \
        [ckpt(r) / "config.json" for r in RUNS if r not in ADAPTERS]
    for config in configs:
        d = hf_model.build(str(config), trace=True)
        weights = [p for p in d.params if p.trainable and len(p.shape) >= 2]
        assert not [p for p in weights if p.problem], config
        assert all(p.layout_from in (hf_model.BY_BOTH, hf_model.BY_FORWARD) for p in weights), config


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("run", ALL)
def test_convert_with_no_flags_and_back_gives_the_source_state(run, needs, cli, tmp_path):
    needs(run)
    bpk, back = tmp_path / "x.bpk", tmp_path / "back.pt"
    res = cli("convert", ckpt(run), bpk, "--no-schedule")
    assert res.returncode == 0, res.stderr
    res = cli("convert", bpk, back)
    assert res.returncode == 0, res.stderr
    a, b = torch_load(ckpt(run) / "optimizer.pt"), torch_load(back)
    torch = pytest.importorskip("torch")
    assert a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"])
    for k, entry in a["state"].items():
        flat_a = {**{f: v for f, v in entry.items() if f != "__bnb_optimizer_quant_state__"},
                  **entry.get("__bnb_optimizer_quant_state__", {})}
        other = b["state"][k]
        flat_b = {**{f: v for f, v in other.items() if f != "__bnb_optimizer_quant_state__"},
                  **other.get("__bnb_optimizer_quant_state__", {})}
        assert sorted(flat_a) == sorted(flat_b), k
        for f, v in flat_a.items():  # tensor for tensor: bitsandbytes' own codes and scales too
            if isinstance(v, torch.Tensor):
                assert v.dtype == flat_b[f].dtype and torch.equal(v, flat_b[f]), (run, k, f)
            else:
                assert v == flat_b[f], (run, k, f)
    res = cli("verify-resume", ckpt(run) / "optimizer.pt", back, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["tracks"]


@pytest.mark.parametrize("run", [pytest.param(r, marks=marks(r)) for r in ("lora", "mixtral")])
def test_linear_maps_cross_to_burn_in_its_orientation(run, needs, tmp_path):
    """LoRA's A [r, in] and B [out, r] and the router [E, H] are F.linear weights: burn's Linear has them
    [in, out]. 3-D experts keep torch's [E, out, in], the plan saying so."""
    needs(run)
    plan = statekit.convert(str(ckpt(run)), str(tmp_path / "x.bpk"), no_schedule=True)
    t = truth(run)["params"]
    with statekit.open(str(tmp_path / "x.bpk")) as c:
        shapes = {p.path: tuple(p.shape) for p in c.optimizer.params}
    for name, info in t.items():
        if info["kind"] in ("linear", "linear-by-forward"):
            assert shapes[name] == tuple(info["shape"][::-1]), name
        elif info["kind"] == "experts-out-in":
            assert shapes[name] == tuple(info["shape"]), name
            action = next(a for a in plan.params if a.src_path == name)
            assert not action.transpose and any("[experts, out, in]" in n for n in action.notes), action.notes


# ----------------------------------------------------------------------------- refusals


def copy_run(run: str, tmp_path):
    dest = tmp_path / run
    shutil.copytree(ckpt(run), dest)
    return dest


@hf
@peft_mark
def test_an_adapter_config_that_does_not_make_the_adapter_file_is_refused_naming_the_tensor(needs, cli, tmp_path):
    needs("lora")
    folder = copy_run("lora", tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["r"] = 8
    (folder / "adapter_config.json").write_text(json.dumps(config))
    res = cli("convert", folder, tmp_path / "x.bpk")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    # the first tensor (by name) the file and the wrapped model disagree on: r 4 in the file, 8 in the config
    assert "adapter_model.safetensors: holds base_model.model.model.layers.0.mlp.down_proj.lora_A.weight as [4, 48] " \
        "but the model peft wraps from adapter_config.json makes it [8, 48]" in res.stderr, res.stderr
    assert not (tmp_path / "x.bpk").exists()


@hf
@peft_mark
def test_a_base_model_nowhere_local_is_refused_saying_what_to_give(needs, cli, tmp_path):
    needs("lora")
    res = cli("convert", ckpt("lora"), tmp_path / "x.bpk", env={"HF_HUB_CACHE": str(tmp_path / "empty")})
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "statekit-fixtures/tiny-llama" in res.stderr and "never downloads" in res.stderr
    assert "--model-config" in res.stderr
    base = next(CACHE.rglob("config.json"))
    res = cli("convert", ckpt("lora"), tmp_path / "x.bpk", "--no-schedule", "--model-config", base,
              env={"HF_HUB_CACHE": str(tmp_path / "empty")})
    assert res.returncode == 0, res.stderr


@hf
@peft_mark
def test_a_folder_of_several_adapters_is_refused_as_none_says_which_trained(needs, cli, tmp_path):
    needs("lora")
    folder = copy_run("lora", tmp_path)
    (folder / "second").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(folder / name, folder / "second" / name)
    res = cli("convert", folder, tmp_path / "x.bpk")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "2 peft adapters ('default', 'second')" in res.stderr and "--names" in res.stderr, res.stderr


@hf
@peft_mark
def test_an_optimizer_of_another_adapter_is_refused_naming_the_position(needs, cli, tmp_path):
    needs("lora")
    folder = copy_run("lora", tmp_path)
    shutil.copyfile(ckpt("dora") / "optimizer.pt", folder / "optimizer.pt")
    res = cli("convert", folder, tmp_path / "x.bpk")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "position #" in res.stderr, res.stderr


def test_without_peft_one_line_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['peft'] = None\n"
            "from statekit.cli import _run\n"
            f"sys.exit(_run(['convert', {str(ckpt('lora'))!r}, {str(tmp_path / 'x.bpk')!r}]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(CACHE)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "statekit[peft]" in res.stderr or "statekit[hf]" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


# ----------------------------------------------------------------------------- training_args.bin


def test_lion_8bit_is_named_by_training_args_bin_in_the_folder_and_beside_its_optimizer_file():
    for where in (ckpt("lion8bit"), ckpt("lion8bit") / "optimizer.pt"):
        with statekit.open(where) as c:
            state = c.optimizer
            assert state.family == "lion" and state.library == "bitsandbytes", state.family_label
            assert all("exp_avg" in p.slots for p in state.params if p.slots)
            assert any("optim='lion_8bit'" in n for n in state.notes)
    # the file alone, elsewhere: bitsandbytes' packing fits three optimizers, and it says so
    with statekit.open(str(FT / ".." / "bnb" / "lion8bit-beta2-0.pt")) as c:
        assert c.optimizer.family is None


def test_an_optim_the_state_contradicts_is_reported():
    with statekit.open(ckpt("lion8bit") / "optimizer.pt") as c:
        state = c.optimizer
    assert hf_args.settle(state, {"optim": "lion_8bit"}) == []  # already lion
    with statekit.open(str(FIXTURES / "bnb" / "lion8bit-beta2-0.pt")) as c:
        said = hf_args.settle(c.optimizer, {"optim": "paged_adamw_8bit"})
    assert said and "paged_adamw_8bit" in said[0] and "bitsandbytes adamw" in said[0], said
    with statekit.open(str(FIXTURES / "bnb" / "lion8bit-beta2-0.pt")) as c:
        said = hf_args.settle(c.optimizer, {"optim": "adamw_torch"})
    assert said and "not a bitsandbytes optimizer" in said[0], said
    args = {"optim": "lion_8bit", "learning_rate": 2e-3, "weight_decay": 0.05, "adam_beta1": 0.8,
            "adam_beta2": 0.99, "adam_epsilon": 1e-7}
    groups = [{"lr": 2e-3, "initial_lr": 2e-3, "betas": (0.8, 0.97), "eps": 0.0, "weight_decay": 0.05}]
    assert hf_args.compare(args, groups) == ["param group 0 has betas=(0.8, 0.97), TrainingArguments say (0.8, 0.99)"]


# ----------------------------------------------------------------------------- --model beside config.json


@hf
def test_a_model_file_with_config_json_beside_it_names_as_the_folder_does(cli, tmp_path):
    pytest.importorskip("transformers")
    folder = ckpt("mixtral")
    assert cli("convert", folder, tmp_path / "folder.bpk", "--no-schedule").returncode == 0
    res = cli("convert", folder / "optimizer.pt", tmp_path / "file.bpk", "--model", folder / "model.safetensors",
              "--no-schedule")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "file.bpk").read_bytes() == (tmp_path / "folder.bpk").read_bytes()
    res = cli("inspect", folder / "optimizer.pt", "--model", folder / "model.safetensors", "--json")
    assert res.returncode == 0, res.stderr
    assert [p["path"] for p in json.loads(res.stdout)["params"]] == [n for g in truth("mixtral")["groups"] for n in g]


# ----------------------------------------------------------------------------- the trace itself


def test_the_trace_tells_orientation_from_the_forward_and_refuses_a_class_it_contradicts():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from statekit.frameworks import hf_model

    class Backwards(torch.nn.Linear):  # an nn.Linear whose forward multiplies x @ W: [in, out]
        def forward(self, x):
            return x @ self.weight

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 6)
            self.router = torch.nn.Parameter(torch.empty(3, 6))  # F.linear: [out, in]
            self.right = torch.nn.Parameter(torch.empty(6, 4))  # x @ W: [in, out]
            self.experts = torch.nn.Parameter(torch.empty(3, 5, 4))  # per expert F.linear: [E, out, in]
            self.odd = Backwards(4, 4, bias=False)
            self.unused = torch.nn.Parameter(torch.empty(2, 2))

        def forward(self, input_ids):
            h = self.embed(input_ids)
            scores = torch.nn.functional.linear(h, self.router)
            y = h @ self.right
            out = torch.nn.functional.linear(y, self.experts[1])  # one expert's [out, in] matrix
            return self.odd(y) + out.sum() + scores.sum()

    with torch.device("meta"):
        model = Model()
    d = hf_model.define(model, "Model", None, "test", torch, transformers)
    by = d.by_name()
    assert (by["router"].layout, by["router"].layout_from) == ("out_in", "forward")
    assert by["right"].layout == "in_out"
    assert by["experts"].layout == "experts"
    assert by["odd.weight"].layout is None and "Backwards makes it a [out, in] Linear weight" in by["odd.weight"].problem
    assert by["unused"].layout is None and "no F.linear" in by["unused"].problem
    assert by["embed.weight"].layout == "embedding"


@hf
def test_an_undecided_layout_is_refused_in_one_line_naming_the_position(tmp_path):
    """A state whose model leaves a weight undecided: convert to burn refuses it with the reason."""
    pytest.importorskip("transformers")
    from statekit.frameworks import hf_model

    with statekit.open(ckpt("mixtral")) as c:
        state = c.optimizer
        gate = next(p for p in state.params if p.path.endswith("mlp.gate.weight"))
        gate.layout, gate.layout_problem = None, "MixtralTopKRouter: made up for the test"
        from statekit.ops.build import build_plan
        from statekit.ops.options import Options

        with pytest.raises(MappingError, match="mlp.gate.weight \\[4, 16\\] \\(MixtralTopKRouter: made up"):
            build_plan(state, str(ckpt("mixtral")), "torch", str(tmp_path / "x.bpk"), "burnpack", Options())
    assert hf_model.OUT_IN == "out_in"
