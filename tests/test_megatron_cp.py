"""Context parallelism (CP > 1) in Megatron checkpoints: read, reshard, written back.

With context parallelism the distributed optimizer shards its buckets over the DP × CP group
(megatron-core 0.19.2: ``optimizer/__init__.py`` passes ``intra_dp_cp_group``; the bucket ends are
padded to ``lcm(DP × CP, 128)``). References, none of them statekit's own output:

- the CP fixtures megatron-core 0.19.2 wrote (``scripts/make_megatron_fixtures.py``; attention is
  the CPU shim's, per CP rank's own chunk, which changes values and not the layout: the manifest's
  ``attention_math``): TP1·PP1 ``dp_reshardable`` at CP2·DP1 (and CP2·DP2, CP3·DP1 with two buckets
  where present), the legacy ``distrib_optim.pt`` at CP2;
- hand-computed facts: the run's sizes (the manifest), the bucket padding ``lcm(DP × CP, 128)``;
- ``fixtures/megatron/0.19.2/load_checks/cp*.json`` / ``…_to_cp2dp1_…json``: megatron-core's own
  load of statekit's CP1 / CP2 folders (``scripts/check_megatron_load.py --cp``), re-checked here by
  digest.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess

import pytest

from statekit import io
from statekit.errors import MappingError, StatekitError, UsageError
from statekit.formats import dcp, megatron_dist
from statekit.formats import megatron_legacy as container
from statekit.formats.torch_pickle import STATEKIT_TO_TORCH
from statekit.frameworks.megatron import config, write_dist, write_legacy
from tests.conftest import FIXTURES, MCORE_PY, ROOT
from tests.test_megatron_reshard import rank_diffs
from tests.test_megatron_write_dist import _tensors

MCORE = FIXTURES / "megatron" / "0.19.2"
MANIFEST = json.loads((FIXTURES / "megatron" / "manifest.json").read_text())["cases"]
CP2 = MCORE / "gpt_torch_dist_dp_reshardable_cp2dp1"
CP2DP2 = MCORE / "gpt_torch_dist_dp_reshardable_cp2dp2"
CP3 = MCORE / "gpt_torch_dist_dp_reshardable_cp3dp1_buckets2"
LEGACY_CP2 = MCORE / "gpt_torch_distopt_cp2dp1"
DP2 = MCORE / "gpt_torch_dist_dp_reshardable_tp1pp1dp2"
CHECKS = MCORE / "load_checks"
PARAMS = 15  # the tiny GPT's parameters (untied): embedding, 2 × 6 per layer, final norm, output layer


def _bytes_objects(folder) -> dict[str, object]:
    d = megatron_dist.MegatronDist(str(folder))
    try:
        return {k: d.reader.value(k) for k, e in d.meta.entries.items()
                if isinstance(e, dcp.BytesEntry) and k.startswith("optimizer.distributed.")}
    finally:
        d.close()


@pytest.mark.parametrize("case", [CP2, CP2DP2, CP3, LEGACY_CP2], ids=lambda p: p.name)
def test_cp_fixture_reads_every_parameter_proved(case):
    assert case.exists(), f"{case}: the committed fixture is missing"
    made = MANIFEST[f"0.19.2/{case.name}"]
    assert made["cp"] > 1 and "attention_math" in made  # the shim's attention, said where it was made
    with io.open_checkpoint(case) as ckpt:
        state = ckpt.optimizer
        names = [p.path for p in state.params]
        assert len(names) == len(set(names)) == PARAMS
        notes = " ".join(state.notes)
        assert "proved: 15" in notes, notes
        if case == LEGACY_CP2:  # the layout note names the DP × CP size the buckets were cut for
            assert f"DP×CP {made['dp'] * made['cp']}" in notes, notes
        for p in state.params:
            assert set(p.slots) == {"exp_avg", "exp_avg_sq", "fp32_master"}, p.path


def test_cp3_buckets_are_padded_for_dp_times_cp():
    """CP3·DP1, two buckets: Megatron pads each bucket end to lcm(DP × CP, 128) = 384; a reader
    that took DP alone (lcm(1, 128) = 128) would cut the second bucket elsewhere."""
    d = megatron_dist.MegatronDist(str(CP3))
    try:
        sizes = d.object("optimizer.distributed.dp_group_idx_0.per_bucket_numel")
        unpadded = d.object("optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded")
    finally:
        d.close()
    ((numel,),), ((raw,),) = [list(v.values()) for v in sizes], [list(v.values()) for v in unpadded]
    assert len(numel) == 2
    assert all(n % math.lcm(3, 128) == 0 for n in numel), numel  # each bucket end padded for DP × CP = 3
    assert any(n % 384 for n in raw), raw  # the padding is needed (a DP-only rule would differ)


def test_cp3_read_with_dp_alone_would_refuse(monkeypatch):
    """What a DP-only layout does on a real CP3 save: refused, the stored bucket sizes naming the
    disagreement (32256 = 84 × 384 stored, 32000 = 250 × 128 for DP 1) — never a silent cut (the
    reader takes DP × CP, as Megatron does)."""
    monkeypatch.setattr(config.MegatronConfig, "dp_cp_size", lambda self: self.need("dp", "test"))
    with pytest.raises(StatekitError, match=r"per_bucket_numel is \[32256, 31872\], the layout gives \[32000, 31872\]"):
        io.open_checkpoint(CP3)


def test_cp3_written_at_its_own_sizes_and_back_from_cp1_is_megatrons_own(tmp_path):
    """The bucket writer pads for DP × CP = 3 (384) as Megatron does: CP3 rewritten dp_reshardable at
    its own sizes, and CP3 → CP1 → CP3, give megatron-core's own tensors and bucket-size objects."""
    write_dist.write(str(CP3), str(tmp_path / "same"), write_dist.Target(sharding="dp_reshardable"))
    write_dist.write(str(CP3), str(tmp_path / "cp1"), write_dist.Target(cp=1, sharding="dp_reshardable"))
    write_dist.write(str(tmp_path / "cp1"), str(tmp_path / "back"), write_dist.Target(cp=3, sharding="dp_reshardable"))
    theirs, objects = _tensors(CP3), _bytes_objects(CP3)
    for out in ("same", "back"):
        assert _tensors(tmp_path / out) == theirs, out
        assert _bytes_objects(tmp_path / out) == objects, out
    d = megatron_dist.MegatronDist(str(tmp_path / "cp1"))
    try:  # at CP 1 the ends are padded to 128
        assert [list(v.values()) for v in d.object("optimizer.distributed.dp_group_idx_0.per_bucket_numel")] == [
            [[32000, 31872]]]
    finally:
        d.close()


@pytest.mark.parametrize("src", [CP2, CP2DP2], ids=lambda p: p.name)
def test_cp2_to_cp1_to_cp2_dp_reshardable_is_megatrons_own(tmp_path, src):
    """CP2 → CP1 (fully_reshardable and dp_reshardable) → CP2 dp_reshardable: every tensor and every
    optimizer ShardedObject is megatron-core's own CP2 save, bit for bit."""
    assert src.exists(), f"{src}: the committed fixture is missing"
    dp = MANIFEST[f"0.19.2/{src.name}"]["dp"]
    one = write_dist.write(str(src), str(tmp_path / "cp1"), write_dist.Target(cp=1))
    assert one.sizes["cp"] == 1 and one.sizes["world_size"] == dp
    write_dist.write(str(src), str(tmp_path / "cp1b"), write_dist.Target(cp=1, sharding="dp_reshardable"))
    theirs = _tensors(src)
    for mid in ("cp1", "cp1b"):
        back = write_dist.write(str(tmp_path / mid), str(tmp_path / f"back-{mid}"),
                                write_dist.Target(cp=2, sharding="dp_reshardable"))
        assert back.sizes["world_size"] == 2 * dp
        assert _tensors(tmp_path / f"back-{mid}") == theirs, mid
        assert _bytes_objects(tmp_path / f"back-{mid}") == _bytes_objects(src), mid
    out = megatron_dist.MegatronDist(str(tmp_path / "cp1"))
    try:
        args = out.common()["args"].fields
        assert (args["context_parallel_size"], args["data_parallel_size"], args["world_size"]) == (1, dp, dp)
        assert "rng_state/shard_0.0_1.1" in out.meta.entries  # the RNG is per (PP, TP): kept at a CP change
    finally:
        out.close()


def test_cp1dp2_to_cp2dp1_keeps_the_buckets(tmp_path):
    """DP2 → CP2·DP1 keeps DP × CP = 2: the bucket tensors are the source's bit for bit (same layout)."""
    write_dist.write(str(DP2), str(tmp_path / "cp2"), write_dist.Target(dp=1, cp=2, sharding="dp_reshardable"))
    ours, theirs = _tensors(tmp_path / "cp2"), _tensors(DP2)
    assert ours == theirs
    d = megatron_dist.MegatronDist(str(tmp_path / "cp2"))
    try:
        args = d.common()["args"].fields
        assert (args["context_parallel_size"], args["data_parallel_size"], args["world_size"]) == (2, 1, 2)
    finally:
        d.close()


def test_legacy_cp2_to_cp1_to_cp2_is_bit_for_bit(tmp_path):
    """Legacy CP2 → CP1 → CP2: every entry of the rank files is Megatron's, bit for bit, but
    ``args.rank`` / ``local_rank``: at CP > 1 both CP ranks have data-parallel rank 0 and both write
    ``model_optim_rng.pt`` (megatron-core 0.19.2 ``save_checkpoint``); the file is whichever wrote
    last (rank 1 here), statekit writes CP rank 0's."""
    one, back = tmp_path / "cp1", tmp_path / "back"
    write_legacy.write(str(LEGACY_CP2), str(one), write_legacy.Target(1, 1, 1, 1, cp=1))
    write_legacy.write(str(one), str(back), write_legacy.Target(1, 1, 1, 1, cp=2))
    rank = "mp_rank_00/model_optim_rng.pt.args#"
    assert rank_diffs(LEGACY_CP2, back) == [f"{rank}.local_rank: 1 != 0", f"{rank}.rank: 1 != 0"]
    args = container.load(str(one / "iter_0000003" / "mp_rank_00" / container.MODEL_FILE))["args"].fields
    assert (args["context_parallel_size"], args["world_size"]) == (1, 1)
    assert "rng_state" in container.load(str(one / "iter_0000003" / "mp_rank_00" / container.MODEL_FILE))


def test_cp_refusals(tmp_path, cli):
    with pytest.raises(MappingError, match=r"--cp 3: the run's seq_length 16 is not a multiple of 2 × CP = 6"):
        write_dist.write(str(CP2), str(tmp_path / "a"), write_dist.Target(cp=3))
    with pytest.raises(UsageError, match="at least 1"):
        write_dist.write(str(CP2), str(tmp_path / "b"), write_dist.Target(cp=0))
    with pytest.raises(MappingError, match=r"--cp 3"):
        write_legacy.write(str(LEGACY_CP2), str(tmp_path / "c"), write_legacy.Target(1, 1, 1, 1, cp=3))
    assert not any((tmp_path / n).exists() and os.listdir(tmp_path / n) for n in "abc")
    r = cli("convert", str(CP2), str(tmp_path / "x.pt"), "--cp", "1")
    assert r.returncode != 0 and "--cp" in r.stderr and "Traceback" not in r.stderr
    r = cli("convert", str(CP2), str(tmp_path / "d"), "--to", "megatron", "--cp", "1")
    assert r.returncode == 0, r.stderr
    assert "CP 2 → 1" in r.stdout


@pytest.mark.parametrize("check", ["cp2dp1_to_cp1dp1", "tp1dp2_to_cp2dp1_dp_reshardable"])
def test_megatron_loaded_exactly_what_statekit_writes_at_another_cp(tmp_path, check):
    """megatron-core 0.19.2 loaded statekit's folder at the target CP (recorded): its re-save's tensors
    are statekit's bit for bit and the source as Megatron reads it; statekit writes it again here and
    every digest must be the recorded one."""
    path = CHECKS / f"{check}.json"
    assert path.exists(), f"{path}: the committed load check is missing"
    result = json.loads(path.read_text())
    assert result["megatron_core_version"] == "0.19.2"
    assert result["all_equal_statekit_written"] and result["all_equal_source_as_megatron_reads_it"]
    assert not result["problems"]
    loaded, source = result["loaded_at"], result["source_sizes"]
    assert loaded.get("cp", 1) != source.get("cp", 1)
    sizes = {"tp": loaded["tp"], "pp": loaded["pp"], "dp": loaded["dp"], "cp": loaded.get("cp", 1)}
    src = MCORE / os.path.basename(result["source"])
    write_dist.write(str(src), str(tmp_path / "out"), write_dist.Target(sharding=result["written_sharding"], **sizes))
    ours = _tensors(tmp_path / "out")
    if result["written_sharding"] == "dp_reshardable":  # Megatron re-saves model space: compare that
        write_dist.write(str(src), str(tmp_path / "ms"), write_dist.Target(**sizes))
        ours = {k: v for k, v in ours.items() if not k.startswith("optimizer.")} | {
            k: v for k, v in _tensors(tmp_path / "ms").items() if k.startswith("optimizer.")}
    assert set(ours) == set(result["tensors"])
    for key, (dtype, shape, raw) in ours.items():
        want = result["tensors"][key]
        assert (list(shape), STATEKIT_TO_TORCH[dtype]) == (want["shape"], want["dtype"]), key
        assert hashlib.sha256(raw).hexdigest() == want["sha256"], key


def test_target_cp_follows_megatrons_own_checks():
    cfg = config.from_args({"context_parallel_size": 2, "seq_length": 16, "tensor_model_parallel_size": 1,
                            "pipeline_model_parallel_size": 1, "data_parallel_size": 1})
    assert config.target_cp(cfg, None, "x") == 2 and config.target_cp(cfg, 4, "x") == 4
    with pytest.raises(MappingError, match="seq_length 16"):
        config.target_cp(cfg, 3, "x")
    hier = config.from_args({**cfg.raw, "hierarchical_context_parallel_sizes": [2, 1]})
    with pytest.raises(MappingError, match="hierarchical_context_parallel_sizes"):
        config.target_cp(hier, 4, "x")


@pytest.mark.megatron
def test_megatron_loads_a_cp1_folder_from_cp2_now(tmp_path):
    """megatron-core's own load of statekit's CP2 → CP1 folder, run now (STATEKIT_MCORE_PY)."""
    if not MCORE_PY:
        pytest.skip("STATEKIT_MCORE_PY (a megatron-core 0.19.2 venv's python) is not set")
    write_dist.write(str(CP2), str(tmp_path / "cp1"), write_dist.Target(cp=1))
    result = tmp_path / "result.json"
    run = subprocess.run([MCORE_PY, str(ROOT / "scripts" / "check_megatron_load.py"), "--source", CP2.name,
                          "--written", str(tmp_path / "cp1"), "--tp", "1", "--cp", "1", "--result", str(result),
                          "--port", "29911"], capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(result.read_text())
    recorded = json.loads((CHECKS / "cp2dp1_to_cp1dp1.json").read_text())
    assert {k: v["sha256"] for k, v in got["tensors"].items()} == {
        k: v["sha256"] for k, v in recorded["tensors"].items()}
