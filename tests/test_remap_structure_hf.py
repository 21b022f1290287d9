"""Structural remaps of real transformers models (marked hf: CI installs transformers).

1. A tiny Llama in Meta's layout (q and k rows as Meta's checkpoints keep them; the model permutes
   q_proj/k_proj outputs, so it computes what the HF layout computes) becomes a Phi-3
   (``Phi3ForCausalLM``: ``qkv_proj``, ``gate_up_proj``): q and k permuted as transformers'
   ``convert_llama_weights_to_hf.py`` ``permute`` does, then joined.
2. A tiny Mixtral with per-expert weights (``experts.{e}.w1/w2/w3``, transformers v4's layout) is
   saved as a v4 checkpoint and loaded by transformers v5's own ``from_pretrained``, whose
   ``WeightConverter`` stacks the experts into ``gate_up_proj [E, 2I, H]`` and ``down_proj``.

In both, ``statekit remap`` learns the map from the two weight files alone; every moment must move
bit for bit as its weight moved, torch's AdamW must load the result, and 3 more steps of both models
must stay together (max |Δw| ≤ 1 % of a cold optimizer's deviation).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

F, nn = torch.nn.functional, torch.nn
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``permute`` of transformers' src/transformers/models/llama/convert_llama_weights_to_hf.py (Meta → HF)."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def rows_of(n: int, heads: int) -> torch.Tensor:
    return permute(torch.arange(n, dtype=torch.float64).view(-1, 1), heads).view(-1).long()


def data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SIZES["vocab_size"], (4, 9), generator=g) for _ in range(n)]


def train(model, opt, batches):
    for x in batches:
        logits = model(x).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def by_name(sd: dict, names: list[str]) -> dict:
    return {n: sd["state"][i] for i, n in enumerate(names) if i in sd["state"]}


def remapped(tmp_path, cli, old_model, new_state_dict, opt):
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    torch.save({k: v.detach() for k, v in old_model.state_dict().items()}, tmp_path / "old.pt")
    torch.save(new_state_dict, tmp_path / "new.pt")
    r = cli("remap", tmp_path / "optim.pt", "--old-model", tmp_path / "old.pt", "--model", tmp_path / "new.pt",
            "-o", tmp_path / "out.pt", "--plan-out", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    return torch.load(tmp_path / "out.pt", weights_only=True), json.loads((tmp_path / "plan.json").read_text())


def goes_on_together(old, opt, new, make, out, convert):
    resumed = make(new.parameters())
    resumed.load_state_dict(out)
    cold_model = type(new)(new.config)
    cold_model.load_state_dict(new.state_dict())
    cold = make(cold_model.parameters())
    batches = data(3, 5)
    train(old, opt, batches)
    train(new, resumed, batches)
    train(cold_model, cold, batches)
    expect = convert({k: v.detach() for k, v in old.state_dict().items()})
    drift = max((new.state_dict()[k] - v).abs().max().item() for k, v in expect.items())
    cold_drift = max((cold_model.state_dict()[k] - v).abs().max().item() for k, v in expect.items())
    assert cold_drift > 0 and drift <= 0.01 * cold_drift, (drift, cold_drift)


def test_meta_llama_into_phi3_permuted_and_fused(tmp_path, cli):
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    old = LlamaForCausalLM(LlamaConfig(**SIZES))
    heads, kv, head_dim = SIZES["num_attention_heads"], SIZES["num_key_value_heads"], 8
    q_rows, k_rows = rows_of(heads * head_dim, heads), rows_of(kv * head_dim, kv)
    for layer in old.model.layers:  # Meta's layout: the HF model's rows, unpermuted, permuted on the way out
        layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: o[..., q_rows])
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: o[..., k_rows])
    make = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
    opt = make(old.parameters())
    train(old, opt, data(4, 1))
    new = Phi3ForCausalLM(Phi3Config(**SIZES))

    def convert(sd: dict) -> dict:
        out = {}
        for name in new.state_dict():
            if "qkv_proj" in name:
                q, k, v = (sd[name.replace("qkv_proj", f"{x}_proj")] for x in "qkv")
                out[name] = torch.cat([permute(q, heads), permute(k, kv), v])
            elif "gate_up_proj" in name:
                out[name] = torch.cat([sd[name.replace("gate_up_proj", f"{x}_proj")] for x in ("gate", "up")])
            else:
                out[name] = sd[name]
        return out

    new.load_state_dict(convert({k: v.detach() for k, v in old.state_dict().items()}))
    x = data(1, 9)[0]
    assert torch.allclose(old(x).logits, new(x).logits, atol=1e-5)  # the same model
    out, plan = remapped(tmp_path, cli, old, new.state_dict(), opt)
    names_old, names_new = list(old.state_dict()), list(new.state_dict())
    old_state, new_state = by_name(opt.state_dict(), names_old), by_name(out, names_new)
    for slot in ("exp_avg", "exp_avg_sq"):
        want = convert({n: s[slot] for n, s in old_state.items()})
        for name, tensor in want.items():
            assert torch.equal(new_state[name][slot], tensor), (name, slot)
    qkv = next(a for a in plan["params"] if a["dst_path"] == "model.layers.0.self_attn.qkv_proj.weight")
    assert qkv["structure"] == "fused" and len(qkv["pieces"]) == 3
    goes_on_together(old, opt, new, make, out, convert)


class PerExpert(nn.ModuleList):
    """transformers v4's Mixtral experts (``experts.{e}.w1/w2/w3``), run as v5's MixtralExperts runs them."""

    def __init__(self, experts):
        super().__init__()
        self.num_experts = experts.num_experts
        self.__dict__["act_fn"] = experts.act_fn  # a function here, not one of the list's modules
        self.config = getattr(experts, "config", None)
        hidden, inter = experts.hidden_dim, experts.intermediate_dim
        for _ in range(self.num_experts):
            m = nn.Module()
            m.w1 = nn.Linear(hidden, inter, bias=False)
            m.w3 = nn.Linear(hidden, inter, bias=False)
            m.w2 = nn.Linear(inter, hidden, bias=False)
            self.append(m)

    @property
    def gate_up_proj(self):
        return torch.stack([torch.cat([m.w1.weight, m.w3.weight]) for m in self])

    @property
    def down_proj(self):
        return torch.stack([m.w2.weight for m in self])

    def forward(self, *args):
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        return MixtralExperts.forward.__wrapped__(self, *args)  # the eager loop, as v5 runs it on a CPU


def test_per_expert_mixtral_into_transformers_v5_stacked_experts(tmp_path, cli):
    from safetensors.torch import save_file
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    old = MixtralForCausalLM(config)
    for layer in old.model.layers:
        layer.mlp.experts = PerExpert(layer.mlp.experts)
    make = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
    opt = make(old.parameters())
    train(old, opt, data(4, 1))
    # a v4 checkpoint, loaded by transformers v5 itself: its WeightConverter stacks the experts
    v4 = tmp_path / "v4"
    v4.mkdir()
    config.save_pretrained(v4)
    save_file({k.replace(".mlp.", ".block_sparse_moe."): v.detach().contiguous() for k, v in old.state_dict().items()},
              str(v4 / "model.safetensors"), metadata={"format": "pt"})
    new = MixtralForCausalLM.from_pretrained(v4)
    new.train()

    def convert(sd: dict) -> dict:
        out = {}
        for name in new.state_dict():
            base = name.rsplit(".", 1)[0]
            if name.endswith("experts.gate_up_proj"):
                out[name] = torch.stack([torch.cat([sd[f"{base}.{e}.w1.weight"], sd[f"{base}.{e}.w3.weight"]])
                                         for e in range(4)])
            elif name.endswith("experts.down_proj"):
                out[name] = torch.stack([sd[f"{base}.{e}.w2.weight"] for e in range(4)])
            else:
                out[name] = sd[name]
        return out

    assert all(torch.equal(v, new.state_dict()[k]) for k, v in convert(old.state_dict()).items())  # transformers did it
    out, plan = remapped(tmp_path, cli, old, new.state_dict(), opt)
    old_state, new_state = by_name(opt.state_dict(), list(old.state_dict())), by_name(out, list(new.state_dict()))
    for slot in ("exp_avg", "exp_avg_sq"):
        for name, tensor in convert({n: s[slot] for n, s in old_state.items()}).items():
            assert torch.equal(new_state[name][slot], tensor), (name, slot)
    kinds = {a["dst_path"]: a["structure"] for a in plan["params"] if a["action"] == "assemble"}
    assert kinds["model.layers.0.mlp.experts.gate_up_proj"] == "stacked"
    assert kinds["model.layers.1.mlp.experts.down_proj"] == "stacked"
    goes_on_together(old, opt, new, make, out, convert)
