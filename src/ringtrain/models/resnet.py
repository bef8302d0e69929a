"""A ResNet-style CNN with many layers for 32x32 images.

Shape: a 3x3 stem convolution, then one *stage* per entry of ``widths``; a stage is
``blocks_per_stage`` basic blocks (conv3x3-norm-ReLU-conv3x3-norm plus a shortcut, then
ReLU). Every stage after the first halves the spatial size and its first block has a 1x1
projection shortcut. Global average pooling and a linear classifier end the network.

With the defaults — widths (16, 32, 64, 128, 256), 3 blocks per stage, spatial sizes
32, 16, 8, 4, 2 — that is 31 3x3 convolutions, 4 projection convolutions, 35 norms and a
classifier: 71 layers, 107 parameter tensors, 4.4 M parameters. Many small layers whose
gradients arrive one after another during backward (the case where merging them pays),
with most of the bytes in the last, cheapest-to-compute stage, so the gradient volume is
large for the compute. Channels are kept small so a step fits on one CPU core.

Norms (``norm=``):

- ``"batch"`` (default): BatchNorm2d, as in ResNet. Its statistics are per batch, so a
  rank's forward on its b samples differs from one process's forward on all p·b samples;
  data-parallel training is then *not* equal to single-process training on the
  concatenated batch (torch's DDP has the same property).
- ``"group"``: GroupNorm (statistics per sample; 8 groups, or the most up to 8 that divide a
  stage's width): data-parallel training equals
  single-process training on the concatenated batch up to floating-point reordering. Use
  this in correctness tests.
- ``"none"``: no normalization (identity).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ReferenceModel, check_positive, generator

NORMS = ("batch", "group", "none")


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":  # up to 8 groups: the most of them, up to 8, that divide the channels
        return nn.GroupNorm(max(g for g in range(1, 9) if channels % g == 0), channels)
    return nn.Identity()


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = _norm(norm, c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(norm, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


class ResNet(ReferenceModel):
    """ResNet-style classifier of ``(batch, channels, 32, 32)`` float images."""

    family = "resnet"

    def __init__(
        self,
        widths: tuple[int, ...] = (16, 32, 64, 128, 256),
        blocks_per_stage: int = 3,
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        norm: str = "batch",
    ):
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        widths = tuple(widths)
        if not widths:
            raise ValueError("widths must name at least one stage, got ()")
        for w in widths:
            check_positive("widths[i]", w)
        for name, value in (("blocks_per_stage", blocks_per_stage), ("num_classes", num_classes),
                            ("in_channels", in_channels), ("image_size", image_size)):
            check_positive(name, value)
        self.in_channels = in_channels
        self.image_size = image_size
        self.num_classes = num_classes
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), _norm(norm, widths[0]))
        blocks: list[nn.Module] = []
        c_in = widths[0]
        for stage, c_out in enumerate(widths):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(_BasicBlock(c_in, c_out, stride, norm))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or images.shape[1] != self.in_channels:
            one = images.dim() == 3 and images.shape[0] == self.in_channels
            hint = "; for one image pass images.unsqueeze(0)" if one else ""
            raise ValueError(f"expected a (batch, {self.in_channels}, height, width) float tensor of images, "
                             f"got shape {tuple(images.shape)}{hint}")
        x = torch.relu(self.stem(images))
        x = self.blocks(x)
        return self.fc(x.mean(dim=(2, 3)))

    def make_batch(self, batch_size: int, seed: int = 0):
        check_positive("batch_size", batch_size)
        g = generator(seed)
        images = torch.randn(batch_size, self.in_channels, self.image_size, self.image_size, generator=g)
        labels = torch.randint(0, self.num_classes, (batch_size,), generator=g)
        return images, labels

    def dataset_kwargs(self):
        return {"channels": self.in_channels, "size": self.image_size, "num_classes": self.num_classes}
