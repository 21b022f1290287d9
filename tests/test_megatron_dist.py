"""Megatron-Core torch_dist checkpoints: read without torch, every parameter named as Megatron names it.

SYNTHETIC folders (scripts/make_megatron_dist_synthetic.py): written by real torch 2.13's
``torch.distributed.checkpoint.save`` in the key families, shapes, chunkings, ``MCoreMetadata``
root, ``common.pt`` / ``common_state`` and ShardedObjects of megatron-core's torch_dist format
(shared/docs/megatron-formats.md §2), not by megatron-core itself. Values are compared with what
the generator saved (``truth.pt``) and with real torch's own ``dcp_to_torch_save`` of the same
folder; names with Megatron's naming written out here by hand.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from statekit import io
from statekit.errors import FormatError, MappingError, UnsafePickleError
from statekit.formats import megatron_dist, registry
from statekit.ops.doctor import doctor_files
from tests.conftest import ROOT

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

SCRIPT = ROOT / "scripts" / "make_megatron_dist_synthetic.py"
ITER = "iter_0000005"
L, E = 2, 4

# Megatron's parameter names for the synthetic GPT (named_parameters of one model chunk)
LAYER = ("self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
         "self_attention.linear_qkv.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
         "mlp.linear_fc2.weight")
DENSE = (["embedding.word_embeddings.weight"] + [f"decoder.layers.{i}.{n}" for i in range(L) for n in LAYER]
         + ["decoder.final_layernorm.weight", "output_layer.weight"])
MOE_LAYER = ["self_attention.linear_proj.weight", "self_attention.linear_qkv.layer_norm_weight",
             "self_attention.linear_qkv.weight", "pre_mlp_layernorm.weight", "mlp.router.weight"]
MOE = (["embedding.word_embeddings.weight"]
       + [f"decoder.layers.{i}.{n}" for i in range(L) for n in
          MOE_LAYER + [f"mlp.experts.linear_fc{k}.weight{e}" for k in (1, 2) for e in range(E)]]
       + ["decoder.final_layernorm.weight", "output_layer.weight"])


def _generator():
    spec = importlib.util.spec_from_file_location("make_megatron_dist_synthetic", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_megatron_dist_synthetic"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_dist")
    subprocess.run([sys.executable, str(SCRIPT), str(out)], check=True, capture_output=True, timeout=300)
    _generator()._mcore_module()  # torch's own loader unpickles MCoreMetadata by its Megatron name
    return out


def _truth(case_dir) -> dict:
    return torch.load(case_dir / "truth.pt", weights_only=True)


def _split(key: str, lead: tuple[int, ...]) -> str:
    """The hand-written Megatron name of stacked element ``lead`` of ``key`` (grouped GEMM experts)."""
    if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
        key = f"decoder.layers.{lead[0]}." + key[len("decoder.layers."):]
        lead = lead[1:]
    if lead:
        head, rest = key.split(".experts.experts.")
        key = f"{head}.experts.{rest}{lead[0]}"
    return key


def _stacked(key: str) -> int:
    return (key.startswith("decoder.layers.")) + (".experts.experts." in key)


def _expected(truth: dict) -> dict[str, dict[str, np.ndarray]]:
    """Per parameter name: the saved values, unstacked by hand."""
    out = {}
    for key, values in truth.items():
        n = _stacked(key)
        shape = tuple(values["weight"].shape)
        for lead in np.ndindex(*shape[:n]):
            out[_split(key, tuple(lead))] = {k: v[tuple(lead)] for k, v in values.items()}
    return out


CASES = ["non_distributed", "fully_reshardable", "fully_sharded_model_space", "fully_reshardable-state",
         "non_distributed-moe", "fully_sharded_model_space-moe", "fully_reshardable-moe"]


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_named_and_valued_as_saved(made, case):
    root = made / case
    with io.open_checkpoint(root) as ckpt:
        assert ckpt.format == "megatron-dist"
        state = ckpt.optimizer
        names = [p.path for p in state.params]
        assert names == (MOE if "moe" in case else DENSE)
        assert state.family == "adamw" and {p.step for p in state.params} == {5}
        expected = _expected(_truth(root))
        masters = {p.path: p.slots["fp32_master"] for p in ckpt.optimizer.params}
        master_slot = "param" if case.startswith("fully_reshardable") else "fp32_param"
        for p in state.params:
            want = expected[p.path]
            assert tuple(p.shape) == tuple(want["weight"].shape), p.path
            for slot in ("exp_avg", "exp_avg_sq"):
                assert np.array_equal(p.slots[slot].numpy(), want[slot].numpy()), (p.path, slot)
            assert np.array_equal(masters[p.path].numpy(), want[master_slot].numpy()), p.path
        assert ckpt.metadata["megatron.iteration"] == "5" and ckpt.metadata["megatron.tp"] == "2"
        weights = {m.path: m for m in ckpt.model.params}  # the model: the stored weights
        assert [m.path for m in ckpt.model.params] == names and all(m.dtype == "BF16" for m in weights.values())
        assert all(np.array_equal(weights[n].tensor.numpy(), expected[n]["weight"].view(torch.uint16).numpy()
                                  .view(weights[n].tensor.numpy().dtype)) for n in names)
        assert ckpt.schedulers[0]["lr_decay_style"] == "cosine"


@pytest.mark.parametrize("case", ["non_distributed", "fully_reshardable", "non_distributed-moe"])
def test_values_equal_torch_own_dcp_load(made, case, tmp_path):
    """Real torch's dcp_to_torch_save of the same folder, cut per parameter by hand."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = made / case / ITER
    dcp_to_torch_save(str(folder), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    compared = 0
    with io.open_checkpoint(folder) as ckpt:
        by_name = {p.path: p for p in ckpt.optimizer.params}
        for key, value in full.items():
            if not key.startswith("optimizer.state.exp_avg."):
                continue
            target = key[len("optimizer.state.exp_avg."):]
            n = _stacked(target)
            for lead in np.ndindex(*value.shape[:n]):
                p = by_name[_split(target, tuple(lead))]
                assert np.array_equal(p.slots["exp_avg"].numpy(), value[tuple(lead)].numpy()), key
                assert np.array_equal(p.slots["exp_avg_sq"].numpy(),
                                      full["optimizer.state.exp_avg_sq." + target][tuple(lead)].numpy()), key
                compared += 1
    assert compared == len(by_name)


def test_groups_by_megatron_rule(made):
    with io.open_checkpoint(made / "fully_reshardable-moe") as ckpt:
        state = ckpt.optimizer
        group = {p.path: state.groups[p.group].hyperparams for p in state.params}
    assert group["decoder.layers.0.pre_mlp_layernorm.weight"]["wd_mult"] == 0.0  # 1-D: no weight decay
    assert group["decoder.layers.1.mlp.router.weight"]["wd_mult"] == 1.0
    assert group["decoder.layers.1.mlp.router.weight"]["is_expert_parallel"] is False
    assert group["decoder.layers.0.mlp.experts.linear_fc2.weight3"]["is_expert_parallel"] is True
    assert group["output_layer.weight"]["weight_decay"] == 0.1


def test_save_root_iteration_folder_and_nemo_open(made):
    assert registry.sniff(str(made / "fully_reshardable")) == "megatron-dist"
    assert registry.sniff(str(made / "fully_reshardable" / ITER)) == "megatron-dist"
    with io.open_checkpoint(made / "fully_reshardable-nemo") as ckpt:
        assert [p.path for p in ckpt.optimizer.params] == DENSE  # NeMo 2's module. prefix dropped
        assert ckpt.metadata["megatron.folder"] == "weights"


def test_plain_dcp_folder_stays_dcp(made, tmp_path):
    folder = tmp_path / "plain"
    shutil.copytree(made / "fully_reshardable" / ITER, folder)
    os.unlink(folder / "metadata.json")
    assert registry.sniff(str(folder)) == "dcp"


def test_reformulated_shapes_come_from_mcore_data(made):
    dist = megatron_dist.MegatronDist(made / "fully_sharded_model_space")
    try:
        key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
        assert dist.meta.entries[key].shape == (2, 4, 1, 48)  # [L, 2*TP (SwiGLU W/V), 1, local numel]
        assert dist.reformulated_shape(key) == (2, 24, 8)
    finally:
        dist.close()


def test_doctor_finds_the_fully_reshardable_shift_and_only_there(made):
    shifted = json.loads((made / "fully_reshardable-shift" / "expected.json").read_text())["shifted"]
    want = sorted(_split(k, lead) for k in shifted for lead in
                  (np.ndindex(L) if _stacked(k) else [()]))
    report = doctor_files(made / "fully_reshardable-shift")
    hit = sorted(f["param"] for f in report["findings"] if f["check"] == "megatron-master")
    assert hit == want and want
    assert all("32a03b77c5" in f["message"] for f in report["findings"] if f["check"] == "megatron-master")
    for case in ("fully_reshardable", "fully_reshardable-moe", "fully_sharded_model_space", "non_distributed"):
        assert doctor_files(made / case)["clean"], case


def test_shifted_state_is_refused_naming_parameter_and_rule(made):
    with pytest.raises(FormatError, match=r"parameter embedding\.word_embeddings\.weight: its fp32 master rounded "
                                          r"to BF16 is not the stored weight .* master-vs-weight rule .* 32a03b77c5"):
        io.open_checkpoint(made / "fully_reshardable-shift")


def test_doctor_padding_rows_and_zero_moments(made):
    pad = doctor_files(made / "fully_reshardable-padstate")["findings"]
    assert [(f["check"], f["param"]) for f in pad] == [("padding-state", "embedding.word_embeddings.weight")]
    zeros = doctor_files(made / "fully_reshardable-zeros")["findings"]
    assert [(f["check"], f["param"]) for f in zeros] == [("zero-moments", "decoder.final_layernorm.weight")]


# ------------------------------------------------------------------------------------------ refusals


def _copy(made, case, tmp_path):
    root = tmp_path / case
    shutil.copytree(made / case, root)
    return root


def test_truncated_distcp_refused(made, tmp_path):
    root = _copy(made, "fully_reshardable", tmp_path)
    data = root / ITER / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(FormatError, match="truncated"):
        io.open_checkpoint(root)


def test_missing_common_pt_refused(made, tmp_path):
    root = _copy(made, "fully_reshardable", tmp_path)
    os.unlink(root / ITER / "common.pt")
    with pytest.raises(FormatError, match="neither common.pt nor a common_state"):
        io.open_checkpoint(root)


def test_unknown_pickle_global_refused(made, tmp_path):
    root = _copy(made, "fully_reshardable", tmp_path)
    common = torch.load(root / ITER / "common.pt", weights_only=False)
    common["args"].hook = _Foreign()
    torch.save(common, root / ITER / "common.pt")
    with pytest.raises(UnsafePickleError, match="test_megatron_dist._Foreign"):
        io.open_checkpoint(root)


class _Foreign:
    pass


def test_bucket_space_type_beside_model_space_keys_refused(made, tmp_path):
    """A common state saying a bucket-space type over model-space tensors: refused, naming both."""
    root = _copy(made, "fully_reshardable", tmp_path)
    common = torch.load(root / ITER / "common.pt", weights_only=False)
    common["optimizer"]["param_state_sharding_type"] = "fully_sharded_bucket_space"
    torch.save(common, root / ITER / "common.pt")
    with pytest.raises(FormatError, match="model-space optimizer state beside fully_sharded_bucket_space buffers"):
        io.open_checkpoint(root)


def test_group_that_does_not_fit_refused(made, tmp_path):
    root = _copy(made, "fully_reshardable", tmp_path)
    common = torch.load(root / ITER / "common.pt", weights_only=False)
    del common["optimizer"]["optimizer"]["param_groups"][1]  # the no-weight-decay group
    torch.save(common, root / ITER / "common.pt")
    with pytest.raises(MappingError, match="decoder.layers.0.self_attention.linear_qkv.layer_norm_weight: 0 of"):
        io.open_checkpoint(root)


def test_cli_error_is_one_line(made, tmp_path):
    root = _copy(made, "fully_reshardable", tmp_path)
    os.unlink(root / ITER / "common.pt")
    run = subprocess.run([sys.executable, "-m", "statekit", "inspect", str(root)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=120)
    assert run.returncode != 0
    assert len(run.stderr.strip().splitlines()) == 1 and "common.pt" in run.stderr


# ------------------------------------------------------------------ real fixtures (megatron-core itself)

REAL = ROOT / "fixtures" / "megatron"
DP_RESHARDABLE = REAL / "0.19.2" / "gpt_torch_dist_dp_reshardable_tp1pp1dp2"
# the local spec's registration order (TransformerLayer: input_layernorm, self_attention.linear_proj,
# linear_qkv, pre_mlp_layernorm, mlp), named as its modules name them (saved under TE's fused names)
LOCAL_LAYER = ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
               "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
LOCAL = (["embedding.word_embeddings.weight"] + [f"decoder.layers.{i}.{n}" for i in range(2) for n in LOCAL_LAYER]
         + ["decoder.final_layernorm.weight", "output_layer.weight"])
H, VOCAB = 64, 112
LOCAL_SHAPES = {"input_layernorm.weight": (H,), "self_attention.linear_proj.weight": (H, H),
                "self_attention.linear_qkv.weight": (128, H), "pre_mlp_layernorm.weight": (H,),
                "mlp.linear_fc1.weight": (128, H), "mlp.linear_fc2.weight": (H, H)}


def _local_shape(name: str) -> tuple[int, ...]:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (VOCAB, H)
    if name == "decoder.final_layernorm.weight":
        return (H,)
    return LOCAL_SHAPES[name.split(".", 3)[3]]


@pytest.mark.skipif(not DP_RESHARDABLE.exists(), reason="fixture not merged")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_dp_reshardable_cut_by_hand_computed_offsets(tmp_path):
    """megatron-core 0.19.2's own dp_reshardable save (TP1 PP1 DP2, one bucket): every parameter named,
    proved, and its states equal the bucket tensors torch's own dcp.load gives, cut at offsets
    computed here by hand (parameters reversed, 64-element starts: every size here is a multiple of 64)."""
    import torch.distributed.checkpoint as tdcp

    prefix = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0."
    want = {s: torch.empty(63808, dtype=torch.float32) for s in ("param", "exp_avg", "exp_avg_sq")}
    tdcp.load({prefix + s: t for s, t in want.items()}, checkpoint_id=str(DP_RESHARDABLE / "iter_0000003"),
              no_dist=True)
    offsets, at = {}, 0
    for name in reversed(LOCAL):
        offsets[name] = at
        at += int(np.prod(_local_shape(name)))
    assert at == 63808
    with io.open_checkpoint(DP_RESHARDABLE) as ckpt:
        assert ckpt.format == "megatron-dist" and ckpt.metadata["megatron.sharding"] == "dp_reshardable"
        state = ckpt.optimizer
        assert [p.path for p in state.params] == LOCAL
        masters = {p.path: p.slots["fp32_master"] for p in ckpt.optimizer.params}
        for p in state.params:
            shape = _local_shape(p.path)
            assert tuple(p.shape) == shape
            lo, n = offsets[p.path], int(np.prod(shape))
            for slot in ("exp_avg", "exp_avg_sq"):
                assert np.array_equal(p.slots[slot].numpy().reshape(-1), want[slot][lo:lo + n].numpy()), p.path
            assert np.array_equal(masters[p.path].numpy().reshape(-1), want["param"][lo:lo + n].numpy())
            assert p.step == 3
            wd = state.groups[p.group].hyperparams["wd_mult"]
            assert wd == (0.0 if len(shape) == 1 else 1.0), p.path
        assert ckpt.schedulers[0]["lr_decay_style"] == "cosine"
    assert doctor_files(DP_RESHARDABLE)["clean"]


@pytest.mark.skipif(not DP_RESHARDABLE.exists(), reason="fixture not merged")
def test_real_dp_reshardable_wrong_order_is_refused(tmp_path, monkeypatch):
    """A layout that does not prove is refused naming the parameter and the rule: linear_qkv
    registered before linear_proj (it is after) moves layer 0's attention weights."""
    from statekit.frameworks.megatron import bucket_space

    order = list(bucket_space.LAYER_ORDER["local"])
    qkv, proj = order.index("self_attention.linear_qkv.weight"), order.index("self_attention.linear_proj.weight")
    order[qkv], order[proj] = order[proj], order[qkv]
    monkeypatch.setitem(bucket_space.LAYER_ORDER, "local", tuple(order))
    with pytest.raises(FormatError, match=r"parameter decoder\.layers\.0\.self_attention\.linear_qkv\.weight: its fp32 "
                                          r"master rounded to BF16 is not the stored weight .*master-vs-weight rule "
                                          r"\(dp_reshardable\) does not hold"):
        io.open_checkpoint(DP_RESHARDABLE)


def _torch_load(folder, keys) -> dict:
    """Real torch's own dcp.load of tensor ``keys`` (whole, as allocated from its own metadata)."""
    import torch.distributed.checkpoint as tdcp

    meta = tdcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    tdcp.load(out, checkpoint_id=str(folder), no_dist=True)
    return out


TWO_BUCKETS = REAL / "0.19.2" / "gpt_torch_dist_fully_reshardable_2buckets_tp1pp1dp2"
TP2 = REAL / "0.19.2" / "gpt_torch_dist_fully_reshardable_tp2pp1dp2"
NO_DISTOPT = REAL / "0.19.2" / "gpt_torch_dist_no_distopt_tp1pp1dp2"
MOE_EP2 = REAL / "0.19.2" / "moe_torch_dist_dp_reshardable_ep2dp2"
TIED = LOCAL[:-1]  # tied embeddings: no output_layer.weight


@pytest.mark.skipif(not TWO_BUCKETS.exists(), reason="fixture not merged")
@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_real_fully_reshardable_two_buckets_shift_found_by_doctor_only_there(version):
    """megatron-core 0.19.2's fully_reshardable save with --ddp-num-buckets 2: bucket size
    63808 // 2 = 31904 elements; laid out reversed, bucket 0 closes after the first element that
    reaches it: output 7168 + final norm 64 + layer 1 (4096 + 8192 + 64 + 8192 + 4096 + 64) = 31936.
    Every parameter after it (layer 0 and the embedding) was saved shifted."""
    sizes = {n: int(np.prod(_local_shape(n))) for n in LOCAL}
    at, bucket0 = 0, set()
    for name in reversed(LOCAL):
        bucket0.add(name)
        at += sizes[name]
        if at >= 63808 // 2:
            break
    shifted = sorted(set(LOCAL) - bucket0)
    assert len(shifted) == 7
    folder = REAL / version / TWO_BUCKETS.name
    with pytest.raises(FormatError, match=r"parameter embedding\.word_embeddings\.weight: .*32a03b77c5"):
        io.open_checkpoint(folder)
    report = doctor_files(folder)
    assert sorted(f["param"] for f in report["findings"] if f["check"] == "megatron-master") == shifted
    for healthy in (DP_RESHARDABLE, TP2, NO_DISTOPT, MOE_EP2):
        assert doctor_files(healthy)["clean"], healthy


@pytest.mark.skipif(not TP2.exists(), reason="fixture not merged")
@pytest.mark.parametrize("folder,master", [(TP2, "param"), (NO_DISTOPT, "fp32_param")])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_model_space_values_equal_torch_own_load(folder, master):
    it = next(folder.glob("iter_*"))
    keys = [f"optimizer.state.{s}.{k}" for s in ("exp_avg", "exp_avg_sq", master) for k in _model_keys(it)]
    full = _torch_load(it, keys)
    with io.open_checkpoint(folder) as ckpt:
        state = ckpt.optimizer
        assert [p.path for p in state.params] == TIED
        masters = {p.path: p.slots["fp32_master"] for p in ckpt.optimizer.params}
        seen = 0
        for key in _model_keys(it):
            value = full[f"optimizer.state.exp_avg.{key}"]
            n = _stacked(key)
            for lead in np.ndindex(*value.shape[:n]):
                name = _local_name(_split(key, tuple(lead)))
                p = next(x for x in state.params if x.path == name)
                for slot in ("exp_avg", "exp_avg_sq"):
                    assert np.array_equal(p.slots[slot].numpy(),
                                          full[f"optimizer.state.{slot}.{key}"][tuple(lead)].numpy()), name
                assert np.array_equal(masters[name].numpy(), full[f"optimizer.state.{master}.{key}"][tuple(lead)].numpy())
                seen += 1
        assert seen == len(TIED) and {p.step for p in state.params} == {3}


def _local_name(name: str) -> str:
    """The local spec's own parameter names for the two keys it saves under TE's names."""
    return (name.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
            .replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"))


def _model_keys(folder) -> list[str]:
    dist = megatron_dist.MegatronDist(folder)
    try:
        return [k for k in dist.tensor_entries() if not k.startswith("optimizer.")]
    finally:
        dist.close()


@pytest.mark.skipif(not MOE_EP2.exists(), reason="fixture not merged")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_moe_ep2_experts_cut_by_hand_computed_offsets():
    """The expert part of megatron-core 0.19.2's EP2 dp_reshardable save: EP rank r's buffer holds its
    local experts 2r, 2r+1 of both layers (SequentialMLP: fc1 [64, 64] then fc2 [64, 32] each),
    laid out reversed; expert DP 1."""
    rows = [(layer, e, fc) for layer in range(2) for e in range(4) for fc in (1, 2)]
    size = {1: 64 * 64, 2: 64 * 32}
    it = MOE_EP2 / "iter_0000003"
    pre = "chained_1.optimizer.distributed.dp_group_idx_{}.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32)" \
          ".bucket_idx_0.{}"
    full = _torch_load(it, [pre.format(r, s) for r in range(2) for s in ("exp_avg", "param")])
    with io.open_checkpoint(MOE_EP2) as ckpt:
        by_name = {p.path: p for p in ckpt.optimizer.params}
        masters = {p.path: p.slots["fp32_master"] for p in ckpt.optimizer.params}
        assert len(by_name) == 29
        for r in range(2):
            at = 0
            for layer, e, fc in reversed([x for x in rows if x[1] in (2 * r, 2 * r + 1)]):
                name = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc{fc}.weight"
                got = by_name[name]
                want = full[pre.format(r, "exp_avg")][at:at + size[fc]]
                assert np.array_equal(got.slots["exp_avg"].numpy().reshape(-1), want.numpy()), name
                assert np.array_equal(masters[name].numpy().reshape(-1),
                                      full[pre.format(r, "param")][at:at + size[fc]].numpy()), name
                assert ckpt.optimizer.groups[got.group].hyperparams["is_expert_parallel"] is True
                at += size[fc]


LEGACY_SAME_RUN = REAL / "0.19.2" / "gpt_torch_no_distopt_tp1pp1dp2"


@pytest.mark.skipif(not LEGACY_SAME_RUN.exists(), reason="fixture not merged")
def test_real_torch_dist_agrees_with_the_legacy_reader_on_the_same_run():
    """The same seeded run saved as torch_dist dp_reshardable and as legacy torch files (no distributed
    optimizer: no bucket space there) gives the same names and the same values bit for bit, read by
    the two readers independently."""
    with io.open_checkpoint(DP_RESHARDABLE) as a, io.open_checkpoint(LEGACY_SAME_RUN) as b:
        assert [p.path for p in a.optimizer.params] == [p.path for p in b.optimizer.params] == LOCAL
        for pa, pb in zip(a.optimizer.params, b.optimizer.params, strict=True):
            assert set(pa.slots) == set(pb.slots)
            for slot in pa.slots:
                assert np.array_equal(pa.slots[slot].numpy(), pb.slots[slot].numpy()), (pa.path, slot)
            assert pa.step == pb.step == 3


OLD = REAL / "0.14.0"
FSMS = OLD / "torch_dist-fsms-tp2-dp2"
DPZERO = OLD / "torch_dist-dpzero-tp1-dp2"
FFN = 96
OLD_SHAPES = {"input_layernorm.weight": (H,), "self_attention.linear_proj.weight": (H, H),
              "self_attention.linear_qkv.weight": (128, H), "pre_mlp_layernorm.weight": (H,),
              "mlp.linear_fc1.weight": (2 * FFN, H), "mlp.linear_fc2.weight": (H, FFN)}


def _old_shape(name: str, vocab: int) -> tuple[int, ...]:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (vocab, H)
    if name == "decoder.final_layernorm.weight":
        return (H,)
    return OLD_SHAPES[name.split(".", 3)[3]]


@pytest.mark.skipif(not FSMS.exists(), reason="fixture not merged")
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_fully_sharded_model_space_decoded_as_section_2_5():
    """megatron-core 0.14.0's fully_sharded_model_space save (TP2 DP2): the N-D reformulated tensors
    torch's own dcp.load gives, decoded here by hand with mcore_data's global shape (fragment t of
    the local shape G / fragments, flattened, placed at t * local), equal statekit's parameters."""
    import torch.distributed.checkpoint as tdcp

    _generator()._mcore_module()  # torch's own unpickling of .metadata needs Megatron's class names
    it = FSMS / "iter_0000003"
    meta = tdcp.FileSystemReader(str(it)).read_metadata()
    mcore = meta.mcore_data
    keys = [k for k in mcore if k.startswith("optimizer.state.exp_avg.")]
    assert keys
    full = _torch_load(it, keys)
    with io.open_checkpoint(FSMS) as ckpt:
        state = ckpt.optimizer
        assert [p.path for p in state.params] == LOCAL
        assert ckpt.metadata["megatron.sharding"] == "fully_sharded_model_space"
        by_name = {p.path: p for p in state.params}
        seen = 0
        for key in keys:
            g = tuple(mcore[key]["nd_reformulated_orig_global_shape"])
            stored = full[key]
            frag = tuple(stored.shape[:-1])
            local = tuple(a // b for a, b in zip(g, frag, strict=True))
            decoded = torch.empty(g, dtype=stored.dtype)
            for t in np.ndindex(*frag):
                box = tuple(slice(i * n, (i + 1) * n) for i, n in zip(t, local, strict=True))
                decoded[box] = stored[t].reshape(local)
            target = key[len("optimizer.state.exp_avg."):]
            for lead in np.ndindex(*g[:_stacked(target)]):
                name = _local_name(_split(target, tuple(lead)))
                assert tuple(by_name[name].shape) == _old_shape(name, 128)  # vocab 100 padded to 16 x TP 2
                assert np.array_equal(by_name[name].slots["exp_avg"].numpy(), decoded[tuple(lead)].numpy()), name
                seen += 1
        assert seen == len(LOCAL)
    assert doctor_files(FSMS)["clean"]


@pytest.mark.skipif(not DPZERO.exists(), reason="fixture not merged")
def test_real_dp_zero_gather_scatter_cut_by_hand_computed_offsets():
    """megatron-core 0.14.0's dp_zero_gather_scatter save (TP1 DP2, tied embeddings): the coalesced
    state in the param_state object, as torch.load reads its bytes, cut at offsets computed here
    (parameters reversed; every size is a multiple of 64, so no gaps)."""
    import torch.distributed.checkpoint as tdcp

    _generator()._mcore_module()
    it = DPZERO / "iter_0000003"
    meta = tdcp.FileSystemReader(str(it)).read_metadata()
    key = "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1"
    info = next(v for k, v in meta.storage_data.items() if k.fqn == key)
    raw = (it / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    import io as _io

    coalesced = torch.load(_io.BytesIO(raw), weights_only=True)[0]
    (dtypes, flat), = coalesced[0].items()
    names = LOCAL[:-1]  # tied: no output layer
    offsets, at = {}, 0
    for name in reversed(names):
        offsets[name] = at
        at += int(np.prod(_old_shape(name, 112)))  # vocab 100 padded to a multiple of 16 x TP 1
    assert at == flat["numel_unpadded"]
    with io.open_checkpoint(DPZERO) as ckpt:
        state = ckpt.optimizer
        assert [p.path for p in state.params] == names
        for p in state.params:
            n = int(np.prod(p.shape))
            for slot, stored in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("fp32_master", "param")):
                want = flat[stored][offsets[p.path]:offsets[p.path] + n]
                assert np.array_equal(p.slots[slot].numpy().reshape(-1), want.numpy()), (p.path, slot)
    assert doctor_files(DPZERO)["clean"]


def _torch_dist_cases() -> list:
    return sorted({p.parent.parent for p in REAL.glob("*/*/*/metadata.json")})


@pytest.mark.parametrize("case", _torch_dist_cases(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_real_torch_dist_fixture_reads_proved(case):
    """Every torch_dist save megatron-core wrote for the fixtures opens with each parameter once,
    its states of its weight's shape, every master proved — but the 2-bucket fully_reshardable
    saves, refused and found by doctor."""
    if "2buckets" in case.name:
        with pytest.raises(FormatError, match="32a03b77c5"):
            io.open_checkpoint(case)
        assert not doctor_files(case)["clean"]
        return
    with io.open_checkpoint(case) as ckpt:
        assert ckpt.format == "megatron-dist"
        state = ckpt.optimizer
        names = [p.path for p in state.params]
        assert len(set(names)) == len(names) and names
        weights = {m.path: m for m in ckpt.model.params}
        assert set(weights) == set(names)
        assert f"proved: {len(names)} of {len(names)} parameters" in " ".join(state.notes)
        for p in state.params:
            assert set(p.slots) == {"exp_avg", "exp_avg_sq", "fp32_master"}, p.path
            assert all(tuple(r.shape) == tuple(weights[p.path].shape) for r in p.slots.values()), p.path
            assert re.fullmatch(r"(embedding\.|output_layer\.|decoder\.final_layernorm\.|decoder\.layers\.\d+\.).+",
                                p.path), p.path
    assert doctor_files(case)["clean"]


@pytest.mark.parametrize("a,b", [
    ("0.14.0/moe-ep2-fsms-dp2", "0.14.0/moe-ep2-dpzero-dp2"),  # reformulated model space vs coalesced buckets
    ("0.19.2/moe_torch_dist_dp_reshardable_ep2dp2", "0.19.2/moe_torch_distopt_ep2dp2"),  # vs the legacy reader
])
def test_real_same_run_two_layouts_read_equal(a, b):
    """One seeded run saved in two layouts, each cut by its own code path, reads the same
    parameters with the same values bit for bit."""
    from statekit.ops.diff import diff_files

    assert (REAL / a).exists() and (REAL / b).exists(), "the megatron-core fixtures are committed"
    result = diff_files(REAL / a, REAL / b)
    assert result["equal"], result.get("summary")
    with io.open_checkpoint(REAL / a) as ca, io.open_checkpoint(REAL / b) as cb:
        assert [p.path for p in ca.optimizer.params] == [p.path for p in cb.optimizer.params]
