"""Array namespaces for the optimizer kernels: numpy (default), torch (CPU or CUDA), CuPy.

The kernels in :mod:`statekit.optim` are written once against the few operations of
:class:`Backend`: float32/float64 conversion, a 64-bit integer view, ``where``/``maximum``, two
flavors of square root, and scalar constants. torch and CuPy are imported only when a caller
asks for them (by name, by module, or by passing their arrays).

Every arithmetic operation the kernels perform is a single IEEE-754 operation with one rounding
on all three namespaces, with two traps avoided here:

* ``torch.sqrt`` on float32 CPU tensors is MKL's ``vmsSqrt``, which is not correctly rounded
  (measured: 0.7 % of inputs on AVX-512 Intel, 17 % on AMD Zen 3, 1 ULP off).
  :meth:`Backend.sqrt_ieee` therefore takes the square root in float64 and rounds once to
  float32, which is correctly rounded (53 >= 2*24 + 2, and a faithful float64 root suffices).
* torch on CUDA divides by a *Python scalar* as a multiplication by its reciprocal. Constants
  are therefore 0-dim float32 arrays on the array's device (:meth:`Backend.const`), never Python
  numbers.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import threading
import types
from functools import cache

import numpy as np

from statekit.errors import UsageError
from statekit.optim import fp

#: Elements per block on host memory. Each numpy call costs about half a microsecond besides
#: its loop and a step makes 13-30 calls a block, so fewer, larger blocks pay, as long as a
#: block's working set (the four streams, a few float32 temporaries and the float64 FMA scratch:
#: about 6 MiB at 128K elements) stays in cache. Measured with the in-place kernels and the FMA
#: writing into its output, on a 2-core EPYC (1 MiB L2 per core, 32 MiB L3), one thread, 10M
#: elements: 128K elements 8-15 % faster than 32K for every Adam flavor, 256K and more slower.
#: (Before those kernels, on a 2-core Xeon, 16K-32K had won: docs/numerics.md.)
HOST_BLOCK = 1 << 17
#: Elements per block on a GPU, where launch overhead rather than cache size sets the block.
DEVICE_BLOCK = 1 << 22


#: Bytes every array statekit allocates for a step is aligned to: torch's CPU allocator's
#: alignment, so torch's kernels see statekit's arrays as they see their own tensors.
ALIGN = 64


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an :data:`ALIGN`-byte boundary
    (numpy's allocations are 16-byte aligned)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_copy(array, dtype=np.float32) -> np.ndarray:
    """``array`` copied into a fresh :func:`aligned_empty` array of ``dtype`` (one pass)."""
    array = np.asarray(array)
    out = aligned_empty(array.shape, dtype)
    np.copyto(out, array, casting="unsafe")
    return out


@cache
def torch_available() -> bool:
    """Whether torch can be imported (checked without importing it)."""
    return importlib.util.find_spec("torch") is not None


class Backend:
    """numpy: the reference namespace. Subclasses override what differs for torch and CuPy."""

    name = "numpy"
    block = HOST_BLOCK
    float32 = np.float32
    float64 = np.float64
    int64 = np.int64

    def __init__(self, module: types.ModuleType = np):
        self.xp = module

    # -- placement -------------------------------------------------------------------------
    @property
    def is_torch_cpu(self) -> bool:
        """True when the arrays live where torch's CPU kernels would run on them."""
        return False

    def owns(self, array) -> bool:
        """Whether ``array`` is an array of this namespace."""
        return isinstance(array, np.ndarray)

    # -- allocation and conversion ----------------------------------------------------------
    def to_float32(self, array, copy: bool):
        """``array`` as a C-contiguous float32 array (a fresh :data:`ALIGN`-aligned copy when ``copy``)."""
        if copy:
            return aligned_copy(array)
        return np.array(array, dtype=np.float32, order="C", copy=None)

    def is_float32_contiguous(self, array) -> bool:
        return array.dtype == np.float32 and array.flags.c_contiguous and array.flags.writeable

    def flat(self, array):
        """A 1-D view of a C-contiguous array."""
        return array.reshape(-1)

    def numel(self, array) -> int:
        return int(array.size)

    def full_like(self, array, value: float):
        out = aligned_empty(array.shape)
        out.fill(value)
        return out

    def f32(self, array):
        return array.astype(np.float32)

    def f64(self, array):
        return array.astype(np.float64)

    def bits64(self, array64):
        """The int64 bit pattern of a float64 array (a view)."""
        return array64.view(np.int64)

    def from_bits64(self, bits):
        return bits.view(np.float64)

    def const(self, value: float, like):
        """``value`` rounded to float32, as a scalar usable against ``like``'s arrays."""
        return np.float32(value)

    # -- element-wise operations that are not operators --------------------------------------
    def where(self, cond, a, b):
        return np.where(cond, a, b)

    def maximum(self, a, b, out=None):
        return np.maximum(a, b, out=out)

    # -- block temporaries: binary operations into a given array -----------------------------
    def scratch(self, like, index: int):
        """A float32 buffer the size of the 1-D block ``like``: this thread's ``index``-th,
        reused from block to block and step to step (on numpy: a fresh block-sized temporary
        per operation costs malloc/free, and page faults whenever the allocator hands the
        memory back to the system)."""
        return _SCRATCH32.get(index, like.shape[0])

    def mul(self, a, b, out):
        return np.multiply(a, b, out=out)

    def sub(self, a, b, out):
        return np.subtract(a, b, out=out)

    def div(self, a, b, out):
        return np.divide(a, b, out=out)

    def any(self, mask) -> bool:
        return bool(mask.any())

    def sqrt_ieee(self, x, out=None):
        """Correctly rounded float32 square root (numpy's is: it is the SIMD ``sqrtps``)."""
        return np.sqrt(x, out=out)

    def fma32(self, x, y, z, out=None, positive=False):
        """``x*y + z`` rounded once to float32 (:func:`statekit.optim.fp.fma32`), into ``out``
        when given (``out`` may be ``x``, ``y`` or ``z`` itself).

        For 1-D numpy blocks (``x`` or ``y`` and ``z`` may be scalars): the same candidate test
        on reused per-thread buffers, the float64 sum rounded once straight into ``out``. The
        elements that are candidates (a float64 tie, or a result at or under float32's smallest
        normal, 2**-126, zeros of a nonzero sum included) go through the exact general path
        alone, so a block with one candidate costs one element more, not a second pass over the
        block. Their ``z`` is read back from its float64 copy, so ``out`` may be ``z``.

        ``positive`` says the results are expected to be positive (a second moment): the
        tiny test then first looks at the smallest result itself, which, when it is above
        2**-126, proves every magnitude is, without computing them (one pass less). The
        answer never depends on it: any other block takes the full test.
        """
        if np.ndim(x) == 0:
            x, y = y, x
        n = x.shape[0]
        s, t, low, mask, tiny = _SCRATCH.get(n)
        # float64 operations on float64 buffers: numpy's mixed float32/float64 loops are slower
        np.copyto(s, x)
        if np.ndim(y):
            np.copyto(t, y)
            s *= t  # exact
        else:
            s *= y
        if np.ndim(z):
            np.copyto(t, z)  # t keeps z (exactly) for the candidates below
            s += t  # rounded once, in float64
            z = t
        else:
            s += z
        np.bitwise_and(s.view(np.int64), fp.LOW29, out=low)
        ties = np.count_nonzero(np.equal(low, fp.TIE29, out=mask))  # a fraction of any()'s overhead
        aliased = out is not None and (np.may_share_memory(x, out) or (np.ndim(y) and np.may_share_memory(y, out)))
        r = np.empty(n, np.float32) if out is None or aliased else out
        np.copyto(r, s, casting="same_kind")
        # |r| <= 2**-126 holds for every sum under the normal range (rounding is monotonic);
        # fmin skips NaNs (min would return one and hide a tiny element beside it)
        # (with ``positive``: a smallest result above 2**-126 proves every |r| is; fmin is NaN,
        # and the test false, only when every result is NaN)
        if not (positive and not ties and np.fmin.reduce(r) > _F32_NORMAL_MIN):
            magnitude = np.abs(r, out=low.view(np.float32)[:n])
            if ties or np.fmin.reduce(magnitude) <= _F32_NORMAL_MIN:
                np.logical_or(mask, np.less_equal(magnitude, _F32_NORMAL_MIN, out=tiny), out=mask)
                where = np.flatnonzero(mask)
                where = where[s[where] != 0]  # a zero float64 sum is exact
                if where.size:
                    r[where] = fp.fma32(self, _at(x, where), _at(y, where), _at(z, where))
        if aliased:
            out[...] = r
            return out
        return r

    def sqrt_torch(self, x):
        """The square root torch's CPU kernels compute (MKL ``vmsSqrt``), via torch itself.

        Falls back to the IEEE root when torch is not installed; :func:`statekit.optim.exactness`
        reports that case as ``"tolerance"``.
        """
        if not torch_available():
            return np.sqrt(x)
        torch = importlib.import_module("torch")
        # MKL threads vmsSqrt internally; waking its threads for every block costs milliseconds
        # when the cores are busy with numpy, so each call runs on one thread (results do not
        # depend on the thread count: the root is element-wise).
        # The lock keeps blocks on other threads (statekit.optim.driver) from seeing, or leaving
        # behind, the temporary thread count.
        with _TORCH_THREADS_LOCK:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return torch.sqrt(torch.from_numpy(_ALIGNED_IN.aligned(x))).numpy()
            finally:
                torch.set_num_threads(threads)


    def torch_root(self):
        """``(sqrt, around)``: :meth:`sqrt_torch` for every block of one step, and the context
        that the step's blocks run in (:func:`statekit.optim.driver.run`).

        On numpy with torch installed, ``around`` holds torch at one thread for the whole step
        (once, not per block as :meth:`sqrt_torch` must) and ``sqrt`` calls torch's root with
        nothing else around it; the driver's threads may call it at once (each sets its own
        OpenMP thread count to one on its first call). Without torch: the
        IEEE root, nothing around.
        """
        if not torch_available():
            return self.sqrt_ieee, contextlib.nullcontext
        torch = importlib.import_module("torch")

        @contextlib.contextmanager
        def one_torch_thread():
            with _TORCH_THREADS_LOCK:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    yield
                finally:
                    torch.set_num_threads(threads)

        pinned = threading.local()

        def sqrt(x, out=None):
            # torch's thread count is an OpenMP setting of each calling thread: the driver's
            # worker threads set theirs too (they are statekit's own, and stay at one)
            if not getattr(pinned, "done", False):
                torch.set_num_threads(1)
                pinned.done = True
            # torch's root sees 64-byte aligned memory, as its own tensors are (MKL's
            # vector math may take another path for an unaligned head: ALIGN)
            source = torch.from_numpy(_ALIGNED_IN.aligned(x))
            if out is None or out.ctypes.data % ALIGN:
                root = torch.sqrt(source).numpy()
                return root if out is None else _into(out, root)
            torch.sqrt(source, out=torch.from_numpy(out))
            return out

        return sqrt, one_torch_thread


_TORCH_THREADS_LOCK = threading.RLock()


def _at(value, where):
    """``value[where]`` for an array, the scalar itself otherwise."""
    return value if np.ndim(value) == 0 else value[where]


def _into(out, value):
    """``value`` written into ``out`` (returned), or ``value`` itself when there is no ``out``."""
    if out is None:
        return value
    out[...] = value
    return out


_F32_NORMAL_MIN = np.float32(2.0**-126)


class _Scratch(threading.local):
    """Per-thread float64/int64/bool buffers for :meth:`Backend.fma32`, grown on demand."""

    size = 0
    last = -1

    def get(self, n: int):
        if n == self.last:  # every block but a step's last has the same size
            return self.views
        if n > self.size:
            self.size = n
            self.buffers = [
                np.empty(n, dtype) for dtype in (np.float64, np.float64, np.int64, np.bool_, np.bool_)
            ]
        self.last, self.views = n, [buffer[:n] for buffer in self.buffers]
        return self.views


_SCRATCH = _Scratch()


class _Scratch32(threading.local):
    """Per-thread float32 block buffers for :meth:`Backend.scratch`, grown on demand."""

    def __init__(self):
        self.buffers: list = []

    def get(self, index: int, n: int):
        while len(self.buffers) <= index:
            self.buffers.append(np.empty(0, np.float32))
        if self.buffers[index].shape[0] < n:
            self.buffers[index] = np.empty(n, np.float32)
        return self.buffers[index][:n]


_SCRATCH32 = _Scratch32()


class _AlignedInput(threading.local):
    """Per-thread :data:`ALIGN`-aligned float32 buffer that an unaligned input of torch's root is
    copied into, grown on demand."""

    def __init__(self):
        self.buffer = np.empty(0, np.float32)

    def aligned(self, x) -> np.ndarray:
        x = np.ascontiguousarray(x)
        if x.ctypes.data % ALIGN == 0 or x.dtype != np.float32:
            return x
        if self.buffer.size < x.size:
            self.buffer = aligned_empty(x.size)
        out = self.buffer[:x.size].reshape(x.shape)
        np.copyto(out, x)
        return out


_ALIGNED_IN = _AlignedInput()


class TorchBackend(Backend):
    """torch tensors on one device (CPU or CUDA)."""

    name = "torch"

    def __init__(self, module: types.ModuleType, device=None):
        super().__init__(module)
        self.device = module.device(device if device is not None else "cpu")
        self.block = HOST_BLOCK if self.device.type == "cpu" else DEVICE_BLOCK
        self.float32, self.float64, self.int64 = module.float32, module.float64, module.int64

    @property
    def is_torch_cpu(self) -> bool:
        return self.device.type == "cpu"

    def owns(self, array) -> bool:
        return isinstance(array, self.xp.Tensor)

    def to_float32(self, array, copy: bool):
        t = self.xp.as_tensor(array, device=self.device).detach()
        return t.to(dtype=self.float32, memory_format=self.xp.contiguous_format, copy=copy)

    def is_float32_contiguous(self, array) -> bool:
        return array.dtype == self.float32 and array.is_contiguous() and array.device == self.device

    def numel(self, array) -> int:
        return array.numel()

    def full_like(self, array, value: float):
        return self.xp.full_like(array, value, dtype=self.float32)

    def f32(self, array):
        return array.to(self.float32)

    def f64(self, array):
        return array.to(self.float64)

    def bits64(self, array64):
        return array64.view(self.int64)

    def from_bits64(self, bits):
        return bits.view(self.float64)

    def const(self, value: float, like):
        return self.xp.tensor(float(np.float32(value)), dtype=self.float32, device=like.device)

    def where(self, cond, a, b):
        return self.xp.where(cond, a, b)

    def maximum(self, a, b, out=None):
        return self.xp.maximum(a, b, out=out) if out is not None else self.xp.maximum(a, b)

    def any(self, mask) -> bool:
        return bool(mask.any())

    def scratch(self, like, index: int):
        return self.xp.empty_like(like)

    def mul(self, a, b, out):
        return self.xp.mul(a, b, out=out)

    def sub(self, a, b, out):
        return self.xp.sub(a, b, out=out)

    def div(self, a, b, out):
        return self.xp.div(a, b, out=out)

    def sqrt_ieee(self, x, out=None):
        return _into(out, x.to(self.float64).sqrt().to(self.float32))

    def fma32(self, x, y, z, out=None, positive=False):
        return _into(out, fp.fma32(self, x, y, z))

    def sqrt_torch(self, x):
        return x.sqrt()

    def torch_root(self):
        return (lambda x, out=None: _into(out, self.sqrt_torch(x))), contextlib.nullcontext


class CupyBackend(Backend):
    """CuPy arrays on the current CUDA device."""

    name = "cupy"
    block = DEVICE_BLOCK

    def __init__(self, module: types.ModuleType):
        super().__init__(module)
        self.float32, self.float64, self.int64 = module.float32, module.float64, module.int64

    def owns(self, array) -> bool:
        return isinstance(array, self.xp.ndarray)

    def to_float32(self, array, copy: bool):
        return self.xp.array(array, dtype=self.float32, order="C", copy=copy)

    def is_float32_contiguous(self, array) -> bool:
        return array.dtype == self.float32 and array.flags.c_contiguous

    def full_like(self, array, value: float):
        return self.xp.full_like(array, value, dtype=self.float32)

    def f32(self, array):
        return array.astype(self.float32)

    def f64(self, array):
        return array.astype(self.float64)

    def bits64(self, array64):
        return array64.view(self.int64)

    def from_bits64(self, bits):
        return bits.view(self.float64)

    def where(self, cond, a, b):
        return self.xp.where(cond, a, b)

    def maximum(self, a, b, out=None):
        return self.xp.maximum(a, b, out=out)

    def scratch(self, like, index: int):
        return self.xp.empty_like(like)

    def mul(self, a, b, out):
        return self.xp.multiply(a, b, out=out)

    def sub(self, a, b, out):
        return self.xp.subtract(a, b, out=out)

    def div(self, a, b, out):
        return self.xp.divide(a, b, out=out)

    def sqrt_ieee(self, x, out=None):
        return _into(out, self.xp.sqrt(x.astype(self.float64)).astype(self.float32))

    def fma32(self, x, y, z, out=None, positive=False):
        return _into(out, fp.fma32(self, x, y, z))

    def sqrt_torch(self, x):
        return self.xp.sqrt(x)

    def torch_root(self):
        return (lambda x, out=None: _into(out, self.sqrt_torch(x))), contextlib.nullcontext


_NAMES = {"numpy": "numpy", "np": "numpy", "torch": "torch", "cupy": "cupy", "cp": "cupy"}


def get_backend(xp=None, like=None) -> Backend:
    """The :class:`Backend` for ``xp`` (a Backend, a module, or a name), else for ``like``'s type.

    ``xp=None`` infers the namespace from ``like`` (numpy when ``like`` is not a torch tensor
    or CuPy array). For torch, the device is ``like``'s device (CPU when there is no ``like``).
    """
    if isinstance(xp, Backend):
        return xp
    if xp is None:
        root = type(like).__module__.split(".")[0] if like is not None else "numpy"
        name = root if root in ("torch", "cupy") else "numpy"
    else:
        key = xp.__name__ if isinstance(xp, types.ModuleType) else str(xp)
        if key not in _NAMES:
            raise UsageError(f"unknown array namespace {key!r} (use numpy, torch or cupy)")
        name = _NAMES[key]
    if name == "numpy":
        return Backend(np)
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise UsageError(f"array namespace {name!r} was asked for but is not installed") from exc
    if name == "torch":
        return TorchBackend(module, like.device if like is not None else None)
    return CupyBackend(module)
