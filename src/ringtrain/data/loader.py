"""A loader: a data set plus a sharded sampler, yielding this rank's batches.

A *data set* here is anything with ``__len__`` and ``batch(indices) -> (inputs, targets)``
(:class:`~ringtrain.data.text.TextWindows`, :class:`~ringtrain.data.synthetic.SyntheticImages`,
:class:`~ringtrain.data.synthetic.SyntheticVectors`). Batches are built in the calling
thread, with no worker processes, so the loader's state is only the sampler's
``(epoch, position)``: ``state_dict()`` after step k, restored with ``load_state_dict``
into a fresh loader, yields exactly the batches k+1, k+2, ... of the original run.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch

from .sampler import ShardedSampler


class Dataset(Protocol):
    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]: ...


class ShardedLoader:
    """Rank ``rank`` of ``world_size``'s batches of ``dataset``, ``batch_size`` samples each."""

    def __init__(self, dataset: Dataset, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        self.dataset = dataset
        self.sampler = ShardedSampler(len(dataset), batch_size, rank=rank, world_size=world_size,
                                      seed=seed, shuffle=shuffle)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def position(self) -> int:
        return self.sampler.position

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next batch; crosses epoch boundaries by itself."""
        return self.dataset.batch(self.sampler.next_indices())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless: training loops count steps, not epochs."""
        while True:
            yield self.next_batch()

    def seek(self, steps: int) -> None:
        """Stand where ``steps`` steps from the start leave this loader."""
        self.sampler.seek(steps)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
