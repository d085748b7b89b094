"""pytest plugin: ``pytest --memsentry`` fails tests that leave device memory allocated.

Registered through the ``pytest11`` entry point. Without ``--memsentry`` (or ini
``memsentry = true``) and without ``memsentry`` markers nothing is measured: this module does
not import torch, and the hooks return at once for tests that are not checked. A checked test
is measured once torch is imported (a test whose module did not import torch is not measured:
importing torch allocates once).

How a verdict reaches the terminal: for a checked test the plugin runs pytest's own test
protocol (``runtestprotocol``) with logging deferred, measures after the teardown (when
pytest has dropped the test's fixture values), and when the test passed but leaked it turns
the *call* report into a failure whose ``longrepr`` is the one-line verdict, with the details
in a report section titled ``memsentry``. So a leaking test shows once, as ``LEAKED`` (``L``)
(``PEAK EXCEEDED``, ``P``, above ``max_peak``), is listed in FAILURES and in the short
summary with its verdict, and makes the exit code non-zero; since the report is a failure
when it is logged, pytest counts it as one for ``-x`` and ``--maxfail`` (under which the
repeats that tell growth from memory retained once run right after the test, not at the end).
A test that fails for its own
reason keeps its own failure; its leak is not judged (its traceback keeps its frames alive).
Skipped tests are not checked. A plugin that runs the protocol itself for a test
(pytest-rerunfailures with reruns) does so before memsentry; that test is then not checked.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest
from _pytest.runner import runtestprotocol

from memsentry.units import parse_size
from pytest_memsentry.garbage import Collector
from pytest_memsentry.marks import MARKERS, Limits, limits_for, marker_help
from pytest_memsentry.repeat import Pending, run_twice
from pytest_memsentry.results import (
    NAME,
    RETAINED,
    Measurement,
    Repeat,
    figures_of,
    judge,
    leaking,
    not_judged,
    retained_of,
    retained_summary,
    summary,
)

if TYPE_CHECKING:
    from memsentry import Tracker
    from pytest_memsentry.heap import HeapCheck
    from pytest_memsentry.measure import CudaApi, Window

LIMITS = pytest.StashKey[Limits]()
_TRIGGER_KIB = 64  # pytest_memsentry.heap.TRIGGER (not imported here: it imports torch)
STATUS = {"leaked": ("failed", "L", "LEAKED"), "peak": ("failed", "P", "PEAK EXCEEDED")}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memsentry", "memory leaks (memsentry)")
    group.addoption("--memsentry", action="store_true", default=False,
                    help="fail tests that leave memory allocated on a device (CPU, CUDA) "
                         "after they end")
    group.addoption("--memsentry-max-leak", metavar="SIZE", default=None,
                    help="memory a test may leave allocated per device, e.g. '1 MiB' "
                         "(default 0; ini memsentry_max_leak)")
    group.addoption("--memsentry-max-peak", metavar="SIZE", default=None,
                    help="the most a test may allocate at once per device, e.g. '2 GiB' "
                         "(default no limit; ini memsentry_max_peak)")
    group.addoption("--memsentry-strict", action="store_true", default=False,
                    help="fail tests for any memory they leave allocated; by default a "
                         "test that leaks is run twice more when every test has run and "
                         "fails only if the second of those keeps more again (memory "
                         "retained once is listed, not failed)")
    group.addoption("--memsentry-check", metavar="HOW", default=None,
                    help="how a test is first looked at: 'heap' (default: the growth of "
                         "glibc's heap in use, at no cost to the test's ops; a test that grew "
                         f"it by more than {_TRIGGER_KIB} KiB is run again with its tensor "
                         "storages counted) or 'storages' (every storage made by every op "
                         "counted from the first run: sees leaks of any size, at a cost per "
                         "op; ini memsentry_check)")
    group.addoption("--memsentry-repeat", metavar="WHEN", default=None,
                    help="when a test that left memory behind is run twice more: 'end' "
                         "(default: when every test has run, so no later test sees the "
                         "repeats' side effects; the test is reported then) or 'now' (right "
                         "after it, reported in its place; as under -x, --maxfail, "
                         "--stepwise and pytest-xdist; ini memsentry_repeat)")
    group.addoption("--memsentry-report", action="store_true", default=False,
                    help="print the tests with the largest leaks and peaks at the end")
    parser.addini("memsentry", "check every test for memory leaks (as --memsentry)",
                  type="bool", default=False)
    parser.addini("memsentry_strict", "fail for memory retained once too (as "
                  "--memsentry-strict)", type="bool", default=False)
    parser.addini("memsentry_check", "default of --memsentry-check", default="")
    parser.addini("memsentry_repeat", "default of --memsentry-repeat", default="")
    parser.addini("memsentry_max_leak", "default of --memsentry-max-leak", default="")
    parser.addini("memsentry_max_peak", "default of --memsentry-max-peak", default="")


def _size_option(config: pytest.Config, name: str) -> int | None:
    """The size given on the command line (which wins) or in the ini file; ``None`` if
    neither; ``pytest.UsageError`` naming the option when memsentry cannot read it."""
    value = config.getoption(name)
    source = f"--{name.replace('_', '-')}"
    if value is None:
        value = config.getini(name)
        source = f"ini option {name}"
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        return parse_size(value.strip() if isinstance(value, str) else value)
    except ValueError as error:
        raise pytest.UsageError(f"{source}={value!r}: {error}") from None


def _check_option(config: pytest.Config) -> str:
    return _choice(config, "memsentry_check", {
        "heap": "the default, cheap: a closer look only at tests that grew the heap",
        "storages": "every storage counted, any size"})


def _repeat_option(config: pytest.Config) -> str:
    return _choice(config, "memsentry_repeat", {
        "end": "the default: when every test has run, so that no later test sees a repeat's "
               "side effects",
        "now": "right after the test, which is then reported in its place"})


def _choice(config: pytest.Config, name: str, allowed: dict[str, str]) -> str:
    """The value of the option ``name`` from the command line (which wins) or the ini file,
    the first of ``allowed`` by default; ``pytest.UsageError`` naming the option and each
    allowed value (with what it does) otherwise."""
    value = config.getoption(name)
    source = f"--{name.replace('_', '-')}"
    if value is None:
        value = config.getini(name).strip() or next(iter(allowed))
        source = f"ini option {name}"
    if value not in allowed:
        choices = " or ".join(f"'{key}' ({text})" for key, text in allowed.items())
        raise pytest.UsageError(f"{source}={value!r}: use {choices}")
    return str(value)


def pytest_configure(config: pytest.Config) -> None:
    for name in MARKERS:
        config.addinivalue_line("markers", marker_help(name))
    defaults = Limits(
        max_leak=_size_option(config, "memsentry_max_leak") or 0,
        max_peak=_size_option(config, "memsentry_max_peak"),
    )
    enabled = bool(config.getoption("memsentry") or config.getini("memsentry"))
    config.pluginmanager.register(Manager(config, defaults, enabled), "memsentry-manager")


class Manager:
    """The session's state: which tests are checked and with what limits (in each item's
    stash), the test being measured, the CUDA figures of wider-scoped fixtures, and the
    figures collected for ``--memsentry-report``."""

    def __init__(self, config: pytest.Config, defaults: Limits, enabled: bool) -> None:
        self.config = config
        self.defaults = defaults
        self.enabled = enabled
        self.report = bool(config.getoption("memsentry_report"))
        self.strict = bool(config.getoption("memsentry_strict")
                           or config.getini("memsentry_strict"))
        self.check = _check_option(config)
        self.results: list[tuple[str, Any]] = []
        self.retained: list[tuple[str, str]] = []  # (nodeid, verdict) of tests that kept
        # memory once: listed at the end, failed only under --memsentry-strict
        self.pending: list[Pending] = []  # tests that left memory behind, to repeat
        self.cuda: CudaApi | None = None  # torch.cuda, once a test is measured
        self.collector = Collector()  # gc.collect() around each heap check
        # Repeat a test that left memory behind right after it (not when every test has run)
        # where its verdict is needed at once: a pytest-xdist worker reports each test while
        # it runs, and -x, --maxfail and --stepwise stop on the failures logged so far.
        self.at_once = bool(hasattr(config, "workerinput") or config.getoption("maxfail", 0)
                            or config.getoption("stepwise", False)
                            or _repeat_option(config) == "now")
        self.window: Window | HeapCheck | None = None
        self.fixture_growth: dict[Any, dict[int, int]] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Decide which tests are checked, validating every memsentry marker now: one
        ``pytest.UsageError`` lists every test with bad marker arguments."""
        errors: dict[pytest.Item, str] = {}
        for item in items:
            try:
                limits = limits_for(item, self.defaults, enabled=self.enabled)
            except pytest.UsageError as error:
                errors[item] = str(error)
                continue
            if limits is not None:
                item.stash[LIMITS] = limits
        if not errors:
            return
        if not hasattr(self.config, "workerinput"):
            raise pytest.UsageError("\n".join(errors.values()))
        # A pytest-xdist worker: its UsageError would reach nobody. Report each bad test as a
        # collection error, which xdist shows, and do not run it.
        for item, message in errors.items():
            self.config.hook.pytest_collectreport(
                report=pytest.CollectReport(item.nodeid, "failed", message, [])
            )
        items[:] = [item for item in items if item not in errors]

    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None
                                ) -> bool | None:
        limits = item.stash.get(LIMITS, None)
        if limits is None or "torch" not in sys.modules:
            return None  # pytest's own protocol runs the test
        window = self._window_for(limits)
        try:
            window.start()
        except Exception as error:  # never keep a test from running
            warnings.warn(f"memsentry could not measure {item.nodeid}: {error!r}",
                          pytest.PytestWarning, stacklevel=1)
            window.abort()
            return None
        self.window = window
        try:
            reports = runtestprotocol(item, nextitem=nextitem, log=False)
        except BaseException:
            window.abort()
            raise
        finally:
            self.window = None
        pending = self._judge(item, window, limits, reports)
        if pending is not None and self.at_once:
            # Logged below as a failure if it grows, so that pytest counts it before the
            # next test (its repeats' side effects come before the later tests then).
            self._conclude(pending, run_twice(pending, self))
        elif pending is not None:
            self.pending.append(pending)  # judged and logged when every test has run
            return True
        _log(item, reports)
        return True

    def _window_for(self, limits: Limits) -> Window | HeapCheck:
        """The heap check by default; tensor storages counted from the first run under
        ``--memsentry-strict`` (every leak fails, so each needs its tensors), for a peak
        limit (a peak is only known op by op), without glibc, and once CUDA is initialised
        (the CUDA figures name their tensors through the counter)."""
        import torch

        from pytest_memsentry import heap
        from pytest_memsentry.measure import TorchCuda, Window, warm_up

        if not (self.check == "storages" or self.strict or limits.max_peak is not None
                or not heap.available() or torch.cuda.is_initialized()):
            return heap.HeapCheck(self.collector)
        warm_up()
        if self.cuda is None:
            self.cuda = TorchCuda()
        return Window(self.cuda, self.fixture_growth, collector=self.collector)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, Any, None]:
        """When every test has run: run each test that left memory behind twice more, to tell
        growth from memory retained once, then log its outcome. Run at the end, the repeats
        cannot change what a later test sees."""
        outcome = yield
        if not self.pending:
            return
        interrupted = outcome.excinfo is not None or bool(session.shouldstop)
        pending, self.pending = self.pending, []
        for entry in pending:
            if interrupted:
                repeat = Repeat({}, "the run was interrupted before it could be repeated")
            else:
                repeat = run_twice(entry, self)
            self._conclude(entry, repeat)
            _log(entry.item, entry.reports)

    def _judge(self, item: pytest.Item, window: Window | HeapCheck, limits: Limits,
               reports: list[pytest.TestReport]) -> Pending | None:
        """Measure after teardown and put the verdict on the call report; a test that left
        memory behind is returned, to be repeated when every test has run (unless
        ``--memsentry-strict``, which fails it now)."""
        outcome = outcome_of(reports)
        if outcome is None:
            window.abort()
            return None
        measurement = _measure(item, window, limits, judged=outcome.judged)
        if measurement is None:
            return None
        entry = Pending(item, limits, measurement, reports, outcome.target)
        if not outcome.judged:
            _not_judged(outcome, measurement, limits)
            return None
        if not self.strict and leaking(measurement, limits):
            return entry
        self._conclude(entry, None)
        return None

    def _conclude(self, entry: Pending, repeat: Repeat | None) -> None:
        """The verdict on a test that passed (``repeat``: what its repeats kept)."""
        target = entry.target
        check, notes = judge(entry.measurement, entry.limits, repeat)
        for note in notes:
            warnings.warn(note, _leak_warning(), stacklevel=1)
        verdict = "passed"
        if check is not None:
            verdict = check.status
            target.sections.append((NAME, check.section))
            if check.fails:
                target.outcome = "failed"
                target.longrepr = check.long_repr
            else:
                target.user_properties.append((RETAINED, check.long_repr))
        target.user_properties.append((NAME, entry.measurement.figures(verdict)))

    def pytest_sessionfinish(self) -> None:
        self.collector.release()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any]
                             ) -> Generator[None, None, None]:
        """Memory a wider-scoped fixture makes while it is set up is the fixture's."""
        window = self.window
        if window is None or fixturedef.scope == "function":
            yield
            return
        window.fixture_starting()
        try:
            yield
        finally:
            window.fixture_done(fixturedef)

    @pytest.hookimpl(tryfirst=True)
    def pytest_report_teststatus(self, report: pytest.TestReport
                                 ) -> tuple[str, str, str] | None:
        if report.when != "call" or not report.failed:
            return None
        figures = figures_of(report.user_properties)
        if figures is None:
            return None
        return STATUS.get(figures.get("verdict", ""))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        retained = retained_of(report.user_properties)
        if retained is not None:
            self.retained.append((report.nodeid, retained))
        if self.report:
            figures = figures_of(report.user_properties)
            if figures is not None:
                self.results.append((report.nodeid, figures))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.retained:
            terminalreporter.write_sep("=", "memsentry: memory retained once")
            for line in retained_summary(self.retained):
                terminalreporter.write_line(line)
        if not self.report:
            return
        terminalreporter.write_sep("=", "memsentry report")
        for line in summary(self.results):
            terminalreporter.write_line(line)


class Outcome(NamedTuple):
    """What pytest's reports say of a test that ran: the report that carries memsentry's
    verdict (the first that failed, else the call's), whether its leak is judged (it passed,
    and was not an expected failure that passed) and whether it xpassed."""

    target: pytest.TestReport
    judged: bool
    xpassed: bool


def outcome_of(reports: list[pytest.TestReport]) -> Outcome | None:
    """The test's :class:`Outcome`; ``None`` for a test that is not checked: skipped, or
    only set up (``--setup-only``)."""
    if any(r.skipped for r in reports):
        return None
    call = _call_report(reports)
    failed = _failed_report(reports)
    target = failed or call
    if target is None:
        return None
    xpassed = call is not None and hasattr(call, "wasxfail")
    return Outcome(target, failed is None and not xpassed, xpassed)


def _call_report(reports: list[pytest.TestReport]) -> pytest.TestReport | None:
    return next((r for r in reports if r.when == "call"), None)


def _failed_report(reports: list[pytest.TestReport]) -> pytest.TestReport | None:
    """The first report that failed (setup, call or teardown), or ``None``."""
    return next((r for r in reports if r.failed), None)


def _measure(item: pytest.Item, window: Window | HeapCheck, limits: Limits, *,
             judged: bool) -> Measurement | None:
    """The window's measurement, or ``None`` with a warning when measuring failed: a
    measuring bug never loses the test's own result."""
    try:
        return window.finish(item, limits, judged=judged)
    except Exception as error:
        window.abort()
        warnings.warn(f"memsentry could not measure {item.nodeid}: {error!r}",
                      pytest.PytestWarning, stacklevel=1)
        return None


def _not_judged(outcome: Outcome, measurement: Measurement, limits: Limits) -> None:
    """A test that failed for its own reason (or xpassed): its figures, and the memory still
    allocated above the limit said not judged, and why."""
    target = outcome.target
    reason = ("the test xpassed (an expected failure)" if outcome.xpassed else
              "the test failed, and its traceback keeps its frames (and their "
              "tensors) alive")
    detail = not_judged(measurement, limits, reason)
    if detail is not None:
        target.sections.append((NAME, detail))
    target.user_properties.append((NAME, measurement.figures("not judged")))


def _log(item: pytest.Item, reports: list[pytest.TestReport]) -> None:
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in reports:
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


def _leak_warning() -> type[Warning]:
    from memsentry import LeakWarning

    return LeakWarning


@pytest.fixture
def memsentry() -> Iterator[Tracker]:
    """A memsentry tracker for this test, ``memsentry.track(on_leak="ignore")`` with global
    module hooks, entered before the test and exited at its teardown: call ``t.step()`` to
    close iterations and assert on ``t.report()``."""
    import memsentry as memsentry_package

    with memsentry_package.track(on_leak="ignore") as tracker:
        yield tracker
