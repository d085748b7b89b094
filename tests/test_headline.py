"""The text report starts with what to do: a one-line headline and the findings, then the
tables that explain them; ``view="findings"`` (``--findings-only``) stops after the findings;
the heap backend's breakdown shows the process heap apart from ``other``."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_mlp, train
from torch import nn

import memsentry
from memsentry import Report

ROOT = Path(__file__).resolve().parent.parent


def _leaky(**options: object) -> Report:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []
    with memsentry.track(model, on_leak="ignore", **options) as t:  # type: ignore[arg-type]
        for _ in range(12):
            loss = model(torch.randn(64, 16)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            kept.append(loss)
    return t.report()


def _clean(**options: Any) -> Report:
    model = make_mlp()
    with memsentry.track(model, on_leak="ignore", **options) as t:
        train(model, 8, batch=64)
    return t.report()


def test_the_headline_names_the_leak_its_holder_and_line_before_everything() -> None:
    text = str(_leaky())
    first = text.splitlines()[0]
    assert re.fullmatch(r"memsentry: 1 leak: `kept` at (tests/)?test_headline\.py:\d+ "
                        r"\((tensor-accumulation|retained-graph)\)", first), first
    # the findings come before the header and the tables that explain them
    assert text.index("Findings (") < text.index("memsentry: cpu") < text.index("Layers (")


def test_the_findings_view_stops_after_the_findings() -> None:
    report = _leaky()
    short = report.format(view="findings")
    assert short.startswith("memsentry: 1 leak")
    assert "Findings (1)" in short and "fix:" in short
    assert "Layers (" not in short and "Iterations (" not in short
    assert str(report).startswith(short)  # the full report begins with the same text


def test_a_clean_run_says_so_in_its_first_line() -> None:
    report = _clean()
    hints = [f for f in report.findings if f.severity is memsentry.Severity.HINT]
    first = str(report).splitlines()[0]
    if hints:  # a loaded machine may make the heap move: a hint, never a verdict
        assert first.startswith("memsentry: no leak or waste found; ")
    else:
        assert first.startswith("memsentry: no finding (allocated ")


def test_an_unknown_view_names_the_views() -> None:
    with pytest.raises(ValueError, match="'full', 'findings'"):
        _clean().format(view="short")


def test_the_heap_backend_shows_the_process_heap_apart_from_other() -> None:
    text = str(_clean())
    breakdown = text[text.index("Memory at the highest peak"):]
    heap = next(line for line in breakdown.splitlines()
                if line.startswith("process heap before tracking (not tensors)"))
    other = next(line for line in breakdown.splitlines() if line.startswith("other "))
    # the process heap dwarfs what the tiny loop made; `other` is no longer 90% of the total
    assert int(heap.split()[-1].rstrip("%")) > int(other.split()[-1].rstrip("%"))
    assert "track(exact=True) counts tensor storages only" in " ".join(breakdown.split())


def test_exact_totals_above_the_allocated_peak_are_explained() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters())
    with memsentry.track(model, exact=True) as t:
        for _ in range(4):
            model(torch.randn(32, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
    text = str(t.report())
    assert "process heap before tracking" not in text
    assert "the parts count storages made before tracking began" in " ".join(text.split())


def test_memsentry_show_findings_only(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    _leaky().to_json(path)
    shown = subprocess.run([sys.executable, "-m", "memsentry", "show", "--findings-only",
                            str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("memsentry: 1 leak")
    assert "Layers (" not in shown.stdout


def test_a_narrow_report_shortens_the_totals_label_and_wraps_its_titles() -> None:
    text = _leaky().format(width=60)
    lines = text.splitlines()
    totals = next(line for line in lines if line.startswith(("total", "…")))
    assert totals.split()[0] == "total"  # not "…eaf layers)"
    layers_at = next(i for i, line in enumerate(lines) if line.startswith("Layers ("))
    prose = [line for line in lines[:layers_at] if not line.startswith(" " * 8)]
    assert all(len(line) <= 60 for line in prose)
    iterations = next(line for line in lines if line.startswith("Iterations ("))
    assert len(iterations) <= 60


def test_an_iteration_passed_with_a_count_only_is_marked_and_counted() -> None:
    report = _clean(overhead=None)  # every iteration recorded; then one taken out
    kept = tuple(it for it in report.iterations if it.index != 3)
    text = dataclasses.replace(report, iterations=kept).format()
    table = text[text.index("Iterations ("):].splitlines()
    assert "1 passed with a count only" in " ".join(table[:3])
    labels = [row.split()[0] for row in table
              if row.strip() and row.split()[0][:1] in "0123456789…"]
    assert labels[labels.index("2") + 1] == "…" and labels[labels.index("…") + 1] == "4"
