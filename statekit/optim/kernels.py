"""Which code runs a replay step: torch's own kernels, compiled numba kernels, or the reference.

A *flavor* (:mod:`statekit.optim.common`) names the arithmetic a step reproduces; a *kernel*
names the code that carries it out. Every kernel gives the flavor's bits; they differ in speed:

``reference``
    The element-wise emulation written against :class:`~statekit.optim.backend.Backend`
    (numpy, torch or CuPy arrays): every algorithm and flavor, exact FMA emulated in float64.
    It is the reference the other kernels are tested against, and the fallback.
``torch``
    torch's own code on zero-copy views of the arrays (``torch.from_numpy``;
    :mod:`statekit.optim.torch_kernels`): the fused kernels for ``torch-fused``, torch's
    single-tensor functions (written out with reused buffers, or torch's functional API) for
    ``torch``, its ``foreach=True`` functions for ``torch-foreach``: every torch flavor of every
    algorithm. On CUDA tensors (``--device cuda``) these are torch's CUDA kernels, i.e. the
    arithmetic torch itself runs on that GPU. Needs torch 2.7 or newer (read from its
    metadata, :mod:`statekit.versions`): an older torch leaves ``auto`` to the next kernel.
``numba``
    One compiled pass over memory per step (:mod:`statekit.optim.numba_kernels`,
    :mod:`statekit.optim.numba_more`; the optional ``statekit[fast]`` extra): Adam/AdamW in
    the four flavors, SGD, Adagrad and RMSprop in theirs, torch's NAdam, RAdam, Adamax, Adadelta,
    ASGD and Rprop, burn's Adan and Lion, with a hardware FMA exactly where the framework's kernel
    has one and the IEEE root.
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
from functools import cache

from statekit import versions
from statekit.errors import UsageError
from statekit.optim.backend import Backend, torch_available
from statekit.optim.torch_kernels import SUPPORTS

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

#: (algorithm, flavor) pairs torch's own code runs (statekit.optim.torch_kernels).
TORCH_SUPPORTS = SUPPORTS
#: (algorithm, flavor) pairs with a CuPy kernel (statekit.optim.cupy_kernels.SUPPORTS).
CUPY_SUPPORTS = {("adam", BURN), ("adamw", BURN), ("adamw", CANDLE)}
#: (algorithm, flavor) pairs with a numba kernel (statekit.optim.numba_kernels, numba_more).
NUMBA_SUPPORTS = frozenset(
    {(algo, flavor) for algo in ("adam", "adamw") for flavor in (TORCH_FUSED, TORCH, BURN)} | {("adamw", CANDLE)}
    | {(algo, flavor) for algo in ("nadam", "radam", "asgd") for flavor in (TORCH, "torch-foreach")}
    | {(algo, TORCH) for algo in ("adamax", "adadelta", "rprop")}
    | {(algo, BURN) for algo in ("adan", "lion")}
    | {("sgd", f) for f in (TORCH, TORCH_FUSED, BURN, CANDLE)} | {("adagrad", f) for f in (TORCH, TORCH_FUSED, BURN)}
    | {("rmsprop", TORCH), ("rmsprop", BURN)} | {("adafactor", TORCH), ("adafactor", "torch-foreach")}
)


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
