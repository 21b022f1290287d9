"""Every shell command and Python snippet in README.md and docs/ runs as written.

Each document runs top to bottom in its own temporary folder, which holds ``fixtures/`` (a link to
the shipped fixtures) and the placeholder files the docs name, resolved to shipped fixtures
(:data:`PLACEHOLDERS`). Run:

- ```` ```sh ```` blocks: every command line (``\\`` continues a line, ``&&`` chains);
- ```` ```text ```` transcripts: every ``$ `` line. A transcript showing ``statekit: error:``
  expects that error (exit 1, the same line); any other expects success (doctor/diff/verify-resume:
  the exit status the transcript shows), and each ``warning:``/``note:`` line it shows must be
  one the command prints;
- ```` ```python ```` blocks, each in a fresh namespace (:data:`SETUP` defines what a snippet takes
  from the reader's own program: a model, an optimizer, a writer's output).

Not run: installing (``pip``), the test suite itself (``pytest``), Rust, launcher lines that need a
cluster (``torchrun``, ``srun``, ``sbatch``) and blocks without a language.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, ROOT, run_cli

pytest.importorskip("torch")

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.M | re.S)
# A block whose fence says ``hf`` (```` ```sh hf ````) builds a model's definition with transformers
# (the hf extra, which CI installs): it runs where transformers is importable.
HAVE_HF = importlib.util.find_spec("transformers") is not None
# ``peft`` in the fence (```` ```sh hf peft ````): the block wraps a model with peft (the peft extra, CI installs it)
HAVE_PEFT = importlib.util.find_spec("peft") is not None
# A block whose fence says ``report`` draws report's HTML page with plotly (the report extra, which CI
# installs; the README's test command does not): it runs where plotly is importable.
HAVE_REPORT = importlib.util.find_spec("plotly") is not None
# A placeholder the docs use for the reader's own file → the shipped fixture that stands in for it.
PLACEHOLDERS = {
    "optim-10.bpk": "hand-optim.bpk",
    "model-10.bpk": "hand-model.bpk",
    "names.txt": "hand-names.txt",
    "model-v2.bpk": "lm-model-v2.bpk",
    "lm-optim.bpk": "lm-optim.bpk",
    "optimizer.safetensors": "candle/optimizer.safetensors",
    "model.safetensors": "candle/model.safetensors",
}
# Folders the docs name (sharded.md) → the shipped fixture folder copied in their place.
DIR_PLACEHOLDERS = {
    "ckpt": "dcp/ws2",
    "optimizer_0": "dcp/accelerate/optimizer_0",
    "ds_ckpt": "deepspeed/stage2",
    "ds_ckpt_universal": "deepspeed/stage2/universal",
}
SKIPPED = ("pip ", "python bench/", "python3 bench/", "python3 -m pytest", "python -m pytest", "torchrun ", "srun ", "sbatch ", "cargo ")
# What a snippet takes from the reader's own program, keyed by (document, the snippet's first line).
SETUP = {
    ("sharded.md", 'state = {"optimizer": get_optimizer_state_dict(model, opt)}'): """
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from statekit.cli import _run
assert _run(["convert", "fixtures/hand-optim.bpk", "out", "--optimizer", "adam", "--transpose", "*.weight"]) == 0
model = torch.nn.ModuleDict({"l1": torch.nn.Linear(4, 16), "l2": torch.nn.Linear(16, 1)})
opt = torch.optim.Adam(model.parameters())
""",
    ("streaming.md", "from statekit.stream import ordered, write_all"): """
import io
import numpy as np
from statekit.tensor import TensorRef
refs = [TensorRef.from_array(np.arange(n, dtype=np.float32)) for n in (3, 70000, 5)]
out = io.BytesIO()
pad = lambda i, ref: None
check = lambda i, ref, stream: None
""",
}


def blocks(doc: Path):
    text = doc.read_text(encoding="utf-8")
    for m in BLOCK.finditer(text):
        tags = m.group(2).split()
        if ("hf" in tags and not HAVE_HF) or ("report" in tags and not HAVE_REPORT) or ("peft" in tags and not HAVE_PEFT):
            continue
        yield m.group(1), m.group(3), text.count("\n", 0, m.start()) + 1


def commands(lang: str, body: str) -> list[tuple[str, list[str]]]:
    """(command, transcript lines shown after it) for a shell block or a transcript."""
    lines = body.splitlines()
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if lang == "text" and not line.startswith("$ "):
            if out:
                out[-1][1].append(line)
            i += 1
            continue
        cmd = line[2:] if line.startswith("$ ") else line
        while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
        if cmd.strip() and not cmd.lstrip().startswith("#"):
            out.append((cmd.strip(), []))
        i += 1
    return out


def torch_placeholders(folder: Path) -> None:
    """The reader's own torch files the docs name: an optimizer state of the shipped 4 → 16 → 1 MLP
    (``opt.pt``, as torch saves it: positions only), and for a refactor a Sequential whose second
    Linear moved from index 1 to 2 (``opt-seq.pt``, ``old-names.txt``, ``new-model.pt``)."""
    import torch

    torch.manual_seed(0)
    mlp = torch.nn.ModuleDict({"l1": torch.nn.Linear(4, 16), "l2": torch.nn.Linear(16, 1)})
    opt = torch.optim.Adam(mlp.parameters())
    mlp["l2"](mlp["l1"](torch.randn(8, 4))).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), folder / "opt.pt")
    torch.save(mlp.state_dict(), folder / "mlp-model.pt")  # its weights (sharded.md's universal output)
    old = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(old.parameters())
    old(torch.randn(8, 4)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), folder / "opt-seq.pt")
    (folder / "old-names.txt").write_text("\n".join(n for n, _ in old.named_parameters()) + "\n")
    new = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.save(new.state_dict(), folder / "new-model.pt")


def prepare(folder: Path, doc: Path) -> None:
    (folder / "fixtures").symlink_to(FIXTURES)
    for name, fixture in PLACEHOLDERS.items():
        shutil.copyfile(FIXTURES / fixture, folder / name)
    if doc.name == "sharded.md":
        for name, fixture in DIR_PLACEHOLDERS.items():
            shutil.copytree(FIXTURES / fixture, folder / name)
    torch_placeholders(folder)
    if doc.name == "resume-after-refactor.md":  # its opt.pt is the Sequential's
        shutil.copyfile(folder / "opt-seq.pt", folder / "opt.pt")


def run_shell(cmd: str, folder: Path):
    if all(op not in cmd for op in ("|", ">", "<", "$(", "`")) and cmd.startswith("statekit "):
        return run_cli(*shlex.split(cmd, comments=True)[1:], cwd=folder)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    exe = shutil.which("statekit")
    if exe is None:  # statekit not installed as a script: run the module
        cmd = re.sub(r"(^|&& *)statekit ", rf"\1{sys.executable} -m statekit ", cmd)
    cmd = re.sub(r"(^|&& *)python3? ", rf"\1{sys.executable} ", cmd)
    return subprocess.run(["bash", "-c", cmd], cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def flat(text: str) -> str:
    return " ".join(text.split())


def check_transcript(cmd: str, shown: list[str], res, where: str) -> None:
    out = res.stdout + res.stderr
    errors = [s for s in shown if s.startswith("statekit: error:")]
    if errors:
        assert res.returncode == 1, f"{where}: {cmd} was expected to fail: {out}"
        assert flat(errors[0]) in flat(res.stderr), f"{where}: the docs show {errors[0]!r}, statekit printed {res.stderr!r}"
        return
    expected = 0
    if any("DIVERGES" in s for s in shown) or any(re.search(r"\d+ problems? \(", s) for s in shown):
        expected = 1
    assert res.returncode == expected, f"{where}: {cmd} exited {res.returncode}: {out}"
    for s in shown:
        if s.startswith(("warning:", "note:")):
            assert flat(s) in flat(out), f"{where}: the docs show {s!r}, which {cmd} no longer prints:\n{out}"


def run_python(code: str, folder: Path, where: str) -> None:
    saved = os.getcwd()
    os.chdir(folder)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__doc__"})  # noqa: S102 - the docs' own code
    finally:
        os.chdir(saved)


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_and_snippet_runs(doc, tmp_path):
    prepare(tmp_path, doc)
    ran = 0
    for lang, body, line in blocks(doc):
        where = f"{doc.relative_to(ROOT)}:{line}"
        if lang in ("sh", "bash", "text"):
            for cmd, shown in commands(lang, body):
                if cmd.startswith(SKIPPED):
                    continue
                parts = [c.strip() for c in cmd.split("&&")] if cmd.startswith("pip ") is False else [cmd]
                parts = [c for c in parts if not c.startswith(SKIPPED)]
                for part in parts:
                    res = run_shell(part, tmp_path)
                    assert "Traceback" not in res.stderr and "internal error" not in res.stderr, f"{where}: {res.stderr}"
                    if lang == "text":
                        check_transcript(part, shown, res, where)
                    else:
                        assert res.returncode == 0, f"{where}: {part} exited {res.returncode}:\n{res.stdout}{res.stderr}"
                    ran += 1
        elif lang == "python":
            first = body.strip().splitlines()[0]
            run_python(SETUP.get((doc.name, first), "") + body, tmp_path, where)
            ran += 1
    if doc.name in ("README.md", "converting.md", "python-api.md", "training-checkpoints.md"):
        assert ran, f"{doc.name}: nothing ran"


@pytest.mark.parametrize("content", [b"NRUB\x01", b"BURN" + b"\x00" * 60, b"NRUB\x02\x00" + b"\x00" * 60],
                         ids=["short", "magic", "version"])
def test_burnpack_refusals_read_as_the_docs_show(tmp_path, content):
    """docs/burnpack.md's table of refusals shows what the command line prints."""
    rows = re.findall(r"^\| [^|]+ \| `([^`]+)`", (ROOT / "docs" / "burnpack.md").read_text(), re.M)
    (tmp_path / "x.bpk").write_bytes(content)
    res = run_cli("inspect", tmp_path / "x.bpk")
    printed = res.stderr.split(": ", 2)[-1].strip()
    assert res.returncode == 1
    assert any(printed.startswith(row.split(" …")[0].split("…")[0]) for row in rows), (printed, rows)
