"""Optimizer replay: pure step functions for Adam/AdamW, SGD, RMSprop, AdaGrad and Adan.

Each algorithm has flavors that reproduce one framework's floating-point arithmetic:
``torch-fused`` (torch's fused CPU kernels, bit for bit, pure numpy), ``torch``
(``torch.optim`` for-loop/foreach), ``burn`` (burn 0.22) and ``candle`` (candle-nn AdamW).
The kernels run on numpy, torch (CPU/CUDA) or CuPy arrays, a cache-sized block at a time.

Entry points: :func:`step`, :func:`resolve`, :func:`slot_names`, :func:`exactness` and the
:data:`ALGORITHMS` table (:mod:`statekit.optim.registry`); the arithmetic of every flavor is
documented in the algorithm modules and in ``docs/numerics.md``.
"""

from statekit.optim.backend import Backend, get_backend
from statekit.optim.common import FLAVORS
from statekit.optim.registry import (
    ALGORITHMS,
    BIT_EXACT,
    FRAMEWORK_OF,
    TOLERANCE,
    Algorithm,
    Framework,
    choose_kernel,
    exactness,
    get_algorithm,
    resolve,
    slot_names,
    step,
)

__all__ = [
    "ALGORITHMS",
    "BIT_EXACT",
    "FLAVORS",
    "FRAMEWORK_OF",
    "TOLERANCE",
    "Algorithm",
    "Backend",
    "Framework",
    "choose_kernel",
    "exactness",
    "get_algorithm",
    "get_backend",
    "resolve",
    "slot_names",
    "step",
]
