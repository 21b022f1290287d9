"""The report's learning-rate curve (issue 36 item 2): the op's numbers (``ops/report/lr_curve.py``),
the terminal line, and the page drawn by headless Chromium (offline) with the saved position marked.

References: the lrs the real programs used — megatron-core 0.19.2's scheduler
(``fixtures/megatron/schedule_refs.json``), transformers' Trainer (``fixtures/schedule/hf``), torchtitan
0.3.0 (``fixtures/torchtitan``)."""

from __future__ import annotations

import json
import math
import re

import pytest
from conftest import FIXTURES
from test_report_browser import _needs, render

from statekit.ops.report import report_files

MEGATRON = FIXTURES / "megatron" / "0.19.2" / "gpt_torch_no_distopt_tp1pp1dp2"
REFS = json.loads((FIXTURES / "megatron" / "schedule_refs.json").read_text())


def test_megatron_curve_passes_through_the_lrs_megatron_used():
    s = report_files(MEGATRON).to_json()["schedule"]
    ref = REFS["fixtures"]["0.19.2/gpt_torch_no_distopt_tp1pp1dp2"]
    assert s["unit"] == "updates" and s["position"] == 3 and s["samples_per_update"] == 4
    assert s["lr_now"] == ref["trace"][0]["lr"] and s["lr_next"] == ref["trace"][1]["lr"]
    assert s["steps_left"] == 5  # (32 - 12) samples / 4
    # the curve at iterations 3 … 8 is the real scheduler's lr at 12 … 32 samples
    for k, point in enumerate(ref["trace"][:6]):
        i = s["x"].index(3 + k)
        assert [ys[i] for ys in s["lrs"]] == point["lr"]
    assert s["x"][0] == 0 and s["x"][-1] >= 8


def test_hf_curve_and_terminal_line(cli):
    folder = FIXTURES / "schedule" / "hf" / "linear" / "checkpoint-5"
    ref = json.loads((FIXTURES / "schedule" / "hf" / "reference.json").read_text())["linear"]
    s = report_files(folder).to_json()["schedule"]
    assert s["kind"] == "hf:linear" and s["position"] == 5 and s["steps_left"] == 5
    assert s["lr_now"] == ref["lrs_after_step"]["5"] and s["lr_next"] == ref["lrs_after_step"]["6"]
    # the curve: transformers' lr after each update k is the curve's at position k
    for k, lrs in ref["lrs_after_step"].items():
        if int(k) in s["x"]:
            assert [ys[s["x"].index(int(k))] for ys in s["lrs"]] == lrs, k
    r = cli("report", "--json", folder)
    assert r.returncode == 0 and json.loads(r.stdout)["schedule"]["lr_now"] == s["lr_now"]
    r = cli("report", folder, env={"COLUMNS": "200"})
    line = next(x for x in r.stdout.splitlines() if x.startswith("lr schedule:"))
    assert "hf:linear · position 5 updates" in line and "5 updates left" in line


def test_no_schedule_no_curve():
    assert report_files(FIXTURES / "report" / "b.pt").to_json()["schedule"] is None


def test_a_schedule_without_its_config_says_why(tmp_path):
    import shutil

    shutil.copytree(FIXTURES / "torchtitan" / "linear", tmp_path / "linear",
                    ignore=shutil.ignore_patterns("job_config.json"))
    s = report_files(tmp_path / "linear" / "checkpoint" / "step-4").to_json()["schedule"]
    assert s["x"] == [] and s["position"] == 4 and "not recorded" in s["why"]


def _hover_saved(page) -> str:
    page.locator("#panel-lr").scroll_into_view_if_needed()
    at = page.evaluate("""() => { const gd = document.getElementById('panel-lr');
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const t = gd.data.find(d => d.name.startsWith('saved'));
        const r = gd.querySelector('.nsewdrag[data-subplot="xy"]').getBoundingClientRect();
        return {x: r.left + xa.l2p(t.x[0]), y: r.top + ya.l2p(t.y[0])}; }""")
    page.mouse.move(at["x"], at["y"])
    page.wait_for_selector("#panel-lr .hoverlayer .hovertext", timeout=10_000)
    return page.evaluate("() => document.querySelector('#panel-lr .hoverlayer').textContent")


@pytest.mark.browser
@pytest.mark.parametrize("path", [MEGATRON, FIXTURES / "torchtitan" / "wsd_cosine" / "checkpoint" / "step-7"],
                         ids=["megatron", "torchtitan"])
def test_page_draws_the_lr_curve(tmp_path, cli, path, monkeypatch):
    _needs()
    out = tmp_path / "report.html"
    r = cli("report", path, "-o", out)
    assert r.returncode == 0, r.stderr
    import test_report_browser

    hovered = {}
    real = test_report_browser._hover_cell

    def hover(page, panel, kind, layer):
        hovered["text"] = _hover_saved(page)
        return hovered["text"]

    monkeypatch.setattr(test_report_browser, "_hover_cell", hover)
    try:
        seen = render(tmp_path, out, hover=("lr", "", 0))
    finally:
        monkeypatch.setattr(test_report_browser, "_hover_cell", real)
    assert seen["errors"] == [] and seen["outside"] == []
    assert seen["listed"][0] == "lr" and seen["drawn"]["lr"] > 0
    assert all(not x["cut"] for x in seen["labels"].values()), seen["labels"]
    sched = report_files(path).to_json()["schedule"]
    # the mouse on the saved position: plotly's hover names that position and its lr (6 digits)
    assert f"updates {sched['position']:g}" in seen["hovered"]
    shown = [float(x) for x in re.findall(r"lr (?:now )?([0-9.e-]+)", seen["hovered"])]
    assert shown and all(any(math.isclose(x, lr, rel_tol=1e-5) for lr in sched["lr_now"]) for x in shown), shown
    assert "LR schedule:" in out.read_text(encoding="utf-8")


def test_lightning_curve_counts_what_the_scheduler_counts():
    lightning = FIXTURES / "schedule" / "lightning"
    epoch = report_files(lightning / "epoch_exponential" / "epoch=0-step=4.ckpt").to_json()["schedule"]
    ref = json.loads((lightning / "epoch_exponential" / "reference.json").read_text())
    assert epoch["unit"] == "epochs" and epoch["position"] == 1
    assert epoch["lr_now"] == ref["resumed"]["epoch=0-step=4.ckpt"]["lrs"][0]
    # ExponentialLR(gamma 0.5) per epoch: the curve at epoch 2 is the lr Lightning used in the epoch after next
    assert [ys[epoch["x"].index(2)] for ys in epoch["lrs"]] == ref["resumed"]["epoch=0-step=4.ckpt"]["lrs"][4]
    mid = report_files(lightning / "epoch_midsave" / "epoch=0-step=3.ckpt").to_json()["schedule"]
    assert mid["unit"] == "scheduler steps" and mid["lr_next"] is None and "interval" in mid["why"]
