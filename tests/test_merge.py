"""statekit merge: split/merge round trip byte for byte, conflicts, first/last/mean, refusals, atomicity."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from statekit import io
from statekit.errors import MappingError, UsageError
from statekit.frameworks import burn
from statekit.ops.diff import diff_files
from statekit.ops.merge import merge_files

FIX = ROOT / "fixtures"
MIG = FIX / "migration"
HAND = FIX / "hand-optim.bpk"


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def split(src: Path, tmp_path: Path, groups: list[list[str]]) -> list[Path]:
    """Write each group of parameters of ``src`` to its own file with burn.save_optimizer."""
    out = []
    for i, paths in enumerate(groups):
        with io.open_checkpoint(src) as ckpt:
            state = ckpt.optimizer
            state.params = [p for p in state.params if p.path in paths]
            dst = tmp_path / f"part{i}.bpk"
            burn.save_optimizer(state, str(dst), metadata={})
        out.append(dst)
    return out


def arrays(path) -> dict:
    with io.open_checkpoint(path) as ckpt:
        return {(p.path, s): np.array(r.numpy()) for p in ckpt.optimizer.params for s, r in p.slots.items()} | {
            (p.path, "step"): p.step for p in ckpt.optimizer.params}


def test_split_then_merge_is_byte_identical(tmp_path):
    parts = split(HAND, tmp_path, [["l1.weight", "l1.bias"], ["l2.weight", "l2.bias"]])
    out = tmp_path / "merged.bpk"
    d = merge_files(parts, out)
    assert d["written"] and d["params"] == 4 and d["conflicts"] == [] and d["matched_by"] == "id"
    assert [i["taken"] for i in d["inputs"]] == [2, 2]
    assert sha(out) == sha(HAND)


def test_other_order_equal_field_by_field(tmp_path):
    parts = split(HAND, tmp_path, [["l2.bias"], ["l1.weight", "l2.weight"], ["l1.bias"]])
    out = tmp_path / "merged.bpk"
    merge_files(parts, out)
    assert sha(out) != sha(HAND)  # burn's data order follows the inputs
    assert diff_files(HAND, out)["equal"]


def test_conflict_refused_with_names(tmp_path):
    out = tmp_path / "m.bpk"
    with pytest.raises(MappingError) as err:
        merge_files([HAND, MIG / "optim-l2.bpk"], out)
    message = str(err.value)
    assert "2 parameters are in more than one input" in message
    assert "l2.weight" in message and "l2.bias" in message and "l1.weight" not in message
    assert "optim-l2.bpk" in message and "--on-conflict" in message
    assert not out.exists()


def test_first_and_last(tmp_path):
    first, last = tmp_path / "first.bpk", tmp_path / "last.bpk"
    d = merge_files([HAND, MIG / "optim-run2.bpk"], first, on_conflict="first")
    assert len(d["conflicts"]) == 4 and d["conflicts"][0]["resolution"].startswith("first")
    assert sha(first) == sha(HAND)
    merge_files([HAND, MIG / "optim-run2.bpk"], last, on_conflict="last")
    assert diff_files(last, MIG / "optim-run2.bpk")["equal"]


def test_mean_is_hand_computed_and_takes_largest_step(tmp_path):
    a_path, b_path = MIG / "optim-run2.bpk", MIG / "optim-steps.bpk"  # b: l2.* at step 5
    out = tmp_path / "mean.bpk"
    d = merge_files([a_path, b_path], out, on_conflict="mean")
    a, b, m = arrays(a_path), arrays(b_path), arrays(out)
    for (path, slot), value in m.items():
        if slot == "step":
            assert value == max(a[(path, slot)], b[(path, slot)]) == 21
            continue
        want = ((a[(path, slot)].astype(np.float64) + b[(path, slot)].astype(np.float64)) / 2).astype(np.float32)
        assert value.dtype == np.float32 and np.array_equal(value, want), (path, slot)
        np.testing.assert_allclose(value, (a[(path, slot)] + b[(path, slot)]) / np.float32(2), rtol=1e-6)
    l2 = next(c for c in d["conflicts"] if c["name"] == "l2.bias")
    assert l2["steps"] == [21, 5] and l2["step"] == 21 and l2["resolution"] == "mean"
    assert any("averaged elementwise" in n and "largest step" in n for n in d["notes"])


def test_mean_of_three_and_bf16(tmp_path):
    out = tmp_path / "three.bpk"
    merge_files([HAND, HAND, MIG / "optim-run2.bpk"], out, on_conflict="mean")
    a, b, m = arrays(HAND), arrays(MIG / "optim-run2.bpk"), arrays(out)
    key = ("l1.weight", "exp_avg")
    want = ((2 * a[key].astype(np.float64) + b[key].astype(np.float64)) / 3).astype(np.float32)
    assert np.array_equal(m[key], want)
    bf = FIX / "hand-optim-bf16.bpk"
    merge_files([bf, bf], tmp_path / "bf.bpk", on_conflict="mean")
    assert diff_files(bf, tmp_path / "bf.bpk")["equal"]


def test_mean_refuses_shape_mismatch_and_leaves_nothing(tmp_path):
    out = tmp_path / "m.bpk"
    with pytest.raises(MappingError, match=r"cannot average l1\.weight"):
        merge_files([HAND, MIG / "optim-transposed.bpk"], out, on_conflict="mean")
    assert os.listdir(tmp_path) == []


def test_refusals(tmp_path):
    out = tmp_path / "m.bpk"
    with pytest.raises(MappingError) as err:
        merge_files([HAND, FIX / "hand-optim-sgd.bpk"], out)
    assert "adam" in str(err.value) and "sgd" in str(err.value)
    assert "hand-optim.bpk" in str(err.value) and "hand-optim-sgd.bpk" in str(err.value)
    with pytest.raises(MappingError, match="not optimizer state"):
        merge_files([HAND, FIX / "hand-model.bpk"], out)
    with pytest.raises(UsageError):
        merge_files([HAND], out)
    with pytest.raises(UsageError):
        merge_files([HAND, MIG / "optim-l1.bpk"], tmp_path / "m.unknown")
    with pytest.raises(UsageError):
        merge_files([HAND, MIG / "optim-l1.bpk"], out, on_conflict="max")
    assert os.listdir(tmp_path) == []


def test_output_may_not_be_an_input(tmp_path):
    a = tmp_path / "a.bpk"
    a.write_bytes(HAND.read_bytes())
    with pytest.raises(UsageError, match="also an input"):
        merge_files([a, MIG / "optim-run2.bpk"], a, on_conflict="mean")
    assert sha(a) == sha(HAND)


def test_dry_run_writes_nothing(tmp_path):
    out = tmp_path / "m.bpk"
    d = merge_files([HAND, MIG / "optim-run2.bpk"], out, on_conflict="mean", dry_run=True)
    assert not d["written"] and len(d["conflicts"]) == 4 and not out.exists()


def test_empty_input_is_fine(tmp_path):
    out = tmp_path / "m.bpk"
    merge_files([FIX / "empty-optim.bpk", HAND], out)
    assert sha(out) == sha(HAND)


# ----------------------------------------------------------------------------- CLI (fresh processes)


def test_cli_merge(cli, tmp_path):
    before = {p: sha(p) for p in (MIG / "optim-l1.bpk", MIG / "optim-l2.bpk")}
    out = tmp_path / "m.bpk"
    r = cli("merge", MIG / "optim-l1.bpk", MIG / "optim-l2.bpk", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "4 parameters from 2 inputs" in r.stdout
    assert sha(out) == sha(HAND) and {p: sha(p) for p in before} == before
    r = cli("merge", HAND, MIG / "optim-l1.bpk", "-o", tmp_path / "c.bpk")
    assert r.returncode == 1 and not (tmp_path / "c.bpk").exists()
    line = r.stderr.strip()
    assert line.startswith("statekit: error: 2 parameters are in more than one input") and "l1.bias" in line
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli("merge", HAND, MIG / "optim-run2.bpk", "-o", tmp_path / "mean.bpk", "--on-conflict", "mean", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["written"] and d["on_conflict"] == "mean" and len(d["conflicts"]) == 4
    r = cli("merge", HAND, MIG / "optim-run2.bpk", "-o", tmp_path / "dry.bpk", "--on-conflict", "first", "--dry-run")
    assert r.returncode == 0 and "would write" in r.stdout and not (tmp_path / "dry.bpk").exists()
    assert cli("merge", HAND, HAND, "-o", tmp_path / "x.bpk", "--on-conflict", "max").returncode == 2
    assert cli("merge", HAND, HAND).returncode == 2  # -o is required


def test_merge_writes_the_inputs_framework(tmp_path):
    from statekit.errors import StatekitError

    with pytest.raises(StatekitError):  # burn state into a .pt: convert's job, not merge's
        merge_files([HAND, MIG / "optim-run2.bpk"], tmp_path / "m.pt", on_conflict="mean")
    assert os.listdir(tmp_path) == []


@pytest.mark.torch
def test_torch_inputs(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("statekit.frameworks.torch_io")
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(opt.state_dict(), a)
    want = opt.state_dict()["state"][0]["exp_avg"].numpy().copy()
    sd = opt.state_dict()
    sd["state"][0] = {**sd["state"][0], "exp_avg": sd["state"][0]["exp_avg"] * 3}  # (a dict of the live state)
    torch.save(sd, b)
    d = merge_files([a, b], tmp_path / "mean.pt", on_conflict="mean")
    assert d["matched_by"] == "index" and len(d["conflicts"]) == 2
    with io.open_checkpoint(tmp_path / "mean.pt") as ckpt:
        got = np.array(ckpt.optimizer.find("#0").slots["exp_avg"].numpy())
    np.testing.assert_array_equal(got, ((want.astype(np.float64) * 4) / 2).astype(np.float32))
    with pytest.raises(MappingError, match="cannot merge torch state"):
        merge_files([a, HAND], tmp_path / "x.bpk")
