"""Jupyter and IPython: ``%load_ext memsentry``, then

- ``%%memsentry [options]`` tracks one cell and shows its report under it;
- ``%memsentry start [options]`` ... ``%memsentry stop`` tracks every cell in between (with
  no optimizer, an iteration closes at each call of the first outermost module) and shows
  the report at the stop;
- ``%memsentry_report [--text]`` shows the last report again.

The cell runs in the notebook's namespace as IPython runs its own cells: compiled under a
name that tracebacks and :mod:`linecache` know (the magic's line stays line 1, so line
numbers are the cell's), and a trailing expression comes back as the cell's result, shown
and stored in ``Out``. The user's exceptions come out as they were raised; tracking stops
first, so no hook stays installed, and the report of what ran is kept. Options are checked,
and output files tried, before the cell runs. The magics hold reports (frozen values), never
a model or a tensor.
"""

from __future__ import annotations

import ast
import os
import sys
import types
import warnings
import weakref
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import (
    Magics,
    cell_magic,
    line_magic,
    magics_class,
    output_can_be_silenced,
)
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from torch import nn

from memsentry.cli.files import html_saved, reason, snapshot_saved
from memsentry.errors import LeakWarning, MemsentryError
from memsentry.model import Finding
from memsentry.paths import unwritable
from memsentry.report import Report
from memsentry.reporters.plotly import INSTALL_HINT, have_plotly
from memsentry.tracker import Tracker
from memsentry.usercode.lines import label_sources

#: The options ``%%memsentry`` and ``%memsentry start`` share, as ``memsentry run`` spells them.
_OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("--model",), {"metavar": "NAME", "help": "the notebook variable holding the "
                    "nn.Module to hook (default: every module called)"}),
    (("--device",), {"help": "device to measure (default: the model's, else the first "
                     "module's)"}),
    (("--exact",), {"action": "store_true", "help": "exact peaks (CPU: count every storage, "
                    "~1.15x slower; CUDA: resets the allocator's peak counter)"}),
    (("--json",), {"metavar": "FILE", "help": "also save the report as JSON to FILE"}),
    (("--html",), {"metavar": "FILE", "help": "also save the report as one self-contained "
                   "HTML page to FILE (needs memsentry[html])"}),
    (("--snapshot",), {"metavar": "FILE", "help": "also save the allocation history for "
                       "PyTorch's memory_viz; on CPU it implies --exact"}),
    (("--on-leak",), {"choices": ("warn", "raise", "ignore"), "default": "ignore",
                      "help": "what a LEAK finding does besides being shown: a LeakWarning, "
                      "a LeakError, or nothing (default)"}),
    (("--text",), {"action": "store_true",
                   "help": "show the text report instead of the HTML one"}),
)


_F = TypeVar("_F", bound=Callable[..., Any])
#: The shell's compiler called on a syntax tree (typeshed says it takes source text only).
_Compiler = Callable[[ast.mod, str, str], types.CodeType]


def _named(kind: Callable[[str], Any], name: str) -> Callable[[_F], _F]:
    """IPython's ``@cell_magic(name)`` or ``@line_magic(name)``, typed for a method."""
    decorator: Callable[[_F], _F] = kind(name)
    return decorator


def _tracking_options(magic: Callable[..., Any]) -> Callable[..., Any]:
    """Declare :data:`_OPTIONS` on a magic (for ``magic_arguments``)."""
    for flags, settings in reversed(_OPTIONS):
        magic = argument(*flags, **settings)(magic)
    return magic


@dataclass(frozen=True)
class _Outputs:
    """What to do with the report at the end: the files to write, and the form to show."""

    json: str | None = None
    html: str | None = None
    snapshot: str | None = None
    text: bool = False


@dataclass(frozen=True)
class _Cell:
    """A cell's body compiled as IPython compiles its own cells: the statements, and the
    trailing expression (``None`` when the cell does not end with one)."""

    body: types.CodeType
    last: types.CodeType | None


class _Shown:
    """A report as IPython shows it: the HTML page in a notebook, the text report where only
    text is shown (a terminal), and the text everywhere with ``text``."""

    def __init__(self, report: Report, *, text: bool) -> None:
        self.report, self.text = report, text

    def _repr_html_(self) -> str | None:
        return None if self.text else self.report._repr_html_()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self.report))

    def __repr__(self) -> str:
        return str(self.report)


def _parsed(magic: Callable[..., Any], line: str, name: str) -> Namespace:
    """The options of ``line``, or a UsageError naming the one that is wrong."""
    try:
        return parse_argstring(magic, line)
    except UsageError as error:
        raise UsageError(f"{name}: {error}; `{name.split()[0]}?` lists the options") from None


def _model(shell: InteractiveShell, name: str) -> nn.Module:
    """The module ``--model NAME`` names (``trainer.model`` reads an attribute)."""
    root, *attributes = name.split(".")
    if not all(part.isidentifier() for part in (root, *attributes)):
        raise UsageError(f"--model {name!r}: give the name of a variable of the notebook, "
                         "such as --model net (or net.encoder)")
    if root not in shell.user_ns:
        raise UsageError(f"--model {name!r}: the notebook has no variable {root!r}; run the "
                         "cell that defines it first, or leave --model out to hook every "
                         "module called")
    value = shell.user_ns[root]
    for attribute in attributes:
        if not hasattr(value, attribute):
            raise UsageError(f"--model {name!r}: {type(value).__name__} has no attribute "
                             f"{attribute!r}")
        value = getattr(value, attribute)
    if not isinstance(value, nn.Module):
        raise UsageError(f"--model {name!r} is a {type(value).__name__}, not a torch.nn.Module; "
                         "name the variable holding the model, or leave --model out to hook "
                         "every module called")
    return value


def _unquoted(path: str) -> str:
    """``path`` without the quotes around it: IPython splits a magic's line as Windows'
    shells do and keeps them (``--json "my runs/a.json"``)."""
    if len(path) >= 2 and path[0] == path[-1] and path[0] in "\"'":
        return path[1:-1]
    return path


def _outputs(args: Namespace) -> _Outputs:
    """The files ``args`` asks for, each tried before anything runs."""
    paths = {option: os.path.expanduser(_unquoted(path)) if path else None
             for option, path in (("--json", args.json), ("--html", args.html),
                                  ("--snapshot", args.snapshot))}
    if paths["--html"] and not have_plotly():
        raise UsageError(f"--html: the HTML report needs the plotly package: {INSTALL_HINT}")
    for option, path in paths.items():
        problem = unwritable(path) if path else None
        if problem is not None:
            raise UsageError(f"{option}: {problem}")
    return _Outputs(json=paths["--json"], html=paths["--html"], snapshot=paths["--snapshot"],
                    text=args.text)


def _tracker(shell: InteractiveShell, args: Namespace) -> Tracker:
    """A tracker for ``args`` (not started yet), or a UsageError saying what is wrong."""
    model = _model(shell, args.model) if args.model else None
    try:
        # A cell's leaks are shown with its report, then warned or raised of the cell
        # (``--on-leak``): nothing is said in the middle of it.
        return Tracker(model, device=args.device, exact=args.exact, on_leak=args.on_leak,
                       alarm=_at_the_end, snapshot=bool(args.snapshot))
    except (MemsentryError, TypeError, ValueError) as error:
        raise UsageError(f"--device {args.device!r}: {error}" if args.device else str(error)
                         ) from None


def _at_the_end(text: str, leaks: tuple[Finding, ...]) -> None:
    """The mid-run alarm of a tracked cell: silent, the end of the cell says it."""


def _cell_number(shell: InteractiveShell) -> int:
    """The number of the cell running now (``In[n]``, ``Out[n]``); IPython 9 counts the next
    one in ``execution_count`` while a cell runs, earlier versions this one."""
    count = getattr(shell.displayhook, "prompt_count", None)
    return count if isinstance(count, int) else shell.execution_count


def _compile(shell: InteractiveShell, cell: str, header: str) -> _Cell:
    """``cell`` transformed, cached and compiled by the shell's compiler (its ``__future__``
    flags, its AST transformers); the magic's line is kept, as a comment, as line 1."""
    source = f"# {header}\n{shell.transform_cell(cell)}"
    name = shell.compile.cache(source, _cell_number(shell), raw_code=source)
    tree = shell.transform_ast(shell.compile.ast_parse(source, filename=name))
    body = list(tree.body)
    last = body.pop() if body and isinstance(body[-1], ast.Expr) else None
    compiler = cast(_Compiler, shell.compile)  # it remembers the cells' __future__ imports
    module = compiler(ast.Module(body=body, type_ignores=[]), name, "exec")
    value = None if last is None else compiler(ast.Expression(last.value), name, "eval")
    return _Cell(module, value)


def _execute(shell: InteractiveShell, cell: _Cell) -> Any:
    """Run ``cell`` in the notebook's namespace; the value of its trailing expression."""
    __tracebackhide__ = True  # IPython's tracebacks go from the magic into the cell
    exec(cell.body, shell.user_global_ns, shell.user_ns)
    return None if cell.last is None else eval(cell.last, shell.user_global_ns, shell.user_ns)


def _stop_in_cell(tracker: Tracker, error: BaseException | None, cell: str) -> None:
    """``tracker.stop(error)``, its LeakWarning (``--on-leak warn``) said of the cell
    (``In[5]:1: LeakWarning: ...``) rather than of this module; other warnings as they were."""
    __tracebackhide__ = True
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tracker.stop(error)
    finally:
        for said in caught:
            where = (cell, 1) if issubclass(said.category, LeakWarning) \
                else (said.filename, said.lineno)
            warnings.warn_explicit(said.message, said.category, *where)


def _save(report: Report, tracker: Tracker, outputs: _Outputs) -> None:
    """Write the files asked for. One that cannot be written is said on standard error; the
    report is still shown, and ``%memsentry_report`` shows it again."""
    failures = []
    if outputs.json:
        try:
            report.to_json(outputs.json)
        except OSError as error:
            failures.append(f"--json: could not write {outputs.json!r} ({reason(error)})")
    if outputs.html:
        try:
            print(f"memsentry: {html_saved(report, outputs.html)}")
        except Exception as error:  # OSError, or plotly gone since the check
            failures.append(f"--html: could not write {outputs.html!r} ({reason(error)})")
    if outputs.snapshot:
        try:
            print(f"memsentry: {snapshot_saved(tracker, outputs.snapshot)}")
        except (OSError, ValueError, MemsentryError) as error:
            failures.append(f"--snapshot: could not write {outputs.snapshot!r} "
                            f"({reason(error)})")
    for failure in failures:
        print(f"memsentry: {failure}", file=sys.stderr)


@magics_class
class MemsentryMagics(Magics):
    """``%%memsentry``, ``%memsentry start|stop`` and ``%memsentry_report`` for one shell.

    Holds the tracker that runs across cells (which holds no model), its outputs, and the
    last report.
    """

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self.last: Report | None = None
        self._running: tuple[Tracker, _Outputs, int] | None = None  # across cells, since In[n]

    @property
    def ipython(self) -> InteractiveShell:
        """The shell these magics are registered with."""
        assert self.shell is not None, "MemsentryMagics is made by shell.register_magics()"
        return self.shell

    @property
    def tracking(self) -> bool:
        """Whether ``%memsentry start`` is tracking every cell."""
        return self._running is not None

    @output_can_be_silenced
    @magic_arguments(name="%%memsentry")
    @_tracking_options
    @_named(cell_magic, "memsentry")
    def memsentry_cell(self, line: str, cell: str) -> Any:
        """Track this cell with memsentry and show its report under it.

        Every module the cell calls is hooked (or the one --model names); each optimizer step
        closes an iteration (with none, each call of the first outermost module does). The
        cell's trailing expression is its result, as without the magic.
        """
        __tracebackhide__ = True
        args = _parsed(self.memsentry_cell, line, "%%memsentry")
        self._refuse_if_tracking("%%memsentry")
        outputs, tracker = self._prepared(args, "%%memsentry")
        compiled = _compile(self.ipython, cell, f"%%memsentry {line}".rstrip())
        tracker.start()
        try:
            value = _execute(self.ipython, compiled)
        except BaseException as error:
            try:
                self._stop(tracker, outputs, error)
            except Exception:  # never replace the user's error with memsentry's
                pass
            raise
        self._stop(tracker, outputs)
        return value

    @magic_arguments(name="%memsentry")
    @argument("action", nargs="?", choices=("start", "stop"),
              help="start: track every cell from here on; stop: end and show the report")
    @_tracking_options
    @_named(line_magic, "memsentry")
    def memsentry_line(self, line: str) -> None:
        """Track every cell from ``%memsentry start [options]`` to ``%memsentry stop``, then
        show the report. Iterations close at each optimizer step, else at each call of the
        first outermost module (a cell that runs the model once is an iteration)."""
        args = _parsed(self.memsentry_line, line, "%memsentry")
        if args.action is None:
            raise UsageError("%memsentry takes start or stop: `%memsentry start [options]` "
                             "tracks every cell until `%memsentry stop`; `%%memsentry` tracks "
                             "one cell")
        if args.action == "stop":
            given = [word for word in line.split() if word != "stop"]
            if given:
                raise UsageError(f"%memsentry stop takes no options (got {' '.join(given)}); "
                                 "give them to %memsentry start")
            self._stop_running()
            return
        self._refuse_if_tracking("%memsentry start")
        outputs, tracker = self._prepared(args, "%memsentry start")
        tracker.start()
        self._running = (tracker, outputs, _cell_number(self.ipython))

    @magic_arguments(name="%memsentry_report")
    @argument("--text", action="store_true", help="show the text report, not the HTML one")
    @_named(line_magic, "memsentry_report")
    def memsentry_report(self, line: str) -> None:
        """Show the last report again (of ``%%memsentry`` or ``%memsentry stop``; while
        ``%memsentry start`` tracks, the report so far)."""
        args = _parsed(self.memsentry_report, line, "%memsentry_report")
        if self._running is not None:
            display(_Shown(self._running[0].report(), text=args.text))
            return
        if self.last is None:
            raise UsageError("%memsentry_report: no report yet; track a cell with %%memsentry, "
                             "or cells with %memsentry start ... %memsentry stop")
        display(_Shown(self.last, text=args.text))

    # -- helpers -------------------------------------------------------------------------
    def _prepared(self, args: Namespace, name: str) -> tuple[_Outputs, Tracker]:
        """The outputs and the (unstarted) tracker ``args`` ask for; a UsageError, naming the
        option, the value and what to do, before anything runs."""
        try:
            return _outputs(args), _tracker(self.ipython, args)
        except UsageError as error:
            raise UsageError(f"{name} {error}") from None

    def _refuse_if_tracking(self, name: str) -> None:
        if self._running is not None:
            raise UsageError(f"{name}: %memsentry start is tracking every cell since "
                             f"In[{self._running[2]}]; run %memsentry stop first")

    def _stop_running(self) -> None:
        if self._running is None:
            raise UsageError("%memsentry stop: nothing is being tracked; start with "
                             "%memsentry start (or track one cell with %%memsentry)")
        tracker, outputs, _ = self._running
        self._running = None
        self._stop(tracker, outputs)

    def _stop(self, tracker: Tracker, outputs: _Outputs,
              error: BaseException | None = None) -> None:
        """Stop ``tracker`` (every hook removed), keep its report, write the files asked for
        and show it; after an error, say where the report is instead. A LeakError
        (``--on-leak raise``) comes after the report is shown."""
        __tracebackhide__ = True
        try:
            _stop_in_cell(tracker, error, f"In[{_cell_number(self.ipython)}]")
        finally:
            report = self.last = tracker.report()
            _save(report, tracker, outputs)
            if error is None:
                display(_Shown(report, text=outputs.text))
            else:
                print(f"memsentry: the cell raised {type(error).__name__}; tracking stopped, "
                      "and %memsentry_report shows what was recorded", file=sys.stderr)

    def unload(self) -> None:
        """Stop tracking across cells, if it runs, so that no hook stays installed."""
        if self._running is not None:
            tracker, _, _ = self._running
            self._running = None
            self.last = tracker.stop()


def _labeler(shell: InteractiveShell) -> Callable[[str], str | None]:
    """Names a cell's code ``In[5]`` in findings, through the shell's compiler (held weakly)."""
    compiler = weakref.ref(shell.compile)

    def label(path: str) -> str | None:
        found = compiler()
        named = found.format_code_name(path) if found is not None else None
        return named[1] if named else None

    return label


def load(shell: InteractiveShell) -> None:
    """``%load_ext memsentry``: register the magics with ``shell``."""
    shell.register_magics(MemsentryMagics)
    label_sources(_labeler(shell))


def unload(shell: InteractiveShell) -> None:
    """``%unload_ext memsentry``: stop tracking across cells and remove the magics."""
    magics = shell.magics_manager.registry.pop(MemsentryMagics.__name__, None)
    if isinstance(magics, MemsentryMagics):
        magics.unload()
        for kind, names in (("cell", ("memsentry",)), ("line", ("memsentry", "memsentry_report"))):
            for name in names:
                bound = shell.magics_manager.magics[kind].get(name)
                if getattr(bound, "__self__", None) is magics:
                    del shell.magics_manager.magics[kind][name]
    label_sources(None)


def magics_of(shell: InteractiveShell) -> MemsentryMagics | None:
    """The memsentry magics loaded into ``shell`` (``None`` before ``%load_ext memsentry``);
    ``magics_of(get_ipython()).last`` is the last report."""
    found = shell.magics_manager.registry.get(MemsentryMagics.__name__)
    return found if isinstance(found, MemsentryMagics) else None


__all__ = ["MemsentryMagics", "load", "magics_of", "unload"]
