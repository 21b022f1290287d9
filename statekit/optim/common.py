"""Pieces shared by the algorithm modules: the step entry point, torch's lerp, flavor names.

Every algorithm module exposes ``step(param, grad, slots, step, hp, flavor, xp=None, *,
inplace=False, vector_width=None) -> (param, slots, step)`` built with :func:`make_step` from a
table of *builders*, one per flavor. A builder receives the backend, the complete
hyperparameters (see :mod:`statekit.optim.registry` for names and defaults), the number of
steps already taken, the set of slots the caller supplied and a reference array, and returns
``(kernel, init, tail)``: the block kernel (:mod:`statekit.optim.driver`), initial values for
missing slots, and how many trailing elements torch's fused scalar loop handles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from statekit.errors import UsageError
from statekit.optim import driver, kernels
from statekit.optim.backend import Backend, get_backend
from statekit.optim.fp import f32
from statekit.optim.megatron import ARITHMETIC as MEGATRON_ARITHMETIC
from statekit.optim.megatron import MEGATRON

TORCH_FUSED = "torch-fused"
TORCH = "torch"
#: torch.optim with ``foreach=True``, for the optimizers whose foreach path rounds differently
#: from the for-loop (NAdam, RAdam, ASGD, Adafactor); for the others foreach is ``torch``.
TORCH_FOREACH = "torch-foreach"
BURN = "burn"
CANDLE = "candle"
FLAVORS = (TORCH_FUSED, TORCH, TORCH_FOREACH, BURN, CANDLE, MEGATRON)  # megatron: statekit.optim.megatron
#: flavors that run another flavor's arithmetic (a framework that steps with another's optimizer)
ARITHMETIC_OF = {MEGATRON: MEGATRON_ARITHMETIC}


def arithmetic(flavor: str) -> str:
    """The flavor whose arithmetic ``flavor`` runs (``megatron`` → ``torch``; most flavors are their own)."""
    return ARITHMETIC_OF.get(flavor, flavor)
REFERENCE_KERNEL = "reference"


def make_step(builders: Mapping[str, Callable], slot_names: Callable, algorithm: str):
    """The public ``step`` function of one algorithm, dispatching on the flavor."""

    def step(param, grad, slots, step: int, hp, flavor, xp=None, *, inplace=False, vector_width=None,
             kernel=REFERENCE_KERNEL, name=algorithm):
        flavor = arithmetic(flavor) if flavor not in builders else flavor
        if flavor not in builders:
            raise UsageError(f"{algorithm} has no flavor {flavor!r} (has {', '.join(builders)})")
        b = get_backend(xp, like=param)
        names = slot_names(hp, flavor)
        present = frozenset(slots)
        chosen = kernels.choose(name, flavor, b, kernel, vector_width)
        block, init, tail = builders[flavor](b, hp, int(step), present, param, vector_width)
        p, g, s, shape = driver.prepare(b, param, grad, slots, names, init, inplace)
        if chosen == kernels.TORCH_KERNEL:
            from statekit.optim import torch_kernels

            torch_kernels.run(name, flavor, b, p, g, s, int(step), hp, present)
        elif chosen == kernels.NUMBA:
            from statekit.optim import numba_kernels

            numba_kernels.run(name, flavor, p, g, s, int(step), hp, present, getattr(block, "constants", None))
        elif chosen == kernels.CUPY:
            from statekit.optim import cupy_kernels

            cupy_kernels.run(name, flavor, b, p, g, s, int(step), hp, present)
        else:
            driver.run(b, block, p, g, s, tail(b.numel(p)))
        return p.reshape(shape), {name: s[name].reshape(shape) for name in names}, int(step) + 1

    step.__name__ = f"{algorithm}_step"
    step.__doc__ = f"""One {algorithm} step; see :mod:`statekit.optim.{algorithm}` for the flavors.

    ``param``, ``grad`` and the ``slots`` arrays (PyTorch's state names) share one shape;
    ``step`` is the number of steps already taken (PyTorch's ``state['step']``, burn's
    ``time``, candle's ``step_t``) and the returned step is ``step + 1``. ``hp`` must hold
    every hyperparameter of the algorithm, already checked against what the flavor supports
    (:func:`statekit.optim.step` fills the framework's defaults and checks). Missing slots
    start at their initial value (a first step). Without ``inplace`` the inputs are not
    modified; with it, ``param`` and the slots (writable float32 C-contiguous arrays of the
    namespace) are updated in place and returned. ``vector_width`` applies to ``torch-fused``
    only (:func:`fused_vector_width`). ``kernel`` chooses the code (:mod:`statekit.optim.kernels`:
    ``reference``, the default, ``torch``, ``numba``, ``cupy`` or ``auto``); ``name`` is the registry's
    algorithm name (``adamw`` shares Adam's step).
    """
    return step


def no_tail(numel: int) -> int:
    return 0


def tail_of(width: int) -> Callable[[int], int]:
    """The size of the scalar tail of torch's fused CPU loop: the last ``numel % width``."""
    return lambda numel: numel % width


def fused_vector_width(vector_width: int | None) -> int:
    """Floats per SIMD vector in torch's fused CPU kernels; ``None`` means 8.

    On x86-64 these kernels exist for AVX2 only (they are registered with
    ``REGISTER_DISPATCH``, which gives AVX-512 CPUs the AVX2 kernel: measured on an AVX-512
    Xeon), so the width is 8 wherever torch runs them with FMA. Another width (one that divides
    the 16-float parallel chunk) can be given for other builds.
    """
    if vector_width is None:
        return 8
    if vector_width not in (1, 2, 4, 8, 16):
        raise UsageError(f"vector_width must divide 16 (torch's 64-byte chunk), not {vector_width}")
    return vector_width


def torch_grad(b: Backend, p, g, wd32, maximize: bool, wd: float):
    """torch's gradient preparation: negated when maximizing, then L2 decay ``fma(p, f32(wd), g)``."""
    if maximize:
        g = -g
    if wd != 0:
        g = b.fma32(p, wd32, g)
    return g


def torch_adam_moments(b: Backend, p, g, s, k, *, decoupled: bool, maximize: bool, wd: float, beta1: float, like):
    """The opening torch's NAdam and RAdam share: decoupled decay of ``p`` in place (or the
    coupled gradient), then ``exp_avg`` and ``exp_avg_sq`` updated in place as torch rounds them
    (``k``: the step's float32 constants ``decay``, ``wd``, ``c2``, ``beta2``). Returns ``(g, m, v)``."""
    if decoupled and wd != 0:
        if maximize:
            g = -g
        p[...] = p * k["decay"]
    else:
        g = torch_grad(b, p, g, k["wd"], maximize, wd)
    m = lerp(b, s["exp_avg"], g, 1 - beta1, like)
    s["exp_avg"][...] = m
    v = b.fma32(k["c2"] * g, g, s["exp_avg_sq"] * k["beta2"])
    s["exp_avg_sq"][...] = v
    return g, m, v


def lerp(b: Backend, start, end, weight: float, like, out=None, scratch=None):
    """torch's ``start.lerp(end, weight)`` for float32 (vector and scalar loops agree), into
    ``out`` when given (``start`` itself may be ``out``); ``end - start`` into ``scratch`` when
    given.

    The weight is rounded to float32; below 0.5 in magnitude the result is
    ``fma(w, end - start, start)``, otherwise ``fma(w - 1, end - start, end)``.
    """
    w = f32(weight)
    diff = end - start if scratch is None else b.sub(end, start, scratch)
    if abs(w) < 0.5:
        return b.fma32(b.const(w, like), diff, start, out=out)
    return b.fma32(b.const(f32(w - 1.0), like), diff, end, out=out)


def write_back(param, p, slots: Mapping, new: dict):
    """The step's results ``p`` and ``new`` written into the caller's ``param`` and the slots it
    gave (where the shape is unchanged), ``new`` pointing at them: the ``inplace=True`` contract of
    the steps that compute on float32 copies. Returns ``param``."""
    if p is not param:
        param[...] = p
    for k, v in new.items():
        if k in slots and slots[k].shape == v.shape:
            slots[k][...] = v
            new[k] = slots[k]
    return param
