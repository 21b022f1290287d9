"""SYNTHETIC Megatron legacy checkpoints, written with real torch in the dict shapes of
docs/megatron-formats.md §1 (until the fixtures written by megatron-core itself land under
fixtures/megatron/). Nothing here comes from statekit: the bucket layout is an element-by-element
simulation written from §1.5's prose, the TP shards are cut with torch from global tensors.

``write(root, **options)`` writes ``root/latest_checkpointed_iteration.txt`` and
``root/iter_0000005/mp_rank_*/{model_optim_rng.pt, distrib_optim.pt}`` and returns the global
tensors (name → {"weight", "master", "exp_avg", "exp_avg_sq"} as torch tensors) to compare with.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import random
from collections import OrderedDict

import numpy as np
import torch

H, HEADS, GROUPS, D, FFN, VOCAB, MOE_FFN = 16, 4, 2, 4, 24, 64, 8


def global_params(layers: int, swiglu: bool, untie: bool, experts: int = 0):
    """(name, shape, TP axis, swiglu-fc1) in registration order of the whole model, stage by stage."""
    out = [("embedding.word_embeddings.weight", (VOCAB, H), 0, False)]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (H,), None, False),
            (p + "self_attention.linear_proj.weight", (H, HEADS * D), 1, False),
            (p + "self_attention.linear_proj.bias", (H,), None, False),
            (p + "self_attention.linear_qkv.weight", ((HEADS + 2 * GROUPS) * D, H), 0, False),
            (p + "self_attention.linear_qkv.bias", ((HEADS + 2 * GROUPS) * D,), 0, False),
            (p + "pre_mlp_layernorm.weight", (H,), None, False),
        ]
        if experts:
            out.append((p + "mlp.router.weight", (experts, H), None, False))
            for e in range(experts):
                q = f"{p}mlp.experts.local_experts.{e}."
                out += [(q + "linear_fc1.weight", (MOE_FFN * (2 if swiglu else 1), H), 0, swiglu),
                        (q + "linear_fc2.weight", (H, MOE_FFN), 1, False)]
        else:
            out += [(p + "mlp.linear_fc1.weight", (FFN * (2 if swiglu else 1), H), 0, swiglu),
                    (p + "mlp.linear_fc2.weight", (H, FFN), 1, False)]
    out.append(("decoder.final_layernorm.weight", (H,), None, False))
    if untie:
        out.append(("output_layer.weight", (VOCAB, H), 0, False))
    return out


def _place(name: str, layers: int, pp: int, vp: int | None, experts: int, ep: int):
    """(pp rank, vp chunk, local name, ep rank or None for a dense parameter)."""
    chunks = vp or 1
    if name.startswith("embedding."):
        where = (0, 0)
        local = name
    elif name.startswith("decoder.layers."):
        parts = name.split(".")
        i = int(parts[2])
        per_chunk = layers // (pp * chunks)
        block = i // per_chunk  # blocks go rank-major within a chunk: chunk v holds blocks v*pp .. v*pp+pp-1
        where = (block % pp, block // pp)
        parts[2] = str(i % per_chunk)
        local = ".".join(parts)
    else:
        where = (pp - 1, chunks - 1)
        local = name
    owner = None
    if ".mlp.experts.local_experts." in local:
        parts = local.split(".")
        k = parts.index("local_experts") + 1
        e = int(parts[k])
        per = experts // ep
        owner = e // per
        parts[k] = str(e % per)
        local = ".".join(parts)
    return where[0], where[1], local, owner


def _shard(t: torch.Tensor, axis, swiglu: bool, tp: int, r: int) -> torch.Tensor:
    if axis is None:
        return t.clone()
    if swiglu:
        w, v = t.chunk(2, dim=0)
        return torch.cat([w.chunk(tp, dim=0)[r], v.chunk(tp, dim=0)[r]], dim=0).clone()
    return t.chunk(tp, dim=axis)[r].clone()


def simulate(sizes: list[tuple[str, int]], bucket_size, dp: int, align: int, lcm128: bool):
    """Element owners of one buffer (None: padding) and buckets (start, end, unpadded), §1.5's prose."""
    divisor = math.lcm(dp, 128) if lcm128 else dp
    owners: list = []
    out = []
    start, members = 0, 0
    for name, numel in reversed(sizes):
        while len(owners) % align:
            owners.append(None)
        owners.extend([name] * numel)
        members += 1
        if bucket_size is not None and len(owners) - start >= bucket_size:
            unpadded = len(owners) - start
            while len(owners) % divisor:
                owners.append(None)
            out.append((start, len(owners), unpadded))
            start, members = len(owners), 0
    if members:
        unpadded = len(owners) - start
        while len(owners) % divisor:
            owners.append(None)
        out.append((start, len(owners), unpadded))
    return owners, out


def _args(tp, pp, dp, layers, swiglu, untie, distributed, bucket_size, overlap, version_rule, vp, experts, ep):
    ns = argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        context_parallel_size=1, data_parallel_size=dp, world_size=tp * pp * dp,
        virtual_pipeline_model_parallel_size=vp, num_layers=layers, hidden_size=H, ffn_hidden_size=FFN,
        num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True, kv_channels=D,
        swiglu=swiglu, untie_embeddings_and_output_weights=untie, padded_vocab_size=VOCAB, vocab_size=50,
        make_vocab_size_divisible_by=16, num_experts=experts or None, moe_ffn_hidden_size=MOE_FFN if experts else None,
        overlap_grad_reduce=overlap,
        overlap_param_gather_with_optimizer_step=False, ddp_bucket_size=bucket_size, ddp_num_buckets=None,
        use_distributed_optimizer=distributed, accumulate_allreduce_grads_in_fp32=True, bf16=True, fp16=False,
        params_dtype=torch.bfloat16, optimizer="adam", decoupled_weight_decay=True, lr=3e-4, min_lr=3e-5,
        decoupled_lr=None, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        global_batch_size=8, micro_batch_size=2, ckpt_format="torch", save=os.devnull,
        load_path_obj=None, rng_signal=None,
    )
    if version_rule == ">=0.8":
        ns.ddp_pad_buckets_for_high_nccl_busbw = False
    return ns


def _groups(step: int, with_params: list | None = None):
    base = dict(lr=2.5e-4, betas=(0.9, 0.95), eps=1e-8, amsgrad=False, maximize=False, foreach=None,
                capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True,
                is_expert_parallel=False, default_config=True, lr_mult=1.0, is_decoupled_lr=False,
                max_lr=3e-4, min_lr=3e-5, step=step)
    groups = [dict(base, wd_mult=1.0, weight_decay=0.1), dict(base, wd_mult=0.0, weight_decay=0.0, default_config=False)]
    if with_params is not None:
        for g, ids in zip(groups, with_params, strict=True):
            g["params"] = ids
    return groups


def _distrib_entry(names, shards, size, dp, version_rule, coalesced):
    """One buffer's entry of distrib_optim.pt, laid out by :func:`simulate`."""
    sizes = [(n, shards[n]["weight"].numel()) for n in names]
    align = 64 if version_rule == ">=0.8" else 1
    owners, bks = simulate(sizes, size, dp, align, version_rule != "<=0.6")
    worlds = {k: torch.zeros(len(owners)) for k in ("param", "exp_avg", "exp_avg_sq")}
    for n, _ in sizes:
        first = owners.index(n)
        for key, src in (("param", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            flat = shards[n][src].reshape(-1)
            worlds[key][first:first + flat.numel()] = flat
    if coalesced:
        entry = {k: torch.cat([w[s:s + u] for s, _e, u in bks]) for k, w in worlds.items()}
        entry["numel_unpadded"] = sum(u for _s, _e, u in bks)
        return entry, [e - s for s, e, _u in bks], [u for _s, _e, u in bks]
    return {k: [w[s:e].clone() for s, e, _u in bks] for k, w in worlds.items()}, [e - s for s, e, _u in bks], \
        [u for _s, _e, u in bks]


def write(root: str, *, tp=1, pp=1, dp=1, layers=2, swiglu=True, untie=True, distributed=True,
          bucket_size=None, overlap=False, version_rule=">=0.8", coalesced=True, step=5, seed=0,
          extra_state=True, swap_order=False, vp=None, experts=0, ep=1, cp=1, release=False, groups_reversed_last_stage=False):
    """Write a SYNTHETIC legacy checkpoint (see the module docstring); returns the global tensors.
    ``dp`` is the dense DP size; with ``ep`` > 1 the expert DP size is ``dp // ep`` (TP = PP = 1)."""
    g = torch.Generator().manual_seed(seed)
    params = global_params(layers, swiglu, untie, experts)
    truth = {}
    for name, shape, _axis, _sw in params:
        master = torch.randn(shape, generator=g) * 0.02
        if name.endswith("layernorm.weight"):
            master += 1
        truth[name] = {"master": master, "weight": master.to(torch.bfloat16),
                       "exp_avg": torch.randn(shape, generator=g) * 1e-3,
                       "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6}
    iteration = os.path.join(root, "release" if release else "iter_0000005")
    args = _args(tp, pp, dp, layers, swiglu, untie, distributed, bucket_size, overlap, version_rule, vp, experts, ep)
    args.context_parallel_size = cp
    args.world_size = tp * pp * dp * cp
    sched = {"max_lr": 3e-4, "lr_warmup_steps": 16, "num_steps": step * 8, "lr_decay_style": "cosine",
             "lr_decay_steps": 800, "min_lr": 3e-5, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
             "wd_incr_steps": 800}
    placed = {n: _place(n, layers, pp, vp, experts, ep) for n, _s, _a, _sw in params}
    chunks = vp or 1
    for er in range(ep):
        for pr in range(pp):
            for tr in range(tp):
                name = f"mp_rank_{tr:02d}" + (f"_{pr:03d}" if pp > 1 else "") + (f"_{er:03d}" if ep > 1 else "")
                folder = os.path.join(iteration, name)
                os.makedirs(folder, exist_ok=True)
                models, shards = [], {}
                for v in range(chunks):
                    model = OrderedDict()
                    for n, _s, a, sw in params:
                        prank, chunk, ln, owner = placed[n]
                        if prank != pr or chunk != v or owner not in (None, er):
                            continue
                        shards[(v, ln)] = {k: _shard(t, a, sw, tp, tr) for k, t in truth[n].items()}
                        model[ln] = shards[(v, ln)]["weight"]
                        if extra_state and ".linear_" in ln and ln.endswith(".weight"):
                            model[ln.rsplit(".", 1)[0] + "._extra_state"] = io.BytesIO(b"te-extra")
                    models.append(model)
                obj = {"args": args, "checkpoint_version": 3.0, "iteration": step,
                       "opt_param_scheduler": sched, "num_floating_point_operations_so_far": 1.5e12,
                       "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                      "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.Generator(),
                                      "rng_tracker_states": {}}]}
                if vp:
                    for v, m in enumerate(models):
                        obj[f"model{v}"] = m
                else:
                    obj["model"] = models[0]
                names = [(v, n) for v, m in enumerate(models) for n in m if not n.endswith("_extra_state")]
                is_expert = {k: ".mlp.experts." in k[1] and ep > 1 for k in names}
                dense = [k for k in names if not is_expert[k]]
                expert = [k for k in names if is_expert[k]]
                if distributed:
                    parts_groups = [_groups(step)[::-1] if groups_reversed_last_stage and pr == pp - 1 else _groups(step)]
                    if expert:
                        parts_groups = [_groups(step), [dict(_groups(step)[0], is_expert_parallel=True)]]
                    obj["optimizer"] = ([{"optimizer": {"param_groups": gr}, "grad_scaler": {}} for gr in parts_groups]
                                        if len(parts_groups) > 1 else
                                        {"optimizer": {"param_groups": parts_groups[0]}, "grad_scaler": {}})
                    dkey = (torch.bfloat16, torch.float32)
                    states = []
                    for members, part_dp, writes in ((dense, dp * cp, er == 0), (expert, dp * cp // ep, True)):
                        if not members and states:
                            continue
                        state = {"buckets_coalesced": True} if coalesced else {}
                        gbuf = 0
                        for v in range(chunks):
                            order = [n for c, n in members if c == v]
                            if not order:
                                continue
                            if swap_order:
                                k = order.index(next(n for n in order if "linear_fc2" in n))
                                order[k - 1], order[k] = order[k], order[k - 1]
                            size = bucket_size if overlap and pr == 0 and v == 0 else None
                            local = {n: shards[(v, n)] for n in order}
                            entry, numel, unpadded = _distrib_entry(order, local, size, part_dp, version_rule,
                                                                    coalesced)
                            state[gbuf] = {dkey: entry}
                            if not coalesced:
                                state.setdefault("per_bucket_numel", []).append(numel)
                                state.setdefault("per_bucket_numel_unpadded", []).append(unpadded)
                            gbuf += 1
                        states.append(state if writes else None)
                    distrib = states if len(states) > 1 else states[0]
                    torch.save(distrib, os.path.join(folder, "distrib_optim.pt"))
                else:
                    parts = []
                    for members, expert_part in ((dense, False), (expert, True)):
                        if expert_part and not members:
                            continue
                        no_wd = [k for k in members if k[1].endswith(".bias") or shards[k]["weight"].dim() == 1]
                        wd = [k for k in members if k not in no_wd]
                        ids = {k: i for i, k in enumerate(wd + no_wd)}
                        state = {ids[k]: {"exp_avg": shards[k]["exp_avg"], "exp_avg_sq": shards[k]["exp_avg_sq"],
                                          "step": torch.tensor(float(step))} for k in members}
                        groups = _groups(step, [[ids[k] for k in wd], [ids[k] for k in no_wd]])
                        masters = [[shards[k]["master"] for k in wd], [shards[k]["master"] for k in no_wd]]
                        if expert_part:  # experts: matrices only, one group (is_expert_parallel)
                            groups, masters = [dict(groups[0], is_expert_parallel=True)], masters[:1]
                        parts.append({"optimizer": {"state": state, "param_groups": groups},
                                      "grad_scaler": {"scale": torch.tensor(1.0)}, "fp32_from_fp16_params": masters})
                    obj["optimizer"] = parts if len(parts) > 1 else parts[0]
                torch.save(obj, os.path.join(folder, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("release" if release else str(step))
    return truth
