"""statekit's own format-aware fuzzer: seeds, mutators per reader group, and the case runner.

Used by the hypothesis suite (``tests/fuzz/test_fuzz.py``, a few hundred cases per group) and by
``scripts/fuzz.py`` (long runs in worker processes with time and memory limits). A *case* is
``(group, seed)``: the seed drives a :class:`random.Random` that picks a seed file of the group
and mutates it, so every case can be replayed from its two numbers (and crashers are kept as
files under ``fixtures/fuzz-corpus/``).

A case passes when the file goes through the Python API — open and read every tensor, ``inspect``
with statistics and its text rendering, ``convert`` to one of .pt/.bpk/.safetensors — ending in
a result or a :class:`~statekit.errors.StatekitError`, and what ``convert`` wrote reads back, every
tensor and a whole step count for every parameter (statekit writes nothing it would refuse, and no
damage it would pass on silently). Anything else is a crasher.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import pickle
import pickletools
import random
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
CORPUS = FIXTURES / "fuzz-corpus"

GROUPS = ("burnpack", "msgpack", "bincode", "gzip", "torch-zip", "torch-legacy", "safetensors")
EXTENSIONS = {
    "burnpack": ".bpk", "msgpack": ".mpk", "bincode": ".bin", "gzip": ".mpk.gz",
    "torch-zip": ".pt", "torch-legacy": ".pt", "safetensors": ".safetensors",
}

# ---------------------------------------------------------------------------------- seeds

_SEEDS: dict[str, list[bytes]] = {}


def _read(*names: str) -> list[bytes]:
    return [(FIXTURES / n).read_bytes() for n in names if (FIXTURES / n).exists()]


def _converted(src: str, ext: str, **options) -> bytes | None:
    """A seed statekit writes itself (a torch optimizer state, a statekit.state safetensors)."""
    import tempfile

    import statekit

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"seed{ext}"
        try:
            statekit.convert(FIXTURES / src, out, **options)
        except Exception:  # noqa: BLE001 - a seed that cannot be made is simply left out
            return None
        return out.read_bytes()


def seeds(group: str) -> list[bytes]:
    if group in _SEEDS:
        return _SEEDS[group]
    if group == "burnpack":
        found = _read("hand-optim.bpk", "hand-optim-019.bpk", "hand-optim-sgd.bpk", "hand-optim-rmsprop.bpk",
                      "hand-model.bpk", "hand-scheduler.bpk", "lm-model.bpk", "legacy-bpk/adamw_amsgrad.bpk",
                      "hand-optim-adagrad.bpk", "burn-optim/adafactor.bpk", "burn-optim/lamb.bpk",
                      "burn-optim/lbfgs.bpk", "burn-optim/muon-adamw.bpk", "burn-optim/lion.bpk")
    elif group == "msgpack":
        found = _read("legacy/adam_full.mpk", "legacy/adam_half.mpk", "legacy/adamw_amsgrad.mpk",
                      "legacy/model-21.mpk", "legacy/sgd_momentum.mpk")
    elif group == "bincode":
        found = _read("legacy/adam_full.bin")
        found += [gzip.decompress(b) for b in _read("legacy/sgd_momentum_half.bin.gz")]
    elif group == "gzip":
        found = _read("legacy/adam_half.mpk.gz", "legacy/sgd_momentum_half.bin.gz")
    elif group == "torch-zip":
        found = _read("torch/checkpoint.pt", "torch/state_dict.pt", "torch/nested_dict.pt", "torch/bool.pt",
                      "torch/parameter.pt", "torch_extra/views.pt", "torch_extra/attributes.pt",
                      "torch_extra/big_endian.pt", "torch_extra/protocol4.pt", "bnb/adamw8bit.pt",
                      "bnb/ademamix8bit.pt", "bnb/lamb8bit.pt", "bnb/paged_adamw32bit.pt",
                      "thirdparty/torchao-adamw8bit.pt", "thirdparty/torchao-adamw4bit.pt",
                      "thirdparty/torchao-adamwfp8.pt", "thirdparty/hf-adafactor-trainer.pt",
                      "thirdparty/schedulefree-adamw.pt", "thirdparty/lion-pytorch.pt",
                      "thirdparty/galore-adamw.pt", "hf/v5/llama/checkpoint-2/optimizer.pt")
        made = _converted("hand-optim.bpk", ".pt", optimizer="adam")
        found += [made] if made else []
    elif group == "torch-legacy":
        found = _read("torch/simple_legacy.pt", "torch/legacy_shared_storage.pt", "torch/legacy_uncloned_views.pt",
                      "torch/legacy_with_offsets.pt", "torch_extra/legacy_views.pt", "torch_extra/legacy_dtypes.pt")
    elif group == "safetensors":
        found = _read("candle/model.safetensors", "candle/optimizer.safetensors",
                      "candle/optimizer-nometa.safetensors", "candle/model-bf16.safetensors",
                      "thirdparty/torchao-reference.safetensors", "thirdparty/lion-resume.safetensors")
        made = _converted("hand-optim.bpk", ".safetensors")
        found += [made] if made else []
    else:
        raise KeyError(group)
    _SEEDS[group] = found
    return found


# ---------------------------------------------------------------------------------- values

_INTS = (0, 1, 2, 3, 7, 8, 64, 65, 255, 256, 4096, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53,
         2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -2, -(2**31), -(2**63))


def interesting(rng: random.Random, depth: int = 0) -> object:
    """A value that has broken readers before: huge/negative ints, bools, NaN, deep nesting…"""
    kind = rng.randrange(16)
    if kind < 4:
        return rng.choice(_INTS)
    if kind == 4:
        return rng.choice((True, False, None))
    if kind == 5:
        return rng.choice((1.5, -0.0, math.nan, math.inf, -math.inf, 1e308, 5e-324))
    if kind == 6:
        return rng.choice(("", "x", "F32", "Bool", "U32", "I64", "QFloat", "\ud800", "a" * rng.randrange(1, 5000),
                           "Rank1", "V1", "momentum", "time", "__rank", "0" * 13))
    if kind == 7:  # a shape: zero-size dimensions beside huge ones, or a high rank
        return rng.choice(([0, 2**64 - 1], [0, 2**63, 2**63], [0] * 65, [1] * 65, [2**32, 2**32], [True, 2],
                           [3, -1], [], [2**40]))
    if kind == 8:
        return {"Bool": rng.choice(("Native", "U8", "U32", "U64"))}
    if kind == 9 and depth < 2:
        return [interesting(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 10 and depth < 2:
        return {str(interesting(rng, depth + 1))[:20]: interesting(rng, depth + 1) for _ in range(rng.randrange(3))}
    if kind == 11:  # deep nesting
        value: object = 0
        for _ in range(rng.choice((100, 200, 1000))):
            value = [value]
        return value
    if kind == 12:
        return bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 3, 4, 16))))
    if kind == 13:
        return 1.0
    if kind == 14:
        return rng.randrange(-1000, 100000)
    return list(range(rng.randrange(0, 70)))


def _nodes(obj: object, path=(), out=None, depth=0) -> list:
    out = [] if out is None else out
    out.append(path)
    if depth > 40 or len(out) > 20000:
        return out
    if isinstance(obj, dict):
        for k in list(obj):
            _nodes(obj[k], (*path, ("k", k)), out, depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _nodes(v, (*path, ("i", i)), out, depth + 1)
    return out


def _get(obj, path):
    for _, key in path:
        obj = obj[key]
    return obj


def mutate_tree(tree: object, rng: random.Random, prefer: Callable[[tuple], bool] | None = None) -> object:
    """Change one to three nodes of a JSON-like tree (replace, delete, add, duplicate, rename)."""
    for _ in range(rng.choice((1, 1, 1, 1, 2, 3))):
        nodes = _nodes(tree)
        if prefer is not None and rng.random() < 0.7:
            nodes = [p for p in nodes if prefer(p)] or nodes
        path = rng.choice(nodes)
        if not path:
            if isinstance(tree, dict) and tree and rng.random() < 0.5:
                tree.pop(rng.choice(list(tree)))
            else:
                tree = interesting(rng) if rng.random() < 0.2 else tree
            continue
        parent, (_, key) = _get(tree, path[:-1]), path[-1]
        action = rng.randrange(10)
        if action < 5:
            parent[key] = interesting(rng)
        elif action == 5:
            del parent[key]
        elif action == 6 and isinstance(parent, dict):
            parent[str(interesting(rng))[:30]] = parent[key]
        elif action == 6:
            parent.append(parent[key])
        elif action == 7 and isinstance(parent, dict):
            parent[rng.choice(("dtype", "shape", "data_offsets", "param_id", "bytes", "__metadata__", "tensors",
                               "scalars", "metadata", "time", "moment_1", "V1", "Rank2"))] = parent[key]
        elif action == 8:
            value = parent[key]
            if isinstance(value, int) and not isinstance(value, bool):
                parent[key] = value + rng.choice((-1, 1, 256, -256, 2**32, 2**63))
            elif isinstance(value, list) and value:
                value.insert(rng.randrange(len(value) + 1), rng.choice(value))
            else:
                parent[key] = interesting(rng)
        else:
            parent[key] = rng.choice((True, 1.5, math.nan, math.inf, -1, 2**64))
    return tree


def mutate_bytes(data: bytes, rng: random.Random, tokens: tuple[bytes, ...] = ()) -> bytes:
    """Byte-level havoc: flips, interesting integers, deletions, insertions, splices, truncation."""
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3, 4, 8))):
        n = len(buf)
        action = rng.randrange(9)
        pos = rng.randrange(n) if n else 0
        if action == 0 and n:
            buf[pos] ^= 1 << rng.randrange(8)
        elif action == 1 and n:
            buf[pos] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        elif action == 2:
            width = rng.choice((2, 4, 8))
            value = rng.choice(_INTS) % (1 << (8 * width))
            buf[pos : pos + width] = value.to_bytes(width, rng.choice(("little", "big")))
        elif action == 3 and n:
            del buf[pos : pos + rng.choice((1, 2, 4, 8, 64, 256))]
        elif action == 4:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 2, 4, 8))))
        elif action == 5 and n:
            lo = rng.randrange(n)
            buf[pos:pos] = buf[lo : lo + rng.choice((4, 16, 64, 512))]
        elif action == 6 and n:
            del buf[rng.randrange(n) :]
        elif action == 7 and tokens:
            buf[pos:pos] = rng.choice(tokens)
        elif n:
            width = rng.choice((1, 2, 4, 8))
            old = int.from_bytes(buf[pos : pos + width], "little")
            new = (old + rng.choice((-1, 1, -16, 16, 1 << 31))) % (1 << (8 * width))
            buf[pos : pos + width] = new.to_bytes(width, "little")[: len(buf[pos : pos + width])]
    return bytes(buf)


# ---------------------------------------------------------------------------------- formats


def _mutate_burnpack(data: bytes, rng: random.Random) -> bytes:
    from statekit.formats import cbor

    if rng.random() < 0.2 or len(data) < 10:
        return mutate_bytes(data, rng, (b"NRUB", b"\x01\x00"))
    (size,) = struct.unpack_from("<I", data, 6)
    meta_end = 10 + size
    data_start = -(-meta_end // 256) * 256
    try:
        meta = cbor.decode(data[10:meta_end])
        meta = mutate_tree(meta, rng, prefer=lambda p: any(k in ("shape", "dtype", "data_offsets") for _, k in p)
                           or (len(p) > 1 and p[0][1] == "scalars"))
        raw = cbor.encode(meta)
    except Exception:  # noqa: BLE001 - the mutation made something CBOR cannot hold: havoc instead
        return mutate_bytes(data, rng)
    body = data[data_start:]
    if rng.random() < 0.15:  # values only: NaN, Inf, huge numbers in the tensors
        return data[:data_start] + mutate_bytes(body, rng)
    new_start = -(-(10 + len(raw)) // 256) * 256
    header = data[:6] + struct.pack("<I", len(raw) % (1 << 32))
    return header + raw + b"\0" * (new_start - 10 - len(raw)) + body


def _mutate_msgpack(data: bytes, rng: random.Random) -> bytes:
    import msgpack

    if rng.random() < 0.2:
        return mutate_bytes(data, rng, (b"\xc0", b"\xc3", b"\xcb", b"\xdd\xff\xff\xff\xff", b"\xcf" + b"\xff" * 8))
    try:
        tree = msgpack.unpackb(data, raw=False, strict_map_key=False)
        tree = mutate_tree(tree, rng, prefer=lambda p: len(p) > 2 and p[0][1] == "item")
        return msgpack.packb(tree, use_bin_type=True)
    except Exception:  # noqa: BLE001
        return mutate_bytes(data, rng)


_VARINT_TOKENS = (b"\xfb\xff\xff", b"\xfc\xff\xff\xff\xff", b"\xfd" + b"\xff" * 8, b"\xfd" + b"\x00" * 7 + b"\x40",
                  b"\xfe" + b"\xff" * 16, b"\x00", b"\x01", b"\x08", b"\x41")


def _mutate_bincode(data: bytes, rng: random.Random) -> bytes:
    return mutate_bytes(data, rng, _VARINT_TOKENS)


def _mutate_gzip(data: bytes, rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.25:
        return mutate_bytes(data, rng)
    inner = gzip.decompress(data)
    if roll < 0.35:  # a stream inflating far beyond its size
        return gzip.compress(inner + b"\0" * rng.choice((1 << 20, 8 << 20)), compresslevel=9)
    inner = _mutate_msgpack(inner, rng) if inner[:1] == b"\x83" else _mutate_bincode(inner, rng)
    out = gzip.compress(inner, compresslevel=1, mtime=0)
    return mutate_bytes(out, rng) if rng.random() < 0.1 else out


_PICKLE_TOKENS = (
    pickle.EMPTY_LIST + pickle.BINPUT + b"\x00" + pickle.BINGET + b"\x00" + pickle.APPEND,  # a list holding itself
    pickle.MARK, pickle.APPENDS, pickle.SETITEMS, pickle.TUPLE, pickle.DUP, pickle.POP, pickle.BUILD,
    pickle.NEWTRUE, pickle.NONE, pickle.BINFLOAT + struct.pack(">d", math.nan), pickle.EMPTY_DICT,
    pickle.BININT + struct.pack("<i", -1), pickle.LONG1 + b"\x09" + b"\xff" * 8 + b"\x3f",
    pickle.BINUNICODE + struct.pack("<I", 3) + "\ud800".encode("utf-8", "surrogatepass"),
    pickle.BINGET + b"\x01", pickle.LONG_BINGET + b"\x00\x00\x00\x00", pickle.REDUCE, pickle.STOP,
)


def mutate_pickle(data: bytes, rng: random.Random) -> bytes:
    """Opcode-aware pickle mutation: change an argument, drop/duplicate/insert an opcode."""
    try:
        ops = list(pickletools.genops(data))
    except Exception:  # noqa: BLE001
        return mutate_bytes(data, rng, _PICKLE_TOKENS)
    spans = []
    for i, (_op, _arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        spans.append((pos, end))
    buf = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3))):
        i = rng.randrange(len(ops))
        op, arg, _ = ops[i]
        lo, hi = spans[i]
        if lo > len(buf):
            break
        action = rng.randrange(6)
        if action == 0 and isinstance(arg, int) and op.name in ("BININT", "BININT1", "BININT2", "LONG1"):
            value = rng.choice(_INTS)
            raw = pickle.encode_long(value)
            replacement = pickle.LONG1 + bytes([len(raw)]) + raw if value else pickle.BININT1 + b"\0"
        elif action == 0 and isinstance(arg, str):
            text = rng.choice(("", "\ud800", "x" * 70000, arg + "\udcff", "storage", "0", arg * 2))
            raw = text.encode("utf-8", "surrogatepass")
            replacement = pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw
        elif action == 1:
            replacement = b""
        elif action == 2:
            replacement = bytes(buf[lo:hi]) * 2
        elif action == 3:
            replacement = rng.choice(_PICKLE_TOKENS) + bytes(buf[lo:hi])
        elif action == 4 and op.name in ("BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"):
            replacement = bytes(buf[lo : lo + 1]) + bytes([rng.randrange(256)]) * (hi - lo - 1)
        else:
            replacement = mutate_bytes(bytes(buf[lo:hi]), rng)
        buf[lo:hi] = replacement
        break  # spans are stale after a length change
    return bytes(buf)


def _mutate_torch_zip(data: bytes, rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.25:
        return mutate_bytes(data, rng, (b"PK\x01\x02", b"PK\x05\x06", b"\x40\x00"))
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            entries = [(info.filename, zf.read(info)) for info in zf.infolist()]
    except Exception:  # noqa: BLE001
        return mutate_bytes(data, rng)
    pkl = [i for i, (name, _) in enumerate(entries) if name.endswith("/data.pkl")]
    if pkl and roll < 0.8:
        i = pkl[0]
        entries[i] = (entries[i][0], mutate_pickle(entries[i][1], rng))
    elif entries:
        i = rng.randrange(len(entries))
        name, body = entries[i]
        if rng.random() < 0.3:
            del entries[i]
        else:
            entries[i] = (name, mutate_bytes(body, rng))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for name, body in entries:  # (a fixed date: a case is the same bytes whenever it is made)
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), body)
    return out.getvalue()


def _mutate_torch_legacy(data: bytes, rng: random.Random) -> bytes:
    from statekit.formats import torch_pickle

    if rng.random() < 0.3:
        return mutate_bytes(data, rng, _PICKLE_TOKENS)
    bounds, pos = [], 0
    try:
        for _ in range(5):
            start = pos
            _, pos = torch_pickle.loads(data, pos, lambda sid: torch_pickle.Storage(sid, lambda: b""))
            bounds.append((start, pos))
    except Exception:  # noqa: BLE001
        return mutate_bytes(data, rng)
    lo, hi = bounds[rng.choice((2, 3, 3, 3, 4))]
    if rng.random() < 0.2:  # the storages' element counts and bytes
        return data[:hi] + mutate_bytes(data[hi:], rng)
    return data[:lo] + mutate_pickle(data[lo:hi], rng) + data[hi:]


def _mutate_safetensors(data: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.2 or len(data) < 8:
        return mutate_bytes(data, rng)
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + n])
    except Exception:  # noqa: BLE001
        return mutate_bytes(data, rng)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if isinstance(meta, dict) and meta and rng.random() < 0.5:  # statekit's JSON inside the metadata
        key = rng.choice(list(meta))
        try:
            inner = json.loads(meta[key])
            meta[key] = json.dumps(mutate_tree(inner, rng))
        except Exception:  # noqa: BLE001
            meta[key] = str(interesting(rng))
            if rng.random() < 0.2:
                meta[key] = "[" * 100000 + "]" * 100000
    else:
        header = mutate_tree(header, rng, prefer=lambda p: any(k in ("shape", "dtype", "data_offsets") for _, k in p))
    try:
        raw = json.dumps(header).encode("utf-8", "surrogatepass")
    except Exception:  # noqa: BLE001
        return mutate_bytes(data, rng)
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


MUTATORS: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "burnpack": _mutate_burnpack,
    "msgpack": _mutate_msgpack,
    "bincode": _mutate_bincode,
    "gzip": _mutate_gzip,
    "torch-zip": _mutate_torch_zip,
    "torch-legacy": _mutate_torch_legacy,
    "safetensors": _mutate_safetensors,
}


def make_case(group: str, seed: int) -> bytes:
    """The bytes of case ``seed`` of ``group`` (deterministic)."""
    rng = random.Random(f"{group}:{seed}")
    data = rng.choice(seeds(group))
    for _ in range(rng.choice((1, 1, 1, 1, 1, 2, 3))):
        try:
            data = MUTATORS[group](data, rng)
        except Exception:  # noqa: BLE001 - an earlier mutation broke what this one parses
            data = mutate_bytes(data, rng)
    return data


# ---------------------------------------------------------------------------------- running


def exercise(path: str | os.PathLike, workdir: str | os.PathLike, choice: int = 0) -> str:
    """Run ``path`` through the API; returns "ok" or ``"<stage>:<StatekitError class>"``.

    Any other exception propagates: that is a crasher.
    """
    import statekit
    from statekit.errors import StatekitError

    path, workdir = os.fspath(path), Path(workdir)
    stage = "open"
    try:
        with statekit.open(path) as ckpt:
            _touch(ckpt)
        stage = "inspect"
        result = statekit.inspect(path, stats=True)
        _render(result)
        stage = "convert"
        ext = (".pt", ".bpk", ".safetensors")[choice % 3]
        out = workdir / f"out{ext}"
        statekit.convert(path, out, **({"optimizer": "adam"} if choice % 2 else {}))
    except StatekitError as exc:
        str(exc)  # the message itself must render
        return f"{stage}:{type(exc).__name__}"
    if out.exists():
        _read_back(out)
        out.unlink()
    return "ok"


def _read_back(out: Path) -> None:
    """What statekit wrote reads back: every tensor, and every parameter's step a whole count."""
    import statekit
    from statekit.errors import StatekitError
    from statekit.state import step_problem

    try:
        with statekit.open(out) as again:
            _touch(again)
            for p in again.optimizer.params if again.optimizer is not None else ():
                problem = step_problem(p.step)
                if problem is not None:
                    raise AssertionError(f"statekit wrote {out.name} with parameter {p.label()}: {problem}")
    except StatekitError as exc:
        raise AssertionError(f"statekit wrote {out.name} and refuses to read it back: {exc}") from None


def _touch(ckpt) -> None:
    refs = []
    if ckpt.optimizer is not None:
        for p in ckpt.optimizer.params:
            refs += p.slots.values()
        refs += ckpt.optimizer.global_slots.values()
    if ckpt.model is not None:
        refs += [p.tensor for p in ckpt.model.params if p.tensor is not None]
    for ref in refs:
        if ref.dtype != "QFloat":
            ref.numpy()


def _render(result: dict) -> None:
    """What ``statekit inspect --stats`` prints: the table, and the TSV lines of ``--format tsv``."""
    from rich.console import Console

    from statekit.render import table, tsv_lines

    console = Console(file=io.StringIO(), width=100)
    for item in table("inspect", result, stats=True):
        console.print(item)
    list(tsv_lines("inspect", result))
