"""Limits every reader enforces while it decodes, and the checks shared by all of them.

A file is refused with a one-line :class:`~statekit.errors.FormatError` as soon as it crosses a
limit — before the work or memory the limit guards is spent. The limits are far above what the
frameworks themselves write (burn's own: 100 MB of metadata, 100,000 tensors, 10 GiB a tensor).
"""

from __future__ import annotations

import math
import os
import reprlib

from statekit.errors import MappingError

MAX_RANK = 64  # numpy's limit (and far above any framework's tensors)
MAX_ELEMENTS = (1 << 63) - 1  # bytes or elements of one tensor, zero-size dimensions or not
MAX_TENSORS = 100_000 * 10  # tensors (or records) in one file; burnpack keeps burn's own 100,000
MAX_CONTAINER = 1_000_000  # items in one decoded list or map
MAX_DEPTH = 64  # nesting of decoded metadata, pickles, JSON
MAX_PICKLE_OBJECTS = 50_000_000  # objects one pickle may build (by reference, after the memo)
MAX_INFLATE = 64 << 20  # a gzip stream may inflate to this many bytes …
MAX_INFLATE_RATIO = 8  # … or to this many times its compressed size, whichever is larger
# (optimizer state compresses 1.1–2x; a gzip bomb ~1000x. STATEKIT_GZIP_RATIO=N raises the ratio.)


def shape_problem(shape: object, itemsize: int = 1) -> str | None:
    """Why ``shape`` is not a plausible tensor shape, or None.

    Dimensions are non-negative Python integers (not bools), at most :data:`MAX_RANK` of them, and
    the product of the non-zero dimensions times ``itemsize`` fits in 63 bits — a zero-size
    dimension beside huge ones is still refused, since numpy cannot hold that shape either.
    """
    if not isinstance(shape, list | tuple) or not all(type(d) is int and d >= 0 for d in shape):
        return f"shape {_short(shape)} is not a list of non-negative integers"
    if len(shape) > MAX_RANK:
        return f"rank {len(shape)} exceeds the limit of {MAX_RANK} dimensions"
    total = max(itemsize, 1)
    for d in shape:
        total *= max(d, 1)
        if total > MAX_ELEMENTS:
            return f"shape {_short(shape)} has more than 2^63 bytes (zero-size dimensions included)"
    return None


def stride_problem(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> str | None:
    """Why a strided view cannot be addressed (a byte stride beyond 63 bits), or None."""
    for n, s in zip(shape, stride, strict=False):
        if s * itemsize > MAX_ELEMENTS or (n - 1) * s * itemsize > MAX_ELEMENTS:
            return f"stride {s} of a dimension of size {n} lies beyond 2^63 bytes"
    return None


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be written as UTF-8 (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        shown = _short(text) if len(text) <= 60 else "..." + _short(text[max(0, exc.start - 24) : exc.start + 24])
        return f"{shown} holds a lone surrogate ({text[exc.start]!r} at {exc.start}) and cannot be written as UTF-8"
    return None


def utf8(text: str) -> bytes:
    """``text`` encoded for an output (every format statekit writes holds UTF-8 text). A lone
    surrogate — a name from bytes that are no UTF-8, such as a command-line argument or an API
    string — is refused with a MappingError naming it: statekit writes nothing it would refuse
    to read back (its readers refuse such text, :func:`text_problem`)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise MappingError(text_problem(text)) from None


def utf8_all(value: object) -> None:
    """:func:`utf8` for every string in ``value`` (dict keys and values, lists, tuples), for the
    writers of several files that refuse before the first one is written."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            utf8(node)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)


def depth_problem(value: object, max_depth: int = MAX_DEPTH) -> str | None:
    """Why a decoded JSON-like value nests too deep (lists, dicts, tuples), or None. Iterative."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels"
        stack.extend((child, depth + 1) for child in children)
    return None


def inflate_cap(compressed_size: int) -> int:
    try:
        ratio = int(os.environ.get("STATEKIT_GZIP_RATIO", MAX_INFLATE_RATIO))
    except ValueError:
        ratio = MAX_INFLATE_RATIO
    return max(MAX_INFLATE, ratio * compressed_size)


class _BoundedRepr(reprlib.Repr):
    """``repr`` that visits a bounded number of objects: 3 levels, 6 items a level. A decoded
    structure may share objects by reference (a pickle's memo): its full repr can be
    exponentially long (2^40 leaves from 40 levels), so error messages never ask for it."""

    _PLAIN = (bool, int, float, complex, str, bytes, type(None))

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxstring, self.maxother, self.maxlong = 3, 4, 60, 60, 40
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = 6

    def repr_instance(self, obj: object, level: int) -> str:
        if isinstance(obj, self._PLAIN) or type(obj).__module__ == "statekit.formats.torch_pickle" and hasattr(
                obj, "name"):  # TorchDtype and the allow-list's stand-ins: a name and nothing nested
            return super().repr_instance(obj, level)
        return f"<{type(obj).__name__}>"  # anything else may hold decoded data of any size


_BOUNDED = _BoundedRepr()


def short(value: object, width: int = 60) -> str:
    """A bounded ``repr(value)`` (see :class:`_BoundedRepr`) cut to ``width`` characters."""
    try:
        text = _BOUNDED.repr(value)
    except (RecursionError, ValueError):  # (ValueError: an int past Python's digit limit)
        return f"<{type(value).__name__}>"
    return text if len(text) <= width else text[: width - 3] + "..."


_short = short


def is_finite_integral(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value == int(value)
