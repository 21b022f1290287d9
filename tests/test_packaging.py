"""Packaging: extras declare ranges, constraints.txt pins what the suite runs with (issue 30).

statekit installs into environments that already hold torch and transformers: its extras must
never replace them (no ``==``), while the suite's own versions live in one constraints file that
README's test command and ``.ci/run`` both use.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT
from packaging.requirements import Requirement

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def constraints() -> dict[str, str]:
    """constraints.txt as {name: exact version}."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt pins exact versions: {line}"
            pins[req.name.lower()] = spec.version
    return pins


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^```sh\n(.*?)^```", text, re.M | re.S)
    assert block and text.index(block.group(0)) < text.index("\n## "), "README starts with its two commands"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_extras_declare_ranges_never_pins():
    for extra, reqs in EXTRAS.items():
        for text in reqs:
            req = Requirement(text)
            assert not any(s.operator in ("==", "===") for s in req.specifier), f"[{extra}] pins {text}"
    for text in PYPROJECT["project"]["dependencies"]:
        assert not any(s.operator in ("==", "===") for s in Requirement(text).specifier), text


def test_constraints_pin_a_version_every_extra_admits():
    """Each framework an extra names is pinned in constraints.txt, inside the extra's range."""
    pins = constraints()
    assert pins["torch"] == "2.13.0"  # the CPU wheel these machines hold
    for extra in ("torch", "hf"):
        for text in EXTRAS[extra]:
            req = Requirement(text)
            assert req.name.lower() in pins, f"constraints.txt has no pin for {req.name} ([{extra}])"
            assert req.specifier.contains(pins[req.name.lower()]), f"{text} excludes the tested {pins[req.name]}"


def test_readme_starts_with_install_and_run_then_install_and_test():
    first, second = readme_commands()[:2]
    assert first.startswith("pip install") and "statekit inspect fixtures/" in first
    install, _, test = second.partition(" && ")
    assert shlex.split(install)[:4] == ["pip", "install", "-c", "constraints.txt"]
    assert "pytest" in test


def test_ci_runs_exactly_the_readme_test_command():
    install, _, test = readme_commands()[1].partition(" && ")
    readme_args = shlex.split(install)[2:]  # after "pip install"
    ci = [shlex.split(line) for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    pip_lines = [c for c in ci if c[:4] == ["python3", "-m", "pip", "install"]]
    assert len(pip_lines) == 1
    assert [a for a in pip_lines[0][4:] if not a.startswith(("--quiet", "--disable-pip-version-check"))] == readme_args
    assert shlex.split(test) in ci


# ----------------------------------------------------------------------------- the wheel, alone


def _site_dirs_of(requirements: list[str]) -> list[str]:
    """The folders the running interpreter holds these distributions (and what they require) in."""
    from importlib import metadata

    seen: set[str] = set()
    dirs: list[str] = []
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.name.lower() in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(req.name.lower())
        dist = metadata.distribution(req.name)
        folder = str(dist.locate_file(""))
        if folder not in dirs:
            dirs.append(folder)
        todo += [Requirement(r) for r in dist.requires or []]
    return dirs


@pytest.mark.slow
def test_the_wheel_alone_runs_the_readmes_first_command(tmp_path):
    """``python -m build`` (sdist, then the wheel from it) prints no deprecation warning; the wheel,
    installed alone in a fresh venv (``--no-deps``: its dependencies are the ones already installed
    here, on a path line, so nothing is downloaded), runs README's first command from another folder
    and prints what the source tree prints."""
    src = tmp_path / "src"  # what the build reads, copied: the build writes build/ and *.egg-info beside it
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "statekit", src / "statekit", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)],
                           capture_output=True, text=True, timeout=600)
    log = built.stdout + built.stderr
    assert built.returncode == 0, log[-3000:]
    assert "deprecat" not in log.lower(), [line for line in log.splitlines() if "eprecat" in line]
    (wheel,) = dist.glob("statekit-*.whl")
    with zipfile.ZipFile(wheel) as zf:  # every module of the package, nothing else of the tree
        shipped = {n for n in zf.namelist() if not n.startswith("statekit-")}
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert shipped == {p.relative_to(ROOT).as_posix() for p in (ROOT / "statekit").rglob("*.py")}
    assert "License-Expression: MIT OR Apache-2.0" in meta.splitlines()
    requires = [Requirement(line.partition(":")[2]) for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and not [r for r in requires if any(s.operator in ("==", "===") for s in r.specifier)]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
                    "--no-index", "--disable-pip-version-check", str(wheel)], check=True, timeout=300)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = _site_dirs_of([str(r) for r in requires if not (r.marker and "extra" in str(r.marker))])
    (Path(site) / "statekit-test-deps.pth").write_text("\n".join(deps) + "\n")

    work = tmp_path / "work"  # a folder that is not the source tree, with the shipped fixture
    (work / "fixtures").mkdir(parents=True)
    shutil.copy(ROOT / "fixtures" / "hand-optim.bpk", work / "fixtures" / "hand-optim.bpk")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(COLUMNS="80", LC_ALL="C.UTF-8", PYTHONIOENCODING="utf-8")
    where = subprocess.run([str(py), "-c", "import statekit; print(statekit.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), where
    first = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("pip install"))
    command = shlex.split(first.partition(" && ")[2])
    assert command == ["statekit", "inspect", "fixtures/hand-optim.bpk"]
    ran = subprocess.run([str(venv / "bin" / command[0]), *command[1:]], cwd=work, env=env, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0 and not ran.stderr, ran.stderr
    here = subprocess.run([sys.executable, "-m", "statekit", *command[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert ran.stdout == here.stdout
    assert ran.stdout.startswith("fixtures/hand-optim.bpk: burnpack v1 · optimizer (adam/adamw) · 4 params")
