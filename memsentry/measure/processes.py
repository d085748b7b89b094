"""A process's memory as Linux counts it: ``/proc/<pid>/smaps_rollup`` (resident, proportional
and private bytes), else the resident size in ``/proc/<pid>/status``. Reading the rollup makes
the kernel walk the process's page tables: about 2 ms for a 250 MiB worker on the machine
this was written on, so callers read it on a schedule, off the training thread.
:class:`ResidentReader` reads this process's resident size alone, cheaply enough for every
measured iteration."""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

_KIB = 1024
try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):  # not a POSIX system: no /proc to read either
    _PAGE = 4096


class ProcessMemory(NamedTuple):
    """Bytes: resident, proportional share (``None`` when unknown), private pages (``None``
    when unknown)."""

    rss: int
    pss: int | None
    private: int | None


def _fields(text: str) -> dict[str, int]:
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            values[name.strip()] = int(parts[0]) * _KIB
    return values


def _statm_resident(text: bytes) -> int:
    """The resident bytes in the text of a ``statm`` file (its second field, in pages)."""
    return int(text.split()[1]) * _PAGE


def read_resident(pid: int) -> ProcessMemory | None:
    """Only the resident size of process ``pid``, from ``/proc/<pid>/statm`` (a few
    microseconds: no walk of the page tables), or ``None``."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            resident = _statm_resident(statm.read())
    except (OSError, ValueError, IndexError):
        return None
    return ProcessMemory(resident, None, None)


def read_process(pid: int) -> ProcessMemory | None:
    """The memory of process ``pid`` now, or ``None`` when it is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            values = _fields(rollup.read())
        if "Rss" in values:
            private = values.get("Private_Clean", 0) + values.get("Private_Dirty", 0)
            return ProcessMemory(values["Rss"], values.get("Pss"), private)
    except (OSError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            values = _fields(status.read())
    except (OSError, ValueError):
        return None
    rss = values.get("VmRSS")
    return None if rss is None else ProcessMemory(rss, None, None)


class ResidentReader:
    """The resident size of this process, read often and cheaply: ``/proc/self/statm`` stays
    open and is read again from its start (about 1.5 microseconds). A forked child opens its
    own. :meth:`read` gives ``None`` where there is no such file."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._pid = 0
        self._missing = False

    def read(self) -> int | None:
        if self._missing:
            return None
        pid = os.getpid()
        try:
            if self._fd is None or self._pid != pid:
                self.close()
                self._fd, self._pid = os.open("/proc/self/statm", os.O_RDONLY), pid
            return _statm_resident(os.pread(self._fd, 128, 0))
        except (OSError, ValueError, IndexError):
            self._missing = True
            self.close()
            return None

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (reading again opens it)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass


def resident_peak() -> int | None:
    """The highest resident size this process reached since it began (``ru_maxrss``), or
    ``None`` where the system does not say."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else _KIB) if peak > 0 else None
