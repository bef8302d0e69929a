"""Centralized allreduce: one master reduces everything, then sends the result back.

Words: the *master* is the group's first rank (the seeds' "single GPU master"); the other
ranks are *workers*. Workers send their whole buffer to the master and wait for the result;
the master receives all contributions at once into scratch, reduces them in group order
(its own first, then positions 1, 2, ...), and sends the result to every worker. The result
is computed once, so every rank ends bitwise identical. The master moves 2(p - 1)·n elements
and is the bottleneck: this is the baseline the ring improves on.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..transport.base import CallHeader, Recv, Reducer, Send, Transport
from . import schedule
from .ring import check_buffer


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
    p = len(members)
    if p == 1:
        return
    master = members[0]
    if pos != 0:  # (the master's empty message: schedule.py, *first sends*)
        t.exchange([Send(master, buf)], [Recv(master, buf[:0])], header, deadline)
        t.exchange([], [Recv(master, buf)], header, deadline)
        return
    scratch = np.empty((p - 1, buf.size), dtype=buf.dtype)
    t.exchange([Send(members[j], buf[:0]) for j in range(1, p)],
               [Recv(members[j], scratch[j - 1]) for j in range(1, p)], header, deadline)
    for row in scratch:
        reduce(buf, row)
    t.exchange([Send(members[j], buf) for j in range(1, p)], [], header, deadline)
