"""Megatron GPT → Hugging Face Llama/Qwen2 names: the structural map a ``convert`` of a Megatron checkpoint
to torch runs with (the same :class:`~statekit.structure.pieces.StructureMap` ``remap`` and ``--split`` use).

Built from the run's own settings (the checkpoint's ``megatron.*`` facts, read from ``args``), never from
per-model code (facts in ``/work/shared/docs/megatron-formats.md`` §4):

- ``linear_qkv`` ``[(nq + 2·ng)·d, h]`` is grouped per query group (``q…q k v`` per group, §4.1): q, k and v
  are each one strided piece over the groups; its bias the same without ``h``;
- ``linear_fc1`` of a SwiGLU MLP is ``[gate; up]`` along rows (§4.2);
- the norms (local spec or fused into the linears by the TE spec, §4.3) are renamed;
- the embedding and output rows beyond the true vocabulary (``--vocab-size``) are padding and stripped (§4.4);
  a tied output layer is the embedding (HF has one tensor, ``model.embed_tokens.weight``).

A mixture-of-experts layer (``mlp.router`` + ``mlp.experts``, SequentialMLP's ``local_experts.{e}`` or the
grouped GEMM's ``linear_fc1.weight{e}``) goes to transformers 5's stacked experts, which is what a
``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM`` of transformers 5.24 has as parameters (checked on its
``named_parameters()``): ``mlp.experts.gate_up_proj [E, 2·I, H]`` (expert e's ``[gate; up]`` rows, as Megatron's
SwiGLU ``linear_fc1``), ``mlp.experts.down_proj [E, H, I]`` (``linear_fc2``), the router's weight as
``mlp.gate.weight``. Shared experts and any expert parameter but these are refused, naming the parameter.

Anything else (a bias Llama has no field for, a LayerNorm model, a name of another layer kind) is refused in
one line: a wrong map is worse than none. Adam-family state is elementwise, so every slot follows the weight's
pieces.
"""

from __future__ import annotations

import re

from statekit.errors import MappingError
from statekit.structure.pieces import Piece, StructureMap, TargetMap

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_RENAMED = {  # Megatron (local or TE spec) → HF, inside a layer
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_TOP = {"decoder.final_layernorm.weight": "model.norm.weight"}


def _fact(meta: dict, key: str, where: str, why: str) -> int:
    value = meta.get(f"megatron.{key}")
    if value is None:
        raise MappingError(f"the checkpoint's args have no {key.replace('_', '-')}: needed for {why}", where)
    return int(value)


def _flag(meta: dict, key: str) -> bool | None:
    value = meta.get(f"megatron.{key}")
    return None if value is None else value == "True"


MODEL_TYPES = ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe")
MOE_TYPES = ("mixtral", "qwen3_moe")
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))")


def model_type(meta: dict, given: str | None, where: str) -> str:
    """The Hugging Face model type the map names for: ``given`` (``--hf-model-type``), else the one the run's
    args describe (MoE: mixtral, or qwen3_moe with QK norms; dense: qwen2 with a q/k/v bias, qwen3 with QK
    norms, else llama)."""
    moe = meta.get("megatron.num_experts") not in (None, "None", "0")
    qk_norm = meta.get("megatron.qk_layernorm") == "True"
    if given is not None:
        if given not in MODEL_TYPES:
            raise MappingError(f"--hf-model-type {given}: statekit names Megatron GPT models for "
                               f"{', '.join(MODEL_TYPES)}", where)
        if (given in MOE_TYPES) != moe:
            raise MappingError(f"--hf-model-type {given} is a {'mixture-of-experts' if given in MOE_TYPES else 'dense'}"
                               f" model; this run is {'a mixture of experts' if moe else 'dense'}", where)
        bias = meta.get("megatron.add_qkv_bias") == "True"
        if (given == "qwen2") != bias:  # a field the model has and the run not: from_pretrained would invent it
            raise MappingError(f"--hf-model-type {given}: " + ("a qwen2 has a q/k/v bias, this run has none (no "
                               "--add-qkv-bias)" if given == "qwen2" else f"this run has a q/k/v bias, a {given} "
                               "has none (qwen2 has)"), where)
        if (given in ("qwen3", "qwen3_moe")) != qk_norm:
            raise MappingError(f"--hf-model-type {given}: " + (f"a {given} has QK norms, this run has none (no "
                               "--qk-layernorm)" if given.startswith("qwen3") else f"this run has QK norms, a "
                               f"{given} has none (qwen3 / qwen3_moe have)"), where)
        return given
    if moe:
        return "qwen3_moe" if qk_norm else "mixtral"
    if meta.get("megatron.add_qkv_bias") == "True":
        return "qwen2"
    return "qwen3" if qk_norm else "llama"


def build(meta: dict, shapes: dict[str, tuple[int, ...]], where: str, hf_type: str | None = None) -> StructureMap:
    """The map from the Megatron parameters ``shapes`` (name → global shape) to the names of the HF model
    ``hf_type`` (default: :func:`model_type`'s choice)."""
    hf_type = model_type(meta, hf_type, where)
    experts: dict[str, dict[str, dict[int, tuple[str, tuple[int, ...]]]]] = {}
    n_experts = int(meta.get("megatron.num_experts") or 0) if hf_type in MOE_TYPES else 0
    if _flag(meta, "swiglu") is False:
        raise MappingError("the run has no --swiglu: a Llama/Qwen2 MLP is gated (gate_proj, up_proj), this one is "
                           "not", where)
    norm = meta.get("megatron.normalization")
    if norm not in (None, "RMSNorm"):
        raise MappingError(f"the run's normalization is {norm}: a Llama/Qwen2 model uses RMSNorm", where)
    h = _fact(meta, "hidden_size", where, "the q/k/v split")
    nq = _fact(meta, "num_attention_heads", where, "the q/k/v split")
    ng = int(meta.get("megatron.num_query_groups") or 0) or nq
    d = int(meta.get("megatron.kv_channels") or 0) or h // nq
    if nq % ng:
        raise MappingError(f"num-attention-heads {nq} is not a multiple of num-query-groups {ng}", where)
    vocab = _fact(meta, "vocab_size", where, "stripping the vocabulary's padding rows")
    targets: dict[str, TargetMap] = {}

    def add(t: TargetMap) -> None:
        if t.path in targets:
            raise MappingError(f"{t.path} is made from two Megatron tensors ({targets[t.path].sources[0]}, "
                               f"{t.sources[0]})", where)
        targets[t.path] = t

    for name, shape in shapes.items():
        shape = tuple(shape)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            add(_vocab_rows(name, shape, vocab, where))
            continue
        if name in _TOP:
            add(TargetMap(_TOP[name], shape, [_whole(name, shape)], kind="whole"))
            continue
        m = _LAYER.fullmatch(name)
        if m is None:
            raise MappingError(f"{name}: no Hugging Face Llama/Qwen2 tensor is known for this Megatron parameter",
                               where)
        layer, rest = m.group(1), m.group(2)
        prefix = f"model.layers.{layer}."
        em = _EXPERT.fullmatch(rest) if n_experts else None
        if em is not None:
            e, fc = (int(em.group(1)), em.group(2)) if em.group(1) is not None else (int(em.group(4)), em.group(3))
            experts.setdefault(prefix, {}).setdefault(fc, {})[e] = (name, shape)
        elif rest == "mlp.router.weight" and n_experts:
            if shape[0] != n_experts:
                raise MappingError(f"{name} is {list(shape)}: not [experts {n_experts}, hidden]", where)
            add(TargetMap(prefix + "mlp.gate.weight", shape, [_whole(name, shape)], kind="whole"))
        elif n_experts and rest in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
            raise MappingError(f"{name}: a dense MLP in a mixture-of-experts model; a Hugging Face {hf_type} layer "
                               "has experts only", where)
        elif rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight") \
                and hf_type not in ("qwen3", "qwen3_moe"):
            raise MappingError(f"{name}: a Hugging Face {hf_type} has no QK norm (qwen3 / qwen3_moe have)", where)
        elif rest == "self_attention.linear_qkv.bias" and hf_type != "qwen2":
            raise MappingError(f"{name}: a Hugging Face {hf_type} has no q/k/v bias (qwen2 has)", where)
        elif rest in _RENAMED:
            add(TargetMap(prefix + _RENAMED[rest], shape, [_whole(name, shape)], kind="whole"))
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            for t in _qkv_split(name, shape, prefix + "self_attn.{}_proj." + rest.rsplit(".", 1)[1], h, nq, ng, d,
                                where):
                add(t)
        elif rest == "mlp.linear_fc1.weight":
            for t in _gate_up(name, shape, prefix, where):
                add(t)
        else:
            raise MappingError(f"{name}: no Hugging Face Llama/Qwen2 tensor is known for this Megatron parameter "
                               "(a layer kind or bias statekit does not map)", where)
    for prefix, fcs in experts.items():
        for fc, hf in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
            add(_stacked(prefix + "mlp.experts." + hf, fcs.get(fc, {}), n_experts, fc, where))
    notes = [f"Megatron GPT → Hugging Face {hf_type} names, from the run's args "
             f"({nq} heads, {ng} query groups, kv_channels {d}, vocab {vocab}"
             + (f", {n_experts} experts stacked" if n_experts else "") + ")"]
    return StructureMap(targets, "rules", notes, order=sorted(targets, key=lambda p: _hf_position(p, hf_type)))


def _vocab_rows(name: str, shape: tuple[int, ...], vocab: int, where: str) -> TargetMap:
    """The embedding or output layer without its vocabulary padding rows (§4.4)."""
    hf = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
    if len(shape) != 2 or shape[0] < vocab:
        raise MappingError(f"{name} is {list(shape)}: not [padded vocab ≥ {vocab}, hidden]", where)
    t = TargetMap(hf, (vocab, shape[1]), [Piece(name, (vocab, shape[1]), 0, (shape[1], 1), 0, (shape[1], 1))],
                  kind="split" if shape[0] > vocab else "whole")
    if shape[0] > vocab:
        t.notes.append(f"rows {vocab}…{shape[0] - 1} are vocabulary padding (--vocab-size {vocab}): stripped")
    return t


def _qkv_split(name: str, shape: tuple[int, ...], path: str, h: int, nq: int, ng: int, d: int,
               where: str) -> list[TargetMap]:
    """``linear_qkv`` (weight or bias) grouped per query group (``q…q k v``, §4.1) → q, k, v: each one strided
    piece over the groups. ``path`` has ``{}`` for the projection letter."""
    per = nq // ng
    cols = shape[1] if len(shape) == 2 else 1
    if shape[0] != (nq + 2 * ng) * d or (len(shape) == 2 and cols != h):
        raise MappingError(f"{name} is {list(shape)}: the args say [(heads {nq} + 2·groups {ng})·kv_channels "
                           f"{d} = {(nq + 2 * ng) * d}{', ' + str(h) if len(shape) == 2 else ''}]", where)
    out = []
    for proj, first, rows in (("q", 0, per * d), ("k", per * d, d), ("v", (per + 1) * d, d)):
        box = (ng, rows, cols) if len(shape) == 2 else (ng, rows)
        src = ((per + 2) * d * cols, cols, 1) if len(shape) == 2 else ((per + 2) * d, 1)
        dst = (rows * cols, cols, 1) if len(shape) == 2 else (rows, 1)
        t = TargetMap(path.format(proj), (ng * rows, cols) if len(shape) == 2 else (ng * rows,),
                      [Piece(name, box, first * cols, src, 0, dst)], kind="split")
        t.notes.append(f"{proj} rows of each of {ng} query groups ({per} q heads, 1 k, 1 v of {d} rows)")
        out.append(t)
    return out


def _gate_up(name: str, shape: tuple[int, ...], prefix: str, where: str) -> list[TargetMap]:
    """A SwiGLU ``linear_fc1`` ``[gate; up]`` along rows (§4.2) → gate_proj, up_proj."""
    if len(shape) != 2 or shape[0] % 2:
        raise MappingError(f"{name} is {list(shape)}: not [2·ffn, hidden] (gate; up)", where)
    f, cols = shape[0] // 2, shape[1]
    return [TargetMap(f"{prefix}mlp.{proj}_proj.weight", (f, cols),
                      [Piece(name, (f, cols), first * cols, (cols, 1), 0, (cols, 1))], kind="split")
            for proj, first in (("gate", 0), ("up", f))]


def _stacked(path: str, by_expert: dict[int, tuple[str, tuple[int, ...]]], n: int, fc: str, where: str) -> TargetMap:
    """transformers 5's stacked expert tensor ``[E, …]`` from each expert's Megatron ``fc`` weight, whole."""
    missing = [e for e in range(n) if e not in by_expert]
    if missing or len(by_expert) != n:
        raise MappingError(f"{path}: the checkpoint has {fc} of experts {sorted(by_expert)}, the args say "
                           f"{n} experts (missing {missing})", where)
    shapes = {tuple(s) for _, s in by_expert.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise MappingError(f"{path}: the experts' {fc} weights are not one 2-D shape ({sorted(shapes)})", where)
    shape = next(iter(shapes))
    if fc == "linear_fc1" and shape[0] % 2:
        raise MappingError(f"{by_expert[0][0]} is {list(shape)}: not [2·ffn, hidden] (gate; up)", where)
    size = shape[0] * shape[1]
    pieces = [Piece(by_expert[e][0], (size,), 0, (1,), e * size, (1,)) for e in range(n)]
    t = TargetMap(path, (n, *shape), pieces, kind="stacked")
    t.notes.append(f"{n} experts' {fc} stacked along a new first axis")
    return t


# a decoder layer's named_parameters() order in transformers 5.24 (LlamaDecoderLayer, Qwen2/Qwen3DecoderLayer;
# MixtralDecoderLayer registers the router before the experts, Qwen3MoeSparseMoeBlock after them)
_ATTN = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
         "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
         "self_attn.k_norm.weight")
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_IN_LAYER = {
    "dense": _ATTN + ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight") + _NORMS,
    "mixtral": _ATTN + ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj") + _NORMS,
    "qwen3_moe": _ATTN + ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight") + _NORMS,
}


def _hf_position(path: str, hf_type: str = "llama") -> tuple:
    """Where ``path`` sits in the HF model's ``named_parameters()``: embeddings, layers, final norm, head."""
    if path == "model.embed_tokens.weight":
        return (0,)
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", path)
    if m:
        return (1, int(m.group(1)), _IN_LAYER.get(hf_type, _IN_LAYER["dense"]).index(m.group(2)))
    return (2,) if path == "model.norm.weight" else (3,)


def _whole(name: str, shape: tuple[int, ...]) -> Piece:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return Piece(name, shape, 0, tuple(strides), 0, tuple(strides))


# what Megatron's groups hold that a torch AdamW does not: kept as the group's fields, never compared
_BOOKKEEPING = ("is_expert_parallel", "default_config")


def trainer_groups(state, where: str) -> None:
    """Megatron's param groups as a Hugging Face Trainer builds them: one group of the decayed parameters,
    one of the others (``Trainer.get_decay_parameter_names``: biases and norms). Megatron keeps the experts
    in groups of their own (ChainedOptimizer: dense + expert); each is merged into the dense group of the
    same weight decay when every hyperparameter but that bookkeeping agrees, else refused naming both."""
    merged: list = []
    where_to: dict[int, int] = {}
    for i, g in enumerate(state.groups):
        mine = {k: v for k, v in g.hyperparams.items() if k not in _BOOKKEEPING}
        for j, h in enumerate(merged):
            theirs = {k: v for k, v in h.hyperparams.items() if k not in _BOOKKEEPING}
            if (mine.get("weight_decay") or 0) > 0 and (theirs.get("weight_decay") or 0) > 0 \
                    or (mine.get("weight_decay") or 0) == (theirs.get("weight_decay") or 0) == 0:
                differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                if differ:
                    raise MappingError(f"Megatron param groups {j} and {i} differ in {', '.join(differ)} "
                                       f"({', '.join(f'{k}={theirs.get(k)!r}/{mine.get(k)!r}' for k in differ[:3])}): "
                                       "a Hugging Face Trainer puts all decayed (or all undecayed) parameters in one "
                                       "group", where)
                h.keys.extend(g.keys)
                where_to[i] = j
                break
        else:
            where_to[i] = len(merged)
            merged.append(type(g)(dict(g.hyperparams), list(g.keys), g.family, g.candidates))
    if len(merged) == len(state.groups):
        return
    for p in state.params:
        p.group = where_to[p.group]
    state.groups[:] = merged


def drop_tied_copy(state, meta: dict, where: str) -> str | None:
    """Tied embeddings with PP > 1: the last stage keeps ``output_layer.weight``, a copy of the embedding with
    its own optimizer state (the two are all-reduced every step, so they stay equal). A Hugging Face model with
    ``tie_word_embeddings`` has one tensor: the copy is dropped once every slot of it (moments, master) equals
    the embedding's bit for bit, else refused naming the slot and element. Returns a line for the plan, or None."""
    if meta.get("megatron.untie_embeddings") != "False":
        return None
    by_path = {p.path: p for p in state.params}
    emb, out = by_path.get("embedding.word_embeddings.weight"), by_path.get("output_layer.weight")
    if emb is None or out is None:
        return None
    from statekit.lazy import numpy as np

    for slot in sorted(set(emb.slots) | set(out.slots)):
        a, b = emb.slots.get(slot), out.slots.get(slot)
        if a is None or b is None or tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise MappingError(f"output_layer.weight: tied to the embedding, but its {slot} is not the embedding's "
                               "(missing, or another shape or dtype)", where)
        seen = 0
        for x, y in zip(a.pieces(1 << 18), b.pieces(1 << 18), strict=True):
            bits = f"u{x.dtype.itemsize}"
            differ = np.flatnonzero(x.view(bits) != y.view(bits))
            if differ.size:
                raise MappingError(f"output_layer.weight: tied to the embedding (a copy on the last pipeline stage), "
                                   f"but its {slot} differs from the embedding's at element {seen + int(differ[0])}: "
                                   "a Hugging Face model with tied embeddings has one tensor for both", where)
            seen += x.size
    if (out.step or 0) != (emb.step or 0):
        raise MappingError(f"output_layer.weight: tied to the embedding, at step {out.step}, the embedding at "
                           f"{emb.step}", where)
    state.params.remove(out)
    for g in state.groups:
        if out.key in g.keys:
            g.keys.remove(out.key)
    return ("tied embeddings: output_layer.weight (the last pipeline stage's copy) equals the embedding in every "
            "slot, bit for bit; dropped, as a tied Hugging Face model has one tensor")


# transformers 5.24's Trainer.get_decay_parameter_names: no weight decay for these names (and LayerNorm modules)
_NO_DECAY = tuple(re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                          r"_norm(?:$|\.)"))


def check_trainer_decay(state, structure: StructureMap, where: str) -> None:
    """Each Hugging Face tensor's Megatron sources are in a decayed group exactly when a Trainer decays that
    tensor: the optimizer.pt groups are then the Trainer's own (else torch would pair the saved positions
    with other parameters, or refuse). One line naming the tensor otherwise (``--apply-wd-to-qk-layernorm``,
    a ``wd_mult`` that the Trainer has no word for)."""
    by_path = {p.path: p for p in state.params}
    for path, t in structure.targets.items():
        decays = not any(p.search(path.lower()) for p in _NO_DECAY)
        for src in t.sources:
            p = by_path.get(src)
            if p is None:
                continue
            wd = float(state.groups[p.group].hyperparams.get("weight_decay") or 0.0)
            if (wd > 0) != decays:
                raise MappingError(f"{path}: Megatron's {src} is in a group with weight_decay {wd}, but a Hugging "
                                   f"Face Trainer {'decays' if decays else 'does not decay'} {path} (its "
                                   "get_decay_parameter_names): the optimizer's groups would not be the Trainer's",
                                   where)
