"""The verdict on what one test's measurement found (:mod:`pytest_memsentry.measurement`, whose
values this module gives too), and the end-of-run table: plain values and text, no torch, no
pytest state (the plugin measures; this module judges and formats)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from memsentry.units import format_bytes, parse_size
from pytest_memsentry.marks import Limits
from pytest_memsentry.measurement import TOP, DeviceFigures, LeakedTensor, Measurement, Repeat

#: The name of the report section and of the ``user_properties`` entry.
NAME = "memsentry"
#: The ``user_properties`` entry of a test that retained memory once: its one-line verdict.
RETAINED = "memsentry-retained"

LEAK_FIX = (
    "fix: release what keeps them when the test ends (del it, .clear() the container, or make "
    "it in a function-scoped fixture that frees it at teardown), or allow it: "
    "@pytest.mark.memsentry(max_leak={allow!r})"
)
CYCLE_FIX = (
    "fix: no Python object holds them: break the cycle the note above names, or allow it: "
    "@pytest.mark.memsentry(max_leak={allow!r})"
)
GRAPH_NOTE = (
    "note: a kept tensor with a grad_fn keeps its autograd graph and the tensors it saved for "
    "backward: keep .detach()ed tensors (.item() for numbers), or run the code under "
    "torch.no_grad()"
)
UNREACHED = "nothing memsentry reached (a closure, a hook, torch's own state?)"
UNREACHED_WITH_GRAPHS = "not reached: saved for backward by a kept graph (grad_fn)?"
AUTOGRAD_CYCLE = (
    "a reference cycle inside autograd's graph (C++), which gc.collect() cannot free: an "
    "in-place op on a tensor that requires grad"
)
GRAD_CYCLE = "a cycle: a leaf and its .grad's graph (backward(create_graph=True))"
GRAD_CYCLE_NOTE = (
    "note: backward(create_graph=True) gives each leaf's .grad a graph that refers back to the "
    "leaf, a cycle inside autograd's graph that only ends with the process (PyTorch warns of "
    "it), and each backward adds to a .grad that is not cleared: set `p.grad = None` for every "
    "leaf when its gradient is used (zero_grad() clears only the parameters its optimizer "
    "holds), or take the gradients with torch.autograd.grad(loss, params, create_graph=True), "
    "which stores none"
)
CYCLES = (AUTOGRAD_CYCLE, GRAD_CYCLE)
CYCLE_NOTE = (
    "note: an in-place op on a tensor that requires grad (`a += a * y`, `x[:, 1:] = "
    "f(x[:, :-1])`) can make a cycle inside autograd's graph that only ends with the process: "
    "write it out of place (`a = a + a * y`), or run it under torch.no_grad() when no gradient "
    "is needed"
)
RETAINED_NOTE = (
    "run a second time, the test kept no more ({again}): memory retained once (state "
    "overwritten on every call, a cache filled on first use), not growth; it fails only "
    "under --memsentry-strict"
)
UNREPEATED_NOTE = (
    "the test could not be run a second time to tell growth from memory retained once "
    "({error}), so it did not fail; it fails under --memsentry-strict"
)
PEAK_FIX = (
    "fix: allocate less at once (smaller inputs, free intermediates sooner, torch.no_grad() "
    "where no backward follows), or allow it: @pytest.mark.memsentry(max_peak={allow!r})"
)


@dataclass(frozen=True)
class Check:
    """A failed check: ``long_repr`` is the one-line verdict pytest shows for the test,
    ``section`` the details (the report section titled ``memsentry``), ``status`` what failed
    (``"leaked"`` or ``"peak"``)."""

    status: str
    long_repr: str
    section: str

    @property
    def fails(self) -> bool:
        return self.status != "retained"


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def allowance(value: int) -> str:
    """``value`` as a size string that :func:`parse_size` reads back as at least ``value``
    (``format_bytes`` rounds to one decimal, which can round down)."""
    text = format_bytes(value)
    if parse_size(text) >= value:
        return text
    number, unit = text.split()
    factor = parse_size(f"1 {unit}")
    step = 10 if "." in number else 1
    return f"{math.ceil(value * step / factor) / step:g} {unit}"


def _limit(value: int | None) -> str:
    return "no limit" if value is None else f"limit {format_bytes(value)}"


def _leaking(figures: DeviceFigures, limits: Limits) -> bool:
    return figures.leaked > limits.max_leak


def _peaking(figures: DeviceFigures, limits: Limits) -> bool:
    return limits.max_peak is not None and figures.peak > limits.max_peak


def _leak_clause(figures: DeviceFigures, limits: Limits) -> str:
    clause = f"{format_bytes(figures.leaked)} leaked on {figures.device} " \
             f"({_limit(limits.max_leak)})"
    if figures.tensors:
        clause += f" by {plural(figures.tensors, 'tensor')} still alive after the test"
    else:
        clause += " still allocated after the test"
    if figures.driver is not None:
        clause += f", confirmed by the driver (+{format_bytes(figures.driver)} used)"
    return clause


def _device_line(figures: DeviceFigures, limits: Limits) -> str:
    line = (f"{figures.device}: {format_bytes(figures.leaked)} left allocated "
            f"({_limit(limits.max_leak)}), peak {format_bytes(figures.peak)} "
            f"({_limit(limits.max_peak)})")
    if figures.driver is not None:
        line += f"; the driver reports {format_bytes(figures.driver)} more used"
    return line


def _held_by(tensor: LeakedTensor, unreached: str) -> str:
    """The table's "held by" cell: the holder (with its graph), or ``unreached``."""
    if tensor.holder is None:
        return unreached
    named = tensor.holder not in CYCLES
    return f"{tensor.holder}, with grad_fn" if tensor.grad_fn and named else tensor.holder


def _tensor_table(measurement: Measurement, devices: set[str]) -> list[str]:
    rows = [t for t in measurement.tensors if t.device in devices]
    if not rows:
        return []
    from tabulate import tabulate

    rows.sort(key=lambda t: (-t.bytes, t.holder is None, t.holder or ""))
    table = tabulate(
        _table_cells(rows), headers=["bytes", "tensor", "device", "held by", "allocated at"],
        tablefmt="simple", disable_numparse=True, colalign=("right",),
    )
    lines = ["still alive after the test's teardown and gc.collect(), largest first:", table]
    if measurement.hidden:
        lines.append(f"and {measurement.hidden} more ({format_bytes(measurement.hidden_bytes)})")
    return lines


def _table_cells(rows: list[LeakedTensor]) -> list[list[str]]:
    """The cells of the table's rows; those not reached say why they may not have been."""
    unreached = UNREACHED_WITH_GRAPHS if any(t.grad_fn for t in rows) else UNREACHED
    return [[format_bytes(t.bytes), t.tensor or "?", t.device, _held_by(t, unreached),
             t.site or "?"] for t in rows]


def leaking(measurement: Measurement, limits: Limits) -> bool:
    """Whether some device kept more than ``limits.max_leak`` (confirmed, on CUDA)."""
    return any(_leaking(f, limits) and f.confirmed for f in measurement.devices)


def judge(measurement: Measurement, limits: Limits,
          repeat: Repeat | None = None) -> tuple[Check | None, list[str]]:
    """The verdict on a test that passed: a :class:`Check` when it leaked more than
    ``limits.max_leak`` or peaked above ``limits.max_peak`` on some device, else ``None``;
    and warnings (CUDA allocator growth the driver did not confirm).

    With ``repeat`` (the test run a second time), a leak fails only on the devices where the
    second run kept more again; memory retained once gives a Check with status
    ``"retained"``, which does not fail the test, and only where there is something to look
    at (:func:`evidence`): the heap's growth alone is dropped. Without ``repeat``
    (``--memsentry-strict``) every leak fails."""
    leaks = _leak_verdict(measurement, limits, repeat)
    peaked = [f for f in measurement.devices if _peaking(f, limits)]
    clauses = [*leaks.clauses, *(_peak_clause(f, limits) for f in peaked)]
    if not clauses:
        return None, leaks.warnings
    check = Check(
        status=_status(leaks, peaked),
        long_repr=f"{NAME}: " + "; ".join(clauses),
        section="\n".join(_section(measurement, limits, leaks, peaked, repeat)),
    )
    return check, leaks.warnings


class Leaks(NamedTuple):
    """What a test kept beyond ``max_leak``: the devices the verdict names (``leaked``), those
    that kept more again when the test was repeated (``grew``: all of them without a repeat),
    a clause of the one-line verdict for each, and warnings for CUDA allocator growth the
    driver did not confirm."""

    leaked: list[DeviceFigures]
    grew: list[DeviceFigures]
    clauses: list[str]
    warnings: list[str]


def _leak_verdict(measurement: Measurement, limits: Limits, repeat: Repeat | None) -> Leaks:
    """The leaks a verdict names: without ``repeat`` every leak; with it, growth where the
    second run kept more again, else memory retained once where there is something to look
    at."""
    leaks = _leaks(measurement, limits)
    if repeat is None:
        return leaks
    grew = [f for f in leaks.leaked if repeat.grows(f.device, limits)]
    if not grew:
        retained = [f for f in leaks.leaked if evidence(measurement, f.device)]
        return Leaks(retained, grew, _retained_clauses(measurement, retained, limits),
                     leaks.warnings)
    clauses = leaks.clauses
    if repeat.error is None:
        clauses = [*clauses, f"run again, it kept {repeat.figures()}: it grows with every run"]
    failures = repeat.failures()
    if failures is not None:
        clauses = [*clauses, failures]
    return leaks._replace(grew=grew, clauses=clauses)


def _retained_clauses(measurement: Measurement, retained: list[DeviceFigures],
                      limits: Limits) -> list[str]:
    """A clause per device that retained memory once; the last says where to look."""
    clauses = [_leak_clause(f, limits).replace(" leaked on ", " retained on ", 1)
               for f in retained]
    if clauses:
        clauses[-1] += f" ({_pointers(measurement)})"
    return clauses


def _peak_clause(figures: DeviceFigures, limits: Limits) -> str:
    return (f"peak {format_bytes(figures.peak)} on {figures.device} above the "
            f"limit of {format_bytes(limits.max_peak)} (max_peak)")


def _status(leaks: Leaks, peaked: list[DeviceFigures]) -> str:
    """What failed: ``"leaked"`` (it grows), ``"peak"``, or ``"retained"`` (kept once)."""
    if leaks.grew:
        return "leaked"
    return "peak" if peaked else "retained"


def _section(measurement: Measurement, limits: Limits, leaks: Leaks,
             peaked: list[DeviceFigures], repeat: Repeat | None) -> list[str]:
    """The lines of the report section: each device's figures, the table of the leaked
    tensors, the measurement's notes, then what they mean and the fixes."""
    lines = [_device_line(f, limits) for f in measurement.devices]
    lines += _tensor_table(measurement, {f.device for f in leaks.leaked})
    lines += measurement.notes
    lines += _notes(measurement, limits, leaks.leaked, peaked,
                    repeat if not leaks.grew else None)
    return lines


def evidence(measurement: Measurement, device: str) -> bool:
    """Whether what a test kept on ``device`` can be looked for: tensor storages counted
    there (with the line that made each), or a holder named. The heap check's growth is
    neither: pytest's reports and the one-time set-up of libraries grow the heap too."""
    return any(f.device == device and f.tensors and not measurement.heap
               for f in measurement.devices) or any(
        t.device == device and t.holder for t in measurement.tensors)


def _pointers(measurement: Measurement) -> str:
    """Where to look for what a test retained: up to two holders, else up to two lines."""
    named = [t.holder for t in measurement.tensors if t.holder][:2]
    if named:
        return ", ".join(named)
    sites = list(dict.fromkeys(t.site for t in measurement.tensors if t.site))[:2]
    return "allocated at " + ", ".join(sites) if sites else "held by nothing memsentry reached"


def _leaks(measurement: Measurement, limits: Limits) -> Leaks:
    """The devices that kept more than the limit (all of them grew: no repeat told
    otherwise), a clause for each, and warnings for CUDA allocator growth the driver did not
    confirm."""
    over = [f for f in measurement.devices if _leaking(f, limits)]
    leaked = [f for f in over if f.confirmed]
    return Leaks(leaked, leaked, [_leak_clause(f, limits) for f in leaked],
                 [_unconfirmed_warning(f, limits) for f in over if not f.confirmed])


def _unconfirmed_warning(figures: DeviceFigures, limits: Limits) -> str:
    return (
        f"memsentry: the CUDA caching allocator holds {format_bytes(figures.leaked)} "
        f"more on {figures.device} after the test ({_limit(limits.max_leak)}), but the "
        f"driver's used memory grew by {format_bytes(figures.driver or 0)}, so the leak "
        "was not confirmed and the test was not failed; if it repeats, look for "
        "tensors the test keeps"
    )


def _notes(measurement: Measurement, limits: Limits, leaked: list[DeviceFigures],
           peaked: list[DeviceFigures], retained: Repeat | None) -> list[str]:
    """What the kept tensors mean and the fixes (``retained``: the second run that kept no
    more)."""
    lines = _graph_notes(measurement)
    if leaked and retained is not None:
        lines.append(_retained_note(retained))
    if leaked:
        fix = CYCLE_FIX if _only_cycles(measurement) else LEAK_FIX
        lines.append(fix.format(allow=allowance(max(f.leaked for f in leaked))))
    if peaked:
        lines.append(PEAK_FIX.format(allow=allowance(max(f.peak for f in peaked))))
    return lines


def _only_cycles(measurement: Measurement) -> bool:
    """Whether every kept tensor listed is kept by a cycle inside autograd's graph: no
    holder to release."""
    return bool(measurement.tensors) and all(t.holder in CYCLES for t in measurement.tensors)


def _graph_notes(measurement: Measurement) -> list[str]:
    """The notes on kept autograd graphs: a cycle inside one, a tensor that keeps one."""
    lines = []
    if any(t.holder == AUTOGRAD_CYCLE for t in measurement.tensors):
        lines.append(CYCLE_NOTE)
    if any(t.holder == GRAD_CYCLE for t in measurement.tensors):
        lines.append(GRAD_CYCLE_NOTE)
    if any(t.grad_fn and t.holder not in CYCLES for t in measurement.tensors):
        lines.append(GRAPH_NOTE)
    return lines


def _retained_note(retained: Repeat) -> str:
    """Why memory retained once did not fail the test (or why it could not be told)."""
    if retained.error is None:
        failures = retained.failures()
        note = RETAINED_NOTE.format(again=retained.figures())
        return note if failures is None else f"{note}; {failures}"
    return UNREPEATED_NOTE.format(error=retained.error)


def not_judged(measurement: Measurement, limits: Limits, reason: str) -> str | None:
    """The section for a test that failed for its own reason while memory was still allocated
    above the limit: it says the leak was not judged, and why; ``None`` when nothing was."""
    over = [f for f in measurement.devices if _leaking(f, limits)]
    if not over:
        return None
    still = ", ".join(f"{format_bytes(f.leaked)} on {f.device}" for f in over)
    return (f"leak not judged: {reason}; {still} still allocated after it "
            f"({_limit(limits.max_leak)})")


def _property(user_properties: Iterable[Any], name: str, kind: type) -> Any:
    """The value of the ``name`` entry of a report's ``user_properties`` when it is a
    ``kind``, or ``None`` (pytest-xdist may turn the tuples into lists)."""
    for entry in user_properties:
        if len(entry) == 2 and entry[0] == name and isinstance(entry[1], kind):
            return entry[1]
    return None


def figures_of(user_properties: Iterable[Any]) -> Mapping[str, Any] | None:
    """The figures a report carries, or ``None``."""
    figures: Mapping[str, Any] | None = _property(user_properties, NAME, Mapping)
    return figures


def retained_of(user_properties: Iterable[Any]) -> str | None:
    """The one-line verdict of a test that retained memory once, or ``None``."""
    verdict: str | None = _property(user_properties, RETAINED, str)
    return verdict


def retained_summary(entries: list[tuple[str, str]]) -> list[str]:
    """The end-of-run list of the tests that kept memory once but not more on a second run:
    not failed (``--memsentry-strict`` fails them), listed so that they are seen."""
    lines = [f"{nodeid}: {verdict.removeprefix(NAME + ': ')}" for nodeid, verdict in entries]
    lines.append(
        f"{plural(len(entries), 'test')} kept memory after the first run but no more on a "
        "second run (state overwritten on every call, a cache "
        "filled on first use): not failed; --memsentry-strict fails them"
    )
    return lines


class SummaryRow(NamedTuple):
    """A row of the ``--memsentry-report`` table: one test on one device."""

    test: str
    device: str
    leaked: int
    peak: int
    verdict: str


def _summary_rows(entries: list[tuple[str, Mapping[str, Any]]]) -> list[SummaryRow]:
    return [SummaryRow(nodeid, device, values["leaked"], values["peak"], figures["verdict"])
            for nodeid, figures in entries
            for device, values in figures["devices"].items()]


def _summary_table(title: str, chosen: list[SummaryRow]) -> list[str]:
    """The ``title`` line and the table of ``chosen`` (``none`` when there is no row)."""
    if not chosen:
        return [f"{title}: none"]
    from tabulate import tabulate

    table = tabulate(
        [[r.test, r.device, format_bytes(r.leaked), format_bytes(r.peak), r.verdict]
         for r in chosen],
        headers=["test", "device", "leaked", "peak", "verdict"], tablefmt="simple",
        disable_numparse=True, colalign=("left", "left", "right", "right", "left"),
    )
    return [f"{title}:", table]


def summary(entries: list[tuple[str, Mapping[str, Any]]], top: int = TOP) -> list[str]:
    """The ``--memsentry-report`` text: the tests with the largest leaks and the largest peaks
    (``top`` of each), one row per test and device."""
    if not entries:
        return ["no test was measured: run with --memsentry, or mark tests with "
                "@pytest.mark.memsentry (tests are measured once torch is imported)"]
    rows = _summary_rows(entries)
    leaks = sorted((r for r in rows if r.leaked > 0), key=lambda r: -r.leaked)
    failed = sum(1 for _nodeid, figures in entries if figures["verdict"] in ("leaked", "peak"))
    return [
        f"{plural(len(entries), 'test')} measured, {failed} failed the check",
        *_summary_table("largest leaks", leaks[:top]),
        *_summary_table("largest peaks", sorted(rows, key=lambda r: -r.peak)[:top]),
    ]


__all__ = [
    "AUTOGRAD_CYCLE",
    "GRAD_CYCLE",
    "NAME",
    "RETAINED",
    "TOP",
    "Check",
    "DeviceFigures",
    "LeakedTensor",
    "Measurement",
    "Repeat",
    "allowance",
    "evidence",
    "figures_of",
    "judge",
    "leaking",
    "not_judged",
    "plural",
    "retained_of",
    "retained_summary",
    "summary",
]
