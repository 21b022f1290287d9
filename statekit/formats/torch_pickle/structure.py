"""Limits on what a pickle builds, and the walk that checks a loaded object against them
(self-containment, depth, expansion by reference: memo bombs)."""

from __future__ import annotations

import contextlib
import gc
import operator
from itertools import repeat

from statekit.errors import FormatError
from statekit.formats.torch_pickle.geometry import TensorInfo
from statekit.formats.torch_pickle.values import Float8Codes, Record, WrapperTensor
from statekit.tensor import TensorRef

MAX_DEPTH = 100  # container nesting; torch's checkpoints nest a handful of levels
MAX_STEPS = 200_000_000  # opcodes in one pickle (a torch.save pickle runs ~40 a tensor)
MAX_EXPANSION = 1_000_000  # objects by reference beyond 16 per opcode (shared objects counted per use)
_CONTAINERS = (list, tuple, dict, set)


def _is_container(item: object) -> bool:
    return isinstance(item, _CONTAINERS)


@contextlib.contextmanager
def no_gc():
    """Pause Python's cyclic garbage collector (reference counting still frees everything).

    A loaded pickle is a tree of new objects that all live on; every automatic collection would
    traverse all of them again, which made reading 10^6 tensors a third slower. On leaving, what
    was made meanwhile joins the oldest generation at once, as if it had survived the young
    collections already (``gc.freeze`` then ``gc.unfreeze``: two list splices, which also reset the
    young generation's allocation count): the first allocation after ``gc.enable`` would
    otherwise start a young collection over all of it (measured: 1.5 s of opening 10^6 views).
    Not where objects are frozen already (someone else's: unfreezing would release theirs).
    Whatever a refused pickle leaves in cycles is collected by the next full collection.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


_SCALARS = frozenset((str, int, float, bool, type(None), bytes))
_INFO, _OWN = operator.attrgetter("info"), operator.attrgetter("own")
_NODES = frozenset((tuple, list, set, dict, Record))  # types whose _children is never None


def _leaves_only(children) -> bool:
    """Whether every child is a plain value or a tensor without Python attributes (checked by the
    types present, in C-level passes)."""
    kinds = set(map(type, children))
    if kinds <= _SCALARS:
        return True
    return (kinds == {TensorRef} and set(map(type, map(_INFO, children))) == {TensorInfo}
            and not any(map(_OWN, map(_INFO, children))))  # (python_state lives only in an own dict)


def _children(node: object):
    kind = type(node)  # (the exact types first: nearly every node is one)
    if kind is tuple or kind is list or kind is set:
        return node
    if kind is dict:
        return node.values()
    if kind is Record:
        return node.fields.values()
    if kind is TensorRef:
        state = node.info.get("python_state")
        return state.values() if state else None
    if kind in _SCALARS:
        return None
    return _children_of_subclass(node)


def _children_of_subclass(node: object):
    if isinstance(node, list | tuple | set):
        return node
    if isinstance(node, dict):
        return node.values()
    if isinstance(node, TensorRef):
        state = node.info.get("python_state")
        return state.values() if state else None
    if isinstance(node, Record):
        return node.fields.values()
    if isinstance(node, WrapperTensor):
        return node.state.values()
    if isinstance(node, Float8Codes):  # a float8 tensor outside a wrapper subclass's codes
        raise FormatError(node.refusal)
    return None


def check_structure(root: object, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_EXPANSION) -> None:
    """Refuse a loaded object that contains itself, nests deeper than ``max_depth`` or — counting
    shared objects once per reference, as every walk over it will — holds more than ``max_nodes``
    (a memo "billion laughs"). Iterative, and linear in the distinct objects."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    active: set[int] = set()
    stack: list = [(root, False)]
    while stack:
        node, done = stack.pop()
        kind = type(node)  # (_children, its commonest cases inline)
        if kind is tuple or kind is list:
            children = node
        elif kind is dict:
            children = node.values()
        elif kind is Record:
            children = node.fields.values()
        else:
            children = _children(node)
            if children is None:
                continue
        key = id(node)
        if done:
            active.discard(key)
            # (a leaf counts 1, at depth 0; in C-level passes)
            size = 1 + sum(map(sizes.get, map(id, children), repeat(1)))
            depth = 1 + max(map(depths.get, map(id, children), repeat(0)), default=0)
            if size > max_nodes:
                raise FormatError(f"pickle expands to more than {max_nodes} objects by reference (a memo bomb)")
            if depth > max_depth:
                raise FormatError(f"pickle nests containers deeper than {max_depth} levels")
            sizes[key], depths[key] = size, depth
            continue
        if key in sizes:
            continue
        if key in active:
            raise FormatError("pickle builds a container that contains itself")
        if _leaves_only(children):  # (a tuple of ints, a state_dict's tensors: done at once, no loop in Python)
            size = 1 + len(children)
            if size > max_nodes:
                raise FormatError(f"pickle expands to more than {max_nodes} objects by reference (a memo bomb)")
            if 1 > max_depth:
                raise FormatError(f"pickle nests containers deeper than {max_depth} levels")
            sizes[key], depths[key] = size, 1
            continue
        active.add(key)
        stack.append((node, True))
        for child in children:
            kind = type(child)
            if kind in _NODES:
                stack.append((child, False))
            elif kind in _SCALARS or (kind is TensorRef and child.info.get("python_state") is None):
                continue  # leaves: most children of a large state_dict
            elif _children(child) is not None:  # (_children refuses a float8 tensor here)
                stack.append((child, False))
