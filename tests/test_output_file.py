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


@pytest.fixture(autouse=True)
def cache_judged_fast(monkeypatch):
    """No copy into the page cache counts as slow (tiny test blocks cost more CPU per byte than
    8 MiB ones), and no earlier test's verdict carries over; the tests of the switch set their own."""
    monkeypatch.setattr(atomic, "SLOW_CACHE_RATE", 1)
    monkeypatch.setattr(atomic, "_CACHE_SLOW", False)


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
    monkeypatch.setenv("STATEKIT_DIRECT_IO", "1")
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


def test_short_and_batched_writes_land_where_they_belong(tmp_path, monkeypatch, small_blocks):
    """With direct I/O the writer thread writes the blocks waiting for it with one pwritev, and
    goes on where a short write stopped (mid-block, at any byte)."""
    monkeypatch.setenv("STATEKIT_DIRECT_IO", "1")
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


def test_cached_writes_are_small_and_their_writeback_starts_block_by_block(tmp_path, monkeypatch):
    """Through the page cache (the default), no write is larger than atomic.PIECE, a short write
    goes on where it stopped, and the writeback of each block is asked for once it is written:
    the ranges asked for cover the file's full blocks exactly, in order."""
    monkeypatch.delenv("STATEKIT_DIRECT_IO", raising=False)
    monkeypatch.setattr(atomic, "BLOCK", 8 * 4096)
    monkeypatch.setattr(atomic, "PIECE", 3 * 4096)
    real = os.pwrite
    sizes, offsets, ranges = [], [], []

    def pwrite(fd, data, offset):
        sizes.append(len(data))
        offsets.append(offset)
        return real(fd, data, offset) if len(sizes) % 4 else real(fd, bytes(data)[:1001], offset)

    class WriteOut:
        def __call__(self, fd, offset, nbytes, flags):
            ranges.append((offset, nbytes, flags))
            return 0

    monkeypatch.setattr(atomic.os, "pwrite", pwrite)
    monkeypatch.setattr(atomic, "_write_out_function", WriteOut)
    data = np.random.default_rng(11).bytes(20 * 8 * 4096 + 5000)
    with atomic.atomic_write(tmp_path / "out") as fh:
        fh.write(data)
    assert (tmp_path / "out").read_bytes() == data
    assert max(sizes) == 3 * 4096 and 1001 in [o % 4096 for o in offsets]  # went on after 1001 bytes
    full = [r for r in ranges if r[1] == 8 * 4096]
    assert full == [(i * 8 * 4096, 8 * 4096, 2) for i in range(20)]


def direct_writes(monkeypatch) -> list[int]:
    """The offsets of the writes made while the file was open with O_DIRECT (os.pwritev watched)."""
    import fcntl

    real = os.pwritev
    seen = []

    def pwritev(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(atomic.os, "pwritev", pwritev)
    return seen


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_a_slow_copy_into_the_page_cache_sends_the_rest_direct(tmp_path, monkeypatch):
    """Two blocks in a row copied slower than SLOW_CACHE_RATE (here: any copy is) switch the file
    to O_DIRECT from the third block on; the bytes are the same, and the process's next output
    is direct from its first block. A fast copy never switches."""
    monkeypatch.delenv("STATEKIT_DIRECT_IO", raising=False)
    monkeypatch.setattr(atomic, "BLOCK", 8 * 4096)
    block = 8 * 4096
    data = np.random.default_rng(12).bytes(30 * block + 777)
    seen = direct_writes(monkeypatch)

    with atomic.atomic_write(tmp_path / "fast") as fh:
        fh.write(data)
    assert (tmp_path / "fast").read_bytes() == data and seen == [] and not atomic._CACHE_SLOW

    monkeypatch.setattr(atomic, "SLOW_CACHE_RATE", 1 << 62)  # every copy is slower than that
    with atomic.atomic_write(tmp_path / "slow") as fh:
        fh.write(data)
    assert (tmp_path / "slow").read_bytes() == data
    assert seen and min(seen) == 2 * block and atomic._CACHE_SLOW
    seen.clear()
    with atomic.atomic_write(tmp_path / "next") as fh:
        fh.write(data)
    assert (tmp_path / "next").read_bytes() == data and min(seen) == 0


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_no_switch_when_direct_io_is_refused_or_asked_against(tmp_path, monkeypatch):
    """STATEKIT_DIRECT_IO=0 keeps every block in the page cache however slow the copy; so does a
    file system that answered O_DIRECT with EINVAL."""
    monkeypatch.setattr(atomic, "BLOCK", 8 * 4096)
    monkeypatch.setattr(atomic, "SLOW_CACHE_RATE", 1 << 62)
    data = np.random.default_rng(13).bytes(20 * 8 * 4096)
    seen = direct_writes(monkeypatch)
    monkeypatch.setenv("STATEKIT_DIRECT_IO", "0")
    with atomic.atomic_write(tmp_path / "a") as fh:
        fh.write(data)
    assert (tmp_path / "a").read_bytes() == data and seen == [] and not atomic._CACHE_SLOW

    monkeypatch.setenv("STATEKIT_DIRECT_IO", "1")
    real = atomic.os.pwritev
    import fcntl

    def refusing(fd, buffers, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(atomic.os, "pwritev", refusing)
    calls = []
    monkeypatch.setattr(atomic.OutputFile, "_set_direct",
                        lambda self, on, real_set=atomic.OutputFile._set_direct: calls.append(on) or real_set(self, on))
    with atomic.atomic_write(tmp_path / "b") as fh:
        fh.write(data)
    assert (tmp_path / "b").read_bytes() == data
    assert calls.count(True) == 1  # asked once at the start, refused, never asked again


def test_writeback_is_linux_sync_file_range():
    """The writeback call is the C library's sync_file_range where the system has it (Linux);
    asked for a range of a real file, it succeeds."""
    fn = atomic._write_out_function()
    if not hasattr(os, "O_DIRECT"):
        assert fn is None
        return
    assert fn is not None
    import tempfile

    with tempfile.TemporaryFile() as fh:
        fh.write(b"z" * 65536)
        fh.flush()
        assert fn(fh.fileno(), 0, 65536, atomic.WRITE_OUT) == 0


def test_a_failure_mid_file_leaves_no_file_and_no_thread(tmp_path, small_blocks):
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="producer"), atomic.atomic_write(dst) as fh:
        fh.write(b"x" * (12 * BLOCK))
        raise RuntimeError("producer failed")
    assert dst.read_bytes() == b"old" and leftovers(dst) == [] and threads() == []


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_failed_disk_write_reaches_the_writer(tmp_path, monkeypatch, small_blocks, direct):
    monkeypatch.setenv("STATEKIT_DIRECT_IO", direct)
    name = "pwritev" if direct == "1" else "pwrite"
    real = getattr(os, name)

    def failing(fd, data, offset):
        if offset >= 3 * BLOCK:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(atomic.os, name, failing)
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
