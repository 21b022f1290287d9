"""Muon (momentum orthogonalised by Newton–Schulz): torch 2.13 (``torch.optim.Muon``; no foreach).

Hyperparameters: ``lr weight_decay momentum nesterov ns_coefficients eps ns_steps adjust_lr_fn``.
Slot: ``momentum_buffer`` (starts at 0; torch's buffer is an EMA, ``lerp``, not ``mu*B + g``).
Matrices only (torch refuses any other parameter in its constructor)::

    buf = lerp(buf, g, 1 - momentum)
    u = lerp(g, buf, momentum) if nesterov else buf
    X = NS(u)                                 (bfloat16, below)
    r = sqrt(max(1, A/B)) (adjust_lr_fn None / "original") or 0.2*sqrt(max(A, B)) ("match_rms_adamw")
    p = p * f32(1 - lr*wd);  p = fma(f32(X), f32(-lr*r), p)        (A, B = the parameter's shape)

Newton–Schulz, with torch's bfloat16 tensors (``(a, b, c) = ns_coefficients``)::

    X = bf16(u), transposed when A > B;  X = X / max(norm(X), eps)
    ns_steps times: G = X @ X.T;  G' = b*G + c*(G @ G);  X = a*X + G' @ X     (each a bfloat16 tensor)
    transposed back

With torch installed these are torch's own bfloat16 CPU kernels (``addmm``/``mm``/``norm`` on
zero-copy views): bit-exact. Without torch :func:`newton_schulz_bf16` emulates them with
``ml_dtypes``, following the accumulation order measured on torch's kernel (oneDNN on x86-64):
bit-identical on every matrix tried, but a model of one CPU's kernel rather than torch's code,
so :func:`statekit.optim.exactness` still says ``tolerance`` without torch.
"""

from __future__ import annotations

import math

import numpy as np

from statekit.errors import UsageError
from statekit.optim.backend import Backend
from statekit.optim.common import TORCH, lerp
from statekit.optim.tensorwise import make_tensor_step

_NP = Backend(np)


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``momentum_buffer``."""
    return ("momentum_buffer",)


def _check(shape, hp):
    if len(shape) != 2:
        raise UsageError(f"Muon steps matrices only; this parameter has shape {list(shape)} (torch refuses it too: "
                         "give it to another optimizer)")


def adjust_ratio(adjust_lr_fn, shape) -> float:
    """torch's ``_adjust_lr`` factor for a parameter of ``shape``."""
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    return 1.0


def _matmul_bf16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` of bfloat16 values (held in float32) as torch's CPU kernel (oneDNN) accumulates
    it, measured: one float32 accumulator per output, the inner dimension taken two at a time,
    the odd position of each pair first, each exact product added with one rounding."""
    acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
    k = a.shape[1]
    for q in range(0, k, 2):
        for r in ((q + 1, q) if q + 1 < k else (q,)):
            acc += np.multiply.outer(a[:, r], b[r, :])  # a bfloat16 product is exact in float32
    return acc


def _epilogue(acc: np.ndarray, alpha: float, beta: float, c: np.ndarray) -> np.ndarray:
    """``addmm``'s ``beta*c + alpha*acc``, as measured: ``fma(f32(beta), c, f32(alpha)*acc)``."""
    scaled = (np.float32(alpha) * acc).astype(np.float32)
    return np.asarray(_NP.fma32(np.ascontiguousarray(c, np.float32).reshape(-1), np.float32(beta),
                                scaled.reshape(-1)), dtype=np.float32).reshape(c.shape)


def newton_schulz_bf16(u: np.ndarray, coefficients, steps: int, eps: float) -> np.ndarray:
    """torch's ``_zeropower_via_newtonschulz`` emulated with ml_dtypes bfloat16 (float32 result).

    Every bfloat16 tensor is held as float32 values rounded to bfloat16 (round to nearest even);
    the products follow :func:`_matmul_bf16`, ``addmm`` :func:`_epilogue`, the norm is a float64
    sum rounded to float32 then bfloat16. Measured against torch's own kernels on an AMD EPYC
    (Zen 3, AVX2): bit-identical (docs/numerics.md §10).
    """
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16

    def rnd(x):
        return np.asarray(x, dtype=np.float32).astype(bf16).astype(np.float32)

    a, b, c = coefficients
    x = rnd(u)
    transposed = u.shape[0] > u.shape[1]
    if transposed:
        x = np.ascontiguousarray(x.T)
    norm = rnd(np.float32(np.sqrt(np.sum(np.square(x, dtype=np.float64)))))
    norm = rnd(max(float(norm), float(np.float32(eps))))
    x = rnd(x / norm)
    for _ in range(int(steps)):
        gram = rnd(_matmul_bf16(x, np.ascontiguousarray(x.T)))
        update = rnd(_epilogue(_matmul_bf16(gram, gram), c, b, gram))
        x = rnd(_epilogue(_matmul_bf16(update, x), 1.0, a, x))
    if transposed:
        x = np.ascontiguousarray(x.T)
    return x


def newton_schulz(u: np.ndarray, coefficients, steps: int, eps: float, ops) -> np.ndarray:
    """``_zeropower_via_newtonschulz`` as torch computes it (torch's kernels when installed)."""
    torch = ops.torch
    if torch is None:
        return newton_schulz_bf16(u, coefficients, steps, eps)
    a, b, c = coefficients
    x = torch.from_numpy(np.ascontiguousarray(u)).bfloat16()
    transposed = u.shape[0] > u.shape[1]
    if transposed:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(int(steps)):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    if transposed:
        x = x.T
    return x.float().numpy()


def _run(p, g, slots, step, hp, ops):
    momentum, lr, wd = hp["momentum"], hp["lr"], hp["weight_decay"]
    buf = slots.get("momentum_buffer", np.zeros_like(g))
    flat_g = g.reshape(-1)
    new_buf = np.asarray(lerp(_NP, buf.reshape(-1), flat_g, 1 - momentum, None), dtype=np.float32)
    if hp["nesterov"]:
        update = np.asarray(lerp(_NP, flat_g, new_buf, momentum, None), dtype=np.float32)
    else:
        update = new_buf
    x = newton_schulz(update.reshape(g.shape), tuple(hp["ns_coefficients"]), hp["ns_steps"], hp["eps"], ops)
    adjusted = lr * adjust_ratio(hp["adjust_lr_fn"], p.shape)
    p *= np.float32(1 - lr * wd)
    p[...] = np.asarray(_NP.fma32(x.reshape(-1), np.float32(-adjusted), p.reshape(-1)), dtype=np.float32).reshape(p.shape)
    return {"momentum_buffer": new_buf.reshape(g.shape)}


RUNS = {TORCH: _run}

step = make_tensor_step(RUNS, slot_names, "muon", check=_check, fresh=lambda shape: {"momentum_buffer": shape})
