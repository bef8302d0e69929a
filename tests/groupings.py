"""Every contiguous grouping of n layers, for the exhaustive checks of planners and layouts."""

from __future__ import annotations

import itertools
from typing import Iterator


def contiguous_groupings(n: int) -> Iterator[list[tuple[int, int]]]:
    """All 2^(n-1) ways to cut layers 0..n-1 into contiguous (first, last) groups, in order."""
    for cuts in itertools.product((False, True), repeat=max(n - 1, 0)):
        groups, first = [], 0
        for k, cut in enumerate(cuts):
            if cut:
                groups.append((first, k))
                first = k + 1
        groups.append((first, n - 1))
        yield groups
