"""The Sphinx extension of memsentry's documentation: pages that show what the code says and
what the commands print, made from the code when the docs are built.

- ``memsentry-output``: runs a shell command, shows it and what it printed;
- ``memsentry-python``: shows a program, runs it, shows what it printed;
- ``memsentry-file``: shows a file and puts it in the directory of the page's later runs;
- ``memsentry-finding``: a loop of the test suite and the finding of one rule it gets
  (:mod:`memsentry_findings`);
- ``memsentry-rules``: the rules' table and one section per rule, from ``memsentry.RULES``;
- ``memsentry-cli``: each subcommand's usage and arguments, from ``build_parser()``;
- ``memsentry-options``: track()'s options, from ``memsentry.settings.SETTINGS``;
- ``memsentry-pytest-options``: the plugin's options and ini keys, from its ``pytest_addoption``;
- ``memsentry-schema``: the JSON layout of a saved report, one table per object.

The run directives are :mod:`memsentry_runs` (runs and cache: :mod:`memsentry_outputs`), the
reference data :mod:`memsentry_reference`, the shared node helpers :mod:`memsentry_nodes`. A
page that uses one of these directives is read again when the
package's sources or the samples change.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import memsentry_outputs as outputs
import memsentry_reference as reference
from docutils import nodes
from memsentry_findings import FindingDirective
from memsentry_nodes import (
    digest,
    docstring_source,
    inline,
    literal,
    parse_rst,
    section,
    sources,
    table,
    track,
)
from memsentry_runs import FileDirective, OutputDirective, PythonDirective
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util.docutils import SphinxDirective

_STATIC = Path(__file__).resolve().parent / "static"


# -- memsentry-rules, memsentry-cli, memsentry-schema --------------------------------------


class RulesDirective(SphinxDirective):
    """````{memsentry-rules}````: a table of every rule, then a section per rule with its
    check's docstring (id: the rule's id; label ``rule-<id>``)."""

    def run(self) -> list[nodes.Node]:
        track(self)
        from memsentry import RULES

        entries = reference.rule_entries()
        rows = []
        for entry in entries:
            link = nodes.reference("", "", nodes.literal(entry.id, entry.id), refid=entry.id,
                                   internal=True)
            source = docstring_source(RULES[entry.id].check)
            causes = ", ".join(entry.causes) or "—"
            if entry.fallback:
                causes = "— (fallback)"
            rows.append([[link], [nodes.Text(", ".join(entry.severities))],
                         [nodes.Text(causes)], [nodes.Text(entry.devices)],
                         parse_rst(self, entry.summary, source)])
        result: list[nodes.Node] = [table(
            ["rule", "may report at", "names a cause at", "devices", "summary"], rows,
            [18, 10, 12, 7, 53], ["memsentry-rules"])]
        for entry in entries:
            part = section(self, [nodes.literal(entry.id, entry.id)], [entry.id],
                           f"rule-{entry.id}")
            facts = self._facts(entry)
            part += nodes.paragraph(facts, facts, classes=["memsentry-rule-facts"])
            part.extend(parse_rst(self, entry.doc, docstring_source(RULES[entry.id].check)))
            result.append(part)
        return result

    @staticmethod
    def _facts(entry: reference.RuleEntry) -> str:
        causes = (f"names a cause at {', '.join(entry.causes)}" if entry.causes
                  else "names no cause")
        if entry.fallback:
            causes = "speaks only when no rule named a cause"
        devices = "all devices" if entry.devices == "all" else f"{entry.devices} only"
        return f"Reports at {', '.join(entry.severities)}; {causes}; {devices}."


class OptionsDirective(SphinxDirective):
    """````{memsentry-options}````: track()'s options from ``memsentry.settings.SETTINGS``:
    name, default, what it takes, what it does, and ``memsentry run``'s flag."""

    def run(self) -> list[nodes.Node]:
        from memsentry.settings import SETTINGS

        track(self)
        rows = []
        for setting in SETTINGS:
            flag: list[nodes.Node] = []
            if setting.flag is not None:
                spelled = setting.flag.name + (f" {setting.flag.metavar}"
                                               if setting.flag.metavar else "")
                flag = [nodes.literal(spelled, spelled)]
            passed = "yes" if setting.framework else "no"
            rows.append([[nodes.literal(setting.name, setting.name)],
                         [nodes.literal(repr(setting.default), repr(setting.default))],
                         [nodes.Text(setting.accepts)], [nodes.Text(setting.help)], flag,
                         [nodes.Text(passed)]])
        return [table(["option", "default", "takes", "what it does", "memsentry run",
                       "callbacks pass it"], rows, [12, 8, 16, 44, 12, 8])]


class PluginOptionsDirective(SphinxDirective):
    """````{memsentry-pytest-options}````: the plugin's options and their ini keys, from its
    ``pytest_addoption``."""

    def run(self) -> list[nodes.Node]:
        from memsentry_plugin_options import plugin_options, unmatched_inis

        track(self)
        stray = unmatched_inis()
        if stray:
            raise self.error(f"memsentry-pytest-options: ini keys with no option: {stray}")
        rows = []
        for entry in plugin_options():
            spelled = entry.option + (f"={entry.metavar}" if entry.metavar else "")
            ini: list[nodes.Node] = []
            if entry.ini is not None:
                ini = [nodes.literal(entry.ini, entry.ini), nodes.Text(f" ({entry.ini_type})")]
            default = "off" if entry.default is False else (
                "-" if entry.default is None else repr(entry.default))
            rows.append([[nodes.literal(spelled, spelled)], ini, [nodes.Text(default)],
                         [nodes.Text(entry.help)]])
        return [table(["option", "ini key", "default", "meaning"], rows, [18, 16, 6, 60])]


class CliDirective(SphinxDirective):
    """````{memsentry-cli}```` [subcommand]: each subcommand (or the one named) with its
    description, usage and arguments. The full form makes sections titled
    ``memsentry <name>`` (id ``memsentry-<name>``, label ``cli-<name>``)."""

    optional_arguments = 1

    def run(self) -> list[nodes.Node]:
        track(self)
        only = self.arguments[0] if self.arguments else None
        try:
            commands = reference.cli_commands(only=only)
        except KeyError as error:
            raise self.error(f"memsentry-cli: {error.args[0]}") from None
        result: list[nodes.Node] = []
        for command in commands:
            body = self._command(command)
            if only is not None:
                result.extend(body)
                continue
            part = section(self, [nodes.literal(command.prog, command.prog)],
                           [f"memsentry-{command.name}"], f"cli-{command.name}")
            part.extend(body)
            result.append(part)
        return result

    def _command(self, command: reference.CliCommand) -> list[nodes.Node]:
        rows = []
        for argument in command.arguments:
            names: list[nodes.Node] = []
            for i, name in enumerate(argument.names):
                names += [nodes.Text(", ")] * bool(i) + [nodes.literal(name, name)]
            value = [nodes.literal(argument.value, argument.value)] if argument.value else []
            if argument.value and not argument.names[0].startswith("-"):
                value = [nodes.Text(argument.value)]  # a positional's count, in words
            default = ([nodes.literal(argument.default, argument.default)]
                       if argument.default else [])
            rows.append([names, value, default, inline(argument.help)])
        return [
            nodes.paragraph("", "", *inline(command.description or command.summary)),
            literal(command.usage),
            table(["argument", "value", "default", "what it does"], rows, [22, 18, 10, 50],
                  ["memsentry-cli"]),
        ]


class SchemaDirective(SphinxDirective):
    """````{memsentry-schema}````: the JSON of a saved report, one table per object (id and
    label ``schema-<class>``), the root first."""

    def run(self) -> list[nodes.Node]:
        track(self)
        result: list[nodes.Node] = []
        for obj in reference.schema_objects():
            part = section(self, [nodes.Text(obj.name)], [obj.anchor], obj.anchor)
            if obj.doc:
                part.extend(parse_rst(self, obj.doc, docstring_source(obj.cls)))
            rows = [[[nodes.literal(field.name, field.name)], self._type(field.type),
                     [nodes.Text("; ".join(field.notes))]] for field in obj.fields]
            part += table(["key", "JSON type", "notes"], rows, [20, 45, 35],
                          ["memsentry-schema"])
            result.append(part)
        return result

    @staticmethod
    def _type(pieces: Sequence[reference.Piece]) -> list[nodes.Node]:
        made: list[nodes.Node] = []
        for piece in pieces:
            if piece.kind == "code":
                made.append(nodes.literal(piece.text, piece.text))
            elif piece.kind == "link":
                made.append(nodes.reference("", piece.text, refid=reference.anchor_of(piece.text),
                                            internal=True))
            else:
                made.append(nodes.Text(piece.text))
        return made


# -- keeping generated pages current --------------------------------------------------------


def _outdated(app: Sphinx, env: BuildEnvironment, added: set[str], changed: set[str],
              removed: set[str]) -> list[str]:
    """Pages made from the sources are read again when the sources changed."""
    now = digest()
    return [docname for docname, seen in sources(env).items()
            if seen != now and docname in env.found_docs and docname not in changed]


def _purge(app: Sphinx, env: BuildEnvironment, docname: str) -> None:
    sources(env).pop(docname, None)


def _merge(app: Sphinx, env: BuildEnvironment, docnames: set[str],
           other: BuildEnvironment) -> None:
    theirs = sources(other)
    sources(env).update({d: theirs[d] for d in docnames if d in theirs})


def _prune(app: Sphinx, error: Exception | None) -> None:
    if error is None:
        outputs.prune(Path(app.srcdir) / "_build" / ".outputs")


def _static(app: Sphinx) -> None:
    if app.builder.format == "html":
        app.config.html_static_path.append(str(_STATIC))
        app.add_css_file("memsentry_docs.css")


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("memsentry-output", OutputDirective)
    app.add_directive("memsentry-python", PythonDirective)
    app.add_directive("memsentry-file", FileDirective)
    app.add_directive("memsentry-finding", FindingDirective)
    app.add_directive("memsentry-rules", RulesDirective)
    app.add_directive("memsentry-cli", CliDirective)
    app.add_directive("memsentry-options", OptionsDirective)
    app.add_directive("memsentry-pytest-options", PluginOptionsDirective)
    app.add_directive("memsentry-schema", SchemaDirective)
    app.connect("env-get-outdated", _outdated)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    app.connect("builder-inited", _static)
    app.connect("build-finished", _prune)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True,
            "env_version": 1}
