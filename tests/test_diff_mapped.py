"""diff compares two file spans where they lie (memcmp of read-only maps, ``stream.same_spans``)
and reads them only where that cannot tell: the answers are the ones reading gives."""

import shutil

import numpy as np
import pytest
from conftest import ROOT

from statekit import io, stream
from statekit.errors import StatekitError
from statekit.ops.diff import compare_refs, diff_files
from statekit.tensor import FileSpan, SourceFile

HAND = ROOT / "fixtures" / "hand-optim.bpk"


@pytest.fixture
def two_files(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 17, dtype=np.uint8).tobytes()
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * 100 + data)
    b.write_bytes(b"yy" * 7 + data)
    fa, fb = SourceFile.open(str(a)), SourceFile.open(str(b))
    yield fa, fb, b, len(data)
    fa.close()
    fb.close()


def test_same_spans_finds_a_difference_at_any_byte_across_windows(two_files, monkeypatch):
    fa, fb, b, n = two_files
    monkeypatch.setattr(stream, "MAP_WINDOW", 4096)  # four windows, the last one short
    assert stream.same_spans(FileSpan(fa, 100, n), FileSpan(fb, 14, n))
    assert stream.same_spans(FileSpan(fa, 100, 0), FileSpan(fb, 14, 0))
    original = b.read_bytes()
    for k in (0, 4095, 4096, n // 2, n - 1):
        changed = bytearray(original)
        changed[14 + k] ^= 0x01
        b.write_bytes(bytes(changed))
        assert not stream.same_spans(FileSpan(fa, 100, n), FileSpan(fb, 14, n)), k
    b.write_bytes(original)
    assert not stream.same_spans(FileSpan(fa, 100, n), FileSpan(fb, 14, n - 1))  # lengths differ
    assert not stream.same_spans(FileSpan(fa, 100, n), FileSpan(fb, 15, n))  # past b's end: cannot tell


def test_equal_tensors_are_not_read_and_say_what_reading_says(monkeypatch):
    with io.open_checkpoint(HAND) as a, io.open_checkpoint(HAND) as b:
        pairs = [(pa.slots[s], pb.slots[s]) for pa, pb in zip(a.optimizer.params, b.optimizer.params, strict=True)
                 for s in pa.slots]
        read = [compare_refs(x, y) for x, y in _without_maps(monkeypatch, pairs)]

        def no_reads(*args, **kwargs):
            raise AssertionError("an equal span was read")

        with monkeypatch.context() as m:
            m.setattr(FileSpan, "chunks", no_reads)
            m.setattr(FileSpan, "read", no_reads)
            mapped = [compare_refs(x, y) for x, y in pairs]
    assert mapped == read and all(r["equal"] and r["compared"] and r["differing"] == 0 for r in mapped)
    assert len(mapped) == 8


def _without_maps(monkeypatch, pairs):
    with monkeypatch.context() as m:
        m.setattr(stream, "same_spans", lambda a, b: False)
        yield from list(pairs)


def test_a_truncated_copy_is_read_and_refused_as_before(tmp_path):
    short = tmp_path / "short.bpk"
    data = HAND.read_bytes()
    short.write_bytes(data[: len(data) - 64])
    with pytest.raises(StatekitError, match="ended|truncated"):
        diff_files(HAND, short)


def test_a_copy_with_one_changed_value_differs_by_exactly_it(tmp_path):
    copy = tmp_path / "copy.bpk"
    shutil.copy(HAND, copy)
    with io.open_checkpoint(HAND) as ckpt:
        p = ckpt.optimizer.params[0]
        name, ref = next(iter(p.slots.items()))
        offset = ref.span.offset
    raw = bytearray(copy.read_bytes())
    value = np.frombuffer(bytes(raw[offset : offset + 4]), np.float32)[0]
    raw[offset : offset + 4] = np.float32(value * 2 + 1).tobytes()
    copy.write_bytes(bytes(raw))
    d = diff_files(HAND, copy)
    differing = [(q["a"]["path"], f["name"], f["differing"]) for q in d["params"] for f in q["fields"]
                 if not f["equal"]]
    assert not d["equal"] and len(differing) == 1 and differing[0][1:] == (name, 1)
