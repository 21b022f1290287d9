"""Megatron GPT → torch optimizer.state_dict with Hugging Face Llama names: checked element for element
against the fixture's own optimizer state read by real torch (q/k/v rows indexed by hand from §4.1 of
the Megatron format notes), and loaded by torch AdamW over a transformers Llama of the run's sizes."""

import glob
import json
import os
import pickle
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]

FIX = "fixtures/megatron/0.19.2/gpt_torch_no_distopt_tp1pp1dp2"


class _Stub:
    def __init__(self, *a, **k):
        pass

    def __setstate__(self, state):
        self.__dict__.update(state if isinstance(state, dict) else {})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):  # megatron is not installed: its args namespace is a plain object
        if module.split(".")[0] in ("megatron", "transformer_engine", "apex"):
            return _Stub
        return super().find_class(module, name)


def _megatron_state():
    """name → {exp_avg, exp_avg_sq, step} from model_optim_rng.pt, by Megatron's grouping (decay params,
    then the norms, each in model order)."""
    f = glob.glob(f"{FIX}/iter_*/mp_rank_00/model_optim_rng.pt")[0]
    ckpt = torch.load(f, weights_only=False, map_location="cpu",
                      pickle_module=types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle"))
    model = [(k, v) for k, v in ckpt["model"].items() if torch.is_tensor(v) and "_extra_state" not in k]
    decay = [k for k, v in model if v.dim() == 2]
    norms = [k for k, v in model if v.dim() == 1]
    sd = ckpt["optimizer"]["optimizer"]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    out = {name: sd["state"][i] for name, i in zip(decay + norms, ids, strict=True)}
    for name, v in model:
        assert out[name]["exp_avg"].shape == v.shape
    return out, vars(ckpt["args"])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("mc") / "optimizer.pt"
    run = subprocess.run([sys.executable, "-m", "statekit", "convert", FIX, str(out), "--no-schedule"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "fp32 master weights of 15 parameters are not carried" in run.stdout + run.stderr
    return torch.load(out, weights_only=True)


def test_every_element_matches_the_fixtures_own_state(converted):
    mega, args = _megatron_state()
    nq, ng, d, vocab = args["num_attention_heads"], args["num_query_groups"], args["kv_channels"], args["vocab_size"]
    per = nq // ng
    by_name = {n: converted["state"][i] for g in converted["param_groups"]
               for n, i in zip(g["param_names"], g["params"], strict=True)}
    for slot in ("exp_avg", "exp_avg_sq"):
        for layer in range(args["num_layers"]):
            qkv = mega[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"][slot]
            q_rows = [g * (per + 2) * d + j for g in range(ng) for j in range(per * d)]
            k_rows = [g * (per + 2) * d + per * d + j for g in range(ng) for j in range(d)]
            v_rows = [g * (per + 2) * d + (per + 1) * d + j for g in range(ng) for j in range(d)]
            for proj, rows in (("q", q_rows), ("k", k_rows), ("v", v_rows)):
                got = by_name[f"model.layers.{layer}.self_attn.{proj}_proj.weight"][slot]
                assert torch.equal(got, qkv[rows]), (layer, proj, slot)
            fc1 = mega[f"decoder.layers.{layer}.mlp.linear_fc1.weight"][slot]
            f = fc1.shape[0] // 2
            assert torch.equal(by_name[f"model.layers.{layer}.mlp.gate_proj.weight"][slot], fc1[:f])
            assert torch.equal(by_name[f"model.layers.{layer}.mlp.up_proj.weight"][slot], fc1[f:])
            for mc, hf in (("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
                           ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
                           ("input_layernorm.weight", "input_layernorm.weight"),
                           ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight")):
                assert torch.equal(by_name[f"model.layers.{layer}.{hf}"][slot],
                                   mega[f"decoder.layers.{layer}.{mc}"][slot])
        assert torch.equal(by_name["model.embed_tokens.weight"][slot],
                           mega["embedding.word_embeddings.weight"][slot][:vocab])
        assert torch.equal(by_name["lm_head.weight"][slot], mega["output_layer.weight"][slot][:vocab])
        assert torch.equal(by_name["model.norm.weight"][slot], mega["decoder.final_layernorm.weight"][slot])
    steps = {float(s["step"]) for s in by_name.values()}
    assert steps == {float(mega["output_layer.weight"]["step"])}


@pytest.mark.hf
def test_torch_adamw_over_the_hf_model_loads_it(converted):
    transformers = pytest.importorskip("transformers")
    _, args = _megatron_state()
    cfg = transformers.LlamaConfig(vocab_size=args["vocab_size"], hidden_size=args["hidden_size"],
                                   intermediate_size=args["ffn_hidden_size"], num_hidden_layers=args["num_layers"],
                                   num_attention_heads=args["num_attention_heads"],
                                   num_key_value_heads=args["num_query_groups"], head_dim=args["kv_channels"],
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    # Trainer's two groups from the model itself: weight decay, then none (norms and biases), each in
    # named_parameters() order; AdamW pairs the saved state with them by position
    named = list(model.named_parameters())
    decay = [p for n, p in named if "norm" not in n and "bias" not in n]
    no_decay = [p for n, p in named if "norm" in n or "bias" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    opt.load_state_dict(converted)
    saved = {n: converted["state"][i] for g in converted["param_groups"]
             for n, i in zip(g["param_names"], g["params"], strict=True)}
    assert len(opt.state) == len(named) == len(saved)
    for n, p in named:
        assert torch.equal(opt.state[p]["exp_avg"], saved[n]["exp_avg"]), n
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()  # the loaded state steps the HF model


def test_a_moe_model_goes_to_stacked_experts_in_two_trainer_groups(tmp_path):
    """Megatron's expert group (ChainedOptimizer) joins the decayed group, as a Trainer groups a Mixtral: each
    expert's moments land at its index of transformers 5's stacked gate_up_proj / down_proj."""
    out = tmp_path / "o.pt"
    run = subprocess.run([sys.executable, "-m", "statekit", "convert", "fixtures/megatron/0.19.2/moe_torch_distopt_ep2dp2",
                          str(out), "--no-schedule"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "proved against its stored weights" in run.stdout + run.stderr
    assert "give --old-model" not in run.stdout + run.stderr
    sd = torch.load(out, weights_only=True)
    assert [g["weight_decay"] for g in sd["param_groups"]] == [0.1, 0.0]
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    assert "model.layers.1.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.gate.weight" in names
    by_name = {n: sd["state"][i] for g in sd["param_groups"] for n, i in zip(g["param_names"], g["params"], strict=True)}
    assert tuple(by_name["model.layers.0.mlp.experts.gate_up_proj"]["exp_avg"].shape) == (4, 64, 64)
    assert tuple(by_name["model.layers.0.mlp.experts.down_proj"]["exp_avg"].shape) == (4, 64, 32)


def test_a_model_type_the_run_does_not_fit_is_refused_in_one_line(tmp_path):
    out = tmp_path / "o.pt"
    run = subprocess.run([sys.executable, "-m", "statekit", "convert", FIX, str(out), "--hf-model-type", "qwen3", "--no-schedule"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and not out.exists()
    assert "QK norms" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert "Traceback" not in run.stderr


def test_dry_run_shows_the_split_and_writes_nothing(tmp_path):
    out = tmp_path / "o.pt"
    run = subprocess.run([sys.executable, "-m", "statekit", "convert", FIX, str(out), "--dry-run", "--no-schedule"],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"})
    assert run.returncode == 0, run.stderr
    assert not out.exists()
    assert "model.layers.0.self_attn.k_proj.weight" in run.stdout
    assert "vocab 100" in run.stdout


def test_the_megatron_schedule_is_not_dropped_in_silence(tmp_path):
    """opt_param_scheduler (cosine over samples) has no torch scheduler file statekit writes: refused unless
    --no-schedule, which the plan then states."""
    out = tmp_path / "o.pt"
    run = subprocess.run([sys.executable, "-m", "statekit", "convert", FIX, str(out)], capture_output=True, text=True)
    assert run.returncode == 1 and not out.exists()
    assert "megatron:cosine" in run.stderr and "--no-schedule" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    run = subprocess.run([sys.executable, "-m", "statekit", "convert", FIX, str(out), "--no-schedule"],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"})
    assert run.returncode == 0 and out.exists()
    assert "schedule" in (run.stdout + run.stderr) and "dropped" in (run.stdout + run.stderr)


def test_a_safetensors_target_holds_the_same_split_state(tmp_path):
    """statekit's safetensors layout from a Megatron source: one entry per Hugging Face tensor (linear_qkv split
    into three, each under its own key), the moments the fixture's own, read by torch."""
    out = tmp_path / "o.safetensors"
    run = subprocess.run([sys.executable, "-m", "statekit", "convert", FIX, str(out), "--no-schedule"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    from safetensors import safe_open

    mega, args = _megatron_state()
    nq, ng, d, vocab = args["num_attention_heads"], args["num_query_groups"], args["kv_channels"], args["vocab_size"]
    per = nq // ng
    with safe_open(str(out), "pt") as f:
        entries = json.loads(f.metadata()["params"]) if "params" in f.metadata() else None
        keys = set(f.keys())
        layout = {e["path"]: e["slots"] for e in entries} if entries else None
        assert layout is not None and len(layout) == len(entries)
        for layer in range(args["num_layers"]):
            qkv = mega[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]["exp_avg"]
            k_rows = [g * (per + 2) * d + per * d + j for g in range(ng) for j in range(d)]
            name = layout[f"model.layers.{layer}.self_attn.k_proj.weight"]["exp_avg"]
            assert name in keys and torch.equal(f.get_tensor(name), qkv[k_rows])
        emb = f.get_tensor(layout["model.embed_tokens.weight"]["exp_avg_sq"])
        assert torch.equal(emb, mega["embedding.word_embeddings.weight"]["exp_avg_sq"][:vocab])
