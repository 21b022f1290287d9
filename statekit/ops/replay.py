"""``replay`` and ``verify-resume``: run optimizer steps on a state with the compute core.

``replay`` applies gradient files to a state and its parameters (a state without an entry for a
parameter starts fresh, as the framework would; no state at all reconstructs it from the
gradient history). ``verify-resume`` runs the same seeded steps from an original state, from its
migrated copy and from a cold start, and says whether the migrated run tracks the original:
bit-exact when both use the same arithmetic, else within ``|Δp| ≤ 4·ulp(p) + 2e-5·lr·n``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np

from statekit import dtypes, hyper, naming, paramid
from statekit.errors import MappingError, UsageError
from statekit.formats import registry as formats
from statekit.frameworks import bnb
from statekit.ops import megatron_verify
from statekit.ops.pairing import pair
from statekit.ops.plan import Plan
from statekit.ops.progress import ProgressFactory, silent
from statekit.optim import kernels, registry
from statekit.optim import megatron as megatron_optim
from statekit.optim.backend import aligned_copy
from statekit.optim.tolerance import exp_avg_bound, param_bound
from statekit.state import Checkpoint, OptimizerState, ParamGroup, ParamState, refuse_unusable, settle_from
from statekit.tensor import TensorRef

FLAVOR_OF_FRAMEWORK = {"burn": "burn", "torch": "torch", "candle": "candle"}


# ------------------------------------------------------------------ hyperparameters


def registry_hp(algorithm: str, flavor: str, stored: dict, given: dict) -> dict:
    """The compute core's hyperparameters from a framework's stored values and the user's.

    torch's ``betas`` tuple becomes ``beta1``/``beta2``; keys the algorithm does not know under
    this flavor's framework (torch's ``foreach``, ``fused`` …) are left out.
    """
    merged = hyper.split_betas({**stored, **{k: v for k, v in given.items() if v is not None}})
    algo = registry.get_algorithm(algorithm)
    if flavor not in algo.flavors:  # e.g. a burn Muon record: statekit replays Muon in torch's arithmetic only
        raise UsageError(f"{algorithm} has no {flavor!r} flavor (statekit replays it as {', '.join(algo.flavors)}): "
                         f"its {registry.FRAMEWORK_OF[flavor]} state cannot be stepped here")
    framework = algo.frameworks[registry.FRAMEWORK_OF[flavor]]
    out = {k: v for k, v in merged.items() if k in framework.defaults and v is not None}
    for key in framework.fixed:
        if key in out and out[key] == framework.defaults[key]:
            out.pop(key)
    return registry.resolve(algorithm, flavor, out)


def default_flavor(state: OptimizerState | None, algorithm: str | None = None) -> str:
    """The arithmetic a state's own framework runs: torch's fused kernel when its group says so,
    torch's foreach path when its group says so and ``algorithm`` rounds it differently."""
    if state is None:
        return "torch"
    if state.framework == "torch" and any(g.hyperparams.get("fused") for g in state.groups):
        return "torch-fused"
    if state.framework == "torch" and any(g.hyperparams.get("foreach") for g in state.groups) and algorithm \
            and algorithm in registry.ALGORITHMS and "torch-foreach" in registry.ALGORITHMS[algorithm].flavors:
        return "torch-foreach"
    return FLAVOR_OF_FRAMEWORK.get(state.framework, "torch")


# torch group flags whose arithmetic statekit does not replay (torch 2.13, torch/optim/*.py). capturable:
# torch refuses it on a CPU for every optimizer that has it, and elsewhere steps on tensors (Adam's bias
# corrections in float32, …): not modelled. differentiable: Adam, AdamW and NAdam then take that tensor
# path too ("if capturable or differentiable"), which rounds otherwise; SGD, RMSprop, Adagrad, RAdam,
# Adamax, Adadelta, ASGD and Rprop only clone or go out of place, the same values (tests/test_replay_flags.py).
DIFFERENTIABLE_DIFFERS = frozenset({"adam", "adamw", "nadam"})


def refuse_unmodelled_flags(state: OptimizerState | None, algorithm: str, flavor: str, path: str | None) -> None:
    """A torch param group whose flags make torch step in arithmetic statekit does not replay is
    refused, naming the group and the flag (never replayed as if the flag were off)."""
    if state is None or state.framework != "torch" or not registry.arithmetic(flavor).startswith("torch"):
        return
    for i, g in enumerate(state.groups):
        if g.hyperparams.get("capturable"):
            raise MappingError(f"param group {i} has capturable=True: torch's capturable step (on an accelerator, "
                               "on tensors) rounds otherwise, and statekit does not replay it", path)
        if g.hyperparams.get("differentiable") and algorithm in DIFFERENTIABLE_DIFFERS:
            raise MappingError(f"param group {i} has differentiable=True: torch's {algorithm} then steps on tensors "
                               "and rounds otherwise, and statekit does not replay it", path)


def state_hp(state: OptimizerState | None, group: int = 0) -> dict:
    """The stored hyperparameters of param group ``group`` (torch's words)."""
    if state is None or not state.groups:
        return {}
    hp = state.groups[min(group, len(state.groups) - 1)].hyperparams
    if state.library == bnb.LIBRARY and state.family:  # bitsandbytes packs its hyperparameters its own way
        return bnb.torch_hyperparams(state.family, hp)
    return dict(hp)


def group_hps(state: OptimizerState | None, algorithm: str, flavor: str, given: dict,
              fallback_lr: float | None = None) -> list[dict]:
    """The compute core's hyperparameters of each param group (one set when the state has none):
    each group steps with its own (a no-decay group's weight_decay 0, a head's larger lr)."""
    out = []
    for i in range(max(len(state.groups) if state is not None else 0, 1)):
        stored = state_hp(state, i)
        if fallback_lr is not None:
            stored.setdefault("lr", fallback_lr)
        out.append(registry_hp(algorithm, flavor, stored, given))
    return out


def set_group_hps(lane: Lane, state: OptimizerState | None, hps: list[dict], paths=None) -> None:
    """Each parameter of ``state`` steps in ``lane`` with its group's hyperparameters (``paths``: the
    lane's path for each parameter, where it is not the parameter's own)."""
    if state is None or len(hps) < 2:
        return
    for p in state.params:
        path = paths.get(p.key, p.path) if paths is not None else p.path
        if path is not None:
            lane.hp_of[path] = hps[min(p.group, len(hps) - 1)]


def _differing(hps: list[dict]) -> list[dict] | None:
    return hps if any(h != hps[0] for h in hps[1:]) else None


def pick_algorithm(*states: OptimizerState | None, given: str | None, paths: tuple = ()) -> str:
    """The optimizer to step: ``given`` (``--optimizer``), else the one the states agree on. A state
    whose file cannot tell its family (one of several, :meth:`OptimizerState.settle`) is refused
    until ``given`` names one of them, and then settled as it (its slots renamed for that family)."""
    for i, state in enumerate(states):
        if state is not None and state.family is None and len(state.candidates) > 1:
            where = paths[i] if i < len(paths) else None
            if not given:
                raise UsageError(f"say which optimizer with --optimizer (the state holds {state.family_label})", where)
            try:
                state.settle(given)
            except UsageError as exc:
                exc.path = exc.path or where
                raise
    if given:
        return given.lower()
    for state in states:
        if state is not None and state.family and len(state.candidates) <= 1 and state.family != "mixed":
            return state.family
    fams = [s.family_label for s in states if s is not None]
    raise UsageError(f"say which optimizer with --optimizer (the state holds {', '.join(fams) or 'nothing'})")


# ------------------------------------------------------------------ running


@dataclass
class Lane:
    """One replay: its arithmetic, hyperparameters and evolving arrays, per parameter path.

    ``kernel`` is asked for (``auto``: the fastest that has the step,
    :func:`statekit.optim.registry.choose_kernel`); :attr:`chosen` is the one that runs. The
    lane owns its arrays and steps them in place: a step allocates nothing parameter-sized
    beyond the kernel's own block-sized temporaries.
    """

    algorithm: str
    flavor: str
    hp: dict
    params: dict[str, np.ndarray]
    slots: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    xp: object = None
    kernel: str = "auto"
    chosen: str = field(init=False, default="")
    last_digest: bytes = field(init=False, default=b"")
    keep_final: bool = field(init=False, default=False)  # keep the final state (one parameter's) in last_slots
    last_slots: dict = field(init=False, default_factory=dict)
    hp_of: dict[str, dict] = field(default_factory=dict)  # a path's own hyperparameters (its param group's)
    new_slots: dict = field(init=False, default_factory=dict)  # a resized state's final per-element slots
    source: str | None = None  # the file the lane's state came from, named by its errors

    def __post_init__(self):
        self.chosen = registry.choose_kernel(self.algorithm, self.flavor, xp=self.xp, kernel=self.kernel)

    def step(self, grads: dict[str, np.ndarray]) -> None:
        for path, g in grads.items():
            self.step_one(path, g)

    def step_one(self, path: str, g) -> None:
        """One step of one parameter, in place on the lane's arrays."""
        slots = self.slots.get(path, {})
        hp = self.hp_of.get(path, self.hp)
        try:
            p, slots, t = registry.step(self.algorithm, self.params[path], g, slots, self.steps.get(path, 0), hp,
                                        self.flavor, self.xp, inplace=_owned(self.params[path], slots),
                                        kernel=self.chosen)
        except UsageError as exc:  # the step's own check: name the parameter and the file
            if exc.path is not None:
                raise
            hint = f" (it is not {self.algorithm}'s state: check --optimizer)" if "state slots" in exc.message else ""
            raise UsageError(f"{path}: {exc.message}{hint}", self.source) from None
        self.params[path], self.slots[path], self.steps[path] = p, slots, t


def _owned(param, slots: dict) -> bool:
    """Whether a parameter and its slots can be stepped in place (numpy: writable float32
    C-contiguous; torch/CuPy arrays are the lane's own device copies)."""
    return all(not isinstance(a, np.ndarray) or (a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable)
               for a in (param, *slots.values()))


def owned_float32(ref: TensorRef, transpose: bool = False) -> np.ndarray:
    """A tensor's values as a fresh float32 C-contiguous array of the caller's own, 64-byte
    aligned (as torch allocates): one copy, straight from the file's pages where the tensor is a
    span of its file (nothing read into a buffer first)."""
    with ref.mapped() as arr:
        values = arr if arr is not None else ref.numpy()
        out = aligned_copy(values.T if transpose else values)
        del values, arr
    return out


def slots_of(p: ParamState, transpose: bool = False) -> dict[str, np.ndarray]:
    return {name: owned_float32(ref, transpose) for name, ref in p.slots.items()
            if name not in ("avg", naming.MASTER_SLOT)}  # burn RMSProp's derived copy; Megatron's parameter


def _device_namespace(device: str, backend: str | None):
    if device == "cpu" and backend in (None, "numpy"):
        return None, lambda a: a, lambda a: a
    if backend == "cupy":
        import cupy

        return cupy, cupy.asarray, cupy.asnumpy
    import torch

    dev = torch.device(device)
    return torch, (lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)), (lambda t: t.cpu().numpy())


def replay(state: OptimizerState | None, params: dict[str, TensorRef], grads: list[dict[str, TensorRef]], *,
           algorithm: str, flavor: str, hp: dict, device: str = "cpu", backend: str | None = None,
           progress=None, kernel: str = "auto", group_hp: list[dict] | None = None, source: str | None = None) -> Lane:
    """Apply each gradient set in turn; returns the final lane (params, slots, steps by path;
    ``lane.chosen`` is the kernel that ran).

    Gradients are read one parameter of one step at a time (a memory-mapped file's tensor is
    used in place): memory is the parameters and their state plus one gradient tensor,
    whatever the number of steps.
    """
    xp, to_dev, to_host = _device_namespace(device, backend)
    lane = Lane(algorithm, flavor, hp, {n: to_dev(owned_float32(r)) for n, r in params.items()},
                xp=xp, kernel=kernel, source=source)
    if group_hp is not None:  # ``group_hp``: each param group's hyperparameters (group_hps), by the state's groups
        set_group_hps(lane, state, group_hp)
    if state is not None:
        for p in state.params:
            if p.path is None:
                raise MappingError(f"state parameter {p.label()} has no path to match the parameter file")
            if p.path not in lane.params:
                continue
            if p.shape is not None and tuple(p.shape) != tuple(lane.params[p.path].shape):
                raise MappingError(f"{p.path}: state shape {list(p.shape)} but the parameter is "
                                   f"{list(lane.params[p.path].shape)}")
            if p.slots:
                lane.slots[p.path] = {k: to_dev(v) for k, v in slots_of(p).items()}
            lane.steps[p.path] = int(p.step or 0)
    for grad_set in grads:
        unknown = sorted(set(grad_set) - set(lane.params))
        if unknown:
            raise MappingError(f"gradients for parameters that are not in the parameter file: {', '.join(unknown[:5])}")
        for n, r in grad_set.items():
            # read once: a float32 span of its file is stepped where the page cache holds it
            with r.mapped() as mapped:
                g = mapped if mapped is not None and mapped.dtype == np.float32 else None
                lane.step_one(n, to_dev(g if g is not None else np.asarray(r.numpy(), dtype=np.float32)))
                del g, mapped
        if progress:
            progress()
    lane.params = {n: to_host(a) for n, a in lane.params.items()}
    lane.slots = {n: {k: to_host(v) for k, v in s.items()} for n, s in lane.slots.items()}
    return lane


def lane_state(lane: Lane, template: OptimizerState | None, family: str) -> OptimizerState:
    """An OptimizerState holding a lane's result, keeping the template's ids, order and groups."""
    params: list[ParamState] = []
    known = {p.path: p for p in template.params} if template else {}
    order = [p.path for p in template.params] if template else []
    order += [n for n in lane.params if n not in order]
    for i, path in enumerate(order):
        old = known.get(path)
        slots = {k: TensorRef.from_array(v.astype(dtypes.numpy_dtype(_dtype(old, k)))) for k, v in lane.slots.get(path, {}).items()}
        step = lane.steps.get(path, old.step if old else None)
        if old is not None:
            params.append(ParamState(key=old.key, id=old.id, index=old.index, path=path, rank=old.rank, step=step,
                                     slots=slots or old.slots, extra=dict(old.extra), group=old.group, family=family))
        elif path in lane.slots:
            params.append(ParamState(key=str(i), id=paramid.generated(path), index=i, path=path, rank=lane.params[path].ndim,
                                     step=step, slots=slots, family=family))
    groups = template.groups if template else [ParamGroup(keys=[p.key for p in params])]
    fw = template.framework if template else "neutral"
    return OptimizerState(family=family, candidates=(family,), params=params, groups=groups, framework=fw,
                          hyperparams_stored=bool(template and template.hyperparams_stored))


def _dtype(old: ParamState | None, slot: str) -> str:
    if old is not None and slot in old.slots:
        return old.slots[slot].dtype
    return "F32"


def write_state(state: OptimizerState, path: str, fmt: str, family: str, source: Checkpoint | None) -> int:
    save = formats.writer(fmt)
    groups = [dict(g.hyperparams) for g in state.groups] if state.groups else [{}]
    if fmt == "torch":
        groups = [hyper.torch_group(family, g) for g in groups]
        for p in state.params:
            if p.index is None:
                raise MappingError(f"{p.path}: no torch position (replay a torch state, or write .bpk/.safetensors)")
    metadata = dict(source.metadata) if source is not None and fmt == "burnpack" else {}
    return save(state, path, family=family, groups=groups, metadata=metadata)


def replay_files(params: str | None, grads: list[str], out_params: str, *, state: str | None = None,
                 out_state: str | None = None, optimizer: str | None = None, flavor: str | None = None,
                 hyperparams: dict | None = None, device: str = "cpu", backend: str | None = None,
                 progress: ProgressFactory | None = None, kernel: str = "auto") -> dict:
    """``statekit replay``: apply the gradient files in order, write the parameters (and state)
    after the last step; returns what ``--json`` prints. Output formats are checked first."""
    from statekit import io
    from statekit.ops.tensorfile import read_tensors, write_tensors

    formats.from_extension(out_params)
    fmt = formats.from_extension(out_state) if out_state else None
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(io.open_checkpoint(state)) if state else None
        st = ckpt.optimizer if ckpt else None
        if ckpt is not None and st is None:
            raise UsageError(f"{state}: holds no optimizer state")
        refuse_unusable(st, state, "replay")
        _refuse_foreign(st, state)
        algorithm = pick_algorithm(st, given=optimizer, paths=(state,))
        start, megatron = _start_params(ckpt, params, flavor)
        flav = flavor or (megatron or default_flavor(st, algorithm))
        refuse_unmodelled_flags(st, algorithm, flav, state)
        hps = group_hps(st, algorithm, flav, hyperparams or {})
        hp = hps[0]
        grad_sets = [read_tensors(g) for g in grads]
        with (progress or silent)("steps", len(grad_sets)) as advance:
            lane = replay(st, start, grad_sets, algorithm=algorithm, flavor=flav, hp=hp,
                          device=device, backend=backend, progress=advance, kernel=kernel, group_hp=hps,
                          source=state)
        write_tensors(out_params, lane.params, ids={p.path: p.id for p in st.params if p.id} if st else None)
        if out_state:
            write_state(lane_state(lane, st, algorithm), out_state, fmt, algorithm, ckpt)
    out = {"optimizer": algorithm, "flavor": flav, "kernel": lane.chosen, "hyperparams": hp, "steps": len(grad_sets),
            "exactness": registry.exactness(flav, algorithm=algorithm), "out_params": out_params,
            "out_state": out_state, "step_counts": {n: lane.steps.get(n, 0) for n in lane.params}}
    if _differing(hps):  # groups of their own: each parameter stepped with its group's
        out["group_hyperparams"] = hps
    warning = kernels.torch_warning(lane.chosen)
    if warning:
        out["warnings"] = [warning]
    return out


def _start_params(ckpt: Checkpoint | None, params: str | None, flavor: str | None) -> tuple[dict, str | None]:
    """replay's parameters before the first step: ``params`` (a file), else a Megatron state's fp32 masters (the
    parameters megatron-core's Adam steps); and the ``megatron`` flavor where the state is Megatron's."""
    from statekit.ops.tensorfile import read_tensors

    megatron = None
    if ckpt is not None and megatron_verify.is_megatron(ckpt):
        megatron_verify.refuse_fused(ckpt, flavor, "--flavor")
        megatron = megatron_optim.MEGATRON
    if params is not None:
        return read_tensors(params), megatron
    if megatron is None:
        raise UsageError("give the parameters before the first step with --params (only a Megatron --state holds "
                         "its own: the fp32 masters)")
    lacking = [p.path for p in ckpt.optimizer.params if naming.MASTER_SLOT not in p.slots]
    if lacking:
        raise MappingError(f"{lacking[0]}: no fp32 master in the checkpoint, so no parameter to step (give --params)",
                           ckpt.path)
    return {p.path: p.slots[naming.MASTER_SLOT] for p in ckpt.optimizer.params}, megatron


# ------------------------------------------------------------------ verify-resume


def synthetic(seed: int, index: int, step: int, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """verify-resume's seeded float32 values, uniform in ``[-scale, scale)``, for parameter
    ``index`` at ``step`` (0: the initial parameter): one independent stream per (seed,
    parameter, step), so any step of any parameter is generated alone, identically for every
    lane. Uniform rather than normal: five times faster to draw, and the check only needs
    gradients of a realistic size and both signs."""
    rng = np.random.default_rng([seed, index, step])
    out = rng.random(shape, dtype=np.float32)
    out -= np.float32(0.5)
    out *= np.float32(2 * scale)
    return out


def _compare(ref: np.ndarray, other: np.ndarray, lr: float, steps: int, block: int = 1 << 20):
    """``(max |Δp|, max |Δp| / bound, bit-identical, first)`` of ``other`` against ``ref``, a block at a
    time (the float64 differences never exist for the whole tensor); ``first``: the multi-index and both
    values of the first element whose bits differ (None if none does)."""
    a, b = ref.reshape(-1), other.reshape(-1)
    max_diff, ratio, identical, first = 0.0, 0.0, True, None
    for lo in range(0, a.shape[0], block):
        x, y = a[lo:lo + block], b[lo:lo + block]
        same = x.view(np.uint32) == y.view(np.uint32)
        identical &= bool(same.all())
        if first is None and not identical:
            at = lo + int(np.flatnonzero(~same)[0])
            first = ([int(i) for i in np.unravel_index(at, ref.shape)], float(a[at]), float(b[at]))
        diff = np.abs(y.astype(np.float64) - x)
        # a NaN on one side only is as far off as can be (max() would pass over it: max(0.0, nan) is 0.0)
        diff[np.isnan(diff) & ~same] = np.inf
        diff[same] = 0.0
        with np.errstate(invalid="ignore"):
            share = diff / param_bound(x, lr, steps)  # NaN where the original is NaN: as far off, unless the same bits
        share[np.isnan(share)] = np.inf
        share[same] = 0.0
        max_diff = max(max_diff, float(diff.max()))
        ratio = max(ratio, float(share.max()))
    return max_diff, ratio, identical, first


def _region(ref: np.ndarray, other: np.ndarray, kept: tuple[int, ...] | None) -> tuple[np.ndarray, np.ndarray]:
    """Both arrays cut to ``kept`` (the region a resized state shares with the original)."""
    if kept is None:
        return ref, other
    cut = tuple(slice(0, n) for n in kept)
    return np.ascontiguousarray(ref[cut]), np.ascontiguousarray(other[cut])


def _run_lane(ln: Lane, which: str, pr, index: int, seed: int, steps: int) -> np.ndarray:
    """Step one parameter of one lane through the seeded steps; its final value in the original's
    layout. ``fresh`` is the migrated state with its per-element slots at a new parameter's values
    (zero; Adagrad's ``sum`` its initial accumulator: :func:`statekit.hyper.fresh_value`), what a
    resized state's new elements must behave like; its 0-dim slots (ASGD's ``eta`` and ``mu``, NAdam's
    ``mu_product``) are the tensor's own schedule, which new elements share in the one tensor torch
    steps: they stay as migrated. ``cold`` has no state at all."""
    shape_a, shape_m = tuple(pr.original.shape or ()), pr.migrated_shape
    full = tuple(max(x, y) for x, y in zip(shape_a, shape_m, strict=True)) if pr.kept else shape_a
    shape = shape_a if which == "original" else shape_m
    t = pr.transpose and which != "original"

    def values(step: int, scale: float) -> np.ndarray:
        arr = synthetic(seed, index, step, full, scale)  # the same numbers for every lane
        if shape != full:
            arr = np.ascontiguousarray(arr[tuple(slice(0, n) for n in shape)])
        return _layout(arr, t)

    ln.params[pr.path] = values(0, 0.5)
    src = pr.original if which == "original" else pr.migrated if which in ("migrated", "fresh") else None
    if src is not None and src.slots:
        slots = slots_of(src, transpose=False)
        if which == "fresh":  # per-element slots fresh (zero; Adagrad's sum its initial accumulator …);
            # the tensor's 0-dim ones (as the file keeps them) kept
            hp = ln.hp_of.get(pr.path, ln.hp)
            slots = {k: np.full_like(v, hyper.fresh_value(ln.algorithm, k, hp) or 0.0) if src.slots[k].shape else v
                     for k, v in slots.items()}
        ln.slots[pr.path] = slots
    if src is not None and src.step is not None:
        ln.steps[pr.path] = int(src.step)
    for k in range(steps):
        ln.step_one(pr.path, values(k + 1, 0.1))
    final_slots = ln.slots.pop(pr.path, {})
    ln.steps.pop(pr.path, None)
    if which in ("original", "migrated"):
        ln.last_digest = _digest(final_slots)  # for the bit-exact state comparison (no copy kept)
        if ln.keep_final:  # for the tolerance one, after a lossy migration
            ln.last_slots = final_slots
    final = ln.params.pop(pr.path)
    if pr.kept and which in ("migrated", "fresh"):  # the new elements of the state too (ASGD's ax moves no parameter)
        ln.new_slots = {k: _layout(v, t) for k, v in final_slots.items() if v.shape == final.shape}
    return _layout(final, t)


def _digest(slots: dict) -> bytes:
    """A digest of a lane's final state (slot names, shapes and float32 bits): two lanes with the
    same arithmetic must end with the same one. It catches state the parameter never reads
    (ASGD's average ``ax``) without keeping a copy of it."""
    import hashlib

    h = hashlib.blake2b(digest_size=32)
    for name in sorted(slots):
        a = np.ascontiguousarray(np.asarray(slots[name], dtype=np.float32))
        h.update(f"{name}:{a.shape};".encode("utf-8", "surrogatepass"))
        h.update(a.view(np.uint8).reshape(-1).data)
    return h.digest()


def _new_elements_equal(fresh: np.ndarray, migrated: np.ndarray, kept: tuple[int, ...]) -> bool:
    """Whether a resized state's new elements (outside ``kept``) stepped exactly like a fresh state."""
    mask = np.ones(fresh.shape, dtype=bool)
    mask[tuple(slice(0, n) for n in kept)] = False
    return bool(np.array_equal(fresh[mask].view(np.uint32), migrated[mask].view(np.uint32)))


def _layout(array: np.ndarray, transpose: bool) -> np.ndarray:
    return np.ascontiguousarray(array.T) if transpose else array


QUANTIZED_SHARE = 0.05  # an 8-bit side: the migrated run's deviation against a cold start's
# Algorithms whose flavors differ in the precision of the update itself: between two such flavors a
# run is compared with a cold start's deviation, as for re-quantized moments (4·ulp + 2e-5·lr·n is
# far below what the rounding of the update alone moves a parameter).
LOW_PRECISION_UPDATE = {"muon": "torch's Newton–Schulz runs in bfloat16, burn's in float32"}


def _slots_close(ref: dict, other: dict) -> bool:
    """The same slots, each within ``1e-5·max|s| + 4·ulp(s)`` of the reference (after a lossy
    migration in the same arithmetic: a rescaled buffer that rounds differently)."""
    if sorted(ref) != sorted(other):
        return False
    for name, a in ref.items():
        a, b = np.asarray(a, dtype=np.float32), np.asarray(other[name], dtype=np.float32)
        if a.shape != b.shape:
            return False
        if a.size and not bool((np.abs(b.astype(np.float64) - a) <= exp_avg_bound(a)).all()):
            return False
    return True


def _flavors(a_state, b_state, algorithm: str, chosen: tuple, said_by_user: bool, notes: list[str]):
    """Each side's arithmetic: what was chosen, else its framework's. A bitsandbytes state of an
    algorithm statekit has one arithmetic for (Lion: burn's) steps in it on both sides, said in a note."""
    flav_a = chosen[0] or default_flavor(a_state, algorithm)
    flav_b = chosen[1] or default_flavor(b_state, algorithm)
    known = registry.ALGORITHMS[algorithm].flavors if algorithm in registry.ALGORITHMS else ()
    if len(known) == 1 and not said_by_user and flav_a not in known and flav_b not in known \
            and bnb.LIBRARY in (a_state.library, b_state.library):
        notes.append(f"bitsandbytes {algorithm} state stepped on both sides in {known[0]}'s {algorithm} arithmetic, the "
                     f"one statekit has (it checks that the migrated state continues as the original does)")
        flav_a = flav_b = known[0]
    return flav_a, flav_b, known


def _quantized(*states: OptimizerState) -> bool:
    """Whether a side keeps 8-bit moments (bitsandbytes): its values cannot be carried exactly."""
    return any(getattr(enc, "bits", None) == 8 for s in states for p in s.params for enc in p.encoding.values())


def _verify_param(pr, index: int, lanes: dict, seed: int, steps: int, lr: float, exact: bool, tick,
                  quantized: bool = False, low_precision_update: bool = False) -> dict:
    """One parameter through every lane; its row of the report. ``tick(n_lanes)`` after each lane."""
    run = ["original", "migrated", "cold"] + (["fresh"] if pr.kept else [])
    slots_checked = exact and not (pr.reset or pr.kept or pr.transpose)
    # a migration that does not start from the original's bits: its state is compared by tolerance
    lossy = slots_checked and bool(pr.original.slots) and bool(pr.migrated and pr.migrated.slots) and \
        _digest(slots_of(pr.original, transpose=False)) != _digest(slots_of(pr.migrated, transpose=False))
    for name in ("original", "migrated"):
        lanes[name].keep_final = lossy
    ref = kept_final = None
    seen = {}
    for which in run:
        final = _run_lane(lanes[which], which, pr, index, seed, steps)
        if which == "original":
            ref = final
        elif which == "migrated":
            if not pr.reset:
                seen["migrated"] = _compare(*_region(ref, final, pr.kept), lr, steps)
            if pr.kept or pr.reset:
                kept_final = final
        elif which == "cold":
            seen["cold"] = _compare(*_region(ref, final, pr.kept), lr, steps)
            if pr.reset:  # a state the remap restarted on purpose must step like a cold start
                seen["migrated"] = _compare(*_region(final, kept_final, pr.kept), lr, steps)
        else:
            fresh_s, migrated_s = lanes["fresh"].new_slots, lanes["migrated"].new_slots
            seen["fresh"] = _new_elements_equal(final, kept_final, pr.kept) and sorted(fresh_s) == sorted(migrated_s) \
                and all(_new_elements_equal(fresh_s[k], migrated_s[k], pr.kept) for k in fresh_s)
            lanes["fresh"].new_slots, lanes["migrated"].new_slots = {}, {}
        del final
        if tick:
            tick(len(run))
    max_diff, ratio, identical, first = seen["migrated"]
    tracks = identical if exact or pr.reset else ratio <= 1.0
    if lossy:  # the same arithmetic from a state that is not the original's bits (a lossy conversion):
        # parameters and state within tolerance; a swapped moment is still far outside it. Moments
        # re-quantized to 8 bits differ by up to a quantization step: those are judged by the parameters
        same_slots = lanes["original"].last_digest == lanes["migrated"].last_digest
        requantized = any(getattr(enc, "bits", None) == 8 for side in (pr.original, pr.migrated) if side is not None
                          for enc in side.encoding.values())
        tracks = ratio <= 1.0 and (same_slots or requantized or _slots_close(lanes["original"].last_slots,
                                                                               lanes["migrated"].last_slots))
    elif slots_checked:  # the same arithmetic: the state after the steps must be the same bits too
        same_slots = lanes["original"].last_digest == lanes["migrated"].last_digest
        tracks = tracks and same_slots
    for name in ("original", "migrated"):
        lanes[name].last_slots = {}
    cold_diff = seen["cold"][0]
    low_precision = low_precision_update and not identical and not pr.reset
    if (quantized or low_precision) and not identical and not pr.reset:
        # moments re-quantized to 8 bits, or an update rounded to bfloat16: near the original, far from cold
        tracks = max_diff <= QUANTIZED_SHARE * cold_diff
    row = {"path": pr.path, "transposed": pr.transpose, "has_state": bool(pr.migrated and pr.migrated.slots),
           "tracks": tracks, "bit_exact": identical, "max_abs_diff": max_diff, "tolerance_ratio": ratio,
           "cold_ratio": seen["cold"][1]}
    if slots_checked:
        row["state_bit_exact"] = same_slots
    if lossy:
        row["lossy_start"] = True
    if quantized or low_precision:
        row["share_of_cold"] = max_diff / cold_diff if cold_diff else 0.0
    if pr.migrated is not None and pr.migrated.path and pr.migrated.path != pr.path:
        row["migrated_path"] = pr.migrated.path
    if pr.origin is not None:  # a tensor read from pieces of others (Megatron → Hugging Face): which
        row["from"] = pr.origin.describe()
    if first is not None and not tracks:
        row["first_difference"] = {"element": first[0], "original": first[1], "migrated": first[2]}
        if pr.origin is not None:
            row["first_difference"]["from"] = pr.origin.describe(tuple(first[0]))
    if pr.reset:
        row["reset"] = True
    if pr.kept:
        row.update(kept=list(pr.kept), new_elements_fresh=seen["fresh"], tracks=tracks and seen["fresh"])
    return row


def _refuse_foreign(st: OptimizerState | None, path: str | None) -> None:
    """replay runs torch's, burn's and candle's own arithmetic: a third-party optimizer's state (torchao
    re-quantizing its moments, transformers Adafactor, …) is not replayed as if it were theirs."""
    from statekit.frameworks import torch_thirdparty

    if torch_thirdparty.is_foreign(st):
        raise MappingError(f"{st.family_label} state: replay runs torch's, burn's and candle's own arithmetic, not "
                           "this optimizer's; convert it first where an optimizer continues it (statekit convert)",
                           path)


def _as_continued(original: Checkpoint, migrated: Checkpoint, optimizer: str | None):
    """A side from an optimizer outside torch.optim (torchao, transformers Adafactor, …) as the
    state of the optimizer that continues it (:func:`statekit.frameworks.torch_thirdparty.adapt`):
    the arithmetic both sides are replayed in. Refused where none continues it."""
    from dataclasses import replace

    from statekit.frameworks import torch_thirdparty

    notes: list[str] = []
    sides = [original, migrated]
    flavors: list[str | None] = [None, None]
    for i, ckpt in enumerate(sides):
        if torch_thirdparty.is_foreign(ckpt.optimizer):
            flavors[i] = torch_thirdparty.KNOWN[ckpt.optimizer.family].flavor
            other = sides[1 - i].optimizer
            target = other.framework if other is not None and not torch_thirdparty.is_foreign(other) else "torch"
            want = optimizer or (other.family if other is not None and other.family in ("adam", "adamw") else None)
            state, said = torch_thirdparty.adapt(ckpt.optimizer, target, optimizer=want, path=ckpt.path)
            if target == "burn" and state.family == "adafactor" and flavors[i] is None:
                flavors[i] = "burn"  # transformers' Adafactor steps as burn's (ε₁ in g², both switches), not torch's
            sides[i] = replace(ckpt, optimizer=state)
            notes += [f"{ckpt.path}: {n}" for n in said]
    return sides[0], sides[1], notes, flavors


def _lanes(algorithm: str, flavors: tuple[str, str], hps_a: list[dict], hps_b: list[dict], pairs,
           kernel: str, sources: tuple[str | None, str | None] = (None, None)) -> dict[str, Lane]:
    """verify-resume's lanes; each side's parameter steps with its own group's hyperparameters."""
    lanes = {name: Lane(algorithm, flavors[name != "original"], (hps_b if name != "original" else hps_a)[0], {},
                        kernel=kernel, source=sources[name != "original"])
             for name in ("original", "migrated", "cold", "fresh")}
    for pr in pairs:  # under the pair's path
        lanes["original"].hp_of[pr.path] = hps_a[min(pr.original.group, len(hps_a) - 1)]
        if pr.migrated is not None:
            for name in ("migrated", "cold", "fresh"):
                lanes[name].hp_of[pr.path] = hps_b[min(pr.migrated.group, len(hps_b) - 1)]
    return lanes


def _sides(original: Checkpoint, migrated: Checkpoint, optimizer: str | None, plan: Plan | None, flavors: tuple):
    """Both sides as verify-resume steps them: an optimizer outside torch.optim as the one that continues it
    (:func:`_as_continued`), a Megatron original without its masters and paired by convert's map
    (:mod:`statekit.ops.megatron_verify`); returns them, the notes, each side's flavor and the Megatron pairing."""
    original, migrated, adapted, (flavor_a, flavor_b) = _as_continued(original, migrated, optimizer)
    mc = megatron_verify.prepare(original, migrated, flavors)
    if mc is not None:  # a Megatron original: its masters are the parameters, its tensors paired by convert's map
        if plan is not None:
            raise UsageError("--plan pairs a remap's output; a Megatron checkpoint is paired by its own map")
        original, migrated = mc.original, mc.migrated
        flavor_a, flavor_b = flavor_a or mc.flavors[0], flavor_b or mc.flavors[1]
        adapted += mc.notes
    for side in (original, migrated):
        if side.optimizer is None:
            raise UsageError(f"{side.path}: holds no optimizer state")
        refuse_unusable(side.optimizer, side.path, "verify a resume")
    return original, migrated, adapted, (flavor_a, flavor_b), mc


def verify_resume(original: Checkpoint, migrated: Checkpoint, *, steps: int = 10, seed: int = 0,
                  optimizer: str | None = None, given: dict | None = None, flavor_original: str | None = None,
                  flavor_migrated: str | None = None, transpose: list[str] | None = None, progress=None,
                  kernel: str = "auto", plan: Plan | None = None) -> dict:
    """Run ``steps`` seeded steps from the original state, the migrated one and a cold start, and
    compare; returns a JSON-able report. Pairs come from ``plan``, the migrated file's record of
    its sources, or equal paths (:mod:`statekit.ops.pairing`). A resized state is compared on
    the region both hold; its new elements must step like a fresh state (hyper.fresh_value) at the migrated step."""
    original, migrated, adapted, (flavor_a, flavor_b), mc = _sides(original, migrated, optimizer, plan,
                                                                   (flavor_original, flavor_migrated))
    a_state, b_state = original.optimizer, migrated.optimizer
    if "mixed" in (a_state.family, b_state.family):
        return _verify_mixed(original, migrated, a_state, b_state, steps=steps, seed=seed, optimizer=optimizer,
                             given=given or {}, flavors=(flavor_original, flavor_migrated), transpose=transpose,
                             progress=progress, kernel=kernel, plan=plan, adapted=adapted)
    adapted += [] if optimizer else settle_from(a_state, b_state, migrated.path)
    algorithm = pick_algorithm(b_state, a_state, given=optimizer, paths=(migrated.path, original.path))
    chosen = (flavor_original or flavor_a, flavor_migrated or flavor_b)
    flav_a, flav_b, known = _flavors(a_state, b_state, algorithm, chosen, bool(flavor_original or flavor_migrated), adapted)
    for flav, side, flag in ((flav_a, original, "--flavor-original"), (flav_b, migrated, "--flavor-migrated")):
        if known and flav not in known:  # e.g. a torch file's Lion (bitsandbytes, lion-pytorch): burn's arithmetic only
            raise UsageError(f"{side.path}: statekit has no {flav} arithmetic for {algorithm} (it has "
                             f"{', '.join(known)}); say which to run with {flag} {known[0]}")
    refuse_unmodelled_flags(a_state, algorithm, flav_a, original.path)
    refuse_unmodelled_flags(b_state, algorithm, flav_b, migrated.path)
    given = given or {}
    stored_a, stored_b = state_hp(a_state), state_hp(b_state)
    # burn files keep no learning rate: a side without one runs at the other's (or 1e-3)
    fallback_lr = given.get("lr") or stored_b.get("lr") or stored_a.get("lr") or 1e-3
    hps_a = group_hps(a_state, algorithm, flav_a, given, fallback_lr)
    hps_b = group_hps(b_state, algorithm, flav_b, given, fallback_lr)
    hp_a, hp_b = hps_a[0], hps_b[0]
    pairs, pair_notes = (mc.pairs, []) if mc is not None else pair(original, migrated, transpose or [], plan)
    lanes = _lanes(algorithm, (flav_a, flav_b), hps_a, hps_b, pairs, kernel, (original.path, migrated.path))
    exact = registry.same_arithmetic(flav_a, flav_b) and registry.exactness(flav_a, algorithm=algorithm) == \
        registry.BIT_EXACT
    if algorithm == "adafactor" and any(pr.transpose for pr in pairs):
        exact = False  # a transposed weight swaps the factors: the same update, rounded in another order
    quantized = _quantized(a_state, b_state)
    low_precision = algorithm in LOW_PRECISION_UPDATE and flav_a != flav_b
    lrs = sorted({float(h.get("lr", 1e-3)) for h in hps_a})
    lr_text = f"lr={lrs[0]:g}" if len(lrs) == 1 else "lr of each parameter's group"
    rows, ok = [], True
    # One parameter at a time, one lane after the other; each step's gradient is generated when
    # it is used (the same numbers for every lane: one seeded stream per parameter and step).
    # Peak memory: one lane's parameter and slots, one gradient, the original's final parameter
    # and (for a resized or restarted state) the migrated one's, whatever the number of steps and
    # parameters.
    for index, pr in enumerate(pairs):
        lr = float(lanes["original"].hp_of.get(pr.path, hp_a).get("lr", 1e-3))  # the tolerance: its group's lr
        row = _verify_param(pr, index, lanes, seed, steps, lr, exact, quantized=quantized,
                            low_precision_update=low_precision, tick=
                            (lambda n: progress(steps / (n * len(pairs)))) if progress else None)
        ok &= row["tracks"]
        rows.append(row)
    notes = list(pair_notes) + adapted
    squares = [pr.path for pr in pairs if len(pr.original.shape or ()) == 2 and pr.original.shape[0] == pr.original.shape[1]
               and not pr.transpose and a_state.framework != b_state.framework and pr.via == "path"]
    if squares:
        notes.append(f"square weights paired untransposed: {', '.join(squares)} (--transpose GLOB if the conversion "
                     "transposed them)")
    return {"original": original.path, "migrated": migrated.path, "optimizer": algorithm, "notes": notes,
            "flavors": {"original": flav_a, "migrated": flav_b},
            "kernels": {"original": lanes["original"].chosen, "migrated": lanes["migrated"].chosen},
            "criterion": ("bit-exact" if exact else f"|Δp| ≤ 4·ulp(p) + 2e-5·lr·n ({lr_text}, n={steps})")
            + (f"; where 8-bit moments were re-quantized: max |Δp| ≤ {QUANTIZED_SHARE:g} × a cold start's"
               if quantized else "")
            + (f"; {LOW_PRECISION_UPDATE[algorithm]}: max |Δp| ≤ {QUANTIZED_SHARE:g} × a cold start's"
               if low_precision else "")
            + ("; where the migrated state does not start from the original's bits (a lossy conversion): "
               "|Δp| ≤ 4·ulp(p) + 2e-5·lr·n and each state tensor within 1e-5·max|s| + 4·ulp(s)"
               if any(r.get("lossy_start") for r in rows) else ""),
            "hyperparams": {"original": hp_a, "migrated": hp_b}, "steps": steps, "seed": seed,
            "tracks": ok, "params": rows,
            **({"group_hyperparams": {"original": hps_a, "migrated": hps_b}}
               if _differing(hps_a) or _differing(hps_b) else {})}


def _families(state: OptimizerState, optimizer: str | None, path: str) -> dict[str, str]:
    """Each parameter's family (by path) in a record holding several (burn's optimizer groups),
    ``--optimizer`` settling the parts whose state fits several families."""
    if state.family == "mixed" and optimizer and state.ambiguous:
        state.resolved(optimizer)
    left = sorted({p.family_label for p in state.params if len(p.candidates) > 1})
    if left:
        raise UsageError(f"{path}: say which optimizer each part is with --optimizer (the state holds "
                         f"{state.family_label}; still open: {', '.join(left)}), e.g. --optimizer muon,adamw")
    unknown = [p.label() for p in state.params if p.family is None]
    if unknown:
        raise UsageError(f"{path}: parameters of an unrecognised layout: {', '.join(unknown[:3])}")
    return {p.path or p.key: p.family or state.family for p in state.params}


def _verify_mixed(original, migrated, a_state, b_state, *, steps, seed, optimizer, given, flavors, transpose,
                  progress, kernel, plan, adapted) -> dict:
    """verify-resume of records whose parameters hold different optimizers (a Muon run's Muon and
    AdamW groups): each pair steps in its own family's arithmetic, the same on both sides."""
    fam_a = _families(a_state, optimizer, original.path)
    fam_b = _families(b_state, optimizer, migrated.path) if b_state.family == "mixed" else None
    pairs, pair_notes = pair(original, migrated, transpose or [], plan)
    lr = float(given.get("lr") or 1e-3)
    sets: dict[str, dict] = {}
    hps: dict[str, dict] = {}
    rows, ok, exact_all = [], True, True
    for index, pr in enumerate(pairs):
        family = fam_a.get(pr.path)
        other = fam_b.get(pr.migrated.path or pr.path) if fam_b is not None and pr.migrated is not None else (
            b_state.family if fam_b is None else family)
        if family is None or other != family:
            raise UsageError(f"{pr.path}: {family or 'no state'} in {original.path}, {other} in {migrated.path}")
        if family not in sets:
            flav_a = flavors[0] or default_flavor(a_state, family)
            flav_b = flavors[1] or default_flavor(b_state, family)
            hp_a = registry_hp(family, flav_a, {"lr": lr}, given)
            hp_b = registry_hp(family, flav_b, {"lr": lr}, given)
            hps[family] = {"original": hp_a, "migrated": hp_b, "flavors": {"original": flav_a, "migrated": flav_b}}
            sets[family] = {"original": Lane(family, flav_a, hp_a, {}, kernel=kernel, source=original.path),
                            "migrated": Lane(family, flav_b, hp_b, {}, kernel=kernel, source=migrated.path),
                            "cold": Lane(family, flav_b, hp_b, {}, kernel=kernel, source=migrated.path),
                            "fresh": Lane(family, flav_b, hp_b, {}, kernel=kernel, source=migrated.path)}
        flav = hps[family]["flavors"]
        exact = flav["original"] == flav["migrated"] and registry.exactness(
            flav["original"], algorithm=family) == registry.BIT_EXACT
        exact_all &= exact
        row = _verify_param(pr, index, sets[family], seed, steps, lr, exact,
                            (lambda n: progress(steps / (n * len(pairs)))) if progress else None)
        row["optimizer"] = family
        ok &= row["tracks"]
        rows.append(row)
    names = " + ".join(sets)
    return {"original": original.path, "migrated": migrated.path, "optimizer": names,
            "notes": list(pair_notes) + adapted + [f"one optimizer per parameter group: {names}"],
            "flavors": {side: "/".join(dict.fromkeys(h["flavors"][side] for h in hps.values()))
                        for side in ("original", "migrated")},
            "kernels": {side: "/".join(dict.fromkeys(s[side].chosen for s in sets.values()))
                        for side in ("original", "migrated")},
            "criterion": "bit-exact" if exact_all else f"|Δp| ≤ 4·ulp(p) + 2e-5·lr·n (lr={lr:g}, n={steps})",
            "hyperparams": {"original": {f: h["original"] for f, h in hps.items()},
                            "migrated": {f: h["migrated"] for f, h in hps.items()}},
            "steps": steps, "seed": seed, "tracks": ok, "params": rows}


def verify_resume_files(original: str, migrated: str, *, names: list[str] | None = None, model=None,
                        plan: str | None = None, key: str | None = None, model_config: str | None = None,
                        trust_remote_code: bool = False, **options) -> dict:
    """``statekit verify-resume``: open both sides (files or checkpoint folders), name unnamed torch
    positions from ``names`` / ``model`` (a :class:`~statekit.state.ModelInfo`), load a remap
    ``plan`` (a saved plan's path), and :func:`verify_resume` them."""
    from statekit import io
    from statekit.ops.convert import name_checkpoint, open_options
    from statekit.ops.options import Options

    loaded = Plan.load(plan) if plan else None
    opts = Options(names=names, model=model, model_config=model_config, trust_remote_code=trust_remote_code)
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(io.open_checkpoint(original, **open_options(opts)))
        b = stack.enter_context(io.open_checkpoint(migrated, **open_options(opts, key)))
        for ckpt in (a, b):
            if ckpt.optimizer is not None and (names is not None or model is not None or model_config) \
                    and not all(p.path for p in ckpt.optimizer.params):
                name_checkpoint(ckpt, opts, ckpt.path)
        report = verify_resume(a, b, plan=loaded, **options)
        _schedules(report, a, b)
        return report


def _schedules(report: dict, a, b) -> None:
    """Both sides' LR schedules over the report's steps: lrs that differ make it diverge (the
    optimizer state alone does not resume a run whose schedule moved); one side without is a note."""
    from statekit.ops.schedule_carry import compare_lrs

    found = compare_lrs(a, b, report["steps"])
    if found is None:
        return
    report["schedule"] = found
    if "why" in found:
        report["notes"].append(f"learning rates not compared: {found['why']}")
    elif not found["same"]:
        d = found["first_difference"]
        report["tracks"] = False
        report["notes"].append(f"the LR schedules differ at update {d['update']}: lr {d['original']!r} vs "
                               f"{d['migrated']!r}")
    else:
        report["notes"].append(f"the LR schedules agree over the next {report['steps']} updates"
                               + (" (bit for bit)" if found["exact"] else " (to 1e-12: burn's arithmetic)"))

