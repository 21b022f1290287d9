"""Megatron legacy checkpoints (iter_N/mp_rank_*/model_optim_rng.pt [+ distrib_optim.pt]).

Tests named ``test_synthetic_*`` read SYNTHETIC checkpoints written here with real torch in
Megatron's dict shapes (tests/megatron_synth.py), compared with the global tensors torch cut the
shards from; tests on files megatron-core itself wrote read fixtures/megatron/.
"""

from __future__ import annotations

import os
import re
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


def test_synthetic_groups_matched_by_identity_not_position(tmp_path):
    # mcore <= 0.12 ordered groups as first seen on each rank: a stage may list them in another order
    truth = synth.write(str(tmp_path), pp=2, dp=2, groups_reversed_last_stage=True)
    state = io.open_checkpoint(str(tmp_path)).optimizer
    assert len(state.groups) == 2
    no_wd = next(g for g in state.groups if g.hyperparams["wd_mult"] == 0.0)
    assert set(no_wd.keys) == {n for n, t in truth.items() if t["master"].dim() == 1}


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


def test_synthetic_virtual_pipeline_chunks(tmp_path):
    # PP 2 × VP 2, 8 layers: model0/model1 per rank, layers made global by chunk and rank
    truth = synth.write(str(tmp_path), tp=2, pp=2, vp=2, dp=2, layers=8, overlap=True, bucket_size=300)
    ckpt = io.open_checkpoint(str(tmp_path))
    _check_against(ckpt, truth)


@pytest.mark.parametrize("distributed", [True, False])
def test_synthetic_moe_chained_optimizer_dense_and_expert(tmp_path, distributed):
    # EP 2, 4 experts (2 per EP rank), dense DP 2 and expert DP 1: a ChainedOptimizer whose dense
    # state is in the EP-rank-0 folder only; local experts 0-1 of EP rank 1 are experts 2-3
    truth = synth.write(str(tmp_path), dp=2, ep=2, experts=4, distributed=distributed)
    ckpt = io.open_checkpoint(str(tmp_path))
    _check_against(ckpt, truth)
    expert_groups = [g for g in ckpt.optimizer.groups if g.hyperparams.get("is_expert_parallel")]
    assert len(expert_groups) == 1
    assert set(expert_groups[0].keys) == {n for n in truth if ".experts." in n}


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


# fixtures/megatron/ (the fixture generator's cases) and fixtures/megatron_buckets/ (two more legacy
# cases with several buckets, scripts/make_megatron_legacy_buckets.py through the same driver)
FIXTURE_ROOTS = (FIXTURES, os.path.join(ROOT, "fixtures", "megatron_buckets"))


def _normalized(case: dict) -> dict:
    """A case of fixtures/megatron/0.14.0/manifest.json (the older generator's keys) in the keys of
    fixtures/megatron/manifest.json."""
    if "num_layers" not in case:
        return case
    m = case["model"]
    return {**case, "model": {"num_layers": case["num_layers"], "hidden_size": m["hidden"],
                              "ffn_hidden_size": m["ffn_hidden"], "num_attention_heads": m["heads"],
                              "num_query_groups": m["query_groups"], "kv_channels": m["kv_channels"]}}


def _manifests() -> dict[str, tuple[str, dict]]:
    import glob
    import json

    out = {}
    for root in FIXTURE_ROOTS:
        for manifest in [os.path.join(root, "manifest.json"), *sorted(glob.glob(os.path.join(root, "*", "manifest.json")))]:
            if not os.path.isfile(manifest):
                continue
            base = os.path.dirname(manifest)
            with open(manifest) as fh:
                for key, case in json.load(fh)["cases"].items():
                    path = os.path.join(base, key)
                    out[os.path.relpath(path, os.path.dirname(FIXTURES))] = (path, _normalized(case))
    return out


def _legacy_fixtures() -> list[str]:
    return sorted(k for k, (path, v) in _manifests().items() if v.get("format") == "torch" and os.path.isdir(path))


LEGACY = _legacy_fixtures()


class _Fake:
    """A stand-in for a Megatron class (absent here) that pickles back as the same global."""

    def __init__(self, *args):
        self._args = args

    def __reduce__(self):
        import copyreg

        state = {k: v for k, v in self.__dict__.items() if k != "_args"}
        if "_args" in self.__dict__:  # made by REDUCE (an enum): called again with its arguments
            return (type(self), self._args)
        return (copyreg.__newobj__, (type(self),), state)  # NEWOBJ + BUILD (a dataclass)


def _fake_modules():
    """{module name: module} holding a :class:`_Fake` subclass for each Megatron global asked for."""
    import pickle
    import types

    modules: dict[str, types.ModuleType] = {}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("megatron"):
                parts = module.split(".")
                for k in range(1, len(parts)):  # (the packages above it, for pickle's import when saving)
                    modules.setdefault(".".join(parts[:k]), types.ModuleType(".".join(parts[:k])))
                mod = modules.setdefault(module, types.ModuleType(module))
                if not hasattr(mod, name):
                    setattr(mod, name, type(name, (_Fake,), {"__module__": module, "__qualname__": name}))
                return getattr(mod, name)
            return super().find_class(module, name)

    pickle_module = types.ModuleType("megatron_fake_pickle")
    pickle_module.Unpickler, pickle_module.load = Unpickler, pickle.load
    return modules, pickle_module


def _torch_load(file, modules=None):
    """torch's own load of a Megatron file; Megatron's classes stand in as :class:`_Fake` s."""
    found, pickle_module = _fake_modules()
    obj = torch.load(file, weights_only=False, pickle_module=pickle_module)
    if modules is not None:
        modules.update(found)
    return obj


@pytest.mark.skipif(not LEGACY, reason="no legacy fixtures written by megatron-core yet")
@pytest.mark.parametrize("key", LEGACY)
def test_megatron_written_every_element_named_and_proved(key):
    """Every parameter of the model named, every element of every bucket-space tensor claimed by
    exactly one parameter (the rest zeros), the slices checked by torch's own rounding against the
    weights torch loads from the same files."""
    from statekit.frameworks.megatron import legacy

    path, case = _manifests()[key]
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
    if "padded_vocab_size" in case:
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
    if case["tp"] > 1:  # the joined tensors against torch's own cat of the rank files' shards
        pp = case["pp"]
        folder = os.path.dirname(reader.rank_records[0].folder)
        last = f"_{pp - 1:03d}" if pp > 1 else ""
        loads = [_torch_load(os.path.join(folder, f"mp_rank_{t:02d}{last}", "model_optim_rng.pt"))["model"]
                 for t in range(case["tp"])]
        weights = ckpt.model.by_path()
        layer = case["model"]["num_layers"] - 1
        local = layer % (case["model"]["num_layers"] // pp)
        fc1 = [m[f"decoder.layers.{local}.mlp.linear_fc1.weight"] for m in loads]
        want = {
            "mlp.linear_fc1.weight": torch.cat([f.chunk(2)[0] for f in fc1] + [f.chunk(2)[1] for f in fc1]),
            "self_attention.linear_qkv.weight": torch.cat(
                [m[f"decoder.layers.{local}.self_attention.linear_qkv.weight"] for m in loads]),
            "self_attention.linear_proj.weight": torch.cat(
                [m[f"decoder.layers.{local}.self_attention.linear_proj.weight"] for m in loads], dim=1),
            "mlp.linear_fc2.weight": torch.cat([m[f"decoder.layers.{local}.mlp.linear_fc2.weight"] for m in loads],
                                               dim=1),
        }
        for suffix, tensor in want.items():
            assert torch.equal(_torch(weights[f"decoder.layers.{layer}.{suffix}"].tensor), tensor), suffix


def test_synthetic_joined_tensors_stream_in_bounded_pieces(tmp_path):
    truth = synth.write(str(tmp_path), tp=2)
    ckpt = io.open_checkpoint(str(tmp_path))
    for name in ("decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight"):
        p = ckpt.optimizer.find(name)
        pieces = list(p.slots["exp_avg"].pieces(7))
        assert max(x.size for x in pieces) <= 7
        chunks = list(p.slots["exp_avg_sq"].iter_bytes(40))
        assert max(len(c) for c in chunks) <= 40
        import numpy as np

        assert np.array_equal(np.concatenate(pieces), truth[name]["exp_avg"].reshape(-1).numpy())


REAL_TP2PP2 = os.path.join(FIXTURES, "0.19.2", "gpt_torch_distopt_tp2pp2dp1")


def _real_copy(tmp_path):
    import shutil

    assert os.path.isdir(REAL_TP2PP2), "the megatron-core fixture gpt_torch_distopt_tp2pp2dp1 is committed"
    dest = tmp_path / "ckpt"
    shutil.copytree(REAL_TP2PP2, dest)
    return dest


def _distrib_entry(d):
    ((_, entry),) = d[0].items()
    return entry


def test_megatron_written_states_swapped_between_parameters_are_refused(tmp_path):
    """Two same-size parameters' states exchanged in megatron-core's own distrib_optim.pt: the
    element counts all still fit; the proof names the first parameter whose master is not its weight."""
    from statekit.frameworks.megatron import legacy

    dest = _real_copy(tmp_path)
    reader = legacy._Reader(str(dest))
    reader.read()
    rank = next(r for r in reader.rank_records if r.where.pp == 1 and r.where.tp == 0)
    norms = [p for c in rank.chunks for p in c if p.name.endswith("layernorm.weight")][:2]
    base = megatron_legacy.load(os.path.join(rank.folder, "distrib_optim.pt"))
    start = _distrib_entry(base)["param"].span.offset
    at = [(p.master.span.offset - start) // 4 for p in norms]
    file = os.path.join(rank.folder, "distrib_optim.pt")
    d = torch.load(file, weights_only=True)
    entry = _distrib_entry(d)
    n = norms[0].weight.numel
    for key in ("param", "exp_avg", "exp_avg_sq"):
        a, b = entry[key][at[0]:at[0] + n].clone(), entry[key][at[1]:at[1] + n].clone()
        entry[key][at[0]:at[0] + n], entry[key][at[1]:at[1] + n] = b, a
    torch.save(d, file)
    with pytest.raises(ProofError, match=r"parameter decoder\.layers\.0\.\w+\.weight: its fp32 master rounded to BF16 "
                                         r"is not the stored weight .* the bucket layout \(rule >=0\.8"):
        io.open_checkpoint(str(dest))


def test_megatron_written_shifted_state_is_refused(tmp_path):
    """The state shifted by 64 elements (what mcore's fully_reshardable multi-bucket save does to
    every parameter after bucket 0), total length kept: refused by the proof."""
    dest = _real_copy(tmp_path)
    file = dest / "iter_0000003" / "mp_rank_01_000" / "distrib_optim.pt"
    d = torch.load(file, weights_only=True)
    entry = _distrib_entry(d)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        entry[key] = torch.roll(entry[key], 64)
    torch.save(d, file)
    with pytest.raises(ProofError, match="does not hold"):
        io.open_checkpoint(str(dest))


def test_megatron_written_truncated_distrib_optim_is_refused(tmp_path):
    dest = _real_copy(tmp_path)
    file = dest / "iter_0000003" / "mp_rank_00_001" / "distrib_optim.pt"
    d = torch.load(file, weights_only=True)
    entry = _distrib_entry(d)
    for key in ("param", "exp_avg", "exp_avg_sq"):
        entry[key] = entry[key][:-64].clone()
    torch.save(d, file)
    with pytest.raises(FormatError, match=r"mp_rank_00_001/distrib_optim.pt: buffer 0 .*: 'param' has \d+ elements, "
                                          r"numel_unpadded is \d+"):
        io.open_checkpoint(str(dest))


def test_synthetic_context_parallel_shards_over_dp_times_cp(tmp_path):
    # the distributed optimizer's group is DP × CP: DP 2 × CP 3 pads bucket ends to lcm(6, 128)
    truth = synth.write(str(tmp_path), dp=2, cp=3)
    ckpt = io.open_checkpoint(str(tmp_path))
    _check_against(ckpt, truth)
    assert any("DP×CP 6" in n for n in ckpt.optimizer.notes)


def test_synthetic_release_folder(tmp_path):
    truth = synth.write(str(tmp_path), tp=2, release=True)
    assert megatron_legacy.iteration_dir(str(tmp_path)).endswith("release")
    _check_against(io.open_checkpoint(str(tmp_path)), truth)


def test_proof_rounding_per_dtype():
    import ml_dtypes
    import numpy as np

    from statekit.frameworks.megatron import proof
    from statekit.tensor import TensorRef

    rng = np.random.default_rng(0)
    master = np.concatenate([rng.standard_normal(5000).astype(np.float32),
                             np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40], np.float32)])
    for dtype, np_dtype in (("BF16", ml_dtypes.bfloat16), ("F16", np.float16), ("F32", np.float32)):
        weight = master.astype(np_dtype)  # numpy's / ml_dtypes' round-to-nearest-even
        assert proof.prove("w", TensorRef.from_array(master), TensorRef.from_array(weight, dtype), "r") == master.size
        bad = weight.copy()
        bad[17] = np_dtype(3.0)
        with pytest.raises(proof.ProofError, match=rf"parameter w: .* rounded to {dtype} is not the stored weight at "
                                                   r"element 17 of 5006 .*: rule X does not hold"):
            proof.prove("w", TensorRef.from_array(master), TensorRef.from_array(bad, dtype), "rule X")
    # torch's own rounding (what Megatron's copy into the model does), ties and subnormals included
    ties = (np.arange(1 << 16, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    for values in (master, ties, rng.standard_normal(1 << 16).astype(np.float32) * 1e-39):
        t = torch.from_numpy(values.copy())
        for dtype, tdt in (("BF16", torch.bfloat16), ("F16", torch.float16)):
            want = t.to(tdt).view(torch.int16).numpy().view(np.uint16)
            got = proof.rounded_bits(values, dtype)
            nan = np.isnan(values)
            assert np.array_equal(got[~nan], want[~nan]), dtype
    with pytest.raises(proof.ProofError, match="its master has 5006 elements, the stored weight 5"):
        proof.prove("w", TensorRef.from_array(master), TensorRef.from_array(master[:5]), "r")


def test_one_rank_folder_or_file_reads_the_whole_checkpoint(tmp_path):
    truth = synth.write(str(tmp_path), tp=2, dp=2)
    rank = tmp_path / "iter_0000005" / "mp_rank_01"
    for given in (rank, rank / "model_optim_rng.pt", rank / "distrib_optim.pt"):
        ckpt = io.open_checkpoint(str(given))
        assert ckpt.format == "megatron-legacy"
        _check_against(ckpt, truth)


REAL_2BUCKETS = os.path.join(ROOT, "fixtures", "megatron_buckets", "0.19.2", "legacy_distopt_dp2_2buckets")


@pytest.mark.parametrize("change", [{"ddp_num_buckets": 3}, {"overlap_grad_reduce": False}])
def test_megatron_written_coalesced_file_is_bucket_size_agnostic_at_64_element_sizes(tmp_path, monkeypatch, change):
    """megatron-core's own 2-bucket save with its args' bucket settings changed (re-pickled with the
    same globals). Every parameter of this model has a multiple of 64 elements, so no 64-element gap
    is padded anywhere and the coalesced file is the same for any bucket size (mcore 0.7's
    "agnostic to the bucket size"): it reads the same and proves. (Where a gap exists, a wrong setting
    is refused: test_synthetic_wrong_bucket_size_in_args_is_refused.)"""
    import shutil

    import numpy as np

    assert os.path.isdir(REAL_2BUCKETS), "the megatron-core fixture legacy_distopt_dp2_2buckets is committed"
    dest = tmp_path / "ckpt"
    shutil.copytree(REAL_2BUCKETS, dest)
    file = dest / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    modules: dict = {}
    obj = _torch_load(file, modules)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    assert all(p.numel() % 64 == 0 for p in obj["model"].values() if isinstance(p, torch.Tensor))
    for k, v in change.items():
        setattr(obj["args"], k, v)
    torch.save(obj, file)
    a, b = io.open_checkpoint(str(REAL_2BUCKETS)), io.open_checkpoint(str(dest))
    assert "2 bucket(s)" in " ".join(a.optimizer.notes) and "2 bucket(s)" not in " ".join(b.optimizer.notes)
    for p, q in zip(a.optimizer.params, b.optimizer.params, strict=True):
        assert p.path == q.path
        for slot in p.slots:
            assert np.array_equal(p.slots[slot].numpy(), q.slots[slot].numpy())


def test_synthetic_state_in_alignment_gaps_is_warned_of(tmp_path):
    synth.write(str(tmp_path), dp=2)
    file = tmp_path / "iter_0000005" / "mp_rank_00" / "distrib_optim.pt"
    d = torch.load(file, weights_only=True)
    entry = next(iter(d[0].values()))
    gap = (entry["exp_avg"] == 0).nonzero()[0].item()  # the first zero: an alignment gap (moments are random)
    entry["exp_avg"][gap] = 1.0
    torch.save(d, file)
    ckpt = io.open_checkpoint(str(tmp_path))
    assert [w for w in ckpt.warnings if "1 exp_avg elements that no parameter owns" in w]
    assert not io.open_checkpoint(str(REAL_TP2PP2)).warnings if os.path.isdir(REAL_TP2PP2) else True


@pytest.mark.parametrize("tracker,message", [
    ("zzz", "latest_checkpointed_iteration.txt holds 'zzz', not an iteration number or 'release'"),
    ("9", "latest_checkpointed_iteration.txt names iter_0000009, which holds no mp_rank_"),
])
def test_synthetic_bad_tracker_is_refused_by_name(tmp_path, tracker, message):
    synth.write(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(tracker)
    assert registry.sniff(str(tmp_path)) == "megatron-legacy"
    with pytest.raises(FormatError, match=re.escape(message)):
        io.open_checkpoint(str(tmp_path))


def test_synthetic_distrib_optim_not_a_dict_is_refused(tmp_path):
    synth.write(str(tmp_path))
    file = tmp_path / "iter_0000005" / "mp_rank_00" / "distrib_optim.pt"
    torch.save(5, file)
    with pytest.raises(FormatError, match=r"mp_rank_00/distrib_optim.pt: distrib_optim.pt holds an int, not a dict"):
        io.open_checkpoint(str(tmp_path))
