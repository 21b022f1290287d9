"""NAdam (momentum decay, L2 or decoupled weight decay): torch 2.13 for-loop and foreach.

Hyperparameters: ``lr beta1 beta2 eps weight_decay momentum_decay decoupled_weight_decay
maximize``. Slots: ``exp_avg``, ``exp_avg_sq`` and the 0-dim ``mu_product`` (torch keeps it as a
float32 CPU tensor, starting at 1.0). ``t`` is the float32 step after the increment.

Scalars in Python float64 (``psi`` = momentum_decay)::

    bc2 = 1 - beta2**t
    mu = beta1 * (1 - 0.5 * 0.96**(t*psi));  mu_next = beta1 * (1 - 0.5 * 0.96**((t+1)*psi))
    mu_product = f32(mu_product * f32(mu))            (in place on the float32 0-dim tensor)
    c_grad = -lr * (1 - mu) / (1 - mu_product);  c_avg = (-lr * mu_next) / (1 - mu_product * mu_next)

Element-wise (``f32`` of each scalar; ``sqrt`` is torch's CPU root, as for Adam)::

    g = -g (maximize);  decoupled: p = p * f32(1 - lr*wd)   else: g = fma(p, f32(wd), g)
    m = lerp(m, g, 1 - beta1);  v = fma(f32(1-beta2) * g, g, v * f32(beta2))
    torch:         denom = sqrt(v / f32(bc2)) + f32(eps)
    torch-foreach: denom = sqrt(v) / f32(bc2**0.5) + f32(eps)
    p = p + (f32(c_grad) * g) / denom;  p = p + (f32(c_avg) * m) / denom
"""

from __future__ import annotations

from statekit.optim.common import TORCH, TORCH_FOREACH, torch_adam_moments
from statekit.optim.fp import f32
from statekit.optim.tensorwise import make_scalar_step


def slot_names(hp, flavor: str) -> tuple[str, ...]:
    """``exp_avg``, ``exp_avg_sq``, ``mu_product`` (0-dim)."""
    return ("exp_avg", "exp_avg_sq", "mu_product")


def constants(hp, step: int, scalars) -> dict:
    """The step's scalars (Python floats; each kernel rounds them to float32 once) and the new
    ``mu_product``."""
    t = f32(step + 1)
    beta1, beta2, lr, wd, psi = hp["beta1"], hp["beta2"], hp["lr"], hp["weight_decay"], hp["momentum_decay"]
    bc2 = 1 - beta2**t
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (t * psi)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * psi)))
    mu_product = f32(scalars.get("mu_product", 1.0) * f32(mu))
    mu_product_next = mu_product * mu_next
    return {
        "decay": 1 - lr * wd,
        "wd": wd,
        "beta2": beta2,
        "c2": 1 - beta2,
        "bc2": bc2,
        "bc2_sqrt": bc2**0.5,
        "eps": hp["eps"],
        "c_grad": -lr * (1.0 - mu) / (1.0 - mu_product),
        "c_avg": (-lr * mu_next) / (1.0 - mu_product_next),
        "mu_product": mu_product,
    }


def _builder(foreach: bool):
    def build(b, hp, step, present, like, scalars):
        beta1, wd = hp["beta1"], hp["weight_decay"]
        decoupled, maximize = hp["decoupled_weight_decay"], hp["maximize"]
        values = constants(hp, step, scalars)
        k = {name: b.const(value, like) for name, value in values.items()}
        sqrt, around = b.torch_root()

        def kernel(p, g, s, tail):
            g, m, v = torch_adam_moments(b, p, g, s, k, decoupled=decoupled, maximize=maximize, wd=wd,
                                         beta1=beta1, like=like)
            if foreach:
                denom = sqrt(v) / k["bc2_sqrt"] + k["eps"]
            else:
                denom = sqrt(v / k["bc2"]) + k["eps"]
            p[...] = p + (k["c_grad"] * g) / denom
            p[...] = p + (k["c_avg"] * m) / denom

        kernel.around = around
        kernel.constants = values  # what the numba kernel takes (statekit.optim.numba_more)
        return kernel, {}, {"mu_product": values["mu_product"]}

    return build


BUILDERS = {TORCH: _builder(foreach=False), TORCH_FOREACH: _builder(foreach=True)}

step = make_scalar_step(BUILDERS, slot_names, ("mu_product",), "nadam")
