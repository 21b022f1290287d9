"""Modules imported on first use, so that commands that never touch them never pay for them.

``from statekit.lazy import numpy as np`` gives an object that imports numpy the first time one
of its attributes is read, then keeps each attribute it handed out as its own (later reads
cost a plain attribute lookup). A header-only ``statekit inspect`` reads no tensor and imports
no numpy (measured: numpy is the largest import of the command, bigger than Python itself).
"""

from __future__ import annotations

import importlib


class LazyModule:
    """A stand-in for module ``name``: imported at the first attribute read."""

    def __init__(self, name: str):
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr: str):
        value = getattr(importlib.import_module(self._lazy_name), attr)
        self.__dict__[attr] = value
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self._lazy_name!r}>"


numpy = LazyModule("numpy")
ml_dtypes = LazyModule("ml_dtypes")  # imported on first attribute read: only where an extended dtype is met
