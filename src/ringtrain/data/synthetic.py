"""Synthetic, learnable data sets for the CNN and the MLP, generated on demand.

Sample ``i`` of stream ``k`` of a data set with seed ``s`` is drawn from a torch generator
seeded with ``mix(s, k, i)``: it is the same whichever rank asks for it, in whatever batch,
on any machine, and nothing is stored. Each data set also has a *teacher* drawn from ``s``
alone (class prototypes for images, a linear map for vectors) so the labels can be learned
and a falling loss means training works. *Streams* share the teacher and differ in their
samples: stream 0 is the training split, stream 1 the validation split.

- :class:`SyntheticImages`: label ``y`` uniform over the classes; image = prototype[y]
  (a smooth random pattern, 8x8 upsampled) + ``noise`` · standard normal.
- :class:`SyntheticVectors`: x standard normal; label = argmax of teacher · x.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .sampler import mix


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _gen(*values: int) -> torch.Generator:
    return torch.Generator().manual_seed(mix(*values))


def _check_indices(indices, n: int) -> list[int]:
    idx = [int(i) for i in np.asarray(indices, dtype=np.int64).reshape(-1)]
    if any(i < 0 or i >= n for i in idx):
        raise IndexError(f"sample index out of range [0, {n})")
    return idx


class SyntheticImages:
    """``num_samples`` images of shape ``(channels, size, size)`` in ``num_classes`` classes."""

    def __init__(self, num_samples: int = 50_000, num_classes: int = 10, channels: int = 3,
                 size: int = 32, noise: float = 1.0, seed: int = 0, stream: int = 0):
        for name, value in (("num_samples", num_samples), ("num_classes", num_classes),
                            ("channels", channels), ("size", size)):
            _positive(name, value)
        if not noise >= 0:
            raise ValueError(f"noise must be >= 0, got {noise!r}")
        self.num_samples, self.num_classes = num_samples, num_classes
        self.shape = (channels, size, size)
        self.noise, self.seed, self.stream = float(noise), seed, stream
        coarse = torch.randn(num_classes, channels, 8, 8, generator=_gen(seed, 2**40))
        self.prototypes = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear",
                                                          align_corners=False)

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int) -> tuple[torch.Tensor, int]:
        g = _gen(self.seed, self.stream, index)
        label = int(torch.randint(0, self.num_classes, (1,), generator=g))
        image = self.prototypes[label] + self.noise * torch.randn(self.shape, generator=g)
        return image, label

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Images ``(n, C, H, W)`` float32 and labels ``(n,)`` int64."""
        pairs = [self.sample(i) for i in _check_indices(indices, self.num_samples)]
        if not pairs:
            return torch.empty(0, *self.shape), torch.empty(0, dtype=torch.int64)
        return torch.stack([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])


class SyntheticVectors:
    """``num_samples`` vectors of ``in_features`` labelled by a fixed random linear teacher."""

    def __init__(self, num_samples: int = 50_000, in_features: int = 1024, num_classes: int = 10, seed: int = 0,
                 stream: int = 0):
        for name, value in (("num_samples", num_samples), ("in_features", in_features),
                            ("num_classes", num_classes)):
            _positive(name, value)
        self.num_samples, self.in_features, self.num_classes = num_samples, in_features, num_classes
        self.seed, self.stream = seed, stream
        self.teacher = torch.randn(num_classes, in_features, generator=_gen(seed, 2**40))

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Vectors ``(n, in_features)`` float32 and labels ``(n,)`` int64."""
        idx = _check_indices(indices, self.num_samples)
        if not idx:
            return torch.empty(0, self.in_features), torch.empty(0, dtype=torch.int64)
        x = torch.stack([torch.randn(self.in_features, generator=_gen(self.seed, self.stream, i)) for i in idx])
        return x, (x @ self.teacher.T).argmax(dim=1)
