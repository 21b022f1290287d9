"""Which code runs a replay step: torch's own kernels, compiled numba kernels, or the reference.

A *flavor* (:mod:`statekit.optim.common`) names the arithmetic a step reproduces; a *kernel*
names the code that carries it out. Every kernel gives the flavor's bits; they differ in speed:

``reference``
    The element-wise emulation written against :class:`~statekit.optim.backend.Backend`
    (numpy, torch or CuPy arrays): every algorithm and flavor, exact FMA emulated in float64.
    It is the reference the other kernels are tested against, and the fallback.
``torch``
    torch's own code on zero-copy views of the arrays (``torch.from_numpy``): the fused kernels
    ``torch._fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_`` / ``_fused_adagrad_`` for the
    ``torch-fused`` flavor, ``torch.optim``'s single-tensor functions (``foreach=False``) for the
    ``torch`` flavor. On CUDA tensors (``--device cuda``) these are torch's CUDA kernels, i.e.
    the arithmetic torch itself runs on that GPU. Needs torch 2.7 or newer (read from its
    metadata, :mod:`statekit.versions`): an older torch leaves ``auto`` to the next kernel.
``numba``
    One compiled pass over memory per step (:mod:`statekit.optim.numba_kernels`, the optional
    ``statekit[fast]`` extra): Adam/AdamW in the four flavors, with a hardware FMA exactly
    where the framework's kernel has one.
``cupy``
    One CUDA element-wise kernel per step on CuPy arrays (``--device cuda --backend cupy``):
    burn's Adam/AdamW and candle's AdamW (:mod:`statekit.optim.cupy_kernels`; checked on the
    CPU through an emulation of its source, untested on a real GPU).

:func:`choose` picks the fastest kernel that supports the step (``auto``) or checks an explicit
choice (``--kernel``). torch, numba and CuPy are imported only when their kernel runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import warnings
from functools import cache

from statekit import versions
from statekit.errors import UsageError
from statekit.optim.backend import Backend, torch_available

# the flavor names of statekit.optim.common (which imports this module)
TORCH_FUSED, TORCH, BURN, CANDLE = "torch-fused", "torch", "burn", "candle"

AUTO = "auto"
REFERENCE = "reference"
TORCH_KERNEL = "torch"
NUMBA = "numba"
CUPY = "cupy"
KERNELS = (REFERENCE, TORCH_KERNEL, NUMBA, CUPY)
#: what ``--kernel`` accepts
CHOICES = (AUTO, *KERNELS)

#: (algorithm, flavor) pairs torch's own code runs.
TORCH_SUPPORTS = {
    ("adam", TORCH_FUSED), ("adamw", TORCH_FUSED), ("sgd", TORCH_FUSED), ("adagrad", TORCH_FUSED),
    ("adam", TORCH), ("adamw", TORCH), ("sgd", TORCH), ("adagrad", TORCH), ("rmsprop", TORCH),
}
#: (algorithm, flavor) pairs with a CuPy kernel (statekit.optim.cupy_kernels.SUPPORTS).
CUPY_SUPPORTS = {("adam", BURN), ("adamw", BURN), ("adamw", CANDLE)}
#: (algorithm, flavor) pairs with a numba kernel.
NUMBA_SUPPORTS = {
    (algo, flavor) for algo in ("adam", "adamw") for flavor in (TORCH_FUSED, TORCH, BURN)
} | {("adamw", CANDLE)}


@cache
def numba_available() -> bool:
    """Whether numba can be imported (checked without importing it)."""
    return importlib.util.find_spec("numba") is not None


# the first torch whose optimizer functions take what run_torch passes (adam's decoupled_weight_decay)
TORCH_KERNEL_FROM = (2, 7)


def torch_warning(kernel: str) -> str | None:
    """One line when torch's own kernel ran with a torch outside the tested range."""
    line = versions.outside("torch") if kernel == TORCH_KERNEL else None
    return f"{line}; its kernels ran the steps" if line else None


def _why_not(kernel: str, algorithm: str, flavor: str, b: Backend, vector_width) -> str | None:
    """None when ``kernel`` can run this step, else the reason it cannot."""
    if kernel == REFERENCE:
        return None
    if kernel == TORCH_KERNEL:
        if not torch_available():
            return "torch is not installed"
        if not versions.at_least("torch", TORCH_KERNEL_FROM):
            return (f"torch {versions.installed('torch')} is older than 2.7, whose adam() takes the "
                    "decoupled_weight_decay these kernels pass")
        if b.name not in ("numpy", "torch"):
            return f"torch kernels take numpy arrays or torch tensors, not {b.name} arrays"
        if (algorithm, flavor) not in TORCH_SUPPORTS:
            return f"torch has no {flavor} {algorithm} kernel"
        if flavor == TORCH_FUSED and vector_width not in (None, 8):
            return "torch's fused CPU kernels have 8-float vectors (vector_width)"
        return None
    if kernel == NUMBA:
        if not numba_available():
            return "numba is not installed (pip install 'statekit[fast]')"
        if b.name != "numpy":
            return "numba kernels take numpy arrays"
        if (algorithm, flavor) not in NUMBA_SUPPORTS:
            return f"there is no numba {flavor} {algorithm} kernel"
        if flavor == TORCH_FUSED and vector_width not in (None, 8):
            return "the numba torch-fused kernel models 8-float vectors (vector_width)"
        return None
    if kernel == CUPY:
        if b.name != "cupy":
            return f"CuPy kernels take CuPy arrays (--backend cupy), not {b.name} arrays"
        if (algorithm, flavor) not in CUPY_SUPPORTS:
            return f"there is no CuPy {flavor} {algorithm} kernel"
        return None
    raise UsageError(f"unknown kernel {kernel!r} (known: {', '.join(CHOICES)})")


def choose(algorithm: str, flavor: str, b: Backend, kernel: str | None = AUTO, vector_width=None) -> str:
    """The kernel that runs ``algorithm``/``flavor`` on ``b``'s arrays.

    ``auto``: torch's own code when torch is installed and has this step (on numpy arrays and
    torch tensors), else numba on numpy arrays, else the CuPy kernel on CuPy arrays, else the
    reference. For the ``torch`` flavor
    the reference needs torch's square root to be bit-exact; without torch, numba and the
    reference both take the IEEE root (``exactness`` says ``tolerance``). An explicit kernel
    that cannot run the step is refused with the reason.
    """
    kernel = AUTO if kernel is None else kernel
    if kernel == AUTO:
        for candidate in (TORCH_KERNEL, NUMBA, CUPY):
            if _why_not(candidate, algorithm, flavor, b, vector_width) is None:
                return candidate
        return REFERENCE
    reason = _why_not(kernel, algorithm, flavor, b, vector_width)
    if reason is not None:
        raise UsageError(f"--kernel {kernel}: {reason}")
    return kernel


# ---------------------------------------------------------------------------------- torch


def _as_torch(torch, b: Backend, array):
    """A torch tensor sharing ``array``'s memory (numpy arrays through ``torch.from_numpy``)."""
    if b.name == "torch":
        return array
    with warnings.catch_warnings():
        # read-only gradients (memory-mapped files): the kernels below never write a gradient
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def run_torch(algorithm: str, flavor: str, b: Backend, p, g, s: dict, step: int, hp, present) -> None:
    """One step with torch's own kernel, in place on ``p`` and the slots ``s`` (any namespace
    :func:`choose` accepted); ``step`` is the number of steps already taken, ``present`` the
    slots the caller supplied (a missing momentum buffer means SGD's first step)."""
    torch = importlib.import_module("torch")
    tp, tg = _as_torch(torch, b, p), _as_torch(torch, b, g)
    ts = {name: _as_torch(torch, b, value) for name, value in s.items()}
    fused = flavor == TORCH_FUSED
    device = tp.device if fused else torch.device("cpu")
    if fused:  # torch's Python wrappers add 1 to the steps before calling the fused kernels
        steps = [torch.tensor(float(step + 1), dtype=torch.float32, device=device)]
    else:
        steps = [torch.tensor(float(step), dtype=torch.float32, device=device)]
    if algorithm in ("adam", "adamw"):
        vmax = [ts["max_exp_avg_sq"]] if hp["amsgrad"] else []
        common = dict(
            lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"],
            amsgrad=hp["amsgrad"], maximize=hp["maximize"],
        )
        if fused:
            func = torch._fused_adamw_ if hp["decoupled_weight_decay"] else torch._fused_adam_
            func([tp], [tg], [ts["exp_avg"]], [ts["exp_avg_sq"]], vmax, steps, **common)
        elif _plain_cpu(tp, tg):  # torch's single-tensor Adam, its temporaries in reused buffers
            _single_tensor_adam(torch, tp, tg, ts["exp_avg"], ts["exp_avg_sq"], vmax, step + 1,
                                decoupled_weight_decay=hp["decoupled_weight_decay"], **common)
        else:
            from torch.optim.adam import adam

            adam([tp], [tg], [ts["exp_avg"]], [ts["exp_avg_sq"]], vmax, steps, foreach=False, fused=None,
                 decoupled_weight_decay=hp["decoupled_weight_decay"], **common)
    elif algorithm == "sgd":
        momentum = hp["momentum"]
        common = dict(weight_decay=hp["weight_decay"], momentum=momentum, lr=hp["lr"], dampening=hp["dampening"],
                      nesterov=hp["nesterov"], maximize=hp["maximize"])
        first = "momentum_buffer" not in present
        bufs = [ts["momentum_buffer"]] if momentum != 0 else []
        if fused:
            torch._fused_sgd_([tp], [tg], bufs, is_first_step=first and momentum != 0, **common)
        else:
            from torch.optim.sgd import sgd

            listed = [None] if first or momentum == 0 else bufs
            sgd([tp], [tg], listed, foreach=False, fused=None, **common)
            if momentum != 0 and first:
                ts["momentum_buffer"].copy_(listed[0])
    elif algorithm == "adagrad":
        common = dict(lr=hp["lr"], lr_decay=hp["lr_decay"], weight_decay=hp["weight_decay"], eps=hp["eps"],
                      maximize=hp["maximize"])
        if fused:
            torch._fused_adagrad_([tp], [tg], [ts["sum"]], steps, **common)
        else:
            from torch.optim.adagrad import adagrad

            adagrad([tp], [tg], [ts["sum"]], steps, foreach=False, fused=None, **common)
    elif algorithm == "rmsprop":
        from torch.optim.rmsprop import rmsprop

        rmsprop([tp], [tg], [ts["square_avg"]], [ts["grad_avg"]] if hp["centered"] else [],
                [ts["momentum_buffer"]] if hp["momentum"] > 0 else [], steps, foreach=False,
                maximize=hp["maximize"], lr=hp["lr"], alpha=hp["alpha"], eps=hp["eps"],
                weight_decay=hp["weight_decay"], momentum=hp["momentum"], centered=hp["centered"])
    else:  # pragma: no cover - choose() refuses these
        raise UsageError(f"torch has no {algorithm} kernel")


# ------------------------------------------------------------- torch's single-tensor Adam, no temporaries

_scratch = threading.local()


def _plain_cpu(p, g) -> bool:
    """A real CPU float tensor: what :func:`_single_tensor_adam` is written for."""
    return p.device.type == "cpu" and g.device.type == "cpu" and p.is_floating_point() and not p.is_complex()


def _buffers(torch, like, count: int) -> list:
    """``count`` scratch tensors shaped like ``like``, reused across steps (each thread its own;
    one size kept at a time, the largest so far): a fresh parameter-sized temporary costs its
    page faults at every step."""
    flat = getattr(_scratch, "flat", None)
    n = like.numel()
    if flat is None or flat.dtype != like.dtype or flat.numel() < n * count:
        _scratch.flat = flat = None
        _scratch.flat = flat = torch.empty(n * count, dtype=like.dtype)
    return [flat[i * n:(i + 1) * n].view(like.shape) for i in range(count)]


def _single_tensor_adam(torch, param, grad, exp_avg, exp_avg_sq, vmax: list, step: int, *, lr, beta1, beta2,
                        weight_decay, eps, amsgrad, maximize, decoupled_weight_decay) -> None:
    """``torch.optim.adam._single_tensor_adam`` (``foreach=False``, not capturable, not
    differentiable) for one real CPU tensor, each temporary written into a reused buffer
    (``out=`` / in place) instead of a fresh tensor: the same ATen kernels on the same operands
    in the same order, hence the same bits (``tests/test_kernels.py`` checks it against torch's
    own function), without two fresh parameter-sized tensors per step. ``step`` counts this one.
    """
    g_buf, d_buf = _buffers(torch, param, 2)
    if maximize:
        grad = torch.neg(grad, out=g_buf)
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = torch.add(grad, param, alpha=weight_decay, out=g_buf)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = float(step)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if amsgrad:
        torch.maximum(vmax[0], exp_avg_sq, out=vmax[0])
        denom = torch.sqrt(vmax[0], out=d_buf)
    else:
        denom = torch.sqrt(exp_avg_sq, out=d_buf)
    denom.div_(bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
