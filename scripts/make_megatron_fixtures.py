"""Write Megatron-Core optimizer checkpoints with the real megatron-core, on CPU.

The fixtures under ``fixtures/megatron/<mcore-version>/<case>/`` are what
Megatron-LM's own ``megatron.training`` code writes: its argument parser
(``parse_args``/``validate_args``, so the ``args`` in the checkpoint are real),
``initialize_megatron``, ``setup_model_and_optimizer`` (Megatron's DDP, its
distributed or mixed-precision optimizer and LR scheduler), ``train_step`` (its
pipeline schedules, grad reduce-scatter, clipping, Adam step) and
``save_checkpoint``. This script only supplies what ``pretrain_gpt.py`` would:
a GPT model provider (Megatron's ``GPTModel`` with its local layer spec:
Transformer Engine needs CUDA), random token batches and a loss.

Run it with the interpreter of a venv that has megatron-core (it never runs in
statekit's own environment; statekit never imports it)::

    /work/venvs/mcore-0.19.2/bin/python scripts/make_megatron_fixtures.py \
        --out fixtures/megatron [--case NAME ...]
    /work/venvs/mcore-0.16.1/bin/python scripts/make_megatron_fixtures.py \
        --megatron-lm-src /work/venvs/src/Megatron-LM-core_v0.16.1 --out fixtures/megatron

``--verify-resume gpt_torch_dist_dp_reshardable_tp1pp1dp2_next_step`` resumes
that run from its iteration-3 save with Megatron's own ``load_checkpoint``,
trains one step and compares every tensor with the run's own iteration-4 save.

Setup of a venv: ``python3 -m venv /work/venvs/mcore-<ver>``, then
``pip install torch==2.13.0 numpy packaging psutil triton`` (psutil: the
torch_dist writer's worker; triton: imported by 0.19's pipeline schedules) and
``pip install --no-deps megatron-core==<ver>``. The 0.19.x wheels are tagged
cp312 only: ``pip download --no-deps --python-version 3.12 --only-binary=:all:
megatron-core==0.19.2`` and unzip the wheel into the venv's site-packages (its
pure-Python code runs on 3.11 but for ``typing.override``, see the shim).
Megatron-LM's 0.16 ``megatron/training`` also imports six, regex, pyyaml and
pydantic (``pip install`` them). Wheels before 0.19 carry only
``megatron/core``; ``--megatron-lm-src`` then names a Megatron-LM source tree at
the matching tag holding ``megatron/training`` (with its ``megatron/core``
removed so that the wheel's is used): ``git archive core_v0.16.1 megatron``.
None of Megatron-LM's code is in this repository.

The CPU redirects (device placement, streams, RNG, and 0.19's one
Python-3.12-only import) are in ``scripts/mcore_cpu_shim.py``, each with why it
changes no layout. Processes talk over gloo, started with torch's elastic
launcher (``python -m torch.distributed.run``), 1-4 processes per case.

Each case's command line, parallel sizes and model config go to
``fixtures/megatron/manifest.json`` (facts of how the files were made, no value
that statekit computes).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------

MODEL = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 16,
    "swiglu": True,
    "normalization": "RMSNorm",
    "bias_linear": False,
    "position_embedding_type": "rope",
    "seq_length": 16,
    "vocab_size": 100,
    "make_vocab_size_divisible_by": 16,
    "transformer_impl": "local",
    "bf16": True,
}

COMMON = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "64",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "16", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--seq-length", "16", "--max-position-embeddings", "16",
    "--vocab-size", "100", "--make-vocab-size-divisible-by", "16", "--tokenizer-type", "NullTokenizer",
    "--micro-batch-size", "2", "--train-iters", "8",
    "--lr", "0.01", "--min-lr", "0.001", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
    "--init-method-std", "0.02", "--bf16",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
    "--no-persist-layer-norm", "--distributed-backend", "gloo", "--seed", "1234",
    "--log-interval", "1", "--eval-iters", "0", "--save-interval", "1000",
]

MOE = [
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
    "--moe-token-dispatcher-type", "allgather", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "0.01",
]

# name: (tp, pp, ep, dp, extra args, saves, what it is). dp is the dense DP size.
CASES = {
    "gpt_torch_dist_dp_reshardable_tp1pp1dp2": (
        1, 1, 1, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist"],
        [3], "distributed optimizer, dp_reshardable (default), untied embeddings"),
    "gpt_torch_dist_dp_reshardable_tp1pp1dp2_next_step": (
        1, 1, 1, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist"],
        [3, 4], "the run of gpt_torch_dist_dp_reshardable_tp1pp1dp2 saved at 3 and again "
                "one step later at 4 (same run, same seed)"),
    "gpt_torch_dist_dp_reshardable_tp2pp1dp2": (
        2, 1, 1, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist"],
        [3], "distributed optimizer, dp_reshardable, TP2 (one buffer per model-parallel rank, "
             "TP-local shapes), untied embeddings"),
    "gpt_torch_dist_dp_reshardable_tp1pp2dp2": (
        1, 2, 1, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist"],
        [3], "distributed optimizer, dp_reshardable, PP2 (stage-local layers per model-parallel "
             "rank), untied embeddings"),
    "gpt_torch_dist_fully_reshardable_tp2pp1dp2": (
        2, 1, 1, 2,
        ["--use-distributed-optimizer", "--ckpt-format", "torch_dist",
         "--dist-ckpt-optim-fully-reshardable"],
        [3], "distributed optimizer, fully_reshardable, tied embeddings, one bucket"),
    "gpt_torch_dist_fully_reshardable_2buckets_tp1pp1dp2": (
        1, 1, 1, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable",
         "--overlap-grad-reduce", "--ddp-num-buckets", "2"],
        [3], "fully_reshardable with 2 buckets (overlap_grad_reduce): the save of every "
             "released mcore <= 0.19.2 shifts the state of params after bucket 0 "
             "(silent corruption, fixed by Megatron-LM commit 32a03b77c5)"),
    "gpt_torch_dist_no_distopt_tp1pp1dp2": (
        1, 1, 1, 2,
        ["--ckpt-format", "torch_dist"],
        [3], "no distributed optimizer (Float16Optimizer, model-space optimizer.state.*), "
             "tied embeddings"),
    "gpt_torch_distopt_tp2pp2dp1": (
        2, 2, 1, 1,
        ["--use-distributed-optimizer", "--ckpt-format", "torch"],
        [3], "legacy torch format, distributed optimizer (distrib_optim.pt), tied embeddings "
             "(PP2: the output layer holds its own copy in the last stage)"),
    "gpt_torch_no_distopt_tp1pp1dp2": (
        1, 1, 1, 2,
        ["--untie-embeddings-and-output-weights", "--ckpt-format", "torch"],
        [3], "legacy torch format, no distributed optimizer (fp32_from_fp16_params)"),
    "moe_torch_dist_dp_reshardable_ep2dp2": (
        1, 1, 2, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist"] + MOE,
        [3], "MoE, 4 experts top-2, EP2 (expert DP 1, dense DP 2), ChainedOptimizer "
             "dense + expert, dp_reshardable"),
    "moe_torch_dist_fully_reshardable_ep2dp2": (
        1, 1, 2, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable"] + MOE,
        [3], "MoE, 4 experts top-2, EP2 (expert DP 1, dense DP 2), ChainedOptimizer "
             "dense + expert, fully_reshardable"),
    "moe_torch_dist_fully_reshardable_ep1dp2": (
        1, 1, 1, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable"] + MOE,
        [3], "MoE, 4 experts top-2, EP1 (the experts are dense parameters: one optimizer), "
             "fully_reshardable"),
    "moe_torch_dist_dp_reshardable_ep1dp2": (
        1, 1, 1, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist"] + MOE,
        [3], "MoE, 4 experts top-2, EP1 (the experts in the dense buffer: one optimizer), "
             "dp_reshardable"),
    "moe_torch_distopt_ep2dp2": (
        1, 1, 2, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch"] + MOE,
        [3], "MoE, 4 experts top-2, EP2, legacy torch format with distrib_optim.pt lists"),
    "qwen2_torch_qkv_bias_tp1pp1dp1": (
        1, 1, 1, 1,
        ["--untie-embeddings-and-output-weights", "--ckpt-format", "torch", "--add-qkv-bias"],
        [3], "legacy torch format, no distributed optimizer, a q/k/v bias (a Qwen2-shaped model: "
             "the Trainer-folder conversion's qwen2 type)"),
    "gpt_torch_dist_dp_reshardable_cp2dp1": (
        1, 1, 1, 1,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist", "--context-parallel-size", "2"],
        [3], "distributed optimizer, dp_reshardable, context parallel 2 x DP 1: the buckets are "
             "sharded over DP x CP = 2 (attention per CP rank's own chunk: the shim's, see "
             "attention_math)"),
    "gpt_torch_dist_dp_reshardable_cp2dp2": (
        1, 1, 1, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist", "--context-parallel-size", "2"],
        [3], "distributed optimizer, dp_reshardable, context parallel 2 x DP 2: the buckets are "
             "sharded over DP x CP = 4 (attention per CP rank's own chunk: the shim's)"),
    "gpt_torch_dist_dp_reshardable_cp3dp1_buckets2": (
        1, 1, 1, 1,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch_dist", "--context-parallel-size", "3",
         "--seq-length", "12", "--max-position-embeddings", "12",
         "--overlap-grad-reduce", "--ddp-num-buckets", "2"],
        [3], "distributed optimizer, dp_reshardable, context parallel 3 x DP 1, 2 buckets: "
             "bucket ends padded to lcm(DP x CP, 128) = 384, not lcm(DP, 128) = 128, so the second "
             "bucket starts where only the DP x CP size puts it (sequence 12: 2 x CP chunks; "
             "attention per CP rank's own chunk: the shim's)"),
    "gpt_torch_distopt_cp2dp1": (
        1, 1, 1, 1,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer",
         "--ckpt-format", "torch", "--context-parallel-size", "2"],
        [3], "legacy torch format, distributed optimizer (distrib_optim.pt gathered over DP x CP "
             "= 2), context parallel 2 (attention per CP rank's own chunk: the shim's)"),
    "moe_torch_qk_layernorm_tp1pp1dp1": (
        1, 1, 1, 1,
        ["--untie-embeddings-and-output-weights", "--ckpt-format", "torch", "--qk-layernorm"] + MOE,
        [3], "MoE with QK layernorm (a Qwen3-MoE-shaped model: the Trainer-folder conversion's "
             "qwen3_moe type), legacy torch format, no distributed optimizer"),
}

# appended to every case's Megatron arguments (``--model-args``; Megatron's parser keeps the last
# of a repeated option): bench/megatron.py scales the model up with it, never for fixtures
EXTRA_ARGS: list[str] = []

# what each mcore version gets (the older release: cases 1, 2, 4 of the brief)
PER_VERSION = {
    "0.19": list(CASES),
    "0.16": [
        "gpt_torch_dist_dp_reshardable_tp1pp1dp2",
        "gpt_torch_dist_fully_reshardable_tp2pp1dp2",
        "gpt_torch_dist_fully_reshardable_2buckets_tp1pp1dp2",
        "gpt_torch_distopt_tp2pp2dp1",
        "gpt_torch_no_distopt_tp1pp1dp2",
    ],
}


def case_cp(name: str) -> int:
    """The context-parallel size a case's arguments ask for (1 without the option)."""
    extra = CASES[name][4]
    if "--context-parallel-size" in extra:
        return int(extra[extra.index("--context-parallel-size") + 1])
    return 1


def case_argv(name: str, save_dir: str) -> tuple[int, list[str]]:
    tp, pp, ep, dp, extra, saves, _ = CASES[name]
    world = tp * pp * case_cp(name) * dp
    n_micro = 2 if pp > 1 else 1
    gbs = 2 * dp * n_micro
    argv = COMMON + [
        "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp),
        "--expert-model-parallel-size", str(ep),
        "--global-batch-size", str(gbs),
        "--save", save_dir,
    ] + extra + EXTRA_ARGS
    return world, argv


# ---------------------------------------------------------------------------
# worker: runs inside torch.distributed.run, one process per rank
# ---------------------------------------------------------------------------


def _worker(ns: argparse.Namespace) -> None:
    if ns.megatron_lm_src:
        sys.path.insert(0, ns.megatron_lm_src)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mcore_cpu_shim

    mcore_cpu_shim.install()
    if "--context-parallel-size" in ns.megatron_args:
        mcore_cpu_shim.local_cp_attention()

    import torch
    from megatron.core import mpu
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training import get_args
    from megatron.training import initialize as minit
    from megatron.training import training as mtrain
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.checkpointing import save_checkpoint

    saves = [int(s) for s in ns.saves.split(",")]
    sys.argv = ["pretrain_gpt.py"] + shlex.split(ns.megatron_args)

    # Megatron's dataset helpers are compiled with `make` at start-up; no Megatron
    # dataset is used here (batches are random tokens), so that step is skipped.
    minit._compile_dependencies = lambda: None
    init_sig = inspect.signature(minit.initialize_megatron)
    if "extra_args_provider" in init_sig.parameters:  # <= 0.18: it parses the args itself
        minit.initialize_megatron(allow_no_cuda=True)
    else:
        from megatron.training.arguments import parse_args, validate_args
        from megatron.training.global_vars import set_global_variables

        args = parse_args()
        validate_args(args, {})
        set_global_variables(args)
        minit.initialize_megatron(allow_no_cuda=True)
    args = get_args()

    def model_provider(pre_process=True, post_process=True, vp_stage=None, **kw):
        config = core_transformer_config_from_args(args)
        if args.num_experts:
            spec = get_gpt_decoder_block_spec(
                config, use_transformer_engine=False, normalization=args.normalization,
                **({"vp_stage": vp_stage} if "vp_stage" in inspect.signature(
                    get_gpt_decoder_block_spec).parameters else {}))
        else:
            spec = get_gpt_layer_local_spec(
                config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
                normalization=config.normalization)
        kwargs = {}
        if "vp_stage" in inspect.signature(GPTModel.__init__).parameters:
            kwargs["vp_stage"] = vp_stage
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            **kwargs,
        )

    if args.load:
        # --verify-resume only. Without TE/Apex, DistributedOptimizer.state_dict() asserts that
        # torch Adam holds exactly one 'step' value, which is false before the first step, and
        # the torch_dist loading path (sharded_state_dict(is_loading=True)) calls it first: a
        # resume with torch Adam fails at that assert (on GPUs TE's FusedAdam takes the other
        # branch). The states are filled first with Megatron's own dummy fill (the one its
        # fsdp_dtensor load uses); the load then overwrites every moment and master, and the
        # step is set from the loaded param groups below.
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        orig_ssd = DistributedOptimizer.sharded_state_dict

        ssd_sig = inspect.signature(orig_ssd)

        def sharded_state_dict(self, *a, **k):
            is_loading = ssd_sig.bind(self, *a, **k).arguments.get("is_loading", False)
            if is_loading and not self.optimizer.state:
                self._init_optimizer_states_with_dummy_values()
            return orig_ssd(self, *a, **k)

        DistributedOptimizer.sharded_state_dict = sharded_state_dict

        # Same torch-Adam path, fully_reshardable load (load_parameter_state_from_fully_reshardable):
        # the loaded per-parameter tensors leave out torch Adam's 'step' (Megatron keeps the step in
        # the param groups), but _set_main_param_and_optimizer_states indexes every tensor of the
        # parameter's live state, 'step' included: KeyError. A 'step' that is not a tensor is what
        # its loop skips; the step is set from the loaded param groups below.
        orig_set = DistributedOptimizer._set_main_param_and_optimizer_states

        def set_states(self, model_param, tensors):
            if "step" not in tensors:
                tensors = {**tensors, "step": None}
            return orig_set(self, model_param, tensors)

        DistributedOptimizer._set_main_param_and_optimizer_states = set_states

    smo = mtrain.setup_model_and_optimizer
    params = list(inspect.signature(smo).parameters)
    if params[0] == "model_type":
        model, optimizer, scheduler = smo(ModelType.encoder_or_decoder, model_provider)
    else:
        model, optimizer, scheduler = smo(model_provider, ModelType.encoder_or_decoder)

    if args.load:
        # --verify-resume only. On the same torch-Adam path the per-parameter 'step' that torch
        # Adam uses is not restored: after the load every parameter's state shares one step
        # tensor left from the dummy fill (1, not the checkpoint's), while the checkpoint's step
        # is in each param group's 'step' (one step per group is what Megatron saves). Each
        # parameter gets its own copy of its group's loaded step, as an unresumed run has.
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner = getattr(opt, "optimizer", None)
            for group in getattr(inner, "param_groups", []):
                for p in group["params"]:
                    st = inner.state.get(p)
                    if st is not None and "step" in st and "step" in group:
                        st["step"] = torch.tensor(float(group["step"]), dtype=st["step"].dtype)

    dp_rank = mpu.get_data_parallel_rank()
    mbs, seq, vocab = args.micro_batch_size, args.seq_length, args.vocab_size

    start = args.iteration  # 0, or the iteration a --load resumed from
    n_micro = args.global_batch_size // (mbs * args.data_parallel_size)

    def batches():
        step = start * n_micro  # the batches an uninterrupted run would see next
        while True:
            g = torch.Generator().manual_seed(1000 * step + dp_rank)
            tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
            step += 1
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
        if args.context_parallel_size > 1:
            # what pretrain_gpt's get_batch does: each CP rank keeps its zigzag chunks of the
            # sequence (Megatron's own split); the model slices the RoPE table the same way
            from megatron.core.utils import get_batch_on_this_cp_rank

            part = get_batch_on_this_cp_rank(
                {"tokens": tokens, "labels": labels, "position_ids": position_ids,
                 "cu_seqlens": None}, False, cp_group=mpu.get_context_parallel_group())
            tokens, labels, position_ids = part["tokens"], part["labels"], part["position_ids"]
        out = model(tokens, position_ids, None, labels=labels)
        return out, loss_func

    config = get_model_config(model[0])
    # what megatron.training.training.train() sets up before its loop
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    for chunk in model:
        chunk.train()
    config.grad_scale_func = optimizer.scale_loss
    config.timers = mtrain.get_timers()
    if isinstance(model[0], DDP) and args.overlap_grad_reduce:
        config.no_sync_func = [c.no_sync for c in model]
        if len(model) == 1:
            config.no_sync_func = config.no_sync_func[0]
        if args.align_grad_reduce:
            config.grad_sync_func = [c.start_grad_sync for c in model]
            if len(model) == 1:
                config.grad_sync_func = config.grad_sync_func[0]
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = [c.start_param_sync for c in model]
        if len(model) == 1:
            config.param_sync_func = config.param_sync_func[0]
    if getattr(config, "finalize_model_grads_func", None) is None:
        config.finalize_model_grads_func = finalize_model_grads
    get_rerun_state_machine().current_iteration = start
    fb = get_forward_backward_func()
    from megatron.core.rerun_state_machine import RerunDataIterator

    data = RerunDataIterator(batches())  # as Megatron's own data iterators are wrapped
    flops = args.num_floating_point_operations_so_far
    iteration = start
    gbs = args.global_batch_size
    ts_params = inspect.signature(mtrain.train_step).parameters
    for target in saves:
        while iteration < target:
            call = dict(iteration=iteration) if "iteration" in ts_params else {}
            out = mtrain.train_step(forward_step, data, model, optimizer, scheduler, config, fb,
                                    **call)
            skipped = out[1]
            if skipped:
                raise SystemExit(f"iteration {iteration + 1}: Megatron skipped the step")
            iteration += 1
            if torch.distributed.get_rank() == 0:
                print(f"iteration {iteration}: loss {out[0]} grad norm {out[5]}", flush=True)
            args.iteration = iteration
            args.consumed_train_samples += gbs
            flops += mtrain.num_floating_point_operations(args, gbs)
        save_checkpoint(iteration, model, optimizer, scheduler, flops)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        import megatron.core

        facts = {
            "padded_vocab_size": args.padded_vocab_size,
            "data_parallel_size": args.data_parallel_size,
            "world_size": args.world_size,
            "megatron_core_version": megatron.core.__version__,
            "torch_version": torch.__version__,
        }
        Path(ns.facts).write_text(json.dumps(facts))
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------


def _mcore_version(src: str | None) -> str:
    code = "import megatron.core; print(megatron.core.__version__)"
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tempfile.gettempdir())
    if out.returncode:
        raise SystemExit(f"megatron-core does not import in {sys.executable}: {out.stderr[-500:]}")
    return out.stdout.strip().splitlines()[-1]


def run_case(name: str, version: str, out_root: Path, src: str | None, port: int) -> dict:
    tp, pp, ep, dp, extra, saves, what = CASES[name]
    dest = out_root / version / name
    # a fixed place (the path is recorded in args.save and the DCP metadata)
    tmp = Path(tempfile.gettempdir()) / "mcore-fixtures-run" / version / name
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_dir = tmp / "ckpt"
    world, argv = case_argv(name, str(save_dir))
    facts = tmp / "facts.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           f"--master-port={port}", str(Path(__file__).resolve()), "--worker",
           "--saves", ",".join(map(str, saves)), "--facts", str(facts),
           "--megatron-args", shlex.join(argv)]
    if src:
        cmd += ["--megatron-lm-src", src]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    log = tmp / "log.txt"
    print(f"[{version}] {name}: {world} processes ...", flush=True)
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                            cwd=tempfile.gettempdir()).returncode
    if rc:
        tail = log.read_text()[-6000:]
        raise RuntimeError(f"{name} failed (rc {rc}); log {log}:\n{tail}")
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(save_dir, dest)
    got = json.loads(facts.read_text())
    logs = Path(tempfile.gettempdir()) / "mcore-fixture-logs"
    logs.mkdir(exist_ok=True)
    shutil.copy(log, logs / f"{version}-{name}.log")
    shutil.rmtree(tmp)
    shown = [a if a != str(save_dir) else f"<out>/{version}/{name}" for a in argv]
    return {
        "case": name,
        "what": what,
        "megatron_core_version": got["megatron_core_version"],
        "torch_version": got["torch_version"],
        "format": "torch_dist" if "torch_dist" in argv else "torch",
        "distributed_optimizer": "--use-distributed-optimizer" in argv,
        "optimizer_sharding_type": (
            None if "--use-distributed-optimizer" not in argv or "torch_dist" not in argv
            else "fully_reshardable" if "--dist-ckpt-optim-fully-reshardable" in argv
            else "dp_reshardable"),
        "tp": tp, "pp": pp, "ep": ep, "cp": case_cp(name), "dp": dp,
        "expert_dp": world // (tp * ep * pp) if "--num-experts" in argv else None,
        "world_size": world,
        "iterations_saved": saves,
        "padded_vocab_size": got["padded_vocab_size"],
        "tied_embeddings": "--untie-embeddings-and-output-weights" not in argv,
        "moe": "--num-experts" in argv,
        "model": MODEL | ({"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}
                          if "--num-experts" in argv else {})
                 | ({"seq_length": int(extra[extra.index("--seq-length") + 1])}
                    if "--seq-length" in extra else {}),
        "params_dtype": "bfloat16 (fp32 masters in the optimizer)",
        "adam": "torch.optim.AdamW (no TE/Apex on CPU), via megatron's optimizer",
        "launcher": f"python -m torch.distributed.run --nproc-per-node={world} (gloo, CPU)",
        "megatron_args": shlex.join(shown),
    } | ({"attention_math": (
        "the CPU shim's (scripts/mcore_cpu_shim.py local_cp_attention): each CP rank attends "
        "within its own sequence chunks, not ring attention across ranks; the values differ "
        "from a TE run's, the parameters, buckets and optimizer layout do not")}
        if case_cp(name) > 1 else {})


_COMPARE = r"""
import sys, warnings
warnings.filterwarnings("ignore")
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
a, b, tmp = sys.argv[1:4]
dcp_to_torch_save(a, tmp + "/a.pt")
dcp_to_torch_save(b, tmp + "/b.pt")
sa = torch.load(tmp + "/a.pt", weights_only=False)
sb = torch.load(tmp + "/b.pt", weights_only=False)
ta = {k for k, v in sa.items() if isinstance(v, torch.Tensor)}
tb = {k for k, v in sb.items() if isinstance(v, torch.Tensor)}
assert ta == tb, sorted(ta ^ tb)
bad = [k for k in sorted(ta) if not torch.equal(sa[k], sb[k])]
print(f"{len(ta)} tensors compared, {len(bad)} differ")
for k in bad:
    print("  differs:", k)
sys.exit(1 if bad else 0)
"""


def verify_resume(name: str, version: str, out_root: Path, src: str | None, port: int) -> None:
    """Resume the saved run at its first iteration with Megatron's own load, train one step,
    save, and compare every tensor with the run's own next save (bit for bit)."""
    tp, pp, ep, dp, extra, saves, _ = CASES[name]
    if len(saves) < 2 or "torch_dist" not in extra:
        raise SystemExit(f"{name}: not a torch_dist case saved twice")
    first, second = saves[0], saves[1]
    fixture = (out_root / version / name).resolve()
    tmp = Path(tempfile.gettempdir()) / "mcore-fixtures-run" / version / f"{name}-resume"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "load").mkdir(parents=True)
    shutil.copytree(fixture / f"iter_{first:07d}", tmp / "load" / f"iter_{first:07d}")
    (tmp / "load" / "latest_checkpointed_iteration.txt").write_text(str(first))
    world, argv = case_argv(name, str(tmp / "ckpt"))
    argv += ["--load", str(tmp / "load")]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           f"--master-port={port}", str(Path(__file__).resolve()), "--worker",
           "--saves", str(second), "--facts", str(tmp / "facts.json"),
           "--megatron-args", shlex.join(argv)]
    if src:
        cmd += ["--megatron-lm-src", src]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    with open(tmp / "log.txt", "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                            cwd=tempfile.gettempdir()).returncode
    if rc:
        raise SystemExit(f"resume of {name} failed (rc {rc}); log {tmp / 'log.txt'}")
    rc = subprocess.run([sys.executable, "-c", _COMPARE,
                         str(tmp / "ckpt" / f"iter_{second:07d}"),
                         str(fixture / f"iter_{second:07d}"), str(tmp)],
                        cwd=tempfile.gettempdir()).returncode
    print(f"[{version}] {name}: resumed from {first} and stepped once: "
          + ("bit for bit the run's own save at " if rc == 0 else "DIFFERS from the save at ")
          + str(second), flush=True)
    if rc:
        raise SystemExit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="fixtures/megatron")
    p.add_argument("--case", action="append", help="only these cases (default: all for the version)")
    p.add_argument("--megatron-lm-src", help="Megatron-LM source tree with megatron/training "
                   "(needed when the megatron-core wheel lacks it, i.e. before 0.19)")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--model-args", default="", help="Megatron arguments appended to each case's "
                   "(e.g. '--hidden-size 1024 --num-layers 4'): bench/megatron.py's big checkpoints")
    p.add_argument("--verify-resume", metavar="CASE", help="resume CASE (a case saved twice) "
                   "from its first save with Megatron's load, step once, compare with its second")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--saves", help=argparse.SUPPRESS)
    p.add_argument("--facts", help=argparse.SUPPRESS)
    p.add_argument("--megatron-args", help=argparse.SUPPRESS)
    ns = p.parse_args()
    EXTRA_ARGS[:] = shlex.split(ns.model_args)
    if ns.worker:
        _worker(ns)
        return
    if ns.megatron_lm_src:
        os.environ["PYTHONPATH"] = ns.megatron_lm_src + os.pathsep + os.environ.get("PYTHONPATH", "")
    version = _mcore_version(ns.megatron_lm_src)
    series = ".".join(version.split(".")[:2])
    names = ns.case or PER_VERSION.get(series)
    if not names:
        raise SystemExit(f"no cases for megatron-core {version}")
    out_root = Path(ns.out)
    if ns.verify_resume:
        verify_resume(ns.verify_resume, version, out_root, ns.megatron_lm_src, ns.port)
        return
    manifest_path = out_root / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.setdefault("about", "How each checkpoint under fixtures/megatron/ was made "
                        "(scripts/make_megatron_fixtures.py). Facts of the run only.")
    cases = manifest.setdefault("cases", {})
    failed = []
    for i, name in enumerate(names):
        try:
            entry = run_case(name, version, out_root, ns.megatron_lm_src, ns.port + i)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            failed.append(name)
            continue
        cases[f"{version}/{name}"] = entry
        manifest["cases"] = dict(sorted(cases.items()))
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"[{version}] {name}: ok", flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
