"""The plugin's default first look at a test, the heap check: a test that grew glibc's heap by
more than 64 KiB is run again with its storages counted, and judged on those runs; smaller
leaks are left to ``--memsentry-check=storages``."""

from __future__ import annotations

import gc
import re
import weakref

import pytest

from memsentry.measure.cpu import MALLINFO2_UNAVAILABLE
from pytest_memsentry.garbage import Collector
from pytest_memsentry.measure import warm_up

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.skipif(MALLINFO2_UNAVAILABLE is not None,
                                reason=MALLINFO2_UNAVAILABLE or "")

warm_up()  # the repeats count storages: import torch._dynamo once, outside the inner runs

SUITE = """
    import pytest
    import torch

    CACHE = []
    SMALL = []


    def test_big_leak():
        CACHE.append(torch.ones(512, 1024))      # 2 MiB a run, kept by a global


    def test_small_leak():
        SMALL.append(torch.ones(256))            # 1 KiB a run


    def test_large_temporary():
        assert torch.ones(1024, 1024).sum() > 0  # 4 MiB at once, freed at once


    class TestOverwrite:
        def test_cache_filled_once(self):
            type(self).table = torch.ones(256, 1024)   # 1 MiB, replaced on every run


    def test_fails_on_its_own():
        assert torch.ones(2).sum() == 3
"""


def statuses(result: pytest.RunResult) -> dict[str, str]:
    found = {}
    for line in result.stdout.lines:
        match = re.match(r"\S+::(\S+) ([A-Z][A-Z ]+?)\s+\[", line)
        if match:
            found[match.group(1)] = match.group(2)
    return found


def test_the_heap_check_finds_a_growing_leak_with_its_holder(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("--memsentry", "-v")
    assert statuses(result) == {
        "test_big_leak": "LEAKED", "test_small_leak": "PASSED",
        "test_large_temporary": "PASSED", "test_cache_filled_once": "PASSED",
        "test_fails_on_its_own": "FAILED",
    }
    text = result.stdout.str()
    assert "memsentry: 2.0 MiB leaked on cpu (limit 0 B) by 1 tensor" in text
    assert "it grows with every run" in text
    assert re.search(r"2\.0 MiB +float32\[512, 1024\] +cpu +CACHE\[\d\] \(global in "
                     r"test_suite\.py\) +test_suite\.py:9", text)
    assert "the process's heap grew by" in text
    assert "assert tensor(2.) == 3" in text  # the test's own failure, untouched
    # The overwritten table grew the heap on the first run only: the heap's second look
    # stopped there, and the test passes without a line (the heap names no tensor).
    assert "retained" not in text


def test_counting_storages_sees_the_small_leak_too(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("--memsentry", "--memsentry-check=storages", "-v")
    found = statuses(result)
    assert found["test_big_leak"] == found["test_small_leak"] == "LEAKED"
    assert found["test_large_temporary"] == "PASSED"


def test_the_ini_option_and_a_bad_value(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeini("[pytest]\nmemsentry = true\nmemsentry_check = storages\n")
    result = pytester.runpytest("-v")
    assert statuses(result)["test_small_leak"] == "LEAKED"
    result = pytester.runpytest("--memsentry-check=fast")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--memsentry-check='fast': use 'heap'*or 'storages'*"])


def test_a_leak_held_in_cycles_is_found_by_default(pytester: pytest.Pytester) -> None:
    # Each test's teardown leaves 128 KiB of cyclic garbage. Read without gc.collect()
    # before the test and with it after, the previous test's garbage (freed by that
    # collection) was subtracted from this test's growth and hid its leak of the same size.
    pytester.makepyfile(test_cycles="""
        import pytest
        import torch


        class Node:
            def __init__(self):
                self.me = self                       # freed only by gc.collect()
                self.data = torch.ones(32 * 1024)    # 128 KiB


        @pytest.fixture(scope="session")
        def registry():
            return []


        @pytest.fixture
        def scratch():
            return Node()                            # cyclic garbage after the teardown


        def test_first(registry, scratch):
            pass


        def test_keeps_a_node(registry, scratch):
            registry.append(Node())


        def test_last(registry):
            pass
    """)
    result = pytester.runpytest("--memsentry", "-v")
    result.assert_outcomes(passed=2, failed=1)
    assert statuses(result)["test_keeps_a_node"] == "LEAKED"
    result.stdout.fnmatch_lines([
        "memsentry: 128 KiB leaked on cpu (limit 0 B) by 1 tensor still alive after the test; "
        "run again, it kept 128 KiB more on cpu: it grows with every run",
        "*128 KiB *float32[[]32768] *cpu *fixture 'registry'[[]*].data (session scope fixture)*",
    ])
    assert "retained" not in result.stdout.str()



class Node:
    def __init__(self) -> None:
        self.me = self


def test_the_window_frees_only_the_garbage_the_test_made() -> None:
    old = Node()
    old_ref = weakref.ref(old)
    gc.collect()  # `old` survives into the oldest generation...
    del old       # ...and becomes garbage there, as a torn-down module fixture's value does
    clock = iter([0.0, 10.0, 10.5, 10.6, 12.6])  # read by each tidy() (and for its cost)
    collector = Collector(clock=lambda: next(clock))  # reads 0.0
    collector.open()
    new = Node()
    new_ref = weakref.ref(new)
    del new
    gc.collect()  # inside the window (the test's own call, or one Python starts)
    assert new_ref() is None and old_ref() is not None
    collector.close()
    assert old_ref() is not None and gc.get_freeze_count() == 0
    collector.tidy()  # the first, at 10.0: a full collection, which cost 0.5 s
    assert old_ref() is None
    again = Node()
    again_ref = weakref.ref(again)
    gc.collect()
    del again
    collector.tidy()  # at 10.6: 0.1 s after one that cost 0.5 s, so none
    assert again_ref() is not None
    collector.tidy()  # at 12.6 (20 x 0.5 s = 10 s not yet passed): still none
    assert again_ref() is not None
    gc.collect()


ONE_TIME = """
    import torch

    _NAMES = {}  # a module-level cache, filled on first use


    def names(n):
        if n not in _NAMES:
            _NAMES[n] = [f"row {i}" for i in range(n)]
        return _NAMES[n]


    def test_first_svd():
        u, s, v = torch.linalg.svd(torch.randn(64, 64))   # LAPACK's one-time set-up
        assert s.shape == (64,)


    def test_first_convolution():
        out = torch.nn.functional.conv2d(torch.randn(1, 3, 32, 32), torch.randn(8, 3, 3, 3))
        assert out.shape == (1, 8, 30, 30)


    def test_cache_filled_once():
        assert len(names(20_000)) == 20_000


    def test_allocates_and_frees():
        assert torch.ones(1024, 1024).sum() == 1024 * 1024
"""


@pytest.mark.parametrize("check", ["heap", "storages"])
def test_one_time_set_up_gets_no_line(pytester: pytest.Pytester, check: str) -> None:
    # A fresh process, so that these are the first calls of the ops: each grew the heap by
    # 0.2 to 1 MiB on its first run only, which was listed as "retained once" with nothing
    # to look for.
    pytester.makepyfile(test_once=ONE_TIME)
    result = pytester.runpytest_subprocess("--memsentry", f"--memsentry-check={check}",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
    text = result.stdout.str()
    assert "retained" not in text and "memsentry:" not in text


LEAKING = """
    import torch

    HISTORY = []


    def test_grows_first():
        HISTORY.append(torch.ones(64 * 1024))   # 256 KiB a run


    def test_grows_second():
        HISTORY.append(torch.ones(64 * 1024))


    def test_grows_third():
        HISTORY.append(torch.ones(64 * 1024))


    def test_clean():
        assert torch.ones(8).sum() == 8
"""


@pytest.mark.parametrize(("args", "leaked"), [(["-x"], 1), (["--maxfail=2"], 2)])
def test_maxfail_stops_after_leaking_tests(pytester: pytest.Pytester, args: list[str],
                                           leaked: int) -> None:
    pytester.makepyfile(test_leaking=LEAKING)
    result = pytester.runpytest("--memsentry", "-v", *args)
    result.assert_outcomes(failed=leaked)
    assert list(statuses(result).values()) == ["LEAKED"] * leaked
    result.stdout.fnmatch_lines([f"*stopping after {leaked} failures*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    # Without it every test runs, and the leaks are judged when all have run.
    result = pytester.runpytest("--memsentry", "-v")
    result.assert_outcomes(failed=3, passed=1)
