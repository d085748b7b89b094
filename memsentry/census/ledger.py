"""The memory a census walk has counted: each storage (or NumPy-owned buffer) once, credited
to the first holder that met it; a second holder meeting it marks the first as sharing it."""

from __future__ import annotations

from typing import Protocol

#: (device, address) of a storage or of memory a NumPy array owns.
Key = tuple[str, int]


class Sharer(Protocol):
    """A holder as the ledger sees it: the bytes it shares with another holder."""

    shared_bytes: int


class StorageLedger:
    """Storages met so far in one walk. ``static``: pointers of the tracked modules'
    parameters and buffers, counted only when asked (a whole model kept in a container)."""

    def __init__(self, static: set[int]) -> None:
        self.static = static
        self.seen: set[Key] = set()
        self._owners: dict[Key, Sharer] = {}  # the holder that counted each
        self._shared: set[Key] = set()

    def count(self, key: Key, size: int, holder: Sharer | None, *,
              parameters: bool = False) -> int:
        """``size`` the first time ``key`` is met, else 0. Met again from another ``holder``,
        its first holder is marked as sharing it (``del`` on that holder alone would not free
        it)."""
        if key[1] in self.static and not parameters:
            return 0
        if key in self.seen:
            first = self._owners.get(key)
            if holder is not None and first is not None and first is not holder \
                    and key not in self._shared:
                self._shared.add(key)
                first.shared_bytes += size
            return 0
        self.seen.add(key)
        if holder is not None:
            self._owners[key] = holder
        return size

    def claim(self, key: Key) -> bool:
        """Whether ``key`` is met for the first time (marking it met)."""
        if key in self.seen:
            return False
        self.seen.add(key)
        return True
