"""Ranks that disagree about which peers a call talks to (different algorithms, or lengths that
make ``auto`` choose differently) raise MismatchError on every rank within moments, on every
transport, instead of waiting on each other until the deadline (transport.base, *watching*;
collectives.schedule, *first sends*)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch.distributed as dist

from ringtrain.comm import Communicator
from ringtrain.transport.local import LocalHub, on_threads

TIMEOUT = 5.0  # the communicators' deadline: a rank that waits it out has not been told


def _connect(kind: str, rank: int, world: int, store, prefix: str):
    if kind == "local":
        return store.transport(rank)
    if kind == "shm":
        from ringtrain.transport.shm import ShmTransport

        return ShmTransport.connect(rank, world, store, timeout=10, prefix=prefix)
    from ringtrain.transport.tcp import TcpTransport

    return TcpTransport.connect(rank, world, store, secret=None, timeout=10, host_ids=["h"] * world, prefix=prefix)


def _allreduce_once(comm: Communicator, algorithm: str, length: int = 6):
    """(error type name or "returned", seconds, text) of one allreduce on ``comm``, which it closes."""
    start = time.monotonic()
    try:
        comm.allreduce(np.zeros(length, np.float32), algorithm=algorithm)
        return "returned", time.monotonic() - start, ""
    except Exception as exc:  # noqa: BLE001 - the result
        return type(exc).__name__, time.monotonic() - start, str(exc)
    finally:
        comm.close()


def _calls(kind: str, world: int, algorithm_of, length_of=lambda rank: 6):
    """Each rank's (error type name, seconds, text) for one allreduce with its own algorithm and length."""
    store = LocalHub(world) if kind == "local" else dist.HashStore()
    prefix = f"t{time.monotonic_ns()}"

    def body(rank: int):
        t = _connect(kind, rank, world, store, prefix)
        comm = Communicator(t, timeout=TIMEOUT)
        return _allreduce_once(comm, algorithm_of(rank), length_of(rank))

    return on_threads(world, body, timeout=60)


def _told_at_once(results) -> None:
    assert all(name == "MismatchError" and took < TIMEOUT / 2 for name, took, _ in results), results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["local", "shm", "tcp"])
def test_a_rank_on_the_ring_among_central_ones_is_a_mismatch_on_every_rank(kind):
    """Rank 1 (ring) sends to rank 2 and waits on rank 0; rank 0 (central's master) waits on
    rank 1, rank 2 on rank 0: rank 1's message waited unread at rank 2 until the deadline."""
    results = _calls(kind, 3, lambda rank: "ring" if rank == 1 else "central")
    _told_at_once(results)
    said = " ".join(text for _, _, text in results)
    assert "algorithm=ring" in said and "algorithm=central" in said, said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["local", "shm", "tcp"])
def test_lengths_either_side_of_auto_s_threshold_are_a_mismatch_on_every_rank(kind):
    """80 KB on rank 0 (auto: ring), 60 KB on the others (halving_doubling): rank 1 raised
    MismatchError and told every peer, but ranks 0, 2 and 3 waited on each other, not on it."""
    _told_at_once(_calls(kind, 4, lambda rank: "auto", lambda rank: 20000 if rank == 0 else 15000))



@pytest.mark.timeout(60)
@pytest.mark.parametrize("odd", ["halving_doubling", "hierarchical"])
def test_a_rank_that_waits_first_on_central_s_master_is_a_mismatch_on_every_rank(odd):
    """Rank 1 waits first for rank 0 (halving_doubling: for its extra's fold; hierarchical, on
    hosts a, b, b: rank 0 takes 1 for a cross-ring peer, 1 waits for its spare 2), and rank 0,
    central's master, waits for rank 1's buffer: with nothing sent between them, nothing was
    unread anywhere to tell them (schedule.py, *first sends*)."""
    world = 3
    store = LocalHub(world)

    def body(rank: int):
        comm = Communicator(store.transport(rank), timeout=TIMEOUT, host_ids=["a", "b", "b"])
        return _allreduce_once(comm, odd if rank == 1 else "central")

    _told_at_once(on_threads(world, body, timeout=60))


@pytest.mark.parametrize("p", range(2, 10))
def test_no_halving_doubling_rank_starts_by_only_receiving(p):
    from ringtrain.collectives import schedule

    for pos in range(p):
        for n in (0, 1, 7):
            assert schedule.halving_doubling_plan(n, p, pos)[0].sends, (p, pos, n)


def _composite_calls(hosts: list[str], algorithm_of):
    """As _calls, over the ``auto`` transport of a cluster: shm among a host's ranks, tcp between hosts."""
    from ringtrain.transport.composite import CompositeTransport
    from ringtrain.transport.shm import ShmTransport
    from ringtrain.transport.tcp import TcpTransport

    world, store, prefix = len(hosts), dist.HashStore(), f"c{time.monotonic_ns()}"

    def body(rank: int):
        same = [r for r in range(world) if hosts[r] == hosts[rank]]
        shm = ShmTransport.connect(rank, world, store, timeout=10, prefix=prefix + "shm/", peers=same)
        tcp = TcpTransport.connect(rank, world, store, secret=None, timeout=10, host_ids=hosts, prefix=prefix + "tcp/")
        comm = Communicator(CompositeTransport(rank, world, {r: shm for r in same if r != rank}, tcp),
                            timeout=TIMEOUT, host_ids=hosts)
        return _allreduce_once(comm, algorithm_of(rank))

    return on_threads(world, body, timeout=60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts, odd, theirs, ours", [("aabb", 3, "ring", "halving_doubling"),
                                                      ("aabb", 2, "central", "hierarchical"),
                                                      ("aabbb", 3, "central", "ring"),
                                                      ("aabbb", 4, "halving_doubling", "central")])
def test_over_the_auto_transport_across_hosts_a_mismatch_is_told_over_the_idle_half_too(hosts, odd, theirs, ours):
    """An exchange over one half of the auto transport (shm within a host, tcp between hosts)
    watched only that half: a mismatched message or an abort waiting on the other half was not
    seen, and ranks waited out the deadline (transport.base, also_watch)."""
    results = _composite_calls(list(hosts), lambda rank: ours if rank == odd else theirs)
    assert all(name in ("MismatchError", "PeerLost") and took < TIMEOUT / 2 for name, took, _ in results), results
    assert any(name == "MismatchError" for name, _, _ in results), results
