"""Reading the allocator snapshots PyTorch writes (``torch.cuda.memory._dump_snapshot()``)
and judging the memory they recorded, without running anything again: ``memsentry show
snap.pickle``."""

from __future__ import annotations

from memsentry.snapshots.read import (
    DEFAULT_LIMIT,
    AllocatorSnapshot,
    Block,
    Event,
    Frame,
    Segment,
    SnapshotError,
    is_pickle,
    read_snapshot,
)

__all__ = ["DEFAULT_LIMIT", "AllocatorSnapshot", "Block", "Event", "Frame", "Segment",
           "SnapshotError", "is_pickle", "read_snapshot"]
