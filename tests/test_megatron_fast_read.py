"""The Megatron read path at speed (issue 35's bench goal), checked against real torch and the
real megatron-core fixtures:

- the master-vs-weight proof works on raw bits: its bf16 fast path agrees with torch 2.13's own
  fp32 → bf16 rounding bit for bit, on weights read as file bytes, across pieces, and refuses
  what the exact rule refuses (NaN masters whose bits would carry into an inf or a signed zero);
- opening a real checkpoint (torch_dist bucket space and model space, legacy TP·PP, MoE) and
  proving every master imports no ml_dtypes (its import costs a second);
- boxes of torch_dist tensors are streamed in bounded pieces that reassemble to torch's own
  ``dcp.load`` of the same keys;
- proofs on several threads name the same first failing parameter as one thread does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from statekit import io
from statekit.errors import FormatError
from statekit.frameworks.megatron import proof
from statekit.stream import using_jobs
from statekit.tensor import FileSpan, SourceFile, TensorRef
from tests.conftest import ROOT

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

REAL = ROOT / "fixtures" / "megatron" / "0.19.2"
TWO_BUCKETS = ROOT / "fixtures" / "megatron" / "0.19.2" / "gpt_torch_dist_fully_reshardable_2buckets_tp1pp1dp2"
PIECE = proof.PIECE_ELEMENTS


def _file_ref(tmp_path, name: str, data: bytes, dtype: str, n: int) -> TensorRef:
    """A tensor read from a file span (as every checkpoint reader hands them out)."""
    path = tmp_path / name
    path.write_bytes(b"\0" * 7 + data)  # (an odd offset: nothing aligned by luck)
    src = SourceFile.open(str(path))
    return TensorRef(dtype, (n,), span=FileSpan.at(src, 7, len(data)))


def _torch_bf16_bits(values: np.ndarray) -> bytes:
    return torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def _masters() -> np.ndarray:
    """Three pieces and a bit of fp32 values: normals, every exponent with a tie (bit 15 set, the
    rest clear), subnormals, infinities, zeros of both signs."""
    rng = np.random.default_rng(35)
    ties = (np.arange(1 << 16, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    ties = ties[~np.isnan(ties)]
    parts = [rng.standard_normal(PIECE).astype(np.float32), ties,
             (rng.standard_normal(PIECE) * 1e-39).astype(np.float32),
             np.array([np.inf, -np.inf, 0.0, -0.0, 3.4e38, -3.4e38], np.float32),
             rng.standard_normal(PIECE + 12345).astype(np.float32) * 1e4]
    return np.concatenate(parts)


def test_bf16_proof_on_file_bits_agrees_with_torch_rounding(tmp_path):
    master = _masters()
    n = master.size
    m_ref = _file_ref(tmp_path, "m", master.tobytes(), "F32", n)
    w = _torch_bf16_bits(master)
    assert proof.prove("p", m_ref, _file_ref(tmp_path, "w", w, "BF16", n), "rule R") == n
    # one bit off, in the third piece: refused at that element, as the exact rule words it
    at = 2 * PIECE + 5
    bad = bytearray(w)
    bad[2 * at] ^= 1
    with pytest.raises(proof.ProofError, match=rf"^parameter p: its fp32 master rounded to BF16 is not the stored "
                                               rf"weight at element {at} of {n} \(.*\): rule R does not hold"):
        proof.prove("p", m_ref, _file_ref(tmp_path, "bad", bytes(bad), "BF16", n), "rule R")
    # the same values as an fp16 weight (numpy's rounding: torch's, checked below) and as fp32
    f16 = torch.from_numpy(master.copy()).to(torch.float16).numpy()
    assert proof.prove("p", m_ref, _file_ref(tmp_path, "h", f16.tobytes(), "F16", n), "r") == n
    assert proof.prove("p", m_ref, _file_ref(tmp_path, "f", master.tobytes(), "F32", n), "r") == n


@pytest.mark.parametrize("nan_bits,weight_bits,proves", [
    (0x7FFFFFFF, 0x8000, False),  # the plain integer rounding would carry it into -0.0
    (0x7F800001, 0x7F80, False),  # ... and this one into +inf
    (0xFFFFFFFF, 0x0000, False),  # ... and a negative NaN into +0.0
    (0x7FC00000, None, True),  # torch's own rounding of the NaN: a NaN
    (0x7F800001, 0x7FC1, True),  # another NaN's bits: NaN == NaN for the proof
])
def test_nan_master_never_proves_a_number(tmp_path, nan_bits, weight_bits, proves):
    master = np.random.default_rng(1).standard_normal(PIECE + 100).astype(np.float32)
    at = PIECE + 3
    master.view(np.uint32)[at] = nan_bits
    weight = np.frombuffer(_torch_bf16_bits(master), np.uint16).copy()
    assert (int(weight[at]) & 0x7FFF) > 0x7F80  # torch keeps a NaN a NaN
    if weight_bits is not None:
        weight[at] = weight_bits
    m = _file_ref(tmp_path, "m", master.tobytes(), "F32", master.size)
    w = _file_ref(tmp_path, "w", weight.tobytes(), "BF16", master.size)
    if proves:
        assert proof.prove("p", m, w, "r") == master.size
    else:
        with pytest.raises(proof.ProofError, match=rf"at element {at} of {master.size}"):
            proof.prove("p", m, w, "r")


_NO_ML_DTYPES = """
import json, sys
from statekit import io
with io.open_checkpoint(sys.argv[1]) as ckpt:
    notes = [n for n in ckpt.optimizer.notes if n.startswith("proved")]
print(json.dumps({"ml_dtypes": "ml_dtypes" in sys.modules, "notes": notes}))
"""


@pytest.mark.parametrize("case", ["gpt_torch_dist_dp_reshardable_tp1pp1dp2", "gpt_torch_dist_fully_reshardable_tp2pp1dp2",
                                  "gpt_torch_distopt_tp2pp2dp1", "moe_torch_dist_dp_reshardable_ep2dp2",
                                  "moe_torch_distopt_ep2dp2"])
def test_opening_and_proving_imports_no_ml_dtypes(case):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _NO_ML_DTYPES, str(REAL / case)], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    got = json.loads(out.stdout)
    assert got["notes"] and "did not prove" not in got["notes"][0]
    assert got["ml_dtypes"] is False, case


def _torch_load(folder, keys) -> dict:
    import torch.distributed.checkpoint as tdcp

    meta = tdcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    tdcp.load(out, checkpoint_id=str(folder), no_dist=True)
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", ["gpt_torch_dist_fully_reshardable_tp2pp1dp2",
                                  "gpt_torch_dist_dp_reshardable_tp1pp1dp2"])
def test_boxes_stream_in_bounded_pieces_equal_to_torch_load(case):
    """Every parameter's master, moments and weight, read in pieces of 4 KiB (so that spans, runs
    of several chunks and slabs all cut), reassemble to torch's own load of the stored tensors;
    no piece is larger than asked."""
    from statekit.frameworks.megatron import regions

    folder = REAL / case
    it = next(folder.glob("iter_*"))
    with io.open_checkpoint(folder) as ckpt:
        dist = ckpt.container.dist
        entries = dist.tensor_entries()
        full = _torch_load(it, list(entries))
        seen, kinds = 0, set()
        for key, entry in entries.items():
            # every row block a layer and a TP shard can be cut to: the whole tensor, one layer, rows
            lead = entry.shape[:1] if key.startswith(("decoder.layers.", "optimizer.state.")) and len(
                entry.shape) > 2 else ()
            for i in range(lead[0] if lead else 1):
                boxes = [((i, i + 1), *((0, d) for d in entry.shape[1:]))] if lead else [tuple((0, d) for d in entry.shape)]
                if entry.shape:  # a band of the last axis too: cut across chunks (DP ranges, TP shards)
                    b = list(boxes[0])
                    lo, hi = b[-1]
                    b[-1] = (lo + (hi - lo) // 3, hi - (hi - lo) // 5)
                    boxes.append(tuple(b))
                for box in boxes:
                    shape = tuple(b - a for a, b in box)
                    ref = regions.boxed(dist.reader, entry, box, shape, {})
                    runs = regions._runs(dist.reader, entry, box)
                    kinds.add("slabs" if runs is None else "one span" if len(runs) == 1 else "spans")
                    parts = list(ref.iter_bytes(4096))
                    assert all(len(p) <= 4096 for p in parts)
                    want = full[key][tuple(slice(a, b) for a, b in box)].contiguous()
                    want = want.view(torch.int16 if want.element_size() == 2 else torch.int32).numpy().tobytes()
                    assert b"".join(bytes(p) for p in parts) == want, (key, box)
                    seen += 1
        assert seen >= 32 and kinds >= {"one span", "spans"}
        if "tp2" in case:
            assert "slabs" in kinds


def test_parallel_proofs_refuse_the_same_first_parameter():
    """The 2-bucket fully_reshardable save of 0.19.2 (states shifted after bucket 0): the refusal
    names the first parameter in named_parameters order, whatever the thread count."""
    messages = []
    for jobs in (1, 4):
        with using_jobs(jobs), pytest.raises(FormatError) as exc:
            io.open_checkpoint(TWO_BUCKETS)
        messages.append(str(exc.value))
    assert messages[0] == messages[1]
    assert "parameter embedding.word_embeddings.weight:" in messages[0]


# ------------------------------------------------- bucket space beyond TP = PP = 1 (mcore 0.19.2's own saves)

LAYER = ("input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
         "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
NAMES = (["embedding.word_embeddings.weight"] + [f"decoder.layers.{i}.{n}" for i in range(2) for n in LAYER]
         + ["decoder.final_layernorm.weight", "output_layer.weight"])
AXIS = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0, "self_attention.linear_qkv.weight": 0,
        "mlp.linear_fc1.weight": 0, "self_attention.linear_proj.weight": 1, "mlp.linear_fc2.weight": 1}


def _axis(name: str):
    return AXIS.get(name) if name in AXIS else AXIS.get(name.split(".", 3)[-1])


def _stage(name: str, pp: int) -> int:
    """Megatron's uniform split of the fixtures' 2 layers: the embedding and layer 0 on stage 0 of
    PP2, layer 1, the final norm and the output layer on stage 1."""
    if pp == 1 or name.startswith("embedding.") or name.startswith("decoder.layers.0."):
        return 0
    return 1


def _hand_cut(folder, tp: int, pp: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's states, from torch's own dcp.load of each model-parallel rank's bucket
    tensors (rank = pp_rank × TP + tp_rank), cut by hand: each stage's parameters reversed, every
    size a multiple of 64 (so no gaps), the TP-local shapes joined on each parameter's TP axis
    (SwiGLU fc1: the ranks' W halves first, then their V halves), replicated ones TP rank 0's."""
    import torch.distributed.checkpoint as tdcp

    it = next(folder.glob("iter_*"))
    meta = tdcp.FileSystemReader(str(it)).read_metadata().state_dict_metadata
    shapes = {n: tuple(meta[_model_key(n)].size)[1:] if "layers." in n else tuple(meta[_model_key(n)].size)
              for n in NAMES}
    local = {}
    for n in NAMES:
        s, a = list(shapes[n]), _axis(n)
        if a is not None:
            s[a] //= tp
        local[n] = tuple(s)
    per_rank = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            mp = pp_rank * tp + tp_rank
            prefix = f"optimizer.distributed.dp_group_idx_{mp}.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0."
            flat = {s: torch.empty(tuple(meta[prefix + s].size), dtype=torch.float32) for s in ("param", "exp_avg", "exp_avg_sq")}
            tdcp.load({prefix + s: t for s, t in flat.items()}, checkpoint_id=str(it), no_dist=True)
            at = 0
            for n in reversed([n for n in NAMES if _stage(n, pp) == pp_rank]):
                size = int(np.prod(local[n]))
                assert size % 64 == 0
                per_rank[n, tp_rank] = {s: t[at:at + size].reshape(local[n]) for s, t in flat.items()}
                at += size
            assert at == flat["param"].numel()
    out = {}
    for n in NAMES:
        a = _axis(n)
        parts = [per_rank[n, t] for t in range(tp)]
        if tp == 1 or a is None:
            out[n] = parts[0]
        elif n.endswith("linear_fc1.weight"):
            out[n] = {s: torch.cat([p[s].chunk(2)[0] for p in parts] + [p[s].chunk(2)[1] for p in parts])
                      for s in parts[0]}
        else:
            out[n] = {s: torch.cat([p[s] for p in parts], dim=a) for s in parts[0]}
    return out


def _model_key(name: str) -> str:
    """The torch_dist key a parameter's weight is saved under (stacked layers; the local spec's
    norms under TE's fused names)."""
    if not name.startswith("decoder.layers."):
        return name
    rest = name.split(".", 3)[3]
    rest = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}.get(rest, rest)
    return f"decoder.layers.{rest}"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case,tp,pp", [("gpt_torch_dist_dp_reshardable_tp2pp1dp2", 2, 1),
                                        ("gpt_torch_dist_dp_reshardable_tp1pp2dp2", 1, 2)])
def test_real_dp_reshardable_tp_pp_cut_and_joined_by_hand(case, tp, pp):
    folder = REAL / case
    want = _hand_cut(folder, tp, pp)
    with io.open_checkpoint(folder) as ckpt:
        assert ckpt.metadata["megatron.sharding"] == "dp_reshardable"
        state = ckpt.optimizer
        assert [p.path for p in state.params] == NAMES
        assert any(n.startswith(f"proved: {len(NAMES)} of {len(NAMES)} parameters") for n in state.notes)
        for p in state.params:
            for slot, stored in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("fp32_master", "param")):
                assert np.array_equal(p.slots[slot].numpy(), want[p.path][stored].numpy()), (p.path, slot)
            assert p.step == 3


def test_real_dp_reshardable_tp2_wrong_rank_order_is_refused(monkeypatch):
    """TP ranks taken in the wrong order (PP fastest instead of TP) join the shards wrongly: refused
    by the proof, naming the first parameter and the rule."""
    from statekit.frameworks.megatron import bucket_space

    real = bucket_space._tp_joined
    monkeypatch.setattr(bucket_space, "_tp_joined", lambda reader, parts, *a: real(reader, parts[::-1], *a))
    with pytest.raises(FormatError, match=r"parameter embedding\.word_embeddings\.weight: its fp32 master rounded to "
                                          r"BF16 is not the stored weight .*\(dp_reshardable\) does not hold"):
        io.open_checkpoint(REAL / "gpt_torch_dist_dp_reshardable_tp2pp1dp2")
