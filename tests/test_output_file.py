"""Atomic outputs through staging blocks (statekit.atomic.OutputFile): every byte lands where it
was written, with direct I/O or without, and a failure anywhere leaves no file and no thread."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from statekit import atomic, stream

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 8192


@pytest.fixture
def small_blocks(monkeypatch):
    """Staging blocks of 8 KiB: every output of a few KiB crosses blocks and goes to the disk in
    full blocks plus a tail, as a large file does with 8 MiB blocks."""
    monkeypatch.setattr(atomic, "BLOCK", BLOCK)


def threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "statekit-output"]


def leftovers(dst: Path) -> list[str]:
    return [p.name for p in dst.parent.iterdir() if p.name.endswith(".tmp")]


def write_in_pieces(fh, data: bytes, sizes) -> None:
    """``data`` through ``write`` and through ``staging``/``commit``, alternating, in pieces of ``sizes``."""
    pos, k = 0, 0
    while pos < len(data):
        n = min(sizes[k % len(sizes)], len(data) - pos)
        if k % 2:
            assert fh.write(memoryview(data)[pos : pos + n]) == n
        else:
            view = fh.staging(n)
            assert 1 <= len(view) <= n
            view[:] = data[pos : pos + len(view)]
            fh.commit(len(view))
            n = len(view)
        pos += n
        k += 1
        assert fh.tell() == pos


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("total", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 10 * BLOCK + 4097, 37 * BLOCK])
def test_every_byte_lands_where_it_was_written(tmp_path, monkeypatch, small_blocks, direct, total):
    monkeypatch.setenv("STATEKIT_DIRECT_IO", direct)
    data = np.random.default_rng(total).bytes(total)
    dst = tmp_path / "out.bin"
    with atomic.atomic_write(dst) as fh:
        write_in_pieces(fh, data, [1, 4095, 3 * BLOCK + 5, 17, BLOCK])
    assert dst.read_bytes() == data
    assert leftovers(dst) == [] and threads() == []


def test_numpy_pieces_of_any_dtype_are_written_as_their_bytes(tmp_path, small_blocks):
    arr = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    with atomic.atomic_write(tmp_path / "a") as fh:
        fh.write(memoryview(arr))  # format "f", two dimensions
        fh.write(arr[:, :3].copy())
    assert (tmp_path / "a").read_bytes() == arr.tobytes() + arr[:, :3].tobytes()


def test_a_file_system_that_refuses_direct_io_gets_the_same_bytes(tmp_path, monkeypatch, small_blocks):
    """O_DIRECT accepted when set but refused at the first write (EINVAL): the block is written
    again through the page cache, and so is every later one."""
    real = os.pwritev
    refused = []

    def pwritev(fd, buffers, offset):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(atomic.os, "pwritev", pwritev)
    data = np.random.default_rng(5).bytes(20 * BLOCK + 123)
    with atomic.atomic_write(tmp_path / "out") as fh:
        fh.write(data)
    assert (tmp_path / "out").read_bytes() == data
    assert refused == [0]


@pytest.mark.parametrize("direct", ["1", "0"])
def test_short_and_batched_writes_land_where_they_belong(tmp_path, monkeypatch, small_blocks, direct):
    """The writer thread writes the blocks waiting for it with one pwritev, and goes on where a
    short write stopped (mid-block, at any byte)."""
    monkeypatch.setenv("STATEKIT_DIRECT_IO", direct)
    real = os.pwritev
    sizes = []

    def pwritev(fd, buffers, offset):
        sizes.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset) if len(sizes) % 3 else real(fd, [bytes(buffers[0])[:4097]], offset)

    monkeypatch.setattr(atomic.os, "pwritev", pwritev)
    data = np.random.default_rng(9).bytes(50 * BLOCK + 17)
    with atomic.atomic_write(tmp_path / "out") as fh:
        fh.write(data)  # faster than any disk: blocks queue up, and are written together
    assert (tmp_path / "out").read_bytes() == data
    assert max(sizes) > BLOCK


def test_a_failure_mid_file_leaves_no_file_and_no_thread(tmp_path, small_blocks):
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="producer"), atomic.atomic_write(dst) as fh:
        fh.write(b"x" * (12 * BLOCK))
        raise RuntimeError("producer failed")
    assert dst.read_bytes() == b"old" and leftovers(dst) == [] and threads() == []


def test_a_failed_disk_write_reaches_the_writer(tmp_path, monkeypatch, small_blocks):
    real = os.pwritev

    def pwritev(fd, buffers, offset):
        if offset >= 3 * BLOCK:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers, offset)

    monkeypatch.setattr(atomic.os, "pwritev", pwritev)
    dst = tmp_path / "out.bpk"
    with pytest.raises(OSError, match="No space left"), atomic.atomic_write(dst) as fh:
        for _ in range(100):
            fh.write(b"y" * BLOCK)
    assert not dst.exists() and leftovers(dst) == [] and threads() == []


@pytest.mark.parametrize("drop_cache", ["0", "1"])
def test_spans_are_read_straight_into_the_output(tmp_path, small_blocks, monkeypatch, drop_cache):
    """A file span goes through staging (PieceStream.write_to), a computed tensor through
    write(): the same bytes and CRC as iterating, elements across block edges included, and a
    NaN is still refused after the tensor's last byte — with no output file."""
    import zlib

    from statekit.errors import MappingError
    from statekit.formats.burnpack import BurnpackFile, PackTensor, write_burnpack
    from statekit.tensor import TensorRef

    monkeypatch.setattr(stream, "CONCURRENT_MIN", 0)
    monkeypatch.setenv("STATEKIT_DROP_CACHE", drop_cache)  # pieces dropped from the page cache once read
    rng = np.random.default_rng(2)
    arrays = {"a": rng.standard_normal(3001).astype(np.float64), "b": rng.standard_normal((33, 70)).astype(np.float32),
              "c": rng.standard_normal(5).astype(np.float16)}
    bad = np.ones(4000, np.float32)
    bad[3999] = np.inf
    write_burnpack(tmp_path / "in.bpk", [PackTensor(n, TensorRef.from_array(a)) for n, a in
                                         {**arrays, "bad": bad}.items()], unaligned=True)
    with BurnpackFile(tmp_path / "in.bpk") as pack:
        for jobs in (1, 3):
            refs = [stream.checked(pack.tensor("a"), "a", None), pack.tensor("b"), stream.transpose(pack.tensor("b")),
                    stream.checked(pack.tensor("c"), "c", None)]
            expect = [arrays["a"].tobytes(), arrays["b"].tobytes(), arrays["b"].T.tobytes(), arrays["c"].tobytes()]
            dst = tmp_path / f"out{jobs}"
            crcs = []
            with atomic.atomic_write(dst) as fh:
                fh.write(b"123")  # nothing below is aligned to its element size in the file
                for _ref, piece_stream in stream.ordered(refs, jobs=jobs, crc=True, out=fh):
                    piece_stream.write_to(fh)
                    crcs.append((piece_stream.crc, piece_stream.nbytes))
            assert dst.read_bytes() == b"123" + b"".join(expect)
            assert crcs == [(zlib.crc32(e), len(e)) for e in expect]
            with pytest.raises(MappingError, match="bad: 0 NaN and 1 Inf"), atomic.atomic_write(tmp_path / "x") as fh:
                for _ref, piece_stream in stream.ordered([pack.tensor("b"), stream.checked(pack.tensor("bad"), "bad", None)],
                                                         jobs=jobs, out=fh):
                    piece_stream.write_to(fh)
            assert not (tmp_path / "x").exists() and leftovers(tmp_path / "x") == []


@pytest.mark.slow
def test_every_fixture_output_is_unchanged_through_small_blocks(tmp_path, small_blocks):
    """The output table of test_output_hashes with 8 KiB staging blocks: every output of more
    than one block goes through direct writes and block edges."""
    spec = importlib.util.spec_from_file_location("capture", ROOT / "scripts/capture_output_hashes.py")
    capture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capture)
    table = json.loads((ROOT / "tests/data/output-sha256.json").read_text())
    wrong = [name for name, item in table.items() if capture.run_case(item["case"], str(tmp_path)) != item["sha256"]]
    assert wrong == []


def test_a_span_past_the_end_of_its_file_is_not_mapped_but_refused(tmp_path):
    """A transpose maps its source; a span the file does not hold is read instead, and that
    read refuses it with the file's name (never a SIGBUS from the map)."""
    from statekit.errors import FormatError
    from statekit.tensor import FileSpan, SourceFile, TensorRef

    (tmp_path / "short.bin").write_bytes(b"\0" * 1000)
    src = SourceFile.open(str(tmp_path / "short.bin"))
    try:
        with src.mapped(0, 1000) as view:
            assert view is not None and bytes(view) == b"\0" * 1000
            del view
        with src.mapped(8, 4000) as view:
            assert view is None
        ref = TensorRef(dtype="F32", shape=(10, 100), span=FileSpan(src, 8, 4000))
        with pytest.raises(FormatError, match="file ended"), atomic.atomic_write(tmp_path / "out") as fh:
            for _, piece_stream in stream.ordered([stream.transpose(ref)], out=fh):
                piece_stream.write_to(fh)
        assert not (tmp_path / "out").exists()
    finally:
        src.close()
