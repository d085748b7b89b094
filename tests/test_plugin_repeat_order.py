"""When a test that left memory behind is repeated: by default when every test has run (no
later test sees the repeats' side effects, and the test is reported then), or with
``--memsentry-repeat=now`` right after it, reported in its place as in the plain run."""

from __future__ import annotations

import re

import pytest

from pytest_memsentry.measure import warm_up

pytest_plugins = ["pytester"]

warm_up()  # (see test_plugin.py: torch._dynamo's libraries are registered once)

SUITE = """
    import torch

    KEPT = []


    def test_first():
        pass


    def test_grows():
        KEPT.append(torch.ones(100_000))


    def test_last():
        pass
"""


def _order(result: pytest.RunResult) -> list[tuple[str, str]]:
    """(name, status) of each test, in the order a ``-v`` run reported them."""
    found = []
    for line in result.stdout.lines:
        match = re.match(r"\S+::(\S+) ([A-Z][A-Z ]+?)\s+\[", line)
        if match:
            found.append((match[1], match[2]))
    return found


@pytest.mark.parametrize("how", [["--memsentry-repeat=now"], ["-o", "memsentry_repeat=now"]],
                         ids=["option", "ini"])
def test_repeated_now_a_test_is_reported_in_its_place(pytester: pytest.Pytester,
                                                      how: list[str]) -> None:
    pytester.makepyfile(test_order=SUITE)
    plain = pytester.runpytest("-p", "no:memsentry", "-v")
    now = pytester.runpytest("--memsentry", *how, "-v")
    assert [name for name, _ in _order(now)] == [name for name, _ in _order(plain)]
    assert _order(now) == [("test_first", "PASSED"), ("test_grows", "LEAKED"),
                           ("test_last", "PASSED")]


def test_by_default_the_repeated_test_is_reported_when_the_others_have_run(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_order=SUITE)
    result = pytester.runpytest("--memsentry", "-v")
    assert _order(result) == [("test_first", "PASSED"), ("test_last", "PASSED"),
                              ("test_grows", "LEAKED")]


def test_an_unknown_value_names_the_option_and_what_each_value_does(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_order=SUITE)
    result = pytester.runpytest("--memsentry", "--memsentry-repeat=later")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--memsentry-repeat='later': use 'end' (the default: *"
                                 "or 'now' (right after the test, *"])
