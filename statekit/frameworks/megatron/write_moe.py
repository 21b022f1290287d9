"""A mixture-of-experts run's optimizer written to torch_dist ``fully_reshardable``, at its own or
another expert-parallel size (``statekit convert MOE_DIR OUT --to megatron --ep N``).

What megatron-core 0.19.2 does (``optimizer/__init__.py`` ``get_megatron_optimizer``,
``_get_param_groups``; ``optimizer.py`` ``ChainedOptimizer.sharded_state_dict``):

- an expert parameter is *expert-parallel* (``allreduce=False``) only when EP > 1 or ETP ≠ TP
  (``tensor_parallel/layers.py`` ``use_expert_pgs``); then the experts have their own param
  groups (``is_expert_parallel: True``) and their own DistributedOptimizer, the ChainedOptimizer's
  second member. At EP 1 (ETP = TP) they are dense parameters: one member, the dense groups;
- the param groups are keyed by (overrides, is_expert_parallel), all-gathered over the world and
  sorted (the no-override group first); each member keeps the groups of its own parameters;
- with a fully-reshardable sharding type and ``content_metadata.chained_optim_avoid_prefix`` the
  members' tensor keys carry no ``chained_{i}.`` prefix (the expert keys, ``…mlp.experts.experts.…``,
  are distinct anyway) and the common state's ``optimizer`` is ``{0: dense, 1: expert}``, each with
  its ``optimizer.param_groups`` and ``param_state_sharding_type``; one member is written as a
  dense run's.

torch_dist stores the experts stacked and global (``…mlp.experts.experts.linear_fc1.weight
[L, E, …]``), so an EP change moves no tensor: the target's members and groups are rebuilt
(:func:`target_groups`) and ``args`` say the new EP. EP > 1 → EP 1 joins each expert group to the
dense group of the same identifiers (refused unless every other entry, the step included, agrees);
EP 1 → EP > 1 gives the expert parameters the groups they were in, marked ``is_expert_parallel``,
and the dense member the groups of its own parameters.
"""

from __future__ import annotations

from statekit.errors import MappingError, UsageError
from statekit.frameworks.megatron import config

EXPERT = ".mlp.experts."
_IDENTITY = ("wd_mult", "lr_mult", "is_decoupled_lr")
_DEFAULTS = (1.0, 1.0, False)


def experts_apart(ep: int, tp: int, etp: int | None) -> bool:
    """Whether the experts are expert-parallel parameters (their own groups and member)."""
    return ep > 1 or (etp is not None and etp != tp)


def sizes(cfg: config.MegatronConfig, ep: int | None, tp: int, pp: int, dp: int, where: str) -> dict[str, int]:
    """The target's expert-parallel size and expert DP (world / (EP·TP·PP)), checked as Megatron would."""
    experts = cfg.num_experts
    ep = ep or cfg.ep or 1
    if ep < 1:
        raise UsageError(f"--ep {ep}: a parallel size is at least 1")
    if not experts:
        if ep != 1:
            raise UsageError(f"--ep {ep}: the model has no experts")
        return {"ep": 1}
    if cfg.etp is not None and cfg.etp != (cfg.tp or 1):
        raise MappingError(f"args.expert_tensor_parallel_size {cfg.etp} differs from TP {cfg.tp}: statekit does not "
                           "write such a MoE run yet", where)
    if (tp, pp) != (cfg.tp or 1, cfg.pp or 1):
        raise MappingError(f"a MoE run at TP {tp} PP {pp} (the source's TP {cfg.tp or 1} PP {cfg.pp or 1}): statekit "
                           "changes a MoE run's EP and DP only yet (Megatron's own load at another TP/PP is not checked)",
                           where)
    if experts % ep:
        raise UsageError(f"--ep {ep}: the model's {experts} experts do not split into EP {ep}")
    world = tp * pp * dp * (cfg.cp or 1)
    if world % (ep * tp * pp):
        raise UsageError(f"--ep {ep}: the world TP×PP×DP×CP = {world} is not a multiple of EP×TP×PP = {ep * tp * pp} "
                         "(Megatron's expert data-parallel size is world / (EP·TP·PP))")
    return {"ep": ep, "expert_dp": world // (ep * tp * pp)}


def _twin(groups: list[dict], g: dict, where: str) -> int:
    hits = [i for i, h in enumerate(groups)
            if all(h.get(k, d) == g.get(k, d) for k, d in zip(_IDENTITY, _DEFAULTS, strict=True))]
    if len(hits) != 1:
        ident = {k: g.get(k) for k in _IDENTITY}
        raise MappingError(f"param group {ident}: {len(hits)} dense groups have its identifiers; statekit does not "
                           "guess where its parameters go", where)
    return hits[0]


def _join(dense: list[dict], expert: list[dict], where: str) -> list[dict]:
    """EP > 1 → EP 1: the expert groups into their dense twins (every entry but the flag equal)."""
    for g in expert:
        twin = dense[_twin(dense, g, where)]
        differ = sorted(k for k in set(twin) | set(g) if k != "is_expert_parallel" and twin.get(k) != g.get(k))
        if differ:
            raise MappingError(f"the expert param group {({k: g.get(k) for k in _IDENTITY})} has other {differ} than "
                               "the dense group it joins at EP 1: statekit does not choose", where)
    return dense


def _split(groups: list[dict], used: dict[int, set[bool]]) -> tuple[list[dict], list[dict]]:
    """EP 1 → EP > 1: each member keeps the groups its parameters are in (in the source's order)."""
    dense = [g for i, g in enumerate(groups) if False in used.get(i, set())]
    expert = [dict(g, is_expert_parallel=True) for i, g in enumerate(groups) if True in used.get(i, set())]
    return dense, expert


def target_groups(members: list[list[dict]], used: dict[int, set[bool]], apart: bool,
                  where: str) -> tuple[list[list[dict]], str | None]:
    """The target's members' param groups and the note saying what moved. ``members``: the
    source's (one, or dense + expert); ``used``: for each of a one-member source's groups, whether
    dense (False) and expert (True) parameters are in it."""
    if len(members) not in (1, 2):
        raise MappingError(f"a ChainedOptimizer of {len(members)} members: statekit writes dense + expert only", where)
    for i, groups in enumerate(members):
        flags = {bool(g.get("is_expert_parallel", False)) for g in groups}
        if flags - {len(members) == 2 and i == 1}:
            raise MappingError(f"optimizer member {i}'s param groups are marked is_expert_parallel {sorted(flags)}: "
                               "not the dense + expert members statekit knows", where)
    if (len(members) == 2) == apart:
        return members, None
    if not apart:
        return [_join(*members, where)], ("EP 1: the experts are dense parameters in one optimizer (each expert group "
                                           "joined the dense group of its identifiers, every entry and the step equal)")
    dense, expert = _split(members[0], used)
    if not expert:
        raise MappingError("--ep > 1 but no parameter is an expert's: nothing for the expert optimizer", where)
    return [dense, expert], ("EP > 1: the experts get their own optimizer (the ChainedOptimizer's second member), "
                             "with the groups they were in marked is_expert_parallel")


def common_optimizer(members: list[list[dict]], sharding: str) -> dict:
    """The common state's ``optimizer`` for fully_reshardable: one member's dict, or ``{i: …}``."""
    parts = [{"optimizer": {"param_groups": groups}, "param_state_sharding_type": sharding} for groups in members]
    return parts[0] if len(parts) == 1 else dict(enumerate(parts))


def groups_used(state) -> dict[int, set[bool]]:
    """For each param group of the read optimizer, whether dense (False) and expert (True)
    parameters are in it (the reader placed each by Megatron's rule and proved its master)."""
    used: dict[int, set[bool]] = {}
    for p in state.params:
        used.setdefault(p.group, set()).add(EXPERT in p.key)
    return used


def target(members: list[list[dict]] | None, used: dict[int, set[bool]], sizes: dict[str, int], sharding: str,
           notes: list[str], where: str) -> list[list[dict]] | None:
    """The target's optimizer members (None: a dense run's, the source's groups as they are)."""
    if members is None:
        if "expert_dp" in sizes:  # experts, but a source whose optimizer members statekit did not read
            raise MappingError("a MoE run (experts) from this source: statekit writes the torch_dist optimizer of a "
                               "MoE torch_dist source only yet", where)
        return None
    apart = experts_apart(sizes["ep"], sizes["tp"], sizes["tp"])
    if sharding != "fully_reshardable" and apart:
        raise MappingError(f"--sharding {sharding} for a MoE run at EP {sizes['ep']}: statekit writes the expert "
                           "optimizer fully_reshardable only yet (Megatron loads that at any EP/TP/PP/DP)", where)
    out, note = target_groups(members, used, apart, where)
    if note:
        notes.append(note)
    return out
