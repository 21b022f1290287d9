#!/usr/bin/env python3
"""How fast is a structural map learned from the weights, and in how much memory?

Builds, for each dtype (f32, bf16), a pair of weight files of about ``--gib`` GiB each: an old
Llama-like model (q, k, v, o, gate, up, down per layer, GQA, an embedding and a head) and the same
model as the user's conversion left it (q and k rows permuted per head as transformers'
``convert_llama_weights_to_hf.py`` permutes them, q/k/v fused into ``qkv_proj``, gate/up fused into
``gate_up_proj``, the vocabulary grown by 64 rows), both safetensors in torch's layout. Then it times,
in fresh processes, with the page cache cold (the two files evicted with ``posix_fadvise``) and warm:

    cat OLD NEW > /dev/null                          the baseline: reading both files once
    statekit remap S --old-model OLD --model NEW -o OUT --dry-run
                                                     S holds one parameter's state: the time is the
                                                     map's (every new tensor is mapped and proved)

    python -c "import statekit.api ...; t0; api.remap(S, OUT, model=NEW, old_model=OLD, dry_run=True)"
                                                     the same through the Python API, timed from the
                                                     call (the modules imported before the clock
                                                     starts): the map's inference alone, without the
                                                     interpreter's start and the imports (a fixed
                                                     0.2-0.4 s that does not grow with the files)

and prints the ratios (goal: the map's inference ≤ 2 × the baseline, cold and warm) and the peak RSS
of the command. A second, smaller
pair with tensors of half the size shows how peak RSS grows with tensor size (it should not grow
beyond one tensor's line keys).

Usage: python bench/refactor.py [--gib 1] [--repeat 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import optional  # noqa: E402
from scale import run  # noqa: E402

from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack  # noqa: E402
from statekit.tensor import TensorRef  # noqa: E402

MIB = 1 << 20


def rope(w: np.ndarray, heads: int) -> np.ndarray:
    d1, d2 = w.shape
    return w.reshape(heads, d1 // heads // 2, 2, d2).transpose(0, 2, 1, 3).reshape(d1, d2)


def shapes(gib: float, itemsize: int, dim: int) -> tuple[dict, int, int]:
    heads, kv, inter, vocab = dim // 128, max(1, dim // 512), int(dim * 2.75) // 64 * 64, 8192
    per_layer = (dim * dim * 2 + 2 * kv * 128 * dim + 3 * inter * dim + 2 * dim) * itemsize
    layers = max(1, int((gib * (1 << 30) - 2 * vocab * dim * itemsize) // per_layer))
    out = {"model.embed_tokens.weight": (vocab, dim)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (heads * 128, dim), p + "self_attn.k_proj.weight": (kv * 128, dim),
                p + "self_attn.v_proj.weight": (kv * 128, dim), p + "self_attn.o_proj.weight": (dim, heads * 128),
                p + "mlp.gate_proj.weight": (inter, dim), p + "mlp.up_proj.weight": (inter, dim),
                p + "mlp.down_proj.weight": (dim, inter), p + "input_layernorm.weight": (dim,),
                p + "post_attention_layernorm.weight": (dim,)}
    out |= {"model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)}
    return out, heads, kv


def write_pair(folder: str, gib: float, dtype, dim: int) -> tuple[str, str, str]:
    """old.safetensors, new.safetensors and a one-parameter state; tensors written one at a time."""
    from safetensors.numpy import save_file

    table, heads, kv = shapes(gib, np.dtype(dtype).itemsize, dim)
    rng = np.random.default_rng(0)

    def values(shape):
        if len(shape) == 1:
            return np.ones(shape, dtype)
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    old = {name: values(shape) for name, shape in table.items()}
    new = {}
    for name, w in old.items():
        p = name.rsplit(".", 2)[0] + "."
        if name.endswith("q_proj.weight"):
            q, k, v = w, old[p + "k_proj.weight"], old[p + "v_proj.weight"]
            new[p + "qkv_proj.weight"] = np.concatenate([rope(q, heads), rope(k, kv), v])
        elif name.endswith("gate_proj.weight"):
            new[p.replace("mlp.", "mlp.") + "gate_up_proj.weight"] = np.concatenate([w, old[p + "up_proj.weight"]])
        elif name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue
        elif name == "model.embed_tokens.weight":
            new[name] = np.concatenate([w, values((64, w.shape[1]))])
        else:
            new[name] = w
    o, n = os.path.join(folder, "old.safetensors"), os.path.join(folder, "new.safetensors")
    save_file(old, o)
    save_file(new, n)
    del old, new
    state = os.path.join(folder, "one.bpk")
    ref = TensorRef.from_array(np.zeros(table["model.norm.weight"], np.float32))
    write_burnpack(state, [PackTensor("7.momentum.moment_1", ref, param_id=7),
                           PackTensor("7.momentum.moment_2", ref, param_id=7)],
                   {"7": "model.norm.weight"}, {"7.__rank": Scalar("UInt", 1), "7.momentum.time": Scalar("UInt", 3)})
    return o, n, state


def evict(*paths: str) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def best(cmd, repeat: int, cold: bool, files) -> tuple[float, int]:
    times, peak = [], 0
    for _ in range(repeat):
        if cold:
            evict(*files)
        else:
            run(["cat", *files])
        wall, rss = run(cmd)
        times.append(wall)
        peak = max(peak, rss)
    return min(times), peak


INFER = """
import sys, time
import statekit.api as api
state, out, old, new, tiny_old, tiny_new, report = sys.argv[1:8]
api.remap(state, out, model=tiny_new, old_model=tiny_old, dry_run=True)  # loads the modules, reads no big file
t = time.perf_counter()
api.remap(state, out, model=new, old_model=old, dry_run=True)
with open(report, "w") as fh:
    fh.write(repr(time.perf_counter() - t))
"""


def write_tiny_pair(folder: str, dim: int, dtype) -> tuple[str, str]:
    """A few small tensors fused as the big pair's are (and the state's parameter): a remap of it
    first loads every module the timed one uses, so the clock sees the inference alone."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((8, 16), dtype=np.float32).astype(dtype) for _ in range(2))
    norm = np.ones(dim, dtype)
    o, n = os.path.join(folder, "tiny-old.safetensors"), os.path.join(folder, "tiny-new.safetensors")
    save_file({"model.norm.weight": norm, "a.q_proj.weight": q, "a.k_proj.weight": k}, o)
    save_file({"model.norm.weight": norm, "a.qk_proj.weight": np.concatenate([rope(q, 2), k])}, n)
    return o, n


def best_inference(folder: str, state: str, old: str, new: str, repeat: int, cold: bool, dim: int, dtype) -> float:
    """The fastest of ``repeat`` fresh processes' inference, timed inside each (see :data:`INFER`)."""
    times = []
    report = os.path.join(folder, "seconds")
    tiny = write_tiny_pair(folder, dim, dtype)
    for _ in range(repeat):
        if cold:
            evict(old, new)
        else:
            run(["cat", old, new])
        run([sys.executable, "-W", "ignore", "-c", INFER, state, os.path.join(folder, "out.bpk"), old, new, *tiny,
             report])
        with open(report) as fh:
            times.append(float(fh.read()))
    return min(times)


def measure(folder: str, gib: float, dtype, dim: int, repeat: int) -> list[tuple]:
    old, new, state = write_pair(folder, gib, dtype, dim)
    size = (os.path.getsize(old) + os.path.getsize(new)) / (1 << 30)
    remap = [sys.executable, "-m", "statekit", "remap", state, "--old-model", old, "--model", new, "-o",
             os.path.join(folder, "out.bpk"), "--dry-run"]
    rows = []
    for cache in ("cold", "warm"):
        base, base_rss = best(["cat", old, new], repeat, cache == "cold", [old, new])
        wall, rss = best(remap, repeat, cache == "cold", [old, new])
        inference = best_inference(folder, state, old, new, repeat, cache == "cold", dim, dtype)
        rows.append((np.dtype(dtype).name, dim, f"{size:.2f}", cache, base, inference, inference / base, wall,
                     wall / base, rss // 1024))
    for p in (old, new, state):
        os.unlink(p)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size of each weight file")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    print(optional.line())
    folder = tempfile.mkdtemp(prefix="statekit-refactor-", dir=args.dir)
    rows = []
    try:
        for dtype, dim in ((np.float32, 2048), (ml_dtypes.bfloat16, 2048), (np.float32, 1024)):
            t = time.perf_counter()
            rows += measure(folder, args.gib if dim == 2048 else args.gib / 2, dtype, dim, args.repeat)
            print(f"  ({np.dtype(dtype).name} dim {dim}: {time.perf_counter() - t:.0f} s)", file=sys.stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print()
    head = ("dtype", "dim", "GiB read", "cache", "cat s", "map s", "× cat", "command s", "× cat", "peak MiB",
            "goal: map ≤ 2 × cat")
    widths = (9, 5, 9, 6, 7, 6, 6, 10, 6, 9, 20)
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for dt, dim, size, cache, base, inference, ratio, wall, wall_ratio, rss in rows:
        cells = (dt, dim, size, cache, f"{base:.2f}", f"{inference:.2f}", f"{ratio:.2f}", f"{wall:.2f}",
                 f"{wall_ratio:.2f}", rss, "met" if ratio <= 2 else "missed")
        print("  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True)))
    print(f"\nload: {[f'{x:.2f}' for x in os.getloadavg()]} on {os.cpu_count()} cores; each time the best of "
          f"{args.repeat}; map: the inference through the Python API in a fresh process, timed from the call; "
          f"command: `statekit remap ... --dry-run` end to end (the interpreter's start and the imports included); "
          f"peak: the command's; the dim-1024 pair has tensors of a quarter the size (peak RSS should not follow them)")


if __name__ == "__main__":
    main()
