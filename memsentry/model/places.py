"""Where things are: a line of source, the scope a holder lives in, the path that reaches it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memsentry.model.kinds import ScopeKind, StepKind
from memsentry.usercode.location import Location


@dataclass(frozen=True)
class Scope:
    """Where a holder lives: ``name`` is the function, module, script path, class or fixture
    scope; ``file`` the source file of a function. Prints as the reports spell it
    (``train() in train.py``, ``module utils``, ``class Logger``, ``session scope``)."""

    kind: ScopeKind
    name: str
    file: str | None = None

    def __str__(self) -> str:
        if self.kind == ScopeKind.FUNCTION:
            return f"{self.name}() in {self.file}" if self.file else f"{self.name}()"
        if self.kind == ScopeKind.MODULE:
            return f"module {self.name}"
        if self.kind == ScopeKind.CLASS:
            return f"class {self.name}"
        if self.kind == ScopeKind.FIXTURE:
            return f"{self.name} scope"
        return self.name


@dataclass(frozen=True)
class Step:
    """One step of a path to a tensor. ``name`` is the root's or attribute's name, the ``repr``
    of a dict key, a sequence index in decimal, or a frame-kept local's name; ``function`` is
    the function of a frame local."""

    kind: StepKind
    name: str
    function: str | None = None

    def __post_init__(self) -> None:
        # Paths are dict keys on the census's hot path: hash a step once, not at every lookup.
        object.__setattr__(self, "_hash", hash((self.kind, self.name, self.function)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def spelled(self) -> str:
        """The step as code would write it after what comes before."""
        if self.kind == StepKind.ROOT:
            return self.name
        if self.kind == StepKind.ATTRIBUTE:
            return f".{self.name}"
        if self.kind in (StepKind.KEY, StepKind.INDEX):
            return f"[{self.name}]"
        if self.kind == StepKind.FRAME_LOCAL:
            return f"[{self.function}(): {self.name}]"
        if self.kind == StepKind.CACHED:
            return "(…)"
        return "{…}"

    @property
    def is_subscript(self) -> bool:
        """A key, index or member: a step into a container's items."""
        return self.kind in (StepKind.KEY, StepKind.INDEX, StepKind.MEMBER, StepKind.CACHED)


def root(name: str) -> Step:
    return Step(StepKind.ROOT, name)


def attribute(name: str) -> Step:
    return Step(StepKind.ATTRIBUTE, name)


def spell(path: Sequence[Step]) -> str:
    """A path as code would write it: ``logger.history['loss']``, ``outputs[3]``."""
    return "".join(step.spelled() for step in path)


def until_subscript(path: Sequence[Step]) -> tuple[Step, ...]:
    """The path up to its first key, index or member: ``self.history`` for
    ``self.history['loss'][2]``."""
    for index, step in enumerate(path):
        if step.is_subscript and index:
            return tuple(path[:index])
    return tuple(path)


__all__ = ["Location", "Scope", "Step", "attribute", "root", "spell", "until_subscript"]
