"""Megatron-Bridge 0.6.2's own training loop on CPU, for a Bridge checkpoint fixture (WORK IN PROGRESS).

**Status (2026-12-07 16:47 UTC):** Bridge's ``pretrain`` builds the run: a tiny Llama-like
``GPTModelProvider`` (2 layers, hidden 64, 4 heads, 2 query groups, SwiGLU, RMSNorm, RoPE, bf16, untied), mock
GPT data, Bridge's ``distributed_fused_adam_with_cosine_annealing`` optimizer, the distributed optimizer, and 2
gloo processes (DP 2). It trains 3 iterations (lm loss 4.65 → 3.91) and saves through Bridge's own
``save_checkpoint`` (torch_dist, dp_reshardable): ``fixtures/megatron_bridge/0.6.2/
bridge_gpt_torch_dist_dp_reshardable_dp2``, 1.1 MB. Two earlier runs with ``fully_parallel_save=True`` and one
with it off hung after "Storing distributed optimizer sharded state of type dp_reshardable". The committed run
(the same settings as that last one, from this file) finished. The cause of the hang was not found: rerun if it
hangs. statekit reads the folder (run_config.yaml for the layout, train_state.pt for the position:
``tests/test_megatron_bridge_folder.py``).

Run (see ``bridge_cpu_imports.py`` for the venv; HELPERS is Megatron's own
``megatron/core/datasets/helpers.cpp`` compiled for Python 3.11 with pybind11, as its ``make`` would, because
the 0.19.2 wheel ships only the cp312 ``.so``)::

    TORCHDYNAMO_DISABLE=1 PYTHONPATH=EXTRA torchrun --nproc-per-node 2 \\
        scripts/make_megatron_bridge_fixtures.py BRIDGE HELPERS_SO OUT

Patches on top of ``mcore_cpu_shim`` and ``bridge_cpu_imports``, and why they change no saved layout:
``initialize_megatron(allow_no_cuda=True)`` is Bridge's own option. Dataset helpers come from the compiled
``helpers.cpp`` and are not ``make``-compiled at start-up. The JIT fusion warm-up is skipped, and the model's
fusions are off: they are kernels for the same arithmetic. ``TORCHDYNAMO_DISABLE=1`` runs eagerly because
inductor asks the shim's fake device for ``gcnArchName``. The ``recipes`` packages' ``__init__`` files are not
run, since they import every model recipe. ``peft.lora_layers`` is stubbed: ``flop_utils`` imports LoRA, which
needs Transformer Engine and is never built here.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys


def _install(bridge: str, helpers_so: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bridge_cpu_imports
    import mcore_cpu_shim

    mcore_cpu_shim.install()
    bridge_cpu_imports.EMPTY.update({"megatron.bridge.recipes", "megatron.bridge.recipes.utils"})
    bridge_cpu_imports.install(bridge)
    spec = importlib.util.spec_from_file_location("megatron.core.datasets.helpers_cpp", helpers_so)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    sys.modules["megatron.core.datasets.helpers_cpp"] = helpers
    name = "megatron.bridge.peft.lora_layers"
    sys.modules[name] = bridge_cpu_imports._Anything(name)
    import megatron.bridge.training.initialize as ini
    import megatron.bridge.training.setup as setup

    ini.compile_helpers = lambda: None
    ini._warmup_jit_function = lambda *a, **k: None
    setup.initialize_megatron = functools.partial(setup.initialize_megatron, allow_no_cuda=True)


def _config(out: str):
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedInitConfig,
        GPTDatasetConfig,
        LoggerConfig,
        RNGConfig,
        TrainingConfig,
        ValidationConfig,
    )
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.core.distributed import DistributedDataParallelConfig

    opt, sched = distributed_fused_adam_with_cosine_annealing(lr_warmup_iters=1, lr_decay_iters=3, max_lr=1e-2,
                                                              min_lr=1e-3)
    model = GPTModelProvider(
        num_layers=2, transformer_layer_spec=local_layer_spec, hidden_size=64, ffn_hidden_size=64,
        num_attention_heads=4, num_query_groups=2, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
        share_embeddings_and_output_weights=False, seq_length=32, vocab_size=100, make_vocab_size_divisible_by=16,
        bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    dataset = GPTDatasetConfig(random_seed=1234, reset_attention_mask=False, reset_position_ids=False,
                               eod_mask_loss=False, seq_length=32, num_dataset_builder_threads=1, blend=None,
                               blend_per_split=None, split="1,1,1", data_sharding=True, dataloader_type="single",
                               skip_getting_attention_mask_from_dataset=True)
    cfg = ConfigContainer(
        model=model, train=TrainingConfig(train_iters=3, global_batch_size=4, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0), optimizer=opt, scheduler=sched,
        ddp=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        dataset=dataset, logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100),
        checkpoint=CheckpointConfig(save_interval=3, save=out, ckpt_format="torch_dist", fully_parallel_save=False,
                                    async_save=False),
        rng=RNGConfig(seed=1234), dist=DistributedInitConfig(), mixed_precision="bf16_mixed")
    cfg.dist.distributed_backend = "gloo"
    cfg.optimizer.use_precision_aware_optimizer = False
    return cfg


def main() -> None:
    bridge, helpers_so, out = sys.argv[1:4]
    _install(bridge, helpers_so)
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    pretrain(_config(out), forward_step)


if __name__ == "__main__":
    main()
