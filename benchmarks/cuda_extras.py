"""Three behaviours that only a CUDA device shows, checked on one (issue 24's unproven list).

1. A loop whose weights are updated by hand (no ``torch.optim``), on the GPU, under ``watch()``
   and ``track()``: a list that keeps every step's output is named, the same loop without the
   list gives no LEAK, and the two modes agree.
2. Batches pinned in host memory (``tensor.pin_memory()``, as ``DataLoader(pin_memory=True)``
   does) and copied to the device: the report's pinned-memory figures and line.
3. The process's resident memory during a CUDA run: the report's readings of the process.

Prints what it saw and exits 1 if a check failed.

    python benchmarks/cuda_extras.py
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import memsentry
from memsentry.reporters.breakdown import pinned_line


def _hand_loop(keep: bool, watch: bool, device: str = "cuda") -> memsentry.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    x, y = torch.randn(32, 64, device=device), torch.randn(32, 8, device=device)
    kept_outputs = []
    make = memsentry.watch if watch else memsentry.track
    with make(model, on_leak="ignore") as tracker:
        for _ in range(60):
            out = model(x)
            loss = nn.functional.mse_loss(out, y)
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(0.01 * p.grad)
            if keep:
                kept_outputs.append(out)
    return tracker.report()


def _leaks(report: memsentry.Report) -> list[memsentry.Finding]:
    return [f for f in report.findings if f.severity is memsentry.Severity.LEAK]


def main() -> int:
    if not torch.cuda.is_available():
        print("CUDA is not available here: nothing to check")
        return 1
    failed = []
    for watch in (False, True):
        mode = "watch" if watch else "track"
        leaky, clean = _hand_loop(True, watch), _hand_loop(False, watch)
        found = _leaks(leaky)
        named = [f for f in found if "kept_outputs" in f.message]
        print(f"hand-updated loop, {mode}: backend {leaky.backend}, {len(leaky.iterations)} "
              f"iterations; leaky: {len(found)} LEAK, holder named: {bool(named)}; clean: "
              f"{len(_leaks(clean))} LEAK")
        for f in found[:2]:
            print(f"    {f.message[:300]}")
        if not named or _leaks(clean):
            failed.append(f"hand-updated loop under {mode}")

    model = nn.Linear(256, 256).cuda()
    with memsentry.track(model, on_leak="ignore") as tracker:
        for _ in range(20):
            batch = torch.randn(64, 256).pin_memory()
            model(batch.to("cuda", non_blocking=True)).sum().backward()
    report = tracker.report()
    print(f"pinned: {report.pinned}")
    if report.pinned is None or report.pinned.held <= 0:
        failed.append("pinned host memory")
    else:
        print(f"    {pinned_line(report.pinned)}")
        print("    in the text: " + str("pinned" in str(report)))
    print(f"resident peak: {report.resident_peak}; process readings: {len(report.process)}")
    for sample in report.process[:3]:
        print(f"    {sample}")
    if not report.process or report.resident_peak is None:
        failed.append("resident memory")
    print("FAILED: " + ", ".join(failed) if failed else "all three checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
