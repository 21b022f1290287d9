"""Megatron-Bridge's own Megatron → Hugging Face mapping of a megatron-core checkpoint, as reference files.

Runs NVIDIA-NeMo/Megatron-Bridge 0.6.2's conversion code — ``LlamaBridge.mapping_registry()`` (which HF
tensor each Megatron parameter becomes) and its ``AutoMapping`` / ``QKVMapping`` / ``GatedMLPMapping``
``megatron_to_hf`` (the q/k/v split per query group, the gate/up split) — on the fixture
``fixtures/megatron/<ver>/gpt_torch_no_distopt_tp1pp1dp2`` (a legacy save: its model weights and its
``Float16Optimizer`` moments read with ``torch.load``), and writes what Bridge makes of the weights and of each
moment moved by the same mapping to ``fixtures/megatron_bridge/0.6.2/<case>/{weights,exp_avg,exp_avg_sq}
.safetensors``. ``tests/test_megatron_hf_folder.py`` compares statekit's Trainer folder with them element for
element.

What is Bridge's and what is not: Bridge's export (``AutoBridge.export_hf_weights``) needs a Megatron model
built by its provider and torch.distributed; here the mappings get the run's own ``GPTModel`` (built on CPU from the
checkpoint's args by Megatron's ``core_transformer_config_from_args`` and local layer spec, as the fixture
generator builds it; its modules' classes tell the mappings how each tensor is sharded) under a gloo group of
one process (TP = PP = 1, so no shard is gathered), and the checkpoint's tensors. Bridge's export strips
the vocabulary padding rows to the HF ``vocab_size`` (``megatron-formats.md`` §4.4); the mapping does not, so
this script cuts the embedding and output rows to ``args.vocab_size``. Megatron-Bridge does not install on
Python 3.11 / CPU (it requires Python ≥ 3.12, transformers ≤ 5.12.1, Transformer Engine, flashinfer…): its
wheel is unzipped and only ``megatron/bridge/models/conversion`` and ``models/llama`` are imported, with empty
package modules standing in for the ``__init__`` files that import every model bridge, and a stub for
``conversion/peft_bridge.py`` (its LoRA half needs Transformer Engine; never called here).

Run (a venv with megatron-core 0.19.2, torch 2.13 and transformers 5.12.1; Bridge's wheel unzipped in
BRIDGE)::

    python scripts/make_megatron_bridge_reference.py --bridge BRIDGE --out fixtures/megatron_bridge
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import types
from pathlib import Path

CASE = "gpt_torch_no_distopt_tp1pp1dp2"
MOE_CASE = "moe_torch_distopt_ep2dp2"


def _packages(bridge: str) -> None:
    """``megatron.bridge`` without running its ``__init__`` files (they import every model's bridge)."""
    import megatron

    root = os.path.join(bridge, "megatron", "bridge")
    for name in ("", ".models", ".models.conversion", ".utils", ".models.llama", ".peft", ".models.gpt",
                 ".models.hf_pretrained", ".models.decorators", ".models.qwen"):
        mod = types.ModuleType("megatron.bridge" + name)
        mod.__path__ = [os.path.join(root, *name.split(".")[1:])]
        sys.modules["megatron.bridge" + name] = mod
    megatron.__path__.append(os.path.join(bridge, "megatron"))

    class _Anything(types.ModuleType):  # Bridge's PEFT (LoRA) half: needs Transformer Engine, never called here
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    name = "megatron.bridge.models.conversion.peft_bridge"
    sys.modules[name] = _Anything(name)


def _model(args, config):
    """The run's GPTModel (Megatron's local spec, as the fixture generator builds it): the modules Bridge's
    mappings look at (their class decides how a tensor is sharded). Its own weights are not used."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    spec = get_gpt_layer_local_spec(config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
                                    normalization=config.normalization)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bridge", required=True, help="Megatron-Bridge 0.6.2's wheel, unzipped")
    ap.add_argument("--fixtures", default="fixtures/megatron/0.19.2")
    ap.add_argument("--out", default="fixtures/megatron_bridge")
    ns = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mcore_cpu_shim

    mcore_cpu_shim.install()
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    _packages(ns.bridge)
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge
    from megatron.training.arguments import core_transformer_config_from_args

    f = glob.glob(f"{ns.fixtures}/{CASE}/iter_*/mp_rank_00/model_optim_rng.pt")[0]
    ckpt = torch.load(f, weights_only=False, map_location="cpu")
    args = ckpt["args"]
    config = core_transformer_config_from_args(args)
    gpt = _model(args, config)
    model = [(k, v) for k, v in ckpt["model"].items() if torch.is_tensor(v) and "_extra_state" not in k]
    decay = [k for k, v in model if v.dim() == 2]  # Megatron's param groups: decayed, then norms
    norms = [k for k, v in model if v.dim() == 1]
    sd = ckpt["optimizer"]["optimizer"]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    state = {name: sd["state"][i] for name, i in zip(decay + norms, ids, strict=True)}
    registry = LlamaBridge().mapping_registry()
    out = {"weights": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, weight in model:
        mapping = registry.megatron_to_hf_lookup(name)
        if mapping is None:
            raise SystemExit(f"Megatron-Bridge has no mapping for {name}")
        for kind, tensor in (("weights", weight), ("exp_avg", state[name]["exp_avg"]),
                             ("exp_avg_sq", state[name]["exp_avg_sq"])):
            module = gpt.get_submodule(name.rsplit(".", 1)[0])
            for hf, value in mapping.megatron_to_hf(tensor.clone(), module).items():
                if hf in ("model.embed_tokens.weight", "lm_head.weight"):
                    value = value[: args.vocab_size]  # Bridge's export: HF vocab_size rows (see above)
                out[kind][hf] = value.contiguous()
    dest = Path(ns.out) / "0.6.2" / CASE
    dest.mkdir(parents=True, exist_ok=True)
    for kind, tensors in out.items():
        save_file(tensors, dest / f"{kind}.safetensors", metadata={"source": f"{CASE}, Megatron-Bridge 0.6.2"})
    print(f"wrote {dest}: {len(out['weights'])} tensors each")
    _moe(ns, config_from_args=core_transformer_config_from_args)
    dist.destroy_process_group()


def _moe(ns, config_from_args) -> None:
    """The MoE case, weights only: Qwen3MoEBridge's mappings (the Megatron-Bridge MoE bridge of a Llama-like
    model with SwiGLU experts; its HF names are per expert, ``mlp.experts.{e}.gate_proj.weight`` …) of the
    legacy EP2 save's bf16 weights. Expert ``l`` of EP rank ``r``'s folder is global expert ``r·E/EP + l``
    (Megatron's own numbering, §4.5); the moments of this save are in ``distrib_optim.pt``'s bucket space, which
    torch alone does not name, so none are written."""
    import torch
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from safetensors.torch import save_file

    files = sorted(glob.glob(f"{ns.fixtures}/{MOE_CASE}/iter_*/mp_rank_00_00[0-9]/model_optim_rng.pt"))
    ckpts = [torch.load(f, weights_only=False, map_location="cpu") for f in files]
    args = ckpts[0]["args"]
    ep, experts = args.expert_model_parallel_size, args.num_experts
    if len(files) != ep:
        raise SystemExit(f"{MOE_CASE}: {len(files)} EP folders, args say EP {ep}")
    weights = {}
    for rank, ckpt in enumerate(ckpts):
        for name, value in ckpt["model"].items():
            if not torch.is_tensor(value) or "_extra_state" in name:
                continue
            parts = name.split(".")
            if "local_experts" in parts:
                at = parts.index("local_experts") + 1
                parts[at] = str(rank * (experts // ep) + int(parts[at]))
            elif rank:
                continue  # dense parameters: every EP rank holds the same; rank 0's
            weights[".".join(parts)] = value
    args.expert_model_parallel_size = 1  # one process builds all experts (the modules only tell the sharding)
    config = config_from_args(args)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                   max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                   share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                   position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                   rotary_base=args.rotary_base)
    registry = Qwen3MoEBridge().mapping_registry()
    out = {}
    for name, weight in weights.items():
        mapping = registry.megatron_to_hf_lookup(name)
        if mapping is None:
            raise SystemExit(f"Megatron-Bridge has no mapping for {name}")
        for hf, value in mapping.megatron_to_hf(weight.clone(), gpt.get_submodule(name.rsplit(".", 1)[0])).items():
            if hf in ("model.embed_tokens.weight", "lm_head.weight"):
                value = value[: args.vocab_size]
            out[hf] = value.contiguous()
    dest = Path(ns.out) / "0.6.2" / MOE_CASE
    dest.mkdir(parents=True, exist_ok=True)
    save_file(out, dest / "weights.safetensors", metadata={"source": f"{MOE_CASE}, Megatron-Bridge 0.6.2"})
    print(f"wrote {dest}: {len(out)} tensors")


if __name__ == "__main__":
    main()
