"""What ``memsentry.watch()`` keeps over a long run: the tiny-step loop of ``cost.py``
(``Linear(4,4)-ReLU-Linear(4,1)``, SGD) for N iterations under ``watch()``, with the process's
resident memory and memsentry's own records (timeline entries, censuses) read every
``--every`` iterations. A bounded tracker levels off; one that keeps a record per iteration
grows with N.

    python benchmarks/watch_memory.py --iterations 100000 --json benchmarks/watch-memory.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

import memsentry


def rss_mib() -> float:
    """Resident memory now (MiB), from /proc; the peak where /proc is absent."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * resource.getpagesize() / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=10_000)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    rows = []
    started = time.perf_counter()
    with memsentry.watch(model, on_leak="ignore") as tracker:
        for it in range(1, args.iterations + 1):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if it % args.every == 0:
                report = tracker.report()
                cost = report.cost
                assert cost is not None
                rows.append({"iteration": it, "rss_mib": round(rss_mib(), 1),
                             "timeline": len(report.iterations),
                             "dropped": report.dropped_iterations,
                             "censuses": len(report.censuses), "sampled": cost.sampled,
                             "share": round(cost.share, 4),
                             "seconds": round(time.perf_counter() - started, 1)})
                print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    header = (f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.platform()}, "
              f"torch {torch.__version__}, memsentry at {commit}")
    print(header)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
