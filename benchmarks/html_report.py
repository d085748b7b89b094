"""How long the HTML report takes to make and to open, by the number of iterations recorded.

Real tracked runs of a small leaky MLP loop (a list keeps every step's output) for each size,
then, in interleaved rounds: ``Report.to_html()`` timed in this process, and the page opened
in headless Chromium (playwright), timed from navigation until plotly has drawn the timeline,
then a hover over the middle of the timeline until plotly shows its label. Medians over the
rounds; the sizes run in a shuffled order each round. The largest size also runs with the
timeline drawn whole (``unthinned``), to show what thinning saves.

    python benchmarks/html_report.py [--sizes 60 1000 10000] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
from torch import nn

import memsentry
from memsentry import Report
from memsentry.reporters.html import render_html


def tracked_run(iterations: int) -> Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    with memsentry.track(model, on_leak="ignore", max_iterations=max(iterations, 2)) as t:
        for _ in range(iterations):
            out = model(torch.randn(16, 32))
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept.append(out.detach())
    return t.report()


def open_in_browser(page_file: Path, chromium: str) -> tuple[float, float]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=chromium,
                                         args=["--no-sandbox", "--disable-gpu",
                                               "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        start = time.perf_counter()
        page.goto(page_file.as_uri())
        page.wait_for_selector("#memsentry-timeline .main-svg")
        drawn = time.perf_counter() - start
        box = page.locator("#memsentry-timeline .nsewdrag").first.bounding_box()
        assert box is not None
        start = time.perf_counter()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_selector("#memsentry-timeline .hoverlayer .hovertext")
        hovered = time.perf_counter() - start
        browser.close()
    return drawn, hovered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[60, 1000, 10_000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).with_name("html-results.json")))
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    reports = {n: tracked_run(n) for n in args.sizes}
    cases = [(n, False) for n in args.sizes] + [(max(args.sizes), True)]
    folder = Path(tempfile.mkdtemp())
    timings: dict[tuple[int, bool], dict[str, list[float]]] = {
        case: {"build_s": [], "drawn_s": [], "hover_s": []} for case in cases}
    sizes: dict[tuple[int, bool], int] = {}
    for _ in range(args.rounds):
        random.shuffle(cases)
        for case in cases:
            n, whole = case
            path = folder / f"r{n}{'-whole' if whole else ''}.html"
            start = time.perf_counter()
            page = render_html(reports[n], at_most=10**9 if whole else 1500)
            path.write_text(page, encoding="utf-8")
            timings[case]["build_s"].append(time.perf_counter() - start)
            sizes[case] = len(page.encode())
            if chromium:
                drawn, hovered = open_in_browser(path, chromium)
                timings[case]["drawn_s"].append(drawn)
                timings[case]["hover_s"].append(hovered)
    rows = []
    for case in sorted(cases):
        n, whole = case
        row: dict[str, object] = {"iterations": len(reports[n].iterations), "unthinned": whole,
                                  "bytes": sizes[case]}
        row.update({k: round(statistics.median(v), 3) for k, v in timings[case].items() if v})
        rows.append(row)
        print(row)
    result = {"date": date.today().isoformat(), "torch": torch.__version__,
              "rounds": args.rounds, "chromium": chromium, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
