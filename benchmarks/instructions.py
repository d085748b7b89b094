"""What memsentry and its peers cost a loop, counted in CPU instructions (issue 41).

Wall time on a shared two-core machine moves by tens of percent from run to run; the number of
instructions a process executes does not. Each (loop, tool, length) runs in its own process
under valgrind's callgrind with instrumentation off until the loop is built and warmed up
untracked; then a small C helper (compiled here against ``valgrind/callgrind.h``, called with
ctypes) turns it on and dumps the counts at four points:

* ``start``: the tool's start (``track(...).__enter__()``, ``tracemalloc.start()``, ...);
* ``first5``: the first five iterations;
* ``rest``: the iterations after the fifth;
* ``stop``: the tool's stop (``__exit__``).

Ratios are against the same loop untracked in the same layout: ``whole`` is start + every
iteration + stop over the untracked iterations; ``iterations`` every iteration alone, the ratio
the ledger should agree with; ``first5`` and ``rest`` the first five and the others. For
memsentry the report's ledger (``report.cost.share``: memsentry's clocked seconds over the
loop's own) is printed as kept under callgrind and, in brackets, as kept by the same block run
natively right after (a second under callgrind is not the CPU's). Python's hash seed, torch's
threads and OpenBLAS's threads are fixed, so two runs of a child count the same to within a
few hundred thousand instructions.

Loops (synthetic, one CPU thread):

* ``tiny``: ``Linear(4,4)-ReLU-Linear(4,1)``, batch 2, MSE, Adam;
* ``inference``: ``Linear(32,64)-ReLU-Linear(64,64)-ReLU-Linear(64,10)`` under ``no_grad``,
  batch 8, no optimizer: an iteration is one forward;
* ``rl``: episodes of 50 forwards of a ``Linear(8,32)-Tanh-Linear(32,4)`` policy (log-probs
  kept), then one update with Adam: an iteration is one episode;
* ``wide``: 1,000 blocks of ``Linear(8,8)-ReLU`` (2,001 modules), batch 4, SGD.

Tools: ``untracked``; ``watch`` and ``track`` (``memsentry.watch/track(model,
on_leak="ignore")``, defaults); ``memray`` (``memray.Tracker`` to a file); ``tracemalloc``;
``profiler`` (``torch.profiler.profile(activities=[CPU], profile_memory=True)``,
``key_averages()`` at the stop); ``memtracker``
(``torch.distributed._tools.mem_tracker.MemTracker``, ``track_external``,
``reset_mod_stats()`` every iteration as its docs ask).

    python benchmarks/instructions.py --loops tiny,inference --tools untracked,watch,track \\
        --iterations 2000 --jobs 2 --json benchmarks/instructions-results.json

Each run takes a minute or more (callgrind runs 30 to 60 times slower than the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
HELPER_SOURCE = r"""
#include <valgrind/callgrind.h>
void ms_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void ms_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
void ms_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""
PHASES = ("start", "first5", "rest", "stop")
FIRST = 5
WARM_UP = 20
ENV = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1"}


# -- the child: one loop under one tool, dumped at the phases -----------------------------
class Callgrind:
    """The client requests, through the helper library."""

    def __init__(self, library: str) -> None:
        self._lib = ctypes.CDLL(library)

    def start(self) -> None:
        self._lib.ms_start()

    def dump(self, name: str) -> None:
        self._lib.ms_dump(name.encode())

    def stop(self) -> None:
        self._lib.ms_stop()


@dataclass
class Loop:
    model: Any
    optimizer: Any
    step: Callable[[], None]


def _supervised(model: Any, optimizer: Any, x: Any, y: Any) -> Loop:
    """A training loop on one batch: MSE, ``zero_grad``, backward, step."""
    from torch import nn

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return Loop(model, optimizer, step)


def _tiny() -> Loop:
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    return _supervised(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                       torch.randn(2, 4), torch.randn(2, 1))


def _inference() -> Loop:
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10)).eval()
    x = torch.randn(8, 32)
    sink: list[float] = []

    def step() -> None:
        with torch.no_grad():
            sink.append(float(model(x)[0, 0]))
        if len(sink) > 100:
            sink.clear()

    return Loop(model, None, step)


def _rl() -> Loop:
    import torch
    from torch import nn

    policy = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    states = torch.randn(50, 8)

    def step() -> None:
        log_probs = []
        for t in range(50):
            logits = policy(states[t])
            log_probs.append(torch.log_softmax(logits, -1)[t % 4])
        loss = -torch.stack(log_probs).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return Loop(policy, optimizer, step)


def _wide() -> Loop:
    import torch
    from torch import nn

    model = nn.Sequential(*[m for _ in range(1000) for m in (nn.Linear(8, 8), nn.ReLU())])
    return _supervised(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                       torch.randn(4, 8), torch.randn(4, 8))


LOOPS: dict[str, Callable[[], Loop]] = {
    "tiny": _tiny, "inference": _inference, "rl": _rl, "wide": _wide}


@contextlib.contextmanager
def _untracked(loop: Loop, out: dict[str, Any]) -> Iterator[Callable[[], None]]:
    yield loop.step


def _memsentry(watch: bool) -> Callable[[Loop, dict[str, Any]],
                                        contextlib.AbstractContextManager[Callable[[], None]]]:
    @contextlib.contextmanager
    def tool(loop: Loop, out: dict[str, Any]) -> Iterator[Callable[[], None]]:
        import memsentry

        make = memsentry.watch if watch else memsentry.track
        tracker = make(loop.model, on_leak="ignore")
        with tracker:
            yield loop.step
        out["tracker"] = tracker

    return tool


@contextlib.contextmanager
def _memray(loop: Loop, out: dict[str, Any]) -> Iterator[Callable[[], None]]:
    import memray

    path = Path(tempfile.mkdtemp()) / "memray.bin"
    with memray.Tracker(path):
        yield loop.step


@contextlib.contextmanager
def _tracemalloc(loop: Loop, out: dict[str, Any]) -> Iterator[Callable[[], None]]:
    import tracemalloc

    tracemalloc.start()
    try:
        yield loop.step
        tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()


@contextlib.contextmanager
def _profiler(loop: Loop, out: dict[str, Any]) -> Iterator[Callable[[], None]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield loop.step
    prof.key_averages()


@contextlib.contextmanager
def _memtracker(loop: Loop, out: dict[str, Any]) -> Iterator[Callable[[], None]]:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if loop.optimizer is None:
        tracker.track_external(loop.model)
    else:
        tracker.track_external(loop.model, loop.optimizer)

    def step() -> None:
        loop.step()
        tracker.reset_mod_stats()

    with tracker:
        yield step


TOOLS = {"untracked": _untracked, "watch": _memsentry(True), "track": _memsentry(False),
         "memray": _memray, "tracemalloc": _tracemalloc, "profiler": _profiler,
         "memtracker": _memtracker}


def child(loop_name: str, tool: str, iterations: int, library: str) -> None:
    """Run one block under callgrind's client requests; print its facts as one JSON line."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    loop = LOOPS[loop_name]()
    for _ in range(WARM_UP):
        loop.step()
    if tool in ("watch", "track"):
        import memsentry

        # memsentry's names import lazily: importing is the program's start, not the block.
        getattr(memsentry, tool)
    gc.collect()
    out: dict[str, Any] = {}
    callgrind = Callgrind(library)
    callgrind.start()
    with contextlib.ExitStack() as stack:
        step = stack.enter_context(TOOLS[tool](loop, out))
        callgrind.dump("start")
        for index in range(iterations):
            step()
            if index == FIRST - 1:
                callgrind.dump("first5")
        callgrind.dump("rest")
    callgrind.dump("stop")
    callgrind.stop()
    facts: dict[str, Any] = {}
    tracker = out.get("tracker")
    if tracker is not None:
        facts = _ledger(tracker.report())
    print("INSTRUCTIONS-FACTS " + json.dumps(facts), flush=True)


def _ledger(report: Any) -> dict[str, Any]:
    cost = report.cost
    return {"share": cost.share, "iterations": cost.iterations,
            "sampled": cost.sampled, "censuses": cost.part("censuses").events,
            "deferred": cost.censuses_deferred, "loop_s": cost.loop_seconds,
            "own_s": cost.own_seconds,
            "parts_s": {p.part: p.seconds for p in cost.parts},
            "leaks": sum(f.severity.name == "LEAK" for f in report.findings)}


# -- the parent: the matrix of runs --------------------------------------------------------
def build_helper(where: Path) -> Path:
    source = where / "callgrind_requests.c"
    library = where / "libcallgrind_requests.so"
    source.write_text(HELPER_SOURCE)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True)
    return library


def counts(directory: Path) -> dict[str, int]:
    """The instructions of each phase, from callgrind's dump files."""
    found: dict[str, int] = {}
    for path in sorted(directory.glob("cg.out.*")):
        text = path.read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: Client Request: (\S+)", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if trigger and total:
            found[trigger.group(1)] = int(total.group(1))
    return found


def _facts(stdout: str) -> dict[str, Any]:
    for line in stdout.splitlines():
        if line.startswith("INSTRUCTIONS-FACTS "):
            return dict(json.loads(line.split(" ", 1)[1]))
    return {}


def run_one(loop: str, tool: str, iterations: int, library: Path) -> dict[str, Any]:
    """One block under callgrind (its phases' instructions and the ledger it kept there), then
    the same block run natively for the ledger a user's run keeps: under callgrind a second
    lasts some 50 times longer for the CPU's work and not for the system's, so the clocked
    shares are not the machine's."""
    child = [sys.executable, str(Path(__file__).resolve()), "--child", loop, tool,
             str(iterations), str(library)]
    env = {**os.environ, **ENV}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={directory / 'cg.out'}", *child]
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        phases = counts(directory)
    if done.returncode or set(phases) != set(PHASES):
        raise RuntimeError(f"{loop}/{tool}/{iterations} failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    native = subprocess.run(child, capture_output=True, text=True, env=env, check=False)
    return {"loop": loop, "tool": tool, "iterations": iterations, "phases": phases,
            "ledger": _facts(done.stdout), "ledger_native": _facts(native.stdout)}


def ratios(run: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    mine, plain = run["phases"], base["phases"]
    loop_plain = plain["first5"] + plain["rest"]
    whole = sum(mine[p] for p in PHASES)
    loop_mine = mine["first5"] + mine["rest"]
    return {"whole": whole / (sum(plain[p] for p in PHASES) or 1),
            "iterations": loop_mine / loop_plain,
            "first5": mine["first5"] / plain["first5"],
            "rest": mine["rest"] / plain["rest"] if plain["rest"] else float("nan"),
            "start_per_loop": mine["start"] / loop_plain,
            "stop_per_loop": mine["stop"] / loop_plain}


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| loop | iterations | tool | whole | its iterations | first 5 | after the 5th "
             "| start | stop | ledger's share (native) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    bases = {(r["loop"], r["iterations"]): r for r in runs if r["tool"] == "untracked"}
    for run in runs:
        base = bases.get((run["loop"], run["iterations"]))
        if base is None or run is base:
            continue
        r = ratios(run, base)
        lines.append(
            f"| {run['loop']} | {run['iterations']:,} | {run['tool']} | {r['whole']:.3f}x "
            f"| {r['iterations']:.3f}x | {r['first5']:.2f}x | {r['rest']:.3f}x "
            f"| {r['start_per_loop']:.1%} | {r['stop_per_loop']:.1%} | {_ledger_cell(run)} |")
    return "\n".join(lines)


def _ledger_cell(run: dict[str, Any]) -> str:
    """The ledger's share under callgrind, and natively where the run has it."""
    shares = [run.get(key, {}).get("share") for key in ("ledger", "ledger_native")]
    cells = [f"{share:.1%}" for share in shares if isinstance(share, float)]
    if len(cells) == 2:
        return f"{cells[0]} ({cells[1]})"
    return cells[0] if cells else ""


def _git_head() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=HERE, check=False)
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--child":
        child(args[1], args[2], int(args[3]), args[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", default="tiny,inference")
    parser.add_argument("--tools", default="untracked,watch,track")
    parser.add_argument("--iterations", default="2000",
                        help="comma-separated lengths, each run for every loop and tool")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(args)
    loops = options.loops.split(",")
    tools = options.tools.split(",")
    lengths = [int(n) for n in options.iterations.split(",")]
    unknown = [n for n in loops if n not in LOOPS] + [t for t in tools if t not in TOOLS]
    if unknown:
        parser.error(f"unknown loop or tool {unknown}: loops {sorted(LOOPS)}, "
                     f"tools {sorted(TOOLS)}")
    if "untracked" not in tools:
        tools.insert(0, "untracked")
    with tempfile.TemporaryDirectory() as tmp:
        library = build_helper(Path(tmp))
        plan = [(loop, tool, n) for loop in loops for n in lengths for tool in tools]
        with ThreadPoolExecutor(options.jobs) as pool:
            runs = list(pool.map(lambda p: run_one(p[0], p[1], p[2], library), plan))
    print(table(runs))
    if options.json:
        result = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
                  "machine": platform.platform(), "python": platform.python_version(),
                  "commit": _git_head(), "runs": runs}
        options.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
