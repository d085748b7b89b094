"""The storages a test left alive, and which of them are its leak: plain values and decisions
on them, no torch, no pytest state (:class:`pytest_memsentry.measure.Window` gathers them).

Storages are kept by their data pointer (``dict[int, LiveStorage]``), in the order the
storage counter saw them: where two are the same size, the first made is listed first.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import NamedTuple

from memsentry.model import Location
from memsentry.units import format_bytes
from pytest_memsentry.marks import Limits
from pytest_memsentry.measurement import DeviceFigures
from pytest_memsentry.results import plural

CPU = "cpu"


class LiveStorage(NamedTuple):
    """A storage made during the test and still alive after it: the device it is on
    (``"cpu"``, ``"cuda:0"``), its size in bytes and the line of the user's code that made
    it (``None`` when the lines were not recorded or none was the user's)."""

    device: str
    nbytes: int
    site: Location | None


#: Live storages by their data pointer.
Storages = Mapping[int, LiveStorage]


def total_bytes(storages: Storages) -> int:
    return sum(storage.nbytes for storage in storages.values())


def on_device(storages: Storages, device: str) -> dict[int, LiveStorage]:
    """The storages on ``device`` (``"cpu"``, ``"cuda:0"``), in their order."""
    return {pointer: s for pointer, s in storages.items() if s.device == device}


def without(storages: Storages, pointers: Container[int]) -> dict[int, LiveStorage]:
    """``storages`` less those whose pointer is in ``pointers``, in their order."""
    return {pointer: s for pointer, s in storages.items() if pointer not in pointers}


# -- made by wider-scoped fixtures ------------------------------------------------------------
def owned_by_fixtures(storages: Storages, owners: Mapping[int, str]) -> dict[int, LiveStorage]:
    """The storages a wider-scoped fixture made while it was set up (``owners``: pointer ->
    the fixture's label)."""
    return {pointer: s for pointer, s in storages.items() if pointer in owners}


def fixture_notes(owned: Storages, owners: Mapping[int, str]) -> list[str]:
    """One note per fixture, by label, for what it made while it was set up: not the test's
    leak, since the fixture keeps it until its scope ends."""
    notes = []
    for label in sorted({owners[pointer] for pointer in owned}):
        mine = {p: s for p, s in owned.items() if owners[p] == label}
        notes.append(f"not counted: {format_bytes(total_bytes(mine))} "
                     f"({plural(len(mine), 'tensor')}) made by {label} while it was set "
                     "up: the fixture keeps it until its scope ends")
    return notes


# -- made by first imports ---------------------------------------------------------------------
def made_by_imports(storages: Storages, imported: set[str]) -> dict[int, LiveStorage]:
    """The storages made by a line of a module first imported during the test (``imported``:
    those modules' files, as :func:`memsentry.usercode.lines.short_path` writes them)."""
    return {pointer: s for pointer, s in storages.items()
            if s.site is not None and s.site.file in imported}


def import_note(once: Storages) -> str:
    """The note for what first imports made (a one-time initialisation, not a leak)."""
    return (f"not counted: {format_bytes(total_bytes(once))} "
            f"({plural(len(once), 'tensor')}) made by modules first imported "
            "during the test (a one-time initialisation)")


# -- what the test answers for ------------------------------------------------------------------
class Accounting(NamedTuple):
    """The storages the test answers for (``candidates``), what first imports made
    (``once``) and the notes on what was left out and why."""

    candidates: dict[int, LiveStorage]
    once: dict[int, LiveStorage]
    notes: list[str]


def account(live: Storages, owners: Mapping[int, str], imported: set[str]) -> Accounting:
    """Split what is still alive after the test into what wider-scoped fixtures made while
    they were set up, what first imports made and the rest: the test's."""
    notes = fixture_notes(owned_by_fixtures(live, owners), owners)
    candidates = without(live, owners)
    once = made_by_imports(candidates, imported)
    if once:
        notes.append(import_note(once))
        candidates = without(candidates, once)
    return Accounting(candidates, once, notes)


def cpu_figures(candidates: Storages, peak: int) -> DeviceFigures:
    """The CPU's figures: the bytes and the number of the CPU storages left alive."""
    cpu = on_device(candidates, CPU)
    return DeviceFigures(CPU, total_bytes(cpu), peak, len(cpu))


def over_limit(devices: list[DeviceFigures], limits: Limits) -> set[str]:
    """The devices that kept more than ``limits.max_leak``."""
    return {figures.device for figures in devices if figures.leaked > limits.max_leak}


__all__ = [
    "CPU",
    "Accounting",
    "LiveStorage",
    "Storages",
    "account",
    "cpu_figures",
    "fixture_notes",
    "import_note",
    "made_by_imports",
    "on_device",
    "over_limit",
    "owned_by_fixtures",
    "total_bytes",
    "without",
]
