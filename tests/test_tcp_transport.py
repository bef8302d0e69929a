"""The tcp transport over real sockets: ranks as threads of this process, and as real processes.

Test data makes every (rank, element) distinct and integer valued, so results are compared
exactly.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringtrain.errors import AuthError, CommError, CommTimeout, MismatchError, PeerLost, ProtocolError
from ringtrain.transport import local, tcp, tcp_setup, wire
from ringtrain.transport.base import CallHeader, Recv, Send
from ringtrain.transport.tcp import TcpTransport
from ringtrain.transport.tcp_setup import Listener
from sockets import congestion

pytestmark = pytest.mark.timeout(60)

SECRET = b"test-secret-0123456789"
CALL = CallHeader(1, "allreduce", "sum", "ring", "float32", 0)


def add(out, incoming):
    np.add(out, incoming, out=out)


def on_threads(n, fn, timeout=30.0):
    """Run fn(rank) on n threads; return each rank's result or exception (a hang fails the test)."""
    return local.on_threads(n, fn, timeout)


def build_mesh(world, host_ids=None, secrets_=None, timeout=10.0, prefix="t", **kw):
    """Connect ``world`` ranks on threads; ``timeout`` may be one value or one per rank."""
    store = dist.HashStore()
    host_ids = host_ids or ["h"] * world
    secrets_ = secrets_ or [SECRET] * world
    timeouts = timeout if isinstance(timeout, list) else [timeout] * world

    def connect(r):
        return TcpTransport.connect(
            r, world, store, secret=secrets_[r], timeout=timeouts[r], host_ids=host_ids, prefix=prefix, **kw
        )

    return on_threads(world, connect, max(timeouts) + 10)


@pytest.fixture
def mesh():
    made = []

    def make(world, **kw):
        ts = build_mesh(world, **kw)
        made.extend(t for t in ts if isinstance(t, TcpTransport))
        for t in ts:
            if isinstance(t, BaseException):
                raise t
        return ts

    yield make
    for t in made:
        t.close()


def values(rank, n, dtype=np.float32, stride=1):
    return (np.arange(n, dtype=np.int64) * stride + rank * n).astype(dtype)


def deadline(s=10.0):
    return time.monotonic() + s


# --- correctness on threads ------------------------------------------------------------------


@pytest.mark.parametrize(
    "world, hosts",
    [(1, None), (2, None), (2, ["a", "b"]), (3, ["a", "a", "b"]), (4, ["a", "b", "a", "b"])],
)
@pytest.mark.parametrize("n", [0, 1, 1023, 70_001])
@pytest.mark.parametrize("thread_send_bytes", [None, 64], ids=["inline", "sender-threads"])
def test_ring_shift_and_reduce_exact(mesh, world, hosts, n, thread_send_bytes):
    # small segments: many per message; tiny thread_send_bytes: the sender threads carry most frames
    ts = mesh(world, host_ids=hosts, segment_bytes=4096, thread_send_bytes=thread_send_bytes)

    def step(r):
        t = ts[r]
        right, left = (r + 1) % world, (r - 1) % world
        got = np.full(n, -1, np.float32)
        t.exchange([Send(right, values(r, n))], [Recv(left, got)], CALL, deadline())
        acc = values(r, n, np.int64)
        t.exchange([Send(right, values(r, n, np.int64))], [Recv(left, acc, add)], CALL, deadline())
        return got, acc

    for r, res in enumerate(on_threads(world, step)):
        assert not isinstance(res, BaseException), res
        got, acc = res
        left = (r - 1) % world
        np.testing.assert_array_equal(got, values(left, n))
        np.testing.assert_array_equal(acc, values(r, n, np.int64) + values(left, n, np.int64))


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32, np.uint16, np.uint8])
def test_dtypes_and_unaligned_segments(mesh, dtype):
    ts = mesh(2, segment_bytes=1000)  # not a multiple of 8: rounded down per dtype
    n = 777

    def step(r):
        acc = values(r, n, dtype, stride=0) + 1
        ts[r].exchange([Send(1 - r, values(r, n, dtype, stride=0) + 1)], [Recv(1 - r, acc, add)], CALL, deadline())
        return acc

    res = on_threads(2, step)
    for r in range(2):
        np.testing.assert_array_equal(res[r], (values(0, n, dtype, 0) + 1) + (values(1, n, dtype, 0) + 1))


@pytest.mark.parametrize("thread_send_bytes", [None, 64], ids=["inline", "sender-threads"])
def test_all_to_all_with_every_peer_at_once(mesh, thread_send_bytes):
    world, n = 4, 50_000
    ts = mesh(world, host_ids=["a", "a", "b", "b"], segment_bytes=8192, thread_send_bytes=thread_send_bytes)

    def step(r):
        acc = values(r, n, np.int64)
        others = [p for p in range(world) if p != r]
        ts[r].exchange(
            [Send(p, values(r, n, np.int64)) for p in others], [Recv(p, acc, add) for p in others], CALL, deadline()
        )
        return acc

    expect = sum(values(r, n, np.int64) for r in range(world))
    for res in on_threads(world, step):
        np.testing.assert_array_equal(res, expect)


def test_many_exchanges_keep_order_and_headers(mesh):
    ts = mesh(2, thread_send_bytes=24)  # some frames inline, some in the sender threads

    def step(r):
        out = []
        for seq in range(200):
            call = CallHeader(seq, "send", dtype="int64", numel=seq % 7)
            buf = np.empty(seq % 7, np.int64)
            mine = np.arange(seq % 7, dtype=np.int64) + 1000 * seq + r
            sends = [Send(1 - r, mine)] if (seq + r) % 3 else []
            ts[r].exchange(sends, [Recv(1 - r, buf)] if (seq + 1 - r) % 3 else [], call, deadline())
            out.append(buf.copy() if (seq + 1 - r) % 3 else None)
        return out

    res = on_threads(2, step)
    for r in range(2):
        for seq, buf in enumerate(res[r]):
            if buf is not None:
                np.testing.assert_array_equal(buf, np.arange(seq % 7) + 1000 * seq + (1 - r))


def test_ping_pong_while_sender_threads_finish(mesh):
    """The peer's next frame and the sender thread's wake-up often arrive in one poll."""
    ts = mesh(2, thread_send_bytes=1)
    big = np.arange(1 << 18, dtype=np.int64)

    def step(r):
        got = np.empty_like(big)
        small = np.empty(3, np.int64)
        for k in range(15):
            if r == 0:
                ts[0].exchange([Send(1, big + k)], [], CALL, deadline())
                ts[0].exchange([], [Recv(1, small)], CALL, deadline())
                assert small.tolist() == [k, k, k]
            else:
                ts[1].exchange([], [Recv(0, got)], CALL, deadline())
                assert got[-1] == big[-1] + k
                ts[1].exchange([Send(0, np.full(3, k, np.int64))], [], CALL, deadline())

    assert on_threads(2, step) == [None, None]


def test_self_send_and_receive(mesh):
    (t,) = mesh(1)
    acc = np.arange(5, dtype=np.int32)
    t.exchange([Send(0, np.ones(5, np.int32))], [Recv(0, acc, add)], CALL, deadline())
    np.testing.assert_array_equal(acc, np.arange(5) + 1)


def test_receive_straight_into_the_callers_buffer(mesh):
    ts = mesh(2)
    dest = np.zeros(1 << 16, np.float32)
    address = dest.__array_interface__["data"][0]

    def step(r):
        if r == 0:
            ts[0].exchange([Send(1, values(0, dest.size))], [], CALL, deadline())
        else:
            ts[1].exchange([], [Recv(0, dest)], CALL, deadline())

    on_threads(2, step)
    assert dest.__array_interface__["data"][0] == address
    np.testing.assert_array_equal(dest, values(0, dest.size))


def test_bad_arguments(mesh):
    store = dist.HashStore()
    kw = dict(secret=None, timeout=1.0, host_ids=["h"], prefix="bad")
    with pytest.raises(ValueError, match="rank"):
        TcpTransport.connect(1, 1, store, **kw)
    with pytest.raises(ValueError, match="timeout"):
        TcpTransport.connect(0, 1, store, **{**kw, "timeout": 0})
    with pytest.raises(ValueError, match="host_ids"):
        TcpTransport.connect(0, 1, store, **{**kw, "host_ids": ["a", "b"]})
    with pytest.raises(ValueError, match="secret"):
        TcpTransport.connect(0, 1, store, **{**kw, "secret": b""})
    ts = mesh(2)
    with pytest.raises(ValueError, match="contiguous"):
        ts[0].exchange([Send(1, np.zeros(10)[::2])], [], CALL, deadline())
    with pytest.raises(ValueError, match="no connection"):
        ts[0].exchange([Send(5, np.zeros(1))], [], CALL, deadline())
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ts[0].exchange([], [Recv(1, frozen)], CALL, deadline())


def test_default_listener_binds_the_interface_toward_the_store(monkeypatch):
    """Not every interface: the one that reaches the store's host (MASTER_ADDR)."""
    bound = []
    real = Listener.__init__

    def spy(self, me, **kw):
        real(self, me, **kw)
        bound.append([s.getsockname()[0] for s in self._socks if s.family != socket.AF_UNIX])

    monkeypatch.setattr(Listener, "__init__", spy)
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)

    def connect(r):
        # one client per rank: a TCPStore client blocked in wait() holds its connection
        store = dist.TCPStore("127.0.0.1", master.port, 1, False, timeout=datetime.timedelta(seconds=10))
        return TcpTransport.connect(r, 2, store, secret=SECRET, timeout=10, host_ids=["a", "b"], prefix="bind")

    ts = on_threads(2, connect)
    for t in ts:
        assert isinstance(t, TcpTransport), t
        t.close()
    assert bound == [["127.0.0.1"], ["127.0.0.1"]]


def test_a_stale_endpoint_in_the_store_is_read_again(mesh):
    """A store reused by a second communicator may still hold the first one's endpoints."""
    store = dist.HashStore()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    store.set("re/tcp/0", '{"tcp": ["127.0.0.1", %d]}' % dead.getsockname()[1])
    dead.close()  # nothing listens there now

    def connect(r):
        if r == 0:
            time.sleep(0.3)  # rank 1 finds the stale endpoint first
        return TcpTransport.connect(r, 2, store, secret=SECRET, timeout=10, host_ids=["a", "b"], prefix="re")

    ts = on_threads(2, connect)
    try:
        assert all(isinstance(t, TcpTransport) for t in ts), ts
    finally:
        for t in ts:
            if isinstance(t, TcpTransport):
                t.close()


# --- errors on threads -----------------------------------------------------------------------


def test_mismatched_headers_raise_on_both_ranks(mesh):
    ts = mesh(2)

    def step(r):
        call = CallHeader(4, "allreduce", "sum" if r == 0 else "max", "ring", "float32", 8)
        ts[r].exchange([Send(1 - r, np.zeros(8, np.float32))], [Recv(1 - r, np.zeros(8, np.float32))], call, deadline())

    res = on_threads(2, step)
    for r in range(2):
        assert isinstance(res[r], MismatchError), res[r]
        assert f"rank {r} called" in str(res[r]) and f"rank {1 - r} called" in str(res[r])
        assert "op=sum" in str(res[r]) and "op=max" in str(res[r])


def test_a_connection_left_mid_frame_is_not_reused(mesh):
    """After a MismatchError the payload is still unread: a later call must not parse it as a frame."""
    ts = mesh(2)
    other = CallHeader(9, "broadcast", dtype="float32", numel=3, root=1)
    ts[1].exchange([Send(0, np.arange(3, dtype=np.float32))], [], other, deadline())
    with pytest.raises(MismatchError):
        ts[0].exchange([], [Recv(1, np.zeros(3, np.float32))], CALL, deadline())
    with pytest.raises(CommError, match="half-read"):
        ts[0].exchange([], [Recv(1, np.zeros(3, np.float32))], other, deadline())


def test_one_send_and_one_receive_per_peer(mesh):
    ts = mesh(2)
    with pytest.raises(ValueError, match="more than one Send"):
        ts[0].exchange([Send(1, np.zeros(2)), Send(1, np.zeros(2))], [], CALL, deadline())
    with pytest.raises(ValueError, match="more than one Recv"):
        ts[0].exchange([], [Recv(1, np.zeros(2)), Recv(1, np.zeros(2))], CALL, deadline())
    # nothing was sent or armed by the refused calls: the pair still works
    on_threads(2, lambda r: ts[r].exchange([Send(1 - r, np.ones(2))], [Recv(1 - r, np.zeros(2))], CALL, deadline()))


def test_payload_size_mismatch(mesh):
    ts = mesh(2)

    def step(r):
        if r == 0:
            ts[0].exchange([Send(1, np.zeros(10, np.float32))], [], CALL, deadline(2))
        else:
            ts[1].exchange([], [Recv(0, np.zeros(9, np.float32))], CALL, deadline(2))

    res = on_threads(2, step)
    assert isinstance(res[1], MismatchError) and "expected 36 bytes" in str(res[1])


@pytest.mark.parametrize(
    "error", [MismatchError("shapes differ"), CommTimeout("rank 9 is slow"), ValueError("user bug")]
)
def test_abort_reaches_a_waiting_peer_with_the_same_type(mesh, error):
    ts = mesh(3)

    def step(r):
        if r == 0:
            time.sleep(0.1)
            ts[0].abort(error)
            return None
        ts[r].exchange([], [Recv(0, np.zeros(4, np.float32))], CALL, deadline())

    res = on_threads(3, step)
    expected = type(error) if isinstance(error, CommError) else CommError
    for r in (1, 2):
        assert type(res[r]) is expected, res[r]
        assert str(res[r]).startswith("rank 0 aborted: ") and str(error) in str(res[r])


@pytest.mark.parametrize("thread_send_bytes", [None, 1], ids=["inline", "sender-threads"])
@pytest.mark.parametrize("hosts", [["a", "b"], ["a", "a"]], ids=["tcp", "unix"])
def test_abort_reaches_a_peer_blocked_sending(mesh, thread_send_bytes, hosts):
    ts = mesh(2, host_ids=hosts, thread_send_bytes=thread_send_bytes)
    big = np.zeros(32 << 20, np.uint8)  # far more than the socket buffers hold

    def step(r):
        if r == 1:
            time.sleep(0.3)
            ts[1].abort(MismatchError("rank 1 saw rank 7 call broadcast"))
            return None
        t0 = time.monotonic()
        try:
            ts[0].exchange([Send(1, big)], [], CALL, deadline(10))
        finally:
            res_time.append(time.monotonic() - t0)

    res_time: list = []
    res = on_threads(2, step)
    # the ABORT frame waiting in rank 0's receive buffer wins over the broken pipe
    assert isinstance(res[0], MismatchError), res[0]
    assert "rank 1 aborted: rank 1 saw rank 7" in str(res[0])
    assert res_time[0] < 5


def test_tcp_receive_waits_for_big_chunks_but_checks_every_header_at_once(mesh):
    """SO_RCVLOWAT: a large frame wakes the receiver per RCVLOWAT_BYTES, its header at once
    (a wrong length is a MismatchError straight away, not a timeout), and every socket is
    back to waking for any byte after an exchange (an ABORT frame is short)."""
    ts = mesh(2, host_ids=["a", "b"])
    n = 3 * tcp.RCVLOWAT_BYTES + 12345  # not a multiple of the low-water mark

    def big(r):
        got = values(r, n // 4, np.int64)
        ts[r].exchange([Send(1 - r, values(r, n // 4, np.int64))], [Recv(1 - r, got, add)], CALL, deadline())
        return got

    res = on_threads(2, big)
    for r in range(2):
        np.testing.assert_array_equal(res[r], values(0, n // 4, np.int64) + values(1, n // 4, np.int64))
    for t in ts:
        for conn in t._conns.values():
            assert conn.lowat == 1
            assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1

    def short(r):
        if r == 1:
            ts[1].exchange([Send(0, np.zeros(10, np.uint8))], [], CALL, deadline())
            return None
        t0 = time.monotonic()
        try:
            ts[0].exchange([], [Recv(1, np.zeros(1 << 20, np.uint8))], CALL, deadline(20))
        finally:
            took.append(time.monotonic() - t0)

    took: list = []
    res = on_threads(2, short)
    assert isinstance(res[0], MismatchError) and "announced 10" in str(res[0]), res[0]
    assert took[0] < 5


def test_peer_that_closes_is_peer_lost(mesh):
    ts = mesh(2)
    ts[1].close()
    with pytest.raises(PeerLost, match="rank 1"):
        ts[0].exchange([], [Recv(1, np.zeros(4))], CALL, deadline())
    with pytest.raises(PeerLost, match="gone"):  # the connection stays dead
        ts[0].exchange([Send(1, np.zeros(4))], [], CALL, deadline())


def test_silent_peer_times_out_naming_it(mesh):
    ts = mesh(3)
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match=r"receiving from rank 2 .*call #1 allreduce"):
        ts[0].exchange([Send(1, np.zeros(4))], [Recv(2, np.zeros(4))], CALL, deadline(0.3))
    assert time.monotonic() - t0 < 2


def sender_threads():
    return [th for th in threading.enumerate() if th.name.startswith("ringtrain-tcp-send")]


def test_close_is_idempotent_and_ends_sockets_and_threads(mesh):
    # Threads are compared as sets: an earlier test's sender thread may still be ending.
    # A send the socket buffer takes whole leaves inline, with no thread: 4 MiB sometimes did, so
    # the frames are 32 MiB, and the test asks for the threads it made (one per connection used).
    before = set(sender_threads())
    ts = mesh(3, thread_send_bytes=1)
    on_threads(3, lambda r: ts[r].exchange(
        [Send(p, np.zeros(1 << 22)) for p in range(3) if p != r],
        [Recv(p, np.zeros(1 << 22)) for p in range(3) if p != r], CALL, deadline()))
    mine = set(sender_threads()) - before
    assert 1 <= len(mine) <= 6
    socks = [c.sock for t in ts for c in t._conns.values()]
    for t in ts:
        t.close()
        t.close()
    assert all(s.fileno() == -1 for s in socks)
    assert not [th for th in mine if th.is_alive()]
    with pytest.raises(CommError, match="closed"):
        ts[0].exchange([], [], CALL, deadline())


def test_failed_exchange_with_a_sender_thread_mid_frame_then_abort(mesh):
    """Rank 0's big send is in its sender thread when its receive fails; abort must not
    interleave an ABORT frame into that DATA frame: rank 1 sees PeerLost, not garbage."""
    ts = mesh(2, thread_send_bytes=1)
    big = np.zeros(16 << 20, np.uint8)

    def step(r):
        if r == 0:
            try:
                ts[0].exchange([Send(1, big)], [Recv(1, np.zeros(4, np.float32))], CALL, deadline(0.5))
            except CommTimeout as exc:
                ts[0].abort(exc)
                return "timeout"
        time.sleep(1.0)  # rank 1 reads nothing until rank 0 gave up
        ts[1].exchange([], [Recv(0, np.zeros(big.size, np.uint8))], CALL, deadline(5))

    res = on_threads(2, step)
    assert res[0] == "timeout"
    assert isinstance(res[1], PeerLost), res[1]


# --- set-up: authentication and refusals -------------------------------------------------------


def test_wrong_secret_is_refused_before_data(caplog):
    caplog.set_level(logging.WARNING)
    wrong = b"wrong-secret-9999"
    res = build_mesh(2, secrets_=[SECRET, wrong], timeout=[1.0, 10.0])
    assert isinstance(res[1], AuthError), res[1]  # the connecting side
    assert isinstance(res[0], CommTimeout), res[0]  # the listener refused it and waited on
    for text in [str(res[0]), str(res[1]), caplog.text]:
        assert SECRET.decode() not in text and wrong.decode() not in text
    assert "refused a connection" in caplog.text


@pytest.mark.parametrize("secrets_", [[SECRET, None], [None, SECRET]])
def test_missing_secret_is_refused(secrets_):
    res = build_mesh(2, secrets_=secrets_, timeout=[1.0, 10.0])
    assert isinstance(res[1], AuthError), res[1]
    assert isinstance(res[0], CommTimeout), res[0]


def test_without_secret_a_handshake_still_runs(mesh):
    ts = mesh(3, secrets_=[None] * 3)
    assert all(isinstance(t, TcpTransport) for t in ts)


def test_peer_of_another_job_is_a_protocol_error():
    store = dist.HashStore()
    prefixes = ["jobA", "jobB"]

    def connect(r):
        if r == 1:  # rank 1 of job B finds rank 0 of job A's endpoint under its own key
            while not store.check(["jobA/tcp/0"]):
                time.sleep(0.01)
            store.set("jobB/tcp/0", store.get("jobA/tcp/0"))
        return TcpTransport.connect(r, 2, store, secret=None, timeout=[1.0, 10.0][r], host_ids=["h", "h"],
                                    prefix=prefixes[r])

    res = on_threads(2, connect)
    assert isinstance(res[1], ProtocolError) and "another job" in str(res[1])
    assert isinstance(res[0], CommTimeout)


class ListenerThread:
    """Rank 0's listener of a 2-rank job, admitting rank 1, on a thread."""

    def __init__(self, secret=SECRET, handshake_timeout=2.0, wait=20.0):
        self.me = tcp_setup.Identity(0, 2, "fuzz", secret)
        self.listener = Listener(self.me, unix=True, tcp=True, handshake_timeout=handshake_timeout)
        self.result: dict = {}
        self.thread = threading.Thread(target=self._run, args=(wait,), daemon=True)
        self.thread.start()

    def _run(self, wait):
        try:
            self.result["socks"] = self.listener.accept({1}, deadline(wait))
        except BaseException as exc:  # noqa: BLE001
            self.result["error"] = exc

    def raw(self, kind="tcp"):
        if kind == "tcp":
            return socket.create_connection(tuple(self.listener.endpoints["tcp"]), timeout=5)
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(tcp_setup._unix_address(self.listener.endpoints["unix"]))
        return s

    def legit(self, secret=SECRET):
        me = tcp_setup.Identity(1, 2, "fuzz", secret)
        return tcp_setup.dial(self.listener.endpoints, True, me, 0, deadline(5))

    def finish(self):
        self.thread.join(25)
        assert not self.thread.is_alive()
        self.listener.close()
        for s in self.result.get("socks", {}).values():
            s.close()
        return self.result


def read_until_closed(sock, limit=1 << 16):
    got = b""
    while len(got) < limit:
        try:
            chunk = sock.recv(4096)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        got += chunk
    return got


def test_replayed_handshake_is_refused():
    lt = ListenerThread()
    # Record a genuine connector's bytes, then play them to the listener again.
    me = tcp_setup.Identity(1, 2, "fuzz", SECRET)
    hello = wire.Hello.fresh(wire.CONNECT, True, 1, 0, 2, me.job).pack()
    s = lt.raw()
    s.sendall(hello)
    answer = s.recv(wire.HELLO_SIZE + wire.MAC_SIZE, socket.MSG_WAITALL)
    recorded_mac = me.mac(wire.CONNECT, hello, answer[: wire.HELLO_SIZE])
    s.close()  # (the listener refuses this one: it never got the MAC)
    s = lt.raw()
    s.sendall(hello + recorded_mac)  # the replay: same hello, same MAC, but a new listener nonce
    assert read_until_closed(s)[wire.HELLO_SIZE + wire.MAC_SIZE :] == b""  # no ACK, closed
    s.close()
    lt.legit().close()
    res = lt.finish()
    assert set(res["socks"]) == {1}
    assert lt.listener.refused == 2


@pytest.mark.timeout(30)
def test_strangers_failed_handshakes_do_not_grow_the_nonce_set():
    """Only a handshake whose MAC verified records its nonce: strangers (a wrong secret, a
    random MAC, a hello and no MAC) leave the listener's set as it was, however many come."""
    lt = ListenerThread()
    job = tcp_setup.Identity(1, 2, "fuzz", SECRET).job
    rounds = 10
    for _ in range(rounds):
        with pytest.raises(AuthError):  # a connector with another secret: refused by its own check
            lt.legit(secret=b"some other secret").close()
        for mac in (os.urandom(wire.MAC_SIZE), b""):  # a random MAC; none at all
            s = lt.raw()
            s.sendall(wire.Hello.fresh(wire.CONNECT, True, 1, 0, 2, job).pack())
            s.recv(wire.HELLO_SIZE + wire.MAC_SIZE, socket.MSG_WAITALL)
            s.sendall(mac)
            if not mac:
                s.shutdown(socket.SHUT_WR)
            assert read_until_closed(s) == b""  # no ACK, closed
            s.close()
    # Every stranger's handshake was answered (read above), so the listener is past each.
    assert lt.listener._seen == set()
    lt.legit().close()
    res = lt.finish()
    assert set(res["socks"]) == {1}
    assert lt.listener.refused == 3 * rounds
    assert len(lt.listener._seen) == 1  # the genuine peer's nonce


@pytest.mark.timeout(30)
def test_a_genuine_handshake_replayed_after_it_succeeded_is_refused_by_its_nonce():
    me, peer = tcp_setup.Identity(0, 2, "fuzz", SECRET), tcp_setup.Identity(1, 2, "fuzz", SECRET)
    seen: set[bytes] = set()
    sent: list[bytes] = []

    def accept_on_pair(connect_side):
        a, b = socket.socketpair()
        with a, b:
            out: dict = {}
            th = threading.Thread(target=lambda: out.update(r=_catch(tcp_setup.accept_handshake, a, me, {1}, seen,
                                                                     deadline(5))), daemon=True)
            th.start()
            connect_side(b)
            b.shutdown(socket.SHUT_WR)
            th.join(10)
            assert not th.is_alive()
            return out["r"]

    def genuine(sock):
        real_send = sock.sendall

        class Recording:  # a socket that records what the connector sends
            def __getattr__(self, name):
                return getattr(sock, name)

            def sendall(self, data):
                sent.append(bytes(data))
                return real_send(data)

            def send(self, data):
                sent.append(bytes(data))
                return sock.send(data)

        tcp_setup.connect_handshake(Recording(), peer, 0, deadline(5))

    assert accept_on_pair(genuine) == 1
    assert len(seen) == 1
    hello = b"".join(sent)[: wire.HELLO_SIZE]

    def replay(sock):
        sock.sendall(hello + bytes(wire.MAC_SIZE))

    refused = accept_on_pair(replay)
    assert isinstance(refused, AuthError) and "replayed" in str(refused), refused
    assert len(seen) == 1


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test judges it
        return exc


@pytest.mark.parametrize("payload", [b"", b"GET / HTTP/1.1\r\n\r\n", b"RTHS" + bytes(200), os.urandom(68)])
def test_listener_survives_garbage_and_keeps_serving(payload):
    lt = ListenerThread()
    for kind in ("tcp", "unix"):
        s = lt.raw(kind)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            read_until_closed(s)
        except OSError:  # the listener may have refused and closed already
            pass
        s.close()
    lt.legit().close()
    res = lt.finish()
    assert "error" not in res and set(res["socks"]) == {1}
    assert lt.listener.refused == 2


def test_silent_connection_is_dropped_after_the_handshake_timeout():
    lt = ListenerThread(handshake_timeout=0.2)
    silent = lt.raw()
    lt.legit().close()
    res = lt.finish()
    silent.close()
    assert set(res["socks"]) == {1}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_silent_strangers_do_not_hold_back_a_genuine_peer(kind):
    """Handshakes run one at a time: 8 connections that said nothing, made ahead of rank 1, held it
    for 8 x the handshake timeout (8 x 2 s here, past its 5 s dial deadline; 40 s of a 30 s set-up
    with the default 5 s)."""
    lt = ListenerThread(handshake_timeout=2.0)
    strangers = [lt.raw(kind) for _ in range(8)]
    try:
        time.sleep(0.2)  # (the listener has accepted them all)
        t0 = time.monotonic()
        lt.legit().close()
        took = time.monotonic() - t0
        res = lt.finish()
    finally:
        for s in strangers:
            s.close()
    assert "error" not in res and set(res["socks"]) == {1}, res
    assert took < 1.8, took  # (one at a time, the first stranger alone held it 2 s)
    assert lt.listener.refused == 8  # (dropped when set-up ended: none of them was admitted)


@pytest.mark.timeout(30)
def test_stalled_handshakes_are_dropped_at_their_own_deadlines_side_by_side():
    """Each connection has handshake_timeout from its accept: 6 that stall (3 silent, 3 after a hello)
    are all refused about 0.5 s after they came, not one after another, and the listener waits on."""
    lt = ListenerThread(handshake_timeout=0.5)
    job = tcp_setup.Identity(1, 2, "fuzz", SECRET).job
    stalled = [lt.raw() for _ in range(3)]
    for _ in range(3):
        s = lt.raw("unix")
        s.sendall(wire.Hello.fresh(wire.CONNECT, True, 1, 0, 2, job).pack())  # then no MAC
        stalled.append(s)
    t0 = time.monotonic()
    while lt.listener.refused < 6 and time.monotonic() - t0 < 5:
        time.sleep(0.02)
    took = time.monotonic() - t0
    for s in stalled:
        assert read_until_closed(s)[wire.HELLO_SIZE + wire.MAC_SIZE:] == b""  # no ACK, closed
        s.close()
    assert lt.listener.refused == 6 and took < 2.0, (lt.listener.refused, took)  # (one after another: 3 s)
    assert lt.thread.is_alive()  # still waiting for rank 1
    lt.legit().close()
    res = lt.finish()
    assert set(res["socks"]) == {1} and lt.listener._seen and len(lt.listener._seen) == 1


@pytest.mark.timeout(30)
def test_a_flood_of_silent_strangers_past_the_cap_drops_the_oldest_not_the_genuine_peer(monkeypatch):
    monkeypatch.setattr(tcp_setup, "MAX_PENDING_HANDSHAKES", 4)
    lt = ListenerThread(handshake_timeout=10.0)
    strangers = [lt.raw() for _ in range(20)]
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        lt.legit().close()
        took = time.monotonic() - t0
        res = lt.finish()
    finally:
        for s in strangers:
            s.close()
    assert set(res["socks"]) == {1} and took < 5.0, (res, took)  # (behind the strangers: 10 s or more)
    assert lt.listener.refused == 20


@pytest.mark.timeout(60)
def test_silent_strangers_at_a_ranks_port_do_not_stall_the_mesh():
    """End to end through TcpTransport.connect: 8 silent connections to rank 0's published endpoint
    before rank 1 dials. Before: set-up took 40 s (8 x HANDSHAKE_TIMEOUT), past a 30 s timeout
    (CommTimeout on rank 0, PeerLost on rank 1); now as without them."""
    import json

    store = dist.HashStore()
    held: list[socket.socket] = []

    def connect(r):
        if r == 1:
            store.wait(["p/tcp/0"])
            endpoint = tuple(json.loads(bytes(store.get("p/tcp/0")))["tcp"])
            held.extend(socket.create_connection(endpoint, timeout=5) for _ in range(8))
            time.sleep(0.2)
        t0 = time.monotonic()
        t = TcpTransport.connect(r, 2, store, secret=SECRET, timeout=30.0, host_ids=["a", "b"], prefix="p")
        return t, time.monotonic() - t0

    try:
        res = on_threads(2, connect, timeout=40)
    finally:
        for s in held:
            s.close()
    for r in res:
        assert not isinstance(r, BaseException), res
        r[0].close()
    assert res[1][1] < 2.0, res


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(
        st.binary(max_size=200),
        st.builds(lambda tail: wire.HELLO_MAGIC + bytes([wire.VERSION]) + tail, st.binary(max_size=140)),
        st.builds(
            lambda rank, world, flags, role: wire.Hello(role, bool(flags), rank, 0, world, wire.job_digest("fuzz"), bytes(32)).pack()
            + os.urandom(32),
            st.integers(0, 3),
            st.integers(1, 4),
            st.integers(0, 1),
            st.sampled_from([wire.CONNECT, wire.ACCEPT]),
        ),
    )
)
def test_fuzz_listener(fuzz_listener, data):
    """Random, truncated and almost-right handshakes: each refused, the listener keeps serving."""
    s = fuzz_listener.raw()
    try:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        tail = read_until_closed(s)
    except OSError:
        tail = b""
    finally:
        s.close()
    assert wire.ACK not in tail[wire.HELLO_SIZE + wire.MAC_SIZE :]
    assert fuzz_listener.thread.is_alive()


@pytest.fixture(scope="module")
def fuzz_listener():
    lt = ListenerThread(handshake_timeout=1.0, wait=110.0)
    yield lt
    refused = lt.listener.refused
    lt.legit().close()  # after all that, a genuine peer still gets in
    res = lt.finish()
    assert "error" not in res and set(res["socks"]) == {1}, res
    assert refused >= 500


# --- hostile frames on an established connection ---------------------------------------------


def pair():
    """A transport for rank 0 whose connection to rank 1 is the other end of a socketpair."""
    a, b = socket.socketpair()
    return TcpTransport(0, 2, {1: a}), b


@pytest.mark.parametrize(
    "raw, error",
    [
        (b"X" * wire.FRAME_HEADER_SIZE, ProtocolError),
        (wire.encode_data_header(CALL, 1 << 39), MismatchError),  # claims 512 GiB: no allocation
        (wire.encode_data_header(CALL, wire.MAX_PAYLOAD)[:-8] + (2**63).to_bytes(8, "little"), ProtocolError),
        (wire.encode_data_header(CALL, 16)[:30], PeerLost),  # truncated, then closed
        (wire.encode_data_header(CALL, 16) + b"12345", PeerLost),  # payload cut short
        (wire.encode_abort(AuthError("x"))[:-1], PeerLost),  # ABORT cut short
    ],
)
def test_hostile_frames(raw, error):
    t, evil = pair()
    evil.sendall(raw)
    evil.shutdown(socket.SHUT_WR)
    tracemalloc.start()
    try:
        with pytest.raises(error):
            t.exchange([], [Recv(1, np.zeros(4, np.float32))], CALL, deadline(5))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    if error is ProtocolError:
        assert t._conns[1].dead and t._conns[1].sock.fileno() == -1  # that connection is closed
    t.close()
    evil.close()


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(
        st.binary(max_size=120),
        st.builds(lambda tail: wire.FRAME_MAGIC + bytes([wire.VERSION]) + tail, st.binary(max_size=120)),
        st.builds(
            lambda length, cut, kind: (
                wire.encode_data_header(CALL, length) if kind else wire.encode_abort(CommError("e" * length))
            )[: wire.FRAME_HEADER_SIZE + cut],
            st.integers(0, 40),
            st.integers(0, 40),
            st.booleans(),
        ),
    )
)
def test_fuzz_frames_on_a_connection(data):
    """Whatever a peer sends, the receive ends with data or a CommError, never a hang or a crash."""
    t, evil = pair()
    try:
        evil.sendall(data)
        evil.shutdown(socket.SHUT_WR)
        buf = np.zeros(4, np.float32)
        try:
            t.exchange([], [Recv(1, buf)], CALL, deadline(2))
        except CommError as exc:
            assert not isinstance(exc, CommTimeout)
        else:
            assert data[: wire.FRAME_HEADER_SIZE] == wire.encode_data_header(CALL, 16)
    finally:
        t.close()
        evil.close()


# --- real processes --------------------------------------------------------------------------


def _proc_main(rank, world, port, hosts, scenario, q):
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(50, exit=True, file=sys.stderr)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=20))
        t = TcpTransport.connect(rank, world, store, secret=SECRET, timeout=20, host_ids=hosts, prefix="mp")
        n = 300_001
        right, left = (rank + 1) % world, (rank - 1) % world
        if scenario == "ring":
            cur, acc = values(rank, n, np.int64), values(rank, n, np.int64)
            for step in range(world - 1):
                call = CallHeader(step, "allreduce", "sum", "ring", "int64", n)
                nxt = np.empty(n, np.int64)
                t.exchange([Send(right, cur)], [Recv(left, nxt)], call, deadline(20))
                t.exchange([Send(right, cur)], [Recv(left, acc, add)], call, deadline(20))
                cur = nxt
            q.put((rank, "ok", int(acc.sum()), int(acc[n // 2])))
        else:  # "killed" or "stopped": the last rank gets SIGKILL or SIGSTOP once connected
            if rank == world - 1:
                q.put((rank, "ready", 0, 0))
                time.sleep(60)
            got = np.empty(n, np.int64)
            t0 = time.monotonic()
            wait = 8 if scenario == "killed" else 2
            try:
                t.exchange([Send(right, values(rank, n, np.int64))], [Recv(left, got)], CALL, deadline(wait))
                t.exchange([Send(right, got)], [Recv(left, got)], CALL, deadline(wait))
                q.put((rank, "no error", 0, 0))
            except CommError as exc:
                q.put((rank, type(exc).__name__, time.monotonic() - t0, str(exc)))
        t.close()
    except BaseException as exc:  # noqa: BLE001
        q.put((rank, "crash", 0, repr(exc)))


def run_procs(world, hosts, scenario, signal_last=None, timeout=40):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=20), wait_for_workers=False)
    procs = [ctx.Process(target=_proc_main, args=(r, world, store.port, hosts, scenario, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        end = time.monotonic() + timeout
        expected = world
        while len(out) < expected:
            rank, status, a, b = q.get(timeout=max(0.1, end - time.monotonic()))
            if status == "ready" and signal_last is not None:
                time.sleep(0.2)
                os.kill(procs[rank].pid, signal_last)
                out[rank] = ("signalled", 0, 0)
                continue
            out[rank] = (status, a, b)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world, hosts", [(2, ["h", "h"]), (3, ["a", "b", "a"])])
def test_processes_ring_allreduce_exact(world, hosts):
    n = 300_001
    out = run_procs(world, hosts, "ring")
    total = sum(values(r, n, np.int64) for r in range(world))
    for r in range(world):
        assert out[r] == ("ok", int(total.sum()), int(total[n // 2])), out[r]


@pytest.mark.multiprocess
def test_processes_peer_killed():
    # rank 2 reaches rank 0 over TCP and rank 1 over a Unix socket
    out = run_procs(3, ["a", "b", "b"], "killed", signal_last=signal.SIGKILL)
    assert out[2][0] == "signalled"
    for r in (0, 1):
        status, took, text = out[r]
        assert status in ("PeerLost", "CommTimeout"), out[r]
        assert took < 8 + 2
    # rank 0 receives from rank 2 (the killed one) and must name it
    assert "rank 2" in out[0][2]


@pytest.mark.multiprocess
def test_processes_peer_stopped_times_out_naming_it():
    out = run_procs(3, ["a", "a", "b"], "stopped", signal_last=signal.SIGSTOP)
    status, took, text = out[0]  # rank 0 receives from the stopped rank 2
    assert status == "CommTimeout" and "receiving from rank 2" in text, out[0]
    assert took < 2 + 2
    assert out[1][0] in ("CommTimeout", "PeerLost"), out[1]


@pytest.mark.parametrize("ends", ["sent", "closed"])
def test_a_watched_peer_whose_frame_header_comes_in_parts(mesh, ends):
    # Rank 0 waits on rank 1 and, after WATCH_AFTER, watches rank 2 for an ABORT frame. The
    # frame's header comes in two parts: the watch saw part of it, stopped watching rank 2 for
    # the rest of the exchange, and its abort surfaced only at the deadline. Now the watch wakes
    # once the whole header is there; a peer that ends mid-header does not make it spin.
    ts = mesh(3, host_ids=["a", "b", "c"])  # (TCP connections, not Unix sockets)
    frame = wire.encode_abort(MismatchError("rank 2 saw rank 7 call broadcast"))

    def step(r):
        if r == 1:
            return None
        if r == 2:
            sock = ts[2]._conns[0].sock
            time.sleep(0.2)
            sock.sendall(frame[:10])
            time.sleep(0.3)
            if ends == "sent":
                sock.sendall(frame[10:])
            else:
                sock.shutdown(socket.SHUT_WR)
            return None
        t0, cpu0 = time.monotonic(), time.thread_time()
        try:
            ts[0].exchange([], [Recv(1, np.zeros(4, np.float32))], CALL, deadline(2.0 if ends == "sent" else 1.5))
        finally:
            took.append((time.monotonic() - t0, time.thread_time() - cpu0))

    took: list = []
    res = on_threads(3, step)
    if ends == "sent":
        assert isinstance(res[0], MismatchError) and "rank 2 aborted: rank 2 saw rank 7" in str(res[0]), res[0]
        assert took[0][0] < 1.5, took
    else:
        assert isinstance(res[0], CommTimeout), res[0]
        assert took[0][1] < 0.5, took  # (waited in poll, not in a loop around it)


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="TCP_CONGESTION is Linux's")
@pytest.mark.parametrize("setting", [None, "reno", "system", "nosuch"])
def test_tcp_connections_take_the_congestion_control_asked_for(mesh, monkeypatch, caplog, setting):
    # Ours default to cubic where the kernel lets a socket choose (under BBR the ring's
    # exchanges ran 12-18 ms long now and then: tcp_setup.TCP_CONGESTION); the environment
    # names another or keeps the kernel's; a name the kernel refuses is said, and the default stays.
    if setting is not None:
        monkeypatch.setenv("RINGTRAIN_TCP_CONGESTION", setting)
    plain = socket.socket()
    system = congestion(plain)
    try:
        plain.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
        cubic = "cubic"
    except OSError:  # (not allowed to this user here)
        cubic = system
    plain.close()
    caplog.set_level(logging.WARNING, logger="ringtrain.transport.tcp_setup")
    ts = mesh(2, host_ids=["a", "b"])
    got = {congestion(conn.sock) for t in ts for conn in t._conns.values()}
    assert got == {{None: cubic, "reno": "reno", "system": system, "nosuch": system}[setting]}
    warned = [r.getMessage() for r in caplog.records if "congestion" in r.getMessage()]
    assert bool(warned) == (setting == "nosuch") and all("'nosuch' is not available here" in w for w in warned)
