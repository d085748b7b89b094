"""Reading reports of schema 1 (memsentry 0.1.0), where holders, scopes and places were
strings: they are turned into today's typed values, as well as strings allow."""

from __future__ import annotations

import re
from typing import Any

from memsentry.model.codec import to_plain
from memsentry.model.kinds import ScopeKind, StepKind, SubjectKind
from memsentry.model.places import Location, Scope, Step

_LINE = re.compile(r"^(?P<file>.+):(?P<line>\d+)$")


def _location(text: str | None, function: str | None = None) -> Any:
    match = _LINE.match(text or "")
    if match is None:
        return None
    return to_plain(Location(match["file"], int(match["line"]), function))


def _scope(text: str | None) -> Any:
    if not text:
        return None
    if " in " in text and text.split(" in ", 1)[0].endswith("()"):
        function, file = text.split(" in ", 1)
        return to_plain(Scope(ScopeKind.FUNCTION, function[:-2], file))
    for prefix, kind in (("module ", ScopeKind.MODULE), ("class ", ScopeKind.CLASS)):
        if text.startswith(prefix):
            return to_plain(Scope(kind, text[len(prefix):]))
    if text.endswith(" scope"):
        return to_plain(Scope(ScopeKind.FIXTURE, text[: -len(" scope")]))
    return to_plain(Scope(ScopeKind.SCRIPT, text))


def _holder(data: dict[str, Any]) -> dict[str, Any]:
    path = [to_plain(Step(StepKind.ROOT, data.get("name", "?")))]
    return {**data, "path": path, "scope": _scope(data.get("scope")),
            "where": _location(data.get("where"))}


def _finding(data: dict[str, Any]) -> dict[str, Any]:
    where = data.get("where")
    location = _location(where)
    subject = None
    if where and location is None:
        subject = {"kind": SubjectKind.HOLDER.value, "name": where, "path": None}
    return {**data, "location": location, "subject": subject}


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 report dict in today's layout."""
    censuses = []
    for census in data.get("censuses", ()):
        hooks = [{**h, "module": None if h.get("module") == "<global>" else h.get("module"),
                  "where": _location(h.get("where"))} for h in census.get("hooks", ())]
        censuses.append({**census, "holders": [_holder(h) for h in census.get("holders", ())],
                         "hooks": hooks})
    unused = [{**u, "where": _location(u.get("where"), u.get("function"))}
              for u in data.get("unused_graphs", ())]
    measured = "heap" if data.get("backend") == "cpu-mallinfo2" else "tensors"
    return {**data, "censuses": censuses, "unused_graphs": unused, "measured": measured,
            "findings": [_finding(f) for f in data.get("findings", ())]}
