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


# --- along depth: a real 32-layer Trainer folder (scripts/make_report_depth_fixture.py) -------------

DEPTH = REPORT / "qwen2-32"
RESET = "model.layers.17.mlp.down_proj.weight"
# Qwen2's modules in a decoder layer, in the order they are defined; each Linear's bias beside its weight
QWEN2_KINDS = ["self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
               "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
               "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
               "post_attention_layernorm.weight"]


@pytest.fixture(scope="module")
def qwen(cli_module):
    pytest.importorskip("transformers")  # naming the Trainer folder's positions: the model's definition
    return _json(cli_module, DEPTH / "checkpoint-6", "--weights", DEPTH / "checkpoint-6" / "model.safetensors",
                 "--against", DEPTH / "checkpoint-3")


@pytest.fixture(scope="module")
def qwen_truth():
    return json.loads((DEPTH / "truth.json").read_text())


def test_place_reads_layer_and_kind_from_any_framework_names():
    from statekit.ops.report.depth import place, places

    assert place("model.layers.17.mlp.down_proj.weight") == ("model.layers", 17, "mlp.down_proj.weight")
    assert place("transformer.h.3.attn.c_attn.weight") == ("transformer.h", 3, "attn.c_attn.weight")
    assert place("blocks.11.ff.0.weight") == ("blocks", 11, "ff.0.weight")  # the first number is the layer
    assert place("model.layers.2.mlp.experts.7.w1") == ("model.layers", 2, "mlp.experts.7.w1")
    for apart in ("model.embed_tokens.weight", "lm_head.weight", "#5", "123 (0ABC)", "conv1.weight", "layers.x.w"):
        assert place(apart) is None
    # group order (weights, then biases) is not depth: biases sit beside their weights, the head after
    order = ["emb.weight", "layers.0.q.weight", "layers.0.o.weight", "layers.1.q.weight", "layers.1.o.weight",
             "head.weight", "layers.0.q.bias", "layers.1.q.bias", "norm.weight"]
    got = places(order)
    by_depth = [order[i] for i in sorted(range(len(order)), key=lambda i: got[i]["depth"])]
    assert by_depth == ["emb.weight", "layers.0.q.weight", "layers.0.q.bias", "layers.0.o.weight",
                        "layers.1.q.weight", "layers.1.q.bias", "layers.1.o.weight", "head.weight", "norm.weight"]


@pytest.mark.hf
def test_a_real_trainer_folder_is_placed_by_layer_and_kind(qwen, qwen_truth):
    """Every tensor of the 32-layer Trainer state: its layer and kind from the live model's names,
    the order along depth Qwen2's (the state's own order is Trainer's groups: weights, then the rest)."""
    tensors = qwen["tensors"]
    names = [n for g in qwen_truth["groups"] for n in g]
    assert [t["path"] for t in tensors] == names  # the JSON keeps the state's order
    for t in tensors:
        parts = t["path"].split(".")
        if parts[:2] == ["model", "layers"]:
            assert (t["stack"], t["layer"], t["kind"]) == ("model.layers", int(parts[2]), ".".join(parts[3:]))
        else:
            assert t["path"] in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
            assert t["layer"] is None and t["kind"] is None
    along = [t["path"] for t in sorted(tensors, key=lambda t: t["depth"])]
    layered = [f"model.layers.{i}.{k}" for i in range(32) for k in QWEN2_KINDS]
    assert along[0] == "model.embed_tokens.weight" and along[1:-2] == layered
    assert set(along[-2:]) == {"model.norm.weight", "lm_head.weight"}
    assert sorted(t["depth"] for t in tensors) == list(range(len(tensors))) and len(tensors) == 387


@pytest.mark.hf
def test_a_tensor_reset_to_step_0_is_a_reset_not_also_eps_dominated(qwen):
    """torch's own fresh entry (step 0, zero moments) is one reset: its step-size numbers are
    undefined (1 − βᵗ = 0), not "100 % of coordinates have √v̂ < ε"."""
    torch = pytest.importorskip("torch")
    state = torch.load(DEPTH / "checkpoint-6" / "optimizer.pt", weights_only=True)
    names = [t["path"] for t in qwen["tensors"]]
    raw = state["state"][names.index(RESET)]
    assert float(raw["step"]) == 0 and not raw["exp_avg"].any() and not raw["exp_avg_sq"].any()
    found = [(f["path"], f["check"]) for f in qwen["findings"] if f["path"] == RESET]
    assert ("reset", ) == tuple(c for _, c in found if c in ("reset", "eps", "zero-moments"))
    assert not [f for f in qwen["findings"] if f["check"] == "eps"]
    t = next(t for t in qwen["tensors"] if t["path"] == RESET)
    assert t["step"] == 0 and t["m_zero_fraction"] == 1.0 and t["v_zero_fraction"] == 1.0
    assert t["eps_fraction"] is None and t["eff_lr_log10"] is None and t["update_rms"] is None
    assert t["update_weight_ratio"] is None and t["v_hat_sqrt_mean"] is None


@pytest.mark.hf
def test_v_that_fell_to_zero_reads_fell_to_0(qwen, cli_module):
    drop = [f for f in qwen["findings"] if f["check"] == "v-drop"]
    assert [f["path"] for f in drop] == [RESET]
    assert "fell to 0" in drop[0]["message"] and "inf" not in drop[0]["message"]
    assert not any("inf" in f["message"] for f in qwen["findings"])
    r = cli_module("report", DEPTH / "checkpoint-6", "--against", DEPTH / "checkpoint-3", env={"COLUMNS": "100"})
    row = next(line for line in r.stdout.splitlines() if line.startswith(RESET) and "-3" in line)
    assert row.split()[1:3] == ["to", "0"] and "inf" not in r.stdout


@pytest.mark.hf
def test_outliers_are_against_the_same_module_kind(qwen):
    """v_proj's biases are not outliers of "every bias": k_proj's (softmax cancels their gradient)
    sit decades below, but each kind along the 32 layers stays within a decade or so of its median."""
    torch = pytest.importorskip("torch")
    state = torch.load(DEPTH / "checkpoint-6" / "optimizer.pt", weights_only=True)
    b2 = state["param_groups"][0]["betas"][1]
    names = [t["path"] for t in qwen["tensors"]]
    spread: dict[str, list[float]] = {}
    for i, name in enumerate(names):
        s = state["state"][i]
        if name.startswith("model.layers.") and float(s["step"]) > 0:
            v = s["exp_avg_sq"].double().numpy() / (1 - b2 ** float(s["step"]))
            spread.setdefault(name.split(".", 3)[3], []).append(math.log10(math.sqrt(v.mean())))
    mid = {k: float(np.median(x)) for k, x in spread.items()}
    assert mid["self_attn.v_proj.bias"] - mid["self_attn.k_proj.bias"] > 3  # across kinds: decades apart
    assert all(max(abs(x - mid[k]) for x in xs) < 3 for k, xs in spread.items())  # within a kind: not
    assert not [f for f in qwen["findings"] if f["check"] == "outlier"]


@pytest.mark.hf
def test_page_panels_are_laid_along_depth(qwen):
    """No panel has an axis of one tick per tensor: a heat map of kinds × layers, a line per kind,
    the three tensors off the layer pattern apart; hover names each tensor."""
    pytest.importorskip("plotly")
    from statekit.render.report_html import figures

    figs = dict(figures(qwen))
    assert {"eff", "eps", "update", "ratio", "hist", "resets", "zeros", "compare-v"} <= set(figs)
    for key, fig in figs.items():
        if key in ("hist", "lr"):  # (lr: the schedule's curve, not a depth panel)
            continue
        heat, *lines = [tr for tr in fig["data"] if tr.get("yaxis") in ("y", "y2")]
        apart = [tr for tr in fig["data"] if tr.get("yaxis") == "y3"]
        assert heat["type"] == "heatmap" and heat["x"] == list(range(32)) and heat["y"] == QWEN2_KINDS, key
        assert [tr["name"] for tr in lines] == QWEN2_KINDS and all(len(tr["x"]) <= 32 for tr in lines), key
        assert set(apart[0]["y"]) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}, key
        for i, kind in enumerate(QWEN2_KINDS):
            for layer in range(32):
                cell = heat["text"][i][layer]
                assert not cell or cell.startswith(f"<b>model.layers.{layer}.{kind}</b>"), (key, cell)
    resets = figs["resets"]["data"][0]
    assert resets["z"][QWEN2_KINDS.index("mlp.down_proj.weight")][17] == -6
    assert sum(x != 0 for row in resets["z"] for x in row if x is not None) == 1
    hist = figs["hist"]["layout"]["yaxis"]
    assert len(hist["tickvals"]) == 35 and "model.layers.17" in hist["ticktext"]
    fell = figs["compare-v"]["data"][0]["text"][QWEN2_KINDS.index("mlp.down_proj.weight")][17]
    assert fell.startswith(f"<b>{RESET}</b>") and "v fell to 0" in fell


@pytest.mark.hf
def test_page_without_names_on_the_layer_pattern_is_drawn_along_the_order(qwen):
    """A state whose names say nothing of layers (positions only): one chart along depth per panel."""
    pytest.importorskip("plotly")
    from statekit.render.report_html import figures

    bare = {**qwen, "tensors": [{**t, "stack": None, "layer": None, "kind": None} for t in qwen["tensors"]]}
    name_at = {t["depth"]: t["path"] for t in qwen["tensors"]}
    figs = dict(figures(bare))
    assert {"eff", "eps", "resets", "compare-v"} <= set(figs)
    for key, fig in figs.items():
        if key not in ("hist", "lr"):  # (lr: the schedule's curve, not a depth panel)
            (trace,) = fig["data"]
            assert trace["type"] == "scatter" and len(trace["x"]) <= 387, key
            assert all(text.startswith(f"<b>{name_at[x]}</b>") for x, text in zip(trace["x"], trace["text"],
                                                                                   strict=True)), key


@pytest.mark.hf
def test_terminal_rows_go_along_depth(cli):
    r = cli("report", DEPTH / "checkpoint-6", env={"COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    rows = [line.split(" (")[0] for line in r.stdout.splitlines() if " (" in line and line.startswith(("model", "lm"))]
    layers = [f"model.layers.{i}" for i in range(32)]
    assert rows[0] == "model.embed_tokens" and rows[1:33] == layers and set(rows[33:35]) == {"model.norm", "lm_head"}


def test_a_compared_file_at_a_long_path_is_named_short_in_panel_titles():
    """Panel titles hold the compared file's last two parts (at most 40 characters): the whole path
    of a checkout at a long path was cut off by the panel (seen at a 114-character path)."""
    from statekit.render.report_html import _short_name

    long = "/tmp/" + "p" * 110 + "/statekit/fixtures/report/qwen2-32/checkpoint-3"
    assert _short_name(long) == "qwen2-32/checkpoint-3"
    assert _short_name("a.pt") == "a.pt"
    name = _short_name("/x/" + "d" * 60 + "/" + "f" * 50 + ".pt")
    assert len(name) == 40 and name.startswith("…") and name.endswith("f.pt")
