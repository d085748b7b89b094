"""``non-pytorch-memory`` on reports built by hand: on CUDA, device memory NVML counts for the
process beyond what PyTorch reserved, ``NON_PYTORCH_BYTES`` or more, is a hint naming the
libraries that take it; the CUDA context alone, other devices and missing figures are not."""

from __future__ import annotations

import pytest
from builders import GiB, check, report

from memsentry.model import Finding, Severity, SubjectKind
from memsentry.rules.device import NON_PYTORCH_BYTES

RULE = "non-pytorch-memory"


def _found(process_used: object, reserved: int | None = 2 * GiB,
           device: str = "cuda:0") -> list[Finding]:
    return check(RULE, report(device=device, reserved=reserved,
                              nvml={"process_used": process_used}))


def test_memory_other_libraries_took_is_a_hint_with_what_to_look_for() -> None:
    (finding,) = _found(6 * GiB)
    assert (finding.rule, finding.severity, finding.bytes) == (RULE, Severity.HINT, 4 * GiB)
    assert finding.subject is not None
    assert (finding.subject.kind, finding.subject.name) == (SubjectKind.DEVICE, "cuda:0")
    assert finding.message.startswith(
        "NVML counts 6.0 GiB on cuda:0 for this process, 4.0 GiB more than PyTorch reserved "
        "(2.0 GiB)")
    assert "NCCL buffers, cuDNN/cuBLAS workspaces" in finding.message
    assert "NCCL_BUFFSIZE" in finding.fix and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in (
        finding.fix)


def test_the_extra_memory_counts_from_non_pytorch_bytes() -> None:
    assert _found(2 * GiB + NON_PYTORCH_BYTES - 1) == []
    assert [f.bytes for f in _found(2 * GiB + NON_PYTORCH_BYTES)] == [NON_PYTORCH_BYTES]


def test_the_cuda_context_and_kernel_images_alone_are_not_reported() -> None:
    """Field guide #25: 300 MB to 1 GB outside the allocator, one-time."""
    assert _found(2 * GiB + 900 * 2**20) == []


def test_a_figure_read_back_as_a_float_still_counts() -> None:
    assert [f.bytes for f in _found(float(6 * GiB))] == [4 * GiB]


@pytest.mark.parametrize("process_used", [None, "6 GiB", True, float("nan")])
def test_a_process_figure_that_is_not_a_number_is_not_judged(process_used: object) -> None:
    """NVML would not say (a MIG slice), or a report edited by hand holds anything."""
    assert _found(process_used) == []


def test_without_nvml_figures_nothing_is_judged() -> None:
    assert check(RULE, report(device="cuda:0", reserved=2 * GiB)) == []
    assert check(RULE, report(device="cuda:0", reserved=2 * GiB,
                              nvml={"reason": "NVML not found"})) == []


def test_without_the_reserved_figure_nothing_is_judged() -> None:
    assert _found(6 * GiB, reserved=None) == []


def test_a_cpu_run_is_not_judged() -> None:
    assert _found(6 * GiB, device="cpu") == []
