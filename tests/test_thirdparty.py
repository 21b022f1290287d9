"""Optimizer states written by the optimizers people add to torch (fixtures/thirdparty/, made by
scripts/make_thirdparty_fixtures.py with torchao, transformers, lion-pytorch, schedulefree,
torch-optimi, galore-torch and grokadamw): recognised, read with their real tensors, converted
where another optimizer continues them, refused by name otherwise. None of those packages is
needed here: the references (torchao's own dequantize(), transformers' continued run) are files."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import statekit
from statekit.errors import MappingError
from statekit.ops.inspect import inspect

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

THIRD = Path(__file__).resolve().parent.parent / "fixtures" / "thirdparty"
TORCHAO = ("torchao-adamw8bit", "torchao-adamw4bit", "torchao-adamwfp8", "torchao-adamw8bit-bf16")
AO_NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]
SMALL_NAMES = ["0.weight", "0.bias", "2.weight"]

# every fixture: the family statekit gives it and the fields of its first parameter
FAMILIES = {
    "torchao-adamw8bit": ("torchao-adam-8bit", "torchao AdamW8bit", {"exp_avg", "exp_avg_sq"}),
    "torchao-adamw4bit": ("torchao-adam-4bit", "torchao AdamW4bit", {"exp_avg", "exp_avg_sq"}),
    "torchao-adamwfp8": ("torchao-adam-fp8", "torchao AdamWFp8", {"exp_avg", "exp_avg_sq"}),
    "torchao-adamw8bit-bf16": ("torchao-adam-8bit", "torchao AdamW8bit", {"exp_avg", "exp_avg_sq"}),
    "hf-adafactor-relative": ("transformers-adafactor", "transformers Adafactor",
                              {"exp_avg_sq_row", "exp_avg_sq_col", "RMS"}),
    "hf-adafactor-trainer": ("transformers-adafactor", "transformers Adafactor",
                             {"exp_avg_sq_row", "exp_avg_sq_col", "RMS"}),
    "hf-adafactor-beta1": ("transformers-adafactor", "transformers Adafactor",
                           {"exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "RMS"}),
    "lion-pytorch": ("lion-pytorch", "lion-pytorch Lion", {"exp_avg"}),
    "schedulefree-adamw": ("schedulefree-adamw", "schedule-free AdamWScheduleFree", {"z", "exp_avg_sq"}),
    "schedulefree-adamw-eval": ("schedulefree-adamw", "schedule-free AdamWScheduleFree", {"z", "exp_avg_sq"}),
    "schedulefree-sgd": ("schedulefree-sgd", "schedule-free SGDScheduleFree", {"z"}),
    "schedulefree-radam": ("schedulefree-radam", "schedule-free RAdamScheduleFree", {"z", "exp_avg_sq"}),
    "optimi-stableadamw": ("optimi-stableadamw", "torch-optimi StableAdamW", {"exp_avg", "exp_avg_sq", "eps_sq"}),
    "apex-fusedadam": ("apex-fusedadam", "apex FusedAdam", {"exp_avg", "exp_avg_sq"}),
    "deepspeed-fusedadam": ("deepspeed-fusedadam", "DeepSpeed FusedAdam", {"exp_avg", "exp_avg_sq"}),
}


def torch_load(path):
    return torch.load(path, weights_only=True)


def bits(t) -> np.ndarray:
    """A tensor's bytes as integers, for bit-for-bit comparisons (NaN and -0.0 included)."""
    arr = t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
    return arr.numpy()


def as_torch(ref):
    """A statekit tensor's values as a torch tensor (bfloat16 through its bits)."""
    arr = np.array(ref.numpy())
    if ref.dtype == "BF16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def names_file(tmp_path: Path, names: list[str]) -> Path:
    path = tmp_path / "names.txt"
    path.write_text("\n".join(names) + "\n")
    return path


def test_torchao_states_convert_with_torchao_impossible_to_import(tmp_path):
    """In a fresh interpreter where ``import torchao`` (and transformers) fails, as if not
    installed: the torchao files still read and convert."""
    import subprocess

    code = (
        "import sys\n"
        "for lib in ('torchao', 'transformers', 'lion_pytorch', 'schedulefree', 'optimi'): sys.modules[lib] = None\n"
        "import statekit\n"
        f"statekit.convert({str(THIRD / 'torchao-adamwfp8.pt')!r}, {str(tmp_path / 'out.pt')!r}, optimizer='adamw')\n"
        "assert not [m for m in sys.modules if m.startswith('torchao') and sys.modules[m] is not None]\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    reference = load_file(THIRD / "torchao-reference.safetensors")
    assert (bits(torch_load(tmp_path / "out.pt")["state"][0]["exp_avg"])
            == bits(reference["torchao-adamwfp8.0.exp_avg"])).all()


@pytest.mark.parametrize("stem", sorted(FAMILIES))
def test_every_fixture_inspects_with_its_family_and_its_tensors(stem, cli, tmp_path):
    family, name, fields = FAMILIES[stem]
    saved = torch_load(THIRD / f"{stem}.pt") if not stem.startswith("torchao") else None
    with statekit.open(THIRD / f"{stem}.pt") as ckpt:
        d = inspect(ckpt, stats=True)
        assert d["family"] == family and name in d["family_label"]
        assert not d["warnings"]
        first = d["params"][0]
        assert set(first["fields"]) == fields
        for p, param in zip(d["params"], ckpt.optimizer.params, strict=True):
            assert p["family"] == family and p["step"] == (None if stem == "lion-pytorch" else 3)  # Lion keeps none
            for field, item in p["fields"].items():
                assert item["stats"]["nan"] == 0 and item["stats"]["min"] is not None
                if saved is not None:  # the values are the file's own
                    want = saved["state"][param.index][field]
                    got = as_torch(param.slots[field])
                    assert list(item["shape"]) == list(want.shape) and torch.equal(got, want)
    # the family as the CLI reports it: its JSON (torch-optimi's step tensor in a group: JSON too),
    # of a copy at a path so long that the header wraps wherever the checkout is
    deep = tmp_path / ("d" * 150)
    deep.mkdir()
    shutil.copy(THIRD / f"{stem}.pt", deep / f"{stem}.pt")
    res = cli("inspect", "--json", deep / f"{stem}.pt")
    assert res.returncode == 0, res.stderr
    shown = json.loads(res.stdout)
    assert shown["kind"] == "optimizer" and shown["family"] == family and name in shown["family_label"]
    # the header names it too: read from a short relative path, so that the checkout's path (which
    # the header starts with) cannot wrap the line (regression: it did at a 120-character checkout)
    res = cli("inspect", f"{stem}.pt", cwd=THIRD)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"{stem}.pt: ") and f" · optimizer ({name}" in res.stdout.splitlines()[0]


def test_transformers_adafactor_shows_the_parameter_shape_its_factors_imply():
    with statekit.open(THIRD / "hf-adafactor-relative.pt") as ckpt:
        assert [p.shape for p in ckpt.optimizer.params] == [(8, 12), (8,), (4, 8)]
        assert [p.rank for p in ckpt.optimizer.params] == [2, 1, 2]


def test_optimi_stableadamw_inspect_json_shows_the_groups_step_tensor(cli):
    """Regression: the 0-dim step tensor torch-optimi keeps in its param group reached the JSON
    encoder as a TensorRef and ended inspect --json in an internal error."""
    res = cli("inspect", "--json", THIRD / "optimi-stableadamw.pt")
    assert res.returncode == 0, res.stderr
    group = json.loads(res.stdout)["groups"][0]["hyperparameters"]
    assert group["step"] == 3 and group["beta1"] == 0.9 and group["max_lr"] is None
    res = cli("inspect", "--json", THIRD / "torchao-adamw8bit.pt")  # torchao's lr, a 0-dim float32 tensor
    assert json.loads(res.stdout)["groups"][0]["hyperparameters"]["lr"] == pytest.approx(0.01)


def test_schedule_free_shows_its_mode_and_steps(cli):
    # read from the JSON: the note is a line of ~150 characters, wrapped wherever the width asks
    d = json.loads(cli("inspect", "--json", THIRD / "schedulefree-adamw.pt").stdout)
    assert any("train mode: the saved parameters are y" in n for n in d["notes"])
    d = json.loads(cli("inspect", "--json", THIRD / "schedulefree-adamw-eval.pt").stdout)
    assert any("eval mode: the saved parameters are x" in n for n in d["notes"])
    group = d["groups"][0]["hyperparameters"]
    assert group["train_mode"] is False and group["weight_sum"] > 0 and group["k"] == 3


# ------------------------------------------------------------------------------- torchao


@pytest.mark.parametrize("stem", TORCHAO)
def test_torchao_moments_equal_torchaos_dequantize_bit_for_bit(stem):
    reference = load_file(THIRD / "torchao-reference.safetensors")
    with statekit.open(THIRD / f"{stem}.pt") as ckpt:
        for p in ckpt.optimizer.params:
            for field, ref in p.slots.items():
                want = reference[f"{stem}.{p.index}.{field}"]
                got = as_torch(ref)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert (bits(got) == bits(want)).all(), f"{stem} #{p.index} {field}"
                for size in (1, 7, 64, 1000):  # pieces of any size, across block boundaries
                    if want.dtype == torch.float32:
                        pieces = list(ref.pieces(size))
                        assert {x.size for x in pieces[:-1]} <= {size}
                        assert (np.concatenate(pieces).view(np.int32) == bits(want).reshape(-1)).all()


@pytest.mark.parametrize("stem", TORCHAO)
def test_torchao_to_pt_is_torchaos_dequantize_and_loads_into_torch_adamw(stem, cli, tmp_path):
    reference = load_file(THIRD / "torchao-reference.safetensors")
    out = tmp_path / "adamw.pt"
    res = cli("convert", THIRD / f"{stem}.pt", out, "--optimizer", "adamw")
    assert res.returncode == 0, res.stderr
    sd = torch_load(out)
    assert sd["param_groups"][0]["decoupled_weight_decay"] is True
    assert sd["param_groups"][0]["lr"] == pytest.approx(0.01) and sd["param_groups"][0]["weight_decay"] == 0.01
    for idx, entry in sd["state"].items():
        assert entry["step"].item() == 3.0
        for field in ("exp_avg", "exp_avg_sq"):
            want = reference[f"{stem}.{idx}.{field}"]
            assert entry[field].dtype == want.dtype and (bits(entry[field]) == bits(want)).all()
    dtype = torch.bfloat16 if stem.endswith("bf16") else torch.float32
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10)).to(dtype)
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(sd)
    model(torch.randn(4, 64, dtype=dtype)).sum().backward()
    opt.step()
    assert opt.state_dict()["state"][0]["step"].item() == 4.0
    verify = cli("verify-resume", THIRD / f"{stem}.pt", out, "--names", names_file(tmp_path, AO_NAMES))
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_torchao_to_burn_and_verify_resume(cli, tmp_path):
    out = tmp_path / "adamw.bpk"
    names = names_file(tmp_path, AO_NAMES)
    res = cli("convert", THIRD / "torchao-adamw4bit.pt", out, "--optimizer", "adamw", "--names", names,
              "--transpose", "*.weight")
    assert res.returncode == 0, res.stderr
    reference = load_file(THIRD / "torchao-reference.safetensors")
    with statekit.open(out) as ckpt:
        by_path = {p.path: p for p in ckpt.optimizer.params}
        got = by_path["0.weight"].slots["exp_avg"].numpy()
        assert (got.T == reference["torchao-adamw4bit.0.exp_avg"].numpy()).all()  # burn keeps [in, out]
    verify = cli("verify-resume", THIRD / "torchao-adamw4bit.pt", out, "--names", names, "--transpose", "*.weight")
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_torchao_without_optimizer_says_adam_or_adamw(cli, tmp_path):
    res = cli("convert", THIRD / "torchao-adamw8bit.pt", tmp_path / "x.pt")
    assert res.returncode == 1 and not (tmp_path / "x.pt").exists()
    assert "torchao-adamw8bit.pt" in res.stderr and "--optimizer adamw or --optimizer adam" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_float8_tensor_outside_torchaos_codes_is_still_refused(cli):
    res = cli("inspect", Path(__file__).resolve().parent.parent / "fixtures" / "torch_extra" / "float8.pt")
    assert res.returncode == 1 and "float8_e4m3fn is not supported" in res.stderr


# ------------------------------------------------------------------------- transformers Adafactor


def test_transformers_adafactor_to_torch_adafactor_resumes_transformers_run(cli, tmp_path):
    out = tmp_path / "adafactor.pt"
    res = cli("convert", THIRD / "hf-adafactor-relative.pt", out)
    assert res.returncode == 0, res.stderr
    sd = torch_load(out)
    saved = torch_load(THIRD / "hf-adafactor-relative.pt")
    assert sd["state"][0]["row_var"].shape == (8, 1) and sd["state"][0]["col_var"].shape == (1, 12)
    assert torch.equal(sd["state"][0]["row_var"].reshape(-1), saved["state"][0]["exp_avg_sq_row"])
    assert torch.equal(sd["state"][1]["variance"], saved["state"][1]["exp_avg_sq"])
    ref = load_file(THIRD / "hf-adafactor-resume.safetensors")
    params = [torch.nn.Parameter(ref[f"param.{i}"].clone()) for i in range(3)]
    opt = torch.optim.Adafactor(params)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.01  # transformers' relative step min(1e-2, 1/√t)
    cold = [torch.nn.Parameter(ref[f"param.{i}"].clone()) for i in range(3)]
    cold_opt = torch.optim.Adafactor(cold, lr=0.01)
    for k in range(3, 8):
        for i in range(3):
            params[i].grad, cold[i].grad = ref[f"grad.{k}.{i}"].clone(), ref[f"grad.{k}.{i}"].clone()
        opt.step()
        cold_opt.step()
    for i in range(3):
        final = ref[f"final.{i}"]
        moved = (final - ref[f"param.{i}"]).abs().max().item()
        resumed = (params[i].detach() - final).abs().max().item()
        restarted = (cold[i].detach() - final).abs().max().item()
        assert resumed <= 4 * torch.finfo(torch.float32).eps * final.abs().max().item(), (i, resumed, moved)
        assert restarted > 100 * max(resumed, 1e-9)  # a cold restart is visibly elsewhere
    verify = cli("verify-resume", THIRD / "hf-adafactor-relative.pt", out, "--names", names_file(tmp_path, SMALL_NAMES))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "exp_avg_sq_row/col (means of g²+ε₁) become row_var" in verify.stdout


@pytest.mark.parametrize("stem, says", [
    ("hf-adafactor-trainer", "scale_parameter=False, but torch.optim.Adafactor always scales its step"),
    ("hf-adafactor-beta1", "beta1=0.9 keeps a first moment (exp_avg)"),
])
def test_transformers_adafactor_torch_cannot_continue_is_refused_naming_the_difference(stem, says, cli, tmp_path):
    res = cli("convert", THIRD / f"{stem}.pt", tmp_path / "x.pt")
    assert res.returncode == 1 and not (tmp_path / "x.pt").exists()
    assert says in res.stderr and f"{stem}.pt" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


# -------------------------------------------------------------------- FusedAdam, StableAdamW


@pytest.mark.parametrize("stem", ["apex-fusedadam", "deepspeed-fusedadam"])
def test_fusedadam_to_torch_adam_is_the_adam_state_it_holds(stem, cli, tmp_path):
    out = tmp_path / "adam.pt"
    res = cli("convert", THIRD / f"{stem}.pt", out)
    assert res.returncode == 0, res.stderr
    assert "Adam and AdamW take the same step" in res.stderr
    reference = load_file(THIRD / "fusedadam-reference.safetensors")
    sd = torch_load(out)
    for idx, entry in sd["state"].items():
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[field], reference[f"{idx}.{field}"]), (idx, field)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4, bias=False))
    opt = torch.optim.AdamW(model.parameters())
    opt.load_state_dict(sd)
    verify = cli("verify-resume", THIRD / f"{stem}.pt", out, "--names", names_file(tmp_path, SMALL_NAMES))
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_apex_fusedadam_with_weight_decay_needs_adam_or_adamw(tmp_path):
    saved = torch_load(THIRD / "apex-fusedadam.pt")
    saved["param_groups"][0]["weight_decay"] = 0.01
    torch.save(saved, tmp_path / "wd.pt")
    with pytest.raises(MappingError, match="decoupled"):
        statekit.convert(str(tmp_path / "wd.pt"), str(tmp_path / "out.pt"))
    statekit.convert(str(tmp_path / "wd.pt"), str(tmp_path / "out.pt"), optimizer="adam")
    assert torch_load(tmp_path / "out.pt")["param_groups"][0]["decoupled_weight_decay"] is False


@pytest.mark.parametrize("stem, says", [
    ("optimi-stableadamw", "StableAdamW keeps debiased moments"),
    ("schedulefree-adamw", "schedule-free keeps z and averages the iterates"),
    ("schedulefree-sgd", "schedule-free keeps z"),
    ("schedulefree-radam", "schedule-free keeps z"),
])
def test_states_no_optimizer_continues_are_refused_by_name(stem, says, cli, tmp_path):
    for target in ("x.pt", "x.bpk"):
        res = cli("convert", THIRD / f"{stem}.pt", tmp_path / target)
        assert res.returncode == 1 and says in res.stderr and not (tmp_path / target).exists()
        assert len(res.stderr.strip().splitlines()) == 1


# -------------------------------------------------------------------------- GaLore, GrokAdamW


@pytest.mark.parametrize("stem, says", [
    ("galore-adamw", "a GaLore optimizer state (galore-torch)"),
    ("grokadamw", "a GrokAdamW optimizer state (grokadamw)"),
])
def test_galore_and_grokadamw_are_refused_in_one_line_naming_them(stem, says, cli):
    for command in (["inspect"], ["doctor"], ["convert", "--dry-run"]):
        args = [*command, THIRD / f"{stem}.pt"] + (["/tmp/never.pt"] if command[0] == "convert" else [])
        res = cli(*args)
        assert res.returncode != 0, res.stdout
        assert says in res.stderr and f"{stem}.pt" in res.stderr
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------- doctor


@pytest.mark.parametrize("stem", sorted(FAMILIES))
def test_doctor_passes_every_fixture(stem, cli):
    res = cli("doctor", THIRD / f"{stem}.pt")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no problems found" in res.stdout


def test_doctor_finds_a_nan_planted_in_a_torchao_block_scale(cli, tmp_path):
    """The dequantized moments are what doctor checks: a NaN scale spoils its whole block (256 values)."""
    import zipfile

    from statekit.formats import torch_pt

    src = THIRD / "torchao-adamw8bit.pt"
    scale = torch_pt.load_pt(src)["state"][0]["exp_avg_sq"].state["scale"]
    key = scale.info["storage_key"]
    out = tmp_path / "nan.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename.endswith(f"/data/{key}"):
                values = np.frombuffer(data, dtype="<f4").copy()
                values[2] = np.nan
                data = values.tobytes()
            zout.writestr(item, data)
    res = cli("doctor", out)
    assert res.returncode != 0
    assert "exp_avg_sq: 256 NaN of 4096" in res.stdout


def test_a_torchao_record_that_does_not_add_up_is_refused_naming_it():
    from statekit.errors import FormatError
    from statekit.formats.torch_pickle import WrapperTensor
    from statekit.frameworks.torch_thirdparty import wrapper_slot
    from statekit.tensor import TensorRef

    codes = TensorRef.from_array(np.zeros((64, 64), dtype=np.uint8))
    qmap = TensorRef.from_array(np.linspace(-1, 1, 256, dtype=np.float32))
    cls = "torchao.optim.subclass_8bit.OptimState8bit"
    for state, says in (
        ({"codes": codes, "scale": TensorRef.from_array(np.ones(15, np.float32)), "qmap": qmap}, "15 scales"),
        ({"codes": codes, "scale": TensorRef.from_array(np.ones(16, np.float32))}, "256-entry qmap"),
        ({"codes": codes, "qmap": qmap}, "without its codes and float32 scale"),
    ):
        with pytest.raises(FormatError, match=says):
            wrapper_slot(WrapperTensor(cls, "float32", (64, 64), (64, 1), "cpu", state), "state[0].exp_avg", "x.pt")
    shaped = {"codes": TensorRef.from_array(np.zeros(8, np.uint8)), "scale": TensorRef.from_array(np.ones(1, np.float32)),
              "qmap": TensorRef.from_array(np.ones(16, np.float32)), "_shape": ("a",)}
    with pytest.raises(FormatError, match="not a tuple of sizes"):
        wrapper_slot(WrapperTensor(cls.replace("8bit", "4bit"), "float32", (16,), (1,), "cpu", shaped), "w", "x.pt")


# ------------------------------------------------------------------------------------- Lion


def test_lion_pytorch_to_burn_lion_momentum_is_exp_avg_bit_for_bit(cli, tmp_path):
    out = tmp_path / "lion.bpk"
    names = names_file(tmp_path, SMALL_NAMES)
    res = cli("convert", THIRD / "lion-pytorch.pt", out, "--names", names, "--transpose", "*.weight")
    assert res.returncode == 0, res.stderr
    assert "decoupled_weight_decay=True" in res.stderr  # what the file cannot say is said
    saved = torch_load(THIRD / "lion-pytorch.pt")
    with statekit.open(out) as ckpt:
        assert ckpt.optimizer.family == "lion"
        by_path = {p.path: p for p in ckpt.optimizer.params}
        for i, name in enumerate(SMALL_NAMES):
            p = by_path[name]
            assert p.step is None and set(p.slots) == {"exp_avg"}  # burn's {id}.momentum
            got = as_torch(p.slots["exp_avg"])
            want = saved["state"][i]["exp_avg"]
            assert torch.equal(got.T if want.dim() == 2 else got, want)
        d = inspect(ckpt)
        assert all(set(p["fields"]) == {"momentum"} for p in d["params"])


def test_lion_pytorch_has_no_torch_optimizer_to_continue_it(cli, tmp_path):
    res = cli("convert", THIRD / "lion-pytorch.pt", tmp_path / "x.pt")
    assert res.returncode == 1 and "torch has no lion optimizer" in res.stderr


@pytest.mark.parametrize("stem", ["torchao-adamw8bit", "hf-adafactor-relative", "schedulefree-adamw"])
def test_replay_does_not_pass_a_third_party_update_off_as_torchs(stem, cli, tmp_path):
    from safetensors.numpy import save_file

    save_file({"0.weight": np.zeros((8, 12), np.float32)}, tmp_path / "p.safetensors")
    res = cli("replay", "--state", THIRD / f"{stem}.pt", "--params", tmp_path / "p.safetensors", "--grads",
              tmp_path / "p.safetensors", "--out-params", tmp_path / "out.safetensors")
    assert res.returncode == 1 and "replay runs torch's, burn's and candle's own arithmetic" in res.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_remap_continues_a_third_party_state_as_convert_does(cli, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4, bias=False))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    out = tmp_path / "remapped.pt"
    res = cli("remap", THIRD / "hf-adafactor-relative.pt", "--model", tmp_path / "model.pt", "-o", out,
              "--names", names_file(tmp_path, SMALL_NAMES))
    assert res.returncode == 0, res.stderr
    sd = torch_load(out)
    saved = torch_load(THIRD / "hf-adafactor-relative.pt")
    assert sd["param_groups"][0]["param_names"] == SMALL_NAMES and sd["param_groups"][0]["lr"] == 0.01
    assert torch.equal(sd["state"][2]["col_var"].reshape(-1), saved["state"][2]["exp_avg_sq_col"])
    torch.optim.Adafactor(model.parameters()).load_state_dict(sd)


def test_merge_refuses_a_third_party_state_by_name(cli, tmp_path):
    res = cli("merge", THIRD / "lion-pytorch.pt", THIRD / "lion-pytorch.pt", "-o", tmp_path / "m.pt",
              "--on-conflict", "first")
    assert res.returncode == 1 and "lion-pytorch Lion" in res.stderr and "convert it first" in res.stderr
    assert "internal error" not in res.stderr and not (tmp_path / "m.pt").exists()


def test_torchao_fields_say_how_they_are_stored(cli):
    res = cli("inspect", "--json", THIRD / "torchao-adamw4bit.pt")
    params = json.loads(res.stdout)["params"]
    assert params[0]["fields"]["exp_avg"]["stored_as"] == "torchao OptimState4bit: 4-bit codes (two a byte), block 128"
    assert params[0]["fields"]["exp_avg"]["dtype"] == "F32" and params[0]["shape"] == [64, 64]
    assert "stored_as" not in params[1]["fields"]["exp_avg"]  # the 64-element bias: a plain tensor


def test_lion_pytorch_run_continues_bit_for_bit_as_burn_lion_from_the_converted_record(cli, tmp_path):
    """statekit's burn Lion, started from the converted .bpk and fed lion-pytorch's own gradients of
    steps 4..8, lands exactly where lion-pytorch took the model; verify-resume agrees."""
    from safetensors.numpy import save_file

    out = tmp_path / "lion.bpk"
    names = names_file(tmp_path, SMALL_NAMES)
    assert cli("convert", THIRD / "lion-pytorch.pt", out, "--names", names, "--transpose", "*.weight").returncode == 0
    ref = load_file(THIRD / "lion-resume.safetensors")

    def burn_layout(key: str) -> dict:  # burn keeps Linear weights [in, out]
        return {n: (ref[f"{key}.{i}"].T if ref[f"{key}.{i}"].dim() == 2 else ref[f"{key}.{i}"]).contiguous().numpy()
                for i, n in enumerate(SMALL_NAMES)}

    save_file(burn_layout("param"), tmp_path / "p.safetensors")
    grads = []
    for k in range(3, 8):
        save_file(burn_layout(f"grad.{k}"), tmp_path / f"g{k}.safetensors")
        grads += ["--grads", tmp_path / f"g{k}.safetensors"]
    res = cli("replay", "--state", out, "--params", tmp_path / "p.safetensors", *grads,
              "--out-params", tmp_path / "after.safetensors")
    assert res.returncode == 0, res.stderr
    after = load_file(tmp_path / "after.safetensors")
    final = burn_layout("final")
    for name in SMALL_NAMES:
        assert (bits(after[name]) == final[name].view(np.int32)).all(), name
    verify = cli("verify-resume", THIRD / "lion-pytorch.pt", out, "--names", names, "--transpose", "*.weight")
    assert verify.returncode == 0 and "bit-exact" in verify.stdout, verify.stdout + verify.stderr


@pytest.mark.parametrize("stem", ["torchao-adamw8bit", "torchao-adamw4bit", "torchao-adamwfp8"])
def test_torchao_inspect_counts_the_bytes_stored_not_the_dequantized_ones(stem, cli):
    import zipfile

    path = THIRD / f"{stem}.pt"
    with zipfile.ZipFile(path) as z:  # the file's tensor storages (codes, scales, the shared qmap, steps)
        stored = sum(i.file_size for i in z.infolist() if "/data/" in i.filename)
    d = json.loads(cli("inspect", "--json", path).stdout)
    # less the group's lr and each parameter's step (0-dim float32 tensors; steps are shown apart)
    assert d["bytes"] == stored - 4 * (len(d["params"]) + 1) < d["file_bytes"]
    # torchao quantizes the moments of a tensor of 4096 elements or more (here the 64×64 weight only)
    big = [p for p in d["params"] if math.prod(p["shape"]) >= 4096]
    assert [p["shape"] for p in big] == [[64, 64]]
    assert all("stored_label" in f for p in big for f in p["fields"].values())
    moments = 64 * 64 * 2  # exp_avg and exp_avg_sq, read as float32
    assert d["dequantized_bytes"] == moments * 4
    table = cli("inspect", path.name, cwd=THIRD).stdout  # a short relative path: the header's wrap is fixed
    assert "dequantized" in table.split("┏")[0]
    assert "exp_avg (" in table  # the table says the moment is stored quantized


def test_transformers_adafactor_run_continues_as_burn_adafactor_from_the_converted_record(cli, tmp_path):
    """statekit's burn Adafactor, started from the converted .bpk and fed transformers' own gradients
    of steps 4..8, tracks where transformers took the model: burn holds ε₁ inside its moments as
    transformers does (not added twice: the moments keep the file's bits), and both switches carry."""
    from safetensors.numpy import save_file

    out = tmp_path / "adafactor.bpk"
    names = names_file(tmp_path, SMALL_NAMES)
    res = cli("convert", THIRD / "hf-adafactor-relative.pt", out, "--names", names, "--transpose", "*.weight")
    assert res.returncode == 0, res.stderr
    assert "relative_step=True, scale_parameter=True" in res.stdout and "epsilon_1=1e-30" in res.stdout
    assert "already hold ε₁" in res.stderr
    saved = torch_load(THIRD / "hf-adafactor-relative.pt")
    with statekit.open(out) as ckpt:
        got = {n: {k: v.numpy() for k, v in p.slots.items()} for n, p in zip(SMALL_NAMES, sorted(
            ckpt.optimizer.params, key=lambda p: -p.slots.get("row_var", p.slots.get("variance")).numel), strict=True)}
    # burn's [in, out] weight: its row factor is transformers' column factor, bit for bit
    assert (got["0.weight"]["row_var"].reshape(-1).view(np.int32) == bits(saved["state"][0]["exp_avg_sq_col"])).all()
    assert (got["0.weight"]["col_var"].reshape(-1).view(np.int32) == bits(saved["state"][0]["exp_avg_sq_row"])).all()
    assert (got["0.bias"]["variance"].view(np.int32) == bits(saved["state"][1]["exp_avg_sq"])).all()
    ref = load_file(THIRD / "hf-adafactor-resume.safetensors")

    def burn_layout(key: str) -> dict:  # burn keeps Linear weights [in, out]
        return {n: (ref[f"{key}.{i}"].T if ref[f"{key}.{i}"].dim() == 2 else ref[f"{key}.{i}"]).contiguous().numpy()
                for i, n in enumerate(SMALL_NAMES)}

    save_file(burn_layout("param"), tmp_path / "p.safetensors")
    grads = []
    for k in range(3, 8):
        save_file(burn_layout(f"grad.{k}"), tmp_path / f"g{k}.safetensors")
        grads += ["--grads", tmp_path / f"g{k}.safetensors"]
    res = cli("replay", "--state", out, "--params", tmp_path / "p.safetensors", *grads,
              "--out-params", tmp_path / "after.safetensors")
    assert res.returncode == 0, res.stderr
    restarted = cold_burn_adafactor(burn_layout("param"), [burn_layout(f"grad.{k}") for k in range(3, 8)])
    after, final = load_file(tmp_path / "after.safetensors"), burn_layout("final")
    for name in SMALL_NAMES:
        off = np.abs(after[name].numpy() - final[name]).max()
        cold_off = np.abs(restarted[name] - final[name]).max()
        # burn and transformers order the update differently (burn rounds every scalar to float32,
        # divides where transformers multiplies by an rsqrt): a few float32 ulp of the largest weight
        assert off <= 4 * np.finfo(np.float32).eps * np.abs(final[name]).max(), (name, off)
        assert cold_off > 100 * max(off, 1e-9), (name, off, cold_off)
    verify = cli("verify-resume", THIRD / "hf-adafactor-relative.pt", out, "--names", names, "--transpose", "*.weight")
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize("stem, says", [
    ("hf-adafactor-trainer", None),
    ("hf-adafactor-beta1", "beta1=0.9 keeps a first moment (exp_avg), which burn's Adafactor does not have"),
])
def test_transformers_adafactor_to_burn_carries_both_switches_and_refuses_what_burn_cannot_express(
        stem, says, cli, tmp_path):
    out = tmp_path / "x.bpk"
    res = cli("convert", THIRD / f"{stem}.pt", out, "--names", names_file(tmp_path, SMALL_NAMES),
              "--transpose", "*.weight")
    if says is None:  # the Trainer's settings: burn has both switches, transformers' own values carry
        assert res.returncode == 0, res.stderr
        assert "lr=0.001" in res.stdout and "relative_step=False, scale_parameter=False" in res.stdout
        saved = torch_load(THIRD / f"{stem}.pt")
        with statekit.open(out) as ckpt:
            variance = next(p.slots["variance"] for p in ckpt.optimizer.params if "variance" in p.slots).numpy()
        assert (variance.view(np.int32) == bits(saved["state"][1]["exp_avg_sq"])).all()  # ε₁ not added twice
        verify = cli("verify-resume", THIRD / f"{stem}.pt", out, "--names", names_file(tmp_path, SMALL_NAMES),
                     "--transpose", "*.weight")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert "arithmetic burn → burn" in verify.stdout  # transformers' update is burn's, not torch's
        return
    assert res.returncode == 1 and not out.exists()
    assert says in res.stderr and f"{stem}.pt" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def cold_burn_adafactor(params: dict, grads: list[dict]) -> dict:
    """burn's Adafactor from no state (its first step) over the same gradients: the restart a silent
    no-op restore would give."""
    from statekit.optim.burn_extra import adafactor

    hp = {"lr": 1e-2, "epsilon_1": 1e-30, "epsilon_2": 1e-3, "d": 1.0, "beta2_decay": -0.8, "weight_decay": 0.0,
          "relative_step": True, "scale_parameter": True}
    out = {n: v.copy() for n, v in params.items()}
    for n in out:
        state, step = {}, 0
        for g in grads:
            state = adafactor(out[n], g[n], state, step, hp)
            step += 1
    return out


@pytest.mark.parametrize("setting, says", [
    ({"weight_decay": 0.1}, "weight_decay=0.1 decays by the scaled, relative step in transformers, by the plain lr in "
                            "burn's Adafactor"),
    ({"warmup_init": True}, "warmup_init=True grows the relative step from 1e-6·t, which burn's Adafactor cannot do"),
])
def test_transformers_adafactor_settings_burn_cannot_express_are_refused(setting, says):
    from statekit.frameworks.torch_thirdparty import adapt

    with statekit.open(THIRD / "hf-adafactor-relative.pt") as ckpt:
        state = ckpt.optimizer
        state.groups[0].hyperparams.update(setting)
        with pytest.raises(MappingError, match="cannot continue as burn's Adafactor") as err:
            adapt(state, "burn")
    assert says in str(err.value)
