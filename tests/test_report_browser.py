"""The report page as a person sees it: Debian's headless Chromium loads it with the network cut,
no console errors, every panel drawn, hover names a tensor. Skips only where chromium (or the
report / browser extras) is absent outside CI; in CI (``CI=true``, ``.ci/run`` installs them) it runs."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import FIXTURES

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPORT = FIXTURES / "report"


def _needs() -> None:
    if os.environ.get("CI") == "true":
        return  # CI installs all of it: a missing piece must fail, not skip
    if not os.path.exists(CHROMIUM):
        pytest.skip("no chromium (apt-get install chromium)")
    pytest.importorskip("plotly")
    pytest.importorskip("playwright")


# every label plotly draws: axes' ticks (x, x2, y3 …), the legends, the colour bars
LABELS = "g[class$='tick'] > text, .legendtext, .cbaxis text, .annotation-text, .gtitle"


def render(tmp_path, page_path, *, hover: tuple[str, str, int] | None = None) -> dict:
    """Load ``page_path`` offline in a fresh profile; what the page drew and what went wrong.
    ``hover``: (panel, kind, layer): the mouse on that cell of the panel's heat map."""
    from playwright.sync_api import sync_playwright

    errors, outside = [], []
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                    headless=True, args=FLAGS, offline=True,
                                                    viewport={"width": 1280, "height": 900})
        try:
            def route(r):
                if r.request.url.startswith("file:"):
                    r.continue_()
                else:
                    outside.append(r.request.url)
                    r.abort()
            ctx.route("**/*", route)
            page = ctx.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_path.as_uri())
            page.wait_for_function("() => [...document.querySelectorAll('[id^=panel-]')]"
                                   ".every(d => d.querySelector('.main-svg'))", timeout=60_000)
            drawn = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('[id^=panel-]')].map(
                d => [d.id.slice(6), d.querySelectorAll('.point, .bars path, .heatmaplayer image, .js-line').length]))""")
            listed = json.loads(page.evaluate("() => document.body.dataset.report"))["panels"]
            findings = page.evaluate("() => [...document.querySelectorAll('#findings tbody tr')].map(r => r.innerText)")
            # per panel: the labels drawn outside the figure (cut off), and the most tick labels on one axis
            labels = page.evaluate("""(sel) => Object.fromEntries([...document.querySelectorAll('[id^=panel-]')].map(d => {
                const box = d.querySelector('.main-svg').getBoundingClientRect();
                const cut = [...d.querySelectorAll(sel)].filter(t => t.textContent.trim()).filter(t => {
                    const b = t.getBoundingClientRect();
                    return b.width > 0 && (b.left < box.left - 1 || b.right > box.right + 1
                                           || b.top < box.top - 1 || b.bottom > box.bottom + 1);
                }).map(t => t.textContent);
                const per = {};
                d.querySelectorAll("g[class$='tick'] > text").forEach(t => {
                    const k = t.parentNode.getAttribute('class'); per[k] = (per[k] || 0) + 1; });
                return [d.id.slice(6), {cut, most: Math.max(0, ...Object.values(per))}];
            }))""", LABELS)
            hovered = None
            if hover:
                panel, row, layer = hover
                hovered = _hover_cell(page, panel, row, layer)
        finally:
            ctx.close()
    return {"errors": errors, "outside": outside, "drawn": drawn, "listed": listed, "findings": findings,
            "hovered": hovered, "labels": labels}


def _hover_cell(page, panel: str, kind: str, layer: int) -> str:
    """Move the mouse, as a person would, onto the heat map cell (kind, layer) of ``panel``."""
    page.locator(f"#panel-{panel}").scroll_into_view_if_needed()
    heat = page.evaluate("""(id) => { const gd = document.getElementById(id);
        const t = gd.data[0], xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const r = gd.querySelector('.nsewdrag[data-subplot="xy"]').getBoundingClientRect();
        return {kinds: t.y, layers: t.x, range: xa.range, rows: ya.range, left: r.left, top: r.top,
                width: r.width, height: r.height}; }""", f"panel-{panel}")
    col = heat["layers"].index(layer)
    lo, hi = heat["range"]
    x = heat["left"] + (heat["layers"][col] - lo) / (hi - lo) * heat["width"]
    top, bottom = heat["rows"][1], heat["rows"][0]  # reversed: the first kind on top
    y = heat["top"] + (heat["kinds"].index(kind) - top) / (bottom - top) * heat["height"]
    page.mouse.move(x, y)
    page.wait_for_selector(f"#panel-{panel} .hoverlayer .hovertext", timeout=10_000)
    return page.evaluate(f"() => document.querySelector('#panel-{panel} .hoverlayer').textContent")


def test_page_opens_offline_with_every_panel_drawn(tmp_path, cli):
    _needs()
    out = tmp_path / "report.html"
    r = cli("report", REPORT / "b.pt", "--weights", REPORT / "model.pt", "--against", REPORT / "a.pt", "-o", out)
    assert r.returncode == 0, r.stderr
    text = out.read_text(encoding="utf-8")
    assert "<script src" not in text and "<link" not in text  # everything inlined
    seen = render(tmp_path, out, hover=("eff", "weight", 2))
    assert seen["errors"] == [] and seen["outside"] == []
    assert set(seen["listed"]) == {"eff", "eps", "update", "ratio", "hist", "resets", "zeros", "profile-m",
                                   "profile-v", "profile-w", "compare-v", "compare-m", "compare-step"}
    assert set(seen["drawn"]) == set(seen["listed"]) and all(n > 0 for n in seen["drawn"].values()), seen["drawn"]
    rows = seen["findings"]
    assert len(rows) == 5 and rows[0].startswith("error") and "head.weight" in rows[0]
    assert "hidden.2.weight" in seen["hovered"]  # the weight of the third hidden layer
    assert all(not x["cut"] for x in seen["labels"].values()), seen["labels"]


@pytest.mark.hf
@pytest.mark.parametrize("folder", ["report/qwen2-32/checkpoint-6", "hf/v5/qwen2/checkpoint-2"])
def test_a_real_model_reads_along_depth(tmp_path, cli, folder):
    """A Qwen2 Trainer folder (32 layers; and 1): no label cut off, no axis of one tick per tensor,
    and hovering a cell names its tensor."""
    _needs()
    pytest.importorskip("transformers")  # the folder's names come from the model's definition
    out = tmp_path / "report.html"
    path = FIXTURES / folder
    args = ["--against", REPORT / "qwen2-32" / "checkpoint-3"] if "32" in folder else []
    r = cli("report", path, "--weights", path / "model.safetensors", *args, "-o", out)
    assert r.returncode == 0, r.stderr
    layers = 32 if "32" in folder else 1
    seen = render(tmp_path, out, hover=("resets", "mlp.down_proj.weight", layers // 2 + 1 if layers > 1 else 0))
    assert seen["errors"] == [] and seen["outside"] == []
    assert all(n > 0 for n in seen["drawn"].values()) and set(seen["drawn"]) == set(seen["listed"])
    assert all(not x["cut"] for x in seen["labels"].values()), {k: x["cut"] for k, x in seen["labels"].items()}
    assert max(x["most"] for x in seen["labels"].values()) <= 40  # 387 tensors, never 387 ticks
    if layers == 32:
        assert "model.layers.17.mlp.down_proj.weight" in seen["hovered"] and "step 0" in seen["hovered"]
        assert {"compare-v", "compare-m", "compare-step", "ratio"} <= set(seen["listed"])
    else:
        assert "model.layers.0.mlp.down_proj.weight" in seen["hovered"]


def test_family_views_draw(tmp_path, cli):
    _needs()
    for name in ("torch_optim/adafactor.pt", "bnb/adamw8bit.pt"):
        out = tmp_path / (name.replace("/", "-") + ".html")
        r = cli("report", FIXTURES / name, "-o", out)
        assert r.returncode == 0, r.stderr
        seen = render(tmp_path, out)
        assert seen["errors"] == [] and seen["outside"] == []
        assert any(k.startswith("family-") for k in seen["drawn"]) and all(n > 0 for n in seen["drawn"].values()), \
            seen["drawn"]
        assert all(not x["cut"] for x in seen["labels"].values()), seen["labels"]
