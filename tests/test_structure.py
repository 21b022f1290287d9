"""The structural map on its own: pieces, coverage, rules, and the map inferred from weights in numpy,
each against the numpy operation that made the new tensors (concatenate, stack, transpose, a RoPE or a
GQA interleave)."""

from __future__ import annotations

import os
import threading

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from statekit import io
from statekit.errors import MappingError, UsageError
from statekit.structure import coverage
from statekit.structure import rules as structure_rules
from statekit.structure.access import Weight
from statekit.structure.apply import assembled
from statekit.structure.infer import Unproduced, infer
from statekit.structure.pieces import Piece, StructureMap, TargetMap, compress, describe
from statekit.structure.settle import settle
from statekit.tensor import TensorRef

RNG = np.random.default_rng(0)


def rope(w: np.ndarray, heads: int) -> np.ndarray:
    d1, d2 = w.shape
    return w.reshape(heads, d1 // heads // 2, 2, d2).transpose(0, 2, 1, 3).reshape(d1, d2)


def build(t: TargetMap, sources: dict[str, np.ndarray], fill=0.0) -> np.ndarray:
    refs = {k: TensorRef.from_array(v) for k, v in sources.items()}
    ref = assembled(t, refs, "F32", fill)
    return np.concatenate(list(ref.pieces())).reshape(t.shape)


def mapped(tmp_path, old: dict, new: dict, **kw):
    save_file(old, str(tmp_path / "old.safetensors"))
    save_file(new, str(tmp_path / "new.safetensors"))
    with io.open_checkpoint(str(tmp_path / "old.safetensors")) as a, io.open_checkpoint(
            str(tmp_path / "new.safetensors")) as b:
        return infer([Weight(m.path, m.tensor) for m in a.model.params],
                     [Weight(m.path, m.tensor) for m in b.model.params], **kw)


def f32(*shape) -> np.ndarray:
    return RNG.normal(size=shape).astype(np.float32)


# ----------------------------------------------------------------------------- pieces


def test_a_rope_permutation_folds_into_one_piece_and_moves_rows_as_torch_does():
    heads, rows, cols = 4, 16, 3
    per = rows // heads // 2
    # one piece per run of rows, as the lines give them: rows h·dh + a·dh/2 + b ← h·dh + 2b + a
    runs = [Piece("q", (per, cols), (h * (rows // heads) + a) * cols, (2 * cols, 1),
                  (h * (rows // heads) + a * per) * cols, (cols, 1)) for h in range(heads) for a in range(2)]
    folded = compress(runs)
    assert folded == [Piece("q", (heads, 2, per, cols), 0, (rows // heads * cols, cols, 2 * cols, 1), 0,
                            (rows // heads * cols, per * cols, cols, 1))]
    q = f32(rows, cols)
    t = TargetMap("q2", (rows, cols), folded)
    assert np.array_equal(build(t, {"q": q}), rope(q, heads))
    assert describe(folded[0], (rows, cols), (rows, cols)) == "[all] ← q, rows permuted per head (RoPE, 4 heads)"


def test_coverage_refuses_overlaps_holes_and_reads_outside():
    a = Piece("a", (4,), 0, (1,), 0, (1,))
    coverage.check(TargetMap("t", (2, 4), [a, Piece("b", (4,), 0, (1,), 4, (1,))]), {"a": 4, "b": 4})
    with pytest.raises(MappingError, match=r"two pieces of the map write element \[0, 2\]"):
        coverage.check(TargetMap("t", (2, 4), [a, Piece("b", (6,), 0, (1,), 2, (1,))]), {"a": 4, "b": 6})
    with pytest.raises(MappingError, match="writes 4 of 8 elements and declares 0 new"):
        coverage.check(TargetMap("t", (2, 4), [a]), {"a": 4})
    coverage.check(TargetMap("t", (2, 4), [a], new=4), {"a": 4})
    with pytest.raises(MappingError, match="reads outside b"):
        coverage.check(TargetMap("t", (2, 4), [a, Piece("b", (4,), 1, (1,), 4, (1,))]), {"a": 4, "b": 4})
    # column pieces (burn's axis-1 join) are checked a row segment at a time
    cols = [Piece("g", (3, 2), 0, (2, 1), 0, (4, 1)), Piece("u", (3, 2), 0, (2, 1), 2, (4, 1))]
    coverage.check(TargetMap("t", (3, 4), cols), {"g": 6, "u": 6})


# ----------------------------------------------------------------------------- rules


def test_rules_fuse_split_stack_unstack_as_numpy_does():
    old = {f"l.{i}.{n}": f32(*s) for i in range(2) for n, s in (("q", (4, 3)), ("k", (2, 3)), ("v", (2, 3)))}
    rules = structure_rules.parse(fuse=["l.*.qkv=l.*.q,l.*.k,l.*.v"])
    smap = structure_rules.build(rules, {k: v.shape for k, v in old.items()}, None, "torch")
    assert list(smap.targets) == ["l.0.qkv", "l.1.qkv"]
    for i in range(2):
        want = np.concatenate([old[f"l.{i}.q"], old[f"l.{i}.k"], old[f"l.{i}.v"]])
        assert np.array_equal(build(smap.targets[f"l.{i}.qkv"], old), want)
    burn = structure_rules.build(rules, {k: v.T.shape for k, v in old.items()}, None, "burn")  # [d_in, d_out]
    burn_old = {k: np.ascontiguousarray(v.T) for k, v in old.items()}
    want = np.concatenate([burn_old["l.0.q"], burn_old["l.0.k"], burn_old["l.0.v"]], axis=1)
    assert np.array_equal(build(burn.targets["l.0.qkv"], burn_old), want)
    experts = {f"e.{i}.w1": f32(3, 5) for i in range(3)} | {f"e.{i}.w3": f32(3, 5) for i in range(3)}
    stack = structure_rules.build(structure_rules.parse(stack=["gate_up=e.*.w1,e.*.w3"]),
                                  {k: v.shape for k, v in experts.items()}, None, "torch")
    want = np.stack([np.concatenate([experts[f"e.{i}.w1"], experts[f"e.{i}.w3"]]) for i in range(3)])
    assert np.array_equal(build(stack.targets["gate_up"], experts), want)
    stacked = {"gate_up": want}
    back = structure_rules.build(structure_rules.parse(unstack=["gate_up=e.*.w1,e.*.w3"]), {"gate_up": want.shape},
                                 {k: v.shape for k, v in experts.items()}, "torch")
    for name, value in experts.items():
        assert np.array_equal(build(back.targets[name], stacked), value)
    split = structure_rules.build(structure_rules.parse(split=["qkv=q,k,v"]), {"qkv": (8, 3)},
                                  {"q": (4, 3), "k": (2, 3), "v": (2, 3)}, "torch")
    whole = f32(8, 3)
    assert [build(split.targets[n], {"qkv": whole}).tolist() for n in "qkv"] == \
        [whole[:4].tolist(), whole[4:6].tolist(), whole[6:].tolist()]


def test_rules_refuse_what_does_not_fit():
    with pytest.raises(UsageError, match="as many"):
        structure_rules.parse(fuse=["l.*.qkv=l.0.q,l.*.k"])
    with pytest.raises(MappingError, match="does not join"):
        structure_rules.build(structure_rules.parse(fuse=["qk=q,k"]), {"q": (4, 3), "k": (4, 2)}, None, "torch")
    with pytest.raises(MappingError, match=r"numbered tensors are \[0, 2\]"):
        structure_rules.build(structure_rules.parse(stack=["w=e.*.w"]), {"e.0.w": (2,), "e.2.w": (2,)}, None, "torch")
    with pytest.raises(MappingError, match="add up to 6"):
        structure_rules.build(structure_rules.parse(split=["qkv=q,k"]), {"qkv": (8, 3)},
                              {"q": (4, 3), "k": (2, 3)}, "torch")
    with pytest.raises(MappingError, match="matches no tensor"):
        structure_rules.build(structure_rules.parse(fuse=["x=a,b"]), {"q": (1,)}, None, "torch")


# ----------------------------------------------------------------------------- inference


def test_inferred_gqa_interleave_transposes_unstacks_and_splits(tmp_path):
    groups, per, hd, dim = 2, 2, 2, 6
    q, k, v = f32(groups * per * hd, dim), f32(groups * hd, dim), f32(groups * hd, dim)
    # Megatron's fused QKV: [q_g0, k_0, v_0, q_g1, k_1, v_1]
    blocks = []
    for g in range(groups):
        blocks += [q[g * per * hd : (g + 1) * per * hd], k[g * hd : (g + 1) * hd], v[g * hd : (g + 1) * hd]]
    conv1d = f32(dim, 5)  # GPT-2's Conv1D [in, out]
    stacked = f32(3, 4, dim)
    old = {"q": q, "k": k, "v": v, "c_attn": conv1d, "experts": stacked, "dropped": f32(3, 3)}
    new = {"qkv": np.concatenate(blocks), "linear": np.ascontiguousarray(conv1d.T),
           **{f"e.{i}": stacked[i] for i in range(3)}}
    found = mapped(tmp_path, old, new)
    t = found.map.targets
    assert t["qkv"].kind == "interleaved" and len(t["qkv"].pieces) == 3  # one folded piece per source
    assert np.array_equal(build(t["qkv"], old), new["qkv"])
    assert t["linear"].kind == "transposed" and np.array_equal(build(t["linear"], old), new["linear"])
    assert all(t[f"e.{i}"].kind == "unstacked" for i in range(3))
    assert found.unused == ["dropped"]


def test_split_a_fused_tensor_back_and_bf16_bits(tmp_path):
    q, k = f32(4, 3).astype(ml_dtypes.bfloat16), f32(2, 3).astype(ml_dtypes.bfloat16)
    found = mapped(tmp_path, {"qk": np.concatenate([q, k])}, {"q": q, "k": k})
    assert {n: t.kind for n, t in found.map.targets.items()} == {"q": "split", "k": "split"}
    assert found.map.targets["k"].pieces[0].src_offset == 12


def test_duplicate_rows_are_settled_by_their_neighbours_or_refused(tmp_path):
    q = f32(8, 4)
    q[2] = q[3] = q[5] = 0.0  # zero rows: each equal to the others, and to k's
    k = f32(4, 4)
    k[1] = 0.0
    found = mapped(tmp_path, {"q": q, "k": k}, {"qk": np.concatenate([q, k])})
    assert np.array_equal(build(found.map.targets["qk"], {"q": q, "k": k}), np.concatenate([q, k]))
    assert [p.source for p in found.map.targets["qk"].pieces] == ["q", "k"]
    # interleaved rows give the zero rows no neighbour to continue: which zero row is which is a guess
    with pytest.raises(MappingError, match="qk: row 1 is equal to lines of k, q alike"):
        mapped(tmp_path, {"q": q, "k": k}, {"qk": np.concatenate([rope(q, 2), k])})


def test_grown_rows_and_columns_start_fresh(tmp_path):
    emb, out, both = f32(5, 3), f32(3, 5), f32(2, 2)
    new = {"emb": np.concatenate([emb, f32(2, 3)]), "out": np.concatenate([out, f32(3, 2)], axis=1),
           "both": np.pad(both, ((0, 1), (0, 1))) + np.pad(np.zeros((2, 2), np.float32), ((0, 1), (0, 1)),
                                                                constant_values=7)}
    found = mapped(tmp_path, {"emb": emb, "out": out, "both": both}, new)
    t = found.map.targets
    assert (t["emb"].kind, t["emb"].new) == ("grown", 6) and (t["out"].kind, t["out"].new) == ("grown", 6)
    assert (t["both"].kind, t["both"].new) == ("grown", 5)
    moment = {"out": f32(3, 5)}
    built = build(t["out"], moment, fill=0.25)
    assert np.array_equal(built[:, :5], moment["out"]) and (built[:, 5:] == 0.25).all()


def test_what_the_old_weights_cannot_produce_is_refused_or_new(tmp_path):
    a = f32(4, 3)
    changed = a.copy()
    changed[2, 1] += 1
    with pytest.raises(MappingError, match=r"a\[2, 1\] is .* in the new weights, but the map reads .* from a\[2, 1\]"):
        mapped(tmp_path, {"a": a}, {"a": changed})
    found = mapped(tmp_path, {"a": a}, {"a": changed}, declared_new=["a"])
    assert found.map.targets["a"].kind == "new" and found.unused == ["a"]
    found = mapped(tmp_path, {"a": a}, {"a": a, "head": f32(2, 2)})  # a new parameter: fresh state
    assert found.map.targets["head"].kind == "new"
    q, k = f32(5, 3), f32(3, 3)
    with pytest.raises(MappingError, match=r"fused: 8 of its 9 rows come from k, q, row 5 from none of the old"):
        mapped(tmp_path, {"q": q, "k": k}, {"fused": np.concatenate([q, f32(1, 3), k])})


def test_weights_are_related_when_a_tensor_that_is_not_constant_finds_old_candidates(tmp_path):
    """Issue 38: the pair is moved by path only when it shares no values; an untrained norm (all ones in
    both) is what any two initialisations share and says nothing, one row of a renamed tensor does."""
    a, norm = f32(4, 3), np.ones(3, np.float32)
    with pytest.raises(Unproduced) as unrelated:  # a model saved before its weights were loaded
        mapped(tmp_path, {"a": a, "norm": norm}, {"a": f32(4, 3), "norm": norm})
    assert not unrelated.value.related
    changed = a.copy()
    changed[1, 2] += 1
    with pytest.raises(Unproduced, match=r"b\[1, 2\] is .* in the new weights, but a\[1, 2\]") as related:
        mapped(tmp_path, {"a": a, "norm": f32(3)}, {"b": changed})
    assert related.value.related
    # a renamed vector whose whole key leads to an old one the proof refutes is no new tensor either
    v = f32(100)
    edited = v.copy()
    from statekit.structure import access

    at = min(set(access.positions(100, access.SAMPLES).tolist()) - set(access.positions(100, access.WHOLE_SAMPLES)
                                                                       .tolist()))
    edited[at] += 1  # (sampled by its row's key, not by the whole key: that one still leads to v)
    with pytest.raises(Unproduced, match=rf"w\[{at}\] is .* but the map reads .* from v\[{at}\] \(its key is v's"):
        mapped(tmp_path, {"v": v}, {"w": edited})
    assert mapped(tmp_path, {"v": v}, {"w": f32(100)}).map.targets["w"].kind == "new"  # a new parameter


def test_settle_uses_the_path_the_rules_and_the_siblings():
    assert settle("a.w", ["a.w", "b.w"], None, {}) == ("a.w", "their own paths")
    assert settle("x.w", ["a.w", "b.w"], lambda p: {p.replace("b.", "x.")}, {})[0] == "b.w"
    known = {"blk.3.attn.qkv": ["layers.3.attn.q"], "blk.3.attn.o": ["layers.3.attn.o"]}
    assert settle("blk.3.attn.norm", ["layers.2.attn.norm", "layers.3.attn.norm"], None, known)[0] == \
        "layers.3.attn.norm"
    assert settle("n", ["a", "b"], None, {})[0] is None


def test_structure_maps_round_trip_as_json():
    t = TargetMap("x", (2, 3), [Piece("a", (2, 3), 0, (3, 1), 0, (3, 1))], new=0, kind="whole")
    smap = StructureMap({"x": t}, "rules", ["--fuse 'x=a'"])
    assert StructureMap.from_json(smap.to_json()) == smap
    with pytest.raises(MappingError, match="shape and strides disagree"):
        Piece.from_json({"source": "a", "shape": [2], "src_offset": 0, "src_strides": [1, 1], "dst_offset": 0,
                         "dst_strides": [1]})


@pytest.mark.parametrize("window", [1 << 20, 0])
@pytest.mark.parametrize("jobs", [1, 3])
def test_the_proof_on_threads_finds_what_one_thread_finds_and_the_same_first_difference(tmp_path, monkeypatch, jobs,
                                                                                       window):
    """Every comparison cut small (runs in 40-byte chunks read 12 bytes at a time, blocks of 8 elements,
    read into buffers or, with no window, compared over maps) and run on ``jobs`` threads: the same
    map, and a tensor changed in two places is refused at the first of them."""
    from statekit import stream
    from statekit.structure import proof

    monkeypatch.setattr(proof, "PARALLEL_MIN", 0)
    monkeypatch.setattr(proof, "RUN_CHUNK", 40)
    monkeypatch.setattr(proof, "PIECE", 12)
    monkeypatch.setattr(proof, "WINDOW", window)
    monkeypatch.setattr(proof, "BLOCK", 8)
    monkeypatch.setattr(stream, "current_jobs", lambda: jobs)
    q, k, v, w = f32(8, 6), f32(4, 6), f32(4, 6), f32(30, 7)
    old = {"q": q, "k": k, "v": v, "w": w}
    new = {"qkv": np.concatenate([rope(q, 2), k, v]), "w": w.copy(), "wt": np.ascontiguousarray(w.T)}
    found = mapped(tmp_path, old, new)
    assert np.array_equal(build(found.map.targets["qkv"], old), new["qkv"])
    assert {n: t.kind for n, t in found.map.targets.items()}["wt"] == "transposed"
    changed = dict(new, w=w.copy())
    changed["w"][21, 3] += 1  # in a later chunk than the next one
    changed["w"][4, 2] += 1
    with pytest.raises(MappingError, match=r"w\[4, 2\] is .* in the new weights, but the map reads .* from w\[4, 2\]"):
        mapped(tmp_path, {"w": w}, {"w": changed["w"]})


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_a_key_of_a_few_rows_is_the_key_numpy_mixes_for_many(dtype):
    """Whole-tensor keys are mixed in Python's integers (one row), line keys in numpy (many rows):
    a new tensor and the old one it is found equal to may take either path, so both give the same
    bits, also where the element bits wrap 64 bits when offset (the top of uint64)."""
    from statekit.structure import access

    top = np.iinfo(dtype).max
    rows = np.array([[top, 0, 1, top - 1, 7, top, top, 3] * 8, list(range(64))], dtype=dtype)
    many = np.repeat(rows, 1 + access._FEW_ROWS, axis=0)  # enough rows for numpy's path
    by_numpy = access.mix(many, 4096)[:: 1 + access._FEW_ROWS]
    by_python = access.mix(rows, 4096)
    assert by_python.dtype == np.uint64
    assert by_python.tolist() == by_numpy.tolist()
    assert by_python[0] != by_python[1]


@pytest.mark.parametrize("room", ["fits", "memory short", "over the cap"])
def test_weights_not_in_the_page_cache_are_read_ahead_and_the_map_is_the_same(tmp_path, monkeypatch, room):
    """Files the page cache does not hold are read front to back (every byte of both files, in 1 MiB
    pieces): first, each on its own thread, when they fit in half the available memory and under
    FIRST_MAX; else on a thread while the map is learned, the whole-tensor keys' samples asked for at
    once. The map is the one learned without it; files the cache holds are left alone."""
    from statekit.structure import readahead

    q, k, v = f32(8, 6), f32(4, 6), f32(4, 6)
    old = {"q": q, "k": k, "v": v}
    new = {"qkv": np.concatenate([rope(q, 2), k, v])}
    cached = mapped(tmp_path, old, new)
    read: list[tuple[int, int]] = []
    threads: set[str] = set()

    def spy(files, stop):
        read.extend((lo, hi) for _, lo, hi in files)
        threads.add(threading.current_thread().name)
        real(files, stop)

    real = readahead._read
    monkeypatch.setattr(readahead, "_read", spy)
    monkeypatch.setattr(readahead, "cached_fraction", lambda fd, lo, hi: 0.0)
    fits = room == "fits"
    monkeypatch.setattr(readahead, "available_memory", lambda: 1000 if room == "memory short" else 1 << 40)
    if room == "over the cap":
        monkeypatch.setattr(readahead, "FIRST_MAX", 10)  # (bytes: the two files hold more)
    asked: list[list[int]] = []
    real_will_need = readahead.will_need
    monkeypatch.setattr(readahead, "will_need", lambda fd, at: (asked.append(list(at)), real_will_need(fd, at)))
    uncached = mapped(tmp_path, old, new)
    assert uncached.map == cached.map
    sizes = [(tmp_path / f"{name}.safetensors").stat().st_size for name in ("old", "new")]
    assert sorted(hi for _, hi in read) == sorted(sizes)  # both files, each to its last tensor's end
    if fits:  # read first, a thread a file; nothing is cold after
        assert threads == {"statekit-read"} and len(read) == 2 and asked == []
    else:
        assert threads == {"statekit-readahead"}
        # the whole-tensor keys' samples asked for at once: q 48 elements, k and v 24 (all of them),
        # qkv 64 of its 96 (every element: 96 // 64 = 1), four bytes apart
        assert sorted(len(at) for at in asked) == [24, 24, 48, 64]
        assert all(np.diff(at).tolist() == [4] * (len(at) - 1) for at in asked)
    monkeypatch.setattr(readahead, "cached_fraction", lambda fd, lo, hi: 1.0)
    read.clear()
    asked.clear()
    assert mapped(tmp_path, old, new).map == cached.map and read == [] and asked == []


def test_available_memory_is_read_from_the_system():
    from statekit.structure import readahead

    free = readahead.available_memory()
    if not os.path.exists("/proc/meminfo"):
        assert free is None
        return
    with open("/proc/meminfo") as fh:
        total = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemTotal:"))
    assert 0 < free <= total


def test_pages_asked_for_are_each_asked_once(monkeypatch):
    from statekit.structure import readahead

    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, at, n, how: calls.append((at, n, how)))
    page = readahead.mmap.PAGESIZE
    readahead.will_need(3, [0, 10, page, page + 904, 2 * page + 4, 10])
    assert calls == [(0, page, os.POSIX_FADV_WILLNEED), (page, page, os.POSIX_FADV_WILLNEED),
                     (2 * page, page, os.POSIX_FADV_WILLNEED)]


def test_keys_mix_each_row_a_little_endian_word_at_a_time():
    """Four uint16 elements make one word; three are padded with zeros to one (hand-computed)."""
    from statekit.structure import access

    words = access._words(np.array([[1, 2, 3], [0xFFFF, 0, 0x8000]], np.uint16))
    assert words.tolist() == [[0x0000_0003_0002_0001], [0x0000_8000_0000_FFFF]]
    assert access._words(np.arange(8, dtype=np.uint32).reshape(1, 8)).tolist() == [
        [1 << 32, 2 | 3 << 32, 4 | 5 << 32, 6 | 7 << 32]]
    # the key of a row depends on every sampled element: change any one and it changes
    rows = np.tile(np.arange(1, 17, dtype=np.uint16), (17, 1))
    for j in range(16):
        rows[j + 1, j] ^= 1
    assert len(set(access.mix(rows, 2048).tolist())) == 17


@given(st.lists(st.integers(0, 20), max_size=40), st.lists(st.integers(0, 22), max_size=40))
@settings(max_examples=200, deadline=None)
def test_candidates_are_the_ranges_of_equal_keys(old, new):
    """Each new key's candidates are exactly the old entries with its key (none, one or several)."""
    from statekit.structure.lines import LineIndex

    index = LineIndex()
    index._parts = [(np.array(old, np.uint64), 0, 0)]
    lo, hi = index.candidates(np.array(new, np.uint64))
    ordered = sorted(old)
    assert [(int(a), int(b)) for a, b in zip(lo, hi, strict=True)] == [
        (sum(x < k for x in ordered), sum(x <= k for x in ordered)) for k in new]


def test_columns_are_not_keyed_when_no_old_line_is_as_long(tmp_path, monkeypatch):
    """q, k, v [8|4|4, 6] joined into qkv [16, 6]: qkv's columns (16 long) match no old line (6, 8 and 4
    long), so no column key is read; the map is the rows' map."""
    from statekit.structure import access

    calls = []
    real = access.col_keys
    monkeypatch.setattr(access, "col_keys", lambda w: (calls.append(w.path), real(w))[1])
    q, k, v = f32(8, 6), f32(4, 6), f32(4, 6)
    result = mapped(tmp_path, {"q": q, "k": k, "v": v}, {"qkv": np.concatenate([q, k, v])})
    assert calls == []
    assert result.map.targets["qkv"].sources == ["q", "k", "v"]


def test_the_page_cache_probe_sees_a_file_read_and_one_let_go(tmp_path):
    from statekit.structure import readahead

    path = tmp_path / "w.bin"
    path.write_bytes(np.arange(1 << 20, dtype=np.uint32).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.read(fd, size)
        assert readahead.cached_fraction(fd, 0, size) == 1.0
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if readahead.cached_fraction(fd, 0, size) == 1.0:
            pytest.skip("this file system keeps its pages (tmpfs)")
        assert readahead.cached_fraction(fd, 0, size) < readahead.CACHED
    finally:
        os.close(fd)


@pytest.mark.parametrize("band", [1 << 20, 1200, 64])
def test_row_keys_read_from_the_file_in_bands_are_the_keys_of_the_rows_in_memory(tmp_path, monkeypatch, band):
    """Rows gathered from the file's pages a band at a time, the pages let go after each (1 MiB: the
    whole tensor at once; 1200 bytes: one row a band; 64 bytes: less than a row, still a row a band):
    the keys are those of the same rows in memory, each the mix of its row's sampled elements, which
    lie at an even step from the first."""
    from statekit.structure import access

    monkeypatch.setattr(access, "RELEASE_EVERY", band)
    assert access.positions(300).tolist() == list(range(0, 16 * 18, 18))  # 300 // 16 = 18
    assert access.positions(5).tolist() == [0, 1, 2, 3, 4]
    w = f32(37, 300)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    expected = access.mix(w.view(np.uint32)[:, access.positions(300)], 300)
    with io.open_checkpoint(str(tmp_path / "w.safetensors")) as ckpt:
        (m,) = ckpt.model.params
        on_file = access.row_keys(Weight("w", m.tensor))
        columns = access.col_keys(Weight("w", m.tensor))
    in_memory = access.row_keys(Weight("w", TensorRef.from_array(w)))
    assert on_file.tolist() == in_memory.tolist() == expected.tolist()
    assert columns.tolist() == access.mix(w.view(np.uint32)[access.positions(37)].T, 37).tolist()
    assert len(set(on_file.tolist())) == 37


def test_a_column_map_the_proof_refutes_is_followed_by_the_rows_map(tmp_path):
    """Row 7 of a new [128, 8] tensor is row 3 of another old tensor: the new columns (128 long) sample
    rows 0, 8, …, 120, so each has the key of a column of ``a``; that map is refuted by the proof, and
    the rows' map (a's rows, b's row 3) is learned and proved instead of a refusal. Where the rows
    cannot make it either (row 7 changed), the refusal is the columns' proof's, naming the element."""
    a, b = f32(128, 8), f32(16, 8)
    new = a.copy()
    new[7] = b[3]
    t = mapped(tmp_path, {"a": a, "b": b}, {"n": new}).map.targets["n"]
    assert t.sources == ["a", "b"]
    assert np.array_equal(build(t, {"a": a, "b": b}), new)
    new = a.copy()
    new[7, 2] += 1.0
    with pytest.raises(MappingError, match=r"n\[7, 2\] is .* in the new weights, but the map reads .* from a\[7, 2\]"):
        mapped(tmp_path, {"a": a}, {"n": new})


def _on_threads(monkeypatch, jobs: int) -> None:
    from statekit import stream
    from statekit.structure import proof

    monkeypatch.setattr(proof, "PARALLEL_MIN", 0)
    monkeypatch.setattr(proof, "RUN_CHUNK", 64)
    monkeypatch.setattr(proof, "PIECE", 16)
    monkeypatch.setattr(stream, "current_jobs", lambda: jobs)


@pytest.mark.parametrize("jobs", [1, 3])
def test_proofs_left_under_way_are_taken_in_the_tensors_order(tmp_path, monkeypatch, jobs):
    """x, y, z each two old [8, 40] tensors joined; x changed at column 33 (not sampled for its key: the
    proof, left under way while y and z are keyed, refutes it), z at column 0 (sampled: refused before
    any proof). Both named, x first, alike on one thread and on three."""
    _on_threads(monkeypatch, jobs)
    old = {name: f32(8, 40) for name in "abcdef"}
    new = {"x": np.concatenate([old["a"], old["b"]]), "y": np.concatenate([old["c"], old["d"]]),
           "z": np.concatenate([old["e"], old["f"]])}
    found = mapped(tmp_path, old, new)
    assert {p: t.sources for p, t in found.map.targets.items()} == {"x": ["a", "b"], "y": ["c", "d"],
                                                                     "z": ["e", "f"]}
    new["x"][3, 33] += 1
    new["z"][5, 0] += 1
    with pytest.raises(MappingError) as refused:
        mapped(tmp_path, old, new)
    said = str(refused.value)
    assert said.index("x[3, 33] is") < said.index("z[5, 0] is") and "y[" not in said and "y:" not in said


def test_an_error_in_a_proof_under_way_stops_the_others(tmp_path, monkeypatch):
    """A read that fails in one staged proof is the error raised; the proofs still under way are
    stopped: every task given to the comparison threads has finished or was cancelled."""
    from statekit.errors import FormatError
    from statekit.structure import proof

    _on_threads(monkeypatch, 3)
    real = proof._compare_run

    def failing(t, new, source, piece):
        if t.path == "x":
            raise FormatError("x: the file ends inside this tensor", "new.safetensors")
        return real(t, new, source, piece)

    monkeypatch.setattr(proof, "_compare_run", failing)
    pool = proof._pool(3)
    given = []
    submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda fn: (given.append(submit(fn)), given[-1])[1])
    old = {name: f32(8, 40) for name in "abcd"}
    new = {"x": np.concatenate([old["a"], old["b"]]), "y": np.concatenate([old["c"], old["d"]])}
    with pytest.raises(FormatError, match="the file ends inside"):
        mapped(tmp_path, old, new)
    assert given and all(f.done() for f in given)


@pytest.mark.parametrize("shape", [(8, 6), (300, 300)])
def test_whole_keys_read_from_the_file_are_the_keys_in_memory(tmp_path, shape):
    """A small tensor read whole, a larger one (360 KB) an element a read: the key, and the key of its
    transpose's positions, are those of the same tensor in memory."""
    from statekit.structure import access

    w = f32(*shape)
    save_file({"w": w}, str(tmp_path / "w.safetensors"))
    order = access.transposed_positions(shape[::-1])
    in_memory = Weight("w", TensorRef.from_array(w))
    with io.open_checkpoint(str(tmp_path / "w.safetensors")) as ckpt:
        (m,) = ckpt.model.params
        on_file = Weight("w", m.tensor)
        assert access.whole_key(on_file) == access.whole_key(in_memory)
        assert access.whole_key(on_file, order) == access.whole_key(in_memory, order)
    assert access.whole_key(in_memory, order) == access.whole_key(Weight("wt", TensorRef.from_array(
        np.ascontiguousarray(w.T))))


def test_tensors_proved_equal_are_not_proved_again(tmp_path, monkeypatch):
    """Three all-ones norms before and after: the first new one is proved equal to each old one (3
    proofs), the others to the first old one only (1 each): bit equality is transitive, 5 proofs in
    all instead of 9; each is settled by its own name."""
    from statekit.structure import proof

    calls = []
    real = proof.disagreement
    monkeypatch.setattr(proof, "disagreement", lambda t, *a, **k: (calls.append(t.path), real(t, *a, **k))[1])
    norms = {f"{m}.norm": np.ones(16, np.float32) for m in "abc"}
    result = mapped(tmp_path, norms, dict(norms))
    assert calls == ["a.norm"] * 3 + ["b.norm", "c.norm"]
    assert {p: t.sources for p, t in result.map.targets.items()} == {p: [p] for p in norms}


def _fused_model():
    q, k, v, o, w = f32(8, 6), f32(4, 6), f32(4, 6), f32(6, 8), f32(5, 7)
    old = {"q": q, "k": k, "v": v, "o": o, "w": w}
    new = {"qkv": np.concatenate([rope(q, 2), k, v]), "o": o.copy(), "wt": np.ascontiguousarray(w.T)}
    return old, new


def test_old_line_keys_read_early_are_the_ones_the_index_takes(tmp_path, monkeypatch):
    """While the whole tensors are proved, a thread reads the line keys of the old tensors the whole
    keys say no new tensor is (q, k, v; not o, equal to the new o, nor w, the new wt transposed); the
    index takes them instead of reading them again, and the map is the one learned without it."""
    from statekit.structure import infer as inference

    old, new = _fused_model()
    taken: list[tuple[str, bool]] = []
    real_take = inference._EarlyKeys.take
    monkeypatch.setattr(inference._EarlyKeys, "take",
                        lambda self, w, orient: (lambda keys: (taken.append((w.path, keys is not None)), keys)[1])(
                            real_take(self, w, orient)))
    early = mapped(tmp_path, old, new)
    assert sorted(taken) == [("k", True), ("q", True), ("v", True)]
    monkeypatch.setattr(inference._Inferrer, "_likely_lines", lambda self, todo: [])
    assert mapped(tmp_path, old, new).map == early.map


def test_old_line_keys_guessed_wrong_change_nothing(tmp_path, monkeypatch):
    """Every old tensor's rows and columns read early (o and w are whole sources, not line sources): the
    index still takes only the tensors and lengths it would have read, and the map is the same."""
    from statekit.structure import infer as inference
    from statekit.structure.lines import COL, ROW

    old, new = _fused_model()
    plain = mapped(tmp_path, old, new)
    monkeypatch.setattr(inference._Inferrer, "_likely_lines",
                        lambda self, todo: [(o, d) for o in self.old.values() for d in (ROW, COL)])
    assert mapped(tmp_path, old, new).map == plain.map


def test_old_line_keys_that_fail_early_are_read_again_where_the_error_is_raised():
    from statekit.structure import infer as inference
    from statekit.structure.lines import ROW

    class Broken(Weight):
        def mapped(self, sequential=False):
            raise OSError("gone")

    w = Broken("w", TensorRef.from_array(f32(4, 6)))
    w.ref = type("Ref", (), {"span": object(), "array_loader": None, "shape": (4, 6), "dtype": "F32"})()
    early = inference._EarlyKeys([(w, ROW)])
    assert early.take(w, ROW) is None  # (the thread's error: nothing kept, the index reads it itself)
    early.stop()
