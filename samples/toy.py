"""The model and data the sample scripts share: a small classifier on synthetic points."""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Classifier(nn.Module):
    """An MLP of three blocks; big enough that every step allocates a few MiB."""

    def __init__(self, features: int = 512, hidden: int = 1024, classes: int = 10) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--batch", type=int, default=128, help="batch size (default 128)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def batches(steps: int, batch: int, device: str, features: int = 512):
    """Yield ``steps`` batches of random points whose class is the arg-max of 10 features."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(batch, features, generator=generator)
        y = x[:, :10].argmax(dim=1)
        yield x.to(device), y.to(device)
