#!/usr/bin/env python3
"""Write ``fixtures/migration/``: models after a refactor and optimizer states with planted problems.

Everything derives from ``fixtures/hand-optim.bpk`` / ``hand-model.bpk`` (burn Adam after 21 steps
on the 4 → 16 → 1 MLP, ``scripts/make_fixtures.py``), so each file differs from the originals in
exactly the way its name says:

==========================  ==================================================================
model-renamed.bpk           l1 → encoder.0, l2 → head, fresh ParamIds (a renamed, re-initialised model)
model-new-head.bpk          the same model plus aux_head.weight [16, 3] and aux_head.bias [3]
model-grown.bpk             l1.weight grown from [4, 16] to [6, 16] (same id: a grown vocabulary)
optim-transposed.bpk        l1.weight's moments stored [16, 4] (torch's [out, in] layout)
optim-nan.bpk               2 NaN in l1.weight exp_avg, 1 +Inf in l2.weight exp_avg_sq
optim-zero.bpk              l1.bias exp_avg and exp_avg_sq all zero at step 21
optim-steps.bpk             l2.weight and l2.bias at step 5, the others at 21
optim-rank9.bpk             an extra parameter deep.kernel of rank 9 (burn loads ≤ 8)
optim-dup-path.bpk          an extra ParamId whose path is also l1.bias
optim-bad-rank.bpk          l1.weight's __rank says 3 (its tensors are 4×16)
optim-one-ulp.bpk           l1.weight exp_avg_sq[0, 0] one ULP larger (np.nextafter)
optim-l1.bpk, optim-l2.bpk  hand-optim.bpk split in two (l1.*, l2.*), as burn.save_optimizer writes them
optim-run2.bpk              a second run: the same model and ids, other training data (seed 2)
==========================  ==================================================================

Run from the repository root: ``python scripts/make_migration_fixtures.py`` (idempotent; byte-stable).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import make_fixtures as mf  # noqa: E402

from statekit.formats.burnpack import PackTensor, write_burnpack  # noqa: E402
from statekit.frameworks import burn  # noqa: E402
from statekit.state import OptimizerState, ParamState  # noqa: E402
from statekit.tensor import TensorRef  # noqa: E402

FIX = os.path.join(ROOT, "fixtures")
OUT = os.path.join(FIX, "migration")
F = np.float32
# Fresh ParamIds (what a re-initialised burn model gets), fixed so the files are byte-stable.
NEW_IDS = {
    "encoder.0.weight": 11400714819323198485,
    "encoder.0.bias": 7046029254386353131,
    "head.weight": 14181476777654086739,
    "head.bias": 3202034522624059733,
    "aux_head.weight": 12605985483714917081,
    "aux_head.bias": 1442695040888963407,
    "deep.kernel": 6364136223846793005,
    "dup": 9650029242287828579,
}
RENAMED = {"l1.weight": "encoder.0.weight", "l1.bias": "encoder.0.bias", "l2.weight": "head.weight",
           "l2.bias": "head.bias"}


def load_state() -> tuple[OptimizerState, dict[str, dict[str, np.ndarray]]]:
    """hand-optim.bpk as a state whose slots are in-memory copies (the file can then be closed)."""
    ckpt = burn.open_checkpoint(os.path.join(FIX, "hand-optim.bpk"))
    state = ckpt.optimizer
    arrays = {p.path: {s: np.array(r.numpy()) for s, r in p.slots.items()} for p in state.params}
    for p in state.params:
        p.slots = {s: TensorRef.from_array(a, "F32") for s, a in arrays[p.path].items()}
    ckpt.close()
    return state, arrays


def with_params(state: OptimizerState, params: list[ParamState]) -> OptimizerState:
    return dataclasses.replace(state, params=params, groups=[])


def param(state: OptimizerState, path: str, **changes) -> ParamState:
    p = next(q for q in state.params if q.path == path)
    slots = changes.pop("arrays", None)
    new = dataclasses.replace(p, slots=dict(p.slots), extra=dict(p.extra), **changes)
    if slots is not None:
        new.slots = {s: TensorRef.from_array(a, "F32") for s, a in slots.items()}
    return new


def save(name: str, state: OptimizerState) -> None:
    path = os.path.join(OUT, name)
    burn.save_optimizer(state, path, metadata={})
    print(f"{path}: {os.path.getsize(path)} bytes")


def save_model(name: str, tensors: list[tuple[str, np.ndarray, int]]) -> None:
    path = os.path.join(OUT, name)
    write_burnpack(path, [PackTensor(n, TensorRef.from_array(a.astype(F)), param_id=i) for n, a, i in tensors])
    print(f"{path}: {os.path.getsize(path)} bytes")


def second_run(seed: int = 2) -> dict[str, dict]:
    """burn Adam for 21 steps from the same initial weights on other data (make_fixtures' arithmetic)."""
    w = mf.init_model()
    st: dict[str, dict] = {p: {} for p in mf.ORDER}
    data = mf.batches(seed)
    for _ in range(mf.STEPS):
        x, y = next(data)
        grads = mf.gradients(w, x, y)
        for p in mf.ORDER:
            w[p], st[p] = mf.adam(w[p], grads[p], st[p], 1e-2)
    return st


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    state, arrays = load_state()
    weights = {p: np.asarray(v) for p, v in np.load(os.path.join(FIX, "hand-train-adam.npz")).items()
               if p.endswith("/param")}
    w = {k.split("/")[0]: v for k, v in weights.items()}

    # --- models after a refactor
    save_model("model-renamed.bpk", [(RENAMED[p], w[p], NEW_IDS[RENAMED[p]]) for p in mf.ORDER])
    rng = np.random.default_rng(7)
    head = [("aux_head.weight", rng.uniform(-0.25, 0.25, (16, 3)), NEW_IDS["aux_head.weight"]),
            ("aux_head.bias", np.zeros(3), NEW_IDS["aux_head.bias"])]
    save_model("model-new-head.bpk", [(p, w[p], mf.IDS[p]) for p in mf.ORDER] + head)
    grown = {**w, "l1.weight": np.concatenate([w["l1.weight"], rng.uniform(-0.5, 0.5, (2, 16))])}
    save_model("model-grown.bpk", [(p, grown[p], mf.IDS[p]) for p in mf.ORDER])

    # --- states with one planted problem each
    everything = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]

    def variant(name: str, path: str, **changes) -> None:
        save(name, with_params(state, [param(state, p, **changes) if p == path else param(state, p)
                                       for p in everything]))

    l1w = arrays["l1.weight"]
    variant("optim-transposed.bpk", "l1.weight", arrays={s: np.ascontiguousarray(a.T) for s, a in l1w.items()})
    nan = {s: a.copy() for s, a in l1w.items()}
    nan["exp_avg"][0, 3] = nan["exp_avg"][2, 7] = np.nan
    inf = {s: a.copy() for s, a in arrays["l2.weight"].items()}
    inf["exp_avg_sq"][5, 0] = np.inf
    save("optim-nan.bpk", with_params(state, [param(state, "l1.weight", arrays=nan), param(state, "l1.bias"),
                                              param(state, "l2.weight", arrays=inf), param(state, "l2.bias")]))
    variant("optim-zero.bpk", "l1.bias", arrays={s: np.zeros_like(a) for s, a in arrays["l1.bias"].items()})
    save("optim-steps.bpk", with_params(state, [param(state, p, step=5 if p.startswith("l2") else 21)
                                                for p in everything]))
    deep_shape = (1, 1, 1, 1, 1, 1, 1, 2, 3)
    deep = ParamState(key=str(NEW_IDS["deep.kernel"]), id=NEW_IDS["deep.kernel"], path="deep.kernel", step=21,
                      family="adam", extra={"__step_kind": "UInt"},
                      slots={"exp_avg": TensorRef.from_array(np.full(deep_shape, 0.01, F), "F32"),
                             "exp_avg_sq": TensorRef.from_array(np.full(deep_shape, 1e-4, F), "F32")})
    save("optim-rank9.bpk", with_params(state, [param(state, p) for p in everything] + [deep]))
    dup = param(state, "l1.bias", key=str(NEW_IDS["dup"]), id=NEW_IDS["dup"])
    save("optim-dup-path.bpk", with_params(state, [param(state, p) for p in everything] + [dup]))
    variant("optim-bad-rank.bpk", "l1.weight", rank=3)
    ulp = {s: a.copy() for s, a in l1w.items()}
    ulp["exp_avg_sq"][0, 0] = np.nextafter(ulp["exp_avg_sq"][0, 0], np.float32(np.inf))
    variant("optim-one-ulp.bpk", "l1.weight", arrays=ulp)

    # --- inputs for merge
    save("optim-l1.bpk", with_params(state, [param(state, p) for p in everything[:2]]))
    save("optim-l2.bpk", with_params(state, [param(state, p) for p in everything[2:]]))
    run2 = second_run()
    save("optim-run2.bpk", with_params(state, [
        param(state, p, arrays={"exp_avg": run2[p]["moment_1"], "exp_avg_sq": run2[p]["moment_2"]},
              step=run2[p]["time"]) for p in everything]))


if __name__ == "__main__":
    main()
