"""``memsentry info``: what this machine offers: torch, devices, allocator and NVML figures."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from memsentry.units import format_bytes

if TYPE_CHECKING:
    from memsentry.measure.machine import MachineInfo


def collect() -> MachineInfo:
    from memsentry.measure.machine import collect as survey  # imports torch

    return survey()


def prepare_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def _info_lines() -> list[str]:
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
                f"  NVML: {'MIG slice ' if nv.mig else ''}used {format_bytes(nv.used)} of "
                f"{format_bytes(nv.total)}, this "
                f"process {format_bytes(nv.process_used)}, GPU utilisation "
                f"{'-' if nv.gpu_utilization is None else str(nv.gpu_utilization) + '%'}"
            )
        else:
            lines.append(f"  NVML: unavailable: {nv.reason}")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(collect().to_dict(), indent=2))
    else:
        print("\n".join(_info_lines()))
    return 0
