"""Naive allreduce: every rank sends its whole buffer to every other rank, in one exchange.

Words: a *contribution* is one rank's whole input buffer. Each rank receives the p - 1 other
contributions into scratch, then reduces all p of them in group order (position 0 first):
``((x0 op x1) op x2) ...``. Every rank evaluates that same expression, so results are
bitwise identical although floating-point reduction is not associative. Each rank sends and
receives (p - 1)·n elements and holds (p - 1)·n elements of scratch: the seeds' all-to-all
baseline, fine for tiny buffers and few ranks.
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
    scratch = np.empty((p - 1, buf.size), dtype=buf.dtype)
    parts = [buf if j == pos else scratch[j - (j > pos)] for j in range(p)]
    others = [j for j in range(p) if j != pos]
    t.exchange(
        [Send(members[j], buf) for j in others],
        [Recv(members[j], parts[j]) for j in others],
        header,
        deadline,
    )
    acc = parts[0]  # buf itself at position 0, else a scratch row we may overwrite
    for j in range(1, p):
        reduce(acc, parts[j])
    if acc is not buf:
        np.copyto(buf, acc)
