"""statekit.frameworks.megatron.buckets: hand-computed layouts per version rule, and a brute-force
element-by-element simulation of the rules of docs/megatron-formats.md §1.5 (hypothesis)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statekit.errors import FormatError
from statekit.frameworks.megatron import buckets
from statekit.frameworks.megatron.buckets import LayoutParam, layout_buffer


def _p(name, numel, **kw):
    return LayoutParam(name, (numel,), "BF16", **kw)


ABC = [_p("a", 10), _p("b", 100), _p("c", 3)]


def _spans(layout):
    return {n: (p.start, p.end, p.bucket, p.coalesced) for n, p in layout.placements.items()}


def test_rule_ge_08_one_bucket_hand_computed():
    # reversed: c at 0; b's start 3 padded to 64; a's start 164 padded to 192; end 202 padded to lcm(2,128)
    lay = layout_buffer(ABC, None, 2, buckets.rule(">=0.8"))
    assert _spans(lay) == {"c": (0, 3, 0, 0), "b": (64, 164, 0, 64), "a": (192, 202, 0, 192)}
    assert [(b.start, b.end, b.numel_unpadded) for b in lay.buckets] == [(0, 256, 202)]
    assert list(lay.placements) == ["c", "b", "a"]


def test_rule_07_no_param_alignment():
    lay = layout_buffer(ABC, None, 2, buckets.rule("0.7"))
    assert _spans(lay) == {"c": (0, 3, 0, 0), "b": (3, 103, 0, 3), "a": (103, 113, 0, 103)}
    assert [(b.start, b.end, b.numel_unpadded) for b in lay.buckets] == [(0, 128, 113)]


def test_rule_le_06_end_padded_to_dp():
    lay = layout_buffer(ABC, None, 3, buckets.rule("<=0.6"))
    assert [(b.start, b.end, b.numel_unpadded) for b in lay.buckets] == [(0, 114, 113)]
    assert not buckets.rule("<=0.6").coalesced


def test_busbw_padding():
    lay = layout_buffer(ABC, None, 2, buckets.rule(">=0.8"), pad_for_busbw=True)
    assert lay.buckets[0].end == 2**16


def test_two_buckets_and_rank_shards_hand_computed():
    # bucket size 100, DP 4: b ends at 164 >= 100 -> bucket 0 = [0, 256) (164 padded to lcm(4,128)=128's
    # multiple); a starts bucket 1 at 256, ends 266 -> [256, 384), unpadded 10
    lay = layout_buffer(ABC, 100, 4, buckets.rule(">=0.8"))
    assert [(b.start, b.end, b.numel_unpadded) for b in lay.buckets] == [(0, 256, 164), (256, 384, 10)]
    assert _spans(lay)["a"] == (256, 266, 1, 164)
    assert lay.placements["a"].bucket_offset == 0
    assert lay.numel_unpadded == 174
    # shard size 64 per rank in bucket 0: b = elements 64..164 -> rank 1 [0, 64), rank 2 [0, 36)
    assert lay.rank_pieces("b") == [(0, 1, 0, 0, 64), (0, 2, 0, 64, 36)]
    # bucket 1's shard is 32: a lies in rank 0's
    assert lay.rank_pieces("a") == [(1, 0, 0, 0, 10)]


def test_shared_embedding_gets_its_own_bucket():
    params = [_p("emb", 50, shared_embedding=True), _p("w", 10)]
    lay = layout_buffer(params, None, 1, buckets.rule(">=0.8"))
    # w at 0..10; emb's start padded to 64 closes bucket 0 there (unpadded 64, end 128); emb at 128..178
    assert [(b.start, b.end, b.numel_unpadded) for b in lay.buckets] == [(0, 128, 64), (128, 256, 50)]
    assert _spans(lay)["emb"] == (128, 178, 1, 64)


def test_split_buffers_by_dtype_and_expert():
    params = [_p("x", 4), LayoutParam("e", (4,), "BF16", expert=True), LayoutParam("f", (2,), "F32")]
    split = buckets.split_buffers(params, grad_reduce_in_fp32=True, experts_separate=True)
    keys = list(split)
    assert keys == [buckets.BufferKey("BF16", "F32", False), buckets.BufferKey("BF16", "F32", True),
                    buckets.BufferKey("F32", "F32", False)]
    together = buckets.split_buffers(params, grad_reduce_in_fp32=False, experts_separate=False)
    assert [p.name for p in together[buckets.BufferKey("BF16", "BF16", False)]] == ["x", "e"]


def test_numel_unpadded_check_names_the_layout():
    lay = layout_buffer(ABC, None, 2, buckets.rule(">=0.8"))
    lay.check_numel_unpadded(202, "buffer 0")
    with pytest.raises(FormatError, match=r"buffer 0: numel_unpadded is 203, the layout .* gives 202"):
        lay.check_numel_unpadded(203, "buffer 0")
    with pytest.raises(FormatError, match="unknown bucket layout rule"):
        buckets.rule("0.9")


# ------------------------------------------------------------------ brute force (hypothesis)

def _simulate(params, bucket_size, dp, align, lcm128, busbw):
    """Element by element: a list of the owning name (None: padding) per buffer element, and the
    buckets as (start, end, unpadded); written from the prose of §1.5, not from buckets.py."""
    divisor = (math.lcm(dp, 128, 2**16) if busbw else math.lcm(dp, 128)) if lcm128 else dp
    buf: list[str | None] = []
    out_buckets = []
    bstart = 0
    members = 0

    def close():
        nonlocal bstart, members
        unpadded = len(buf) - bstart
        while len(buf) % divisor:
            buf.append(None)
        out_buckets.append((bstart, len(buf), unpadded))
        bstart, members = len(buf), 0

    for p in reversed(params):
        while len(buf) % align:
            buf.append(None)
        if p.shared_embedding and members:
            close()
        buf.extend([p.name] * p.numel)
        members += 1
        if (bucket_size is not None and len(buf) - bstart >= bucket_size) or p.shared_embedding:
            close()
    if members:
        close()
    return buf, out_buckets


@st.composite
def _cases(draw):
    n = draw(st.integers(1, 8))
    params = []
    for i in range(n):
        numel = draw(st.integers(1, 300))
        shared = draw(st.booleans()) if i in (0, n - 1) else False
        params.append(LayoutParam(f"p{i}", (numel,), "BF16", shared_embedding=shared))
    bucket_size = draw(st.one_of(st.none(), st.integers(1, 600)))
    dp = draw(st.integers(1, 6))
    rule = draw(st.sampled_from(sorted(buckets.RULES)))
    busbw = draw(st.booleans()) and rule != "<=0.6"
    return params, bucket_size, dp, rule, busbw


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_layout_matches_brute_force(case):
    params, bucket_size, dp, rule_name, busbw = case
    rule = buckets.rule(rule_name)
    lay = layout_buffer(params, bucket_size, dp, rule, pad_for_busbw=busbw)
    buf, sim_buckets = _simulate(params, bucket_size, dp, rule.param_align, rule.end_lcm_128, busbw)
    assert [(b.start, b.end, b.numel_unpadded) for b in lay.buckets] == sim_buckets
    assert lay.numel == len(buf)
    for p in params:
        where = [i for i, owner in enumerate(buf) if owner == p.name]
        pl = lay.placements[p.name]
        assert (pl.start, pl.end) == (where[0], where[-1] + 1)
    # the coalesced tensor: each bucket's first numel_unpadded elements, back to back
    coalesced = [owner for b in sim_buckets for owner in buf[b[0]:b[0] + b[2]]]
    for p in params:
        pl = lay.placements[p.name]
        assert coalesced[pl.coalesced:pl.coalesced + p.numel] == [p.name] * p.numel
    # DP shards: rank r owns [start + r*S, start + (r+1)*S) of each bucket
    for p in params:
        got = []
        for bucket, rank, local, plo, n in lay.rank_pieces(p.name):
            b = sim_buckets[bucket]
            shard = (b[1] - b[0]) // dp
            assert 0 <= local and local + n <= shard
            first = b[0] + rank * shard + local
            assert buf[first:first + n] == [p.name] * n
            got.append((plo, n))
        assert sum(n for _, n in got) == p.numel
        assert [lo for lo, _ in got] == [sum(n for _, n in got[:i]) for i in range(len(got))]


# ------------------------------------------------------- against megatron-core's own layout code

LAYOUTS = sorted((Path(__file__).resolve().parent.parent / "fixtures" / "megatron_layouts").glob("mcore-*.json"))


@pytest.mark.parametrize("file", LAYOUTS, ids=lambda p: p.stem)
def test_layout_equals_megatron_cores_own(file):
    """fixtures/megatron_layouts/ holds layouts megatron-core computed itself
    (scripts/make_megatron_layouts.py): every parameter's (start, end, bucket), every bucket's
    (start, end) and numel_unpadded must be statekit's."""
    data = json.loads(file.read_text())
    assert len(data["cases"]) > 50
    for case in data["cases"]:
        params = [LayoutParam(f"p{i}", (n,), "BF16", shared_embedding=s)
                  for i, (n, s) in enumerate(zip(case["sizes"], case["shared"], strict=True))]
        lay = layout_buffer(params, case["bucket_size"], case["dp"], buckets.rule(">=0.8"), pad_for_busbw=case["busbw"])
        got = [[lay.placements[p.name].start, lay.placements[p.name].end, lay.placements[p.name].bucket]
               for p in params]
        assert got == case["params"], case
        assert [[b.start, b.end] for b in lay.buckets] == case["buckets"], case
        assert [b.numel_unpadded for b in lay.buckets] == case["numel_unpadded"], case
