"""``statekit report``: its numbers against numpy's computation of the formulas on states real torch
wrote (``fixtures/report``, ``scripts/make_report_fixtures.py``: an ε-dominated tensor, a reset
tensor, a NaN), its findings, ``--against``, ``--weights``, the terminal view's width, and every
optimizer fixture statekit reads."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import FIXTURES

REPORT = FIXTURES / "report"
SICK = {"hidden.2.weight": "eps", "hidden.1.weight": "reset", "head.weight": "nonfinite"}


def _json(cli, *args) -> dict:
    r = cli("report", *map(str, args), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def torch_state():
    """b.pt and model.pt read by torch itself: path → (step, m, v, w) as float64 arrays."""
    torch = pytest.importorskip("torch")
    state = torch.load(REPORT / "b.pt", weights_only=True)
    model = torch.load(REPORT / "model.pt", weights_only=True)
    group = state["param_groups"][0]
    out = {}
    for index, name in zip(group["params"], group["param_names"], strict=True):
        s = state["state"][index]
        out[name] = (float(s["step"]), s["exp_avg"].double().numpy().reshape(-1),
                     s["exp_avg_sq"].double().numpy().reshape(-1), model[name].double().numpy().reshape(-1))
    return out, group


@pytest.fixture(scope="module")
def full(cli_module):
    return _json(cli_module, REPORT / "b.pt", "--weights", REPORT / "model.pt", "--against", REPORT / "a.pt")


@pytest.fixture(scope="module")
def cli_module():
    from conftest import run_cli

    return run_cli


@pytest.mark.torch
def test_numbers_equal_numpy_of_the_formulas(full, torch_state):
    params, group = torch_state
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    by_path = {t["path"]: t for t in full["tensors"]}
    assert set(by_path) == set(params)
    for path, (step, m, v, w) in params.items():
        t = by_path[path]
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        assert t["step"] == step and t["numel"] == m.size and t["family"] == "adamw"
        # fractions: exactly
        assert t["m_zero_fraction"] == np.mean(m == 0)
        assert t["v_zero_fraction"] == np.mean(v == 0)
        assert t["eps_fraction"] == np.mean(np.sqrt(v / bc2) < eps)
        assert t["nonfinite"] == int((~np.isfinite(m)).sum() + (~np.isfinite(v)).sum())
        ok = np.isfinite(m) & np.isfinite(v)
        m, v, w = m[ok], v[ok], w[ok]
        u = (m / bc1) / (np.sqrt(v / bc2) + eps)
        rms = lambda x: float(np.sqrt(np.mean(x * x)))  # noqa: E731
        assert t["update_rms"] == pytest.approx(rms(u), rel=1e-4)
        assert t["m_rms"] == pytest.approx(rms(m), rel=1e-4)
        assert t["v_sqrt_mean"] == pytest.approx(math.sqrt(v.mean()), rel=1e-4)
        assert t["w_rms"] == pytest.approx(rms(w), rel=1e-4)
        assert t["update_weight_ratio"] == pytest.approx(lr * rms(u + wd * w) / rms(w), rel=1e-4)
        eff = np.log10(lr / (np.sqrt(v / bc2) + eps))
        for key, q in (("p5", 5), ("p50", 50), ("p95", 95)):
            assert abs(t["eff_lr_log10"][key] - np.percentile(eff, q, method="inverted_cdf")) < 0.05, (path, key)
            if eff.size >= 1000:
                assert abs(t["eff_lr_log10"][key] - np.percentile(eff, q)) < 0.05, (path, key)
        hist = t["v_hat_sqrt_log10_hist"]
        assert sum(hist["counts"]) + hist["zeros"] == int((v >= 0).sum())
        logs = np.log10(np.sqrt(v[v > 0] / bc2))
        assert hist["lo"] <= logs.min() + 0.05 and hist["lo"] + len(hist["counts"]) * hist["width"] >= logs.max() - 0.05


def test_findings_name_exactly_the_sick_tensors(full):
    named = {f["path"] for f in full["findings"]}
    assert named == set(SICK)
    checks = {(f["path"], f["check"]) for f in full["findings"]}
    for path, check in SICK.items():
        assert (path, check) in checks
    nan = [f for f in full["findings"] if f["check"] == "nonfinite"]
    assert [f["severity"] for f in nan] == ["error"] and full["findings"][0] == nan[0]
    assert full["common_step"] == 60


def test_against_flags_exactly_the_reset_tensor(full, cli_module):
    compared = [f for f in full["findings"] if f["check"] in ("step-back", "v-drop")]
    assert {f["path"] for f in compared} == {"hidden.1.weight"}
    rows = {c["path"]: c for c in full["compare"]}
    assert rows["hidden.1.weight"]["step_delta"] == -40
    assert all(c["step_delta"] == 10 for p, c in rows.items() if p != "hidden.1.weight")
    # a state against itself: nothing moved
    same = _json(cli_module, REPORT / "a.pt", "--against", REPORT / "a.pt")
    assert all(c["v_rms_log2_ratio"] == pytest.approx(0, abs=1e-12) and c["m_cosine"] == pytest.approx(1)
               for c in same["compare"])
    assert not [f for f in same["findings"] if f["check"] in ("step-back", "v-drop")]


@pytest.mark.torch
def test_against_numbers(full):
    torch = pytest.importorskip("torch")
    a = torch.load(REPORT / "a.pt", weights_only=True)
    b = torch.load(REPORT / "b.pt", weights_only=True)
    names = a["param_groups"][0]["param_names"]
    b1, b2 = a["param_groups"][0]["betas"]
    rows = {c["path"]: c for c in full["compare"]}
    for i, name in enumerate(names):
        sa, sb = a["state"][i], b["state"][i]
        va, vb = sa["exp_avg_sq"].double().numpy().ravel(), sb["exp_avg_sq"].double().numpy().ravel()
        ok = np.isfinite(va) & np.isfinite(vb)
        ra = np.sqrt(np.mean(va[ok] ** 2)) / (1 - b2 ** float(sa["step"]))
        rb = np.sqrt(np.mean(vb[ok] ** 2)) / (1 - b2 ** float(sb["step"]))
        assert rows[name]["v_rms_log2_ratio"] == pytest.approx(math.log2(rb / ra), abs=1e-4)
        ma, mb = sa["exp_avg"].double().numpy().ravel()[ok], sb["exp_avg"].double().numpy().ravel()[ok]
        cos = ma @ mb / np.sqrt((ma @ ma) * (mb @ mb))
        assert rows[name]["m_cosine"] == pytest.approx(cos, abs=1e-6)


def test_without_weights_the_ratio_is_null(cli):
    r = _json(cli, REPORT / "a.pt")
    assert all(t["update_weight_ratio"] is None and t["w_rms"] is None for t in r["tensors"])
    assert r["compare"] == []
    # a.pt: the ε-dominated tensor only (no reset, no NaN yet)
    assert {f["path"] for f in r["findings"]} == {"hidden.2.weight"}


@pytest.mark.parametrize("width", [80, 100, 60])
def test_terminal_view_fits_the_width(cli, width):
    r = cli("report", REPORT / "b.pt", "--weights", REPORT / "model.pt", "--against", REPORT / "a.pt",
            env={"COLUMNS": str(width)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= width
    assert any("head.weight" in line and "nonfinite" in line for line in lines)
    # the reset tensor's row (its name cut in the middle where the width asks) ends with its step
    assert any(line.startswith("hid") and line.split()[-1] == "10" and "0/0" in line for line in lines)


def test_many_tensors_are_shown_a_layer_at_a_time(tmp_path, cli):
    from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack
    from statekit.tensor import TensorRef

    rng = np.random.default_rng(0)
    tensors, scalars, meta = [], {}, {}
    for i in range(60):
        pid = 10**18 + i
        m = rng.normal(size=32).astype(np.float32) * 1e-3
        v = (m * m * 50).astype(np.float32)
        for field, x in (("momentum.moment_1", m), ("momentum.moment_2", v)):
            tensors.append(PackTensor(f"{pid}.{field}", TensorRef.from_array(x), param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", 1)
        scalars[f"{pid}.momentum.time"] = Scalar("UInt", 9)
        meta[str(pid)] = f"layers.{i // 3}.w{i % 3}"
    write_burnpack(str(tmp_path / "s.bpk"), tensors, meta, scalars)
    r = cli("report", tmp_path / "s.bpk", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    assert "per layer" in r.stdout and "layers.19 (3)" in r.stdout
    assert max(map(len, r.stdout.splitlines())) <= 80
    assert "defaults were assumed" in r.stdout


def test_burn_defaults_or_flags(cli):
    plain = _json(cli, FIXTURES / "hand-optim.bpk")
    assert plain["hyperparameters"][0]["values"]["eps"] == 1e-5
    assert plain["hyperparameters"][0]["assumed"] == ["betas", "eps", "lr", "weight_decay"]
    assert any("store no hyperparameters" in n for n in plain["notes"])
    given = _json(cli, FIXTURES / "hand-optim.bpk", "--lr", "0.01", "--eps", "1e-8")
    a, b = plain["tensors"][0]["eff_lr_log10"]["p50"], given["tensors"][0]["eff_lr_log10"]["p50"]
    assert given["hyperparameters"][0]["values"]["lr"] == 0.01 and b > a
    assert given["hyperparameters"][0]["assumed"] == ["betas", "weight_decay"]


def test_tsv_one_row_per_tensor(cli):
    r = cli("report", REPORT / "b.pt", "--format", "tsv")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 13 and lines[0].split("\t")[:3] == ["path", "family", "step"]


def test_bad_input_is_one_line(cli, tmp_path):
    r = cli("report", FIXTURES / "lm-model.bpk")
    assert r.returncode == 1 and "not optimizer state" in r.stderr and len(r.stderr.splitlines()) == 1
    r = cli("report", REPORT / "b.pt", "--weights", REPORT / "a.pt")
    assert r.returncode == 1 and "not a model" in r.stderr and "a.pt" in r.stderr


OPTIM_FIXTURES = ["hand-optim.bpk", "hand-optim-amsgrad.bpk", "hand-optim-rmsprop.bpk", "hand-optim-adagrad.bpk",
                  "hand-optim-sgd.bpk", "burn-optim/adafactor.bpk", "burn-optim/lamb.bpk", "burn-optim/lion.bpk",
                  "burn-optim/muon.bpk", "burn-optim/adan.bpk", "torch_optim/adafactor.pt", "torch_optim/adamw.pt",
                  "torch_optim/muon.pt", "bnb/adamw8bit.pt", "bnb/rmsprop8bit.pt", "bnb/lion8bit.pt"]


@pytest.mark.parametrize("name", OPTIM_FIXTURES)
def test_every_family_reports(cli, name):
    r = _json(cli, FIXTURES / name)
    assert r["tensors"] and all(t["numel"] > 0 for t in r["tensors"])
    for t in r["tensors"]:
        eff = t["eff_lr_log10"]
        if eff is not None and eff["p50"] is not None:
            assert eff["p5"] <= eff["p50"] <= eff["p95"]
        assert t["nonfinite"] == 0
    assert not [f for f in r["findings"] if f["severity"] == "error"]


def test_adafactor_factors_rebuild_v(cli):
    """torch Adafactor: v = row_var @ col_var / mean(row_var), each coordinate's step min(lr, 1/√t)/√v."""
    torch = pytest.importorskip("torch")
    ckpt = torch.load(FIXTURES / "torch_optim/adafactor.pt", weights_only=True)["optimizer"]
    r = _json(cli, FIXTURES / "torch_optim/adafactor.pt")
    group = ckpt["param_groups"][0]
    for t, (_, s) in zip(r["tensors"], sorted(ckpt["state"].items()), strict=True):
        step = float(s["step"])
        if "row_var" in s:
            row, col = s["row_var"].double().numpy(), s["col_var"].double().numpy()
            v = (row @ col / max(row.mean(), np.finfo(np.float32).eps)).ravel()
            assert t["family_view"]["factors"]["row"]["rms"] == pytest.approx(np.sqrt(np.mean(row**2)), rel=1e-6)
        else:
            v = s["variance"].double().numpy().ravel()
        eff = np.log10(min(group["lr"], 1 / math.sqrt(step)) / np.sqrt(v))
        assert abs(t["eff_lr_log10"]["p50"] - np.percentile(eff, 50, method="inverted_cdf")) < 0.05


def test_report_imports_no_plotly_without_a_page():
    """plotly is imported by ``report -o`` only; the command line's other commands never see it."""
    from test_startup import run

    r = run("report", "fixtures/hand-optim.bpk", "--json")
    assert r["code"] == 0 and json.loads(r["out"])["tensors"]
    assert "plotly" not in {m.split(".")[0] for m in r["modules"]}
    r = run("inspect", "fixtures/hand-optim.bpk")
    assert not {"plotly", "statekit.ops.report"} & set(r["modules"])


def test_page_is_written_atomically_and_self_contained(tmp_path, cli):
    pytest.importorskip("plotly")
    out = tmp_path / "r.html"
    r = cli("report", REPORT / "b.pt", "-o", out)
    assert r.returncode == 0 and "wrote" in r.stdout and "1 errors" in r.stdout
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and "Plotly.newPlot" in text and "<script src" not in text
    assert "http://" not in text.split("</head>")[1] and "https://" not in text.split("</head>")[1]
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]


def test_param_selects_and_refuses(cli):
    r = _json(cli, REPORT / "b.pt", "--param", "hidden.*.weight")
    assert [t["path"] for t in r["tensors"]] == [f"hidden.{i}.weight" for i in range(4)]
    bad = cli("report", REPORT / "b.pt", "--param", "nope.*")
    assert bad.returncode == 2 and "nope" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_empty_and_global_states(cli):
    r = _json(cli, FIXTURES / "empty-optim.bpk")
    assert r["tensors"] == [] and r["findings"] == []
    assert cli("report", FIXTURES / "empty-optim.bpk", env={"COLUMNS": "80"}).returncode == 0


def test_python_api_is_the_json(full):
    import statekit

    r = statekit.report(REPORT / "b.pt", weights=REPORT / "model.pt", against=REPORT / "a.pt")
    assert [t["path"] for t in r["tensors"]] == [t["path"] for t in full["tensors"]]
    assert r["findings"] == full["findings"]
    slower = statekit.report(REPORT / "b.pt", lr=1e-4, params=["inp.weight"])
    assert slower["tensors"][0]["eff_lr_log10"]["p50"] == pytest.approx(full["tensors"][0]["eff_lr_log10"]["p50"] - 1)
