"""What NEWOBJ and BUILD make of what is on the stack — a :class:`Record` for an allowed class,
a tensor's Python attributes, an OrderedDict's (checked, dropped) state — for the opcode loop and
the templates alike."""

from __future__ import annotations

from statekit.errors import FormatError, UnsafePickleError
from statekit.formats import limits
from statekit.formats.torch_pickle.allowlist import _with_info
from statekit.formats.torch_pickle.values import Record, RecordClass, _build_record, _python_state
from statekit.tensor import TensorRef


def new_record(records: dict[int, RecordClass], cls: object, args: object) -> Record:
    """NEWOBJ ``cls(*args)`` for an allowed class: a :class:`Record` (its class kept in ``records``)."""
    if not isinstance(cls, RecordClass):
        raise UnsafePickleError(f"refusing to instantiate {limits.short(cls)} from pickle: not an allowed class")
    if args != ():
        raise FormatError(f"malformed pickle: {cls.name} is created with arguments {limits.short(args)}")
    record = Record(cls.name)
    records[id(record)] = cls
    return record


def built(records: dict[int, RecordClass], inst: object, state: object) -> object:
    """BUILD ``inst`` with ``state``: what then stands where ``inst`` stood. A :class:`Record`
    that an allowed callable returned (REDUCE: numpy's ``_reconstruct``, a ``torch.Generator``)
    keeps its state as pickled, under ``fields["state"]``."""
    if isinstance(inst, Record):
        rclass = records.get(id(inst))
        if rclass is None:  # made by an allowed callable (REDUCE), not NEWOBJ: its state kept as pickled
            inst.fields["state"] = state
        else:
            _build_record(inst, rclass, state)
    elif isinstance(inst, TensorRef):
        attributes = _python_state(state)
        if attributes:
            return _with_info(inst, python_state={**inst.info.get("python_state", {}), **attributes})
    elif isinstance(inst, dict):
        _python_state(state)  # OrderedDict instance attributes: validated, not kept
    else:
        raise FormatError(f"malformed pickle: BUILD on a {type(inst).__name__}")
    return inst
