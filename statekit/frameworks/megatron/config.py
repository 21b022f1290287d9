"""What a Megatron checkpoint says about its run, read from the pickled ``args`` Namespace.

Megatron-LM keeps no architecture or parallelism description besides ``args`` (the training
command line as an ``argparse.Namespace``, pickled into ``model_optim_rng.pt`` and ``common.pt``;
docs: ``/work/shared/docs/megatron-formats.md`` §1.2, §8). :func:`from_args` turns it into a
:class:`MegatronConfig`; every field a reader needs but the file lacks is left None and asked for
through :meth:`MegatronConfig.need`, which raises one line naming the fact and what needs it
(never a default guessed in its place).

The API (stable; ``mcore-dist`` builds on it):

- ``from_args(args, source=None) -> MegatronConfig``: ``args`` is the unpickled Namespace (a
  :class:`~statekit.formats.torch_pickle.Record`) or a plain dict of its fields;
- ``MegatronConfig.need(field, why) -> value``: the value, or FormatError
  ``"args has no <field>: needed for <why>"``;
- the fields below (parallel sizes, model shape, buckets, precision) and
  :meth:`MegatronConfig.bucket_size` (the DDP bucket size of one model chunk on one pp rank,
  Megatron's own resolution), :meth:`dp_cp_size`, :meth:`expert_dp_size`,
  :meth:`version_signals`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from statekit.errors import FormatError, MappingError, UsageError

# args field → MegatronConfig field, where the names differ (both spellings Megatron used)
_RENAMES = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "virtual_pipeline_model_parallel_size": "vp",
    "context_parallel_size": "cp",
    "data_parallel_size": "dp",
    "world_size": "world_size",
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "swiglu": "swiglu",
    "untie_embeddings_and_output_weights": "untie_embeddings",
    "padded_vocab_size": "padded_vocab_size",
    "vocab_size": "vocab_size",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "overlap_grad_reduce": "overlap_grad_reduce",
    "overlap_param_gather_with_optimizer_step": "overlap_param_gather_with_optimizer_step",
    "ddp_bucket_size": "ddp_bucket_size",
    "ddp_num_buckets": "ddp_num_buckets",
    "ddp_pad_buckets_for_high_nccl_busbw": "pad_buckets_for_high_nccl_busbw",
    "use_distributed_optimizer": "use_distributed_optimizer",
    "accumulate_allreduce_grads_in_fp32": "grad_reduce_in_fp32",
    "bf16": "bf16",
    "fp16": "fp16",
    "params_dtype": "params_dtype",
    "optimizer": "optimizer",
    "use_precision_aware_optimizer": "use_precision_aware_optimizer",
    "num_distributed_optimizer_instances": "num_distributed_optimizer_instances",
    "decoder_first_pipeline_num_layers": "first_stage_layers",
    "num_layers_in_first_pipeline_stage": "first_stage_layers",
    "decoder_last_pipeline_num_layers": "last_stage_layers",
    "num_layers_in_last_pipeline_stage": "last_stage_layers",
    "pipeline_model_parallel_layout": "pipeline_layout",
    "account_for_embedding_in_pipeline_split": "account_for_embedding",
    "account_for_loss_in_pipeline_split": "account_for_loss",
    "moe_layer_freq": "moe_layer_freq",
    "ckpt_format": "ckpt_format",
    "decoupled_lr": "decoupled_lr",
    "lr": "lr",
    "min_lr": "min_lr",
    "weight_decay": "weight_decay",
    "adam_beta1": "adam_beta1",
    "adam_beta2": "adam_beta2",
    "adam_eps": "adam_eps",
    "global_batch_size": "global_batch_size",
    "micro_batch_size": "micro_batch_size",
    "group_query_attention": "group_query_attention",
    "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "normalization": "normalization",
    "qk_layernorm": "qk_layernorm",
    "transformer_impl": "transformer_impl",
    "num_floating_point_operations_so_far": None,
}


@dataclass
class MegatronConfig:
    """The run's facts (None: not in ``args``). Sizes are Megatron's: ``dp`` excludes ``cp``."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    vp: int | None = None
    cp: int | None = None
    dp: int | None = None
    world_size: int | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    group_query_attention: bool | None = None
    kv_channels: int | None = None
    swiglu: bool | None = None
    untie_embeddings: bool | None = None
    padded_vocab_size: int | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: object = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather_with_optimizer_step: bool | None = None
    ddp_bucket_size: int | None = None
    ddp_num_buckets: int | None = None
    pad_buckets_for_high_nccl_busbw: bool | None = None
    use_distributed_optimizer: bool | None = None
    grad_reduce_in_fp32: bool | None = None
    bf16: bool | None = None
    fp16: bool | None = None
    params_dtype: object = None
    optimizer: str | None = None
    use_precision_aware_optimizer: bool | None = None
    num_distributed_optimizer_instances: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    pipeline_layout: object = None
    account_for_embedding: bool | None = None
    account_for_loss: bool | None = None
    ckpt_format: str | None = None
    decoupled_lr: float | None = None
    lr: float | None = None
    min_lr: float | None = None
    weight_decay: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_eps: float | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    add_bias_linear: bool | None = None
    add_qkv_bias: bool | None = None
    normalization: str | None = None
    qk_layernorm: bool | None = None
    transformer_impl: str | None = None
    raw: dict = field(default_factory=dict, repr=False)  # every args field, as read
    source: str | None = None  # the file the args came from, for messages

    def need(self, name: str, why: str):
        """The value of field ``name``; a one-line FormatError naming it and ``why`` when absent."""
        value = getattr(self, name)
        if value is None:
            raise FormatError(f"args has no {_arg_name(name)}: needed for {why}", self.source)
        return value

    @property
    def param_dtype(self) -> str:
        """The model weights' dtype as a statekit name (``BF16``, ``F16``, ``F32``)."""
        if self.bf16:
            return "BF16"
        if self.fp16:
            return "F16"
        if self.bf16 is None and self.fp16 is None:
            raise FormatError("args has neither bf16 nor fp16: the weights' precision is unknown", self.source)
        return "F32"

    def dp_cp_size(self) -> int:
        """The distributed optimizer's group size for dense parameters: DP × CP (§1.1)."""
        dp = self.need("dp", "the distributed optimizer's shard count")
        cp = self.cp or 1
        instances = self.num_distributed_optimizer_instances or 1
        if instances != 1:
            raise FormatError(f"args.num_distributed_optimizer_instances is {instances}: statekit reads only one "
                              "distributed-optimizer instance", self.source)
        return dp * cp

    def expert_dp_size(self) -> int:
        """The expert data-parallel size: world / (ETP × EP × PP)."""
        world = self.world_size
        tp, pp, ep = self.tp or 1, self.pp or 1, self.ep or 1
        etp = self.etp if self.etp is not None else tp
        if world is None:
            world = self.need("dp", "the expert data-parallel size") * (self.cp or 1) * tp * pp
        if world % (etp * ep * pp):
            raise FormatError(f"world size {world} is not a multiple of ETP×EP×PP = {etp * ep * pp}", self.source)
        return world // (etp * ep * pp)

    def experts_in_own_buffer(self) -> bool:
        """Expert parameters have their own buffer (``allreduce=False``) when EP > 1 or ETP ≠ TP."""
        tp = self.tp or 1
        return (self.ep or 1) > 1 or (self.etp is not None and self.etp != tp)

    def bucket_size(self, num_parameters: int, pp_rank: int, chunk: int) -> int | None:
        """The DDP bucket size of model chunk ``chunk`` on pipeline rank ``pp_rank`` (None: one
        bucket), as Megatron resolves it (``resolve_ddp_bucket_size`` and DDP's per-chunk rule):
        ``num_parameters // ddp_num_buckets``, else ``ddp_bucket_size``, else
        ``max(40_000_000, 1_000_000 × dp_cp)``; None without ``overlap_grad_reduce``, on every
        pp rank > 0, for every chunk after the first and with
        ``overlap_param_gather_with_optimizer_step``. ``num_parameters`` counts every parameter
        of the rank's model chunks (``model.parameters()``)."""
        if self.overlap_grad_reduce is None:
            self.need("overlap_grad_reduce", "the distributed optimizer's bucket size")
        if not self.overlap_grad_reduce or pp_rank > 0 or chunk > 0 or self.overlap_param_gather_with_optimizer_step:
            return None
        if self.ddp_num_buckets is not None:
            return num_parameters // self.ddp_num_buckets
        if self.ddp_bucket_size is not None:
            return self.ddp_bucket_size
        return max(40_000_000, 1_000_000 * self.dp_cp_size())

    def version_signals(self) -> dict[str, str]:
        """What ``args`` tells of the mcore release that wrote it (no version field exists, §8.6):
        the args a release introduced, each named with the release."""
        signals: dict[str, str] = {}
        for arg, since in _VERSION_ARGS:
            if arg in self.raw:
                signals[arg] = since
        return signals

    def facts(self) -> dict[str, str]:
        """The run's facts as text, for a checkpoint's metadata (``inspect`` shows them)."""
        out: dict[str, str] = {}
        for key in ("tp", "pp", "ep", "etp", "vp", "cp", "dp", "num_layers", "hidden_size", "ffn_hidden_size",
                    "num_attention_heads", "num_query_groups", "kv_channels", "swiglu", "untie_embeddings",
                    "padded_vocab_size", "num_experts", "use_distributed_optimizer", "overlap_grad_reduce",
                    "ddp_bucket_size", "ddp_num_buckets", "pad_buckets_for_high_nccl_busbw", "bf16", "fp16",
                    "grad_reduce_in_fp32", "optimizer", "lr", "min_lr", "decoupled_lr", "weight_decay", "vocab_size",
                    "normalization", "add_bias_linear", "add_qkv_bias", "qk_layernorm"):
            value = getattr(self, key)
            if value is not None:
                out[f"megatron.{key}"] = str(value)
        for key in _HF_ARGS:  # as read, for a Hugging Face config.json built from the run (ops/megatron_config)
            if self.raw.get(key) is not None:
                out[f"megatron.args.{key}"] = str(self.raw[key])
        return out


# args a Hugging Face model config is built from (ops/megatron_config.py), kept as read
_HF_ARGS = ("layernorm_epsilon", "norm_epsilon", "rotary_base", "rotary_percent", "rotary_interleaved",
            "rotary_scaling_factor", "use_rope_scaling", "rope_type", "mrope_section", "position_embedding_type",
            "max_position_embeddings", "seq_length", "init_method_std", "layernorm_zero_centered_gamma",
            "apply_layernorm_1p", "softmax_type", "train_iters", "global_batch_size", "moe_router_topk",
            "moe_router_pre_softmax", "moe_router_score_function", "moe_router_topk_scaling_factor",
            "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size", "moe_layer_freq",
            "moe_grouped_gemm", "moe_ffn_hidden_size", "moe_aux_loss_coeff", "moe_router_num_groups",
            "moe_z_loss_coeff", "moe_input_jitter_eps", "attention_output_gate", "qk_l2_norm", "no_rope_freq",
            "micro_batch_size",
            "multi_latent_attention", "hidden_dropout", "attention_dropout", "params_dtype", "window_size",
            "glu_linear_offset", "activation_func_clamp_value", "softmax_scale",
            "apply_residual_connection_post_layernorm", "use_mup", "mtp_num_layers", "experimental_attention_variant",
            "is_hybrid_model", "heterogeneous_block_specs", "linear_attention_freq", "rope_scaling_factor")


# args that first appeared in a release (each checked in that tag's arguments.py, §0)
_VERSION_ARGS = (
    ("ddp_pad_buckets_for_high_nccl_busbw", "core >= 0.12"),
    ("dist_ckpt_optim_fully_reshardable", "core >= 0.15"),
    ("ckpt_convert_update_legacy_dist_opt_format", "core >= 0.6"),
)


def _arg_name(name: str) -> str:
    for arg, ours in _RENAMES.items():
        if ours == name:
            return arg
    return name


def _fields(args: object) -> dict:
    if isinstance(args, dict):
        return dict(args)
    fields = getattr(args, "fields", None)
    if isinstance(fields, dict) and getattr(args, "cls", "") in ("argparse.Namespace", "types.SimpleNamespace"):
        return dict(fields)
    raise FormatError(f"args is a {type(args).__name__}, not an argparse.Namespace")


def _typed(name: str, value: object, source: str | None) -> object:
    default = MegatronConfig.__dataclass_fields__[name].type
    if value is None:
        return None
    if "int" in default and "bool" not in default:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FormatError(f"args.{_arg_name(name)} is {value!r}, not an integer", source)
    if "bool" in default and not isinstance(value, bool):
        raise FormatError(f"args.{_arg_name(name)} is {value!r}, not a boolean", source)
    return value


def from_args(args: object, source: str | None = None) -> MegatronConfig:
    """The run's facts from its ``args`` (see the module docstring). Sizes Megatron derives at
    start-up (``data_parallel_size``, ``world_size``) are taken as stored; ``dp`` is derived as
    ``world / (TP × PP × CP)`` only where ``data_parallel_size`` is absent and ``world_size`` is not."""
    raw = _fields(args)
    cfg = MegatronConfig(raw=raw, source=source)
    for arg, ours in _RENAMES.items():
        if ours is None or arg not in raw:
            continue
        if getattr(cfg, ours) is not None:  # the first spelling wins (the newer one is listed first)
            continue
        setattr(cfg, ours, _typed(ours, raw[arg], source))
    if cfg.dp is None and cfg.world_size is not None and cfg.tp and cfg.pp:
        denominator = cfg.tp * cfg.pp * (cfg.cp or 1)
        if cfg.world_size % denominator == 0:
            cfg.dp = cfg.world_size // denominator
    if cfg.world_size is None and cfg.dp and cfg.tp and cfg.pp:
        cfg.world_size = cfg.dp * cfg.tp * cfg.pp * (cfg.cp or 1)
    if cfg.kv_channels is None and cfg.hidden_size and cfg.num_attention_heads:
        if cfg.hidden_size % cfg.num_attention_heads == 0:
            cfg.kv_channels = cfg.hidden_size // cfg.num_attention_heads  # Megatron's own default
    if cfg.num_query_groups is None and cfg.group_query_attention is False and cfg.num_attention_heads:
        cfg.num_query_groups = cfg.num_attention_heads  # no GQA: one group per head (Megatron's default)
    for name in ("tp", "pp", "ep", "cp", "dp"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise FormatError(f"args.{_arg_name(name)} is {value}", source)
    return cfg


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: a multiple of ``divisible_by × TP`` (§4.4)."""
    multiple = divisible_by * tp
    return math.ceil(vocab / multiple) * multiple


def target_cp(cfg: MegatronConfig, cp: int | None, where: str | None) -> int:
    """The context-parallel size of the run a rewritten checkpoint is for (None: the source's),
    refused where Megatron's ``validate_args`` would refuse the run: the sequence must split into
    ``2 × CP`` chunks, and hierarchical CP sizes (whose product must be CP) are not rewritten."""
    source = cfg.cp or 1
    if cp is None:
        return source
    if cp < 1:
        raise UsageError(f"--cp {cp}: a parallel size is at least 1")
    if cp != source and cfg.raw.get("hierarchical_context_parallel_sizes"):
        raise MappingError(f"--cp {cp}: args.hierarchical_context_parallel_sizes is "
                           f"{cfg.raw['hierarchical_context_parallel_sizes']} (its product must be CP): statekit does "
                           "not rewrite it", where)
    seq = cfg.raw.get("seq_length")
    if cp > 1 and isinstance(seq, int) and seq % (2 * cp):
        raise MappingError(f"--cp {cp}: the run's seq_length {seq} is not a multiple of 2 × CP = {2 * cp} (Megatron "
                           "refuses such a run)", where)
    return cp
