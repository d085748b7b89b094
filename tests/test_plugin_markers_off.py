"""A suite that uses memsentry's markers under ``--strict-markers`` and switches the plugin
off with ``-p no:memsentry``: it stops at collection unless it declares the markers itself,
as docs/pytest.md shows; that declaration also stands beside the plugin's own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

DOCS = Path(__file__).resolve().parent.parent / "docs" / "pytest.md"

TESTS = """
    import pytest

    @pytest.mark.memsentry(max_leak="1 MiB")
    def test_limited():
        pass

    @pytest.mark.no_memsentry
    def test_unchecked():
        pass
"""


def _documented_ini() -> str:
    blocks = re.findall(r"```ini\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert len(blocks) == 1, blocks
    return blocks[0].replace("[pytest]\n", "[pytest]\naddopts = --strict-markers\n", 1)


def test_without_the_plugin_undeclared_markers_stop_collection(pytester: pytest.Pytester
                                                               ) -> None:
    pytester.makepyfile(test_marked=TESTS)
    result = pytester.runpytest_subprocess("-p", "no:memsentry", "--strict-markers", "-q")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert "'memsentry' not found in `markers` configuration option" in result.stdout.str()


@pytest.mark.parametrize("plugin", [["-p", "no:memsentry"], ["--memsentry"], []],
                         ids=["off", "on", "loaded"])
def test_the_documented_declaration_runs_the_suite_with_the_plugin_on_or_off(
        pytester: pytest.Pytester, plugin: list[str]) -> None:
    pytester.makeini(_documented_ini())
    pytester.makepyfile(test_marked=TESTS)
    result = pytester.runpytest_subprocess(*plugin, "-q")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=2)
