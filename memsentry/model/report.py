"""Everything one tracking run recorded and the rules concluded, frozen, with its JSON form."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, TypeVar

from memsentry.errors import ReportError
from memsentry.model.breakdown import Breakdowns
from memsentry.model.codec import build, found, to_plain
from memsentry.model.cost import Cost
from memsentry.model.devices import DeviceMemory
from memsentry.model.findings import Finding
from memsentry.model.holders import Census, HolderLength, UnusedGraph
from memsentry.model.kinds import Measured, PeakMode
from memsentry.model.legacy import upgrade
from memsentry.model.oom import OutOfMemory
from memsentry.model.processes import PinnedMemory, ProcessSample, WorkerMemory
from memsentry.model.reading import read_json
from memsentry.model.timeline import IterationStats, LayerStats
from memsentry.paths import replace_text

#: The version of the JSON layout; 1 was memsentry 0.1.0's (holders named by a string).
SCHEMA_VERSION = 2

#: The fix, where a report holds what memsentry never writes.
_DAMAGED = ("memsentry never writes this: the file was damaged or edited since; save the "
            "report again")

R = TypeVar("R", bound="ReportData")


@dataclass(frozen=True)
class ReportData:
    """Everything one ``track()`` run recorded, and the findings the rules made of it.

    ``baseline`` is the allocated memory when tracking began (parameters, buffers and every
    tensor created before are part of it, not growth). ``peak_mode`` says how peaks were
    measured (``"sampled"``, at module and saved-tensor boundaries: a lower bound of the true
    peak; or ``"exact"``, every allocation counted). ``measured`` says what the figures count:
    tensor memory only, or the whole process heap (the CPU's default backend).
    ``allocator_stats`` is the backend's raw counters when the report was made
    (``torch.cuda.memory_stats()`` on CUDA, glibc's ``mallinfo2`` fields on CPU); ``nvml`` is
    the driver's view of a CUDA device (used, total, this process, utilisation) or why it is
    unavailable. ``censuses`` are the holder searches made at iteration boundaries;
    ``unused_graphs`` the forward calls whose autograd graph no backward used. ``oom`` is the
    out-of-memory error that ended the block, explained (``None`` when none did). In a
    ``torch.distributed`` process group, ``rank``, ``world_size`` and ``host`` say whose run
    it is (``None`` outside one), and rank 0's report combines every rank's: ``ranks`` holds
    the per-rank reports in rank order (those that reported) and ``findings`` all of theirs,
    each with its ``rank``. ``cost`` is what memsentry's own work took, part by part.
    ``workers`` are the DataLoader worker processes followed while tracking, ``process`` the
    tracked process's own readings as the system counts it (when tracking began and ended,
    and with the workers' readings), ``resident_peak`` the highest resident memory the
    process reached since it began (``None`` where the system does not say), and ``pinned``
    the page-locked host memory PyTorch's pinned allocator held (``None`` without CUDA).
    ``other_threads`` counts the threads, other than the loop's, that stepped an optimizer or
    ran a tracked loop in the process while this one was tracked: figures that count the
    whole process (the C heap, a device's allocator) count their memory too. ``devices``
    describes each CUDA device that held memory when tracking stopped, in a process that sees
    more than one (a model spread over GPUs), by the allocator and by NVML; empty otherwise.
    ``lengths`` are the lengths of the containers the censuses found growing, read again at every
    boundary memsentry closed after that (a container that fills to a size and stays is seen
    staying between two censuses far apart).

    :class:`memsentry.Report` is this value with its text rendering (``str(report)``).
    """

    device: str
    backend: str
    baseline: int
    layers: tuple[LayerStats, ...] = ()
    iterations: tuple[IterationStats, ...] = ()
    findings: tuple[Finding, ...] = ()
    peak: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    total_memory: int | None = None
    peak_mode: PeakMode = PeakMode.SAMPLED
    measured: Measured = Measured.TENSORS
    notes: tuple[str, ...] = ()
    dropped_iterations: int = 0
    torch_version: str = ""
    allocator_stats: dict[str, Any] | None = None
    nvml: dict[str, Any] | None = None
    censuses: tuple[Census, ...] = ()
    unused_graphs: tuple[UnusedGraph, ...] = ()
    oom: OutOfMemory | None = None
    rank: int | None = None
    world_size: int | None = None
    host: str | None = None
    ranks: tuple[ReportData, ...] = ()
    cost: Cost | None = None
    workers: tuple[WorkerMemory, ...] = ()
    process: tuple[ProcessSample, ...] = ()
    resident_peak: int | None = None
    pinned: PinnedMemory | None = None
    other_threads: int = 0
    devices: tuple[DeviceMemory, ...] = ()
    lengths: tuple[HolderLength, ...] = ()

    @property
    def breakdown(self) -> Breakdowns:
        """What memory held at each iteration's peak, by category (parameters, gradients,
        optimizer state, activations, other), and at the highest of those peaks."""
        return Breakdowns.of([it.parts for it in self.iterations])

    def layer(self, name: str) -> LayerStats:
        """The :class:`LayerStats` called ``name``; ``KeyError`` lists the names if absent."""
        for stats in self.layers:
            if stats.name == name:
                return stats
        known = ", ".join(repr(s.name) for s in self.layers[:12])
        more = "" if len(self.layers) <= 12 else f" and {len(self.layers) - 12} more"
        raise KeyError(f"no layer named {name!r}; recorded layers: {known or 'none'}{more}")

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (plain ints, floats, strings, lists) with a ``schema`` version."""
        data: dict[str, Any] = to_plain(self)
        data["breakdown"] = to_plain(self.breakdown)  # derived: read back from the iterations
        data["schema"] = SCHEMA_VERSION
        return data

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int = 2) -> str:
        """Serialise to JSON; also write it to ``path`` when one is given (whole or not at
        all: a failed write leaves the file that was there as it was). Returns the text."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            replace_text(path, text + "\n")
        return text

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any]) -> R:
        """Rebuild a report written by :meth:`to_dict` (or read back from :meth:`to_json`);
        reports of schema 1 (memsentry 0.1.0) are upgraded. Unknown keys are ignored. A
        value that is not a report, or a field that holds anything but its declared type (a
        ``null``, a string for a number, a number out of range), raises
        :class:`~memsentry.errors.ReportError` (a ``ValueError``) naming the field."""
        if not isinstance(data, dict) or "device" not in data or "backend" not in data:
            raise ReportError(
                "not a memsentry report: expected a JSON object with 'device', 'backend' and "
                "'schema' keys, as written by Report.to_json() or `memsentry run --json`"
            )
        schema = data.get("schema", 1)
        if isinstance(schema, bool) or not isinstance(schema, int):
            raise ReportError(f"expected int, got {found(schema)}; {_DAMAGED}",
                              field=f"{cls.__name__}.schema")
        if schema > SCHEMA_VERSION:
            raise ReportError(
                f"this report has schema {found(schema)}, newer than this memsentry reads "
                f"({SCHEMA_VERSION}); upgrade memsentry to read it"
            )
        try:
            return build(cls, upgrade(data) if schema < SCHEMA_VERSION else data)
        except ReportError as error:
            raise ReportError(f"{error.problem}; {_DAMAGED}", field=error.field) from None

    @classmethod
    def from_json(cls: type[R], path: str | os.PathLike[str]) -> R:
        """Read a report saved with :meth:`to_json`. A file that is not a report raises
        :class:`~memsentry.errors.ReportError` (a ``ValueError``) naming the file and what
        is wrong, in bounded time and memory: not a regular file (a directory, a device, a
        FIFO), larger than 256 MiB (``MEMSENTRY_MAX_REPORT_SIZE`` changes the limit), not
        UTF-8 JSON, nested too deep, or a field that is not its declared type (see
        :meth:`from_dict`). A file that is missing or cannot be opened raises ``OSError``."""
        name = os.fspath(path)
        try:
            return cls.from_dict(read_json(name))
        except ReportError as error:
            raise (error if error.path else error.within(name)) from None



__all__ = ["SCHEMA_VERSION", "ReportData"]
