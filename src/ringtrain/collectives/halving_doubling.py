"""Rabenseifner's allreduce: recursive-halving reduce-scatter, recursive-doubling allgather.

Words (the plan itself is schedule.halving_doubling_plan):

- *core ranks*: q = 2^floor(log2 p) of the group's ranks, numbered by *virtual rank*
  0..q-1; the other r = p - q are *extras*. Positions 2k and 2k+1 (k < r) pair up: the even
  one is an extra, the odd one is core virtual rank k; positions from 2r on are core
  virtual rank ``position - r``.
- *fold*: each extra sends its whole buffer to its partner, which reduces it in; *unfold*:
  at the end the partner sends the full result back. Any world size works this way.
- *block*: the buffer is cut into q blocks by schedule.chunk_bounds (so any length works,
  including n < p and n = 0; empty messages still travel and carry the call header).
- *halving round* with distance d (q/2, q/4, ..., 1): virtual rank v exchanges with v ^ d,
  keeps the half of its current block range picked by bit d of v, sends the other half and
  reduces the partner's copy of the kept half into its own. After log2 q rounds v holds
  block v fully reduced. *Doubling rounds* replay the rounds in reverse, copying.

Cost: 2·log2(q) start-ups (+2 with extras) and 2·(q-1)/q·n elements per core rank, versus
2·(p-1) start-ups for the ring: the choice for short buffers. Every element is reduced on
exactly one rank in each round, so all ranks end bitwise identical.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..transport.base import CallHeader, Reducer, Transport
from . import schedule
from .ring import check_buffer, walk


def allreduce(
    t: Transport,
    buf: np.ndarray,
    reduce: Reducer,
    header: CallHeader,
    deadline: float,
    group: Optional[Sequence[int]] = None,
) -> None:
    check_buffer(buf)
    members, pos = schedule.resolve_group(t.rank, t.world_size, group)
    walk(t, buf, schedule.halving_doubling_plan(buf.size, len(members), pos), members, reduce, header, deadline)
