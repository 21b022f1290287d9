#!/usr/bin/env python3
"""Write ``fixtures/report/qwen2-32/``: a real 32-layer Trainer run, for the report laid along depth.

    nice python3 scripts/make_report_depth_fixture.py        # torch 2.13, transformers 5.x, accelerate

A ``Qwen2ForCausalLM`` from a config with 32 layers and a tiny hidden size (16; untied ``lm_head``, so
the tensors off the layer pattern are the embedding, the final norm and the head), no download,
trained 6 steps by ``transformers.Trainer`` on CPU on random tokens (AdamW, constant learning rate
2e-3, weight decay 0.1: Trainer's two groups, decayed weights then biases and norms). Trainer saves
``checkpoint-3/`` and ``checkpoint-6/`` (less ``rng_state.pth``, random-number state not read by
statekit). One fault is planted the way a partial load makes it:

- at the end of step 6, before Trainer saves, the state of ``model.layers.17.mlp.down_proj.weight``
  is replaced by the entry torch's AdamW creates for a parameter it has not stepped yet
  (``step`` 0, ``exp_avg`` and ``exp_avg_sq`` zero): in ``checkpoint-6`` that tensor is reset to
  step 0, and against ``checkpoint-3`` its v fell to 0.

Every ``self_attn.k_proj.bias`` gets (nearly) no gradient of its own (softmax is blind to a shift
of every key by the same vector): their ε-domination is the model's, not planted.
``truth.json``: each parameter's name, shape and param group as the live optimizer held them, and
the reset tensor. Tests read the committed files; they do not run this.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "report" / "qwen2-32"
LAYERS, HIDDEN, VOCAB, CTX = 32, 16, 64, 16
STEPS, SAVE = 6, 3
RESET = "model.layers.17.mlp.down_proj.weight"
HYPER = {"learning_rate": 2e-3, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-8}


def main() -> None:
    import torch
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    transformers.set_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                                      num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=CTX, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.Qwen2ForCausalLM(config)
    truth: dict = {}

    class Plant(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            opt = getattr(optimizer, "optimizer", optimizer)
            by_param = {p: n for n, p in model.named_parameters()}
            truth["groups"] = [[by_param[p] for p in g["params"]] for g in opt.param_groups]
            truth["shapes"] = {n: list(p.shape) for n, p in model.named_parameters()}
            if state.global_step == STEPS:
                p = dict(model.named_parameters())[RESET]
                # what torch.optim.AdamW._init_group makes for a parameter without state
                opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}
                truth["reset"] = RESET

    ids = torch.randint(0, VOCAB, (64, CTX), generator=torch.Generator().manual_seed(1))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=STEPS, save_strategy="steps", save_steps=SAVE, per_device_train_batch_size=8,
            lr_scheduler_type="constant", logging_steps=100, report_to="none", use_cpu=True, seed=0,
            dataloader_num_workers=0, disable_tqdm=True, **HYPER)
        Trainer(model=model, args=args, train_dataset=Data(), callbacks=[Plant()]).train()
        shutil.rmtree(OUT, ignore_errors=True)
        OUT.mkdir(parents=True)
        for step in (SAVE, STEPS):
            shutil.copytree(Path(tmp) / f"checkpoint-{step}", OUT / f"checkpoint-{step}",
                            ignore=shutil.ignore_patterns("rng_state*.pth"))
    truth["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    truth["hyperparams"] = HYPER
    (OUT / "truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    for path in sorted(OUT.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size:>8}  {path.relative_to(OUT)}")


if __name__ == "__main__":
    main()
