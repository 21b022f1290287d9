"""bitsandbytes' 8-bit blockwise quantization, in numpy: exactly what bitsandbytes computes.

A tensor of ``n`` float32 values is cut, flat in C order, into blocks of ``block`` elements (256
since bitsandbytes 0.44, 2048 before; the last block shorter). Each block keeps ``absmax`` (its
largest magnitude, float32) and one uint8 code per element: the index of the nearest entry of a
256-entry map (``qmap``: the signed "dynamic" map for first moments, the unsigned one for second
moments), and decodes as ``qmap[code] * absmax[block]`` (float32; bitsandbytes'
``dequantize_blockwise``, CPU C kernel and pure-torch alike).

bitsandbytes has two quantizers that disagree on a few codes per 8192 elements:

- ``cpu`` — its C kernel (``quantize_cpu_impl``, csrc/cpu_ops.cpp of 0.50), the one
  ``quantize_blockwise`` and the 8-bit optimizers use on a CPU: ``x * (1 / absmax)`` clamped to
  [-1, 1], then a 65536-entry table (``((v + 1) * 0.5) * 65535 + 0.5`` truncated) that gives each
  grid point the first map entry whose upper midpoint is not below it — so a value is coded by
  the grid point it rounds to, not by itself (0.0 codes as the entry nearest 1.5e-5);
- ``torch`` — its pure-torch "default" kernel (backends/default/ops.py): ``x * (1 / absmax)``
  clamped to [-1, 1], then ``bucketize`` against the midpoints of neighbouring entries (a value
  on a midpoint goes down).

Every function works on whole blocks of a flat piece, so a caller streams any tensor through
them a bounded piece at a time (:func:`statekit.frameworks.bnb` does).
"""

from __future__ import annotations

from functools import cache

from statekit.lazy import numpy as np

BLOCK_SIZES = (256, 2048)  # bitsandbytes >= 0.44, <= 0.43
QUANTIZERS = ("cpu", "torch")


def blocks(n: int, block: int) -> int:
    return -(-n // block)


def block_size(n: int, n_absmax: int) -> int | None:
    """The block size a tensor of ``n`` elements with ``n_absmax`` scales was quantized with."""
    found = [b for b in BLOCK_SIZES if blocks(n, b) == n_absmax]
    return found[0] if len(found) == 1 else None


def _linspace(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace(start, end, steps, dtype=torch.float32)`` on a CPU, value for value: a
    float32 step, the first half counted up from ``start``, the second down from ``end``, each
    value one fused multiply-add (exact in float64 here: a float32 step times a small integer,
    rounded once to float32)."""
    f = np.float32
    step = np.float64((f(end) - f(start)) / f(steps - 1))
    idx = np.arange(steps)
    up = np.float64(f(start)) + step * idx
    down = np.float64(f(end)) - step * (steps - 1 - idx)
    return np.where(idx < steps // 2, up, down).astype(np.float32)


def dynamic_map(signed: bool) -> np.ndarray:
    """bitsandbytes' ``create_dynamic_map(signed)`` (7 exponent bits, 8 bits in all): 256 sorted
    float32 values, 0 and 1.0 among them."""
    data: list[float] = []
    for i in range(7):
        items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        bounds = _linspace(0.1, 1.0, items)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        scale = np.float32(10 ** (-6 + i))
        data += (scale * means).astype(np.float32).tolist()
        if signed:
            data += (-scale * means).astype(np.float32).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return np.array(sorted(data), dtype=np.float32)


def dequantize(codes: np.ndarray, absmax: np.ndarray, qmap: np.ndarray, block: int) -> np.ndarray:
    """float32 values of a flat piece of codes starting at a block boundary (``absmax``: its blocks')."""
    codes = np.asarray(codes).reshape(-1)
    values = np.asarray(qmap, dtype=np.float32)[codes]
    scales = np.repeat(np.asarray(absmax, dtype=np.float32).reshape(-1), block)[: codes.size]
    return values * scales


LUT_SIZE = 65536


@cache
def _lut(qmap_bytes: bytes) -> np.ndarray:
    """bitsandbytes' CPU quantization table for a map: for each of 65536 evenly spaced values in
    [-1, 1] (``-1 + 2i/65535`` in float32), the first entry whose upper midpoint is not below it."""
    qmap = np.frombuffer(qmap_bytes, dtype=np.float32)
    mid = (np.float32(0.5) * (qmap[:-1] + qmap[1:])).astype(np.float32)
    grid = (np.float32(-1.0) + (np.float32(2.0) * np.arange(LUT_SIZE, dtype=np.float32)) / np.float32(LUT_SIZE - 1))
    return np.minimum(np.searchsorted(mid, grid.astype(np.float32), side="left"), 255).astype(np.uint8)


def _block_absmax(x: np.ndarray, block: int) -> np.ndarray:
    """Each block's largest magnitude, float32 (a NaN counts as 0, as the C kernel sanitizes it)."""
    n = x.size
    full = n - n % block
    mags = np.nan_to_num(np.abs(x), nan=0.0, posinf=np.inf)
    parts = [mags[:full].reshape(-1, block).max(axis=1)] if full else []
    if full < n:
        parts.append(mags[full:].max(keepdims=True))
    return (np.concatenate(parts) if parts else np.empty(0)).astype(np.float32)


def quantize(x: np.ndarray, qmap: np.ndarray, block: int, quantizer: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """(uint8 codes, float32 absmax) of a flat float32 piece starting at a block boundary."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    qmap = np.asarray(qmap, dtype=np.float32)
    if quantizer == "cpu":
        absmax = _block_absmax(x, block)
        scale = np.repeat(absmax, block)[: x.size]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            inv = np.float32(1.0) / scale
            v = np.clip(x * inv, np.float32(-1.0), np.float32(1.0))
            pos = ((v + np.float32(1.0)) * np.float32(0.5)) * np.float32(LUT_SIZE - 1) + np.float32(0.5)
        idx = np.nan_to_num(pos, nan=0.0).astype(np.uint32).astype(np.uint16)
        codes = _lut(qmap.tobytes())[idx]
        codes[scale == 0] = 0  # an all-zero block: every code 0
        return codes, absmax
    if quantizer == "torch":
        n = x.size
        full = n - n % block
        tiny = np.float32(1e-38)
        absmax = np.abs(x[:full]).reshape(-1, block).max(axis=1) if full else np.empty(0, np.float32)
        scaled = (x[:full].reshape(-1, block) * (np.float32(1.0) / np.maximum(absmax, tiny))[:, None]).reshape(-1)
        if full < n:  # the last, shorter block: divided, its absmax kept clamped (as the kernel does)
            last = np.maximum(np.abs(x[full:]).max(keepdims=True), tiny)
            absmax, scaled = np.concatenate([absmax, last]), np.concatenate([scaled, x[full:] / last])
        absmax = absmax.astype(np.float32)
        scaled = np.clip(scaled, np.float32(-1), np.float32(1))
        bounds = (qmap[:-1] + qmap[1:]) / np.float32(2)
        return np.searchsorted(bounds, scaled, side="left").astype(np.uint8), absmax
    raise ValueError(f"quantizer must be one of {', '.join(QUANTIZERS)}, not {quantizer!r}")


# the magnitude of the map entry bitsandbytes codes a block's largest element with: +1.0 (the last
# entry, both maps) or the signed map's first, -0.99296875 (the entry nearest -1)
_EXTREMES = (1.0, 0.99296875)


def requantize(x: np.ndarray, qmap: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(uint8 codes, float32 absmax, blocks recovered) of values that bitsandbytes itself dequantized
    with this map and block size: each block's own codes and scale where ``qmap[code] * absmax``
    gives every value back bit for bit, bitsandbytes' CPU quantizer (:func:`quantize`) elsewhere.

    A block bitsandbytes quantized keeps its largest element's magnitude as ``absmax`` and codes it
    with an extreme entry of the map, so the scale is that magnitude over 1.0 or over 0.99296875
    (give or take the float32 rounding of the division, tried on both sides); the codes are then
    the map entries the values are, checked by dequantizing. Re-quantizing such values instead
    (the quantizer takes ``max |x|`` as the new scale) moves most codes of a block whose extreme
    entry was the negative one.
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    qmap = np.asarray(qmap, dtype=np.float32)
    codes, absmax = quantize(x, qmap, block, "cpu")
    n = x.size
    nblocks = blocks(n, block)
    if n == 0:
        return codes, absmax, 0
    pad = nblocks * block - n
    values = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(nblocks, block) if pad else x.reshape(nblocks, block)
    valid = np.ones((nblocks, block), dtype=bool)
    if pad:
        valid[-1, block - pad:] = False
    top = np.abs(values).max(axis=1).astype(np.float32)
    done = np.zeros(nblocks, dtype=bool)
    out_codes = codes.copy()
    out_absmax = absmax.copy()
    bounds = (qmap[:-1] + qmap[1:]) / np.float32(2)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for extreme in _EXTREMES:
            base = (top / np.float32(extreme)).astype(np.float32)
            for scale in (base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))):
                todo = ~done & (scale > 0) & np.isfinite(scale)
                if not todo.any():
                    break
                s = scale[todo].astype(np.float32)
                v = values[todo]
                got = np.clip(np.searchsorted(bounds, v / s[:, None], side="left"), 0, 255).astype(np.uint8)
                same = ((qmap[got] * s[:, None]).astype(np.float32) == v) | ~valid[todo]
                hit = same.all(axis=1)
                rows = np.flatnonzero(todo)[hit]
                if rows.size:
                    done[rows] = True
                    out_absmax[rows] = s[hit]
                    flat = got[hit].reshape(-1)
                    for k, row in enumerate(rows):
                        start, end = row * block, min(row * block + block, n)
                        out_codes[start:end] = flat[k * block: k * block + (end - start)]
    return out_codes, out_absmax, int(done.sum())
