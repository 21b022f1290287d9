"""Two optimizers over one model ⇄ one burn record with two groups.

torch's Muon takes only 2-D parameters, so a real torch Muon run keeps a second optimizer (AdamW)
for the others: two optimizers, two state_dicts. burn composes the same run in one
``ModuleOptimizer`` (``with_group``), whose record holds both families parameter by parameter.

- torch pair → burn: ``convert muon.pt out.bpk --also adamw.pt`` (``--also-key`` when the second
  state sits in a checkpoint). The second state's parameters join as the record's next groups;
  ``statekit.groups`` metadata keeps each group's optimizer and hyperparameters.
- burn → torch pair: ``convert out.bpk muon.pt --also-out adamw.pt``: the output gets the family
  named first by ``--optimizer`` (else the first group's), ``--also-out`` the other one.

Where burn keeps the same fields for two families (SGD-momentum and Muon, Adam and AdamW) and the
file does not say which, ``--optimizer A,B`` settles each part; a part left open is refused.
"""

from __future__ import annotations

from dataclasses import replace

from statekit import hyper
from statekit.errors import MappingError, UsageError
from statekit.ops.plan import Plan
from statekit.state import OptimizerState, ParamGroup

ALSO_PREFIX = "also:"  # source keys of the second input's parameters (torch positions repeat)


def wanted_families(optimizer: str | None) -> list[str]:
    return [w.strip().lower() for w in (optimizer or "").split(",") if w.strip()]


def merge(a: OptimizerState, b: OptimizerState, b_path: str) -> OptimizerState:
    """One state holding ``a``'s groups, then ``b``'s (keys of ``b`` prefixed, groups renumbered);
    each parameter keeps its own family."""
    for s, where in ((a, "the input"), (b, b_path)):
        if not s.family or s.family == "mixed":
            raise MappingError(f"{where}: the optimizer family could not be determined ({s.family_label}); "
                               "--also pairs two states of known optimizers")
        if s.framework != "torch":
            raise UsageError("--also pairs two torch optimizer states (a Muon run's Muon and AdamW)")
    paths_a = {p.path for p in a.params if p.path}
    both = sorted(p.path for p in b.params if p.path in paths_a)
    if both:
        raise MappingError(f"parameters in both optimizer states: {', '.join(both[:4])}", b_path)
    offset = len(a.groups)
    params = [replace(p, family=a.family) for p in a.params]
    for p in b.params:
        params.append(replace(p, key=ALSO_PREFIX + p.key, group=p.group + offset, family=b.family))
    groups = [ParamGroup(dict(g.hyperparams), list(g.keys)) for g in a.groups]
    groups += [ParamGroup(dict(g.hyperparams), [ALSO_PREFIX + k for k in g.keys]) for g in b.groups]
    names = a.names_from if a.names_from == b.names_from else "; ".join(x for x in (a.names_from, b.names_from) if x)
    return OptimizerState(family="mixed", params=params, groups=groups, hyperparams_stored=True, framework="torch",
                          notes=a.notes + b.notes, names_from=names or None)


def families_of_groups(state: OptimizerState) -> list[str | None]:
    """Each group's family (None where its parameters disagree or are unknown)."""
    out = []
    for i in range(max(len(state.groups), 1)):
        fams = {p.family for p in state.params if p.group == i}
        out.append(fams.pop() if len(fams) == 1 else None)
    return out


def settle(state: OptimizerState, wanted: list[str], path: str) -> None:
    """Give every parameter of a record mixing families its own, from ``--optimizer A,B`` where the
    fields cannot tell (burn keeps SGD-momentum's and Muon's, Adam's and AdamW's, alike): each name
    settles the part it fits (:meth:`OptimizerState.resolved`); a part left open is refused."""
    unknown = [p.label() for p in state.params if p.family is None]
    if unknown:
        raise MappingError(f"parameters {', '.join(unknown[:3])}: unrecognised state layout; statekit converts "
                           "only states it recognises exactly", path)
    open_names = {c for p in state.ambiguous for c in p.candidates}
    settled = {p.family for p in state.params}
    stray = [w for w in wanted if w not in open_names and w not in settled]
    if stray:
        raise UsageError(f"--optimizer {','.join(stray)}: no parameter's state can be that (the file holds "
                         f"{state.family_label})")
    names = [w for w in wanted if w in open_names]
    if names:
        state.resolved(names)
    if state.ambiguous:
        parts = list(dict.fromkeys(wanted + [p.candidates[-1] for p in state.ambiguous]
                                   + [p.family for p in state.params if not p.candidates]))
        raise UsageError(f"{path} holds {state.family_label.removeprefix('mixed: ')}: burn keeps identical state "
                         f"for {' and '.join(sorted({'/'.join(p.candidates) for p in state.ambiguous}))}; say "
                         f"which with --optimizer {','.join(parts)} (one name per part)")


def split(state: OptimizerState, wanted: list[str]) -> list[tuple[str, OptimizerState]]:
    """A state mixing families as one state per family, in the order of ``wanted`` (then of the
    groups): each keeps its groups (renumbered) and its parameters' torch order."""
    order: list[str] = [w for w in wanted if any(p.family == w for p in state.params)]
    for f in families_of_groups(state) + [p.family for p in state.params]:
        if f and f not in order:
            order.append(f)
    out = []
    for fam in order:
        members = [p for p in state.params if p.family == fam]
        old_groups = sorted({p.group for p in members})
        renumber = {g: i for i, g in enumerate(old_groups)}
        groups = [ParamGroup(dict(state.groups[g].hyperparams) if g < len(state.groups) else {},
                             [p.key for p in members if p.group == g]) for g in old_groups]
        params = [replace(p, group=renumber[p.group]) for p in members]
        if all(p.index is not None for p in params):  # torch positions of this optimizer alone
            ranked = sorted(params, key=lambda p: p.index)
            for i, p in enumerate(ranked):
                p.index = i
        out.append((fam, OptimizerState(family=fam, candidates=(fam,), params=params, groups=groups,
                                        hyperparams_stored=state.hyperparams_stored, framework=state.framework,
                                        notes=list(state.notes), names_from=state.names_from)))
    return out


def combine(plans: list[Plan]) -> Plan:
    """One plan for a burn record from the plans of each optimizer (groups one after the other)."""
    first = plans[0]
    out = replace(first, params=[], hyperparams=[], assumed=[], transforms=[], warnings=[], metadata={})
    families: list[str] = []
    offset = 0
    exact = []
    for plan in plans:
        for a in plan.params:
            out.params.append(replace(a, group=a.group + offset))
        out.transforms += [dict(t, group=t["group"] + offset) for t in plan.transforms]
        n = max(len(plan.hyperparams), 1)
        out.hyperparams += plan.hyperparams or [{}]
        families += [plan.family] * n
        out.assumed = sorted(set(out.assumed) | set(plan.assumed))
        out.warnings += [w for w in plan.warnings if w not in out.warnings]
        if plan.exactness:
            exact.append(f"{plan.family}: {plan.exactness}")
        offset += n
    out.group_families = families
    out.family = "+".join(dict.fromkeys(families))
    out.exactness = "; ".join(exact) or None
    members = [[a.dst_id for a in out.params if a.group == i and a.action not in ("drop", "new")]
               for i in range(len(out.hyperparams))]
    out.metadata = hyper.groups_to_metadata(out.hyperparams, members, families)
    paths = {}
    for plan in plans:
        paths.update(hyper.paths_from_metadata(plan.metadata))
    out.metadata.update(hyper.paths_to_metadata(paths))
    seen: dict[str, str] = {}
    for a in out.params:
        if a.dst_id and a.action not in ("drop", "new"):
            if a.dst_id in seen:
                raise MappingError(f"{seen[a.dst_id]} and {a.dst_path} get the same burn ParamId {a.dst_id}")
            seen[a.dst_id] = a.dst_path or a.src_key
    return out
