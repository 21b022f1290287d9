import math

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from statekit.formats import cbor


@pytest.mark.parametrize(
    ("value", "hexbytes"),
    [
        ({"Int": -1}, "a163496e7420"),  # burn-formats.md §1.2, StepLrScheduler initial iter_idx
        (3.0, "f94200"),  # shortest form: half
        (21.0, "f94d40"),
        (0.1, "fb3fb999999999999a"),  # not exact in f32: double
        (float(__import__("numpy").float32(1e-5)), "fa3727c5ac"),  # an f32 widened: single
        (float("inf"), "f97c00"),
        (-0.0, "f98000"),
        ([2304, 2560], "82190900190a00"),  # mnist conv1.conv.bias offsets
        (9505838338724798577, "1b83eb859adffb2071"),  # its param_id
        ({}, "a0"),
    ],
)
def test_encoding_matches_ciborium(value, hexbytes):
    assert cbor.encode(value).hex() == hexbytes


def test_nan_is_half():
    assert cbor.encode(float("nan")).hex() == "f97e00"


def test_depth_limit():
    deep = b"\x81" * 200 + b"\x00"
    with pytest.raises(cbor.CborError, match="nesting"):
        cbor.decode(deep)


@pytest.mark.parametrize("data", [b"\x9f\x00\xff", b"\xc1\x00", b"\x7b" + b"\xff" * 8, b"\x82\x00", b"\x00\x00"])
def test_rejects_unsupported_or_truncated(data):
    with pytest.raises(cbor.CborError):
        cbor.decode(data)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(json_like)
def test_roundtrip_and_agrees_with_cbor2(value):
    data = cbor.encode(value)
    assert cbor2.loads(data) == value
    assert cbor.decode(data) == value


@given(st.floats(allow_nan=False))
def test_floats_use_the_shortest_exact_width(x):
    data = cbor.encode(x)
    assert cbor2.loads(data) == x and math.copysign(1, cbor2.loads(data)) == math.copysign(1, x)
    widths = {0xF9: 2, 0xFA: 4, 0xFB: 8}
    import struct

    for fmt, head, size in ((">e", 0xF9, 2), (">f", 0xFA, 4)):
        try:
            fits = struct.unpack(fmt, struct.pack(fmt, x))[0] == x
        except OverflowError:
            fits = False
        if fits:
            assert data[0] == head and len(data) == 1 + size
            break
    else:
        assert data[0] == 0xFB and widths[data[0]] == 8
