"""Megatron-Bridge folders: the run's settings from ``run_config.yaml`` as Megatron-LM ``args``.

Megatron-Bridge (0.6.2 checked, ``training/checkpointing.py``) saves torch_dist folders whose common
state has no ``args``; the run's ``ConfigContainer`` is beside the DCP files as ``run_config.yaml``
(``cfg.to_yaml``: plain keys, ``_target_`` strings, no YAML tags). :func:`args_from_run_config`
maps the fields the bucket layout needs onto Megatron-LM's args names (one table); a needed field
that is missing refuses naming it and the file. PyYAML is optional (``statekit[megatron]``) and is
imported only here; ``yaml.safe_load`` only. SwiGLU is ``model.gated_linear_unit`` with the
activation's ``_target_`` path (never imported). The same table carries the schedule's settings that
``opt_param_scheduler`` lacks and the model fields a Hugging Face config is built from or refused for
(:mod:`statekit.ops.megatron_config`); :data:`TRAIN_STATE` names ``train_state.pt``'s keys as Megatron-LM names
the same counters (read by :mod:`.bridge_state`).
"""

from __future__ import annotations

import os

from statekit.errors import FormatError

RUN_CONFIG = "run_config.yaml"

# (section, Bridge field) → Megatron-LM args name; the first section found wins
_TABLE = (
    ("model", "tensor_model_parallel_size", "tensor_model_parallel_size"),
    ("model", "pipeline_model_parallel_size", "pipeline_model_parallel_size"),
    ("model", "context_parallel_size", "context_parallel_size"),
    ("model", "expert_model_parallel_size", "expert_model_parallel_size"),
    ("model", "expert_tensor_parallel_size", "expert_tensor_parallel_size"),
    ("model", "virtual_pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"),
    ("model", "num_layers", "num_layers"),
    ("model", "hidden_size", "hidden_size"),
    ("model", "ffn_hidden_size", "ffn_hidden_size"),
    ("model", "num_attention_heads", "num_attention_heads"),
    ("model", "num_query_groups", "num_query_groups"),
    ("model", "kv_channels", "kv_channels"),
    ("model", "vocab_size", "vocab_size"),
    ("model", "make_vocab_size_divisible_by", "make_vocab_size_divisible_by"),
    ("model", "num_moe_experts", "num_experts"),
    ("model", "add_bias_linear", "add_bias_linear"),
    ("model", "add_qkv_bias", "add_qkv_bias"),
    ("model", "normalization", "normalization"),
    ("model", "qk_layernorm", "qk_layernorm"),
    ("model", "bf16", "bf16"),
    ("model", "fp16", "fp16"),
    ("ddp", "bucket_size", "ddp_bucket_size"),
    ("ddp", "overlap_grad_reduce", "overlap_grad_reduce"),
    ("ddp", "use_distributed_optimizer", "use_distributed_optimizer"),
    ("ddp", "grad_reduce_in_fp32", "accumulate_allreduce_grads_in_fp32"),
    ("ddp", "pad_buckets_for_high_nccl_busbw", "ddp_pad_buckets_for_high_nccl_busbw"),
    ("ddp", "num_distributed_optimizer_instances", "num_distributed_optimizer_instances"),
    ("optimizer", "optimizer", "optimizer"),
    ("optimizer", "use_precision_aware_optimizer", "use_precision_aware_optimizer"),
    ("optimizer", "lr", "lr"),
    ("optimizer", "min_lr", "min_lr"),
    ("optimizer", "weight_decay", "weight_decay"),
    ("optimizer", "adam_beta1", "adam_beta1"),
    ("optimizer", "adam_beta2", "adam_beta2"),
    ("optimizer", "adam_eps", "adam_eps"),
    ("train", "global_batch_size", "global_batch_size"),
    ("train", "micro_batch_size", "micro_batch_size"),
    ("train", "train_iters", "train_iters"),
    ("train", "train_samples", "train_samples"),
    ("train", "rampup_batch_size", "rampup_batch_size"),
    # the schedule's settings outside opt_param_scheduler (schedule_megatron reads them from args)
    ("scheduler", "lr_warmup_init", "lr_warmup_init"),
    ("scheduler", "lr_wsd_decay_style", "lr_wsd_decay_style"),
    ("scheduler", "lr_wsd_decay_iters", "lr_wsd_decay_iters"),
    ("scheduler", "lr_wsd_decay_samples", "lr_wsd_decay_samples"),
    ("scheduler", "override_opt_param_scheduler", "override_opt_param_scheduler"),
    ("scheduler", "use_checkpoint_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"),
    # what a Hugging Face config is built from (ops/megatron_config) or refused for. Bridge's model provider
    # is a TransformerConfig, whose fields Megatron-LM's args carry under the same names, except: the
    # model's length is seq_length (GPTModelProvider.provide: max_sequence_length=self.seq_length; Bridge's own
    # CONFIG_MAPPING pairs HF max_position_embeddings with it), and rope_scaling is args' use_rope_scaling
    ("model", "seq_length", "max_position_embeddings"),
    ("model", "seq_length", "seq_length"),
    ("model", "rope_scaling", "use_rope_scaling"),
    ("model", "rope_scaling_factor", "rope_scaling_factor"),
    *(("model", f, f) for f in (
        "layernorm_epsilon", "rotary_base", "rotary_percent", "rotary_interleaved", "rotary_scaling_factor",
        "position_embedding_type", "mrope_section", "no_rope_freq", "init_method_std", "layernorm_zero_centered_gamma",
        "softmax_type", "softmax_scale", "attention_output_gate", "qk_l2_norm", "multi_latent_attention",
        "hidden_dropout", "attention_dropout", "window_size", "glu_linear_offset", "activation_func_clamp_value",
        "apply_residual_connection_post_layernorm", "use_mup", "mtp_num_layers", "experimental_attention_variant",
        "is_hybrid_model", "heterogeneous_block_specs", "linear_attention_freq", "moe_router_topk",
        "moe_router_pre_softmax", "moe_router_score_function", "moe_router_topk_scaling_factor",
        "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_grouped_gemm",
        "moe_ffn_hidden_size", "moe_aux_loss_coeff", "moe_router_num_groups", "moe_z_loss_coeff",
        "moe_input_jitter_eps")),
)
# train_state.pt (Bridge's TrainState.state_dict, training/state.py; saved by checkpointing.save_checkpoint) key →
# what Megatron-LM calls the same counter: the common state's iteration and num_floating_point_operations_so_far,
# args' sample counters and phase flags
TRAIN_STATE = (
    ("step", "iteration"),
    ("consumed_train_samples", "consumed_train_samples"),
    ("skipped_train_samples", "skipped_train_samples"),
    ("consumed_valid_samples", "consumed_valid_samples"),
    ("floating_point_operations_so_far", "num_floating_point_operations_so_far"),
    ("do_train", "do_train"),
    ("do_valid", "do_valid"),
    ("do_test", "do_test"),
)
# fields the layout cannot do without (present, and not null)
_NEEDED = ("model.tensor_model_parallel_size", "model.pipeline_model_parallel_size", "model.num_layers",
           "model.hidden_size", "model.num_attention_heads", "model.vocab_size",
           "model.make_vocab_size_divisible_by", "model.gated_linear_unit", "model.activation_func",
           "model.share_embeddings_and_output_weights", "model.transformer_layer_spec",
           "ddp.use_distributed_optimizer", "ddp.overlap_grad_reduce", "ddp.grad_reduce_in_fp32",
           "model.bf16", "model.fp16")
_SILU = {"torch.nn.functional.silu", "torch.nn.SiLU", "torch.nn.modules.activation.SiLU"}
_GELU = {"torch.nn.functional.gelu", "megatron.core.fusions.fused_bias_gelu.bias_gelu_impl"}


def beside(folder: str) -> str | None:
    """The ``run_config.yaml`` of a torch_dist iteration folder (None: not a Bridge folder)."""
    path = os.path.join(folder, RUN_CONFIG)
    return path if os.path.isfile(path) else None


def load(path: str) -> dict:
    try:
        import yaml
    except ImportError:
        raise FormatError("reading a Megatron-Bridge run_config.yaml needs PyYAML: pip install "
                          "'statekit[megatron]'", path) from None
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise FormatError(f"cannot read: {exc.strerror}", path) from None
    except yaml.YAMLError as exc:
        raise FormatError(f"not valid YAML: {str(exc).splitlines()[0]}", path) from None
    if not isinstance(data, dict):
        raise FormatError(f"the top level is a {type(data).__name__}, not a mapping", path)
    return data


def _get(data: dict, dotted: str):
    node: object = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _target(value: object) -> str | None:
    return value.get("_target_") if isinstance(value, dict) else None


def _swiglu(data: dict, path: str) -> bool:
    act = _target(_get(data, "model.activation_func"))
    if act in _SILU:
        return bool(_get(data, "model.gated_linear_unit"))
    if act in _GELU:
        return False
    raise FormatError(f"model.activation_func {act!r} is not one statekit knows (silu or gelu)", path)


def _impl(data: dict, path: str) -> str:
    spec = _target(_get(data, "model.transformer_layer_spec")) or ""
    if spec.endswith("local_layer_spec"):
        return "local"
    if spec.endswith("transformer_engine_layer_spec") or spec.endswith("default_layer_spec"):
        return "transformer_engine"
    raise FormatError(f"model.transformer_layer_spec {spec!r} is not one statekit knows", path)


def args_from_run_config(path: str, world_size: int) -> dict:
    """Megatron-LM-named args from a Bridge ``run_config.yaml``; ``world_size`` is the number of
    ranks that wrote the DCP files (Bridge stores no world size)."""
    data = load(path)
    for dotted in _NEEDED:
        if _get(data, dotted) is None:
            raise FormatError(f"{dotted} is missing: needed to cut the optimizer buffers into parameters", path)
    args: dict = {}
    for section, field, name in _TABLE:
        value = _get(data, f"{section}.{field}")
        if value is not None and name not in args:
            args[name] = value
    args["swiglu"] = _swiglu(data, path)
    args["untie_embeddings_and_output_weights"] = not _get(data, "model.share_embeddings_and_output_weights")
    args["transformer_impl"] = _impl(data, path)
    args["world_size"] = world_size
    args["ckpt_format"] = "torch_dist"
    if args.get("ddp_bucket_size") is None:
        args.pop("ddp_bucket_size", None)
    return args
