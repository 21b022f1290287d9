"""Which ``torch.optim`` optimizer wrote a state_dict: decided from every state field AND every
param-group key, never from one signature key.

The table below is what torch 2.13.0 itself writes: each optimizer of ``torch.optim`` was built on a
small model and stepped 3 times, and its ``state`` fields and ``param_groups`` keys read back
(``scripts/torch_optimizer_keys.py`` prints them; ``tests/test_torch_families.py`` checks this table
against the installed torch). A group matches a family when it has exactly that family's keys, plus
only keys no torch optimizer uses as a hyperparameter (``param_names``, the LR schedulers'
``initial_lr``/``max_lr``/…, a user's own tags), and every stepped parameter's fields are that
family's. Anything else is *unknown*, described by its fields and keys, and conversion refuses it.

Adam and AdamW write the same keys; torch 2.13's AdamW is Adam with ``decoupled_weight_decay=True``
(AdamW forces it on load), so that key's value decides, and an ``Adam(decoupled_weight_decay=True)``
is an AdamW in every respect. A group from an older torch that lacks some keys is not guessed: the
families it could be are listed as candidates and ``--optimizer`` must say which.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TorchFamily:
    family: str  # statekit's name
    cls: str  # torch.optim class name
    keys: frozenset[str]  # param_group keys (without "params")
    required: frozenset[str]  # state fields of every stepped parameter
    optional: frozenset[str] = frozenset()  # fields present depending on hyperparameters / shape


def _f(family, cls, keys, required, optional=()):
    return TorchFamily(family, cls, frozenset(keys.split()), frozenset(required.split()), frozenset(optional))


ADAM_KEYS = "lr betas eps weight_decay amsgrad maximize foreach capturable differentiable fused decoupled_weight_decay"
FAMILIES: tuple[TorchFamily, ...] = (
    _f("adam", "Adam", ADAM_KEYS, "step exp_avg exp_avg_sq", ["max_exp_avg_sq"]),
    _f("adamw", "AdamW", ADAM_KEYS, "step exp_avg exp_avg_sq", ["max_exp_avg_sq"]),
    _f("sgd", "SGD", "lr momentum dampening weight_decay nesterov maximize foreach differentiable fused", "",
       ["momentum_buffer"]),
    _f("rmsprop", "RMSprop", "lr momentum alpha eps centered weight_decay capturable foreach maximize differentiable",
       "step square_avg", ["momentum_buffer", "grad_avg"]),
    _f("adagrad", "Adagrad", "lr lr_decay eps weight_decay initial_accumulator_value foreach maximize differentiable "
       "fused", "step sum"),
    _f("nadam", "NAdam", "lr betas eps weight_decay momentum_decay decoupled_weight_decay maximize foreach capturable "
       "differentiable", "step mu_product exp_avg exp_avg_sq"),
    _f("radam", "RAdam", "lr betas eps weight_decay maximize foreach capturable decoupled_weight_decay differentiable",
       "step exp_avg exp_avg_sq"),
    _f("adamax", "Adamax", "lr betas eps weight_decay foreach maximize differentiable capturable",
       "step exp_avg exp_inf"),
    _f("adadelta", "Adadelta", "lr rho eps weight_decay maximize capturable foreach differentiable",
       "step square_avg acc_delta"),
    _f("adafactor", "Adafactor", "lr beta2_decay eps d weight_decay foreach maximize", "step",
       ["row_var", "col_var", "variance"]),
    _f("asgd", "ASGD", "lr lambd alpha t0 weight_decay foreach maximize differentiable capturable", "step eta mu ax"),
    _f("rprop", "Rprop", "lr etas step_sizes foreach maximize differentiable capturable", "step prev step_size"),
    _f("sparseadam", "SparseAdam", "lr betas eps maximize", "step exp_avg exp_avg_sq"),
    _f("muon", "Muon", "lr weight_decay momentum nesterov ns_coefficients eps ns_steps adjust_lr_fn", "momentum_buffer"),
    # L-BFGS keeps one state, under its first parameter's id
    _f("lbfgs", "LBFGS", "lr max_iter max_eval tolerance_grad tolerance_change history_size line_search_fn",
       "func_evals n_iter", ["d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss", "al"]),
)
BY_NAME = {f.family: f for f in FAMILIES}
# Keys torch.optim uses as hyperparameters: a group carrying one of another family is not that family.
HYPER_KEYS = frozenset().union(*(f.keys for f in FAMILIES))
# What torch itself adds to groups besides hyperparameters (kept, never used to decide).
ANNOTATIONS = frozenset({"param_names", "initial_lr", "max_lr", "min_lr", "base_lr", "max_momentum",
                         "base_momentum", "swa_lr"})


@dataclass
class Verdict:
    family: str | None  # None: unknown
    candidates: tuple[str, ...] = ()  # when keys are missing (an older torch): the families it may be
    detail: str = ""  # "fields …, group keys …" for unknown states

    @property
    def label(self) -> str:
        if self.family:
            return self.family
        if self.candidates:
            return f"unknown ({self.detail}; one of {', '.join(self.candidates)}: say which with --optimizer)"
        return f"unknown ({self.detail})"


def _describe(fields: set[str], keys: set[str]) -> str:
    return f"fields {', '.join(sorted(fields)) or 'none'}, group keys {', '.join(sorted(keys)) or 'none'}"


def _fields_fit(f: TorchFamily, per_param: list[set[str]]) -> bool:
    allowed = f.required | f.optional
    return all(not fields or (f.required <= fields and fields <= allowed) for fields in per_param)


def _key_fit(f: TorchFamily, keys: set[str]) -> bool:
    extra = keys - f.keys
    return f.keys <= keys and not (extra & HYPER_KEYS)


def classify_group(group: dict, per_param: list[set[str]]) -> Verdict:
    """The family of one param group, from its keys and its parameters' state fields."""
    keys = {k for k in group if k != "params"}
    fields = set().union(*per_param) if per_param else set()
    exact = [f for f in FAMILIES if _key_fit(f, keys) and _fields_fit(f, per_param)]
    if exact and {f.family for f in exact} <= {"adam", "adamw"}:
        return Verdict("adamw" if group.get("decoupled_weight_decay") else "adam")
    if len(exact) == 1:
        return Verdict(exact[0].family)
    detail = _describe(fields, keys - ANNOTATIONS)
    if exact:  # pragma: no cover - the table's key sets are pairwise distinct
        return Verdict(None, tuple(f.family for f in exact), detail)
    # an older torch: fewer keys, none foreign
    partial = [f for f in FAMILIES if (keys - ANNOTATIONS) <= f.keys and not ((keys - f.keys) & HYPER_KEYS)
               and _fields_fit(f, per_param) and keys & f.keys]
    if partial and len(keys & HYPER_KEYS) >= 2:
        return Verdict(None, tuple(f.family for f in partial), detail)
    return Verdict(None, (), detail)


def classify(groups: list[dict], per_param: list[list[set[str]]]) -> Verdict:
    """The family of a whole state: every group must agree."""
    verdicts = [classify_group(g, p) for g, p in zip(groups, per_param, strict=True)]
    if not verdicts:
        return Verdict(None, (), "no param groups")
    fams = {v.family for v in verdicts}
    if len(fams) == 1 and None not in fams:
        return verdicts[0]
    unknown = [v for v in verdicts if v.family is None]
    if unknown:
        cands = set(unknown[0].candidates)
        for v in verdicts:
            cands &= set(v.candidates) if v.family is None else {v.family}
        return Verdict(None, tuple(c for c in unknown[0].candidates if c in cands), unknown[0].detail)
    return Verdict(None, (), "param groups of different optimizers: " + ", ".join(sorted(f for f in fams if f)))


def class_name(family: str) -> str:
    f = BY_NAME.get(family)
    return f"torch.optim.{f.cls}" if f else family
