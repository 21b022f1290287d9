"""Open any supported file as a :class:`~statekit.state.Checkpoint`, by content, not extension.

The formats, their sniffers and openers are the one table :mod:`statekit.formats.registry`;
this module is the door the rest of statekit (and the Python API) opens files through.
"""

from __future__ import annotations

from statekit.formats.registry import open_checkpoint, sniff

__all__ = ["open_checkpoint", "sniff"]
