"""``track(snapshot=...)``: the allocation history of one tracking run, as the snapshot file
PyTorch's memory_viz opens (https://pytorch.org/memory_viz, ``torch.cuda._memory_viz``).

On CUDA the caching allocator records it (:class:`~memsentry.measure.history.CudaHistory`:
memsentry's own recording, or the program's where it records already, left as it was);
on CPU the storage-counting backend does (:class:`~memsentry.measure.history.History`), which
is why ``snapshot`` turns ``exact`` on where the device is the CPU. At the end the snapshot is
frozen (plain dicts of ints and strings) and, when a path was given, written; a failure to
record or to write becomes a note in the report, never an error in the user's run.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from memsentry.measure import StorageBackend, device_of_module
from memsentry.measure.allocators import history_refused
from memsentry.measure.history import CudaHistory, History, Snapshot, recording_now
from memsentry.paths import replace_bytes
from memsentry.record.options import Options

if TYPE_CHECKING:
    from memsentry.record.boundary import Boundaries
    from memsentry.record.recorder import Recorder

#: memory_viz's page reads pickles of protocols 2 to 4 (Python 3.14 writes 5 by default).
PICKLE_PROTOCOL = 4

EXACT_NOTE = ("track(snapshot=...) turned on exact storage counting (cpu-storages): the CPU "
              "memory_viz snapshot comes from the dispatch mode that sees every storage made.")

BORROWED_HISTORY_NOTE = (
    "Your program was already recording CUDA's allocation history "
    "(torch.cuda.memory._record_memory_history): the memory_viz snapshot was taken from that "
    "recording, which memsentry left as it was (still on, with your stacks and max_entries "
    "rather than snapshot_entries), so it also holds what was recorded before tracking began.")
UNKNOWN_HISTORY_NOTE = (
    "No memory_viz snapshot: this torch cannot say whether your program records CUDA's "
    "allocation history (torch._C._cuda_isHistoryEnabled is missing), and memsentry switching "
    "its own on and off would end yours and replace its settings. Record it yourself with "
    "torch.cuda.memory._record_memory_history() and take torch.cuda.memory._snapshot() when "
    "tracking ends.")


def with_snapshot_options(options: Options, model: nn.Module | None) -> Options:
    """``options`` with ``exact`` on where a snapshot is asked for and the device is (or will
    be, as far as can be told before the run) the CPU; a device memsentry cannot snapshot
    raises ``ValueError``."""
    if not options.snapshot:
        return options
    device = expected_device(options, model)
    if device is not None and device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"track(snapshot=...): memory_viz snapshots are recorded on CUDA (the caching "
            f"allocator's history) and on the CPU (storage counting), not on {device}; track "
            "without snapshot there"
        )
    if device is not None and device.type == "cpu" and not options.exact:
        return replace(options, exact=True)
    return options


def expected_device(options: Options, model: nn.Module | None) -> torch.device | None:
    """The device the run will measure, as far as can be told before it: the one asked for,
    else the model's, else the CPU where CUDA is not initialised (``None``: not known)."""
    device = options.device
    if device is None and model is not None:
        device = device_of_module(model)
    if device is None and not torch.cuda.is_initialized():  # never a driver call here
        device = torch.device("cpu")
    return device


def write_snapshot(data: Snapshot, path: str | os.PathLike[str]) -> str:
    """Pickle ``data`` to ``path`` (the file memory_viz opens); returns the path written."""
    name = os.fspath(path)
    replace_bytes(name, pickle.dumps(data, protocol=PICKLE_PROTOCOL))  # whole or not at all
    return name


class SnapshotRecording:
    """The memory_viz snapshot of one tracking run: started after the recorder, frozen at its
    end (and written when ``track(snapshot=path)`` gave a path). Its ``notes`` go into the
    report. A CPU history stays in its compact form after the end; the dicts torch's tools
    read are built each time the snapshot is asked for."""

    def __init__(self, options: Options, *, exact_implied: bool = False) -> None:
        self.enabled = options.snapshot
        self.path = options.snapshot_path
        self.max_entries = options.snapshot_entries
        self.notes: list[str] = [EXACT_NOTE] if exact_implied else []
        self._history: History | None = None
        self._backend: StorageBackend | None = None  # while recording
        self._live: dict[int, int] | None = None  # the CPU storages alive at the end
        self._cuda: CudaHistory | None = None  # while recording
        self._cuda_snapshot: Snapshot | None = None  # taken at the end
        self._boundaries: Boundaries | None = None  # marking iteration ends, while recording
        self._ended = False

    def start(self, recorder: Recorder) -> None:
        """Begin recording on the recorder's device (it has started); never raises."""
        if not self.enabled:
            return
        backend = recorder._sampler.backend
        device = recorder.device
        try:
            if isinstance(backend, StorageBackend):
                self._history = History(self.max_entries)
                backend.record_history(self._history)
                self._backend = backend
                self._boundaries = recorder._boundaries
                self._boundaries.mark = self._history.mark
            elif (device is not None and device.type == "cuda") or (
                    device is None and torch.cuda.is_initialized()):
                self._start_cuda()
            else:
                self.notes.append(
                    f"No memory_viz snapshot: {device or 'the device'} was measured with "
                    f"{getattr(backend, 'name', 'no backend')}, not storage counting; pass "
                    "exact=True (or device='cpu') to track() to record CPU storages.")
        except Exception as error:  # recording is an extra: the run goes on without it
            self._history = self._backend = self._cuda = None
            self.notes.append(f"No memory_viz snapshot: recording could not start ({error}).")

    def _start_cuda(self) -> None:
        """Switch the CUDA allocator's history on, where its allocator keeps one; use the
        program's own recording where it has one (:class:`CudaHistory`)."""
        refused = history_refused()
        if refused is not None:
            self.notes.append(refused)
            return
        recording = recording_now()
        if recording is None:
            self.notes.append(UNKNOWN_HISTORY_NOTE)
            return
        cuda = CudaHistory(self.max_entries, borrowed=recording)
        cuda.start()  # the device is picked at the first call: most likely CUDA
        self._cuda = cuda
        if recording:
            self.notes.append(BORROWED_HISTORY_NOTE)

    def end(self, device: torch.device | None) -> None:
        """Stop recording at the end of tracking and write the snapshot where asked; never
        raises (what failed is noted)."""
        if not self.enabled or self._ended:
            return
        self._ended = True
        try:
            self._stop(device)
        except Exception as error:
            self._history = None
            self.notes.append(f"No memory_viz snapshot: taking it failed ({error}).")
        if self._history is not None and self._history.dropped:
            self.notes.append(
                f"The memory_viz snapshot keeps the last {self._history.max_entries:,} of the "
                f"{self._history.recorded:,} trace entries recorded (snapshot_entries); the "
                "storages still alive at the end are all in it.")
        if self.path is not None:
            self._write(self.path)

    def _write(self, path: str) -> None:
        """Write the snapshot to ``path``; a failure to write it is noted (the snapshot is
        kept)."""
        try:
            data = self.data()
            if data is not None:
                write_snapshot(data, path)
        except Exception as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror \
                else str(error)
            self.notes.append(
                f"The memory_viz snapshot could not be written to {path!r} ({reason}); "
                "it is kept: tracker.snapshot(path) writes it elsewhere.")

    def _stop(self, device: torch.device | None) -> None:
        backend, cuda = self._backend, self._cuda
        self._backend = self._cuda = None
        if self._boundaries is not None:
            self._boundaries.mark = None
            self._boundaries = None
        if backend is not None:
            try:
                self._live = backend.live_storages()
            finally:
                backend.record_history(None)
                if self._history is not None:
                    self._history.close()
        if cuda is not None:
            if device is not None and device.type == "cpu":
                self.notes.append(
                    "The memory_viz snapshot is CUDA's, but the run was measured on the CPU "
                    "(the device was picked at the first module call); pass device='cpu' to "
                    "track() for a snapshot of CPU storages.")
            self._cuda_snapshot = cuda.stop()

    def data(self) -> Snapshot | None:
        """The snapshot: as it was when tracking ended, or, while tracking, as it stands;
        ``None`` when nothing was recorded."""
        if self._history is not None:
            if self._ended:
                live = self._live or {}
            else:
                live = self._backend.live_storages() if self._backend is not None else {}
            return self._history.snapshot(live)
        if self._cuda is not None:
            return self._cuda.snapshot()
        return self._cuda_snapshot
