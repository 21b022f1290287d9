#!/usr/bin/env python3
"""Write the states ``statekit report`` is tested on, in ``fixtures/report/`` (needs torch 2.13).

    python scripts/make_report_fixtures.py

A small tanh MLP (``inp`` 16 → 64, ``hidden.0..3`` 64 → 64, ``head`` 64 → 8) trained by
``torch.optim.AdamW`` (lr 1e-3, weight decay 0.01, named parameters: the state keeps their paths)
on a fixed regression task, with faults planted the way they happen:

- ``hidden.2.weight``'s gradients are scaled by 1e-9 (a hook), from the first step: its √v̂ sits
  far below ε = 1e-8 (an ε-dominated tensor);
- ``a.pt``: the optimizer's state_dict after 50 steps;
- then ``hidden.1.weight``'s state is dropped (``del opt.state[p]``, as a partial load does) and
  training goes on 10 steps: its step restarts at 1 (a reset tensor);
- ``b.pt``: the state_dict after 60 steps, with one element of ``head.weight``'s ``exp_avg_sq``
  set to NaN; ``model.pt``: the model's state_dict after 60 steps (``--weights``).

Tests read the same files with ``torch.load`` and recompute every number with numpy.
"""

from __future__ import annotations

from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "report"
EPS_TENSOR, RESET_TENSOR, NAN_TENSOR = "hidden.2.weight", "hidden.1.weight", "head.weight"


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 64)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.head(x)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = MLP()
    params = dict(model.named_parameters())
    params[EPS_TENSOR].register_hook(lambda g: g * 1e-9)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.01)
    x = torch.randn(256, 16)
    target = torch.sin(x @ torch.randn(16, 8))

    def step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()

    for _ in range(50):
        step()
    torch.save(opt.state_dict(), OUT / "a.pt")
    del opt.state[params[RESET_TENSOR]]
    for _ in range(10):
        step()
    state = opt.state_dict()
    names = state["param_groups"][0]["param_names"]
    state["state"][names.index(NAN_TENSOR)]["exp_avg_sq"].view(-1)[7] = float("nan")
    torch.save(state, OUT / "b.pt")
    torch.save(model.state_dict(), OUT / "model.pt")


if __name__ == "__main__":
    main()
