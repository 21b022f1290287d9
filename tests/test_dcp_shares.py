"""Several processes write one DCP output: ``--shard I/N``, torchrun, SLURM; finalize; resume.

Every process plans the same conversion and writes only its parts; the last to finish writes
``.metadata``. The reference is the same conversion run by one process: the directories must be
byte-identical. The input is a checkpoint real torch wrote (fixtures/dcp/ws2, FSDP2 at world 2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from statekit.errors import FormatError, UsageError
from statekit.formats import dcp
from statekit.ops import shares
from tests.conftest import FIXTURES, ROOT

SRC = FIXTURES / "dcp" / "ws2"


def _cli(*args, env=None, check=True):
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_ARRAY_TASK_ID"):
        if not env or name not in env:
            full.pop(name, None)
    r = subprocess.run([sys.executable, "-m", "statekit", *map(str, args)], capture_output=True, text=True,
                       env=full, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _files(directory):
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory)) if not n.endswith(".part.json")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "ckpt"
    _cli("convert", SRC, out, "--shards", "4")
    assert sorted(os.listdir(out)) == [".metadata"] + [f"__{i}_0.distcp" for i in range(4)]
    return _files(out)


def test_four_processes_with_shard_flags_write_what_one_process_writes(tmp_path, reference):
    out = tmp_path / "ckpt"
    procs = [subprocess.Popen([sys.executable, "-m", "statekit", "convert", str(SRC), str(out), "--shard", f"{i}/4"],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert _files(out) == reference
    # whichever finished last wrote .metadata; every process said what it did
    assert sum("wrote " + str(out) + "/.metadata" in o for o, _ in outputs) >= 1


@pytest.mark.slow
def test_torchrun_shares_come_from_rank_and_world_size(tmp_path, reference):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    out = tmp_path / "ckpt"
    r = subprocess.run([torchrun, "--nproc-per-node", "4", "--master-port", "0", "-m", "statekit", "convert",
                        str(SRC), str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert _files(out) == reference
    assert "torchrun (RANK/WORLD_SIZE)" in r.stdout + r.stderr


KILLER = """
import os, signal, sys
from statekit.formats import torch_pt
real, calls = torch_pt.write_pt_stream, [0]
def dying(fh, obj, folder="archive"):
    calls[0] += 1
    if calls[0] == 3:  # mid-file: two archives written, a third begun
        fh.write(b"PK\\x03\\x04 half an archive"); fh.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fh, obj, folder)
torch_pt.write_pt_stream = dying
from statekit.cli import main
sys.argv = ["statekit", *sys.argv[1:]]
main()
"""


def test_a_share_killed_mid_write_is_completed_by_a_rerun(tmp_path, reference):
    out = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", KILLER, "convert", str(SRC), str(out), "--shard", "1/4"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9
    assert any(n.endswith(".tmp") for n in os.listdir(out)) and not (out / "__1_0.distcp").exists()
    for i in (0, 2, 3):
        r = _cli("convert", SRC, out, "--shard", f"{i}/4")
    assert "waiting for parts [1]" in r.stdout + r.stderr and not (out / ".metadata").exists()
    r = _cli("finalize", out, check=False)
    assert r.returncode == 1 and "part 1 of 4 is missing" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _cli("convert", SRC, out, "--shard", "1/4")  # the rerun
    assert "wrote parts [1]" in r.stdout + r.stderr and ".metadata" in r.stdout + r.stderr
    assert not any(n.endswith(".tmp") for n in os.listdir(out))
    assert _files(out) == reference
    r = _cli("convert", SRC, out, "--shard", "2/4")  # a second rerun skips its finished part
    assert "skipped [2]" in r.stdout + r.stderr
    assert _files(out) == reference


def test_finalize_refuses_a_part_of_another_plan(tmp_path):
    out = tmp_path / "ckpt"
    for i in range(2):
        _cli("convert", SRC, out, "--shard", f"{i}/2")
    manifest = out / "__1_0.distcp.part.json"
    manifest.write_text(manifest.read_text().replace('"plan": "', '"plan": "0'))
    with pytest.raises(FormatError, match="another plan"):
        dcp.finalize(out)


@pytest.mark.parametrize(("env", "expected"), [
    ({"RANK": "2", "WORLD_SIZE": "4"}, (2, 4)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (5, 8)),
    ({"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_COUNT": "4"}, (2, 4)),
    ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (1, 2)),
    ({}, None),
])
def test_shares_from_launcher_variables(env, expected):
    got = shares.from_environment(env)
    assert (None if got is None else (got.index, got.count)) == expected


@pytest.mark.parametrize("text", ["4/4", "1", "a/b", "-1/2", "0/0"])
def test_bad_shard_flags_are_usage_errors(text):
    with pytest.raises(UsageError):
        shares.parse(text)


def test_balanced_assignment_of_parts_by_bytes():
    from statekit.tensor import TensorRef

    items = [dcp.Item(f"t{i}", (f"t{i}",), TensorRef("F32", (n,))) for i, n in enumerate([100, 90, 40, 30, 20, 10])]
    groups = [[it] for it in items]
    parts = dcp.assign(groups, 2)
    loads = [sum(items[i].value.nbytes for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(6)) and abs(loads[0] - loads[1]) <= 40
