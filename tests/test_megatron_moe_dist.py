"""A MoE run (ChainedOptimizer: dense + expert members) to torch_dist fully_reshardable, with EP
changes (``convert --to megatron --ep N``; :mod:`statekit.frameworks.megatron.write_moe`).

References, none of them statekit's own output:

- the fixtures megatron-core 0.19.2 wrote (``scripts/make_megatron_fixtures.py``): the same MoE
  run (4 experts, top-2, 2 layers) saved dp_reshardable and fully_reshardable at EP 2 and at EP 1
  (four runs of the same args and seed; the runs are not bit-identical to each other, so across
  runs only the structure, the args and the param groups compare);
- ``fixtures/megatron/0.19.2/load_checks/moe_*.json``: what megatron-core's own ``load_checkpoint``
  loaded from statekit's folders at EP 2 → EP 1, EP 1 → EP 2 and the same sizes
  (``scripts/check_megatron_load.py``), re-checked here by digest;
- hand-computed sizes: 29 parameters and 88896 elements (embedding and output 112 × 64 each, the
  final norm 64; per layer qkv 128 × 64, proj 64 × 64, two norms 64, router 4 × 64, 4 experts of
  fc1 64 × 64 and fc2 64 × 32).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from statekit.errors import MappingError
from statekit.formats import dcp, megatron_dist
from statekit.formats.torch_pickle import STATEKIT_TO_TORCH
from statekit.frameworks.megatron import dist as dist_reader
from statekit.frameworks.megatron import write_dist, write_moe
from tests.conftest import FIXTURES, MCORE_PY, ROOT

MCORE = FIXTURES / "megatron" / "0.19.2"
EP2_DPR = MCORE / "moe_torch_dist_dp_reshardable_ep2dp2"
EP2_FR = MCORE / "moe_torch_dist_fully_reshardable_ep2dp2"
EP1_DPR = MCORE / "moe_torch_dist_dp_reshardable_ep1dp2"
EP1_FR = MCORE / "moe_torch_dist_fully_reshardable_ep1dp2"
CHECKS = MCORE / "load_checks"
ITER = "iter_0000003"
ELEMENTS = 2 * 112 * 64 + 64 + 2 * (128 * 64 + 64 * 64 + 2 * 64 + 4 * 64 + 4 * (64 * 64 + 64 * 32))


def _write(src, dst, **target) -> write_dist.Written:
    return write_dist.write(str(src), str(dst), write_dist.Target(**target))


def _open(folder):
    return megatron_dist.MegatronDist(str(folder))


def _tensors(folder) -> dict[str, tuple]:
    d = _open(folder)
    try:
        return {k: (e.dtype, e.shape, bytes(d.reader.tensor(e).raw())) for k, e in d.tensor_entries().items()}
    finally:
        d.close()


def _objects(folder) -> dict[str, bytes]:
    d = _open(folder)
    try:
        return {k: d.raw_object(k) for k, e in d.meta.entries.items()
                if isinstance(e, dcp.BytesEntry) and not k.startswith("common_state/")}
    finally:
        d.close()


def _values(folder) -> dict[str, object]:
    """The ShardedObjects' values (their pickles differ in bytes from Megatron's, not in value)."""
    d = _open(folder)
    try:
        return {k: d.reader.value(k) for k, e in d.meta.entries.items()
                if isinstance(e, dcp.BytesEntry) and k.startswith("optimizer.distributed.")}
    finally:
        d.close()


def _common(folder) -> dict:
    d = _open(folder)
    try:
        return d.common()
    finally:
        d.close()


def _args(common: dict) -> dict:
    return {k: v for k, v in common["args"].fields.items() if k not in ("save", "load")}


@pytest.mark.parametrize("check", ["moe_ep2dp2_same_sizes", "moe_ep2dp2_to_ep1dp2", "moe_ep1dp2_to_ep2dp2"])
def test_megatron_loaded_exactly_what_statekit_writes(tmp_path, check):
    """megatron-core 0.19.2's own load_checkpoint (recorded) of statekit's folder at the target EP:
    every tensor it held after the load is what statekit writes, bit for bit (re-written here, the
    digests compared), and equal to the source as Megatron itself reads it; its optimizer has the
    target's members (two at EP 2, one at EP 1) with the source's param groups."""
    result = json.loads((CHECKS / f"{check}.json").read_text())
    assert result["megatron_core_version"] == "0.19.2"
    assert result["all_equal_statekit_written"] and result["all_equal_source_as_megatron_reads_it"]
    assert not result["problems"] and result["next_step_saved"]
    assert all(v["equal"] for v in result["common_state_after_load"].values())
    loaded, source = result["loaded_at"], result["source_sizes"]
    assert result["optimizer_members_after_load"] == (2 if loaded["ep"] > 1 else 1)
    if loaded["ep"] == source["ep"]:
        assert result["next_step_max_abs_diff"] == 0.0  # the same run: Megatron's next step is its own resume's
    _write(MCORE / os.path.basename(result["source"]), tmp_path / "out", ep=loaded["ep"])
    ours = _tensors(tmp_path / "out")
    assert set(ours) == set(result["tensors"])
    for key, (dtype, shape, raw) in ours.items():
        want = result["tensors"][key]
        assert (list(shape), STATEKIT_TO_TORCH[dtype]) == (want["shape"], want["dtype"]), key
        assert hashlib.sha256(raw).hexdigest() == want["sha256"], key


@pytest.mark.megatron
def test_megatron_loads_ep2_to_ep1_now(tmp_path):
    """megatron-core's own load of statekit's EP 2 → EP 1 folder, run now (STATEKIT_MCORE_PY): the
    tensors it holds after the load are the recorded ones."""
    if not MCORE_PY:
        pytest.skip("STATEKIT_MCORE_PY (a megatron-core 0.19.2 venv's python) is not set")
    _write(EP2_DPR, tmp_path / "ep1", ep=1)
    result = tmp_path / "result.json"
    run = subprocess.run([MCORE_PY, str(ROOT / "scripts" / "check_megatron_load.py"), "--source", EP2_DPR.name,
                          "--written", str(tmp_path / "ep1"), "--tp", "1", "--ep", "1", "--result", str(result),
                          "--port", "29741"], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(result.read_text())
    recorded = json.loads((CHECKS / "moe_ep2dp2_to_ep1dp2.json").read_text())
    assert got["optimizer_members_after_load"] == 1
    assert {k: v["sha256"] for k, v in got["tensors"].items()} == {
        k: v["sha256"] for k, v in recorded["tensors"].items()}


@pytest.mark.parametrize("src", [EP1_DPR, EP1_FR, EP2_DPR, EP2_FR])
def test_every_element_proved_and_experts_where_megatron_puts_them(src):
    """At EP 1 megatron-core 0.19.2 keeps the experts as dense parameters (one optimizer, groups not
    marked is_expert_parallel); at EP 2 in the expert member. Every element is proved either way."""
    ckpt = dist_reader.open_checkpoint(str(src))
    try:
        state = ckpt.optimizer
        assert len(state.params) == 29
        assert f"{ELEMENTS} elements" in next(n for n in state.notes if n.startswith("proved: 29 of 29"))
        ep = _common(src)["args"].fields["expert_model_parallel_size"]
        for p in state.params:
            expert = ".mlp.experts." in p.key
            assert state.groups[p.group].hyperparams["is_expert_parallel"] is (expert and ep > 1), p.key
    finally:
        ckpt.container.close()


@pytest.mark.parametrize("src", [EP2_FR, EP1_FR])
def test_same_sizes_give_megatrons_own_back(tmp_path, src):
    """A Megatron-written MoE fully_reshardable save rewritten at its own sizes: every tensor, every
    ShardedObject and the common state are Megatron's own."""
    _write(src, tmp_path / "out")
    assert _tensors(tmp_path / "out") == _tensors(src)
    assert _objects(tmp_path / "out") == _objects(src)
    ours, theirs = _common(tmp_path / "out"), _common(src)
    assert set(ours) == set(theirs)
    assert {k: v for k, v in ours.items() if k != "args"} == {k: v for k, v in theirs.items() if k != "args"}
    assert _args(ours) == _args(theirs)


@pytest.mark.parametrize("src, ep, want", [
    (EP2_DPR, None, EP2_FR),  # the sharding type only
    (EP2_DPR, 1, EP1_FR),  # EP 2 -> 1: the expert member joins the dense one
    (EP1_DPR, None, EP1_FR),
    (EP1_DPR, 2, EP2_FR),  # EP 1 -> 2: the experts get their own member
    (EP1_FR, 2, EP2_FR),
])
def test_written_as_megatron_writes_that_run(tmp_path, src, ep, want):
    """statekit's folder against megatron-core's own fully_reshardable save of the same run at the
    target EP: the same tensor keys, dtypes and shapes, the same ShardedObjects, the same common
    state (param groups per member, sharding types, content metadata, scheduler), the same args but
    the save path, the RNG and the rerun state (not carried at another EP)."""
    _write(src, tmp_path / "out", ep=ep)
    ours, theirs = _tensors(tmp_path / "out"), _tensors(want)
    assert {k: v[:2] for k, v in ours.items()} == {k: v[:2] for k, v in theirs.items()}
    moved = ep is not None
    assert set(_objects(tmp_path / "out")) == {k for k in _objects(want)
                                               if not (moved and k.startswith(("rng_state/", "rerun_state")))}
    c_ours, c_theirs = _common(tmp_path / "out"), _common(want)
    assert c_ours["optimizer"] == c_theirs["optimizer"]
    assert c_ours["content_metadata"] == c_theirs["content_metadata"]
    assert c_ours["opt_param_scheduler"] == c_theirs["opt_param_scheduler"]
    a_ours, a_theirs = _args(c_ours), _args(c_theirs)
    if moved:
        assert a_ours.pop("no_save_rng") is True and not a_theirs.pop("no_save_rng", None)
        assert "rerun_state_machine" not in c_ours
    assert a_ours == a_theirs


def test_round_trip_ep2_ep1_ep2(tmp_path):
    """EP 2 → EP 1 → EP 2 gives Megatron's EP 2 save back: every tensor bit for bit, the layers'
    ShardedObjects, the members' param groups."""
    _write(EP2_FR, tmp_path / "ep1", ep=1)
    _write(tmp_path / "ep1", tmp_path / "ep2", ep=2)
    assert _tensors(tmp_path / "ep2") == _tensors(EP2_FR)
    src = _objects(EP2_FR)
    assert _objects(tmp_path / "ep2") == {k: v for k, v in src.items()
                                          if not k.startswith(("rng_state/", "rerun_state"))}
    assert _common(tmp_path / "ep2")["optimizer"] == _common(EP2_FR)["optimizer"]
    assert len(_common(tmp_path / "ep1")["optimizer"]) == 2  # one member: its {optimizer, param_state_sharding_type}


def test_cli_says_the_ep_change(tmp_path, cli):
    r = cli("convert", EP2_DPR, tmp_path / "ep1", "--to", "megatron", "--ep", "1")
    assert r.returncode == 0, r.stderr
    assert "TP 1 PP 1 EP 1 (expert DP 2) DP 2 (world 2)" in r.stdout
    assert "EP 2 → 1" in r.stdout and "EP 1: the experts are dense parameters" in r.stdout
    r = cli("convert", EP2_DPR, tmp_path / "bad", "--to", "megatron", "--ep", "3")
    assert r.returncode != 0 and "4 experts do not split into EP 3" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists() or not os.listdir(tmp_path / "bad")


def test_ep1_dp_reshardable_at_its_own_sizes_is_megatrons_own(tmp_path):
    """At EP 1 the experts sit in the dense buffer: written dp_reshardable at the source's sizes it is
    megatron-core's own save bit for bit (every tensor: the bucket with its gaps), the layers' and
    RNG objects byte for byte, the optimizer's objects (groups, bucket sizes) in value."""
    _write(EP1_DPR, tmp_path / "out", sharding="dp_reshardable")
    assert _tensors(tmp_path / "out") == _tensors(EP1_DPR)
    ours, theirs = _objects(tmp_path / "out"), _objects(EP1_DPR)
    assert set(ours) == set(theirs)
    assert all(ours[k] == theirs[k] for k in theirs if not k.startswith("optimizer."))
    assert _values(tmp_path / "out") == _values(EP1_DPR)
    assert _common(tmp_path / "out")["optimizer"] == _common(EP1_DPR)["optimizer"]


def test_ep2_to_ep1_dp_reshardable_lays_the_buckets_out_as_megatron(tmp_path):
    """EP 2 → EP 1 in bucket space: the keys, shapes, bucket sizes and param groups of megatron-core's
    own EP 1 dp_reshardable save of the run (another run: its values differ)."""
    _write(EP2_DPR, tmp_path / "out", ep=1, sharding="dp_reshardable")
    ours, theirs = _tensors(tmp_path / "out"), _tensors(EP1_DPR)
    assert {k: v[:2] for k, v in ours.items()} == {k: v[:2] for k, v in theirs.items()}
    assert _values(tmp_path / "out") == _values(EP1_DPR)  # [{(bf16, fp32): [88960]}] and the groups


def test_dp_reshardable_with_an_expert_member_is_refused(tmp_path):
    with pytest.raises(MappingError, match="expert optimizer fully_reshardable only"):
        _write(EP1_DPR, tmp_path / "out", ep=2, sharding="dp_reshardable")
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def _group(wd_mult: float, expert: bool, **more) -> dict:
    return {"wd_mult": wd_mult, "lr_mult": 1.0, "is_decoupled_lr": False, "is_expert_parallel": expert,
            "lr": 0.01, "step": 3.0, **more}


def test_groups_join_only_when_every_entry_agrees():
    """EP 2 → 1: an expert group whose lr or step is not its dense twin's is refused, never merged."""
    dense, expert = [_group(1.0, False), _group(0.0, False)], [_group(1.0, True)]
    joined, note = write_moe.target_groups([dense, expert], {}, apart=False, where="x")
    assert joined == [dense] and note.startswith("EP 1")
    for bad in ({"lr": 0.02}, {"step": 4.0}):
        with pytest.raises(MappingError, match="other .* than the dense group it joins"):
            write_moe.target_groups([dense, [_group(1.0, True, **bad)]], {}, apart=False, where="x")


def test_groups_split_by_where_the_parameters_are():
    """EP 1 → 2: each member keeps the groups its parameters are in; a group only the experts use
    leaves the dense member, one only dense parameters use is not given to the experts."""
    groups = [_group(1.0, False), _group(0.0, False), _group(1.0, False, lr_mult=2.0)]
    used = {0: {False, True}, 1: {False}, 2: {True}}
    (dense, expert), _ = write_moe.target_groups([groups], used, apart=True, where="x")
    assert dense == groups[:2]
    assert expert == [dict(groups[0], is_expert_parallel=True), dict(groups[2], is_expert_parallel=True)]
    with pytest.raises(MappingError, match="is_expert_parallel"):
        write_moe.target_groups([[_group(1.0, True)]], {}, apart=False, where="x")
