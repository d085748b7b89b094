"""Detection benchmark: every scenario of the heuristics suite, and what memsentry concluded.

Runs each scenario of ``tests/scenarios.py`` (the field guide's patterns as real training
loops on CPU) and prints a matrix: the pattern, the rule expected, the rules reported, whether
the finding names the holder, and after how many iterations the expected LEAK first appears
(the scenario is re-run with 1, 2, 3, ... iterations until it does). Then the totals: leaks
found, leaks missed, false LEAK findings on the not-a-leak scenarios.

With ``--watch`` every scenario runs under ``memsentry.watch()`` instead (``memsentry.track``
is replaced by it for the run: the always-on mode, 1% budget, censuses on the doubling
schedule as its budget allows and when memory left at boundaries climbs), to check that it
finds what ``track()`` finds, and after how many iterations.

    python benchmarks/detection.py [--watch] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from scenarios import Scenario
from scenarios_verdicts import ALL_SCENARIOS as SCENARIOS

import memsentry

LEAK = memsentry.Severity.LEAK


def _matches(finding: memsentry.Finding, scenario: Scenario) -> bool:
    return (
        finding.rule == scenario.rule
        and finding.severity is scenario.severity
        and (scenario.holder is None or scenario.holder in finding.message)
    )


def _first_detection(scenario: Scenario) -> int | None:
    """The fewest iterations after which the expected LEAK is reported (None: never, up to
    the scenario's own length)."""
    for steps in range(1, scenario.steps + 1):
        report = scenario.run(steps)
        if any(_matches(f, scenario) for f in report.findings):
            return steps
    return None


def evaluate(scenario: Scenario) -> dict[str, object]:
    started = time.perf_counter()
    report = scenario.run(scenario.steps)
    findings = report.findings
    expected = [f for f in findings if _matches(f, scenario)]
    rule_hit = any(
        f.rule == scenario.rule and f.severity is scenario.severity for f in findings
    )
    leaks = [f for f in findings if f.severity is LEAK]
    row: dict[str, object] = {
        "scenario": scenario.name,
        "guide": scenario.guide,
        "kind": scenario.kind,
        "expected": f"{scenario.rule} ({scenario.severity})" if scenario.rule else "no LEAK",
        "reported": ", ".join(f"{f.rule} ({f.severity})" for f in findings) or "-",
        "found": bool(expected) if scenario.rule else not leaks,
        "rule_only": rule_hit,
        "holder_named": bool(expected) if scenario.holder else None,
        "false_leaks": 0 if scenario.rule else len(leaks),
        "stray_leaks": sum(1 for f in leaks if f.rule != scenario.rule) if scenario.rule else 0,
        "first_leak_at": None,
        "seconds": 0.0,
    }
    if scenario.severity is LEAK and expected:
        row["first_leak_at"] = _first_detection(scenario)
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows and totals to this file")
    parser.add_argument("--watch", action="store_true",
                        help="run every scenario under memsentry.watch() instead of track()")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.watch:
        memsentry.track = memsentry.watch  # type: ignore[assignment]  # the scenarios call it
    rows = [evaluate(s) for s in SCENARIOS]

    def yes(value: object) -> str:
        return "-" if value is None else ("yes" if value else "NO")

    table = [
        [r["guide"], r["scenario"], r["expected"], r["reported"], yes(r["found"]),
         yes(r["holder_named"]), r["first_leak_at"] or "-"]
        for r in rows
    ]
    leak_rows = [r for r in rows if r["kind"] == "leak"]
    other_rows = [r for r in rows if r["kind"] in ("waste", "hint")]
    normal_rows = [r for r in rows if r["kind"] == "not a leak"]
    totals = {
        "leaks_found": sum(bool(r["found"]) for r in leak_rows),
        "leaks_missed": sum(not r["found"] for r in leak_rows),
        "waste_and_hints_found": sum(bool(r["found"]) for r in other_rows),
        "waste_and_hints_missed": sum(not r["found"] for r in other_rows),
        "holders_named": sum(bool(r["holder_named"]) for r in rows if r["holder_named"]
                             is not None),
        "holders_expected": sum(r["holder_named"] is not None for r in rows),
        "false_leaks_on_normal_loops": sum(int(r["false_leaks"]) for r in normal_rows),
        "stray_leaks_in_other_scenarios": sum(int(r["stray_leaks"]) for r in rows),
        "latest_first_leak": max((int(r["first_leak_at"]) for r in leak_rows
                                  if r["first_leak_at"]), default=None),
    }
    mode = "watch()" if args.watch else "track()"
    print(f"memsentry detection benchmark ({mode}), {date.today().isoformat()}: memsentry "
          f"{memsentry.__version__}, torch {torch.__version__}, Python "
          f"{platform.python_version()}, {platform.machine()}, CPU")
    print(tabulate(table, headers=["#", "scenario", "expected", "reported", "found",
                                   "holder", "LEAK after N iters"], tablefmt="github"))
    print()
    print(f"leaks found {totals['leaks_found']} of {len(leak_rows)}, missed "
          f"{totals['leaks_missed']}; waste and hints found {totals['waste_and_hints_found']} "
          f"of {len(other_rows)}; holders named {totals['holders_named']} of "
          f"{totals['holders_expected']}; false LEAK findings on {len(normal_rows)} normal "
          f"loops: {totals['false_leaks_on_normal_loops']}; stray LEAK findings elsewhere: "
          f"{totals['stray_leaks_in_other_scenarios']}; most iterations before the first LEAK: "
          f"{totals['latest_first_leak']}")
    if args.json:
        saved = {"mode": mode, "rows": rows, "totals": totals}
        Path(args.json).write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")
    missed = totals["leaks_missed"] or totals["false_leaks_on_normal_loops"]
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
