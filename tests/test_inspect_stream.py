"""inspect's streamed rows (``stream=True``, what the CLI uses): the same description, table, TSV
and JSON as the list of rows built at once, row for row, statistics included."""

import io
import sys

import pytest
from conftest import ROOT

import statekit.io as skio
from statekit import output, render
from statekit.ops.inspect import Rows, inspect

FILES = ["fixtures/hand-optim.bpk", "fixtures/lm-optim.bpk", "fixtures/lm-model.bpk",
         "fixtures/bnb/adamw8bit.pt", "fixtures/bnb/adamw8bit-nan.pt", "fixtures/bnb/adamw32bit.pt",
         "fixtures/torch_optim/adafactor.pt", "fixtures/torch_optim/lbfgs.pt"]


def _both(path: str, stats: bool, only=None):
    with skio.open_checkpoint(str(ROOT / path)) as ckpt:
        listed = inspect(ckpt, stats=stats, only=only)
        streamed = inspect(ckpt, stats=stats, only=only, stream=True)
        assert isinstance(streamed["params"], Rows)
        return listed, streamed, [dict(r) for r in streamed["params"]], list(streamed["params"])


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("path", FILES)
def test_streamed_rows_are_the_listed_ones(path, stats):
    listed, streamed, once, twice = _both(path, stats)
    assert listed["params"] == once == twice  # read twice: the same rows (statistics computed once)
    assert len(streamed["params"]) == len(listed["params"])
    if listed["params"]:
        assert streamed["params"][-1] == listed["params"][-1]
    assert output.dumps(streamed) == output.dumps(listed)
    assert list(render.tsv_lines("inspect", streamed)) == list(render.tsv_lines("inspect", listed))


def test_streamed_selection_and_statistics_values():
    listed, streamed, once, _ = _both("fixtures/bnb/adamw8bit.pt", True, only=["#1"])
    assert len(once) == 1 and once == listed["params"]
    assert any("stats" in f for f in once[0]["fields"].values())


def test_json_is_written_in_chunks_and_whole_when_only_json_can_write_it(monkeypatch):
    monkeypatch.setattr(output, "PIECES", 8)
    value = {"a": [{"x": i, "y": [1.5, None]} for i in range(50)], "b": "text"}
    pieces: list[str] = []
    output.write_chunks(value, pieces.append)
    assert len(pieces) > 5 and "".join(pieces) == output.dumps(value)
    odd = {"a": list(range(50)), "z": {1: 2}}  # an int key: json's own text, given whole, nothing before it
    pieces.clear()
    output.write_chunks(odd, pieces.append)
    import json
    assert pieces == [json.dumps(odd, indent=2, allow_nan=False)]


def test_plain_table_of_many_groups_by_position_is_the_listed_one(monkeypatch):
    from statekit.render import inspect as view

    with skio.open_checkpoint(str(ROOT / "fixtures/lm-optim.bpk")) as ckpt:
        d = inspect(ckpt)
    base = d["params"]
    rows = [{**base[k % len(base)], "path": f"m{k % 7}.w{k}"} for k in range(1200)]  # 7 groups, interleaved
    listed = {**d, "params": rows}
    streamed = {**d, "params": Rows(lambda k: dict(rows[k]), len(rows))}
    monkeypatch.setattr(view, "CHUNK_LINES", 100)

    def text(x):
        out = view.params_table(x, 120)
        return "".join(out)
    assert text(streamed) == text(listed)
    whole = text(listed)
    assert whole.count("\n") == 2 + 1200 + 7 and "m3: " in whole
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    for item in view.params_table(streamed, 120):
        buf.write(item)
    assert buf.getvalue() == whole
