"""Rendering stays linear in the report's size: a finding whose message is megabytes long (one
word, or many words) is wrapped to the width asked for, keeps every character, and takes
time in proportion to its length (a word was cut by copying its rest at every line)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from memsentry import Report, Severity
from memsentry.cli import main
from memsentry.model import Finding

MB = 2**20
WIDTH = 80


def _report(message: str, fix: str = "keep less") -> Report:
    finding = Finding(rule="long-message", severity=Severity.LEAK, message=message, fix=fix,
                      bytes=1)
    return Report(device="cpu", backend="none", baseline=0, findings=(finding,))


def _paragraphs(text: str) -> tuple[list[str], list[str]]:
    """The finding's message and fix paragraphs, as printed."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("  LEAK"))
    fix = next(i for i, line in enumerate(lines) if line.startswith("        fix: "))
    end = next((i for i in range(fix + 1, len(lines)) if not lines[i].startswith(" " * 13)),
               len(lines))
    return lines[head:fix], lines[fix:end]


def test_show_wraps_a_2mb_word_and_2mb_of_words_keeping_every_character(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    word = "".join(chr(ord("a") + i % 26) for i in range(2 * MB))
    words = " ".join(f"w{i}" for i in range(2 * MB // 8))
    path = tmp_path / "report.json"
    _report(word, words).to_json(path)
    assert main(["show", "--width", str(WIDTH), str(path)]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= WIDTH
    head, fix = _paragraphs(out)
    assert "".join(line.strip() for line in head) == f"LEAK  long-message: {word}"
    assert all(len(line) == WIDTH for line in head[:-1])  # each line filled, none short
    assert " ".join(line.strip() for line in fix) == f"fix: {words}"


def _seconds_to_render(size: int) -> float:
    report = _report("z" * size)
    best = float("inf")
    for _ in range(2):
        started = time.process_time()
        text = report.format(width=100, view="findings")
        best = min(best, time.process_time() - started)
    assert text.count("z") == size
    return best


def test_rendering_a_long_word_takes_time_in_proportion_to_its_length() -> None:
    small, large = _seconds_to_render(2 * MB), _seconds_to_render(8 * MB)
    # Four times the length: four times the time when linear, sixteen when quadratic.
    assert large < 8 * max(small, 0.01), (small, large)


@pytest.mark.parametrize("columns", [60, 80, 132])
def test_the_width_is_columns_when_no_width_is_given(
        columns: int, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    words = " ".join(f"word{i}" for i in range(400))
    report = _report(words, words)
    for text in (str(report), report.format(view="findings")):
        assert max(len(line) for line in text.splitlines()) <= columns
        assert max(len(line) for line in _paragraphs(text)[0]) > columns - 10  # filled
    path = tmp_path / "report.json"
    report.to_json(path)
    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert max(len(line) for line in shown.splitlines()) <= columns
    assert main(["show", "--width", "200", str(path)]) == 0  # an explicit width wins
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) > columns


def test_without_columns_or_a_terminal_the_width_is_100(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    words = " ".join(f"word{i}" for i in range(400))
    text = str(_report(words))
    assert 90 < max(len(line) for line in text.splitlines()) <= 100
