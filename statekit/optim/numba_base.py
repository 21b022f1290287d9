"""What every numba kernel shares: the float32 FMA intrinsic, numpy's ``maximum``, and the
serial twin each parallel kernel runs below :data:`PARALLEL_FROM` elements.

Imports numba: imported only when a numba kernel runs (the ``statekit[fast]`` extra).
"""

from __future__ import annotations

from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def fma32(typingctx, a, b, c):
    """``a*b + c`` rounded once (``llvm.fma.f32``) for three float32 values."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@njit(inline="always")
def _maximum(a, b):
    """``np.maximum``: NaN when either is NaN."""
    return b if (b >= a or b != b) else a


#: below this many elements the serial twin of each kernel runs: waking numba's thread pool
#: costs more than the loop
PARALLEL_FROM = 1 << 16
_SERIAL: dict = {}


def serial_twin(kernel):
    """Register ``kernel``'s serial twin (the same loop without the thread pool), compiled on first use."""
    _SERIAL[kernel] = njit(cache=True, error_model="numpy")(kernel.py_func)
    return kernel


def pick(kernel, n: int):
    """``kernel`` for ``n`` elements, or its serial twin below :data:`PARALLEL_FROM`."""
    return kernel if n >= PARALLEL_FROM else _SERIAL[kernel]


