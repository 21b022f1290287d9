"""Hugging Face / torch optimizer state → a Megatron torch_dist checkpoint (``convert --to megatron
--megatron-args FROM_DIR``).

The run's layout comes from ``FROM_DIR``, an existing Megatron torch_dist checkpoint of the same
architecture: its ``args`` (heads, query groups, kv_channels, vocabulary, parallel sizes), its
tensor keys and shapes, its layers' ``_extra_state`` objects and its param groups. The values come
from the HF side: the moments from the torch optimizer state (positions named by ``--model``, as
for any torch source), the fp32 masters from the HF model's weights (``--model``; they must be
fp32, else no master exists to write), the Megatron weights the masters rounded to the run's dtype.

Names move by the inverse of :mod:`.megatron_hf`'s structural map (the map Megatron → HF names
uses): each Megatron tensor is assembled from the HF pieces the map cuts it into (q/k/v rows back
into each query group of ``linear_qkv``, gate/up into ``linear_fc1``, norms renamed); every element
must be written exactly once, but the vocabulary padding rows, which stay zero. The step is the HF
parameters' one step (refused when they differ): the groups' ``step``, the ``iteration``, and the
scheduler's and args' sample counts (``step × global_batch_size``); the RNG and rerun state of
``FROM_DIR`` are not carried (not this run's).
"""

from __future__ import annotations

import numpy as np

from statekit import dtypes, io
from statekit.errors import MappingError, UsageError
from statekit.formats.torch_pickle import Record
from statekit.frameworks.megatron import dist as dist_reader
from statekit.frameworks.megatron import stacking, write_dist
from statekit.tensor import TensorRef

HF_SLOTS = (("param", None), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


def write(src: str, dst: str, megatron_args: str, model_path: str | None, target: write_dist.Target, name_state,
          shards: int | None = None) -> write_dist.Written:
    """``model_path``: the HF model file (its fp32 weights: the masters); ``name_state(state)`` names
    the torch state's positions (the convert machinery, :func:`.convert.name_source_params`)."""
    from statekit.ops import megatron_hf  # noqa: PLC0415 (same floor)

    if model_path is None:
        raise UsageError("--megatron-args needs --model: the HF model's fp32 weights are the Megatron masters")
    ckpt_m = dist_reader.open_checkpoint(megatron_args)
    try:
        source = write_dist._from_dist(ckpt_m)
        names = _names(source)
        smap = megatron_hf.build(ckpt_m.metadata, {n: s for n, (_k, _l, s) in names.items()}, megatron_args)
        with io.open_checkpoint(src) as hf, io.open_checkpoint(model_path) as weights:
            if hf.optimizer is None:
                raise MappingError("holds no optimizer state", src)
            if weights.model is None:
                raise MappingError("holds no model weights (the masters)", model_path)
            name_state(hf.optimizer)
            return _write(source, hf.optimizer, weights.model, names, smap, dst, target, shards, src)
    finally:
        ckpt_m.container.close()


def _names(source) -> dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]:
    args = source.cfg.raw
    grouped = args.get("moe_grouped_gemm")
    out = {}
    for key, entry in source.model.items():
        name_key, _ = dist_reader._strip(key)
        for lead in stacking.indices(name_key, entry.shape):
            name = stacking.param_name(name_key, lead, None if grouped is None else bool(grouped),
                                       args.get("transformer_impl"))
            out[name] = (key, lead, tuple(entry.shape[len(lead):]))
    return out


def _write(source, state, model, names, smap, dst, target, shards, src) -> write_dist.Written:
    where = src
    by_path = {p.path: p for p in state.params if p.path}
    if len(by_path) != len(state.params):
        raise MappingError("some positions of the optimizer state have no name (give --model)", where)
    weights = {p.path: p for p in model.params if getattr(p, "tensor", None) is not None}
    pieces: dict[str, list] = {n: [] for n in names}
    for t in smap.targets.values():
        if t.path not in by_path:
            raise MappingError(f"{t.path}: the Megatron layout has it, the HF optimizer state does not", where)
        if t.path not in weights:
            raise MappingError(f"{t.path}: not in the --model weights (the masters)", where)
        for pc in t.pieces:
            pieces[pc.source].append((t.path, pc))
    unused = sorted(set(by_path) - set(smap.targets))
    if unused:
        raise MappingError(f"{unused[0]}: an HF parameter the Megatron layout has no place for", where)
    steps = {p.step for p in state.params}
    if len(steps) != 1 or not isinstance(next(iter(steps)), int | float):
        raise MappingError(f"the HF parameters hold different steps {sorted(map(str, steps))[:4]}: Megatron keeps "
                           "one per group", where)
    step = next(iter(steps))
    vocab = source.cfg.need("vocab_size", "the vocabulary padding rows")
    stacked_w: dict[str, list] = {}
    stacked_s: dict[str, dict[str, list]] = {}
    for name, (key, _lead, shape) in names.items():
        entry = source.model[key]
        pad_rows = shape[0] - vocab if dist_reader._strip(key)[0] in write_dist.VOCAB_KEYS else 0
        parts = {slot: _assembled(name, shape, pieces[name], by_path, weights, hf_slot, pad_rows)
                 for slot, hf_slot in HF_SLOTS}
        stacked_s.setdefault(key, {s: [] for s, _ in HF_SLOTS})
        for slot, ref in parts.items():
            stacked_s[key][slot].append(ref)
        stacked_w.setdefault(key, []).append(_rounded(parts["param"], entry.dtype))
    for key, entry in source.model.items():
        lead_shape = tuple(entry.shape[:len(stacking.stack_axes(dist_reader._strip(key)[0]))])
        source.weights[key] = write_dist._stacked(stacked_w[key], lead_shape, key)
        source.states[key] = {s: write_dist._stacked(refs, lead_shape, key) for s, refs in stacked_s[key].items()}
    gbs = source.cfg.need("global_batch_size", "the scheduler's sample count")
    common = source.common
    common["iteration"] = int(step)
    scheduler = common.get("opt_param_scheduler")
    if isinstance(scheduler, dict):
        common["opt_param_scheduler"] = {**scheduler, "num_steps": int(step) * gbs}
    common.pop("rerun_state_machine", None)
    common["num_floating_point_operations_so_far"] = 0.0
    args = common["args"]
    common["args"] = Record(args.cls, {**args.fields, "consumed_train_samples": int(step) * gbs, "iteration": int(step)})
    for g in source.groups:
        g["step"] = float(step)
    source.objects = {k: v for k, v in source.objects.items() if "._extra_state/" in k}
    source.rng_kept = False
    source.sharding = "HF / torch AdamW state"
    source.folder = f"iter_{int(step):07d}"
    source.where = where
    source.notes[:0] = [f"layout and args from the Megatron checkpoint given by --megatron-args; moments from {src}, "
                        "masters from the --model weights; step "
                        f"{step}: iteration {int(step)}, {int(step) * gbs} samples (global batch {gbs})"]
    return write_dist._write(source, dst, target, shards)


def _assembled(name, shape, parts, by_path, weights, hf_slot, pad_rows) -> TensorRef:
    """One Megatron parameter's slot (``hf_slot`` None: the master, from the HF weight), built when read."""

    def build() -> np.ndarray:
        out = np.zeros(int(np.prod(shape)), dtype=np.float32)
        covered = np.zeros(out.size, dtype=np.int8)
        for path, pc in parts:
            ref = weights[path].tensor if hf_slot is None else by_path[path].slots.get(hf_slot)
            if ref is None:
                raise MappingError(f"{path}: no {hf_slot} state")
            if ref.dtype != "F32":
                raise MappingError(f"{path}: its {'weight' if hf_slot is None else hf_slot} is {ref.dtype}; the Megatron "
                                   "master and moments are F32 (an fp32 model file is needed for the masters)")
            flat = np.ascontiguousarray(ref.numpy(), dtype=np.float32).reshape(-1)
            src = np.lib.stride_tricks.as_strided(out[pc.src_offset:], pc.shape, tuple(s * 4 for s in pc.src_strides))
            cov = np.lib.stride_tricks.as_strided(covered[pc.src_offset:], pc.shape, pc.src_strides)
            dst = np.lib.stride_tricks.as_strided(flat[pc.dst_offset:], pc.shape, tuple(s * 4 for s in pc.dst_strides))
            src[...] = dst
            cov[...] += 1
        want = np.ones(out.size, dtype=np.int8)
        if pad_rows:
            want[-pad_rows * int(np.prod(shape[1:])):] = 0
        if not np.array_equal(covered, want):
            bad = int(np.nonzero(covered != want)[0][0])
            raise MappingError(f"{name}: element {bad} is written {int(covered[bad])} times by the HF pieces, not "
                               f"{int(want[bad])}")
        return out.reshape(shape)

    return TensorRef("F32", tuple(shape), array_loader=build)


def _rounded(master: TensorRef, dtype: str) -> TensorRef:
    """The master rounded to the model's dtype (numpy's casts round to nearest even, as torch's)."""
    if dtype == "F32":
        return master
    return TensorRef(dtype, master.shape, array_loader=lambda: master.numpy().astype(dtypes.numpy_dtype(dtype)))

