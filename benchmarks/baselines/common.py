"""The workload every system in benchmarks/peers.py trains: the same MLP, batch and SGD step.

``mlp(dims)``: Linear layers with ReLU between them (the default 2048-4096-4096-10
has 25.2M parameters); ``batch(step, worker, ...)``: that worker's inputs
and labels for that step, the same in every system; ``dims_for(params)``:
hidden width for a model of about ``params`` parameters.
"""

from __future__ import annotations

import torch
from torch import nn

IN, OUT = 2048, 10


def mlp(dims: tuple[int, ...], seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


def numel(dims: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in zip(dims, dims[1:]))


def dims_for(params: float) -> tuple[int, ...]:
    """IN-h-h-OUT with h chosen so that the MLP has about ``params`` parameters."""
    # h^2 + (IN + OUT + 2) h + OUT - params = 0
    b = IN + OUT + 2
    h = int((-b + (b * b + 4 * (params - OUT)) ** 0.5) / 2)
    return (IN, max(8, h), max(8, h), OUT)


def batch(step: int, worker: int, size: int, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + worker)
    return torch.randn(size, dims[0], generator=g), torch.randint(0, dims[-1], (size,), generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)
