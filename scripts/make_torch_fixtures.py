"""Write the small torch-made fixtures in ``fixtures/torch_extra/`` (needs torch 2.13).

    python scripts/make_torch_fixtures.py

Every file is written by torch itself (``torch.save``), except ``big_endian.pt``, which is
``views.pt`` re-zipped with byte-swapped storages and a ``byteorder`` record of ``big`` (what
torch writes on a big-endian machine); tests compare statekit's reading of each file with
``torch.load`` of the same file, so nothing here hard-codes expected values. The legacy-format
files differ from run to run (torch names their storages by memory address).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "torch_extra"


def views() -> dict:
    """Tensors sharing one storage: transposed, offset, strided, 0-dim and zero-stride views."""
    base = torch.arange(24, dtype=torch.float32) * 0.5 - 3.0
    grid = base.view(4, 6)
    return {
        "base": base,
        "transposed": grid.t(),
        "offset_slice": base[5:11],
        "every_third": base[1::3],
        "column": grid[:, 2],
        "element": base[7],
        "block": grid[1:3, 2:5],
        "expanded": torch.tensor([1.5, -2.0]).view(2, 1).expand(2, 3),
        "int_view": torch.arange(12, dtype=torch.int64).view(3, 4).t()[1:],
    }


def dtypes() -> dict:
    """One tensor per dtype statekit reads (uint16/32/64 go through _rebuild_tensor_v3)."""
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(2, 3, generator=gen) * 100
    out = {}
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        out[str(dtype)] = values.to(dtype)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8):
        out[str(dtype)] = values.to(torch.int64).to(dtype)
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        out[str(dtype)] = values.abs().to(torch.int64).to(dtype)
    out["torch.bool"] = values > 0
    out["zero_dim_f32"] = torch.tensor(2.5)
    out["zero_dim_i64"] = torch.tensor(-7)
    out["zero_dim_bf16"] = torch.tensor(0.1, dtype=torch.bfloat16)
    out["empty_2d"] = torch.empty(0, 3, dtype=torch.float16)
    out["empty_u16"] = torch.empty(0, dtype=torch.uint16)
    return out


def objects() -> dict:
    """The non-tensor values torch.load(weights_only=True) accepts."""
    return {
        "ints": [0, 255, 256, 65535, 65536, -1, 2**31 - 1, -(2**31), 2**40, -(2**70)],
        "floats": (0.1, float("inf"), float("-inf"), -0.0, 1e308),
        "nested": {"a": (1, (2, [3, {"b": None}])), 7: "seven", "ünï": "çødé"},
        "set": {1, 2, 3},
        "bytes": b"\x00\xff bytes",
        "complex": 1.5 - 2j,
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "flags": [True, False, None],
    }


def attributes() -> dict:
    """Parameters and tensors with requires_grad and Python attributes."""
    param = torch.nn.Parameter(torch.arange(4, dtype=torch.float32))
    frozen = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
    tagged_param = torch.nn.Parameter(torch.full((3,), 0.25))
    tagged_param.tag = "decoder"
    tagged = torch.linspace(0, 1, 5)
    tagged.note = 12
    grad = torch.arange(3, dtype=torch.float64).requires_grad_()
    return {"param": param, "frozen": frozen, "tagged_param": tagged_param, "tagged": tagged, "grad": grad}


def big_endian(source: Path, target: Path) -> None:
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as dst:
        pickled = src.read("views/data.pkl")
        itemsizes = _storage_itemsizes(source)
        for info in src.infolist():
            data = src.read(info)
            name = info.filename.replace("views/", "big_endian/", 1)
            if name.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in name:
                key = name.rsplit("/", 1)[1]
                data = _swap(data, itemsizes[key])
            elif name.endswith("/data.pkl"):
                data = pickled
            dst.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)  # reproducible


def _storage_itemsizes(path: Path) -> dict[str, int]:
    """Element size per storage key: torch numbers storages in order of first appearance."""
    seen: dict[int, int] = {}
    for tensor in torch.load(path, weights_only=True).values():
        seen.setdefault(tensor.untyped_storage().data_ptr(), tensor.element_size())
    return {str(i): size for i, size in enumerate(seen.values())}


def _swap(data: bytes, itemsize: int) -> bytes:
    return b"".join(data[i : i + itemsize][::-1] for i in range(0, len(data), itemsize))


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.save(views(), OUT / "views.pt")
    torch.save(views(), OUT / "legacy_views.pt", _use_new_zipfile_serialization=False)
    torch.save(dtypes(), OUT / "dtypes.pt")
    legacy = {k: v for k, v in dtypes().items() if v.dtype not in (torch.uint16, torch.uint32, torch.uint64)}
    torch.save(legacy, OUT / "legacy_dtypes.pt", _use_new_zipfile_serialization=False)  # no uint16+ there
    torch.save(objects(), OUT / "objects.pt")
    torch.save(attributes(), OUT / "attributes.pt")
    torch.save({"x": torch.arange(5.0), "pair": (1, 2)}, OUT / "protocol4.pt", pickle_protocol=4)
    torch.save({"z": torch.tensor([1 + 2j, 3 - 4j])}, OUT / "complex.pt")
    torch.save({"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)}, OUT / "quantized.pt")
    torch.save({"f8": torch.zeros(2, dtype=torch.float8_e4m3fn)}, OUT / "float8.pt")
    big_endian(OUT / "views.pt", OUT / "big_endian.pt")


if __name__ == "__main__":
    main()
