"""Ctrl-C ends a wait inside gloo (transport.ctrl_c): the watcher, the breaker, and two ranks
on transport="torch" where one is interrupted while it waits for the other."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from ringtrain.transport import ctrl_c

from mp_harness import run_ranks

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="sockets are found in /proc/self/fd")


def _blocked_recv(sock: socket.socket, breaker: ctrl_c.Breaker, got: list) -> threading.Thread:
    """A thread in ``sock.recv`` under ``breaker.waiting()``, as a gloo wait would be."""
    def run():
        with breaker.waiting():
            got.append(sock.recv(1))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    end = time.monotonic() + 5  # (until it is in the wait: a fixed sleep may end before a starved thread gets there)
    while not breaker._waits:
        assert time.monotonic() < end, "the thread never began its wait"
        time.sleep(0.001)
    time.sleep(0.05)  # (and into recv: a break between the two still ends recv, with b"")
    return t


@pytest.fixture
def pair():
    before = ctrl_c._socket_ids()
    (a, b), made = ctrl_c.made_sockets(socket.socketpair)
    yield a, b, made, before
    a.close()
    b.close()


def test_made_sockets_are_the_new_ones(pair):
    a, b, made, before = pair
    assert {fd for fd, _ in made} == {a.fileno(), b.fileno()}
    assert not made & before


def test_break_shuts_down_only_while_a_wait_is_in_progress(pair):
    a, b, made, _ = pair
    breaker = ctrl_c.Breaker(made)
    assert breaker.break_if_waiting() is False  # no wait: the sockets are left as they are
    b.sendall(b"x")
    assert a.recv(1) == b"x" and not breaker.broken

    got: list = []
    t = _blocked_recv(a, breaker, got)
    assert breaker.break_if_waiting() is True
    t.join(2)
    assert not t.is_alive() and got == [b""]  # woken: the connection reads as closed
    assert breaker.broken


def test_break_leaves_a_listener_listening():
    listener, made = ctrl_c.made_sockets(lambda: socket.create_server(("127.0.0.1", 0)))
    a, b = socket.socketpair()
    breaker = ctrl_c.Breaker(made | {(a.fileno(), os.fstat(a.fileno()).st_ino)})
    got: list = []
    t = _blocked_recv(a, breaker, got)
    with listener, a, b:
        breaker.break_if_waiting()
        t.join(2)
        assert got == [b""]
        with socket.create_connection(listener.getsockname(), timeout=2):  # still accepts
            conn, _ = listener.accept()
            conn.close()


def test_a_closed_descriptor_taken_by_another_socket_is_not_touched():
    a, b = socket.socketpair()
    made = frozenset({(a.fileno(), os.fstat(a.fileno()).st_ino)})
    fd = a.fileno()
    a.close()
    b.close()
    c, d = socket.socketpair()  # the lowest free numbers: c most likely takes a's
    with c, d:
        breaker = ctrl_c.Breaker(made)
        got: list = []
        t = _blocked_recv(c, breaker, got)
        breaker.break_if_waiting()
        time.sleep(0.2)
        assert t.is_alive() or c.fileno() != fd  # not shut down: another socket's number now
        d.sendall(b"y")
        t.join(2)
        assert got == [b"y"]


def _interrupt_self_while(breaker: ctrl_c.Breaker, sock: socket.socket, got: list) -> threading.Thread:
    t = _blocked_recv(sock, breaker, got)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the KeyboardInterrupt ends it
    return t


def test_ctrl_c_breaks_a_watched_wait_and_the_wakeup_fd_is_given_back(pair):
    a, b, made, _ = pair
    breaker = ctrl_c.Breaker(made)
    ctrl_c.watch(breaker)
    try:
        got: list = []
        t = _interrupt_self_while(breaker, a, got)
        t.join(2)
        assert got == [b""] and breaker.broken
    finally:
        ctrl_c.unwatch(breaker)
    assert signal.set_wakeup_fd(-1) == -1  # nothing of ours is left behind
    assert ctrl_c._watcher is None


def test_a_handler_of_the_scripts_own_is_left_to_decide(pair):
    a, b, made, _ = pair
    breaker = ctrl_c.Breaker(made)
    seen = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    ctrl_c.watch(breaker)
    try:
        got: list = []
        t = _blocked_recv(a, breaker, got)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        assert seen == [signal.SIGINT] and t.is_alive() and not breaker.broken
        b.sendall(b"z")
        t.join(2)
        assert got == [b"z"]
    finally:
        ctrl_c.unwatch(breaker)
        signal.signal(signal.SIGINT, before)


def test_a_wakeup_fd_held_by_someone_else_stays_theirs(pair):
    a, b, made, _ = pair
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    try:
        breaker = ctrl_c.Breaker(made)
        ctrl_c.watch(breaker)  # a no-op: Ctrl-C then waits for the wait, as before
        assert ctrl_c._watcher is None
        ctrl_c.unwatch(breaker)
        assert signal.set_wakeup_fd(w) == w
    finally:
        signal.set_wakeup_fd(-1)
        os.close(r)
        os.close(w)


def _interrupted_in_torch_transport(rank, world_size, port):
    """Rank 1 waits in gloo for rank 0, which sends it SIGINT and comes only 3 s later. Times
    are CLOCK_MONOTONIC, one clock for every process of the machine."""
    import ringtrain

    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="torch", timeout=30)
    pids = np.zeros(world_size, dtype=np.int64)
    pids[rank] = os.getpid()
    comm.allgather(pids)
    x = np.arange(5, dtype=np.float32)
    if rank == 1:
        try:
            comm.allreduce(x)
            time.sleep(5)  # (where the KeyboardInterrupt lands if the call ends first)
        except KeyboardInterrupt:
            return "interrupted", time.monotonic()
        return "not interrupted", time.monotonic()
    time.sleep(1.0)
    killed = time.monotonic()
    os.kill(int(pids[1]), signal.SIGINT)
    time.sleep(3.0)
    t0 = time.monotonic()
    try:
        comm.allreduce(x)
    except ringtrain.CommError as exc:
        return type(exc).__name__, str(exc), killed, time.monotonic() - t0
    return "no error", "", killed, time.monotonic() - t0


@pytest.mark.timeout(90)
def test_ctrl_c_ends_a_rank_waiting_in_gloo_and_its_peer_hears_of_it():
    r0, r1 = run_ranks(_interrupted_in_torch_transport, 2, timeout=60)
    kind, text, killed, took = r0
    assert r1[0] == "interrupted", r1
    # at the Ctrl-C, not once rank 0 came 3 s later (before the watcher: only then, or at the
    # 30 s deadline)
    assert r1[1] - killed < 2.0, (r1[1] - killed, r0)
    assert kind == "PeerLost" and "rank 1" in text, r0  # the interrupted rank is named
    assert took < 5.0, r0
