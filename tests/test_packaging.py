"""Packaging: extras declare ranges, constraints.txt pins what the suite runs with (issue 30).

statekit installs into environments that already hold torch and transformers: its extras must
never replace them (no ``==``), while the suite's own versions live in one constraints file that
README's test command and ``.ci/run`` both use.
"""

from __future__ import annotations

import re
import shlex
import tomllib

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
