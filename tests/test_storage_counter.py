"""The storage counter under the pytest plugin and ``track(exact=True)``: which storages an op
made, and the user's line that made each (read when asked, not when made)."""

from __future__ import annotations

import gc
import inspect

import torch

from memsentry.measure.storage import StorageCounter
from pytest_memsentry.cycles import _unreferred

BASELINE = torch.zeros(64)


def _line_of(text: str) -> int:
    lines, start = inspect.getsourcelines(_made_here)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _made_here() -> tuple[torch.Tensor, torch.Tensor]:
    kept = torch.ones(256)
    dropped = torch.ones(128)
    del dropped
    other = torch.full((32,), 2.0)
    return kept, other


def test_each_live_storage_names_the_users_line_that_made_it() -> None:
    counter = StorageCounter(sites=True)
    with counter:
        kept, other = _made_here()
    sites = counter.sites
    assert sites is not None
    by_size = {counter.live[pointer]: site for pointer, site in sites.items()}
    assert set(by_size) == {256 * 4, 32 * 4}  # the freed storage left with its line
    made = by_size[256 * 4]
    assert made is not None
    assert made.line == _line_of("kept = torch.ones(256)")
    assert made.function == "_made_here"
    assert made.file.endswith("test_storage_counter.py")
    other_site = by_size[32 * 4]
    assert other_site is not None and other_site.line == _line_of("other = torch.full")
    del kept, other
    assert counter.live == {}
    assert counter.sites == {}


def test_without_sites_nothing_is_remembered() -> None:
    counter = StorageCounter()
    with counter:
        kept = torch.ones(8)
    assert counter.sites is None
    assert list(counter.live.values()) == [32]
    del kept


def test_views_in_place_ops_and_inputs_are_not_new_storages() -> None:
    counter = StorageCounter()
    with counter:
        view = BASELINE[4:8]
        BASELINE.add_(0)
        joined = torch.cat([BASELINE, BASELINE])  # inputs given in a list
        summed = torch.add(BASELINE, 1, alpha=2)
    assert sorted(counter.live.values()) == [64 * 4, 128 * 4]
    del view, joined, summed


def test_an_out_argument_resized_by_the_op_counts_its_new_storage() -> None:
    out = torch.empty(0)
    counter = StorageCounter()
    with counter:
        torch.add(BASELINE, BASELINE, out=out)  # ``out`` grows: a new storage of 256 B
    assert list(counter.live.values()) == [64 * 4]
    assert out.untyped_storage().data_ptr() in counter.live


def test_a_tensor_only_the_searchs_own_lists_refer_to_is_unreferred() -> None:
    held = torch.ones(2)
    loose = torch.ones(3)
    holder = {"x": held}
    mine = [held, loose]
    gc.collect()
    alone = _unreferred(mine, mine)
    assert alone == {id(loose)}  # ``held`` is in a dict; ``loose`` only in ``mine`` here
    assert holder["x"] is held


def _made_on_a_device(counter: StorageCounter) -> torch.Tensor:
    made = torch.ones(16)
    counter._see_device(made, set())  # as _count does for a result not on the CPU
    return made


def test_a_storage_on_another_device_names_its_line_when_listed() -> None:
    # No GPU here: a CPU result is handed to the branch that CUDA results take (the dispatch
    # sends it every result whose `is_cpu` is False), to check what that branch keeps.
    counter = StorageCounter(sites=True, other_devices=True)
    made = _made_on_a_device(counter)
    ((device, size, where),) = counter.device_sites.values()
    assert (device, size) == ("cpu", 64)
    assert where is not None and where.function == "_made_on_a_device"
    _source, start = inspect.getsourcelines(_made_on_a_device)
    assert where.line == start + 2
    del made
    gc.collect()
    assert counter.device_sites == {}  # freed: off the list
