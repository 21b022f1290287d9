"""Tensors whose bytes are file spans back to back (``TensorRef.runs``) are written straight from
the files: the bytes must be exactly what numpy's own slicing of the same values gives, with the
direct path and with the worker pieces alike (expected values computed by numpy, never by statekit)."""

import zlib

import numpy as np
import pytest

from statekit import stream, tensor
from statekit.atomic import atomic_write
from statekit.frameworks.megatron import write_buckets
from statekit.structure.apply import _file_runs, assembled
from statekit.structure.pieces import Piece, TargetMap
from statekit.tensor import FileSpan, SourceFile, TensorRef


@pytest.fixture
def source(tmp_path):
    """A (96, 64) float32 matrix at offset 100 of a file, as a plain span."""
    values = np.arange(96 * 64, dtype=np.float32).reshape(96, 64) * 0.5 - 7
    path = tmp_path / "src.bin"
    path.write_bytes(b"\x01" * 100 + values.tobytes() + b"\x02" * 50)
    fh = open(path, "rb")
    sf = SourceFile(fh, str(path))
    ref = TensorRef("F32", (96, 64), span=FileSpan.at(sf, 100, values.nbytes))
    yield values, ref
    fh.close()


def _written(tmp_path, refs, jobs):
    out = tmp_path / "out.bin"
    with stream.using_jobs(jobs), atomic_write(out) as fh:
        crcs = []
        for _, s in stream.ordered(refs, crc=True, out=fh):
            s.write_to(fh)
            crcs.append(s.crc)
    return out.read_bytes(), crcs


def _rows_piece(src_row: int, dst_row: int, rows: int, cols: int) -> Piece:
    return Piece("w", (rows, cols), src_row * cols, (cols, 1), dst_row * cols, (cols, 1))


@pytest.mark.parametrize("jobs", [1, 2])
def test_row_blocks_of_a_fused_matrix_are_read_from_the_file(tmp_path, source, jobs):
    values, ref = source
    # q/k/v per query group: target rows from every third block of 8 rows (interleaved), as megatron_hf maps
    pieces = [_rows_piece(g * 24, g * 8, 8, 64) for g in range(4)]
    t = TargetMap("q", (32, 64), pieces)
    got = assembled(t, {"w": ref}, "F32")
    want = np.concatenate([values[g * 24:g * 24 + 8] for g in range(4)])
    assert _file_runs(t, {"w": ref}, 4) is not None
    data, crcs = _written(tmp_path, [got], jobs)
    assert data == want.tobytes()
    assert crcs == [zlib.crc32(want.tobytes())]
    assert b"".join(bytes(p) for p in got.iter_bytes(1000)) == want.tobytes()  # the pieces agree


def test_a_transposing_map_is_not_read_as_runs(tmp_path, source):
    values, ref = source
    t = TargetMap("t", (64, 96), [Piece("w", (64, 96), 0, (1, 64), 0, (96, 1))])
    runs = _file_runs(t, {"w": ref}, 4)  # one element each: left to the pieces
    assert runs is not None and not tensor.worth_runs(runs)
    data, _ = _written(tmp_path, [assembled(t, {"w": ref}, "F32")], 1)
    assert data == values.T.tobytes()


def test_a_map_with_new_elements_or_a_cast_has_no_runs(source):
    _, ref = source
    grown = TargetMap("g", (97, 64), [_rows_piece(0, 0, 96, 64)], new=64)
    assert assembled(grown, {"w": ref}, "F32").runs is None
    assert assembled(TargetMap("c", (96, 64), [_rows_piece(0, 0, 96, 64)]), {"w": ref}, "F16").runs is None


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_bucket_with_gaps_is_the_parts_and_zeros(tmp_path, source, jobs, monkeypatch):
    monkeypatch.setattr(tensor, "MIN_RUN", 1)  # (small runs here: still read one by one)
    values, ref = source
    part_a = TensorRef("F32", (10, 64), chunk_reader=lambda n: iter([]),
                       runs=lambda: [FileSpan.at(ref.span.file, 100 + 5 * 256, 10 * 256)])
    parts = [(3, part_a), (3 + 640 + 7, ref)]
    numel = 3 + 640 + 7 + values.size + 11
    b = write_buckets.bucket(parts, numel, "bucket")
    runs = tensor.file_runs(b)
    assert runs is not None and tensor.worth_runs(runs)
    want = np.concatenate([np.zeros(3, np.float32), values[5:15].reshape(-1), np.zeros(7, np.float32),
                           values.reshape(-1), np.zeros(11, np.float32)])
    data, _ = _written(tmp_path, [b], jobs)
    assert data == want.tobytes()


def test_runs_that_do_not_add_up_are_not_used(source):
    _, ref = source
    short = TensorRef("F32", (96, 64), chunk_reader=lambda n: iter([]), runs=lambda: [FileSpan.at(ref.span.file, 100, 8)])
    assert tensor.file_runs(short) is None


def test_cut_and_extend_join_neighbours(source):
    _, ref = source
    f = ref.span.file
    runs = tensor.extend_runs([], [FileSpan.at(f, 0, 10), FileSpan.at(f, 10, 5), 4, 6, FileSpan.at(f, 40, 8)])
    assert [(r.offset, r.length) if isinstance(r, FileSpan) else r for r in runs] == [(0, 15), 10, (40, 8)]
    out: list = []
    assert tensor.cut_runs(runs, 12, 20, out)
    assert [(r.offset, r.length) if isinstance(r, FileSpan) else r for r in out] == [(12, 3), 10, (40, 7)]
    assert not tensor.cut_runs(runs, 30, 10, [])
