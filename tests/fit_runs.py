"""Real torch runs for tests/test_fit.py: a tiny model trained 2 steps, its trainable set (or its
optimizer) changed, then 3 more steps — once continued in memory (the optimizer's state moved to the
new optimizer by parameter object, as one would by hand: the run that never went through a file), once
through the saved state, ``statekit fit`` and ``optimizer.load_state_dict``. CPU, fixed seeds and data:
the two are compared bit for bit."""

from __future__ import annotations

import copy

import torch

BATCHES = 5


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.l1 = torch.nn.Linear(8, 8)
        self.l2 = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.head(torch.relu(self.l2(torch.relu(self.l1(self.embed(x))))))


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 10, (4, 6), generator=g), torch.randint(0, 10, (4, 6), generator=g)


def tiny_loss(model, i: int):
    x, y = batch(i)
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 10), y.reshape(-1))


def decay_groups(model, only=None, **hp):
    """Trainer-like groups over the trainable parameters: weights decayed, biases not; with names."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and (only is None or only(n))]
    return [dict(params=[p for n, p in named if n.endswith("weight")],
                 param_names=[n for n, p in named if n.endswith("weight")], weight_decay=0.1, **hp),
            dict(params=[p for n, p in named if not n.endswith("weight")],
                 param_names=[n for n, p in named if not n.endswith("weight")], weight_decay=0.0, **hp)]


def steps(model, optimizers, first: int, count: int, loss=tiny_loss) -> None:
    for i in range(first, first + count):
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        loss(model, i).backward()
        for o in optimizers:
            o.step()


def transplant(old_opt, old_model, new_opt, new_model, change=None) -> None:
    """The in-memory continuation: each new parameter that the old optimizer held gets its state
    (cloned; ``change(state)`` turns it into the new optimizer's), matched by name."""
    old = dict(old_model.named_parameters())
    for name, p in new_model.named_parameters():
        q = old.get(name)
        if q is not None and q in old_opt.state and any(p is r for g in new_opt.param_groups for r in g["params"]):
            st = {k: v.clone() for k, v in old_opt.state[q].items()}
            new_opt.state[p] = change(st) if change else st


def snapshot(model, optimizers) -> dict:
    """Every parameter's value and every optimizer's state, by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"w:{n}": p.detach().clone() for n, p in model.named_parameters()}
    for k, o in enumerate(optimizers):
        for p, st in o.state.items():
            for key, v in st.items():
                out[f"s{k}:{names[id(p)]}:{key}"] = v.clone() if torch.is_tensor(v) else v
    return out


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k
        else:
            assert x == y, k


def deep(obj):
    return copy.deepcopy(obj)
