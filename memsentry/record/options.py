"""The options of one tracking run, checked before anything is hooked."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from memsentry.measure import parse_device
from memsentry.record.coverage import OVERHEAD
from memsentry.record.paths import unwritable

OnLeak = Literal["warn", "raise", "ignore"]
ON_LEAK: tuple[OnLeak, ...] = ("warn", "raise", "ignore")
#: Trace entries a memory_viz snapshot keeps by default (the oldest are dropped).
SNAPSHOT_ENTRIES = 100_000


@dataclass(frozen=True)
class Options:
    """What to record and what to do with leaks; see :class:`memsentry.Tracker` for each."""

    device: torch.device | None = None
    exact: bool = False
    saved_tensors: bool = True
    backward: bool = True
    max_iterations: int = 10_000
    on_leak: OnLeak = "warn"
    holders: bool = True
    holder_budget: float = 0.5
    overhead: float | None = OVERHEAD
    gather_timeout: float = 60.0
    snapshot: bool = False
    snapshot_path: str | None = None
    snapshot_entries: int = SNAPSHOT_ENTRIES
    watch: bool = False

    @classmethod
    def checked(cls, *, device: torch.device | str | int | None, exact: object,
                saved_tensors: object, backward: object, max_iterations: object,
                on_leak: object, holders: object, holder_budget: object,
                overhead: object = OVERHEAD, gather_timeout: object = 60.0,
                snapshot: object = False,
                snapshot_entries: object = SNAPSHOT_ENTRIES, watch: object = False) -> Options:
        """Options from ``track()``'s arguments; a bad one raises an error naming it and what
        it accepts."""
        flags = {"exact": exact, "saved_tensors": saved_tensors, "backward": backward,
                 "holders": holders, "watch": watch}
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise TypeError(f"track({name}=...) takes True or False, got {flag!r}")
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) \
                or max_iterations < 2:
            raise ValueError(
                f"track(max_iterations=...) must be an int of at least 2, got {max_iterations!r}"
            )
        if isinstance(holder_budget, bool) or not isinstance(holder_budget, int | float) \
                or not holder_budget > 0:
            raise ValueError(
                "track(holder_budget=...) is the seconds one holder search may take, a number "
                f"above 0 (default 0.5), got {holder_budget!r}"
            )
        if overhead is not None and (isinstance(overhead, bool)
                                     or not isinstance(overhead, int | float)
                                     or not 0 < overhead <= 10):
            raise ValueError(
                "track(overhead=...) is the share of the loop's time memsentry may spend, a "
                "number above 0 (default 0.04, i.e. 4%; watch() 0.01), or None to measure "
                f"everything whatever it costs; got {overhead!r}"
            )
        if isinstance(gather_timeout, bool) or not isinstance(gather_timeout, int | float) \
                or not gather_timeout > 0:
            raise ValueError(
                "track(gather_timeout=...) is the seconds rank 0 waits for the other ranks' "
                f"reports at the end, a number above 0 (default 60), got {gather_timeout!r}"
            )
        if on_leak not in ON_LEAK:
            raise ValueError(
                f"track(on_leak={on_leak!r}): use one of {', '.join(map(repr, ON_LEAK))}"
            )
        path = snapshot_path(snapshot)
        if isinstance(snapshot_entries, bool) or not isinstance(snapshot_entries, int) \
                or snapshot_entries < 1:
            raise ValueError(
                "track(snapshot_entries=...) is the number of memory_viz trace entries kept "
                f"(the oldest are dropped), an int of at least 1 (default {SNAPSHOT_ENTRIES:,}), "
                f"got {snapshot_entries!r}"
            )
        return cls(
            device=parse_device(device) if device is not None else None,
            exact=bool(exact), saved_tensors=bool(saved_tensors), backward=bool(backward),
            max_iterations=max_iterations, on_leak=on_leak,
            holders=bool(holders), holder_budget=float(holder_budget),
            overhead=None if overhead is None else float(overhead),
            gather_timeout=float(gather_timeout),
            snapshot=snapshot is not False, snapshot_path=path, snapshot_entries=snapshot_entries,
            watch=bool(watch),
        )


def snapshot_path(snapshot: object) -> str | None:
    """The file ``track(snapshot=...)`` writes at the end (``None`` for ``True`` and
    ``False``); a bad value, or a path that cannot be written, raises an error saying why."""
    if isinstance(snapshot, bool):
        return None
    path = os.fspath(snapshot) if isinstance(snapshot, str | os.PathLike) else None
    if not isinstance(path, str) or not path:
        raise TypeError(
            "track(snapshot=...) takes False (the default), True (record, then write with "
            "tracker.snapshot(path)) or the path of the pickle file to write at the end (a str "
            f"or os.PathLike), for PyTorch's memory_viz; got {snapshot!r}"
        )
    problem = unwritable(path)
    if problem is not None:
        raise ValueError(f"track(snapshot={path!r}): {problem}")
    return path
