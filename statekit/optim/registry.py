"""The one table of optimizer algorithms, their flavors, hyperparameters and state slots.

Names are framework-neutral (PyTorch's): state slots ``exp_avg exp_avg_sq max_exp_avg_sq
momentum_buffer square_avg grad_avg sum`` (+ Adan's ``exp_avg_diff neg_pre_grad``, burn
RMSProp's ``avg``); hyperparameters ``lr beta1 beta2 beta3 eps weight_decay amsgrad maximize
decoupled_weight_decay momentum dampening nesterov alpha centered lr_decay
initial_accumulator_value no_prox`` (torch's ``betas`` tuple is split into ``beta1``/``beta2``).
The step count is an int held beside the slots: the number of steps already taken.

Each algorithm lists, per framework, every hyperparameter with that framework's default
(``None``: no default, the caller must give it: burn's learning rate lives outside its
optimizer) and the hyperparameters the framework cannot change (``fixed``); both come from the
one table of defaults, :mod:`statekit.hyper`. A flavor uses its framework's column: ``torch``
and ``torch-fused`` → torch, ``burn`` → burn, ``candle`` → candle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from statekit import hyper
from statekit.errors import UsageError
from statekit.optim import (
    adadelta,
    adafactor,
    adagrad,
    adam,
    adamax,
    adan,
    asgd,
    burn_extra,
    muon,
    nadam,
    radam,
    rmsprop,
    rprop,
    sgd,
)
from statekit.optim.backend import get_backend, torch_available
from statekit.optim.common import (
    BURN,
    CANDLE,
    FLAVORS,
    MEGATRON,
    TORCH,
    TORCH_FOREACH,
    TORCH_FUSED,
    arithmetic,
)

BIT_EXACT = "bit-exact"
TOLERANCE = "tolerance"

FRAMEWORK_OF = {TORCH_FUSED: "torch", TORCH: "torch", TORCH_FOREACH: "torch", BURN: "burn", CANDLE: "candle",
                MEGATRON: "torch"}  # megatron-core steps with torch's (or TE/apex's) Adam, torch's hyperparameters


@dataclass(frozen=True)
class Framework:
    """One framework's hyperparameter defaults for an algorithm (``None``: required)."""

    defaults: Mapping[str, object]
    fixed: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Algorithm:
    """An algorithm: its step function, state slots, flavors and per-framework defaults."""

    name: str
    step: Callable
    slot_names: Callable[[Mapping, str], tuple[str, ...]]
    flavors: tuple[str, ...]
    frameworks: Mapping[str, Framework]


def _frameworks(name: str, flavors: tuple[str, ...]) -> dict[str, Framework]:
    """The defaults of ``name`` in every framework its flavors run, from :mod:`statekit.hyper`'s one table."""
    names = dict.fromkeys(FRAMEWORK_OF[f] for f in flavors)
    return {fw: Framework(hyper.core_defaults(fw, name), hyper.fixed(fw, name)) for fw in names}


def _algorithm(name: str, module, flavors: tuple[str, ...]) -> Algorithm:
    return Algorithm(name, module.step, module.slot_names, flavors, _frameworks(name, flavors))


def _by_flavor(torch_step: Callable, burn_step: Callable) -> Callable:
    """One algorithm's ``step`` with torch's flavors in one module and burn's in another."""

    def step(param, grad, slots, step, hp, flavor, xp=None, **kw):
        chosen = burn_step if flavor == BURN else torch_step
        return chosen(param, grad, slots, step, hp, flavor, xp, **kw)

    return step


ALGORITHMS: dict[str, Algorithm] = {
    "adam": _algorithm("adam", adam, (TORCH_FUSED, TORCH, BURN, MEGATRON)),
    "adamw": _algorithm("adamw", adam, (TORCH_FUSED, TORCH, BURN, CANDLE, MEGATRON)),
    "sgd": _algorithm("sgd", sgd, (TORCH_FUSED, TORCH, BURN, CANDLE)),
    "rmsprop": _algorithm("rmsprop", rmsprop, (TORCH, BURN)),
    "adagrad": _algorithm("adagrad", adagrad, (TORCH_FUSED, TORCH, BURN)),
    "adan": _algorithm("adan", adan, (BURN,)),
    "nadam": _algorithm("nadam", nadam, (TORCH, TORCH_FOREACH)),
    "radam": _algorithm("radam", radam, (TORCH, TORCH_FOREACH)),
    "adamax": _algorithm("adamax", adamax, (TORCH,)),
    "adadelta": _algorithm("adadelta", adadelta, (TORCH,)),
    "asgd": _algorithm("asgd", asgd, (TORCH, TORCH_FOREACH)),
    "rprop": _algorithm("rprop", rprop, (TORCH,)),
    # torch's for-loop/foreach (optim.adafactor, optim.muon) and burn 0.22's (optim.burn_extra)
    "adafactor": Algorithm("adafactor", _by_flavor(adafactor.step, burn_extra.STEPS["adafactor"]),
                           adafactor.slot_names, (TORCH, TORCH_FOREACH, BURN),
                           _frameworks("adafactor", (TORCH, TORCH_FOREACH, BURN))),
    "muon": Algorithm("muon", _by_flavor(muon.step, burn_extra.STEPS["muon"]), muon.slot_names, (TORCH, BURN),
                      _frameworks("muon", (TORCH, BURN))),
    # burn 0.22's whole-tensor steps (statekit.optim.burn_extra); torch has neither
    **{name: Algorithm(name, burn_extra.STEPS[name], burn_extra.slot_names_of(name), (BURN,),
                       _frameworks(name, (BURN,)))
       for name in ("lamb", "lion")},
}


#: Optimizers statekit recognises but cannot step from a gradient alone, and why.
NOT_REPLAYABLE = {
    "lbfgs": "L-BFGS evaluates the loss closure several times per step (line search, function "
             "evaluations), which gradient files cannot stand in for",
    "sparseadam": "SparseAdam steps only the rows a sparse gradient touches, and gradient files hold dense tensors",
}


def get_algorithm(name: str) -> Algorithm:
    """The :class:`Algorithm` called ``name``; an optimizer of :data:`NOT_REPLAYABLE` is refused with its reason."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        if name in NOT_REPLAYABLE:
            raise UsageError(f"{name} cannot be replayed: {NOT_REPLAYABLE[name]} (inspect and convert still "
                             "work)") from None
        raise UsageError(f"unknown optimizer {name!r} (known: {', '.join(ALGORITHMS)})") from None


def resolve(name: str, flavor: str, hp: Mapping | None = None) -> dict:
    """The complete hyperparameters of ``name`` for ``flavor``: ``hp`` over the framework's defaults.

    Refuses unknown names, missing required values and values the framework cannot express.
    """
    algo = get_algorithm(name)
    if flavor not in algo.flavors:
        raise UsageError(f"{name} has no {flavor!r} flavor (has {', '.join(algo.flavors)})")
    framework = algo.frameworks[FRAMEWORK_OF[flavor]]
    hp = dict(hp or {})
    unknown = sorted(set(hp) - set(framework.defaults))
    if unknown:
        raise UsageError(f"unknown {name} hyperparameters {unknown} (known: {', '.join(framework.defaults)})")
    for key in framework.fixed & set(hp):
        if hp[key] != framework.defaults[key]:
            raise UsageError(f"{flavor} {name} cannot use {key}={hp[key]!r}")
    full = framework.defaults | hp
    missing = sorted(key for key, value in full.items() if value is None)
    if missing:
        flags = ", ".join(f"--{m.replace('_', '-')}" for m in missing)
        raise UsageError(f"{flavor} {name} needs {', '.join(missing)}: the framework has no default (give {flags})")
    return full


def slot_names(name: str, flavor: str, hp: Mapping | None = None) -> tuple[str, ...]:
    """The state slots ``name`` keeps under ``flavor`` with these hyperparameters."""
    return get_algorithm(name).slot_names(resolve(name, flavor, hp), flavor)


def step(
    name: str,
    param,
    grad,
    slots: Mapping | None = None,
    step: int = 0,
    hp: Mapping | None = None,
    flavor: str = TORCH,
    xp=None,
    *,
    inplace: bool = False,
    vector_width: int | None = None,
    kernel: str | None = "reference",
):
    """One optimizer step: ``(new_param, new_slots, new_step)``.

    ``name`` is a key of :data:`ALGORITHMS`; ``hp`` is completed with the defaults of the
    flavor's framework (:func:`resolve`); ``slots`` maps slot names to arrays of ``param``'s
    shape (missing ones start fresh); ``step`` counts the steps already taken. ``xp`` chooses
    the array namespace (numpy, torch, cupy; default: that of ``param``). See the algorithm
    modules for each flavor's arithmetic and :func:`exactness` for what it reproduces.
    ``kernel`` is the code that runs it (:mod:`statekit.optim.kernels`): ``reference`` (the
    default: the emulation every other kernel is tested against), ``torch``, ``numba`` or
    ``auto`` (:func:`choose_kernel`); all give the same bits.
    """
    full = resolve(name, flavor, hp)
    return get_algorithm(name).step(
        param, grad, dict(slots or {}), step, full, flavor, xp, inplace=inplace, vector_width=vector_width,
        kernel=kernel, name=name,
    )


def choose_kernel(name: str, flavor: str, xp=None, like=None, kernel: str | None = "auto",
                  vector_width: int | None = None) -> str:
    """The kernel :func:`step` runs for ``name``/``flavor`` on ``xp`` (or ``like``'s namespace):
    ``auto`` picks the fastest that has the step, an explicit name is checked
    (:func:`statekit.optim.kernels.choose`)."""
    from statekit.optim import kernels

    get_algorithm(name)
    return kernels.choose(name, arithmetic(flavor), get_backend(xp, like=like), kernel, vector_width)


def same_arithmetic(a: str, b: str) -> bool:
    """Whether flavors ``a`` and ``b`` round every step the same way (``megatron`` and ``torch`` do)."""
    return arithmetic(a) == arithmetic(b)


def exactness(flavor: str, xp=None, algorithm: str | None = None) -> str:
    """``"bit-exact"`` or ``"tolerance"``: how ``flavor`` on namespace ``xp`` matches its reference.

    * ``torch-fused``: bit-exact to torch's fused CPU kernel (AVX2 kernel, the one x86-64 CPUs
      with AVX2 or AVX-512 run) on every namespace: the replica uses only IEEE operations and
      an exact FMA emulation.
    * ``torch`` / ``torch-foreach``: bit-exact to ``torch.optim`` with ``foreach=False``/``True``
      (``torch-foreach``: ``foreach=True`` where it rounds differently) on CPU when the square
      root (and, for Adafactor and Muon, the reductions and bfloat16 products) are torch's own, i.e. on numpy with torch installed or on torch CPU tensors;
      otherwise (no torch, CUDA, CuPy) the IEEE root differs by 1 ULP on some inputs and the
      result is within the tolerance of :mod:`statekit.optim.tolerance`. SGD has no square
      root: always bit-exact. torch's Muon is not replayed without torch at all (its step is
      refused: :data:`statekit.optim.muon.NEEDS_TORCH`).
    * ``burn`` / ``candle``: bit-exact to the modelled reference (burn's ndarray backend,
      candle's CPU backend without ``mkl``: one IEEE rounding per tensor op), which was
      reconstructed from their sources, not run.
    * ``megatron``: megatron-core's Adam/AdamW on CPU, which is torch's (:mod:`statekit.optim.megatron`): as
      ``torch``.
    """
    if flavor not in FLAVORS:
        raise UsageError(f"unknown flavor {flavor!r} (known: {', '.join(FLAVORS)})")
    flavor = arithmetic(flavor)
    if flavor not in (TORCH, TORCH_FOREACH) or algorithm == "sgd":
        return BIT_EXACT
    b = get_backend(xp)
    if b.is_torch_cpu or (b.name == "numpy" and torch_available()):
        return BIT_EXACT
    return TOLERANCE
