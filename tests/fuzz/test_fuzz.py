"""The fuzz suite: format-aware mutations of real files for every reader group, through the API.

Every case must end in a result or a StatekitError (see ``harness.exercise``). CI runs a bounded
number of cases per group (about 40–60 s in all on two cores); ``scripts/fuzz.py --cases N`` runs
long campaigns with time and memory limits and keeps crashers under ``fixtures/fuzz-corpus/``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# cases per group in CI, by how long a case of the group takes
EXAMPLES = {"burnpack": 600, "msgpack": 700, "bincode": 700, "gzip": 450, "torch-zip": 700, "torch-legacy": 700,
            "safetensors": 600}


@pytest.mark.slow
@pytest.mark.parametrize("group", harness.GROUPS)
def test_mutated_files_end_in_a_result_or_a_statekit_error(group, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(group)

    @settings(max_examples=EXAMPLES[group], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 2**32 - 1))
    def case(seed):
        path = workdir / f"case{harness.EXTENSIONS[group]}"
        path.write_bytes(harness.make_case(group, seed))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy on NaN/Inf statistics
            harness.exercise(path, workdir, seed)

    case()


def test_every_group_has_seeds():
    for group in harness.GROUPS:
        assert harness.seeds(group), group


def test_mutators_are_deterministic():
    for group in harness.GROUPS:
        assert harness.make_case(group, 7) == harness.make_case(group, 7)
