"""verify-resume from a Megatron checkpoint, and the ``megatron`` replay flavor, checked against megatron-core's own saves.

The reference is the fixture ``gpt_torch_dist_dp_reshardable_tp1pp1dp2_next_step`` (``scripts/make_megatron_fixtures.py
--verify-resume``): one megatron-core 0.19.2 run saved at iteration 3 and again at 4. The gradient its step 4 used is
recovered from the two saves element for element (``test_megatron_hf_folder._recover_gradient``: the float32 g for
which torch's Adam takes the iteration-3 moments to the iteration-4 ones); one step of the ``megatron`` flavor from
iteration 3 with it must give Megatron's iteration-4 moments bit for bit, and the masters of torch's own
``AdamW`` (what megatron-core steps with on a CPU) on the CPU the test runs on bit for bit. Megatron's own iteration-4
masters are that arithmetic with each element's float32 root free in its last 2 ulps
(``test_megatron_hf_folder.assert_megatrons_masters``): torch's CPU ``sqrt`` is MKL's, whose last bit depends on the
CPU (the fixture was written on an AMD EPYC; an AVX-512 Xeon rounds about 1 root in 20 apart). Where the CPU's masters
equal the file's, rounded to bf16 they are Megatron's stored iteration-4 weights.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from statekit import io
from statekit.errors import MappingError
from statekit.ops import megatron_verify
from statekit.ops.megatron_hf import build
from statekit.ops.replay import group_hps, replay, verify_resume

ROOT = "fixtures/megatron/0.19.2"
DIST = f"{ROOT}/gpt_torch_dist_dp_reshardable_tp1pp1dp2"
NEXT = f"{ROOT}/gpt_torch_dist_dp_reshardable_tp1pp1dp2_next_step"


def _statekit(*args):
    return subprocess.run([sys.executable, "-m", "statekit", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.torch
def test_megatron_flavor_takes_megatrons_own_step_4():
    pytest.importorskip("torch")
    from test_megatron_hf_folder import (
        _read_megatron,
        _recover_gradient,
        _torch_next_masters,
        assert_megatrons_masters,
    )

    from statekit.frameworks.megatron.proof import rounded_bits
    from statekit.tensor import TensorRef

    s3, groups3, _ = _read_megatron(f"{NEXT}/iter_0000003")
    s4, _, _ = _read_megatron(f"{NEXT}/iter_0000004")
    beta1, beta2 = groups3[0]["betas"]
    g4 = _recover_gradient(s3, s4, beta1, beta2)
    here = _torch_next_masters(s3, groups3, g4)  # torch.optim.AdamW on this CPU (its root's last bit is the CPU's)
    assert_megatrons_masters(s3, groups3, g4, s4, here)
    grads = {n: TensorRef.from_array(g.numpy()) for n, g in g4.items()}
    with io.open_checkpoint(f"{NEXT}/iter_0000003") as c, io.open_checkpoint(f"{NEXT}/iter_0000004") as c4:
        state = c.optimizer
        masters = {p.path: p.slots["fp32_master"] for p in state.params}  # the parameter megatron-core's Adam steps
        lane = replay(state, masters, [grads], algorithm="adamw", flavor="megatron", hp={},
                      group_hp=group_hps(state, "adamw", "megatron", {}))
        stored = {p.path: p for p in c4.model.params}
        for n, want in s4.items():
            assert lane.steps[n] == 4 == want["step"]
            for slot in ("exp_avg", "exp_avg_sq"):
                assert np.array_equal(lane.slots[n][slot].view(np.uint32), want[slot].numpy().view(np.uint32)), n
            assert np.array_equal(lane.params[n].view(np.uint32), here[n].numpy().view(np.uint32)), n
            weight = stored[n]  # megatron-core rounds the stepped master into the bf16 weight it saves
            assert weight.dtype == "BF16"
            same = lane.params[n].reshape(-1) == want["fp32_master"].numpy().reshape(-1)  # (all, on its CPU)
            got = rounded_bits(lane.params[n].reshape(-1), "BF16")
            assert np.array_equal(got[same], np.frombuffer(weight.tensor.raw(), dtype=np.uint16)[same]), n


@pytest.mark.torch
def test_replay_cli_steps_a_megatron_state_over_its_masters(tmp_path):
    """``statekit replay --state MEGATRON`` without --params: the masters are the parameters, the flavor megatron."""
    pytest.importorskip("torch")
    from safetensors.numpy import load_file, save_file
    from test_megatron_hf_folder import (
        _read_megatron,
        _recover_gradient,
        _torch_next_masters,
        assert_megatrons_masters,
    )

    s3, groups3, _ = _read_megatron(f"{NEXT}/iter_0000003")
    s4, _, _ = _read_megatron(f"{NEXT}/iter_0000004")
    g = _recover_gradient(s3, s4, *groups3[0]["betas"])
    here = _torch_next_masters(s3, groups3, g)  # torch.optim.AdamW on this CPU
    assert_megatrons_masters(s3, groups3, g, s4, here)
    save_file({n: t.contiguous().numpy() for n, t in g.items()}, str(tmp_path / "g4.safetensors"))
    run = _statekit("replay", "--state", f"{NEXT}/iter_0000003", "--grads", str(tmp_path / "g4.safetensors"),
                    "--out-params", str(tmp_path / "p4.safetensors"), "--out-state", str(tmp_path / "s4.safetensors"),
                    "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["flavor"] == "megatron" and result["exactness"] == "bit-exact"
    got = load_file(str(tmp_path / "p4.safetensors"))
    assert sorted(got) == sorted(s4)
    for n in s4:
        assert np.array_equal(got[n].view(np.uint32), here[n].numpy().view(np.uint32)), n
    with io.open_checkpoint(str(tmp_path / "s4.safetensors")) as c:
        for p in c.optimizer.params:
            assert p.step == 4 and sorted(p.slots) == ["exp_avg", "exp_avg_sq"]
            for slot in p.slots:
                assert np.array_equal(p.slots[slot].numpy().reshape(p.shape).view(np.uint32),
                                      s4[p.path][slot].numpy().view(np.uint32)), (p.path, slot)


def _verify(*args):
    run = _statekit("verify-resume", *args, "--steps", "3", "--json")
    assert "Traceback" not in run.stderr, run.stderr
    return run, (json.loads(run.stdout) if run.stdout.strip() else None)


@pytest.fixture(scope="module")
def trainer_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("vr") / "checkpoint-3"
    run = _statekit("convert", DIST, str(out), "--to", "hf-trainer")
    assert run.returncode == 0, run.stderr
    return out


@pytest.mark.torch
def test_verify_resume_megatron_against_its_trainer_folder(trainer_folder):
    run, report = _verify(DIST, str(trainer_folder))
    assert run.returncode == 0, run.stdout + run.stderr
    assert report["tracks"] and report["criterion"] == "bit-exact"
    assert report["flavors"] == {"original": "megatron", "migrated": "torch"}
    assert len(report["params"]) == 21  # every Hugging Face tensor of the llama (q/k/v and gate/up apart)
    assert all(r["bit_exact"] and r["state_bit_exact"] for r in report["params"])
    rows = {r["path"]: r for r in report["params"]}
    assert rows["model.layers.0.self_attn.k_proj.weight"]["from"] == "decoder.layers.0.self_attention.linear_qkv.weight"
    assert rows["model.embed_tokens.weight"]["from"] == "embedding.word_embeddings.weight"


@pytest.mark.torch
def test_a_swapped_moment_row_diverges_naming_the_tensor_and_the_megatron_element(trainer_folder, tmp_path):
    import shutil

    torch = pytest.importorskip("torch")
    bad = tmp_path / "checkpoint-3"
    shutil.copytree(trainer_folder, bad)
    sd = torch.load(bad / "optimizer.pt", weights_only=True)
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    m = sd["state"][ids[names.index("model.layers.1.self_attn.k_proj.weight")]]["exp_avg"]
    m[[3, 4]] = m[[4, 3]].clone()
    torch.save(sd, bad / "optimizer.pt")
    run, report = _verify(DIST, str(bad))
    assert run.returncode == 1 and not report["tracks"]
    wrong = [r for r in report["params"] if not r["tracks"]]
    assert [r["path"] for r in wrong] == ["model.layers.1.self_attn.k_proj.weight"]
    first = wrong[0]["first_difference"]
    assert first["element"] == [3, 0]
    # k rows of query group 0 sit after its 2 q heads of 16 rows (heads 4, groups 2, kv_channels 16): row 32 + 3
    assert first["from"] == "decoder.layers.1.self_attention.linear_qkv.weight element [35, 0]"
    shown = _statekit("verify-resume", DIST, str(bad), "--steps", "2")
    assert shown.returncode == 1
    assert "first divergence: model.layers.1.self_attn.k_proj.weight element [3, 0] (from " \
           "decoder.layers.1.self_attention.linear_qkv.weight element [35, 0])" in shown.stdout


def test_verify_resume_megatron_against_its_tp2_reshard(tmp_path):
    out = tmp_path / "tp2"
    run = _statekit("convert", DIST, str(out), "--to", "megatron", "--tp", "2", "--no-schedule")
    assert run.returncode == 0, run.stderr
    run, report = _verify(DIST, str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    assert report["flavors"] == {"original": "megatron", "migrated": "megatron"} and report["tracks"]
    rows = {r["path"]: r for r in report["params"]}
    assert len(rows) == 15
    # Megatron pads the vocabulary (100) to a multiple of make_vocab_size_divisible_by (16) × TP: 112 rows at TP 1,
    # 128 at TP 2; the 16 rows the reshard added are zero state and must step as a fresh state's
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert rows[name]["kept"] == [112, 64] and rows[name]["new_elements_fresh"], rows[name]
    assert all(r["bit_exact"] for r in report["params"])


def test_a_fused_adam_state_is_refused_unless_a_flavor_is_given():
    with io.open_checkpoint(DIST) as a, io.open_checkpoint(DIST) as b:
        a.optimizer.groups[0].hyperparams["adam_w_mode"] = True  # what TE / apex FusedAdam keep in a group
        with pytest.raises(MappingError, match="FusedAdam"):
            verify_resume(a, b, steps=1)


def test_source_element_follows_the_qkv_rows():
    """By hand (§4.1 of the Megatron format notes): linear_qkv rows per query group are q q k v (heads 4, groups 2,
    kv_channels 2, hidden 3): group g holds rows 8g..8g+3 q, 8g+4..8g+5 k, 8g+6..8g+7 v."""
    meta = {"megatron.hidden_size": "3", "megatron.num_attention_heads": "4", "megatron.num_query_groups": "2",
            "megatron.kv_channels": "2", "megatron.vocab_size": "5"}
    smap = build(meta, {"decoder.layers.0.self_attention.linear_qkv.weight": (16, 3)}, "x")
    for proj, rows in (("q", [0, 1, 2, 3, 8, 9, 10, 11]), ("k", [4, 5, 12, 13]), ("v", [6, 7, 14, 15])):
        t = smap.targets[f"model.layers.0.self_attn.{proj}_proj.weight"]
        for i, r in enumerate(rows):
            for col in range(3):
                name, flat = megatron_verify.source_element(t, (i, col))
                assert name == "decoder.layers.0.self_attention.linear_qkv.weight" and flat == r * 3 + col


@pytest.mark.torch
def test_a_legacy_tp2_pp2_tied_save_against_its_trainer_folder_and_its_reshard(tmp_path):
    """megatron-core's legacy save (TP 2 × PP 2, distributed optimizer, tied embeddings: the last stage's copy of the
    embedding is dropped once equal) against the Trainer folder and the TP1·PP1·DP2 legacy reshard convert writes."""
    legacy = f"{ROOT}/gpt_torch_distopt_tp2pp2dp1"
    folder, flat = tmp_path / "checkpoint-3", tmp_path / "tp1"
    assert _statekit("convert", legacy, str(folder)).returncode == 0
    assert _statekit("convert", legacy, str(flat), "--to", "megatron-legacy", "--tp", "1", "--pp", "1", "--dp", "2",
                     "--vocab-divisible-by", "32", "--no-schedule").returncode == 0
    for target, flavors, n in ((folder, {"original": "megatron", "migrated": "torch"}, 20),
                               (flat, {"original": "megatron", "migrated": "megatron"}, 14)):
        run, report = _verify(legacy, str(target))
        assert run.returncode == 0, run.stdout + run.stderr
        assert report["flavors"] == flavors and report["criterion"] == "bit-exact"
        assert len(report["params"]) == n and all(r["bit_exact"] for r in report["params"])
        assert "output_layer.weight" not in {r["path"] for r in report["params"]}  # the tied copy: one tensor
        assert any(note.startswith("tied embeddings: output_layer.weight") for note in report["notes"])
