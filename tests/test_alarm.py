"""The alarm while the run lives: a leak is said the moment the census that proves it is taken
(a warning at the user's line, a LeakError at the next boundary, the alarm callback, one line
on stderr under ``memsentry run``), and the report file holds the latest report meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from builders import censuses, holder_states, iterations, path, report
from torch import nn

import memsentry
from memsentry.alarm import SEEN_FROM, held_from
from memsentry.model import Finding, Severity, Subject
from memsentry.rules.series import holder_series


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


class Loop:
    """A training loop that keeps each loss with its graph (``leaky``) or its float; it notes
    the iteration it was in when a warning came."""

    def __init__(self, *, leaky: bool = True) -> None:
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.kept: list[object] = []
        self.leaky = leaky
        self.iteration = -1
        self.warned_at: list[int] = []

    def run(self, steps: int) -> None:
        for self.iteration in range(steps):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = self.model(torch.randn(8, 16)).pow(2).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                self.evaluate()
            leak_warnings = [w for w in caught if issubclass(w.category, memsentry.LeakWarning)]
            if leak_warnings:
                self.warned_at.append(self.iteration)
                assert leak_warnings[0].filename == __file__  # the user's line
            self.keep(loss)

    def evaluate(self) -> None:
        """What the step does after the optimizer's (nothing here)."""

    def keep(self, loss: torch.Tensor) -> None:
        self.kept.append(loss if self.leaky else loss.item())


def test_a_leak_is_warned_about_while_the_loop_runs() -> None:
    loop = Loop()
    with warnings.catch_warnings(record=True) as at_the_end:
        warnings.simplefilter("always")
        with memsentry.track(loop.model) as t:
            loop.run(40)
    # The censuses of iterations 2, 3 and 4 prove it; it still holds at the census of
    # iteration 34 (over eight times as far into the run), taken as iteration 35 begins: the
    # warning comes then, 5 iterations before the end, which does not say it again.
    assert loop.warned_at == [35]
    assert not [w for w in at_the_end if issubclass(w.category, memsentry.LeakWarning)]
    assert [f.rule for f in t.report().findings] == ["tensor-accumulation"]


def test_on_leak_raise_stops_the_loop_at_the_next_boundary() -> None:
    loop = Loop()
    with pytest.raises(memsentry.LeakError) as raised, \
            warnings.catch_warnings(record=True) as caught, \
            memsentry.track(loop.model, on_leak="raise") as t:
        warnings.simplefilter("always")
        loop.run(40)
    assert loop.iteration == 35  # not the end of the loop
    assert raised.value.findings[0].rule == "tensor-accumulation"
    assert "`self.kept`" in str(raised.value)
    assert not [w for w in caught if issubclass(w.category, memsentry.LeakWarning)]
    assert not t.active and t.report().findings  # stopped, with the report kept


def test_the_alarm_callback_hears_each_leak_once_and_its_error_is_raised_in_the_loop() -> None:
    heard: list[tuple[int, str]] = []
    loop = Loop()

    def alarm(text: str, leaks: tuple[memsentry.Finding, ...]) -> None:
        heard.append((loop.iteration, leaks[0].rule))

    with memsentry.track(loop.model, alarm=alarm, on_leak="ignore"):
        loop.run(40)
    assert heard == [(35, "tensor-accumulation")]

    class Stop(Exception):
        pass

    def stop(text: str, leaks: tuple[memsentry.Finding, ...]) -> None:
        raise Stop(text)

    loop = Loop()
    with pytest.raises(Stop), memsentry.track(loop.model, alarm=stop):
        loop.run(40)
    assert loop.iteration == 35


def test_no_alarm_for_a_loop_that_keeps_floats() -> None:
    heard: list[str] = []
    loop = Loop(leaky=False)
    with memsentry.track(loop.model, alarm=lambda text, leaks: heard.append(text)) as t:
        loop.run(40)
    assert heard == [] and loop.warned_at == []
    assert not t.report().findings


def test_the_report_file_holds_the_latest_report_while_the_run_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "live.json"
    loop = Loop()
    seen: dict[int, int] = {}  # iteration -> findings in the file then

    class Watching(Loop):
        def run(self, steps: int) -> None:
            for _ in range(steps):
                super().run(1)
                if path.exists():
                    seen[len(seen)] = len(json.loads(path.read_text())["findings"])

    loop = Watching()
    with memsentry.track(loop.model, on_leak="ignore", report_path=path) as t:
        loop.run(12)
    assert seen and max(seen.values()) == 1  # written as soon as the rules found it
    final = memsentry.Report.from_json(path)
    assert final.findings == t.report().findings
    assert final.iterations == t.report().iterations
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.json"]  # no temporary left
    mask = os.umask(0o022)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask  # as open() makes it, not private


def test_the_report_is_built_once_when_tracking_ended() -> None:
    loop = Loop(leaky=False)
    with memsentry.track(loop.model) as t:
        loop.run(4)
        assert t.report() is not t.report()  # while running, as of now
    assert t.report() is t.report()


def test_bad_alarm_and_report_path_are_refused_before_tracking(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="alarm"):
        memsentry.track(alarm="print")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="report_path"):
        memsentry.track(report_path=tmp_path / "missing" / "r.json")


def test_watch_finds_the_leak_and_keeps_to_one_percent() -> None:
    loop = Loop()
    with memsentry.watch(loop.model) as w:
        loop.run(40)
    report = w.report()
    assert report.cost is not None and report.cost.budget == pytest.approx(0.01)
    assert [f.rule for f in report.findings] == ["tensor-accumulation"]
    assert loop.warned_at and 32 < loop.warned_at[0] <= 36


class Evaluating(Loop):
    """Training that keeps every fifth step's evaluation outputs with their graphs: the list
    gains one every 5 iterations. Its newest output is ``self.out`` too, so the censuses of 2
    to 4 see ``self.out`` alone, those of 6 and 10 one more in the list, and the rule finds
    the list only at 34, once it rose at two censuses."""

    def evaluate(self) -> None:
        if self.iteration % 5 == 0:
            self.out = self.model(torch.randn(8, 16))
            self.kept.append(self.out)

    def keep(self, loss: torch.Tensor) -> None:
        """The training loss is not kept."""


@pytest.mark.parametrize("mode", ["track", "watch", "watch, no budget left"])
def test_a_list_that_grows_every_fifth_step_is_said_within_a_100_step_run(mode: str) -> None:
    # It held from the census of 6, which first saw it, so the census of 66 (over eight times
    # as far) confirms it, said as iteration 67 begins. Under watch() that census is past the
    # seven always taken: it is taken whatever the account holds, as a verdict rests on it.
    loop = Evaluating()
    if mode == "track":
        tracker = memsentry.track(loop.model)
    else:
        tracker = memsentry.watch(loop.model, overhead=1e-6 if "no budget" in mode else 0.01)
    with warnings.catch_warnings(record=True) as at_the_end:
        warnings.simplefilter("always")
        with tracker as t:
            loop.run(100)
    assert loop.warned_at == [67]
    assert not [w for w in at_the_end if issubclass(w.category, memsentry.LeakWarning)]
    (leak,) = [f for f in t.report().findings if f.severity is memsentry.Severity.LEAK]
    assert leak.rule == "tensor-accumulation" and leak.subject is not None
    assert leak.subject.name == "self.kept"
    taken = [c.iteration for c in t.report().censuses]
    assert 66 in taken
    if "no budget" in mode:  # the account paid for none after 34 but that one and the end's
        assert [i for i in taken if i > 34] == [66, 99]


def test_a_holder_held_from_the_census_that_first_saw_it_never_before_the_third() -> None:
    at = [2, 3, 4, 6, 10, 18, 34]
    rows = {"outputs": [None, None, None, *holder_states("outputs", tensors=[1, 1, 3, 6])],
            "steady": holder_states("steady", tensors=[1, 1, 1, 2, 2, 4, 7]),
            "flushed": holder_states("flushed", tensors=[4, 5, 6, 8, 12, 2, 4])}
    built = report(iterations=iterations([1000] * 35), censuses=censuses(at, *rows.values()))
    series = holder_series(built)

    def leak(name: str) -> Finding:
        return Finding("tensor-accumulation", Severity.LEAK, "grows", "trim it",
                       subject=Subject.holder(path(name)))

    assert held_from(series, leak("outputs"), 34) == 6
    assert held_from(series, leak("steady"), 34) == SEEN_FROM == 4
    assert held_from(series, leak("steady"), 3) == 3  # found earlier still: from then
    assert held_from(series, leak("flushed"), 34) == 18  # it fell at 18: from there
    assert held_from(series, leak("absent"), 34) == 34  # no census saw it: as found
    loop_wide = Finding("memory-growth", Severity.LEAK, "grows", "look", bytes=1)
    assert held_from(series, loop_wide, 34) == 34


SCRIPT = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
history = []
for it in range(50):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    history.append(loss)
    print(f"iteration {it}", file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("watch", [False, True], ids=["run", "run --watch"])
def test_memsentry_run_says_the_leak_on_stderr_while_the_script_runs(
        tmp_path: Path, watch: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    report = tmp_path / "r.json"
    command = [sys.executable, "-m", "memsentry", "run", "--json", str(report), str(script)]
    if watch:
        command.insert(4, "--watch")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    (alarm,) = [i for i, line in enumerate(lines) if line.startswith("memsentry run: LEAK")]
    assert "tensor-accumulation: `history`" in lines[alarm]
    assert "iteration 49" in lines[alarm + 1:]  # said while the script still ran
    assert json.loads(report.read_text())["findings"][0]["rule"] == "tensor-accumulation"
