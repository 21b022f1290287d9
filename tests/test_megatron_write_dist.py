"""Megatron torch_dist written by statekit (``convert --to megatron``): another TP/PP/DP.

References, none of them statekit's own output:

- ``fixtures/megatron/0.19.2/load_checks/*.json``: what megatron-core 0.19.2's own
  ``load_checkpoint`` loaded from a statekit-written folder (``scripts/check_megatron_load.py``:
  Megatron loads it at the target sizes and re-saves at once; the digests are of Megatron's
  tensors, and the script checked them against Megatron's own reading of the source). Here the
  statekit side is written again and must give the same bytes;
- the fixtures megatron-core wrote (a fully_reshardable save rewritten at its own sizes must give
  Megatron's own tensors back bit for bit);
- hand-computed facts: Megatron's padded vocabulary (100 tokens, divisible by 16 × TP: 112 at
  TP1, 128 at TP2), the fixture run's args (tests/… manifest: TP, DP, world).

``STATEKIT_MCORE_PY`` (a megatron-core venv's python) runs the Megatron load itself (marker
``megatron``; skipped without it).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import numpy as np
import pytest

from statekit import dtypes
from statekit.errors import FormatError, MappingError, UsageError
from statekit.formats import dcp, megatron_dist
from statekit.formats.torch_pickle import STATEKIT_TO_TORCH
from statekit.frameworks.megatron import write_dist
from tests.conftest import FIXTURES, MCORE_PY, ROOT

MCORE = FIXTURES / "megatron" / "0.19.2"
DP_RESHARDABLE = MCORE / "gpt_torch_dist_dp_reshardable_tp1pp1dp2"  # TP1 DP2, untied, Megatron-written
FULLY_TP2 = MCORE / "gpt_torch_dist_fully_reshardable_tp2pp1dp2"  # TP2 DP2, tied, Megatron-written
CHECKS = MCORE / "load_checks"
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
ITER = "iter_0000003"


def _write(src, dst, **target) -> write_dist.Written:
    return write_dist.write(str(src), str(dst), write_dist.Target(**target))


def _tensors(folder) -> dict[str, bytes]:
    d = megatron_dist.MegatronDist(str(folder))
    try:
        return {k: (e.dtype, e.shape, bytes(d.reader.tensor(e).raw())) for k, e in d.tensor_entries().items()}
    finally:
        d.close()


def _base(key: str) -> str:
    for slot in ("param", "exp_avg_sq", "exp_avg"):
        if key.startswith(f"optimizer.state.{slot}."):
            return key[len(f"optimizer.state.{slot}."):]
    return key


@pytest.mark.parametrize("check", ["tp1dp2_to_tp2dp2", "tp1dp2_to_tp2pp2dp1", "tp1dp2_same_sizes",
                                   "tp1dp2_to_tp1dp1_dp_reshardable", "tp1dp2_to_tp2dp2_dp_reshardable",
                                   "tp1dp2_to_tp2pp2dp1_dp_reshardable", "legacy_tp2pp2dp1_to_tp1dp2"])
def test_megatron_loaded_exactly_what_statekit_writes(tmp_path, check):
    """Megatron's own load (recorded) took every tensor statekit writes, bit for bit, and equal to
    the source as Megatron itself reads it. A dp_reshardable folder Megatron re-saves in model space:
    its weights compare with statekit's as written, its optimizer with statekit's fully_reshardable
    writing at the same sizes."""
    result = json.loads((CHECKS / f"{check}.json").read_text())
    assert result["megatron_core_version"] == "0.19.2"
    assert result["all_equal_statekit_written"] and result["all_equal_source_as_megatron_reads_it"]
    assert not result["problems"]
    assert all(v["equal"] for v in result["common_state_after_load"].values())
    loaded = result["loaded_at"]
    if loaded == result["source_sizes"] | {"world_size": loaded["world_size"]}:
        assert result["next_step_max_abs_diff"] == 0.0  # the same run: Megatron's next step is its own resume's
    sizes = {"tp": loaded["tp"], "pp": loaded["pp"], "dp": loaded["dp"]}
    source = MCORE / os.path.basename(result["source"])
    _write(source, tmp_path / "out", sharding=result["written_sharding"], **sizes)
    ours = _tensors(tmp_path / "out")
    if result["written_sharding"] == "dp_reshardable":
        assert any(".distributed." in k for k in ours)
        _write(source, tmp_path / "model-space", **sizes)
        ours = {k: v for k, v in ours.items() if not k.startswith("optimizer.")} | {
            k: v for k, v in _tensors(tmp_path / "model-space").items() if k.startswith("optimizer.")}
    assert set(ours) == set(result["tensors"])
    for key, (dtype, shape, raw) in ours.items():
        want = result["tensors"][key]
        assert list(shape) == want["shape"], key
        assert STATEKIT_TO_TORCH[dtype] == want["dtype"], key
        assert hashlib.sha256(raw).hexdigest() == want["sha256"], key


def test_tp_change_pads_the_vocabulary_and_rewrites_args(tmp_path):
    done = _write(DP_RESHARDABLE, tmp_path / "out", tp=2)
    assert done.sizes == {"tp": 2, "pp": 1, "dp": 2, "cp": 1, "world_size": 4, "padded_vocab_size": 128, "ep": 1}
    assert (tmp_path / "out" / megatron_dist.TRACKER).read_text() == "3"
    out = megatron_dist.MegatronDist(str(tmp_path / "out"))
    src = megatron_dist.MegatronDist(str(DP_RESHARDABLE))
    try:
        common = out.common()
        args = common["args"].fields
        assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"],
                args["data_parallel_size"], args["world_size"], args["padded_vocab_size"]) == (2, 1, 2, 4, 128)
        assert args["no_save_rng"] is True  # no rank of the source had the target ranks' RNG
        assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
        assert common["iteration"] == 3
        assert common["opt_param_scheduler"] == src.common()["opt_param_scheduler"]
        source_groups = src.object("optimizer.distributed.dp_group_idx_0.optimizer")["param_groups"]
        assert common["optimizer"]["optimizer"]["param_groups"] == source_groups
        assert "rerun_state_machine" not in common  # another world: Megatron would ignore it
        keys = set(out.meta.entries)
        assert not any(k.startswith("rng_state/") for k in keys)
        # the layers' TE extra state travels byte for byte
        extra = [k for k in src.meta.entries if "._extra_state/" in k]
        assert extra and all(out.raw_object(k) == src.raw_object(k) for k in extra)
        e = out.tensor_entries()["optimizer.state.exp_avg.output_layer.weight"]
        assert e.shape == (128, 64)  # ceil(100 / (16 * 2)) * 32
        rows = out.reader.tensor(e).numpy()
        assert not rows[112:].any()  # new padding rows are zero
    finally:
        out.close()
        src.close()


def test_same_sizes_give_megatrons_own_tensors_back(tmp_path):
    """A Megatron-written fully_reshardable save rewritten at its own sizes: every tensor (weights,
    masters, moments) is Megatron's, bit for bit; RNG and rerun state copied as they are."""
    _write(FULLY_TP2, tmp_path / "out")
    theirs, ours = _tensors(FULLY_TP2), _tensors(tmp_path / "out")
    assert set(ours) == set(theirs)
    assert all(ours[k] == theirs[k] for k in theirs)
    src, out = megatron_dist.MegatronDist(str(FULLY_TP2)), megatron_dist.MegatronDist(str(tmp_path / "out"))
    try:
        for k, e in src.meta.entries.items():
            if isinstance(e, dcp.BytesEntry) and not k.startswith("common_state/"):
                assert out.raw_object(k) == src.raw_object(k), k
        assert out.common()["rerun_state_machine"] == src.common()["rerun_state_machine"]
    finally:
        src.close()
        out.close()


@pytest.mark.parametrize("fixture", ["gpt_torch_dist_dp_reshardable_tp1pp1dp2", "gpt_torch_dist_dp_reshardable_tp2pp1dp2",
                                     "gpt_torch_dist_dp_reshardable_tp1pp2dp2"])
def test_dp_reshardable_at_the_same_sizes_is_megatrons_own(tmp_path, fixture):
    """dp_reshardable written at the source's own sizes (TP1·DP2, TP2·DP2, PP2·DP2): every tensor
    (each model-parallel rank's buckets, its TP-local shards at their offsets, the gaps) and every
    ShardedObject's value is what megatron-core wrote."""
    source = MCORE / fixture
    _write(source, tmp_path / "out", sharding="dp_reshardable")
    theirs, ours = _tensors(source), _tensors(tmp_path / "out")
    assert set(ours) == set(theirs) and all(ours[k] == theirs[k] for k in theirs)
    assert sum(".bucket_idx_" in k for k in theirs) == 3 * (1 if fixture.endswith("tp1pp1dp2") else 2)
    src, out = megatron_dist.MegatronDist(str(source)), megatron_dist.MegatronDist(str(tmp_path / "out"))
    try:
        objects = sorted(k for k, e in src.meta.entries.items() if isinstance(e, dcp.BytesEntry))
        assert objects == sorted(k for k, e in out.meta.entries.items() if isinstance(e, dcp.BytesEntry))
        for k in objects:
            if k.startswith("optimizer.distributed."):
                assert out.reader.value(k) == src.reader.value(k), k
        assert out.common()["optimizer"] == src.common()["optimizer"]
        assert out.common()["content_metadata"] == src.common()["content_metadata"]
    finally:
        src.close()
        out.close()


def test_dp_reshardable_at_another_dp_reads_back_as_the_source(tmp_path, cli):
    """DP 2 → 1 in bucket space: the bucket sizes are the layout's for DP 1 (ends padded to
    lcm(1, 128) = 128: 63808 elements → 63872) and every parameter's state is the source's."""
    _write(DP_RESHARDABLE, tmp_path / "dp1", dp=1, sharding="dp_reshardable")
    out = megatron_dist.MegatronDist(str(tmp_path / "dp1"))
    try:
        assert out.common()["args"].fields["data_parallel_size"] == 1
        sizes = out.object("optimizer.distributed.dp_group_idx_0.per_bucket_numel")
        assert [list(v.values()) for v in sizes] == [[[63872]]]
    finally:
        out.close()
    same = cli("diff", str(DP_RESHARDABLE), str(tmp_path / "dp1"), "--json")
    assert same.returncode == 0, same.stdout + same.stderr


def test_dp_reshardable_round_trip_through_tp2_pp2(tmp_path):
    """TP1·DP2 → TP2·PP2·DP1 → TP1·DP2, bucket space both ways: every tensor and every optimizer
    ShardedObject is megatron-core's own save again, bit for bit. On the way, four model-parallel
    ranks (mp = pp_rank × 2 + tp_rank), each one bucket (DP 1: ends padded to 128)."""
    _write(DP_RESHARDABLE, tmp_path / "tp2pp2", sharding="dp_reshardable", tp=2, pp=2, dp=1)
    mid = megatron_dist.MegatronDist(str(tmp_path / "tp2pp2"))
    try:
        fields = mid.common()["args"].fields
        assert (fields["tensor_model_parallel_size"], fields["pipeline_model_parallel_size"],
                fields["data_parallel_size"]) == (2, 2, 1)
        for mp in range(4):
            sizes = mid.object(f"optimizer.distributed.dp_group_idx_{mp}.per_bucket_numel")
            assert [n % 128 for v in sizes for n in next(iter(v.values()))] == [0], mp
        assert not any(k.startswith("optimizer.distributed.dp_group_idx_4") for k in mid.meta.entries)
    finally:
        mid.close()
    _write(tmp_path / "tp2pp2", tmp_path / "back", sharding="dp_reshardable", tp=1, pp=1, dp=2)
    theirs, back = _tensors(DP_RESHARDABLE), _tensors(tmp_path / "back")
    assert set(back) == set(theirs) and all(back[k] == theirs[k] for k in theirs)
    src, out = megatron_dist.MegatronDist(str(DP_RESHARDABLE)), megatron_dist.MegatronDist(str(tmp_path / "back"))
    try:
        objects = sorted(k for k in src.meta.entries if k.startswith("optimizer.distributed."))
        assert objects == sorted(k for k in out.meta.entries if k.startswith("optimizer.distributed."))
        for k in objects:
            if isinstance(src.meta.entries[k], dcp.BytesEntry):
                assert out.reader.value(k) == src.reader.value(k), k
    finally:
        src.close()
        out.close()


def test_tp_shard_ranges_by_hand():
    """Which flat elements TP rank r keeps: row-parallel (axis 1) a column block per row; SwiGLU
    fc1 ([W; V] on axis 0) W_r's rows then V_r's."""
    from statekit.frameworks.megatron import write_buckets  # noqa: PLC0415

    assert write_buckets.shard_ranges((4, 6), 1, 2, 1, False, "w") == [(3, 6), (9, 12), (15, 18), (21, 24)]
    assert write_buckets.shard_ranges((8, 2), 0, 2, 1, True, "fc1") == [(4, 8), (12, 16)]
    assert write_buckets.shard_ranges((8, 2), 0, 4, 0, False, "qkv") == [(0, 4)]
    with pytest.raises(MappingError, match="does not split"):
        write_buckets.shard_ranges((6, 2), 0, 4, 0, False, "qkv")


def test_round_trip_tp2_tp1_tp2(tmp_path):
    """TP2 → TP1 → TP2: bit for bit but the vocabulary rows TP1 does not have (112..127, beyond
    vocab_size 100), which come back zero; TP1 → TP2 → TP1 is bit for bit throughout."""
    _write(FULLY_TP2, tmp_path / "tp1", tp=1)
    done = _write(tmp_path / "tp1", tmp_path / "tp2", tp=2)
    assert done.sizes["padded_vocab_size"] == 128
    theirs, back = _tensors(FULLY_TP2), _tensors(tmp_path / "tp2")
    assert set(back) == set(theirs)
    for k, (dtype, shape, raw) in theirs.items():
        assert back[k][:2] == (dtype, shape), k
        if _base(k) in VOCAB_KEYS:
            cut = 112 * 64 * dtypes.itemsize(dtype)
            assert back[k][2][:cut] == raw[:cut], k
            assert not any(back[k][2][cut:]), k
        else:
            assert back[k][2] == raw, k
    _write(tmp_path / "tp2", tmp_path / "tp1b", tp=1)
    assert _tensors(tmp_path / "tp1b") == _tensors(tmp_path / "tp1")


def test_cut_rows_that_held_state_are_said(tmp_path):
    done = _write(FULLY_TP2, tmp_path / "tp1", tp=1)
    said = [n for n in done.notes if n.startswith("embedding.word_embeddings.weight: rows 112..127 cut")]
    assert said and "nonzero" in said[0]  # Megatron trains the padding rows (their logits enter the loss)
    d = megatron_dist.MegatronDist(str(FULLY_TP2))
    try:
        rows = d.reader.tensor(d.tensor_entries()["optimizer.state.exp_avg.embedding.word_embeddings.weight"]).numpy()
        assert np.any(rows[112:] != 0)
    finally:
        d.close()


@pytest.mark.parametrize("src, target, error, words", [
    (MCORE / "moe_torch_dist_dp_reshardable_ep2dp2", {"tp": 2}, MappingError, "EP and DP only"),
    (MCORE / "moe_torch_dist_dp_reshardable_ep2dp2", {"ep": 3}, UsageError, "4 experts do not split"),
    (MCORE / "moe_torch_dist_dp_reshardable_ep2dp2", {"ep": 4}, UsageError, "not a multiple of EP×TP×PP"),
    (MCORE / "moe_torch_dist_dp_reshardable_ep2dp2", {"sharding": "dp_reshardable"}, MappingError,
     "fully_reshardable only"),
    (DP_RESHARDABLE, {"ep": 2}, UsageError, "no experts"),
    (FULLY_TP2, {"sharding": "dp_reshardable", "pp": 2}, MappingError, "PP 2 with tied embeddings"),
    (DP_RESHARDABLE, {"sharding": "zero"}, UsageError, "one of fully_reshardable, dp_reshardable"),
    (DP_RESHARDABLE, {"tp": 3}, UsageError, "num_attention_heads 4 is not divisible"),
    (DP_RESHARDABLE, {"pp": 3}, UsageError, "num_layers 2"),
    (MCORE / "moe_torch_distopt_ep2dp2", {"tp": 1}, MappingError, "MoE"),
    (MCORE / "gpt_torch_no_distopt_tp1pp1dp2", {"tp": 2}, MappingError, "not Megatron's distributed"),
    (MCORE / "gpt_torch_dist_no_distopt_tp1pp1dp2", {"tp": 2}, MappingError, "not Megatron's distributed"),
    (MCORE / "gpt_torch_dist_fully_reshardable_2buckets_tp1pp1dp2", {"tp": 2}, FormatError, "master-vs-weight"),
])
def test_refusals_leave_nothing(tmp_path, src, target, error, words):
    with pytest.raises(error, match=words):
        _write(src, tmp_path / "out", **target)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_two_buckets_megatron_resumes_statekits_folder_as_its_own(tmp_path):
    """A 2-bucket legacy run written as fully_reshardable at its own sizes: Megatron's load of it
    and Megatron's own load of the legacy files train the next step bit for bit alike (recorded).
    Megatron's re-save shifts the states after bucket 0 (its fully_reshardable save bug), so only
    the tensors it leaves unshifted can compare with statekit's; they do."""
    result = json.loads((CHECKS / "legacy_2buckets_same_sizes.json").read_text())
    assert result["all_equal_source_as_megatron_reads_it"] and result["next_step_max_abs_diff"] == 0.0
    assert all(v["equal"] for v in result["common_state_after_load"].values())
    _write(ROOT / result["source"], tmp_path / "out")
    ours = _tensors(tmp_path / "out")
    assert set(ours) == set(result["tensors"])
    shifted = [k for k, e in result["tensors"].items() if e["equals_statekit_written"] is False]
    assert shifted and all(k.startswith("optimizer.state.") for k in shifted)
    for key, (_dtype, _shape, raw) in ours.items():
        same = hashlib.sha256(raw).hexdigest() == result["tensors"][key]["sha256"]
        assert same == (key not in shifted), key


def test_megatron_resumes_five_tp2_buckets_as_its_own(tmp_path):
    """The legacy TP2·DP2 run with --overlap-grad-reduce --ddp-bucket-size 5000 (tied; five buckets
    per model-parallel rank) written dp_reshardable at its own sizes: Megatron's load of statekit's
    buckets holds the source as its own load of the legacy files does, and trains the next step
    bit for bit alike (recorded); the weights it holds are statekit's."""
    result = json.loads((CHECKS / "legacy_tp2dp2_bucket5000_same_sizes_dp_reshardable.json").read_text())
    assert result["written_sharding"] == "dp_reshardable" and result["loaded_at"]["tp"] == 2
    assert result["all_equal_statekit_written"] and result["all_equal_source_as_megatron_reads_it"]
    assert result["next_step_max_abs_diff"] == 0.0 and not result["problems"]
    _write(ROOT / result["source"], tmp_path / "out", sharding="dp_reshardable")
    out = megatron_dist.MegatronDist(str(tmp_path / "out"))
    try:
        for mp in range(2):
            sizes = out.object(f"optimizer.distributed.dp_group_idx_{mp}.per_bucket_numel")
            assert len(next(iter(sizes[0].values()))) == 5, mp
    finally:
        out.close()
    ours = {k: v for k, v in _tensors(tmp_path / "out").items() if not k.startswith("optimizer.")}
    assert set(ours) == {k for k in result["tensors"] if not k.startswith("optimizer.")}
    for key, (_dtype, _shape, raw) in ours.items():
        assert hashlib.sha256(raw).hexdigest() == result["tensors"][key]["sha256"], key


LEGACY = MCORE / "gpt_torch_distopt_tp2pp2dp1"  # legacy files, TP2 PP2, tied: the last stage's output copy


def test_legacy_source_at_its_own_sizes(tmp_path):
    """A legacy checkpoint (mp_rank_*/model_optim_rng.pt + distrib_optim.pt) written as torch_dist at
    its own TP2·PP2: every parameter's weight, master and moments are what the legacy files hold (as
    the legacy reader joins them, proved); the tied output copy is stored once."""
    from statekit import io as skio  # noqa: PLC0415

    done = _write(LEGACY, tmp_path / "out")
    assert any("stored once" in n for n in done.notes)
    with skio.open_checkpoint(str(LEGACY)) as a, skio.open_checkpoint(str(tmp_path / "out")) as b:
        pa = {p.key: p for p in a.optimizer.params}
        pb = {p.key: p for p in b.optimizer.params}
        assert set(pa) - set(pb) == {"output_layer.weight"} and set(pb) <= set(pa)
        for k, p in pb.items():
            assert set(p.slots) == set(pa[k].slots), k
            for slot, ref in p.slots.items():
                assert bytes(ref.raw()) == bytes(pa[k].slots[slot].raw()), (k, slot)
            assert p.step == pa[k].step == 3
        wa = {m.path: m for m in a.model.params}
        for m in b.model.params:
            assert bytes(m.tensor.raw()) == bytes(wa[m.path].tensor.raw()), m.path
    out = megatron_dist.MegatronDist(str(tmp_path / "out"))
    try:
        fields = out.common()["args"].fields
        assert (fields["ckpt_format"], fields["no_save_rng"], fields["tensor_model_parallel_size"]) == (
            "torch_dist", True, 2)
        extra = sorted(k for k in out.meta.entries if "_extra_state" in k)
        assert len(extra) == 8 and all(out.reader.value(k) == [None] for k in extra)  # 4 linears × 2 layers
    finally:
        out.close()


def test_cli(tmp_path, cli):
    r = cli("convert", str(DP_RESHARDABLE), str(tmp_path / "tp2"), "--to", "megatron", "--tp", "2", "--json",
            env={"COLUMNS": "60"})
    assert r.returncode == 0, r.stderr
    said = json.loads(r.stdout)
    assert (said["sharding"], said["iteration"], said["sizes"]["tp"], said["sizes"]["padded_vocab_size"]) == (
        "fully_reshardable", 3, 2, 128)
    assert (tmp_path / "tp2" / ITER / "metadata.json").is_file()
    again = cli("convert", str(DP_RESHARDABLE), str(tmp_path / "tp2"), "--to", "megatron", "--tp", "2")
    assert again.returncode != 0 and "exists already" in again.stderr and "Traceback" not in again.stderr
    wrong = cli("convert", str(DP_RESHARDABLE), str(tmp_path / "x.pt"), "--tp", "2")
    assert wrong.returncode != 0 and "--to megatron" in wrong.stderr
    assert not (tmp_path / "x.pt").exists()


def _free_port() -> int:
    """A port no one listens on now (the script uses it and the next: helpers' runs at once must not meet)."""
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.megatron
@pytest.mark.parametrize("check, sizes", [
    ("tp1dp2_to_tp2dp2", {"tp": 2}),
    ("tp1dp2_to_tp2pp2dp1_dp_reshardable", {"tp": 2, "pp": 2, "dp": 1, "sharding": "dp_reshardable"}),
])
def test_megatron_loads_it_now(tmp_path, check, sizes):
    """megatron-core's own load of a statekit-written folder (TP2 fully_reshardable; TP2·PP2·DP1
    bucket space), run now (STATEKIT_MCORE_PY): the tensors Megatron holds are the recorded ones."""
    python = MCORE_PY
    if not python:
        pytest.skip("STATEKIT_MCORE_PY (a megatron-core 0.19.2 venv's python) is not set")
    _write(DP_RESHARDABLE, tmp_path / "out", **sizes)
    result = tmp_path / "result.json"
    dims = [str(x) for k in ("tp", "pp", "dp") if k in sizes for x in (f"--{k}", sizes[k])]
    run = subprocess.run([python, str(ROOT / "scripts" / "check_megatron_load.py"),
                          "--source", DP_RESHARDABLE.name, "--written", str(tmp_path / "out"), *dims,
                          "--result", str(result), "--port", str(_free_port())],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(result.read_text())
    recorded = json.loads((CHECKS / f"{check}.json").read_text())
    assert {k: v["sha256"] for k, v in got["tensors"].items()} == {
        k: v["sha256"] for k, v in recorded["tensors"].items()}


HF = MCORE.parent / "hf_llama_for_megatron"  # a transformers Llama trained 3 steps with torch AdamW


@pytest.mark.torch
def test_hf_state_to_megatron(tmp_path, cli):
    """HF names → Megatron torch_dist (--megatron-args): each Megatron tensor is the HF tensors
    assembled by Megatron's layout, written here by hand with torch from the HF files: q/k/v rows
    per query group (2 q heads, 1 k, 1 v of 16 rows each) into linear_qkv, gate;up into linear_fc1,
    the norms under the local spec's saved names, vocabulary rows 100.. zero; masters = the HF fp32
    weights, Megatron's bf16 weights = them rounded (torch's own cast)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file  # noqa: PLC0415

    r = cli("convert", str(HF / "optimizer.pt"), str(tmp_path / "out"), "--to", "megatron", "--megatron-args",
            str(DP_RESHARDABLE), "--model", str(HF / "model.safetensors"), "--names", str(HF / "optimizer_names.txt"),
            "--names-order", "optimizer", "--tp", "2", "--json")
    assert r.returncode == 0, r.stderr
    sd = torch.load(HF / "optimizer.pt", weights_only=True)
    names = (HF / "optimizer_names.txt").read_text().split()
    state = {names[i]: s for i, s in sd["state"].items()}
    weights = load_file(str(HF / "model.safetensors"))
    out = megatron_dist.MegatronDist(str(tmp_path / "out"))
    try:
        entries = out.tensor_entries()

        def got(key, layer=None):
            a = torch.from_numpy(np.array(out.reader.tensor(entries[key]).numpy(), dtype=np.float32))
            return a if layer is None else a[layer]

        def qkv(get):
            q, k, v = (get(f"self_attn.{p}_proj.weight") for p in "qkv")
            return torch.cat([torch.cat([q[32 * g:32 * (g + 1)], k[16 * g:16 * (g + 1)], v[16 * g:16 * (g + 1)]])
                              for g in range(2)])

        for layer in range(2):
            def hf(name, slot, layer=layer):
                key = f"model.layers.{layer}.{name}"
                return weights[key] if slot == "param" else state[key][slot]

            for slot in ("exp_avg", "exp_avg_sq", "param"):
                pre = f"optimizer.state.{slot}.decoder.layers."
                assert torch.equal(got(pre + "self_attention.linear_qkv.weight", layer),
                                   qkv(lambda n, s=slot: hf(n, s)))
                assert torch.equal(got(pre + "mlp.linear_fc1.weight", layer),
                                   torch.cat([hf("mlp.gate_proj.weight", slot), hf("mlp.up_proj.weight", slot)]))
                assert torch.equal(got(pre + "mlp.linear_fc2.weight", layer), hf("mlp.down_proj.weight", slot))
                assert torch.equal(got(pre + "self_attention.linear_proj.weight", layer), hf("self_attn.o_proj.weight", slot))
                assert torch.equal(got(pre + "self_attention.linear_qkv.layer_norm_weight", layer),
                                   hf("input_layernorm.weight", slot))
                assert torch.equal(got(pre + "mlp.linear_fc1.layer_norm_weight", layer),
                                   hf("post_attention_layernorm.weight", slot))
        emb = got("optimizer.state.exp_avg.embedding.word_embeddings.weight")
        assert emb.shape == (128, 64) and torch.equal(emb[:100], state["model.embed_tokens.weight"]["exp_avg"])
        assert not emb[100:].any()
        head = got("optimizer.state.param.output_layer.weight")
        assert torch.equal(head[:100], weights["lm_head.weight"]) and not head[100:].any()
        bf16 = out.reader.tensor(entries["decoder.final_layernorm.weight"]).numpy()
        assert np.array_equal(bf16.view(np.uint16),
                              weights["model.norm.weight"].to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
        common = out.common()
        assert common["iteration"] == 3 and common["args"].fields["consumed_train_samples"] == 12  # 3 steps × GBS 4
        assert {g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]} == {3.0}
    finally:
        out.close()
    # megatron-core's own load of this folder at TP2 (recorded): every tensor it held is statekit's
    result = json.loads((CHECKS / "hf_llama_to_tp2dp2.json").read_text())
    assert result["all_equal_statekit_written"] and not result["problems"] and result["next_step_saved"]
    ours = _tensors(tmp_path / "out")
    assert set(ours) == set(result["tensors"])
    assert all(hashlib.sha256(raw).hexdigest() == result["tensors"][k]["sha256"] for k, (_d, _s, raw) in ours.items())


@pytest.mark.torch
def test_an_hf_schedule_beside_the_state_is_not_dropped_in_silence(tmp_path, cli):
    """The opt_param_scheduler written is --megatron-args' own: an HF run's scheduler.pt beside the state
    (here a real torch LambdaLR's state_dict) is refused unless --no-schedule."""
    torch = pytest.importorskip("torch")
    import shutil  # noqa: PLC0415

    src = tmp_path / "hf"
    shutil.copytree(HF, src)
    p = torch.nn.Parameter(torch.zeros(1))
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW([p], lr=1e-3), lambda s: 1.0 - s / 10)
    for _ in range(3):
        sched.optimizer.step()
        sched.step()
    torch.save(sched.state_dict(), src / "scheduler.pt")
    args = ("convert", str(src / "optimizer.pt"), str(tmp_path / "out"), "--to", "megatron", "--megatron-args",
            str(DP_RESHARDABLE), "--model", str(src / "model.safetensors"), "--names", str(src / "optimizer_names.txt"),
            "--names-order", "optimizer")
    r = cli(*args)
    assert r.returncode == 1 and not (tmp_path / "out").exists()
    assert "LR schedule" in r.stderr and "--no-schedule" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert cli(*args, "--no-schedule").returncode == 0
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()
