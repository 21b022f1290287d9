"""The CLI's output anywhere: 80 columns, --format table|json|tsv, errors in one place, --param globs."""

from __future__ import annotations

import json
import os
import re

import pytest
from conftest import FIXTURES

HAND = "fixtures/hand-optim.bpk"


def row_of(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if name in line)


@pytest.mark.parametrize("columns", ["80", "60"])
def test_inspect_at_80_columns_keeps_path_shape_dtype_step_fields(cli, columns):
    r = cli("inspect", HAND, env={"COLUMNS": columns})
    assert r.returncode == 0, r.stderr
    row = row_of(r.stdout, "l1.weight")
    assert "4×16" in row and "F32" in row and "21" in row and "momentum.moment_1" in row
    assert all(len(line) <= int(columns) for line in r.stdout.splitlines()[1:] if line.startswith(("│", "┃", "┏")))


def test_inspect_tsv_is_one_header_and_one_line_per_parameter(cli):
    r = cli("inspect", HAND, "--format", "tsv")
    lines = r.stdout.splitlines()
    assert lines[0].split("\t") == ["path", "id", "display_id", "rank", "shape", "dtype", "step", "fields"]
    assert len(lines) == 1 + 4
    assert lines[1].split("\t")[:7] == ["l1.weight", "18402649998147242804", "6j5mg0dcb1hvu", "2", "4×16", "F32", "21"]


def test_header_size_is_the_file_size(cli):
    d = json.loads(cli("inspect", HAND, "--json").stdout)
    assert d["file_bytes"] == os.path.getsize(FIXTURES / "hand-optim.bpk") and d["bytes"] == 776
    assert "3.0 KiB (776 B in tensors)" in cli("inspect", HAND).stdout


@pytest.mark.parametrize("command", [
    ["inspect", HAND], ["diff", HAND, HAND], ["doctor", HAND],
    ["merge", HAND, HAND, "--on-conflict", "first", "-o", "{tmp}/m.bpk", "--dry-run"],
    ["split", HAND, "--into", "a=l1.*", "--rest", "b", "-o", "{tmp}/parts", "--dry-run"],
    ["fit", FIXTURES / "fit" / "frozen-optim.pt", "--model", FIXTURES / "fit" / "model.pt", "--group", "decay=*.weight",
     "--group", "no_decay=*", "-o", "{tmp}/f.pt", "--dry-run"],
    ["verify-resume", HAND, HAND, "--optimizer", "adam", "--lr", "1e-3", "-k", "2"],
    ["convert", HAND, "{tmp}/o.safetensors", "--dry-run"],
])
def test_every_reporting_command_speaks_table_json_and_tsv(cli, tmp_path, command):
    args = [str(a).replace("{tmp}", str(tmp_path)) for a in command]
    as_json = cli(*args, "--format", "json")
    assert as_json.stdout.strip() and as_json.stdout == cli(*args, "--json").stdout
    json.loads(as_json.stdout)
    tsv = cli(*args, "--format", "tsv").stdout.splitlines()
    assert tsv and all("\t" in line for line in tsv[:1])
    assert len({line.count("\t") for line in tsv}) == 1  # one header, rows of the same width


def test_json_errors_are_json_on_stderr(cli):
    r = cli("inspect", "does-not-exist.bpk", "--json")
    assert r.returncode == 1 and r.stdout == ""
    err = json.loads(r.stderr)
    assert err["exit_code"] == 1 and "does-not-exist.bpk" in err["error"]
    r = cli("diff", "does-not-exist.bpk", HAND, "--format", "json")
    assert r.returncode == 2 and json.loads(r.stderr)["exit_code"] == 2


def test_usage_errors_are_one_line(cli):
    for args in (["inspect"], ["inspect", HAND, "--nope"], ["convert", HAND]):
        r = cli(*args)
        assert r.returncode == 2
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("statekit: error: "), r.stderr


def test_usage_shows_metavars_not_python_types(cli):
    for command in ("inspect", "convert", "remap", "replay", "verify-resume", "diff", "merge", "split", "fit", "doctor"):
        text = cli(command, "--help").stdout
        assert not re.search(r"\b(FLOAT|INTEGER|TEXT|PATH)\b|<(float|int|str|path)>", text), (command, text)


def test_shell_completion_is_on(cli):
    assert "--install-completion" in cli("--help").stdout


def test_param_globs_on_inspect_diff_and_doctor(cli, tmp_path):
    d = json.loads(cli("inspect", HAND, "--param", "l1.*", "--json").stdout)
    assert [p["path"] for p in d["params"]] == ["l1.weight", "l1.bias"]
    assert cli("inspect", HAND, "--param", "nothing.*").returncode == 1
    d = json.loads(cli("diff", HAND, "fixtures/hand-optim-bf16.bpk", "--param", "l2.*", "--json").stdout)
    assert {p["label"] for p in d["params"]} <= {"l2.weight", "l2.bias"} and len(d["params"]) == 2
    d = json.loads(cli("doctor", HAND, "--param", "*.bias", "--json").stdout)
    assert d["params"] == 2


@pytest.mark.parametrize("columns", ["80", "60"])
def test_inspect_of_a_global_state_fits_the_terminal(cli, columns):
    """burn's L-BFGS record: its "global scalars" line was one line of 97 characters at 80 columns."""
    r = cli("inspect", FIXTURES / "burn-optim" / "lbfgs.bpk", env={"COLUMNS": columns})
    assert r.returncode == 0, r.stderr
    assert all(len(line) <= int(columns) for line in r.stdout.splitlines()), r.stdout
    shown = " ".join(r.stdout.split())
    assert "g_iter=8" in shown and "prev_loss=" in shown and "history_y.len=7" in shown
