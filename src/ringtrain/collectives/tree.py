"""Logarithmic-depth collectives: binomial-tree broadcast and the dissemination barrier.

Words: *relative rank* ``v = position - root`` (mod p); in the binomial tree v's parent is
``v - lowbit(v)`` and its children are ``v + 2^k`` for every ``2^k < lowbit(v)`` (the root's:
every power of two below p). A broadcast takes ``ceil(log2 p)`` rounds, each moving the whole
buffer: best when the buffer is short (start-up cost dominates). The *dissemination barrier*
runs ``ceil(log2 p)`` rounds in which position i sends an empty message to ``i + 2^k`` and
waits for one from ``i - 2^k``; after the last round every rank has (transitively) heard
from every other, so no rank leaves before all have entered.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..transport.base import CallHeader, Transport
from . import schedule
from .ring import check_buffer, walk


def broadcast(
    t: Transport,
    buf: np.ndarray,
    root: int,
    header: CallHeader,
    deadline: float,
    group: Optional[Sequence[int]] = None,
) -> None:
    """Copy global rank ``root``'s ``buf`` to every group member, along a binomial tree."""
    check_buffer(buf)
    members, pos = schedule.resolve_group(t.rank, t.world_size, group)
    if root not in members:
        raise ValueError(f"broadcast root {root!r} is not in the group {list(members)}")
    plan = schedule.binomial_broadcast_plan(buf.size, len(members), pos, members.index(root))
    walk(t, buf, plan, members, None, header, deadline)


def barrier(t: Transport, header: CallHeader, deadline: float, group: Optional[Sequence[int]] = None) -> None:
    """Return once every group member has entered the barrier."""
    members, pos = schedule.resolve_group(t.rank, t.world_size, group)
    walk(t, np.empty(0, dtype=np.uint8), schedule.dissemination_plan(len(members), pos), members, None, header, deadline)
