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
- ``run_all(items)``: ``prove(*item)`` for each item, ``--jobs`` at a time on threads; the
  outcomes in order (an element count or the :class:`ProofError`);
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
    fast = _Rounder(min(PIECE_ELEMENTS, master.numel)) if weight.dtype == "BF16" else None
    for mb, got in zip(bit_pieces(master, PIECE_ELEMENTS), bit_pieces(weight, PIECE_ELEMENTS), strict=False):
        if mb.size != got.size:  # (both read exact pieces; a short one is a truncated file)
            raise ProofError(f"parameter {name}: master and weight pieces differ in length at element {done}",
                             source)
        if fast is not None and fast.equal(mb, got):
            done += mb.size
            continue
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


class _Rounder:
    """fp32 bits → bf16 bits, round-to-nearest-even, in reused buffers (no temporaries): the
    common case, no NaN and every element equal, in a few passes of integer operations; a piece
    with a NaN or any difference is looked at again with :func:`rounded_bits`."""

    def __init__(self, n: int):
        self.t = np.empty(n, dtype=np.uint32)
        self.u = np.empty(n, dtype=np.uint16)
        self.nan = np.empty(n, dtype=bool)

    def equal(self, bits, got) -> bool:
        n = bits.size
        t, u, nan = self.t[:n], self.u[:n], self.nan[:n]
        np.isnan(bits.view(np.float32), out=nan)
        if nan.any():  # (a NaN's bits can carry into the exponent or the sign here)
            return False
        np.right_shift(bits, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, bits, out=t)
        np.add(t, 0x7FFF, out=t)
        np.right_shift(t, 16, out=t)
        np.copyto(u, t, casting="unsafe")
        return bool(np.array_equal(u, got))


def _outcome(item: tuple) -> int | ProofError:
    try:
        return prove(*item)
    except ProofError as exc:
        return exc


def run_all(items: list[tuple], stop_at_first: bool = False) -> list[int | ProofError]:
    """``prove(*item)`` for every item, ``--jobs`` (``STATEKIT_JOBS``) at a time on threads (numpy
    and ``pread`` release the GIL), at most 8; the outcomes in the items' order, each the element
    count proved or the :class:`ProofError`. ``stop_at_first``: the queued proofs after the first
    failure (in order) are not started where they can still be cancelled."""
    from concurrent.futures import ThreadPoolExecutor

    from statekit.stream import current_jobs

    jobs = max(1, min(current_jobs(), 8, len(items)))
    if jobs == 1:
        out = []
        for item in items:
            out.append(_outcome(item))
            if stop_at_first and isinstance(out[-1], ProofError):
                break
        return out
    pool = ThreadPoolExecutor(jobs)
    try:
        futures = [pool.submit(_outcome, item) for item in items]
        out = []
        for f in futures:
            out.append(f.result())
            if stop_at_first and isinstance(out[-1], ProofError):
                break
        return out
    finally:
        pool.shutdown(cancel_futures=True)
