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
  it answers handshakes one at a time, refuses (logs and closes) anything that fails one,
  and keeps serving until every expected peer is in or the deadline passes. It is closed
  once the mesh is built.
- *endpoint*: where a listener can be reached, published in the job's store under
  ``{prefix}/tcp/{rank}``.

Every wait ends by the caller's deadline (CommTimeout naming the peer); a refused or failed
handshake is AuthError or ProtocolError saying why.
"""

from __future__ import annotations

import datetime
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
#: A listener gives any one incoming handshake at most this long.
HANDSHAKE_TIMEOUT = 5.0

_IN = select.POLLIN | select.POLLPRI


def remaining(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.monotonic``; negative once it passed)."""
    return deadline - time.monotonic()


def _tune(sock: socket.socket) -> None:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if SOCKET_BUFFER_BYTES else ():
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:  # pragma: no cover - some platforms refuse; defaults still work
            pass


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


def connect_handshake(sock: socket.socket, me: Identity, peer: int, deadline: float) -> None:
    """Run the connector's side on a connected socket; AuthError/ProtocolError/CommTimeout."""
    mine = wire.Hello.fresh(wire.CONNECT, me.has_secret, me.rank, peer, me.world_size, me.job)
    mine_bytes = mine.pack()
    try:
        _send_all(sock, mine_bytes, deadline)
        reply = _recv_exact(sock, wire.HELLO_SIZE + wire.MAC_SIZE, deadline)
        if reply is None:
            raise ProtocolError(f"rank {peer} closed the connection during the handshake with rank {me.rank}")
        theirs_bytes = reply[: wire.HELLO_SIZE]
        theirs = wire.Hello.unpack(theirs_bytes)
        wire.check_hello(theirs, mine)
        wire.check_secrets_agree(theirs, me.has_secret)
        if not wire.mac_ok(me.mac(wire.ACCEPT, mine_bytes, theirs_bytes), reply[wire.HELLO_SIZE :]):
            raise AuthError(f"rank {peer} could not prove it holds this job's shared secret (the secrets differ)")
        _send_all(sock, me.mac(wire.CONNECT, mine_bytes, theirs_bytes), deadline)
        ack = _recv_exact(sock, len(wire.ACK), deadline)
        if ack != wire.ACK:
            raise ProtocolError(f"rank {peer} refused the connection from rank {me.rank}")
    except socket.timeout:
        raise CommTimeout(f"rank {me.rank}: handshake with rank {peer} did not finish by the deadline") from None
    except (ConnectionError, OSError) as exc:
        if isinstance(exc, CommError):
            raise
        raise PeerLost(f"rank {me.rank}: connection to rank {peer} failed during the handshake: {exc}") from None


def accept_handshake(sock: socket.socket, me: Identity, expected: set[int], seen_nonces: set[bytes], deadline: float) -> int:
    """Run the acceptor's side; return the peer's rank. Raises CommError/OSError on refusal.

    ``seen_nonces``: the connector nonces of the handshakes this listener admitted; one seen
    again is a replay. A nonce is added only once its MAC verified.
    """
    data = _recv_exact(sock, wire.HELLO_SIZE, deadline)
    if data is None:
        raise ProtocolError("connection closed before a complete hello")
    theirs = wire.Hello.unpack(data)
    mine = wire.Hello.fresh(wire.ACCEPT, me.has_secret, me.rank, theirs.rank, me.world_size, me.job)
    mine_bytes = mine.pack()
    # Answer first, so that a connector of another job or with other secrets can say why.
    _send_all(sock, mine_bytes + me.mac(wire.ACCEPT, data, mine_bytes), deadline)
    wire.check_hello(theirs, mine)
    wire.check_secrets_agree(theirs, me.has_secret)
    if theirs.rank not in expected:
        raise ProtocolError(f"rank {theirs.rank} is not expected to connect to rank {me.rank} (now)")
    if theirs.nonce in seen_nonces:
        raise AuthError(f"replayed handshake claiming rank {theirs.rank}")
    mac = _recv_exact(sock, wire.MAC_SIZE, deadline)
    if mac is None:
        raise AuthError(f"peer claiming rank {theirs.rank} left before proving it holds the secret")
    if not wire.mac_ok(me.mac(wire.CONNECT, data, mine_bytes), mac):
        raise AuthError(f"peer claiming rank {theirs.rank} failed authentication")
    # Recorded only now that the MAC (over both nonces) verified: a stranger cannot grow the set.
    seen_nonces.add(theirs.nonce)
    _send_all(sock, wire.ACK, deadline)
    return theirs.rank


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
                _tune(s)
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
                _tune(s)
                s.bind((bind_host, 0))
                s.listen(max(128, me.world_size))
                host = publish_host or s.getsockname()[0]
                self.endpoints["tcp"] = [host, s.getsockname()[1]]
        except BaseException:
            self.close()
            raise

    def accept(self, expected: set[int], deadline: float) -> dict[int, socket.socket]:
        """Admit one authenticated connection from each rank in ``expected``."""
        waiting = set(expected)
        got: dict[int, socket.socket] = {}
        poller = select.poll()
        by_fd = {s.fileno(): s for s in self._socks}
        for fd in by_fd:
            poller.register(fd, _IN)
        try:
            while waiting:
                left = remaining(deadline)
                if left <= 0:
                    raise CommTimeout(
                        f"rank {self.me.rank}: ranks {sorted(waiting)} did not connect before the deadline"
                    )
                for fd, _ in poller.poll(math.ceil(left * 1000)):
                    try:
                        conn, addr = by_fd[fd].accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    peer = self._admit(conn, addr, waiting, deadline)
                    if peer is not None:
                        waiting.discard(peer)
                        got[peer] = conn
        except BaseException:
            for s in got.values():
                s.close()
            raise
        return got

    def _admit(self, conn: socket.socket, addr, waiting: set[int], deadline: float) -> Optional[int]:
        conn_deadline = min(deadline, time.monotonic() + self.handshake_timeout)
        try:
            return accept_handshake(conn, self.me, waiting, self._seen, conn_deadline)
        except (CommError, OSError) as exc:  # socket.timeout is an OSError
            self.refused += 1
            reason = "handshake timed out" if isinstance(exc, socket.timeout) else f"{type(exc).__name__}: {exc}"
            log.warning("rank %d refused a connection from %r: %s", self.me.rank, addr or "local", reason)
            conn.close()
            return None

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


def _address(endpoints: dict, same_host: bool, peer: int) -> tuple[int, object]:
    if same_host and "unix" in endpoints:
        return socket.AF_UNIX, _unix_address(str(endpoints["unix"]))
    if "tcp" in endpoints:
        host, port = endpoints["tcp"]
        family = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
        return family, (str(host), int(port))
    raise ProtocolError(f"rank {peer} published no endpoint this rank can use: {sorted(endpoints)}")


def dial(endpoints: dict, same_host: bool, me: Identity, peer: int, deadline: float,
         refresh: Optional[Callable[[], dict]] = None) -> socket.socket:
    """Connect to ``peer``'s listener (Unix socket if on the same host) and authenticate.

    A refused connection is retried until the deadline, asking ``refresh`` (if given) for
    the peer's endpoints again each time, in case a stale one was read.
    """
    while True:
        family, address = _address(endpoints, same_host, peer)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _tune(sock)
            left = remaining(deadline)
            if left <= 0:
                raise CommTimeout(f"rank {me.rank}: could not reach rank {peer} before the deadline")
            sock.settimeout(left)
            sock.connect(address)
            connect_handshake(sock, me, peer, deadline)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            time.sleep(min(0.05, max(0.0, remaining(deadline))))
            if refresh is not None:
                endpoints = refresh()
        except socket.timeout:
            sock.close()
            raise CommTimeout(f"rank {me.rank}: could not reach rank {peer} before the deadline") from None
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
