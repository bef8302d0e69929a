"""Ring collectives: reduce-scatter, allgather, allreduce (both), broadcast and barrier.

Words (see schedule.py for chunk, segment, step, transfer, plan):

- *right* / *left* neighbour: the next / previous position in the group, cyclically.
- *reduce-scatter*: ``p - 1`` steps; in each, every rank sends one chunk to its right
  neighbour, which reduces it into its own copy of that chunk. Each chunk is thus reduced
  exactly once along the ring, starting one position after its owner and ending at it.
- *allgather*: ``p - 1`` steps of forwarding whole chunks, copying.
- *allreduce* = reduce-scatter then allgather; every rank sends and receives
  ``2 (p - 1) / p · n`` elements. Results are bitwise identical on every rank because each
  element is reduced on one rank and only copied afterwards.

Each step is cut into segments of at most ``max_segment_bytes`` (default
schedule.DEFAULT_SEGMENT_BYTES); within a transfer the transport moves the outgoing segment
and reduces the incoming one concurrently, and streams long messages itself.

Broadcast is a pipelined chain along the ring when the buffer spans enough segments
(bandwidth-optimal for long buffers) and a binomial tree otherwise (fewer start-ups); the
rule is schedule.chain_beats_tree. Barrier is a dissemination barrier (``ceil(log2 p)`` rounds), see tree.py.

Every function takes ``group`` (global ranks in order, None = all) and works in place on a
1-D contiguous numpy array; reductions go only through ``reduce`` (``out = out op in``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..transport.base import CallHeader, Recv, Reducer, Send, Transport
from . import schedule


def check_buffer(buf: np.ndarray) -> None:
    """ValueError unless ``buf`` is a writable 1-D contiguous numpy array."""
    if not isinstance(buf, np.ndarray):
        raise ValueError(f"collectives work on numpy arrays (use ops.flat_view), got {type(buf).__name__}")
    if buf.ndim != 1 or not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ValueError("collectives need a writable 1-D C-contiguous buffer (use ops.flat_view)")


def walk(
    t: Transport,
    buf: np.ndarray,
    plan: schedule.Plan,
    group: Sequence[int],
    reduce: Optional[Reducer],
    header: CallHeader,
    deadline: float,
) -> None:
    """Execute a plan: one transport exchange per transfer, positions mapped through group."""
    for x in plan:
        sends = [Send(group[peer], buf[lo:hi]) for peer, lo, hi in x.sends]
        recvs = [Recv(group[peer], buf[lo:hi], reduce if x.reduce else None) for peer, lo, hi in x.recvs]
        t.exchange(sends, recvs, header, deadline)


def _setup(t: Transport, buf: np.ndarray, group, max_segment_bytes):
    check_buffer(buf)
    members, pos = schedule.resolve_group(t.rank, t.world_size, group)
    return members, pos, schedule.segment_elems(buf.itemsize, max_segment_bytes)


def allreduce(
    t: Transport,
    buf: np.ndarray,
    reduce: Reducer,
    header: CallHeader,
    deadline: float,
    group: Optional[Sequence[int]] = None,
    *,
    max_segment_bytes: Optional[int] = None,
) -> None:
    """Ring allreduce of ``buf`` in place: reduce-scatter then allgather."""
    members, pos, seg = _setup(t, buf, group, max_segment_bytes)
    plan = schedule.ring_plan(buf.size, len(members), pos, seg, "allreduce")
    walk(t, buf, plan, members, reduce, header, deadline)


def reduce_scatter(
    t: Transport,
    buf: np.ndarray,
    reduce: Reducer,
    header: CallHeader,
    deadline: float,
    group: Optional[Sequence[int]] = None,
    *,
    max_segment_bytes: Optional[int] = None,
) -> None:
    """Afterwards chunk ``pos`` of ``buf`` holds that chunk reduced over the group; the
    other chunks hold partial results (scratch)."""
    members, pos, seg = _setup(t, buf, group, max_segment_bytes)
    plan = schedule.ring_plan(buf.size, len(members), pos, seg, "reduce_scatter")
    walk(t, buf, plan, members, reduce, header, deadline)


def allgather(
    t: Transport,
    buf: np.ndarray,
    header: CallHeader,
    deadline: float,
    group: Optional[Sequence[int]] = None,
    *,
    max_segment_bytes: Optional[int] = None,
) -> None:
    """Position ``i``'s chunk ``i`` of ``buf`` is copied into chunk ``i`` on every rank."""
    members, pos, seg = _setup(t, buf, group, max_segment_bytes)
    plan = schedule.ring_plan(buf.size, len(members), pos, seg, "allgather")
    walk(t, buf, plan, members, None, header, deadline)


def broadcast(
    t: Transport,
    buf: np.ndarray,
    root: int,
    header: CallHeader,
    deadline: float,
    group: Optional[Sequence[int]] = None,
    *,
    max_segment_bytes: Optional[int] = None,
) -> None:
    """Copy global rank ``root``'s ``buf`` into every group member's ``buf``."""
    members, pos, seg = _setup(t, buf, group, max_segment_bytes)
    if root not in members:
        raise ValueError(f"broadcast root {root!r} is not in the group {list(members)}")
    p, root_pos = len(members), members.index(root)
    if schedule.chain_beats_tree(schedule.segment_count(buf.size, seg), p):
        plan = schedule.chain_broadcast_plan(buf.size, p, pos, root_pos, seg)
    else:
        plan = schedule.binomial_broadcast_plan(buf.size, p, pos, root_pos)
    walk(t, buf, plan, members, None, header, deadline)


def agree(t: Transport, header: CallHeader, deadline: float) -> None:
    """Every rank sends its call header to the next rank and checks the previous one's: equal
    around the ring is equal everywhere, else MismatchError. One message time, for calls in
    which some rank would not hear from another (a broadcast's root only sends; two ranks that
    each take the other for the root only receive) or whose bytes move outside ringtrain's
    transport (algorithm "native")."""
    p, r = t.world_size, t.rank
    empty = np.empty(0, dtype=np.uint8)
    t.sendrecv((r + 1) % p, empty, (r - 1) % p, np.empty(0, dtype=np.uint8), header, deadline)


def barrier(t: Transport, header: CallHeader, deadline: float, group: Optional[Sequence[int]] = None) -> None:
    """Return once every group member has entered the barrier (dissemination, log2 p rounds)."""
    from . import tree

    tree.barrier(t, header, deadline, group)
