#!/usr/bin/env python3
"""Fixtures for structural refactors (docs/resume-after-refactor.md), made with real torch 2.13 and
transformers 5.x, tiny enough to commit (fixtures/refactor/):

- ``llama-optim.pt``: torch AdamW state (with ``param_names``) of a tiny Llama whose q_proj/k_proj rows
  are in Meta's layout, after 4 steps; ``llama.safetensors``: its weights;
- ``phi3.pt``: the same model converted as a user converts it to ``Phi3ForCausalLM``: q and k
  permuted as transformers' ``convert_llama_weights_to_hf.py`` ``permute`` does, q/k/v joined into
  ``qkv_proj``, gate/up into ``gate_up_proj``, the vocabulary grown by 8 rows (checked: Phi-3 computes
  the same logits on the old tokens); ``phi3-edited.pt``: one value changed; ``phi3-qkv-edited.pt`` and
  ``phi3-qkv-last-row.pt``: ``phi3.pt`` with one element of a fused ``qkv_proj`` changed, in a q row the
  RoPE permute moved and in v's last row (issue 38: refused at that element, never moved by path or
  taken for a grown row);
  ``phi3.bpk``: the Phi-3 weights as a burn model (Linear weights [d_in, d_out], ParamIds);
- ``mixtral-optim.pt``, ``mixtral-v4.safetensors``: a tiny Mixtral with per-expert weights
  (``experts.{e}.w1/w2/w3``, transformers v4's layout) after 4 AdamW steps; ``mixtral-v5.safetensors``:
  what transformers v5's own ``from_pretrained`` makes of the v4 checkpoint (experts stacked into
  ``gate_up_proj`` and ``down_proj`` by its WeightConverter).

    python scripts/make_refactor_fixtures.py          # writes fixtures/refactor/
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "fixtures", "refactor")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

SIZES = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
GROW = 8


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(3, SIZES["vocab_size"], (4, 9), generator=g)
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def save(tensors: dict, name: str) -> None:
    """safetensors for the old weights (the optimizer names its positions); a torch state_dict (.pt) for the
    new, whose order is the new model's named_parameters() order, which torch pairs state with."""
    path = os.path.join(OUT, name)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    if name.endswith(".pt"):
        torch.save(tensors, path)
    else:
        save_file(tensors, path)
    print(f"{path}: {os.path.getsize(path)} bytes")


def llama_to_phi3() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    old = LlamaForCausalLM(LlamaConfig(**SIZES))
    heads, kv = SIZES["num_attention_heads"], SIZES["num_key_value_heads"]
    head_dim = SIZES["hidden_size"] // heads
    q_rows = permute(torch.arange(heads * head_dim, dtype=torch.float64).view(-1, 1), heads).view(-1).long()
    k_rows = permute(torch.arange(kv * head_dim, dtype=torch.float64).view(-1, 1), kv).view(-1).long()
    for layer in old.model.layers:  # Meta's layout: rows permuted on the way out, as the HF layout computes
        layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: o[..., q_rows])
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: o[..., k_rows])
    opt = torch.optim.AdamW(old.named_parameters(), lr=1e-2)
    train(old, opt, 4, 1)
    torch.save(opt.state_dict(), os.path.join(OUT, "llama-optim.pt"))
    weights = {k: v.detach() for k, v in old.state_dict().items()}
    save(weights, "llama.safetensors")
    new = Phi3ForCausalLM(Phi3Config(**{**SIZES, "vocab_size": SIZES["vocab_size"] + GROW}))
    converted = {}
    g = torch.Generator().manual_seed(3)
    for name, like in new.state_dict().items():
        if "qkv_proj" in name:
            q, k, v = (weights[name.replace("qkv_proj", f"{x}_proj")] for x in "qkv")
            converted[name] = torch.cat([permute(q, heads), permute(k, kv), v])
        elif "gate_up_proj" in name:
            converted[name] = torch.cat([weights[name.replace("gate_up_proj", f"{x}_proj")] for x in ("gate", "up")])
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = torch.randn(GROW, like.shape[1], generator=g) * 0.02
            converted[name] = torch.cat([weights[name], rows])
        else:
            converted[name] = weights[name]
    new.load_state_dict(converted)
    x = torch.randint(3, SIZES["vocab_size"], (2, 7))
    assert torch.allclose(old(x).logits, new(x).logits[..., : SIZES["vocab_size"]], atol=1e-5)
    save(converted, "phi3.pt")
    edited = dict(converted)
    edited["model.layers.1.mlp.gate_up_proj.weight"] = converted["model.layers.1.mlp.gate_up_proj.weight"].clone()
    edited["model.layers.1.mlp.gate_up_proj.weight"][30, 5] += 0.5
    save(edited, "phi3-edited.pt")
    burn_model(converted, "phi3.bpk")


QKV_EDITS = {"phi3-qkv-edited.pt": (1, 7), "phi3-qkv-last-row.pt": (31, 4)}  # (row, column) of layer 0's qkv_proj


def qkv_edited() -> None:
    """phi3.pt (as written above) with one element of model.layers.0.self_attn.qkv_proj.weight changed."""
    weights = torch.load(os.path.join(OUT, "phi3.pt"), weights_only=True)
    for name, (row, col) in QKV_EDITS.items():
        edited = dict(weights)
        edited["model.layers.0.self_attn.qkv_proj.weight"] = weights["model.layers.0.self_attn.qkv_proj.weight"].clone()
        edited["model.layers.0.self_attn.qkv_proj.weight"][row, col] += 0.5
        save(edited, name)


def burn_model(weights: dict, name: str) -> None:
    from statekit import paramid
    from statekit.formats.burnpack import PackTensor, write_burnpack
    from statekit.tensor import TensorRef

    tensors = []
    for path, w in weights.items():
        value = w.T.contiguous() if w.dim() == 2 and "embed_tokens" not in path else w  # burn's Linear [in, out]
        tensors.append(PackTensor(path, TensorRef.from_array(value.numpy()), param_id=paramid.generated(path)))
    path = os.path.join(OUT, name)
    write_burnpack(path, tensors)
    print(f"{path}: {os.path.getsize(path)} bytes")


def mixtral_stacked() -> None:
    from test_remap_structure_hf import PerExpert
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    old = MixtralForCausalLM(config)
    for layer in old.model.layers:
        layer.mlp.experts = PerExpert(layer.mlp.experts)
    opt = torch.optim.AdamW(old.named_parameters(), lr=1e-2)
    train(old, opt, 4, 1)
    torch.save(opt.state_dict(), os.path.join(OUT, "mixtral-optim.pt"))
    weights = {k: v.detach() for k, v in old.state_dict().items()}
    save(weights, "mixtral-v4.safetensors")
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        save_file({k.replace(".mlp.", ".block_sparse_moe."): v.contiguous() for k, v in weights.items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        new = MixtralForCausalLM.from_pretrained(folder)
    stacked = new.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(stacked[1], torch.cat([weights["model.layers.0.mlp.experts.1.w1.weight"],
                                              weights["model.layers.0.mlp.experts.1.w3.weight"]]))
    save(new.state_dict(), "mixtral-v5.pt")


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    np.random.seed(0)
    llama_to_phi3()
    qkv_edited()
    mixtral_stacked()


if __name__ == "__main__":
    main()
