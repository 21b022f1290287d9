"""bitsandbytes optimizer states, as bitsandbytes 0.50.2 wrote them (``fixtures/bnb/``, written by
``scripts/make_bnb_fixtures.py``; bitsandbytes' own dequantized moments and quantizer outputs are in
the ``*.ref.npz`` beside them). bitsandbytes is not needed here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BNB = Path(__file__).resolve().parent.parent / "fixtures" / "bnb"
STATES = sorted(p.name for p in BNB.glob("*.pt") if p.name != "torch-adamw.pt")


def test_the_fixture_set_is_there():
    assert len(STATES) >= 13 and "adamw8bit.pt" in STATES and "paged_adamw8bit.pt" in STATES


@pytest.mark.parametrize("name", STATES)
def test_no_state_is_shown_as_empty(cli, name):
    """The silent wrong answer of issue 19: nested state read as "0 tensors", rows "(no state)"."""
    d = json.loads(cli("inspect", f"fixtures/bnb/{name}", "--json").stdout)
    assert d["tensors"] >= 8 and d["bytes"] > 20_000
    assert d["family"] and all(p["family"] for p in d["params"])
    assert all(p["fields"] for p in d["params"])
    assert "(no state)" not in cli("inspect", f"fixtures/bnb/{name}").stdout
