"""Proved, never guessed: a parameter's optimizer state is called its own only after its fp32
master, rounded to the weight's dtype, equals the weight stored in the same checkpoint bit for bit.

Megatron's mixed-precision optimizers keep an fp32 master of every half-precision parameter and
copy it, rounded (round-to-nearest-even, what ``Tensor.copy_`` does), into the model's weight after
each step; the checkpoint saves both (``/work/shared/docs/megatron-formats.md`` §1.5 last notes,
§3.3). So a layout — a parameter order, a bucket rule, a DP size, a TP join — that cuts the master
tensor wrongly shows at once: the slice it calls parameter P's does not round to P's weight. An fp32
weight must equal its master exactly. Only this check makes a layout a fact; the rules of
:mod:`.buckets` only propose one.

Streamed: both tensors are read in bounded pieces (:meth:`TensorRef.pieces`), so memory does not
grow with the parameter. numpy only (no torch).

The API (stable; ``mcore-dist`` builds on it):

- ``prove(name, master, weight, rule, source=None)``: returns the element count proved, or raises
  :class:`ProofError` (a FormatError) ``"parameter <name>: its fp32 master rounded to <dtype> is not
  the stored weight at element <i> (…): <rule> does not hold"``;
- ``rounded_bits(values_f32, dtype)``: the bit patterns of ``values`` rounded to ``dtype``.
"""

from __future__ import annotations

import math

from statekit.errors import FormatError
from statekit.lazy import numpy as np
from statekit.tensor import TensorRef, rechunk

PIECE_ELEMENTS = 1 << 18  # elements compared at a time (1 MiB of fp32 per side)


class ProofError(FormatError):
    """A layout that does not prove: the master cut for a parameter is not that parameter's."""


def rounded_bits(values, dtype: str):
    """``values`` (fp32 array) rounded to ``dtype`` as unsigned bit patterns (BF16 and F16:
    round-to-nearest-even, NaN kept a NaN; F32: the bits themselves)."""
    f32 = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "F32":
        return f32.view(np.uint32)
    if dtype == "F16":
        with np.errstate(over="ignore"):  # beyond fp16's range: inf, as torch rounds it
            return f32.astype(np.float16).view(np.uint16)
    if dtype == "BF16":
        bits = f32.view(np.uint32)
        with np.errstate(over="ignore"):  # (only a NaN's bits can wrap: NaNs are set below)
            rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
        nan = np.isnan(f32)
        if nan.any():
            rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
        return rounded
    raise ProofError(f"no rounding rule from F32 to {dtype}")


_UINT = {"F32": "<u4", "F16": "<u2", "BF16": "<u2"}
_NAN_ABOVE = {"BF16": 0x7F80, "F16": 0x7C00}  # |bits| above infinity's: a NaN


def bit_pieces(ref: TensorRef, elements: int):
    """``ref``'s elements as unsigned bit patterns, flat in C order, in pieces of exactly
    ``elements`` (the last shorter): read as raw bytes, so a bf16 weight needs no bf16 type
    (importing ml_dtypes costs a second)."""
    bits = np.dtype(_UINT[ref.dtype])
    if ref.array_loader is not None:  # (an in-memory array: its own dtype is already there)
        source = (p.view(bits) for p in ref.pieces(elements))
    else:
        source = (np.frombuffer(b, dtype=bits) for b in ref.iter_bytes(elements * bits.itemsize))
    return rechunk(source, elements)


def _nan_bits(bits, dtype: str):
    if dtype == "F32":
        return np.isnan(bits.view(np.float32))
    return (bits & np.uint16(0x7FFF)) > _NAN_ABOVE[dtype]


def _floats(bits, dtype: str) -> str:
    """A weight's bits for people (``0x3f80 (1.0)``)."""
    value = int(bits)
    if dtype == "BF16":
        f = np.array([value << 16], dtype=np.uint32).view(np.float32)[0]
    elif dtype == "F16":
        f = np.array([value], dtype=np.uint16).view(np.float16)[0]
    else:
        f = np.array([value], dtype=np.uint32).view(np.float32)[0]
    return f"{value:#06x} ({float(f):.6g})"


def prove(name: str, master: TensorRef, weight: TensorRef, rule: str, source: str | None = None) -> int:
    """Check ``master`` (fp32, any shape of the same element count, C order) against ``weight``."""
    if master.dtype != "F32":
        raise ProofError(f"parameter {name}: its master is {master.dtype}, not fp32: {rule} does not hold", source)
    if weight.dtype not in ("BF16", "F16", "F32"):
        raise ProofError(f"parameter {name}: the stored weight is {weight.dtype}; no master can round to it", source)
    if master.numel != weight.numel:
        raise ProofError(f"parameter {name}: its master has {master.numel} elements, the stored weight "
                         f"{weight.numel} ({list(weight.shape)}): {rule} does not hold", source)
    done = 0
    for mb, got in zip(bit_pieces(master, PIECE_ELEMENTS), bit_pieces(weight, PIECE_ELEMENTS), strict=False):
        if mb.size != got.size:  # (both read exact pieces; a short one is a truncated file)
            raise ProofError(f"parameter {name}: master and weight pieces differ in length at element {done}",
                             source)
        m = mb.view(np.float32)
        want = rounded_bits(m, weight.dtype)
        bad = want != got
        if bad.any():
            bad &= ~(np.isnan(m) & _nan_bits(got, weight.dtype))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ProofError(
                f"parameter {name}: its fp32 master rounded to {weight.dtype} is not the stored weight at element "
                f"{done + i} of {weight.numel} (master {float(m[i]):.6g} → {_floats(want[i], weight.dtype)}, weight "
                f"{_floats(got[i], weight.dtype)}): {rule} does not hold", source)
        done += m.size
    if done != math.prod(weight.shape):
        raise ProofError(f"parameter {name}: only {done} of {weight.numel} elements could be read", source)
    return done
