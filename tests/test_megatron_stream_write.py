"""The Megatron write paths hold no whole tensor (issue 35's flat-memory goal), checked against
torch's own load of the real megatron-core fixtures and against numpy slicing written here:

- a DCP tensor whose chunks are each one C-order run (the SwiGLU fc1 weight: two halves per
  layer) is streamed in order, never assembled whole, and its bytes are torch's ``dcp.load``;
- the legacy reshard's TP shard of a tensor with its vocabulary rows padded or cut
  (``write_legacy._shard_ref``) is the numpy slice of the padded tensor, in pieces of any size;
- ``stream.same_bytes`` compares two tensors cut into pieces at different places.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from statekit.formats import dcp, megatron_dist
from statekit.frameworks.megatron import write_legacy
from statekit.stream import same_bytes
from statekit.tensor import TensorRef
from tests.conftest import ROOT

REAL = ROOT / "fixtures" / "megatron" / "0.19.2"


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fc1_halves_stream_in_order_equal_to_torch_load():
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as tdcp

    folder = next((REAL / "gpt_torch_dist_dp_reshardable_tp1pp1dp2").glob("iter_*"))
    reader = dcp.DcpReader(folder, megatron_dist.MEGATRON_GLOBALS)
    key = "decoder.layers.mlp.linear_fc1.weight"
    entry = reader.meta.entries[key]
    assert len(entry.chunks) == 2 * entry.shape[0]  # (what megatron-core wrote: a layer's two halves)
    ref = reader.tensor(entry)
    assert ref.array_loader is None and ref.chunk_reader is not None
    meta = tdcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    out = {key: torch.empty(tuple(meta[key].size), dtype=meta[key].properties.dtype)}
    tdcp.load(out, checkpoint_id=str(folder), no_dist=True)
    want = out[key].view(torch.int16).numpy().tobytes()
    parts = list(ref.iter_bytes(1000))
    assert max(len(p) for p in parts) <= 1000
    assert b"".join(bytes(p) for p in parts) == want


def _expected(a: np.ndarray, rows: int, tp: int, rank: int, axis: int | None, swiglu: bool) -> np.ndarray:
    """The shard by plain numpy: rows padded with zeros or cut, then the rank's equal part."""
    if rows > a.shape[0]:
        a = np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])
    a = a[:rows]
    if axis is None or tp == 1:
        return a
    if swiglu:
        w, v = np.split(a, 2, axis=0)
        return np.concatenate([np.split(w, tp, axis=0)[rank], np.split(v, tp, axis=0)[rank]])
    return np.split(a, tp, axis=axis)[rank]


@pytest.mark.parametrize("shape,axis,swiglu", [((24, 8), 0, False), ((8, 24), 1, False), ((32, 8), 0, True),
                                               ((4, 6, 8), 2, False), ((16,), 0, False), ((16,), None, False)])
def test_legacy_shards_streamed_equal_numpy_slices(shape, axis, swiglu):
    rng = np.random.default_rng(1)
    a = rng.integers(1, 2**31, size=shape, dtype=np.int64).astype(np.uint32).view(np.float32)
    for tp, rows, piece in itertools.product((1, 2, 4), (shape[0], shape[0] + 8, shape[0] // 2), (4, 20, 1 << 20)):
        if swiglu and rows % (2 * tp) or axis is not None and tp > 1 and (rows, *shape[1:])[axis] % tp:
            continue
        for rank in range(tp):
            want = _expected(a, rows, tp, rank, axis, swiglu)
            ref = write_legacy._shard_ref(TensorRef.from_array(a), rows, "p", tp if axis is not None else 1, rank,
                                          axis, swiglu, want.shape)
            parts = list(ref.iter_bytes(piece))
            assert all(len(p) <= max(piece, 4) for p in parts)
            assert b"".join(bytes(p) for p in parts) == np.ascontiguousarray(want).tobytes(), (tp, rows, rank)


def test_same_bytes_across_differently_cut_pieces():
    a = np.arange(10_000, dtype=np.float32)
    whole = TensorRef.from_array(a)

    def cut(sizes):
        def pieces(_size):
            data, at = a.tobytes(), 0
            for n in itertools.cycle(sizes):
                if at >= len(data):
                    return
                yield data[at:at + n]
                at += n
        return TensorRef("F32", a.shape, chunk_reader=pieces)

    assert same_bytes(whole, cut([7, 1000, 13]), piece=999)
    b = a.copy()
    b[-1] = -1
    assert not same_bytes(whole, TensorRef.from_array(b))
    assert not same_bytes(whole, TensorRef.from_array(a.reshape(100, 100)))
    assert not same_bytes(whole, TensorRef.from_array(a.astype(np.float64)))
