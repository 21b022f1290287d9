"""The console script asks numpy's OpenBLAS for one thread for the commands that multiply no
matrices (statekit.entry.one_blas_thread): its idle workers spin at start-up and take a core."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from statekit.entry import MATRIX_COMMANDS, one_blas_thread


@pytest.mark.parametrize("args", [["convert", "a.bpk", "b.pt"], ["inspect", "x.pt"], ["diff", "a", "b"], ["remap"],
                                  ["merge"], ["doctor"], ["--help"], []])
def test_commands_that_move_bytes_get_one_blas_thread(args):
    env: dict[str, str] = {}
    one_blas_thread(args, env)
    assert env == {"OPENBLAS_NUM_THREADS": "1"}


@pytest.mark.parametrize("command", ["replay", "verify-resume"])
def test_commands_with_matrix_steps_keep_every_thread(command):
    env: dict[str, str] = {}
    one_blas_thread([command, "optim.bpk"], env)
    assert env == {} and command in MATRIX_COMMANDS


def test_the_users_own_choice_is_kept():
    env = {"OPENBLAS_NUM_THREADS": "8"}
    one_blas_thread(["convert"], env)
    assert env == {"OPENBLAS_NUM_THREADS": "8"}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts the threads of a process in /proc, on more than one core")
def test_numpy_then_starts_no_blas_workers():
    """In a fresh interpreter: numpy imported after one_blas_thread(["convert"]) runs fewer
    threads than numpy imported for ``replay`` (OpenBLAS's workers, one per further core)."""
    code = ("import os, sys; from statekit.entry import one_blas_thread; one_blas_thread(sys.argv[1:]); "
            "import numpy; print(len(os.listdir('/proc/self/task')))")
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    counts = {cmd: int(subprocess.run([sys.executable, "-c", code, cmd], capture_output=True, text=True, env=env,
                                      check=True).stdout) for cmd in ("convert", "replay")}
    assert counts["convert"] == 1 and counts["replay"] > 1
