"""The pytest plugin (``pytest --memsentry``), run on real test files through ``pytester``.

These runs count storages from each test's first run (``--memsentry-check=storages``, added
to every inner run), which sees leaks of any size; the default heap check, which
looks closer only at tests that grew the heap, is tested in tests/test_plugin_heap.py.

Most runs are in-process (``runpytest``): the plugin enters its dispatch mode only around each
inner test, and the measurement only counts storages made inside that window, so the outer
process does not disturb it. Runs that need a process without torch, or a GPU, are
subprocesses. CUDA logic is also exercised on CPU with a fake of the plugin's CUDA calls
(tests/plugin_cases/plugin_fake_cuda.py).
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memsentry.units import parse_size
from pytest_memsentry import marks
from pytest_memsentry.marks import Limits
from pytest_memsentry.measure import warm_up
from pytest_memsentry.results import (
    DeviceFigures,
    LeakedTensor,
    Measurement,
    Repeat,
    allowance,
    judge,
    summary,
)

pytest_plugins = ["pytester"]

# In-process pytester runs drop the modules they imported when they end. The first op under a
# dispatch mode imports torch._dynamo, which registers operator libraries that cannot be
# registered twice: import it here, once, outside the runs.
warm_up()

CASES = Path(__file__).parent / "plugin_cases"


@pytest.fixture(autouse=True)
def count_storages(request: pytest.FixtureRequest) -> None:
    """Every inner run of these tests counts storages (pytester clears PYTEST_ADDOPTS)."""
    if "pytester" not in request.fixturenames:
        return
    pytester = request.getfixturevalue("pytester")
    for name in ("runpytest", "runpytest_subprocess"):
        setattr(pytester, name, functools.partial(getattr(pytester, name),
                                                  "--memsentry-check=storages"))
MiB = 1024 * 1024


def lit(text: str) -> str:
    """``text`` as an fnmatch pattern that matches it literally."""
    return text.replace("[", "[[]").replace("*", "[*]").replace("?", "[?]")


def output(result: pytest.RunResult) -> str:
    return result.stdout.str()


def statuses(result: pytest.RunResult) -> dict[str, str]:
    """Each test's status word in a ``-v`` run (``PASSED``, ``LEAKED``, ...), by name: tests
    that left memory behind are repeated and reported when the others have run."""
    found = {}
    for line in result.stdout.lines:
        match = re.match(r"\S+::(\S+) ([A-Z][A-Z ]+?)\s+\[", line)
        if match:
            found[match[1]] = match[2]
    return found


# -- leaks fail, with the verdict on one line and who holds what --------------------------------
LEAKING = """
    import pytest
    import torch

    CACHE = []


    @pytest.fixture(scope="session")
    def registry():
        return []


    def test_leak():
        CACHE.append(torch.ones(512, 1024))
        CACHE.append(torch.zeros(512, 1024))


    def test_into_session_fixture(registry):
        registry.append(torch.ones(256))


    class TestKeeps:
        kept = []

        def test_class_attribute(self):
            self.kept.append(torch.ones(64, 64))

        def test_instance_attribute(self):
            self.big = torch.ones(128, 128)


    HISTORY = []


    def test_graph():
        weight = torch.ones(16, 16, requires_grad=True)
        HISTORY.append(torch.ones(4, 16) @ weight)
"""


def test_leaks_fail_with_a_one_line_verdict_naming_holder_and_line(pytester):
    pytester.makepyfile(test_leak=LEAKING)
    result = pytester.runpytest("--memsentry", "-v")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=4, passed=1)
    assert statuses(result) == {
        "test_leak": "LEAKED", "test_into_session_fixture": "LEAKED",
        "test_class_attribute": "LEAKED", "test_graph": "LEAKED",
        "test_instance_attribute": "PASSED",  # overwritten on every run: retained once
    }
    result.stdout.fnmatch_lines([
        "*_ test_leak _*",
        "memsentry: 4.0 MiB leaked on cpu (limit 0 B) by 2 tensors still alive after the test; "
        "run again, it kept 4.0 MiB more on cpu: it grows with every run",
        "*- memsentry -*",
        "cpu: 4.0 MiB left allocated (limit 0 B), peak 4.0 MiB (no limit)",
        "*bytes*tensor*device*held by*allocated at*",
        lit("2.0 MiB  float32[512, 1024]  cpu       CACHE[0] (global in test_leak.py)") + "*"
        + "test_leak.py:13",
        lit("2.0 MiB  float32[512, 1024]  cpu       CACHE[1] (global in test_leak.py)") + "*"
        + "test_leak.py:14",
        "fix: release what keeps them*or allow it: @pytest.mark.memsentry(max_leak='4.0 MiB')",
    ])
    text = output(result)
    assert "fixture 'registry'[0] (session scope fixture)" in text
    assert "TestKeeps.kept[0] (class attribute)" in text
    result.stdout.fnmatch_lines([
        "*= memsentry: memory retained once =*",
        "test_leak.py::TestKeeps::test_instance_attribute: 64 KiB retained on cpu (limit 0 B) "
        "by 1 tensor still alive after the test (self.big (test instance; pytest keeps it "
        "until the session ends))",
        "1 test kept memory after the first run but no more on a second run*not failed; "
        "--memsentry-strict fails them",
    ])
    result.stdout.fnmatch_lines([
        "memsentry: 1.5 KiB leaked on cpu (limit 0 B) by 3 tensors still alive after the test*",
        "*1.0 KiB  ?*cpu*not reached: saved for backward by a kept graph (grad_fn)?*"
        "test_leak.py:35",
        "*256 B  float32[[]4, 16[]]*HISTORY[[]0[]] (global in test_leak.py), with grad_fn*"
        "test_leak.py:36",
        "*256 B  ?*not reached: saved for backward*test_leak.py:36",
        "note: a kept tensor with a grad_fn keeps its autograd graph*",
    ])
    result.stdout.fnmatch_lines([
        "LEAKED test_leak.py::test_leak - memsentry: 4.0 MiB leaked on cpu (limit 0 B)*",
    ])
    strict = pytester.runpytest("--memsentry", "--memsentry-strict", "-v")
    strict.assert_outcomes(failed=5)
    assert statuses(strict)["test_instance_attribute"] == "LEAKED"
    strict.stdout.fnmatch_lines([
        "memsentry: 64 KiB leaked on cpu (limit 0 B) by 1 tensor still alive after the test",
    ])
    assert "run again" not in output(strict) and "retained once" not in output(strict)


def test_progress_letter_and_a_leak_nobody_reachable_holds(pytester):
    pytester.makepyfile(test_letters="""
        import torch.nn.functional


        def test_clean():
            assert torch.ones(3).sum() == 3


        def test_kept_by_a_library():
            # A library module's globals are not walked: nothing the user's code reaches holds it.
            torch.nn.functional._kept_by_test = torch.ones(1000)
    """)
    result = pytester.runpytest("--memsentry")  # overwritten on every call: retained, not failed
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "test_letters.py::test_kept_by_a_library: 3.9 KiB retained on cpu (limit 0 B) by 1 "
        "tensor still alive after the test (allocated at test_letters.py:10)",  # the line
    ])
    result = pytester.runpytest("--memsentry", "--memsentry-strict")
    result.stdout.fnmatch_lines(["test_letters.py .L*"])
    result.stdout.fnmatch_lines([
        "memsentry: 3.9 KiB leaked on cpu (limit 0 B) by 1 tensor still alive after the test",
        "*3.9 KiB  ?*cpu*nothing memsentry reached (a closure, a hook, torch's own state?)*"
        "test_letters.py:10",
    ])


def test_a_tensor_kept_by_a_functools_cache_is_named_by_the_cached_function(pytester):
    pytester.makepyfile(test_cache="""
        import functools

        import torch


        @functools.lru_cache
        def table(n):
            return torch.ones(n)


        def test_clean():
            assert torch.ones(3).sum() == 3


        def test_cached():
            assert table(1000).sum() == 1000
    """)
    result = pytester.runpytest("--memsentry")  # a cache filled once: retained, not failed
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "test_cache.py::test_cached: 3.9 KiB retained on cpu (limit 0 B) by 1 tensor still "
        "alive after the test (table(…) (global in test_cache.py))",
    ])
    result = pytester.runpytest("--memsentry", "--memsentry-strict")
    result.stdout.fnmatch_lines(["test_cache.py .L*"])
    result.stdout.fnmatch_lines([
        "memsentry: 3.9 KiB leaked on cpu (limit 0 B) by 1 tensor still alive after the test",
        "*3.9 KiB  float32[[]1000[]]*cpu*table(…) (global in test_cache.py)*test_cache.py:8",
    ])


# -- what is not a leak ---------------------------------------------------------------------
CLEAN = """
    import gc

    import pytest
    import torch

    SHARED = []
    IN_USE = []


    def setup_module():
        SHARED.append(torch.ones(300))          # xunit set-up: the module's, not the test's


    @pytest.fixture
    def batch():
        tensor = torch.ones(256, 256)
        IN_USE.append(tensor)
        yield tensor
        IN_USE.clear()                         # freed at the fixture's teardown


    @pytest.fixture(scope="module")
    def weights():
        return torch.ones(128, 128)            # kept until the module ends


    @pytest.fixture(scope="session")
    def vocab():
        return {"embedding": torch.ones(64, 32)}


    def test_clean():
        x = torch.ones(1000)
        assert x.sum() == 1000


    def test_cycle_only_gc_frees():
        gc.disable()
        try:
            node = {"tensor": torch.ones(10_000)}
            node["self"] = node
        finally:
            gc.enable()


    def test_function_fixture(batch):
        assert batch.shape == (256, 256)


    def test_module_fixture_first_use(weights, vocab):
        assert weights.sum() == 128 * 128


    def test_module_fixture_again(weights, vocab):
        assert weights.shape == (128, 128)


    def test_lazy_import():
        import lazy_helper                    # builds a table when first imported
        assert lazy_helper.TABLE.numel() == 4096


    @pytest.mark.memsentry(max_leak="16 KiB")
    def test_small_leak_allowed():
        SHARED.append(torch.ones(1024))        # 4 KiB


    @pytest.mark.no_memsentry
    def test_not_checked():
        SHARED.append(torch.ones(1024, 1024))


    def test_without_torch_ops():
        assert sum(range(10)) == 45
"""


def test_what_is_not_a_leak_passes(pytester):
    pytester.makepyfile(test_clean=CLEAN,
                        lazy_helper="import torch\nTABLE = torch.ones(64, 64)\n")
    result = pytester.runpytest("--memsentry", "-v")
    assert result.ret == pytest.ExitCode.OK, output(result)
    result.assert_outcomes(passed=9)


def test_a_fixture_keeping_the_tests_tensor_and_its_own(pytester):
    """Memory a module fixture made is left out and said so; a tensor the test put into that
    fixture is the test's."""
    pytester.makepyfile(test_fixture_leak="""
        import pytest
        import torch


        @pytest.fixture(scope="module")
        def store():
            return [torch.ones(1024)]


        def test_adds(store):
            store.append(torch.ones(2048))


        def test_later(store):                 # the fixture lives on: the tensor stays
            assert len(store) == 2
    """)
    result = pytester.runpytest("--memsentry")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines([
        "memsentry: 8.0 KiB leaked on cpu (limit 0 B) by 1 tensor still alive after the test; "
        "run again, it kept 8.0 KiB more on cpu: it grows with every run",
        "*fixture 'store'[[]1[]] (module scope fixture)*test_fixture_leak.py:11",
        "not counted: 4.0 KiB (1 tensor) made by fixture 'store' (module scope) while it was "
        "set up: the fixture keeps it until its scope ends",
    ])


# -- peaks ------------------------------------------------------------------------------------
def test_peak_above_max_peak_fails_with_its_own_verdict(pytester):
    pytester.makepyfile(test_peak="""
        import pytest
        import torch


        @pytest.mark.memsentry(max_peak="1 MiB")
        def test_big_temporary():
            assert torch.ones(1024, 1024).sum() > 0      # 4 MiB at once, freed at once


        def test_small_temporary():
            assert torch.ones(1024).sum() > 0
    """)
    result = pytester.runpytest("--memsentry", "-v", "--memsentry-max-peak", "2 MiB")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines([
        "*::test_big_temporary PEAK EXCEEDED*",
        "*::test_small_temporary PASSED*",
        "memsentry: peak 4.0 MiB on cpu above the limit of 1.0 MiB (max_peak)",
        "*cpu: 0 B left allocated (limit 0 B), peak 4.0 MiB (limit 1.0 MiB)",
        "fix: allocate less at once*@pytest.mark.memsentry(max_peak='4.1 MiB')",
    ])


# -- tests that fail, skip or error on their own --------------------------------------------
def test_own_failures_are_kept_and_skips_not_checked(pytester):
    pytester.makepyfile(test_own="""
        import pytest
        import torch

        CACHE = []


        def test_fails():
            CACHE.append(torch.ones(1024))
            assert 1 == 2


        @pytest.fixture
        def broken():
            CACHE.append(torch.ones(1024))
            raise RuntimeError("fixture broke")


        def test_setup_error(broken):
            pass


        def test_skips():
            CACHE.append(torch.ones(1024))
            pytest.skip("not today")


        @pytest.mark.xfail(reason="known")
        def test_xfails():
            CACHE.append(torch.ones(1024))
            assert False
    """)
    result = pytester.runpytest("--memsentry", "-rA")
    result.assert_outcomes(failed=1, errors=1, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines(["FAILED test_own.py::test_fails - assert 1 == 2"])
    result.stdout.fnmatch_lines(["ERROR test_own.py::test_setup_error - RuntimeError: fixture*"])
    result.stdout.fnmatch_lines([
        "*_ test_fails _*",
        "*assert 1 == 2*",
        "*- memsentry -*",
        "leak not judged: the test failed, and its traceback keeps its frames (and their "
        "tensors) alive; 4.0 KiB on cpu still allocated after it (limit 0 B)",
    ])
    assert "LEAKED" not in output(result)


# -- switching it on and off ------------------------------------------------------------------
def test_without_the_flag_only_marked_tests_are_checked(pytester):
    pytester.makepyfile(test_flag="""
        import pytest
        import torch

        CACHE = []


        def test_unmarked_leak():
            CACHE.append(torch.ones(1024))


        @pytest.mark.memsentry
        def test_marked_leak():
            CACHE.append(torch.ones(1024))
    """)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*::test_unmarked_leak PASSED*", "*::test_marked_leak LEAKED*"])


def test_the_closest_marker_decides_and_limits_merge(pytester):
    pytester.makepyfile(test_merge="""
        import pytest
        import torch

        CACHE = []


        @pytest.mark.no_memsentry
        class TestOff:
            def test_off(self):
                CACHE.append(torch.ones(1024))


            @pytest.mark.memsentry
            def test_back_on(self):
                CACHE.append(torch.ones(1024))


        @pytest.mark.memsentry(max_leak="8 KiB")
        class TestLimits:
            @pytest.mark.memsentry(max_peak="1 MiB")
            def test_small_leak_big_peak(self):
                CACHE.append(torch.ones(1024))             # 4 KiB: allowed by the class
                assert torch.ones(1024, 1024).sum() > 0    # 4 MiB at once: above the test's

            def test_small_leak(self):
                CACHE.append(torch.ones(1024))
    """)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=2, failed=2)
    assert statuses(result) == {
        "test_off": "PASSED", "test_back_on": "LEAKED",
        "test_small_leak_big_peak": "PEAK EXCEEDED", "test_small_leak": "PASSED",
    }
    result.stdout.fnmatch_lines([
        "memsentry: peak 4.0 MiB on cpu above the limit of 1.0 MiB (max_peak)",
        "cpu: 4.0 KiB left allocated (limit 8.0 KiB), peak 4.0 MiB (limit 1.0 MiB)",
    ])


INI_CASES = """
    import torch

    CACHE = []


    def test_512_kib():
        CACHE.append(torch.ones(128, 1024))


    def test_2_mib():
        CACHE.append(torch.ones(512, 1024))
"""


def test_ini_turns_it_on_and_the_command_line_wins(pytester):
    pytester.makeini("""
        [pytest]
        memsentry = true
        memsentry_max_leak = 1 MiB
    """)
    pytester.makepyfile(test_ini=INI_CASES)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "test_ini.py .L*",
        "memsentry: 2.0 MiB leaked on cpu (limit 1.0 MiB) by 1 tensor still alive after the test*",
    ])
    result = pytester.runpytest("--memsentry-max-leak=0")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["memsentry: 512 KiB leaked on cpu (limit 0 B) by 1 tensor*"])


# -- usage errors: at collection, naming the test and what is accepted --------------------------
ACCEPTS = ("@pytest.mark.memsentry accepts max_leak=SIZE, max_peak=SIZE, where SIZE is bytes "
           "(an int) or a string like '512 KiB', '2GB', '1.5 MiB'")


@pytest.mark.parametrize(("mark", "message"), [
    ('memsentry(max_leek="1 MiB")',
     "test_bad.py::test_marked: @pytest.mark.memsentry got unknown argument(s) max_leek; "
     + ACCEPTS),
    ('memsentry("1 MiB")',
     "test_bad.py::test_marked: @pytest.mark.memsentry got positional argument(s) '1 MiB'; "
     + ACCEPTS),
    ('memsentry(max_leak="lots")',
     "test_bad.py::test_marked: @pytest.mark.memsentry(max_leak='lots'): cannot read 'lots' as "
     "a size: use bytes or a number with one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. "
     "'512 KiB', '2GB', '1.5 MiB')"),
    ("memsentry(max_peak=-1)",
     "test_bad.py::test_marked: @pytest.mark.memsentry(max_peak=-1): a size cannot be negative, "
     "got -1"),
    ("no_memsentry(max_leak=1)",
     "test_bad.py::test_marked: @pytest.mark.no_memsentry got unknown argument(s) max_leak; "
     "@pytest.mark.no_memsentry takes no arguments"),
])
def test_bad_marker_arguments_are_usage_errors_at_collection(pytester, mark, message):
    pytester.makepyfile(test_bad=f"""
        import pytest

        @pytest.mark.{mark}
        def test_marked():
            pass

        def test_other():
            pass
    """)
    result = pytester.runpytest()  # without --memsentry: markers are checked all the same
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {lit(message)}"])


def test_bad_marker_under_xdist_is_a_collection_error(pytester):
    """A worker's UsageError would reach nobody: the bad test is a collection error instead,
    with the same message, and is not run."""
    pytester.makepyfile(test_bad="""
        import pytest

        @pytest.mark.memsentry(max_leek=1)
        def test_marked():
            pass

        def test_other():
            pass
    """)
    result = pytester.runpytest("-n", "2")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR collecting test_bad.py*",
        "test_bad.py::test_marked: @pytest.mark.memsentry got unknown argument(s) max_leek; "
        + lit(ACCEPTS),
    ])


@pytest.mark.parametrize(("args", "ini", "message"), [
    (["--memsentry-max-leak=2XB"], None,
     "ERROR: --memsentry-max-leak='2XB': cannot read '2XB' as a size*"),
    (["--memsentry-max-peak", "-1"], None,
     "ERROR: --memsentry-max-peak='-1': cannot read '-1' as a size*"),
    ([], "memsentry_max_peak = huge",
     "ERROR: ini option memsentry_max_peak='huge': cannot read 'huge' as a size*"),
])
def test_bad_option_sizes_are_usage_errors(pytester, args, ini, message):
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


SIZES = [
    (0, 0), (1024, 1024), ("1024", 1024), ("512 KiB", 512 * 1024), ("512KiB", 512 * 1024),
    ("2GB", 2_000_000_000), ("2 gb", 2_000_000_000), ("1.5 MiB", 1_572_864), ("1.5MiB", 1_572_864),
    ("3 k", 3000), ("3K", 3000), (" 7 B ", 7), (".5 KiB", 512), ("1 TiB", 1024**4),
    ("10 MB", 10_000_000), ("1 GiB", 1024**3),
    ("", None), ("lots", None), ("1 XB", None), ("MiB", None), ("-1", None), ("1e3", None),
    ("1,5 MiB", None), ("1 MiB 2", None), (-1, None), (True, None), (1.5, None), (None, None),
]


@pytest.mark.parametrize(("value", "expected"), SIZES)
def test_marker_sizes(value, expected):
    if expected is None:
        with pytest.raises(ValueError):
            parse_size(value)
        if value is not None:
            with pytest.raises(ValueError):
                marks.memsentry(max_leak=value)
    else:
        assert marks.memsentry(max_leak=value) == {"max_leak": expected}
        assert marks.memsentry(max_peak=value) == {"max_peak": expected}


def test_marker_help_comes_from_the_marker_functions(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines([
        "@pytest.mark.memsentry(max_leak=None, max_peak=None): Check this test for memory "
        "leaks, also without --memsentry. max_leak: *",
        "@pytest.mark.no_memsentry(): Do not check this test for memory leaks, even with "
        "--memsentry.",
    ])


# -- the report table, and pytest-xdist ---------------------------------------------------------
def test_xdist_and_the_report_table(pytester):
    pytester.makepyfile(test_spread="""
        import pytest
        import torch

        CACHE = []


        @pytest.mark.parametrize("n", [1, 2, 3, 4])
        def test_clean(n):
            assert torch.ones(n * 1024).sum() == n * 1024


        def test_leak():
            CACHE.append(torch.ones(256, 1024))


        def test_fails():
            assert False
    """)
    result = pytester.runpytest("--memsentry", "--memsentry-report", "-n", "2", "-v")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=4, failed=2)
    result.stdout.fnmatch_lines(["*LEAKED test_spread.py::test_leak*"])
    result.stdout.fnmatch_lines([
        "*= memsentry report =*",
        "6 tests measured, 1 failed the check",
        "largest leaks:",
        "test*device*leaked*peak*verdict",
        "test_spread.py::test_leak*cpu*1.0 MiB*1.0 MiB*leaked",
        "largest peaks:",
        "test*device*leaked*peak*verdict",
        "test_spread.py::test_leak*cpu*1.0 MiB*1.0 MiB*leaked",
        "test_spread.py::test_clean[[]4[]]*cpu*0 B*16 KiB*passed",
    ])
    result.stdout.fnmatch_lines(["LEAKED test_spread.py::test_leak - memsentry: 1.0 MiB leaked*"])


# -- the memsentry fixture ---------------------------------------------------------------------
def test_memsentry_fixture_gives_an_active_tracker(pytester):
    pytester.makepyfile(test_with_tracker="""
        import torch
        from torch import nn


        def test_tracks(memsentry):
            assert memsentry.active
            model = nn.Linear(8, 4)
            for _ in range(3):
                model(torch.randn(2, 8)).sum().backward()
                memsentry.step()
            report = memsentry.report()
            assert len(report.iterations) == 3
            assert report.layer("Linear").calls == 3
    """)
    result = pytester.runpytest("--memsentry")
    result.assert_outcomes(passed=1)


# -- torch is never imported for nothing ---------------------------------------------------------
def test_plugin_does_not_import_torch():
    code = ("import sys, pytest_memsentry.plugin\n"
            "from memsentry.units import parse_size\n"
            "assert parse_size('1 MiB') == 1048576\n"
            "assert 'torch' not in sys.modules and 'memsentry.tracker' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tests_that_never_import_torch_pass_with_the_flag(pytester):
    pytester.makepyfile(test_no_torch="""
        import sys

        def test_plain():
            assert "pytest_memsentry.plugin" in sys.modules
            assert "torch" not in sys.modules
    """)
    result = pytester.runpytest_subprocess("--memsentry", "--memsentry-max-leak", "1 MiB",
                                           "--memsentry-report")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["no test was measured*"])


# -- CUDA, with a fake of the plugin's CUDA calls --------------------------------------------------
FAKE_CONFTEST = """
    from plugin_fake_cuda import FAKE


    def pytest_sessionstart(session):
        session.config.pluginmanager.get_plugin("memsentry-manager").cuda = FAKE
"""


def _fake_cuda(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(plugin_fake_cuda=(CASES / "plugin_fake_cuda.py").read_text())
    pytester.makeconftest(FAKE_CONFTEST)


def test_cuda_leaks_fail_only_when_the_driver_confirms_them(pytester):
    _fake_cuda(pytester)
    pytester.makepyfile(test_fake="""
        import pytest
        from plugin_fake_cuda import FAKE, MiB


        def test_confirmed():
            FAKE.alloc(4 * MiB)


        def test_on_second_device():
            FAKE.alloc(4 * MiB, device=1)


        def test_allocator_only():
            FAKE.alloc(2 * MiB, driver=False)


        def test_driver_only():
            FAKE.driver_grows(64 * MiB)


        def test_transient():
            FAKE.alloc_until_settled(8 * MiB)


        @pytest.mark.memsentry(max_leak="1 MiB", max_peak="3 MiB")
        def test_peak():
            FAKE.alloc(4 * MiB)
            FAKE.free(4 * MiB)


        def test_cuda_turned_off_here():
            FAKE.on = False


        def test_initialises_cuda():
            FAKE.on = True                 # CUDA first initialised by this test: not checked
            FAKE.alloc(4 * MiB)
    """)
    result = pytester.runpytest("-v", "--memsentry")
    result.assert_outcomes(passed=5, failed=3)
    assert statuses(result) == {
        "test_confirmed": "LEAKED", "test_on_second_device": "LEAKED",
        "test_allocator_only": "PASSED", "test_driver_only": "PASSED",
        "test_transient": "PASSED", "test_peak": "PEAK EXCEEDED",
        "test_cuda_turned_off_here": "PASSED", "test_initialises_cuda": "PASSED",
    }
    result.stdout.fnmatch_lines([
        "memsentry: 4.0 MiB leaked on cuda:0 (limit 0 B) still allocated after the test, "
        "confirmed by the driver (+4.0 MiB used); run again, it kept 4.0 MiB more on cuda:0: "
        "it grows with every run",
        "cpu: 0 B left allocated (limit 0 B), *",
        "cuda:0: 4.0 MiB left allocated (limit 0 B), peak 4.0 MiB (no limit); the driver "
        "reports 4.0 MiB more used",
        "cuda:1: 0 B left allocated (limit 0 B), peak 0 B (no limit)",
    ])
    result.stdout.fnmatch_lines(["memsentry: 4.0 MiB leaked on cuda:1 (limit 0 B)*"])
    result.stdout.fnmatch_lines([
        "memsentry: peak 4.0 MiB on cuda:0 above the limit of 3.0 MiB (max_peak)",
    ])
    result.stdout.fnmatch_lines([
        "*test_allocator_only*",
        "*LeakWarning: memsentry: the CUDA caching allocator holds 2.0 MiB more on cuda:0 after "
        "the test (limit 0 B), but the driver's used memory grew by 0 B, so the leak was not "
        "confirmed and the test was not failed*",
    ])


def test_cuda_memory_of_wider_fixtures_is_theirs(pytester):
    _fake_cuda(pytester)
    pytester.makepyfile(test_fixtures="""
        import pytest
        from plugin_fake_cuda import FAKE, MiB


        @pytest.fixture(scope="module")
        def on_device():
            FAKE.alloc(16 * MiB)
            yield
            FAKE.free(16 * MiB)


        def test_first_use(on_device):
            pass


        def test_last_use_leaks(on_device):   # the fixture's release must not hide this leak
            FAKE.alloc(2 * MiB)
    """, test_later="""
        from plugin_fake_cuda import FAKE, MiB


        def test_after_the_module():
            pass
    """)
    result = pytester.runpytest("-v", "--memsentry")
    result.assert_outcomes(passed=2, failed=1)
    assert statuses(result) == {
        "test_first_use": "PASSED", "test_last_use_leaks": "LEAKED",
        "test_after_the_module": "PASSED",
    }
    result.stdout.fnmatch_lines(["memsentry: 2.0 MiB leaked on cuda:0 (limit 0 B)*"])


# -- CUDA, for real ---------------------------------------------------------------------------
@pytest.mark.cuda
def test_real_cuda_leak_is_named(pytester):
    pytester.makepyfile(test_gpu="""
        import torch

        torch.ones(1, device="cuda")          # CUDA initialised before the tests (collection)
        CACHE = []


        def test_leaks_on_cuda():
            CACHE.append(torch.ones(1024, 1024, device="cuda"))


        def test_clean_on_cuda():
            x = torch.ones(1024, 1024, device="cuda")
            assert x.sum().item() == 1024 * 1024


        def test_matmul_workspace_is_not_a_leak():
            a = torch.randn(512, 512, device="cuda")
            assert torch.isfinite(a @ a).all().item()
    """)
    result = pytester.runpytest_subprocess("--memsentry", "-v")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*::test_leaks_on_cuda LEAKED*",
        "memsentry: 4.0 MiB leaked on cuda:0 (limit 0 B) by 1 tensor still alive after the "
        "test, confirmed by the driver*",
        "*4.0 MiB  float32[[]1024, 1024[]]  cuda:0*CACHE[[]0[]] (global in test_gpu.py)*"
        "test_gpu.py:8",
    ])


@pytest.mark.cuda
def test_real_cuda_peak_and_module_fixture(pytester):
    pytester.makepyfile(test_gpu_fixture="""
        import pytest
        import torch

        torch.ones(1, device="cuda")


        @pytest.fixture(scope="module")
        def weights():
            return torch.ones(1024, 1024, device="cuda")


        def test_first(weights):
            assert weights.sum().item() > 0


        def test_second(weights):
            assert weights.shape == (1024, 1024)


        @pytest.mark.memsentry(max_peak="8 MiB")
        def test_big_temporary():
            assert torch.ones(4096, 1024, device="cuda").sum().item() > 0   # 16 MiB
    """)
    result = pytester.runpytest_subprocess("--memsentry", "-v")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*::test_big_temporary PEAK EXCEEDED*",
        "memsentry: peak 16 MiB on cuda:0 above the limit of 8.0 MiB (max_peak)",
    ])


# -- judging and formatting, on hand-made figures ------------------------------------------------
def test_judge_lists_ten_tensors_and_counts_the_rest():
    tensors = tuple(LeakedTensor(MiB, "cpu", "float32[262144]", f"CACHE[{i}] (global in t.py)",
                                 "t.py:3") for i in range(10))
    measurement = Measurement((DeviceFigures("cpu", 12 * MiB, 12 * MiB, 12),), tensors,
                              hidden=2, hidden_bytes=2 * MiB)
    check, notes = judge(measurement, Limits())
    assert check is not None and not notes
    assert check.status == "leaked"
    assert "\n" not in check.long_repr
    assert check.long_repr == ("memsentry: 12 MiB leaked on cpu (limit 0 B) by 12 tensors "
                               "still alive after the test")
    assert check.section.count("CACHE[") == 10
    assert "and 2 more (2.0 MiB)" in check.section
    assert judge(measurement, Limits(max_leak=12 * MiB)) == (None, [])


def test_memory_retained_once_is_listed_only_with_something_to_look_for():
    once = Repeat({"cpu": 0})  # the second run kept no more
    heap = Measurement((DeviceFigures("cpu", 600 * 1024, 0, 0),), heap=True,
                       notes=("the process's heap grew by 600 KiB over the test",))
    assert judge(heap, Limits(), once) == (None, [])  # the heap's growth alone: no line
    unnamed = Measurement((DeviceFigures("cpu", 4096, 4096, 1),),
                          (LeakedTensor(4096, "cpu", None, None, "t.py:8"),))
    check, _notes = judge(unnamed, Limits(), once)
    assert check is not None and check.status == "retained" and not check.fails
    assert check.long_repr == ("memsentry: 4.0 KiB retained on cpu (limit 0 B) by 1 tensor "
                               "still alive after the test (allocated at t.py:8)")
    named = Measurement((DeviceFigures("cpu", 4096, 4096, 1),),
                        (LeakedTensor(4096, "cpu", "float32[1024]", "model.last (global)",
                                      "t.py:8"),))
    check, _notes = judge(named, Limits(), once)
    assert check is not None and check.long_repr.endswith("(model.last (global))")
    # Growth is judged on the counted runs, whatever started the closer look.
    check, _notes = judge(unnamed, Limits(), Repeat({"cpu": 4096}))
    assert check is not None and check.status == "leaked"


def test_allowance_reads_back_at_least_the_value():
    for value in (0, 1, 1023, 1024, 1025, 4_194_305, 10 * MiB + 1, 3 * 1024**3 + 5):
        assert parse_size(allowance(value)) >= value
    assert allowance(4 * MiB) == "4.0 MiB"
    assert allowance(4 * MiB + 1) == "4.1 MiB"


def test_summary_without_measurements_says_how_to_get_some():
    assert summary([])[0].startswith("no test was measured")


# -- growth or memory retained once (issue 10) -----------------------------------------------
ONCE_OR_GROWING = """
    import functools

    import torch

    HISTORY = []


    class Scorer:
        def __init__(self):
            self.last = None

        def __call__(self, x):
            self.last = x.argmax(-1)          # overwritten on every call
            return self.last


    class TestScorer:
        scorer = Scorer()                     # created once per class

        def test_scores(self):
            assert self.scorer(torch.randn(64, 1000)).shape == (64,)


    @functools.lru_cache
    def positions(n):
        return torch.arange(n, dtype=torch.float32)


    def test_cache_filled_on_first_use():
        assert positions(4096)[-1] == 4095


    def test_grows():
        HISTORY.append(torch.ones(1000))


    def test_sees_one_entry():                # a repeat run at once would make it fail
        assert len(HISTORY) == 1
"""


def test_only_growth_fails_by_default_and_strict_fails_what_was_kept_once(pytester):
    pytester.makepyfile(test_once=ONCE_OR_GROWING)
    result = pytester.runpytest("--memsentry", "-v")
    result.assert_outcomes(passed=3, failed=1)
    assert statuses(result) == {
        "test_scores": "PASSED", "test_cache_filled_on_first_use": "PASSED",
        "test_grows": "LEAKED", "test_sees_one_entry": "PASSED",
    }
    result.stdout.fnmatch_lines([
        "memsentry: 3.9 KiB leaked on cpu (limit 0 B) by 1 tensor still alive after the test; "
        "run again, it kept 3.9 KiB more on cpu: it grows with every run",
    ])
    result.stdout.fnmatch_lines([
        "*= memsentry: memory retained once =*",
        "test_once.py::TestScorer::test_scores: 512 B retained on cpu (limit 0 B) by 1 tensor "
        "still alive after the test (TestScorer.scorer.last (class attribute))",
        "test_once.py::test_cache_filled_on_first_use: 16 KiB retained on cpu*",
        "2 tests kept memory after the first run but no more on a second run*",
    ])
    strict = pytester.runpytest("--memsentry", "--memsentry-strict", "-v")
    strict.assert_outcomes(passed=1, failed=3)
    assert statuses(strict)["test_sees_one_entry"] == "PASSED"
    assert "retained once" not in output(strict)


def test_strict_from_the_ini_file(pytester):
    pytester.makeini("[pytest]\nmemsentry = true\nmemsentry_strict = true\n")
    pytester.makepyfile(test_once=ONCE_OR_GROWING)
    pytester.runpytest().assert_outcomes(passed=1, failed=3)


def test_a_repeat_that_fails_is_judged_on_what_it_kept(pytester):
    pytester.makepyfile(test_repeat_fails="""
        import torch

        KEPT = []
        OUTPUTS = []


        def test_refuses_a_second_run():
            assert not KEPT, "this test cannot run twice"
            KEPT.append(torch.ones(1000))


        def test_asserts_on_what_it_grows():
            OUTPUTS.append(torch.ones(1000))
            assert len(OUTPUTS) == 1
    """)
    result = pytester.runpytest("--memsentry", "-v")
    result.assert_outcomes(passed=1, failed=1)
    assert statuses(result) == {"test_refuses_a_second_run": "PASSED",
                                "test_asserts_on_what_it_grows": "LEAKED"}
    result.stdout.fnmatch_lines([
        "test_repeat_fails.py::test_refuses_a_second_run: 3.9 KiB retained on cpu*",
    ])
    # Said as such: a flaky test, or one that depends on the state it changes.
    text = output(result)
    assert "it grows with every run; 2 of its repeats failed its own checks (a flaky test, " \
           "or one that depends on state it changes); what it kept still counts" in text


def test_a_cycle_inside_autograds_graph_is_named(pytester):
    pytester.makepyfile(test_cycle="""
        import torch


        def test_in_place_on_a_tensor_that_requires_grad():
            scale = torch.nn.Linear(1, 1)(torch.tensor([[2.0]]))
            acc = torch.ones(1, 1)
            acc += acc * scale                    # pytorch/pytorch#105147
    """)
    result = pytester.runpytest("--memsentry")
    result.assert_outcomes(failed=1)
    text = output(result)
    assert "a reference cycle inside autograd's graph (C++), which gc.collect() cannot " \
           "free" in text
    assert "write it out of place (`a = a + a * y`)" in text
    assert "nothing memsentry reached" not in text


def test_the_cycle_backward_with_create_graph_makes_is_named_and_its_fix_clears_it(pytester):
    """A leaf's .grad with a graph refers back to the leaf: the storages grow with every run
    (a weight no optimizer clears sums every backward's graph into its .grad), and no Python
    object holds them. Setting the gradients to None, as the note says, leaves nothing."""
    pytester.makepyfile(test_second_order="""
        import torch


        def _steps(clear):
            weight = torch.randn(10, 5, requires_grad=True)
            bias = torch.randn(10, requires_grad=True)
            x = torch.randn(5)
            for _ in range(20):
                loss = (weight.mv(x) + bias).pow(2).sum()
                loss.backward(create_graph=True)
            if clear:
                weight.grad = bias.grad = None


        def test_kept():
            _steps(clear=False)


        def test_cleared():
            _steps(clear=True)
    """)
    result = pytester.runpytest("--memsentry", "-v")
    result.assert_outcomes(passed=1, failed=1)
    assert statuses(result) == {"test_kept": "LEAKED", "test_cleared": "PASSED"}
    text = output(result)
    assert "a cycle: a leaf and its .grad's graph (backward(create_graph=True))" in text
    assert "set `p.grad = None` for every leaf" in text
    assert "fix: no Python object holds them" in text
    assert "nothing memsentry reached" not in text


def test_tensors_made_in_another_thread_are_counted(pytester):
    pytester.makepyfile(test_thread="""
        import threading

        import torch

        RESULTS = []


        def test_worker_thread_keeps_a_tensor():
            worker = threading.Thread(target=lambda: RESULTS.append(torch.ones(2048)))
            worker.start()
            worker.join()


        def test_thread_that_frees_its_tensor():
            worker = threading.Thread(target=lambda: torch.ones(2048).sum())
            worker.start()
            worker.join()
    """)
    result = pytester.runpytest("--memsentry", "-v")
    result.assert_outcomes(passed=1, failed=1)
    assert statuses(result)["test_worker_thread_keeps_a_tensor"] == "LEAKED"
    result.stdout.fnmatch_lines([
        "*8.0 KiB  float32[[]2048[]]  cpu       RESULTS[[]0[]] (global in test_thread.py)*",
    ])


def test_a_small_named_tensor_is_listed_before_larger_unreached_ones(pytester):
    pytester.makepyfile(test_small="""
        import torch.nn.functional

        SMALL = []


        def test_keeps_much_unreached_and_a_little_named():
            # 12 x 16 KiB nobody reachable names: a library module's globals are not walked
            torch.nn.functional._kept_by_test = [torch.ones(4096) for n in range(12)]
            SMALL.append(torch.ones(2))           # 8 B in a global: the part that grows
    """)
    result = pytester.runpytest("--memsentry", "--memsentry-strict")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*8 B  float32[[]2[]]*SMALL[[]0[]] (global in test_small.py)*"])
    result.stdout.fnmatch_lines(["and 3 more (48 KiB)"])


# -- code the plugin must not break (issue 11) -----------------------------------------------
def test_compiled_and_traced_tests_pass_under_memsentry_in_any_order(pytester):
    pytester.makepyfile(test_compiled="""
        import pytest
        import torch
        from torch import nn


        def _compiled(backend):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            return torch.compile(model, backend=backend, fullgraph=True)


        @pytest.mark.no_memsentry
        def test_compiled_unchecked_first():
            assert _compiled("eager")(torch.randn(2, 8)).shape == (2, 8)


        @pytest.mark.parametrize("backend", ["eager", "inductor"])
        def test_compiled_fullgraph(backend):
            assert _compiled(backend)(torch.randn(2, 8)).shape == (2, 8)


        def test_jit_trace():
            # A convolution: the tracer does not see ops a Python dispatch mode ran
            model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.Flatten())
            traced = torch.jit.trace(model, torch.randn(2, 3, 8, 8))
            for _ in range(3):  # the executor's later runs use an optimised graph
                x = torch.randn(2, 3, 8, 8)
                assert torch.equal(traced(x), model(x))


        @pytest.mark.no_memsentry
        def test_compiled_unchecked_after():
            assert _compiled("eager")(torch.randn(2, 8)).shape == (2, 8)
    """)
    # In a subprocess: an in-process run would import torch._inductor and pytester would then
    # drop those modules, so that a later import in this process registers them twice.
    result = pytester.runpytest_subprocess("--memsentry", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)


def test_counted_tests_collect_only_their_own_garbage_and_give_every_object_back(pytester):
    """Under the storages check the objects alive before a test are set aside while it runs
    (the collection after it walks only what it made), as under the heap check: the test's own
    cycles are collected, its leak is still found, and nothing stays set aside after it."""
    pytester.makepyfile(test_frozen="""
        import gc
        import weakref

        import torch

        KEPT = []


        class Node:
            def __init__(self):
                self.me = self
                self.tensor = torch.ones(4096)


        def test_own_cycle_is_collected():
            ref = weakref.ref(Node())
            gc.collect()
            assert ref() is None


        def test_keeps_a_tensor():
            KEPT.append(torch.ones(8192))


        def test_after():
            pass
        """)
    pytester.makeconftest("""
        import gc
        from pathlib import Path

        SEEN = []


        def pytest_runtest_call(item):
            SEEN.append(f"{item.name}:{gc.get_freeze_count() > 0}")


        def pytest_sessionfinish(session):
            SEEN.append(f"end:{gc.get_freeze_count()}")
            Path("frozen.txt").write_text(" ".join(SEEN))
        """)
    result = pytester.runpytest("--memsentry", "-v")
    assert statuses(result) == {"test_own_cycle_is_collected": "PASSED",
                                "test_keeps_a_tensor": "LEAKED", "test_after": "PASSED"}
    seen = (pytester.path / "frozen.txt").read_text().split()
    assert "test_own_cycle_is_collected:True" in seen  # set aside while the test ran
    assert seen[-1] == "end:0"  # and given back
