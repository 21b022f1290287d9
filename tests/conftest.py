import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the installed CLI as a user would (a fresh process)."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("STATEKIT_DEBUG", None) if not env or "STATEKIT_DEBUG" not in env else None
    exe = shutil.which("statekit")
    cmd = [exe] if exe else [sys.executable, "-m", "statekit"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=full_env,
                          cwd=cwd or ROOT, timeout=120)


@pytest.fixture
def cli():
    return run_cli
