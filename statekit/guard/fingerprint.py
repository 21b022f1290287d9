"""Fingerprints of live optimizers and schedulers, and where they are saved beside a checkpoint.

A fingerprint holds per parameter its name, shape, step and, for every state tensor, a few
statistics and a digest of :data:`SAMPLE` elements at fixed positions; each param group's
hyperparameters and members; the LR scheduler's position. torch is imported only when a function runs."""

from __future__ import annotations

import hashlib
import json
import math
import os

from statekit.guard.report import ResumeError

FILE = "statekit-guard.json"
VERSION = 1
SAMPLE = 16  # elements sampled per state tensor, at fixed evenly spaced positions
# prefixes wrappers add to parameter names (DDP's module., torch.compile's _orig_mod.)
WRAPPERS = ("module.", "_orig_mod.")


def _name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPERS:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def _unwrap(optimizer):
    """The torch optimizer inside a wrapper (Accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            break
        optimizer = inner
    return optimizer


def _index_cache():
    cache: dict = {}

    def index(torch, n: int, device):
        key = (n, str(device))
        if key not in cache:
            cache[key] = torch.linspace(0, n - 1, SAMPLE, dtype=torch.float64).round().long().to(device)
        return cache[key]

    return index


_INDEX = _index_cache()
_DTYPES: dict = {}


def _tensor_facts(torch, t, pending: list) -> dict:
    """A state tensor's facts; its sampled elements are queued on ``pending`` (:func:`_settle` fills in
    their statistics and digest, all tensors at once: a few torch calls per state, not per tensor)."""
    if hasattr(t, "to_local"):  # a DTensor (FSDP2): this rank's shard
        t = t.to_local()
    n = t.numel()
    dtype = _DTYPES.get(t.dtype) or _DTYPES.setdefault(t.dtype, str(t.dtype).removeprefix("torch."))
    facts = {"dtype": dtype, "shape": list(t.shape)}
    if n == 0:
        return facts | {"digest": "", "sampled": 0}
    # torch.take reads flat (row-major) positions of any layout: one call, no reshape
    pending.append((facts, torch.take(t, _INDEX(torch, n, t.device)) if n > SAMPLE else t.reshape(-1)))
    return facts


def _settle(torch, pending: list) -> None:
    """Statistics and digests of the queued samples, stacked by dtype and length."""
    batches: dict = {}
    for facts, sample in pending:
        batches.setdefault((sample.dtype, sample.numel(), sample.device), []).append((facts, sample))
    for (_dtype, k, _device), items in batches.items():
        stacked = torch.stack([s for _, s in items]).cpu()
        raw = stacked.view(torch.uint8).numpy()
        values = (stacked.abs() if stacked.is_complex() else stacked).double()
        finite = torch.isfinite(values)
        mags = torch.where(finite, values.abs(), torch.zeros((), dtype=torch.float64))
        counted = finite.sum(1)
        stats = torch.stack([(values == 0).sum(1).double(), k - counted.double(), mags.sum(1), mags.amax(1)], 1)
        for (facts, _), row, (zeros, nonfinite, total, top), finite_n in zip(items, raw, stats.tolist(),
                                                                             counted.tolist(), strict=True):
            facts.update(digest=hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest(), sampled=k,
                         zeros=int(zeros), nonfinite=int(nonfinite),
                         absmean=total / finite_n if finite_n else None, absmax=top if finite_n else None)


def _plain(value):
    """A hyperparameter as JSON keeps it (tensors as numbers, tuples as lists); None when it cannot."""
    if hasattr(value, "item") and hasattr(value, "numel"):
        return value.item() if value.numel() == 1 else None
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, list | tuple):
        items = [_plain(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value, strict=True)) else items
    return None


def _optimizer_fingerprint(torch, optimizer, names: dict[int, str], pending: list) -> dict:
    optimizer = _unwrap(optimizer)
    params, groups = [], []
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        members = []
        for j, p in enumerate(group["params"]):
            name = names.get(id(p)) or (_name(given[j]) if given and j < len(given) else None) or f"#{index}"
            members.append(name)
            st = optimizer.state.get(p)
            entry = {"name": name, "index": index, "group": g, "shape": list(p.shape), "state": None}
            if st:
                step = st.get("step")
                fields = {}
                for k, v in st.items():
                    if k == "step":
                        continue
                    if torch.is_tensor(v):
                        fields[k] = _tensor_facts(torch, v, pending)
                    elif (pv := _plain(v)) is not None:
                        fields[k] = {"value": pv}
                entry["state"] = {"step": float(step) if step is not None else None, "fields": fields}
            params.append(entry)
            index += 1
        hyper = {k: _plain(v) for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({"params": members, "hyper": {k: v for k, v in hyper.items() if v is not None}})
    return {"class": type(optimizer).__name__, "params": params, "groups": groups}


def _scheduler_fingerprint(scheduler) -> dict:
    sd = scheduler.state_dict() if hasattr(scheduler, "state_dict") else {}
    keep = {k: _plain(v) for k, v in sd.items() if k in ("last_epoch", "_step_count", "_last_lr", "base_lrs")}
    return {"class": type(scheduler).__name__, "state": {k: v for k, v in keep.items() if v is not None}}


def _listed(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, list | tuple) else [x]


def _names(models) -> dict[int, str]:
    out: dict[int, str] = {}
    for m in models:
        for name, p in m.named_parameters():
            out.setdefault(id(p), _name(name))
    return out


def fingerprint(optimizer, *, scheduler=None, model=None) -> dict:
    """The fingerprint of live optimizers (one, or a list) and schedulers, as :func:`save_fingerprint` writes it."""
    import torch

    names = _names(_listed(model))
    pending: list = []
    with torch.no_grad():
        optimizers = [_optimizer_fingerprint(torch, o, names, pending) for o in _listed(optimizer)]
        _settle(torch, pending)
    return {"statekit_guard": VERSION, "sample": SAMPLE, "optimizers": optimizers,
            "schedulers": [_scheduler_fingerprint(s) for s in _listed(scheduler)]}


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def fingerprint_path(where: str | os.PathLike) -> str:
    """Where the fingerprint for ``where`` lives: inside a checkpoint folder, beside a checkpoint file
    (``ckpt.pt`` → ``ckpt.pt.statekit-guard.json``), or ``where`` itself when it ends in ``.json``; one
    file per rank when several ranks run."""
    where = os.fspath(where)
    if where.endswith(".json"):
        path = where
    elif os.path.isdir(where) or not os.path.splitext(where)[1]:
        path = os.path.join(where, FILE)
    else:
        path = f"{where}.{FILE}"
    rank, world = _rank()
    return path if world == 1 else f"{path[:-5]}-rank{rank}.json"


def save_fingerprint(optimizer, where: str | os.PathLike, *, scheduler=None, model=None) -> str:
    """Write the fingerprint of ``optimizer`` (and ``scheduler``, named through ``model``) for the
    checkpoint at ``where``; returns the file written."""
    path = fingerprint_path(where)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = json.dumps(fingerprint(optimizer, scheduler=scheduler, model=model), separators=(",", ":"))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(data)
    os.replace(tmp, path)
    return path


def load_fingerprint(where: str | os.PathLike) -> tuple[dict, str]:
    path = fingerprint_path(where)
    try:
        with open(path, encoding="utf-8") as fh:
            saved = json.load(fh)
    except FileNotFoundError:
        raise ResumeError("no fingerprint to check the resume against (save_fingerprint writes it at save)",
                          path) from None
    except (OSError, ValueError) as exc:
        raise ResumeError(f"not a statekit guard fingerprint: {exc}", path) from None
    if not isinstance(saved, dict) or saved.get("statekit_guard") != VERSION:
        raise ResumeError(f"not a statekit guard fingerprint of version {VERSION}", path)
    return saved, path
