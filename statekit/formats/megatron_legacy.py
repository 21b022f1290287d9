"""Megatron-LM legacy checkpoints (``--ckpt-format torch``), read without Megatron or torch.

A save root holds ``latest_checkpointed_iteration.txt`` (an iteration number, or ``release``) and
one folder per saved iteration, ``iter_{N:07d}/`` (or ``release/``). Each iteration folder holds
one folder per model-parallel rank, ``mp_rank_{tp:02d}`` with ``_{pp:03d}`` when PP > 1 and
``_{ep:03d}`` when EP > 1 (:func:`statekit.frameworks.megatron.names.parse_rank_dir` tells a lone
three-digit part apart with args), each with ``model_optim_rng.pt`` (``args``, ``iteration``, the
rank's ``model`` state, ``optimizer``, ``opt_param_scheduler``, ``rng_state``…) and, with the
distributed optimizer, ``distrib_optim.pt`` (the parameter state, gathered over DP×CP).
Sources: Megatron-LM ``megatron/training/checkpointing.py`` (``get_checkpoint_name``,
``read_metadata``), ``/work/shared/docs/megatron-formats.md`` §1.

The pickles are read by statekit's own interpreter (:mod:`statekit.formats.torch_pickle`), tensors
lazy; the globals allowed beyond torch's are exactly Megatron's own allow-list
(``megatron/core/safe_globals.py`` ``SAFE_GLOBALS``), each built as a plain record or value:
``argparse.Namespace``, ``types.SimpleNamespace``, ``OptimizerConfig`` and ``io.BytesIO`` as
records; the enums (``AttnBackend``, ``CudaGraphModule``, ``CudaGraphScope``,
``InferenceCudaGraphScope``, ``ModelType``, ``RerunDiagnostic``, ``RerunMode``, ``RerunState``,
``signal.Signals``) as their values; ``pathlib.PosixPath`` as its text; numpy's ``_reconstruct``,
``ndarray``, ``dtype``, ``UInt32DType`` and ``torch._C.Generator`` (the RNG states) as records whose
state is kept unread. Nothing of any class is imported or run; any other global is refused.
"""

from __future__ import annotations

import os
import posixpath
import re

from statekit.errors import FormatError
from statekit.formats import torch_pickle, torch_pt
from statekit.formats.torch_pickle import Record, RecordClass

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DISTRIB_FILE = "distrib_optim.pt"
ITER_DIR = re.compile(r"^iter_(\d{7,})$")
RANK_DIR = re.compile(r"^mp_rank_\d{2}(?:_\d{3})?(?:_\d{3})?$")

_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "signal.Signals",
)
_RECORDS = (
    "argparse.Namespace",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.optimizer.OptimizerConfig",
)
_BYTES_IO = ("_io.BytesIO", "io.BytesIO")  # NEWOBJ + BUILD((value, position, attributes))
_OPAQUE = (  # REDUCE'd, then BUILT: kept as records, their state unread (RNG states)
    "numpy.core.multiarray._reconstruct",
    "numpy._core.multiarray._reconstruct",
    "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    "torch._C.Generator",
)


def _enum(name: str):
    def make(value: object, *_rest: object) -> object:
        if not isinstance(value, int | str | float | tuple):
            raise FormatError(f"{name}({value!r}) is not an enum value")
        return value

    return torch_pickle.allowed_callable(name, make)


def _opaque(name: str):
    def make(*args: object) -> Record:
        return Record(name, {"args": args})

    return torch_pickle.allowed_callable(name, make)


def _simple_namespace(*args: object) -> Record:
    if args not in ((), ({},)) and not (len(args) == 1 and isinstance(args[0], dict)):
        raise FormatError("types.SimpleNamespace is created with arguments other than a dict")
    return Record("types.SimpleNamespace", dict(args[0]) if args else {})


def _path(*parts: object) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise FormatError(f"PosixPath arguments {parts!r} are not strings")
    return posixpath.join(*parts) if parts else "."


def _globals() -> dict[str, object]:
    allowed: dict[str, object] = {name: RecordClass(name) for name in _RECORDS}
    allowed.update({name: RecordClass(name, ("value", "position", "attributes")) for name in _BYTES_IO})
    allowed.update({name: _enum(name) for name in _ENUMS})
    allowed.update({name: _opaque(name) for name in _OPAQUE})
    allowed["numpy.ndarray"] = RecordClass("numpy.ndarray")  # only as _reconstruct's first argument
    allowed["types.SimpleNamespace"] = torch_pickle.allowed_callable("types.SimpleNamespace", _simple_namespace)
    for module in ("pathlib", "pathlib._local"):
        allowed[f"{module}.PosixPath"] = torch_pickle.allowed_callable(f"{module}.PosixPath", _path)
    return allowed


MEGATRON_GLOBALS = _globals()


def load(path: str) -> object:
    """One Megatron ``torch.save`` file, tensors lazy (:func:`statekit.formats.torch_pt.load_pt`)."""
    return torch_pt.load_pt(path, MEGATRON_GLOBALS)


def _rank_dirs(folder: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(n for n in names if RANK_DIR.match(n) and os.path.isfile(os.path.join(folder, n, MODEL_FILE)))


def is_iteration_dir(path: str) -> bool:
    return os.path.isdir(path) and bool(_rank_dirs(path))


def read_tracker(root: str) -> str:
    """The iteration folder's name that ``latest_checkpointed_iteration.txt`` names."""
    tracker = os.path.join(root, TRACKER)
    with open(tracker, "rb") as fh:
        text = fh.read(64).decode("ascii", "replace").strip()
    if text == "release":
        return "release"
    if not text.isdigit():
        raise FormatError(f"{TRACKER} holds {text!r}, not an iteration number or 'release'", root)
    return f"iter_{int(text):07d}"


def iteration_dir(path: str) -> str | None:
    """The iteration folder ``path`` is, the one its tracker file names (a save root), or the one a
    rank folder lies in (one rank's files are read with the others, never alone)."""
    if not os.path.isdir(path):
        return None
    if is_iteration_dir(path):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    if RANK_DIR.match(os.path.basename(os.path.abspath(path))) and is_iteration_dir(parent):
        return parent
    if os.path.isfile(os.path.join(path, TRACKER)):
        try:
            inner = os.path.join(path, read_tracker(path))
        except (FormatError, OSError):
            return None
        return inner if is_iteration_dir(inner) else None
    return None


def directory_of(path: str) -> str | None:
    """The iteration folder when ``path`` is a rank folder's ``model_optim_rng.pt`` or
    ``distrib_optim.pt`` (read with the whole checkpoint: one rank's file names no parameter)."""
    if os.path.basename(path) not in (MODEL_FILE, DISTRIB_FILE):
        return None
    rank = os.path.dirname(os.path.abspath(path))
    parent = os.path.dirname(rank)
    if RANK_DIR.match(os.path.basename(rank)) and is_iteration_dir(parent):
        return parent
    return None


def claims(head: bytes, path: str) -> bool:
    """Registry sniffer (directories): a save root or an iteration folder with rank folders (a save
    root whose tracker names no such folder is claimed too, to be refused by name)."""
    if iteration_dir(path) is not None:
        return True
    if not os.path.isfile(os.path.join(path, TRACKER)):
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any((ITER_DIR.match(n) or n == "release") and is_iteration_dir(os.path.join(path, n)) for n in names)


def rank_dirs(iteration: str) -> list[str]:
    """The rank folders (names) of an iteration folder that hold a ``model_optim_rng.pt``."""
    found = _rank_dirs(iteration)
    if not found:
        raise FormatError(f"no mp_rank_*/{MODEL_FILE} in this folder", iteration)
    return found


def iteration_of(name: str) -> int | str:
    m = ITER_DIR.match(name)
    return int(m.group(1)) if m else name
