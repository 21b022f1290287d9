"""L-BFGS state burn ⇄ torch: one global state of flat vectors over every parameter.

burn's L-BFGS is a port of torch's (``shared/docs/optimizers-burn-torch.md`` §1.6, §3.3). Its state
is the same algorithm under other names, with two of torch's fields left out:

| burn | torch | |
|---|---|---|
| ``history_s.i`` | ``old_stps[i]`` | s (steps) |
| ``history_y.i`` | ``old_dirs[i]`` | y (gradient differences; torch's "dirs" hold y) |
| — | ``ro[i]`` | 1/(y·s): derived |
| — | ``H_diag`` | (y·s)/(y·y) of the newest pair (1 before any): derived |
| ``d``, ``t``, ``prev_flat_grad`` | the same | |
| ``g_iter`` | ``n_iter`` | |
| ``prev_loss`` | ``prev_loss`` | different moment (neither is read by the next step) |
| — | ``func_evals`` | a count torch only reports |

Every flat vector is the parameters' values one after the other, each in its framework's parameter
order **and layout**: a Linear weight is [out, in] in torch and [in, out] in burn, so its segment is
transposed, and the segments are re-joined in the target's order. torch → burn keeps torch's own
``ro``, ``H_diag``, ``func_evals`` and the segment list in ``statekit.lbfgs`` metadata (burn ignores
it; burn rewrites its file without it), so converting back is exact; a burn file without it gets
``ro`` and ``H_diag`` computed (float64 dot products rounded to float32).
"""

from __future__ import annotations

import json
import math

from statekit import hyper
from statekit.errors import MappingError, UsageError
from statekit.formats import registry
from statekit.lazy import numpy as np
from statekit.ops.options import Options
from statekit.ops.plan import ParamAction, Plan
from statekit.ops.rules import matches_any
from statekit.state import Checkpoint, OptimizerState, ParamGroup, ParamState
from statekit.tensor import FileSpan, TensorRef

META_KEY = "statekit.lbfgs"
# burn name ↔ torch name of the flat vectors and scalars that only change name
VECTORS = (("d", "d"), ("prev_flat_grad", "prev_flat_grad"))
LISTS = (("history_s", "old_stps"), ("history_y", "old_dirs"))


# ----------------------------------------------------------------------------- the global state, neutral


def history(state: OptimizerState) -> tuple[list[TensorRef], list[TensorRef]]:
    """(s vectors, y vectors), oldest first, from either framework's global state."""
    g, sc = state.global_slots, state.global_scalars
    if state.framework == "burn":
        return ([g[f"history_s.{i}"] for i in range(int(sc.get("history_s.len", 0)))],
                [g[f"history_y.{i}"] for i in range(int(sc.get("history_y.len", 0)))])
    return ([g[f"old_stps.{i}"] for i in range(int(sc.get("old_stps.len", 0)))],
            [g[f"old_dirs.{i}"] for i in range(int(sc.get("old_dirs.len", 0)))])


def vector_length(state: OptimizerState, path: str) -> int | None:
    lengths = {len(r.shape) == 1 and r.shape[0] for n, r in state.global_slots.items()
               if n not in ("H_diag", "t") and not n.startswith("ro.") and r.shape != ()}
    if False in lengths or len(lengths) > 1:
        raise MappingError(f"L-BFGS flat vectors of different lengths or ranks ({sorted(map(str, lengths))})", path)
    return lengths.pop() if lengths else None


# ----------------------------------------------------------------------------- segments


def segment(ref: TensorRef, lo: int, n: int, shape: tuple) -> TensorRef:
    """Elements ``lo`` … ``lo + n`` of a flat vector as a tensor of ``shape``: a span of the file when
    the vector is one (read with pread), a slice of values already in memory, else gathered from
    the vector's pieces."""
    if ref.span is not None and ref.array_loader is None:
        item = ref.nbytes // ref.numel
        return TensorRef(dtype=ref.dtype, shape=tuple(shape),
                         span=FileSpan(ref.span.file, ref.span.offset + lo * item, n * item))
    if ref.array_loader is not None:
        return TensorRef(dtype=ref.dtype, shape=tuple(shape),
                         array_loader=lambda: np.ascontiguousarray(ref.numpy().reshape(-1)[lo:lo + n]).reshape(shape))

    def values():
        parts, at = [], 0
        for piece in ref.pieces():
            a, b = max(lo, at), min(lo + n, at + piece.size)
            if a < b:
                parts.append(piece[a - at:b - at])
            at += piece.size
            if at >= lo + n:
                break
        return np.concatenate(parts).reshape(shape) if parts else np.empty(shape, dtype=piece.dtype)

    return TensorRef(dtype=ref.dtype, shape=tuple(shape), array_loader=values)


def rejoined(ref: TensorRef, segments: list[dict]) -> TensorRef:
    """The flat vector in the target's order and layout: each segment cut from ``ref``, transposed
    where it says, joined; one parameter's segment in memory at a time."""
    from statekit import stream

    total = sum(s["numel"] for s in segments)

    def source(elements: int):
        for s in segments:
            part = segment(ref, s["src_offset"], s["numel"], tuple(s["src_shape"]))
            if s["transpose"]:
                part = stream.transpose(part)
            yield from part.pieces(elements)

    return stream.derived(ref.dtype, (total,), source, resident=max((s["numel"] for s in segments), default=0) * 4)


def _dot(a: TensorRef, b: TensorRef) -> float:
    """a·b in float64 over aligned pieces (bounded memory)."""
    total = 0.0
    for x, y in zip(a.pieces(), b.pieces(), strict=True):
        total += float(np.dot(x.astype(np.float64), y.astype(np.float64)))
    return total


def _f32(value: float) -> float:
    return float(np.float32(value))


# ----------------------------------------------------------------------------- planning


def _torch_shapes(ckpt: Checkpoint, opts: Options) -> dict[str, tuple]:
    shapes: dict[str, tuple] = {}
    for model in (ckpt.model, opts.model if opts.model is not None and opts.model.order == "named_parameters"
                  else None):
        if model is not None:
            shapes.update({m.path: tuple(m.shape) for m in model.params if not m.buffer})
    if opts.names is not None and hasattr(opts.names, "entries"):
        shapes.update({e.name: tuple(e.shape) for e in opts.names.entries if e.shape is not None})
    return shapes


def _torch_order(opts: Options) -> list[str] | None:
    if opts.names is not None:
        return [e.name for e in opts.names.entries] if hasattr(opts.names, "entries") else list(opts.names)
    if opts.model is not None and opts.model.order == "named_parameters":
        return [m.path for m in opts.model.params if not m.buffer]
    return None


def _decide(path: str, shape: tuple, want: tuple | None, opts: Options) -> bool | None:
    """Whether the segment of ``path`` is transposed between the two layouts (None: undecided)."""
    if len(shape) != 2:
        return False
    if matches_any(path, opts.transpose):
        return True
    if matches_any(path, opts.no_transpose):
        return False
    if want is not None and shape[0] != shape[1]:
        if tuple(want) == shape[::-1]:
            return True
        if tuple(want) == shape:
            return False
    return None


def build(ckpt: Checkpoint, src: str, dst: str, fmt: str, opts: Options) -> Plan:
    """The plan for an L-BFGS state: every segment's place in both vectors, the renames and the
    derived fields, or a MappingError naming what is missing."""
    state = ckpt.optimizer
    src_fw, dst_fw = state.framework, registry.framework_of(fmt)
    if {src_fw, dst_fw} - {"burn", "torch"}:
        raise UsageError(f"L-BFGS state moves between burn and torch; {dst} is {fmt}")
    n = vector_length(state, src)
    meta = _stored(ckpt)
    plan = Plan("convert", src, ckpt.format, dst, fmt, "lbfgs")
    torch_shapes = _torch_shapes(ckpt, opts) if src_fw == "torch" or dst_fw == "torch" else {}
    src_segments = _source_segments(state, src, dst_fw, meta, torch_shapes, opts, plan)
    missing = [path for path, shape in src_segments if shape is None]
    if missing:
        raise MappingError(f"L-BFGS: no shape for {', '.join(missing[:4])}; give --names FILE with shapes "
                           "(fc.weight [16, 4] per line) or --model", src)
    order, want = _target_order(state, src, dst_fw, meta, torch_shapes, opts, src_segments, plan)
    by_path = dict(src_segments)
    offsets, lo = {}, 0
    for path, shape in src_segments:
        offsets[path] = lo
        lo += math.prod(shape)
    if n is not None and lo != n:
        raise MappingError(f"L-BFGS vectors hold {n} values, the parameters {lo} "
                           f"({', '.join(f'{p} {list(s)}' for p, s in src_segments[:4])}…)", src)
    absent = [p for p in order if p not in by_path]
    extra = [p for p in by_path if p not in order]
    if absent or extra:
        raise MappingError("L-BFGS: the two parameter lists differ (" + "; ".join(
            x for x in (absent and f"not in the source: {', '.join(absent[:4])}",
                        extra and f"not in the target: {', '.join(extra[:4])}") if x) + ")", src)
    recorded = set(meta.get("transposed", ())) if dst_fw == "torch" and "transposed" in meta else None
    segments, undecided, at = [], [], 0
    for i, path in enumerate(order):
        shape = tuple(by_path[path])
        decided = _decide(path, shape, want.get(path), opts) if src_fw != dst_fw else False
        if decided is None and recorded is not None and len(shape) == 2:  # back as the record says it came
            decided = path in recorded
        if decided is None:
            undecided.append(f"{path} {list(shape)}")
            continue
        out_shape = shape[::-1] if decided else shape
        if want.get(path) is not None and tuple(want[path]) != out_shape:
            raise MappingError(f"L-BFGS: {path} is {list(shape)} in the source, {list(want[path])} in the target", src)
        numel = math.prod(shape)
        segments.append({"path": path, "src_offset": offsets[path], "numel": numel, "src_shape": list(shape),
                         "transpose": decided})
        plan.params.append(ParamAction(
            action="keep", src_key=path, src_path=path, src_shape=list(shape), dst_path=path, dst_index=i,
            dst_shape=list(out_shape), transpose=decided,
            notes=[f"flat [{offsets[path]}:{offsets[path] + numel}] → [{at}:{at + numel}]"]))
        at += numel
    if undecided:
        raise MappingError(_UNDECIDED.format(", ".join(undecided)), src)
    plan.segments = segments
    _hyper_and_fields(plan, state, src_fw, dst_fw, opts, meta)
    if dst_fw == "torch" and meta.get("names_in_file") is False and opts.names is None and opts.model is None:
        plan.metadata[hyper.OMIT_NAMES_KEY] = "omit"  # the original kept no param_names, nor does its copy
    return plan


def _source_segments(state, src, dst_fw, meta, torch_shapes, opts, plan) -> list[tuple[str, tuple | None]]:
    """The source vector's segments in its order: [(path, shape in the source's layout)]."""
    src_fw = state.framework
    if src_fw == "torch":
        params = sorted(state.params, key=lambda p: p.index if p.index is not None else 0)
        unnamed = [f"#{p.key}" for p in params if not p.path]
        if unnamed:
            raise MappingError(f"L-BFGS: positions {', '.join(unnamed[:4])} have no name; give --names FILE (with "
                               "shapes) or a training checkpoint's model", src)
        src_segments = [(p.path, torch_shapes.get(p.path)) for p in params]
    elif meta.get("segments"):
        src_segments = [(path, tuple(shape)) for path, shape in meta["segments"]]
    else:
        order = _torch_order(opts) if dst_fw == "torch" else None
        if order is None:
            raise MappingError("a burn L-BFGS record keeps no parameter order or shapes: give the torch order with "
                               "--names FILE (with shapes) or --model MODEL.pt", src)
        src_segments, open_layout = [], []
        for path in order:
            shape = torch_shapes.get(path)
            decided = _decide(path, shape, None, opts) if shape else False
            if decided is None:
                open_layout.append(f"{path} {list(shape)}")
            src_segments.append((path, shape[::-1] if shape and decided else shape))
        if open_layout:
            raise MappingError(_UNDECIDED.format(", ".join(open_layout)), src)
        plan.warnings.append("burn's parameter order assumed to be the torch order given (burn's L-BFGS "
                             "concatenates in module visit order; the record does not say it), transposed where "
                             "--transpose says")
    return src_segments


def _target_order(state, src, dst_fw, meta, torch_shapes, opts, src_segments, plan):
    """The target's parameter order and the shapes it expects (None where unknown)."""
    src_fw = state.framework
    if dst_fw == "torch":
        order = _torch_order(opts) or ([p for p, _ in src_segments] if src_fw == "torch" else
                                       meta.get("torch_order"))
        if order is None:
            raise MappingError("PyTorch pairs L-BFGS's vectors with parameters by position: give --names FILE or "
                               "--model MODEL.pt", src)
        recorded = {path: tuple(shape) for path, shape in meta.get("torch_shapes", [])}
        want = {path: torch_shapes.get(path, recorded.get(path)) for path in order}
    else:
        if opts.model is not None and opts.model.order == "burn":
            order = [m.path for m in opts.model.params if not m.buffer]
            want = {m.path: tuple(m.shape) for m in opts.model.params}
        else:
            order = [p for p, _ in src_segments]
            want = {p: None for p in order}
            plan.warnings.append("burn's parameter order assumed to be torch's (no burn --model given): burn's "
                                 "L-BFGS concatenates in module visit order")
    return order, want


_UNDECIDED = ("cannot tell which rank-2 parameters are Linear weights (burn stores them [d_in, d_out], torch "
              "[out, in]): {}; give --transpose GLOB / --no-transpose GLOB, or --model with the target shapes")


def _stored(ckpt: Checkpoint) -> dict:
    try:
        data = json.loads((ckpt.metadata or {}).get(META_KEY, "{}"))
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def _hyper_and_fields(plan: Plan, state, src_fw, dst_fw, opts, meta) -> None:
    given = {k: v for k, v in opts.hyperparams.items() if v is not None}
    stored = state.groups[0].hyperparams if state.groups else {}
    if src_fw == "torch":
        values = {**stored, **given}
        plan.assumed = []
    else:
        values, plan.assumed = hyper.resolve("lbfgs", given, stored or None)
        if "max_eval" in plan.assumed and "max_iter" not in plan.assumed:
            values["max_eval"] = int(values["max_iter"]) * 5 // 4  # burn's init(): max_iter * 5 / 4
    if dst_fw == "torch":
        plan.hyperparams = [hyper.torch_group("lbfgs", values)]
    else:
        plan.hyperparams = [{k: v for k, v in values.items() if k not in plan.assumed}]
        plan.metadata = hyper.to_metadata("lbfgs", plan.hyperparams[0])
    renames = ["history_s.i ⇄ old_stps[i] (s), history_y.i ⇄ old_dirs[i] (y), g_iter ⇄ n_iter"]
    if dst_fw == "torch" and src_fw == "burn":
        exact = _torch_fields_kept(state, meta)
        if exact:
            renames.append("ro, H_diag and func_evals: torch's own, kept in the file's statekit.lbfgs metadata")
            plan.exactness = "exact back: the vectors re-split losslessly and torch's ro, H_diag and func_evals kept"
        else:
            renames.append("ro[i] = 1/(y_i·s_i) and H_diag = (y·s)/(y·y) of the newest pair (1 before any): "
                           "computed in float64, rounded to float32; func_evals (not kept by burn) = 0")
            plan.exactness = ("tracks: ro and H_diag are derived (torch's float32 dot products round differently), "
                              "and burn re-evaluates the closure on a step's last iteration, torch does not")
        renames.append("prev_loss carried as it is: burn keeps the loss after the last evaluation, torch the loss "
                       "at the start of the last iteration; neither is read by the next step")
    elif dst_fw == "burn" and src_fw == "torch":
        renames.append("ro, H_diag, func_evals (burn keeps none) kept in statekit.lbfgs metadata for the way back")
        plan.exactness = ("exact back to torch; burn continues it with the same algorithm (a port of torch's), "
                          "not bit for bit: burn's scalar control flow is float64")
    plan.transforms = [{"group": 0, "slot": "(global)", "op": "rename", "value": 0.0, "text": t} for t in renames]


def _torch_fields_kept(state: OptimizerState, meta: dict) -> bool:
    torch_meta = meta.get("torch") or {}
    s, _ = history(state)
    return bool(torch_meta) and torch_meta.get("n_iter") == state.global_scalars.get("g_iter") \
        and len(torch_meta.get("ro", [])) == len(s)


# ----------------------------------------------------------------------------- carrying it out


def target_state(plan: Plan, state: OptimizerState, meta: dict) -> OptimizerState:
    """The target's global state (tensors lazy: each vector re-joined piece by piece)."""
    segs = plan.segments
    dst_fw = registry.framework_of(plan.target_format)
    src_fw = state.framework

    def vec(ref):
        return ref if src_fw == dst_fw else rejoined(ref, segs)

    out = OptimizerState(family="lbfgs", candidates=("lbfgs",), framework=dst_fw,
                         groups=[ParamGroup(dict(plan.hyperparams[0]) if plan.hyperparams else {}, [])])
    if dst_fw == "burn":
        out.global_slots, out.global_scalars = _burn_fields(plan, state, vec)
    else:
        out.params = [ParamState(key=str(a.dst_index), index=a.dst_index, path=a.dst_path, family="lbfgs")
                      for a in plan.params]
        out.groups[0].keys = [p.key for p in out.params]
        out.global_slots, out.global_scalars = _torch_fields(state, meta, vec)
    return out


def _burn_fields(plan: Plan, state: OptimizerState, vec) -> tuple[dict, dict]:
    """burn's L-BFGS record fields; torch's own ro, H_diag, func_evals and the segments kept in metadata."""
    g, sc = state.global_slots, state.global_scalars
    src_fw, segs = state.framework, plan.segments
    s_list, y_list = history(state)
    slots: dict[str, TensorRef] = {}
    scalars: dict[str, object] = {}
    scalars["history_s.len"] = len(s_list)
    for i, ref in enumerate(s_list):
        slots[f"history_s.{i}"] = vec(ref)
    scalars["history_y.len"] = len(y_list)
    for i, ref in enumerate(y_list):
        slots[f"history_y.{i}"] = vec(ref)
    for burn_name, torch_name in VECTORS:
        if torch_name in g:
            slots[burn_name] = vec(g[torch_name])
    t = sc.get("t", g.get("t"))
    if t is not None:
        scalars["t"] = float(t.numpy().reshape(-1)[0]) if isinstance(t, TensorRef) else float(t)
    if "prev_loss" in sc:
        scalars["prev_loss"] = float(sc["prev_loss"])
    scalars["g_iter"] = int(sc.get("n_iter", sc.get("g_iter", 0)))
    if src_fw == "torch":
        ro = [float(g[f"ro.{i}"].numpy().reshape(-1)[0]) for i in range(int(sc.get("ro.len", 0)))]
        h = g.get("H_diag", sc.get("H_diag"))
        kept = {"n_iter": int(sc.get("n_iter", 0)), "func_evals": sc.get("func_evals", 0), "ro": ro,
                "H_diag": float(h.numpy().reshape(-1)[0]) if isinstance(h, TensorRef) else h,
                "H_diag_tensor": isinstance(h, TensorRef), "t_tensor": isinstance(g.get("t"), TensorRef)}
        plan.metadata[META_KEY] = json.dumps({
            "torch": kept, "segments": [[s["path"], s["src_shape"][::-1] if s["transpose"] else s["src_shape"]]
                                        for s in segs],
            "transposed": [s["path"] for s in segs if s["transpose"]],  # the way back undoes exactly these
            "names_in_file": state.torch_names_in_file is not False,
            "torch_order": [s["path"] for s in sorted(segs, key=lambda s: s["src_offset"])],
            "torch_shapes": [[s["path"], s["src_shape"]] for s in sorted(segs, key=lambda s: s["src_offset"])]},
            separators=(",", ":"))
    return slots, scalars


def _torch_fields(state: OptimizerState, meta: dict, vec) -> tuple[dict, dict]:
    """torch LBFGS's state (filed under the first parameter): renamed, re-joined, ro and H_diag
    kept (torch's own, from metadata) or derived."""
    g, sc = state.global_slots, state.global_scalars
    src_fw = state.framework
    s_list, y_list = history(state)
    slots: dict[str, TensorRef] = {}
    scalars: dict[str, object] = {}
    kept = (meta.get("torch") or {}) if src_fw == "burn" and _torch_fields_kept(state, meta) else None
    scalars["func_evals"] = int(kept["func_evals"]) if kept else int(sc.get("func_evals", 0))
    scalars["n_iter"] = int(sc.get("g_iter", sc.get("n_iter", 0)))
    for burn_name, torch_name in VECTORS:
        name = burn_name if src_fw == "burn" else torch_name
        if name in g:
            slots[torch_name] = vec(g[name])
    t = sc.get("t", g.get("t"))
    if t is not None:
        value = float(t.numpy().reshape(-1)[0]) if isinstance(t, TensorRef) else t
        if (kept and kept.get("t_tensor")) or isinstance(t, TensorRef):
            slots["t"] = TensorRef.from_array(np.array(value, dtype=np.float32))
        else:
            scalars["t"] = float(value)
    ys = [vec(r) for r in y_list]
    ss = [vec(r) for r in s_list]
    for i, ref in enumerate(ys):
        slots[f"old_dirs.{i}"] = ref
    for i, ref in enumerate(ss):
        slots[f"old_stps.{i}"] = ref
    if kept:
        ro = [np.float32(r) for r in kept["ro"]]
        h = kept["H_diag"]
        h_tensor = kept.get("H_diag_tensor", True)
    elif src_fw == "torch":
        ro = [g[f"ro.{i}"] for i in range(int(sc.get("ro.len", 0)))]
        h = g.get("H_diag", sc.get("H_diag"))
        h_tensor = isinstance(h, TensorRef)
    else:
        ro = [_lazy_ro(y, s) for y, s in zip(y_list, s_list, strict=True)]
        h = _lazy_hdiag(y_list[-1], s_list[-1]) if y_list else 1
        h_tensor = bool(y_list)
    for i, r in enumerate(ro):
        slots[f"ro.{i}"] = r if isinstance(r, TensorRef) else TensorRef.from_array(np.array(r, dtype=np.float32))
    if h is not None:
        if isinstance(h, TensorRef):
            slots["H_diag"] = h
        elif h_tensor:
            slots["H_diag"] = TensorRef.from_array(np.array(h, dtype=np.float32))
        else:
            scalars["H_diag"] = h
    if "prev_loss" in sc:
        scalars["prev_loss"] = float(sc["prev_loss"])
    scalars["old_dirs.len"] = scalars["old_stps.len"] = scalars["ro.len"] = len(ys)
    return slots, scalars


def _lazy_ro(y: TensorRef, s: TensorRef) -> TensorRef:
    def value():
        return np.array(np.float32(1.0) / np.float32(_dot(y, s)), dtype=np.float32)
    return TensorRef(dtype="F32", shape=(), array_loader=value)


def _lazy_hdiag(y: TensorRef, s: TensorRef) -> TensorRef:
    def value():
        return np.array(np.float32(_dot(y, s)) / np.float32(_dot(y, y)), dtype=np.float32)
    return TensorRef(dtype="F32", shape=(), array_loader=value)


def saved_plan(plan_in: str, src: str, dst: str, fmt: str) -> Plan:
    plan = Plan.load(plan_in)
    if plan.target_format != fmt or not plan.segments:
        raise UsageError(f"the plan is not an L-BFGS plan writing {fmt}")
    plan.source, plan.target = src, dst
    return plan


def writer(plan: Plan, ckpt: Checkpoint, fmt: str, dst: str):
    """``write(advance, warnings)`` for :func:`statekit.ops.convert.carry_out_with`."""
    def write(advance, warnings):
        target = target_state(plan, ckpt.optimizer, _stored(ckpt))
        save = registry.writer(fmt)
        return save(target, dst, family="lbfgs", groups=plan.hyperparams, metadata=dict(plan.metadata),
                    progress=advance, on_warning=warnings.append)
    return write
