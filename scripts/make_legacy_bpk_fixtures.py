#!/usr/bin/env python3
"""Write ``fixtures/legacy-bpk/``: the burn 0.22 burnpack records of the states in ``fixtures/legacy/``.

Built from ``fixtures/legacy/truth.npz`` alone (never from the legacy files or statekit's legacy
reader), following ``docs/burn-formats.md`` §2 and the §4.6 migration table: tensors
``<decimal id>.momentum.<field>`` with ``param_id``, scalars ``<id>.__rank`` and ``<id>.momentum.time``
(``UInt``), metadata ``<id> → module path``. Half-precision records keep F16 tensors. Parameters
and fields are written in the legacy files' order (l1.weight, l1.bias, l2.weight, l2.bias;
moment_1, moment_2, max_moment_2), so a conversion that keeps that order is byte-identical.

Usage: ``python scripts/make_legacy_bpk_fixtures.py [--check]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack
from statekit.tensor import TensorRef

ROOT = Path(__file__).resolve().parent.parent
TRUTH = ROOT / "fixtures" / "legacy" / "truth.npz"
OUT = ROOT / "fixtures" / "legacy-bpk"
ADAM = ("moment_1", "moment_2")

# name → (fields, dtype, has the momentum.time step)
OPTIMIZERS = {
    "adam_full.bpk": (ADAM, "F32", True),
    "adam_half.bpk": (ADAM, "F16", True),
    "adamw_amsgrad.bpk": ((*ADAM, "max_moment_2"), "F32", True),
    "sgd_momentum.bpk": (("velocity",), "F32", False),
    "sgd_momentum_half.bpk": (("velocity",), "F16", False),
}
NUMPY = {"F32": np.float32, "F16": np.float16}


def optimizer(truth: dict, fields: tuple[str, ...], dtype: str, timed: bool):
    tensors, meta, scalars = [], {}, {}
    for pid, path in zip(truth["ids"].tolist(), truth["paths"].tolist(), strict=True):
        for name in fields:
            arr = truth[f"{pid}.momentum.{name}"].astype(NUMPY[dtype])
            tensors.append(PackTensor(f"{pid}.momentum.{name}", TensorRef.from_array(arr, dtype), param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", int(truth[f"{pid}.__rank"]))
        if timed:
            scalars[f"{pid}.momentum.time"] = Scalar("UInt", int(truth[f"{pid}.momentum.time"]))
        meta[str(pid)] = path
    return tensors, meta, scalars


def model(truth: dict):
    tensors = [
        PackTensor(path, TensorRef.from_array(truth[f"model.{path}"], "F32"), param_id=pid)
        for pid, path in zip(truth["ids"].tolist(), truth["paths"].tolist(), strict=True)
    ]
    return tensors, {}, {}


def build(out: Path) -> list[Path]:
    truth = dict(np.load(TRUTH))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (fields, dtype, timed) in OPTIMIZERS.items():
        write_burnpack(out / name, *optimizer(truth, fields, dtype, timed))
        written.append(out / name)
    write_burnpack(out / "model-21.bpk", *model(truth))
    written.append(out / "model-21.bpk")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with fixtures/legacy-bpk instead of writing")
    args = parser.parse_args(argv)
    if not args.check:
        for path in build(OUT):
            print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [p.name for p in build(Path(tmp)) if p.read_bytes() != (OUT / p.name).read_bytes()]
    for name in stale:
        print(f"stale: fixtures/legacy-bpk/{name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
