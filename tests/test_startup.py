"""Start-up: a command imports only what it needs (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from statekit import typer_fast

PROBE = """
import io, contextlib, json, sys
sys.argv = ["statekit", *json.loads(sys.argv[1])]
from statekit.entry import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        main()
except SystemExit as exc:
    code = exc.code or 0
else:
    code = 0
print(json.dumps({"code": code, "out": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def run(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(args))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_version_imports_no_command_line():
    r = run("--version")
    assert r["code"] == 0 and r["out"].startswith("statekit ")
    heavy = {"typer", "click", "rich", "numpy", "torch", "pydantic"} & {m.split(".")[0] for m in r["modules"]}
    assert not heavy


@pytest.mark.parametrize("fmt", [[], ["--json"]])
def test_header_only_inspect_imports_no_numpy_torch_or_pydantic(fmt):
    r = run("inspect", "fixtures/hand-optim.bpk", *fmt)
    assert r["code"] == 0 and "weight" in r["out"]
    roots = {m.split(".")[0] for m in r["modules"]}
    assert not {"numpy", "ml_dtypes", "torch", "pydantic"} & roots, sorted({"numpy", "torch", "pydantic"} & roots)
    assert "rich.progress" not in r["modules"]  # no progress bar for a short command (stdout is not a terminal)


def test_inspect_with_stats_does_read_tensors():
    """The lazy numpy is real numpy as soon as values are needed."""
    r = run("inspect", "fixtures/hand-optim.bpk", "--stats", "--json")
    assert r["code"] == 0 and "numpy" in r["modules"]


def test_plain_typer_options_are_coerced_without_pydantic(tmp_path):
    """statekit's int/float/path/list options keep typer's behaviour: values converted, a bad
    number is one usage error naming the option."""
    assert typer_fast.install()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bad = subprocess.run([sys.executable, "-m", "statekit", "verify-resume", "a.bpk", "b.pt", "--lr", "fast"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--lr" in bad.stderr and "fast" in bad.stderr
    r = run("verify-resume", "fixtures/hand-optim.bpk", "fixtures/hand-optim.bpk", "--steps", "2", "--lr", "1e-2", "--optimizer", "adam",
            "--json")
    report = json.loads(r["out"])
    assert r["code"] == 0 and report["steps"] == 2 and report["hyperparams"]["original"]["lr"] == 0.01
    assert "pydantic" not in {m.split(".")[0] for m in r["modules"]}


def test_ranged_options_keep_their_bounds():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bad = subprocess.run([sys.executable, "-m", "statekit", "verify-resume", "fixtures/hand-optim.bpk",
                          "fixtures/hand-optim.bpk", "--steps", "0"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--steps" in bad.stderr and "0" in bad.stderr
