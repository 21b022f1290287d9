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


# ---- --stats of many one-element tensors: read together, the numbers bit for bit the same

def _span_refs(tmp_path):
    """One-element tensors of every dtype and edge value over one file (as a .pt's views are), with
    tensors that cannot be read together mixed in: several elements, another dtype, a span longer
    than its one element, an in-memory array, QFloat, an offset off its dtype's grid."""
    import math

    import numpy as np

    from statekit.tensor import FileSpan, SourceFile, TensorRef

    floats = [0.0, -0.0, 1.5, -3.25, math.nan, math.inf, -math.inf, 2.0**600, -(2.0**1000), 5e-324, 1e308,
              2.0**500, 2.0**501, 1e-200]
    cases = [("F64", "<f8", floats), ("F32", "<f4", floats[:7] + [3e38, 1e-45, 2.5e-30]),
             ("F16", "<f2", [0.0, -0.0, 65504.0, 6e-8, math.nan, -math.inf]),
             ("I64", "<i8", [0, -1, 2**63 - 1, -(2**63), 2**53 + 1]), ("I8", "i1", [-128, 127]),
             ("U64", "<u8", [2**64 - 1]), ("Bool", "?", [True, False])]
    blob = bytearray()
    laid = []  # (dtype, offset, length, shape)
    for name, spec, values in cases:
        with np.errstate(over="ignore"):
            data = np.array(values * 3, dtype=spec).tobytes()
        size = np.dtype(spec).itemsize
        blob += bytes(-len(blob) % 8)
        base = len(blob)
        blob += data
        laid += [(name, base + k * size, size, (1,)) for k in range(len(values) * 3)]
        laid.append((name, base, 2 * size, (2,)))  # two elements: computed --jobs at a time
        laid.append((name, base, 2 * size, (1,)))  # a span longer than its one element
    blob += b"\x00"
    laid.append(("F32", len(blob) - 1 - 4, 4, (1,)))  # off the 4-byte grid of the F32s before
    path = tmp_path / "values.bin"
    path.write_bytes(bytes(blob))
    source = SourceFile.open(str(path))
    refs = [TensorRef(dtype=d, shape=shape, span=FileSpan(source, off, n)) for d, off, n, shape in laid]
    refs.insert(5, TensorRef.from_array(np.array([7.0], dtype=np.float32)))
    refs.insert(9, TensorRef(dtype="QFloat", shape=(1,), span=FileSpan(source, 0, 1)))
    return source, refs


@pytest.mark.parametrize("batch", [4096, 7, 1])
def test_one_element_statistics_read_together_are_each_ones(tmp_path, monkeypatch, batch):
    import numpy as np

    from statekit.ops import inspect as ops

    monkeypatch.setattr(ops, "ONE_BATCH", batch)
    source, refs = _span_refs(tmp_path)
    try:
        want = np.array([ops._encoded(ops.tensor_stats(r)) for r in refs], dtype=np.float64)
        progress = []
        got = ops._stat_table(refs, progress.append)
        assert got.tobytes() == want.tobytes()  # bit for bit: -0.0, NaN counts, the scaled sums
        assert progress == sorted(progress) and progress[-1] == len(refs)
        if batch == 4096:  # one read for the F64s (the first file dtype), the rest one by one
            at, values = ops._read_ones(refs)
            assert len(at) == 3 * 14 and values.dtype == np.float64
        calls = []
        real = ops.tensor_stats
        monkeypatch.setattr(ops, "tensor_stats", lambda r, *a: calls.append(r) or real(r, *a))
        ops._stat_table(refs, lambda n: None)
        together = sum(r.numel == 1 for r in calls)
        assert together < sum(r.numel == 1 for r in refs) - 40  # most were read together
        calls.clear()
        monkeypatch.setattr(ops, "ONE_READ", 0)  # none may be read together: each alone, the same numbers
        assert ops._stat_table(refs, lambda n: None).tobytes() == want.tobytes()
        assert sum(r.numel == 1 for r in calls) == sum(r.numel == 1 for r in refs)
    finally:
        source.close()


def test_one_element_statistics_of_a_short_file_fail_in_their_turn(tmp_path):
    from statekit.errors import StatekitError
    from statekit.ops import inspect as ops
    from statekit.tensor import FileSpan, SourceFile, TensorRef

    path = tmp_path / "short.bin"
    path.write_bytes(bytes(40))
    source = SourceFile.open(str(path))
    refs = [TensorRef(dtype="F32", shape=(1,), span=FileSpan(source, 4 * k, 4)) for k in range(12)]
    try:
        assert ops._read_ones(refs) is None  # the read comes short: none read together
        with pytest.raises(StatekitError) as alone:
            ops.tensor_stats(refs[10])
        with pytest.raises(StatekitError) as together:
            ops._stat_table(refs, lambda n: None)
        assert str(together.value) == str(alone.value)
    finally:
        source.close()


# ---- a model's streamed rows: the stats table from the numbers, JSON without a first walk of rows

def _model_checkpoint(tmp_path, n: int, odd_path: object = None):
    import numpy as np

    from statekit.state import Checkpoint, ModelInfo, ModelParam
    from statekit.tensor import FileSpan, SourceFile, TensorRef

    values = np.linspace(-3.0, 5.0, n).astype(np.float32)
    values[::97] = np.nan
    values[5::101] = -np.inf
    path = tmp_path / "model.bin"
    wide = np.full(1200, np.nan, dtype=np.float64)  # 1,100 NaN and 100 -Inf: counts wider than their headers
    wide[:100] = -np.inf
    wide[-1] = -1.234e-300  # the widest number .4g writes
    path.write_bytes(values.tobytes() + np.arange(12, dtype=np.float32).tobytes() + wide.tobytes())
    source = SourceFile.open(str(path))
    params = [ModelParam(path=f"blocks.{k // 10}.w{k}" if k % 13 else f"top{k}", shape=(1,), dtype="F32",
                         tensor=TensorRef(dtype="F32", shape=(1,), span=FileSpan(source, 4 * k, 4)),
                         id=k * 7919 if k % 3 == 0 else None, buffer=k % 11 == 0)
              for k in range(n)]
    params.insert(3, ModelParam(path="big.weight", shape=(3, 4), dtype="F32",
                                tensor=TensorRef(dtype="F32", shape=(3, 4), span=FileSpan(source, 4 * n, 48))))
    params.insert(8, ModelParam(path="empty.weight", shape=(2,), dtype="F32"))  # no tensor: no statistics
    params.insert(9, ModelParam(path="", shape=(1,), dtype="QFloat", id=5,
                                tensor=TensorRef(dtype="QFloat", shape=(1,), span=FileSpan(source, 0, 1))))
    params.append(ModelParam(path="wide.weight", shape=(1200,), dtype="F64",
                             tensor=TensorRef(dtype="F64", shape=(1200,), span=FileSpan(source, 4 * n + 48, 9600))))
    if odd_path is not None:
        params[20].path = odd_path
    ckpt = Checkpoint(path=str(path), format="torch", kind="model", model=ModelInfo(params=params),
                      n_tensors=len(params), nbytes=4 * n + 48, container=source)
    return ckpt


@pytest.mark.parametrize("n", [40, 700])  # the rich table, and the plain one (above PLAIN_ROWS)
def test_model_stats_table_json_and_tsv_streamed_are_the_listed_ones(tmp_path, n):
    from statekit.render import inspect as view

    with _model_checkpoint(tmp_path, n) as ckpt:
        listed = inspect(ckpt, stats=True)
        streamed = inspect(ckpt, stats=True, stream=True)
        rows = streamed["params"]
        assert rows.json_check() == ()  # paths, dtypes, ids and shapes are str/int/None: no row walked
        assert list(rows) == listed["params"] and list(rows.without_stats()) == inspect(ckpt)["params"]
        assert sum(1 for _ in rows.stat_values()) == len(listed["params"]) - 1  # (the one without a tensor)

        def text(table) -> str:
            from statekit.render import boxes

            if isinstance(table, list):
                return "".join(table)
            if isinstance(table, boxes.Grid):
                return boxes.draw(table, 120)
            from rich.console import Console

            console = Console(width=200, record=True, file=io.StringIO())
            console.print(table)
            return console.export_text()
        assert text(view.stats_table(streamed)) == text(view.stats_table(listed))
        assert text(view.params_table(streamed, 120)) == text(view.params_table(listed, 120))
        shown = text(view.stats_table(streamed))
        assert "(value)" in shown and "top0" in shown and " 1099 " in shown and "-1.234e-300" in shown
        chunks: list[str] = []
        output.write_chunks(streamed, chunks.append)
        assert "".join(chunks) == output.dumps(listed)
        assert list(render.tsv_lines("inspect", streamed)) == list(render.tsv_lines("inspect", listed))


class _Name(str):
    """A str subclass: the fast writer leaves it to json."""


@pytest.mark.parametrize("odd", [7, ("a", "b"), {1: "x"}, _Name("n")])
def test_model_rows_json_walks_the_rows_unless_every_value_is_plain(tmp_path, odd):
    import json

    with _model_checkpoint(tmp_path, 30, odd_path=odd) as ckpt:
        listed = inspect(ckpt, stats=True)
        streamed = inspect(ckpt, stats=True, stream=True)
        walked = streamed["params"].json_check()
        assert (walked == ()) is (type(odd) is int)  # an int is JSON's; anything else: the rows are walked
        chunks: list[str] = []
        output.write_chunks(streamed, chunks.append)  # never partial
        text = "".join(chunks)
        assert text == output.dumps(listed)
        if isinstance(odd, dict | _Name):  # only json can write it: json's own text, given whole
            assert chunks == [json.dumps(output._jsonable(listed), indent=2, allow_nan=False)]
        else:
            assert len(chunks) > 0 and json.loads(text)["params"][20]["path"] == json.loads(json.dumps(odd))
