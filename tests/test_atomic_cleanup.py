"""Temporary output files: a killed run's is removed by the next run to the same destination;
SIGTERM cleans up like Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from statekit.atomic import remove_stale

ROOT = Path(__file__).resolve().parent.parent

WRITER = textwrap.dedent("""
    import sys, time
    from statekit.atomic import atomic_write, exit_cleanly_on_sigterm
    if sys.argv[2] == "term":
        exit_cleanly_on_sigterm()
    with atomic_write(sys.argv[1]) as fh:
        fh.write(b"x" * 100_000)
        print("writing", flush=True)
        time.sleep(60)
""")


def start_writer(dst: Path, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(dst), mode], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "writing"
    return proc


def temp_files(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.") and p.suffix == ".tmp")


def test_a_killed_runs_temp_file_is_gone_after_the_next_run(tmp_path, cli, fixtures):
    dst = tmp_path / "out.bpk"
    proc = start_writer(dst, "kill")
    left = temp_files(dst)
    assert len(left) == 1 and f"-{proc.pid}." in left[0]
    proc.kill()
    proc.wait()
    assert temp_files(dst) == left  # SIGKILL leaves it behind …
    result = cli("convert", fixtures / "hand-optim.bpk", dst)
    assert result.returncode == 0, result.stderr
    assert temp_files(dst) == []  # … and the next run to the same destination removes it
    assert dst.read_bytes() == (fixtures / "hand-optim.bpk").read_bytes()


def test_a_live_writers_temp_file_is_kept(tmp_path):
    dst = tmp_path / "out.pt"
    proc = start_writer(dst, "kill")
    try:
        left = temp_files(dst)
        assert remove_stale(dst) == []
        assert temp_files(dst) == left
        other = tmp_path / ".other.pt.statekit-x-1.abc.tmp"  # another destination's: not ours to judge
        other.write_bytes(b"")
        assert remove_stale(dst) == [] and other.exists()
    finally:
        proc.kill()
        proc.wait()
    assert remove_stale(dst) == left


def test_sigterm_removes_the_temp_file(tmp_path):
    dst = tmp_path / "out.safetensors"
    proc = start_writer(dst, "term")
    assert len(temp_files(dst)) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert temp_files(dst) == [] and not dst.exists()
