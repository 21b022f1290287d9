#!/usr/bin/env python3
"""Draw docs/report.png: the top of ``statekit report``'s page (the findings and the first two panels)
for the shipped 32-layer Qwen2 Trainer folder ``fixtures/report/qwen2-32/checkpoint-6`` (with
``--weights`` its model.safetensors and ``--against`` checkpoint-3), in Debian's headless Chromium.

    python scripts/report_screenshot.py        # needs chromium, plotly, playwright and transformers
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
        fx = ROOT / "fixtures" / "report" / "qwen2-32"
        subprocess.run([sys.executable, "-m", "statekit", "report", "fixtures/report/qwen2-32/checkpoint-6",
                        "--weights", str(fx / "checkpoint-6" / "model.safetensors"), "--against",
                        str(fx / "checkpoint-3"), "-o", str(page_path)], check=True, cwd=ROOT)
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(str(Path(tmp) / "profile"), executable_path="/usr/bin/chromium",
                                                        headless=True, args=FLAGS, offline=True,
                                                        viewport={"width": 1200, "height": 1000})
            page = ctx.new_page()
            page.goto(page_path.as_uri())
            page.wait_for_function("() => [...document.querySelectorAll('[id^=panel-]')]"
                                   ".every(d => d.querySelector('.main-svg'))", timeout=60_000)
            bottom = page.evaluate("() => document.querySelector('[data-panel=eps]').getBoundingClientRect().bottom")
            page.screenshot(path=str(ROOT / "docs" / "report.png"), full_page=True,
                            clip={"x": 0, "y": 0, "width": 1200, "height": bottom + 12})
            ctx.close()


if __name__ == "__main__":
    main()
