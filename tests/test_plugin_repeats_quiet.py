"""A test ``--memsentry`` sends for repeats is heard of once: the repeats report nothing to
any channel (unittest subtests, the ``subtests`` fixture, junit-xml), so the counts, the
outcomes and the exit status are those of the plain run."""

from __future__ import annotations

import pytest

from pytest_memsentry.measure import warm_up

pytest_plugins = ["pytester"]

warm_up()  # (see test_plugin.py: torch._dynamo's libraries are registered once)

#: A test that keeps a 256 x 256 module on its first call only (retained once, so it is
#: repeated) and checks in a subtest that it ran once: a repeat that reported its subtest
#: would fail the suite.
UNITTEST = """
    import unittest
    from torch import nn

    _CALLS = []
    _MODULES = nn.ModuleList()


    class TestOnce(unittest.TestCase):
        def test_once(self):
            _CALLS.append(1)
            if len(_CALLS) == 1:
                _MODULES.append(nn.Linear(256, 256))
            with self.subTest("called once"):
                self.assertEqual(len(_CALLS), 1)
"""

FIXTURE = """
    from torch import nn

    _CALLS = []
    _MODULES = nn.ModuleList()


    def test_once(subtests):
        _CALLS.append(1)
        if len(_CALLS) == 1:
            _MODULES.append(nn.Linear(256, 256))
        with subtests.test("called once"):
            assert len(_CALLS) == 1
"""


@pytest.mark.parametrize("source", [UNITTEST, FIXTURE], ids=["unittest", "subtests"])
def test_repeats_report_no_subtest_again(pytester: pytest.Pytester, source: str) -> None:
    pytester.makepyfile(test_once=source)
    plain = pytester.runpytest("-p", "no:memsentry", "-q")
    tracked = pytester.runpytest("--memsentry", "--memsentry-check=storages", "-q",
                                 "--junitxml=junit.xml")
    assert plain.ret == 0 and tracked.ret == 0, tracked.stdout.str()
    assert tracked.parseoutcomes() == plain.parseoutcomes() | {"seconds": tracked.duration} \
        or {k: v for k, v in tracked.parseoutcomes().items() if k != "seconds"} == \
        {k: v for k, v in plain.parseoutcomes().items() if k != "seconds"}, \
        (plain.stdout.str(), tracked.stdout.str())
    assert "SUBFAIL" not in tracked.stdout.str()
    junit = (pytester.path / "junit.xml").read_text()
    assert "<failure" not in junit and junit.count("<testcase ") == 1, junit
