"""statekit inspect / convert from the user's side: the installed command on real files."""

import hashlib
import json

import pytest
from conftest import ROOT

HAND = {
    "18402649998147242804": ("6j5mg0dcb1hvu", "l1.weight", [4, 16]),
    "4872954564708272749": (None, "l1.bias", [16]),
    "708128169117982014": (None, "l2.weight", [16, 1]),
    "2021826497617271949": (None, "l2.bias", [1]),
}


def test_inspect_table(cli):
    r = cli("inspect", "fixtures/hand-optim.bpk")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "burnpack v1" in out and "optimizer (adam/adamw)" in out and "8 tensors, 8 scalars" in out
    for line in ("l1.weight", "18402649998147242804", "6j5mg0dcb1hvu", "4×16"):
        assert line in out
    assert "l1: 160 elements, 640 B" in out  # 2 moments × (64 + 16) f32 elements
    assert "store no hyperparameters" in out


def test_inspect_json_schema(cli):
    r = cli("inspect", "fixtures/hand-optim.bpk", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["format"], d["version"], d["kind"], d["family"]) == ("burnpack", 1, "optimizer", "adam")
    assert (d["tensors"], d["scalars"]) == (8, 8)
    assert d["family_candidates"] == ["adam", "adamw"]
    params = {p["id"]: p for p in d["params"]}
    assert set(params) == set(HAND)
    l1 = params["18402649998147242804"]
    assert l1["display_id"] == "6j5mg0dcb1hvu" and l1["path"] == "l1.weight"
    assert (l1["rank"], l1["shape"], l1["dtype"], l1["step"]) == (2, [4, 16], "F32", 21)
    assert l1["fields"]["momentum.moment_1"] == {"shape": [4, 16], "dtype": "F32", "slot": "exp_avg"}
    assert set(l1["fields"]) == {"momentum.moment_1", "momentum.moment_2"}
    for pid, (_, path, shape) in HAND.items():
        assert params[pid]["path"] == path and params[pid]["shape"] == shape
    assert sum(len(p["fields"]) for p in d["params"]) == 8


def test_inspect_real_burn_model(cli):
    r = cli("inspect", "../shared/fixtures/burn/mnist-model.bpk" if (ROOT.parent / "shared").exists()
            else "fixtures/burn/mnist-model.bpk", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kind"] == "model" and len(d["params"]) == 18
    bias = next(p for p in d["params"] if p["path"] == "conv1.conv.bias")
    assert (bias["id"], bias["display_id"]) == ("9505838338724798577", "e4gfnnsqgnlo6")


@pytest.mark.parametrize(
    ("name", "kind", "family"),
    [("hand-optim-amsgrad.bpk", "optimizer", "adam"), ("hand-optim-sgd.bpk", "optimizer", "sgd"),
     ("hand-optim-rmsprop.bpk", "optimizer", "rmsprop"), ("hand-optim-adagrad.bpk", "optimizer", "adagrad"),
     ("hand-scheduler.bpk", "scheduler", None), ("hand-model.bpk", "model", None),
     ("empty-optim.bpk", "empty", None)],
)
def test_kinds_and_families(cli, name, kind, family):
    d = json.loads(cli("inspect", f"fixtures/{name}", "--json").stdout)
    assert (d["kind"], d["family"]) == (kind, family)


def test_amsgrad_has_max_moment(cli):
    d = json.loads(cli("inspect", "fixtures/hand-optim-amsgrad.bpk", "--json").stdout)
    assert all("momentum.max_moment_2" in p["fields"] for p in d["params"])


def test_stats(cli):
    r = cli("inspect", "fixtures/hand-optim.bpk", "--stats", "--json")
    d = json.loads(r.stdout)
    import numpy as np

    truth = np.load(ROOT / "fixtures/hand-train-adam.npz")
    l1 = next(p for p in d["params"] if p["path"] == "l1.weight")
    s = l1["fields"]["momentum.moment_2"]["stats"]
    v = truth["l1.weight/moment_2"].astype(np.float64)
    assert s["min"] == pytest.approx(v.min()) and s["max"] == pytest.approx(v.max())
    assert s["rms"] == pytest.approx(np.sqrt((v * v).mean())) and s["nan"] == 0
    assert "field statistics" in cli("inspect", "fixtures/hand-optim.bpk", "--stats").stdout


MALFORMED = sorted((ROOT / "fixtures/malformed").glob("*.bpk"))


@pytest.mark.parametrize("path", MALFORMED, ids=lambda p: p.name)
def test_malformed_one_line_error(cli, path):
    r = cli("inspect", path)
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("statekit: error: ") and path.name in lines[0]


def test_debug_shows_traceback(cli):
    r = cli("inspect", "fixtures/malformed/bad-magic.bpk", env={"STATEKIT_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_usage_errors_keep_exit_2(cli):
    assert cli("inspect").returncode == 2
    assert cli("inspect", "fixtures/hand-optim.bpk", "--nope").returncode == 2


def test_missing_file(cli):
    r = cli("inspect", "does-not-exist.bpk")
    assert r.returncode == 1 and "does-not-exist.bpk" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("name", ["hand-optim.bpk", "hand-optim-019.bpk", "burn/mnist-model.bpk", "hand-scheduler.bpk"])
def test_convert_bpk_to_bpk_is_byte_identical(cli, tmp_path, name):
    src = ROOT / "fixtures" / name
    r = cli("convert", src, tmp_path / "out.bpk")
    assert r.returncode == 0, r.stderr
    assert hashlib.sha256((tmp_path / "out.bpk").read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()


def test_convert_dry_run_writes_nothing(cli, tmp_path):
    r = cli("convert", "fixtures/hand-optim.bpk", tmp_path / "out.bpk", "--dry-run")
    assert r.returncode == 0 and not (tmp_path / "out.bpk").exists()


def test_python_module_entry_point():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "statekit", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "inspect" in r.stdout


def test_help_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys; from statekit.cli import app; import statekit.io; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize("name", ["l1.weight", "18402649998147242804", "6j5mg0dcb1hvu", "6J5MG0DCB1HVU"])
def test_param_accepts_every_spelling(cli, name):
    d = json.loads(cli("inspect", "fixtures/hand-optim.bpk", "--param", name, "--json").stdout)
    assert [p["path"] for p in d["params"]] == ["l1.weight"]


def test_param_on_a_model_and_unknown_names(cli):
    d = json.loads(cli("inspect", "fixtures/burn/mnist-model.bpk", "-p", "e4gfnnsqgnlo6", "--json").stdout)
    assert [p["path"] for p in d["params"]] == ["conv1.conv.bias"]
    r = cli("inspect", "fixtures/hand-optim.bpk", "-p", "l3.weight")
    assert r.returncode == 1 and "'l3.weight'" in r.stderr


def test_stats_of_float64_state_near_its_range_neither_overflow_nor_warn():
    """Hand-computed: [1e300, -1e300, 3e300, nan] has mean 1e300 and RMS sqrt(11/3)·1e300."""
    import math
    import warnings

    import numpy as np

    from statekit.ops.inspect import tensor_stats
    from statekit.tensor import TensorRef

    ref = TensorRef.from_array(np.array([1e300, -1e300, 3e300, np.nan]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = tensor_stats(ref, block=2)  # the largest value arrives in the second block
    assert s["mean"] == pytest.approx(1e300) and s["rms"] == pytest.approx(np.sqrt(11 / 3) * 1e300)
    assert (s["min"], s["max"], s["nan"], s["inf"]) == (-1e300, 3e300, 1, 0)
    small = tensor_stats(TensorRef.from_array(np.array([1.0, 2.0, 2.0], dtype=np.float32)))
    assert (small["mean"], small["rms"]) == (5 / 3, math.sqrt(3))


@pytest.mark.parametrize("columns", [80, 50])
def test_inspect_lines_wrap_to_the_terminal_width(cli, tmp_path, columns):
    """Issue 21: the header (path · format · family · counts · size) was one 135-character line
    at 80 columns; group, note and warning lines too. Every line now fits, and nothing is lost:
    joined back, the words are the unwrapped output's (COLUMNS unset: 160+ columns)."""
    import shutil

    deep = tmp_path / "runs" / "experiment-2026-12-01" / "checkpoints" / "optimizer-epoch-0042"
    deep.mkdir(parents=True)
    for name in ("fixtures/hand-optim.bpk", "fixtures/torch/checkpoint.pt"):
        path = deep / name.rsplit("/", 1)[1]
        shutil.copy(ROOT / name, path)
        wide = cli("inspect", path, env={"COLUMNS": "400"})
        narrow = cli("inspect", path, env={"COLUMNS": str(columns)})
        assert wide.returncode == narrow.returncode == 0, narrow.stderr
        assert max(map(len, wide.stdout.splitlines())) > columns  # (the long lines this is about)
        lines = narrow.stdout.splitlines()
        assert max(map(len, lines)) <= columns, max(lines, key=len)
        text = [ln for ln in lines if not ln.startswith(("┏", "┃", "┡", "│", "└", "├"))]
        unwrapped = [ln for ln in wide.stdout.splitlines() if not ln.startswith(("┏", "┃", "┡", "│", "└", "├"))]
        assert "".join(text).replace(" ", "") == "".join(unwrapped).replace(" ", "")
        assert lines[0].startswith(str(path)[: columns - 4])


def test_stats_of_many_tensors_are_aligned_text_with_torchs_values(cli, tmp_path):
    """Above 500 rows --stats is aligned text, not a rich table (rich took ~1 ms a row: 10^6 views,
    a quarter of an hour); each row's values are torch's own."""
    torch = pytest.importorskip("torch")
    tensors = {f"t{i}": torch.arange(4, dtype=torch.float32) * (i - 300) for i in range(600)}
    torch.save(tensors, tmp_path / "many.pt")
    r = cli("inspect", tmp_path / "many.pt", "--stats")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    start = lines.index("field statistics")
    assert lines[start + 1].split() == ["path", "field", "min", "max", "mean", "rms", "nan", "inf"]
    rows = {ln.split()[0]: ln.split()[2:] for ln in lines[start + 3 : start + 603]}
    assert len(rows) == 600
    for name, t in tensors.items():
        want = [t.min().item(), t.max().item(), t.mean().item(), t.square().mean().sqrt().item()]
        assert [float(v) for v in rows[name][:4]] == pytest.approx(want, rel=1e-3, abs=1e-9), name
        assert rows[name][4:] == ["0", "0"]


def test_one_element_statistics_are_the_streamed_ones():
    """--stats of a one-element tensor skips numpy's per-call cost (10^6 views): the same numbers,
    bit for bit, as the streamed path, for every dtype and the edge values (±0, NaN, ±Inf, past
    2^500, subnormal, int64 beyond 2^53, bool)."""
    import math

    import numpy as np

    from statekit.ops import inspect as ops_inspect
    from statekit.tensor import TensorRef

    floats = [0.0, -0.0, 1.5, -3.25, math.nan, math.inf, -math.inf, 2.0**600, -(2.0**1000), 5e-324, 1e308]
    cases = [(np.float64, floats), (np.float32, floats[:7] + [3e38, 1e-45]), (np.float16, [0.0, -0.0, 65504.0, 6e-8]),
             (np.int64, [0, -1, 2**63 - 1, -(2**63), 2**53 + 1]), (np.int8, [-128, 127]), (np.uint64, [2**64 - 1]),
             (np.bool_, [True, False])]
    seen = 0
    for dtype, values in cases:
        for v in values:
            with np.errstate(over="ignore"):
                arr = np.array([v], dtype=dtype).reshape(())
            ref = TensorRef.from_array(arr)
            one, streamed = ops_inspect.tensor_stats(ref), ops_inspect._streamed_stats(ref, ops_inspect.BLOCK)
            assert one.keys() == streamed.keys()
            for k in one:
                a, b = one[k], streamed[k]
                assert (a is None and b is None) or (type(a) is type(b) and (a == b or a != a and b != b)
                                                     and math.copysign(1, a) == math.copysign(1, b)), (dtype, v, k, a, b)
            seen += 1
    assert seen > 25
