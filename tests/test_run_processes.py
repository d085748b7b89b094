"""``memsentry run`` and the script's processes and threads, each case against ``python
script.py`` itself: a child the script forks reports nothing; ``os._exit`` from any thread
still leaves the report and the status; a Ctrl-C ends the process with python's status (which
depends on what the script imported); SIGTERM to a process group with DataLoader workers
prints nothing python would not.

``MEMSENTRY_SIGNAL_RUNS`` sets how many runs the racy case gets (4 by default)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_run_signals import _default_signals, _environment

from memsentry import Report

REPO = Path(__file__).resolve().parent.parent
BANNER = f"\n{'=' * 30} memsentry report {'=' * 30}\n"
TIMEOUT = 180
RUNS = int(os.environ.get("MEMSENTRY_SIGNAL_RUNS", "4"))

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "SIGHUP"),
                                reason="POSIX processes and signals")

#: A few training steps (an optimizer imports torch's compiler), then the case's ending.
TRAINED = """\
import os, signal, sys, threading, time
import torch
from torch import nn

model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
print("ready", flush=True)
"""


def _run(command: list[str], cwd: Path, send: int | None = None, *, group: bool = False
         ) -> subprocess.CompletedProcess[str]:
    """Run ``command``; with ``send``, deliver that signal once the script printed its first
    line (with ``group``, half a second later, to the whole process group)."""
    proc = subprocess.Popen(command, cwd=cwd, env=_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals,
                            start_new_session=group)
    first = ""
    try:
        if send is not None:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            if group:
                time.sleep(0.5)  # the loop runs on: the signal lands anywhere in it
                os.killpg(proc.pid, send)
            else:
                proc.send_signal(send)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, first + out, err)


def python(script: Path, send: int | None = None, *, group: bool = False
           ) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, script.name], script.parent, send, group=group)


def memsentry(script: Path, send: int | None = None, *, group: bool = False
              ) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "memsentry", "run", "--json", "r.json", script.name]
    return _run(command, script.parent, send, group=group)


def script_output(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout.split(BANNER)[0]


def assert_as_under_python(tracked: subprocess.CompletedProcess[str],
                           plain: subprocess.CompletedProcess[str], *,
                           same_line: bool = True) -> None:
    """Same status, same output of the script, the same standard error, one report. A
    signal sent from outside lands on whatever line each run is at (``same_line=False``):
    then the traceback's last line is compared, not the line it names."""
    assert tracked.returncode == plain.returncode, (
        f"memsentry run: {tracked.returncode}, python: {plain.returncode}\n"
        f"{tracked.stderr[-3000:]}")
    assert script_output(tracked) == plain.stdout
    if same_line:
        assert tracked.stderr == plain.stderr
    else:
        assert tracked.stderr.splitlines()[-1:] == plain.stderr.splitlines()[-1:]
        assert tracked.stderr.startswith("Traceback") == plain.stderr.startswith("Traceback")
    assert tracked.stdout.count(BANNER) == 1


# -- Ctrl-C: python's status, whatever its reason -----------------------------------------------
INTERRUPTS = {
    "raised": ("raise KeyboardInterrupt", None),
    "os.kill": ("os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(60)", None),
    "from the parent": ("time.sleep(60)", signal.SIGINT),
}


@pytest.mark.parametrize("form", list(INTERRUPTS))
def test_an_uncaught_interrupt_exits_with_pythons_status(tmp_path: Path, form: str) -> None:
    """With torch's compiler imported python exits 1 after an uncaught ``KeyboardInterrupt``
    (an atexit function of torch imports a module late); without torch it dies of SIGINT.
    ``memsentry run`` ends as python does in both (it died of SIGINT in both)."""
    body, send = INTERRUPTS[form]
    statuses = set()
    for name, head in (("trained.py", TRAINED), ("bare.py", 'import os, signal, time\n'
                                                             'print("ready", flush=True)\n')):
        script = tmp_path / name
        script.write_text(head + body + "\n", encoding="utf-8")
        plain, tracked = python(script, send), memsentry(script, send)
        assert_as_under_python(tracked, plain, same_line=send is None)
        assert plain.stderr.rstrip().endswith("KeyboardInterrupt")
        assert Report.from_json(tmp_path / "r.json") is not None
        statuses.add(plain.returncode)
    assert len(statuses) == 2  # python's two ends: each case above checked one


# -- forked children --------------------------------------------------------------------------
FORKS = """\
sys.stdout.flush()
pid = os.fork()
if pid == 0:
    child = nn.Bilinear(3, 3, 1)  # trained in the child only
    child(torch.randn(2, 3), torch.randn(2, 3)).sum().backward()
    print("child", flush=True)
{ending}
else:
    _, status = os.waitpid(pid, 0)
    print("the child exited with", os.waitstatus_to_exitcode(status), flush=True)
print("the end of the script", flush=True)
"""

CHILD_ENDINGS = {
    "returns": "    pass",
    "sys.exit": "    sys.exit(3)",
    "raises": "    raise ValueError('in the child')",
}


@pytest.mark.parametrize("ending", list(CHILD_ENDINGS))
def test_a_forked_child_prints_no_report_and_writes_no_file(tmp_path: Path,
                                                            ending: str) -> None:
    """A child made by ``os.fork()`` runs the rest of the script and ends as under python
    (its output, traceback and status, which the parent prints); only the process that
    started tracking prints the report and writes ``--json``."""
    script = tmp_path / "forks.py"
    script.write_text(TRAINED + FORKS.replace("{ending}", CHILD_ENDINGS[ending]),
                      encoding="utf-8")
    plain, tracked = python(script), memsentry(script)
    assert_as_under_python(tracked, plain)
    assert "child" in plain.stdout and "the child exited with" in plain.stdout
    names = {layer.name for layer in Report.from_json(tmp_path / "r.json").layers}
    assert "Linear" in names and "Bilinear" not in names  # the parent's report


# -- os._exit from a thread -------------------------------------------------------------------
MAIN_THREADS = {
    "sleeps": "time.sleep(60)",
    "joins the thread": "worker.join()",
    "trains": "while True:\n    model(torch.randn(64, 4)).sum().backward()\n    opt.step()",
}


@pytest.mark.parametrize("main", list(MAIN_THREADS))
def test_os_exit_from_a_thread_leaves_the_report_and_the_status(tmp_path: Path,
                                                                main: str) -> None:
    """``os._exit(5)`` in a thread other than the main one, whatever the main thread does:
    the report (as the documentation promises for ``os._exit``), then status 5."""
    script = tmp_path / "exits.py"
    script.write_text(TRAINED + textwrap.dedent("""\
        def leave():
            time.sleep(0.3)
            print("leaving", flush=True)
            os._exit(5)


        worker = threading.Thread(target=leave)
        worker.start()
        """) + MAIN_THREADS[main] + "\n", encoding="utf-8")
    plain, tracked = python(script), memsentry(script)
    assert_as_under_python(tracked, plain)
    assert plain.returncode == 5
    assert Report.from_json(tmp_path / "r.json").layer("Linear").calls >= 3


# -- SIGTERM to a process group with DataLoader workers ----------------------------------------
LOADER = """\
import time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Data(Dataset):
    def __len__(self):
        return 10**7

    def __getitem__(self, i):
        return torch.full((4096,), float(i % 7))


if __name__ == "__main__":
    model = nn.Linear(4096, 1)
    loader = DataLoader(Data(), batch_size=4, num_workers=2)
    started = time.monotonic()
    for step, batch in enumerate(loader):
        model(batch)
        if step == 20:
            print("ready", flush=True)
        if time.monotonic() - started > 60:  # a safety net: the test stops it long before
            break
"""


def _own_lines(text: str) -> str:
    """Standard error without memsentry's own lines (the report's notice)."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith("memsentry"))


def test_sigterm_to_a_group_with_dataloader_workers_prints_what_python_prints(
        tmp_path: Path) -> None:
    """The workers die of the same SIGTERM: python dies at once and says nothing. memsentry
    waited for the script to leave its timing of the batch fetch, and the script then saw
    its workers gone ("DataLoader worker ... exited unexpectedly") in most runs."""
    script = tmp_path / "loader.py"
    script.write_text(LOADER, encoding="utf-8")
    plain = python(script, signal.SIGTERM, group=True)
    assert plain.returncode == -signal.SIGTERM and plain.stderr == "", plain.stderr
    failures = []
    for run in range(RUNS):
        (tmp_path / "r.json").unlink(missing_ok=True)
        tracked = memsentry(script, signal.SIGTERM, group=True)
        problems = []
        if tracked.returncode != plain.returncode:
            problems.append(f"exit {tracked.returncode}")
        if _own_lines(tracked.stderr) != plain.stderr:
            problems.append("standard error: " + _own_lines(tracked.stderr)[-2000:])
        if tracked.stdout.count(BANNER) != 1 or not (tmp_path / "r.json").is_file():
            problems.append("no report")
        if problems:
            failures.append(f"run {run}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)
