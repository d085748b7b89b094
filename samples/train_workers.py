"""DataLoader workers that copy the dataset. Try: memsentry run samples/train_workers.py

The dataset keeps its samples as a list of dicts. A forked worker shares its parent's pages
until it writes to them, and reading a Python object writes its reference count: each of the
two workers copies, page by page, every record it reads. Their memory climbs through the first
epoch towards the size of the records, in every worker. ``--arrays`` keeps the same samples
as two NumPy arrays, which reading does not write to: the workers copy nothing.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class RecordSet(Dataset[tuple[torch.Tensor, int]]):
    """Samples as Python objects: one dict per sample, its features a list of floats."""

    def __init__(self, size: int, features: int) -> None:
        rng = np.random.default_rng(0)
        values = rng.standard_normal((size, features)).tolist()
        self.records = [{"features": row, "label": int(row[0] > 0)} for row in values]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        record = self.records[index]
        return torch.tensor(record["features"]), record["label"]


class ArraySet(Dataset[tuple[torch.Tensor, int]]):
    """The same samples as two NumPy arrays: a worker reads them without writing a page."""

    def __init__(self, size: int, features: int) -> None:
        rng = np.random.default_rng(0)
        self.features = rng.standard_normal((size, features)).astype(np.float32)
        self.labels = (self.features[:, 0] > 0).astype(np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(self.features[index]), int(self.labels[index])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300_000,
                        help="samples in the dataset (default 300,000)")
    parser.add_argument("--features", type=int, default=8, help="features per sample")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    parser.add_argument("--arrays", action="store_true",
                        help="keep the samples as NumPy arrays (the fix)")
    args = parser.parse_args()

    torch.manual_seed(0)
    train_set = (ArraySet if args.arrays else RecordSet)(args.records, args.features)
    loader = DataLoader(train_set, batch_size=512, shuffle=True, num_workers=args.workers)
    model = nn.Sequential(nn.Linear(args.features, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(args.epochs):
        total, batches = 0.0, 0
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        print(f"epoch {epoch}: mean loss {total / batches:.4f} over {batches} batches")


if __name__ == "__main__":
    main()
