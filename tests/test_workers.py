"""DataLoader worker processes are followed while tracking: each worker's memory as the system
counts it, on the report beside the process's own, without changing what the loader yields."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

import memsentry
import memsentry.record.workers as workers_module

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/<pid>/smaps_rollup")


class Records(Dataset[tuple[torch.Tensor, int]]):
    """Samples kept as a list of dicts: every read writes the objects' reference counts."""

    def __init__(self, size: int) -> None:
        self.records = [{"features": [float(i)] * 8, "label": i % 4} for i in range(size)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        record = self.records[index]
        return torch.tensor(record["features"]), record["label"]


@pytest.fixture
def every_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reading at every fetch (the schedule's interval is tested by its own figures)."""
    monkeypatch.setattr(workers_module, "MIN_INTERVAL", 0.0)
    monkeypatch.setattr(workers_module, "SHARE", 1e9)


def _train(loader: DataLoader[tuple[torch.Tensor, int]], epochs: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_each_worker_is_followed_beside_the_process(every_fetch: None) -> None:
    dataset = Records(60_000)

    def loader() -> DataLoader[tuple[torch.Tensor, int]]:
        return DataLoader(dataset, batch_size=1024, num_workers=2,
                          generator=torch.Generator().manual_seed(3), shuffle=True)

    plain = _train(loader(), epochs=1)
    with memsentry.track(on_leak="ignore") as t:
        tracked = _train(loader(), epochs=1)
    assert tracked == plain  # the same batches, in the same order, the same results
    report = t.report()
    assert sorted(w.worker for w in report.workers) == [0, 1]
    assert {w.dataset for w in report.workers} == {"Records"}
    for worker in report.workers:
        assert len(worker.samples) >= 3
        assert all(s.private is not None and s.rss > 0 for s in worker.samples)
        # Reading the records copied the pages their objects live on into the worker.
        first, last = worker.samples[0], worker.samples[-1]
        assert last.private is not None and first.private is not None
        assert last.private - first.private > 2 * 1024 * 1024
        assert [s.seconds for s in worker.samples] == sorted(s.seconds for s in worker.samples)
    assert report.process and all(s.rss > 0 for s in report.process)
    # The readings ran inside the batch fetches: their time is memsentry's, in its budget.
    assert report.cost is not None
    reading = report.cost.part("workers")
    assert reading.events >= 3 and 0 < reading.seconds < report.cost.own_seconds
    again = memsentry.Report.from_dict(report.to_dict())
    assert again.workers == report.workers and again.process == report.process


def test_each_pass_over_a_loader_starts_new_workers_of_the_same_loader(
        every_fetch: None) -> None:
    loader = DataLoader(Records(8_000), batch_size=1024, num_workers=2)
    other = DataLoader(Records(4_000), batch_size=1024, num_workers=2)
    with memsentry.track(on_leak="ignore") as t:
        _train(loader, epochs=2)
        _train(other, epochs=1)
    report = t.report()
    assert sorted((w.loader, w.epoch, w.worker) for w in report.workers) == [
        (1, 1, 0), (1, 1, 1), (1, 2, 0), (1, 2, 1), (2, 1, 0), (2, 1, 1)]
    assert len({w.pid for w in report.workers}) == 6
    table = str(report)
    assert "loader 1 (Records) pass 2 worker 1, pid" in table
    assert "loader 2 (Records) worker 0, pid" in table  # one pass: none named


def test_a_loader_without_workers_has_none_to_follow(every_fetch: None) -> None:
    with memsentry.track(on_leak="ignore") as t:
        _train(DataLoader(Records(4_000), batch_size=1024), epochs=1)
    assert t.report().workers == ()


class Columns(Dataset[tuple[torch.Tensor, int]]):
    """The same samples kept as two NumPy arrays: reading them writes no reference count."""

    def __init__(self, size: int) -> None:
        self.features = np.repeat(np.arange(size, dtype=np.float32)[:, None], 8, axis=1)
        self.labels = np.arange(size) % 4

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.features[index]), int(self.labels[index])


class Caching(Columns):
    """Keeps every sample it made, in each worker's own copy of the dataset."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.made: list[torch.Tensor] = []

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.made.append(torch.randn(2048))  # 8 KiB per sample, never dropped
        return super().__getitem__(index)


def _findings(dataset: Dataset[tuple[torch.Tensor, int]], epochs: int = 1, *,
              persistent: bool = False) -> list[memsentry.Finding]:
    loader = DataLoader(dataset, batch_size=1024, num_workers=2, shuffle=True,
                        persistent_workers=persistent)
    with memsentry.track(on_leak="ignore") as t:
        _train(loader, epochs)
    found = [f for f in t.report().findings if f.rule == "worker-memory"]
    print(_readings(t.report()))  # pytest shows it when a test fails
    return found


def _readings(report: memsentry.Report) -> str:
    """Each worker's private memory at every reading (KiB), for a failing test's message."""
    return "\n".join(f"worker {w.worker} pass {w.epoch}: "
                     f"{[(s.private or 0) // 1024 for s in w.samples]}"
                     for w in report.workers)


@pytest.mark.parametrize("epochs", [1, 2])
def test_copy_on_read_of_a_list_of_dicts_is_named_with_its_attribute(
        every_fetch: None, epochs: int) -> None:
    train_set = Records(300_000)
    loader = DataLoader(train_set, batch_size=1024, num_workers=2, shuffle=True)
    with memsentry.track(on_leak="ignore") as t:
        _train(loader, epochs=epochs)
    (finding,) = [f for f in t.report().findings if f.rule == "worker-memory"]
    assert finding.severity is memsentry.Severity.WASTE
    assert "the 2 workers of the DataLoader over `train_set` (Records)" in finding.message
    assert "`train_set.records` is a list of dict (300,000 items" in finding.message
    assert "copy-on-read" in finding.message
    assert "NumPy arrays" in finding.fix and "`train_set.records`" in finding.fix
    assert finding.bytes is not None and finding.bytes >= 32 * 1024 * 1024
    # Without persistent workers, each pass's workers copy the records again: one finding.
    again = "the loader started new workers for each of its 2 passes over the data"
    assert (again in finding.message) == (epochs == 2)


def test_the_same_samples_in_numpy_arrays_get_no_finding(every_fetch: None) -> None:
    assert _findings(Columns(300_000)) == []


class NamedCaching(Caching):
    """The caching dataset with a list of Python strings too: some copy-on-read, far less
    than what its workers keep."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.names = [f"sample_{i:06d}" for i in range(size)]


@pytest.mark.parametrize(("dataset", "why"), [
    (Caching, "still growing through the later half of the run"),
    (NamedCaching, "more than a copy of the dataset's Python objects explains"),
])
def test_a_worker_that_keeps_what_it_makes_is_told_apart(
        every_fetch: None, dataset: type[Caching], why: str) -> None:
    (finding,) = _findings(dataset(8_000), epochs=4, persistent=True)
    assert finding.severity is memsentry.Severity.LEAK
    assert why in finding.message
    # The holder is the attribute __getitem__ adds to, at its line.
    assert "`__getitem__` adds to `self.made` (tests/test_workers.py:" in finding.message
    assert finding.subject is not None and finding.subject.name == "self.made"
    assert finding.location is not None and finding.location.file.endswith("test_workers.py")
    assert "`self.made`" in finding.fix


def test_on_the_default_schedule_each_worker_is_read_at_its_epochs_last_batch() -> None:
    # Workers that do not persist are shut down before the loop sees the epoch end: their
    # last reading is taken as the last batch is fetched, whatever the schedule.
    with memsentry.track(on_leak="ignore") as t:
        _train(DataLoader(Records(20_000), batch_size=1024, num_workers=2), epochs=1)
    report = t.report()
    assert len(report.workers) == 2
    assert all(len(w.samples) >= 2 for w in report.workers)


@pytest.mark.parametrize("mode", ["watch", "start-stop"])
def test_the_always_on_mode_and_the_callbacks_follow_the_workers(
        every_fetch: None, mode: str) -> None:
    """``watch()``, and ``start()``/``stop()`` as a framework's callbacks call them, follow
    the workers as ``track()`` does and name the same copy."""
    train_set = Records(300_000)
    loader = DataLoader(train_set, batch_size=1024, num_workers=2, shuffle=True)
    tracker = (memsentry.watch(on_leak="ignore") if mode == "watch"
               else memsentry.track(on_leak="ignore"))
    tracker.start()
    try:
        _train(loader, epochs=1)
    finally:
        tracker.stop()
    report = tracker.report()
    assert len(report.workers) == 2
    (finding,) = [f for f in report.findings if f.rule == "worker-memory"]
    assert "`train_set.records` is a list of dict" in finding.message


def test_spawned_workers_are_followed_and_a_leak_in_them_is_told(every_fetch: None) -> None:
    """Workers started with ``spawn`` get the dataset pickled, not forked: reading it copies
    nothing, and what their ``__getitem__`` keeps is still a leak."""
    loader = DataLoader(Caching(8_000), batch_size=1024, num_workers=2,
                        persistent_workers=True, multiprocessing_context="spawn")
    with memsentry.track(on_leak="ignore") as t:
        losses = _train(loader, epochs=4)
    report = t.report()
    seen = _readings(report)
    assert len(report.workers) == 2 and all(len(w.samples) >= 6 for w in report.workers), seen
    (finding,) = [f for f in report.findings if f.rule == "worker-memory"] or [None]
    assert finding is not None and finding.severity is memsentry.Severity.LEAK, seen
    assert losses == _train(DataLoader(Caching(8_000), batch_size=1024, num_workers=2,
                                       persistent_workers=True,
                                       multiprocessing_context="spawn"), epochs=4)


class Reader:
    """What a library's image dataset keeps (a reader holding the list of files)."""

    def __init__(self, size: int) -> None:
        self.samples = [(f"/data/train/{i % 4}/img_{i:07d}.jpg", i % 4) for i in range(size)]


class Folder(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, size: int) -> None:
        self.reader = Reader(size)

    def __len__(self) -> int:
        return len(self.reader.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.reader.samples[index]
        return torch.full((8,), float(len(path))), label


def test_samples_kept_by_an_object_the_dataset_holds_are_named_through_it(
        every_fetch: None) -> None:
    """``train_set.reader.samples``, and the same list through a ``Subset`` of it."""
    train_set = Folder(300_000)
    part = Subset(train_set, range(200_000))
    for dataset, spelled in ((train_set, "train_set.reader.samples"),
                             (part, "part.dataset.reader.samples")):
        loader = DataLoader(dataset, batch_size=1024, num_workers=2, shuffle=True)
        with memsentry.track(on_leak="ignore") as t:
            _train(loader, epochs=1)
        (finding,) = [f for f in t.report().findings if f.rule == "worker-memory"]
        assert f"`{spelled}` is a list of tuple (300,000 items" in finding.message
