"""Building the tcp transport's mesh: identities, handshakes, listeners, dialing.

Words (hellos and the handshake's messages are defined in ``wire.py``):

- *connection*: the socket between this rank and one peer, a Unix-domain stream socket
  when both ranks have the same host identity (``host_ids``), TCP otherwise. Made once, by
  the higher rank connecting to the lower rank's listener; ``tcp.TcpTransport`` then keeps
  it non-blocking and moves frames over it.
- *identity*: what a rank proves in a handshake: its rank, the world size, the job digest
  (of the store prefix) and, if the job has one, that it holds the job's shared secret. The
  parameter server's channels use the same handshake (``ps.protocol``).
- *listener*: this rank's listening sockets during set-up (one Unix, one TCP, as needed);
  it runs handshakes side by side, each with its own deadline, refuses (logs and closes)
  anything that fails one or says nothing by then, and keeps serving until every expected
  peer is in or the deadline passes. It is closed once the mesh is built.
- *endpoint*: where a listener can be reached, published in the job's store under
  ``{prefix}/tcp/{rank}``.

Every wait ends by the caller's deadline (CommTimeout naming the peer); a refused or failed
handshake is AuthError or ProtocolError saying why.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import math
import os
import secrets as _secrets
import select
import socket
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from ..errors import AuthError, CommError, CommTimeout, PeerLost, ProtocolError
from . import wire

log = logging.getLogger(__name__)

#: Requested SO_SNDBUF / SO_RCVBUF for TCP (the kernel caps it at net.core.[rw]mem_max).
#: Unix sockets keep the kernel's default (~200 KiB): measured on a 16-core host, 2 ranks,
#: 64 MiB, a 4 MiB buffer cut the bidirectional rate from ~5 to ~2.7 GB/s per direction
#: (the smaller buffer's bytes are still in cache when the receiver copies them out).
SOCKET_BUFFER_BYTES = 4 << 20
#: The congestion control of ringtrain's own TCP connections (TCP_CONGESTION, Linux), where the
#: kernel lets a socket choose it; RINGTRAIN_TCP_CONGESTION names another, or ``system`` keeps the
#: kernel's default. Measured (the Intel VM, whose default is BBR; emulated 1 Gbit/s, 2 ranks, 25
#: ring allreduces of 16 MiB with gloo beside them): under BBR one exchange in several took 12-18 ms
#: longer than the link needs (no loss, no retransmission; the ring's exchanges leave a sender idle
#: between them), p90 157.5 ms against gloo's 144.0; with cubic p90 143.2 and at most 143.4 (gloo
#: 144.7, 149.5), and the MLP's schedules at 1 Gbit/s 847-862 ms a step, not 864-889. Not for
#: parameter servers' connections (``tune_socket(congestion=False)``): 4 workers pushing to 2
#: servers at once ran faster under BBR (the MLP, 2 sharded servers: 1.85x one against 1.60x).
TCP_CONGESTION = "cubic"
#: A listener gives any one incoming handshake at most this long.
HANDSHAKE_TIMEOUT = 5.0
#: Handshakes a listener runs at once (at least twice the ranks it expects); beyond, the oldest goes.
MAX_PENDING_HANDSHAKES = 128

_IN = select.POLLIN | select.POLLPRI


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.monotonic``; negative once it passed)."""
    return deadline - time.monotonic()


def congestion_control() -> Optional[str]:
    """The congestion control ringtrain's TCP connections ask for (TCP_CONGESTION, or the
    RINGTRAIN_TCP_CONGESTION environment variable); None: the kernel's default."""
    name = os.environ.get("RINGTRAIN_TCP_CONGESTION", TCP_CONGESTION).strip()
    return None if name.lower() in ("", "system") else name


_refused_congestion: set[str] = set()  # (names the kernel refused: said once a process)


def tune_socket(sock: socket.socket, congestion: bool = True) -> None:
    """TCP only: no Nagle delay, the socket buffers and (``congestion``) the congestion control
    above."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if SOCKET_BUFFER_BYTES else ():
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:  # pragma: no cover - some platforms refuse; defaults still work
            pass
    if congestion:
        _set_congestion_control(sock)


def _set_congestion_control(sock: socket.socket) -> None:
    """The TCP socket takes :func:`congestion_control`'s where the kernel lets it (Linux); a name
    it refuses is said once a process (unless it is the default, not named by the user)."""
    name = congestion_control()
    if name is None or not hasattr(socket, "TCP_CONGESTION"):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:  # not built or not allowed here: the kernel's default stays
        if name not in _refused_congestion and (name != TCP_CONGESTION or "RINGTRAIN_TCP_CONGESTION" in os.environ):
            log.warning("TCP congestion control %r is not available here (%s); the kernel's default stays "
                        "(RINGTRAIN_TCP_CONGESTION: a name in /proc/sys/net/ipv4/tcp_allowed_congestion_control, "
                        "or 'system')", name, exc.strerror or exc)
        _refused_congestion.add(name)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> Optional[bytes]:
    """n bytes, or None if the peer ends the stream first; socket.timeout at the deadline."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = remaining(deadline)
        if left <= 0:
            raise socket.timeout("deadline passed")
        sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    left = remaining(deadline)
    if left <= 0:
        raise socket.timeout("deadline passed")
    sock.settimeout(left)
    sock.sendall(data)


def _unix_address(name: str) -> str:
    """Published names start with '@' for Linux's abstract namespace (no file to remove)."""
    return "\0" + name[1:] if name.startswith("@") else name


def route_address(toward: str) -> str:
    """The local address of the interface that reaches ``toward`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(toward, 9, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(infos[0][4])
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


# --- handshakes -------------------------------------------------------------------------


class Identity:
    """What one rank needs to run handshakes: rank, world size, job digest, secret."""

    __slots__ = ("rank", "world_size", "job", "_secret")

    def __init__(self, rank: int, world_size: int, prefix: str, secret: Optional[bytes]):
        self.rank = rank
        self.world_size = world_size
        self.job = wire.job_digest(prefix)
        self._secret = secret

    def __repr__(self) -> str:  # never show the secret
        return f"Identity(rank={self.rank}, world_size={self.world_size})"

    @property
    def has_secret(self) -> bool:
        return self._secret is not None

    def mac(self, role: int, connect_hello: bytes, accept_hello: bytes) -> bytes:
        return wire.handshake_mac(self._secret, role, connect_hello, accept_hello)


def connect_handshake(sock: socket.socket, me: Identity, peer: int, deadline: float, *,
                      peer_name: Optional[str] = None) -> None:
    """Run the connector's side on a connected socket; AuthError/ProtocolError/CommTimeout.

    ``peer_name``: what this side's errors call the peer (default ``rank {peer}``; the parameter
    server's workers name the server they dial). ``wire.check_hello``'s checks of the hellos
    number both sides as the handshake does."""
    them = f"rank {peer}" if peer_name is None else peer_name
    mine = wire.Hello.fresh(wire.CONNECT, me.has_secret, me.rank, peer, me.world_size, me.job)
    mine_bytes = mine.pack()
    try:
        _send_all(sock, mine_bytes, deadline)
        reply = _recv_exact(sock, wire.HELLO_SIZE + wire.MAC_SIZE, deadline)
        if reply is None:
            raise ProtocolError(f"{them} closed the connection during the handshake with rank {me.rank}")
        theirs_bytes = reply[: wire.HELLO_SIZE]
        theirs = wire.Hello.unpack(theirs_bytes)
        wire.check_hello(theirs, mine)
        wire.check_secrets_agree(theirs, me.has_secret, them)
        if not wire.mac_ok(me.mac(wire.ACCEPT, mine_bytes, theirs_bytes), reply[wire.HELLO_SIZE :]):
            raise AuthError(f"{them} could not prove it holds this job's shared secret (the secrets differ)")
        _send_all(sock, me.mac(wire.CONNECT, mine_bytes, theirs_bytes), deadline)
        ack = _recv_exact(sock, len(wire.ACK), deadline)
        if ack != wire.ACK:
            raise ProtocolError(f"{them} refused the connection from rank {me.rank}")
    except socket.timeout:
        raise CommTimeout(f"rank {me.rank}: handshake with {them} did not finish by the deadline") from None
    except (ConnectionError, OSError) as exc:
        if isinstance(exc, CommError):
            raise
        raise PeerLost(f"rank {me.rank}: connection to {them} failed during the handshake: {exc}") from None


class Acceptance:
    """The acceptor's side of one handshake, as steps without I/O: ``accept_handshake`` runs one
    on a blocking socket, ``Listener`` many at once on non-blocking ones (so that strangers who
    connect and say nothing cannot hold a genuine peer's handshake back).

    ``expected``: the ranks that may still connect (read at each step: the listener's own set).
    ``seen_nonces``: the connector nonces of the handshakes this listener admitted; one seen
    again is a replay. A nonce is added only once its MAC verified. ``name``: how refusals name a
    handshake rank (a parameter server's peers are workers numbered from 0; default "rank r").
    """

    __slots__ = ("me", "expected", "seen_nonces", "name", "_hello", "_answer", "_rank")

    def __init__(self, me: Identity, expected: set[int], seen_nonces: set[bytes],
                 name: Callable[[int], str] = "rank {}".format):
        self.me = me
        self.expected = expected
        self.seen_nonces = seen_nonces
        self.name = name
        self._hello = self._answer = b""
        self._rank = -1

    def hello(self, data: bytes) -> tuple[bytes, Optional[CommError]]:
        """The connector's hello (HELLO_SIZE bytes): what to send back, and the refusal to raise
        once it is sent (None: wait for the MAC). A hello that does not parse raises at once."""
        theirs = wire.Hello.unpack(data)
        mine = wire.Hello.fresh(wire.ACCEPT, self.me.has_secret, self.me.rank, theirs.rank, self.me.world_size,
                                self.me.job)
        mine_bytes = mine.pack()
        # Answer first, so that a connector of another job or with other secrets can say why.
        answer = mine_bytes + self.me.mac(wire.ACCEPT, data, mine_bytes)
        try:
            wire.check_hello(theirs, mine)
            wire.check_secrets_agree(theirs, self.me.has_secret, self.name(theirs.rank))
            if theirs.rank not in self.expected:
                raise ProtocolError(f"{self.name(theirs.rank)} is not expected to connect to "
                                    f"{self.name(self.me.rank)} (now)")
            if theirs.nonce in self.seen_nonces:
                raise AuthError(f"replayed handshake claiming {self.name(theirs.rank)}")
        except CommError as refusal:
            return answer, refusal
        self._hello, self._answer, self._rank = data, mine_bytes, theirs.rank
        return answer, None

    def mac(self, mac: bytes) -> int:
        """The connector's MAC (MAC_SIZE bytes): its rank once verified (then send ``wire.ACK``)."""
        if not wire.mac_ok(self.me.mac(wire.CONNECT, self._hello, self._answer), mac):
            raise AuthError(f"peer claiming {self.name(self._rank)} failed authentication")
        if self._rank not in self.expected:  # another connection proved this rank in the meantime
            raise ProtocolError(f"{self.name(self._rank)} is not expected to connect to "
                                f"{self.name(self.me.rank)} (now)")
        # Recorded only now that the MAC (over both nonces) verified: a stranger cannot grow the set.
        self.seen_nonces.add(wire.Hello.unpack(self._hello).nonce)
        return self._rank

    def left_early(self) -> CommError:
        """The refusal for a connection that closed before the step it owed."""
        if self._rank < 0:
            return ProtocolError("connection closed before a complete hello")
        return AuthError(f"peer claiming {self.name(self._rank)} left before proving it holds the secret")


def accept_handshake(sock: socket.socket, me: Identity, expected: set[int], seen_nonces: set[bytes], deadline: float,
                     name: Callable[[int], str] = "rank {}".format) -> int:
    """Run the acceptor's side on a blocking socket; return the peer's rank. Raises CommError/OSError
    on refusal (``Acceptance`` says what is checked, and what ``name`` is)."""
    steps = Acceptance(me, expected, seen_nonces, name)
    data = _recv_exact(sock, wire.HELLO_SIZE, deadline)
    if data is None:
        raise steps.left_early()
    answer, refusal = steps.hello(data)
    _send_all(sock, answer, deadline)
    if refusal is not None:
        raise refusal
    mac = _recv_exact(sock, wire.MAC_SIZE, deadline)
    if mac is None:
        raise steps.left_early()
    rank = steps.mac(mac)
    _send_all(sock, wire.ACK, deadline)
    return rank


class Listener:
    """This rank's listening sockets during set-up, and the loop that admits peers."""

    def __init__(self, me: Identity, *, unix: bool, tcp: bool, bind_host: str = "127.0.0.1",
                 publish_host: Optional[str] = None, handshake_timeout: float = HANDSHAKE_TIMEOUT):
        self.me = me
        self.handshake_timeout = handshake_timeout
        self.endpoints: dict[str, object] = {}
        self.refused = 0  # connections refused so far (tests read it)
        self._socks: list[socket.socket] = []
        self._unix_path: Optional[str] = None
        self._seen: set[bytes] = set()
        try:
            if unix:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._socks.append(s)
                tune_socket(s)
                if sys.platform.startswith("linux"):
                    name = f"@ringtrain-{os.getpid()}-{_secrets.token_hex(8)}"
                else:  # pragma: no cover - no abstract namespace elsewhere
                    name = os.path.join(tempfile.gettempdir(), f"ringtrain-{os.getpid()}-{_secrets.token_hex(8)}.sock")
                    self._unix_path = name
                s.bind(_unix_address(name))
                s.listen(max(128, me.world_size))
                self.endpoints["unix"] = name
            if tcp:
                s = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM)
                self._socks.append(s)
                tune_socket(s)
                s.bind((bind_host, 0))
                s.listen(max(128, me.world_size))
                host = publish_host or s.getsockname()[0]
                self.endpoints["tcp"] = [host, s.getsockname()[1]]
        except BaseException:
            self.close()
            raise

    def accept(self, expected: set[int], deadline: float) -> dict[int, socket.socket]:
        """Admit one authenticated connection from each rank in ``expected``.

        Handshakes run side by side on non-blocking sockets, each with its own deadline
        (``handshake_timeout`` from its accept): connections that say nothing wait out theirs
        without holding back anyone else's. Run one at a time, 8 such connections made ahead of
        a genuine peer held it for 8 x 5 s, past a 30 s set-up deadline.
        """
        waiting = set(expected)
        got: dict[int, socket.socket] = {}
        pending: dict[int, _Pending] = {}  # by fd, oldest first
        poller = select.poll()
        by_fd = {s.fileno(): s for s in self._socks}
        for fd, s in by_fd.items():
            s.setblocking(False)
            poller.register(fd, _IN)
        cap = max(MAX_PENDING_HANDSHAKES, 2 * len(expected))
        try:
            while waiting:
                now = time.monotonic()
                for fd in [fd for fd, p in pending.items() if p.deadline <= now]:
                    self._refuse(pending.pop(fd), poller, "handshake timed out")
                left = deadline - now
                if left <= 0:
                    raise CommTimeout(
                        f"rank {self.me.rank}: ranks {sorted(waiting)} did not connect before the deadline"
                    )
                wake = min([deadline] + [p.deadline for p in pending.values()])
                for fd, events in poller.poll(max(math.ceil((wake - now) * 1000), 1)):
                    if fd in by_fd:
                        self._take(by_fd[fd], pending, poller, waiting, cap)
                        continue
                    p = pending.get(fd)
                    if p is None:
                        continue
                    try:
                        rank = p.step(events)
                    except (CommError, OSError) as exc:
                        del pending[fd]
                        if p.rank is not None:  # (it proved itself, then its ACK could not be sent)
                            waiting.add(p.rank)
                        reason = f"{type(exc).__name__}: {exc}"
                        self._refuse(p, poller, reason)
                        continue
                    if p.rank is not None:
                        waiting.discard(p.rank)  # claimed at once: no second handshake for it
                    if rank is not None:  # its ACK is sent: admitted
                        del pending[fd]
                        poller.unregister(fd)
                        got[rank] = p.conn
                    else:
                        poller.modify(fd, p.events())
        except BaseException:
            for s in got.values():
                s.close()
            raise
        finally:
            for p in pending.values():  # set-up is over (or failed) before theirs finished
                self._refuse(p, poller, "set-up ended before its handshake finished")
        return got

    def _take(self, listening: socket.socket, pending: dict, poller, waiting: set[int], cap: int) -> None:
        """Accept what the listening socket holds; beyond ``cap`` handshakes the oldest is dropped
        (a genuine one needs one round trip; a stranger's would wait for its deadline)."""
        while True:
            try:
                conn, addr = listening.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:  # out of descriptors: make room, or give up as before
                if exc.errno not in (errno.EMFILE, errno.ENFILE) or not pending:
                    raise
                self._refuse(pending.pop(next(iter(pending))), poller, "too many handshakes at once")
                continue
            if len(pending) >= cap:
                self._refuse(pending.pop(next(iter(pending))), poller, "too many handshakes at once")
            conn.setblocking(False)
            p = _Pending(conn, addr, Acceptance(self.me, waiting, self._seen),
                         time.monotonic() + self.handshake_timeout)
            pending[conn.fileno()] = p
            poller.register(conn.fileno(), p.events())

    def _refuse(self, p: "_Pending", poller, reason: str) -> None:
        self.refused += 1
        log.warning("rank %d refused a connection from %r: %s", self.me.rank, p.addr or "local", reason)
        try:
            poller.unregister(p.conn.fileno())
        except (KeyError, ValueError):
            pass
        p.conn.close()

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks = []
        if self._unix_path is not None:
            try:
                os.unlink(self._unix_path)
            except FileNotFoundError:
                pass
            self._unix_path = None


class _Pending:
    """One connection's handshake in a listener: what it still owes (``need`` bytes) and what is
    still to be sent to it (``out``), driven by ``step`` on each poll event."""

    __slots__ = ("conn", "addr", "steps", "deadline", "need", "got", "out", "refusal", "rank")

    def __init__(self, conn: socket.socket, addr, steps: Acceptance, deadline: float):
        self.conn, self.addr, self.steps, self.deadline = conn, addr, steps, deadline
        self.need, self.got, self.out = wire.HELLO_SIZE, b"", b""
        self.refusal: Optional[CommError] = None  # raised once the answer is out
        self.rank: Optional[int] = None  # proven (MAC verified); admitted once the ACK is out

    def events(self) -> int:
        return select.POLLOUT if self.out else _IN

    def step(self, events: int) -> Optional[int]:
        """Move on after a poll event; the rank once admitted (its ACK sent), else None.
        Raises CommError/OSError for a refusal."""
        if self.out:
            try:
                sent = self.conn.send(self.out)
            except (BlockingIOError, InterruptedError):
                return None
            self.out = self.out[sent:]
            if self.out:
                return None
            if self.refusal is not None:
                raise self.refusal
            return self.rank  # (None while the answer to its hello went out)
        if not events & _IN and events & (select.POLLHUP | select.POLLERR):
            raise self.steps.left_early()
        try:
            chunk = self.conn.recv(self.need - len(self.got))
        except (BlockingIOError, InterruptedError):
            return None
        if not chunk:
            raise self.steps.left_early()
        self.got += chunk
        if len(self.got) < self.need:
            return None
        data, self.got = self.got, b""
        if self.need == wire.HELLO_SIZE:
            self.out, self.refusal = self.steps.hello(data)
            self.need = wire.MAC_SIZE
        else:
            self.rank = self.steps.mac(data)
            self.out, self.need = wire.ACK, 0
        return self.step(select.POLLOUT)  # (a send this small almost always goes at once)


def _address(endpoints: dict, same_host: bool, peer: int) -> tuple[int, object]:
    if same_host and "unix" in endpoints:
        return socket.AF_UNIX, _unix_address(str(endpoints["unix"]))
    if "tcp" in endpoints:
        host, port = endpoints["tcp"]
        family = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
        return family, (str(host), int(port))
    raise ProtocolError(f"rank {peer} published no endpoint this rank can use: {sorted(endpoints)}")


def dial(endpoints: dict, same_host: bool, me: Identity, peer: int, deadline: float,
         refresh: Optional[Callable[[], dict]] = None, *, peer_name: Optional[str] = None,
         congestion: bool = True) -> socket.socket:
    """Connect to ``peer``'s listener (Unix socket if on the same host) and authenticate.

    A refused connection is retried until the deadline, asking ``refresh`` (if given) for
    the peer's endpoints again each time, in case a stale one was read. ``peer_name``: as
    ``connect_handshake``'s; ``congestion``: as ``tune_socket``'s.
    """
    them = f"rank {peer}" if peer_name is None else peer_name
    while True:
        family, address = _address(endpoints, same_host, peer)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            tune_socket(sock, congestion)
            left = remaining(deadline)
            if left <= 0:
                raise CommTimeout(f"rank {me.rank}: could not reach {them} before the deadline")
            sock.settimeout(left)
            sock.connect(address)
            connect_handshake(sock, me, peer, deadline, peer_name=peer_name)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            time.sleep(min(0.05, max(0.0, remaining(deadline))))
            if refresh is not None:
                endpoints = refresh()
        except socket.timeout:
            sock.close()
            raise CommTimeout(f"rank {me.rank}: could not reach {them} before the deadline") from None
        except BaseException:
            sock.close()
            raise


# --- the mesh -----------------------------------------------------------------------------------


def build_mesh(rank: int, world_size: int, store, *, secret: Optional[bytes], deadline: float,
               host_ids: Sequence[str], bind_host: Optional[str], prefix: str) -> dict[int, socket.socket]:
    """One authenticated socket to every other rank, through ``store`` (arguments as in
    ``TcpTransport.connect``, already checked; ``deadline`` on ``time.monotonic``).

    Rank r publishes its endpoints under ``{prefix}/tcp/{r}``, connects to every lower
    rank, then admits every higher rank: rank 0 only admits, so each rank's connects
    finish (induction) and nothing waits in a cycle.
    """
    me = Identity(rank, world_size, prefix, secret)
    mine = host_ids[rank]
    peers = [p for p in range(world_size) if p != rank]
    need_unix = any(host_ids[p] == mine for p in peers)
    need_tcp = any(host_ids[p] != mine for p in peers)
    # By default listen only on the interface that reaches the store's host (MASTER_ADDR
    # under torchrun), never on every interface; a store without a host (HashStore) means
    # all ranks share this process, so loopback.
    toward = getattr(store, "host", None) or "127.0.0.1"
    if bind_host is None:
        bind_host = route_address(toward) if need_tcp else "127.0.0.1"
    publish = route_address(toward) if bind_host in ("0.0.0.0", "::", "") else None
    listener = Listener(me, unix=need_unix, tcp=need_tcp, bind_host=bind_host, publish_host=publish)
    socks: dict[int, socket.socket] = {}
    try:
        store.set(f"{prefix}/tcp/{rank}", json.dumps(listener.endpoints))
        for peer in range(rank):
            key = f"{prefix}/tcp/{peer}"
            endpoints = _fetch_endpoints(store, key, rank, peer, deadline)
            socks[peer] = dial(endpoints, host_ids[peer] == mine, me, peer, deadline,
                               refresh=lambda: _fetch_endpoints(store, key, rank, peer, deadline))
        socks.update(listener.accept(set(range(rank + 1, world_size)), deadline))
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    finally:
        listener.close()
    return socks


def _fetch_endpoints(store, key: str, rank: int, peer: int, deadline: float) -> dict:
    left = remaining(deadline)
    try:
        if left <= 0:
            raise TimeoutError
        store.wait([key], datetime.timedelta(seconds=left))
        raw = store.get(key)
    except Exception as exc:  # the store raises its own timeout types
        if isinstance(exc, CommError):
            raise
        raise CommTimeout(f"rank {rank}: rank {peer} did not publish its endpoint before the deadline") from None
    try:
        endpoints = json.loads(bytes(raw).decode("utf-8"))
        if not isinstance(endpoints, dict):
            raise ValueError
    except ValueError:
        raise ProtocolError(f"rank {peer}'s published endpoint is not valid: {bytes(raw)[:80]!r}") from None
    return endpoints
