"""Megatron-Bridge 0.6.2 torch_dist folder (fixture written by Bridge's own pretrain + save_checkpoint)."""

import os
import shutil

import pytest

pytest.importorskip("yaml")

from statekit.errors import FormatError  # noqa: E402
from statekit.frameworks.megatron import dist  # noqa: E402

HERE = os.path.dirname(__file__)
FIX = os.path.join(HERE, "..", "fixtures", "megatron_bridge", "0.6.2", "bridge_gpt_torch_dist_dp_reshardable_dp2")


def _notes(path):
    return " ".join(dist.open_checkpoint(path).optimizer.notes)


def test_every_parameter_named_and_proved():
    notes = _notes(FIX)
    assert "proved: 15 of 15 parameters, 62272 elements" in notes  # 2 layers, h 64, ffn 64 swiglu, vocab 100


def test_no_run_config_refuses(tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(FIX, copy)
    os.remove(copy / "iter_0000003" / "run_config.yaml")
    with pytest.raises(FormatError, match="no args in the common state"):
        dist.open_checkpoint(str(copy))


def test_missing_field_named(tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(FIX, copy)
    cfg = copy / "iter_0000003" / "run_config.yaml"
    text = cfg.read_text().replace("  gated_linear_unit: true\n", "")
    cfg.write_text(text)
    with pytest.raises(FormatError, match="model.gated_linear_unit is missing"):
        dist.open_checkpoint(str(copy))
