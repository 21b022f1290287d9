"""Nothing hidden: a per-parameter entry statekit does not understand (a nested dict, an object that
is not a tensor) is shown as such with its keys, doctor and convert refuse it naming it, and the
family is a name or "unknown (…)", never blank. The files are written by real torch in the test."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")


def _state(path, weird: dict) -> None:
    """A torch AdamW state after one step, with ``weird`` entries added to parameter 0."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0].update(weird)
    torch.save(sd, path)


@pytest.fixture
def nested(tmp_path):
    path = tmp_path / "nested.pt"
    _state(path, {"hidden": {"codes": torch.zeros(3, 4, dtype=torch.uint8), "scale": torch.ones(2), "n": 7}})
    return path


@pytest.fixture
def with_set(tmp_path):
    path = tmp_path / "set.pt"
    _state(path, {"tags": {1, 2}})
    return path


def test_nested_dict_is_shown_with_its_keys(cli, nested):
    d = json.loads(cli("inspect", str(nested), "--json").stdout)
    field = d["params"][0]["fields"]["hidden"]
    assert field["understood"] is False and field["type"] == "dict" and field["keys"] == ["codes", "scale", "n"]
    assert field["entries"]["codes"] == {"shape": [3, 4], "dtype": "U8"}
    assert field["entries"]["n"] == {"value": 7}
    assert d["tensors"] == 8  # 2 params × (2 moments + a step tensor), and the 2 nested ones
    assert any("hidden" in w and "codes, scale, n" in w for w in d["warnings"])
    # the other parameter still reads as AdamW state; the family is never blank
    assert d["family"].startswith("unknown (") and "hidden" in d["family"]
    assert all(p["family"] for p in d["params"])
    table = cli("inspect", nested.name, cwd=nested.parent).stdout  # relative: tmp_path's length wraps nothing
    assert "hidden {codes, scale, n} (not understood)" in table and "family: unknown (" in table


def test_nested_tensors_are_counted(cli, nested, tmp_path):
    plain = tmp_path / "plain.pt"
    _state(plain, {})
    a = json.loads(cli("inspect", str(plain), "--json").stdout)
    b = json.loads(cli("inspect", str(nested), "--json").stdout)
    assert b["tensors"] == a["tensors"] + 2 and b["bytes"] == a["bytes"] + 12 + 8


def test_doctor_refuses_what_it_does_not_understand(cli, nested, with_set):
    for path, what in ((nested, "hidden (a dict (codes, scale, n))"), (with_set, "tags (a set)")):
        r = cli("doctor", str(path), "--json")
        assert r.returncode == 1
        d = json.loads(r.stdout)
        [f] = [f for f in d["findings"] if f["check"] == "opaque"]
        assert f["severity"] == "error" and f["param"] == "#0" and what in f["message"]


@pytest.mark.parametrize("command", [("convert", "{src}", "{out}.bpk"), ("convert", "{src}", "{out}.pt"),
                                     ("merge", "{src}", "{src}", "-o", "{out}.pt"),
                                     ("split", "{src}", "--into", "a=#0", "-o", "{out}"),
                                     ("verify-resume", "{src}", "{src}", "--optimizer", "adamw")])
def test_operations_refuse_it_by_name(cli, nested, tmp_path, command):
    out = tmp_path / "out"
    args = [a.format(src=nested, out=out) for a in command]
    r = cli(*args)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "does not understand" in r.stderr and "parameter #0: hidden (a dict (codes, scale, n))" in r.stderr
    assert not list(tmp_path.glob("out*"))


def test_a_list_of_tensors_is_understood(cli, tmp_path):
    """L-BFGS keeps lists of tensors: a known shape of value, not flagged."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.LBFGS(model.parameters(), history_size=3)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    path = tmp_path / "lbfgs.pt"
    torch.save(opt.state_dict(), path)
    d = json.loads(cli("inspect", str(path), "--json").stdout)
    assert d["family"] == "lbfgs" and not any("does not understand" in w for w in d["warnings"])
