#!/usr/bin/env python3
"""Write the torch-made optimizer fixtures in ``fixtures/torch_optim/`` (needs torch 2.13).

    python scripts/make_torch_optim_fixtures.py

Each run is a tiny model trained a few steps by ``torch.optim`` itself, saved the way training
code saves it (``{"model": ..., "optimizer": ...}``), plus what the same run did next as the
reference a resumed run must reproduce:

- ``adafactor.pt``: ``torch.optim.Adafactor`` (weight decay 0.01), 3 steps on an MLP 4 → 6 → 3;
- ``muon_adamw.pt``: ``torch.optim.Muon`` over the 2-D weights and ``torch.optim.AdamW`` over
  the rest, two optimizers and two state_dicts (``"muon"``, ``"adamw"``; torch's Muon refuses any
  parameter that is not 2-D, so real runs pair it so), 3 steps; ``muon.pt`` / ``adamw.pt`` hold
  the same two state_dicts alone, ``muon_names.txt`` the model's ``named_parameters()`` with shapes;
- ``lbfgs.pt``: ``torch.optim.LBFGS`` (max_iter 4, history_size 3: the history wraps), 3 steps
  on a model 3 → 4 → 2 whose weights are [out, in]; ``lbfgs_wolfe.pt`` the same with
  ``line_search_fn="strong_wolfe"``.

``<name>_next.pt`` holds the batches of 3 more steps and the parameters (and optimizer
state_dicts) after them. Tests resume from the saved state with real torch and compare, so
nothing here hard-codes an expected value.
"""

from __future__ import annotations

from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "torch_optim"
STEPS, NEXT = 3, 3


def mlp(sizes=(4, 6, 3), seed=0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def batches(n, d_in=4, d_out=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, d_in, generator=gen), torch.randn(8, d_out, generator=gen)) for _ in range(n)]


def train(model, optimizers, data):
    for x, y in data:
        for opt in optimizers:
            opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for opt in optimizers:
            opt.step()


def train_lbfgs(model, opt, data):
    for x, y in data:
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def adafactor() -> None:
    model = mlp()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.01)
    data = batches(STEPS + NEXT)
    train(model, [opt], data[:STEPS])
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, OUT / "adafactor.pt")
    train(model, [opt], data[STEPS:])
    torch.save({"batches": data[STEPS:], "params": params(model), "optimizer": opt.state_dict()},
               OUT / "adafactor_next.pt")


def muon_pair(model):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return (torch.optim.Muon(matrices, lr=0.02, momentum=0.95, weight_decay=0.1),
            torch.optim.AdamW(others, lr=3e-3, weight_decay=0.0))


def muon_adamw() -> None:
    model = mlp((4, 8, 3))
    muon, adamw = muon_pair(model)
    data = batches(STEPS + NEXT)
    train(model, [muon, adamw], data[:STEPS])
    torch.save({"model": model.state_dict(), "muon": muon.state_dict(), "adamw": adamw.state_dict()},
               OUT / "muon_adamw.pt")
    torch.save(muon.state_dict(), OUT / "muon.pt")
    torch.save(adamw.state_dict(), OUT / "adamw.pt")
    (OUT / "muon_names.txt").write_text("".join(f"{n} {list(p.shape)}\n" for n, p in model.named_parameters()))
    train(model, [muon, adamw], data[STEPS:])
    torch.save({"batches": data[STEPS:], "params": params(model), "muon": muon.state_dict(),
                "adamw": adamw.state_dict()}, OUT / "muon_adamw_next.pt")


def lbfgs(name: str, **kw) -> None:
    model = mlp((3, 4, 2))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3, **kw)
    data = batches(STEPS + NEXT, d_in=3, d_out=2, seed=2)
    train_lbfgs(model, opt, data[:STEPS])
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, OUT / f"{name}.pt")
    train_lbfgs(model, opt, data[STEPS:])
    torch.save({"batches": data[STEPS:], "params": params(model), "optimizer": opt.state_dict()},
               OUT / f"{name}_next.pt")


def main() -> None:
    assert torch.__version__.startswith("2.13"), torch.__version__
    OUT.mkdir(parents=True, exist_ok=True)
    adafactor()
    muon_adamw()
    lbfgs("lbfgs")
    lbfgs("lbfgs_wolfe", line_search_fn="strong_wolfe")
    for path in sorted(OUT.iterdir()):
        print(f"{path.name}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
