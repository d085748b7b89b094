"""What ``pytest --memsentry`` costs on public test suites, and whether it changes any outcome.

Three suites installed from the package registry (skorch's, ten of gpytorch's example
tests, einops's own on the torch backend, torch.compile included), each run plain, with
``--memsentry`` (the default heap check) and with ``--memsentry
--memsentry-check=storages`` (every storage counted), in an order shuffled every round. Per
mode: the median wall time over rounds and its ratio to the plain run's; per test, the
outcome from ``--junitxml``. A changed outcome is a test whose own result (passed, failed,
error, skipped) differs from the plain run's;
memsentry's own verdicts (``LEAKED``, failures whose message starts with ``memsentry:``) are
counted apart.

No public code is kept here. Set up the corpus virtualenv as in public_corpus.py, then:

    /tmp/corpus/venv/bin/pip download --no-deps --no-binary :all: -d /tmp/corpus/sdist \\
        gpytorch==$(/tmp/corpus/venv/bin/python -c "import gpytorch; print(gpytorch.__version__)")
    tar xzf /tmp/corpus/sdist/gpytorch-*.tar.gz -C /tmp/corpus/sdist
    mkdir -p /tmp/corpus/skorch && /tmp/corpus/venv/bin/pip install einops
    cp -r /tmp/corpus/venv/lib/python3.11/site-packages/skorch/tests /tmp/corpus/skorch/
    /tmp/corpus/venv/bin/python benchmarks/pytest_public.py --python /tmp/corpus/venv/bin/python \\
        --gpytorch /tmp/corpus/sdist/gpytorch-1.15.2 --skorch /tmp/corpus/skorch \\
        --einops --rounds 3 --json benchmarks/pytest-public-results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

GP_FILES = tuple(f"test/examples/test_{name}.py" for name in (
    "simple_gp_regression", "sgpr_regression", "simple_gp_classification",
    "kissgp_gp_regression", "batch_gp_regression", "fixed_noise_fanatasy_updates",
    "white_noise_regression", "grid_gp_regression", "lowrank_gp_regression",
    "svgp_gp_regression"))
SKORCH_FILES = ("tests/test_classifier.py", "tests/test_regressor.py")
#: einops ships its tests inside the package; on the torch backend they include
#: torch.compile (inductor) tests.
EINOPS_ARGS = ("--pyargs", "einops.tests")
EINOPS_ENV = {"EINOPS_TEST_BACKENDS": "torch"}
MODES = {"plain": [], "heap": ["--memsentry"],
         "storages": ["--memsentry", "--memsentry-check=storages"]}


def outcomes(junit: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped / memsentry (a memsentry verdict)."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        result = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                message = child.get("message") or ""
                result = "memsentry" if message.startswith("memsentry:") else child.tag
            elif child.tag == "skipped":
                result = "skipped"
        found[name] = result
    return found


def run(python: str, cwd: Path, files: tuple[str, ...], mode: str,
        extra_env: dict[str, str] | None = None) -> tuple[float, dict[str, str]]:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={junit}", *MODES[mode], *files]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **(extra_env or {}))
        started = time.perf_counter()
        subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=1800, check=False)
        seconds = time.perf_counter() - started
        return seconds, outcomes(junit)


def suite(name: str, python: str, cwd: Path, files: tuple[str, ...], rounds: int,
          rng: random.Random, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    seen: dict[str, dict[str, str]] = {}
    # One untimed plain run first: it fills caches every mode then shares (inductor's
    # compiled kernels, imported bytecode).
    run(python, cwd, files, "plain", extra_env)
    for index in range(rounds):
        order = list(MODES)
        rng.shuffle(order)
        for mode in order:
            seconds, found = run(python, cwd, files, mode, extra_env)
            times[mode].append(seconds)
            seen[mode] = found
            print(f"  {name} round {index + 1} {mode}: {seconds:.1f} s", file=sys.stderr)
    plain = statistics.median(times["plain"])
    result: dict[str, Any] = {"files": list(files), "tests": len(seen["plain"]), "modes": {}}
    for mode in MODES:
        found = seen[mode]
        changed = sorted(t for t, o in found.items()
                         if o != "memsentry" and o != seen["plain"].get(t))
        result["modes"][mode] = {
            "seconds": times[mode], "median_s": statistics.median(times[mode]),
            "vs_plain": statistics.median(times[mode]) / plain,
            "memsentry_verdicts": sorted(t for t, o in found.items() if o == "memsentry"),
            "changed_outcomes": changed,
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the corpus virtualenv's python")
    parser.add_argument("--gpytorch", type=Path, help="unpacked gpytorch sdist")
    parser.add_argument("--skorch", type=Path, help="folder with skorch's tests/")
    parser.add_argument("--einops", action="store_true",
                        help="also einops's own tests (pip install einops into the virtualenv)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.gpytorch is None and args.skorch is None and not args.einops:
        parser.error("name at least one suite: --gpytorch, --skorch or --einops")
    for label, folder, files in (("--gpytorch", args.gpytorch, GP_FILES),
                                 ("--skorch", args.skorch, SKORCH_FILES)):
        if folder is None:
            continue
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            parser.error(f"{label} {folder}: {missing[0]} is missing (see the set-up above)")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: folder {args.json.parent} does not exist")
    rng = random.Random(0)
    started = time.perf_counter()
    suites: dict[str, Any] = {}
    if args.skorch is not None:
        suites["skorch"] = suite("skorch", args.python, args.skorch, SKORCH_FILES, args.rounds,
                                 rng)
    if args.gpytorch is not None:
        suites["gpytorch"] = suite("gpytorch", args.python, args.gpytorch, GP_FILES,
                                   args.rounds, rng)
    if args.einops:
        with tempfile.TemporaryDirectory() as empty:
            suites["einops"] = suite("einops", args.python, Path(empty), EINOPS_ARGS,
                                     args.rounds, rng, EINOPS_ENV)
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(), "rounds": args.rounds, "suites": suites,
    }
    results["seconds"] = time.perf_counter() - started
    for name, data in results["suites"].items():
        print(f"{name}: {data['tests']} tests")
        for mode, figures in data["modes"].items():
            print(f"  {mode:9} {figures['median_s']:7.1f} s  {figures['vs_plain']:.2f}x  "
                  f"changed outcomes: {len(figures['changed_outcomes'])}  memsentry "
                  f"verdicts: {len(figures['memsentry_verdicts'])}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
