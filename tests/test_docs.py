"""The documentation's generated pages, checked without building them: what the local Sphinx
extension (``docs/_ext``) reads from the code covers all of it, and its command runner keeps
its promises (the temporary directory out of the output, a wrong exit status reported)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
import typing
from pathlib import Path

import pytest

import memsentry
from memsentry.cli import build_parser
from memsentry.model import ReportData

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import memsentry_outputs as outputs  # noqa: E402
import memsentry_reference as reference  # noqa: E402


def test_the_rules_table_lists_every_rule_in_the_order_they_run() -> None:
    entries = reference.rule_entries()
    assert [entry.id for entry in entries] == list(memsentry.RULES)
    for entry in entries:
        rule = memsentry.RULES[entry.id]
        assert {s.lower() for s in entry.severities} == {s.value for s in rule.severities}
        assert entry.summary and entry.doc.startswith(entry.summary.split()[0])
        assert entry.fallback == rule.fallback


def _long_options(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    options = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                options[name] = {option for a in sub._actions for option in a.option_strings
                                 if option.startswith("--")}
    return options


def test_the_cli_reference_lists_every_long_option_of_every_subcommand() -> None:
    expected = _long_options(build_parser())
    commands = reference.cli_commands()
    assert [command.name for command in commands] == list(expected)
    assert set(expected) >= {"run", "show", "diff", "info"}
    for command in commands:
        listed = {option for argument in command.arguments for option in argument.long_options}
        assert listed == expected[command.name], command.name
        assert command.usage.startswith(f"usage: memsentry {command.name}")
        assert all("%(" not in argument.help and "%%" not in argument.help
                   for argument in command.arguments)


def test_the_cli_reference_shows_defaults_and_one_subcommand_on_request() -> None:
    (show,) = reference.cli_commands(only="show")
    by_name = {argument.names[-1]: argument for argument in show.arguments}
    assert by_name["--top"].default == "30"
    assert by_name["--format"].value.startswith("{") and by_name["--format"].default == "text"
    assert by_name["--output"].default == ""  # None is not shown
    with pytest.raises(KeyError, match="no subcommand"):
        reference.cli_commands(only="nope")


def _classes(root: type) -> set[type]:
    """Every dataclass a report's fields nest, found by hand."""
    seen: set[type] = set()
    todo = [root]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for hint in typing.get_type_hints(cls).values():
            stack = [hint]
            while stack:
                kind = stack.pop()
                if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                    todo.append(kind)
                stack.extend(typing.get_args(kind))
    return seen


def test_the_schema_covers_every_field_of_the_report_and_what_it_nests() -> None:
    objects = reference.schema_objects()
    assert objects[0].cls is ReportData
    by_class = {obj.cls: obj for obj in objects}
    assert len(by_class) == len(objects)
    assert set(by_class) >= _classes(ReportData)
    for cls, obj in by_class.items():
        keys = [field.name for field in obj.fields]
        assert set(keys) >= {field.name for field in dataclasses.fields(cls)}, cls
        links = {piece.text for field in obj.fields for piece in field.type
                 if piece.kind == "link"}
        assert links <= {o.name for o in objects}
    written = ReportData(device="cpu", backend="cpu", baseline=0).to_dict()
    root_keys = [field.name for field in objects[0].fields]
    assert root_keys[0] == "schema" and set(root_keys) == set(written)


def test_the_schema_spells_types_as_json() -> None:
    from memsentry.model import Finding

    finding = {field.name: field for field in
               next(o for o in reference.schema_objects() if o.cls is Finding).fields}
    assert finding["severity"].type_text == "string, one of leak, waste, hint"
    assert finding["bytes"].type_text == "integer or null"
    assert "may be negative" in finding["bytes"].notes
    assert "may be negative" not in finding["objects"].notes
    assert finding["subject"].type_text == "object Subject or null"
    assert reference.describe(tuple[str, ...])[0].text == "array of "
    assert "".join(p.text for p in reference.describe(tuple[tuple[str, int], ...])) == (
        "array of array of 2: [string, integer]")


def test_the_api_page_documents_every_public_name() -> None:
    page = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"memsentry\.(\w+)", page))
    assert set(memsentry.__all__) <= documented


def test_the_output_runner_hides_its_directory_and_reports_a_wrong_status() -> None:
    program = ("import os, sys; here = os.getcwd(); print(here); "
               "print(os.path.join(here, 'quick.py') + ':9'); "
               "print('samples:', 'toy.py' in os.listdir('samples')); "
               "print('env:', os.environ['COLUMNS'], os.environ['PYTHONHASHSEED']); "
               "print('to stderr', file=sys.stderr); sys.exit(3)")
    returncode, output = outputs.run_output(f'python -c "{program}"', timeout=60)
    assert returncode == 3
    assert output.splitlines() == [".", "quick.py:9", "samples: True", "env: 100 0",
                                   "to stderr"]
    result = outputs.Result(returncode, output, "2.x", "CPU")
    problem = outputs.status_problem("python -c ...", 0, result)
    assert problem is not None
    assert "status 3, expected 0" in problem and "python -c ..." in problem
    assert problem.endswith("quick.py:9\nsamples: True\nenv: 100 0\nto stderr")
    assert outputs.status_problem("python -c ...", 3, result) is None


def test_outputs_are_scrubbed_shortened_and_keyed_by_what_ran() -> None:
    assert outputs.scrub("/tmp/x/a.py:3 in /tmp/x\n/tmp/x/", "/tmp/x") == "a.py:3 in .\n"
    text = "\n".join(str(i) for i in range(10))
    assert outputs.shorten(text, head=2) == "0\n1\n..."
    assert outputs.shorten(text, tail=2) == "...\n8\n9"
    assert outputs.shorten(text, head=1, tail=1) == "0\n...\n9"
    assert outputs.shorten(text, tail=20) == text
    assert outputs.tail(text, 3) == "7\n8\n9"
    key = outputs.cache_key("output", "memsentry info", {"stdout_only": False}, "abc")
    assert key == outputs.cache_key("output", "memsentry info", {"stdout_only": False}, "abc")
    assert key != outputs.cache_key("output", "memsentry info", {"stdout_only": False}, "abd")
    assert key != outputs.cache_key("python", "memsentry info", {"stdout_only": False}, "abc")


def test_help_text_marks_code_and_long_options() -> None:
    assert reference.code_spans("see `memsentry run --json` and --top N, not out-of-memory") == [
        (False, "see "), (True, "memsentry run --json"), (False, " and "), (True, "--top"),
        (False, " N, not out-of-memory")]


def test_results_unused_for_a_month_are_pruned(tmp_path: Path) -> None:
    old, recent = tmp_path / "old.json", tmp_path / "recent.json"
    for path in (old, recent):
        path.write_text("{}")
    month = time.time() - 31 * 86400
    os.utime(old, (month, month))
    assert outputs.prune(tmp_path) == 1
    assert not old.exists() and recent.exists()


def test_the_plugin_options_table_pairs_every_ini_key_with_its_option() -> None:
    import memsentry_plugin_options as plugin

    options = {entry.option: entry for entry in plugin.plugin_options()}
    assert "--memsentry" in options and "--memsentry-check" in options
    assert plugin.unmatched_inis() == []
    assert options["--memsentry-max-leak"].ini == "memsentry_max_leak"
    assert options["--memsentry"].ini_type == "bool"
    assert options["--memsentry-report"].ini is None  # a command-line switch only
