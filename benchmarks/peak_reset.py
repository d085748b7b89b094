"""What keeping the program's peaks costs memsentry's Python: the reset where each iteration
begins (read, fold, reset) and a program's read of the statistics while memsentry keeps
peaks for it.

torch's own calls are stood in for by functions that return a fresh nested dict shaped as
torch/csrc/cuda/Module.cpp's ``memoryStats`` builds it (nine statistics in three pools, two
oversize statistics, five plain counters), so the figures are memsentry's share only; the
time of ``torch._C._cuda_memoryStats`` itself on a GPU is not in them (no GPU here).

    python benchmarks/peak_reset.py [--rounds 9] [--calls 20000]

Prints the median over interleaved rounds of microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from memsentry.measure.peaks import PeakKeeper

STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
         "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "small_pool", "large_pool")


def nested(index: int) -> dict[str, Any]:
    stats: dict[str, Any] = {name: {pool: {"current": 1 << 20, "peak": 1 << 21,
                                           "allocated": 1 << 30, "freed": 1 << 29}
                                    for pool in POOLS} for name in STATS}
    for name in ("oversize_allocations", "oversize_segments"):
        stats[name] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
    for name in ("num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams",
                 "num_device_alloc"):
        stats[name] = 0
    return stats


def per_call(function: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args()
    torch._C._cuda_memoryStats = nested  # type: ignore[attr-defined]
    torch._C._cuda_resetPeakMemoryStats = lambda index: None  # type: ignore[attr-defined]
    keeper = PeakKeeper(("_cuda_memoryStats", "_cuda_resetPeakMemoryStats"))
    account = keeper.join(0)
    keeper.restart(0, account)  # the program's account now keeps peaks: its reads merge
    read_wrapped = torch._C._cuda_memoryStats  # type: ignore[attr-defined]
    figures: dict[str, list[float]] = {"bare read": [], "restart": [], "program read": []}
    for _ in range(args.rounds):  # interleaved
        figures["bare read"].append(per_call(lambda: nested(0), args.calls))
        figures["restart"].append(per_call(lambda: keeper.restart(0, account), args.calls))
        figures["program read"].append(per_call(lambda: read_wrapped(0), args.calls))
    medians = {name: round(statistics.median(values), 2) for name, values in figures.items()}
    medians["restart less the read"] = round(medians["restart"] - medians["bare read"], 2)
    medians["program read less the read"] = round(medians["program read"]
                                                  - medians["bare read"], 2)
    print(json.dumps({"us_per_call": medians, "rounds": args.rounds, "calls": args.calls}))
    keeper.leave(0, account)


if __name__ == "__main__":
    main()
