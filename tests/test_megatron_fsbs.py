"""``fully_sharded_bucket_space`` (megatron-core 0.6-0.7) read from megatron-core 0.7.0's own saves.

The fixtures under ``fixtures/megatron/0.7.0/`` are written by Megatron-LM ``core_v0.7.0``'s
``pretrain_gpt.py`` on CPU (``scripts/make_megatron_07_fixtures.py``): each fsbs run once with
``--ckpt-fully-parallel-save`` (fully_sharded_bucket_space) and once without
(dp_zero_gather_scatter), same seed and data. The expected offsets are computed here by hand from
the model's sizes and 0.7's rules (parameters reversed, no 64-element starts, a bucket closing once
it holds ``--ddp-bucket-size`` elements, its end padded to lcm(DP, 128)); the values compared are
torch's own ``dcp.load`` of the bucket tensors.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from statekit import io
from statekit.errors import FormatError
from statekit.ops.doctor import doctor_files
from tests.conftest import ROOT

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

V07 = ROOT / "fixtures" / "megatron" / "0.7.0"
FSBS = V07 / "torch_dist-fsbs-tp1-dp2"
ITER = "iter_0000003"
H, VOCAB = 64, 112  # vocab 100 + eod padded to a multiple of 16 × TP 1
# the local spec's registration order in 0.7 (TransformerLayer: input_layernorm, self_attention:
# linear_proj then linear_qkv, pre_mlp_layernorm, mlp: linear_fc1, linear_fc2); LayerNorm: weight, bias
LAYER = {"input_layernorm.weight": (H,), "input_layernorm.bias": (H,), "self_attention.linear_proj.weight": (H, H),
         "self_attention.linear_qkv.weight": (128, H), "pre_mlp_layernorm.weight": (H,),
         "pre_mlp_layernorm.bias": (H,), "mlp.linear_fc1.weight": (192, H), "mlp.linear_fc2.weight": (H, 96)}
SHAPES = {"embedding.word_embeddings.weight": (VOCAB, H),
          **{f"decoder.layers.{i}.{n}": s for i in range(2) for n, s in LAYER.items()},
          "decoder.final_layernorm.weight": (H,), "decoder.final_layernorm.bias": (H,),
          "output_layer.weight": (VOCAB, H)}
NAMES = list(SHAPES)
PREFIX = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_"
PAIRS = [("torch_dist-fsbs-tp1-dp2", "torch_dist-dpzero-tp1-dp2", None),
         ("torch_dist-fsbs-bucket40000-tp1-dp2", "torch_dist-dpzero-bucket40000-tp1-dp2", 40000),
         ("torch_dist-fsbs-bucket7230-tp1-dp2", "torch_dist-dpzero-bucket7230-tp1-dp2", 7230)]


def _hand_layout(bucket_size: int | None, divisor: int) -> tuple[dict[str, tuple[int, int]], list[int]]:
    """{name: (bucket, offset in it)} and the padded bucket sizes, by the 0.7 rules written out."""
    where, sizes = {}, []
    start = bucket_start = 0
    for name in reversed(NAMES):
        where[name] = (len(sizes), start - bucket_start)
        start += math.prod(SHAPES[name])
        if bucket_size is not None and start - bucket_start >= bucket_size:
            end = -(-start // divisor) * divisor
            sizes.append(end - bucket_start)
            start = bucket_start = end
    if start > bucket_start:
        sizes.append(-(-start // divisor) * divisor - bucket_start)
    return where, sizes


def _bucket_tensors(folder, n_buckets: int) -> dict:
    import torch.distributed.checkpoint as tdcp

    it = folder / ITER
    meta = tdcp.FileSystemReader(str(it)).read_metadata().state_dict_metadata
    keys = [f"{PREFIX}{b}.{s}" for b in range(n_buckets) for s in ("param", "exp_avg", "exp_avg_sq")]
    out = {k: torch.empty(tuple(meta[k].size), dtype=torch.float32) for k in keys}
    tdcp.load(out, checkpoint_id=str(it), no_dist=True)
    return out


def _need(*names):
    missing = [n for n in names if not (V07 / n).exists()]
    assert not missing, f"the committed fixtures are missing: {missing}"
    return pytest.mark.usefixtures()


@pytest.mark.parametrize("fsbs,_dpzero,bucket_size", PAIRS, ids=[p[0] for p in PAIRS])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsbs_cut_by_hand_computed_offsets(fsbs, _dpzero, bucket_size):
    """Every parameter named as Megatron names it, in registration order, proved; each slot equals
    torch's own load of the bucket tensor at the offset computed here by 0.7's rule."""
    folder = V07 / fsbs
    assert folder.exists(), f"{folder}: the committed fixture is missing"
    where, sizes = _hand_layout(bucket_size, math.lcm(2, 128))
    stored = _bucket_tensors(folder, len(sizes))
    assert [stored[f"{PREFIX}{b}.param"].numel() for b in range(len(sizes))] == sizes
    with io.open_checkpoint(folder) as ckpt:
        assert ckpt.metadata["megatron.sharding"] == "fully_sharded_bucket_space"
        state = ckpt.optimizer
        assert [p.path for p in state.params] == NAMES
        notes = " ".join(state.notes)
        assert f"proved: {len(NAMES)} of {len(NAMES)} parameters, 76416 elements" in notes
        assert f"rule 0.7 told by per_bucket_numel {sizes}" in notes
        for p in state.params:
            assert tuple(p.shape) == SHAPES[p.path]
            bucket, lo = where[p.path]
            n = math.prod(SHAPES[p.path])
            for slot, key in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("fp32_master", "param")):
                want = stored[f"{PREFIX}{bucket}.{key}"][lo:lo + n].numpy()
                assert np.array_equal(p.slots[slot].numpy().reshape(-1), want), (p.path, slot)
            assert p.step == 3
            assert state.groups[p.group].hyperparams["wd_mult"] == (0.0 if len(SHAPES[p.path]) == 1 else 1.0)
    assert doctor_files(folder)["clean"]


@_need("torch_dist-fsbs-bucket7230-tp1-dp2")
def test_padded_bucket_ends_tell_0_7_from_0_6():
    """With bucket ends that 0.7 pads and 0.6 would not, the rule is 0.7's and the note says so
    without claiming 0.6 lays it out the same; the hand layout of 0.6 (ends padded to DP) differs."""
    _, sizes_07 = _hand_layout(7230, 128)
    _, sizes_06 = _hand_layout(7230, 2)
    assert sizes_07 != sizes_06
    with io.open_checkpoint(V07 / "torch_dist-fsbs-bucket7230-tp1-dp2") as ckpt:
        notes = " ".join(ckpt.optimizer.notes)
    assert f"rule 0.7 told by per_bucket_numel {sizes_07}" in notes and "lays it out the same" not in notes


@pytest.mark.parametrize("fsbs,dpzero,_size", PAIRS, ids=[p[0] for p in PAIRS])
def test_fsbs_equals_the_same_run_saved_dp_zero_gather_scatter(fsbs, dpzero, _size):
    """The same seeded run saved without --ckpt-fully-parallel-save (the coalesced param_state
    object, another code path): every parameter, moment and master equal bit for bit."""
    from statekit.ops.diff import diff_files

    assert (V07 / fsbs).exists() and (V07 / dpzero).exists(), "the committed fixtures are missing"
    result = diff_files(V07 / fsbs, V07 / dpzero)
    assert result["equal"], result.get("summary")
    with io.open_checkpoint(V07 / fsbs) as a, io.open_checkpoint(V07 / dpzero) as b:
        assert [p.path for p in a.optimizer.params] == [p.path for p in b.optimizer.params] == NAMES
        for pa, pb in zip(a.optimizer.params, b.optimizer.params, strict=True):
            for slot in ("exp_avg", "exp_avg_sq", "fp32_master"):
                assert np.array_equal(pa.slots[slot].numpy(), pb.slots[slot].numpy()), (pa.path, slot)


@_need("torch_dist-fsbs-tp2-dp2")
def test_fsbs_tp2_joined_and_proved():
    """TP2·DP2: each TP rank's buckets (dp_group_idx 0 and 1) cut and joined on the TP axes, proved."""
    with io.open_checkpoint(V07 / "torch_dist-fsbs-tp2-dp2") as ckpt:
        state = ckpt.optimizer
        assert [p.path for p in state.params] == NAMES
        weights = {m.path: m for m in ckpt.model.params}
        for p in state.params:
            assert tuple(p.shape) == tuple(weights[p.path].shape)
        assert f"proved: {len(NAMES)} of {len(NAMES)} parameters" in " ".join(state.notes)


def test_wrong_order_is_refused_naming_parameter_and_rule(monkeypatch):
    """A layout that does not prove is refused: linear_qkv put before linear_proj (it is after)."""
    from statekit.frameworks.megatron import bucket_space

    order = list(bucket_space.LAYER_ORDER["local"])
    qkv, proj = order.index("self_attention.linear_qkv.weight"), order.index("self_attention.linear_proj.weight")
    order[qkv], order[proj] = order[proj], order[qkv]
    monkeypatch.setitem(bucket_space.LAYER_ORDER, "local", tuple(order))
    with pytest.raises(FormatError, match=r"parameter decoder\.layers\.\d\.self_attention\.linear_(qkv|proj)\.weight: "
                                          r"its fp32 master rounded to BF16 is not the stored weight .*"
                                          r"master-vs-weight rule \(fully_sharded_bucket_space\) does not hold"):
        io.open_checkpoint(FSBS)


def _with_args(tmp_path, name: str, **changes):
    """A copy of fixture ``name`` whose common.pt args say ``changes`` (re-pickled by statekit's
    common-state writer: torch.load would need megatron's ModelType class)."""
    from statekit.formats import megatron_dist

    copy = tmp_path / name
    shutil.copytree(V07 / name, copy)
    common = megatron_dist.MegatronDist(copy).common_to_rewrite()
    common["args"].fields.update(changes)
    (copy / ITER / "common.pt").write_bytes(megatron_dist.common_archive(common))
    return copy


@_need("torch_dist-fsbs-bucket7230-tp1-dp2")
def test_corrupted_bucket_setting_refused_in_one_line(tmp_path):
    """args saying another bucket size than the run's: no rule gives the stored buckets; the CLI
    says so in one line, naming the buffer and both layouts, and exits non-zero."""
    copy = _with_args(tmp_path, "torch_dist-fsbs-bucket7230-tp1-dp2", ddp_bucket_size=9000)
    run = subprocess.run([sys.executable, "-m", "statekit", "inspect", str(copy)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode != 0 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert "gbuf_idx_0: bucket tensors of" in lines[0]
    assert "neither mcore 0.6's nor 0.7's bucket rule holds" in lines[0] and "Traceback" not in run.stderr


def test_convert_to_megatron_writes_fully_reshardable(tmp_path):
    """convert --to megatron re-stacks the proved parameters into the model-space format of current
    megatron-core; reading the written folder back gives every value bit for bit."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "statekit", "convert", str(FSBS), str(out), "--to", "megatron"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "fully_sharded_bucket_space → fully_reshardable" in run.stdout
    with io.open_checkpoint(FSBS) as a, io.open_checkpoint(out) as b:
        assert b.metadata["megatron.sharding"] == "fully_reshardable"
        got = {p.path: p for p in b.optimizer.params}
        assert sorted(got) == sorted(NAMES)
        for p in a.optimizer.params:
            for slot in ("exp_avg", "exp_avg_sq", "fp32_master"):
                assert np.array_equal(p.slots[slot].numpy(), got[p.path].slots[slot].numpy()), (p.path, slot)
