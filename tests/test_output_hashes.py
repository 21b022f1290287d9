"""Every output statekit writes from the committed fixtures is byte-identical to the reference.

``tests/data/output-sha256.json`` holds the sha256 of each output as written before the data path
was made to stream (``scripts/capture_output_hashes.py``, run on that commit); the outputs
themselves were validated against real torch and burn by the tests that load them. Streaming,
piece sizes and ``--jobs`` must not change a byte.
"""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TABLE = json.loads((ROOT / "tests/data/output-sha256.json").read_text())
_spec = importlib.util.spec_from_file_location("capture", ROOT / "scripts/capture_output_hashes.py")
capture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capture)


def test_table_covers_every_writer():
    ops = {(v["case"]["op"], v["case"].get("target")) for v in TABLE.values()}
    assert {("convert", t) for t in ("bpk", "pt", "safetensors", "candle")} <= ops
    assert {("remap", "bpk"), ("merge", None)} <= ops
    assert len(TABLE) > 500


@pytest.mark.parametrize("name", sorted(TABLE))
def test_output_unchanged(tmp_path, name):
    assert capture.run_case(TABLE[name]["case"], str(tmp_path)) == TABLE[name]["sha256"]


@pytest.mark.slow
def test_outputs_unchanged_with_small_pieces_and_jobs(tmp_path, monkeypatch):
    """4 KiB pieces (every tensor split, every transpose in bands) and 3 threads for any size."""
    from statekit import stream, tensor

    monkeypatch.setattr(tensor, "PIECE", 4096)
    monkeypatch.setattr(stream, "CONCURRENT_MIN", 0)
    with stream.using_jobs(3):
        wrong = [name for name, item in TABLE.items() if capture.run_case(item["case"], str(tmp_path)) != item["sha256"]]
    assert wrong == []
