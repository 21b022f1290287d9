"""A Hugging Face Llama trained a few steps with torch AdamW, of the architecture of the
megatron-core fixtures (``scripts/make_megatron_fixtures.py`` ``MODEL``: 2 layers, hidden 64,
FFN 64, 4 heads in 2 query groups of kv_channels 16, SwiGLU, RMSNorm, no biases, vocab 100,
untied embeddings), for ``statekit convert … --to megatron --megatron-args`` (HF → Megatron).

Written by real transformers and torch (run with the system Python)::

    python scripts/make_hf_for_megatron_fixture.py

Output ``fixtures/megatron/hf_llama_for_megatron/``: ``model.safetensors`` (the fp32 weights after
the steps, what the Megatron masters come from), ``optimizer.pt`` (``AdamW.state_dict()``, positions
in the groups' order: decay (2-D) then the rest), ``optimizer_names.txt`` (the parameter names in
that order, for ``--names … --names-order optimizer``), ``config.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "megatron" / "hf_llama_for_megatron"
STEPS = 3


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=16,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(config).float()
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() > 1]
    rest = [(n, p) for n, p in model.named_parameters() if p.dim() <= 1]
    order = [n for n, _ in decay + rest]  # the optimizer's positions: group after group
    decay, rest = [p for _, p in decay], [p for _, p in rest]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, 100, (2, 17), generator=g)
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    torch.save(opt.state_dict(), OUT / "optimizer.pt")
    (OUT / "optimizer_names.txt").write_text("\n".join(order) + "\n")
    for extra in ("generation_config.json",):
        (OUT / extra).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
