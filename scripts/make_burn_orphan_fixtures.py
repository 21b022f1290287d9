#!/usr/bin/env python3
"""Write the burn #5130 fixtures under ``fixtures/burn-orphans/``: an AdamW record grown over three
relaunches, the model files beside it, and the record a fixed burn would have written.

burn #5130 (before PR #5177): ``Module::load_record`` restored a model's weights but not its
ParamIds, so every relaunch gave the same module paths new random ids. ``ModuleOptimizer::
load_record`` still loaded the old record, keyed by the old ids and each with its path (the
record's metadata map), and ``to_record`` wrote every context it held: the orphaned states of each
earlier launch beside the new ones, which started fresh (moments zero, ``time`` from 1) because
no state carried the new ids (burn-formats.md §2.1, §2.3; user-demand-2026.md rows 1 and 12).

The model, data, first ids and the update are ``make_fixtures.py``'s (burn's MLP 4 → 16 → 1,
burn 0.22 Adam in float32 with decoupled weight decay 1e-4 as AdamW); four launches of
``LAUNCHES`` steps each, the weights carried on, the state restarted. The record's tensors are in
one fixed shuffled order (burn writes them in its HashMap's order, unspecified), a parameter's
fields adjacent as burn flattens them.

- ``grown-optim.bpk``: the record after the fourth launch (the first launch plus three
  relaunches): four states per path, three of them orphaned.
- ``model.bpk``: the model the fourth launch saved (its ids: the live states of the record).
- ``model-new-ids.bpk``: the same weights under ids the record never saw (the model as a fifth
  launch loads it before its first step): no state is the model's.
- ``last-launch-optim.bpk``: the fourth launch's states only — what burn with PR #5177 keeps.

Run from the repository root: ``python scripts/make_burn_orphan_fixtures.py`` (idempotent).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack  # noqa: E402
from statekit.tensor import TensorRef  # noqa: E402

_spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(ROOT, "scripts", "make_fixtures.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

OUT = os.path.join(ROOT, "fixtures", "burn-orphans")
F = np.float32
# steps per launch: the last one is the shortest, so its step counter is the smallest in the file
LAUNCHES = (7, 5, 6, 3)
LR, WD = 1e-2, 1e-4
FIELDS = (("momentum.moment_1", "moment_1"), ("momentum.moment_2", "moment_2"))


def launch_ids(n: int) -> dict[str, int]:
    """The ids burn drew for launch ``n`` (8 random bytes read little-endian, IdGenerator::generate)."""
    if n == 0:
        return dict(base.IDS)
    rng = np.random.default_rng(5130 + n)
    return {p: int.from_bytes(rng.bytes(8), "little") for p in base.ORDER}


def launches():
    """``[(ids, state)]`` per launch and the final weights."""
    w = base.init_model()
    data = base.batches()
    out = []
    for n, steps in enumerate(LAUNCHES):
        state: dict[str, dict] = {p: {} for p in base.ORDER}
        for _ in range(steps):
            x, y = next(data)
            grads = base.gradients(w, x, y)
            for p in base.ORDER:
                w[p], state[p] = base.adam(w[p], grads[p], state[p], LR, decoupled_wd=WD)
        out.append((launch_ids(n), state))
    return out, w


def record(cohorts, weights, only=None, seed: int = 0):
    """The record ``to_record`` writes for these (ids, state) cohorts, contexts in a shuffled order;
    ``only``: the cohorts kept, in the same order (the record burn with PR #5177 writes)."""
    contexts = [(n, ids[p], p, state[p]) for n, (ids, state) in enumerate(cohorts) for p in base.ORDER]
    order = np.random.default_rng(seed).permutation(len(contexts))
    tensors, scalars, meta = [], {}, {}
    for i in order:
        n, pid, path, st = contexts[i]
        if only is not None and n not in only:
            continue
        for native, key in FIELDS:
            tensors.append(PackTensor(f"{pid}.{native}", TensorRef.from_array(st[key].astype(F)), param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", weights[path].ndim)
        scalars[f"{pid}.momentum.time"] = Scalar("UInt", int(st["time"]))
        meta[str(pid)] = path
    return tensors, meta, scalars


def write(name, tensors, meta=None, scalars=None):
    path = os.path.join(OUT, name)
    write_burnpack(path, tensors, meta, scalars)
    print(f"{os.path.relpath(path, ROOT)}: {os.path.getsize(path)} bytes")


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    cohorts, w = launches()
    write("grown-optim.bpk", *record(cohorts, w))
    write("last-launch-optim.bpk", *record(cohorts, w, only={len(cohorts) - 1}))
    last = cohorts[-1][0]
    write("model.bpk", [PackTensor(p, TensorRef.from_array(w[p]), param_id=last[p]) for p in base.ORDER])
    fresh = launch_ids(len(LAUNCHES))
    write("model-new-ids.bpk", [PackTensor(p, TensorRef.from_array(w[p]), param_id=fresh[p]) for p in base.ORDER])


if __name__ == "__main__":
    main()
