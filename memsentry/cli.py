"""The ``memsentry`` command: ``run`` a script under tracking, ``info`` about this machine."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Sequence

from memsentry import __version__
from memsentry.errors import MemsentryError
from memsentry.units import format_bytes


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected a number of at least {minimum}, got {value}"
            )
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memsentry",
        description="Find PyTorch memory leaks and say what holds the memory.",
    )
    parser.add_argument("--version", action="version", version=f"memsentry {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser(
        "run",
        help="run a Python script under memsentry.track() and print the memory report",
        description="Run an unmodified script as __main__ (with its own arguments) while every "
        "module call and optimizer step is tracked, then print the report. The exit code is "
        "the script's. memsentry's options go before the script's name.",
    )
    run.add_argument("--json", metavar="FILE", help="also save the report as JSON to FILE")
    run.add_argument("-o", "--output", metavar="FILE",
                     help="write the text report to FILE instead of standard output")
    run.add_argument("--device", help="device to measure (default: the first module's device)")
    run.add_argument("--exact", action="store_true",
                     help="exact peaks (CPU: count every storage, ~1.15x slower; CUDA: resets "
                          "the allocator's peak counter)")
    run.add_argument("--top", type=_at_least(1), default=30,
                     help="layers shown in the table, largest footprint first (default 30)")
    run.add_argument("--depth", type=_at_least(0), default=None,
                     help="hide layers nested deeper than this (the root is depth 0)")
    run.add_argument("--width", type=_at_least(1), default=100,
                     help="terminal width the table is fitted to (default 100)")
    run.add_argument("-m", dest="module", action="store_true",
                     help="run SCRIPT as a module name, like python -m")
    run.add_argument("script", help="the script to run (or the module name, with -m)")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    info = sub.add_parser("info", help="show torch, devices, allocator and NVML figures")
    info.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def command_run(args: argparse.Namespace) -> int:
    from memsentry.tracker import track

    if not args.module and not os.path.isfile(args.script):
        print(f"memsentry run: no such script: {args.script!r}", file=sys.stderr)
        return 2
    try:
        tracker = track(device=args.device, exact=args.exact, on_leak="ignore")
    except (MemsentryError, TypeError, ValueError) as exc:
        print(f"memsentry run: {exc}", file=sys.stderr)
        return 2
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [args.script, *args.args]
    if not args.module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    code = 0
    try:
        with tracker:
            try:
                if args.module:
                    runpy.run_module(args.script, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(args.script, run_name="__main__")
            except SystemExit as exc:
                code = _exit_code(exc)
            except KeyboardInterrupt:
                traceback.print_exc()
                code = 130
            except Exception:  # the script's own failure: show it, still report
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    report = tracker.report()
    text = report.format(max_depth=args.depth, top=args.top, width=args.width)
    sys.stdout.flush()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    else:
        print(f"\n{'=' * 30} memsentry report {'=' * 30}\n{text}")
    if args.json:
        report.to_json(args.json)
    return code


def _info_lines() -> list[str]:
    from memsentry.machine import collect

    info = collect()
    lines = [
        f"memsentry {info.memsentry_version}, torch {info.torch_version}, "
        f"Python {info.python_version}, {info.platform}",
        f"CPU: backend {info.cpu_backend}; allocated {format_bytes(info.cpu_allocated)}, "
        f"heap reserved {format_bytes(info.cpu_reserved)}, RAM {format_bytes(info.ram_total)}",
    ]
    if not info.cuda_available:
        lines.append(f"CUDA: unavailable: {info.cuda_reason}")
        if info.nvml is not None and not info.nvml.available:
            lines.append(f"NVML: unavailable: {info.nvml.reason}")
    for dev in info.cuda_devices:
        lines.append(
            f"cuda:{dev.index} {dev.name}: total {format_bytes(dev.total)}; allocator: "
            f"allocated {format_bytes(dev.allocated)}, reserved {format_bytes(dev.reserved)}, "
            f"peak {format_bytes(dev.peak)}"
        )
        nv = dev.nvml
        if nv.available:
            lines.append(
                f"  NVML: used {format_bytes(nv.used)} of {format_bytes(nv.total)}, this "
                f"process {format_bytes(nv.process_used)}, GPU utilisation "
                f"{'-' if nv.gpu_utilization is None else str(nv.gpu_utilization) + '%'}"
            )
        else:
            lines.append(f"  NVML: unavailable: {nv.reason}")
    return lines


def command_info(args: argparse.Namespace) -> int:
    if args.json:
        from memsentry.machine import collect

        print(json.dumps(collect().to_dict(), indent=2))
    else:
        print("\n".join(_info_lines()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memsentry`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return command_run(args)
    return command_info(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
