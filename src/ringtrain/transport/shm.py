"""The ``shm`` transport: ranks on one host exchange messages through shared memory.

Words (see ``shm_sync`` for segment, mailbox, slot, head and tail):

- *outbox* / *inbox*: the mailbox this rank sends to a peer through (it created it) / the
  mailbox it receives from a peer through (the peer created it). A rank has one of each per
  peer it was connected with.
- *chunk*: the part of a message that fits in one slot. A message of ``n`` bytes travels as
  ``max(1, ceil(n / slot_bytes))`` chunks in consecutive slots, so the receiver copies or
  reduces chunk k while the sender fills chunk k+1 (the pipeline). A receive with a reducer
  applies it straight from the shared slot into the destination, with no extra copy.
- *round*: one pass of :meth:`ShmTransport.exchange`'s loop: every unfinished send writes at
  most one chunk if its outbox has a free slot, every unfinished receive consumes at most one
  chunk if its inbox has one. Sends and receives with several peers thus progress together
  from one thread, and two ranks sending big messages to each other cannot deadlock.

Every slot carries the message's CallHeader and length; the receiver checks both against
its own call and buffer on the first chunk (MismatchError) and that later chunks continue the
same message (ProtocolError otherwise).

A sender rings the receiver's *doorbell* (shm_sync.Doorbell) after it fills a slot, a
receiver rings the sender's after it frees one, so a rank with nothing to do sleeps in the
kernel and wakes as soon as a peer has made progress.

Set-up (``connect``): each rank publishes its process identity in the store, creates its
doorbell and outboxes, publishes their names, opens the peers' ones, says it is ready, and
once every peer is ready unlinks the files it created: from then on nothing is left in
/dev/shm even if the job is killed.

Failures: a peer's abort flag becomes the same error type here ("rank X aborted: ..."), a
peer that closed or whose process died becomes PeerLost (noticed within milliseconds, see
shm_sync.Idle), and a deadline that passes becomes CommTimeout naming the peer and the call.
Data a peer published before it stopped is still delivered first.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
import time
import weakref
import zlib
from collections import deque
from typing import Optional, Sequence

import numpy as np

from ..errors import CLOSED_EARLY, ERROR_TYPES, CommError, CommTimeout, MismatchError, PeerLost, ProtocolError, abort_reason
from .base import CallHeader, Recv, Send, Transport, check_unread
from .shm_sync import (
    ORDERING_OK,
    SLOT_ENTRY,
    SLOT_TABLE,
    W_CLOSED,
    W_HEAD,
    W_TAIL,
    Doorbell,
    Idle,
    Mailbox,
    ProcessId,
    remove_stale_segments,
    segment_dir,
)

DEFAULT_SLOT_BYTES = 512 << 10  # fits a core's 1 MiB L2 with room; see scripts/shm_speed.py
DEFAULT_SLOTS = 8
# a slot-table entry: CallHeader, message length, offset in the message, bytes in this chunk
_ENTRY = struct.Struct(f"<{CallHeader.SIZE}sqqq")
if _ENTRY.size > SLOT_ENTRY:  # pragma: no cover - guards a change of the header format
    raise ImportError(f"slot-table entry of {_ENTRY.size} bytes does not fit in {SLOT_ENTRY}")
_serial = itertools.count()
_serial_lock = threading.Lock()


class _Outgoing:
    """One send in progress: ``pos`` bytes of ``src`` are in the outbox so far."""

    __slots__ = ("peer", "box", "bell", "src", "nbytes", "pos", "done")

    def __init__(self, peer: int, box: Mailbox, bell: Doorbell, buf: np.ndarray):
        self.peer = peer
        self.box = box
        self.bell = bell
        self.src = _bytes_of(buf)
        self.nbytes = self.src.nbytes
        self.pos = 0
        self.done = False

    def push(self, hdr: bytes) -> bool:
        """Write one chunk if the outbox has a free slot; return whether it did."""
        box = self.box
        slots = box.slots
        if box.count - box.seen >= slots:
            box.seen = box.ctl[W_TAIL]
            if box.count - box.seen >= slots:
                return False
        k = box.count % slots
        pos = self.pos
        n = min(box.slot_bytes, self.nbytes - pos)
        _ENTRY.pack_into(box.mm, SLOT_TABLE + k * SLOT_ENTRY, hdr, self.nbytes, pos, n)
        if n:
            box.data[k][:n] = self.src[pos : pos + n]
        self.pos = pos + n
        box.count += 1
        box.ctl[W_HEAD] = box.count  # publish after the data (x86 TSO; see shm_sync)
        self.bell.ring()
        self.done = self.pos >= self.nbytes
        return True


class _Incoming:
    """One receive in progress: ``pos`` bytes of the message have been applied to ``dst``."""

    __slots__ = ("peer", "box", "bell", "buf", "dst", "reduce", "nbytes", "pos", "done", "me")

    def __init__(self, me: int, peer: int, box: Mailbox, bell: Doorbell, r: Recv):
        self.me = me
        self.peer = peer
        self.box = box
        self.bell = bell
        self.buf = r.buf
        self.dst = _bytes_of(r.buf)
        self.reduce = r.reduce
        self.nbytes = self.dst.nbytes
        self.pos = 0
        self.done = False

    def pull(self, header: CallHeader, hdr: bytes) -> bool:
        """Consume one chunk if the inbox has one; return whether it did."""
        box = self.box
        if box.seen == box.count:
            box.seen = box.ctl[W_HEAD]
            if box.seen == box.count:
                return False
        k = box.count % box.slots
        theirs, length, offset, n = _ENTRY.unpack_from(box.mm, SLOT_TABLE + k * SLOT_ENTRY)
        pos = self.pos
        if pos == 0 and offset == 0:
            self._check_first(header, hdr, theirs, length)
        elif theirs != hdr or length != self.nbytes or offset != pos:
            raise ProtocolError(
                f"rank {self.me}: chunk from rank {self.peer} does not continue the message "
                f"(offset {offset}, expected {pos}) during {header.describe()}"
            )
        if n < 0 or n > box.slot_bytes or n > self.nbytes - pos or (n == 0 and self.nbytes):
            raise ProtocolError(f"rank {self.me}: chunk of {n} bytes from rank {self.peer} is malformed")
        if n:
            chunk = box.data[k][:n]
            if self.reduce is None:
                self.dst[pos : pos + n] = chunk
            else:
                size = self.buf.itemsize
                self.reduce(self.buf[pos // size : (pos + n) // size], chunk.view(self.buf.dtype))
        self.pos = pos + n
        box.count += 1
        box.ctl[W_TAIL] = box.count  # the slot is free once we are done reading it
        self.bell.ring()
        self.done = self.pos >= self.nbytes
        return True

    def _check_first(self, header: CallHeader, hdr: bytes, theirs: bytes, length: int) -> None:
        if theirs != hdr:
            header.check(CallHeader.unpack(theirs), self.me, self.peer)
        if length != self.nbytes:
            raise MismatchError(
                f"rank {self.me} expected {self.nbytes} bytes from rank {self.peer} "
                f"but got {length} during {header.describe()}"
            )


def _bytes_of(buf: np.ndarray) -> np.ndarray:
    if buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError("shm transport buffers must be 1-D and contiguous")
    return buf.view(np.uint8)


class ShmTransport(Transport):
    """Shared-memory transport between ranks of one host (see the module text)."""

    name = "shm"

    def __init__(self, rank: int, world_size: int, outboxes: dict, inboxes: dict, bells: dict, procs: dict,
                 local_ranks: int):
        """Use :meth:`connect`. ``bells[rank]`` is our own doorbell, the others the peers'."""
        self.rank = rank
        self.world_size = world_size
        self.host_id = os.uname().nodename
        self._out: dict[int, Mailbox] = outboxes
        self._in: dict[int, Mailbox] = inboxes
        self._bells: dict[int, Doorbell] = bells
        self._procs: dict[int, ProcessId] = procs
        self._idle = Idle(local_ranks=local_ranks)
        self._self_queue: deque = deque()  # messages to ourselves: (header bytes, payload copy)
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _close_all, list(outboxes.values()) + list(inboxes.values()) + list(bells.values())
        )

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        rank: int,
        world_size: int,
        store,
        *,
        timeout: float = 60.0,
        prefix: str = "ringtrain",
        peers: Optional[Sequence[int]] = None,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        slots: int = DEFAULT_SLOTS,
        local_ranks: Optional[int] = None,
    ) -> "ShmTransport":
        """Connect ``rank`` with ``peers`` (default: every other rank) through ``store``.

        ``peers`` must be symmetric (if a lists b, b lists a). Every rank of a job uses the
        same ``prefix``; ranks that connect several times under one prefix (one communicator
        after another) are paired by how many times each has connected. ``store`` needs
        ``set``, ``get``, ``check`` and ``add`` (any torch.distributed Store).

        ``local_ranks`` is how many of the job's ranks run on this host (default: this rank and
        its peers, as the auto transport connects them); a waiting rank spins only while they fit
        on the CPUs it may use, so give it where ``peers`` is a subset of the host's ranks.
        """
        if not ORDERING_OK:
            raise CommError("the shm transport needs x86 memory ordering; use transport='tcp' on this machine")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size) and world_size >= 1, got rank={rank}, world_size={world_size}")
        if slot_bytes < 4096 or slot_bytes % 4096:
            raise ValueError(f"slot_bytes must be a positive multiple of 4096, got {slot_bytes}")
        if not 2 <= slots <= 64:
            raise ValueError(f"slots must be in [2, 64], got {slots}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if local_ranks is not None and not 1 <= local_ranks <= world_size:
            raise ValueError(f"local_ranks must be in [1, world_size={world_size}], got {local_ranks}")
        peers = sorted(set(range(world_size)) - {rank} if peers is None else {int(p) for p in peers} - {rank})
        bad = [p for p in peers if not 0 <= p < world_size]
        if bad:
            raise ValueError(f"peers must be ranks in [0, {world_size}), got {bad}")
        if local_ranks is not None and local_ranks < len(peers) + 1:
            raise ValueError(f"local_ranks must count this rank and its {len(peers)} peer(s) on this host, "
                             f"got {local_ranks}")
        deadline = time.monotonic() + timeout
        remove_stale_segments()
        me = ProcessId.mine()
        with _serial_lock:
            serial = next(_serial)
        tag = f"{zlib.crc32(prefix.encode()):08x}"
        directory = segment_dir()

        # the n-th connect of every rank under this prefix meets the others' n-th connect,
        # so one store can serve communicators made one after another
        generation = store.add(f"{prefix}/shm/generation/{rank}", 1)

        def key(suffix: str) -> str:
            return f"{prefix}/shm/{generation}{suffix}"

        outboxes: dict[int, Mailbox] = {}
        inboxes: dict[int, Mailbox] = {}
        bells: dict[int, Doorbell] = {}

        def path(src: int, dst: int) -> str:  # the bell of rank r is "r-r"
            return os.path.join(directory, f"ringtrain-{me.pidns}-{me.pid}-{tag}-{serial}-{src}-{dst}")

        try:
            store.set(key(f"/pid/{rank}"), me.encode())
            bells[rank] = Doorbell.create(path(rank, rank))
            store.set(key(f"/bell/{rank}"), bells[rank].path.encode())
            for p in peers:
                try:
                    outboxes[p] = Mailbox.create(path(rank, p), slots, slot_bytes)
                except OSError as exc:
                    raise CommError(
                        f"rank {rank}: cannot create a shared-memory mailbox of {slots} x {slot_bytes} bytes "
                        f"in {directory} ({exc}); free space there: {_free_bytes(directory)} bytes. "
                        "Pass smaller slot_bytes/slots or use transport='tcp'"
                    ) from None
                store.set(key(f"/seg/{rank}/{p}"), outboxes[p].path.encode())
            procs = {}
            for p in peers:
                keys = [key(f"/pid/{p}"), key(f"/bell/{p}"), key(f"/seg/{p}/{rank}")]
                _store_wait(store, keys, deadline, rank, p, "publish its segment")
                procs[p] = ProcessId.decode(store.get(keys[0]))
                try:
                    bells[p] = Doorbell.open(store.get(keys[1]).decode())
                    inboxes[p] = Mailbox.open(store.get(keys[2]).decode())
                except OSError as exc:
                    raise PeerLost(f"rank {rank}: cannot map rank {p}'s segment: {exc}") from None
            store.set(key(f"/ready/{rank}"), b"1")
            for p in peers:
                _store_wait(store, [key(f"/ready/{p}")], deadline, rank, p, "map its segments", procs.get(p))
        except BaseException:
            _close_all(list(outboxes.values()) + list(inboxes.values()) + list(bells.values()))
            raise
        for ours in list(outboxes.values()) + [bells[rank]]:  # every peer has opened them
            ours.unlink()
        return cls(rank, world_size, outboxes, inboxes, bells, procs,
                   len(peers) + 1 if local_ranks is None else local_ranks)

    # -- data path ------------------------------------------------------------------------

    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], header: CallHeader, deadline: float) -> None:
        if self._closed:
            raise CommError(f"rank {self.rank}: transport is closed")
        if len({s.peer for s in sends}) < len(sends) or len({r.peer for r in recvs}) < len(recvs):
            raise ValueError("an exchange carries at most one send and one receive per peer")
        hdr = header.pack()
        outs = []
        for s in sends:
            if s.peer == self.rank:
                self._self_queue.append((hdr, _bytes_of(s.buf).copy()))
            else:
                outs.append(_Outgoing(s.peer, self._box(self._out, s.peer), self._bells[s.peer], s.buf))
        ins = []
        for r in recvs:
            if r.peer == self.rank:
                self._recv_self(r, header, hdr)
            else:
                ins.append(_Incoming(self.rank, r.peer, self._box(self._in, r.peer), self._bells[r.peer], r))
        idle = self._idle
        idle.progressed()
        bell = self._bells[self.rank]

        def checks() -> None:  # sees the current outs and ins (closure cells)
            self._check_waiting(outs, ins, header, deadline)

        while outs or ins:
            progressed = False
            for o in outs:
                progressed |= o.push(hdr)
            for i in ins:
                progressed |= i.pull(header, hdr)
            if progressed:
                if any(o.done for o in outs):
                    outs = [o for o in outs if not o.done]
                if any(i.done for i in ins):
                    ins = [i for i in ins if not i.done]
                idle.progressed()
            else:
                idle.step(bell, checks, deadline)

    def _box(self, boxes: dict, peer: int) -> Mailbox:
        try:
            return boxes[peer]
        except KeyError:
            raise ValueError(
                f"rank {self.rank} is not connected to rank {peer} (peers: {sorted(self._out)})"
            ) from None

    def _recv_self(self, r: Recv, header: CallHeader, hdr: bytes) -> None:
        if not self._self_queue:
            raise CommError(f"rank {self.rank}: receive from itself with no matching send during {header.describe()}")
        theirs, payload = self._self_queue.popleft()
        if theirs != hdr:
            header.check(CallHeader.unpack(theirs), self.rank, self.rank)
        if payload.nbytes != r.buf.nbytes:
            raise MismatchError(
                f"rank {self.rank} expected {r.buf.nbytes} bytes from itself but got {payload.nbytes}"
            )
        if r.reduce is None:
            _bytes_of(r.buf)[:] = payload
        else:
            r.reduce(r.buf, payload.view(r.buf.dtype))

    def _check_waiting(self, outs: list, ins: list, header: CallHeader, deadline: float) -> None:
        """Raise if a peer we wait on aborted, closed or died, or if the deadline passed.

        The peer's flags are read before its counters: a peer that wrote its last chunk and
        then closed or exited (or aborted) has its data consumed first (x86 TSO: seeing the
        flag implies seeing the counter stored before it).
        """
        waiting = [(o.peer, o.box, W_TAIL, "make room for our message") for o in outs]
        waiting += [(i.peer, i.box, W_HEAD, "send its message") for i in ins]
        for peer, box, counter, what in waiting:
            inbox = self._in[peer]
            info = inbox.abort_info()
            closed = inbox.ctl[W_CLOSED]
            dead = info is None and not closed and not self._procs[peer].alive()
            if not (info or closed or dead):
                continue
            if counter == W_HEAD and box.ctl[W_HEAD] != box.count:
                continue  # a chunk arrived before the peer stopped: consume it first
            if counter == W_TAIL and box.count - box.ctl[W_TAIL] < box.slots:
                continue
            if info is not None:
                code, text = info
                raise ERROR_TYPES.get(code, CommError)(f"rank {peer} aborted: {text}")
            if closed:
                raise PeerLost(f"rank {self.rank}: rank {peer} closed its transport during {header.describe()}: "
                               f"{CLOSED_EARLY}")
            raise PeerLost(
                f"rank {self.rank}: rank {peer} (pid {self._procs[peer].pid}) died during {header.describe()}"
            )
        self._watch({i.peer for i in ins}, header)
        if self.also_watch is not None:
            self.also_watch(header)
        if time.monotonic() >= deadline:
            peer, _, _, what = waiting[0]
            raise CommTimeout(
                f"rank {self.rank}: timed out waiting for rank {peer} to {what} during {header.describe()}"
            )

    def watch(self, header: CallHeader) -> None:
        self._watch(set(), header)

    def _watch(self, receiving: set, header: CallHeader) -> None:
        """The inboxes of the peers this exchange does not receive from (transport.base,
        *watching*): a peer's abort is its error here; the first chunk of a message waiting
        there is checked against this call (check_unread)."""
        for peer, box in self._in.items():
            if peer in receiving:
                continue
            info = box.abort_info()
            if info is not None:
                code, text = info
                raise ERROR_TYPES.get(code, CommError)(f"rank {peer} aborted: {text}")
            if box.ctl[W_HEAD] == box.count:
                continue
            theirs, _, offset, _ = _ENTRY.unpack_from(box.mm, SLOT_TABLE + (box.count % box.slots) * SLOT_ENTRY)
            if offset == 0:
                check_unread(header, CallHeader.unpack(theirs), self.rank, peer)

    # -- failure and shutdown -------------------------------------------------------------

    def abort(self, error: BaseException) -> None:
        if self._closed:
            return
        code, text = abort_reason(error)
        for peer, box in self._out.items():
            box.set_abort(code, text)
            self._bells[peer].ring()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer, box in self._out.items():
            box.ctl[W_CLOSED] = 1
            self._bells[peer].ring()
        self._finalizer()


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _close_all(things: list) -> None:
    """Close mailboxes and doorbells (unlinking those we created)."""
    for thing in things:
        thing.close()


def _store_wait(store, keys: list, deadline: float, rank: int, peer: int, what: str, proc: Optional[ProcessId] = None) -> None:
    """Wait until ``keys`` exist in the store, watching the peer's process if we know it."""
    delay = 0.001
    while True:
        try:
            if store.check(keys):
                return
        except Exception as exc:  # noqa: BLE001 - the store's own errors say little; name the peer
            raise PeerLost(f"rank {rank}: store failed while waiting for rank {peer} to {what}: {exc}") from None
        if proc is not None and not proc.alive():
            raise PeerLost(f"rank {rank}: rank {peer} (pid {proc.pid}) died before it could {what}")
        if time.monotonic() >= deadline:
            raise CommTimeout(f"rank {rank}: timed out waiting for rank {peer} to {what} (shm transport set-up)")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


__all__ = ["ShmTransport", "remove_stale_segments", "DEFAULT_SLOT_BYTES", "DEFAULT_SLOTS"]