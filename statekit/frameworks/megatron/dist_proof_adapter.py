"""LOCAL ADAPTER, to be replaced by ``statekit.frameworks.megatron.proof`` (owned by the
``mcore-legacy`` branch, not merged yet): the master-vs-weight proof as the torch_dist reader
needs it.

The rule (``shared/docs/megatron-formats.md`` §1.5, §7.1): a mixed-precision run keeps an fp32
master of every parameter, and the weight it trains with is that master rounded to the weight's
dtype (round to nearest even). So wherever a checkpoint holds both, the master rounded to the
weight's dtype equals the stored weight bit for bit; an fp32 weight equals its master. Values
are compared in bounded pieces, never a whole tensor at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from statekit.tensor import TensorRef

PIECE_ELEMENTS = 1 << 20
RULE = "master-vs-weight: the fp32 master rounded to the weight's dtype equals the stored weight"


@dataclass
class Disproof:
    """Where a master and its weight disagree."""

    mismatched: int  # elements
    numel: int
    first: int  # flat index of the first disagreement


def bf16_bits(master: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even) as their 16-bit patterns."""
    u = np.ascontiguousarray(master, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(master)
    if nan.any():  # a NaN stays a (quiet) NaN, as torch's conversion does
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def _bits(master: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_bits(master)
    if dtype == "F16":
        return master.astype(np.float16).view(np.uint16)
    if dtype == "F32":
        return np.ascontiguousarray(master, dtype=np.float32).view(np.uint32)
    raise ValueError(f"no master-vs-weight rule for a {dtype} weight")


def _weight_bits(piece: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "F32":
        return np.ascontiguousarray(piece).view(np.uint32)
    return np.ascontiguousarray(piece).view(np.uint16)


def disproof(master: TensorRef, weight: TensorRef) -> Disproof | None:
    """None when ``master`` rounded to ``weight``'s dtype is ``weight`` bit for bit."""
    if tuple(master.shape) != tuple(weight.shape):
        return Disproof(master.numel, master.numel, 0)
    bad, first, pos = 0, -1, 0
    for m, w in zip(master.cast("F32").pieces(PIECE_ELEMENTS), weight.pieces(PIECE_ELEMENTS), strict=True):
        differ = _bits(m, weight.dtype) != _weight_bits(w, weight.dtype)
        n = int(np.count_nonzero(differ))
        if n and first < 0:
            first = pos + int(np.argmax(differ))
        bad += n
        pos += m.size
    return Disproof(bad, master.numel, first) if bad else None
