import pytest
from hypothesis import given
from hypothesis import strategies as st

from statekit import paramid

# Pairs verified against burn's own output (burn-formats.md §1.9 and §3).
KNOWN = [
    (18402649998147242804, "6j5mg0dcb1hvu"),
    (9505838338724798577, "e4gfnnsqgnlo6"),
    (10777079075451239370, "pbtp1m2hs27pa"),
    (9562590261885004638, "brlk7b1d4mqo8"),
]


@pytest.mark.parametrize(("value", "text"), KNOWN)
def test_known_ids(value, text):
    assert paramid.to_display(value) == text
    assert paramid.from_display(text) == value
    assert paramid.parse(text.upper()) == value
    assert paramid.parse(str(value)) == value


def test_zero_and_max():
    assert paramid.to_display(0) == "0000000000000"
    assert paramid.from_display(paramid.to_display(2**64 - 1)) == 2**64 - 1


def test_short_legacy_ids_zero_extend():
    # 6-byte ids from older burn: 10 characters, the upper two bytes zero.
    value = int.from_bytes(bytes([1, 2, 3, 4, 5, 6]), "little")
    text = paramid.to_display(value)[:10]
    assert paramid.from_display(text) == value


@pytest.mark.parametrize("bad", ["", "xyz", "6j5mg0dcb1hvw", "18446744073709551616", "-1", "6j5mg0dcb1hv"])
def test_rejects_bad_spellings(bad):
    with pytest.raises(ValueError):
        paramid.parse(bad)


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_roundtrip(value):
    text = paramid.to_display(value)
    assert len(text) == 13
    assert paramid.from_display(text) == value


def test_display_form_is_base64s_base32hex_of_the_little_endian_bytes():
    """to_display computes on the integer; the standard library's encoder is the reference."""
    import base64
    import random

    rng = random.Random(13)
    values = [0, 1, 31, 32, 2**63, 2**64 - 1] + [rng.getrandbits(rng.randint(1, 64)) for _ in range(20000)]
    for value in values:
        expected = base64.b32hexencode(value.to_bytes(8, "little")).decode().lower().rstrip("=")
        assert paramid.to_display(value) == expected
        assert paramid.from_display(expected) == value
