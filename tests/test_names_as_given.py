"""File names and parameter names are bytes the user chose: written as given or refused in one
line, never an internal error, and what statekit writes it reads back (issue 29).

- An output path that is not UTF-8 (``$'\\xff'state.pt``: Python holds it as ``'\\udcffstate.pt'``)
  ended in "internal error: UnicodeEncodeError" (the .pt archive folder, DeepSpeed's
  ``latest_universal``); printing such a name did too wherever stdout's errors are ``strict`` (a
  UTF-8 locale other than C.UTF-8, ``PYTHONIOENCODING``), and a terminal whose encoding is not UTF-8
  could not print statekit's own ``·`` and ``×``.
- A parameter name holding a lone surrogate (bytes from the command line that are no UTF-8) ended
  in UnicodeEncodeError in the safetensors, burnpack and candle writers, and the ``.pt`` writer
  wrote it into a file statekit's reader then refused. UTF-8 is what every format statekit writes
  holds, so such a name is refused, named, before anything is written.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
from conftest import FIXTURES, ROOT

import statekit
from statekit.errors import StatekitError

HAND = FIXTURES / "hand-optim.bpk"
TORCH_NAMES = ["--names", FIXTURES / "hand-names.txt", "--transpose", "*.weight", "--optimizer", "adam"]
FF = os.fsdecode(b"\xff")  # the byte 0xff of a file name, as Python holds it ('\udcff')
OUTPUTS = [("state.pt", TORCH_NAMES), ("state.safetensors", []), ("state.bpk", []),
           ("state-dcp", TORCH_NAMES), ("c.safetensors", ["--to", "candle", *TORCH_NAMES[:4], "--optimizer", "adamw"]),
           ("b.pt", ["--to", "bnb", *TORCH_NAMES])]


def listing(folder) -> list[bytes]:
    return sorted(os.listdir(os.fsencode(folder)))


@pytest.mark.parametrize(("name", "extra"), OUTPUTS, ids=[n for n, _ in OUTPUTS])
def test_an_output_name_that_is_not_utf8_is_written_as_given_and_read_back(tmp_path, cli, name, extra):
    out = tmp_path / (FF + name)
    r = cli("convert", HAND, out, *extra)
    assert r.returncode == 0, r.stderr
    assert listing(tmp_path) == [b"\xff" + name.encode()]  # the bytes given, nothing else
    assert f"wrote {out}" in r.stdout  # printed as given (the bytes, read back here as the same str)
    back = cli("inspect", out, "--json")
    assert back.returncode == 0, back.stderr
    assert len(statekit.inspect(str(out))["params"]) == 4


def test_a_pt_named_so_is_the_archive_torch_writes(tmp_path, cli):
    """torch.save names the zip's folder after the file, or "archive" when the path is not ASCII."""
    torch = pytest.importorskip("torch")
    for name in (FF + "state.pt", "é.pt", "plain.pt"):
        ours, theirs = tmp_path / name, tmp_path / f"torch-{name}"
        assert cli("convert", HAND, ours, *TORCH_NAMES).returncode == 0
        torch.save(torch.load(ours, weights_only=True), theirs)
        with zipfile.ZipFile(ours) as a, zipfile.ZipFile(theirs) as b:
            folder = a.namelist()[0].split("/")[0]
            assert folder == ("plain" if name == "plain.pt" else "archive")
            assert folder == b.namelist()[0].split("/")[0] or name == "plain.pt"


def test_a_universal_checkpoint_folder_named_so(tmp_path, cli):
    out = tmp_path / (FF + "universal")
    r = cli("convert", FIXTURES / "deepspeed" / "stage2", out, "--to", "deepspeed-universal")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "latest_universal").read_bytes() == b"\xffuniversal"  # the folder's bytes, as given
    assert cli("inspect", out).returncode == 0


@pytest.mark.parametrize("encoding", ["utf-8:strict", "ascii", "latin-1"])
def test_the_command_line_prints_any_name_on_any_terminal_encoding(tmp_path, encoding):
    """A fresh process whose stdout is strict UTF-8 (a UTF-8 locale other than C.UTF-8), ASCII (the
    C locale without UTF-8 mode) or Latin-1: names come out as their bytes, statekit's own
    characters the encoding lacks as escapes; never an internal error."""
    src = tmp_path / (FF + "h.bpk")
    src.write_bytes(HAND.read_bytes())
    env = {**os.environ, "PYTHONIOENCODING": encoding, "PYTHONPATH": str(ROOT)}
    for args in (["inspect", src], ["doctor", src], ["inspect", tmp_path / (FF + "missing.bpk")]):
        done = subprocess.run([sys.executable, "-m", "statekit", *map(str, args)], capture_output=True, env=env,
                              stdin=subprocess.DEVNULL, timeout=120)
        assert b"internal error" not in done.stderr, done.stderr
        assert done.returncode == (1 if "missing" in str(args[1]) else 0), done.stderr
        assert b"\xffh.bpk" in done.stdout or b"\xffmissing.bpk" in done.stderr


@pytest.mark.parametrize(("name", "extra"), OUTPUTS, ids=[n for n, _ in OUTPUTS])
def test_a_parameter_name_that_is_not_utf8_is_refused_by_name(tmp_path, cli, name, extra):
    """``--rename`` with bytes that are no UTF-8 (argv holds them as lone surrogates)."""
    rename = ["--rename", r"^l1\.weight$=l1.w" + FF + "eight"]
    r = cli("convert", HAND, tmp_path / name, *extra, *rename)
    errors = [line for line in r.stderr.splitlines() if line.startswith("statekit: error:")]
    assert r.returncode == 1 and len(errors) == 1 and r.stderr.endswith(errors[0] + "\n"), r.stderr
    assert "internal error" not in r.stderr
    if "--names" in extra and "candle" not in extra:  # torch pairs by position from the names list, which lacks it
        assert "not among the target's parameters" in r.stderr
    else:
        assert "\\udcff" in r.stderr and "cannot be written as UTF-8" in r.stderr
    assert listing(tmp_path) == []


def test_a_renamed_torch_state_is_refused_before_writing_what_statekit_would_not_read(tmp_path, cli):
    """torch → torch keeps the names: the .pt writer wrote the lone surrogate, and reading that
    file back was refused ("pickled string … holds a lone surrogate")."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.named_parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "named.pt")
    for out in ("r.pt", "r.safetensors", "r-dcp", "r.bpk"):
        args = ["--transpose", "*.weight"] if out.endswith(".bpk") else []
        r = cli("convert", tmp_path / "named.pt", tmp_path / out, "--rename", r"^0\.weight$=0.w" + FF, *args)
        assert r.returncode == 1 and "cannot be written as UTF-8" in r.stderr and "0.w\\udcff" in r.stderr, r.stderr
        assert listing(tmp_path) == [b"named.pt"]
    with pytest.raises(StatekitError, match="lone surrogate"):
        statekit.convert(tmp_path / "named.pt", tmp_path / "api.pt", rename=["^0\\.bias$=0.b\ud800"])
    assert listing(tmp_path) == [b"named.pt"]


def test_a_nul_in_an_api_path_is_a_usage_error(tmp_path):
    """No file name holds a NUL (no command line can pass one); an API string can: it was os's
    ValueError "embedded null byte", not a StatekitError."""
    from statekit.errors import UsageError

    with pytest.raises(UsageError, match="cannot hold a NUL byte"):
        statekit.inspect(str(tmp_path / "a\0.bpk"))
    with pytest.raises(UsageError, match="cannot hold a NUL byte"):
        statekit.convert(HAND, str(tmp_path / "o\0.safetensors"))
    assert listing(tmp_path) == []
