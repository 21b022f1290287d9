"""Stacked torch_dist keys unstacked into the parameters Megatron names.

torch_dist stores a homogeneous decoder's layers under one key without the layer index and a
leading ``[num_layers]`` axis (``decoder.layers.self_attention.linear_qkv.weight [L, …]``), and a
MoE layer's experts under ``….mlp.experts.experts.<fc>.weight [L, E, …]`` (``shared/docs/
megatron-formats.md`` §2.2). Both axes count globally (the save offsets include the pipeline
stage's layer offset and the EP rank's expert offset), so an index along them is the global
layer / expert index. Per-layer keys (``decoder.layers.{i}.…``, non-homogeneous models) keep
their index and have no layer axis.

The names are the ones ``model.named_parameters()`` gives in Megatron (one model chunk):
``decoder.layers.{i}.<rest>``; experts ``decoder.layers.{i}.mlp.experts.linear_fc1.weight{e}``
for the grouped-GEMM experts (TEGroupedMLP, ``--moe-grouped-gemm``) and
``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight`` for SequentialMLP, with
``e`` the global expert index. Which of the two the run used is only in ``args``.
"""

from __future__ import annotations

import itertools
import re

from statekit.errors import FormatError

_STACKED_LAYERS = re.compile(r"(^|\.)(layers)\.(?!\d)")
EXPERTS = ".experts.experts."
NEMO_PREFIX = "module."

# how a per-expert parameter is named, by the experts module the run built (args.moe_grouped_gemm)
EXPERT_NAMES = {
    True: "{head}.experts.{rest}{e}",  # TEGroupedMLP: linear_fc1.weight0, linear_fc1.weight1, ...
    False: "{head}.experts.local_experts.{e}.{rest}",  # SequentialMLP
}


# Megatron's local spec (``get_gpt_layer_local_spec``: ``sharded_state_dict_keys_map``) saves two of
# its layer's parameters under TE's fused names; the parameters themselves keep their modules' names
LOCAL_SPEC_KEYS = {
    "self_attention.linear_qkv.layer_norm_": "input_layernorm.",
    "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
}


def module_name(name: str, transformer_impl: str | None) -> str:
    """The parameter's own name for a key saved under the local spec's mapped names
    (``args.transformer_impl == "local"``); others as they are."""
    if transformer_impl != "local":
        return name
    m = re.match(r"^(decoder\.layers\.\d+\.)(.+)$", name)
    if m is None:
        return name
    for saved, own in LOCAL_SPEC_KEYS.items():
        if m.group(2).startswith(saved):
            return m.group(1) + own + m.group(2)[len(saved):]
    return name


def stack_axes(key: str) -> tuple[str, ...]:
    """The leading axes the key's stored tensor has beyond the parameter's: ``("layer",)``,
    ``("layer", "expert")``, ``("expert",)`` or ``()``."""
    axes = []
    if _STACKED_LAYERS.search(key):
        axes.append("layer")
    if EXPERTS in key:
        axes.append("expert")
    return tuple(axes)


def param_name(key: str, index: tuple[int, ...], grouped_experts: bool | None,
               transformer_impl: str | None = None) -> str:
    """The Megatron parameter name of element ``index`` of the stacked axes of ``key``
    (``transformer_impl``: ``args.transformer_impl``, for the local spec's mapped names)."""
    axes = stack_axes(key)
    if len(axes) != len(index):
        raise FormatError(f"{key}: {len(index)} stacked indices for the axes {axes}")
    name = key
    values = dict(zip(axes, index, strict=True))
    if "layer" in values:
        name = _STACKED_LAYERS.sub(lambda m: f"{m.group(1)}{m.group(2)}.{values['layer']}.", name, count=1)
    if "expert" in values:
        if grouped_experts is None:
            raise FormatError(f"{key}: which experts module wrote it (args.moe_grouped_gemm) is not in the "
                              "checkpoint, so its per-expert parameters cannot be named")
        head, _, rest = name.partition(EXPERTS)
        name = EXPERT_NAMES[grouped_experts].format(head=head, rest=rest, e=values["expert"])
    return module_name(name, transformer_impl)


def indices(key: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every index tuple of the stacked axes of ``key`` (stored as ``shape``)."""
    n = len(stack_axes(key))
    if len(shape) < n:
        raise FormatError(f"{key}: shape {list(shape)} has fewer axes than its stacked axes ({n})")
    return list(itertools.product(*(range(d) for d in shape[:n])))
