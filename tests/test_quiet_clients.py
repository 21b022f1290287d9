"""What the client libraries print is not statekit's output (issue 38, item 4).

With bitsandbytes installed (every QLoRA user), ``inspect`` of a LoRA folder printed bitsandbytes'
"Failed to load CPU gemm_4bit_forward from kernels-community …" lines: importing peft imports it.
Here a fake bitsandbytes on ``sys.path`` prints to stdout and stderr, writes to file descriptor 2,
warns and logs when imported; the real peft imports it as it would the real one. statekit's
output stays its own (its JSON parses, its stderr is empty); ``STATEKIT_DEBUG=1`` shows all of it,
under a line naming what was run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from conftest import FIXTURES, ROOT

from statekit import clients

FAKE = '''
import logging, os, sys, warnings
print("FAKE-BNB on stdout")
print("FAKE-BNB: Failed to load CPU gemm_4bit_forward from kernels-community", file=sys.stderr)
os.write(2, b"FAKE-BNB straight to file descriptor 2\\n")
warnings.warn("FAKE-BNB warns at import")
logging.getLogger("bitsandbytes.cextension").warning("FAKE-BNB logs at import")
__version__ = "0.50.2"
# what peft looks for when it wraps a model (isinstance checks): classes nothing is an instance of
import types
nn = types.SimpleNamespace(**{n: type(n, (), {}) for n in ("Linear8bitLt", "Linear4bit", "Params4bit", "Int8Params")})
'''
MESSAGES = ("FAKE-BNB on stdout", "FAKE-BNB: Failed to load CPU gemm_4bit_forward from kernels-community",
            "FAKE-BNB straight to file descriptor 2", "UserWarning: FAKE-BNB warns at import",
            "bitsandbytes.cextension: WARNING: FAKE-BNB logs at import")


def fake_package(root, name="bitsandbytes"):
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(FAKE)
    return root


def run(args, tmp_path, **env):
    """``python -m statekit ARGS`` in a fresh process with the fake bitsandbytes first on the path."""
    fake = fake_package(tmp_path / "site")
    full = {k: v for k, v in os.environ.items() if k != "STATEKIT_DEBUG"}
    full.update(PYTHONPATH=os.pathsep.join([str(fake), str(ROOT)]), HF_HUB_CACHE=str(FIXTURES / "finetune" / "hf-cache" / "hub"),
                **env)
    return subprocess.run([sys.executable, "-m", "statekit", *map(str, args)], capture_output=True, text=True,
                          env=full, cwd=ROOT, timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.hf
@pytest.mark.peft
def test_inspect_of_a_lora_folder_prints_nothing_of_what_bitsandbytes_prints(tmp_path):
    pytest.importorskip("peft")
    folder = FIXTURES / "finetune" / "lora" / "checkpoint-4"
    res = run(["inspect", "--json", folder], tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    shown = json.loads(res.stdout)  # the fake's stdout line broke the JSON on main
    assert shown["params"] and not any("unnamed" in w for w in shown["warnings"])
    table = run(["inspect", folder], tmp_path / "t")
    assert table.returncode == 0 and "FAKE-BNB" not in table.stdout + table.stderr


@pytest.mark.hf
@pytest.mark.peft
def test_statekit_debug_shows_what_the_client_libraries_printed(tmp_path):
    pytest.importorskip("peft")
    res = run(["inspect", "--json", FIXTURES / "finetune" / "lora" / "checkpoint-4"], tmp_path, STATEKIT_DEBUG="1")
    assert res.returncode == 0, res.stderr
    json.loads(res.stdout)
    assert "statekit: importing peft printed (shown because STATEKIT_DEBUG is set):" in res.stderr
    for message in MESSAGES:
        assert message in res.stderr, (message, res.stderr)


def test_quiet_holds_prints_descriptor_writes_warnings_and_log_records(tmp_path, monkeypatch, capfd):
    """In this process: a module imported inside the block prints, warns and logs; nothing reaches
    stdout or stderr (descriptors included); :func:`clients.held` has all of it."""
    monkeypatch.delenv("STATEKIT_DEBUG", raising=False)
    monkeypatch.syspath_prepend(str(fake_package(tmp_path, "fake_client_a")))
    with clients.quiet("importing fake_client_a"):
        import fake_client_a  # noqa: F401
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    what, text = clients.held()[-1]
    assert what == "importing fake_client_a"
    for message in MESSAGES:
        assert message in text, (message, text)


def test_quiet_shows_it_with_statekit_debug_and_lets_exceptions_through(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("STATEKIT_DEBUG", "1")
    monkeypatch.syspath_prepend(str(fake_package(tmp_path, "fake_client_b")))
    with pytest.raises(ZeroDivisionError), clients.quiet("importing fake_client_b"):
        import fake_client_b  # noqa: F401
        1 / 0  # noqa: B018
    out, err = capfd.readouterr()
    assert out == "" and err.startswith("statekit: importing fake_client_b printed (shown because STATEKIT_DEBUG")
    assert all(message in err for message in MESSAGES)


def test_a_stream_kept_from_inside_the_block_writes_where_stderr_did_once_it_is_over(capfd):
    """A logging handler a library makes at import holds the stream it found: after the block that
    stream passes writes on to the real stderr, and nothing of the block stays in it."""
    with clients.quiet("a handler made inside"):
        handler = logging.StreamHandler()  # (its stream: sys.stderr as the block has it)
        logger = logging.getLogger("statekit-test-kept-stream")
        logger.propagate = False
        logger.addHandler(handler)
        logger.warning("inside")
    try:
        logger.warning("after")
        handler.flush()
        out, err = capfd.readouterr()
        assert err == "after\n" and out == ""
    finally:
        logger.removeHandler(handler)


def test_a_block_inside_a_block_is_the_outer_ones(capfd):
    with clients.quiet("outer"):
        print("one")
        with clients.quiet("inner"):
            print("two")
    assert capfd.readouterr() == ("", "")
    assert clients.held()[-1] == ("outer", "one\ntwo\n")
