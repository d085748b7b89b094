"""The options of one tracking run, checked before anything is hooked."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from memsentry.measure import parse_device
from memsentry.settings import BY_NAME, writable

OnLeak = Literal["warn", "raise", "ignore"]


@dataclass(frozen=True)
class Options:
    """What to record and what to do with leaks; each option is described, with its default
    and what it accepts, in :data:`memsentry.settings.SETTINGS`."""

    device: torch.device | None = None
    exact: bool = BY_NAME["exact"].default
    saved_tensors: bool = BY_NAME["saved_tensors"].default
    backward: bool = BY_NAME["backward"].default
    max_iterations: int = BY_NAME["max_iterations"].default
    on_leak: OnLeak = BY_NAME["on_leak"].default
    holders: bool = BY_NAME["holders"].default
    holder_budget: float = BY_NAME["holder_budget"].default
    overhead: float | None = BY_NAME["overhead"].default
    gather_timeout: float = BY_NAME["gather_timeout"].default
    snapshot: bool = False
    snapshot_path: str | None = None
    snapshot_entries: int = BY_NAME["snapshot_entries"].default
    watch: bool = BY_NAME["watch"].default

    @classmethod
    def checked(cls, **values: object) -> Options:
        """Options from ``track()``'s arguments (those not given take their default); a bad
        one raises an error naming it and what it accepts, as its setting says."""
        kept: dict[str, Any] = {}
        for field in fields(cls):
            if field.name == "snapshot_path":
                continue
            setting = BY_NAME[field.name]
            kept[field.name] = setting.check(values.get(field.name, setting.default))
        device = kept["device"]
        kept["device"] = parse_device(device) if device is not None else None
        kept["snapshot_path"] = snapshot_path(kept["snapshot"])
        kept["snapshot"] = kept["snapshot"] is not False
        return cls(**kept)


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
    return writable("snapshot", path)
