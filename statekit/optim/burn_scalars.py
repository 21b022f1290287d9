"""burn's float32 constants of one Adam/AdamW step, shared by every kernel of burn's arithmetic
(the numpy reference in :mod:`statekit.optim.adam`, the CuPy kernel in
:mod:`statekit.optim.cupy_kernels`) so that they cannot drift apart."""

from __future__ import annotations

import numpy as np

from statekit.optim.fp import powi


def burn_scalars(hp, step: int) -> tuple[dict, float]:
    """burn's constants of one Adam/AdamW step, by the names every burn kernel (the numpy reference,
    :mod:`statekit.optim.cupy_kernels`) uses: the moments' ``beta1 beta2 c1 c2 lr``, then AdamW's
    ``bc1 bc2 eps decay`` (``decay`` = 1 - lr·wd) or Adam's ``cf eps_b2 wd``; and lr·wd itself."""
    one = np.float32(1.0)
    beta1, beta2, eps = np.float32(hp["beta1"]), np.float32(hp["beta2"]), np.float32(hp["eps"])
    wd = np.float32(hp["weight_decay"])
    t = step + 1
    bc1 = one - np.float32(powi(beta1, t))
    bc2 = one - np.float32(powi(beta2, t))
    decay = hp["lr"] * float(wd)
    if hp["decoupled_weight_decay"]:
        scalars = {"bc1": bc1, "bc2": bc2, "eps": eps, "decay": 1.0 - decay}
    else:
        b2 = np.sqrt(bc2)
        scalars = {"cf": b2 / bc1, "eps_b2": eps * b2, "wd": wd}
    scalars |= {"beta1": beta1, "beta2": beta2, "c1": one - beta1, "c2": one - beta2, "lr": hp["lr"]}
    return scalars, decay
