"""Reference learning rates from megatron-core's own ``OptimizerParamScheduler``, for statekit's tests.

Run with the interpreter of a megatron-core venv (never in statekit's environment)::

    /work/venvs/mcore-0.19.2/bin/python scripts/make_megatron_schedule_refs.py \
        --out fixtures/megatron/schedule_refs.json

Two parts, both computed by the real class (``megatron.core.optimizer_param_scheduler``):

* ``fixtures``: every checkpoint under ``fixtures/megatron/<ver>/<case>/`` (written by megatron-core
  itself, see that README). Its ``opt_param_scheduler`` state, ``args`` and the optimizer's param
  groups are read with torch (``common.pt``, the DCP item ``common_state`` (located with
  ``torch.distributed.checkpoint``'s metadata reader, its bytes ``torch.load``-ed), or rank 0's ``model_optim_rng.pt``); a scheduler is built from the
  args the way ``megatron.training.training.get_optimizer_param_scheduler`` does (iteration-based:
  steps = iterations x global batch size), ``load_state_dict`` is called on it (what a resume does),
  and the groups' lr and weight decay are recorded ("now": the next update's), then after each of
  the next ``STEPS`` calls of ``step(increment=global_batch_size)`` (what ``train_step`` does after a
  successful update).
  Where the common state keeps no param groups (``dp_reshardable``: they are in sharded objects),
  one group with Megatron's default ``max_lr`` = ``args.lr``, ``min_lr`` = ``args.min_lr`` stands
  for them (``groups_from: args``).
* ``synthetic``: one scheduler per decay style (and WSD per anneal style), with warm-up from a
  non-zero ``init_lr``, two groups (one with its own max_lr / min_lr, one with wd_mult 0) and a
  weight-decay ramp, stepped through its horizon and past it; the state_dict and the lrs recorded.

The param groups stand in a small object with a ``param_groups`` list (the scheduler touches
nothing else of the optimizer).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

STEPS = 6


class _Opt:
    def __init__(self, groups):
        self.param_groups = [dict(g) for g in groups]


def _scheduler(groups, **kw):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(_Opt(groups), **kw)


def _trace(sched, increment, steps):
    out = [{"num_steps": sched.num_steps, "lr": [g["lr"] for g in sched.optimizer.param_groups],
            "weight_decay": [g["weight_decay"] for g in sched.optimizer.param_groups]}]
    for _ in range(steps):
        sched.step(increment=increment)
        out.append({"num_steps": sched.num_steps, "lr": [g["lr"] for g in sched.optimizer.param_groups],
                    "weight_decay": [g["weight_decay"] for g in sched.optimizer.param_groups]})
    return out


def _common(folder):
    import torch

    it = open(os.path.join(folder, "latest_checkpointed_iteration.txt")).read().strip()
    d = os.path.join(folder, f"iter_{int(it):07d}")
    if os.path.isfile(os.path.join(d, "common.pt")):
        return torch.load(os.path.join(d, "common.pt"), weights_only=False, map_location="cpu")
    if os.path.isfile(os.path.join(d, "metadata.json")) and glob.glob(os.path.join(d, "*.distcp")):
        import io

        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(d).read_metadata()  # ShardedObjects: torch.save'd bytes items

        def load(info):
            with open(os.path.join(d, info.relative_path), "rb") as f:
                f.seek(info.offset)
                value = torch.load(io.BytesIO(f.read(info.length)), weights_only=False, map_location="cpu")
            return value[0] if isinstance(value, list) and len(value) == 1 else value

        items = {index.fqn: info for index, info in meta.storage_data.items()}
        common = next(load(info) for fqn, info in items.items() if fqn.startswith("common_state/shard_"))
        common["_objects"] = {fqn: load(info) for fqn, info in sorted(items.items())
                              if fqn.startswith("optimizer.") and fqn.split("/shard_")[0].endswith(".optimizer")}
        return common
    rank0 = sorted(glob.glob(os.path.join(d, "mp_rank_00*", "model_optim_rng.pt")))[0]
    return torch.load(rank0, weights_only=False, map_location="cpu")


def _groups(common):
    """The optimizer's param groups in the common state (a ChainedOptimizer's members in order), or
    None where they are not there (dp_reshardable keeps them in sharded objects)."""
    def find(obj):
        if not isinstance(obj, dict):
            return []
        if isinstance(obj.get("param_groups"), list):
            return [obj["param_groups"]]
        if isinstance(obj.get("optimizer"), dict):
            return find(obj["optimizer"])
        return [gs for k in sorted(k for k in obj if isinstance(k, int)) for gs in find(obj[k])]

    lists = find(common["optimizer"])
    if not lists:  # dp_reshardable (0.19): ShardedObjects optimizer.distributed.dp_group_idx_N.optimizer
        lists = [gs for _, obj in sorted((common.get("_objects") or {}).items()) for gs in find(obj)]
    if not lists:
        return None
    return [{k: v for k, v in g.items() if k != "params"} for gs in lists for g in gs]


def _for_fixture(folder):
    common = _common(folder)
    args = common["args"]
    sd = common.get("opt_param_scheduler", common.get("lr_scheduler"))
    gbs = args.global_batch_size
    train_iters = args.train_iters
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else train_iters
    warmup = (args.lr_warmup_fraction * decay_iters * gbs if args.lr_warmup_fraction is not None
              else args.lr_warmup_iters * gbs)
    wsd = getattr(args, "lr_wsd_decay_iters", None)
    groups = _groups(common)
    source = "file"
    if groups is None:  # Megatron's default group: max_lr / min_lr from the args (_get_param_groups)
        groups, source = [{"max_lr": args.lr, "min_lr": args.min_lr, "wd_mult": 1.0}], "args"
    sched = _scheduler(groups, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
                       lr_warmup_steps=warmup, lr_decay_steps=decay_iters * gbs, lr_decay_style=args.lr_decay_style,
                       start_wd=args.start_weight_decay, end_wd=args.end_weight_decay, wd_incr_steps=train_iters * gbs,
                       wd_incr_style=args.weight_decay_incr_style, use_checkpoint_opt_param_scheduler=True,
                       override_opt_param_scheduler=False, wsd_decay_steps=None if wsd is None else wsd * gbs,
                       lr_wsd_decay_style=getattr(args, "lr_wsd_decay_style", None))
    sched.load_state_dict(sd)
    return {"state_dict": dict(sd), "global_batch_size": gbs, "groups_from": source, "iteration": common.get("iteration"),
            "trace": _trace(sched, gbs, STEPS)}


def _synthetic():
    groups = [{"lr": 0.0, "weight_decay": 0.0, "wd_mult": 1.0},
              {"lr": 0.0, "weight_decay": 0.0, "wd_mult": 0.0, "max_lr": 3e-3, "min_lr": 2e-4}]
    cases = []
    styles = [("linear", None), ("cosine", None), ("inverse-square-root", None), ("constant", None)]
    styles += [("WSD", s) for s in ("linear", "cosine", "exponential", "minus_sqrt")]
    for style, wsd_style in styles:
        for wd_style in ("linear", "cosine") if style == "cosine" else ("linear",):
            kw = dict(init_lr=1e-5, max_lr=6e-4, min_lr=6e-5, lr_warmup_steps=96, lr_decay_steps=800,
                      lr_decay_style=style, start_wd=0.01, end_wd=0.1, wd_incr_steps=640, wd_incr_style=wd_style,
                      wsd_decay_steps=320 if style == "WSD" else None, lr_wsd_decay_style=wsd_style)
            sched = _scheduler(groups, **kw)
            trace = _trace(sched, 32, 30)  # 0 … 960 samples: warm-up, decay, past the horizon
            cases.append({"kwargs": kw, "groups": groups, "increment": 32, "trace": trace,
                          "state_dict": sched.state_dict()})
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="fixtures/megatron")
    ap.add_argument("--out", default="fixtures/megatron/schedule_refs.json")
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mcore_cpu_shim  # noqa: F401  (0.19's typing.override on Python 3.11)
    import megatron.core

    out = {"megatron_core": getattr(megatron.core, "__version__", None), "fixtures": {}, "synthetic": _synthetic()}
    for folder in sorted(glob.glob(os.path.join(a.fixtures, "*", "*", "latest_checkpointed_iteration.txt"))):
        case = os.path.relpath(os.path.dirname(folder), a.fixtures)
        out["fixtures"][case] = _for_fixture(os.path.dirname(folder))
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1, default=str)
    os.replace(tmp, a.out)
    print(f"{a.out}: {len(out['fixtures'])} fixtures, {len(out['synthetic'])} synthetic schedules")


if __name__ == "__main__":
    main()
