"""An MLP with few, large layers: the communication-heavy reference workload.

``in_features -> hidden[0] -> ... -> hidden[-1] -> num_classes`` with ReLU between the
linear layers. With the defaults (1024 -> 4096 -> 4096 -> 10) it has 21 M parameters in
3 layers: little compute per byte of gradient, so communication dominates the step and
there is little backward time to hide it behind.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ReferenceModel, check_positive, generator


class MLP(ReferenceModel):
    """Classifier of ``(batch, in_features)`` float vectors."""

    family = "mlp"

    def __init__(self, in_features: int = 1024, hidden: tuple[int, ...] = (4096, 4096), num_classes: int = 10):
        super().__init__()
        hidden = tuple(hidden)
        check_positive("in_features", in_features)
        check_positive("num_classes", num_classes)
        for h in hidden:
            check_positive("hidden[i]", h)
        self.in_features = in_features
        self.num_classes = num_classes
        sizes = (in_features, *hidden, num_classes)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            hint = "; for one vector pass x.unsqueeze(0)" if x.shape == (self.in_features,) else ""
            raise ValueError(f"expected a (batch, {self.in_features}) float tensor, got shape {tuple(x.shape)}{hint}")
        return self.net(x)

    def make_batch(self, batch_size: int, seed: int = 0):
        check_positive("batch_size", batch_size)
        g = generator(seed)
        x = torch.randn(batch_size, self.in_features, generator=g)
        y = torch.randint(0, self.num_classes, (batch_size,), generator=g)
        return x, y

    def dataset_kwargs(self):
        return {"in_features": self.in_features, "num_classes": self.num_classes}
