"""``memsentry-finding``: a loop of the test suite (``tests/scenarios.py``,
``tests/doc_examples.py``), shown with the finding of one rule it gets when the docs are built,
printed as the text report prints findings.

````{memsentry-finding} scenarios:loss_summed_as_tensor
:rule: retained-graph
````

The function takes a number of iterations (``:steps:``; the suite's ``STEPS`` by default) and
returns a report. Its source is read from the file, not imported, and shown above the finding;
the run goes through the output cache, keyed also by the tests' sources, so a changed loop runs
again.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path
from typing import Any, ClassVar

from docutils import nodes
from docutils.parsers.rst import directives
from memsentry_nodes import literal
from memsentry_runs import _RunDirective
from sphinx.directives.code import container_wrapper

TESTS = Path(__file__).resolve().parents[2] / "tests"

_SCRIPT = """\
# tests: {digest}
import os
import sys
from dataclasses import replace

sys.path[:0] = [{tests!r}, {root!r}]
from scenarios import STEPS
from {module} import {function} as loop
from memsentry.reporters.text import render_findings

report = loop({steps} or STEPS)
prefix = {root!r} + os.sep  # the checkout's path is not the reader's
chosen = tuple(
    replace(f, message=f.message.replace(prefix, ""), location=None if f.location is None
            else replace(f.location, file=f.location.file.replace(prefix, "")))
    for f in report.findings if f.rule == {rule!r})
if not chosen:
    print("no finding of rule {rule}; the report has:",
          [(f.rule, str(f.severity)) for f in report.findings])
    sys.exit(3)
print("\\n".join(render_findings(replace(report, findings=chosen)).splitlines()[1:]))
"""


def loop_source(module: str, function: str) -> str:
    """The source of ``function`` in ``tests/<module>.py``, read without importing it."""
    path = TESTS / f"{module}.py"
    text = path.read_text(encoding="utf-8")
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            found = ast.get_source_segment(text, node)
            if found is not None:
                return found
    raise LookupError(f"no function {function!r} in {path}")


def tests_digest() -> str:
    """A hash of the test modules the loops come from."""
    sha = hashlib.sha256()
    for path in sorted(TESTS.glob("*.py")):
        sha.update(path.name.encode() + path.read_bytes())
    return sha.hexdigest()[:16]


class FindingDirective(_RunDirective):
    """````{memsentry-finding} module:function```` with ``:rule: id``: the loop's source, then
    the finding of that rule it got (a run without one is a warning)."""

    kind = "finding"
    what = "loop"
    required_arguments = 1
    has_content = False
    option_spec: ClassVar[dict[str, Any]] = {
        **_RunDirective.option_spec,
        "rule": directives.unchanged_required,
        "steps": directives.positive_int,
        "hide-code": directives.flag,
    }

    def run(self) -> list[nodes.Node]:
        module, _, function = self.arguments[0].partition(":")
        rule = self.options.get("rule")
        if not function or not module.isidentifier() or not function.isidentifier():
            raise self.error(f"memsentry-finding: {self.arguments[0]!r} is not module:function")
        if not rule:
            raise self.error("memsentry-finding: name the rule with :rule:")
        try:
            source = loop_source(module, function)
        except (OSError, LookupError) as error:
            raise self.error(f"memsentry-finding: {error}") from error
        script = _SCRIPT.format(digest=tests_digest(), tests=str(TESTS),
                                root=str(TESTS.parent), module=module, function=function,
                                steps=self.options.get("steps", 0), rule=rule)
        output, note = self.execute("python finding.py", {"finding.py": script})
        result: list[nodes.Node] = []
        if "hide-code" not in self.options:
            code = literal(source, "python")
            self.set_source_info(code)
            result.append(container_wrapper(self, code, f"tests/{module}.py"))
        shown = literal(output or "(no output)")
        self.set_source_info(shown)
        result += [shown, note]
        return result


__all__ = ["FindingDirective", "loop_source", "tests_digest"]
