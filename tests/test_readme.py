"""The README holds: at most 200 lines, its quickstart prints what the README shows (the same
headline, findings, sections and layers; the figures may move from run to run), and its
commands run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
TITLES = ("Findings (", "memsentry: cpu", "Layers (", "Iterations (",
          "Memory at the highest peak", "note:")


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _fenced(text: str, after: str, language: str = "") -> str:
    """The first fenced block of ``language`` after the text ``after``."""
    rest = text.split(after, 1)[1] if after else text
    return rest.split(f"```{language}\n", 1)[1].split("\n```", 1)[0]


def _shape(text: str) -> str:
    """Numbers as ``#``, whitespace as one space, the script's folder left out: what does not
    move between runs."""
    text = re.sub(r"\S*/(quick\.py)", r"\1", text)
    return " ".join(re.sub(r"\d+(\.\d+)?", "#", text).split())


def _sections(output: str) -> list[str]:
    """The sections, in order (how many notes there are depends on the machine's load)."""
    return list(dict.fromkeys(title for line in output.splitlines() for title in TITLES
                              if line.startswith(title)))


def _findings(output: str) -> str:
    return output.split("Findings (", 1)[1].split("\n\n", 1)[0]


def _layers(output: str) -> list[tuple[str, ...]]:
    table = output.split("\nLayers (", 1)[1].split("\n\n", 1)[0].splitlines()
    rows = table[table.index(next(r for r in table if r.startswith("----"))) + 1:]
    return [tuple(row.split()[:2]) for row in rows]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= 200


def test_the_quickstart_prints_what_the_readme_shows(tmp_path: Path) -> None:
    quickstart = _section("Quickstart")
    code = _fenced(quickstart, "", "python")
    shown = _fenced(quickstart, "Output")
    (tmp_path / "quick.py").write_text(code + "\n", encoding="utf-8")
    run = subprocess.run([sys.executable, "quick.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env=_env())
    assert run.returncode == 0, run.stderr
    printed = run.stderr + run.stdout  # the warning (stderr) comes before the report
    assert not list(tmp_path.iterdir())[1:], "the quickstart writes no file"
    assert _shape(printed.splitlines()[0]) == _shape(shown.splitlines()[0])  # the warning
    report = run.stdout
    readme_report = shown[shown.index("memsentry: 1 leak"):]
    assert _shape(report.splitlines()[0]) == _shape(readme_report.splitlines()[0])
    assert _shape(_findings(report)) == _shape(_findings(readme_report))
    assert _sections(report) == _sections(readme_report)
    assert _layers(report) == _layers(readme_report)
    assert report.splitlines()[-1] == readme_report.splitlines()[-1] == "131072"


def test_the_main_job_command_runs_as_written() -> None:
    setup = _section("Set up and run (fresh machine, from the repository root)")
    command = _fenced(setup, "Run the main job", "bash").split(" && ")[-1]
    assert command == "memsentry run samples/train_leaky.py --steps 30"
    words = command.split()
    run = subprocess.run([sys.executable, "-m", "memsentry", *words[1:]], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=_env())
    assert run.returncode == 0, run.stderr
    headline = run.stdout.split("memsentry report", 1)[1].splitlines()[1]
    assert headline.startswith("memsentry: 2 leaks"), run.stdout
    assert "`running_loss`" in run.stdout and "`val_logits`" in run.stdout


def test_the_test_command_is_what_ci_runs() -> None:
    setup = _section("Set up and run (fresh machine, from the repository root)")
    command = _fenced(setup, "Run the tests", "bash").split(" && ")[-1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert command in ci.splitlines()
