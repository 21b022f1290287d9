"""Write ``fixtures/thirdparty/``: optimizer states saved by the optimizers people add to torch.

    /work/venvs/thirdparty/bin/python scripts/make_thirdparty_fixtures.py

Needs torch 2.13 and torchao, transformers, schedulefree, lion-pytorch, torch-optimi,
galore-torch and grokadamw (the test suite does not: it reads the committed files). Each optimizer
trains a tiny model a few steps on seeded random data on CPU, and its ``optimizer.state_dict()`` is
saved with ``torch.save`` exactly as a training script (or the HF Trainer) does:

* ``torchao-adamw8bit.pt``, ``torchao-adamw4bit.pt``, ``torchao-adamwfp8.pt``,
  ``torchao-adamw8bit-bf16.pt`` (a bfloat16 model) — torchao's low-bit AdamW. The 64×64 weight
  (4096 elements) holds ``OptimState8bit`` / ``OptimState4bit`` / ``OptimStateFp8`` moments, the
  other tensors plain ones (torchao quantizes only ≥ 4096 elements divisible by the block size).
  ``torchao-reference.safetensors`` keeps torchao's own ``dequantize()`` of every moment
  (``<file stem>.<param index>.<field>``, float32; plain moments as they are).
* ``hf-adafactor-relative.pt`` (transformers' defaults: relative step, parameter scaling),
  ``hf-adafactor-trainer.pt`` (what ``Trainer(optim="adafactor")`` builds: ``scale_parameter=False,
  relative_step=False``), ``hf-adafactor-beta1.pt`` (``beta1=0.9``: a first moment),
  ``hf-adafactor-resume.safetensors`` — for the relative-step run: the model after step 3
  (``param.<i>``), the gradients of steps 4..8 (``grad.<k>.<i>``) and the model after step 8 as
  transformers' Adafactor continued it (``final.<i>``).
* ``lion-pytorch.pt`` (lucidrains' Lion, weight decay 0.1) and ``lion-resume.safetensors`` (the
  same layout as above: what lion-pytorch did in steps 4..8).
* ``schedulefree-adamw.pt``, ``schedulefree-sgd.pt``, ``schedulefree-radam.pt`` (saved in train
  mode, as the Trainer does), ``schedulefree-adamw-eval.pt`` (after ``optimizer.eval()``).
* ``optimi-stableadamw.pt`` (torch-optimi StableAdamW: the step in the param group, a 0-d tensor).
* ``galore-adamw.pt`` (GaLoreAdamW: a ``GaLoreProjector`` object in the state) and
  ``grokadamw.pt`` (GrokAdamW: its state keyed by the parameters themselves, in the param group).
* ``apex-fusedadam.pt`` and ``deepspeed-fusedadam.pt`` — apex and DeepSpeed's FusedAdam need CUDA
  to step, so these two are built, not run: torch.optim.Adam steps the model and its moments are
  laid out as each FusedAdam's ``state_dict()`` lays them out (apex: no per-parameter step, ``step``
  and ``bias_correction`` in the group; DeepSpeed: an int ``step`` per parameter,
  ``bias_correction`` in the group). ``fusedadam-reference.safetensors`` keeps the torch Adam
  state they came from (``<param index>.<field>``).

Every model is seeded; files are small (a few KB to tens of KB).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "thirdparty"
STEPS, MORE = 3, 5

warnings.filterwarnings("ignore")


def small_model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4, bias=False)).to(dtype)


def ao_model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10)).to(dtype)


def batch(model: torch.nn.Module, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    first = next(model.parameters())
    g = torch.Generator().manual_seed(1000 + k)
    x = torch.randn(16, first.shape[1], generator=g).to(first.dtype)
    y = torch.randn(16, list(model.parameters())[-1].shape[0], generator=g).to(first.dtype)
    return x, y


def grads(model: torch.nn.Module, k: int) -> None:
    model.zero_grad()
    x, y = batch(model, k)
    torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()


def train(model, opt, steps: int = STEPS, start: int = 0) -> None:
    for k in range(start, start + steps):
        grads(model, k)
        opt.step()


def save(obj, name: str) -> None:
    torch.save(obj, OUT / name)
    print(f"{name}: {(OUT / name).stat().st_size} bytes")


def resume_reference(model, opt, name: str) -> None:
    """The model now, the gradients of MORE more steps, and the model after the library took them."""
    tensors = {f"param.{i}": p.detach().clone() for i, p in enumerate(model.parameters())}
    for k in range(STEPS, STEPS + MORE):
        grads(model, k)
        for i, p in enumerate(model.parameters()):
            tensors[f"grad.{k}.{i}"] = p.grad.detach().clone()
        opt.step()
    tensors.update({f"final.{i}": p.detach().clone() for i, p in enumerate(model.parameters())})
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT / name)
    print(f"{name}: {(OUT / name).stat().st_size} bytes")


def torchao_files() -> None:
    from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

    reference = {}
    for stem, cls, dtype in (("torchao-adamw8bit", AdamW8bit, torch.float32),
                             ("torchao-adamw4bit", AdamW4bit, torch.float32),
                             ("torchao-adamwfp8", AdamWFp8, torch.float32),
                             ("torchao-adamw8bit-bf16", AdamW8bit, torch.bfloat16)):
        model = ao_model(dtype=dtype)
        opt = cls(model.parameters(), lr=1e-2, weight_decay=0.01)
        train(model, opt)
        sd = opt.state_dict()
        save(sd, f"{stem}.pt")
        for idx, entry in sd["state"].items():
            for field, value in entry.items():
                if field == "step":
                    continue
                plain = value.dequantize() if hasattr(value, "dequantize") and type(value) is not torch.Tensor \
                    else value
                reference[f"{stem}.{idx}.{field}"] = plain.detach().clone().contiguous()
        # the same moments as torchao's own dtype conversion gives them (what torch AdamW would load)
    save_file(reference, OUT / "torchao-reference.safetensors")
    print(f"torchao-reference.safetensors: {(OUT / 'torchao-reference.safetensors').stat().st_size} bytes")


def adafactor_files() -> None:
    from transformers.optimization import Adafactor

    model = small_model()
    opt = Adafactor(model.parameters())  # lr=None, relative_step, scale_parameter, warmup_init=False
    train(model, opt)
    save(opt.state_dict(), "hf-adafactor-relative.pt")
    resume_reference(model, opt, "hf-adafactor-resume.safetensors")

    model = small_model()
    opt = Adafactor(model.parameters(), lr=1e-3, scale_parameter=False, relative_step=False)
    train(model, opt)
    save(opt.state_dict(), "hf-adafactor-trainer.pt")

    model = small_model()
    opt = Adafactor(model.parameters(), lr=1e-3, beta1=0.9, relative_step=False)
    train(model, opt)
    save(opt.state_dict(), "hf-adafactor-beta1.pt")


def lion_files() -> None:
    from lion_pytorch import Lion

    model = small_model()
    opt = Lion(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    train(model, opt)
    save(opt.state_dict(), "lion-pytorch.pt")
    resume_reference(model, opt, "lion-resume.safetensors")


def schedulefree_files() -> None:
    import schedulefree

    for stem, make in (("schedulefree-adamw", lambda ps: schedulefree.AdamWScheduleFree(ps, lr=1e-2, warmup_steps=2)),
                       ("schedulefree-sgd", lambda ps: schedulefree.SGDScheduleFree(ps, lr=1e-2, warmup_steps=2)),
                       ("schedulefree-radam", lambda ps: schedulefree.RAdamScheduleFree(ps, lr=1e-2))):
        model = small_model()
        opt = make(model.parameters())
        opt.train()
        train(model, opt)
        save(opt.state_dict(), f"{stem}.pt")
        if stem == "schedulefree-adamw":
            opt.eval()
            save(opt.state_dict(), f"{stem}-eval.pt")


def optimi_files() -> None:
    from optimi import StableAdamW

    model = small_model()
    opt = StableAdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    train(model, opt)
    save(opt.state_dict(), "optimi-stableadamw.pt")


def galore_grok_files() -> None:
    from galore_torch import GaLoreAdamW
    from grokadamw import GrokAdamW

    model = small_model()
    weights = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    opt = GaLoreAdamW([{"params": others},
                       {"params": weights, "rank": 2, "update_proj_gap": 2, "scale": 0.25, "proj_type": "std"}],
                      lr=1e-2)
    train(model, opt)
    save(opt.state_dict(), "galore-adamw.pt")

    model = small_model()
    opt = GrokAdamW(model.parameters(), lr=1e-2)
    train(model, opt)
    save(opt.state_dict(), "grokadamw.pt")


def fusedadam_files() -> None:
    model = small_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.0)
    train(model, opt)
    sd = opt.state_dict()
    reference = {f"{i}.{f}": v.clone().contiguous() for i, e in sd["state"].items() for f, v in e.items()}
    save_file(reference, OUT / "fusedadam-reference.safetensors")
    group = sd["param_groups"][0]
    common = {"lr": group["lr"], "bias_correction": True, "betas": group["betas"], "eps": group["eps"],
              "weight_decay": group["weight_decay"]}
    # apex/optimizers/fused_adam.py: state {exp_avg, exp_avg_sq} (float32), group carries the step
    apex = {"state": {i: {"exp_avg": e["exp_avg"], "exp_avg_sq": e["exp_avg_sq"]} for i, e in sd["state"].items()},
            "param_groups": [dict(common, step=STEPS, params=group["params"])]}
    save(apex, "apex-fusedadam.pt")
    # deepspeed/ops/adam/fused_adam.py: state {step: int, exp_avg, exp_avg_sq}; bias_correction in the group
    ds = {"state": {i: {"step": STEPS, "exp_avg": e["exp_avg"], "exp_avg_sq": e["exp_avg_sq"]}
                    for i, e in sd["state"].items()},
          "param_groups": [dict(common, params=group["params"])]}
    save(ds, "deepspeed-fusedadam.pt")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torchao_files()
    adafactor_files()
    lion_files()
    schedulefree_files()
    optimi_files()
    galore_grok_files()
    fusedadam_files()


if __name__ == "__main__":
    main()
