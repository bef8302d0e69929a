"""What workers and parameter servers say to each other, on ringtrain's framed, authenticated wire.

Words (frames, hellos, the handshake and ABORT frames are ``transport/wire.py``'s; this
module only adds what travels inside a DATA frame's payload):

- *ps rank*: the number a process has in the handshake: servers are 0..K-1, workers are
  K..K+W-1, and the handshake's world size is K+W. A server admits each worker rank at most
  once, and only after the HMAC handshake over fresh nonces with the job's secret.
- *message*: one DATA frame whose payload starts with the fixed 40-byte *message header*
  (magic ``RTPS``, kind, worker index, count, step, version, extra), followed by ``count``
  partition ids (u32 each) and then the partitions' float32 values in the order of the ids,
  or, for HELLO, WELCOME and BYE, a UTF-8 JSON body of at most MAX_JSON bytes. No pickle.
- *kinds*:
  HELLO (worker -> server, JSON: worker index, layout sizes and digest, parameter shapes,
  strategy and optimizer settings), WELCOME (server -> worker, JSON: the server's version and whether it still needs
  initial values), INIT (worker 0 -> server: initial values of the whole shard), PUSH (worker ->
  server: gradients of some partitions for ``step``, tagged with the ``version`` of the
  parameters they were computed from; ``extra`` = the learning rate to apply them with, the bits
  of an IEEE-754 double, which the header's flag LR_FLAG says: ``lr_of`` refuses a PUSH without
  it, such as an older worker's, whose ``extra`` 0 would read as a rate of 0), PULL (worker -> server: "send me the shard's values for
  ``step``": synchronous servers register it and stream each partition once it has taken step
  ``step`` - 1, asynchronous ones answer with the whole shard once the staleness bound allows),
  PARAMS (server -> worker: some partitions of the shard, any order, for the pull of ``step``,
  at ``version``; ``extra`` = workers still alive), SAVE / SAVED (checkpoint the
  shard at ``step``; a SAVE with ``extra`` = 1 is answered once the shard is copied, the file
  written in the background; a SAVED with ``extra`` = 1 says the save failed, its JSON body
  ``{"error": why}``, and the connection goes on), BYE (worker -> server, then server -> worker
  with its counters as JSON).
  Errors go back as the wire's ABORT frames, so a worker raises the same error type the server
  had, with the server's text.
- *channel*: one connected, authenticated socket with a send lock and byte counters (every byte
  of every frame, headers included, both ways). One thread may send while another receives:
  deadlines are kept with poll() and non-blocking calls, never with the socket's own timeout
  (which both directions share).

A receiver reads the frame header, then the message header, and checks the announced length
against what it expects for that kind before it reads on; values are received straight into
buffers the receiver allocated from its own layout, never sized by what the peer claims.
"""

from __future__ import annotations

import json
import math
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..errors import CommError, CommTimeout, PeerLost, ProtocolError
from ..transport import tcp_setup, wire
from ..transport.base import CallHeader

MAGIC = b"RTPS"
HELLO, WELCOME, INIT, PUSH, PULL, PARAMS, SAVE, SAVED, BYE = range(1, 10)
KIND_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", INIT: "INIT", PUSH: "PUSH", PULL: "PULL",
              PARAMS: "PARAMS", SAVE: "SAVE", SAVED: "SAVED", BYE: "BYE"}
JSON_KINDS = (HELLO, WELCOME, BYE, SAVED)  # (SAVED: only a failed save's)
#: The largest JSON body (HELLO carries a size and a shape per parameter tensor).
MAX_JSON = 4 << 20

_HEADER = struct.Struct("<4sBBHIIqqQ")  # magic kind flags reserved worker count step version extra
#: A PUSH's flag: its ``extra`` is its learning rate (the only flag; on other kinds none).
LR_FLAG = 1
HEADER_SIZE = _HEADER.size  # 40
_ID = np.dtype("<u4")
_IOV_MAX = 512


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded message header; ``body`` = payload bytes that follow it."""

    kind: int
    worker: int
    count: int
    step: int
    version: int
    extra: int
    body: int
    flags: int = 0

    @property
    def name(self) -> str:
        return KIND_NAMES.get(self.kind, str(self.kind))


def pack_header(kind: int, worker: int = 0, count: int = 0, step: int = 0, version: int = 0, extra: int = 0,
                flags: int = 0) -> bytes:
    return _HEADER.pack(MAGIC, kind, flags, 0, worker, count, step, version, extra)


def unpack_header(data: bytes, frame_length: int) -> Header:
    magic, kind, flags, reserved, worker, count, step, version, extra = _HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a parameter-server message: bad magic {bytes(magic)!r}")
    if kind not in KIND_NAMES or flags not in ((0, LR_FLAG) if kind == PUSH else (0,)) or reserved:
        raise ProtocolError(f"malformed parameter-server message: kind {kind}, flags {flags}, reserved {reserved}")
    return Header(kind, worker, count, step, version, extra, frame_length - HEADER_SIZE, flags)


def lr_bits(lr: float) -> int:
    """A PUSH's ``extra``: the learning rate's float64 bits."""
    return struct.unpack("<Q", struct.pack("<d", lr))[0]


def lr_of(head: Header, peer: str) -> float:
    """The learning rate a PUSH carries: a finite number >= 0 (0: a warm-up's first step)."""
    if not head.flags & LR_FLAG:
        raise ProtocolError(f"{peer} pushed step {head.step} without a learning rate (a worker of an older ringtrain: "
                            "run the same version on the workers and the servers)")
    lr = struct.unpack("<d", struct.pack("<Q", head.extra))[0]
    if not (math.isfinite(lr) and lr >= 0):
        raise ProtocolError(f"{peer} pushed step {head.step} with learning rate {lr}, not a finite number >= 0")
    return lr


def ps_identity(rank: int, world: int, job: str, secret: Optional[bytes]) -> tcp_setup.Identity:
    """The handshake identity of ps rank ``rank`` in a job of ``world`` ps ranks."""
    return tcp_setup.Identity(rank, world, f"ringtrain-ps/{job}", secret)


class Channel:
    """One authenticated connection: framed sends under a lock, exact receives, byte counters."""

    def __init__(self, sock: socket.socket, peer: str, timeout: float):
        self.sock = sock
        self.peer = peer  # how errors name the other end
        self.timeout = timeout
        self.bytes_sent = 0
        self.bytes_received = 0
        self._send_lock = threading.Lock()
        self._seq = 0
        sock.setblocking(True)  # and never a timeout: deadlines are poll()'s (see _poll)
        self._fd = sock.fileno()  # poll this number even after close(): POLLNVAL wakes it

    # --- sending ---------------------------------------------------------------------------
    def send(self, kind: int, *, worker: int = 0, step: int = 0, version: int = 0, extra: int = 0,
             ids: Optional[np.ndarray] = None, values: Sequence = (), body: bytes = b"",
             lr: Optional[float] = None) -> None:
        """One message: header, ids (u32), then ``values`` (buffers, sent without copying) or ``body``;
        ``lr``: a PUSH's learning rate (in ``extra``, flagged)."""
        flags = 0
        if lr is not None:
            flags, extra = LR_FLAG, lr_bits(lr)
        idbytes = b"" if ids is None else np.ascontiguousarray(ids, dtype=_ID).tobytes()
        count = 0 if ids is None else len(ids)
        views = [memoryview(v).cast("B") for v in values]
        length = HEADER_SIZE + len(idbytes) + len(body) + sum(v.nbytes for v in views)
        with self._send_lock:
            self._seq += 1
            frame = wire.encode_data_header(CallHeader(self._seq, "send", numel=length), length)
            head = frame + pack_header(kind, worker, count, step, version, extra, flags) + idbytes + body
            self._send_buffers([memoryview(head), *views])

    def send_abort(self, error: BaseException) -> None:
        """Best effort: tell the peer why this side gives up (an ABORT frame)."""
        try:
            with self._send_lock:
                self._send_buffers([memoryview(wire.encode_abort(error))])
        except (OSError, CommError):
            pass

    def _send_buffers(self, views: list[memoryview]) -> None:
        views = [v for v in views if v.nbytes]
        try:
            while views:
                try:
                    n = self.sock.sendmsg(views[:_IOV_MAX], [], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    self._poll(select.POLLOUT, time.monotonic() + self.timeout)
                    continue
                self.bytes_sent += n
                while n and views:
                    if n >= views[0].nbytes:
                        n -= views[0].nbytes
                        views.pop(0)
                    else:
                        views[0] = views[0][n:]
                        n = 0
        except TimeoutError:
            raise CommTimeout(f"sending to {self.peer} did not finish within {self.timeout:g} s") from None
        except OSError as exc:
            raise PeerLost(f"{self.peer} is gone (send failed: {exc})") from None

    def _poll(self, event: int, deadline: Optional[float]) -> None:
        """Wait until the socket is ready for ``event`` (or has an error or hang-up); TimeoutError at deadline."""
        poller = select.poll()
        poller.register(self._fd, event)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError
            if poller.poll(None if left is None else max(1, int(left * 1000) + 1)):
                return

    # --- receiving -------------------------------------------------------------------------
    def recv_header(self, idle_timeout: Optional[float]) -> Header:
        """The next message's header; an ABORT frame is raised as the error it carries.

        ``idle_timeout`` bounds the wait for the first byte (None: wait for ever, for a server
        whose worker may be busy computing); the rest of the frame must follow within timeout.
        """
        first = self._recv_exact(1, idle_timeout, at_boundary=True)
        frame = wire.decode_frame_header(first + self._recv_exact(wire.FRAME_HEADER_SIZE - 1, self.timeout))
        if frame.kind == wire.ABORT:
            payload = self._recv_exact(frame.length, self.timeout)
            kind = type(wire.abort_error(payload, 0))  # the error type the peer had
            raise kind(f"{self.peer} reported: {payload[4:].decode('utf-8', 'replace')}")
        if frame.length < HEADER_SIZE:
            raise ProtocolError(f"{self.peer} sent a {frame.length}-byte message, shorter than a header")
        return unpack_header(self._recv_exact(HEADER_SIZE, self.timeout), frame.length)

    def recv_ids(self, head: Header, limit: int) -> np.ndarray:
        if head.count > limit or head.count * _ID.itemsize > head.body:
            raise ProtocolError(f"{self.peer} sent {head.name} with {head.count} ids (at most {limit} allowed)")
        return np.frombuffer(self._recv_exact(head.count * _ID.itemsize, self.timeout), dtype=_ID).astype(np.int64)

    def recv_json(self, head: Header) -> dict:
        if head.body > MAX_JSON:
            raise ProtocolError(f"{self.peer} sent a {head.body}-byte {head.name} body (at most {MAX_JSON})")
        try:
            value = json.loads(self._recv_exact(head.body, self.timeout).decode("utf-8"))
        except ValueError as exc:  # (not UTF-8, not JSON, or an integer of more digits than Python converts)
            raise ProtocolError(f"{self.peer} sent a {head.name} body that is not JSON: {exc}") from None
        except RecursionError:  # (deeply nested arrays or objects)
            raise ProtocolError(f"{self.peer} sent a {head.name} body nested too deeply to parse") from None
        if not isinstance(value, dict):
            raise ProtocolError(f"{self.peer} sent a {head.name} body that is not a JSON object")
        return value

    def recv_into(self, view: np.ndarray) -> None:
        """Fill ``view`` (a contiguous array this side allocated) from the stream."""
        mv = memoryview(view).cast("B")
        got = 0
        try:
            while got < mv.nbytes:
                k = self._recv_some(mv[got:], time.monotonic() + self.timeout)
                if k == 0:
                    raise PeerLost(f"{self.peer} closed the connection in the middle of a message")
                got += k
                self.bytes_received += k
        except TimeoutError:
            raise CommTimeout(f"{self.peer} stopped sending in the middle of a message ({self.timeout:g} s)") from None
        except ConnectionError as exc:
            raise PeerLost(f"{self.peer} is gone ({exc})") from None

    def _recv_exact(self, n: int, timeout: Optional[float], at_boundary: bool = False) -> bytes:
        buf = np.empty(n, dtype=np.uint8)
        if n == 0:
            return b""
        mv = memoryview(buf)
        got = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while got < n:
                k = self._recv_some(mv[got:], deadline)
                if k == 0:
                    if at_boundary and got == 0:
                        raise EOFError
                    raise PeerLost(f"{self.peer} closed the connection in the middle of a message")
                got += k
                self.bytes_received += k
        except TimeoutError:
            raise CommTimeout(f"{self.peer} sent nothing for {timeout:g} s") from None
        except ConnectionError as exc:
            if at_boundary and got == 0:
                raise EOFError from None
            raise PeerLost(f"{self.peer} is gone ({exc})") from None
        return buf.tobytes()

    def _recv_some(self, mv: memoryview, deadline: Optional[float]) -> int:
        """Receive what has arrived into ``mv`` (at least one byte; 0 at end of stream)."""
        while True:
            try:
                return self.sock.recv_into(mv, len(mv), socket.MSG_DONTWAIT)
            except BlockingIOError:
                self._poll(select.POLLIN, deadline)

    def shut_reading(self) -> None:
        """Stop receiving (a thread blocked in a receive wakes up to the end of the stream); sends
        still go out."""
        try:
            self.sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def close(self) -> None:
        """Shut down both directions first: that wakes a thread blocked in a receive on it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


def dial(endpoint: Sequence, me: tcp_setup.Identity, server: int, timeout: float, *,
         name: Optional[str] = None) -> socket.socket:
    """Connect to server ``server`` at (host, port) and run the connector's handshake. Its errors
    call the server ``name`` (default: "parameter server k at host:port"), not by its handshake
    rank, which a torchrun user would read as a worker's."""
    host, port = str(endpoint[0]), int(endpoint[1])
    return tcp_setup.dial({"tcp": [host, port]}, False, me, server, time.monotonic() + timeout,
                          peer_name=f"parameter server {server} at {host}:{port}" if name is None else name,
                          congestion=False)  # (the kernel's: see tcp_setup.TCP_CONGESTION)


def encode_json(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")
