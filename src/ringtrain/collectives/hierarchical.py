"""Hierarchical allreduce: reduce-scatter inside each host, ring between hosts, allgather inside.

Words (the roles come from schedule.hierarchy_role):

- *host*: the ranks that share a host id (``hosts[r]`` for global rank r, as the
  communicator learned them at rendezvous); hosts are ordered by first appearance in the group.
- *lanes*: m = the smallest host's rank count. On every host the first m ranks (group order)
  are *lane ranks* with local index 0..m-1; lane rank i owns chunk i of
  ``chunk_bounds(n, m)``.
- *spare*: a rank with local index i >= m, present when hosts have unequal rank counts. It
  folds its whole buffer into lane rank i mod m on its host first (lane ranks reduce their
  spares in local-index order, one exchange each) and receives the final result from it at
  the end. With equal hosts there are no spares.
- *cross ring*: the lane ranks with one local index, one per host; they ring-allreduce their
  chunk, so inter-host traffic is 2(h-1)/h of a chunk per rank and every host link carries
  m parallel rings.

Steps for a lane rank: fold spares in; ring reduce-scatter among the host's lane ranks; ring
allreduce of its chunk along its cross ring; ring allgather among the host's lane ranks;
send the result to its spares. Every element is reduced once per stage on one rank and then
copied, so results are bitwise identical everywhere. ``hosts=None`` treats the whole group
as one host (a plain ring).
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import numpy as np

from ..transport.base import CallHeader, Recv, Reducer, Send, Transport
from . import ring, schedule


def allreduce(
    t: Transport,
    buf: np.ndarray,
    reduce: Reducer,
    header: CallHeader,
    deadline: float,
    group: Optional[Sequence[int]] = None,
    *,
    hosts: Optional[Sequence[Hashable]] = None,
    max_segment_bytes: Optional[int] = None,
) -> None:
    ring.check_buffer(buf)
    members, _ = schedule.resolve_group(t.rank, t.world_size, group)
    if hosts is None:
        hosts = [0] * t.world_size
    if len(hosts) != t.world_size:
        raise ValueError(f"hosts must name a host for each of the {t.world_size} ranks, got {len(hosts)}")
    role = schedule.hierarchy_role(members, hosts, t.rank)
    if role.fold_into is not None:  # a spare: hand the buffer over, get the result back
        t.exchange([Send(role.fold_into, buf)], [Recv(role.fold_into, buf[:0])], header, deadline)
        t.exchange([], [Recv(role.fold_into, buf)], header, deadline)
        return
    for spare in role.folded_from:  # (the empty sends: schedule.py, *first sends*)
        t.exchange([Send(spare, buf[:0])], [Recv(spare, buf, reduce)], header, deadline)
    seg = {"max_segment_bytes": max_segment_bytes}
    ring.reduce_scatter(t, buf, reduce, header, deadline, group=role.local, **seg)
    lo, hi = schedule.chunk_bounds(buf.size, role.lanes)[role.lane]
    ring.allreduce(t, buf[lo:hi], reduce, header, deadline, group=role.cross, **seg)
    ring.allgather(t, buf, header, deadline, group=role.local, **seg)
    if role.folded_from:
        t.exchange([Send(spare, buf) for spare in role.folded_from], [], header, deadline)
