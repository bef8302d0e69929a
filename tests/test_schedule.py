"""Exhaustive tests of collectives/schedule.py, without any communication.

Plans are executed by a small simulator over symbolic buffers: each element is a leaf (the
position that contributed it) or a pair (a, b) meaning ``reduce(a, b)``. The simulator uses
the strictest transport semantics (a send completes only once the receiver took it), so a
plan that finishes here cannot deadlock on any transport. Afterwards we check that every
element holds each position's contribution exactly once and that all ranks hold the very
same expression tree (which is what makes floating-point results bitwise identical).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ringtrain.collectives import schedule as S

pytestmark = pytest.mark.timeout(60)

WORLD = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]
LENGTHS = [0, 1, 2, 3, 5, 7, 8, 13, 17, 33]


def leaves(expr) -> list:
    if isinstance(expr, tuple):
        return leaves(expr[0]) + leaves(expr[1])
    return [expr]


def simulate(plans: list[S.Plan], bufs: list[np.ndarray]) -> None:
    """Run every position's plan on symbolic object buffers, rendezvous semantics."""
    p = len(plans)
    idx = [0] * p
    posted = [False] * p
    queues: dict = {}  # (src, dst) -> list of [payload, consumed]
    mine: list[list] = [[] for _ in range(p)]  # messages posted by the current transfer
    got: list[set] = [set() for _ in range(p)]
    while True:
        progress = False
        for r in range(p):
            if idx[r] == len(plans[r]):
                continue
            x = plans[r][idx[r]]
            peers = [peer for peer, _, _ in x.sends]
            assert len(set(peers)) == len(peers), "two sends to one peer in a transfer"
            assert len({peer for peer, _, _ in x.recvs}) == len(x.recvs), "two recvs from one peer"
            for (_, slo, shi), (_, rlo, rhi) in itertools.product(x.sends, x.recvs):
                assert shi <= rlo or rhi <= slo or slo == shi or rlo == rhi, "send and recv ranges overlap"
            if not posted[r]:
                for peer, lo, hi in x.sends:
                    assert peer != r and 0 <= peer < p and 0 <= lo <= hi <= len(bufs[r])
                    msg = [bufs[r][lo:hi].copy(), False]
                    queues.setdefault((r, peer), []).append(msg)
                    mine[r].append(msg)
                posted[r] = True
                progress = True
            for j, (peer, lo, hi) in enumerate(x.recvs):
                if j in got[r] or not queues.get((peer, r)):
                    continue
                msg = queues[(peer, r)].pop(0)
                data = msg[0]
                assert len(data) == hi - lo, f"length mismatch {peer}->{r}: sent {len(data)}, expects {hi - lo}"
                if x.reduce:
                    for e in range(lo, hi):
                        bufs[r][e] = (bufs[r][e], data[e - lo])
                else:
                    bufs[r][lo:hi] = data
                msg[1] = True
                got[r].add(j)
                progress = True
            if len(got[r]) == len(x.recvs) and all(m[1] for m in mine[r]):
                idx[r] += 1
                posted[r] = False
                mine[r] = []
                got[r] = set()
                progress = True
        if all(idx[r] == len(plans[r]) for r in range(p)):
            assert not any(queues.values()), "messages left unreceived"
            return
        assert progress, f"deadlock at transfers {idx}"


def leaf_buffers(n: int, p: int) -> list[np.ndarray]:
    bufs = []
    for r in range(p):
        b = np.empty(n, dtype=object)
        b[:] = [r] * n
        bufs.append(b)
    return bufs


def assert_allreduced(bufs: list[np.ndarray], p: int, elems=None) -> None:
    n = len(bufs[0])
    for e in range(n) if elems is None else elems:
        assert sorted(leaves(bufs[0][e])) == list(range(p)), f"element {e}: {bufs[0][e]}"
        for r in range(1, p):
            assert bufs[r][e] == bufs[0][e], f"element {e} differs on position {r}"


# --- chunks and segments -------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 18))
def test_chunk_bounds_cover_exactly_once(p):
    for n in range(0, 60):
        b = S.chunk_bounds(n, p)
        assert len(b) == p and b[0][0] == 0 and b[-1][1] == n
        for (lo, hi), (lo2, _) in zip(b, b[1:]):
            assert hi == lo2
        sizes = [hi - lo for lo, hi in b]
        assert sizes == [n // p + (1 if i < n % p else 0) for i in range(p)]


def test_chunk_bounds_rejects_bad_arguments():
    with pytest.raises(ValueError):
        S.chunk_bounds(-1, 2)
    with pytest.raises(ValueError):
        S.chunk_bounds(3, 0)


def test_segments_and_counts():
    for lo, hi, count in itertools.product(range(5), range(5, 30), range(1, 9)):
        segs = S.segments(lo, hi, count)
        assert len(segs) == count and segs[0][0] == lo and segs[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    for longest, per in itertools.product(range(0, 40), range(1, 9)):
        c = S.segment_count(longest, per)
        assert c >= 1 and c * per >= longest and (c == 1 or (c - 1) * per < longest)
    assert S.segment_elems(4, 10) == 2 and S.segment_elems(8, 3) == 1
    assert S.segment_elems(4, None) == S.DEFAULT_SEGMENT_BYTES // 4
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="max_segment_bytes"):
            S.segment_elems(4, bad)


def test_resolve_group():
    assert S.resolve_group(2, 4, None) == ((0, 1, 2, 3), 2)
    assert S.resolve_group(2, 4, [3, 2]) == ((3, 2), 1)
    for bad in ([], [0, 0, 2], [2, 4], [0, 1]):
        with pytest.raises(ValueError):
            S.resolve_group(2, 4, bad)


# --- ring ----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", WORLD)
def test_ring_send_chunks_are_permutations(p):
    for phase in ("reduce_scatter", "allgather"):
        for step in range(p - 1):
            assert sorted(S.ring_send_chunk(pos, step, p, phase) for pos in range(p)) == list(range(p))
    # the last chunk each position receives in reduce-scatter is its own
    if p > 1:
        assert [S.ring_send_chunk((pos - 1) % p, p - 2, p, "reduce_scatter") for pos in range(p)] == list(range(p))


@pytest.mark.parametrize("p", WORLD)
def test_ring_allreduce_plan(p):
    for n, seg in itertools.product(LENGTHS, (1, 2, 3, 1000)):
        plans = [S.ring_plan(n, p, pos, seg, "allreduce") for pos in range(p)]
        lengths = {len(pl) for pl in plans}
        assert len(lengths) == 1, "every rank performs the same number of transfers"
        for pl in plans:
            for x in pl:
                assert all(hi - lo <= max(seg, 1) for _, lo, hi in x.sends + x.recvs), "segment too long"
        for k in range(len(plans[0])):  # in every transfer the ring's sends form a permutation
            assert sorted(plans[pos][k].sends[0][0] for pos in range(p)) == list(range(p))
        bufs = leaf_buffers(n, p)
        simulate(plans, bufs)
        assert_allreduced(bufs, p)


@pytest.mark.parametrize("p", WORLD)
def test_ring_reduce_scatter_plan_leaves_own_chunk(p):
    for n, seg in itertools.product(LENGTHS, (1, 4, 1000)):
        plans = [S.ring_plan(n, p, pos, seg, "reduce_scatter") for pos in range(p)]
        bufs = leaf_buffers(n, p)
        simulate(plans, bufs)
        for pos, (lo, hi) in enumerate(S.chunk_bounds(n, p)):
            for e in range(lo, hi):
                assert sorted(leaves(bufs[pos][e])) == list(range(p))


@pytest.mark.parametrize("p", WORLD)
def test_ring_allgather_plan_fills_every_chunk(p):
    for n, seg in itertools.product(LENGTHS, (1, 3, 1000)):
        plans = [S.ring_plan(n, p, pos, seg, "allgather") for pos in range(p)]
        bounds = S.chunk_bounds(n, p)
        bufs = []
        for pos in range(p):
            b = np.empty(n, dtype=object)
            b[:] = ["junk"] * n
            lo, hi = bounds[pos]
            b[lo:hi] = [("chunk", pos)] * (hi - lo)
            bufs.append(b)
        simulate(plans, bufs)
        for pos in range(p):
            for c, (lo, hi) in enumerate(bounds):
                assert all(v == ("chunk", c) for v in bufs[pos][lo:hi])


def broadcast_check(plans, n, p, root):
    bufs = []
    for pos in range(p):
        b = np.empty(n, dtype=object)
        b[:] = [("root", e) if pos == root else "junk" for e in range(n)]
        bufs.append(b)
    simulate(plans, bufs)
    for pos in range(p):
        assert list(bufs[pos]) == [("root", e) for e in range(n)]


@pytest.mark.parametrize("p", WORLD)
def test_chain_broadcast_plan(p):
    for n, seg, root in itertools.product(LENGTHS, (1, 2, 5, 1000), range(p)):
        plans = [S.chain_broadcast_plan(n, p, pos, root, seg) for pos in range(p)]
        broadcast_check(plans, n, p, root)
        assert max(len(pl) for pl in plans) <= S.segment_count(n, seg) + p - 2


@pytest.mark.parametrize("p", WORLD)
def test_binomial_broadcast_plan(p):
    for n, root in itertools.product((0, 1, 4), range(p)):
        plans = [S.binomial_broadcast_plan(n, p, pos, root) for pos in range(p)]
        broadcast_check(plans, n, p, root)
        # every non-root receives exactly once; depth is ceil(log2 p)
        assert sum(len(x.recvs) for pl in plans for x in pl) == p - 1


@pytest.mark.parametrize("p", WORLD + [11, 13])
def test_dissemination_barrier_everyone_hears_from_everyone(p):
    plans = [S.dissemination_plan(p, pos) for pos in range(p)]
    assert all(len(pl) == (p - 1).bit_length() for pl in plans)
    bufs = [np.empty(0, dtype=object) for _ in range(p)]
    simulate(plans, bufs)  # no deadlock, every empty message matched
    known = [{pos} for pos in range(p)]  # who each position knows has entered
    for k in range(len(plans[0])):
        sent = [set(known[pos]) for pos in range(p)]
        for pos in range(p):
            (src, _, _), = plans[pos][k].recvs
            assert plans[src][k].sends[0][0] == pos
            known[pos] |= sent[src]
    assert all(k == set(range(p)) for k in known)


# --- halving-doubling ----------------------------------------------------------------------


def test_virtual_ranks_are_a_bijection():
    for p in range(1, 40):
        q = S.power_of_two_below(p)
        assert q <= p < 2 * q
        vs = [S.hd_virtual_rank(p, pos) for pos in range(p)]
        core = [v for v in vs if v is not None]
        assert sorted(core) == list(range(q))
        assert len(vs) - len(core) == p - q
        for pos, v in enumerate(vs):
            if v is None:
                assert S.hd_virtual_rank(p, pos + 1) is not None
            else:
                assert S.hd_position(p, v) == pos


@pytest.mark.parametrize("p", list(range(1, 18)))
def test_halving_doubling_plan(p):
    for n in LENGTHS + [64, 100]:
        plans = [S.halving_doubling_plan(n, p, pos) for pos in range(p)]
        bufs = leaf_buffers(n, p)
        simulate(plans, bufs)
        assert_allreduced(bufs, p)
        q = S.power_of_two_below(p)
        core = 2 * (q.bit_length() - 1)
        assert max(len(pl) for pl in plans) == core + (2 if p > q else 0)


# --- hierarchical roles --------------------------------------------------------------------

LAYOUTS = [
    "aabb", "aaabb", "abc", "aaaa", "a", "ab", "abab", "aaabbbbcc", "abbbccc", "aaaaaaab", "abcabcab",
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hierarchy_roles(layout):
    hosts = list(layout)
    group = list(range(len(hosts)))
    roles = [S.hierarchy_role(group, hosts, r) for r in group]
    m = roles[0].lanes
    counts = {h: hosts.count(h) for h in hosts}
    assert m == min(counts.values())
    lane_ranks = [r for r in group if roles[r].lane is not None]
    assert len(lane_ranks) == m * len(counts)
    for r in group:
        role = roles[r]
        assert len(role.local) == m and all(hosts[x] == hosts[r] for x in role.local)
        if role.lane is None:
            assert role.fold_into is not None and hosts[role.fold_into] == hosts[r]
            assert r in roles[role.fold_into].folded_from
        else:
            assert role.local[role.lane] == r
            assert len(role.cross) == len(counts) and len({hosts[x] for x in role.cross}) == len(counts)
            for x in role.cross:  # the inter-host ring is the same on every member
                assert roles[x].cross == role.cross
            for x in role.folded_from:
                assert roles[x].fold_into == r
    spares = [r for r in group if roles[r].lane is None]
    assert sorted(x for r in lane_ranks for x in roles[r].folded_from) == spares


def test_hierarchy_role_respects_group_order():
    hosts = ["a", "b", "a", "b"]  # global rank -> host
    role = S.hierarchy_role([3, 2, 1, 0], hosts, 2)
    assert (role.local, role.lane, role.cross) == ((2, 0), 0, (3, 2))  # host b appears first
    role = S.hierarchy_role([3, 2, 1, 0], hosts, 0)
    assert (role.local, role.lane, role.cross) == ((2, 0), 1, (1, 0))


def test_chain_beats_tree_only_with_enough_segments():
    assert not S.chain_beats_tree(1, 8) and not S.chain_beats_tree(100, 2)
    assert S.chain_beats_tree(2, 3) and not S.chain_beats_tree(1, 3)
    assert S.chain_beats_tree(4, 8) and not S.chain_beats_tree(3, 8)
