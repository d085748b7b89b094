"""What the pytest plugin costs per test: a generated suite of small torch tests, run plain,
with ``--memsentry`` and with pytest-memray's ``--memray``, interleaved.

    python benchmarks/pytest_overhead.py [--tests 300] [--rounds 3] [--json PATH]

Each run is a fresh ``python -m pytest -q -p no:cacheprovider`` process on the same suite;
the rounds alternate the modes so machine noise hits them alike. The extra time per test is
(median wall time of the mode - median of the plain run) / number of tests. A mode whose
plugin is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import date
from pathlib import Path

from tabulate import tabulate

_TEST_FILE = '''\
import pytest
import torch
from torch import nn

torch.set_num_threads(1)


@pytest.mark.parametrize("width", [{widths}])
def test_train_step(width):
    torch.manual_seed(width)
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    for _ in range(3):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
'''

MODES: dict[str, tuple[str, ...]] = {
    "plain": (),
    "--memsentry": ("--memsentry",),
    "--memray": ("--memray",),
}
_PLUGINS = {"--memsentry": "pytest_memsentry", "--memray": "pytest_memray"}


def write_suite(directory: Path, tests: int, per_file: int = 50) -> None:
    for start in range(0, tests, per_file):
        widths = ", ".join(str(8 + w) for w in range(start, min(start + per_file, tests)))
        (directory / f"test_generated_{start // per_file:03d}.py").write_text(
            _TEST_FILE.format(widths=widths), encoding="utf-8"
        )


def run(directory: Path, options: tuple[str, ...]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options],
        cwd=directory, capture_output=True, text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, check=False,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"pytest {' '.join(options)} exited {done.returncode}: {tail}")
    return seconds, done.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.tests < 1 or args.rounds < 1:
        parser.error("--tests and --rounds must be at least 1")
    available = {m: o for m, o in MODES.items()
                 if m not in _PLUGINS or importlib.util.find_spec(_PLUGINS[m])}
    times: dict[str, list[float]] = {m: [] for m in available}
    summaries: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(tmp)
        write_suite(suite, args.tests)
        run(suite, ())  # warm the file cache and the interpreter's imports
        for round_index in range(args.rounds):
            order = list(available)
            order = order[round_index % len(order):] + order[: round_index % len(order)]
            for mode in order:
                seconds, summary = run(suite, available[mode])
                times[mode].append(seconds)
                summaries[mode] = summary
                print(f"round {round_index + 1}: {mode:12s} {seconds:6.2f} s  {summary}",
                      file=sys.stderr)
    plain = statistics.median(times["plain"])
    rows, results = [], {}
    for mode in MODES:
        if mode not in times:
            rows.append([mode, "not installed", "", "", ""])
            continue
        median = statistics.median(times[mode])
        extra = (median - plain) / args.tests * 1e3
        results[mode] = {"seconds": times[mode], "median": median, "extra_ms_per_test": extra}
        rows.append([mode, f"{median:.2f}", f"{min(times[mode]):.2f}-{max(times[mode]):.2f}",
                     f"{median / plain:.2f}x", f"{extra:+.1f}"])
    print(f"pytest plugin overhead, {date.today().isoformat()}: {args.tests} generated tests "
          f"(3 SGD steps of a small MLP each), {args.rounds} rounds, Python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs")
    print(tabulate(rows, headers=["mode", "median s", "range s", "vs plain",
                                  "extra ms/test"], tablefmt="github"))
    print(textwrap.fill("last summary lines: " + "; ".join(
        f"{m}: {s}" for m, s in summaries.items()), 100))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
