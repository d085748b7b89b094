"""What reading and judging an allocator snapshot costs (issue 43): time and peak memory
against the file's size, beside torch's own Python reader of the same file.

Snapshots are synthetic, in the format ``torch.cuda.memory._dump_snapshot()`` writes (the
tests' ``snapshot_factory`` layout), as large as ``--sizes`` asks: iterations of 20 tensors
made and 19 freed, stacks of 24 frames drawn from 400 distinct ones, each entry its own list of
frame dicts that are shared between entries as torch's pickler shares them. Each reader runs
in its own process, three times, interleaved; the medians are printed:

* ``pickle``: ``pickle.load`` alone (the floor every reader pays);
* ``torch``: ``pickle.load`` then ``torch.cuda._memory_viz.segsum`` and ``trace`` (its text
  reading of the segments and of every trace entry), output thrown away;
* ``memsentry``: ``read_snapshot`` (the restricted unpickler and the conversion to frozen
  values), ``judge``, ``findings`` and the text verdict.

    python benchmarks/snapshot_read.py --sizes 100MB,1GB \\
        --json benchmarks/snapshot-read-results.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TORCH = "/opt/conda/lib/python3.11/site-packages/torch"
ROUNDS = 3


def _frames(rng: random.Random) -> list[list[dict[str, Any]]]:
    """400 stacks of 24 frames, innermost first: torch's frames, then the user's."""
    torch_frames = [{"filename": f"{TORCH}/nn/modules/{name}.py", "line": line, "name": fn}
                    for name, line, fn in (("linear", 125, "forward"),
                                           ("module", 1762, "_call_impl"),
                                           ("module", 1751, "_wrapped_call_impl"),
                                           ("activation", 133, "forward"))]
    user = [{"filename": f"/home/me/project/model_{i % 40}.py", "line": 10 + i, "name": f"f{i}"}
            for i in range(400)]
    stacks = []
    for i in range(400):
        inner = rng.sample(torch_frames, 2)
        stacks.append(inner + rng.sample(user, 21) + [{"filename": "/home/me/train.py",
                                                      "line": 40 + i % 9, "name": "train"}])
    return stacks


def build(entries: int, path: Path, seed: int = 0) -> int:
    """Write a snapshot of about ``entries`` trace entries to ``path``; its size in bytes."""
    rng = random.Random(seed)
    stacks = _frames(rng)
    trace: list[dict[str, Any]] = []
    live: dict[int, tuple[int, list[dict[str, Any]]]] = {}
    address, now = 0x7F00_0000_0000, 1_700_000_000_000_000
    kept_stack = stacks[0]
    while len(trace) < entries:
        made = []
        for _ in range(20):  # an iteration: 20 tensors made, 19 freed, one kept
            stack = rng.choice(stacks)
            size = rng.choice((512, 4096, 65536, 1 << 20))
            now += 3
            trace.append({"action": "alloc", "addr": address, "size": size, "stream": 0,
                          "frames": list(stack), "time_us": now, "compile_context": "",
                          "user_metadata": ""})
            made.append((address, size, stack))
            address += size
        for addr, size, stack in made[1:]:
            for action in ("free_requested", "free_completed"):
                now += 3
                trace.append({"action": action, "addr": addr, "size": size, "stream": 0,
                              "frames": list(stack), "time_us": now, "compile_context": "",
                              "user_metadata": ""})
        addr, size, _stack = made[0]
        live[addr] = (size, kept_stack)
    blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated",
               "frames": f} for a, (s, f) in live.items()]
    used = sum(s for s, _f in live.values())
    data = {"segments": [{"device": 0, "address": min(live), "total_size": used,
                          "allocated_size": used, "active_size": used, "requested_size": used,
                          "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                          "is_expandable": False, "frames": [], "blocks": blocks}],
            "device_traces": [trace],
            "allocator_settings": {"expandable_segments": False, "max_split_size": -1}}
    with open(path, "wb") as file:
        pickle.dump(data, file)
    return path.stat().st_size


# -- the readers, each run in a child process ---------------------------------------------
def _read_pickle(path: str) -> None:
    with open(path, "rb") as file:
        pickle.load(file)


def _read_torch(path: str) -> None:
    from torch.cuda import _memory_viz

    with open(path, "rb") as file:
        data = pickle.load(file)
    _memory_viz.segsum(data)
    _memory_viz.trace(data)


def _read_memsentry(path: str) -> None:
    from memsentry.reporters.snapshot import render_snapshot
    from memsentry.snapshots import read_snapshot
    from memsentry.snapshots.findings import findings
    from memsentry.snapshots.judge import judge

    snapshot = read_snapshot(path, limit=1 << 40)
    verdict = judge(snapshot)
    render_snapshot(verdict, findings(verdict))


READERS = {"pickle": _read_pickle, "torch": _read_torch, "memsentry": _read_memsentry}


def child(reader: str, path: str) -> None:
    started = time.perf_counter()
    READERS[reader](path)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": peak}))


def run_child(reader: str, path: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--child", reader, str(path)],
                          capture_output=True, text=True, check=True, cwd=ROOT,
                          timeout=3600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--child":
        child(args[1], args[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100MB",
                        help="target file sizes, comma-separated (100MB, 1GB)")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(args)
    per_entry = 150  # bytes of file per trace entry in this layout (measured on 100k)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for target in options.sizes.split(","):
            wanted = int(float(target[:-2]) * {"MB": 1e6, "GB": 1e9}[target[-2:].upper()])
            path = Path(tmp) / f"snap-{target}.pickle"
            size = build(max(1000, wanted // per_entry), path)
            results: dict[str, list[dict[str, float]]] = {name: [] for name in READERS}
            for _ in range(ROUNDS):
                for name in READERS:
                    results[name].append(run_child(name, path))
            row = {"target": target, "file_bytes": size}
            for name, runs in results.items():
                row[name] = {"seconds": statistics.median(r["seconds"] for r in runs),
                             "peak_rss": statistics.median(r["peak_rss"] for r in runs),
                             "runs": runs}
            rows.append(row)
            print(f"{target}: {size / 1e6:,.0f} MB  " + "  ".join(
                f"{name} {row[name]['seconds']:.1f} s {row[name]['peak_rss'] / 2**30:.2f} GiB"
                for name in READERS), flush=True)
    if options.json:
        options.json.write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
            "machine": platform.platform(), "python": platform.python_version(),
            "rounds": ROUNDS, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
