"""Optimizer state_dicts keyed by parameter name (FQN), as torch.distributed writes them.

``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` returns the usual
``{"state": ..., "param_groups": [...]}`` with parameter *names* where ``torch.optim`` has
integer ids::

    {"state": {"fc.weight": {"step": t, "exp_avg": t, ...}, ...},
     "param_groups": [{"lr": ..., "params": ["fc.weight", "fc.bias"]}, ...]}

(``dcp.save`` stores it flattened as ``state.<fqn>.<field>``, ``param_groups.<i>.<key>``;
``dcp_to_torch_save`` writes the nested dict back to one ``.pt``). With
``StateDictOptions(flatten_optimizer_state_dict=True)`` (torchtitan) the dict itself is flat:
``state.<fqn>.<field>`` and ``param_groups.<fqn>.<key>`` — one hyperparameter copy per parameter.

This module turns both into the positional form :mod:`statekit.frameworks.torch_state` reads
(ids in group order, ``param_names`` carrying the FQNs), and builds the FQN form for writing.
Nothing is dropped: a state entry for a name in no group is refused, not skipped.
"""

from __future__ import annotations

from statekit.errors import FormatError
from statekit.tensor import TensorRef

STATE, GROUPS, PARAMS = "state", "param_groups", "params"


def is_fqn_optimizer(obj: object) -> bool:
    """An optimizer state_dict whose groups list parameter names instead of integer ids."""
    if not (isinstance(obj, dict) and isinstance(obj.get(STATE), dict) and isinstance(obj.get(GROUPS), list)):
        return False
    ids = [i for g in obj[GROUPS] if isinstance(g, dict) and isinstance(g.get(PARAMS), list) for i in g[PARAMS]]
    return bool(ids) and all(isinstance(i, str) for i in ids)


def to_positional(sd: dict, path: str) -> dict:
    """The positional state_dict for an FQN-keyed one: parameter ``i`` is the ``i``-th name across
    the groups, ``param_names`` keeps the names. Refuses duplicate names and orphaned state."""
    state: dict[int, object] = {}
    groups = []
    index: dict[str, int] = {}
    for g, group in enumerate(sd[GROUPS]):
        if not isinstance(group, dict) or not isinstance(group.get(PARAMS), list):
            raise FormatError(f"param_groups[{g}] has no 'params' list", path)
        names = group[PARAMS]
        ids = []
        for name in names:
            if not isinstance(name, str):
                raise FormatError(f"param_groups[{g}] mixes parameter names and ids ({name!r})", path)
            if name in index:
                raise FormatError(f"parameter {name!r} is listed in two param_groups", path)
            index[name] = len(index)
            ids.append(index[name])
            if name in sd[STATE]:
                state[index[name]] = sd[STATE][name]
        groups.append({**{k: v for k, v in group.items() if k not in (PARAMS, "param_names")},
                       PARAMS: ids, "param_names": list(names)})
    orphans = [k for k in sd[STATE] if k not in index]
    if orphans:
        raise FormatError(f"optimizer state for {orphans[0]!r} (and {len(orphans) - 1} more) belongs to no "
                          "param_group" if len(orphans) > 1 else
                          f"optimizer state for {orphans[0]!r} belongs to no param_group", path)
    return {STATE: state, GROUPS: groups}


def is_flat_optimizer(obj: object) -> bool:
    """``flatten_optimizer_state_dict=True`` output: only ``state.*`` and ``param_groups.*`` keys."""
    # the all() first: it stops at the first other key (a model state_dict's first name)
    return (isinstance(obj, dict) and bool(obj)
            and all(isinstance(k, str) and k.startswith((STATE + ".", GROUPS + ".")) for k in obj)
            and any(k.startswith(GROUPS + ".") for k in obj))


def unflatten(flat: dict, path: str) -> tuple[dict, list[str]]:
    """The nested FQN form of a flat optimizer dict, and notes on what had to be inferred.

    Names come from ``param_groups.<fqn>.<key>`` (hyperparameter keys hold no dots); each
    ``state.<fqn>.<field>`` is matched to the longest known name. Groups are the runs of names
    with equal hyperparameters (the flat form does not record them), in first-seen order.
    """
    hps: dict[str, dict] = {}
    for key, value in flat.items():
        if key.startswith(GROUPS + "."):
            fqn, _, hp = key[len(GROUPS) + 1:].rpartition(".")
            if not fqn:
                raise FormatError(f"flat optimizer key {key!r} names no parameter", path)
            hps.setdefault(fqn, {})[hp] = value
    names = sorted(hps, key=len, reverse=True)
    state: dict[str, dict] = {}
    for key, value in flat.items():
        if not key.startswith(STATE + "."):
            continue
        rest = key[len(STATE) + 1:]
        fqn = next((n for n in names if rest.startswith(n + ".")), None)
        if fqn is None:
            raise FormatError(f"flat optimizer key {key!r} belongs to no parameter of the param_groups", path)
        node = state.setdefault(fqn, {})
        parts = rest[len(fqn) + 1:].split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    groups: list[dict] = []
    for fqn, hp in hps.items():
        for group in groups:
            if _same(group["__hp"], hp):
                group[PARAMS].append(fqn)
                break
        else:
            groups.append({"__hp": hp, **hp, PARAMS: [fqn]})
    for group in groups:
        del group["__hp"]
    notes = [f"flattened optimizer state: {len(groups)} param group(s) inferred from equal hyperparameters"]
    return {STATE: state, GROUPS: groups}, notes


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(not isinstance(a[k], TensorRef) and a[k] == b[k] for k in a)


def normalize(obj: object, path: str) -> tuple[object, list[str]]:
    """``obj`` with every FQN-keyed or flat optimizer dict (itself, or one entry down) made
    positional; returns the object and notes for the user."""
    notes: list[str] = []

    def fix(node: object) -> object:
        if is_flat_optimizer(node):
            node, more = unflatten(node, path)
            notes.extend(more)
        if is_fqn_optimizer(node):
            notes.append("optimizer state keyed by parameter name (torch.distributed form)")
            return to_positional(node, path)
        return node

    obj = fix(obj)
    # one entry down; only dicts can change (a state_dict of 10^6 tensors is kept: its values' types, C-level)
    if isinstance(obj, dict) and any(issubclass(kind, dict) for kind in set(map(type, obj.values()))):
        fixed = {k: new for k, v in obj.items() if isinstance(v, dict) and (new := fix(v)) is not v}
        if fixed:
            obj = {k: fixed.get(k, v) for k, v in obj.items()}
    return obj, notes


def from_positional(sd: dict) -> dict:
    """The FQN-keyed form (what ``set_optimizer_state_dict`` takes) of a positional state_dict
    whose groups carry ``param_names``."""
    state: dict[str, object] = {}
    groups = []
    for g, group in enumerate(sd[GROUPS]):
        names = group.get("param_names")
        if names is None or len(names) != len(group[PARAMS]):
            raise FormatError(f"param_groups[{g}] has no parameter names; torch.distributed keys state by name")
        for idx, name in zip(group[PARAMS], names, strict=True):
            if idx in sd[STATE]:
                state[name] = sd[STATE][idx]
        groups.append({**{k: v for k, v in group.items() if k not in (PARAMS, "param_names")}, PARAMS: list(names)})
    return {STATE: state, GROUPS: groups}
