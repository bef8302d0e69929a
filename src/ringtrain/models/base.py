"""What every reference model has in common.

Words used here and in the model modules:

- *layer*: a module that owns parameters directly (``nn.Linear``, ``nn.Conv2d``, a norm,
  an embedding, an ``nn.LSTM``). Gradient-merging schedules reason about layers in the
  order backward produces their gradients.
- *parameter tensor*: one ``nn.Parameter``; the unit a gradient hook fires on. A layer has
  one or more (weight, bias, ...).
- *batch*: a pair ``(inputs, targets)`` of CPU tensors; ``model.loss(model(inputs),
  targets)`` is a scalar, the mean over the batch, so the mean of per-rank gradients equals
  the gradient on the concatenated batch (for models without batch statistics).

Every model is deterministic on the CPU: no dropout, no random op in ``forward``, and
only kernels whose backward does not depend on thread scheduling.
"""

from __future__ import annotations

import operator

import torch
from torch import nn


class ReferenceModel(nn.Module):
    """Base class: parameter accounting, the loss, and a synthetic batch of the right shape."""

    #: The registry name of the family this model belongs to.
    family: str = ""

    @property
    def num_params(self) -> int:
        """Number of trainable scalars."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    @property
    def num_param_tensors(self) -> int:
        """Number of trainable parameter tensors (each fires one gradient hook)."""
        return sum(1 for p in self.parameters() if p.requires_grad)

    @property
    def num_layers(self) -> int:
        """Number of modules that own trainable parameters directly."""
        return sum(
            1
            for m in self.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        )

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; ``output`` is ``(..., classes)`` logits, ``target`` the class ids."""
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def make_batch(self, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A random batch of the shapes and dtypes this model takes (for benchmarks)."""
        raise NotImplementedError

    def dataset_kwargs(self) -> dict[str, int]:
        """Arguments to :func:`ringtrain.data.dataset` that make samples of this model's shapes."""
        raise NotImplementedError


def check_positive(name: str, value: int) -> None:
    """Raise ValueError unless ``value`` is a positive int (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_seed(seed) -> int:
    """``seed`` as an int, where torch's generators take it (64 bits: -2**63 to 2**64 - 1; an int
    or a numpy integer, not a bool or a float that would be truncated); else a ValueError
    naming it (torch's own said "Overflow when unpacking long long", from deep in the call)."""
    try:
        if isinstance(seed, bool):
            raise TypeError
        value = operator.index(seed)
    except TypeError:
        raise ValueError(f"seed must be an integer, got {seed!r}") from None
    if not -(2**63) <= value < 2**64:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64) (torch's generators take 64 bits), got {seed}")
    return value


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``; leaves torch's global generator alone."""
    return torch.Generator().manual_seed(check_seed(seed))
