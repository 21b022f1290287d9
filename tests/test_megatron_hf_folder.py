"""Megatron → Hugging Face Trainer folder (``statekit convert MEGATRON checkpoint-N/``), checked with the real
programs: transformers 5.24 builds the model from the folder (``from_pretrained``) with the Megatron weights,
and a real ``Trainer`` resumes from it (``resume_from_checkpoint``) and takes the step Megatron itself took.

The references are files megatron-core 0.19.2 wrote (``scripts/make_megatron_fixtures.py``): the legacy save's
``fp32_from_fp16_params`` and model weights read by torch itself, and for the resume, the same run saved at
iteration 3 and again at 4 (``…_next_step``). The q/k/v rows of the fused ``linear_qkv`` are picked by hand from
the args (§4.1 of the Megatron format notes), independently of statekit's map.
"""

import glob
import json
import os
import pickle
import subprocess
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.torch]

ROOT = "fixtures/megatron/0.19.2"
LEGACY = f"{ROOT}/gpt_torch_no_distopt_tp1pp1dp2"
NEXT = f"{ROOT}/gpt_torch_dist_dp_reshardable_tp1pp1dp2_next_step"
MOE = f"{ROOT}/moe_torch_dist_dp_reshardable_ep2dp2"


def _statekit(*args, ok=True):
    run = subprocess.run([sys.executable, "-m", "statekit", *args], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    if ok:
        assert run.returncode == 0, run.stderr
    return run


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


def _legacy():
    """(masters, weights, args) of the legacy save, by Megatron name, read by torch."""
    f = glob.glob(f"{LEGACY}/iter_*/mp_rank_00/model_optim_rng.pt")[0]
    ckpt = torch.load(f, weights_only=False, map_location="cpu",
                      pickle_module=types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle"))
    model = [(k, v) for k, v in ckpt["model"].items() if torch.is_tensor(v) and "_extra_state" not in k]
    decay = [k for k, v in model if v.dim() == 2]  # Megatron's groups: weight decay, then the norms
    norms = [k for k, v in model if v.dim() == 1]
    flat = [t for g in ckpt["optimizer"]["fp32_from_fp16_params"] for t in g]
    masters = dict(zip(decay + norms, flat, strict=True))
    return masters, dict(model), vars(ckpt["args"])


def to_hf(t: dict, args: dict) -> dict:
    """Megatron name → tensor, as Llama / Mixtral names → tensor, by hand from the args."""
    nq, ng, d, vocab = args["num_attention_heads"], args["num_query_groups"], args["kv_channels"], args["vocab_size"]
    per = nq // ng
    out = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": t["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in t:
        out["lm_head.weight"] = t["output_layer.weight"][:vocab]
    for layer in range(args["num_layers"]):
        mc, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        qkv = t[mc + "self_attention.linear_qkv.weight"]
        rows = {"q": [g * (per + 2) * d + j for g in range(ng) for j in range(per * d)],
                "k": [g * (per + 2) * d + per * d + j for g in range(ng) for j in range(d)],
                "v": [g * (per + 2) * d + (per + 1) * d + j for g in range(ng) for j in range(d)]}
        for proj, r in rows.items():
            out[hf + f"self_attn.{proj}_proj.weight"] = qkv[r]
            if mc + "self_attention.linear_qkv.bias" in t:
                out[hf + f"self_attn.{proj}_proj.bias"] = t[mc + "self_attention.linear_qkv.bias"][r]
        for qk in ("q", "k"):
            if mc + f"self_attention.{qk}_layernorm.weight" in t:
                out[hf + f"self_attn.{qk}_norm.weight"] = t[mc + f"self_attention.{qk}_layernorm.weight"]
        out[hf + "self_attn.o_proj.weight"] = t[mc + "self_attention.linear_proj.weight"]
        out[hf + "input_layernorm.weight"] = t[mc + "input_layernorm.weight"]
        out[hf + "post_attention_layernorm.weight"] = t[mc + "pre_mlp_layernorm.weight"]
        if mc + "mlp.router.weight" in t:
            e = args["num_experts"]
            out[hf + "mlp.gate.weight"] = t[mc + "mlp.router.weight"]
            out[hf + "mlp.experts.gate_up_proj"] = torch.stack(
                [t[mc + f"mlp.experts.local_experts.{i}.linear_fc1.weight"] for i in range(e)])
            out[hf + "mlp.experts.down_proj"] = torch.stack(
                [t[mc + f"mlp.experts.local_experts.{i}.linear_fc2.weight"] for i in range(e)])
        else:
            fc1 = t[mc + "mlp.linear_fc1.weight"]
            f = fc1.shape[0] // 2
            out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
            out[hf + "mlp.down_proj.weight"] = t[mc + "mlp.linear_fc2.weight"]
    return out


def _read_megatron(path: str):
    """name → {slot: fp32 tensor, "step"}, and the groups, as statekit's reader gives them (every element proved
    against the stored weight before it is called a parameter's)."""
    from statekit import io

    out = {}
    with io.open_checkpoint(path) as c:
        for p in c.optimizer.params:
            out[p.path] = {k: torch.from_numpy(np.array(v.numpy(), dtype=np.float32).reshape(p.shape))
                           for k, v in p.slots.items()}
            out[p.path]["step"] = p.step
            out[p.path]["group"] = p.group
        groups = [dict(g.hyperparams) for g in c.optimizer.groups]
        args = {k[len("megatron."):]: v for k, v in c.metadata.items() if k.startswith("megatron.")}
    return out, groups, args


def _torch_next_masters(s3: dict, groups3: list, grads: dict) -> dict:
    """The masters after step 4 as torch's own single-tensor AdamW computes them **on this CPU**: what
    megatron-core's optimizer runs without TE/apex (``torch.optim.AdamW``, ``foreach`` off on CPU), from the
    iteration-3 masters and moments with each group's lr / weight decay / betas / eps, one step of ``grads``.

    Why a reference computed here and not only Megatron's iteration-4 file: torch's float32 CPU ``sqrt`` is
    MKL's ``vmsSqrt``, whose last bit depends on the code path MKL picks for the CPU (the fixture was written on
    an AMD EPYC; on an Intel Xeon with AVX-512 about 1 element in 20 of a step differs by one ulp). The moments do
    not take a root and equal the file bit for bit on every CPU; the masters equal this CPU's torch bit for bit
    and the file's to within that one ulp."""
    out = {}
    for name, s in s3.items():
        g = groups3[s["group"]]
        p = torch.nn.Parameter(s["fp32_master"].clone())
        opt = torch.optim.AdamW([p], lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"],
                                weight_decay=g["weight_decay"], foreach=False)
        opt.state[p] = {"step": torch.tensor(float(s["step"])), "exp_avg": s["exp_avg"].clone(),
                        "exp_avg_sq": s["exp_avg_sq"].clone()}
        p.grad = grads[name].clone()
        opt.step()
        out[name] = p.detach()
    return out


def assert_megatrons_masters(s3: dict, groups3: list, grads: dict, s4: dict, here: dict) -> None:
    """Megatron's iteration-4 masters (``s4``, written on the fixture's CPU) are torch's AdamW step from ``s3``
    with ``grads`` where every element's root is this CPU's torch root or one within 2 ulps of it: the same
    torch kernels (``mul_``, ``sqrt``, ``div``, ``add_``, ``addcdiv_``, as ``torch.optim.adamw``'s single-tensor
    path runs them) with only the root's last bits free. ``here`` (this CPU's ``torch.optim.AdamW``,
    :func:`_torch_next_masters`) must be that arithmetic with no shift at all; a wrong lr, eps, weight decay,
    moment or order of operations matches no shift."""
    for name, s in s3.items():
        g = groups3[s["group"]]
        lr, wd, (b1, b2), eps, t = g["lr"], g["weight_decay"], g["betas"], g["eps"], float(s["step"]) + 1
        m, v, want = s4[name]["exp_avg"], s4[name]["exp_avg_sq"], s4[name]["fp32_master"]
        step_size, bc2_sqrt = lr / (1 - b1 ** t), (1 - b2 ** t) ** 0.5
        root = v.sqrt()
        up, down, matched = root.clone(), root.clone(), torch.zeros_like(want, dtype=torch.bool)
        for shift in range(3):
            for r in ((up,) if shift == 0 else (up, down)):
                p = s["fp32_master"].clone().mul_(1 - lr * wd)
                p.addcdiv_(m, (r / bc2_sqrt).add_(eps), value=-step_size)
                if shift == 0:
                    assert torch.equal(p, here[name]), f"{name}: not torch.optim.AdamW's arithmetic"
                matched |= p == want
            up = torch.nextafter(up, torch.full_like(up, float("inf")))
            down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        assert bool(matched.all()), f"{name}: {int((~matched).sum())} masters match no root within 2 ulps"


@pytest.mark.hf
@pytest.mark.parametrize("weights", ["master", "model"])
def test_from_pretrained_builds_the_megatron_model(tmp_path, weights):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "checkpoint-3"
    run = _statekit("convert", LEGACY, str(out), "--weights", weights)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                                       "trainer_state.json"]
    masters, stored, args = _legacy()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.vocab_size) == (
        args["hidden_size"], args["num_layers"], args["num_attention_heads"], args["num_query_groups"],
        args["kv_channels"], args["ffn_hidden_size"], args["vocab_size"])
    assert cfg.rms_norm_eps == args.get("norm_epsilon", args.get("layernorm_epsilon"))
    assert cfg.rope_parameters["rope_theta"] == args["rotary_base"]
    assert cfg.tie_word_embeddings is False and cfg.max_position_embeddings == args["max_position_embeddings"]
    want = to_hf(masters if weights == "master" else stored, args)
    got = dict(model.named_parameters())
    assert set(got) == set(want)
    for name, p in got.items():
        assert torch.equal(p.detach().float(), want[name].float()), name
    if weights == "model":  # bf16 on disk: the model's own stored weights, bit for bit
        from safetensors.torch import load_file

        disk = load_file(out / "model.safetensors")
        assert {t.dtype for t in disk.values()} == {torch.bfloat16}
        for name, t in disk.items():
            assert torch.equal(t, want[name]), name
    assert "model.safetensors holds the" in run.stdout + run.stderr


def _recover_gradient(s3: dict, s4: dict, beta1: float, beta2: float) -> dict:
    """The gradient Megatron's step 4 used, element for element: the float32 g for which torch's own Adam
    update (``exp_avg.lerp_(g, 1-β1)``, ``exp_avg_sq.mul_(β2).addcmul_(g, g, value=1-β2)``, what Megatron's
    torch Adam runs) takes the iteration-3 moments to the iteration-4 moments exactly; searched outwards from
    (m4 − β1·m3)/(1−β1) one float at a time. Every element must have one."""
    grads = {}
    for name in s3:
        m3, v3, m4, v4 = s3[name]["exp_avg"], s3[name]["exp_avg_sq"], s4[name]["exp_avg"], s4[name]["exp_avg_sq"]
        first = ((m4.double() - beta1 * m3.double()) / (1 - beta1)).float()
        g, found = first.clone(), torch.zeros_like(first, dtype=torch.bool)
        up, down = first.clone(), first.clone()
        for _ in range(400):
            for cand in (up, down):
                ok = (m3.clone().lerp_(cand, 1 - beta1) == m4) & \
                     (v3.clone().mul_(beta2).addcmul_(cand, cand, value=1 - beta2) == v4) & ~found
                g[ok], found = cand[ok], found | ok
            if found.all():
                break
            up = torch.nextafter(up, torch.full_like(up, float("inf")))
            down = torch.nextafter(down, torch.full_like(down, float("-inf")))
        assert found.all(), f"{name}: no float32 gradient takes Megatron's moments from step 3 to step 4"
        grads[name] = g
    return grads


@pytest.mark.hf
def test_trainer_resumes_and_takes_megatrons_own_next_step(tmp_path):
    """Megatron iteration 3 → checkpoint-3/ → transformers Trainer(resume_from_checkpoint) → one step with the
    gradient Megatron's step 4 used: the moments and the step counter equal Megatron's own iteration-4 save bit for
    bit, the weights (fp32 masters) torch's AdamW from Megatron's iteration 3 on this CPU bit for bit (Megatron's
    own file within the last bits of each root: :func:`assert_megatrons_masters`); statekit's torch AdamW replay
    from the folder gives the same."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    s3, groups3, meta = _read_megatron(f"{NEXT}/iter_0000003")
    s4, _, _ = _read_megatron(f"{NEXT}/iter_0000004")
    args = {"num_attention_heads": int(meta["num_attention_heads"]), "num_query_groups": int(meta["num_query_groups"]),
            "kv_channels": int(meta["kv_channels"]), "vocab_size": int(meta["vocab_size"]),
            "num_layers": int(meta["num_layers"])}
    beta1, beta2 = groups3[0]["betas"]
    g_megatron = _recover_gradient(s3, s4, beta1, beta2)
    grads = to_hf(g_megatron, args)
    folder = tmp_path / "checkpoint-3"
    _statekit("convert", f"{NEXT}/iter_0000003", str(folder))
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    doctor = _statekit("doctor", str(folder))  # statekit's own resume checks find nothing in what it wrote
    assert "no problems found" in doctor.stdout

    class GivenGradient(transformers.Trainer):  # the step's gradient is Megatron's, not a new batch's
        def training_step(self, model, inputs, num_items_in_batch=None):
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            return torch.tensor(0.0)

    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config)  # random: the resume loads the folder's weights
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=1, learning_rate=0.01,
        weight_decay=0.1, adam_beta1=beta1, adam_beta2=beta2, adam_epsilon=1e-8, max_grad_norm=0.0,
        optim="adamw_torch", lr_scheduler_type="cosine", save_strategy="no", report_to=[], use_cpu=True,
        logging_steps=1, dataloader_num_workers=0, disable_tqdm=True)
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(8)]
    trainer = GivenGradient(model=model, args=targs, train_dataset=data)
    trainer.train(resume_from_checkpoint=str(folder))
    assert trainer.state.global_step == 4
    # scheduler.pt was loaded (Trainer loads optimizer.pt only beside it): its step went on from 3, its peak lrs
    # are Megatron's max_lr; the λ after that is the Trainer's own (cosine over its max_steps here)
    assert trainer.lr_scheduler.last_epoch == 4
    assert trainer.lr_scheduler.base_lrs == [groups3[0]["max_lr"], groups3[1]["max_lr"]]
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    named = dict(model.named_parameters())
    want_m, want_v = to_hf({n: s["exp_avg"] for n, s in s4.items()}, args), \
        to_hf({n: s["exp_avg_sq"] for n, s in s4.items()}, args)
    # the masters: torch's AdamW on this CPU, bit for bit; Megatron's own (its CPU's roots) within their last bits
    here = _torch_next_masters(s3, groups3, g_megatron)
    assert_megatrons_masters(s3, groups3, g_megatron, s4, here)
    want_p = to_hf(here, args)
    for n, p in named.items():
        st = opt.state[p]
        assert float(st["step"]) == 4.0 == float(s4["output_layer.weight"]["step"])
        assert torch.equal(st["exp_avg"], want_m[n]), n
        assert torch.equal(st["exp_avg_sq"], want_v[n]), n
        assert torch.equal(p.detach(), want_p[n]), n

    # statekit's own torch AdamW replay, from the folder it wrote, with the same gradient
    save_file({n: g.contiguous() for n, g in grads.items()}, tmp_path / "g4.safetensors")
    _statekit("replay", "--state", str(folder), "--params", str(folder / "model.safetensors"), "--grads",
              str(tmp_path / "g4.safetensors"), "--flavor", "torch", "--out-params", str(tmp_path / "p4.safetensors"),
              "--out-state", str(tmp_path / "s4.pt"), "--json")
    from safetensors.torch import load_file

    replayed = load_file(tmp_path / "p4.safetensors")
    sd = torch.load(tmp_path / "s4.pt", weights_only=True)
    by_name = {n: sd["state"][i] for g in sd["param_groups"] for n, i in zip(g["param_names"], g["params"],
                                                                              strict=True)}
    for n, p in named.items():
        assert torch.equal(replayed[n], p.detach()), n
        assert torch.equal(by_name[n]["exp_avg"], want_m[n]) and torch.equal(by_name[n]["exp_avg_sq"], want_v[n]), n


@pytest.mark.hf
def test_moe_goes_to_mixtral_and_its_trainer_loads_the_optimizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    s, _, meta = _read_megatron(MOE)
    args = {"num_attention_heads": int(meta["num_attention_heads"]), "num_query_groups": int(meta["num_query_groups"]),
            "kv_channels": int(meta["kv_channels"]), "vocab_size": int(meta["vocab_size"]),
            "num_layers": int(meta["num_layers"]), "num_experts": int(meta["num_experts"])}
    folder = tmp_path / "checkpoint-3"
    _statekit("convert", MOE, str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 2
    assert model.config.intermediate_size == int(meta["args.moe_ffn_hidden_size"])
    want = {slot: to_hf({n: v[slot] for n, v in s.items()}, args) for slot in ("fp32_master", "exp_avg", "exp_avg_sq")}
    named = dict(model.named_parameters())
    assert set(named) == set(want["fp32_master"])
    for n, p in named.items():
        assert torch.equal(p.detach(), want["fp32_master"][n]), n
    # the Trainer's own optimizer (its decay / no-decay groups over named_parameters()) loads optimizer.pt
    targs = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True,
                                           weight_decay=0.1, optim="adamw_torch")
    trainer = transformers.Trainer(model=model, args=targs)
    opt = trainer.create_optimizer()
    opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    for n, p in named.items():
        assert torch.equal(opt.state[p]["exp_avg"], want["exp_avg"][n]), n
        assert torch.equal(opt.state[p]["exp_avg_sq"], want["exp_avg_sq"][n]), n
        assert float(opt.state[p]["step"]) == 3.0


def _one_line_refusal(run):
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    return run.stderr


def test_refusals_are_one_line_and_write_nothing(tmp_path):
    out = tmp_path / "checkpoint-3"
    err = _one_line_refusal(_statekit("convert", LEGACY, str(out), "--hf-model-type", "qwen2", ok=False))
    assert "q/k/v bias" in err and not out.exists()
    err = _one_line_refusal(_statekit("convert", LEGACY, str(out), "--hf-model-type", "mixtral", ok=False))
    assert "mixture-of-experts" in err and not out.exists()
    err = _one_line_refusal(_statekit("convert", LEGACY, str(out), "--weights", "fp32", ok=False))
    assert "--weights fp32" in err and not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    err = _one_line_refusal(_statekit("convert", LEGACY, str(out), ok=False))
    assert "not empty" in err and os.listdir(out) == ["keep.txt"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    err = _one_line_refusal(_statekit("convert", "fixtures/hf/v5/llama/checkpoint-2", str(tmp_path / "x"), "--to",
                                      "hf-trainer", ok=False))
    assert "written from a Megatron checkpoint" in err and not (tmp_path / "x").exists()


def test_another_source_to_a_folder_named_checkpoint_n_is_still_dcp(tmp_path):
    out = tmp_path / "checkpoint-5"
    _statekit("convert", "fixtures/hf/v5/llama/checkpoint-2", str(out))
    assert (out / ".metadata").exists() and not (out / "config.json").exists()


def test_dry_run_writes_nothing(tmp_path):
    out = tmp_path / "checkpoint-3"
    run = _statekit("convert", LEGACY, str(out), "--dry-run")
    assert not out.exists()
    assert "model.layers.0.self_attn.k_proj.weight" in run.stdout


def test_a_given_config_that_disagrees_with_the_args_is_refused(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))
    out = tmp_path / "checkpoint-3"
    err = _one_line_refusal(_statekit("convert", LEGACY, str(out), "--hf-config", str(cfg), ok=False))
    assert "hidden_size is 128 here, 64" in err and not out.exists()


TIED_PP2 = f"{ROOT}/gpt_torch_distopt_tp2pp2dp1"


@pytest.mark.hf
def test_tied_embeddings_with_pp2_keep_one_tensor(tmp_path):
    """TP2·PP2 with tied embeddings: the last stage's output_layer copy (its own state, equal to the
    embedding's) is not a second tensor in a tied Hugging Face model; the Trainer's optimizer loads the rest."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "checkpoint-3"
    run = _statekit("convert", TIED_PP2, str(folder))
    assert "equals the embedding in every slot" in run.stdout
    s, _, meta = _read_megatron(TIED_PP2)
    args = {k: int(meta[k]) for k in ("num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
                                      "num_layers")}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    named = dict(model.named_parameters())
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True, weight_decay=0.1, optim="adamw_torch"))
    opt = trainer.create_optimizer()
    opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    s = {n: v for n, v in s.items() if n != "output_layer.weight"}
    for slot in ("exp_avg", "exp_avg_sq"):
        want = to_hf({n: v[slot] for n, v in s.items()}, args)
        assert set(want) == set(named)
        for n, p in named.items():
            assert torch.equal(opt.state[p][slot], want[n]), (n, slot)
    master = to_hf({n: v["fp32_master"] for n, v in s.items()}, args)
    for n, p in named.items():
        assert torch.equal(p.detach(), master[n]), n


def test_a_tied_copy_that_differs_is_refused():
    from statekit import io
    from statekit.errors import MappingError
    from statekit.ops import megatron_hf
    from statekit.tensor import TensorRef

    with io.open_checkpoint(TIED_PP2) as c:
        out = next(p for p in c.optimizer.params if p.path == "output_layer.weight")
        moved = np.array(out.slots["exp_avg_sq"].numpy(), dtype=np.float32).copy()
        moved.reshape(-1)[5] = np.nextafter(moved.reshape(-1)[5], np.float32(1))
        out.slots["exp_avg_sq"] = TensorRef.from_array(moved)
        with pytest.raises(MappingError, match="exp_avg_sq differs from the embedding's at element 5"):
            megatron_hf.drop_tied_copy(c.optimizer, c.metadata, TIED_PP2)


BRIDGE = "fixtures/megatron_bridge/0.6.2/gpt_torch_no_distopt_tp1pp1dp2"


def test_the_folder_equals_megatron_bridges_own_mapping(tmp_path):
    """Megatron-Bridge 0.6.2's LlamaBridge mappings of the same checkpoint (scripts/make_megatron_bridge_reference.py:
    its QKVMapping / GatedMLPMapping / AutoMapping run on the weights and on each moment): model.safetensors
    (--weights model) and optimizer.pt's moments equal them element for element, every tensor."""
    from safetensors.torch import load_file

    folder = tmp_path / "checkpoint-3"
    _statekit("convert", LEGACY, str(folder), "--weights", "model")
    weights = load_file(folder / "model.safetensors")
    bridge = load_file(f"{BRIDGE}/weights.safetensors")
    assert set(weights) == set(bridge) and len(bridge) == 21
    for name, t in bridge.items():
        assert t.dtype == weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], t), name
    sd = torch.load(folder / "optimizer.pt", weights_only=True)
    by_name = {n: sd["state"][i] for g in sd["param_groups"] for n, i in zip(g["param_names"], g["params"],
                                                                              strict=True)}
    for slot in ("exp_avg", "exp_avg_sq"):
        moved = load_file(f"{BRIDGE}/{slot}.safetensors")
        assert set(moved) == set(by_name)
        for name, t in moved.items():
            assert torch.equal(by_name[name][slot], t), (name, slot)


def test_moe_weights_equal_megatron_bridges_own_mapping(tmp_path):
    """Megatron-Bridge 0.6.2's Qwen3MoEBridge mappings of the legacy EP2 save (per-expert HF names, the form
    before transformers 5 stacked them): each expert's gate/up/down, the router and the dense tensors equal
    statekit's stacked model.safetensors (--weights model) at that expert's index, element for element."""
    from safetensors.torch import load_file

    folder = tmp_path / "checkpoint-3"
    _statekit("convert", f"{ROOT}/moe_torch_distopt_ep2dp2", str(folder), "--weights", "model")
    ours = load_file(folder / "model.safetensors")
    bridge = load_file("fixtures/megatron_bridge/0.6.2/moe_torch_distopt_ep2dp2/weights.safetensors")
    per_expert = [n for n in bridge if ".mlp.experts." in n]
    assert len(per_expert) == 2 * 4 * 3 and len(bridge) - len(per_expert) + 4 == len(ours)
    for name, t in ours.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            head, kind = name.rsplit(".", 1)
            for e in range(4):
                if kind == "gate_up_proj":
                    want = torch.cat([bridge[f"{head}.{e}.gate_proj.weight"], bridge[f"{head}.{e}.up_proj.weight"]])
                else:
                    want = bridge[f"{head}.{e}.down_proj.weight"]
                assert torch.equal(t[e], want), (name, e)
        else:
            assert torch.equal(t, bridge[name]), name


@pytest.mark.hf
def test_a_given_config_that_fits_is_kept(tmp_path):
    transformers = pytest.importorskip("transformers")
    _, _, args = _legacy()
    cfg = transformers.LlamaConfig(vocab_size=args["vocab_size"], hidden_size=args["hidden_size"],
                                   intermediate_size=args["ffn_hidden_size"], num_hidden_layers=args["num_layers"],
                                   num_attention_heads=args["num_attention_heads"],
                                   num_key_value_heads=args["num_query_groups"], head_dim=args["kv_channels"],
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=7, eos_token_id=8)
    cfg.save_pretrained(tmp_path / "mine")
    out = tmp_path / "checkpoint-3"
    _statekit("convert", LEGACY, str(out), "--hf-config", str(tmp_path / "mine" / "config.json"))
    written = json.loads((out / "config.json").read_text())
    assert written["bos_token_id"] == 7 and written["eos_token_id"] == 8 and written["dtype"] == "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.bos_token_id == 7


@pytest.mark.hf
@pytest.mark.parametrize("case,cls", [("qwen2_torch_qkv_bias_tp1pp1dp1", "Qwen2ForCausalLM"),
                                      ("moe_torch_qk_layernorm_tp1pp1dp1", "Qwen3MoeForCausalLM")])
def test_qwen2_and_qwen3_moe_shaped_runs(tmp_path, case, cls):
    """A run with --add-qkv-bias → qwen2 (biases split per query group like the weight); a MoE run with
    --qk-layernorm → qwen3_moe (q_norm / k_norm; its layer registers the experts before the router, so the
    Trainer's positions differ from Mixtral's): from_pretrained builds it with the Megatron masters, and the
    Trainer's own optimizer loads optimizer.pt with every moment at its parameter (by name)."""
    transformers = pytest.importorskip("transformers")
    src = f"{ROOT}/{case}"
    s, _, meta = _read_megatron(src)
    args = {k: int(meta[k]) for k in ("num_attention_heads", "num_query_groups", "kv_channels", "vocab_size",
                                      "num_layers")}
    args["num_experts"] = int(meta.get("num_experts") or 0)
    folder = tmp_path / "checkpoint-3"
    _statekit("convert", src, str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == cls
    named = dict(model.named_parameters())
    want = {slot: to_hf({n: v[slot] for n, v in s.items()}, args) for slot in ("fp32_master", "exp_avg", "exp_avg_sq")}
    assert set(named) == set(want["fp32_master"])
    for n, p in named.items():
        assert torch.equal(p.detach(), want["fp32_master"][n]), n
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True, weight_decay=0.1, optim="adamw_torch"))
    opt = trainer.create_optimizer()
    opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    for n, p in named.items():
        for slot in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][slot], want[slot][n]), (n, slot)


def test_a_group_split_the_trainer_would_not_make_is_refused():
    """A norm in Megatron's decayed group (as --apply-wd-to-qk-layernorm puts the QK norms there): a Trainer
    never decays a norm, so the saved groups could not be the Trainer's; refused naming the tensor."""
    from statekit import io
    from statekit.errors import MappingError
    from statekit.ops import megatron_hf

    with io.open_checkpoint(f"{ROOT}/moe_torch_qk_layernorm_tp1pp1dp1") as c:
        state = c.optimizer
        shapes = {p.path: tuple(p.shape) for p in state.params}
        structure = megatron_hf.build(c.metadata, shapes, "x")
        megatron_hf.trainer_groups(state, "x")
        megatron_hf.check_trainer_decay(state, structure, "x")  # as saved: the Trainer's split
        decayed = next(i for i, g in enumerate(state.groups) if g.hyperparams["weight_decay"] > 0)
        norm = next(p for p in state.params if p.path == "decoder.layers.1.self_attention.q_layernorm.weight")
        norm.group = decayed
        with pytest.raises(MappingError, match="model.layers.1.self_attn.q_norm.weight: .* does not decay"):
            megatron_hf.check_trainer_decay(state, structure, "x")
