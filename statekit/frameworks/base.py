"""The small interface every framework module implements (records ⇄ state).

A framework module (``burn``, ``burn_legacy_io``, ``torch_io``, ``safetensors_io``,
``candle``) turns one container's records into the neutral state model
(:mod:`statekit.state`) and back. The registry (:mod:`statekit.formats.registry`) names its
functions; ops call them only through the registry, so they never know which framework they
talk to. A module provides the functions its formats' entries name:

- ``open_checkpoint(path, **options) -> Checkpoint`` — the file's kind, state or model, lazily;
- ``save_optimizer(state, path, *, family, groups, metadata, progress, step_policy, on_warning) -> int``
  (:class:`OptimizerWriter`), the one writer signature;
- ``save_model(model, path, *, dtype, metadata, progress) -> int`` (:class:`ModelWriter`).

Call order: a writer is handed a state whose tensors are lazy sources
(:class:`~statekit.tensor.TensorRef`: ``shape``, ``dtype``, ``nbytes``, ``iter_bytes(chunk)``);
it checks everything it can refuse *before* it creates the output (the checks every writer
shares run first: :func:`optimizer_writer`), then streams the tensors
one at a time into an atomic temporary file, reports bytes through ``progress(n)`` and
warnings through ``on_warning(message)`` (never by printing), and returns the file's size.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from statekit.state import refuse_bad_steps

if TYPE_CHECKING:
    from statekit.state import Checkpoint, ModelInfo, OptimizerState


class Opener(Protocol):
    def __call__(self, path: str, **options: object) -> Checkpoint: ...


class OptimizerWriter(Protocol):
    """``family``: the optimizer family to write (default: the state's); ``groups``: one
    hyperparameter dict per parameter group (default: the state's); ``metadata``: free-form
    string metadata where the format keeps any; ``step_policy``: ``"max"`` lets a format with one
    global step write the largest of differing steps (else refused); ``on_warning``: where
    warnings go."""

    def __call__(self, state: OptimizerState, path: str, *, family: str | None = None,
                 groups: list[dict] | None = None, metadata: dict[str, str] | None = None,
                 progress: Callable[[int], None] | None = None, step_policy: str | None = None,
                 on_warning: Callable[[str], None] | None = None) -> int: ...


class ModelWriter(Protocol):
    def __call__(self, model: ModelInfo, path: str, *, dtype: str | None = None,
                 metadata: dict[str, str] | None = None, progress: Callable[[int], None] | None = None) -> int: ...


@runtime_checkable
class Framework(Protocol):
    """A framework module: ``FORMAT`` names its registry entry; the functions that entry names
    (``open_checkpoint`` :class:`Opener`, ``save_optimizer`` :class:`OptimizerWriter`,
    ``save_model`` :class:`ModelWriter`) are checked against these signatures by the tests."""

    FORMAT: str


def optimizer_writer(write: Callable) -> Callable:
    """Every format's optimizer-state writer is declared with this: the checks all writers share run
    before the format's own, before the output exists (a parameter whose step is no whole count,
    :func:`statekit.state.refuse_bad_steps`). ``tests/test_architecture.py`` checks that every
    registry ``write`` entry is one."""

    @functools.wraps(write)
    def checked(state: OptimizerState, path: str, **options: object) -> int:
        refuse_bad_steps(state, writing=os.fspath(path))
        return write(state, path, **options)

    checked.shared_checks = True
    return checked


WRITER_KEYWORDS = ("family", "groups", "metadata", "progress", "step_policy", "on_warning")
MODEL_WRITER_KEYWORDS = ("dtype", "metadata", "progress")
