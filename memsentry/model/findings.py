"""A verdict of the rules: what was seen, about what, where, and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field

from memsentry.model.codec import SIGNED
from memsentry.model.kinds import Severity, SubjectKind
from memsentry.model.places import Location, Step, spell


@dataclass(frozen=True)
class Subject:
    """What a finding is about: a holder (with its ``path``), a module, a type (in a reference
    cycle), a device, or the loop itself. ``name`` is how reports print it."""

    kind: SubjectKind
    name: str
    path: tuple[Step, ...] | None = None

    @classmethod
    def holder(cls, path: tuple[Step, ...]) -> Subject:
        return cls(SubjectKind.HOLDER, spell(path), path)


@dataclass(frozen=True)
class Finding:
    """One verdict of the heuristics engine: what was seen, who holds it, how to fix it.

    ``rule`` is the stable id of the rule; ``message`` and ``fix`` are for people; ``bytes``,
    ``rate`` (bytes per iteration) and ``objects`` (the tensors, graph nodes, hooks or calls
    seen) are the evidence, and every finding has bytes or objects above zero; ``subject`` is
    what the finding is about and ``location`` the line to change, when known. ``rank`` is
    the process (``torch.distributed`` rank) whose run it is about, in a report of a process
    group (``None`` outside one). ``iteration`` is the iteration whose record shows the
    evidence (the census that saw the holder, the last iteration of a growth fit, the peak's
    iteration); ``None`` when the finding is about the run as a whole.
    """

    rule: str
    severity: Severity
    message: str
    fix: str
    bytes: int | None = field(default=None, metadata=SIGNED)
    rate: float | None = field(default=None, metadata=SIGNED)
    objects: int | None = None
    subject: Subject | None = None
    location: Location | None = None
    rank: int | None = None
    iteration: int | None = None

    @property
    def where(self) -> str | None:
        """For display: the line (``file:line``) when known, else the name of the holder,
        module or type the finding is about (``None`` for a device or the loop)."""
        if self.location is not None:
            return str(self.location)
        if self.subject is not None and self.subject.kind in _NAMED:
            return self.subject.name
        return None


_NAMED = frozenset({SubjectKind.HOLDER, SubjectKind.MODULE, SubjectKind.TYPE})


__all__ = ["Finding", "Location", "Subject"]
