"""Write ``fixtures/hf/``: tiny Trainer checkpoints from two transformers releases, with the truth.

    HF_HUB_OFFLINE=1 /work/venvs/hf5/bin/python scripts/make_hf_fixtures.py      # transformers 5.23.0
    HF_HUB_OFFLINE=1 /work/venvs/hf4/bin/python scripts/make_hf_fixtures.py      # transformers 4.46.3
    PYTHONPATH=. python3 scripts/make_hf_fixtures.py --burn-models               # burn-like model files

Each venv: ``python3 -m venv --system-site-packages DIR && DIR/bin/pip install 'torch==2.13.0'
'transformers==X' accelerate``. The test suite does not run this: it reads the committed files.

Every model is built from a tiny config (no download) and trained 2 steps by ``transformers.Trainer``
on random tokens with AdamW hyperparameters that differ from torch's defaults, so that a reader that
assumes them is caught. The Trainer decay / no-decay split changed in transformers 4.49 and 4.53
(../shared/docs/names-and-layouts.md §2.2); 4.46.3 and 5.23.0 put Qwen2's RMSNorm weights in
different groups. Written per release tag (``v5``, ``v4``) and model:

* ``<tag>/<model>/checkpoint-2/`` — the folder exactly as Trainer saved it, less ``rng_state.pth``
  (random-number state, tens of KB, not read by statekit).
* ``<tag>/<model>/truth.json`` — what the training process itself knew, taken from the live objects:
  for each param group the names of its parameters (``optimizer.param_groups`` matched to
  ``model.named_parameters()`` by identity), each parameter's shape, its owning module's class and
  whether that module is an ``nn.Linear`` / ``Conv1D`` / ``nn.Embedding`` / norm (``isinstance``),
  the TrainingArguments' optimizer settings, the tied parameter names, and the versions.

``--burn-models`` (system Python, statekit importable; no transformers needed) writes
``<tag>/<model>/burn-model.bpk`` for the v5 models: a *stand-in* for the model file a burn program
would save (no burn binary is available here), written with statekit's own burnpack model writer
from the checkpoint's ``model.safetensors`` and ``truth.json``: burn's module paths (norm
``weight``/``bias`` → ``gamma``/``beta``, as burn-store's PyTorch adapter names them), burn's
layouts (``nn.Linear`` weights ``[in, out]``) and random ParamIds drawn from a seeded generator.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "hf"
VOCAB, CTX, HIDDEN = 32, 16, 16
STEPS = 2
HYPER = {"learning_rate": 3e-3, "weight_decay": 0.1, "adam_beta1": 0.85, "adam_beta2": 0.95, "adam_epsilon": 1e-6}


def configs(transformers) -> dict:
    """The tiny models per release: v5 all four, v4 the two whose grouping tells the rules apart."""
    llama = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=24, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=CTX,
                 bos_token_id=0, eos_token_id=0, pad_token_id=0)
    out = {
        "llama": lambda: transformers.LlamaConfig(**llama, tie_word_embeddings=False),
        "llama-tied": lambda: transformers.LlamaConfig(**llama, tie_word_embeddings=True),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=CTX, n_embd=HIDDEN, n_layer=1, n_head=2,
                                                bos_token_id=0, eos_token_id=0),
        "qwen2": lambda: transformers.Qwen2Config(**llama, tie_word_embeddings=True),
    }
    if transformers.__version__.startswith("4."):
        return {k: out[k] for k in ("llama-tied", "qwen2")}
    return out


ARCH = {"llama": "LlamaForCausalLM", "llama-tied": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel",
        "qwen2": "Qwen2ForCausalLM"}


def owner_kind(module, torch, transformers) -> str:
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and isinstance(module, transformers.pytorch_utils.Conv1D):
        return "conv1d"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    if isinstance(module, torch.nn.LayerNorm) or "norm" in type(module).__name__.lower():
        return "norm"
    return "other"


def trainer_checkpoint(name: str, make_config, tag: str) -> None:
    import torch
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    transformers.set_seed(0)
    config = make_config()
    model = getattr(transformers, ARCH[name])(config)
    truth: dict = {}

    class Truth(TrainerCallback):
        def on_save(self, args, state, control, model=None, optimizer=None, **kw):
            by_param = {p: n for n, p in model.named_parameters()}
            truth["groups"] = [[by_param[p] for p in g["params"]] for g in optimizer.param_groups]
            truth["group_weight_decay"] = [g["weight_decay"] for g in optimizer.param_groups]
            params = {}
            for n, p in model.named_parameters():
                owner = model.get_submodule(n.rpartition(".")[0])
                params[n] = {"shape": list(p.shape), "module": type(owner).__name__,
                             "kind": owner_kind(owner, torch, transformers)}
            truth["params"] = params
            every = dict(model.named_parameters(remove_duplicate=False))
            truth["tied"] = {n: first for n, p in every.items() for first, q in model.named_parameters()
                             if q is p and n != first}
            truth["optim"] = str(getattr(args.optim, "value", args.optim))
            truth["hyperparams"] = {k: getattr(args, k) for k in HYPER}
            truth["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}

    ids = torch.randint(0, VOCAB, (16, CTX), generator=torch.Generator().manual_seed(1))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=STEPS, save_strategy="steps", save_steps=STEPS, per_device_train_batch_size=4,
            warmup_steps=1, lr_scheduler_type="linear", logging_steps=100, report_to="none", use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True, **HYPER)
        Trainer(model=model, args=args, train_dataset=Data(), callbacks=[Truth()]).train()
        dest = OUT / tag / name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        shutil.copytree(Path(tmp) / f"checkpoint-{STEPS}", dest / f"checkpoint-{STEPS}",
                        ignore=shutil.ignore_patterns("rng_state*.pth"))
    (dest / "truth.json").write_text(json.dumps(truth, indent=1) + "\n")


def burn_models() -> None:
    """Burn-like model files (statekit's writer, see the module docstring) for the v5 checkpoints."""
    import numpy as np
    from safetensors.numpy import load_file

    from statekit.frameworks import burn
    from statekit.state import ModelInfo, ModelParam
    from statekit.tensor import TensorRef

    rng = np.random.default_rng(20)
    for folder in sorted((OUT / "v5").iterdir()):
        truth = json.loads((folder / "truth.json").read_text())
        arrays = load_file(str(folder / f"checkpoint-{STEPS}" / "model.safetensors"))
        params = []
        for name, info in truth["params"].items():
            array = np.asarray(arrays[truth["tied"].get(name, name)], dtype=np.float32)
            path = name
            if info["kind"] == "linear" and name.endswith(".weight"):
                array = np.ascontiguousarray(array.T)
            if info["kind"] == "norm":
                path = name[: -len("weight")] + "gamma" if name.endswith(".weight") else name[: -len("bias")] + "beta"
            params.append(ModelParam(path, tuple(array.shape), "F32", id=int(rng.integers(1, 2**63)),
                                     tensor=TensorRef.from_array(array)))
        burn.save_model(ModelInfo(params, order="burn"), str(folder / "burn-model.bpk"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--burn-models", action="store_true")
    if parser.parse_args().burn_models:
        burn_models()
    else:
        import transformers

        tag = "v" + transformers.__version__.split(".")[0]
        for name, make in configs(transformers).items():
            trainer_checkpoint(name, make, tag)
    for path in sorted(OUT.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size:>8}  {path.relative_to(OUT)}")


if __name__ == "__main__":
    main()
