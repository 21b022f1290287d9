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


# ---------------------------------------------------------------------------------------------------------------
# train_state.pt: the references are torch.load of the files Bridge wrote (torch 2.13, weights_only=True, as
# Bridge's own read_train_state loads them), never statekit's output

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

ITER = os.path.join(FIX, "iter_0000003")
TRAIN_STATE_KEYS = ["step", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
                    "floating_point_operations_so_far", "do_train", "do_valid", "do_test"]  # Bridge's TrainState


def _torch_train_state(path):
    torch = pytest.importorskip("torch")
    sd = torch.load(path, weights_only=True, map_location="cpu")
    return {k: v.item() for k, v in sd.items()}, {k: v.dtype for k, v in sd.items()}


def _statekit(*args, ok=True):
    run = subprocess.run([sys.executable, "-m", "statekit", *args], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    if ok:
        assert run.returncode == 0, run.stderr
    return run


def _one_line(run):
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    return run.stderr


def _rewrite_train_state(path, **changes):
    torch = pytest.importorskip("torch")
    sd = torch.load(path, weights_only=True)
    for k, v in changes.items():
        sd[k] = torch.tensor(v, dtype=sd[k].dtype)
    torch.save(sd, path)


@pytest.mark.torch
def test_train_state_values_equal_torch_load():
    want, dtypes = _torch_train_state(os.path.join(ITER, "train_state.pt"))
    assert list(want) == TRAIN_STATE_KEYS
    # hand-read facts of the fixture: 3 iterations of global batch 4; Bridge 0.6.2's finalize step saves the
    # flops as float32 (its TrainState.state_dict says float64; the save overwrites it)
    assert (want["step"], want["consumed_train_samples"]) == (3, 12)
    assert str(dtypes["floating_point_operations_so_far"]) == "torch.float32"
    latest, _ = _torch_train_state(os.path.join(FIX, "latest_train_state.pt"))
    assert latest == want
    for path in (FIX, ITER):
        ckpt = dist.open_checkpoint(path)
        got = {k[len("train_state."):]: v for k, v in ckpt.scalars.items() if k.startswith("train_state.")}
        assert list(got) == TRAIN_STATE_KEYS
        for k in TRAIN_STATE_KEYS:
            assert got[k] == want[k] and type(got[k]) is type(want[k]), k  # float32 → the same Python float
        assert ckpt.scalars["iteration"] == want["step"]
        assert not ckpt.warnings
    notes = _notes(FIX)
    assert "latest_train_state.pt == iter_0000003/train_state.pt" in notes
    assert "train_state.pt's step 3 == the common state's iteration" in notes
    assert "num_steps 12 == train_state.pt's consumed_train_samples 12 - skipped_train_samples 0" in notes


@pytest.mark.torch
def test_inspect_shows_the_position_table_and_json():
    want, _ = _torch_train_state(os.path.join(ITER, "train_state.pt"))
    table = _statekit("inspect", FIX).stdout
    assert "train_state.consumed_train_samples" in table and "run position (iter_0000003/train_state.pt)" in table
    data = json.loads(_statekit("inspect", FIX, "--format", "json").stdout)
    for k in TRAIN_STATE_KEYS:
        assert data["scalar_values"][f"train_state.{k}"] == want[k], k
    assert data["metadata"]["megatron.train_state.source"] == "iter_0000003/train_state.pt"
    # the schedule's consumed samples are train_state's, and its warm-up start is run_config.yaml's
    assert data["schedule"]["counters"]["consumed_samples"] == want["consumed_train_samples"]
    assert data["schedule"]["params"]["init_lr"] == 0.0 and data["schedule"]["lr_now"] is not None


@pytest.mark.torch
def test_disagreements_are_said_not_picked(tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(FIX, copy)
    _rewrite_train_state(copy / "iter_0000003" / "train_state.pt", step=4, consumed_train_samples=16)
    ckpt = dist.open_checkpoint(str(copy))
    text = " ".join(ckpt.warnings)
    assert "latest_train_state.pt is at step 3, the folder the tracker names (iter_0000003) at step 4" in text
    ckpt = dist.open_checkpoint(str(copy / "iter_0000003"))  # the folder itself: latest_train_state.pt not used
    text = " ".join(ckpt.warnings)
    assert "train_state.pt is at step 4, the common state's iteration is 3" in text
    assert "stepped 12 samples, train_state.pt counts 16 consumed - 0 skipped = 16" in text
    out = tmp_path / "checkpoint-3"
    err = _one_line(_statekit("convert", str(copy / "iter_0000003"), str(out), "--to", "hf-trainer", ok=False))
    assert "at step 4, the common state's iteration is 3" in err and not out.exists()
    doctor = _statekit("doctor", str(copy / "iter_0000003"), "--format", "json", ok=False)
    found = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "counters"]
    assert doctor.returncode == 1 and len(found) == 2 and all(f["severity"] == "warning" for f in found)
    assert "no problems found" in _statekit("doctor", FIX).stdout
    # same step, different counters: latest_train_state.pt against the folder's own
    copy2 = tmp_path / "d"
    shutil.copytree(FIX, copy2)
    _rewrite_train_state(copy2 / "latest_train_state.pt", consumed_valid_samples=8)
    text = " ".join(dist.open_checkpoint(str(copy2)).warnings)
    assert "differ in consumed_valid_samples (8 vs 0)" in text


@pytest.mark.torch
def test_a_train_state_that_is_not_bridges_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    from statekit.errors import UnsafePickleError

    copy = tmp_path / "c"
    shutil.copytree(FIX, copy)
    path = copy / "iter_0000003" / "train_state.pt"
    sd = torch.load(path, weights_only=True)
    del sd["consumed_valid_samples"]
    torch.save(sd, path)
    with pytest.raises(FormatError, match="no 'consumed_valid_samples'"):
        dist.open_checkpoint(str(copy / "iter_0000003"))
    torch.save({**sd, "consumed_valid_samples": torch.tensor([0, 1])}, path)
    with pytest.raises(FormatError, match="'consumed_valid_samples' is a I64 tensor of shape \\(2,\\)"):
        dist.open_checkpoint(str(copy / "iter_0000003"))
    torch.save({**sd, "consumed_valid_samples": torch.tensor(0.0)}, path)
    with pytest.raises(FormatError, match="'consumed_valid_samples' is a F32 tensor: Bridge saves it as an integer"):
        dist.open_checkpoint(str(copy / "iter_0000003"))
    torch.save({**sd, "consumed_valid_samples": tmp_path}, path)  # a pathlib object: a global off the allow-list
    with pytest.raises(UnsafePickleError):
        dist.open_checkpoint(str(copy / "iter_0000003"))


def test_to_megatron_is_refused_in_one_line(tmp_path):
    out = tmp_path / "m"
    err = _one_line(_statekit("convert", FIX, str(out), "--to", "megatron", ok=False))
    assert "a Megatron-Bridge folder" in err and "does not synthesize from run_config.yaml" in err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# convert --to hf-trainer from the Bridge folder. References: run_config.yaml read by PyYAML, train_state.pt by
# torch.load, the model's bf16 weights by torch's own DCP reader (torch.distributed.checkpoint, single process),
# q/k/v and gate/up picked by hand (tests/test_megatron_hf_folder.to_hf); the moments as statekit's reader gives
# them (every master proved against the weight first), moved by the same hand map, loaded by the Trainer's own
# optimizer from optimizer.pt.


def _dcp_weights():
    """Megatron name → bf16 weight, by torch's DCP reader: the stacked ``decoder.layers.*`` keys cut per layer;
    the local layer spec saves its norms under Transformer Engine's names (mcore's ``sharded_state_dict_keys_map``
    ``input_layernorm.`` → ``self_attention.linear_qkv.layer_norm_``, ``pre_mlp_layernorm.`` →
    ``mlp.linear_fc1.layer_norm_``), turned back here."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = tdcp.FileSystemReader(ITER)
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in reader.read_metadata().state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.")}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        tdcp.load(sd, storage_reader=reader, planner=tdcp.DefaultLoadPlanner(allow_partial_load=True))
    back = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
    out = {}
    for key, t in sd.items():
        if key.startswith("decoder.layers."):
            rest = key[len("decoder.layers."):]
            for i in range(t.shape[0]):
                out[f"decoder.layers.{i}.{back.get(rest, rest)}"] = t[i]
        else:
            out[key] = t
    return out


@pytest.mark.torch
@pytest.mark.hf
def test_to_hf_trainer_from_the_bridge_folder(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import yaml
    from safetensors.torch import load_file

    from tests.test_megatron_hf_folder import _read_megatron, to_hf

    with open(os.path.join(ITER, "run_config.yaml")) as fh:
        run = yaml.safe_load(fh)
    m = run["model"]
    args = {"num_attention_heads": m["num_attention_heads"], "num_query_groups": m["num_query_groups"],
            "kv_channels": m["kv_channels"], "vocab_size": m["vocab_size"], "num_layers": m["num_layers"]}
    ts, _ = _torch_train_state(os.path.join(ITER, "train_state.pt"))

    folder = tmp_path / "checkpoint-3"
    _statekit("convert", FIX, str(folder), "--to", "hf-trainer", "--weights", "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (
        m["hidden_size"], m["num_layers"], m["num_attention_heads"], m["num_query_groups"], m["kv_channels"],
        m["ffn_hidden_size"], m["vocab_size"])
    # Bridge's own CONFIG_MAPPING pairs HF max_position_embeddings with the provider's seq_length
    assert cfg.max_position_embeddings == m["seq_length"] == 32
    assert cfg.rms_norm_eps == m["layernorm_epsilon"] and cfg.rope_parameters["rope_theta"] == m["rotary_base"]
    assert cfg.tie_word_embeddings is m["share_embeddings_and_output_weights"] is False
    # model.safetensors (--weights model) is the run's own bf16 weights, element for element
    want = to_hf(_dcp_weights(), args)
    disk = load_file(folder / "model.safetensors")
    assert set(disk) == set(want) == set(dict(model.named_parameters()))
    for name, t in disk.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[name]), name
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["global_step"] == ts["step"] and state["total_flos"] == ts["floating_point_operations_so_far"]
    assert state["max_steps"] == run["train"]["train_iters"]
    assert state["train_batch_size"] == run["train"]["micro_batch_size"]
    sched = torch.load(folder / "scheduler.pt", weights_only=True)
    assert sched["last_epoch"] == ts["step"] and sched["base_lrs"] == [run["optimizer"]["lr"]] * 2

    # each moment is the one Megatron stored for that parameter, moved as the MCore → HF path moves it
    read, _, _ = _read_megatron(FIX)
    moments = {slot: to_hf({n: v[slot] for n, v in read.items()}, args) for slot in ("exp_avg", "exp_avg_sq",
                                                                                      "fp32_master")}
    for name, t in moments["fp32_master"].items():  # the masters the moments belong to round to the weights
        assert torch.equal(t.to(torch.bfloat16), want[name]), name

    # --weights master (the default): the fp32 masters themselves; the Trainer's own optimizer (decay / no-decay
    # groups over named_parameters()) loads optimizer.pt into that fp32 model (torch's load_state_dict casts the
    # state to each parameter's dtype: the bf16 model above would round the moments)
    folder2 = tmp_path / "checkpoint-3b"
    _statekit("convert", FIX, str(folder2), "--to", "hf-trainer")
    for name, t in load_file(folder2 / "model.safetensors").items():
        assert t.dtype == torch.float32 and torch.equal(t, moments["fp32_master"][name]), name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder2)
    targs = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True,
                                           weight_decay=run["optimizer"]["weight_decay"], optim="adamw_torch")
    trainer = transformers.Trainer(model=model, args=targs)
    opt = trainer.create_optimizer()
    opt.load_state_dict(torch.load(folder2 / "optimizer.pt", weights_only=True))
    named = dict(model.named_parameters())
    assert len(named) == 21
    for n, p in named.items():
        assert p.dtype == torch.float32
        assert torch.equal(opt.state[p]["exp_avg"], moments["exp_avg"][n]), n
        assert torch.equal(opt.state[p]["exp_avg_sq"], moments["exp_avg_sq"][n]), n
        assert float(opt.state[p]["step"]) == 3.0 == ts["step"]


@pytest.mark.parametrize("line, new, named", [
    ("  glu_linear_offset: 0.0\n", "  glu_linear_offset: 0.5\n", "args.glu_linear_offset is 0.5"),
    ("  rope_scaling: false\n", "  rope_scaling: true\n", "args.use_rope_scaling is True"),
    ("  position_embedding_type: rope\n", "  position_embedding_type: yarn\n", "args.position_embedding_type is yarn"),
    ("  window_size: null\n", "  window_size:\n  - 8\n  - 0\n", "args.window_size is [8, 0]"),
    ("  use_mup: false\n", "  use_mup: true\n", "args.use_mup is True"),
    ("  seq_length: 32\n  sequence_parallel", "  sequence_parallel", "no max-position-embeddings"),
])
def test_a_model_hf_would_not_compute_is_refused(tmp_path, line, new, named):
    """run_config.yaml edited by hand (the model section's line; seq_length's removal leaves the dataset's)."""
    copy = tmp_path / "c"
    shutil.copytree(FIX, copy)
    cfg = copy / "iter_0000003" / "run_config.yaml"
    text = cfg.read_text()
    model = text.index("\nmodel:\n")
    assert line in text[model:]
    cfg.write_text(text[:model] + text[model:].replace(line, new, 1))
    out = tmp_path / "checkpoint-3"
    err = _one_line(_statekit("convert", str(copy), str(out), "--to", "hf-trainer", ok=False))
    assert named in err and not out.exists()


@pytest.mark.torch
def test_older_and_newer_dtypes_of_the_counters_are_read(tmp_path):
    """Bridge before 0.5 saved the counters as int32 (v0.4.1 training/state.py), and TrainState.state_dict makes
    the flops a float64 (what a save without the finalize step's float32 would hold)."""
    torch = pytest.importorskip("torch")
    copy = tmp_path / "c"
    shutil.copytree(FIX, copy)
    path = copy / "iter_0000003" / "train_state.pt"
    sd = torch.load(path, weights_only=True)
    sd = {k: (v.to(torch.int32) if v.dtype == torch.int64 else v) for k, v in sd.items()}
    sd["floating_point_operations_so_far"] = torch.tensor(2.0 ** 60 + 2.0 ** 8, dtype=torch.float64)
    torch.save(sd, path)
    want, dtypes = _torch_train_state(path)
    assert str(dtypes["step"]) == "torch.int32"
    got = dist.open_checkpoint(str(copy / "iter_0000003")).scalars
    for k in TRAIN_STATE_KEYS:
        assert got[f"train_state.{k}"] == want[k], k
    assert got["train_state.floating_point_operations_so_far"] == 2.0 ** 60 + 2.0 ** 8  # not rounded to float32
