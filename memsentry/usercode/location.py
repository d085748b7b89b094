"""A line of the user's source."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Location:
    """A line of the user's source (``file`` relative to the working directory when inside
    it), and the function it is in when known. Prints as ``file:line``."""

    file: str
    line: int
    function: str | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"
