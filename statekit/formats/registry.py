"""Every file format statekit reads or writes, in one table: :data:`FORMATS`.

Each :class:`Format` entry says everything statekit knows about a format in one place: its name,
the extensions that imply it, the sniffer (owned by the container module under ``formats/``),
the function that opens a file as a :class:`~statekit.state.Checkpoint`, the function that
writes optimizer state and the one that writes named tensors (a model, parameters, gradients),
and the framework whose state layout the format holds. Every other table — the readers tried by
content, the output format of an extension, the framework of a format, the writer of a format —
is derived from this one (:func:`from_extension`, :func:`framework_of`, :func:`writer`, …).

**Adding a format is one entry here plus its modules**: the container under ``formats/``
(bytes ⇄ named tensors, with a ``claims(head, path) -> bool`` sniffer) and the framework module
under ``frameworks/`` (records ⇄ state) that implements :class:`statekit.frameworks.base.Framework`
(``open_checkpoint``, ``save_optimizer``, ``save_model``; any may be left out of the entry).
Nothing in ``ops/``, the CLI or the API changes. A directory format (DCP, a DeepSpeed folder,
a Hugging Face checkpoint folder) sets ``directory=True``: its sniffer then receives ``b""`` and
the directory's path and looks inside it itself.

The functions are named as ``"module:attribute"`` strings and imported only when used, so this
table sits on the bottom floor (it imports nothing of statekit above ``formats/``) and
``statekit --help`` loads no format it does not need.

The writer signature every ``write`` entry shares (see :class:`statekit.frameworks.base.OptimizerWriter`)::

    save_optimizer(state, path, *, family=None, groups=None, metadata=None, progress=None,
                   step_policy=None, on_warning=None) -> int   # bytes written

Writers read tensor data only through the lazy sources the state holds
(:class:`~statekit.tensor.TensorRef`: ``shape``, ``dtype``, ``nbytes``, ``iter_bytes(chunk)``),
one piece at a time, and write atomically.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from statekit.errors import FormatError, UsageError

SNIFF_BYTES = 512  # how much of a file's start the sniffers see


@dataclass(frozen=True)
class Format:
    """One format: the single source of every fact statekit keeps about it."""

    name: str
    framework: str  # whose state layout the format holds ("neutral": statekit's generic layout)
    extensions: tuple[str, ...] = ()  # lower case with the dot; the first is the one suggested
    sniff: str | None = None  # "module:function", (head: bytes, path: str) -> bool
    open: str | None = None  # "module:function", (path: str, **options) -> Checkpoint
    write: str | None = None  # "module:function", the optimizer-state writer (signature above)
    write_model: str | None = None  # "module:function", (model: ModelInfo, path, *, dtype, metadata, progress) -> int
    directory: bool = False  # the "file" is a folder (sharded checkpoints)
    description: str = ""


FORMATS: tuple[Format, ...] = (
    # Sniffers are tried in this order; the first that claims a file wins.
    Format("burnpack", "burn", (".bpk",), sniff="statekit.formats.burnpack:claims",
           open="statekit.frameworks.burn:open_checkpoint", write="statekit.frameworks.burn:save_optimizer",
           write_model="statekit.frameworks.burn:save_model", description="burnpack .bpk"),
    Format("safetensors", "neutral", (".safetensors",), sniff="statekit.formats.safetensors:claims",
           open="statekit.frameworks.safetensors_io:open_checkpoint",
           write="statekit.frameworks.safetensors_io:save_optimizer",
           write_model="statekit.frameworks.safetensors_io:save_model", description="safetensors"),
    Format("burn-legacy", "burn", (".mpk", ".bin"), sniff="statekit.formats.burn_legacy:claims",
           open="statekit.frameworks.burn_legacy_io:open_checkpoint", description="burn .mpk/.bin records"),
    Format("torch", "torch", (".pt", ".pth"), sniff="statekit.formats.torch_pt:claims",
           open="statekit.frameworks.torch_io:open_checkpoint", write="statekit.frameworks.torch_io:save_optimizer",
           write_model="statekit.frameworks.torch_io:save_model", description="PyTorch .pt"),
    # before the plain DCP entry: a torch_dist folder is a DCP folder with metadata.json; also its save
    # root (latest_checkpointed_iteration.txt) and a NeMo 2 checkpoint (weights/)
    Format("megatron-dist", "megatron", sniff="statekit.formats.megatron_dist:claims",
           open="statekit.frameworks.megatron.dist:open_checkpoint", directory=True,
           description="Megatron-Core torch_dist checkpoints"),
    Format("dcp", "torch", sniff="statekit.formats.dcp:claims", open="statekit.frameworks.dcp_io:open_checkpoint",
           write="statekit.frameworks.dcp_io:save_optimizer", directory=True,
           description="torch.distributed checkpoint (DCP) directories"),
    Format("deepspeed", "torch", sniff="statekit.formats.deepspeed:claims",
           open="statekit.frameworks.deepspeed_io:open_checkpoint", directory=True,
           description="DeepSpeed ZeRO and universal checkpoint folders"),
    # the universal layout (ds_to_universal's output) is written on request (--to); read by the entry above.
    Format("deepspeed-universal", "torch", write="statekit.frameworks.deepspeed_io:save_universal", directory=True),
    Format("megatron-legacy", "megatron", sniff="statekit.formats.megatron_legacy:claims",
           open="statekit.frameworks.megatron.legacy:open_checkpoint", directory=True,
           description="Megatron-LM legacy checkpoint folders (iter_N/mp_rank_*/model_optim_rng.pt)"),
    # HF Trainer checkpoint-N/ and Accelerate save_state folders: opened as the torch optimizer inside.
    Format("torch-folder", "torch", sniff="statekit.frameworks.wrappers:claims",
           open="statekit.frameworks.wrappers:open_checkpoint", directory=True,
           description="HF Trainer / Accelerate checkpoint folders"),
    # bitsandbytes' own layouts of a torch .pt (read through the torch entry), written on request (--to):
    # >= 0.49.2 (nested, blocks of 256: what bitsandbytes 0.50 writes), 0.44-0.49.1 (flat), <= 0.43 (blocks of 2048)
    Format("bnb", "torch", write="statekit.frameworks.bnb:save_optimizer"),
    Format("bnb-flat", "torch", write="statekit.frameworks.bnb:save_optimizer_flat"),
    Format("bnb-2048", "torch", write="statekit.frameworks.bnb:save_optimizer_2048"),
    # candle AdamW state is a safetensors file: read through the safetensors entry, written on request.
    Format("candle", "candle", write="statekit.frameworks.candle:save_optimizer"),
)


def names() -> tuple[str, ...]:
    return tuple(f.name for f in FORMATS)


def get(name: str) -> Format:
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(name)


def writable() -> tuple[str, ...]:
    """Formats optimizer state can be written as (``--to`` choices)."""
    return tuple(f.name for f in FORMATS if f.write)


def framework_of(name: str) -> str:
    """The framework whose layout format ``name`` holds; an unknown name is its own framework."""
    try:
        return get(name).framework
    except KeyError:
        return name


def extensions() -> dict[str, str]:
    """Extension → format, for the formats that can be written (what an output path implies)."""
    return {ext: f.name for f in FORMATS if f.write or f.write_model for ext in f.extensions}


def extension_of_framework(framework: str) -> str | None:
    """The extension of the first writable format holding ``framework``'s layout."""
    for f in FORMATS:
        if f.framework == framework and f.write and f.extensions:
            return f.extensions[0]
    return None


def from_extension(path: str | os.PathLike, explicit: str | None = None) -> str:
    """The output format of ``path``: ``explicit`` (``--to``) when given, else its extension."""
    if explicit:
        if explicit not in writable():
            raise UsageError(f"unknown output format {explicit!r} (known: {', '.join(writable())})")
        return explicit
    ext = os.path.splitext(os.fspath(path))[1].lower()
    known = extensions()
    try:
        return known[ext]
    except KeyError:
        listing = ", ".join(sorted(known))
        raise UsageError(f"cannot tell the output format from {os.fspath(path)!r} (known: {listing}; or --to)") from None


def resolve(ref: str):
    """The function a ``"module:attribute"`` entry names (imported now)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _head(path: str) -> bytes:
    if os.path.isdir(path):
        return b""
    try:
        with open(path, "rb") as fh:
            return fh.read(SNIFF_BYTES)
    except OSError as exc:
        raise FormatError(f"cannot open: {exc.strerror}", path) from None


def sniff(path: str | os.PathLike) -> str:
    """The name of the format whose sniffer claims ``path``; FormatError when none does."""
    path = os.fspath(path)
    if "\0" in path:  # (only an API string can hold one; os would raise ValueError)
        raise UsageError(f"{path!r}: a file name cannot hold a NUL byte")
    head = _head(path)
    is_dir = os.path.isdir(path)
    for fmt in FORMATS:
        if fmt.sniff and fmt.directory == is_dir and resolve(fmt.sniff)(head, path):
            return fmt.name
    if is_dir:
        known = ", ".join(f.description for f in FORMATS if f.directory and f.description)
        raise FormatError(f"a folder no reader claims (statekit reads {known}; or give a file in it)", path)
    if not head:
        raise FormatError("file is empty", path)
    described = [f.description for f in FORMATS if f.open and f.description]
    readable = ", ".join(described[:-1]) + " and " + described[-1]
    raise FormatError(f"unrecognised file format (starts with {head[:8].hex(' ')}); statekit reads {readable}", path)


def open_checkpoint(path: str | os.PathLike, **options):
    """Open ``path`` with the reader its content asks for. Tensor data stays on disk until used."""
    fmt = get(sniff(path))
    return resolve(fmt.open)(os.fspath(path), **options)


def writer(name: str):
    """The optimizer-state writer of format ``name`` (shared signature, see the module docstring)."""
    fmt = get(name)
    if fmt.write is None:
        raise UsageError(f"statekit cannot write optimizer state as {name} (writable: {', '.join(writable())})")
    return resolve(fmt.write)


def model_writer(name: str):
    """The named-tensor writer of format ``name``: ``(model, path, *, dtype, metadata, progress) -> int``."""
    fmt = get(name)
    if fmt.write_model is None:
        raise UsageError(f"statekit cannot write named tensors as {name}")
    return resolve(fmt.write_model)
