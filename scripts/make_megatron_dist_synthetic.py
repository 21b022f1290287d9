"""Synthetic Megatron torch_dist folders, written by real torch's torch.distributed.checkpoint.

NOT written by megatron-core: these folders hold the key families, global shapes, chunkings
(TP / EP splits, SwiGLU's 2*TP fragments, the DP ranges of the N-D reformulation), the
``MCoreMetadata`` root with ``mcore_data``, ``common.pt`` / ``common_state`` and the ShardedObject
bytes items of ``shared/docs/megatron-formats.md`` §2, so that statekit's torch_dist reader can be
built and tested before the real fixtures (``fixtures/megatron/<version>/``, written by
megatron-core itself) land. Tests name every case made here "synthetic".

What is torch's own: ``dcp.save`` with a planner whose ``transform_object`` writes bytes items
as given (Megatron's ``MCoreSavePlanner`` does the same) and whose global plan pickles an
``MCoreMetadata`` (a dataclass named as Megatron's, defined here) with ``mcore_data``; sharded
tensors are ``ShardedTensor``s of several local shards in a world of one (gloo), so DCP stores
one chunk per shard as it does for several ranks.

    python scripts/make_megatron_dist_synthetic.py OUT    # writes OUT/<case>/ for every case
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import socket
import sys
import types
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

L, H, NQ, NG, D, FFN, V, VPAD, E, TP = 2, 8, 2, 1, 4, 12, 40, 48, 4, 2
STEP, ITERATION = 5, 5
MODULE = "megatron.core.dist_checkpointing.strategies.torch"

# ---------------------------------------------------------------- a Megatron-named root class


def _mcore_module():
    """``MCoreMetadata`` as a class of Megatron's module name, so that the pickle names it as
    megatron-core's does (torch's own loader then needs this module registered, as here)."""
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    for name in ("megatron", "megatron.core", "megatron.core.dist_checkpointing",
                 "megatron.core.dist_checkpointing.strategies", MODULE):
        sys.modules.setdefault(name, types.ModuleType(name))
    module = sys.modules[MODULE]

    @dataclasses.dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict | None = None

    @dataclasses.dataclass(frozen=True)
    class MCoreSavePlan(SavePlan):  # (what megatron-core 0.14 keeps in .metadata's all_local_plans)
        mcore_data: dict | None = None

    for cls in (MCoreMetadata, MCoreSavePlan):
        cls.__module__ = MODULE
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    return module


class Planner(DefaultSavePlanner):
    def __init__(self, mcore_data: dict, **kw):
        super().__init__(**kw)
        self.mcore_data = mcore_data

    def create_global_plan(self, all_plans):
        plans, md = super().create_global_plan(all_plans)
        return plans, _mcore_module().MCoreMetadata(mcore_data=self.mcore_data, **vars(md))

    def transform_object(self, write_item, object):  # bytes items are already torch.save'd
        return object


# ---------------------------------------------------------------- the model


def bf16_round(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 (round to nearest even) -> fp32, with torch."""
    return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()


def params(moe: bool) -> list[tuple[str, tuple[int, ...], int | None, str]]:
    """(model key, global shape, TP axis or None, kind) in named_parameters order (stacked)."""
    qkv = (NQ + 2 * NG) * D
    out = [("embedding.word_embeddings.weight", (VPAD, H), 0, "col"),
           ("decoder.layers.self_attention.linear_proj.weight", (L, H, NQ * D), 2, "row"),
           ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (L, H), None, "rep"),
           ("decoder.layers.self_attention.linear_qkv.weight", (L, qkv, H), 1, "col")]
    if moe:
        out += [("decoder.layers.pre_mlp_layernorm.weight", (L, H), None, "rep"),
                ("decoder.layers.mlp.router.weight", (L, E, H), None, "rep"),
                ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (L, E, 2 * FFN, H), None, "expert"),
                ("decoder.layers.mlp.experts.experts.linear_fc2.weight", (L, E, H, FFN), None, "expert")]
    else:
        out += [("decoder.layers.mlp.linear_fc1.layer_norm_weight", (L, H), None, "rep"),
                ("decoder.layers.mlp.linear_fc1.weight", (L, 2 * FFN, H), 1, "swiglu"),
                ("decoder.layers.mlp.linear_fc2.weight", (L, H, FFN), 2, "row")]
    out += [("decoder.final_layernorm.weight", (H,), None, "rep"),
            ("output_layer.weight", (VPAD, H), 0, "col")]
    return out


def boxes(key, shape, tp_axis, kind) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offset, size) of each rank's piece of a model tensor (layers, TP, experts)."""
    stacked = key.startswith("decoder.layers.")
    layers = range(shape[0]) if stacked else [None]
    out = []
    for layer in layers:
        lead = () if layer is None else (layer,)
        rest = shape[1:] if layer is not None else shape
        if kind == "expert":
            for e in range(E):
                out.append(((layer, e) + (0,) * (len(shape) - 2), (1, 1) + shape[2:]))
            continue
        if kind == "swiglu":  # gate_r at fragment r and up_r at r + TP of a 2*TP split of axis 1
            n = shape[1] // (2 * TP)
            for f in range(2 * TP):
                out.append(((layer, f * n) + (0,) * (len(shape) - 2), (1, n) + shape[2:]))
            continue
        if tp_axis is None:
            out.append((lead + (0,) * len(rest), (1,) * len(lead) + rest))
            continue
        n = shape[tp_axis] // TP
        for r in range(TP):
            off = [0] * len(shape)
            size = list(shape)
            if layer is not None:
                off[0], size[0] = layer, 1
            off[tp_axis], size[tp_axis] = r * n, n
            out.append((tuple(off), tuple(size)))
    return out


def sharded(full: torch.Tensor, pieces) -> object:
    shards = [Shard(full[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].clone().contiguous(),
                    ShardMetadata(list(off), list(size), "rank:0/cpu")) for off, size in pieces]
    return init_from_local_shards(shards, list(full.shape))


def reformulated(full: torch.Tensor, pieces, dp: int) -> tuple[object, tuple[int, ...]]:
    """The N-D reformulation of fully_sharded_model_space: axis fragmentations + [local numel],
    each DP rank's flattened range its own chunk."""
    shape = tuple(full.shape)
    local = pieces[0][1]
    frag = tuple(g // s for g, s in zip(shape, local, strict=True))
    numel = math.prod(local)
    shards = []
    bounds = [numel * r // dp for r in range(dp + 1)]
    for off, size in pieces:
        index = tuple(o // s for o, s in zip(off, size, strict=True))
        flat = full[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1)
        for r in range(dp):
            a, b = bounds[r], bounds[r + 1]
            if b > a:
                shards.append(Shard(flat[a:b].clone().reshape((1,) * len(frag) + (b - a,)),
                                    ShardMetadata(list(index) + [a], [1] * len(frag) + [b - a], "rank:0/cpu")))
    return init_from_local_shards(shards, list(frag) + [numel]), shape


def namespace(moe: bool, sharding: str | None, **more) -> argparse.Namespace:
    args = argparse.Namespace(
        num_layers=L, hidden_size=H, num_attention_heads=NQ, num_query_groups=NG, kv_channels=D,
        ffn_hidden_size=FFN, swiglu=True, group_query_attention=True, vocab_size=V, padded_vocab_size=VPAD,
        make_vocab_size_divisible_by=VPAD // TP, untie_embeddings_and_output_weights=True,
        tensor_model_parallel_size=TP, pipeline_model_parallel_size=1, expert_model_parallel_size=2 if moe else 1,
        num_experts=E if moe else None, moe_grouped_gemm=moe, bf16=True, fp16=False,
        use_distributed_optimizer=sharding is not None, data_parallel_size=2, context_parallel_size=1,
        ckpt_format="torch_dist", lr=3e-4, min_lr=3e-5, decoupled_lr=None, weight_decay=0.1,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, iteration=ITERATION, train_iters=100,
        dist_ckpt_optim_fully_reshardable=sharding == "fully_reshardable")
    vars(args).update(more)
    return args


def groups(moe: bool) -> list[dict]:
    base = dict(lr=2.4e-4, bias_correction=True, betas=(0.9, 0.95), eps=1e-8, amsgrad=False, max_lr=3e-4,
                min_lr=3e-5, lr_mult=1.0, is_decoupled_lr=False, default_config=True, step=STEP)
    out = [dict(base, weight_decay=0.1, wd_mult=1.0, is_expert_parallel=False),
           dict(base, weight_decay=0.0, wd_mult=0.0, is_expert_parallel=False)]
    if moe:
        out = [[g] for g in out] + [[dict(base, weight_decay=0.1, wd_mult=1.0, is_expert_parallel=True)]]
    return out


def scheduler() -> dict:
    return dict(max_lr=3e-4, lr_warmup_steps=16, num_steps=ITERATION * 8, lr_decay_style="cosine",
                lr_decay_steps=800, min_lr=3e-5, start_wd=0.1, end_wd=0.1, wd_incr_style="constant",
                wd_incr_steps=800)


def saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def write(out: str, case: str) -> None:
    """One case: ``<sharding>[-moe][-state][-shift][-nemo]`` (state: core 0.19's common_state)."""
    words = case.split("-")
    sharding = words[0]
    moe, state19, shift, nemo = "moe" in words, "state" in words, "shift" in words, "nemo" in words
    padstate = "padstate" in words  # state left in the vocabulary padding rows
    zeros = "zeros" in words  # the final norm's moments all zero at step 5 (a load that filled nothing)
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    folder = os.path.join(out, case, "weights") if nemo else os.path.join(out, case, f"iter_{ITERATION:07d}")
    os.makedirs(folder, exist_ok=True)
    if not nemo:
        with open(os.path.join(out, case, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(ITERATION))
    prefix = "module." if nemo else ""
    sd: dict = {}
    mcore: dict = {}
    model = params(moe)
    master, weights, moments = {}, {}, {}
    for key, shape, tp_axis, kind in model:
        m = rng.standard_normal(shape).astype(np.float32) * 0.02
        if key.endswith("layer_norm_weight") or key.endswith("norm.weight"):
            m += 1.0
        if "word_embeddings" in key or key == "output_layer.weight":
            m[V:] = 0.0  # vocab padding rows
        master[key] = m
        weights[key] = torch.from_numpy(m).to(torch.bfloat16)
        moments[key] = (rng.standard_normal(shape).astype(np.float32) * 1e-3,
                        np.abs(rng.standard_normal(shape)).astype(np.float32) * 1e-6)
        if zeros and key == "decoder.final_layernorm.weight":
            for arr in moments[key]:
                arr[...] = 0.0
        if "word_embeddings" in key and not padstate:  # never looked up: no gradient (the output layer's has)
            for arr in moments[key]:
                arr[V:] = 0.0
        sd[prefix + key] = sharded(weights[key], boxes(key, shape, tp_axis, kind))
    states = {"non_distributed": ("fp32_param", "exp_avg", "exp_avg_sq"),
              "fully_sharded_model_space": ("fp32_param", "exp_avg", "exp_avg_sq"),
              "fully_reshardable": ("param", "exp_avg", "exp_avg_sq")}[sharding]
    shifted = set()
    if shift:  # the mcore 0.15-0.19 fully_reshardable multi-bucket save: states after bucket 0 shifted
        shifted = _shift(model, master, moments)
    for key, shape, tp_axis, kind in model:
        values = dict(zip(states, (master[key], *moments[key]), strict=True))
        chain = ("chained_1." if "experts" in key else "chained_0.") if moe and sharding == "fully_sharded_model_space" else ""
        for name in states:
            okey = f"{chain}optimizer.state.{name}.{prefix}{key}"
            full = torch.from_numpy(np.ascontiguousarray(values[name]))
            if sharding == "fully_sharded_model_space":
                sd[okey], mcore[okey] = reformulated(full, boxes(key, shape, tp_axis, kind), dp=2)
                mcore[okey] = {"nd_reformulated_orig_global_shape": mcore[okey]}
            else:
                sd[okey] = sharded(full, boxes(key, shape, tp_axis, kind))
    gs = groups(moe)
    if sharding == "non_distributed":
        inner = {"param_groups": [dict(g, params=[]) for g in (gs if not moe else [x[0] for x in gs])],
                 "state": {"common_step": torch.tensor(float(STEP))}}
        for g in inner["param_groups"]:
            del g["step"]
        optimizer = {"optimizer": inner, "fp32_from_fp16_params": []}
        if moe:
            optimizer = {0: {"optimizer": {"param_groups": inner["param_groups"][:2], "state": inner["state"]}},
                         1: {"optimizer": {"param_groups": inner["param_groups"][2:], "state": inner["state"]}}}
        content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    elif sharding == "fully_reshardable":
        one = lambda g: {"optimizer": {"param_groups": g}, "param_state_sharding_type": sharding}  # noqa: E731
        optimizer = one(gs) if not moe else {0: one([x[0] for x in gs[:2]]), 1: one(gs[2])}
        content = {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False,
                   "chained_optim_avoid_prefix": True}
    else:  # fully_sharded_model_space: param groups in ShardedObjects per model-parallel rank
        optimizer = {"param_state_sharding_type": sharding}
        if moe:
            optimizer = {0: dict(optimizer), 1: dict(optimizer)}
        members = [("chained_0.", [x[0] for x in gs[:2]]), ("chained_1.", gs[2])] if moe else [("", gs)]
        for chain, member in members:
            for mp in range(TP):
                key = f"{chain}optimizer.distributed.dp_group_idx_{mp}.optimizer/shard_0_1"
                sd[key] = saved({"param_groups": member})
                sd[f"{chain}optimizer.distributed.dp_group_idx_{mp}.grad_scaler/shard_0_1"] = saved(None)
        content = {"distrib_optim_sharding_type": sharding}
    common = {"args": namespace(moe, None if sharding == "non_distributed" else sharding),
              "checkpoint_version": 3.0, "iteration": ITERATION, "num_floating_point_operations_so_far": 1.5e12,
              "opt_param_scheduler": scheduler(), "optimizer": optimizer, "content_metadata": content}
    if nemo:
        common = {"global_step": ITERATION, "optimizer": optimizer, "content_metadata": content}
    for pp in range(1):
        for tp in range(TP):
            sd[f"rng_state/shard_{pp}.{tp}_1.{TP}"] = saved([{"random_rng_state": (3, (1, 2), None)}])
    if state19:
        sd["common_state/shard_0_1"] = saved([common])
    else:
        torch.save(common, os.path.join(folder, "common.pt"))
    dcp.save(sd, checkpoint_id=folder, planner=Planner(mcore))
    with open(os.path.join(folder, "metadata.json"), "w") as fh:
        meta = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
        if not state19:
            meta.update(common_backend="torch", common_backend_version=1)
        json.dump(meta, fh)
    with open(os.path.join(out, case, "expected.json"), "w") as fh:
        json.dump({"shifted": sorted(shifted)}, fh)
    # what was saved, model-shaped (stacked), for the tests: the values every reader must give back
    torch.save({key: {"weight": weights[key], **{name: torch.from_numpy(np.ascontiguousarray(v)) for name, v in
                      zip(states, (master[key], *moments[key]), strict=True)}} for key, *_ in model},
               os.path.join(out, case, "truth.pt"))


def _shift(model, master, moments) -> set[str]:
    """Cut the states as the buggy fully_reshardable save did: the buffer in Megatron's layout
    (params reversed, 64-element starts, a bucket closing at 64 elements, bucket ends padded to
    128), bucket-end padding stripped, then every parameter sliced at its padded index."""
    order = [(key, math.prod(shape)) for key, shape, _, _ in model][::-1]
    start, bucket_start, spans, buckets = 0, 0, {}, []
    for key, numel in order:
        start = -(-start // 64) * 64
        spans[key] = (start, start + numel)
        start += numel
        if start - bucket_start >= 64:
            end = -(-start // 128) * 128
            buckets.append((bucket_start, start, end))
            bucket_start = start = end
    if bucket_start != start:
        buckets.append((bucket_start, start, -(-start // 128) * 128))
    shifted = set()
    for index in range(3):
        world = np.zeros(buckets[-1][2], dtype=np.float32)
        for key, (a, b) in spans.items():
            world[a:b] = (master[key], *moments[key])[index].reshape(-1)
        compact = np.concatenate([world[a:e] for a, e, _ in buckets])
        compact = np.pad(compact, (0, len(world) - len(compact)))
        for key, (a, b) in spans.items():
            cut = compact[a:b]
            if not np.array_equal(cut, world[a:b]):
                shifted.add(key)
            target = (master[key], *moments[key])[index]
            target[...] = cut.reshape(target.shape)
    return shifted


CASES = ("non_distributed", "fully_reshardable", "fully_sharded_model_space", "fully_reshardable-state",
         "fully_reshardable-shift", "non_distributed-moe", "fully_sharded_model_space-moe", "fully_reshardable-moe",
         "fully_reshardable-nemo", "fully_reshardable-padstate",
         "fully_reshardable-zeros")


def main() -> None:
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for case in sys.argv[2:] or CASES:
            write(out, case)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
