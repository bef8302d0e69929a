"""Pure offset and peer arithmetic for every collective: no I/O, no numpy, exhaustively tested.

Words used by all algorithm modules:

- *group*: the global ranks taking part, in order; a rank's *position* is its index in the
  group. All the math below is in positions; the algorithm modules map positions to ranks.
- *chunk*: ``chunk_bounds(n, p)`` cuts ``[0, n)`` into ``p`` contiguous chunks, the first
  ``n % p`` of them one element longer. Chunk ``i`` belongs to position ``i``: in-place
  reduce-scatter leaves the reduced chunk ``i`` in its slot of the buffer on position ``i``;
  in-place allgather takes position ``i``'s input from chunk ``i`` and fills every chunk.
- *segment*: a chunk cut further (again by ``chunk_bounds``) so that no message is longer
  than ``max_segment_bytes`` (gloo's maxSegmentSize). Every chunk of one call is cut into
  the same number of segments, so all ranks perform the same number of exchanges.
- *transfer*: one exchange, i.e. what a rank sends and receives at once. A transfer lists
  ``(peer, lo, hi)`` sends and receives (peer as a position, ``[lo, hi)`` an element range
  of the buffer) and whether received data is reduced into the buffer or copied. A *plan*
  is the tuple of one rank's transfers; executing it is a plain loop (``ring.walk``).
- *step*: one round of the ring (reduce-scatter or allgather); ``p - 1`` steps each.

Invariants every plan keeps (and tests/test_schedule.py checks by simulation):

- the k-th message from position a to position b has the same length on both sides, and
  the plans finish even on a transport whose sends complete only once the receiver has
  taken the message (so no transport, buffered or rendezvous, can deadlock on them);
- within one transfer, the ranges sent and the ranges received never overlap;
- every element of the result is reduced by exactly one rank, in an order fixed by the plan
  (never by timing), and then only copied. Ranks therefore end with bitwise identical
  results, although floating-point reduction is not associative;
- empty messages are sent, not skipped: they carry the call header, so ranks that disagree
  about a call raise MismatchError even when their buffers are tiny or empty;
- *first sends*: no rank's first transfer of a call only receives. A rank that would wait for
  a peer's message before it has sent anything (an extra's partner here, the master of
  ``central``, a lane rank of ``hierarchical`` that folds spares in) sends that peer an empty
  message in the same transfer, which the peer takes in its own first transfer. Ranks that
  chose different algorithms would otherwise wait on each other with nothing sent (the
  master of ``central`` for a rank that, under ``halving_doubling``, waits for the master's
  fold) until the deadline; this way a message with the other call's header waits unread at
  one of them, which the transport raises as a MismatchError (transport.base, *watching*).

Plans are cached (they depend only on small integers) so a repeated call pays no planning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

#: The default longest message of a segmented algorithm, in bytes. The transports stream
#: large messages themselves (reducing as data arrives), so this only bounds scratch memory
#: and lets a long chain (broadcast) pipeline; tests set it tiny to force many segments.
DEFAULT_SEGMENT_BYTES = 4 << 20

Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One exchange of one rank: sends and receives as (peer position, lo, hi)."""

    sends: tuple[tuple[int, int, int], ...] = ()
    recvs: tuple[tuple[int, int, int], ...] = ()
    reduce: bool = False  # True: buf[lo:hi] = reduce(buf[lo:hi], incoming); False: copy


Plan = tuple[Transfer, ...]


# --- chunks and segments -------------------------------------------------------------------


@lru_cache(maxsize=4096)
def chunk_bounds(n: int, p: int) -> tuple[Range, ...]:
    """``p`` contiguous ranges covering ``[0, n)``; the first ``n % p`` one element longer."""
    if n < 0 or p < 1:
        raise ValueError(f"chunk_bounds needs n >= 0 and p >= 1, got n={n}, p={p}")
    base, extra = divmod(n, p)
    out = []
    lo = 0
    for i in range(p):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


def segment_elems(itemsize: int, max_segment_bytes: Optional[int]) -> int:
    """How many elements one segment may hold (at least one)."""
    if max_segment_bytes is None:
        max_segment_bytes = DEFAULT_SEGMENT_BYTES
    if not isinstance(max_segment_bytes, int) or max_segment_bytes < 1:
        raise ValueError(f"max_segment_bytes must be a positive integer, got {max_segment_bytes!r}")
    return max(1, max_segment_bytes // max(1, itemsize))


def segment_count(longest: int, seg_elems: int) -> int:
    """Segments needed so that a run of ``longest`` elements fits ``seg_elems`` per segment."""
    return max(1, -(-longest // seg_elems))


def segments(lo: int, hi: int, count: int) -> tuple[Range, ...]:
    """``[lo, hi)`` cut into ``count`` contiguous segments (some empty when hi - lo < count)."""
    return tuple((lo + a, lo + b) for a, b in chunk_bounds(hi - lo, count))


# --- groups --------------------------------------------------------------------------------


def resolve_group(rank: int, world_size: int, group: Optional[Sequence[int]]) -> tuple[tuple[int, ...], int]:
    """The group as a tuple of global ranks and ``rank``'s position in it (ValueError if bad)."""
    if group is None:
        return tuple(range(world_size)), rank
    members = tuple(int(r) for r in group)
    if not members:
        raise ValueError("group must name at least one rank")
    if len(set(members)) != len(members):
        raise ValueError(f"group names a rank twice: {list(members)}")
    bad = [r for r in members if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"group ranks must be in [0, {world_size}), got {bad}")
    if rank not in members:
        raise ValueError(f"rank {rank} is not in group {list(members)}")
    return members, members.index(rank)


# --- ring: reduce-scatter, allgather, and the pipelined chain broadcast -------------------


def ring_send_chunk(pos: int, step: int, p: int, phase: str) -> int:
    """The chunk position ``pos`` sends to its right neighbour at ``step`` of a ring phase.

    reduce_scatter: chunk ``pos - step - 1`` (so that after ``p - 1`` steps position ``pos``
    has received, and reduced, chunk ``pos`` for the last time); allgather: chunk
    ``pos - step`` (it starts by forwarding its own). The chunk received is the one the left
    neighbour sends, i.e. this formula at ``pos - 1``.
    """
    if phase == "reduce_scatter":
        return (pos - step - 1) % p
    if phase == "allgather":
        return (pos - step) % p
    raise ValueError(f"phase must be 'reduce_scatter' or 'allgather', got {phase!r}")


@lru_cache(maxsize=1024)
def ring_plan(n: int, p: int, pos: int, seg_elems: int, phase: str) -> Plan:
    """One ring phase (``reduce_scatter``, ``allgather`` or ``allreduce`` = both) for ``pos``.

    Each step is cut into the same number of segment transfers on every rank; transfer
    ``(step, s)`` sends segment ``s`` of the outgoing chunk right and receives segment ``s``
    of the incoming chunk from the left.
    """
    if phase == "allreduce":
        return ring_plan(n, p, pos, seg_elems, "reduce_scatter") + ring_plan(n, p, pos, seg_elems, "allgather")
    if p == 1:
        return ()
    bounds = chunk_bounds(n, p)
    count = segment_count(bounds[0][1] - bounds[0][0], seg_elems)
    right, left = (pos + 1) % p, (pos - 1) % p
    reduce = phase == "reduce_scatter"
    plan = []
    for step in range(p - 1):
        out_segs = segments(*bounds[ring_send_chunk(pos, step, p, phase)], count)
        in_segs = segments(*bounds[ring_send_chunk(left, step, p, phase)], count)
        for (slo, shi), (rlo, rhi) in zip(out_segs, in_segs):
            plan.append(Transfer(((right, slo, shi),), ((left, rlo, rhi),), reduce))
    return tuple(plan)


@lru_cache(maxsize=1024)
def chain_broadcast_plan(n: int, p: int, pos: int, root: int, seg_elems: int) -> Plan:
    """Pipelined chain broadcast from position ``root`` along the ring.

    The rank at distance ``d`` from the root receives segment ``k - d + 1`` from its left
    and sends segment ``k - d`` to its right in transfer ``k``, so segment ``s`` travels one
    hop per transfer and ``count + p - 2`` transfers finish the job.
    """
    if p == 1:
        return ()
    d = (pos - root) % p
    right, left = (pos + 1) % p, (pos - 1) % p
    count = segment_count(n, seg_elems)
    segs = segments(0, n, count)
    plan = []
    for k in range(count + p - 2):
        sends, recvs = (), ()
        if d < p - 1 and 0 <= k - d < count:
            sends = ((right, *segs[k - d]),)
        if d >= 1 and 0 <= k - d + 1 < count:
            recvs = ((left, *segs[k - d + 1]),)
        if sends or recvs:
            plan.append(Transfer(sends, recvs))
    return tuple(plan)


def chain_beats_tree(count: int, p: int) -> bool:
    """Whether a chain broadcast of ``count`` segments beats a binomial tree over ``p`` ranks.

    Counting transfers of one segment's length (start-ups and bandwidth alike): the chain
    needs ``count + p - 2``, the tree ``ceil(log2 p)`` rounds of ``count`` segments each.
    """
    return count + p - 2 < count * (p - 1).bit_length()


# --- binomial tree and dissemination -----------------------------------------------------


@lru_cache(maxsize=1024)
def binomial_broadcast_plan(n: int, p: int, pos: int, root: int) -> Plan:
    """Binomial-tree broadcast: ``ceil(log2 p)`` rounds, whole buffer per message.

    With ``v = pos - root`` (mod p), v receives from ``v - lowbit(v)`` and then sends to every
    ``v + 2^k < p`` with ``2^k < lowbit(v)`` (the root: every power of two below p), in one
    transfer.
    """
    if p == 1:
        return ()
    v = (pos - root) % p
    low = v & -v if v else 1 << p.bit_length()
    plan = []
    if v:
        plan.append(Transfer(recvs=(((v - low + root) % p, 0, n),)))
    children = []
    bit = 1
    while bit < low and v + bit < p:
        children.append(((v + bit + root) % p, 0, n))
        bit <<= 1
    if children:
        plan.append(Transfer(sends=tuple(reversed(children))))
    return tuple(plan)


@lru_cache(maxsize=1024)
def dissemination_plan(p: int, pos: int) -> Plan:
    """Dissemination barrier: in round k send to ``pos + 2^k`` and receive from ``pos - 2^k``.

    After ``ceil(log2 p)`` rounds every position has heard, directly or through others, from
    every other position, so none leaves before all have entered. Messages are empty.
    """
    plan = []
    dist = 1
    while dist < p:
        plan.append(Transfer((((pos + dist) % p, 0, 0),), (((pos - dist) % p, 0, 0),)))
        dist <<= 1
    return tuple(plan)


# --- Rabenseifner: recursive halving, recursive doubling, any p ----------------------------


def power_of_two_below(p: int) -> int:
    """The largest power of two that is <= p (p >= 1)."""
    return 1 << (p.bit_length() - 1)


def hd_virtual_rank(p: int, pos: int) -> Optional[int]:
    """Position -> virtual rank among the ``2^floor(log2 p)`` core ranks, or None for an extra.

    With ``r = p - 2^floor(log2 p)``, the first ``2r`` positions pair up as (2k, 2k+1): the
    even one is an *extra* that folds its data into the odd one (virtual rank k) and receives
    the result at the end; positions from ``2r`` on are virtual rank ``pos - r``.
    """
    r = p - power_of_two_below(p)
    if pos < 2 * r:
        return None if pos % 2 == 0 else pos // 2
    return pos - r


def hd_position(p: int, v: int) -> int:
    """Inverse of hd_virtual_rank on core ranks."""
    r = p - power_of_two_below(p)
    return 2 * v + 1 if v < r else v + r


@lru_cache(maxsize=1024)
def halving_doubling_plan(n: int, p: int, pos: int) -> Plan:
    """Rabenseifner's allreduce for any p: fold, recursive halving, recursive doubling, unfold.

    Core ranks work on ``chunk_bounds(n, q)`` blocks (q = 2^floor(log2 p)). In halving round
    with distance d (q/2, q/4, ..., 1) virtual rank v keeps the half of its block range
    whose block indices have bit d equal to v's, sends the other half to ``v ^ d`` and
    reduces what ``v ^ d`` sends it; afterwards v owns block v. Doubling replays the rounds
    backwards, copying. Every element is reduced on exactly one rank per round.
    """
    if p == 1:
        return ()
    q = power_of_two_below(p)
    v = hd_virtual_rank(p, pos)
    if v is None:  # an extra: hand everything to the partner, get the result back
        return (Transfer(((pos + 1, 0, n),), ((pos + 1, 0, 0),)), Transfer(recvs=((pos + 1, 0, n),)))
    bounds = chunk_bounds(n, q)

    def elems(blo: int, bhi: int) -> Range:
        return (bounds[blo][0], bounds[bhi - 1][1])

    plan = []
    extra = pos - 1 if pos < 2 * (p - q) else None
    if extra is not None:  # (the empty send: see *first sends*)
        plan.append(Transfer(((extra, 0, 0),), ((extra, 0, n),), reduce=True))
    blo, bhi = 0, q
    halving = []
    d = q // 2
    while d >= 1:
        mid = (blo + bhi) // 2
        keep, give = ((mid, bhi), (blo, mid)) if v & d else ((blo, mid), (mid, bhi))
        peer = hd_position(p, v ^ d)
        plan.append(Transfer(((peer, *elems(*give)),), ((peer, *elems(*keep)),), reduce=True))
        halving.append((peer, keep, give))
        blo, bhi = keep
        d //= 2
    for peer, keep, give in reversed(halving):
        plan.append(Transfer(((peer, *elems(*keep)),), ((peer, *elems(*give)),)))
    if extra is not None:
        plan.append(Transfer(sends=((extra, 0, n),)))
    return tuple(plan)


# --- hierarchical: hosts, lanes, folding ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class HierarchyRole:
    """What one rank does in a hierarchical allreduce (all ranks global, not positions).

    ``lanes`` is the number of ranks every host contributes to the inter-host rings: the
    smallest host's rank count m. On each host the first m ranks (in group order) are lane
    ranks; ``local`` lists them. A rank with local index ``i >= m`` is a *spare*: it folds its
    buffer into lane rank ``i % m`` (``fold_into``) and gets the result back. ``cross`` is
    the inter-host ring of a lane rank: the lane rank with the same local index on every
    host, hosts ordered by their first appearance in the group.
    """

    lanes: int
    local: tuple[int, ...]  # this host's lane ranks
    lane: Optional[int]  # this rank's local index if it is a lane rank
    cross: tuple[int, ...] = ()
    fold_into: Optional[int] = None
    folded_from: tuple[int, ...] = field(default=())


def hierarchy_role(group: Sequence[int], hosts: Sequence, rank: int) -> HierarchyRole:
    """Split ``group`` by host (``hosts[r]`` is global rank r's host id) for ``rank``."""
    by_host: dict = {}
    for r in group:
        by_host.setdefault(hosts[r], []).append(r)
    members = list(by_host.values())
    m = min(len(ms) for ms in members)
    mine = by_host[hosts[rank]]
    i = mine.index(rank)
    local = tuple(mine[:m])
    if i >= m:
        return HierarchyRole(m, local, None, fold_into=mine[i % m])
    cross = tuple(ms[i] for ms in members)
    folded = tuple(mine[j] for j in range(i + m, len(mine), m))
    return HierarchyRole(m, local, i, cross, None, folded)
