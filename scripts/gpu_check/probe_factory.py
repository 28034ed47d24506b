"""The factory the ``memprobe`` section hands to ``bso probe`` and to ``Discovery``.

``gpu_check.probe_factory:setup`` is what a user writes for ``bso probe
MODULE:FACTORY``: an MLP classifier with Adam, built on the CPU (the probe moves
the model to its device), and a batch maker that draws its batch on whatever
device the model is on by then, so that a large batch is never built in host
memory and copied over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

WIDTH = 1024
DEPTH = 24
CLASSES = 10


def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[int], Any], Any]:
    """``(model, optimizer, make_batch, loss_fn)``, as ``bso probe`` takes them."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(WIDTH, CLASSES))
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(model.parameters()).device
        return (
            torch.randn(n, WIDTH, device=device),
            torch.randint(0, CLASSES, (n,), device=device),
        )

    return model, optimizer, make_batch, torch.nn.functional.cross_entropy
