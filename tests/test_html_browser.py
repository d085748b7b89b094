"""The HTML report of a real leaky run, and the diff page of that run against its fixed twin,
opened in a real headless Chromium driven by Playwright: each loads with no console error and
no network request, its timeline is drawn, a finding is visible and links to the timeline, the
layer table sorts. Screenshots are saved to ``test-artifacts/`` (or ``$MEMSENTRY_ARTIFACTS``).

Needs the system's Chromium (Debian: ``apt-get install chromium``) and the ``playwright``
package; where either is missing the test says which and skips (CI installs both).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_html import leaky_loop

import memsentry

pytest.importorskip("plotly", reason="the HTML report needs plotly (memsentry[html])")
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="the browser test needs playwright (pip install playwright)")

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _open(page_file: Path, chart: str, check: Any, screenshot: str) -> tuple[list[str],
                                                                         list[str]]:
    """Open ``page_file`` in Chromium, wait for ``chart`` to be drawn, run ``check(page)``
    and save a full-page screenshot; the console errors and the addresses requested."""
    errors: list[str] = []
    requests: list[str] = []
    with sync_api.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_file.as_uri(), wait_until="load")
            page.wait_for_selector(f"#{chart} .main-svg", timeout=20_000)
            check(page)
            page.screenshot(path=str(_artifacts() / screenshot), full_page=True)
        finally:
            browser.close()
    offsite = [url for url in requests if not url.startswith(("file:", "data:", "blob:",
                                                                "about:"))]
    return errors, offsite


def _artifacts() -> Path:
    folder = Path(os.environ.get("MEMSENTRY_ARTIFACTS", REPO / "test-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install "
                                             "chromium); the browser test needs the system's")
def test_report_opens_offline_in_chromium(tmp_path: Path) -> None:
    report, _ = leaky_loop()
    page_file = tmp_path / "report.html"
    report.to_html(page_file)
    finding = next(f for f in report.findings if f.rule == "tensor-accumulation")

    def check(page: Any) -> None:
        # The timeline is drawn: plotly made a line for allocated and markers.
        lines = page.locator("#memsentry-timeline .scatterlayer .trace").count()
        assert lines >= 5
        # A finding's text is visible, with its holder.
        card = page.locator(".finding.sev-leak", has_text="kept_losses").first
        assert card.is_visible()
        assert "kept_losses" in card.inner_text()
        # Its link marks its iteration on the timeline.
        card.locator("a.jump").click()
        marked: Any = page.evaluate(
            "() => document.getElementById('memsentry-timeline').layout.shapes"
            ".filter(s => s.memsentry).map(s => s.x0)")
        assert marked == [finding.iteration]
        # Sorting by saved bytes puts the layer that saves the most first.
        page.locator("table.layers th", has_text="saved").click()
        order = page.evaluate(
            "() => Array.from(document.querySelectorAll('table.layers tbody tr'))"
            ".map(r => Number(r.cells[5].getAttribute('data-v')))")
        saved = sorted((layer.saved_bytes or 0 for layer in report.layers), reverse=True)
        assert order == saved
        page.locator("table.layers th", has_text="layer").first.click()  # the tree again

    errors, offsite = _open(page_file, "memsentry-timeline", check, "html-report.png")
    assert errors == []
    assert offsite == []
    assert (_artifacts() / "html-report.png").stat().st_size > 10_000


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install "
                                             "chromium); the browser test needs the system's")
def test_diff_page_opens_offline_in_chromium(tmp_path: Path) -> None:
    from test_diff import _train

    fixed, leaky = _train(leaky=False), _train(leaky=True)
    change = memsentry.diff(fixed, leaky)
    page_file = tmp_path / "diff.html"
    change.to_html(page_file, limits=memsentry.Limits.parse(max_peak_increase="5%"))
    finding = next(f for f in change.appeared if f.rule == "tensor-accumulation")

    def check(page: Any) -> None:
        names = page.evaluate(
            "() => document.getElementById('memsentry-diff-timeline').data.map(t => t.name)")
        assert {"old allocated", "new allocated", "old peak", "new peak",
                "finding appeared"} <= set(names)
        assert page.locator("#memsentry-diff-categories .main-svg").count() >= 1
        card = page.locator(".finding.sev-leak", has_text="val_logits").first
        assert card.is_visible()
        assert page.locator(".verdict.crossed", has_text="max-peak-increase").is_visible()
        card.locator("a.jump").click()
        marked = page.evaluate(
            "() => document.getElementById('memsentry-diff-timeline').layout.shapes"
            ".filter(s => s.memsentry).map(s => s.x0)")
        assert marked == [finding.iteration]

    errors, offsite = _open(page_file, "memsentry-diff-timeline", check, "diff-report.png")
    assert errors == []
    assert offsite == []
    assert (_artifacts() / "diff-report.png").stat().st_size > 10_000
