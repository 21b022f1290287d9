"""DeepSpeed checkpoint files, read without DeepSpeed or torch.

A ZeRO checkpoint (``engine.save_checkpoint(dir, tag)``) is a folder ``dir/<tag>/`` (``dir/latest``
names the newest tag) holding ``torch.save`` files:

- ``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``: one per data-parallel rank, the
  optimizer state of that rank's flat partition (layout: :mod:`statekit.frameworks.deepspeed_io`);
- ``mp_rank_{mp:02d}_model_states.pt`` (stage 1/2) or ``zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt``
  (stage 3): ``param_shapes`` (per optimizer group, name → ``torch.Size`` in flattening order),
  the module's state_dict, ``ds_config``, ``ds_version``, ``global_steps``…

A universal checkpoint (``ds_to_universal``) is ``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``
(``{'param': tensor, 'cat_dim': int[, 'vocab_tensor': True]}``; ``step.pt`` a 0-dim tensor) plus
``zero/optimizer_state.pt`` (param_groups…) and the ``*model_states.pt`` files.

Their pickles name a few DeepSpeed classes besides torch's; they are allowed by exact name and
built as plain records (``ZeroStageEnum`` becomes its integer): sources
``deepspeed/runtime/zero/config.py``, ``deepspeed/runtime/fp16/loss_scaler.py``,
``deepspeed/utils/tensor_fragment.py``. Anything else is refused before anything runs.
"""

from __future__ import annotations

import os
import re

from statekit.errors import FormatError
from statekit.formats import torch_pickle, torch_pt
from statekit.formats.torch_pickle import RecordClass

OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


def _stage(value: object) -> int:
    if type(value) is not int or not 0 <= value <= 3:
        raise FormatError(f"ZeroStageEnum({value!r}) is not a ZeRO stage")
    return value


def _globals() -> dict[str, object]:
    allowed: dict[str, object] = {
        "deepspeed.runtime.zero.config.ZeroStageEnum": torch_pickle.allowed_callable("ZeroStageEnum", _stage),
        "argparse.Namespace": RecordClass("argparse.Namespace"),
    }
    for name in ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                 "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                 "deepspeed.utils.tensor_fragment.fragment_address"):
        allowed[name] = RecordClass(name)
    return allowed


DS_GLOBALS = _globals()


def load(path: str) -> object:
    """One DeepSpeed ``torch.save`` file (zip or legacy format), tensors lazy."""
    return torch_pt.load_pt(path, DS_GLOBALS)


def is_zero_dir(path: str) -> bool:
    """A tag folder with ZeRO optimizer shards (or a checkpoint folder whose ``latest`` names one)."""
    return tag_dir(path) is not None


def tag_dir(path: str) -> str | None:
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    if any(OPTIM_FILE.match(n) for n in names):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest, "rb") as fh:
            tag = os.fsdecode(fh.read(256).strip())  # a tag folder's name as its bytes are (UTF-8 or not)
        inner = os.path.join(path, tag)
        if tag and os.sep not in tag and "\0" not in tag and os.path.isdir(inner) and any(
                OPTIM_FILE.match(n) for n in os.listdir(inner)):
            return inner
    return None


def directory_of(path: str) -> str | None:
    """The ZeRO tag folder when ``path`` is one of its shard files (read together, never alone)."""
    name = os.path.basename(path)
    parent = os.path.dirname(os.path.abspath(path))
    if (OPTIM_FILE.match(name) or MODEL_FILE.match(name)) and tag_dir(parent) == parent:
        return parent
    return None


def is_universal_dir(path: str) -> bool:
    zero = os.path.join(path, "zero")
    return os.path.isdir(zero) and os.path.isfile(os.path.join(zero, "optimizer_state.pt"))


def claims(head: bytes, path: str) -> bool:
    """Registry sniffer (directories): a ZeRO checkpoint or a universal checkpoint."""
    return is_zero_dir(path) or is_universal_dir(path)


def optim_files(tag: str) -> dict[int, str]:
    """dp rank → optimizer shard file (model-parallel rank 0 only; others are refused)."""
    found: dict[int, str] = {}
    for name in sorted(os.listdir(tag)):
        m = OPTIM_FILE.match(name)
        if not m:
            continue
        if int(m.group(3)) != 0:
            raise FormatError("model-parallel (mp_rank > 0) ZeRO checkpoints are not supported yet", tag)
        dp = int(m.group(2))
        if dp in found:
            raise FormatError(f"two optimizer shards for data-parallel rank {dp} (bf16 and fp32?)", tag)
        found[dp] = os.path.join(tag, name)
    ranks = sorted(found)
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        raise FormatError(f"optimizer shards of data-parallel ranks {missing} are missing", tag)
    return found


def model_file(tag: str) -> str:
    """The model-states file holding ``param_shapes`` (rank 0's)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(tag, name)):
            return os.path.join(tag, name)
    raise FormatError("no mp_rank_00_model_states.pt: param_shapes (the parameter names) are missing", tag)
