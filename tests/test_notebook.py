"""The notebook magics in a real IPython shell: ``%load_ext memsentry``, ``%%memsentry`` on one
cell, ``%memsentry start`` ... ``%memsentry stop`` across cells, ``%memsentry_report``; and
IPython's output history (``Out``) named as the holder when cells end with a tensor."""

from __future__ import annotations

import builtins
import gc
import linecache
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.modules.module as module_globals
import torch.optim.optimizer as optimizer_globals

pytest.importorskip("IPython", reason="the notebook magics need IPython (pip install ipython)")

from conftest import optimizer_post_hooks
from IPython.core.error import UsageError
from IPython.core.interactiveshell import ExecutionResult, InteractiveShell
from IPython.utils.capture import capture_output
from traitlets.config import Config

import memsentry
from memsentry import Location, Report, Severity
from memsentry.integrations.notebook import MemsentryMagics, magics_of

OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

SETUP = """\
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
"""

#: A training loop that keeps every step's loss with its graph (line 8 of the cell, counting
#: the magic's line as 1, as Jupyter does).
LEAKY = """\
%%memsentry --text
losses = []
for step in range(8):
    loss = model(torch.randn(16, 32)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss)
"""
CLEAN = LEAKY.replace("losses.append(loss)", "losses.append(loss.item())")


def _hooks() -> dict[str, int]:
    """How many global module and optimizer hooks torch has now (memsentry's idle optimizer
    hook of the process left out: see conftest)."""
    counts = {name: len(getattr(owner, name)) for owner, names in (
        (module_globals, ("_global_forward_hooks", "_global_forward_pre_hooks")),
        (optimizer_globals, ("_global_optimizer_pre_hooks",)),
    ) for name in names}
    return {**counts, "_global_optimizer_post_hooks": len(optimizer_post_hooks())}


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[InteractiveShell]:
    """A fresh IPython shell (history in memory, its own profile directory) with memsentry's
    extension loaded; what it changed in the interpreter is put back afterwards."""
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    saved = {name: getattr(sys, name, None) for name in
             ("displayhook", "excepthook", "last_type", "last_value", "last_traceback",
              "last_exc")}
    main = sys.modules["__main__"]
    builtins_before = set(vars(builtins))
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    InteractiveShell.clear_instance()
    ipython = InteractiveShell.instance(config=config)
    ipython.display_formatter.active_types = ["text/plain"]  # no HTML pages: the tests are text
    try:
        run(ipython, "%load_ext memsentry")
        yield ipython
    finally:
        memsentry.unload_ipython_extension(ipython)
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = main
        for name, value in saved.items():
            if value is None:
                if hasattr(sys, name):
                    delattr(sys, name)
            else:
                setattr(sys, name, value)
        for name in set(vars(builtins)) - builtins_before:
            delattr(builtins, name)
        gc.collect()


def run(ipython: InteractiveShell, source: str) -> ExecutionResult:
    """Run one cell as a notebook does (stored in the history, its result in ``Out``)."""
    return ipython.run_cell(source, store_history=True)


def ok(ipython: InteractiveShell, source: str) -> ExecutionResult:
    result = run(ipython, source)
    assert result.success, (result.error_before_exec, result.error_in_exec)
    return result


def magics(ipython: InteractiveShell) -> MemsentryMagics:
    found = magics_of(ipython)
    assert found is not None
    return found


def last_report(ipython: InteractiveShell) -> Report:
    report = magics(ipython).last
    assert report is not None
    return report


def leaks(report: Report) -> list[Any]:
    return [f for f in report.findings if f.severity is Severity.LEAK]


def assert_iterations(report: Report, count: int) -> None:
    """The loop ran ``count`` iterations. The magics keep to memsentry's budget (they take no
    overhead option): a light iteration may pass with a count only, with no row in the
    timeline, so the iterations are counted in ``report.cost`` and the rows are some of them,
    in order; a row for the partial iteration closed at the end comes last, boundary "exit"."""
    assert report.cost is not None and report.cost.iterations == count
    indices = [it.index for it in report.iterations if it.boundary != "exit"]
    assert indices[:1] == [0] and indices == sorted(set(indices)) and indices[-1] < count
    assert [it.index for it in report.iterations if it.boundary == "exit"] in ([], [count])


# -- loading -----------------------------------------------------------------------------------
def test_load_ext_registers_the_three_magics(shell: InteractiveShell) -> None:
    assert shell.find_cell_magic("memsentry") is not None
    assert shell.find_line_magic("memsentry") is not None
    assert shell.find_line_magic("memsentry_report") is not None
    assert "memsentry" in shell.extension_manager.loaded


def test_importing_memsentry_does_not_import_ipython() -> None:
    code = ("import sys, memsentry; memsentry.track; memsentry.Report; "
            "assert 'IPython' not in sys.modules, 'IPython was imported'; "
            "assert callable(memsentry.load_ipython_extension)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_unload_ext_stops_tracking_and_removes_the_magics(shell: InteractiveShell) -> None:
    before = _hooks()
    ok(shell, SETUP)
    ok(shell, "%memsentry start --text")
    assert _hooks() != before  # every module call is hooked now
    ok(shell, "%unload_ext memsentry")
    assert _hooks() == before
    assert shell.find_cell_magic("memsentry") is None
    assert shell.find_line_magic("memsentry_report") is None


# -- %%memsentry -------------------------------------------------------------------------------
def test_a_cell_that_keeps_its_losses_is_reported_with_its_line(
        shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    ok(shell, SETUP)
    cell = shell.execution_count  # the number the next cell gets
    ok(shell, LEAKY)
    shown = capsys.readouterr().out
    assert "LEAK  tensor-accumulation: `losses`" in shown  # the report is shown under the cell
    (finding,) = leaks(last_report(shell))
    assert finding.rule == "tensor-accumulation"
    assert finding.subject is not None and finding.subject.name == "losses"
    assert "carry an autograd graph" in finding.message
    assert finding.location == Location(f"In[{cell}]", 8)  # losses.append(loss)
    assert f"In[{cell}]:8" in shown


def test_a_cell_with_no_module_nor_optimizer_is_judged_too(shell: InteractiveShell) -> None:
    ok(shell, "import torch\nW = torch.randn(30, 200, requires_grad=True)")
    cell = shell.execution_count
    ok(shell, "%%memsentry --text\nhist = []\nfor i in range(30):\n"
              "    loss = torch.tanh(torch.randn(32, 30) @ W).sum()\n    W.grad = None\n"
              "    loss.backward()\n    with torch.no_grad():\n        W -= 0.01 * W.grad\n"
              "    hist.append(loss)")
    report = last_report(shell)
    assert_iterations(report, 30)  # each backward pass closed one
    (finding,) = leaks(report)
    assert finding.subject is not None and finding.subject.name == "hist"
    assert "gains 1 tensor/iter" in finding.message  # each census counted in its time
    assert finding.location == Location(f"In[{cell}]", 9)  # hist.append(loss)


def test_a_clean_loop_gives_no_leak(shell: InteractiveShell) -> None:
    ok(shell, SETUP)
    ok(shell, CLEAN)
    report = last_report(shell)
    assert leaks(report) == []
    assert_iterations(report, 8)  # each optimizer step closed one
    assert len(shell.user_ns["losses"]) == 8


def test_the_cells_trailing_expression_is_its_result(shell: InteractiveShell,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cell = shell.execution_count
    result = ok(shell, "%%memsentry --text\nx = 2\nx * 21")
    assert result.result == 42
    assert shell.user_ns["Out"][cell] == 42
    assert shell.user_ns["_"] == 42
    assert f"Out[{cell}]: 42" in capsys.readouterr().out
    silenced = shell.execution_count
    assert ok(shell, "%%memsentry --text\n40 + 2;").result is None  # `;` silences, as usual
    assert silenced not in shell.user_ns["Out"]


def test_an_error_comes_out_unchanged_and_no_hook_stays(shell: InteractiveShell) -> None:
    before = _hooks()
    ok(shell, SETUP)
    result = run(shell, "%%memsentry --text\nfor step in range(3):\n    model(torch.randn(4, 32))"
                        "\n    if step == 2:\n        raise KeyError('step 2')")
    error = result.error_in_exec
    assert type(error) is KeyError and error.args == ("step 2",)
    frame = traceback.extract_tb(error.__traceback__)[-1]  # the traceback goes into the cell
    assert frame.lineno == 5
    assert linecache.getline(frame.filename, frame.lineno).strip() == "raise KeyError('step 2')"
    assert _hooks() == before
    kept = last_report(shell)
    assert kept.layers[0].calls == 3
    ok(shell, "model(torch.randn(4, 32))")  # a plain call afterwards leaves no trace
    assert last_report(shell) is kept and kept.layers[0].calls == 3


def test_an_out_of_memory_error_keeps_its_type_and_the_post_mortem(
        shell: InteractiveShell) -> None:
    before = _hooks()
    ok(shell, SETUP)
    ok(shell, "class Exhausted(nn.Module):\n    def forward(self, x):\n"
              "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate "
              "2.00 GiB')\nhungry = nn.Sequential(nn.Linear(32, 32), Exhausted())")
    result = run(shell, "%%memsentry --text\nfor step in range(3):\n"
                        "    hungry(torch.randn(4, 32)).sum().backward()")
    error = result.error_in_exec
    assert type(error) is OutOfMemoryError
    assert str(error) == "CUDA out of memory. Tried to allocate 2.00 GiB"
    oom = last_report(shell).oom
    assert oom is not None and oom.requested_bytes == 2 * 2**30
    if sys.version_info >= (3, 11):  # memsentry's verdict rides on the error as a note
        assert error.__notes__[0].startswith("memsentry: out of memory in the forward")
    assert _hooks() == before


def test_the_magic_leaves_the_results_bitwise_the_same(shell: InteractiveShell) -> None:
    loop = ("torch.manual_seed(1)\nnet = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), "
            "nn.Linear(16, 1))\nsgd = torch.optim.Adam(net.parameters())\nlosses = []\n"
            "for step in range(6):\n    x = torch.randn(5, 8)\n"
            "    loss = (net(x) - x.sum(1, keepdim=True)).pow(2).mean()\n"
            "    loss.backward()\n    sgd.step()\n    sgd.zero_grad()\n"
            "    losses.append(loss.detach())\n"
            "result = (torch.stack(losses), [p.detach().clone() for p in net.parameters()])")
    ok(shell, SETUP)
    ok(shell, loop)
    plain = shell.user_ns["result"]
    ok(shell, "%%memsentry --text --exact\n" + loop)
    tracked = shell.user_ns["result"]
    assert last_report(shell).layers  # it did track
    assert torch.equal(plain[0], tracked[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], tracked[1], strict=True))


def test_json_is_written_and_model_names_the_layers(shell: InteractiveShell,
                                                   tmp_path: Path) -> None:
    ok(shell, SETUP)
    path = tmp_path / "my runs" / "cell.json"  # a space: the path is given in quotes
    path.parent.mkdir()
    ok(shell, f'%%memsentry --text --model model --json "{path}"\nmodel(torch.randn(4, 32));')
    saved = Report.from_json(path)
    assert [layer.name for layer in saved.layers] == ["Sequential", "0", "1", "2"]
    assert saved.layers == last_report(shell).layers


def test_on_leak_raise_shows_the_report_then_raises(shell: InteractiveShell,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ok(shell, SETUP)
    result = run(shell, LEAKY.replace("--text", "--text --on-leak raise"))
    assert isinstance(result.error_in_exec, memsentry.LeakError)
    assert "LEAK  tensor-accumulation: `losses`" in capsys.readouterr().out


def test_on_leak_warn_warns_of_the_cell(shell: InteractiveShell) -> None:
    ok(shell, SETUP)
    cell = shell.execution_count
    with pytest.warns(memsentry.LeakWarning, match="tensor-accumulation: `losses`") as said:
        ok(shell, LEAKY.replace("--text", "--text --on-leak warn"))
    assert [(w.filename, w.lineno) for w in said] == [(f"In[{cell}]", 1)]


@pytest.mark.parametrize(("options", "said"), [
    ("--on-leak loud", "'loud'"),
    ("--bogus", "--bogus"),
    ("--json /no/such/folder/r.json", "the folder of '/no/such/folder/r.json' does not exist"),
    ("--snapshot .", "'.' is a directory"),
    ("--model nothing_here", "no variable 'nothing_here'"),
    ("--model opt", "'opt' is a SGD, not a torch.nn.Module"),
    ("--device tpu", "--device 'tpu'"),
])
def test_a_bad_option_is_refused_before_the_cell_runs(shell: InteractiveShell, options: str,
                                                     said: str) -> None:
    ok(shell, SETUP)
    result = run(shell, f"%%memsentry {options}\nran = True")
    assert isinstance(result.error_in_exec, UsageError)
    assert said in str(result.error_in_exec)
    assert "ran" not in shell.user_ns
    assert magics(shell).last is None


# -- %memsentry start ... stop: the output history ------------------------------------------------
def test_cells_ending_with_a_tensor_fill_the_output_history(
        shell: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    before = _hooks()
    ok(shell, SETUP)
    ok(shell, "%memsentry start --text")
    for _ in range(8):
        ok(shell, "model(torch.randn(16, 32))")  # IPython keeps each result in Out[n]
    capsys.readouterr()
    ok(shell, "%memsentry stop")
    shown = capsys.readouterr().out
    assert _hooks() == before
    found = [f for f in leaks(last_report(shell)) if f.rule == "tensor-accumulation"]
    assert len(found) == 1, shown
    (finding,) = found
    assert finding.subject is not None and finding.subject.name == "Out"
    assert "this is IPython's output history" in finding.message
    assert "carry an autograd graph" in finding.message
    assert "`%reset -f out`" in finding.fix and "end such cells with `;`" in finding.fix
    assert "LEAK  tensor-accumulation: `Out`" in shown
    # The forwards of 8 cells, none under no_grad: one finding naming the cells, not 8.
    (waste,) = [f for f in last_report(shell).findings if f.rule == "missing-no-grad"]
    assert " in 8 notebook cells (In[" in waste.message, waste.message
    assert waste.location is not None and waste.location.file.startswith("In[")


def test_cells_ending_with_a_semicolon_keep_nothing(shell: InteractiveShell) -> None:
    ok(shell, SETUP)
    ok(shell, "%memsentry start --text")
    for _ in range(8):
        ok(shell, "model(torch.randn(16, 32));")
    ok(shell, "%memsentry stop")
    assert [f for f in last_report(shell).findings if f.subject is not None
            and f.subject.name == "Out"] == []
    # each call of the model closed the one before it; the eighth's closed at the stop
    assert_iterations(last_report(shell), 7)
    assert last_report(shell).iterations[-1].boundary == "exit"


def test_start_and_stop_refuse_what_does_not_fit(shell: InteractiveShell) -> None:
    ok(shell, SETUP)
    stop = run(shell, "%memsentry stop").error_in_exec
    assert isinstance(stop, UsageError) and "nothing is being tracked" in str(stop)
    assert isinstance(run(shell, "%memsentry").error_in_exec, UsageError)
    started = shell.execution_count
    ok(shell, "%memsentry start --text")
    again = run(shell, "%memsentry start").error_in_exec
    assert isinstance(again, UsageError) and f"since In[{started}]" in str(again)
    cell = run(shell, "%%memsentry\nran = True").error_in_exec
    assert isinstance(cell, UsageError) and "%memsentry stop first" in str(cell)
    assert "ran" not in shell.user_ns
    options = run(shell, "%memsentry stop --text").error_in_exec
    assert isinstance(options, UsageError) and "give them to %memsentry start" in str(options)
    ok(shell, "%memsentry stop")


# -- %memsentry_report -----------------------------------------------------------------------------
def test_memsentry_report_shows_the_last_report(shell: InteractiveShell,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    none_yet = run(shell, "%memsentry_report").error_in_exec
    assert isinstance(none_yet, UsageError) and "no report yet" in str(none_yet)
    ok(shell, SETUP)
    ok(shell, LEAKY)
    capsys.readouterr()
    ok(shell, "%memsentry_report --text")
    assert capsys.readouterr().out.strip() == str(last_report(shell)).strip()


def test_in_a_notebook_the_report_is_the_html_page(shell: InteractiveShell) -> None:
    pytest.importorskip("plotly", reason="the HTML report needs plotly (memsentry[html])")
    shell.display_formatter.active_types = shell.display_formatter.format_types
    ok(shell, SETUP)
    ok(shell, LEAKY.replace("%%memsentry --text", "%%memsentry"))
    with capture_output() as captured:
        ok(shell, "%memsentry_report")
    (shown,) = captured.outputs
    assert "tensor-accumulation" in shown.data["text/html"]
    assert shown.data["text/plain"] == str(last_report(shell))
