"""DeepSpeed ZeRO 1/2/3 and universal checkpoints, read without DeepSpeed or torch.

fixtures/deepspeed/ is written by real DeepSpeed 0.19.8 on CPU (scripts/make_deepspeed_fixtures.py:
gloo, world size 2, AdamW, 3 steps per stage). The expected values are DeepSpeed's own:
``zero_to_fp32`` (master weights) and ``ds_to_universal`` (per-parameter moments and step),
saved by that script as stage{N}-reference.pt.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from statekit import io
from statekit.errors import FormatError, UnsafePickleError
from statekit.formats import deepspeed
from tests.conftest import FIXTURES

DS = FIXTURES / "deepspeed"
torch = pytest.importorskip("torch")


def _reference(stage):
    return torch.load(DS / f"stage{stage}-reference.pt", weights_only=False)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("where", ["root", "tag", "universal"])
def test_consolidated_state_equals_deepspeeds_own(stage, where):
    path = {"root": DS / f"stage{stage}", "tag": DS / f"stage{stage}" / "step3",
            "universal": DS / f"stage{stage}" / "universal"}[where]
    ref = _reference(stage)
    with io.open_checkpoint(path) as ckpt:
        assert ckpt.format == "deepspeed" and ckpt.optimizer.family == "adamw"
        names = [p.path for p in ckpt.optimizer.params]
        assert names == list(ref["fp32"])
        for p in ckpt.optimizer.params:
            moments = ref["universal"][p.path]
            for slot in ("exp_avg", "exp_avg_sq"):  # ds_to_universal of ZeRO-3 saves bare tensors
                want = moments[slot]["param"] if isinstance(moments[slot], dict) else moments[slot]
                ours = p.slots[slot].numpy()  # (ZeRO-3's universal moments are flat: same values in order)
                assert ours.size == want.numel() and np.array_equal(ours.reshape(-1), want.numpy().reshape(-1))
            if "step" in moments:
                assert p.step == moments["step"].item()
            if where != "universal" or stage != 3:  # the script ran 3 steps
                assert p.step == 3
        for m in ckpt.model.params:
            assert np.array_equal(m.tensor.numpy(), ref["fp32"][m.path].detach().numpy()), m.path
        assert ckpt.optimizer.groups[0].hyperparams["weight_decay"] == 0.1


def test_deepspeed_classes_are_allowed_only_for_deepspeed_files():
    shard = DS / "stage2" / "step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    from statekit.formats import torch_pt

    with pytest.raises(UnsafePickleError, match="deepspeed"):
        torch_pt.load_pt(shard)
    obj = deepspeed.load(str(shard))
    mapping = obj["optimizer_state_dict"]["param_slice_mappings"][0]["embed.weight"]
    assert mapping.kind == "fragment_address" and mapping["numel"] == 60


def test_a_missing_rank_is_refused(tmp_path):
    shutil.copytree(DS / "stage2", tmp_path / "ck")
    (tmp_path / "ck" / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(FormatError):
        io.open_checkpoint(tmp_path / "ck")


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_dcp_to_pt_keeps_every_value(tmp_path, cli, stage):
    """Resharding: ZeRO at world size 2 → DCP in 3 files → a single .pt, values intact."""
    r = cli("convert", DS / f"stage{stage}", tmp_path / "dcp", "--shards", "3")
    assert r.returncode == 0, r.stderr
    r = cli("convert", tmp_path / "dcp", tmp_path / "one.pt")
    assert r.returncode == 0, r.stderr
    osd = torch.load(tmp_path / "one.pt", weights_only=True)["optimizer"]
    reference = _reference(stage)
    ref = reference["universal"]
    for name, entry in osd["state"].items():
        want = ref[name]["exp_avg_sq"]
        want = want["param"] if isinstance(want, dict) else want.view(entry["exp_avg_sq"].shape)  # ZeRO-3: flat
        assert torch.equal(entry["exp_avg_sq"], want)
        assert entry["step"].item() == 3
    assert [n for g in osd["param_groups"] for n in g["params"]] == list(reference["fp32"])
