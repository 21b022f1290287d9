"""Every burn 0.22 optimizer's record is recognised from its exact fields and scalars, per
parameter: family (or the stated ambiguity), shapes, dtypes and steps from the tensors, several
families in one record (burn's optimizer groups), L-BFGS's global state.

The records under ``fixtures/burn-optim/`` are written by ``scripts/make_burn_optim_fixtures.py``
in the layouts of ``shared/docs/optimizers-burn-torch.md`` §1 (their values are checked against
the transcriptions of burn's source in ``tests/test_burn_optimizers.py``). The expectations
below are facts of those layouts and of the model (burn's MLP 4 → 16 → 1, 7 steps).
"""

import json

import pytest
from conftest import ROOT

from statekit import api
from statekit.errors import UsageError
from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack
from statekit.io import open_checkpoint
from statekit.ops.build import resolve_families
from statekit.tensor import TensorRef

FIX = ROOT / "fixtures" / "burn-optim"
#: the same folder relative to the checkout (the cli fixture runs there): a table's header starts with
#: the path given, so a table read for text is of a short path that cannot wrap it wherever the checkout is
REL = "fixtures/burn-optim"
SHAPES = {"l1.weight": [4, 16], "l1.bias": [16], "l2.weight": [16, 1], "l2.bias": [1]}
STEPS = 7

# record file → (family, candidates, {path: (fields, step)}) — field names from burn's state structs
KINDS = {
    "adafactor.bpk": ("adafactor", [], {
        "l1.weight": ({"second_moment": [4, 1], "column_second_moment": [1, 16]}, STEPS),
        "l1.bias": ({"second_moment": [16]}, STEPS),
        "l2.weight": ({"second_moment": [16, 1], "column_second_moment": [1, 1]}, STEPS),
        "l2.bias": ({"second_moment": [1]}, STEPS)}),
    "lamb.bpk": ("lamb", [], {p: ({"moment_1": s, "moment_2": s}, STEPS) for p, s in SHAPES.items()}),
    "lion.bpk": ("lion", [], {p: ({"momentum": s}, None) for p, s in SHAPES.items()}),
    "adan.bpk": ("adan", [], {p: ({f"momentum.{f}": s for f in ("exp_avg", "exp_avg_sq", "exp_avg_diff",
                                                                  "neg_pre_grad")}, STEPS)
                              for p, s in SHAPES.items()}),
    "muon.bpk": ("sgd", ["sgd", "muon"], {p: ({"momentum.velocity": SHAPES[p]}, None)
                                          for p in ("l1.weight", "l2.weight")}),
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_record_kind_inspects_with_family_shapes_dtypes_steps(cli, name):
    family, candidates, params = KINDS[name]
    r = cli("inspect", str(FIX / name), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["kind"], d["family"], d["family_candidates"]) == ("optimizer", family, candidates or [family])
    assert {p["path"] for p in d["params"]} == set(params)
    for p in d["params"]:
        fields, step = params[p["path"]]
        assert (p["shape"], p["dtype"], p["step"], p["family"]) == (SHAPES[p["path"]], "F32", step, family)
        assert {k: v["shape"] for k, v in p["fields"].items()} == fields
        assert all(v["dtype"] == "F32" for v in p["fields"].values())
    table = cli("inspect", f"{REL}/{name}").stdout
    assert f"optimizer ({'/'.join(candidates) or family})" in table
    header, *rows = cli("inspect", str(FIX / name), "--format", "tsv").stdout.splitlines()
    cols = header.split("\t")
    for row in rows:
        cells = dict(zip(cols, row.split("\t"), strict=True))
        assert cells["shape"] == "×".join(map(str, SHAPES[cells["path"]])) and cells["dtype"] == "F32"
        assert cells["step"] == (str(STEPS) if params[cells["path"]][1] else "-")


def test_old_fixtures_keep_their_families(cli):
    """The Adam family, SGD, RMSProp and AdaGrad records read as before (the rest of burn's 11)."""
    for name, family, candidates in (("hand-optim.bpk", "adam", ["adam", "adamw"]),
                                     ("hand-optim-sgd.bpk", "sgd", ["sgd", "muon"]),
                                     ("hand-optim-rmsprop.bpk", "rmsprop", ["rmsprop"]),
                                     ("hand-optim-adagrad.bpk", "adagrad", ["adagrad"])):
        d = json.loads(cli("inspect", f"fixtures/{name}", "--json").stdout)
        assert (d["family"], d["family_candidates"]) == (family, candidates), name
        assert len(d["groups"]) == 1


def test_muon_adamw_record_shows_both_families_per_row_and_group(cli):
    d = json.loads(cli("inspect", str(FIX / "muon-adamw.bpk"), "--json").stdout)
    assert d["family"] == "mixed"
    assert [(g["family"], g["family_candidates"], g["params"]) for g in d["groups"]] == [
        ("sgd", ["sgd", "muon"], 2), ("adam", ["adam", "adamw"], 2)]
    rows = {p["path"]: p for p in d["params"]}
    for path in ("l1.weight", "l2.weight"):
        assert (rows[path]["family"], rows[path]["family_candidates"], rows[path]["step"]) == ("sgd", ["sgd", "muon"], None)
        assert list(rows[path]["fields"]) == ["momentum.velocity"]
    for path in ("l1.bias", "l2.bias"):
        assert (rows[path]["family"], rows[path]["family_candidates"], rows[path]["step"]) == (
            "adam", ["adam", "adamw"], STEPS)
    assert {p["path"]: p["shape"] for p in d["params"]} == SHAPES
    assert {p["path"]: p["group"] for p in d["params"]} == {"l1.weight": 0, "l2.weight": 0, "l1.bias": 1, "l2.bias": 1}

    table = cli("inspect", f"{REL}/muon-adamw.bpk").stdout
    assert "optimizer (mixed: sgd/muon + adam/adamw)" in table
    assert "group 0 (2 params): sgd/muon" in table and "group 1 (2 params): adam/adamw" in table
    assert "muon holds only 2-D parameters" in table
    header, *lines = cli("inspect", str(FIX / "muon-adamw.bpk"), "--format", "tsv").stdout.splitlines()
    cols = header.split("\t")
    assert "family" in cols
    fams = {c["path"]: c["family"] for c in (dict(zip(cols, ln.split("\t"), strict=True)) for ln in lines)}
    assert fams == {"l1.weight": "sgd/muon", "l2.weight": "sgd/muon", "l1.bias": "adam/adamw", "l2.bias": "adam/adamw"}


def test_one_family_records_have_no_family_column(cli):
    header = cli("inspect", str(FIX / "lamb.bpk"), "--format", "tsv").stdout.splitlines()[0]
    assert "family" not in header.split("\t")


def test_optimizer_settles_the_ambiguous_part_only():
    ckpt = open_checkpoint(str(FIX / "muon-adamw.bpk"))
    state = resolve_families(ckpt.optimizer, "muon")
    by_path = {p.path: p for p in state.params}
    assert [by_path[p].family for p in ("l1.weight", "l2.weight")] == ["muon", "muon"]
    assert [by_path[p].family_label for p in ("l1.bias", "l2.bias")] == ["adam/adamw", "adam/adamw"]
    assert state.family == "mixed"
    assert [(g.family_label, len(g.keys)) for g in state.groups] == [("muon", 2), ("adam/adamw", 2)]

    state = resolve_families(open_checkpoint(str(FIX / "muon-adamw.bpk")).optimizer, "muon,adamw")
    assert [g.family_label for g in state.groups] == ["muon", "adamw"]
    assert {p.path: p.family for p in state.params} == {"l1.weight": "muon", "l2.weight": "muon",
                                                        "l1.bias": "adamw", "l2.bias": "adamw"}


def test_muon_never_settles_a_vector():
    """burn's Muon takes only 2-D parameters: on an SGD-momentum record with biases, --optimizer
    muon makes the matrices Muon and leaves the biases SGD."""
    state = open_checkpoint(str(ROOT / "fixtures" / "hand-optim-sgd.bpk")).optimizer
    assert (state.family, state.candidates) == ("sgd", ("sgd", "muon"))
    state.resolved("muon")
    assert {p.path: p.family for p in state.params} == {"l1.weight": "muon", "l2.weight": "muon",
                                                        "l1.bias": "sgd", "l2.bias": "sgd"}
    assert state.family == "mixed"
    state = open_checkpoint(str(ROOT / "fixtures" / "hand-optim-sgd.bpk")).optimizer.resolved("sgd")
    assert (state.family, state.candidates) == ("sgd", ("sgd",))


def test_a_family_no_part_fits_is_refused():
    state = open_checkpoint(str(FIX / "muon-adamw.bpk")).optimizer
    with pytest.raises(UsageError, match="no parameter's state can be lion"):
        resolve_families(state, "lion")


def test_convert_of_the_mixed_record_says_what_it_holds(cli, tmp_path):
    r = cli("convert", str(FIX / "muon-adamw.bpk"), str(tmp_path / "x.pt"), "--optimizer", "muon")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "muon + adam/adamw" in r.stderr  # the ambiguous part settled, the other still open
    assert not (tmp_path / "x.pt").exists()


def test_lbfgs_global_state_shown(cli):
    d = json.loads(cli("inspect", str(FIX / "lbfgs.bpk"), "--json").stdout)
    assert (d["family"], d["params"]) == ("lbfgs", [])
    g = d["global"]
    n = sum(s[0] for s in [[4 * 16], [16], [16], [1]])  # every parameter, flattened
    n_pairs = g["scalars"]["history_s.len"]
    assert n_pairs == g["scalars"]["history_y.len"] >= 1
    assert set(g["tensors"]) == ({f"history_s.{i}" for i in range(n_pairs)} | {f"history_y.{i}" for i in range(n_pairs)}
                                 | {"d", "prev_flat_grad"})
    assert all(t == {"shape": [n], "dtype": "F32"} for t in g["tensors"].values())
    assert set(g["scalars"]) == {"history_s.len", "history_y.len", "t", "prev_loss", "g_iter"}
    table = cli("inspect", f"{REL}/lbfgs.bpk").stdout
    assert f"history_s ({n_pairs} vectors)" in table and "prev_flat_grad" in table and "g_iter=" in table


def _record(path, tensors, scalars, meta=None):
    write_burnpack(str(path), tensors, meta or {}, scalars)
    return str(path)


def test_unknown_layout_still_shows_shape_and_dtype(tmp_path):
    pid = 12345
    path = _record(tmp_path / "odd.bpk",
                   [PackTensor(f"{pid}.mystery", TensorRef.from_array(__import__("numpy").zeros((3, 5), "float32")),
                               param_id=pid)],
                   {f"{pid}.__rank": Scalar("UInt", 2)}, {str(pid): "w"})
    d = api.inspect(path)
    (p,) = d["params"]
    assert (p["shape"], p["dtype"]) == ([3, 5], "F32") and p["family"].startswith("unknown")
    assert d["family"].startswith("unknown") and any("does not recognise" in n for n in d["notes"])


def test_adafactor_factors_that_do_not_fit_are_not_called_adafactor(tmp_path):
    import numpy as np

    pid = 7
    bad = [PackTensor(f"{pid}.second_moment", TensorRef.from_array(np.ones((4, 2), "float32")), param_id=pid),
           PackTensor(f"{pid}.column_second_moment", TensorRef.from_array(np.ones((1, 3), "float32")), param_id=pid)]
    path = _record(tmp_path / "bad.bpk", bad, {f"{pid}.__rank": Scalar("UInt", 2), f"{pid}.time": Scalar("UInt", 2)})
    d = api.inspect(path)
    assert d["family"].startswith("unknown") and d["params"][0]["family"].startswith("unknown")
    assert any("do not fit" in n for n in d["notes"])
    # a matrix's Adafactor state without its column factor: burn's step would panic on it
    path = _record(tmp_path / "half.bpk", bad[:1], {f"{pid}.__rank": Scalar("UInt", 2), f"{pid}.time": Scalar("UInt", 2)})
    d = api.inspect(path)
    assert d["family"].startswith("unknown") and any("without column_second_moment" in n for n in d["notes"])


def test_burn_to_burn_copy_of_the_mixed_record_is_exact(tmp_path):
    """Nothing to decide within burn: the record is copied as burn wrote it."""
    api.convert(str(FIX / "muon-adamw.bpk"), str(tmp_path / "y.bpk"))
    assert (tmp_path / "y.bpk").read_bytes() == (FIX / "muon-adamw.bpk").read_bytes()


def test_burn_muon_and_adafactor_do_not_cross_to_torch_unchanged(cli, tmp_path):
    """Same algorithm, different stored quantity: copying burn's velocity into torch's momentum_buffer
    (an EMA, (1 - μ) times it) or burn's second moments (ε₁ inside) would be silently wrong; the
    conversion applies the transform (statekit.ops.crossing) and shows it in the plan."""
    import numpy as np

    from statekit.formats.burnpack import BurnpackFile

    torch = pytest.importorskip("torch")

    names = tmp_path / "n.txt"
    names.write_text("l1.weight\nl2.weight\n")
    r = cli("convert", str(FIX / "muon.bpk"), str(tmp_path / "m.pt"), "--optimizer", "muon", "--names", str(names),
            "--transpose", "*.weight", "--lr", "0.01")
    assert r.returncode == 0 and "(1 − μ) · velocity" in r.stdout, r.stderr
    f = BurnpackFile(str(FIX / "muon.bpk"))
    ids = {f.metadata[n.partition(".")[0]]: n.partition(".")[0] for n in f.tensors}
    velocity = f.tensor(f"{ids['l1.weight']}.momentum.velocity").numpy()
    buffer = torch.load(tmp_path / "m.pt", weights_only=True)["state"][0]["momentum_buffer"].numpy()
    np.testing.assert_array_equal(buffer, velocity.T * np.float32(1 - 0.95))
    r = cli("convert", str(FIX / "adafactor.bpk"), str(tmp_path / "a.pt"), "--names", str(FIX.parent / "hand-names.txt"),
            "--transpose", "*.weight")
    assert r.returncode == 0 and "second_moment − ε₁" in r.stdout, r.stderr


def test_verify_resume_of_the_muon_adamw_record_steps_each_group_in_its_optimizer(cli, tmp_path):
    import numpy as np

    copy = tmp_path / "copy.bpk"
    copy.write_bytes((FIX / "muon-adamw.bpk").read_bytes())
    r = cli("verify-resume", str(FIX / "muon-adamw.bpk"), str(copy), "--lr", "0.01", "--optimizer", "muon,adamw",
            "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert d["optimizer"] == "muon + adamw" and d["criterion"] == "bit-exact"
    assert {p["path"]: p["optimizer"] for p in d["params"]} == {"l1.weight": "muon", "l2.weight": "muon",
                                                                "l1.bias": "adamw", "l2.bias": "adamw"}
    # the adamw part still open: said, not guessed
    r = cli("verify-resume", str(FIX / "muon-adamw.bpk"), str(copy), "--lr", "0.01", "--optimizer", "muon")
    assert r.returncode == 2 and "still open: adam/adamw" in r.stderr
    # l1.bias's two moments swapped (same shape): caught
    ckpt = open_checkpoint(str(FIX / "muon-adamw.bpk"))
    pack = ckpt.container
    tensors = []
    for name in pack.data_order:
        src = name
        if name.endswith(".momentum.moment_1") and pack.metadata.get(name.split(".")[0]) == "l1.bias":
            src = name.replace("moment_1", "moment_2")
        elif name.endswith(".momentum.moment_2") and pack.metadata.get(name.split(".")[0]) == "l1.bias":
            src = name.replace("moment_2", "moment_1")
        e = pack.tensors[src]
        tensors.append(PackTensor(name, TensorRef.from_array(np.ascontiguousarray(pack.tensor(src).numpy())),
                                  param_id=e.param_id))
    write_burnpack(str(tmp_path / "swapped.bpk"), tensors, dict(pack.metadata), dict(pack.scalars))
    r = cli("verify-resume", str(FIX / "muon-adamw.bpk"), str(tmp_path / "swapped.bpk"), "--lr", "0.01",
            "--optimizer", "muon,adamw", "--json")
    assert r.returncode == 1
    bad = {p["path"] for p in json.loads(r.stdout)["params"] if not p["tracks"]}
    assert bad == {"l1.bias"}
