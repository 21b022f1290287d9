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

Anything else (an MoE layer, a bias Llama has no field for, a LayerNorm model, a name of another layer kind)
is refused in one line: a wrong map is worse than none. Adam-family state is elementwise, so every slot
follows the weight's pieces.
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


def build(meta: dict, shapes: dict[str, tuple[int, ...]], where: str) -> StructureMap:
    """The map from the Megatron parameters ``shapes`` (name → global shape) to HF Llama/Qwen2 names."""
    if meta.get("megatron.num_experts") not in (None, "None", "0"):
        raise MappingError("a mixture-of-experts Megatron model: statekit converts dense GPT models to Hugging "
                           "Face names only yet", where)
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
    per = nq // ng
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
            hf = "model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"
            if len(shape) != 2 or shape[0] < vocab:
                raise MappingError(f"{name} is {list(shape)}: not [padded vocab ≥ {vocab}, hidden]", where)
            t = TargetMap(hf, (vocab, shape[1]), [Piece(name, (vocab, shape[1]), 0, (shape[1], 1), 0, (shape[1], 1))],
                          kind="split" if shape[0] > vocab else "whole")
            if shape[0] > vocab:
                t.notes.append(f"rows {vocab}…{shape[0] - 1} are vocabulary padding (--vocab-size {vocab}): stripped")
            add(t)
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
        if rest in _RENAMED:
            add(TargetMap(prefix + _RENAMED[rest], shape, [_whole(name, shape)], kind="whole"))
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            cols = shape[1] if len(shape) == 2 else 1
            if shape[0] != (nq + 2 * ng) * d or (len(shape) == 2 and cols != h):
                raise MappingError(f"{name} is {list(shape)}: the args say [(heads {nq} + 2·groups {ng})·kv_channels "
                                   f"{d} = {(nq + 2 * ng) * d}{', ' + str(h) if len(shape) == 2 else ''}]", where)
            kind = rest.rsplit(".", 1)[1]
            for proj, first, rows in (("q", 0, per * d), ("k", per * d, d), ("v", (per + 1) * d, d)):
                box = (ng, rows, cols) if len(shape) == 2 else (ng, rows)
                src = ((per + 2) * d * cols, cols, 1) if len(shape) == 2 else ((per + 2) * d, 1)
                dst = (rows * cols, cols, 1) if len(shape) == 2 else (rows, 1)
                t = TargetMap(f"{prefix}self_attn.{proj}_proj.{kind}",
                              (ng * rows, cols) if len(shape) == 2 else (ng * rows,),
                              [Piece(name, box, first * cols, src, 0, dst)], kind="split")
                t.notes.append(f"{proj} rows of each of {ng} query groups ({per} q heads, 1 k, 1 v of {d} rows)")
                add(t)
        elif rest == "mlp.linear_fc1.weight":
            if len(shape) != 2 or shape[0] % 2:
                raise MappingError(f"{name} is {list(shape)}: not [2·ffn, hidden] (gate; up)", where)
            f, cols = shape[0] // 2, shape[1]
            for proj, first in (("gate", 0), ("up", f)):
                add(TargetMap(f"{prefix}mlp.{proj}_proj.weight", (f, cols),
                              [Piece(name, (f, cols), first * cols, (cols, 1), 0, (cols, 1))], kind="split"))
        else:
            raise MappingError(f"{name}: no Hugging Face Llama/Qwen2 tensor is known for this Megatron parameter "
                               "(a layer kind or bias statekit does not map)", where)
    notes = [f"Megatron GPT → Hugging Face Llama/Qwen2 names, from the run's args "
                                           f"({nq} heads, {ng} query groups, kv_channels {d}, vocab {vocab})"]
    return StructureMap(targets, "rules", notes, order=sorted(targets, key=_hf_position))


# a Llama/Qwen2 decoder layer's named_parameters() order (transformers' LlamaDecoderLayer / Qwen2DecoderLayer)
_IN_LAYER = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
             "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
             "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight")


def _hf_position(path: str) -> tuple:
    """Where ``path`` sits in the HF model's ``named_parameters()``: embeddings, layers, final norm, head."""
    if path == "model.embed_tokens.weight":
        return (0,)
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", path)
    if m:
        return (1, int(m.group(1)), _IN_LAYER.index(m.group(2)))
    return (2,) if path == "model.norm.weight" else (3,)


def _whole(name: str, shape: tuple[int, ...]) -> Piece:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.insert(0, acc)
        acc *= n
    return Piece(name, shape, 0, tuple(strides), 0, tuple(strides))
