#!/usr/bin/env python3
"""Write the candle fixtures in ``fixtures/candle/``.

A 4 → 16 → 1 MLP as candle-nn builds it (``linear(4, 16, vb.pp("l1"))``: ``l1.weight`` is
``[out, in]`` = ``[16, 4]``), trained for 21 steps of MSE regression with a numpy replica of
candle-nn's ``AdamW::step`` (``torch-candle-numerics.md`` §4.1: f64 bias corrections, tensor ×
scalar as an f32 affine op, decoupled decay ``θ·(1 − lr·wd)``). Files are written with the
``safetensors`` package itself, independently of statekit's writer:

- ``model.safetensors`` — the weights as ``VarMap::save`` writes them (no metadata);
- ``model-bf16.safetensors`` — the same weights in bf16;
- ``optimizer.safetensors`` — the AdamW state in statekit's candle layout (``docs/candle.md``):
  ``first_moment.<var>``, ``second_moment.<var>``, 0-dim I64 ``step_t``, metadata with the format
  tag and hyperparameters;
- ``optimizer-nometa.safetensors`` — the same tensors without metadata, as a candle user's
  ``candle::safetensors::save`` writes them.

Usage: ``python scripts/make_candle_fixtures.py [--check]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "fixtures" / "candle"
STEPS = 21
PARAMS = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
F32 = np.float32


def init() -> dict[str, np.ndarray]:
    """candle's ``linear`` init: weight ~ U(-1/sqrt(in), 1/sqrt(in)) ``[out, in]``, bias likewise."""
    rng = np.random.default_rng(7)
    w: dict[str, np.ndarray] = {}
    for name, (d_out, d_in) in {"l1": (16, 4), "l2": (1, 16)}.items():
        bound = 1.0 / np.sqrt(d_in)
        w[f"{name}.weight"] = rng.uniform(-bound, bound, (d_out, d_in)).astype(F32)
        w[f"{name}.bias"] = rng.uniform(-bound, bound, (d_out,)).astype(F32)
    return w


def grads(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """MSE of ``relu(x W1ᵀ + b1) W2ᵀ + b2`` against ``y``, gradients by hand in f32."""
    h_pre = x @ w["l1.weight"].T + w["l1.bias"]
    h = np.maximum(h_pre, F32(0))
    out = h @ w["l2.weight"].T + w["l2.bias"]
    d_out = (F32(2) * (out - y) / F32(y.size)).astype(F32)
    d_h = (d_out @ w["l2.weight"]) * (h_pre > 0)
    return {
        "l2.weight": (d_out.T @ h).astype(F32),
        "l2.bias": d_out.sum(axis=0).astype(F32),
        "l1.weight": (d_h.T @ x).astype(F32),
        "l1.bias": d_h.sum(axis=0).astype(F32),
    }


def affine(t: np.ndarray, mul: float, add: float = 0.0) -> np.ndarray:
    """candle's CPU ``affine``: ``t·mul + add`` with both scalars converted to the tensor dtype."""
    return (t * t.dtype.type(mul) + t.dtype.type(add)).astype(t.dtype)


def adamw_step(w, m, v, g, t: int, p: dict[str, float]) -> None:
    """One ``candle_nn::AdamW::step`` (step_t already incremented to ``t``)."""
    scale_m = 1.0 / (1.0 - p["beta1"] ** t)
    scale_v = 1.0 / (1.0 - p["beta2"] ** t)
    for name in w:
        m[name] = affine(m[name], p["beta1"]) + affine(g[name], 1.0 - p["beta1"])
        v[name] = affine(v[name], p["beta2"]) + affine(g[name] * g[name], 1.0 - p["beta2"])
        m_hat, v_hat = affine(m[name], scale_m), affine(v[name], scale_v)
        theta = affine(w[name], 1.0 - p["lr"] * p["weight_decay"])
        adjusted = m_hat / affine(np.sqrt(v_hat), 1.0, p["eps"])
        w[name] = (theta - affine(adjusted, p["lr"])).astype(F32)


def train() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Weights, first moments, second moments after ``STEPS`` steps (names as in the VarMap)."""
    rng = np.random.default_rng(8)
    w = init()
    m = {k: np.zeros_like(a) for k, a in w.items()}
    v = {k: np.zeros_like(a) for k, a in w.items()}
    for t in range(1, STEPS + 1):
        x = rng.standard_normal((8, 4)).astype(F32)
        y = np.sin(x.sum(axis=1, keepdims=True)).astype(F32)
        adamw_step(w, m, v, grads(w, x, y), t, PARAMS)
    return w, m, v


def metadata() -> dict[str, str]:
    meta = {"format": "statekit.candle_adamw", "format_version": "1", "optimizer": "candle_nn::AdamW",
            "step_t": str(STEPS), "source": "candle adamw"}
    meta.update({k: repr(v) for k, v in PARAMS.items()})
    return meta


def build(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    w, m, v = train()
    state = {f"first_moment.{k}": a for k, a in m.items()} | {f"second_moment.{k}": a for k, a in v.items()}
    state["step_t"] = np.array(STEPS, dtype=np.int64)
    files = {
        "model.safetensors": (w, None),
        "model-bf16.safetensors": ({k: a.astype(ml_dtypes.bfloat16) for k, a in w.items()}, None),
        "optimizer.safetensors": (state, metadata()),
        "optimizer-nometa.safetensors": (state, None),
    }
    for name, (tensors, meta) in files.items():
        save_file(tensors, str(out / name), metadata=meta)
    return [out / name for name in files]


def content(path: Path) -> tuple:
    """What a file holds, independent of the order of its metadata keys (the safetensors writer
    serialises its metadata HashMap in a random order)."""
    with safe_open(str(path), framework="np") as f:
        meta = f.metadata() or {}
        tensors = {k: (str(f.get_tensor(k).dtype), f.get_tensor(k).tobytes()) for k in f.keys()}
    return sorted(meta.items()), tensors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with fixtures/candle instead of writing")
    args = parser.parse_args(argv)
    if not args.check:
        for path in build(OUT):
            print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [p.name for p in build(Path(tmp)) if content(p) != content(OUT / p.name)]
    for name in stale:
        print(f"stale: fixtures/candle/{name}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
