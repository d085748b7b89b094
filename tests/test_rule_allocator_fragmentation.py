"""``allocator-fragmentation`` on reports built by hand: on CUDA, reserved memory far above the
highest exact peak, or reserved growing while the peak stays flat, is waste the caching
allocator cannot reuse; reserved a little above the peak, growth of the peak itself, sampled
peaks and other devices are not judged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from builders import GiB, MiB, check, iterations, ramp, report

from memsentry.model import Finding, Severity, SubjectKind
from memsentry.rules.device import FRAGMENT_BYTES, FRAGMENT_RATE, FRAGMENT_SHARE
from memsentry.rules.series import WARMUP

RULE = "allocator-fragmentation"


def _found(peak: int | Sequence[int], reserved: int | Sequence[int | None], *, count: int = 8,
           exact: bool = True, **fields: Any) -> list[Finding]:
    """A CUDA run of ``count`` iterations with ``peak`` and ``reserved`` at each (exact peaks
    unless ``exact`` is false), 512 MiB allocated at every boundary."""
    its = iterations([512 * MiB] * count, peak=peak, reserved=reserved, peak_exact=exact)
    fields.setdefault("device", "cuda:0")
    return check(RULE, report(iterations=its, **fields))


def test_reserved_far_above_the_highest_peak_is_waste_with_the_expandable_segments_fix() -> None:
    (finding,) = _found(100 * MiB, 1200 * MiB)
    assert (finding.rule, finding.severity) == (RULE, Severity.WASTE)
    assert (finding.bytes, finding.rate) == (1100 * MiB, None)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.DEVICE, "cuda:0")
    assert finding.message == (
        "1.2 GiB reserved on cuda:0 against a highest peak of 100 MiB after warm-up: 1.1 GiB "
        "the caching allocator holds but cannot reuse")
    assert finding.fix.startswith("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def test_reserved_growing_while_the_peak_stays_flat_is_variable_shapes_splitting_blocks() -> None:
    """Field guide #20: reserved gains 8 MiB a step, the peak does not move; the allocator's
    counters show the split blocks."""
    stats = {"inactive_split_bytes.all.current": 96 * MiB}
    (finding,) = _found(GiB, ramp(GiB + 8 * MiB, 8 * MiB, 8), allocator_stats=stats)
    assert finding.rate == 8 * MiB
    assert finding.bytes == 64 * MiB  # reserved at the end less the peak
    assert ("; reserved grows 8.0 MiB/iter while the peak stays flat, the mark of variable "
            "input shapes splitting cached blocks; 96 MiB sit in inactive split blocks"
            ) in finding.message


def test_under_another_allocator_the_fix_leaves_out_the_native_setting() -> None:
    """``backend:cudaMallocAsync`` never reads ``expandable_segments``."""
    (finding,) = _found(100 * MiB, 1200 * MiB, backend="cuda-malloc-async")
    assert "the allocator holds but cannot reuse" in finding.message
    assert "caching allocator" not in finding.message
    assert finding.fix.startswith("pad or bucket inputs")
    assert "does nothing under this one" in finding.fix


def test_the_cache_keeping_freed_blocks_a_little_above_the_peak_is_not_waste() -> None:
    """Field guide #24: the caching allocator keeps freed blocks; nvidia-smi stays high."""
    assert _found(GiB, GiB + 128 * MiB) == []


def test_reserved_growing_with_the_peak_is_growth_not_fragmentation() -> None:
    peaks = ramp(GiB, 8 * MiB, 8)
    assert _found(peaks, [p + 64 * MiB for p in peaks]) == []


def test_sampled_peaks_are_not_judged() -> None:
    """A peak sampled at hooks misses a layer's temporaries: reserved would look unused."""
    assert _found(100 * MiB, 1200 * MiB, exact=False) == []


def test_a_cpu_run_is_not_judged() -> None:
    assert _found(100 * MiB, 1200 * MiB, device="cpu") == []


def test_iterations_without_a_reserved_figure_are_left_out() -> None:
    """Iterations measured at their boundary only have no reserved figure: of the five that
    have one, three remain after warm-up, one too few; with six, four are enough."""
    five: list[int | None] = [None] * 3 + [1200 * MiB] * 5
    six: list[int | None] = [None] * 2 + [1200 * MiB] * 6
    assert _found(100 * MiB, five) == []
    assert len(_found(100 * MiB, six)) == 1


@pytest.mark.parametrize("reserved", [512 * MiB, 4 * GiB])
def test_reserved_above_the_peak_counts_from_its_share_or_its_bytes_whichever_is_more(
        reserved: int) -> None:
    """With 512 MiB reserved ``FRAGMENT_BYTES`` decide, with 4 GiB ``FRAGMENT_SHARE`` of it."""
    unused = max(int(FRAGMENT_SHARE * reserved), FRAGMENT_BYTES)
    assert [f.bytes for f in _found(reserved - unused, reserved)] == [unused]
    assert _found(reserved - unused + 1, reserved) == []


def test_reserved_growth_counts_from_fragment_rate_an_iteration() -> None:
    assert _found(GiB, ramp(GiB + MiB, FRAGMENT_RATE - 1, 8)) == []
    assert [f.rate for f in _found(GiB, ramp(GiB + MiB, FRAGMENT_RATE, 8))] == [FRAGMENT_RATE]


def test_four_iterations_after_warm_up_are_needed() -> None:
    assert _found(100 * MiB, 1200 * MiB, count=WARMUP + 3) == []
    assert len(_found(100 * MiB, 1200 * MiB, count=WARMUP + 4)) == 1


def test_a_report_whose_iterations_share_one_index_is_judged_without_a_slope() -> None:
    """Reserved 64 MiB above a flat peak: no fragmentation whichever way the missing slope
    is read, and no exception out of the rule (nor out of ``analyse``)."""
    its = [replace(it, index=5) for it in iterations([512 * MiB] * 8, peak=GiB,
                                                      reserved=GiB + 64 * MiB, peak_exact=True)]
    assert check(RULE, report(iterations=its, device="cuda:0")) == []


def test_an_empty_report_has_no_finding() -> None:
    assert check(RULE, report(device="cuda:0")) == []
