"""What one test's measurement found, the verdict on it, and the end-of-run table: plain values
and text, no torch, no pytest state (the plugin measures; this module judges and formats)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from memsentry.units import format_bytes, parse_size
from pytest_memsentry.marks import Limits

#: Leaked tensors listed in a failure's section; the rest are counted.
TOP = 10
#: The name of the report section and of the ``user_properties`` entry.
NAME = "memsentry"
#: The ``user_properties`` entry of a test that retained memory once: its one-line verdict.
RETAINED = "memsentry-retained"

LEAK_FIX = (
    "fix: release what keeps them when the test ends (del it, .clear() the container, or make "
    "it in a function-scoped fixture that frees it at teardown), or allow it: "
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
class LeakedTensor:
    """A storage the test created that is still alive after it: its size and device, the
    tensor that holds it (``float32[512, 1024]``) and who holds that tensor (``None`` when
    the holder search did not reach it), the line that created it, and whether that tensor
    carries an autograd graph (``grad_fn``)."""

    bytes: int
    device: str
    tensor: str | None
    holder: str | None
    site: str | None
    grad_fn: bool = False


@dataclass(frozen=True)
class DeviceFigures:
    """One device's figures for one test, in bytes above what was allocated before its setup.

    ``leaked``: still allocated after the test (after its teardown and ``gc.collect()``), less
    what wider-scoped fixtures and one-time imports made. ``peak``: the most allocated at once
    while the test, its fixtures and their teardown ran. ``tensors``: how many storages make up
    ``leaked``. CUDA only: ``driver``, the growth of the device memory the driver reports used;
    ``confirmed``, whether the driver saw the leak too (unconfirmed leaks warn, not fail).
    """

    device: str
    leaked: int
    peak: int
    tensors: int
    driver: int | None = None
    confirmed: bool = True


@dataclass(frozen=True)
class Measurement:
    """Everything measured for one test: per-device figures, the largest leaked tensors (at
    most :data:`TOP`; ``hidden`` more were not listed) and what was left out and why.
    ``heap``: the figures are the heap check's (:mod:`pytest_memsentry.heap`)."""

    devices: tuple[DeviceFigures, ...]
    tensors: tuple[LeakedTensor, ...] = ()
    hidden: int = 0
    hidden_bytes: int = 0
    notes: tuple[str, ...] = ()
    heap: bool = False  # from the heap check: growth of all allocations, no tensors, no peak

    def figures(self, verdict: str) -> dict[str, Any]:
        """The figures carried on the test's report (``user_properties``), plain data so that
        pytest-xdist can ship them to the controller for ``--memsentry-report``."""
        return {
            "verdict": verdict,
            "devices": {d.device: {"leaked": d.leaked, "peak": d.peak} for d in self.devices},
        }


@dataclass(frozen=True)
class Repeat:
    """A flagged test run a second time: per device, the bytes the second run kept beyond
    what the first run had left (``grown``), or why it could not be run again (``error``)."""

    grown: dict[str, int]
    error: str | None = None

    def grows(self, device: str, limits: Limits) -> bool:
        return self.error is None and self.grown.get(device, 0) > limits.max_leak

    def figures(self) -> str:
        if self.error is not None:
            return self.error
        grown = {d: b for d, b in self.grown.items() if b > 0} or {"cpu": 0}
        return ", ".join(f"{format_bytes(b)} more on {d}" for d, b in grown.items())


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


def _tensor_table(measurement: Measurement, devices: set[str]) -> list[str]:
    rows = [t for t in measurement.tensors if t.device in devices]
    if not rows:
        return []
    from tabulate import tabulate

    unreached = UNREACHED_WITH_GRAPHS if any(t.grad_fn for t in rows) else UNREACHED
    rows.sort(key=lambda t: (-t.bytes, t.holder is None, t.holder or ""))

    def held_by(t: LeakedTensor) -> str:
        if t.holder is None:
            return unreached
        named = t.holder != AUTOGRAD_CYCLE
        return f"{t.holder}, with grad_fn" if t.grad_fn and named else t.holder

    table = tabulate(
        [[format_bytes(t.bytes), t.tensor or "?", t.device, held_by(t), t.site or "?"]
         for t in rows],
        headers=["bytes", "tensor", "device", "held by", "allocated at"],
        tablefmt="simple", disable_numparse=True, colalign=("right",),
    )
    lines = ["still alive after the test's teardown and gc.collect(), largest first:", table]
    if measurement.hidden:
        lines.append(f"and {measurement.hidden} more ({format_bytes(measurement.hidden_bytes)})")
    return lines


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
    leaked, clauses, warnings = _leaks(measurement, limits)
    grew = [f for f in leaked if repeat is None or repeat.grows(f.device, limits)]
    if repeat is not None and not grew:
        leaked = [f for f in leaked if evidence(measurement, f.device)]
        clauses = [_leak_clause(f, limits).replace(" leaked on ", " retained on ", 1)
                   for f in leaked]
        if clauses:
            clauses[-1] += f" ({_pointers(measurement)})"
    elif repeat is not None and repeat.error is None:
        clauses.append(f"run again, it kept {repeat.figures()}: it grows with every run")
    peaked = [f for f in measurement.devices if _peaking(f, limits)]
    for figures in peaked:
        clauses.append(f"peak {format_bytes(figures.peak)} on {figures.device} above the "
                       f"limit of {format_bytes(limits.max_peak)} (max_peak)")
    if not clauses:
        return None, warnings
    lines = [_device_line(f, limits) for f in measurement.devices]
    lines += _tensor_table(measurement, {f.device for f in leaked})
    lines += measurement.notes
    lines += _notes(measurement, limits, leaked, peaked, repeat if not grew else None)
    check = Check(
        status="leaked" if grew else "peak" if peaked else "retained",
        long_repr=f"{NAME}: " + "; ".join(clauses),
        section="\n".join(lines),
    )
    return check, warnings


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


def _leaks(measurement: Measurement, limits: Limits
           ) -> tuple[list[DeviceFigures], list[str], list[str]]:
    """The devices that kept more than the limit, a clause for each, and warnings for CUDA
    allocator growth the driver did not confirm."""
    leaked, clauses, warnings = [], [], []
    for figures in measurement.devices:
        if not _leaking(figures, limits):
            continue
        if figures.confirmed:
            leaked.append(figures)
            clauses.append(_leak_clause(figures, limits))
        else:
            warnings.append(
                f"memsentry: the CUDA caching allocator holds {format_bytes(figures.leaked)} "
                f"more on {figures.device} after the test ({_limit(limits.max_leak)}), but the "
                f"driver's used memory grew by {format_bytes(figures.driver or 0)}, so the leak "
                "was not confirmed and the test was not failed; if it repeats, look for "
                "tensors the test keeps"
            )
    return leaked, clauses, warnings


def _notes(measurement: Measurement, limits: Limits, leaked: list[DeviceFigures],
           peaked: list[DeviceFigures], retained: Repeat | None) -> list[str]:
    """What the kept tensors mean and the fixes (``retained``: the second run that kept no
    more)."""
    lines = []
    if any(t.holder == AUTOGRAD_CYCLE for t in measurement.tensors):
        lines.append(CYCLE_NOTE)
    if any(t.grad_fn and t.holder != AUTOGRAD_CYCLE for t in measurement.tensors):
        lines.append(GRAPH_NOTE)
    if leaked and retained is not None:
        lines.append(RETAINED_NOTE.format(again=retained.figures()) if retained.error is None
                     else UNREPEATED_NOTE.format(error=retained.error))
    if leaked:
        lines.append(LEAK_FIX.format(allow=allowance(max(f.leaked for f in leaked))))
    if peaked:
        lines.append(PEAK_FIX.format(allow=allowance(max(f.peak for f in peaked))))
    return lines


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


def summary(entries: list[tuple[str, Mapping[str, Any]]], top: int = TOP) -> list[str]:
    """The ``--memsentry-report`` text: the tests with the largest leaks and the largest peaks
    (``top`` of each), one row per test and device."""
    if not entries:
        return ["no test was measured: run with --memsentry, or mark tests with "
                "@pytest.mark.memsentry (tests are measured once torch is imported)"]
    rows = [(nodeid, device, values["leaked"], values["peak"], figures["verdict"])
            for nodeid, figures in entries
            for device, values in figures["devices"].items()]
    from tabulate import tabulate

    headers = ["test", "device", "leaked", "peak", "verdict"]
    lines = []
    leaks = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
    failed = sum(1 for _nodeid, figures in entries if figures["verdict"] in ("leaked", "peak"))
    lines.append(f"{plural(len(entries), 'test')} measured, {failed} failed the check")
    for title, chosen in (("largest leaks", leaks[:top]),
                          ("largest peaks", sorted(rows, key=lambda r: -r[3])[:top])):
        if not chosen:
            lines.append(f"{title}: none")
            continue
        lines.append(f"{title}:")
        lines.append(tabulate(
            [[r[0], r[1], format_bytes(r[2]), format_bytes(r[3]), r[4]] for r in chosen],
            headers=headers, tablefmt="simple", disable_numparse=True,
            colalign=("left", "left", "right", "right", "left"),
        ))
    return lines


__all__ = [
    "AUTOGRAD_CYCLE",
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
