"""Write ``fixtures/finetune/``: the fine-tuning checkpoints people have, saved by the real programs.

    python3 -m venv /work/venvs/finetune && /work/venvs/finetune/bin/pip install -e '.[test,hf]' \
        'torch==2.13.0' transformers==5.24.0 peft==0.21.2 bitsandbytes==0.50.2
    cd REPO && HF_HUB_OFFLINE=1 /work/venvs/finetune/bin/python scripts/make_finetune_fixtures.py [NAME ...]

Run from the repository root: the QLoRA run loads its base model from the relative path
``fixtures/finetune/qlora/base`` and peft records that path as ``base_model_name_or_path``. The test
suite does not run this script: it reads the committed files. bitsandbytes 0.50 runs its 8-bit
optimizers and its 4-bit layers on a CPU (paged optimizers fall back to ordinary buffers there, with
a warning), so every run below is a real one, on CPU. Each model is built from a tiny config (no
download), trained a few steps by ``transformers.Trainer`` on random tokens with hyperparameters
that differ from the defaults (a constant learning rate after one warm-up step, so that the saved
param groups' ``lr`` is not the 0 a linear schedule ends at), and its ``checkpoint-N/`` copied as Trainer wrote it, less
``rng_state.pth``:

* ``lora/`` — ``get_peft_model(LlamaForCausalLM, LoraConfig(target_modules=[q_proj, v_proj, down_proj],
  modules_to_save=[lm_head]))``, ``optim="adamw_torch"``, 4 steps. The base model is loaded by its hub id
  ``statekit-fixtures/tiny-llama`` from a Hugging Face cache (``hf-cache/``, written here in the
  cache's own layout and read by ``from_pretrained`` offline; only its ``config.json`` is kept), as a
  user with the base model downloaded has it.
* ``qlora/`` — the base model loaded in 4 bits (``BitsAndBytesConfig(load_in_4bit=True)``, nf4) from
  the local folder ``fixtures/finetune/qlora/base`` (its ``config.json`` kept),
  ``prepare_model_for_kbit_training``, LoRA on q/k/v/o with ``modules_to_save=[lm_head]`` (4096
  elements: 8-bit optimizer state), ``optim="paged_adamw_8bit"``, 4 steps.
* ``dora/`` — DoRA (``use_dora=True``: a ``lora_magnitude_vector`` per adapted module) with
  ``trainable_token_indices`` on the embedding, from the hub id in the cache, ``adamw_torch``, 2 steps.
* ``mixtral/``, ``qwen2-moe/``, ``deepseek-v3/`` — full fine-tunes of transformers v5 mixtures of
  experts (3-D expert weights, a router that is not ``nn.Linear``; Qwen2-MoE's shared expert and its
  gate; DeepSeek-V3's dense first layer, multi-head latent attention and its router's correction
  bias), ``adamw_torch``, 2 steps.
* ``lion8bit/`` — a Llama whose MLP and attention weights have 4096 elements (8-bit state),
  ``optim="lion_8bit"``, 2 steps.

Beside each ``checkpoint-N/`` a ``truth.json`` holds what the training process itself knew, from
the live objects: for each param group the names of its parameters (``optimizer.param_groups``
matched to ``model.named_parameters()`` by identity), each trainable parameter's shape and owning
module class, how the module's own code says the weight is used (``nn.Linear`` / ``Conv1D`` /
``nn.Embedding`` by ``isinstance``, an experts module's ``is_transposed``), the optimizer's class,
``TrainingArguments.optim`` and the versions.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "finetune"
CACHE = OUT / "hf-cache"
HUB_ID = "statekit-fixtures/tiny-llama"
os.environ["HF_HUB_CACHE"] = str(CACHE / "hub")  # before huggingface_hub reads it
REVISION = "5b1f0e3c9a7d2e4f6a8b0c1d3e5f7a9b2c4d6e8f"  # any 40 hex digits: the cache's snapshot name
CTX = 16
HYPER = {"learning_rate": 2e-3, "weight_decay": 0.05, "adam_beta1": 0.8, "adam_beta2": 0.97, "adam_epsilon": 1e-7}

warnings.filterwarnings("ignore")


def llama_config(transformers, **kw):
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=CTX, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                tie_word_embeddings=False)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def owner_kind(module, param, torch, transformers) -> str:
    """How the owning module's own code uses the weight, from the live objects: ``isinstance`` for the
    standard layers, an experts module's ``is_transposed``, and for anything else the module run on a
    random input and compared with ``F.linear`` (a router) or peft's merged embedding rows."""
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if isinstance(module, transformers.pytorch_utils.Conv1D):
        return "conv1d"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if isinstance(module, torch.nn.LayerNorm) or "norm" in type(module).__name__.lower():
        return "norm"
    if hasattr(module, "is_transposed") and hasattr(module, "num_experts"):
        return "experts-in-out" if module.is_transposed else "experts-out-in"
    if param.dim() == 2 and hasattr(module, "forward") and not isinstance(module, torch.nn.ParameterDict):
        x = torch.randn(3, param.shape[1], generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        if torch.allclose(out.float(), torch.nn.functional.linear(x, param.float()), atol=1e-5):
            return "linear-by-forward"  # the module computes F.linear(x, W): [out, in]
    return "other"


def token_rows(model, torch) -> dict:
    """peft's trainable token rows: each delta must be the rows ``token_indices`` of the merged embedding."""
    out = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "TrainableTokensLayer":
            for adapter, delta in module.trainable_tokens_delta.items():
                merged = module.get_merged_weights([adapter])
                rows = module.token_indices[adapter]
                assert torch.equal(merged[rows], delta.detach())
                out[f"{name}.trainable_tokens_delta.{adapter}"] = "embedding-rows"
    return out


def hub_cache(transformers) -> None:
    """The base model in a Hugging Face cache under its hub id (``models--org--name/snapshots/REV``)."""
    repo = CACHE / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    shutil.rmtree(CACHE, ignore_errors=True)
    snapshot = repo / "snapshots" / REVISION
    transformers.set_seed(0)
    transformers.LlamaForCausalLM(llama_config(transformers)).save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)


def trim_cache() -> None:
    """Keep the cache's config.json (what statekit reads) and its refs; the weights are not committed."""
    for path in CACHE.rglob("*"):
        if path.is_file() and path.name not in ("config.json", "main"):
            path.unlink()


def train(name: str, model, steps: int, optim: str, truth: dict, *, batch: int = 4) -> None:
    import torch
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Truth(TrainerCallback):
        def on_save(self, args, state, control, model=None, optimizer=None, **kw):
            by_param = {p: n for n, p in model.named_parameters()}
            truth["groups"] = [[by_param[p] for p in g["params"]] for g in optimizer.param_groups]
            truth["group_weight_decay"] = [g["weight_decay"] for g in optimizer.param_groups]
            params = {}
            for n, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                owner = model.get_submodule(n.rpartition(".")[0])
                params[n] = {"shape": list(p.shape), "module": type(owner).__name__,
                             "kind": owner_kind(owner, p, torch, transformers)}
            for n, kind in token_rows(model, torch).items():
                params[n]["kind"] = kind
            truth["params"] = params
            truth["frozen"] = sum(1 for _, p in model.named_parameters() if not p.requires_grad)
            inner = getattr(optimizer, "optimizer", optimizer)
            truth["optimizer_class"] = f"{type(inner).__module__}.{type(inner).__name__}"
            truth["optim"] = str(getattr(args.optim, "value", args.optim))
            truth["hyperparams"] = {k: getattr(args, k) for k in HYPER}
            truth["versions"] = versions()

    vocab = model.config.vocab_size if hasattr(model, "config") else 128
    ids = torch.randint(1, vocab, (16, CTX), generator=torch.Generator().manual_seed(1))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    transformers.set_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=steps, save_strategy="steps", save_steps=steps, per_device_train_batch_size=batch,
            warmup_steps=1, lr_scheduler_type="constant_with_warmup", logging_steps=100, report_to="none", use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True, optim=optim, **HYPER)
        Trainer(model=model, args=args, train_dataset=Data(), callbacks=[Truth()]).train()
        dest = OUT / name
        for old in dest.glob("checkpoint-*"):
            shutil.rmtree(old)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copytree(Path(tmp) / f"checkpoint-{steps}", dest / f"checkpoint-{steps}",
                        ignore=shutil.ignore_patterns("rng_state*.pth"))
    (dest / "truth.json").write_text(json.dumps(truth, indent=1) + "\n")


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def lora() -> None:
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.set_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(HUB_ID)
    config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                        target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=["lm_head"])
    model = get_peft_model(base, config)
    train("lora", model, 4, "adamw_torch", {"base": HUB_ID, "adapter": "lora"})


def dora() -> None:
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.set_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(HUB_ID)
    config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, use_dora=True,
                        target_modules=["q_proj", "v_proj"], trainable_token_indices={"embed_tokens": [1, 2, 3]})
    model = get_peft_model(base, config)
    train("dora", model, 2, "adamw_torch", {"base": HUB_ID, "adapter": "dora + trainable tokens"})


def qlora() -> None:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    local = Path("fixtures/finetune/qlora/base")  # relative: peft records it as the run gave it
    if Path.cwd() != ROOT:
        sys.exit("run from the repository root (the QLoRA base model's path is relative to it)")
    shutil.rmtree(local, ignore_errors=True)
    transformers.set_seed(0)
    transformers.LlamaForCausalLM(llama_config(transformers, vocab_size=128, hidden_size=32,
                                               intermediate_size=64)).save_pretrained(local)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_compute_dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(local), quantization_config=quant, device_map="cpu")
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    config = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=["lm_head"])
    model = get_peft_model(base, config)
    train("qlora", model, 4, "paged_adamw_8bit", {"base": str(local), "adapter": "lora (4-bit base)"})
    for path in local.iterdir():  # the weights are not committed: statekit reads the config
        if path.name != "config.json":
            path.unlink()


def moe(name: str) -> None:
    import transformers

    transformers.set_seed(0)
    common = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=CTX, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    if name == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=24, num_hidden_layers=1, num_local_experts=4,
                                            num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    elif name == "qwen2-moe":
        config = transformers.Qwen2MoeConfig(**common, intermediate_size=24, moe_intermediate_size=12,
                                             shared_expert_intermediate_size=20, num_hidden_layers=1, num_experts=4,
                                             num_experts_per_tok=2, decoder_sparse_step=1)
        model = transformers.Qwen2MoeForCausalLM(config)
    else:
        common["num_key_value_heads"] = 2  # multi-head latent attention: one key/value head per query head
        config = transformers.DeepseekV3Config(
            **common, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2, first_k_dense_replace=1,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=8,
            kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, head_dim=4)
        model = transformers.DeepseekV3ForCausalLM(config)
    train(name, model, 2, "adamw_torch", {"model": type(model).__name__})


def lion8bit() -> None:
    import transformers

    transformers.set_seed(0)
    config = llama_config(transformers, vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config)
    train("lion8bit", model, 2, "lion_8bit", {"model": type(model).__name__})


def main() -> None:
    import transformers

    wanted = set(sys.argv[1:])
    runs = {"lora": lora, "dora": dora, "qlora": qlora, "mixtral": lambda: moe("mixtral"),
            "qwen2-moe": lambda: moe("qwen2-moe"), "deepseek-v3": lambda: moe("deepseek-v3"), "lion8bit": lion8bit}
    if not wanted or wanted & {"lora", "dora"}:
        hub_cache(transformers)
    for name, run in runs.items():
        if not wanted or name in wanted:
            run()
    trim_cache()
    for path in sorted(OUT.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size:>8}  {path.relative_to(OUT)}")


if __name__ == "__main__":
    main()
