"""The tcp transport: one authenticated, full-duplex socket per pair of ranks.

How the sockets are made and authenticated is ``tcp_setup.py``; this module moves frames
over them. Words (frames are defined in ``wire.py``):

- *connection*: the authenticated socket between this rank and one peer (a Unix-domain
  socket on the same host, TCP otherwise), made once by ``tcp_setup.build_mesh`` and kept
  non-blocking here.
- *send state* / *receive state*: the progress of one frame within one exchange. An
  exchange registers every connection it uses with one ``poll`` and moves whatever bytes
  each socket is ready for, so all peers' sends and receives proceed at once.
- *segment*: when a receive reduces (``Recv.reduce``), the payload lands in a per-connection
  scratch buffer of ``segment_bytes`` and is reduced into the destination segment by segment
  as segments complete, while the kernel keeps receiving the next one. Without a reducer the
  payload goes straight into the destination buffer (``recv_into``), and every send goes
  straight from the caller's buffer (``sendmsg``): no copies, no pickle.
- *sender thread*: a connection's own thread, started on first use, that writes a large
  frame (``thread_send_bytes`` or more) while the exchange's thread receives and reduces;
  Python releases the GIL in ``send``, so the two kernel copies run on two cores. It reports
  through a wake pipe that the exchange's poll watches. Small frames are sent inline.
- *low-water mark*: while a frame arrives over TCP, poll reports its socket readable only
  once the rest of the frame header, then ``RCVLOWAT_BYTES`` of payload (or the rest), are
  waiting (SO_RCVLOWAT), so a paced link wakes the receiver per chunk, not per few packets;
  the header still arrives alone (a wrong length or an ABORT is seen at once), a closed or
  reset peer still wakes it, and every socket is back at 1 byte after the exchange.
- *mid-frame*: a connection whose current DATA frame is partly sent, or handed to its sender
  thread. An ABORT frame cannot be interleaved there, so abort just closes such a connection.

Every wait ends by the caller's deadline (CommTimeout naming the peer and the call); an
end of stream or reset is PeerLost naming the peer; an ABORT frame becomes the same error
type as the one that made the peer abort.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import select
import socket
import threading
import time
from typing import Optional, Sequence

import numpy as np

from ..errors import CLOSED_EARLY, CommError, CommTimeout, MismatchError, PeerLost, ProtocolError
from . import wire
from .base import CallHeader, Recv, Send, Transport, check_unread, usable_cpus
from .tcp_setup import build_mesh, remaining

log = logging.getLogger(__name__)

#: Default reduce segment: big enough that numpy's per-call cost vanishes, small enough to overlap.
DEFAULT_SEGMENT_BYTES = 512 << 10
#: Frames with at least this many bytes still to send go to the connection's sender thread,
#: so the kernel copies them out while this thread receives and reduces (None: never).
#: Measured (16-core host, 2 ranks, 64 MiB, Unix sockets): bidirectional 1.8-2.2 -> 3.4-4.6
#: GB/s per direction, with a reduce 1.4-1.7 -> 2.4-3.1; no change over loopback TCP. On a
#: 2-core host running 2 ranks they cost a little (2.7 -> 2.3 GB/s), so connect() turns them
#: on only when this host has at least 2 cores per local rank.
DEFAULT_THREAD_SEND_BYTES: Optional[int] = 1 << 20
#: While a frame arrives over TCP, poll wakes this rank only once this many of its bytes are
#: waiting (SO_RCVLOWAT; the rest of the frame when less): a paced link (1 Gbit/s) otherwise
#: wakes the receiver for every few packets, each wake-up taking the core from the training
#: thread. Unix sockets ignore it.
RCVLOWAT_BYTES = 256 << 10
#: abort() spends at most this long telling peers.
ABORT_BUDGET = 1.0
#: An exchange not done after this long also watches the connections it does not use
#: (transport.base, *watching*); quick exchanges never pay for registering them.
WATCH_AFTER = 0.05

#: How often an exchange that has waited WATCH_AFTER calls ``also_watch`` (transport.base).
ALSO_WATCH_EVERY = 0.01

_IN = select.POLLIN | select.POLLPRI
_OUT = select.POLLOUT
_BAD = select.POLLERR | select.POLLHUP | select.POLLNVAL


def auto_thread_send_bytes(local_ranks: int) -> Optional[int]:
    """DEFAULT_THREAD_SEND_BYTES when there are >= 2 cores per rank on this host, else None."""
    cores = usable_cpus()
    return DEFAULT_THREAD_SEND_BYTES if cores >= 2 * max(1, local_ranks) else None


# --- helpers -----------------------------------------------------------------------------------


def _wait_fd(fd: int, events: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``events`` on ``fd``; True if any arrived."""
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(max(0, math.ceil(timeout * 1000))))


# --- the transport ------------------------------------------------------------------------------


class _Conn:
    """One peer's socket and the per-connection state that outlives an exchange."""

    __slots__ = ("peer", "sock", "fd", "hdr", "midframe", "reading", "dead", "lowat", "_scratch", "_sender")

    def __init__(self, peer: int, sock: socket.socket):
        sock.setblocking(False)
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.hdr = bytearray(wire.FRAME_HEADER_SIZE)
        self.midframe = False  # a DATA frame is partly sent (or queued for the sender thread)
        self.reading = False  # a frame from the peer is partly received
        self.dead: Optional[str] = None  # why it can no longer be used
        # SO_RCVLOWAT in force; None where it does not apply (not TCP)
        self.lowat: Optional[int] = 1 if sock.family in (socket.AF_INET, socket.AF_INET6) else None
        self._scratch: Optional[np.ndarray] = None
        self._sender: Optional[_Sender] = None

    def send_in_thread(self, st: "_SendState", deadline: float, wake: "_Wake") -> None:
        if self._sender is None:
            self._sender = _Sender(self, wake)
        self.midframe = True  # from now until the thread finishes, no ABORT may interleave
        self._sender.jobs.put((st, deadline))

    def set_lowat(self, nbytes: int) -> None:
        """Let poll report this socket readable once ``nbytes`` are waiting (TCP only)."""
        if self.lowat is None or self.lowat == nbytes or self.dead is not None:
            return
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self.lowat = nbytes
        except OSError:  # (a closed socket: the exchange reports it)
            pass

    def scratch(self, nbytes: int) -> np.ndarray:
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch

    def kill(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
        try:  # wakes a poll on the socket: the sender thread's, or an exchange's in another thread
            self.sock.shutdown(socket.SHUT_RDWR)  # (closing a descriptor does not wake a poll on it)
        except OSError:
            pass
        if self._sender is not None:
            self._sender.stop()
            self._sender = None
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass


class _Wake:
    """A self-pipe: sender threads ring it, the exchange's poll watches ``fd``.

    Ringing after close() does nothing (the lock keeps a late thread from writing into a
    descriptor number the process has since reused).
    """

    def __init__(self):
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()
        self._closed = False

    def ring(self) -> None:
        with self._lock:
            if not self._closed:
                try:
                    os.write(self._w, b"x")
                except BlockingIOError:  # already full of wake-ups
                    pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.fd)
                os.close(self._w)


class _Sender:
    """A connection's sender thread: writes whole frames handed over by exchanges.

    It sets ``state.error`` (an OSError, or "timeout") or completes the frame, then rings
    the transport's wake pipe so that the exchange's poll notices.
    """

    def __init__(self, conn: _Conn, wake: _Wake):
        self.conn = conn
        self.wake = wake
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"ringtrain-tcp-send-{conn.peer}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            st, deadline = job
            try:
                self._send(st, deadline)
            finally:
                st.done = True
                self.conn.midframe = 0 < st.off < st.total
                self.wake.ring()

    def _send(self, st: "_SendState", deadline: float) -> None:
        sock = self.conn.sock
        while st.off < st.total:
            try:
                if st.off < len(st.head):
                    n = sock.sendmsg([memoryview(st.head)[st.off :], st.payload])
                else:
                    n = sock.send(st.payload[st.off - len(st.head) :])
                st.off += n
            except (BlockingIOError, InterruptedError):
                left = remaining(deadline)
                if left <= 0:
                    st.error = "timeout"
                    return
                _wait_fd(self.conn.fd, _OUT, min(left, 0.5))
            except OSError as exc:
                st.error = exc
                return

    def stop(self) -> None:
        self.jobs.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(0.5)


class _SendState:
    __slots__ = ("conn", "head", "payload", "total", "off", "done", "error")

    def __init__(self, conn: _Conn, head: bytes, payload: memoryview):
        self.conn = conn
        self.head = head
        self.payload = payload
        self.total = len(head) + payload.nbytes
        self.off = 0
        self.done = False  # set by a sender thread
        self.error: object = None  # set by a sender thread


class _RecvState:
    __slots__ = ("conn", "recv", "nbytes", "dest", "elems", "got_head", "off", "seg_start", "seg", "scratch")

    def __init__(self, conn: _Conn, recv: Recv, segment_bytes: int):
        conn.reading = True
        self.conn = conn
        self.recv = recv
        self.elems = recv.buf.reshape(-1)
        self.dest = memoryview(self.elems.view(np.uint8))
        self.nbytes = self.dest.nbytes
        self.got_head = 0
        self.off = 0
        self.seg_start = 0
        itemsize = recv.buf.dtype.itemsize
        self.seg = max(itemsize, segment_bytes - segment_bytes % itemsize)
        self.scratch = memoryview(conn.scratch(self.seg)) if recv.reduce is not None else None

    def wanted(self) -> int:
        """Bytes worth waking for: the rest of the frame header (checked on arrival: a
        mismatched length or an ABORT surfaces at once), then the rest of the payload."""
        if self.got_head < wire.FRAME_HEADER_SIZE:
            return wire.FRAME_HEADER_SIZE - self.got_head
        return self.nbytes - self.off


def _as_bytes(buf: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{what} buffer must be a numpy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what} buffer must be C-contiguous")
    return buf.reshape(-1).view(np.uint8)


class TcpTransport(Transport):
    """Framed, authenticated sockets between every pair of ranks (see the module docstring)."""

    name = "tcp"

    def __init__(self, rank: int, world_size: int, socks: dict[int, socket.socket], *,
                 host_id: str = "", segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 thread_send_bytes: Optional[int] = DEFAULT_THREAD_SEND_BYTES):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if segment_bytes < 8:
            raise ValueError(f"segment_bytes must be >= 8, got {segment_bytes}")
        self.rank = rank
        self.world_size = world_size
        self.host_id = host_id
        self.segment_bytes = segment_bytes
        self.thread_send_bytes = thread_send_bytes
        self._conns = {peer: _Conn(peer, s) for peer, s in socks.items()}
        self._wake = _Wake()
        self._closed = False

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def connect(cls, rank: int, world_size: int, store, *, secret: Optional[bytes], timeout: float,
                host_ids: Sequence[str], bind_host: Optional[str] = None, prefix: str = "ringtrain",
                segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                thread_send_bytes: Optional[int] | str = "auto") -> "TcpTransport":
        """Build the full mesh through ``store`` (a torch.distributed Store) by ``timeout``
        seconds (``tcp_setup.build_mesh``).

        - ``secret``: the job's shared secret (None: no authentication, but the handshake
          still refuses strangers and other jobs). Never logged.
        - ``host_ids[r]``: rank r's host identity; equal ids talk over Unix sockets.
        - ``bind_host``: the TCP listening address; default, the local address of the
          interface that reaches the store's host (loopback for a HashStore).
        - ``prefix``: must be unique per job and per communicator: it names the store keys
          and its digest is the job identity checked in every handshake.
        - ``segment_bytes``: reduce granularity (tests make it tiny to cover many segments).
        - ``thread_send_bytes``: frames at least this large go to sender threads; "auto" turns
          them on when the host has >= 2 cores per local rank; None: never.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if secret is not None and (not isinstance(secret, (bytes, bytearray)) or len(secret) == 0):
            raise ValueError("secret must be None or non-empty bytes")
        if len(host_ids) != world_size:
            raise ValueError(f"host_ids must have world_size={world_size} entries, got {len(host_ids)}")
        if isinstance(thread_send_bytes, str):
            if thread_send_bytes != "auto":
                raise ValueError(f"thread_send_bytes must be 'auto', None or an int >= 1, got {thread_send_bytes!r}")
            thread_send_bytes = auto_thread_send_bytes(list(host_ids).count(host_ids[rank]))
        elif thread_send_bytes is not None and thread_send_bytes < 1:
            raise ValueError(f"thread_send_bytes must be 'auto', None or an int >= 1, got {thread_send_bytes!r}")
        socks = build_mesh(rank, world_size, store, secret=bytes(secret) if secret is not None else None,
                           deadline=time.monotonic() + timeout, host_ids=host_ids, bind_host=bind_host, prefix=prefix)
        return cls(rank, world_size, socks, host_id=host_ids[rank], segment_bytes=segment_bytes,
                   thread_send_bytes=thread_send_bytes)

    # ---- exchange -----------------------------------------------------------------------------

    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], header: CallHeader, deadline: float) -> None:
        if self._closed:
            raise CommError(f"rank {self.rank}: transport is closed")
        loopback: Optional[np.ndarray] = None
        outgoing: list[tuple[_Conn, np.ndarray]] = []
        incoming: list[tuple[_Conn, Recv]] = []
        for s in sends:  # check everything before touching any connection's state
            payload = _as_bytes(s.buf, "send")
            if s.peer == self.rank:
                loopback = payload
                continue
            conn = self._conn(s.peer, header)
            if conn.midframe:
                raise CommError(
                    f"rank {self.rank}: an earlier failed call left a frame to rank {s.peer} half-sent; "
                    "this transport cannot be used any more"
                )
            outgoing.append((conn, payload))
        for r in recvs:
            _as_bytes(r.buf, "receive")
            if not r.buf.flags.writeable:
                raise ValueError(f"receive buffer from rank {r.peer} is read-only")
            if r.peer == self.rank:
                continue
            conn = self._conn(r.peer, header)
            if conn.reading:
                raise CommError(
                    f"rank {self.rank}: an earlier failed call left a frame from rank {r.peer} half-read; "
                    "this transport cannot be used any more"
                )
            incoming.append((conn, r))
        for what, pairs in (("Send to", outgoing), ("Recv from", incoming)):
            peers = [conn.peer for conn, _ in pairs]
            if len(set(peers)) != len(peers):
                raise ValueError(f"more than one {what} the same rank in one exchange: {sorted(peers)}")
        for r in recvs:
            if r.peer == self.rank:
                self._recv_loopback(r, loopback, header)
        if not outgoing and not incoming:
            return
        send_states = {
            conn.fd: _SendState(conn, wire.encode_data_header(header, payload.nbytes), memoryview(payload))
            for conn, payload in outgoing
        }
        recv_states = {conn.fd: _RecvState(conn, r, self.segment_bytes) for conn, r in incoming}
        threaded: dict[int, _SendState] = {}
        for fd, st in list(send_states.items()):  # small messages usually leave right here
            if self._pump_send(st, header, deadline):
                del send_states[fd]
            elif self.thread_send_bytes is not None and st.total - st.off >= self.thread_send_bytes:
                del send_states[fd]
                threaded[fd] = st
                st.conn.send_in_thread(st, deadline, self._wake)
        self._run(send_states, recv_states, threaded, header, deadline)

    def _conn(self, peer: int, header: CallHeader) -> _Conn:
        conn = self._conns.get(peer)
        if conn is None:
            raise ValueError(f"rank {self.rank} has no connection to rank {peer} (world size {self.world_size})")
        if conn.dead is not None:
            raise PeerLost(f"rank {self.rank}: connection to rank {peer} is gone ({conn.dead}) during {header.describe()}")
        return conn

    def _recv_loopback(self, r: Recv, payload: Optional[np.ndarray], header: CallHeader) -> None:
        if payload is None:
            raise ValueError(f"rank {self.rank} receives from itself without sending to itself")
        if payload.nbytes != r.buf.nbytes:
            raise MismatchError(f"rank {self.rank} sent itself {payload.nbytes} bytes but expects {r.buf.nbytes}")
        incoming = payload.view(r.buf.dtype)
        if r.reduce is None:
            np.copyto(r.buf.reshape(-1), incoming)
        else:
            r.reduce(r.buf.reshape(-1), incoming)

    def _run(self, sends: dict[int, _SendState], recvs: dict[int, _RecvState], threaded: dict[int, _SendState],
             header: CallHeader, deadline: float) -> None:
        poller = select.poll()
        # Peers we only send to are watched for an ABORT frame; sends in threads report
        # through the wake pipe. The other peers join them once the exchange has waited
        # WATCH_AFTER (_watch_the_rest).
        watch_abort = (set(sends) | set(threaded)) - set(recvs)

        def interest(fd: int) -> int:
            return (_IN if fd in recvs or fd in watch_abort else 0) | (_OUT if fd in sends else 0)

        for fd in set(sends) | set(recvs) | watch_abort:
            poller.register(fd, interest(fd))
        if threaded:
            poller.register(self._wake.fd, _IN)
        receiving = [st.conn for st in recvs.values()]
        raised: list[_Conn] = []  # watched connections whose low-water mark the watch raised
        try:
            self._poll_loop(poller, interest, sends, recvs, threaded, watch_abort, raised, header, deadline)
        finally:  # outside an exchange any byte wakes (an ABORT frame is short)
            for conn in receiving + raised:
                conn.set_lowat(1)

    def _poll_loop(self, poller, interest, sends: dict[int, _SendState], recvs: dict[int, _RecvState],
                   threaded: dict[int, _SendState], watch_abort: set[int], raised: list[_Conn], header: CallHeader,
                   deadline: float) -> None:
        watch_at: Optional[float] = time.monotonic() + WATCH_AFTER
        while sends or recvs or threaded:
            for st in recvs.values():
                st.conn.set_lowat(max(1, min(RCVLOWAT_BYTES, st.wanted())))
            if watch_at is not None and time.monotonic() >= watch_at:
                watch_at = None
                self._watch_the_rest(poller, sends, recvs, threaded, watch_abort)
            left = remaining(deadline) if watch_at is None else min(remaining(deadline), remaining(watch_at))
            if watch_at is None and self.also_watch is not None:  # (the other transport's peers too)
                self.also_watch(header)
                left = min(left, ALSO_WATCH_EVERY)
            events = poller.poll(max(0, math.ceil(left * 1000))) if left > 0 else poller.poll(0)
            if not events and remaining(deadline) <= 0:
                raise self._timeout({**sends, **threaded}, recvs, header)
            for fd, ev in events:
                if fd == self._wake.fd:
                    self._collect(threaded, watch_abort, poller, header, deadline)
                    continue
                before = interest(fd)
                if fd in recvs and ev & (_IN | _BAD):
                    if self._pump_recv(recvs[fd], header, deadline):
                        recvs.pop(fd).conn.reading = False
                elif fd in watch_abort and ev & (_IN | _BAD):
                    conn = sends[fd].conn if fd in sends else threaded[fd].conn if fd in threaded else self._by_fd(fd)
                    whole = self._peek_abort(conn, header, deadline, closed_ok=fd not in sends and fd not in threaded)
                    if whole or ev & _BAD or conn in raised:  # (raised and still short: it ended mid-header)
                        watch_abort.discard(fd)
                    else:  # nothing yet, or part of a frame header: wake once the whole of it is there
                        conn.set_lowat(wire.FRAME_HEADER_SIZE)
                        raised.append(conn)
                if fd in sends and ev & (_OUT | _BAD):
                    if self._pump_send(sends[fd], header, deadline):
                        del sends[fd]
                        watch_abort.discard(fd)
                after = interest(fd)  # registered exactly while interest(fd) != 0
                if after != before:
                    if after == 0:
                        poller.unregister(fd)
                    else:
                        poller.modify(fd, after)

    def _watch_the_rest(self, poller, sends: dict, recvs: dict, threaded: dict, watch_abort: set[int]) -> None:
        """Watch the connections this exchange does not use, at a frame boundary, for one
        ABORT frame or DATA frame (_peek_abort): see WATCH_AFTER."""
        for conn in self._conns.values():
            fd = conn.fd
            if conn.dead is None and not conn.reading and fd not in sends and fd not in recvs and fd not in threaded:
                watch_abort.add(fd)
                poller.register(fd, _IN)

    def watch(self, header: CallHeader) -> None:
        for conn in list(self._conns.values()):
            if conn.dead is None:
                self._peek_abort(conn, header, time.monotonic(), closed_ok=True)

    def _by_fd(self, fd: int) -> _Conn:
        return next(conn for conn in self._conns.values() if conn.fd == fd)

    def _collect(self, threaded: dict[int, _SendState], watch_abort: set[int], poller, header: CallHeader,
                 deadline: float) -> None:
        """Take the finished sends of sender threads; raise what one of them met."""
        self._wake.drain()
        for fd, st in list(threaded.items()):
            if not st.done:
                continue
            del threaded[fd]
            if st.error == "timeout":
                raise self._timeout({fd: st}, {}, header)
            if isinstance(st.error, OSError):
                raise self._lost_while_sending(st.conn, st.error, header, deadline)
            if fd in watch_abort:
                watch_abort.discard(fd)
                poller.unregister(fd)

    def _timeout(self, sends: dict[int, _SendState], recvs: dict[int, _RecvState], header: CallHeader) -> CommTimeout:
        waits = [f"receiving from rank {st.conn.peer} ({st.off} of {st.nbytes} bytes)" for st in recvs.values()]
        waits += [f"sending to rank {st.conn.peer} ({st.off} of {st.total} bytes)" for st in sends.values()]
        return CommTimeout(f"rank {self.rank}: deadline passed while {', '.join(waits)} during {header.describe()}")

    def _pump_send(self, st: _SendState, header: CallHeader, deadline: float) -> bool:
        """Send what the socket takes now; True when the frame is complete."""
        conn = st.conn
        try:
            while st.off < st.total:
                if st.off < len(st.head):
                    n = conn.sock.sendmsg([memoryview(st.head)[st.off :], st.payload])
                else:
                    n = conn.sock.send(st.payload[st.off - len(st.head) :])
                st.off += n
                conn.midframe = st.off < st.total
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise self._lost_while_sending(conn, exc, header, deadline) from None
        return True

    def _lost_while_sending(self, conn: _Conn, exc: OSError, header: CallHeader, deadline: float) -> CommError:
        """The peer went away under a send: surface its ABORT if one is waiting, else PeerLost."""
        try:
            self._peek_abort(conn, header, min(deadline, time.monotonic() + 0.2), wait=True)
        except CommError as err:
            conn.kill(str(err))
            return err
        conn.kill("reset while sending")
        return PeerLost(f"rank {self.rank}: rank {conn.peer} is gone ({exc.strerror or exc}) during {header.describe()}")

    def _peek_abort(self, conn: _Conn, header: CallHeader, deadline: float, wait: bool = False,
                    closed_ok: bool = False) -> bool:
        """If the next frame from ``conn`` is an ABORT, read it and raise its error.

        A DATA frame (the peer is ahead of us) is left unread for the exchange that wants it;
        one of this call with another call header is a MismatchError (check_unread).
        ``closed_ok``: a peer this exchange neither sends to nor receives from may have closed
        (it had no call left): nothing to say then. Returns False where there is nothing, or
        only part of a frame header, to read yet (without ``wait``): a watch goes on then.
        """
        if conn.reading:  # not at a frame boundary: nothing to learn here
            return True
        head = b""
        while True:
            try:
                head = conn.sock.recv(wire.FRAME_HEADER_SIZE, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                head = None
            except OSError:
                return True
            if head == b"":
                if not wait and not closed_ok:
                    conn.kill("closed by the peer")
                    raise PeerLost(f"rank {self.rank}: rank {conn.peer} closed its connection during {header.describe()}: "
                                   f"its process ended, or, if it ended without an error, {CLOSED_EARLY}")
                return True
            if head is not None and len(head) == wire.FRAME_HEADER_SIZE:
                break
            if not wait or remaining(deadline) <= 0:
                return False
            _wait_fd(conn.fd, _IN, min(0.02, remaining(deadline)))
        fh = self._decode(conn, head)
        if fh.kind == wire.ABORT:
            conn.sock.recv(wire.FRAME_HEADER_SIZE)
            conn.reading = True
            raise self._read_abort(conn, fh, deadline)
        check_unread(header, fh.call, self.rank, conn.peer)
        return True

    def _decode(self, conn: _Conn, head: bytes | bytearray) -> wire.FrameHeader:
        try:
            return wire.decode_frame_header(head)
        except ProtocolError as exc:
            conn.kill("malformed frame")
            raise ProtocolError(f"rank {self.rank}: malformed frame from rank {conn.peer}: {exc}") from None

    def _read_abort(self, conn: _Conn, fh: wire.FrameHeader, deadline: float) -> CommError:
        end = min(deadline, time.monotonic() + ABORT_BUDGET) if deadline > time.monotonic() else time.monotonic() + 0.2
        buf = bytearray(fh.length)  # bounded by wire.MAX_ABORT_TEXT
        view = memoryview(buf)
        got = 0
        while got < fh.length:
            try:
                n = conn.sock.recv_into(view[got:], fh.length - got)
            except (BlockingIOError, InterruptedError):
                if remaining(end) <= 0:
                    break
                _wait_fd(conn.fd, _IN, remaining(end))
                continue
            except OSError:
                break
            if n == 0:
                break
            got += n
        conn.kill("peer aborted")
        if got < fh.length:
            return PeerLost(f"rank {conn.peer} aborted (its message was cut off)")
        return wire.abort_error(buf, conn.peer)

    def _pump_recv(self, st: _RecvState, header: CallHeader, deadline: float) -> bool:
        """Receive what the socket holds now; True when the frame is complete."""
        conn = st.conn
        sock = conn.sock
        try:
            while st.got_head < wire.FRAME_HEADER_SIZE:
                n = sock.recv_into(memoryview(conn.hdr)[st.got_head :], wire.FRAME_HEADER_SIZE - st.got_head)
                if n == 0:
                    raise self._eof(st, header)
                st.got_head += n
                if st.got_head == wire.FRAME_HEADER_SIZE:
                    fh = self._decode(conn, conn.hdr)
                    if fh.kind == wire.ABORT:
                        raise self._read_abort(conn, fh, deadline)
                    header.check(fh.call, self.rank, conn.peer)
                    if fh.length != st.nbytes:
                        raise MismatchError(
                            f"rank {self.rank} expected {st.nbytes} bytes from rank {conn.peer} "
                            f"but it announced {fh.length} during {header.describe()}"
                        )
            if st.scratch is None:
                while st.off < st.nbytes:
                    n = sock.recv_into(st.dest[st.off :], st.nbytes - st.off)
                    if n == 0:
                        raise self._eof(st, header)
                    st.off += n
            else:
                while st.off < st.nbytes:
                    seg_end = min(st.seg_start + st.seg, st.nbytes)
                    n = sock.recv_into(st.scratch[st.off - st.seg_start : seg_end - st.seg_start], seg_end - st.off)
                    if n == 0:
                        raise self._eof(st, header)
                    st.off += n
                    if st.off == seg_end:
                        self._reduce_segment(st, seg_end)
        except (BlockingIOError, InterruptedError):
            return False
        except CommError:
            raise
        except OSError as exc:
            conn.kill("reset")
            raise PeerLost(
                f"rank {self.rank}: connection to rank {conn.peer} failed ({exc.strerror or exc}) during {header.describe()}"
            ) from None
        return True

    def _reduce_segment(self, st: _RecvState, seg_end: int) -> None:
        itemsize = st.elems.dtype.itemsize
        a, b = st.seg_start // itemsize, seg_end // itemsize
        incoming = np.frombuffer(st.scratch, dtype=st.elems.dtype, count=b - a)
        st.recv.reduce(st.elems[a:b], incoming)
        st.seg_start = seg_end

    def _eof(self, st: _RecvState, header: CallHeader) -> PeerLost:
        conn = st.conn
        where = "mid-frame" if st.got_head or st.off else "before sending"
        conn.kill("closed by the peer")
        return PeerLost(f"rank {self.rank}: rank {conn.peer} closed its connection ({where}) during {header.describe()}: "
                        f"its process ended, or, if it ended without an error, {CLOSED_EARLY}")

    # ---- abort / close ------------------------------------------------------------------------

    def abort(self, error: BaseException) -> None:
        if self._closed:
            return
        frame = wire.encode_abort(error)
        end = time.monotonic() + ABORT_BUDGET
        told = [conn for conn in self._conns.values()
                if conn.dead is None and not conn.midframe and self._send_abort(conn, frame, end)]
        self._drain_until_closed(told, end)
        self.close()

    def _send_abort(self, conn: _Conn, frame: bytes, end: float) -> bool:
        """Send ``frame`` and shut our side of ``conn`` for writing; True if the frame went out."""
        view = memoryview(frame)
        sent = 0
        try:
            while sent < len(frame):
                try:
                    sent += conn.sock.send(view[sent:])
                except (BlockingIOError, InterruptedError):
                    if remaining(end) <= 0:
                        return False
                    _wait_fd(conn.fd, _OUT, min(0.05, remaining(end)))
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return False
        return True

    @staticmethod
    def _drain_until_closed(conns: list[_Conn], end: float) -> None:
        """Read and drop what the peers send until each closes its side (it has read our ABORT and
        failed in turn) or ``end``: closing a socket with unread bytes sends a reset, and a reset
        can destroy our ABORT before the peer reads it (it would see PeerLost, not our error)."""
        open_fds = {conn.fd: conn for conn in conns}
        poller = select.poll()
        for fd in open_fds:
            poller.register(fd, _IN)
        sink = bytearray(1 << 16)
        while open_fds and remaining(end) > 0:
            for fd, _ in poller.poll(max(1, math.ceil(remaining(end) * 1000))):
                try:
                    n = open_fds[fd].sock.recv_into(sink)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    n = 0
                if not n:
                    poller.unregister(fd)
                    del open_fds[fd]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._conns.values():
            conn.kill("closed by this rank")
        self._wake.close()

    def __del__(self) -> None:  # pragma: no cover - safety net
        try:
            self.close()
        except Exception:
            pass
