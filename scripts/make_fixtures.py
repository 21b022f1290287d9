#!/usr/bin/env python3
"""Write statekit's burnpack fixtures: what burn 0.22 leaves after 21 steps on a small MLP.

The model is burn's two-layer MLP 4 → 16 → 1 (ReLU, MSE loss, 97 parameters). burn's Linear keeps
weights as ``[d_in, d_out]``. Training data, initial weights and the 21 steps are deterministic;
each optimizer's update follows burn 0.22's arithmetic in float32 (burn-formats.md §2.5), so the
files hold what burn's ``ModuleOptimizer::to_record`` would write. Malformed variants for the
error tests go to ``fixtures/malformed/``.

Run from the repository root: ``python scripts/make_fixtures.py`` (idempotent; byte-stable).
"""

from __future__ import annotations

import os
import struct
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from statekit.formats import cbor  # noqa: E402
from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack  # noqa: E402
from statekit.optim.backend import Backend  # noqa: E402
from statekit.tensor import TensorRef  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
F = np.float32
STEPS = 21
IDS = {
    "l1.weight": 18402649998147242804,
    "l1.bias": 4872954564708272749,
    "l2.weight": 708128169117982014,
    "l2.bias": 2021826497617271949,
}
ORDER = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
_EXACT = Backend(np)


def init_model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "l1.weight": (rng.uniform(-0.5, 0.5, (4, 16))).astype(F),
        "l1.bias": (rng.uniform(-0.5, 0.5, (16,))).astype(F),
        "l2.weight": (rng.uniform(-0.25, 0.25, (16, 1))).astype(F),
        "l2.bias": np.zeros((1,), F),
    }


def batches(seed: int = 1):
    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=(4, 1)).astype(F)
    while True:
        x = rng.normal(size=(8, 4)).astype(F)
        # numpy's float32 sin is its FMA build's (AVX2 and up) on the machine that wrote the fixtures
        yield x, matmul32(np.sin(x), true_w, lanes=8)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``a*b + c`` element-wise in float32 with one rounding (statekit's exact emulation)."""
    a, b, c = np.broadcast_arrays(np.asarray(a, F), np.asarray(b, F), np.asarray(c, F))
    flat = _EXACT.fma32(np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1),
                        np.ascontiguousarray(c).reshape(-1))
    return np.asarray(flat, F).reshape(c.shape)


def matmul32(a: np.ndarray, b: np.ndarray, lanes: int = 1) -> np.ndarray:
    """``a @ b`` in float32, summed in the order OpenBLAS summed it on the machine that wrote the
    fixtures (an AVX-512 Xeon), so that every CPU computes the same gradients: each output one
    FMA chain over the inner index in order; with ``lanes``, ``lanes`` chains (inner index modulo
    ``lanes``) folded by halves (lane ``l`` + lane ``l + lanes/2``) down to four, then in pairs
    (sgemv_t's 8 lanes and ``hadd``). numpy's own ``@`` calls the CPU's BLAS kernel, whose order
    differs between CPUs (on AVX2, ``x.T @ d_h`` keeps two chains, even and odd): the gradients,
    hence every trained state, then differed in the last bits (``tests/test_burn_optimizers.py``
    failed on an AVX2 machine). This model regenerates every committed fixture byte for byte."""
    a, b = np.asarray(a, F), np.asarray(b, F)
    chains = [np.zeros((a.shape[0], b.shape[1]), F) for _ in range(min(lanes, a.shape[1]))]
    for k in range(a.shape[1]):
        chains[k % len(chains)] = _fma(a[:, k:k + 1], b[k:k + 1, :], chains[k % len(chains)])
    while len(chains) > 4:
        half = len(chains) // 2
        chains = [(chains[i] + chains[i + half]).astype(F) for i in range(half)]
    while len(chains) > 1:
        chains = [(chains[2 * i] + chains[2 * i + 1]).astype(F) for i in range(len(chains) // 2)]
    return chains[0]


def gradients(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """MSE loss of relu(x·W1 + b1)·W2 + b2 against y; weights are [d_in, d_out] as in burn. Every
    product in :func:`matmul32`'s fixed order (the same bits on every CPU)."""
    h_pre = matmul32(x, w["l1.weight"]) + w["l1.bias"]
    h = np.maximum(h_pre, F(0))
    out = matmul32(h, w["l2.weight"], lanes=8) + w["l2.bias"]
    d_out = (F(2) / F(out.size)) * (out - y)
    d_h = matmul32(d_out, w["l2.weight"].T) * (h_pre > 0)
    return {
        "l1.weight": matmul32(x.T, d_h),
        "l1.bias": d_h.sum(0).astype(F),
        "l2.weight": matmul32(h.T, d_out),
        "l2.bias": d_out.sum(0).astype(F),
    }


# ----------------------------------------------------------------- burn 0.22 update rules (f32)


def adam(theta, g, st, lr, amsgrad=False, decoupled_wd=0.0, b1=0.9, b2=0.999, eps=1e-5):
    b1, b2, eps = F(b1), F(b2), F(eps)
    if not st:
        m, v = g * (F(1) - b1), (g * g) * (F(1) - b2)
        t = 1
        vmax = v if amsgrad else None
    else:
        m = st["moment_1"] * b1 + g * (F(1) - b1)
        v = st["moment_2"] * b2 + (g * g) * (F(1) - b2)
        t = st["time"] + 1
        vmax = np.maximum(st["max_moment_2"], v) if amsgrad else None
    vhat = vmax if amsgrad else v
    if decoupled_wd:  # AdamW's textbook form
        mhat = m / (F(1) - b1 ** np.int32(t))
        vh = vhat / (F(1) - b2 ** np.int32(t))
        u = mhat / (np.sqrt(vh) + eps)
        theta = theta * F(1 - lr * decoupled_wd)
    else:
        bc2 = np.sqrt(F(1) - b2 ** np.int32(t))
        cf = bc2 / (F(1) - b1 ** np.int32(t))
        u = (m * cf) / (np.sqrt(vhat) + eps * bc2)
    new = {"time": t, "moment_1": m, "moment_2": v}
    if amsgrad:
        new["max_moment_2"] = vmax
    return (theta - u * F(lr)).astype(F), new


def sgd_momentum(theta, g, st, lr, momentum=0.9, dampening=0.1):
    v = g if not st else g * F(1 - dampening) + st["velocity"] * F(momentum)
    return (theta - v * F(lr)).astype(F), {"velocity": v}


def rmsprop_centered(theta, g, st, lr, alpha=0.99, momentum=0.9, eps=1e-5):
    a = F(alpha)
    sa = (g * g) * (F(1) - a) if not st else st["square_avg"] * a + (g * g) * (F(1) - a)
    ga = g * (F(1) - a) if not st else st["grad_avg"] * a + g * (F(1) - a)
    avg = sa - ga * ga
    step = g / (np.sqrt(avg) + F(eps))
    buf = step if not st else st["buf"] * F(momentum) + step
    return (theta - buf * F(lr)).astype(F), {"square_avg": sa, "grad_avg": ga, "avg": avg, "buf": buf}


def adagrad(theta, g, st, lr, lr_decay=0.0, eps=1e-5):
    s = g * g if not st else st["sum"] + g * g
    t = 1 if not st else st["time"] + 1
    lr_t = lr / (1 + (t - 1) * lr_decay)
    return (theta - (g / (np.sqrt(s) + F(eps))) * F(lr_t)).astype(F), {"sum": s, "time": t}


def train(rule, steps=STEPS, lr=1e-2, **kw):
    w = init_model()
    state: dict[str, dict] = {p: {} for p in ORDER}
    data = batches()
    for _ in range(steps):
        x, y = next(data)
        grads = gradients(w, x, y)
        for p in ORDER:
            w[p], state[p] = rule(w[p], grads[p], state[p], lr, **kw)
    return w, state


# ----------------------------------------------------------------- records


def optimizer_record(state, fields, step_field=None, dtype="F32", extra_meta=None):
    """Tensors/scalars/metadata as ModuleOptimizer::to_record writes them (ORDER = hash order)."""
    tensors, scalars, meta = [], {}, {}
    for path in ORDER:
        pid = IDS[path]
        for native, key in fields:
            arr = state[path][key]
            if dtype == "BF16":
                ref = TensorRef.from_array(arr.astype(ml_dtypes.bfloat16), "BF16")
            else:
                ref = TensorRef.from_array(arr.astype(F), "F32")
            tensors.append(PackTensor(f"{pid}.{native}", ref, param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", state[path]["__rank"])
        if step_field:
            scalars[f"{pid}.{step_field[0]}"] = Scalar("UInt", int(state[path][step_field[1]]))
        meta[str(pid)] = path
    meta.update(extra_meta or {})
    return tensors, meta, scalars


def with_ranks(state, weights):
    for p in ORDER:
        state[p]["__rank"] = weights[p].ndim
    return state


def write(name, tensors, meta=None, scalars=None, **kw):
    path = os.path.join(OUT, name)
    write_burnpack(path, tensors, meta, scalars, **kw)
    print(f"{path}: {os.path.getsize(path)} bytes")


def main() -> None:
    os.makedirs(os.path.join(OUT, "malformed"), exist_ok=True)
    adam_fields = [("momentum.moment_1", "moment_1"), ("momentum.moment_2", "moment_2")]
    step = ("momentum.time", "time")

    w, st = train(adam)
    with_ranks(st, w)
    write("hand-optim.bpk", *optimizer_record(st, adam_fields, step))
    write("hand-optim-bf16.bpk", *optimizer_record(st, adam_fields, step, dtype="BF16"))
    write("hand-optim-019.bpk", *optimizer_record(st, adam_fields, step), unaligned=True)
    model = [PackTensor(p, TensorRef.from_array(w[p]), param_id=IDS[p]) for p in ORDER]
    write("hand-model.bpk", model)
    np.savez(os.path.join(OUT, "hand-train-adam.npz"),
             **{f"{p}/{k}": np.asarray(v) for p in ORDER for k, v in st[p].items()},
             **{f"{p}/param": w[p] for p in ORDER})

    w, st = train(adam, amsgrad=True, decoupled_wd=1e-4)
    with_ranks(st, w)
    ams = [("momentum.max_moment_2", "max_moment_2"), *adam_fields]
    write("hand-optim-amsgrad.bpk", *optimizer_record(st, ams, step))

    w, st = train(sgd_momentum)
    with_ranks(st, w)
    write("hand-optim-sgd.bpk", *optimizer_record(st, [("momentum.velocity", "velocity")]))

    w, st = train(rmsprop_centered, lr=1e-3)
    with_ranks(st, w)
    rms = [("square_avg.square_avg", "square_avg"), ("centered.grad_avg", "grad_avg"),
           ("centered.avg", "avg"), ("momentum.buf", "buf")]
    write("hand-optim-rmsprop.bpk", *optimizer_record(st, rms))

    w, st = train(adagrad)
    with_ranks(st, w)
    write("hand-optim-adagrad.bpk", *optimizer_record(st, [("lr_decay.sum", "sum")], ("lr_decay.time", "time")))

    # LR scheduler record: Noam base scheduler (f64 step) and a cosine group scheduler.
    tiny_lm()

    write("hand-scheduler.bpk", [], None,
          {"0.step": Scalar("Float", 21.0), "1.current_iter": Scalar("UInt", 20), "2.iter_idx": Scalar("Int", -1)})
    write("empty-optim.bpk", [])
    malformed()


def tiny_lm() -> None:
    """A tiny language model's Adam state and two versions of its model, for the remap guide.

    v1: embed.weight [10, 8], ff.weight [8, 16], ff.bias [16], out.weight [16, 10].
    v2 (a refactor): the vocabulary grows 10 → 12 (embed.weight [12, 8], out.weight [16, 12]),
    ``ff`` moves to ``blocks.0.ff``, and a new head ``aux.weight`` [16, 4] appears.
    """
    rng = np.random.default_rng(7)
    v1 = {"embed.weight": (10, 8), "ff.weight": (8, 16), "ff.bias": (16,), "out.weight": (16, 10)}
    ids = {path: int(rng.integers(1, 2**63)) * 2 + 1 for path in v1}
    state = {}
    for path, shape in v1.items():
        st, theta = {}, rng.normal(0, 0.1, shape).astype(F)
        for _ in range(STEPS):
            theta, st = adam(theta, rng.normal(0, 0.05, shape).astype(F), st, 1e-3)
        st["__rank"] = len(shape)
        state[path] = (theta, st)
    tensors, scalars, meta = [], {}, {}
    for path in v1:
        pid, (_, st) = ids[path], state[path]
        for native, key in (("momentum.moment_1", "moment_1"), ("momentum.moment_2", "moment_2")):
            tensors.append(PackTensor(f"{pid}.{native}", TensorRef.from_array(st[key]), param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", st["__rank"])
        scalars[f"{pid}.momentum.time"] = Scalar("UInt", st["time"])
        meta[str(pid)] = path
    write("lm-optim.bpk", tensors, meta, scalars)
    write("lm-model.bpk", [PackTensor(p, TensorRef.from_array(state[p][0]), param_id=ids[p]) for p in v1])
    v2 = {"embed.weight": (12, 8), "blocks.0.ff.weight": (8, 16), "blocks.0.ff.bias": (16,),
          "out.weight": (16, 12), "aux.weight": (16, 4)}
    ids2 = {path: int(rng.integers(1, 2**63)) * 2 for path in v2}
    write("lm-model-v2.bpk", [PackTensor(p, TensorRef.from_array(rng.normal(0, 0.1, shape).astype(F)),
                                          param_id=ids2[p]) for p, shape in v2.items()])


def malformed() -> None:
    """Broken files, each with one defect, derived from hand-optim.bpk."""
    good = open(os.path.join(OUT, "hand-optim.bpk"), "rb").read()
    n = struct.unpack("<I", good[6:10])[0]
    meta = cbor.decode(good[10 : 10 + n])

    def with_meta(m: dict, body_from=None) -> bytes:
        raw = cbor.encode(m)
        d = -(-(10 + len(raw)) // 256) * 256
        data = good[-(-(10 + n) // 256) * 256 :] if body_from is None else body_from
        return b"NRUB" + struct.pack("<HI", 1, len(raw)) + raw + b"\0" * (d - 10 - len(raw)) + data

    def tweak(fn) -> dict:
        m = cbor.decode(cbor.encode(meta))
        fn(m)
        return m

    first, second = list(meta["tensors"])[:2]  # l1.weight's moment_1 and moment_2, same shape
    cases = {
        "short.bpk": good[:7],
        "bad-magic.bpk": b"BURN" + good[4:],
        "version-2.bpk": good[:4] + struct.pack("<H", 2) + good[6:],
        "metadata-too-large.bpk": good[:6] + struct.pack("<I", 200 * 1024 * 1024) + good[10:],
        "metadata-past-end.bpk": good[:6] + struct.pack("<I", len(good)) + good[10:],
        "invalid-cbor.bpk": good[:10] + b"\xff" * n + good[10 + n :],
        "no-tensors.bpk": with_meta({"metadata": meta["metadata"]}),
        "truncated.bpk": good[:-100],
        "offset-past-end.bpk": with_meta(tweak(lambda m: m["tensors"][first].update(
            data_offsets=[1 << 20, (1 << 20) + 4 * 64]))),
        "misaligned.bpk": with_meta(tweak(lambda m: m["tensors"][first].update(
            data_offsets=[m["tensors"][first]["data_offsets"][0] + 4,
                          m["tensors"][first]["data_offsets"][1] + 4]))),
        "overlap.bpk": with_meta(tweak(lambda m: m["tensors"][second].update(
            data_offsets=m["tensors"][first]["data_offsets"]))),
        "length-mismatch.bpk": with_meta(tweak(lambda m: m["tensors"][first].update(shape=[4, 15]))),
        "huge-tensor.bpk": with_meta(tweak(lambda m: m["tensors"][first].update(
            shape=[1 << 31, 8], data_offsets=[0, 1 << 36]))),
        "deep-cbor.bpk": (lambda raw: b"NRUB" + struct.pack("<HI", 1, len(raw)) + raw)(
            b"\xa1\x67tensors" + b"\x81" * 200 + b"\x00"),
        "unknown-dtype.bpk": with_meta(tweak(lambda m: m["tensors"][first].update(dtype="F8"))),
        "bad-scalar.bpk": with_meta(tweak(lambda m: m["scalars"].update({"1.__rank": {"Str": 1}}))),
    }
    for name, data in cases.items():
        with open(os.path.join(OUT, "malformed", name), "wb") as fh:
            fh.write(data)
    print(f"{len(cases)} malformed files in {os.path.join(OUT, 'malformed')}")


if __name__ == "__main__":
    main()
