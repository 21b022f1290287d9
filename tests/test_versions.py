"""The installed releases of torch, transformers and bitsandbytes: read without importing them, said
where they decide something, one warning line outside the tested range, never a refusal (issue 30)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import numpy as np
import pytest
from conftest import FIXTURES, ROOT
from packaging.requirements import Requirement
from safetensors.numpy import save_file

import statekit
from statekit import versions
from statekit.errors import UsageError
from statekit.frameworks import bnb, hf_model
from statekit.optim import kernels
from statekit.optim.backend import Backend


def fake_installed(monkeypatch, **releases):
    """``versions.installed`` answering ``releases`` (None: not installed) and the truth for the rest."""
    real = versions.installed

    def installed(dist):
        key = dist.replace("-", "_")
        return releases[key] if key in releases else real(dist)

    monkeypatch.setattr(versions, "installed", installed)


def test_versions_parse_and_compare_by_number():
    assert versions.parse("2.13.0+cpu") == (2, 13, 0)
    assert versions.parse("5.24.0.dev0") == (5, 24, 0)
    assert versions.parse("0.49") == (0, 49)
    assert versions.parse("nightly") is None and versions.parse(None) is None
    assert versions.outside("torch", "2.10.1") is None  # inside 2.7 … 2.13
    assert versions.outside("torch", "2.13.9") is None  # a patch release of the newest tested minor
    assert versions.outside("torch", "2.14.1") == "torch 2.14.1 is newer than the releases statekit was tested with (2.7 to 2.13)"
    assert versions.outside("transformers", "4.40.2") == \
        "transformers 4.40.2 is older than the releases statekit was tested with (4.46 to 5.24)"
    assert versions.outside("transformers", "4.100.0") is None  # 100 > 46: compared as numbers, not text
    assert versions.outside("torch", "unknown") is None


def test_the_installed_release_is_read_without_importing_the_library():
    """importlib.metadata's answer, checked against the imported library's own __version__."""
    probe = ("import json, sys; from statekit import versions; v = versions.installed('torch'); "
             "before = 'torch' in sys.modules; import torch; "
             "print(json.dumps([v, before, torch.__version__, versions.installed('no-such-dist-here')]))")
    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    read, imported_before, real, absent = json.loads(done.stdout)
    assert read == real and not imported_before and absent is None


def test_the_installed_release_is_what_importlib_metadata_says_without_importing_it():
    """The .dist-info folder's name, checked against importlib.metadata (in a fresh interpreter:
    neither importlib.metadata nor the library is imported to answer)."""
    dists = ["torch", "transformers", "numpy", "typing-extensions", "safetensors", "no-such-dist-here"]
    probe = ("import json, sys; from statekit import versions; got = [versions.installed(d) for d in sys.argv[1:]]; "
             "clean = 'importlib.metadata' not in sys.modules and 'torch' not in sys.modules; "
             "from importlib import metadata\n"
             "def real(d):\n"
             "    try:\n        return metadata.version(d)\n"
             "    except metadata.PackageNotFoundError:\n        return None\n"
             "print(json.dumps([got, [real(d) for d in sys.argv[1:]], clean]))")
    done = subprocess.run([sys.executable, "-c", probe, *dists], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got, real, clean = json.loads(done.stdout)
    assert got == real and real[-1] is None and real[0] is not None and clean


def test_the_tested_ranges_are_pyprojects_floors_and_the_constraints_pins():
    """versions.TESTED, pyproject.toml's extras and constraints.txt say the same thing."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    floors = {}
    for text in extras["hf"]:
        req = Requirement(text)
        (spec,) = req.specifier
        assert spec.operator == ">="
        floors[req.name] = versions.parse(spec.version)
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[req.name] = versions.parse(next(iter(req.specifier)).version)
    for dist in ("torch", "transformers"):
        low, high = versions.TESTED[dist]
        assert floors[dist][:2] == low and pins[dist][:2] == high, dist


# ----------------------------------------------------------------------------- transformers / torch definitions


@pytest.mark.hf
def test_a_definition_built_outside_the_tested_range_warns_once_and_still_names(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import torch

    folder = FIXTURES / "hf" / "v5" / "llama" / "checkpoint-2"
    for dist, module in (("transformers", transformers), ("torch", torch)):  # the range: exactly what is installed
        have = versions.parse(module.__version__)[:2]
        monkeypatch.setitem(versions.TESTED, dist, (have, have))
    with statekit.open(folder) as ckpt:
        assert not [w for w in ckpt.warnings if "tested" in w]
    monkeypatch.setitem(versions.TESTED, "transformers", ((0, 1), (0, 2)))
    with statekit.open(folder) as ckpt:
        said = [w for w in ckpt.warnings if "tested" in w]
        assert said == [f"transformers {transformers.__version__} is newer than the releases statekit was tested with "
                        f"(0.1 to 0.2); the model's definition was built with it"]
        assert all(p.path for p in ckpt.optimizer.params)  # named all the same
        assert "rule of transformers >= 4.53" in ckpt.optimizer.names_from  # and the decay rule it applied said


def test_builder_warnings_name_each_library_outside_the_range():
    assert hf_model.builder_warnings("5.24.0", "2.13.0+cpu") == []
    assert hf_model.builder_warnings("4.40.2", "2.6.0") == [
        "transformers 4.40.2 is older than the releases statekit was tested with (4.46 to 5.24); "
        "the model's definition was built with it",
        "torch 2.6.0 is older than the releases statekit was tested with (2.7 to 2.13); "
        "the model's definition was built with it"]


# ----------------------------------------------------------------------------- torch's kernel in replay


def test_torch_older_than_2_7_leaves_auto_to_the_next_kernel_and_refuses_an_explicit_one(monkeypatch):
    pytest.importorskip("torch")
    b = Backend()
    assert kernels.choose("adamw", "torch", b) == "torch"
    fake_installed(monkeypatch, torch="2.6.0")
    assert kernels.choose("adamw", "torch", b) in ("numba", "reference")
    with pytest.raises(UsageError, match=r"--kernel torch: torch 2.6.0 is older than 2.7, whose adam\(\) takes"):
        kernels.choose("adamw", "torch", b, "torch")


def test_replay_with_torchs_kernel_outside_the_range_warns_in_one_line(monkeypatch, tmp_path, cli):
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    save_file({"w": rng.normal(size=(4, 3)).astype(np.float32)}, str(tmp_path / "p.safetensors"))
    save_file({"w": rng.normal(size=(4, 3)).astype(np.float32)}, str(tmp_path / "g.safetensors"))
    args = ["replay", "--params", tmp_path / "p.safetensors", "--grads", tmp_path / "g.safetensors",
            "--optimizer", "adamw", "--flavor", "torch", "--lr", "1e-2", "--out-params", tmp_path / "o.safetensors"]
    have = versions.parse(versions.installed("torch"))[:2]
    monkeypatch.setitem(versions.TESTED, "torch", (have, have))  # the range: exactly what is installed
    r = cli(*args, "--json")
    assert r.returncode == 0 and "warnings" not in json.loads(r.stdout)
    monkeypatch.setitem(versions.TESTED, "torch", ((2, 7), (2, 13)))
    fake_installed(monkeypatch, torch="2.14.1")
    r = cli(*args, "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["kernel"] == "torch"
    assert report["warnings"] == ["torch 2.14.1 is newer than the releases statekit was tested with (2.7 to 2.13); "
                                  "its kernels ran the steps"]
    r = cli(*args)
    assert r.returncode == 0 and r.stderr.count("warning:") == 1 and "torch 2.14.1 is newer" in r.stderr


# ----------------------------------------------------------------------------- writing for the installed library


def test_each_bitsandbytes_release_writes_one_layout():
    assert [bnb.format_for(v) for v in ((0, 43, 3), (0, 44, 0), (0, 49, 1), (0, 49, 2), (0, 50, 2), (1, 0))] == \
        ["bnb-2048", "bnb-flat", "bnb-flat", "bnb", "bnb", "bnb"]


@pytest.mark.parametrize(("installed", "said"), [
    (None, []),
    ("0.50.2", []),
    ("0.48.2", ["bitsandbytes 0.48.2 is older than the releases statekit was tested with (0.50)",
                "--to bnb writes the layout of bitsandbytes >= 0.49.2 (nested entries, blocks of 256); the installed "
                "bitsandbytes 0.48.2 writes that of bitsandbytes 0.44 to 0.49.1 (flat entries, blocks of 256): "
                "--to bnb-flat for it"]),
])
def test_bnb_output_says_when_the_installed_bitsandbytes_writes_another_layout(monkeypatch, tmp_path, cli,
                                                                             installed, said):
    fake_installed(monkeypatch, bitsandbytes=installed)
    out = tmp_path / "out.pt"
    r = cli("convert", "fixtures/bnb/torch-adamw.pt", out, "--to", "bnb", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert [w for w in plan["warnings"] if "installed" in w or "tested" in w] == said
    assert not out.exists()


@pytest.mark.parametrize(("installed", "warned"), [("2.5.1", True), ("2.13.0", False), (None, False)])
def test_param_names_written_for_a_torch_that_predates_them_are_said(monkeypatch, tmp_path, cli, installed, warned):
    fake_installed(monkeypatch, torch=installed)
    out = tmp_path / "out.pt"
    r = cli("convert", "fixtures/hand-optim.bpk", out, "--optimizer", "adam", "--names", "fixtures/hand-names.txt",
            "--transpose", "*.weight")
    assert r.returncode == 0, r.stderr
    line = ("each param group keeps param_names, as torch >= 2.6 writes them; the installed torch 2.5.1 loads them "
            "as a group key it does not use")
    assert (line in " ".join(r.stderr.split())) is warned
    from statekit.formats import torch_pt

    assert torch_pt.load_pt(str(out))["param_groups"][0]["param_names"] == [
        "l1.weight", "l1.bias", "l2.weight", "l2.bias"]  # what the line says is in the file


def test_a_torch_file_that_keeps_param_names_says_its_names_come_from_them(tmp_path, cli):
    from statekit.frameworks.torch_io import NAMES_IN_FILE

    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    for name, params in (("named", model.named_parameters()), ("plain", model.parameters())):
        opt = torch.optim.AdamW(params, lr=1e-2)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        torch.save(opt.state_dict(), tmp_path / f"{name}.pt")
    named = json.loads(cli("inspect", tmp_path / "named.pt", "--json").stdout)
    assert [p["path"] for p in named["params"]] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert NAMES_IN_FILE in named["notes"]
    plain = json.loads(cli("inspect", tmp_path / "plain.pt", "--json").stdout)
    assert NAMES_IN_FILE not in plain["notes"] and not any(p["path"] for p in plain["params"])
