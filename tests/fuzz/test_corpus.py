"""Every crasher the fuzzer ever found (``fixtures/fuzz-corpus/``) now ends in a result or a
StatekitError."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import pytest

CASES = sorted(p for p in harness.CORPUS.glob("*") if p.is_file() and p.name != "README.md") \
    if harness.CORPUS.exists() else []


@pytest.mark.parametrize("path", CASES, ids=[p.name for p in CASES])
def test_corpus_case(path, tmp_path):
    case = tmp_path / path.name
    case.write_bytes(path.read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for choice in range(3):  # every output the fuzzer converts to: .pt, .bpk (adam), .safetensors
            harness.exercise(case, tmp_path, choice)
