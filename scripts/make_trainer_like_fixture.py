"""Write fixtures/trainer_like/: a checkpoint laid out and grouped like Hugging Face Trainer's, with plain torch.

Trainer builds its optimizer with two param groups: the parameters that get weight decay (every
weight except LayerNorm weights), then those that do not (biases and LayerNorm weights), each in
``model.named_parameters()`` order (``Trainer.get_decay_parameter_names``). So the optimizer's
positions are NOT in named_parameters() order, which is what this fixture is for. The model is a
tiny GPT-2-like network (2 blocks, Conv1D weights stored [in, out] as in transformers, the LM
head tied to the token embedding): 28 parameters, several sharing a shape.

Files: ``optimizer.pt`` (AdamW state after 3 steps), ``scheduler.pt`` (LambdaLR), ``pytorch_model.bin``
(the state_dict: named_parameters() order, tied head included), ``model.safetensors`` (sorted by
name, tied head removed, as save_pretrained writes it), ``names.txt`` (named_parameters() order),
``trainer_state.json``. Run: ``python3 scripts/make_trainer_like_fixture.py`` (torch 2.13).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

OUT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trainer_like")
D, VOCAB, CTX, LAYERS = 16, 50, 8, 2


class Conv1D(nn.Module):  # transformers' Conv1D: weight [in, out]
    def __init__(self, n_out: int, n_in: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.attn = nn.Module()
        self.attn.c_attn = Conv1D(3 * D, D)
        self.attn.c_proj = Conv1D(D, D)
        self.ln_2 = nn.LayerNorm(D)
        self.mlp = nn.Module()
        self.mlp.c_fc = Conv1D(4 * D, D)
        self.mlp.c_proj = Conv1D(D, 4 * D)

    def forward(self, x):
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(D, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1)
        x = x + self.attn.c_proj(att @ v)
        return x + self.mlp.c_proj(torch.nn.functional.gelu(self.mlp.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(VOCAB, D)
        self.transformer.wpe = nn.Embedding(CTX, D)
        self.transformer.h = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.transformer.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT-2

    def forward(self, ids):
        t = self.transformer
        x = t.wte(ids) + t.wpe(torch.arange(ids.shape[1]))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Trainer's rule: every parameter except biases and LayerNorm parameters gets weight decay."""
    norm = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, nn.LayerNorm) for p, _ in m.named_parameters()}
    return [n for n, _ in model.named_parameters() if n not in norm and not n.endswith("bias")]


def trainer_optimizer(model: nn.Module, lr: float = 5e-3, weight_decay: float = 0.01):
    decay = set(decay_parameter_names(model))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def lr_lambda(step: int) -> float:  # Trainer's linear schedule with warmup (2 warmup, 20 total)
    return step / 2 if step < 2 else max(0.0, (20 - step) / 18)


def batch(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, VOCAB, (4, CTX), generator=g)


def train_step(model, opt, sched, i: int) -> None:
    ids = batch(i)
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT()
    opt = trainer_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    return model, opt, sched


def main() -> None:
    assert torch.__version__.startswith("2.13"), torch.__version__
    from safetensors.torch import save_file

    model, opt, sched = build()
    for i in range(3):
        train_step(model, opt, sched, i)
    os.makedirs(OUT, exist_ok=True)
    torch.save(opt.state_dict(), os.path.join(OUT, "optimizer.pt"))
    torch.save(sched.state_dict(), os.path.join(OUT, "scheduler.pt"))
    torch.save(model.state_dict(), os.path.join(OUT, "pytorch_model.bin"))
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, os.path.join(OUT, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(OUT, "names.txt"), "w") as fh:
        fh.writelines(f"{n}\n" for n, _ in model.named_parameters())
    with open(os.path.join(OUT, "trainer_state.json"), "w") as fh:
        json.dump({"global_step": 3, "max_steps": 20}, fh)
    print(f"wrote {OUT}: {len(list(model.parameters()))} parameters, groups "
          f"{[len(g['params']) for g in opt.param_groups]}", file=sys.stderr)


if __name__ == "__main__":
    main()
