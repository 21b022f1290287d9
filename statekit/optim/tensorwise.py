"""Steps that are not purely element-wise: per-parameter scalar slots, factored slots, reductions.

:func:`statekit.optim.common.make_step` runs a block kernel over a parameter and slots of its
shape. Some torch 2.13 optimizers keep more:

* **scalar slots**, 0-dim tensors beside the moments (NAdam's ``mu_product``, ASGD's ``eta`` and
  ``mu``): :func:`make_scalar_step` reads them once per step, hands their values to the flavor's
  builder (which computes the step's constants from them, as torch does with ``.item()``), runs
  the element-wise kernel a block at a time over the full-shape slots, and returns the new
  scalars as 0-dim float32 arrays;
* **whole-tensor steps** (Adafactor's norms and factored ``row_var``/``col_var``, Muon's
  Newton–Schulz matrix products): :func:`make_tensor_step` hands the flavor's function the
  whole parameter, gradient and slots as float32 numpy arrays (torch tensors and CuPy arrays are
  copied to the host and back).

:class:`TorchOps` holds the operations whose rounding is not one IEEE operation per element and
that torch computes with its own kernels: the float32 norms and means (a vectorised reduction,
whose summation order fixes the last bit), ``rsqrt``, and bfloat16 matrix products. With torch
installed they are torch's own kernels called on zero-copy views (bit-exact, like the torch
flavor's square root, :meth:`statekit.optim.backend.Backend.sqrt_torch`); without torch they are
numpy approximations (float64 sums rounded once), and :func:`statekit.optim.exactness` says
``tolerance``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

import numpy as np

from statekit.errors import UsageError
from statekit.optim import driver, kernels
from statekit.optim.backend import get_backend, torch_available
from statekit.optim.common import write_back


def _prepared(algorithm: str, flavors: Mapping, slot_names: Callable, param, slots: Mapping, hp, flavor: str, xp,
              kernel, name: str, vector_width):
    """What every step built here checks first: the flavor exists, the kernel is one it has, and
    the caller gave no slot it does not keep. (backend, slot names, the kernel that runs it)."""
    if flavor not in flavors:
        raise UsageError(f"{algorithm} has no flavor {flavor!r} (has {', '.join(flavors)})")
    b = get_backend(xp, like=param)
    chosen = kernels.choose(name, flavor, b, kernel, vector_width)
    names = slot_names(hp, flavor)
    unknown = sorted(set(slots) - set(names))
    if unknown:
        raise UsageError(f"unexpected optimizer state slots {unknown}; expected {list(names)}")
    return b, names, chosen

def _host(b, array) -> np.ndarray:
    """``array`` as a numpy array (a torch tensor or CuPy array is copied to the host)."""
    if b.name == "torch":
        return array.detach().cpu().numpy()
    if b.name == "cupy":
        return b.xp.asnumpy(array)
    return np.asarray(array)


def _back(b, array: np.ndarray, like):
    """A host float32 array in ``like``'s namespace and device."""
    if b.name == "torch":
        return b.xp.from_numpy(np.ascontiguousarray(array)).to(like.device)
    if b.name == "cupy":
        return b.xp.asarray(array)
    return array


def scalar_value(b, value) -> float:
    """A 0-dim slot's value as a Python float (torch's ``.item()``)."""
    return float(np.asarray(_host(b, value), dtype=np.float64).reshape(()))


def make_scalar_step(builders: Mapping[str, Callable], slot_names: Callable, scalar_slots: tuple[str, ...],
                     algorithm: str):
    """The public ``step`` of an element-wise algorithm with 0-dim slots ``scalar_slots``.

    A builder is ``build(b, hp, step, present, like, scalars) -> (kernel, init, new_scalars)``:
    ``scalars`` maps the scalar slots the caller gave to their values (missing ones are absent:
    the builder knows torch's initial values); ``new_scalars`` maps every scalar slot to its value
    after the step (rounded to float32 by the caller); ``kernel`` and ``init`` are as for
    :func:`statekit.optim.common.make_step` and cover the full-shape slots only.
    """

    def step(param, grad, slots, step: int, hp, flavor, xp=None, *, inplace=False, vector_width=None,
             kernel=kernels.REFERENCE, name=algorithm):
        b, names, chosen = _prepared(algorithm, builders, slot_names, param, slots, hp, flavor, xp, kernel, name,
                                     vector_width)
        scalars = {}
        for n in scalar_slots:
            if n in slots:
                if int(np.prod(tuple(slots[n].shape))) != 1:
                    raise UsageError(f"state {n!r} has shape {tuple(slots[n].shape)}, a 0-dim value was expected")
                scalars[n] = scalar_value(b, slots[n])
        full = {k: v for k, v in slots.items() if k not in scalar_slots}
        block, init, new_scalars = builders[flavor](b, hp, int(step), frozenset(slots), param, scalars)
        tensor_names = [n for n in names if n not in scalar_slots]
        p, g, s, shape = driver.prepare(b, param, grad, full, tensor_names, init, inplace)
        if chosen == kernels.TORCH_KERNEL:
            from statekit.optim import torch_kernels

            new_scalars = torch_kernels.run(name, flavor, b, p, g, s, int(step), hp, frozenset(slots), scalars)
        elif chosen == kernels.NUMBA:
            from statekit.optim import numba_kernels

            new_scalars = numba_kernels.run(name, flavor, p, g, s, int(step), hp, frozenset(slots), block.constants)
        else:
            driver.run(b, block, p, g, s, 0)
        out = {}
        for n in names:
            if n in scalar_slots:
                value = np.array(new_scalars[n], dtype=np.float32)
                if inplace and n in slots and isinstance(slots[n], np.ndarray) and slots[n].flags.writeable:
                    slots[n][...] = value
                    value = slots[n]
                out[n] = value if b.name == "numpy" else _back(b, value, param)
            else:
                out[n] = s[n].reshape(shape)
        return p.reshape(shape), out, int(step) + 1

    step.__name__ = f"{algorithm}_step"
    step.__doc__ = f"""One {algorithm} step; see :mod:`statekit.optim.{algorithm}` for the flavors.

    As :func:`statekit.optim.common.make_step`'s steps, plus the 0-dim slots {', '.join(scalar_slots)}
    (float32 0-dim arrays in and out; missing ones start at torch's initial values).
    """
    return step


def make_tensor_step(runs: Mapping[str, Callable], slot_names: Callable, algorithm: str,
                     check: Callable | None = None, fresh: Callable | None = None, numba: Callable | None = None):
    """The public ``step`` of an algorithm that needs whole tensors.

    ``runs[flavor](p, g, slots, step, hp, ops) -> new slots`` gets float32 C-contiguous numpy
    arrays (``p`` is updated in place: the caller's own with ``inplace``, else a copy; ``g`` and
    ``slots``, the caller's slots with missing ones absent, are only read) and a
    :class:`TorchOps`. ``check(shape, hp)`` may refuse a shape before anything runs.
    ``fresh(shape) -> {slot: shape}`` names the slots a parameter of ``shape`` keeps (missing
    ones start at zero): the ``torch`` kernel (:mod:`statekit.optim.torch_kernels`) steps them in
    place with torch's own code. ``numba(p, g, slots, step, hp, flavor) -> new slots`` is the
    ``numba`` kernel, where the algorithm has one (same contract as ``runs``).
    """

    def step(param, grad, slots, step: int, hp, flavor, xp=None, *, inplace=False, vector_width=None,
             kernel=kernels.REFERENCE, name=algorithm):
        b, _, chosen = _prepared(algorithm, runs, slot_names, param, slots, hp, flavor, xp, kernel, name,
                                 vector_width)
        shape = tuple(param.shape)
        if tuple(grad.shape) != shape:
            raise UsageError(f"gradient shape {tuple(grad.shape)} does not match parameter shape {shape}")
        if check is not None:
            check(shape, hp)
        if chosen == kernels.TORCH_KERNEL:
            return _torch_tensor_step(b, name, flavor, param, grad, slots, int(step), hp, inplace, fresh(shape))
        owned = inplace and b.name == "numpy" and b.is_float32_contiguous(param)
        p = param if owned else np.array(_host(b, param), dtype=np.float32, order="C", copy=True)
        g = np.ascontiguousarray(_host(b, grad), dtype=np.float32)
        s = {k: np.ascontiguousarray(_host(b, v), dtype=np.float32) for k, v in slots.items()}
        if chosen == kernels.NUMBA:
            new = numba(p, g, s, int(step), hp, flavor)
        else:
            new = runs[flavor](p, g, s, int(step), hp, TorchOps())
        if inplace and b.name == "numpy":
            p = write_back(param, p, slots, new)
        elif b.name != "numpy":
            p = _back(b, p, param)
            new = {k: _back(b, v, param) for k, v in new.items()}
        return p, new, int(step) + 1

    step.__name__ = f"{algorithm}_step"
    step.__doc__ = f"""One {algorithm} step; see :mod:`statekit.optim.{algorithm}` for the flavors."""
    return step


def _torch_tensor_step(b, name, flavor, param, grad, slots, step, hp, inplace, shapes):
    """A whole-tensor step with torch's own code: in place on the caller's arrays with
    ``inplace`` (writable float32 C-contiguous), else on copies; missing slots start at zero."""
    from statekit.optim import torch_kernels

    def own(array):
        if inplace and b.owns(array) and b.is_float32_contiguous(array):
            return array
        return b.to_float32(array, copy=True)

    p = own(param)
    g = b.to_float32(grad, copy=False)
    s = {}
    for slot, slot_shape in shapes.items():
        if slot in slots:
            if tuple(slots[slot].shape) != tuple(slot_shape):
                raise UsageError(f"state {slot!r} has shape {tuple(slots[slot].shape)}, {name} keeps "
                                 f"{tuple(slot_shape)} for a parameter of shape {tuple(param.shape)}")
            s[slot] = own(slots[slot])
        else:
            s[slot] = (np.zeros(slot_shape, np.float32) if b.name == "numpy"
                       else b.xp.zeros(slot_shape, dtype=b.float32, device=b.device))
    torch_kernels.run(name, flavor, b, p, g, s, step, hp, frozenset(slots))
    return p, s, step + 1


class TorchOps:
    """torch's own kernels for the operations that are not one rounding per element (see the
    module's docstring), or numpy approximations when torch is not installed."""

    def __init__(self):
        self.torch = importlib.import_module("torch") if torch_available() else None

    @property
    def exact(self) -> bool:
        return self.torch is not None

    def _t(self, x: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(x))

    def norm(self, x: np.ndarray) -> float:
        """``x.norm(2).item()`` of a float32 array (a float32 value)."""
        if self.torch is not None:
            return float(self._t(x).norm(2).item())
        return float(np.float32(np.sqrt(np.sum(np.square(x, dtype=np.float64)))))

    def norm_dim(self, x: np.ndarray, dim: int) -> np.ndarray:
        """``torch.norm(x, dim=dim, keepdim=True)`` (float32)."""
        if self.torch is not None:
            return self.torch.norm(self._t(x), dim=dim, keepdim=True).numpy()
        return np.sqrt(np.sum(np.square(x, dtype=np.float64), axis=dim, keepdims=True)).astype(np.float32)

    def mean_dim(self, x: np.ndarray, dim: int) -> np.ndarray:
        """``x.mean(dim=dim, keepdim=True)`` (float32)."""
        if self.torch is not None:
            return self._t(x).mean(dim=dim, keepdim=True).numpy()
        return np.mean(x, axis=dim, keepdims=True, dtype=np.float64).astype(np.float32)

    def rsqrt(self, x: np.ndarray) -> np.ndarray:
        """``x.rsqrt()`` (float32). torch's CPU kernel is ``1 / sqrt(x)``, two IEEE float32
        operations, in its vector and scalar code alike (measured: 0 of 10^6 differ), so the
        numpy form is torch's bits on every CPU."""
        if self.torch is not None:
            return self._t(x).rsqrt().numpy()
        return np.float32(1.0) / np.sqrt(x)

    def sqrt(self, x: np.ndarray) -> np.ndarray:
        """torch's float32 CPU ``sqrt`` (MKL), else the IEEE root."""
        if self.torch is not None:
            return self._t(x).sqrt().numpy()
        return np.sqrt(x)
