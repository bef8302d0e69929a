"""Models, data and training loops shared by the DistributedDataParallel tests (no tests here).

*Global batch* of a step: ``world_size * PER_RANK`` rows; rank r trains on rows
``[r * PER_RANK, (r + 1) * PER_RANK)``. The *reference* trains one model on the whole global
batch in one process; in exact arithmetic the two give the same parameters after every step
(the mean of per-rank means of equal-sized slices is the mean of the whole batch).
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

PER_RANK = 4
STEPS = 20
LR = 0.05
MOMENTUM = 0.9


class MLP(nn.Module):
    """Six linear layers of different sizes (gradients of very different sizes)."""

    def __init__(self):
        super().__init__()
        widths = [12, 32, 24, 48, 16, 40, 5]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 12, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(12, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 2 * 2, 5),
        )

    def forward(self, x):
        return self.body(x)


class WithUnused(nn.Module):
    """``unused`` never takes part in forward."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(12, 5)
        self.unused = nn.Linear(12, 5)

    def forward(self, x):
        return self.used(x)


MODELS = {"mlp": MLP, "conv": ConvNet, "unused": WithUnused}
INPUT_SHAPES = {"mlp": (12,), "conv": (3, 8, 8), "unused": (12,)}


_SEEDING = threading.Lock()


def make_model(name: str, seed: int = 0) -> nn.Module:
    """The model, seeded and drawn under a lock: the ranks of the thread tests share torch's
    global generator, and one rank seeding in the middle of another's draw gives that rank other
    initial values (a test comparing two of its models then fails now and then)."""
    with _SEEDING:
        torch.manual_seed(seed)
        return MODELS[name]()


def global_batch(name: str, step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn((world_size * PER_RANK, *INPUT_SHAPES[name]), generator=g)
    y = torch.randn((world_size * PER_RANK, 5), generator=g)
    return x, y


def rank_batch(name: str, step: int, world_size: int, rank: int):
    x, y = global_batch(name, step, world_size)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return x[rows], y[rows]


def train(model: nn.Module, batches, steps: int = STEPS) -> list[torch.Tensor]:
    """SGD with momentum on ``batches(step) -> (x, y)``; returns the final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        x, y = batches(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def reference(name: str, world_size: int, steps: int = STEPS) -> list[torch.Tensor]:
    """Single-process training on the concatenated (global) batch."""
    return train(make_model(name), lambda s: global_batch(name, s, world_size), steps)


def perturbed(model: nn.Module, rank: int) -> nn.Module:
    """A copy whose parameters differ on ranks other than 0 (the broadcast must undo it)."""
    model = copy.deepcopy(model)
    if rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * rank)
    return model
