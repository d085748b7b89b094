"""What one census (the holder search) costs on a loop with a large reachable state.

A 4-layer Transformer encoder trained with AdamW for 11 steps per block (censuses at
iterations 2, 3, 4, 6 and 10), next to 3,000 nested dicts and 3,000 small objects held in
globals, so that each census walks some 21,000 objects. Prints the median census time over
the blocks. ``--tree DIR`` imports memsentry from another checkout (to compare two commits).

    python benchmarks/census_cost.py [--blocks 3] [--tree DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys


class Config:
    """A small user object, as configs and records are."""

    def __init__(self, i: int) -> None:
        self.x = i
        self.y = [i] * 3
        self.z = {"q": i}


STATE = {f"k{i}": {"a": [i, i + 1, {"b": (i,)}], "c": str(i)} for i in range(3000)}
OBJECTS = [Config(i) for i in range(3000)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--tree", help="import memsentry from this checkout")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    import torch
    from torch import nn

    import memsentry

    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    model = nn.TransformerEncoder(layer, 4)
    opt = torch.optim.AdamW(model.parameters())
    seconds: list[float] = []
    for _ in range(args.blocks):
        with memsentry.track(model, on_leak="ignore") as t:
            for _ in range(11):
                model(torch.randn(4, 16, 64)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        report = t.report()
        seconds += [c.seconds for c in report.censuses]
        objects = report.censuses[-1].objects
    print(f"memsentry from {memsentry.__file__}: {len(seconds)} censuses of about "
          f"{objects:,} objects, median {statistics.median(seconds) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
