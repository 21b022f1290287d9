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

These are torch's own bfloat16 CPU kernels (``addmm``/``mm``/``norm`` on zero-copy views):
bit-exact. Without torch the step is refused (:data:`NEEDS_TORCH`): torch's bfloat16 product
sums in an order that depends on the CPU and on torch's kernel choice (measured on one AVX2
machine: ATen's ``default`` and ``avx2`` capabilities give different products; an emulation of
the AVX2 oneDNN order, bit-identical there, missed the stated tolerance 14x on an AVX-512-BF16 /
AMX CPU), so a torch-free path could promise neither torch's bits nor a tolerance.
"""

from __future__ import annotations

import math

import numpy as np

from statekit.errors import UsageError
from statekit.optim import backend
from statekit.optim.backend import Backend
from statekit.optim.common import TORCH, lerp
from statekit.optim.tensorwise import make_tensor_step

_NP = Backend(np)


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``momentum_buffer``."""
    return ("momentum_buffer",)


NEEDS_TORCH = (
    "torch's Muon is replayed with torch's own bfloat16 matrix products, and torch is not installed: their "
    "summation order depends on the CPU and on the kernel torch picks there (ATen's or oneDNN's; AVX2, AVX-512-BF16, "
    "AMX), and Newton–Schulz amplifies one rounding into many, so no torch-free emulation can promise torch's bits "
    "or a stated tolerance on every CPU (pip install torch)")


def _check(shape, hp):
    if not backend.torch_available():
        raise UsageError(NEEDS_TORCH)
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


def newton_schulz(u: np.ndarray, coefficients, steps: int, eps: float, ops) -> np.ndarray:
    """``_zeropower_via_newtonschulz`` with torch's own bfloat16 kernels."""
    torch = ops.torch
    if torch is None:  # pragma: no cover - _check refuses the step first
        raise UsageError(NEEDS_TORCH)
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
