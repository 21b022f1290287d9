"""Checkpoints written by HF Trainer, Accelerate and Lightning (fixtures/clients/, made by
scripts/make_client_fixtures.py with the real programs), read and converted by statekit and resumed
with real torch 2.13 against the uninterrupted run's record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

CLIENTS = Path(__file__).resolve().parent.parent / "fixtures" / "clients"
TRAINER = CLIENTS / "trainer" / "checkpoint-3"
REFERENCE = CLIENTS / "trainer-resume.safetensors"
ACCELERATE = CLIENTS / "accelerate"
LIGHTNING = CLIENTS / "lightning" / "epoch=0-step=4.ckpt"


@pytest.fixture(scope="module")
def record() -> dict:
    with safe_open(str(REFERENCE), "pt") as fh:
        meta = json.loads(fh.metadata()["resume"])
    return {"meta": meta, "tensors": load_file(str(REFERENCE))}


def linear_warmup(warmup: int, total: int):
    """transformers' get_linear_schedule_with_warmup lambda, as written there."""

    def factor(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        return max(0.0, float(total - step) / float(max(1, total - warmup)))

    return factor


def resume_with_torch(record: dict, optimizer_file) -> tuple[dict, torch.optim.Optimizer]:
    """Trainer's resume in plain torch: AdamW over the checkpoint's parameters in Trainer's groups,
    the saved state loaded by position, LambdaLR rebuilt with last_epoch, the recorded gradients fed."""
    meta, ref = record["meta"], record["tensors"]
    weights = load_file(str(TRAINER / "model.safetensors"))
    params = {n: torch.nn.Parameter(weights[n].clone()) for n in meta["names"]}
    groups = []
    for names, hp in zip(meta["groups"], meta["hyperparams"], strict=True):
        hp = {k: tuple(v) if k == "betas" else v for k, v in hp.items() if k != "initial_lr"}
        groups.append({"params": [params[n] for n in names], **hp})
    opt = torch.optim.AdamW(groups)
    opt.load_state_dict(torch.load(optimizer_file, weights_only=True))
    sched = meta["scheduler"]
    lr_sched = torch.optim.lr_scheduler.LambdaLR(
        opt, linear_warmup(sched["num_warmup_steps"], sched["num_training_steps"]), last_epoch=meta["save_at"] - 1)
    for k in range(meta["steps"]):
        assert [g["lr"] for g in opt.param_groups] == meta["lrs"][k]
        for n, p in params.items():
            p.grad = ref[f"grad.{k}.{n}"].clone()
        opt.step()
        lr_sched.step()
        opt.zero_grad()
    return params, opt


def assert_bit_identical(record: dict, params: dict, opt) -> None:
    ref = record["tensors"]
    for n, p in params.items():
        assert torch.equal(p.detach(), ref[f"param.{n}"]), n
        state = opt.state[p]
        assert torch.equal(state["exp_avg"], ref[f"exp_avg.{n}"]), n
        assert torch.equal(state["exp_avg_sq"], ref[f"exp_avg_sq.{n}"]), n
        assert torch.equal(state["step"].reshape(1), ref[f"step.{n}"]), n


def test_the_record_replays_from_trainers_own_files(record):
    """The reference itself: Trainer's optimizer.pt resumed in plain torch reproduces the run."""
    params, opt = resume_with_torch(record, TRAINER / "optimizer.pt")
    assert_bit_identical(record, params, opt)


# ----------------------------------------------------------------------------- folders and wrappers


def torch_load(path):
    return torch.load(path, weights_only=True)


def test_trainer_folder_opens_by_content(cli):
    import statekit

    saved = torch_load(TRAINER / "optimizer.pt")
    with statekit.open(TRAINER) as ckpt:
        assert ckpt.format == "torch" and ckpt.kind == "optimizer"
        assert ckpt.metadata["layout"] == "hf-trainer" and ckpt.metadata["model_file"] == "model.safetensors"
        state = ckpt.optimizer
        assert state.family == "adamw"
        assert [len(g.keys) for g in state.groups] == [len(g["params"]) for g in saved["param_groups"]] == [10, 18]
        for p in state.params:
            assert tuple(p.shape) == tuple(saved["state"][p.index]["exp_avg"].shape)
            assert p.step == saved["state"][p.index]["step"].item()
        sched = torch_load(TRAINER / "scheduler.pt")
        assert ckpt.schedulers[0]["last_epoch"] == sched["last_epoch"] == 3
        assert ckpt.schedulers[0]["base_lrs"] == sched["base_lrs"]
        trainer_state = json.loads((TRAINER / "trainer_state.json").read_text())
        assert ckpt.scalars["global_step"] == trainer_state["global_step"]
    res = cli("inspect", "--json", TRAINER)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["schedulers"][0]["last_epoch"] == 3
    res = cli("inspect", TRAINER.name, cwd=TRAINER.parent)  # the table, from a short relative path
    assert res.returncode == 0, res.stderr
    assert "schedule: hf:linear" in res.stdout and "position 3" in res.stdout  # the schedule (issue 36)


def test_accelerate_folder_opens_by_content():
    import statekit

    saved = torch_load(ACCELERATE / "optimizer.bin")
    with statekit.open(ACCELERATE) as ckpt:
        assert ckpt.metadata["layout"] == "accelerate"
        assert ckpt.optimizer.family == "adamw"
        assert [tuple(p.shape) for p in ckpt.optimizer.params] == [
            tuple(saved["state"][i]["exp_avg"].shape) for i in saved["param_groups"][0]["params"]]
        assert ckpt.schedulers[0]["step_size"] == torch_load(ACCELERATE / "scheduler.bin")["step_size"]


def test_a_folder_statekit_does_not_know_is_one_line(cli, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    res = cli("inspect", tmp_path)
    assert res.returncode == 1
    assert res.stderr.count("\n") == 1 and str(tmp_path) in res.stderr and "Trainer" in res.stderr


def lightning_names_and_shapes() -> list[tuple[str, tuple]]:
    saved = torch_load(LIGHTNING)
    return [(n, tuple(t.shape)) for n, t in saved["state_dict"].items()]


@pytest.mark.parametrize("key", [None, "optimizer_states.0", "optimizer_states"])
def test_lightning_ckpt_finds_its_optimizer_and_names(key):
    import statekit

    saved = torch_load(LIGHTNING)
    opt = saved["optimizer_states"][0]
    with statekit.open(LIGHTNING, key=key) as ckpt:
        assert ckpt.kind == "optimizer" and ckpt.optimizer.family == "adam"
        # Lightning's state_dict lists the module's parameters (no buffers here) in named_parameters() order,
        # the order of its one param group
        assert [(p.path, tuple(p.shape)) for p in ckpt.optimizer.params] == lightning_names_and_shapes()
        assert [p.step for p in ckpt.optimizer.params] == [opt["state"][i]["step"].item() for i in range(7)]
        assert ckpt.schedulers[0]["step_size"] == saved["lr_schedulers"][0]["step_size"]
        assert ckpt.scalars["global_step"] == saved["global_step"]


def test_lightning_ckpt_converts_without_key_and_back_into_torch(cli, tmp_path):
    out, back = tmp_path / "optim.bpk", tmp_path / "back.pt"
    res = cli("convert", LIGHTNING, out, "--transpose", "net.fc*.weight", "--no-transpose", "net.embed.weight",
              "--no-schedule")
    assert res.returncode == 0, res.stderr
    import statekit

    with statekit.open(out) as ckpt:
        got = [(p.path, tuple(p.shape)) for p in ckpt.optimizer.params]
    want = [(n, s[::-1] if n.startswith("net.fc") and len(s) == 2 else s) for n, s in lightning_names_and_shapes()]
    assert sorted(got) == sorted(want)
    res = cli("convert", out, back, "--optimizer", "adam", "--lr", "0.0005")  # the record says what to transpose back
    assert res.returncode == 0, res.stderr
    saved = torch_load(LIGHTNING)["optimizer_states"][0]
    sd = torch_load(back)
    # the Lightning file kept no param_names (statekit solved them from its state_dict): neither does the copy,
    # and every position holds the original's state
    assert "param_names" not in sd["param_groups"][0] and "param_names" not in saved["param_groups"][0]
    assert sd["param_groups"][0]["params"] == saved["param_groups"][0]["params"]
    for i in saved["param_groups"][0]["params"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sd["state"][i][field], saved["state"][i][field]), (i, field)


# ----------------------------------------------------------------------------- Trainer → burn → torch → resume


@pytest.fixture
def no_hf(monkeypatch):
    """The path without transformers (the names list): ``import transformers`` fails, as where it is not
    installed (tests/test_hf.py covers the folder's model definition)."""
    monkeypatch.setitem(sys.modules, "transformers", None)


def test_trainer_checkpoint_to_burn_and_back_resumes_bit_identically(cli, record, tmp_path, no_hf):
    import statekit

    meta = record["meta"]
    bpk, back = tmp_path / "optim.bpk", tmp_path / "back.pt"
    # GPT-2's Conv1D weights are stored [in, out], as burn's Linear: nothing is transposed
    res = cli("convert", TRAINER, bpk, "--names", CLIENTS / "names.txt", "--no-transpose", "*", "--no-schedule")
    assert res.returncode == 0, res.stderr
    saved = torch_load(TRAINER / "optimizer.pt")
    position = {}  # Trainer's own record of which parameter each optimizer position is
    for g, names in enumerate(meta["groups"]):
        for j, name in enumerate(names):
            position[name] = saved["param_groups"][g]["params"][j]
    with statekit.open(bpk) as ckpt:
        params = ckpt.optimizer.params
        assert sorted(p.path for p in params) == sorted(meta["names"])
        for p in params:
            assert list(p.shape) == meta["shapes"][p.path], p.path
            assert [n for n in meta["groups"][p.group]].count(p.path) == 1, p.path
            for field in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(torch.from_numpy(p.slots[field].numpy().copy()),
                                   saved["state"][position[p.path]][field]), (p.path, field)
    res = cli("convert", bpk, back)  # the .bpk records its layout: nothing to repeat on the way back
    assert res.returncode == 0, res.stderr
    assert "0 of 28 parameters transposed back" in res.stdout + res.stderr
    params, opt = resume_with_torch(record, back)  # LambdaLR(last_epoch=...) needs every group's initial_lr
    assert_bit_identical(record, params, opt)
    res = cli("verify-resume", TRAINER, bpk)
    assert res.returncode == 0, res.stdout + res.stderr


def test_trainer_folder_names_come_from_the_names_list_and_the_folders_model(cli, no_hf):
    res = cli("inspect", TRAINER, "--names", CLIENTS / "names.txt", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    meta_names = [line for line in (CLIENTS / "names.txt").read_text().splitlines() if line]
    assert sorted(p["path"] for p in got["params"]) == sorted(meta_names)
    assert not any(w.startswith("parameters left unnamed") for w in got["warnings"])
    # without the list, model.safetensors (sorted by name) cannot say which [16, 16] is which: unnamed, said once
    res = cli("inspect", TRAINER, "--json")
    got = json.loads(res.stdout)
    assert all(p["path"] is None for p in got["params"])
    assert sum("--names" in w for w in got["warnings"]) == 1


# ----------------------------------------------------------------------------- other model files in a folder


def trainer_copy(tmp_path, record, model_file: str):
    """The Trainer folder with its model saved another way: pytorch_model.bin (torch.save of the
    state_dict, named_parameters() order) or a two-shard safetensors index."""
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "checkpoint-3"
    shutil.copytree(TRAINER, folder)
    (folder / "model.safetensors").unlink()
    weights = load_file(str(TRAINER / "model.safetensors"))
    ordered = {n: weights[n] for n in record["meta"]["names"]}
    if model_file == "pytorch_model.bin":
        torch.save(ordered, folder / model_file)
    else:
        names = sorted(ordered)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for shard, members in shards.items():
            save_file({n: ordered[n] for n in members}, str(folder / shard))
        index = {"metadata": {}, "weight_map": {n: s for s, members in shards.items() for n in members}}
        (folder / model_file).write_text(json.dumps(index))
    return folder


def test_a_trainer_folder_with_pytorch_model_bin_names_itself(record, tmp_path):
    import statekit

    folder = trainer_copy(tmp_path, record, "pytorch_model.bin")
    with statekit.open(folder) as ckpt:
        assert ckpt.metadata["model_file"] == "pytorch_model.bin"
        by_group = [[p.path for p in ckpt.optimizer.params if p.group == g] for g in range(2)]
    assert by_group == record["meta"]["groups"]  # Trainer's own record of its groups


def test_a_sharded_model_index_gives_shapes_but_no_order(cli, record, tmp_path, no_hf):
    folder = trainer_copy(tmp_path, record, "model.safetensors.index.json")
    res = cli("inspect", folder, "--json")
    got = json.loads(res.stdout)
    assert all(p["path"] is None for p in got["params"]) and any("--names" in w for w in got["warnings"])
    res = cli("inspect", folder, "--names", CLIENTS / "names.txt", "--json")
    got = json.loads(res.stdout)
    groups = [[p["path"] for p in got["params"] if p["group"] == g] for g in range(2)]
    assert groups == record["meta"]["groups"]


def test_doctor_and_diff_take_folders(cli):
    res = cli("doctor", ACCELERATE)
    assert res.returncode == 0, res.stdout + res.stderr
    res = cli("diff", TRAINER, TRAINER)
    assert res.returncode == 0, res.stdout + res.stderr


def test_accelerate_key_names_an_optimizer_file_and_lists_the_present_ones(cli):
    res = cli("inspect", ACCELERATE, "--key", "optimizer_1")
    assert res.returncode == 1 and "optimizer_1.bin" in res.stderr and "optimizer.bin" in res.stderr
    assert res.stderr.count("\n") == 1
