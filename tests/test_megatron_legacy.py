"""Megatron legacy checkpoints (iter_N/mp_rank_*/model_optim_rng.pt [+ distrib_optim.pt]).

Tests named ``test_synthetic_*`` read SYNTHETIC checkpoints written here with real torch in
Megatron's dict shapes (tests/megatron_synth.py), compared with the global tensors torch cut the
shards from; tests on files megatron-core itself wrote read fixtures/megatron/.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from statekit import io
from statekit.errors import FormatError, StatekitError, UnsafePickleError
from statekit.formats import megatron_legacy, registry
from statekit.frameworks.megatron import config, names
from statekit.frameworks.megatron.proof import ProofError

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

sys.path.insert(0, os.path.dirname(__file__))
import megatron_synth as synth  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torch(ref):
    import numpy as np

    arr = ref.numpy()
    if ref.dtype == "BF16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr))


def _check_against(ckpt, truth):
    state = ckpt.optimizer
    assert [p.path for p in state.params] == list(truth)
    weights = ckpt.model.by_path()
    for p in state.params:
        t = truth[p.path]
        assert tuple(p.shape) == tuple(t["master"].shape)
        assert torch.equal(_torch(p.slots["exp_avg"]), t["exp_avg"]), p.path
        assert torch.equal(_torch(p.slots["exp_avg_sq"]), t["exp_avg_sq"]), p.path
        assert torch.equal(_torch(p.slots["fp32_master"]), t["master"]), p.path
        assert torch.equal(_torch(weights[p.path].tensor), t["weight"]), p.path


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 2), (2, 2, 2), (1, 2, 3)])
def test_synthetic_distributed_every_element_named_and_joined(tmp_path, tp, pp, dp):
    truth = synth.write(str(tmp_path), tp=tp, pp=pp, dp=dp, layers=4)
    ckpt = io.open_checkpoint(str(tmp_path))
    assert ckpt.format == "megatron-legacy"
    _check_against(ckpt, truth)
    state = ckpt.optimizer
    assert state.family == "adamw"
    assert {p.step for p in state.params} == {5}
    # group membership by Megatron's rule: biases and 1-D parameters in the no-weight-decay group
    no_wd = [g for g in state.groups if g.hyperparams["wd_mult"] == 0.0]
    assert len(no_wd) == 1
    assert set(no_wd[0].keys) == {n for n, t in truth.items() if t["master"].dim() == 1}
    assert ckpt.metadata["megatron.tp"] == str(tp) and ckpt.metadata["megatron.iteration"] == "5"
    assert ckpt.schedulers[0]["num_steps"] == 40
    assert any(n.startswith("proved: ") for n in state.notes)


def test_synthetic_iteration_folder_and_save_root_both(tmp_path):
    synth.write(str(tmp_path), tp=2)
    assert registry.sniff(str(tmp_path)) == "megatron-legacy"
    assert registry.sniff(str(tmp_path / "iter_0000005")) == "megatron-legacy"
    a = io.open_checkpoint(str(tmp_path / "iter_0000005"))
    assert [p.path for p in a.optimizer.params] == [p.path for p in io.open_checkpoint(str(tmp_path)).optimizer.params]


@pytest.mark.parametrize("rule", ["0.7", "<=0.6"])
def test_synthetic_older_bucket_rules(tmp_path, rule):
    truth = synth.write(str(tmp_path), tp=2, dp=3, version_rule=rule, coalesced=rule != "<=0.6")
    ckpt = io.open_checkpoint(str(tmp_path))
    _check_against(ckpt, truth)
    assert any(f"bucket layout {rule}" in n for n in ckpt.optimizer.notes)


def test_synthetic_several_buckets(tmp_path):
    # overlap_grad_reduce with a small bucket size: several buckets on pp rank 0, one on rank 1
    truth = synth.write(str(tmp_path), pp=2, dp=2, overlap=True, bucket_size=500)
    ckpt = io.open_checkpoint(str(tmp_path))
    _check_against(ckpt, truth)
    assert any("bucket size 500" in n and "1 bucket(s)" not in n for n in ckpt.optimizer.notes)


def test_synthetic_non_distributed_optimizer(tmp_path):
    truth = synth.write(str(tmp_path), tp=2, pp=2, distributed=False)
    ckpt = io.open_checkpoint(str(tmp_path))
    _check_against(ckpt, truth)
    assert any("non-distributed" in n for n in ckpt.optimizer.notes)


def test_synthetic_joined_tp_shards_equal_torch_load_of_the_same_files(tmp_path):
    """The joined tensors against torch's own load of the rank files, joined by torch."""
    synth.write(str(tmp_path), tp=2, swiglu=True)
    ckpt = io.open_checkpoint(str(tmp_path))
    it = tmp_path / "iter_0000005"
    loaded = [torch.load(it / f"mp_rank_{r:02d}" / "model_optim_rng.pt", weights_only=False) for r in range(2)]
    fc1 = [m["model"]["decoder.layers.0.mlp.linear_fc1.weight"] for m in loaded]
    want = torch.cat([f.chunk(2)[0] for f in fc1] + [f.chunk(2)[1] for f in fc1])
    assert torch.equal(_torch(ckpt.model.by_path()["decoder.layers.0.mlp.linear_fc1.weight"].tensor), want)
    proj = [m["model"]["decoder.layers.1.self_attention.linear_proj.weight"] for m in loaded]
    assert torch.equal(_torch(ckpt.model.by_path()["decoder.layers.1.self_attention.linear_proj.weight"].tensor),
                       torch.cat(proj, dim=1))


def test_synthetic_wrong_bucket_size_in_args_is_refused(tmp_path):
    # the coalesced file is bucket-size agnostic wherever a bucket closes on a 64-element boundary
    # (mcore 0.7's "agnostic to the bucket size"): 650 closes one after a 16-element layernorm
    synth.write(str(tmp_path), dp=2, overlap=True, bucket_size=650)
    _rewrite_args(tmp_path, overlap_grad_reduce=False)
    with pytest.raises(FormatError, match=r"numel_unpadded|does not hold") as exc:
        io.open_checkpoint(str(tmp_path))
    assert "\n" not in str(exc.value)


def test_synthetic_swapped_parameter_order_is_refused_naming_the_parameter(tmp_path):
    synth.write(str(tmp_path), dp=2, swap_order=True)
    with pytest.raises(ProofError, match=r"parameter decoder\.layers\.\d\.mlp\.linear_fc[12]\.weight: its fp32 master "
                       r"rounded to BF16 is not the stored weight .* the bucket layout .* does not hold"):
        io.open_checkpoint(str(tmp_path))


def test_synthetic_truncated_distrib_optim_is_refused(tmp_path):
    synth.write(str(tmp_path), dp=2)
    file = tmp_path / "iter_0000005" / "mp_rank_00" / "distrib_optim.pt"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError) as exc:
        io.open_checkpoint(str(tmp_path))
    assert "distrib_optim.pt" in str(exc.value) and "\n" not in str(exc.value)


def test_synthetic_short_coalesced_tensor_is_refused(tmp_path):
    synth.write(str(tmp_path), dp=2)
    file = tmp_path / "iter_0000005" / "mp_rank_00" / "distrib_optim.pt"
    d = torch.load(file, weights_only=False)
    entry = next(iter(d[0].values()))
    for k in ("param", "exp_avg", "exp_avg_sq"):
        entry[k] = entry[k][:-100].clone()
    entry["numel_unpadded"] -= 100
    torch.save(d, file)
    with pytest.raises(FormatError, match=r"buffer 0 .*numel_unpadded is \d+; the layout"):
        io.open_checkpoint(str(tmp_path))


def test_synthetic_missing_rank_folder_is_refused(tmp_path):
    synth.write(str(tmp_path), tp=2, pp=2)
    import shutil

    shutil.rmtree(tmp_path / "iter_0000005" / "mp_rank_01_001")
    with pytest.raises(FormatError, match=r"rank folders for \(tp, pp, ep\) \[\(1, 1, 0\)\] are missing"):
        io.open_checkpoint(str(tmp_path))


def test_synthetic_cli_inspect_and_doctor(tmp_path):
    synth.write(str(tmp_path), tp=2, pp=2, dp=2)
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "statekit", "inspect", str(tmp_path)], capture_output=True,
                         text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "decoder.layers.1.mlp.linear_fc1.weight" in out.stdout and "megatron-legacy" in out.stdout
    assert "run: iteration 5, TP 2 · PP 2 · EP 1 · DP 2" in out.stdout
    doc = subprocess.run([sys.executable, "-m", "statekit", "doctor", str(tmp_path)], capture_output=True,
                         text=True, env=env)
    assert doc.returncode in (0, 1), doc.stderr
    assert "Traceback" not in doc.stderr
    diff = subprocess.run([sys.executable, "-m", "statekit", "diff", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, env=env)
    assert diff.returncode == 0, diff.stderr


def test_synthetic_bad_folder_cli_one_line(tmp_path):
    synth.write(str(tmp_path), tp=2, dp=2, swap_order=True)
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "statekit", "inspect", str(tmp_path)], capture_output=True,
                         text=True, env=env)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "does not hold" in out.stderr


def test_foreign_global_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    synth.write(str(tmp_path))
    file = tmp_path / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"
    obj = torch.load(file, weights_only=False)
    obj["evil"] = Evil()
    torch.save(obj, file)
    with pytest.raises(UnsafePickleError):
        io.open_checkpoint(str(tmp_path))


def _rewrite_args(root, **changes):
    it = root / "iter_0000005"
    for folder in sorted(it.iterdir()):
        file = folder / "model_optim_rng.pt"
        obj = torch.load(file, weights_only=False)
        for k, v in changes.items():
            setattr(obj["args"], k, v)
        torch.save(obj, file)


# ----------------------------------------------------------------------- config and names


def test_rank_folder_names_resolved_with_args():
    pp2 = config.from_args({"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 1})
    ep2 = config.from_args({"pipeline_model_parallel_size": 1, "expert_model_parallel_size": 2})
    def where(name, cfg):
        r = names.parse_rank_dir(name, cfg)
        return r.tp, r.pp, r.ep

    assert where("mp_rank_01_001", pp2) == (1, 1, 0)
    assert where("mp_rank_01_001", ep2) == (1, 0, 1)
    assert where("mp_rank_00_002_001", ep2) == (0, 2, 1)
    with pytest.raises(FormatError, match="args do not say"):
        names.parse_rank_dir("mp_rank_00_001", config.from_args({}))


def test_layer_offsets_uniform_vp_and_uneven():
    uniform = config.from_args({"pipeline_model_parallel_size": 4, "num_layers": 8})
    assert [names.layer_offset(uniform, r) for r in range(4)] == [0, 2, 4, 6]
    # VP 2, PP 2, 8 layers: chunk 0 of rank 0 holds 0-1, rank 1 2-3; chunk 1 of rank 0 4-5, rank 1 6-7
    vp = config.from_args({"pipeline_model_parallel_size": 2, "num_layers": 8,
                           "virtual_pipeline_model_parallel_size": 2})
    assert [names.layer_offset(vp, r, v) for v in range(2) for r in range(2)] == [0, 2, 4, 6]
    uneven = config.from_args({"pipeline_model_parallel_size": 3, "num_layers": 8,
                               "decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 2})
    assert [names.layer_offset(uneven, r) for r in range(3)] == [0, 2, 6]
    moe = config.from_args({"expert_model_parallel_size": 2, "num_experts": 4})
    assert names.globalize("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", moe, 0, None, 1) == \
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    assert names.globalize("decoder.layers.0.mlp.experts.linear_fc2.weight1", moe, 0, None, 1) == \
        "decoder.layers.0.mlp.experts.linear_fc2.weight3"


def test_missing_fact_is_named():
    cfg = config.from_args({"tensor_model_parallel_size": 1}, "x.pt")
    with pytest.raises(StatekitError, match=r"^x\.pt: args has no overlap_grad_reduce: needed for"):
        cfg.bucket_size(10, 0, 0)
    assert config.from_args({"overlap_grad_reduce": True, "ddp_num_buckets": 4}).bucket_size(100, 0, 0) == 25
    assert config.from_args({"overlap_grad_reduce": True, "data_parallel_size": 64}).bucket_size(1, 0, 0) == 64_000_000
    assert config.from_args({"overlap_grad_reduce": True, "ddp_bucket_size": 9}).bucket_size(1, 1, 0) is None


def test_container_sniffer_ignores_other_folders(tmp_path):
    (tmp_path / "iter_0000001").mkdir()
    assert not megatron_legacy.claims(b"", str(tmp_path))


# --------------------------------------------------- files megatron-core itself wrote (fixtures)

FIXTURES = os.path.join(ROOT, "fixtures", "megatron")


def _legacy_fixtures() -> list[str]:
    import json

    manifest = os.path.join(FIXTURES, "manifest.json")
    if not os.path.isfile(manifest):
        return []
    with open(manifest) as fh:
        cases = json.load(fh)["cases"]
    return sorted(k for k, v in cases.items() if v.get("format") == "torch"
                  and os.path.isdir(os.path.join(FIXTURES, k)))


def _fixture_case(key: str) -> dict:
    import json

    with open(os.path.join(FIXTURES, "manifest.json")) as fh:
        return json.load(fh)["cases"][key]


LEGACY = _legacy_fixtures()


def _torch_load(file):
    """torch's own load of a Megatron file; Megatron's classes (absent here) stand in as stubs."""
    import pickle
    import types

    class _Stub:
        def __init__(self, *a, **k):
            pass

        def __setstate__(self, state):
            pass

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("megatron"):
                return _Stub
            return super().find_class(module, name)

    module = types.ModuleType("megatron_stub_pickle")
    module.Unpickler, module.load = Unpickler, pickle.load
    return torch.load(file, weights_only=False, pickle_module=module)


@pytest.mark.skipif(not LEGACY, reason="no legacy fixtures written by megatron-core yet")
@pytest.mark.parametrize("key", LEGACY)
def test_megatron_written_every_element_named_and_proved(key):
    """Every parameter of the model named, every element of every bucket-space tensor claimed by
    exactly one parameter (the rest zeros), the slices checked by torch's own rounding against the
    weights torch loads from the same files."""
    from statekit.frameworks.megatron import legacy

    case = _fixture_case(key)
    path = os.path.join(FIXTURES, key)
    reader = legacy._Reader(path)
    ckpt = reader.read()
    state = ckpt.optimizer
    assert ckpt.format == "megatron-legacy"
    assert all(set(p.slots) == {"exp_avg", "exp_avg_sq", "fp32_master"} for p in state.params)
    layers = case["model"]["num_layers"]
    layer_ids = {int(p.path.split(".")[2]) for p in state.params if p.path.startswith("decoder.layers.")}
    assert layer_ids == set(range(layers))
    h = case["model"]["hidden_size"]
    shapes = {p.path: tuple(p.shape) for p in state.params}
    assert shapes["embedding.word_embeddings.weight"] == (case["padded_vocab_size"], h)
    groups, kv = case["model"]["num_query_groups"], case["model"]["kv_channels"]
    heads = case["model"]["num_attention_heads"]
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == ((heads + 2 * groups) * kv, h)
    ffn = case["model"].get("ffn_hidden_size")
    if "decoder.layers.0.mlp.linear_fc1.weight" in shapes:
        assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * ffn, h)
    for rank in reader.rank_records:
        sd = _torch_load(os.path.join(rank.folder, "model_optim_rng.pt"))
        models = [sd["model"]] if "model" in sd else [sd[f"model{i}"] for i in range(len(rank.chunks))]
        distrib = None
        if case["distributed_optimizer"]:
            distrib = _torch_load(os.path.join(rank.folder, "distrib_optim.pt"))
            flat = megatron_legacy.load(os.path.join(rank.folder, "distrib_optim.pt"))
        claimed: dict = {}
        for chunk in rank.chunks:
            for p in chunk:
                weight = models[p.chunk][p.name]
                if p.master is None:
                    continue
                # torch's own rounding of the master statekit cut, against torch's own load of the weight
                assert torch.equal(_torch(p.master).to(weight.dtype), weight), p.name
                if distrib is None:
                    continue
                parts = flat if isinstance(flat, list) else [flat]
                tparts = distrib if isinstance(distrib, list) else [distrib]
                for i, part in enumerate(parts):
                    if part is None:
                        continue
                    for gbuf, entry in part.items():
                        if not isinstance(gbuf, int):
                            continue
                        (tensors,) = entry.values()
                        base = tensors["param"].span
                        if base.file.path != p.master.span.file.path or not (
                                base.offset <= p.master.span.offset < base.offset + base.length):
                            continue
                        lo = (p.master.span.offset - base.offset) // 4
                        n = p.weight.numel
                        (ttensors,) = tparts[i][gbuf].values()
                        for slot, key_ in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                            assert torch.equal(_torch(p.moments[slot]).reshape(-1), ttensors[key_][lo:lo + n]), p.name
                        mask = claimed.setdefault((i, gbuf), torch.zeros(ttensors["param"].numel(), dtype=torch.bool))
                        assert not mask[lo:lo + n].any(), f"{p.name} overlaps another parameter"
                        mask[lo:lo + n] = True
        if distrib is not None:
            assert claimed, f"{rank.folder}: no parameter's slices were found in distrib_optim.pt"
            tparts = distrib if isinstance(distrib, list) else [distrib]
            for (i, gbuf), mask in claimed.items():
                (ttensors,) = tparts[i][gbuf].values()
                for key_ in ("param", "exp_avg", "exp_avg_sq"):
                    assert not ttensors[key_][~mask].any(), f"{rank.folder}: unclaimed nonzero {key_} elements"
    assert any(n.startswith("proved: ") for n in state.notes)
