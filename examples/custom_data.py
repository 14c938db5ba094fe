"""Federate your own torch Dataset and model through the Python API.

    python examples/custom_data.py

Any map-style ``torch.utils.data.Dataset`` of ``(x, y)`` pairs works: flasync materialises it once into contiguous
tensors, partitions it over clients as the config says, and trains the model the factory builds.
"""

from __future__ import annotations

import torch
from torch import nn

import flasync


class TwoMoons(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Two interleaved half circles with noise: a small non-linear problem."""

    def __init__(self, n: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        angle = torch.rand(n, generator=generator) * torch.pi
        self.y = torch.randint(0, 2, (n,), generator=generator)
        x = torch.stack([torch.cos(angle), torch.sin(angle)], dim=1)
        x[self.y == 1] = torch.stack([1 - torch.cos(angle), 0.5 - torch.sin(angle)], dim=1)[self.y == 1]
        self.x = x + 0.1 * torch.randn(n, 2, generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.x[index], int(self.y[index])


def make_model() -> nn.Module:
    """Build the network every client trains."""
    return nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


if __name__ == "__main__":
    config = flasync.load_config(
        None,
        [
            "population.num_clients=50",
            "partition.alpha=0.3",
            "stop.max_versions=80",
            "tracking.experiment=custom-data",
        ],
    )
    summary = flasync.run(config, dataset=TwoMoons(4000), test_dataset=TwoMoons(1000, seed=1), model_factory=make_model)
    print(f"accuracy {summary.accuracy:.3f}, run {summary.run_id}")
