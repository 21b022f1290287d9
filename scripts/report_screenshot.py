#!/usr/bin/env python3
"""Draw docs/report.png: the top of ``statekit report``'s page for the shipped fixture
``fixtures/report/b.pt`` (with ``--weights`` and ``--against``), in Debian's headless Chromium.

    python scripts/report_screenshot.py        # needs chromium, plotly and playwright
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        page_path = Path(tmp) / "report.html"
        fx = ROOT / "fixtures" / "report"
        subprocess.run([sys.executable, "-m", "statekit", "report", "fixtures/report/b.pt", "--weights",
                        str(fx / "model.pt"), "--against", str(fx / "a.pt"), "-o", str(page_path)],
                       check=True, cwd=ROOT)
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(str(Path(tmp) / "profile"), executable_path="/usr/bin/chromium",
                                                        headless=True, args=FLAGS, offline=True,
                                                        viewport={"width": 1200, "height": 1500})
            page = ctx.new_page()
            page.goto(page_path.as_uri())
            page.wait_for_function("() => [...document.querySelectorAll('[id^=panel-]')]"
                                   ".every(d => d.querySelector('.main-svg'))", timeout=60_000)
            page.screenshot(path=str(ROOT / "docs" / "report.png"))
            ctx.close()


if __name__ == "__main__":
    main()
