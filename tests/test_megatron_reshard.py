"""Megatron legacy checkpoints resharded (frameworks/megatron/shard.py, write_legacy.py,
``statekit convert … --to megatron-legacy``).

References: the rank files megatron-core 0.19.2 itself wrote (fixtures/megatron/0.19.2/), and
megatron-core 0.19.2's own load of statekit-written folders (fixtures/megatron_load_legacy/
result.json, written by scripts/check_megatron_load_legacy.py: what Megatron re-saved right after
loading, digest by digest).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statekit.errors import StatekitError
from statekit.formats import megatron_legacy as container
from statekit.formats.torch_pickle import Record
from statekit.frameworks.megatron import config, legacy, shard, write_legacy
from statekit.tensor import TensorRef
from tests.conftest import MCORE_PY

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "megatron" / "0.19.2"
TP2PP2 = FIX / "gpt_torch_distopt_tp2pp2dp1"
NO_DISTOPT = FIX / "gpt_torch_no_distopt_tp1pp1dp2"
MOE = FIX / "moe_torch_distopt_ep2dp2"
RESULT = ROOT / "fixtures" / "megatron_load_legacy" / "result.json"


# ------------------------------------------------------------------------- shard ∘ join = id

NAMES = {  # name → the reader's TP axis (legacy.TP_AXES), the fact under test
    "decoder.layers.0.self_attention.linear_qkv.weight": 0,
    "decoder.layers.0.mlp.linear_fc1.weight": 0,
    "embedding.word_embeddings.weight": 0,
    "decoder.layers.3.self_attention.linear_proj.weight": 1,
    "decoder.layers.1.mlp.linear_fc2.weight": 1,
    "decoder.layers.0.input_layernorm.weight": None,
    "decoder.layers.0.mlp.router.weight": None,
}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(NAMES)), tp=st.sampled_from([1, 2, 4]), swiglu=st.booleans(),
       rows=st.integers(1, 3), cols=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_shard_then_join_is_identity(name, tp, swiglu, rows, cols, seed):
    axis = NAMES[name]
    swiglu = swiglu and "linear_fc1" in name
    shape = [rows * tp * (2 if swiglu else 1), cols * tp]
    if axis is None:
        shape = [rows * 4]
    whole = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    parts = [shard.tp_shard(whole, name, tp, r, swiglu) for r in range(tp)]
    if axis is not None and tp > 1:
        assert all(p.shape[axis] == whole.shape[axis] // tp for p in parts)
    if swiglu and tp > 1:  # rank r holds [W_r; V_r]: gate rows then up rows (hand-cut)
        half, part = shape[0] // 2, shape[0] // 2 // tp
        assert np.array_equal(parts[1][:part], whole[part:2 * part])
        assert np.array_equal(parts[1][part:], whole[half + part:half + 2 * part])
    joined = legacy.joined([TensorRef.from_array(p) for p in parts], axis, swiglu).numpy()
    assert np.array_equal(joined, whole)


def test_unknown_tp_axis_is_refused():
    with pytest.raises(StatekitError, match="knows no TP axis"):
        shard.tp_shard(np.zeros((4, 4), np.float32), "decoder.layers.0.mystery.weight", 2, 0)


def test_places_follow_uniform_stages_and_expert_blocks():
    cfg = config.from_args({"num_experts": 8, "num_layers": 4})
    p = shard.place("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", cfg, 4, 2, 4)
    assert (p.pp, p.ep, p.local) == (1, 2, "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight")
    assert shard.place("output_layer.weight", cfg, 4, 2, 1).pp == 1
    assert shard.place("embedding.word_embeddings.weight", cfg, 4, 2, 1).pp == 0
    assert config.padded_vocab(100, 16, 2) == 128 and config.padded_vocab(100, 16, 1) == 112


def test_custom_pipeline_layouts_are_refused():
    cfg = config.from_args({"decoder_first_pipeline_num_layers": 1})
    with pytest.raises(StatekitError, match="uniform pipeline stages only"):
        shard.check_uniform(cfg, "x")


# ------------------------------------------------------------------------ rank files compared


def _same(a, b, where, diffs):
    if isinstance(a, TensorRef) or isinstance(b, TensorRef):
        if not (isinstance(a, TensorRef) and isinstance(b, TensorRef)) or a.dtype != b.dtype \
                or tuple(a.shape) != tuple(b.shape) or bytes(a.raw()) != bytes(b.raw()):
            diffs.append(where)
    elif isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            diffs.append(f"{where}: keys {list(a)} != {list(b)}")
        for k in a:
            if k in b:
                _same(a[k], b[k], f"{where}.{k}", diffs)
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            diffs.append(f"{where}: {len(a)} != {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _same(x, y, f"{where}[{i}]", diffs)
    elif isinstance(a, Record) and isinstance(b, Record):
        if a.cls != b.cls:
            diffs.append(f"{where}: {a.cls} != {b.cls}")
        _same(a.fields, b.fields, f"{where}#", diffs)
    elif type(a) is not type(b) or a != b:
        diffs.append(f"{where}: {a!r:.60} != {b!r:.60}")


def rank_diffs(a: Path, b: Path, drop=()) -> list[str]:
    """Every difference between the rank files of two legacy save roots (entries ``drop`` left out)."""
    (it,) = [d for d in os.listdir(a) if d.startswith("iter_")]
    assert sorted(os.listdir(a / it)) == sorted(os.listdir(b / it))
    diffs: list[str] = []
    for rank in sorted(os.listdir(a / it)):
        assert sorted(os.listdir(a / it / rank)) == sorted(os.listdir(b / it / rank))
        for f in sorted(os.listdir(a / it / rank)):
            x, y = container.load(str(a / it / rank / f)), container.load(str(b / it / rank / f))
            if isinstance(x, dict):
                for k in drop:
                    x.pop(k, None)
                    y.pop(k, None)
            _same(x, y, f"{rank}/{f}", diffs)
    assert (a / container.TRACKER).read_text() == (b / container.TRACKER).read_text()
    return diffs


def test_same_sizes_rewrite_megatrons_own_rank_files_bit_for_bit(tmp_path):
    """The TP2·PP2 fixture's rank files (megatron-core 0.19.2's save) = statekit's shards of the
    joined tensors, every entry (model, coalesced distrib_optim.pt, args, rng_state…)."""
    out = tmp_path / "same"
    write_legacy.write(str(TP2PP2), str(out), write_legacy.Target(2, 2, 1, 1))
    assert rank_diffs(TP2PP2, out) == []
    out = tmp_path / "moe"
    write_legacy.write(str(MOE), str(out), write_legacy.Target(1, 1, 2, 2))
    assert rank_diffs(MOE, out) == []


def test_tp2pp2_to_tp1pp1_and_back_is_bit_for_bit(tmp_path):
    one, back = tmp_path / "tp1", tmp_path / "back"
    r = write_legacy.write(str(TP2PP2), str(one), write_legacy.Target(1, 1, 1, 1, vocab_divisible_by=32))
    assert r.folders == ["mp_rank_00"]
    assert any("output_layer.weight copy equals the embedding" in n for n in r.notes)
    write_legacy.write(str(one), str(back), write_legacy.Target(2, 2, 1, 1, vocab_divisible_by=16))
    # rng_state belongs to a rank: none is written on a TP/PP change (said in the notes)
    assert rank_diffs(TP2PP2, back, drop=("rng_state",)) == []
    obj = container.load(str(one / "iter_0000003" / "mp_rank_00" / container.MODEL_FILE))
    assert "rng_state" not in obj
    a = obj["args"].fields
    assert (a["tensor_model_parallel_size"], a["pipeline_model_parallel_size"], a["padded_vocab_size"]) == (1, 1, 128)


def test_moe_ep2_to_ep4_and_back_and_a_dp_change(tmp_path):
    ep4, back, dp4 = tmp_path / "ep4", tmp_path / "back", tmp_path / "dp4"
    r = write_legacy.write(str(MOE), str(ep4), write_legacy.Target(1, 1, 4, 4))
    assert r.folders == [f"mp_rank_00_{e:03d}" for e in range(4)]
    write_legacy.write(str(ep4), str(back), write_legacy.Target(1, 1, 2, 2))
    assert rank_diffs(MOE, back, drop=("rng_state",)) == []
    # dense state in the EP-rank-0 folder only, as Megatron writes it
    assert container.load(str(ep4 / "iter_0000003" / "mp_rank_00_001" / container.DISTRIB_FILE))[0] is None
    write_legacy.write(str(MOE), str(dp4), write_legacy.Target(1, 1, 2, 4))
    diffs = rank_diffs(MOE, dp4)  # the same ranks: rng_state copied; only the sizes in args differ
    assert diffs and all(d.endswith(("data_parallel_size: 2 != 4", "world_size: 2 != 4")) for d in diffs)


def test_moe_ep2_to_ep1_and_back_moves_the_expert_optimizer(tmp_path):
    """EP 1 (ETP = TP): the experts are dense parameters for Megatron (one optimizer, their groups the
    dense ones); back at EP 2 the ChainedOptimizer's expert member is rebuilt as Megatron wrote it."""
    one, back = tmp_path / "ep1", tmp_path / "back"
    r = write_legacy.write(str(MOE), str(one), write_legacy.Target(1, 1, 1, 2))
    assert r.folders == ["mp_rank_00"]
    obj = container.load(str(one / "iter_0000003" / "mp_rank_00" / container.MODEL_FILE))
    assert isinstance(obj["optimizer"], dict)
    assert [g["is_expert_parallel"] for g in obj["optimizer"]["optimizer"]["param_groups"]] == [False, False]
    write_legacy.write(str(one), str(back), write_legacy.Target(1, 1, 2, 2))
    assert rank_diffs(MOE, back, drop=("rng_state",)) == []


def test_statekit_diff_equal_after_reshard(tmp_path):
    out = tmp_path / "ep4"
    write_legacy.write(str(MOE), str(out), write_legacy.Target(1, 1, 4, 4))
    done = _cli("diff", str(MOE), str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["equal"] is True


def test_non_distributed_form_is_megatrons_and_crosses_both_ways(tmp_path):
    """The non-distributed form (torch ids by group, a step tensor each, fp32_from_fp16_params) at the
    fixture's sizes is megatron-core's own file bit for bit; either form converts to the other and back."""
    same = tmp_path / "same"
    write_legacy.write(str(NO_DISTOPT), str(same), write_legacy.Target(1, 1, 1, 2))
    assert rank_diffs(NO_DISTOPT, same) == []
    dist = tmp_path / "tp2pp2"
    r = write_legacy.write(str(NO_DISTOPT), str(dist), write_legacy.Target(2, 2, 1, 1, distributed=True))
    assert any("target is written in the distributed form" in n for n in r.notes)
    obj = container.load(str(dist / "iter_0000003" / "mp_rank_01_001" / container.MODEL_FILE))
    groups = obj["optimizer"]["optimizer"]["param_groups"]
    assert [g["step"] for g in groups] == [3.0, 3.0]  # the fixture's torch step per parameter is 3
    assert all("params" not in g for g in groups)
    back = tmp_path / "back"
    write_legacy.write(str(dist), str(back), write_legacy.Target(1, 1, 1, 2, 16, distributed=False))
    assert rank_diffs(NO_DISTOPT, back, drop=("rng_state",)) == []
    plain, again = tmp_path / "plain", tmp_path / "again"
    write_legacy.write(str(TP2PP2), str(plain), write_legacy.Target(1, 1, 1, 2, 32, distributed=False))
    assert not (plain / "iter_0000003" / "mp_rank_00" / container.DISTRIB_FILE).exists()
    write_legacy.write(str(plain), str(again), write_legacy.Target(2, 2, 1, 1, 16, distributed=True))
    assert rank_diffs(TP2PP2, again, drop=("rng_state",)) == []


# ---------------------------------------------------------------------------------- refusals


def test_refusals(tmp_path):
    with pytest.raises(StatekitError, match=r"padding rows 112-127 hold .* nonzero"):
        write_legacy.write(str(TP2PP2), str(tmp_path / "a"), write_legacy.Target(1, 1, 1, 1))
    with pytest.raises(StatekitError, match="do not split into PP 4"):
        write_legacy.write(str(TP2PP2), str(tmp_path / "c"), write_legacy.Target(2, 4, 1, 1))
    with pytest.raises(StatekitError, match="experts do not split into EP 3"):
        write_legacy.write(str(MOE), str(tmp_path / "d"), write_legacy.Target(1, 1, 3, 3))
    assert not any(tmp_path.iterdir())  # nothing left behind, not even a temporary folder


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "statekit", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)


def test_cli_writes_and_refuses_in_one_line(tmp_path):
    out = tmp_path / "o"
    done = _cli("convert", str(TP2PP2), str(out), "--to", "megatron-legacy", "--tp", "1", "--pp", "1",
                "--vocab-divisible-by", "32", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["sizes"] == {"tp": 1, "pp": 1, "ep": 1, "dp": 1} and got["rank_folders"] == ["mp_rank_00"]
    bad = tmp_path / "bad"
    done = _cli("convert", str(TP2PP2), str(bad), "--to", "megatron-legacy", "--tp", "1", "--pp", "1")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "padding rows" in done.stderr
    assert not bad.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    done = _cli("convert", str(MOE), str(tmp_path / "dry"), "--to", "megatron-legacy", "--ep", "4", "--dp", "4",
                "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["bytes_written"] is None and got["rank_folders"] == [f"mp_rank_00_{e:03d}" for e in range(4)]
    assert not (tmp_path / "dry").exists()
    done = _cli("convert", str(TP2PP2), str(tmp_path / "x.pt"), "--tp", "2")
    assert done.returncode != 0 and "apply to --to megatron or --to megatron-legacy" in done.stderr


# ------------------------------------------------------------- megatron-core's own load of it


def _load_script():
    spec = importlib.util.spec_from_file_location("check_megatron_load_legacy",
                                                  ROOT / "scripts" / "check_megatron_load_legacy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.torch
def test_megatron_loaded_what_statekit_writes(tmp_path):
    """megatron-core 0.19.2 loaded each folder and re-saved it: its tensors' digests are in the
    recorded result. statekit writes the same folders again here; every digest must be the one
    Megatron re-saved (so every element Megatron loaded is where statekit puts it)."""
    pytest.importorskip("torch")
    script = _load_script()
    result = json.loads(RESULT.read_text())
    assert set(result) == set(script.CHECKS)
    for check, r in result.items():
        assert r["megatron_core_version"] == "0.19.2"
        assert r["loaded_equals_written"] and r["step_4_saved"] and r["step_4_finite"], check
        argv = [a if a != "OUT" else str(tmp_path / check) for a in script.command(check)]
        done = _cli(*argv)
        assert done.returncode == 0, done.stderr
        assert script.digests(tmp_path / check) == r["digests"], check


@pytest.mark.slow
@pytest.mark.skipif(not MCORE_PY, reason="STATEKIT_MCORE_PY names no megatron-core venv")
def test_megatron_loads_statekit_legacy_checkpoints(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run([MCORE_PY, str(ROOT / "scripts" / "check_megatron_load_legacy.py"),
                           "--statekit-python", sys.executable, "--out", str(out)], capture_output=True, text=True,
                          cwd=ROOT, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert all(r["loaded_equals_written"] for r in got.values())
