"""The optimizers people add to torch, recognised in an ``optimizer.state_dict()``.

transformers' Adafactor, torchao's low-bit AdamW, lucidrains' Lion, schedule-free, torch-optimi's
StableAdamW, apex's and DeepSpeed's FusedAdam, GaLore and GrokAdamW all save through
``torch.save(optimizer.state_dict())``, so their files read like any torch state, but their fields
and group keys are no ``torch.optim`` class's (``shared/docs/optimizers-third-party.md`` §7). Each
is recognised here from every stepped parameter's fields **and** its groups' keys (:data:`KNOWN`),
never from one key, and is given a family of its own (``transformers-adafactor``, …) so that no
code takes it for the torch optimizer it resembles. :func:`adapt` is the one place where such a
state becomes a ``torch.optim``/burn family's state, for ``convert`` and ``verify-resume``: only
where the update means the same, otherwise refused naming the difference.

torchao's moments are tensor subclasses (``OptimState8bit``/``4bit``/``Fp8``): the pickle reader
keeps them as :class:`~statekit.formats.torch_pickle.WrapperTensor` records, and :func:`wrapper_slot`
turns each into a lazy float32 tensor dequantized exactly as torchao's ``dequantize()`` does
(``qmap[codes] * scale`` per block, in float32), block by block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from statekit.errors import FormatError, MappingError, StatekitError, UsageError
from statekit.lazy import numpy as np
from statekit.state import OptimizerState, ParamGroup, ParamState
from statekit.tensor import TensorRef


@dataclass(frozen=True)
class Foreign:
    """One optimizer from outside ``torch.optim``: statekit's family id, what people call it, and
    what a conversion does with it (``target``: the family whose update it continues as, per
    target framework; ``refused``: why it is not converted; ``flavor``: the replay arithmetic that
    is the library's own, where statekit has it)."""

    family: str
    name: str
    target: str | None = None
    refused: str = ""
    flavor: str | None = None  # the replay flavor whose arithmetic is this optimizer's own (None: the target's)


KNOWN: dict[str, Foreign] = {f.family: f for f in (
    Foreign("transformers-adafactor", "transformers Adafactor (transformers.optimization.Adafactor)", "adafactor"),
    Foreign("torchao-adam-8bit", "torchao AdamW8bit or Adam8bit (8-bit OptimState8bit moments)", "adam"),
    Foreign("torchao-adam-4bit", "torchao AdamW4bit or Adam4bit (4-bit OptimState4bit moments)", "adam"),
    Foreign("torchao-adam-fp8", "torchao AdamWFp8 or AdamFp8 (float8 OptimStateFp8 moments)", "adam"),
    Foreign("torchao-adam", "torchao low-bit AdamW or Adam (no tensor large enough to be quantized)", "adam"),
    # lion-pytorch's update is burn Lion's, operation for operation (tests: bit for bit on its own run)
    Foreign("lion-pytorch", "lion-pytorch Lion (lion_pytorch.Lion)", "lion", flavor="burn"),
    Foreign("apex-fusedadam", "apex FusedAdam (apex.optimizers.FusedAdam; step kept in the param group)", "adam"),
    Foreign("deepspeed-fusedadam", "DeepSpeed FusedAdam (deepspeed.ops.adam.FusedAdam)", "adam"),
    Foreign("deepspeed-cpuadam", "DeepSpeed CPUAdam (deepspeed.ops.adam.DeepSpeedCPUAdam)", "adam"),
    Foreign("optimi-stableadamw", "torch-optimi StableAdamW (optimi.StableAdamW; step kept in the param group)",
            refused="StableAdamW keeps debiased moments (its β are rescaled every step: exp_avg is torch's "
                    "exp_avg/(1-β1^t)) and divides each tensor's learning rate by max(1, RMS(g/√v)); "
                    "torch's Adam/AdamW and burn's do neither"),
    Foreign("schedulefree-adamw", "schedule-free AdamWScheduleFree (schedulefree)",
            refused="schedule-free keeps z and averages the iterates (k, weight_sum, lr_max in the group); "
                    "no torch.optim or burn optimizer continues that update"),
    Foreign("schedulefree-sgd", "schedule-free SGDScheduleFree (schedulefree)",
            refused="schedule-free keeps z and averages the iterates (k, weight_sum, lr_max in the group); "
                    "no torch.optim or burn optimizer continues that update"),
    Foreign("schedulefree-radam", "schedule-free RAdamScheduleFree (schedulefree)",
            refused="schedule-free keeps z and averages the iterates (k, weight_sum, lr_max in the group); "
                    "no torch.optim or burn optimizer continues that update"),
    Foreign("schedulefree-adamw-reference", "schedule-free AdamWScheduleFreeReference (schedulefree)",
            refused="schedule-free keeps z and averages the iterates (k, weight_sum, lr_max in the group); "
                    "no torch.optim or burn optimizer continues that update"),
)}

TORCHAO_KIND = {"OptimState8bit": "torchao-adam-8bit", "OptimState4bit": "torchao-adam-4bit",
                "OptimStateFp8": "torchao-adam-fp8"}
ANNOTATIONS = frozenset({"param_names", "initial_lr", "max_lr", "min_lr", "base_lr", "swa_lr"})
ADAFACTOR_KEYS = frozenset("lr eps clip_threshold decay_rate beta1 weight_decay scale_parameter relative_step "
                           "warmup_init".split())
ADAFACTOR_FIELDS = frozenset({"step", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "RMS", "exp_avg"})
SCHEDULEFREE_KEYS = frozenset({"k", "train_mode", "weight_sum", "lr_max"})
SCHEDULEFREE_FIELDS = frozenset({"z", "exp_avg_sq", "exp_avg", "x", "y"})
FUSED_KEYS = frozenset({"lr", "bias_correction", "betas", "eps", "weight_decay"})
TORCHAO_KEYS = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad"})
GROK_KEYS = frozenset({"alpha_init", "lamb", "gamma", "grokking_signal_fns"})

# pickle globals that only one library writes: refused (a class statekit must not run), by name
REFUSED_GLOBALS = {
    "galore_torch.": "a GaLore optimizer state (galore-torch): each parameter's state holds a GaLoreProjector "
                     "object and moments of the projected low-rank shape; statekit does not read GaLore states",
    "apollo_torch.": "an APOLLO optimizer state (apollo-torch): each parameter's state holds a projector object; "
                     "statekit does not read APOLLO states",
}


# ---------------------------------------------------------------------------------------------
# recognising


def refuse_global(name: str, path: str) -> None:
    """Raise the one-line refusal for a pickle global only a known optimizer writes (if it is one)."""
    for prefix, why in REFUSED_GLOBALS.items():
        if name.startswith(prefix):
            raise StatekitError(f"{why} (its pickle names {name})", path)


def _keys(group: dict) -> frozenset[str]:
    return frozenset(k for k in group if k != "params" and k not in ANNOTATIONS)


def identify(sd: dict, path: str) -> Foreign | None:
    """The optimizer outside ``torch.optim`` that wrote ``sd``, or None. Every group and every
    stepped parameter must fit; GrokAdamW is refused here by name."""
    groups = [g for g in sd["param_groups"] if isinstance(g, dict)]
    keys = [_keys(g) for g in groups]
    if any(GROK_KEYS <= k for k in keys):
        raise StatekitError("a GrokAdamW optimizer state (grokadamw): its per-parameter state lives in "
                            "param_groups[i]['state'], a dict keyed by the parameters themselves; statekit does not "
                            "read GrokAdamW states", path)
    entries = [e for e in sd["state"].values() if isinstance(e, dict) and e]
    fields = [frozenset(map(str, e)) for e in entries]
    if not groups:
        return None
    values = [v for e in entries for v in e.values()]
    wrappers = {type_name(v) for v in values if _is_wrapper(v)}
    if wrappers:
        kinds = {TORCHAO_KIND.get(w) for w in wrappers}
        if len(kinds) != 1 or None in kinds or not all(TORCHAO_KEYS <= k for k in keys):
            return None
        return KNOWN[kinds.pop()]
    if all(ADAFACTOR_KEYS <= k for k in keys) and all(f <= ADAFACTOR_FIELDS and "step" in f for f in fields):
        return KNOWN["transformers-adafactor"]
    if all(SCHEDULEFREE_KEYS <= k for k in keys) and all(f <= SCHEDULEFREE_FIELDS for f in fields):
        if all("decay_at_z" in k for k in keys):
            return KNOWN["schedulefree-adamw-reference"]
        if all("momentum" in k for k in keys):
            return KNOWN["schedulefree-sgd"]
        if all("silent_sgd_phase" in k for k in keys):
            return KNOWN["schedulefree-radam"]
        if all("betas" in k for k in keys):
            return KNOWN["schedulefree-adamw"]
        return None
    if all(k == {"lr", "betas", "weight_decay"} for k in keys) and all(f == {"exp_avg"} for f in fields):
        return KNOWN["lion-pytorch"]
    if all({"beta1", "beta2", "step", "decouple_lr", "kahan_sum"} <= k for k in keys) and all(
            {"exp_avg", "exp_avg_sq", "eps_sq"} <= f <= {"exp_avg", "exp_avg_sq", "eps_sq", "kahan_comp"}
            for f in fields):
        return KNOWN["optimi-stableadamw"]
    if all(k == FUSED_KEYS | {"step"} for k in keys) and all(f == {"exp_avg", "exp_avg_sq"} for f in fields):
        return KNOWN["apex-fusedadam"]
    if all(f == {"step", "exp_avg", "exp_avg_sq"} for f in fields) and all(
            isinstance(e["step"], int) for e in entries):
        if all(k == FUSED_KEYS for k in keys):
            return KNOWN["deepspeed-fusedadam"]
        if all(k == FUSED_KEYS | {"amsgrad"} for k in keys):
            return KNOWN["deepspeed-cpuadam"]
    if all(k == TORCHAO_KEYS for k in keys) and all(type_name(g.get("lr")) == "TensorRef" for g in groups) and all(
            f <= {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"} for f in fields):
        return KNOWN["torchao-adam"]
    return None


def type_name(value: object) -> str:
    if _is_wrapper(value):
        return value.cls.rsplit(".", 1)[-1]
    return type(value).__name__


def _is_wrapper(value: object) -> bool:
    from statekit.formats.torch_pickle import WrapperTensor

    return isinstance(value, WrapperTensor)


def settle(foreign: Foreign, state: OptimizerState, sd: dict, path: str) -> None:
    """Finish a recognised state: its family, its label, steps kept in param groups, notes."""
    state.family, state.candidates, state.family_detail = foreign.family, (foreign.family,), foreign.name
    for p in state.params:
        p.family = foreign.family
    groups = sd["param_groups"]
    if foreign.family in ("apex-fusedadam", "optimi-stableadamw"):
        for p in state.params:
            value = groups[p.group].get("step")
            if p.slots and value is not None:
                p.step = group_step(value, f"param_groups[{p.group}]", path)
        state.notes.append(f"{foreign.name.split(' (')[0]} keeps one step count per param group, shown on each of its "
                           "parameters")
    if foreign.family.startswith("torchao-adam"):
        state.notes.append("torchao's low-bit moments are shown dequantized to float32 exactly as torchao's "
                           "dequantize() gives them; the file does not say whether it was Adam or AdamW "
                           "(is_adamw is not saved)")
    if foreign.family.startswith("schedulefree"):
        mode = {bool(g.get("train_mode")) for g in groups}
        where = "train mode: the saved parameters are y, the interpolation the gradients are taken at" \
            if mode == {True} else "eval mode: the saved parameters are x, the averaged iterate" \
            if mode == {False} else "some groups in train mode, some in eval mode"
        state.notes.append(f"schedule-free state saved in {where}; k (steps), weight_sum and lr_max are in the "
                           "param groups")
        for p in state.params:
            p.step = groups[p.group].get("k") if p.slots else None
    if foreign.family == "deepspeed-fusedadam" and any(
            len({p.step for p in state.params if p.group == g and p.slots}) > 1 for g in range(len(groups))):
        state.notes.append("DeepSpeed FusedAdam increments only the last parameter's step in each group outside "
                           "ZeRO (deepspeedai/DeepSpeed#8471): the steps differ within a group")


def group_step(value: object, where: str, path: str) -> int | float:
    if isinstance(value, TensorRef):
        if value.numel != 1:
            raise FormatError(f"{where}: step has {value.numel} elements, expected one", path)
        return value.numpy().reshape(-1)[0].item()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    raise FormatError(f"{where}: step is {type(value).__name__}, expected a number or 0-dim tensor", path)


# ---------------------------------------------------------------------------------------------
# torchao's quantized moments


STORED = {"OptimState8bit": "8-bit codes", "OptimState4bit": "4-bit codes (two a byte)",
          "OptimStateFp8": "float8_e4m3fn codes"}
LABEL = {"OptimState8bit": "8-bit", "OptimState4bit": "4-bit", "OptimStateFp8": "fp8"}


def wrapper_slot(value, where: str, path: str) -> TensorRef:
    """A torchao OptimState8bit / 4bit / Fp8 moment as a lazy float32 tensor of the parameter's
    shape, dequantized as torchao does, block by block (memory: a few blocks)."""
    kind = type_name(value)
    if kind not in TORCHAO_KIND:
        raise FormatError(f"{where}: a {value.cls} tensor subclass, which statekit does not read", path)
    st = value.state
    codes, scale = st.get("codes"), st.get("scale")
    if not isinstance(codes, TensorRef) or not isinstance(scale, TensorRef) or scale.dtype != "F32":
        raise FormatError(f"{where}: {kind} without its codes and float32 scale tensors", path)
    shape = st.get("_shape", value.shape) if kind == "OptimState4bit" else value.shape
    if not isinstance(shape, tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise FormatError(f"{where}: {kind} shape {shape!r:.80} is not a tuple of sizes", path)
    numel = math.prod(shape)
    per_code = 2 if kind == "OptimState4bit" else 1
    qmap = st.get("qmap")
    if kind == "OptimStateFp8":
        if codes.info.get("float8") != "float8_e4m3fn" or codes.dtype != "U8":
            raise FormatError(f"{where}: OptimStateFp8 codes are not float8_e4m3fn", path)
    elif not isinstance(qmap, TensorRef) or qmap.dtype != "F32" or qmap.numel != (256 if per_code == 1 else 16) \
            or codes.dtype != "U8":
        raise FormatError(f"{where}: {kind} without uint8 codes and its {256 if per_code == 1 else 16}-entry qmap",
                          path)
    if codes.numel * per_code != numel or not scale.numel or numel % scale.numel:
        raise FormatError(f"{where}: {kind} of shape {list(shape)} has {codes.numel} codes and {scale.numel} scales",
                          path)
    block = numel // scale.numel
    if per_code == 2 and block % 2:
        raise FormatError(f"{where}: OptimState4bit block size {block} is odd", path)
    return TensorRef(dtype="F32", shape=shape, piece_source=_dequantizer(kind, codes, scale, qmap, block, numel),
                     info={"stored_as": f"torchao {kind}: {STORED[kind]}, block {block}",
                           "stored_label": f"{LABEL[kind]}/{block}",
                           # what the file holds: the sizes inspect counts are of these, not of the float32
                           "stored_tensors": tuple(r for r in (codes, scale, qmap) if isinstance(r, TensorRef))})


def _dequantizer(kind: str, codes: TensorRef, scale: TensorRef, qmap: TensorRef | None, block: int, numel: int):
    """Pieces of the dequantized moment: each value is ``q · scale[k // block]`` (one float32
    product, as torchao's broadcast multiply gives it). Memory: one piece of codes and the scales
    of the blocks it touches, whatever the block size."""
    def pieces(elements: int):
        from statekit.lazy import ml_dtypes
        from statekit.tensor import Elements

        per_code = 2 if kind == "OptimState4bit" else 1
        size = max(per_code, elements - elements % per_code)
        table = qmap.numpy().reshape(-1) if qmap is not None else None
        scales = Elements(scale.pieces(max(1, size // block + 1)))
        window, start, lo = np.empty(0, dtype=np.float32), 0, 0  # scales of blocks start, start+1, …
        for c in codes.pieces(size // per_code):
            if kind == "OptimState4bit":  # packed as (c[::2] << 4) | c[1::2]: the high nibble first
                c = np.stack([c >> 4, c & 0xF], axis=-1).reshape(-1)
            q = c.view(ml_dtypes.float8_e4m3fn).astype(np.float32) if table is None else table[c]
            first, last = lo // block, (lo + q.size - 1) // block
            window, start = window[first - start:], first
            if start + window.size <= last:
                window = np.concatenate([window, scales.take(last + 1 - start - window.size).astype(np.float32)])
            index = np.arange(lo, lo + q.size, dtype=np.int64) // block - start
            yield q * window[index]
            lo += q.size

    return pieces


# ---------------------------------------------------------------------------------------------
# continuing as another optimizer (convert, verify-resume)


def is_foreign(state: OptimizerState | None) -> bool:
    return state is not None and state.family in KNOWN


def adapt(state: OptimizerState, target: str, *, optimizer: str | None = None, path: str | None = None
          ) -> tuple[OptimizerState, list[str]]:
    """``state`` as the state of the family that continues it (torch names, neutral groups), for a
    conversion into ``target`` (a framework: ``torch``, ``burn``, …), with notes for the plan; a
    MappingError naming the difference where no optimizer of ``target`` continues it."""
    foreign = KNOWN[state.family]
    try:
        if foreign.target is None:
            raise MappingError(f"{foreign.name} state: {foreign.refused}; statekit reads it but does not convert it")
        if foreign.target == "adam":
            return _as_adam(state, foreign, optimizer)
        if foreign.target == "adafactor":
            return _as_adafactor(state, foreign, target)
        return _as_lion(state, foreign, target)
    except StatekitError as exc:
        if exc.path is None and path is not None:
            exc.path = path
        raise


def _copy(state: OptimizerState, family: str, groups: list[dict], params: list[ParamState], notes) -> OptimizerState:
    return OptimizerState(family=family, candidates=(family,), params=params,
                          groups=[ParamGroup(hyperparams=g, keys=list(old.keys)) for g, old in zip(groups, state.groups,
                                                                                                  strict=True)],
                          hyperparams_stored=True, framework="torch", notes=list(notes), names_from=state.names_from)


def _param(p: ParamState, family: str, slots: dict, step) -> ParamState:
    return replace(p, slots=slots, step=step, extra={k: v for k, v in p.extra.items() if k.startswith("__")},
                   family=family)


def _number(value: object, key: str) -> object:
    if isinstance(value, TensorRef):  # torchao keeps lr as a 0-dim float32 tensor
        if value.numel != 1:
            raise MappingError(f"param group key {key!r} is a tensor of {value.numel} elements")
        return value.numpy().reshape(-1)[0].item()
    return value


def _as_adam(state: OptimizerState, foreign: Foreign, optimizer: str | None):
    groups = [dict(g.hyperparams) for g in state.groups]
    decays = {float(_number(g.get("weight_decay", 0) or 0, "weight_decay")) for g in groups}
    notes: list[str] = []
    wanted = optimizer.lower() if optimizer else None
    if wanted not in (None, "adam", "adamw"):
        raise UsageError(f"--optimizer {wanted}: the file holds {foreign.name} state, an Adam/AdamW update "
                         "(say --optimizer adam or adamw)")
    if wanted is None:
        if decays != {0.0}:
            raise MappingError(f"{foreign.name} state: the file does not say whether weight decay was decoupled "
                               "(AdamW) or added to the gradient (Adam); say --optimizer adamw or --optimizer adam")
        wanted = "adamw"
        notes.append("weight decay is 0: Adam and AdamW take the same step; written as AdamW")
    out_groups = []
    for i, g in enumerate(groups):
        if foreign.family in ("apex-fusedadam", "deepspeed-fusedadam", "deepspeed-cpuadam"):
            if not g.get("bias_correction", True):
                raise MappingError(f"{foreign.name} state: param_groups[{i}] has bias_correction=False; torch's "
                                   "Adam/AdamW always corrects the moments' bias")
            if g.get("amsgrad"):
                raise MappingError(f"{foreign.name} state: param_groups[{i}] has amsgrad=True, which its kernel "
                                   "does not implement as torch does")
        values = {k: _number(g[k], k) for k in ("lr", "betas", "eps", "weight_decay") if k in g}
        values.update({k: g[k] for k in ANNOTATIONS if k in g})
        values["amsgrad"] = bool(g.get("amsgrad", False))
        values["decoupled_weight_decay"] = wanted == "adamw"
        out_groups.append(values)
    params = []
    for p in state.params:
        slots = {k: v for k, v in p.slots.items() if k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
        params.append(_param(p, wanted, slots, p.step))
    if foreign.family == "deepspeed-fusedadam" and any(n.startswith("DeepSpeed FusedAdam increments") for n in
                                                       state.notes):
        raise MappingError(f"{foreign.name} state: the steps differ within a param group (DeepSpeed FusedAdam "
                           "increments only the last parameter's; deepspeedai/DeepSpeed#8471), so the true step "
                           "of the others is not in the file")
    if foreign.family.startswith("torchao-adam"):
        notes.append(f"moments from {foreign.name} dequantized to float32 exactly as torchao does; torchao "
                     "re-quantizes them after every step, torch keeps them in full precision from here on")
    else:
        notes.append(f"{foreign.name}: the same Adam arithmetic as torch's (rounding aside)")
    return _copy(state, wanted, out_groups, params, notes), notes


# transformers Adafactor's param-group keys and what torch's / burn's Adafactor call them
def _adafactor_problems(g: dict, i: int, target: str, has_first_moment: bool) -> list[str]:
    out = []
    where = f"param_groups[{i}]"
    if g.get("beta1") is not None or has_first_moment:
        out.append(f"{where}: beta1={g.get('beta1')} keeps a first moment (exp_avg), which {target}'s Adafactor "
                   "does not have")
    if g.get("warmup_init"):
        out.append(f"{where}: warmup_init=True grows the relative step from 1e-6·t, which {target}'s Adafactor "
                   "cannot do")
    if target == "torch":
        if not g.get("scale_parameter"):
            out.append(f"{where}: scale_parameter=False, but torch.optim.Adafactor always scales its step by the "
                       "parameter's RMS")
        if not g.get("relative_step"):
            out.append(f"{where}: relative_step=False (a constant lr={g.get('lr')}), but torch.optim.Adafactor's "
                       "step size is min(lr, 1/√t), which differs from step "
                       f"{math.floor(1 / float(g['lr']) ** 2) + 1 if g.get('lr') else 1} on")
    plain_lr = not g.get("relative_step") and not g.get("scale_parameter")
    if float(g.get("weight_decay") or 0) != 0 and (target == "torch" or not plain_lr):
        out.append(f"{where}: weight_decay={g['weight_decay']} decays by the scaled, relative step in transformers, by "
                   f"the plain lr in {target}'s Adafactor")
    return out


def _as_adafactor(state: OptimizerState, foreign: Foreign, target: str):
    if target not in ("torch", "burn"):
        raise MappingError(f"{foreign.name} state → {target}: no Adafactor there (statekit moves it to "
                           "torch.optim.Adafactor or burn's Adafactor)")
    problems: list[str] = []
    has_first = {p.group for p in state.params if "exp_avg" in p.slots}
    out_groups = []
    for i, g in enumerate(dict(g.hyperparams) for g in state.groups):
        problems += _adafactor_problems(g, i, target, i in has_first)
        eps = g.get("eps") or (1e-30, 1e-3)
        values = {"lr": 1e-2 if g.get("relative_step") else g.get("lr"), "beta2_decay": g.get("decay_rate", -0.8),
                  "eps": tuple(eps), "d": g.get("clip_threshold", 1.0), "weight_decay": g.get("weight_decay", 0.0)}
        if target == "burn":  # burn's switches and its two epsilons (torch has neither switch)
            del values["eps"]
            values.update(epsilon_1=float(eps[0]), epsilon_2=float(eps[1]), relative_step=bool(g.get("relative_step")),
                          scale_parameter=bool(g.get("scale_parameter")))
        values.update({k: g[k] for k in ANNOTATIONS if k in g})
        out_groups.append(values)
    if problems:
        raise MappingError(f"{foreign.name} state cannot continue as {target}'s Adafactor: " + "; ".join(problems))
    params = []
    for p in state.params:
        slots: dict[str, TensorRef] = {}
        for name, ref in p.slots.items():
            if target == "burn" and name.startswith("exp_avg_sq"):
                ref = _without_eps1(ref, out_groups[p.group]["epsilon_1"])
            if name == "exp_avg_sq_row":  # [..., R] → [..., R, 1]: the same bytes
                slots["row_var"] = replace(ref, shape=tuple(ref.shape) + (1,))
            elif name == "exp_avg_sq_col":  # [..., C] → [..., 1, C]
                slots["col_var"] = replace(ref, shape=tuple(ref.shape[:-1]) + (1, ref.shape[-1]))
            elif name == "exp_avg_sq":
                slots["variance"] = ref
        params.append(_param(p, "adafactor", slots, p.step))
    notes = ["transformers Adafactor's exp_avg_sq_row/col (means of g²+ε₁) become row_var [..., n, 1] and col_var "
             "[..., 1, m], exp_avg_sq becomes variance; RMS is dropped (recomputed from the parameter at every step)",
             "transformers adds ε₁ to g² before averaging, torch clamps with it instead: the moments differ by at most ε₁ "
             f"(eps[0]={out_groups[0].get('eps', (1e-30,))[0] if out_groups else 1e-30:g})"]
    if target == "burn":  # burn, like transformers, adds ε₁ to g² before averaging
        eps1 = out_groups[0]["epsilon_1"] if out_groups else 1e-30
        notes[1] = (f"transformers adds ε₁ (eps[0]={eps1:g}) to g² before averaging, as burn does: its moments "
                    "already hold ε₁, so they are taken as torch's minus ε₁ and burn's crossing adds it back (the "
                    f"file's own bits for entries of 0 or ≥ {2.0**-74:.2g})")
        notes.append("burn's relative_step, scale_parameter, epsilon_1, epsilon_2, decay_rate (beta2_decay), "
                     "clip_threshold (d) and weight_decay are transformers' own settings, carried as stored")
    if any(g.hyperparams.get("relative_step") for g in state.groups):
        notes.append("relative_step=True: the step size is min(1e-2, 1/√t), written as lr=0.01")
    return _copy(state, "adafactor", out_groups, params, notes), notes


def _without_eps1(ref: TensorRef, eps1: float) -> TensorRef:
    """``ref − ε₁`` in its own dtype, piece by piece (transformers' moments hold ε₁ as burn's do;
    the torch ⇄ burn crossing adds it again)."""
    from statekit import stream

    return stream.combine([ref], lambda piece: np.asarray(piece - piece.dtype.type(eps1), dtype=piece.dtype),
                          ref.dtype)


def _as_lion(state: OptimizerState, foreign: Foreign, target: str):
    from statekit import naming

    out_groups = []
    for g in (dict(g.hyperparams) for g in state.groups):
        values = {k: g[k] for k in ("lr", "betas", "weight_decay") if k in g}
        values.update({k: g[k] for k in ANNOTATIONS if k in g})
        out_groups.append(values)
    try:
        slot = next(iter(naming.layout("burn", "lion").slots.values()))
    except KeyError:
        raise MappingError(f"{foreign.name} state: statekit knows no Lion optimizer to continue it") from None
    params = [_param(p, "lion", {slot: p.slots["exp_avg"]} if "exp_avg" in p.slots else {}, None)
              for p in state.params]
    notes = ["lion-pytorch's exp_avg is Lion's momentum: the same update (sign of β1·m + (1-β1)·g, then "
             "m ← β2·m + (1-β2)·g, weight decay θ·(1 - lr·wd))",
             "lion-pytorch's decoupled_weight_decay=True (wd divided by the initial lr) is not saved in the file: "
             "the weight decay is taken as stored"]
    return _copy(state, "lion", out_groups, params, notes), notes
