"""Writing DeepSpeed's universal checkpoint layout, checked file by file against ``ds_to_universal``.

The references are DeepSpeed 0.19.8's own ``ds_to_universal`` output committed under
``fixtures/deepspeed/stage{2,3}/universal`` (``scripts/make_deepspeed_fixtures.py``): statekit
converts the same run's ZeRO shards to the universal layout and every tensor file must hold the
same values, shapes, dtypes and ``cat_dim``.
"""

from __future__ import annotations

import os

import pytest

from statekit.formats import deepspeed
from tests.conftest import FIXTURES

torch = pytest.importorskip("torch")

DS = FIXTURES / "deepspeed"
SLOTS = ("fp32", "exp_avg", "exp_avg_sq")


def _params(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder / "zero") if (folder / "zero" / n).is_dir())


def _assert_same_universal(ours, theirs, *, flat_reference: bool = False) -> None:
    assert _params(ours) == _params(theirs)
    for name in _params(theirs):
        for slot in SLOTS:
            got = torch.load(ours / "zero" / name / f"{slot}.pt", weights_only=True)
            want = torch.load(theirs / "zero" / name / f"{slot}.pt", weights_only=True)
            assert set(got) == {"param", "cat_dim"} and got["cat_dim"] == 0, (name, slot, got.keys())
            if flat_reference:  # ds_to_universal of ZeRO-3 saves the bare tensor, flat
                assert torch.equal(got["param"].flatten(), want), (name, slot)
            else:
                assert got["cat_dim"] == want["cat_dim"] and set(got) == set(want)
                assert got["param"].dtype == want["param"].dtype and got["param"].shape == want["param"].shape
                assert torch.equal(got["param"], want["param"]), (name, slot)
        got_step = torch.load(ours / "zero" / name / "step.pt", weights_only=True)
        assert got_step.dtype == torch.float32 and got_step.shape == () and got_step.item() == 3
        if not flat_reference:
            want_step = torch.load(theirs / "zero" / name / "step.pt", weights_only=True)
            assert torch.equal(got_step, want_step)
    got_opt = torch.load(ours / "zero" / "optimizer_state.pt", weights_only=True)
    want_opt = deepspeed.load(str(theirs / "zero" / "optimizer_state.pt"))  # holds DeepSpeed classes
    assert got_opt["param_groups"] == want_opt["param_groups"]
    assert got_opt["ds_version"] == want_opt.get("ds_version", "0.19.8")
    module = torch.load(ours / "mp_rank_00_model_states.pt", weights_only=True)
    for name in _params(theirs):
        fp32 = torch.load(theirs / "zero" / name / "fp32.pt", weights_only=True)
        fp32 = fp32["param"] if isinstance(fp32, dict) else fp32
        assert torch.equal(module["module"][name].flatten(), fp32.flatten())
    assert module["global_steps"] == 3 and module["skipped_steps"] == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_shards_to_universal_equal_ds_to_universal(tmp_path, cli, stage):
    r = cli("convert", DS / f"stage{stage}", tmp_path / "universal", "--to", "deepspeed-universal")
    assert r.returncode == 0, r.stderr
    _assert_same_universal(tmp_path / "universal", DS / f"stage{stage}" / "universal", flat_reference=stage == 3)
    assert (tmp_path / "latest_universal").read_text() == "universal"  # as ds_to_universal writes it


def test_universal_to_pt_and_back(tmp_path, cli):
    """universal → .pt (optimizer state only) → universal again, the weights from --model."""
    src = DS / "stage2" / "universal"
    assert cli("convert", src, tmp_path / "opt.pt").returncode == 0
    weights = deepspeed.load(str(src / "mp_rank_00_model_states.pt"))["module"]
    torch.save({k: torch.from_numpy(v.numpy().copy()) for k, v in weights.items()}, tmp_path / "model.pt")
    r = cli("convert", tmp_path / "opt.pt", tmp_path / "again", "--to", "deepspeed-universal",
            "--model", tmp_path / "model.pt")
    assert r.returncode == 0, r.stderr
    _assert_same_universal(tmp_path / "again", src)


def test_no_weights_is_refused_by_name(tmp_path, cli):
    assert cli("convert", DS / "stage2" / "universal", tmp_path / "opt.pt").returncode == 0
    r = cli("convert", tmp_path / "opt.pt", tmp_path / "out", "--to", "deepspeed-universal")
    assert r.returncode == 1
    assert "embed.weight: no fp32 master weight" in r.stderr and "--model" in r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "latest_universal").exists()


def test_non_adam_state_is_refused(tmp_path, cli):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "sgd.pt")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    r = cli("convert", tmp_path / "sgd.pt", tmp_path / "out", "--to", "deepspeed-universal", "--model",
            tmp_path / "model.pt")
    assert r.returncode == 1 and "holds Adam/AdamW state" in r.stderr and "sgd" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
