#!/usr/bin/env python3
"""Write the burn ≤ 0.21 legacy-record fixtures in ``fixtures/legacy/``.

The bytes follow the encoder rules in ``docs/burn-formats.md`` §4, written independently of statekit's
reader (no statekit imports for encoding):

- named msgpack (rmp-serde ``write_named``): structs are maps in field order, ``None`` is ``nil``,
  ``PhantomData`` (``_b``) is an empty array, newtype enum variants are ``{name: value}`` maps,
  integers use the smallest encoding, tensor bytes are ``bin``;
- bincode 2 ``standard()``: fields in order without names, varint integers, ``Option`` as a 0/1 tag,
  enum variants as a varint index, ``PhantomData`` as nothing;
- gzip with ``mtime = 0`` so the output is reproducible.

Model: the two-layer MLP 4 → 16 → 1 with burn's ``Linear`` weights ``[d_in, d_out]``. State values
come from ``numpy.random.default_rng(0)``; ``truth.npz`` holds them as float32 arrays keyed like
burnpack leaves (``"<decimal id>.momentum.moment_1"``), plus ``"<id>.__rank"``, ``"<id>.momentum.time"``,
``"model.<path>"`` weights and the ``ids``/``paths`` arrays.

Usage: ``python scripts/make_legacy_fixtures.py [--out DIR] [--check]`` (``--check`` compares
instead of writing and exits 1 on any difference).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import io
import struct
import sys
import zipfile
from pathlib import Path

import msgpack
import numpy as np

VERSION = "0.21.0"
TIME = 21
# (module path, ParamId, shape) for Mlp { l1: Linear(4 → 16), l2: Linear(16 → 1) }
PARAMS = (
    ("l1.weight", 18402649998147242804, (4, 16)),
    ("l1.bias", 4872954564708272749, (16,)),
    ("l2.weight", 708128169117982014, (16, 1)),
    ("l2.bias", 2021826497617271949, (1,)),
)
NUMPY = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8")}
BINCODE_DTYPE_INDEX = {"F64": 0, "F32": 1, "F16": 3}  # burn ≥ 0.17 DType variant order
SETTINGS = {
    # settings → (FloatElem type name, IntElem type name, tensor dtype)
    "Full": ("f32", "i32", "F32"),
    "Half": ("half::binary16::f16", "i16", "F16"),
    "Double": ("f64", "i64", "F64"),
}


def id_to_str(value: int) -> str:
    """ParamId display form (§3): base32hex of the 8 little-endian bytes, lower case, unpadded."""
    return base64.b32hexencode(value.to_bytes(8, "little")).decode().lower().rstrip("=")


def metadata(recorder: str, settings: str) -> dict[str, str]:
    """``BurnMetadata`` exactly as ``recorder_metadata`` builds it (``type_name`` strings)."""
    float_name, int_name, _ = SETTINGS[settings]
    full = f"burn_core::record::settings::{settings}PrecisionSettings"
    return {
        "float": float_name,
        "int": int_name,
        "format": f"burn_core::record::file::{recorder}<{full}>",
        "version": VERSION,
        "settings": f"{settings}PrecisionSettings",
    }


# ------------------------------------------------------------------------------------------------
# State values
# ------------------------------------------------------------------------------------------------


def make_values() -> dict[str, dict[str, np.ndarray]]:
    """Per module path: moment_1, moment_2 (≥ 0), max_moment_2 (≥ moment_2), velocity, weight."""
    rng = np.random.default_rng(0)
    values: dict[str, dict[str, np.ndarray]] = {}
    for path, _, shape in PARAMS:
        m1 = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        m2 = (rng.standard_normal(shape) ** 2 * 0.01).astype(np.float32)
        vmax = (m2 + np.abs(rng.standard_normal(shape)) * 0.001).astype(np.float32)
        velocity = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        bound = 1.0 / np.sqrt(4 if path.startswith("l1") else 16)
        weight = rng.uniform(-bound, bound, shape).astype(np.float32)
        values[path] = {
            "moment_1": m1,
            "moment_2": m2,
            "max_moment_2": vmax,
            "velocity": velocity,
            "weight": weight,
        }
    return values


# ------------------------------------------------------------------------------------------------
# Named msgpack (rmp-serde write_named)
# ------------------------------------------------------------------------------------------------


def mp_tensor(arr: np.ndarray, dtype: str) -> dict:
    """``TensorData {bytes, shape, dtype}``: raw LE bytes (bin), dims, unit-variant dtype name."""
    return {"bytes": arr.astype(NUMPY[dtype]).tobytes(), "shape": list(arr.shape), "dtype": dtype}


def mp_record(meta: dict[str, str], item: object) -> bytes:
    """``BurnRecord {metadata, item, _b: PhantomData}``; ``_b`` is a unit struct → empty array."""
    return msgpack.packb({"metadata": meta, "item": item, "_b": []}, use_bin_type=True)


def mp_optimizer(states: dict[int, tuple[int, dict]]) -> dict:
    """``HashMap<String, AdaptorRecordItem>``: id → {"V1": {"Rank<D>": state}}."""
    return {id_to_str(pid): {"V1": {f"Rank{rank}": state}} for pid, (rank, state) in states.items()}


def mp_adam_state(v: dict[str, np.ndarray], dtype: str, amsgrad: bool) -> dict:
    return {
        "momentum": {
            "time": TIME,
            "moment_1": mp_tensor(v["moment_1"], dtype),
            "moment_2": mp_tensor(v["moment_2"], dtype),
            "max_moment_2": mp_tensor(v["max_moment_2"], dtype) if amsgrad else None,
        }
    }


def mp_sgd_state(v: dict[str, np.ndarray], dtype: str) -> dict:
    return {"momentum": {"velocity": mp_tensor(v["velocity"], dtype)}}  # Some(MomentumState)


def mp_model(values: dict[str, dict[str, np.ndarray]], dtype: str) -> dict:
    """``MlpRecord {l1: LinearRecord {weight, bias}, l2: ...}``; params are ``ParamSerde {id, param}``."""
    item: dict = {}
    for path, pid, _ in PARAMS:
        module, name = path.split(".")
        item.setdefault(module, {"weight": None, "bias": None})
        item[module][name] = {"id": id_to_str(pid), "param": mp_tensor(values[path]["weight"], dtype)}
    return item


# ------------------------------------------------------------------------------------------------
# bincode 2, standard config
# ------------------------------------------------------------------------------------------------


def varint(n: int) -> bytes:
    if n < 0:
        raise ValueError("use zigzag for signed values")
    if n < 251:
        return bytes([n])
    if n < 1 << 16:
        return b"\xfb" + struct.pack("<H", n)
    if n < 1 << 32:
        return b"\xfc" + struct.pack("<I", n)
    return b"\xfd" + struct.pack("<Q", n)


def bc_str(s: str) -> bytes:
    raw = s.encode()
    return varint(len(raw)) + raw


def bc_option(payload: bytes | None) -> bytes:
    return b"\x00" if payload is None else b"\x01" + payload


def bc_tensor(arr: np.ndarray, dtype: str) -> bytes:
    """``TensorData``: bytes (len + raw), shape (len + varints), dtype (variant index)."""
    raw = arr.astype(NUMPY[dtype]).tobytes()
    shape = varint(arr.ndim) + b"".join(varint(d) for d in arr.shape)
    return varint(len(raw)) + raw + shape + varint(BINCODE_DTYPE_INDEX[dtype])


def bc_record(meta: dict[str, str], item: bytes) -> bytes:
    """``BurnRecord``: the five metadata strings, the item, nothing for ``_b``."""
    fields = ("float", "int", "format", "version", "settings")
    return b"".join(bc_str(meta[k]) for k in fields) + item


def bc_optimizer(states: dict[int, tuple[int, bytes]]) -> bytes:
    """Map length, then (id string, V1 = variant 0, Rank<D> = variant D, state) per entry."""
    out = [varint(len(states))]
    for pid, (rank, state) in states.items():
        out += [bc_str(id_to_str(pid)), varint(0), varint(rank), state]
    return b"".join(out)


def bc_adam_state(v: dict[str, np.ndarray], dtype: str, amsgrad: bool) -> bytes:
    vmax = bc_tensor(v["max_moment_2"], dtype) if amsgrad else None
    return varint(TIME) + bc_tensor(v["moment_1"], dtype) + bc_tensor(v["moment_2"], dtype) + bc_option(vmax)


def bc_sgd_state(v: dict[str, np.ndarray], dtype: str) -> bytes:
    return bc_option(bc_tensor(v["velocity"], dtype))  # momentum: Option<MomentumState{velocity}>


# ------------------------------------------------------------------------------------------------
# Assembling the fixture set
# ------------------------------------------------------------------------------------------------


def per_param(values, make_state) -> dict[int, tuple[int, object]]:
    return {pid: (len(shape), make_state(values[path])) for path, pid, shape in PARAMS}


def gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=6, mtime=0)


def truth_npz(values: dict[str, dict[str, np.ndarray]]) -> bytes:
    """An ``.npz`` with fixed zip timestamps (byte-reproducible)."""
    arrays: dict[str, np.ndarray] = {
        "ids": np.array([pid for _, pid, _ in PARAMS], dtype=np.uint64),
        "paths": np.array([path for path, _, _ in PARAMS]),
    }
    for path, pid, shape in PARAMS:
        v = values[path]
        arrays[f"{pid}.__rank"] = np.array(len(shape), dtype=np.int64)
        arrays[f"{pid}.momentum.time"] = np.array(TIME, dtype=np.int64)
        for name in ("moment_1", "moment_2", "max_moment_2", "velocity"):
            arrays[f"{pid}.momentum.{name}"] = v[name]
        arrays[f"model.{path}"] = v["weight"]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in arrays.items():
            with zf.open(zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w") as fh:
                np.lib.format.write_array(fh, arr, allow_pickle=False)
    return buf.getvalue()


def build_fixtures() -> dict[str, bytes]:
    """File name → bytes for every fixture."""
    v = make_values()
    mpk = "NamedMpkFileRecorder"

    def mp_adam(dtype: str, amsgrad: bool = False) -> dict:
        return mp_optimizer(per_param(v, lambda x: mp_adam_state(x, dtype, amsgrad)))

    def bc_adam(dtype: str, amsgrad: bool = False) -> bytes:
        return bc_optimizer(per_param(v, lambda x: bc_adam_state(x, dtype, amsgrad)))

    return {
        "adam_full.mpk": mp_record(metadata(mpk, "Full"), mp_adam("F32")),
        "adam_half.mpk": mp_record(metadata(mpk, "Half"), mp_adam("F16")),
        "adam_half.mpk.gz": gz(mp_record(metadata("NamedMpkGzFileRecorder", "Half"), mp_adam("F16"))),
        "adamw_amsgrad.mpk": mp_record(metadata(mpk, "Full"), mp_adam("F32", amsgrad=True)),
        "sgd_momentum.mpk": mp_record(
            metadata(mpk, "Full"), mp_optimizer(per_param(v, lambda x: mp_sgd_state(x, "F32")))
        ),
        "adam_full.bin": bc_record(metadata("BinFileRecorder", "Full"), bc_adam("F32")),
        "sgd_momentum_half.bin.gz": gz(
            bc_record(
                metadata("BinGzFileRecorder", "Half"),
                bc_optimizer(per_param(v, lambda x: bc_sgd_state(x, "F16"))),
            )
        ),
        "model-21.mpk": mp_record(metadata(mpk, "Full"), mp_model(v, "F32")),
        "truth.npz": truth_npz(v),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / "fixtures" / "legacy"
    )
    parser.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    args = parser.parse_args(argv)
    fixtures = build_fixtures()
    if args.check:
        stale = [
            n
            for n, data in fixtures.items()
            if not (args.out / n).is_file() or (args.out / n).read_bytes() != data
        ]
        for name in stale:
            print(f"stale: {args.out / name}", file=sys.stderr)
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in fixtures.items():
        (args.out / name).write_bytes(data)
        print(f"{args.out / name}  {len(data)} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
