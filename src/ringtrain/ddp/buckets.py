"""Bucket layout: where each gradient lives in the flat buffers that travel as one allreduce.

Words used here:

- *parameter id* (``pid``): a parameter's index in the wrapper's list of parameters that
  require a gradient (registration order, as ``module.parameters()`` yields them).
- *order*: the parameters in **backward order**, ``order[k]`` = the id of the parameter whose
  gradient is the k-th to become ready. It is the "layer" order of :mod:`ringtrain.plan`:
  position k of the order is layer k of a plan.
- *group*: a plan's ``(first, last)`` range of positions in the order.
- *bucket*: one flat buffer and one allreduce. A bucket holds the gradients of a group's
  parameters, back to back in backward order. A group whose parameters have different dtypes
  is split into consecutive single-dtype buckets (a flat buffer has one dtype).
- *slot*: a parameter's stretch ``[offset, offset + numel)`` of its bucket's buffer.

Everything here is pure: it maps an order, a plan's groups, and the parameters' sizes and
dtypes to a layout; the wrapper allocates buffers from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One bucket: its parameters in backward order and their slots."""

    index: int
    """Position of the bucket in launch order (backward order)."""
    pids: tuple[int, ...]
    """Parameter ids of the bucket, in backward order."""
    offsets: tuple[int, ...]
    """Element offset of each parameter's slot, parallel to ``pids``."""
    numel: int
    """Elements in the bucket's buffer."""
    dtype: Any
    """The element type every parameter of the bucket shares (a torch dtype)."""
    itemsize: int
    """Bytes per element."""

    def __post_init__(self) -> None:
        if len(self.pids) != len(self.offsets) or not self.pids:
            raise ValueError("a bucket needs one offset per parameter and at least one parameter")

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def check_order(order: Sequence[int], count: int) -> list[int]:
    """``order`` as a list, or a ValueError if it is not a permutation of 0..count-1."""
    out = [int(p) for p in order]
    if sorted(out) != list(range(count)):
        raise ValueError(f"order must be a permutation of the {count} parameter ids, got {out!r}")
    return out


def layout(
    order: Sequence[int],
    groups: Sequence[tuple[int, int]],
    numels: Sequence[int],
    dtypes: Sequence[Any],
    itemsizes: Sequence[int],
) -> list[BucketSpec]:
    """The buckets of a plan: each group in order, split wherever the dtype changes.

    ``numels``, ``dtypes`` and ``itemsizes`` are indexed by parameter id.
    """
    order = check_order(order, len(numels))
    expected = 0
    for first, last in groups:
        if first != expected or last < first:
            raise ValueError(f"groups must be contiguous ranges covering 0..{len(order) - 1}, got {list(groups)!r}")
        expected = last + 1
    if expected != len(order):
        raise ValueError(f"groups cover positions 0..{expected - 1} of 0..{len(order) - 1}")
    buckets: list[BucketSpec] = []
    for first, last in groups:
        run: list[int] = []
        for pos in range(first, last + 1):
            pid = order[pos]
            if run and dtypes[pid] != dtypes[run[0]]:
                buckets.append(_bucket(len(buckets), run, numels, dtypes, itemsizes))
                run = []
            run.append(pid)
        buckets.append(_bucket(len(buckets), run, numels, dtypes, itemsizes))
    return buckets


def bucket_of(buckets: Sequence[BucketSpec], count: int) -> list[tuple[int, int]]:
    """For each parameter id: (bucket index, slot offset)."""
    where: list[tuple[int, int]] = [(-1, -1)] * count
    for b in buckets:
        for pid, off in zip(b.pids, b.offsets):
            where[pid] = (b.index, off)
    return where


def _bucket(index: int, pids: list[int], numels, dtypes, itemsizes) -> BucketSpec:
    offsets, total = [], 0
    for pid in pids:
        offsets.append(total)
        total += int(numels[pid])
    return BucketSpec(index, tuple(pids), tuple(offsets), total, dtypes[pids[0]], int(itemsizes[pids[0]]))
