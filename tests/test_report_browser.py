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


def render(tmp_path, page_path, *, hover: bool = False) -> dict:
    """Load ``page_path`` offline in a fresh profile; what the page drew and what went wrong."""
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
            hovered = None
            if hover:
                point = page.locator("#panel-eff .point").nth(6)
                point.hover(force=True)
                page.wait_for_selector("#panel-eff .hoverlayer .hovertext", timeout=10_000)
                hovered = page.evaluate("() => document.querySelector('#panel-eff .hoverlayer').textContent")
        finally:
            ctx.close()
    return {"errors": errors, "outside": outside, "drawn": drawn, "listed": listed, "findings": findings,
            "hovered": hovered}


def test_page_opens_offline_with_every_panel_drawn(tmp_path, cli):
    _needs()
    out = tmp_path / "report.html"
    r = cli("report", REPORT / "b.pt", "--weights", REPORT / "model.pt", "--against", REPORT / "a.pt", "-o", out)
    assert r.returncode == 0, r.stderr
    text = out.read_text(encoding="utf-8")
    assert "<script src" not in text and "<link" not in text  # everything inlined
    seen = render(tmp_path, out, hover=True)
    assert seen["errors"] == [] and seen["outside"] == []
    assert set(seen["listed"]) == {"eff", "eps", "update", "ratio", "hist", "resets", "profile", "compare"}
    assert set(seen["drawn"]) == set(seen["listed"]) and all(n > 0 for n in seen["drawn"].values()), seen["drawn"]
    rows = seen["findings"]
    assert len(rows) == 5 and rows[0].startswith("error") and "head.weight" in rows[0]
    assert "hidden.2.weight" in seen["hovered"]  # the seventh tensor along depth


def test_family_views_draw(tmp_path, cli):
    _needs()
    for name in ("torch_optim/adafactor.pt", "bnb/adamw8bit.pt"):
        out = tmp_path / (name.replace("/", "-") + ".html")
        r = cli("report", FIXTURES / name, "-o", out)
        assert r.returncode == 0, r.stderr
        seen = render(tmp_path, out)
        assert seen["errors"] == [] and seen["outside"] == []
        assert "family" in seen["drawn"] and all(n > 0 for n in seen["drawn"].values()), seen["drawn"]
