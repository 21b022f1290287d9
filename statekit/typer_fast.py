"""Start typer without pydantic: plain coercion for the plain option types statekit uses.

typer >= 0.2x coerces every parameter of the invoked command through a pydantic ``TypeAdapter``
(``typer._adapters``), which imports pydantic and builds schemas: measured 126 ms of a 0.6 s
``statekit inspect`` (``python -X importtime``), more than everything else the command imports.
statekit's options are ``str``, ``int``, ``float``, ``bool``, ``Path``, optional ones and lists
or tuples of those, where the adapters do nothing a constructor call does not.

:func:`install` wraps typer's ``build_runtime_param`` so those annotations get a coercion that
calls the type itself; every other parameter (ranges such as ``min=1``, choices, files, custom
parsers) still goes to typer's own builder. With a typer that has no such hook (older releases,
which use click's types and no pydantic) it does nothing.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from pathlib import Path

PLAIN = (str, int, float, Path)
_NAMES = {str: "text", int: "integer", float: "float", Path: "path"}


def _plain(annotation) -> type | None:
    """The plain type behind ``annotation`` (``X``, ``X | None``), else None."""
    if annotation in PLAIN or annotation is bool:
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _plain(args[0])
    return None


def _shape(annotation):
    """``(container, item types)`` for plain annotations and lists/tuples of them, else None."""
    inner = annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            return None
        inner = args[0]
    origin = typing.get_origin(inner)
    if origin in (list, tuple):
        items = typing.get_args(inner)
        if origin is tuple and (len(items) == 2 and items[1] is Ellipsis):
            return None
        plain = [_plain(t) for t in items]
        if not items or any(t is None or t is bool for t in plain):
            return None
        return origin, tuple(plain)
    plain = _plain(inner)
    return (None, (plain,)) if plain is not None else None


def _convert(kind: type, value, param, ctx):
    """``value`` as ``kind`` (typer's spelling of booleans), or typer's BadParameter."""
    from typer._click.exceptions import BadParameter

    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "t", "yes", "y", "on"):
            return True
        if text in ("0", "false", "f", "no", "n", "off"):
            return False
    elif isinstance(value, kind):
        return value
    else:
        try:
            return kind(value)
        except (TypeError, ValueError):
            pass
    raise BadParameter(f"{value!r} is not a valid {_NAMES.get(kind, kind.__name__)}.", ctx=ctx, param=param)

def _bounded(value, info, param, ctx):
    """typer's ``min=``/``max=`` (``clamp=`` moves the value inside instead of refusing it)."""
    low, high = getattr(info, "min", None), getattr(info, "max", None)
    if low is not None and value < low:
        if getattr(info, "clamp", False):
            return low
    elif high is not None and value > high:
        if getattr(info, "clamp", False):
            return high
    else:
        return value
    from typer._click.exceptions import BadParameter

    bounds = " and ".join(f"x{op}{b}" for op, b in ((">=", low), ("<=", high)) if b is not None)
    raise BadParameter(f"{value} is not in the range {bounds}.", ctx=ctx, param=param)


#: typer's path checks at their defaults: none of them asked for
_PATH_DEFAULTS = {"exists": False, "file_okay": True, "dir_okay": True, "writable": False, "resolve_path": False,
                  "allow_dash": False, "path_type": None}


def _plain_path(info) -> bool:
    return all(getattr(info, name, default) == default for name, default in _PATH_DEFAULTS.items())


def install() -> bool:
    """Route plain parameters around typer's pydantic adapters; True when typer has the hook."""
    try:
        from typer import core
        from typer._click.exceptions import BadParameter
        from typer._coercion import RuntimeParam
    except ImportError:
        return False
    original = getattr(core, "build_runtime_param", None)
    if original is None or getattr(original, "_statekit_fast", False):
        return original is not None

    @dataclass(frozen=True)
    class PlainRuntimeParam(RuntimeParam):
        container: object = None
        kinds: tuple = ()

        def _coerce_value(self, value, param, ctx):
            if self.container is None:
                return _bounded(_convert(self.kinds[0], value, param, ctx), self.parameter_info, param, ctx)
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            if self.container is tuple:
                if len(items) != len(self.kinds):
                    raise BadParameter(f"{len(self.kinds)} values are required, but {len(items)} given.",
                                       ctx=ctx, param=param)
                return tuple(_convert(k, v, param, ctx) for k, v in zip(self.kinds, items, strict=True))
            return [_convert(self.kinds[0], v, param, ctx) for v in items]

    def build_runtime_param(descriptor):
        info = descriptor.parameter_info
        shape = _shape(descriptor.annotation)
        plain = (
            shape is not None
            and descriptor.file_annotation is None
            and getattr(info, "parser", None) is None
            and getattr(info, "click_type", None) is None
            and (shape[0] is None and shape[1][0] in (int, float)
                 or getattr(info, "min", None) is None and getattr(info, "max", None) is None)
            and not getattr(info, "min_open", False)
            and not getattr(info, "max_open", False)
            and not descriptor.is_choice
            and (Path not in shape[1] or _plain_path(info))
        )
        if not plain:
            return original(descriptor)
        return PlainRuntimeParam(parameter_info=info, annotation=descriptor.annotation, container=shape[0],
                                 kinds=shape[1])

    build_runtime_param._statekit_fast = True
    core.build_runtime_param = build_runtime_param
    return True
