"""Bucket layout (pure): every parameter in exactly one slot, slots back to back in backward
order, one dtype per bucket, groups honoured."""

from __future__ import annotations

import itertools

import pytest
import torch

from groupings import contiguous_groupings
from ringtrain.ddp.buckets import bucket_of, check_order, layout


def test_layout_follows_order_and_groups():
    numels = [5, 7, 1, 3]
    order = [3, 1, 0, 2]
    specs = layout(order, [(0, 1), (2, 3)], numels, [torch.float32] * 4, [4] * 4)
    assert [s.pids for s in specs] == [(3, 1), (0, 2)]
    assert [s.offsets for s in specs] == [(0, 3), (0, 5)]
    assert [s.numel for s in specs] == [10, 6]
    assert [s.nbytes for s in specs] == [40, 24]
    assert bucket_of(specs, 4) == [(1, 0), (0, 3), (1, 5), (0, 0)]


def test_dtype_change_splits_a_group():
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float32]
    specs = layout([0, 1, 2, 3], [(0, 3)], [2, 2, 2, 2], dtypes, [4, 4, 8, 4])
    assert [s.pids for s in specs] == [(0, 1), (2,), (3,)]
    assert [s.dtype for s in specs] == [torch.float32, torch.float64, torch.float32]
    assert [s.index for s in specs] == [0, 1, 2]
    assert specs[1].nbytes == 16


def test_same_itemsize_different_dtype_splits_a_group():
    # float16 and bfloat16 are both two bytes: one buffer of either would reduce the other's
    # bits as its own.
    dtypes = [torch.float16, torch.bfloat16, torch.bfloat16, torch.float16, torch.float32, torch.int32]
    specs = layout([0, 1, 2, 3, 4, 5], [(0, 5)], [3] * 6, dtypes, [2, 2, 2, 2, 4, 4])
    assert [s.pids for s in specs] == [(0,), (1, 2), (3,), (4,), (5,)]
    assert [s.dtype for s in specs] == [torch.float16, torch.bfloat16, torch.float16, torch.float32, torch.int32]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_every_grouping_and_order_covers_each_parameter_once(n):
    numels = [i + 1 for i in range(n)]
    for order in itertools.permutations(range(n)):
        for groups in contiguous_groupings(n):
            specs = layout(order, groups, numels, [torch.float32] * n, [4] * n)
            assert [p for s in specs for p in s.pids] == list(order)
            for s in specs:
                ends = [o + numels[p] for p, o in zip(s.pids, s.offsets)]
                assert list(s.offsets) == [0] + ends[:-1] and s.numel == ends[-1]


@pytest.mark.parametrize("order, groups", [
    ([0, 0, 1], [(0, 2)]), ([0, 1], [(0, 0)]), ([0, 1], [(1, 1), (0, 0)]), ([0, 1, 2], [(0, 1), (3, 3)]),
    ([0, 1, 2], [(0, 0), (1, 0), (1, 2)]),  # an empty group (last < first), however it is followed
])
def test_bad_order_or_groups_raise(order, groups):
    with pytest.raises(ValueError):
        layout(order, groups, [1] * len(order), [torch.float32] * len(order), [4] * len(order))


def test_check_order_names_the_problem():
    with pytest.raises(ValueError, match="permutation"):
        check_order([1, 2], 2)
