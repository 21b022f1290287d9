"""Each optimizer family's arithmetic, as the health report reads it from a state alone.

One :class:`Plan` per parameter says which slots to stream and which per-element program to run:

- the **denominator** ``d = a·D^pow + b`` of the family's step, with ``D`` a slot (Adam's ``v``) or
  a value made of slots (centered RMSprop's ``v − ḡ²``, Adafactor's ``R·C/mean(R)``), so that the
  **effective step size** of a coordinate is ``eff_num / d`` (Adam: ``lr / (√v̂ + ε)``);
- the **ε test**, a predicate on ``D`` that holds for small values (Adam: ``√v̂ < ε``);
- the **update** ``u``: ``k·m / d`` (the Adam family), ``k·slot`` (a momentum buffer) or
  ``sign(m)`` (Lion), with decoupled weight decay ``wd`` for the update:weight ratio;
- ``v``: the second moment whose ``log10 √v̂`` is histogrammed (``v̂ = v · v_scale``).

docs/report.md writes every family's formulas down; ``statekit/optim`` holds the step functions
these follow (the report never steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from statekit import hyper
from statekit.state import OptimizerState, ParamState

ADAM_LIKE = frozenset({"adam", "adamw", "lamb"})
DECOUPLED = frozenset({"adamw", "lion", "muon", "adafactor"})  # families whose decay is outside the update


@dataclass
class Plan:
    """How one parameter's state is read (see the module's docstring)."""

    family: str
    hyper: dict[str, object]
    m: str | None = None
    v: str | None = None
    v_scale: float | None = 1.0  # None: v̂ undefined (step 0)
    d_slots: tuple[str, ...] = ()
    d_fn: Callable | None = None  # arrays of d_slots → D (None: D is the first of d_slots)
    d_pow: float = 0.5
    d_a: float = 1.0
    d_b: float = 0.0
    eff_num: float | None = None  # effective step size eff_num / d
    eff_const: float | None = None  # or one step size for every coordinate (SGD, Lion)
    eps_pred: Callable[[float], bool] | None = None  # on D: True for values counted as ε-dominated
    u_kind: str | None = None  # "ratio" (k·m/d), "slot" (k·u_slot), "sign" (sign(m))
    u_slot: str | None = None
    u_k: float = 1.0
    wd: float = 0.0  # decoupled weight decay in the update:weight ratio
    lr: float | None = None
    factored: tuple[str, str] | None = None  # Adafactor's (row, col) slots: D is rebuilt from them
    factored_eps: float = 0.0  # torch's clamp of mean(R) (eps1) in the rebuilt v
    notes: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)  # hyperparameters taken from the defaults (burn)
    formula: str = ""


def step_of(p: ParamState) -> float | None:
    return None if p.step is None else float(p.step)


def group_values(state: OptimizerState, p: ParamState) -> dict[str, object]:
    if state.groups and 0 <= p.group < len(state.groups):
        return dict(state.groups[p.group].hyperparams)
    return {}


def defaults(framework: str, family: str, p: ParamState) -> dict[str, object]:
    """The family's defaults in ``framework`` (burn keeps no learning rate: torch's default)."""
    torch = dict(hyper.CONFIGS["torch"].get(family, {}))
    own = dict(hyper.CONFIGS.get(framework, {}).get(family, {})) if framework != "torch" else {}
    if framework == "burn" and family == "sgd" and "momentum_buffer" in p.slots:
        own.update(hyper.BURN_MOMENTUM)
    values = {**torch, **own}
    if values.get("lr") is None and torch.get("lr") is not None:
        values["lr"] = torch["lr"]
    return values


def resolve(state: OptimizerState, p: ParamState, family: str, given: dict[str, object]
            ) -> tuple[dict[str, object], list[str]]:
    """The hyperparameters of ``p``: given (flags) over stored (its group) over the defaults;
    and the names taken from the defaults (burn files store none)."""
    stored = group_values(state, p) if state.hyperparams_stored or state.framework != "burn" else {}
    base = defaults(state.framework, family, p)
    values, assumed = {}, []
    for key in {**base, **stored, **given}:
        if given.get(key) is not None:
            values[key] = given[key]
        elif key in stored:
            values[key] = stored[key]
        else:
            values[key] = base[key]
            if key in ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "alpha", "lr_decay",
                       "rho", "beta2_decay", "epsilon_1", "epsilon_2"):
                assumed.append(key)
    return values, assumed


def _num(values: dict, key: str, default: float) -> float:
    v = values.get(key)
    if isinstance(v, bool) or v is None:
        return default
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _betas(values: dict, default=(0.9, 0.999)) -> tuple[float, float]:
    b = values.get("betas")
    if isinstance(b, list | tuple) and len(b) == 2:
        return float(b[0]), float(b[1])
    return _num(values, "beta1", default[0]), _num(values, "beta2", default[1])


class _SqrtBelow:
    """``√(x·scale) < eps`` in float64, as numpy computes it (``key``: its constants)."""

    def __init__(self, scale: float, eps: float) -> None:
        self.scale, self.eps, self.key = scale, eps, ("sqrt_below", scale, eps)

    def __call__(self, x: float) -> bool:
        return math.sqrt(x * self.scale) < self.eps if x >= 0 else True


_sqrt_below = _SqrtBelow


def plan_for(state: OptimizerState, p: ParamState, family: str | None, given: dict[str, object]) -> Plan:
    """The :class:`Plan` of one parameter of ``family`` (None or unknown: moments only)."""
    fam = family or "unknown"
    if fam not in PLANS:
        plan = Plan(fam, {}, m="exp_avg" if "exp_avg" in p.slots else None,
                    v="exp_avg_sq" if "exp_avg_sq" in p.slots else None)
        plan.formula = "no step formula for this family: its moments only"
        return plan
    values, assumed = resolve(state, p, fam, given)
    plan = PLANS[fam](p, values)
    plan.family, plan.hyper = fam, values
    if assumed and state.framework == "burn" and not state.hyperparams_stored:
        plan.assumed = sorted(assumed)
    if step_of(p) == 0:
        _unstepped(plan)
    return plan


def _unstepped(plan: Plan) -> None:
    """A tensor at step 0: its state was made and never stepped (a reset, or a state built before
    the first step). Its moments hold no gradient and every bias correction ``1 − βᵗ`` is 0, so the
    step-size numbers (effective step, ε share, update, v̂) are undefined: none is given, where a
    step of 1 would make every coordinate "ε-dominated". The stored moments are still measured."""
    plan.eff_num = plan.eff_const = plan.eps_pred = None
    plan.u_kind = plan.u_slot = None
    plan.v_scale = None
    plan.formula = "step 0: never stepped since its state was made; no step-size numbers (moments as stored)"


def _adam(p: ParamState, hp: dict) -> Plan:
    b1, b2 = _betas(hp)
    eps, lr, t = _num(hp, "eps", 1e-8), _num(hp, "lr", 1e-3), step_of(p) or 1.0
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    denom = "max_exp_avg_sq" if "max_exp_avg_sq" in p.slots and hp.get("amsgrad", True) else "exp_avg_sq"
    decoupled = p.family in ("adamw",) or bool(hp.get("decoupled_weight_decay"))
    return Plan("adam", hp, m="exp_avg", v="exp_avg_sq", v_scale=1 / bc2, d_slots=(denom,),
                d_a=1 / math.sqrt(bc2), d_b=eps, eff_num=lr, eps_pred=_sqrt_below(1 / bc2, eps),
                u_kind="ratio", u_k=1 / bc1, wd=_num(hp, "weight_decay", 0.0) if decoupled else 0.0, lr=lr,
                formula="m̂ = m/(1−β1ᵗ), v̂ = v/(1−β2ᵗ), u = m̂/(√v̂+ε), eff = lr/(√v̂+ε)")


def _adamw(p: ParamState, hp: dict) -> Plan:
    plan = _adam(p, hp)
    plan.wd = _num(hp, "weight_decay", 0.0)
    return plan


def _lamb(p: ParamState, hp: dict) -> Plan:
    plan = _adam(p, hp)
    plan.formula += "; LAMB's trust ratio ‖θ‖/‖u+wd·θ‖ is left out"
    return plan


def _nadam(p: ParamState, hp: dict) -> Plan:
    plan = _adam(p, hp)
    b1, _ = _betas(hp)
    t, psi = step_of(p) or 1.0, _num(hp, "momentum_decay", 4e-3)
    mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
    prod = _scalar(p, "mu_product")
    if prod is None:
        prod = math.prod(b1 * (1 - 0.5 * 0.96 ** (s * psi)) for s in range(1, int(t) + 1))
    plan.u_k = mu_next / (1 - prod * mu_next)
    plan.formula = ("d = √(v/(1−β2ᵗ))+ε, u = μₜ₊₁·m/(1−Πμ·μₜ₊₁)/d (the gradient's own term is not in the "
                    "state), eff = lr/d")
    return plan


def _radam(p: ParamState, hp: dict) -> Plan:
    b1, b2 = _betas(hp)
    eps, lr, t = _num(hp, "eps", 1e-8), _num(hp, "lr", 1e-3), step_of(p) or 1.0
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * t * b2**t / bc2
    wd = _num(hp, "weight_decay", 0.0) if hp.get("decoupled_weight_decay") else 0.0
    if rho_t <= 5:
        return Plan("radam", hp, m="exp_avg", v="exp_avg_sq", v_scale=1 / bc2, eff_const=lr, u_kind="slot",
                    u_slot="exp_avg", u_k=1 / bc1, wd=wd, lr=lr,
                    formula="ρₜ ≤ 5: u = m/(1−β1ᵗ), no second moment in the step, eff = lr")
    rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
    scale = rect * math.sqrt(bc2)
    return Plan("radam", hp, m="exp_avg", v="exp_avg_sq", v_scale=1 / bc2, d_slots=("exp_avg_sq",), d_b=eps,
                eff_num=lr * scale, eps_pred=_sqrt_below(1.0, eps), u_kind="ratio", u_k=scale / bc1, wd=wd, lr=lr,
                formula="r = rect(ρₜ)·√(1−β2ᵗ), u = r·m/(1−β1ᵗ)/(√v+ε), eff = lr·r/(√v+ε), ε test √v < ε")


def _adamax(p: ParamState, hp: dict) -> Plan:
    b1, _ = _betas(hp)
    lr, t = _num(hp, "lr", 2e-3), step_of(p) or 1.0
    return Plan("adamax", hp, m="exp_avg", v=None, d_slots=("exp_inf",), d_pow=1.0, eff_num=lr, u_kind="ratio",
                u_k=1 / (1 - b1**t), lr=lr,
                formula="u = m/(1−β1ᵗ)/exp_inf, eff = lr/exp_inf (exp_inf ≥ ε always: no ε test)")


def _rmsprop(p: ParamState, hp: dict) -> Plan:
    eps, lr = _num(hp, "eps", 1e-8), _num(hp, "lr", 1e-2)
    centered = "grad_avg" in p.slots
    plan = Plan("rmsprop", hp, m=None, v="square_avg", d_slots=("square_avg", "grad_avg") if centered
                else ("square_avg",), d_b=eps, eff_num=lr, eps_pred=_sqrt_below(1.0, eps), lr=lr,
                formula="d = √v+ε (centered: √(v−ḡ²)+ε), eff = lr/d; u = momentum buffer when kept")
    if centered:
        plan.d_fn = lambda sq, g: sq - g * g
    if "momentum_buffer" in p.slots:
        plan.u_kind, plan.u_slot, plan.m = "slot", "momentum_buffer", "momentum_buffer"
    return plan


def _adagrad(p: ParamState, hp: dict) -> Plan:
    eps, lr, t = _num(hp, "eps", 1e-10), _num(hp, "lr", 1e-2), step_of(p) or 1.0
    clr = lr / (1 + (t - 1) * _num(hp, "lr_decay", 0.0))
    return Plan("adagrad", hp, v="sum", d_slots=("sum",), d_b=eps, eff_num=clr, eps_pred=_sqrt_below(1.0, eps),
                lr=lr, formula="d = √sum+ε, eff = lr/(1+(t−1)·lr_decay)/d; the update needs the gradient")


def _adadelta(p: ParamState, hp: dict) -> Plan:
    eps, lr = _num(hp, "eps", 1e-6), _num(hp, "lr", 1.0)
    return Plan("adadelta", hp, v="square_avg", d_slots=("square_avg", "acc_delta"),
                d_fn=lambda sq, acc: (sq + eps) / (acc + eps), eff_num=lr, eps_pred=lambda x: False, lr=lr,
                formula="eff = lr·√(Δ+ε)/√(v+ε); the update needs the gradient")


def _sgd(p: ParamState, hp: dict) -> Plan:
    lr = _num(hp, "lr", 1e-3)
    plan = Plan("sgd", hp, m="momentum_buffer" if "momentum_buffer" in p.slots else None, eff_const=lr, lr=lr,
                formula="eff = lr for every coordinate; u = the momentum buffer (Nesterov's gradient term left out)")
    if plan.m:
        plan.u_kind, plan.u_slot = "slot", "momentum_buffer"
    return plan


def _muon(p: ParamState, hp: dict) -> Plan:
    lr = _num(hp, "lr", 1e-3)
    shape = p.shape or ()
    ratio = math.sqrt(max(1.0, shape[0] / shape[1])) if len(shape) == 2 and shape[1] else 1.0
    return Plan("muon", hp, m="momentum_buffer", eff_const=lr * ratio, lr=lr, wd=_num(hp, "weight_decay", 0.0),
                formula="the step is lr·√max(1, A/B)·NS(buffer): eff = that scale; the orthogonalized "
                        "update is not computed")


def _lion(p: ParamState, hp: dict) -> Plan:
    lr = _num(hp, "lr", 1e-4)
    return Plan("lion", hp, m="exp_avg", eff_const=lr, u_kind="sign", lr=lr, wd=_num(hp, "weight_decay", 0.0),
                formula="u = sign(m) (the gradient's share of sign(β1·m+(1−β1)·g) left out), eff = lr")


def _adafactor(p: ParamState, hp: dict) -> Plan:
    lr, t = _num(hp, "lr", 1e-2), step_of(p) or 1.0
    rho = min(lr, 1 / math.sqrt(t)) if hp.get("relative_step", True) else lr
    burn = "epsilon_1" in hp
    eps1 = _eps1(hp)
    plan = Plan("adafactor", hp, d_pow=0.5, eff_num=rho, lr=lr, wd=_num(hp, "weight_decay", 0.0),
                formula="v = R·C/mean(R) (a matrix) or the variance, eff = min(lr, 1/√t)/√v "
                        "(× max(ε2, RMS θ) with --weights)")
    if "row_var" in p.slots and "col_var" in p.slots:
        plan.factored, plan.factored_eps = ("row_var", "col_var"), 0.0 if burn else eps1
        plan.v = "(R·C/mean R)"
    else:
        plan.v, plan.d_slots = "variance", ("variance",)
    if not burn:  # torch clamps v at eps1²: the coordinates the clamp holds
        plan.eps_pred = lambda x: x < eps1 * eps1
    return plan


def _eps1(hp: dict) -> float:
    eps = hp.get("eps")
    if isinstance(eps, list | tuple) and eps and eps[0] is not None:
        return float(eps[0])
    return 1.1920928955078125e-07  # torch: finfo(float32).eps when eps[0] is None


def _scalar(p: ParamState, slot: str) -> float | None:
    ref = p.slots.get(slot)
    if ref is None or ref.numel != 1:
        return None
    try:
        return float(ref.numpy().reshape(-1)[0])
    except (ValueError, TypeError):
        return None


PLANS: dict[str, Callable[[ParamState, dict], Plan]] = {
    "adam": _adam, "adamw": _adamw, "lamb": _lamb, "nadam": _nadam, "radam": _radam, "adamax": _adamax,
    "rmsprop": _rmsprop, "adagrad": _adagrad, "adadelta": _adadelta, "sgd": _sgd, "muon": _muon,
    "lion": _lion, "adafactor": _adafactor,
}
