#!/usr/bin/env python3
"""Write the fuzz-corpus cases of the faults reported in issue 29 (needs torch 2.13).

    python scripts/make_fault_cases.py

The fuzzer keeps the cases it finds (``scripts/fuzz.py``); these were reported from a fuzz run
whose seeds were not kept, so each is made here the way the fuzzer's mutators make theirs — a
real file, written by burn's or torch's own format, with one value changed — and kept under
``fixtures/fuzz-corpus/`` with the fuzzer's naming (``<reader group>-<sha256 prefix>.<ext>``),
replayed by ``tests/fuzz/test_corpus.py`` from then on:

- burnpack: ``fixtures/hand-optim.bpk`` with parameter l1.weight's ``time`` scalar NaN (a Float):
  convert to .safetensors ended in "internal error: ValueError: cannot convert float NaN to
  integer", to .pt it wrote step NaN;
- torch-legacy: a torch Adam state saved in torch's legacy format, its param group holding a
  ``None`` key (and no ``lr``): inspect, doctor and convert ended in "internal error: TypeError:
  '<' not supported between instances of 'NoneType' and 'str'" (frameworks/torch_families.py);
- torch-zip: ``{"w": an empty view}`` saved by torch, the view's storage offset set to 2^63:
  reading it raised OverflowError through the Python API;
- torch-zip: a torch Adam state whose param group's ``params`` is a float: "internal error:
  TypeError: 'float' object is not iterable" (frameworks/torch_fqn.py; found beside the above).
"""

from __future__ import annotations

import hashlib
import io
import math
import pickle
import struct
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fixtures" / "fuzz-corpus"


def keep(group: str, ext: str, data: bytes) -> None:
    path = CORPUS / f"{group}-{hashlib.sha256(data).hexdigest()[:12]}{ext}"
    path.write_bytes(data)
    print(path.relative_to(ROOT))


def nan_step_burnpack() -> bytes:
    import sys

    sys.path.insert(0, str(ROOT))
    from statekit.formats import cbor

    data = (ROOT / "fixtures" / "hand-optim.bpk").read_bytes()
    (size,) = struct.unpack_from("<I", data, 6)
    meta = cbor.decode(data[10 : 10 + size])
    pid = next(k for k, path in meta["metadata"].items() if path == "l1.weight")
    meta["scalars"][f"{pid}.momentum.time"] = {"Float": math.nan}
    raw = cbor.encode(meta)
    start, new_start = -(-(10 + size) // 256) * 256, -(-(10 + len(raw)) // 256) * 256
    return data[:6] + struct.pack("<I", len(raw)) + raw + b"\0" * (new_start - 10 - len(raw)) + data[start:]


def adam_state() -> dict:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam([p])
    p.grad = torch.randn(3)
    opt.step()
    return opt.state_dict()


def saved(obj: object, **options) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out, **options)
    return out.getvalue()


def none_key_legacy() -> bytes:
    sd = adam_state()
    del sd["param_groups"][0]["lr"]
    sd["param_groups"][0][None] = 1
    return saved(sd, _use_new_zipfile_serialization=False)


def huge_offset_zip() -> bytes:
    data = saved({"w": torch.ones(3)[3:]})  # an empty view at storage offset 3
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        entries = [(info.filename, zf.read(info)) for info in zf.infolist()]
    name, pkl = next((n, b) for n, b in entries if n.endswith("/data.pkl"))
    at = pkl.index(pickle.BINPERSID) + 1  # the storage, then its offset (BININT1 3)
    assert pkl[at : at + 2] == pickle.BININT1 + b"\x03", pkl[at : at + 2]
    raw = pickle.encode_long(2**63)
    pkl = pkl[:at] + pickle.LONG1 + bytes([len(raw)]) + raw + pkl[at + 2 :]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for n, body in entries:
            zf.writestr(n, pkl if n == name else body)
    return out.getvalue()


def float_params_zip() -> bytes:
    sd = adam_state()
    sd["param_groups"][0]["params"] = 0.5
    return saved(sd)


def main() -> None:
    CORPUS.mkdir(parents=True, exist_ok=True)
    keep("burnpack", ".bpk", nan_step_burnpack())
    keep("torch-legacy", ".pt", none_key_legacy())
    keep("torch-zip", ".pt", huge_offset_zip())
    keep("torch-zip", ".pt", float_params_zip())


if __name__ == "__main__":
    main()
