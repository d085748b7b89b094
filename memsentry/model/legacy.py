"""Reading reports of schema 1 (memsentry 0.1.0), where holders, scopes and places were
strings: they are turned into today's typed values, as well as strings allow. What is not
as schema 1 wrote it is left as it is, for the codec to name."""

from __future__ import annotations

import re
from typing import Any

from memsentry.model.codec import to_plain
from memsentry.model.kinds import ScopeKind, StepKind, SubjectKind
from memsentry.model.places import Location, Scope, Step

_LINE = re.compile(r"^(?P<file>.+):(?P<line>\d{1,18})$")


def _location(text: Any, function: Any = None) -> Any:
    if not isinstance(text, str):
        return text
    match = _LINE.match(text)
    if match is None:
        return None
    return to_plain(Location(match["file"], int(match["line"]), function))


def _scope(text: Any) -> Any:
    if not isinstance(text, str):
        return text
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


def _holder(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    path = [to_plain(Step(StepKind.ROOT, data.get("name", "?")))]
    return {**data, "path": path, "scope": _scope(data.get("scope")),
            "where": _location(data.get("where"))}


def _finding(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    where = data.get("where")
    location = _location(where)
    subject = None
    if isinstance(where, str) and where and location is None:
        subject = {"kind": SubjectKind.HOLDER.value, "name": where, "path": None}
    return {**data, "location": location, "subject": subject}


def _census(census: Any) -> Any:
    if not isinstance(census, dict):
        return census
    hooks = census.get("hooks", [])
    if isinstance(hooks, list):
        hooks = [{**h, "module": None if h.get("module") == "<global>" else h.get("module"),
                  "where": _location(h.get("where"))} if isinstance(h, dict) else h
                 for h in hooks]
    holders = census.get("holders", [])
    if isinstance(holders, list):
        holders = [_holder(h) for h in holders]
    return {**census, "holders": holders, "hooks": hooks}


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 report dict in today's layout."""
    censuses, unused, findings = (data.get(key, [])
                                  for key in ("censuses", "unused_graphs", "findings"))
    if isinstance(censuses, list):
        censuses = [_census(census) for census in censuses]
    if isinstance(unused, list):
        unused = [{**u, "where": _location(u.get("where"), u.get("function"))}
                  if isinstance(u, dict) else u for u in unused]
    if isinstance(findings, list):
        findings = [_finding(f) for f in findings]
    measured = "heap" if data.get("backend") == "cpu-mallinfo2" else "tensors"
    return {**data, "censuses": censuses, "unused_graphs": unused, "measured": measured,
            "findings": findings}
