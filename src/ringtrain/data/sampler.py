"""Which samples each rank trains on, step by step, reproducibly and resumably.

Words:

- *sample index*: an integer in ``[0, num_samples)``; a data set turns a list of them into
  a batch.
- *epoch order*: a permutation of all sample indices, a pure function of
  ``(seed, epoch)`` (the identity when ``shuffle=False``).
- *global batch* ``k`` of an epoch: entries ``[k·G, (k+1)·G)`` of the epoch order, where
  ``G = world_size · batch_size``. An epoch has ``num_samples // G`` global batches; the
  remainder is dropped, so every global batch is full and every rank steps in lockstep.
- *rank slice*: rank ``r`` takes entries ``[r·b, (r+1)·b)`` of each global batch. The rank
  slices are disjoint and their concatenation in rank order is the global batch, which is
  exactly the batch one process with ``batch_size = G`` would see: data-parallel training
  on ``p`` ranks and single-process training on the concatenated batch see the same data.
- *position*: the number of global batches already taken in the current epoch. The pair
  ``(epoch, position)`` is the whole state; saving and restoring it resumes exactly.

The permutation is computed from 64-bit integer arithmetic (splitmix64 keys, sorted), not
from a library random generator, so it is the same on every machine and every numpy or
torch version — ranks on different hosts agree without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer applied elementwise to a uint64 array (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def mix(*values: int) -> int:
    """A 63-bit integer that depends on every value in order (for seeding per-sample generators).

    Each value is an integer (Python or numpy, of any size or sign) taken modulo 2**64, as a
    64-bit register holds it: -1 and 2**64 - 1 mix alike.
    """
    h = np.zeros(1, dtype=np.uint64)
    for v in values:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"seeds and indices must be integers, got {v!r}")
        h = splitmix64(h ^ np.array([int(v) % 2**64], dtype=np.uint64))
    return int(h[0] >> np.uint64(1))


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch order: a permutation of ``range(n)`` that depends only on (seed, epoch)."""
    stream = np.array([mix(seed, epoch)], dtype=np.uint64)
    keys = splitmix64(stream + np.arange(n, dtype=np.uint64))
    return np.argsort(keys, kind="stable")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(slots=True)
class ShardedSampler:
    """Hands rank ``rank`` of ``world_size`` its slice of each global batch."""

    num_samples: int
    """Size of the data set."""
    batch_size: int
    """Samples per rank per step."""
    rank: int = 0
    """This process's rank, in ``[0, world_size)``."""
    world_size: int = 1
    """Number of ranks sharing each global batch."""
    seed: int = 0
    """Seed of the epoch orders; all ranks must use the same one."""
    shuffle: bool = True
    """False: every epoch visits the samples in index order."""
    epoch: int = field(default=0)
    """Current epoch (state)."""
    position: int = field(default=0)
    """Global batches already taken in the current epoch (state)."""
    _order: np.ndarray | None = field(default=None, repr=False, compare=False)
    _order_epoch: int = field(default=-1, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("batch_size", self.batch_size, 1)
        _check_int("world_size", self.world_size, 1)
        _check_int("rank", self.rank, 0)
        _check_int("seed", self.seed, 0)
        _check_int("num_samples", self.num_samples, 0)
        _check_int("epoch", self.epoch, 0)
        _check_int("position", self.position, 0)
        for name in ("num_samples", "batch_size", "rank", "world_size", "seed", "epoch", "position"):
            setattr(self, name, int(getattr(self, name)))  # (numpy's ints would reach state_dict's checkpoint)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.num_samples < self.global_batch_size:
            if self.num_samples == 0:
                fix = "the data set is empty"
            elif self.num_samples < self.world_size:  # (no batch_size helps)
                fix = f"every rank needs a sample: use a larger data set or at most {self.num_samples} ranks"
            else:
                fix = "use a smaller batch_size"
            raise ValueError(
                f"num_samples={self.num_samples} is smaller than one global batch "
                f"(world_size {self.world_size} x batch_size {self.batch_size}); {fix}"
            )
        if self.position >= self.batches_per_epoch:
            raise ValueError(f"position must be < batches_per_epoch={self.batches_per_epoch}, got {self.position}")

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.batch_size

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All sample indices in the order epoch ``epoch`` visits them (cached per epoch)."""
        if self._order_epoch != epoch or self._order is None:
            n = self.num_samples
            self._order = permutation(n, self.seed, epoch) if self.shuffle else np.arange(n)
            self._order_epoch = epoch
        return self._order

    def global_batch(self, epoch: int, position: int) -> np.ndarray:
        """Sample indices of global batch ``position`` of ``epoch`` (all ranks' slices)."""
        g = self.global_batch_size
        return self.epoch_order(epoch)[position * g:(position + 1) * g]

    def rank_slice(self, epoch: int, position: int) -> np.ndarray:
        """This rank's sample indices of global batch ``position`` of ``epoch``."""
        b = self.batch_size
        return self.global_batch(epoch, position)[self.rank * b:(self.rank + 1) * b]

    def next_indices(self) -> np.ndarray:
        """This rank's indices for the next step; advances the state."""
        indices = self.rank_slice(self.epoch, self.position)
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        return indices

    def seek(self, steps: int) -> None:
        """Stand where ``steps`` calls of next_indices from the start leave the sampler (one global
        batch per step)."""
        _check_int("steps", steps, 0)
        self.epoch, self.position = divmod(int(steps), self.batches_per_epoch)

    def state_dict(self) -> dict[str, int]:
        """The resumable state plus what it is only valid for (plain ints: checkpoint-safe)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. The global batch may be split over a different world size."""
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ValueError(f"cannot resume: the saved sampler state lacks {missing}")
        for key in ("seed", "num_samples", "global_batch_size", "shuffle"):
            mine = self.state_dict()[key]
            if int(state[key]) != mine:
                raise ValueError(
                    f"cannot resume: the saved sampler has {key}={int(state[key])}, this one has {mine}"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        _check_int("epoch", epoch, 0)
        if not 0 <= position < self.batches_per_epoch:
            raise ValueError(f"saved position {position} is outside [0, {self.batches_per_epoch})")
        self.epoch, self.position = epoch, position
