"""``memory-headroom`` on reports built by hand: on CUDA, an exact peak that uses less than
half the device gets a hint with the batch that would fit; a full device, sampled peaks, a
peak made mostly of temporaries measured at one batch size, and other devices do not."""

from __future__ import annotations

from typing import Any

import pytest
from builders import GiB, check, iterations, parts, report

from memsentry.model import Breakdown, Finding, IterationStats, LayerStats, Severity, SubjectKind
from memsentry.rules.headroom import HEADROOM_SHARE, TARGET_SHARE, UNEXPLAINED_SHARE
from memsentry.rules.series import WARMUP

RULE = "memory-headroom"
TOTAL = 80 * GiB
#: The peak of 6 GiB: 1 GiB of parameters, 4 GiB of activations, 1 GiB of other memory.
EXPLAINED = parts(6 * GiB, parameters=GiB, activations=4 * GiB)


def _run(peak: int | list[int] = 6 * GiB, *, count: int = 8, batch: int | list[int] | None = 64,
         breakdown: Breakdown | None = EXPLAINED, exact: bool = True
         ) -> tuple[IterationStats, ...]:
    """``count`` iterations of batch ``batch`` whose exact peak is ``peak`` (2 GiB held at
    each boundary), broken down as ``breakdown``."""
    return iterations([2 * GiB] * count, peak=peak, peak_exact=exact, batch=batch,
                      parts=breakdown)


def _found(its: tuple[IterationStats, ...], **fields: Any) -> list[Finding]:
    fields.setdefault("device", "cuda:0")
    fields.setdefault("total_memory", TOTAL)
    return check(RULE, report(iterations=its, **fields))


def test_a_small_peak_gets_the_batch_that_would_fit_from_the_activations_per_sample() -> None:
    """Batch 64, 4 GiB of activations at the peak: 64 MiB a sample over 2 GiB that does not
    grow with the batch."""
    (finding,) = _found(_run())
    assert (finding.rule, finding.severity) == (RULE, Severity.HINT)
    assert (finding.bytes, finding.iteration) == (TOTAL - 6 * GiB, WARMUP)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.DEVICE, "cuda:0")
    fits = int((TARGET_SHARE * TOTAL - 2 * GiB) // (64 * 2**20))
    assert finding.message == (
        f"the peak, 6.0 GiB, uses 8% of cuda:0's 80 GiB; with 2.0 GiB that does not grow with "
        f"the batch and 64 MiB per sample (from the activations per sample measured at batch "
        f"64), a batch of about {fits:,} would fit in 85% of it")
    assert finding.fix.startswith("raise the batch size (and scale the learning rate)")


def test_two_batch_sizes_give_a_fitted_line_even_when_temporaries_dominate() -> None:
    """4 GiB at batch 32, 6 GiB at batch 64: the peaks themselves say how the batch grows it,
    whatever the breakdown leaves unexplained."""
    temporaries = parts(6 * GiB, parameters=GiB, activations=GiB)
    its = _run([4 * GiB] * 4 + [6 * GiB] * 4, batch=[32] * 4 + [64] * 4, breakdown=temporaries)
    (finding,) = _found(its)
    assert "64 MiB per sample (from the peaks measured at batch 32, 64)" in finding.message


def test_without_a_batch_size_the_hint_says_only_how_much_is_used() -> None:
    (finding,) = _found(_run(batch=None))
    assert finding.message == "the peak, 6.0 GiB, uses 8% of cuda:0's 80 GiB"


def test_a_peak_made_mostly_of_temporaries_at_one_batch_size_gets_no_batch_advice() -> None:
    """Attention scores or a loss's logits may grow with the batch or not: one batch size
    cannot tell, so no batch that fits can be told."""
    temporaries = parts(6 * GiB, parameters=GiB, activations=GiB)
    assert _found(_run(breakdown=temporaries)) == []


def test_the_unexplained_share_of_the_peak_counts_from_unexplained_share() -> None:
    peak = 8 * GiB
    other = int(UNEXPLAINED_SHARE * peak)

    def with_other(bytes_: int) -> list[Finding]:
        breakdown = parts(peak, parameters=GiB, activations=peak - GiB - bytes_)
        return _found(_run(peak, breakdown=breakdown))

    assert len(with_other(other)) == 1
    assert with_other(other + 1) == []


def test_a_peak_from_half_the_device_is_not_headroom() -> None:
    half = int(HEADROOM_SHARE * TOTAL)
    assert _found(_run(half)) == []
    assert len(_found(_run(half - 1))) == 1


def test_sampled_peaks_are_not_judged() -> None:
    """A peak sampled at hooks misses the temporaries inside layers."""
    assert _found(_run(exact=False)) == []


def test_without_the_device_size_nothing_is_judged() -> None:
    assert _found(_run(), total_memory=None) == []


def test_a_cpu_run_is_not_judged() -> None:
    assert _found(_run(), device="cpu") == []


def test_two_iterations_after_warm_up_are_needed() -> None:
    assert _found(_run(count=WARMUP + 1)) == []
    assert len(_found(_run(count=WARMUP + 2))) == 1


@pytest.mark.parametrize("saved", [None, 3 * GiB])
def test_without_parts_the_outermost_layers_saved_bytes_give_the_line(saved: int | None
                                                                      ) -> None:
    """A peak read without a breakdown: what the model's forward saved for backward is the
    part that grows with the batch; without it there is no line to draw."""
    model = LayerStats(name="model", type="Net", depth=0, calls=8, param_bytes=GiB,
                       output_bytes=None, saved_bytes=saved, forward_delta=None,
                       forward_peak=None)
    (finding,) = _found(_run(breakdown=None), layers=(model,))
    assert ("per sample (from the activations per sample" in finding.message) is bool(saved)


def test_an_empty_report_has_no_finding() -> None:
    assert check(RULE, report(device="cuda:0", total_memory=TOTAL)) == []
