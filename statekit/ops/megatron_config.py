"""A Hugging Face ``config.json`` for a Megatron GPT run, built from the run's own ``args`` (the checkpoint's
``megatron.*`` facts), for the model types :mod:`statekit.ops.megatron_hf` names tensors for.

Every field comes from an arg (facts: ``/work/shared/docs/megatron-formats.md`` §4, §8): hidden size, layers,
heads, query groups (``num_key_value_heads``), kv channels (``head_dim``), the FFN size, the true vocabulary
(``vocab_size``, not the padded one), ``max_position_embeddings``, the RMSNorm epsilon, the RoPE base,
``tie_word_embeddings`` (``not untie_embeddings_and_output_weights``), the MoE expert count, top-k and aux-loss
coefficient. What a Hugging Face model of that type would compute differently is refused in one line naming
the arg (partial or interleaved RoPE, RoPE scaling, zero-centred norms, sigmoid or pre-softmax routing, an
expert bias, shared experts, dense layers between MoE layers, …): a config that builds a different model
would be a silently wrong answer. The tokenizer is not part of a Megatron checkpoint: no token ids are set.
"""

from __future__ import annotations

import json

from statekit.errors import MappingError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

# args whose value other than this one builds a model the Hugging Face types here do not compute
_MUST = (("position_embedding_type", "rope", "the position embedding"),
         ("rotary_percent", "1.0", "partial RoPE"),
         ("rotary_interleaved", "False", "interleaved RoPE"),
         ("use_rope_scaling", "False", "RoPE scaling"),
         ("rotary_scaling_factor", "1.0", "RoPE scaling"),
         ("layernorm_zero_centered_gamma", "False", "zero-centred norm weights (HF = Megatron + 1)"),
         ("apply_layernorm_1p", "False", "zero-centred norm weights (HF = Megatron + 1)"),
         ("softmax_type", "vanilla", "the attention softmax"),
         ("attention_output_gate", "False", "a gated attention output"),
         ("qk_l2_norm", "False", "L2-normalised q/k"),
         ("multi_latent_attention", "False", "multi-latent attention"),
         ("glu_linear_offset", "0.0", "an offset added to the GLU's linear half"),
         ("apply_residual_connection_post_layernorm", "False", "the residual taken after the norm"),
         ("use_mup", "False", "µP multipliers"),
         ("is_hybrid_model", "False", "a hybrid (Mamba) model"),
         ("heterogeneous_block_specs", "False", "per-layer block specs"))
_MUST_MOE = (("moe_router_score_function", "softmax", "the router's score function"),
             ("moe_router_pre_softmax", "False", "softmax before top-k (HF renormalises the top-k)"),
             ("moe_router_enable_expert_bias", "False", "an expert bias in the router"),
             ("moe_layer_freq", "1", "dense layers between MoE layers"))
_ABSENT_MOE = (("moe_router_topk_scaling_factor", "a top-k scaling factor"),
               ("moe_shared_expert_intermediate_size", "shared experts"),
               ("moe_router_num_groups", "group-limited routing"),
               ("moe_input_jitter_eps", "router input jitter"),
               ("rope_type", "a RoPE type"),
               ("no_rope_freq", "layers without RoPE"),
               ("mrope_section", "multimodal RoPE sections"),
               ("window_size", "sliding-window attention"),
               ("activation_func_clamp_value", "a clamped activation"),
               ("softmax_scale", "a softmax scale other than 1/sqrt(head_dim)"),
               ("mtp_num_layers", "multi-token prediction layers"),
               ("experimental_attention_variant", "an experimental attention variant"),
               ("linear_attention_freq", "linear-attention layers"))


def _arg(meta: dict, key: str) -> str | None:
    value = meta.get(f"megatron.args.{key}", meta.get(f"megatron.{key}"))
    return None if value in (None, "None") else value


def _int(meta: dict, key: str, where: str, why: str) -> int:
    value = _arg(meta, key)
    if value is None:
        raise MappingError(f"the checkpoint's args have no {key.replace('_', '-')}: needed for {why}", where)
    return int(value)


def _float(meta: dict, keys: tuple[str, ...], where: str, why: str) -> float:
    for key in keys:
        value = _arg(meta, key)
        if value is not None:
            return float(value)
    raise MappingError(f"the checkpoint's args have no {keys[0].replace('_', '-')}: needed for {why}", where)


def refuse_unmapped(meta: dict, hf_type: str, where: str) -> None:
    """One line naming the first arg whose setting the Hugging Face ``hf_type`` does not compute."""
    moe = hf_type in ("mixtral", "qwen3_moe")
    for key, want, what in _MUST + (_MUST_MOE if moe else ()):
        value = _arg(meta, key)
        if value is not None and value != want and not (want == "1.0" and float(value) == 1.0):
            raise MappingError(f"args.{key} is {value}: {what}, which a Hugging Face {hf_type} does not compute",
                               where)
    for key, what in _ABSENT_MOE:
        if (moe or not key.startswith("moe_")) and _arg(meta, key) not in (None, "0", "False"):
            raise MappingError(f"args.{key} is {_arg(meta, key)}: {what}, which a Hugging Face {hf_type} does "
                               "not compute", where)
    if meta.get("megatron.add_bias_linear") == "True":
        raise MappingError(f"args.add_bias_linear is True: a Hugging Face {hf_type} has no biases in its linear "
                           "layers besides q/k/v (qwen2)", where)


def build(meta: dict, hf_type: str, dtype: str, where: str) -> dict:
    """The ``config.json`` dict of a Hugging Face ``hf_type`` model for the run ``meta`` describes; ``dtype``
    (statekit's name) is what ``model.safetensors`` holds."""
    refuse_unmapped(meta, hf_type, where)
    why = "the Hugging Face config"
    heads = _int(meta, "num_attention_heads", where, why)
    hidden = _int(meta, "hidden_size", where, why)
    cfg: dict = {
        "architectures": [ARCHITECTURES[hf_type]],
        "model_type": hf_type,
        "vocab_size": _int(meta, "vocab_size", where, "the unpadded vocabulary"),
        "hidden_size": hidden,
        "intermediate_size": _int(meta, "ffn_hidden_size", where, why),
        "num_hidden_layers": _int(meta, "num_layers", where, why),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_arg(meta, "num_query_groups") or heads),
        "head_dim": int(_arg(meta, "kv_channels") or hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": _int(meta, "max_position_embeddings", where, why),
        "rms_norm_eps": _float(meta, ("norm_epsilon", "layernorm_epsilon"), where, "the RMSNorm epsilon"),
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": _float(meta, ("rotary_base",), where, "the RoPE base")},
        "tie_word_embeddings": meta.get("megatron.untie_embeddings") != "True",
        "attention_dropout": float(_arg(meta, "attention_dropout") or 0.0),
        "initializer_range": float(_arg(meta, "init_method_std") or 0.02),
        "dtype": TORCH_DTYPES[dtype],
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if meta.get("megatron.untie_embeddings") is None:
        raise MappingError("the checkpoint's args have no untie-embeddings-and-output-weights: needed for "
                           "tie_word_embeddings", where)
    if hf_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if hf_type in ("mixtral", "qwen3_moe"):
        experts = _int(meta, "num_experts", where, why)
        topk = _int(meta, "moe_router_topk", where, "the experts per token")
        moe_ffn = int(_arg(meta, "moe_ffn_hidden_size") or cfg["intermediate_size"])
        aux = float(_arg(meta, "moe_aux_loss_coeff") or 0.0)
        cfg.update(num_experts_per_tok=topk, router_aux_loss_coef=aux, output_router_logits=aux > 0)
        if hf_type == "mixtral":
            cfg.update(num_local_experts=experts, intermediate_size=moe_ffn, router_jitter_noise=0.0)
        else:
            cfg.update(num_experts=experts, moe_intermediate_size=moe_ffn, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[])
    return cfg


# fields of a given --hf-config that must agree with the run's (the rest of the given config is kept)
_CHECKED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "rms_norm_eps",
            "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def read(path: str) -> dict:
    """A ``config.json`` as a dict (one line naming the file when it is not one)."""
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise MappingError(f"not a readable config.json ({exc})", path) from None
    if not isinstance(cfg, dict):
        raise MappingError("config.json is not a JSON object", path)
    return cfg


def given(path: str, built: dict, where: str) -> dict:
    """``--hf-config FILE``: that config, each field the run also decides checked against the args (one line
    naming the first that differs); its ``dtype`` becomes what ``model.safetensors`` holds."""
    cfg = read(path)
    for key in _CHECKED:
        if key in cfg and key in built and cfg[key] is not None and cfg[key] != built[key]:
            raise MappingError(f"{key} is {cfg[key]!r} here, {built[key]!r} in the Megatron run's args ({where})",
                               path)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    if theta is not None and float(theta) != built["rope_parameters"]["rope_theta"]:
        raise MappingError(f"rope_theta is {theta} here, {built['rope_parameters']['rope_theta']} in the Megatron "
                           f"run's args ({where})", path)
    return {**cfg, "dtype": built["dtype"]}
