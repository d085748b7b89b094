"""``input-bound`` judges the wait for the DataLoader's next batch, and nothing else: slow code
of the loop's own (a ``torch.cat`` after the step, a generator that decodes) is not blamed on
data loading, and timing the fetches changes nothing a program sees."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

import memsentry

STEPS = 12


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, size: int, delay: float = 0.0, broken_at: int | None = None) -> None:
        self.size, self.delay, self.broken_at = size, delay, broken_at

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == self.broken_at:
            raise KeyError(f"sample {index} is missing")
        if self.delay:
            time.sleep(self.delay)
        return torch.randn(16), torch.tensor(index % 4)


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _hints(report: memsentry.Report) -> list[memsentry.Finding]:
    return [f for f in report.findings if f.rule == "input-bound"]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_slow_dataset_is_named_as_the_wait(workers: int) -> None:
    model, opt = _setup()
    # 160 ms a batch: far past the step even when a loaded machine slows the loop tenfold.
    loader = DataLoader(Samples(8 * STEPS, delay=0.02), batch_size=8, num_workers=workers)
    with memsentry.track(model, on_leak="ignore") as t:
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    hints = _hints(t.report())
    assert len(hints) == 1
    assert "for the DataLoader's next batch" in hints[0].message
    assert "num_workers" in hints[0].fix


def test_slow_work_after_the_step_is_not_blamed_on_data() -> None:
    # The iteration's time outside forward and backward is the loop's own (a bank of
    # features concatenated after the step), the batch itself comes at once.
    model, opt = _setup()
    loader = DataLoader(Samples(8 * STEPS), batch_size=8)
    bank = torch.zeros(0, 4)
    with memsentry.track(model, on_leak="ignore") as t:
        for x, y in loader:
            out = model(x)
            nn.functional.cross_entropy(out, y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.05)  # stands for slow code of the loop's own after the step
            bank = torch.cat([bank[-64:], out.detach()])
    assert not _hints(t.report())


def test_a_loop_fed_by_its_own_generator_is_not_judged() -> None:
    # Its wait cannot be told apart from its own work: no verdict rather than a guess.
    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(STEPS):
            time.sleep(0.05)
            yield torch.randn(8, 16), torch.randint(0, 4, (8,))

    model, opt = _setup()
    with memsentry.track(model, on_leak="ignore") as t:
        for x, y in batches():
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert not _hints(t.report())
    assert all(it.data_seconds is None for it in t.report().iterations)


def test_timing_the_fetches_changes_nothing_the_program_sees() -> None:
    original = vars(_SingleProcessDataLoaderIter)["_next_data"]
    model, _ = _setup()
    seen: list[str] = []
    with memsentry.track(model, on_leak="ignore"):
        assert vars(_SingleProcessDataLoaderIter)["_next_data"] is not original
        # A dataset's error reaches the loop as it is.
        with pytest.raises(KeyError, match="sample 3 is missing"):
            for _ in DataLoader(Samples(8, broken_at=3), batch_size=2):
                seen.append("batch")
        # torch's warning about an IterableDataset that yields more than its length still
        # names the loop's line.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = DataLoader(_Counting(), batch_size=None)
            len(loader)
            for _ in loader:
                pass
    assert seen == ["batch"]
    assert vars(_SingleProcessDataLoaderIter)["_next_data"] is original
    lengths = [w for w in caught if "samples have been fetched" in str(w.message)]
    assert lengths and lengths[0].filename == __file__


class _Counting(IterableDataset[int]):
    def __len__(self) -> int:
        return 2

    def __iter__(self) -> Iterator[int]:
        return iter(range(4))
