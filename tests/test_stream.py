"""The streaming data path: pieces, transforms and concurrent ordering against plain numpy."""

import warnings

import numpy as np
import pytest

from statekit import stream, tensor
from statekit.errors import MappingError
from statekit.formats.burnpack import BurnpackFile, PackTensor, write_burnpack
from statekit.tensor import TensorRef


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 4 KiB and threads for any total, so every boundary and hand-off is exercised."""
    monkeypatch.setattr(tensor, "PIECE", 4096)
    monkeypatch.setattr(stream, "CONCURRENT_MIN", 0)


def values(ref: TensorRef, elements: int) -> np.ndarray:
    pieces = list(ref.pieces(elements))
    assert all(p.size == elements for p in pieces[:-1]) and (not pieces or 0 < pieces[-1].size <= elements)
    return np.concatenate(pieces) if pieces else np.empty(0)


@pytest.fixture
def packed(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal((37, 300)).astype(np.float32),
              "h": rng.standard_normal((5, 7, 9)).astype(np.float16),
              "b": rng.standard_normal(1001).astype(np.float64), "e": np.zeros((0, 4), np.float32)}
    write_burnpack(tmp_path / "a.bpk", [PackTensor(n, TensorRef.from_array(a)) for n, a in arrays.items()])
    with BurnpackFile(tmp_path / "a.bpk") as pack:
        yield arrays, {n: pack.tensor(n) for n in arrays}


@pytest.mark.parametrize("elements", [1, 7, 300, 4096, 1 << 20])
def test_pieces_from_a_file_are_exact(packed, elements):
    arrays, refs = packed
    for name, arr in arrays.items():
        assert np.array_equal(values(refs[name], elements), arr.reshape(-1))


@pytest.mark.parametrize("elements", [1, 13, 37, 299, 300, 301, 5000, 1 << 20])
def test_transpose_resize_cast_match_numpy(packed, elements):
    arrays, refs = packed
    w, ref = arrays["w"], refs["w"]
    assert np.array_equal(values(stream.transpose(ref), elements), w.T.reshape(-1))
    assert np.array_equal(values(stream.transpose(refs["h"]), elements), arrays["h"].T.reshape(-1))
    grown = np.zeros((40, 310), np.float32)
    grown[:37, :300] = w
    assert np.array_equal(values(stream.resize(ref, (40, 310)), elements), grown.reshape(-1))
    assert np.array_equal(values(stream.resize(ref, (20, 100)), elements), w[:20, :100].reshape(-1))
    both = stream.cast(stream.resize(stream.transpose(ref), (301, 30)), "F16")
    expect = np.zeros((301, 30), np.float32)
    expect[:300, :30] = w.T[:, :30]
    assert np.array_equal(values(both, elements), expect.astype(np.float16).reshape(-1))
    assert np.array_equal(stream.transpose(ref).numpy(), w.T)


def test_blocked_transpose_of_a_large_matrix():
    src = np.arange(1000 * 777, dtype=np.float32).reshape(1000, 777)
    out = np.empty((777, 1000), np.float32)
    stream.transpose_into(out, src)
    assert np.array_equal(out, src.T)


@pytest.mark.parametrize("jobs", [1, 2, 3, 8])
def test_a_band_transposed_by_several_threads(jobs):
    src = np.arange(2101 * 999, dtype=np.float32).reshape(2101, 999)  # 8 MiB: shared when jobs > 1
    out = np.empty((999, 2101), np.float32)
    with stream.using_jobs(jobs):
        stream._transpose_shared(out, src)
    assert np.array_equal(out, src.T)


def test_nonfinite_counted_over_the_whole_tensor(small_pieces):
    arr = np.ones(5000, np.float32)
    arr[[3, 4000]] = np.nan
    arr[4999] = np.inf
    ref = stream.checked(TensorRef.from_array(arr), "l1.weight.exp_avg", "x.bpk")
    with pytest.raises(MappingError, match=r"l1.weight.exp_avg: 2 NaN and 1 Inf values"):
        list(ref.iter_bytes())
    assert stream.checked(TensorRef.from_array(np.arange(3)), "i", None).piece_source is None  # ints pass


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_nonfinite_scan_warns_nothing(dtype):
    """inf + -inf (NaN sum) and a finite sum past the range are counted exactly, silently."""
    big = np.finfo(dtype).max
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert stream.nonfinite(np.array([np.inf, -np.inf, 1], dtype)) == (0, 2)
        assert stream.nonfinite(np.array([big, big, -big], dtype)) == (0, 0)
        assert stream.nonfinite(np.array([np.nan, big, big], dtype)) == (1, 0)


@pytest.mark.parametrize("jobs", [1, 2, 5])
def test_ordered_is_the_same_for_any_jobs(small_pieces, packed, jobs):
    arrays, refs = packed
    refs = [refs["w"], stream.transpose(refs["w"]), refs["e"], refs["h"], stream.transpose(refs["b"]),
            stream.checked(refs["b"], "b", None)]  # file spans go through reused buffers
    seen = []
    for ref, piece_stream in stream.ordered(refs, jobs=jobs, crc=True):
        data = b"".join(bytes(p) for p in piece_stream)
        import zlib

        assert piece_stream.crc == zlib.crc32(data) and piece_stream.nbytes == len(data) == ref.nbytes
        seen.append(data)
    expect = [arrays["w"].tobytes(), arrays["w"].T.tobytes(), b"", arrays["h"].tobytes(),
              arrays["b"].tobytes(), arrays["b"].tobytes()]
    assert seen == expect


def test_ordered_raises_the_first_failure_in_order(small_pieces):
    good = TensorRef.from_array(np.ones(3000, np.float32))
    bad1 = stream.checked(TensorRef.from_array(np.full(3000, np.nan, np.float32)), "first", None)
    bad2 = stream.checked(TensorRef.from_array(np.full(10, np.inf, np.float32)), "second", None)
    with pytest.raises(MappingError, match="first"):
        for _, piece_stream in stream.ordered([good, bad1, bad2, good], jobs=3):
            list(piece_stream)


@pytest.mark.parametrize("fast", [True, False])
def test_crc_with_and_without_isal(monkeypatch, fast):
    import zlib

    data = np.random.default_rng(1).bytes(100_003)
    if not fast:
        monkeypatch.setattr(stream, "_CRC32", zlib.crc32)
    crc = stream.crc32_function()
    assert crc(data[50:], crc(data[:50])) == zlib.crc32(data) == crc(data)


@pytest.mark.parametrize("n", [0, 1, 5 << 10, (2 << 20) - 1, (2 << 20) + 3, (8 << 20) + 12_345])
def test_crc_in_parts_on_threads_is_zlibs(monkeypatch, n):
    """Without isal, large buffers are CRC'd in parts on threads and combined: zlib's values
    (references: zlib.crc32 of the whole, from several start values, bytes and memoryviews)."""
    import zlib

    monkeypatch.setattr(stream, "default_jobs", lambda: 4)
    data = np.random.default_rng(n).bytes(n)
    for start in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        want = zlib.crc32(data, start)
        assert stream.crc32_threads(data, start) == want
        assert stream.crc32_threads(memoryview(data), start) == want
        assert stream.crc32_threads(np.frombuffer(data, np.uint8).data, start) == want


def test_crc32_combine_is_zlibs():
    import zlib

    rng = np.random.default_rng(7)
    for _ in range(200):
        a, b = rng.bytes(int(rng.integers(0, 300))), rng.bytes(int(rng.integers(0, 300)))
        assert stream.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = bytes(3 << 20)  # a length with many bits set
    assert stream.crc32_combine(zlib.crc32(b"x"), zlib.crc32(big), len(big)) == zlib.crc32(b"x" + big)


def test_diff_skips_equal_bytes_and_finds_every_difference(tmp_path, monkeypatch):
    """diff reads both files in pieces and computes only where bytes differ: the same facts
    whatever the piece size, and exactly the elements changed here."""
    from statekit.ops.diff import compare_refs

    a = np.random.default_rng(3).standard_normal(300_000).astype(np.float32)
    b = a.copy()
    b[5] += 1.0
    b[70_000] = np.nextafter(b[70_000], np.float32(np.inf))
    b[299_999] = np.nan
    b[150_000] = -a[150_000] if a[150_000] else 1.0  # the largest change
    for name, arr in (("a", a), ("b", b)):
        write_burnpack(tmp_path / f"{name}.bpk", [PackTensor("t", TensorRef.from_array(arr))])
    with BurnpackFile(tmp_path / "a.bpk") as pa, BurnpackFile(tmp_path / "b.bpk") as pb:
        whole = compare_refs(pa.tensor("t"), pb.tensor("t"))
        monkeypatch.setattr(tensor, "PIECE", 8192)
        small = compare_refs(pa.tensor("t"), pb.tensor("t"), block=512)
        same = compare_refs(pa.tensor("t"), pa.tensor("t"))
    assert whole == small
    assert whole["differing"] == 4 and whole["nan_mismatch"] == 1 and whole["max_ulp"] >= 1
    assert whole["worst"]["index"] == [150_000] and whole["max_abs"] == pytest.approx(2 * abs(float(a[150_000])))
    assert same["equal"] and same["differing"] == 0 and same["max_abs"] == 0.0 and same["worst"] is None
