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
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)  # no terminal
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
    # stdout is not a terminal: the table and lines are drawn without rich (statekit.render.boxes)
    assert "rich" not in roots and "┏" in r["out"] or fmt


def test_float32_convert_imports_no_ml_dtypes(tmp_path):
    """ml_dtypes (0.7 imports in about a second) only for a tensor of its dtypes (issue 21)."""
    r = run("convert", "fixtures/hand-optim.bpk", str(tmp_path / "out.pt"), "--optimizer", "adam",
            "--names", "fixtures/hand-names.txt", "--transpose", "*")
    assert r["code"] == 0 and (tmp_path / "out.pt").stat().st_size > 3000
    roots = {m.split(".")[0] for m in r["modules"]}
    assert "numpy" in roots and "ml_dtypes" not in roots


def test_bf16_convert_does_import_ml_dtypes(tmp_path):
    r = run("convert", "fixtures/hand-optim-bf16.bpk", str(tmp_path / "out.safetensors"), "--optimizer", "adam")
    assert r["code"] == 0 and "ml_dtypes" in {m.split(".")[0] for m in r["modules"]}


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


def _many_params(path, n: int) -> None:
    import numpy as np

    from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack
    from statekit.tensor import TensorRef

    tensors, scalars, meta = [], {}, {}
    values = np.arange(4, dtype=np.float32)
    for i in range(n):
        pid = 10**18 + i
        for field in ("momentum.moment_1", "momentum.moment_2"):
            tensors.append(PackTensor(f"{pid}.{field}", TensorRef.from_array(values), param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", 1)
        scalars[f"{pid}.momentum.time"] = Scalar("UInt", 3)
        meta[str(pid)] = f"layers.{i // 2}.{'weight' if i % 2 else 'bias'}"
    write_burnpack(str(path), tensors, meta, scalars)


def test_long_tables_are_plain_text_and_never_a_rich_table(tmp_path, cli, monkeypatch):
    """Above render.inspect.PLAIN_ROWS parameters the table is aligned text (one line per
    parameter, a total under each group); TSV and JSON never build a rich table either."""
    from statekit.render import inspect as view

    n = view.PLAIN_ROWS + 100
    path = tmp_path / "wide.bpk"
    _many_params(path, n)

    def no_table(*args, **kwargs):
        raise AssertionError("a rich Table was built")

    monkeypatch.setattr("rich.table.Table.__init__", no_table)
    table = cli("inspect", path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("path "))
    assert lines[header].split()[:2] == ["path", "id"] and set(lines[header + 1]) <= {"-", " "}
    rows = [line for line in lines if line.startswith("layers.")]
    assert len(rows) == n and rows[0].split()[0] == "layers.0.bias"
    # the group total: 2 parameters x 2 moments x 4 float32 = 16 elements, 64 bytes
    assert sum(line.strip() == "layers.0: 16 elements, 64 B" for line in lines) == 1
    tsv = cli("inspect", path, "--format", "tsv")
    assert tsv.returncode == 0 and len(tsv.stdout.splitlines()) == n + 1
    js = cli("inspect", path, "--json")
    assert js.returncode == 0 and len(json.loads(js.stdout)["params"]) == n


@pytest.mark.parametrize("args", [["inspect", "--help"], ["convert", "--help"], ["verify-resume", "--help"],
                                  ["inspect", "--nope", "x"], ["inspekt", "x"], ["--help"], []])
def test_only_the_command_asked_for_is_built_and_it_answers_as_the_whole_app(cli, monkeypatch, args):
    """cli._app_for hands typer an app of the one command named first: help, usage errors and
    exit codes are the whole app's."""
    from statekit import cli as cli_module

    if args and not args[0].startswith("-") and args[0] != "inspekt":
        assert [c.callback.__name__ for c in cli_module._app_for(args).registered_commands] != \
            [c.callback.__name__ for c in cli_module.app.registered_commands]
    single = cli(*args)
    monkeypatch.setattr(cli_module, "_app_for", lambda argv: cli_module.app)
    whole = cli(*args)
    assert (single.returncode, single.stdout, single.stderr) == (whole.returncode, whole.stdout, whole.stderr)
