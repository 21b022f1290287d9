"""Schedule files written beside a converted optimizer, each as its own program writes it.

* :func:`write_torch_scheduler`: a torch LR scheduler's ``state_dict()`` as ``torch.save`` writes it
  (``scheduler.pt``: loads with ``torch.load(weights_only=True)`` and ``load_state_dict``);
  :func:`lambda_lr_state` is the LambdaLR state HF Trainer saves and loads, keys in torch's order.
* :func:`write_burn_scheduler`: a burn 0.22 scheduler record (``scheduler-N.bpk``: a burnpack of
  scalars only, the Learner's group 0 under ``0.``), with statekit's string metadata (burn ignores it).
* :func:`write_trainer_state`: ``trainer_state.json`` as ``TrainerState.save_to_json`` writes it
  (``indent=2, sort_keys=True``).

Each write is atomic and returns the bytes written.
"""

from __future__ import annotations

import json
import os

from statekit.atomic import atomic_write


def lambda_lr_state(base_lrs: list[float], position: int, lrs: list[float], plain_function: bool = False) -> dict:
    """A LambdaLR's ``state_dict()`` standing at ``position`` (the next update uses ``lrs``).

    ``lr_lambdas``: ``None`` per group for a plain function (HF ``constant``), ``{}`` for a
    ``functools.partial`` (every other HF schedule): what ``state_dict()`` keeps of each."""
    return {"base_lrs": [float(b) for b in base_lrs], "last_epoch": int(position), "_step_count": int(position) + 1,
            "_is_initial": False, "_get_lr_called_within_step": False, "_last_lr": [float(x) for x in lrs],
            "lr_lambdas": [None if plain_function else {} for _ in base_lrs]}


def write_torch_scheduler(path: str, state: dict) -> int:
    from statekit.formats import torch_pt

    torch_pt.save_pt(state, path)
    return os.path.getsize(path)


def write_burn_scheduler(path: str, counters: dict, metadata: dict[str, str] | None = None) -> int:
    """``counters``: record key → ``(variant, value)`` (``{"0.current_iter": ("UInt", 4)}``)."""
    from statekit.formats.burnpack import Scalar, write_burnpack

    scalars = {key: Scalar(kind, value) for key, (kind, value) in counters.items()}
    return write_burnpack(path, [], metadata or {}, scalars)


def write_trainer_state(path: str, state: dict) -> int:
    data = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
    with atomic_write(path) as fh:
        fh.write(data)
    return len(data)


def copy_file(src: str, dst: str) -> int:
    """A schedule file that applies unchanged (same framework), copied byte for byte."""
    with open(src, "rb") as fh, atomic_write(dst) as out:
        while chunk := fh.read(1 << 20):
            out.write(chunk)
    return os.path.getsize(dst)
