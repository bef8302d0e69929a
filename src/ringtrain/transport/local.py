"""An in-process transport: ranks are threads of one process, messages go through queues.

It exists for fast, exact tests of the collectives (world sizes up to dozens in
milliseconds) and follows the same contract as the real transports: headers are checked,
sizes are checked, every wait has a deadline, abort and close reach the peers.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

import numpy as np

from ..errors import CLOSED_EARLY, ERROR_TYPES, CommError, CommTimeout, MismatchError, PeerLost, abort_reason
from .base import CallHeader, Recv, Send, Transport, check_unread

_ABORT = "abort"
_CLOSED = "closed"
WATCH_EVERY = 0.01  # seconds between looks at the peers a receive does not wait on


class LocalHub:
    """The shared state of one in-process job: a queue per ordered pair of ranks."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.queues = {(s, d): queue.Queue() for s in range(world_size) for d in range(world_size)}

    def transport(self, rank: int) -> "LocalTransport":
        return LocalTransport(self, rank)


class LocalTransport(Transport):
    name = "local"

    def __init__(self, hub: LocalHub, rank: int):
        if not 0 <= rank < hub.world_size:
            raise ValueError(f"rank must be in [0, {hub.world_size}), got {rank}")
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self._closed = False
        self.host_id = "local"

    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], header: CallHeader, deadline: float) -> None:
        if self._closed:
            raise CommError(f"rank {self.rank}: transport is closed")
        for s in sends:
            self.hub.queues[(self.rank, s.peer)].put(("data", header, s.buf.copy()))
        for r in recvs:
            self._recv(r, header, deadline)

    def _recv(self, r: Recv, header: CallHeader, deadline: float) -> None:
        q = self.hub.queues[(r.peer, self.rank)]
        while True:
            timeout = deadline - time.monotonic()
            try:
                kind, theirs, payload = q.get(timeout=min(max(timeout, 0.0), WATCH_EVERY))
                break
            except queue.Empty:
                self._watch(r.peer, header)
                if self.also_watch is not None:
                    self.also_watch(header)
                if time.monotonic() >= deadline:
                    raise CommTimeout(
                        f"rank {self.rank}: no message from rank {r.peer} within the deadline during {header.describe()}"
                    ) from None
        if kind == _ABORT:
            code, text = theirs
            raise ERROR_TYPES[code](f"rank {r.peer} aborted: {text}")
        if kind == _CLOSED:
            raise PeerLost(f"rank {self.rank}: rank {r.peer} closed its transport during {header.describe()}: "
                           f"{CLOSED_EARLY}")
        header.check(theirs, self.rank, r.peer)
        if payload.nbytes != r.buf.nbytes:
            raise MismatchError(
                f"rank {self.rank} expected {r.buf.nbytes} bytes from rank {r.peer} "
                f"but got {payload.nbytes} during {header.describe()}"
            )
        incoming = payload.view(r.buf.dtype)
        if r.reduce is None:
            np.copyto(r.buf, incoming)
        else:
            r.reduce(r.buf, incoming)

    def watch(self, header: CallHeader) -> None:
        self._watch(-1, header)

    def _watch(self, waited: int, header: CallHeader) -> None:
        """The other peers' queues, while waiting on ``waited``'s (transport.base, *watching*)."""
        for peer in range(self.world_size):
            if peer in (self.rank, waited):
                continue
            q = self.hub.queues[(peer, self.rank)]
            with q.mutex:
                waiting = list(q.queue)
            for kind, theirs, _ in waiting:
                if kind == _ABORT:
                    code, text = theirs
                    raise ERROR_TYPES[code](f"rank {peer} aborted: {text}")
                if kind == "data":
                    check_unread(header, theirs, self.rank, peer)

    def abort(self, error: BaseException) -> None:
        code, text = abort_reason(error)  # (worded as the other transports word it)
        for peer in range(self.world_size):
            if peer != self.rank:
                self.hub.queues[(self.rank, peer)].put((_ABORT, (code, text), None))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in range(self.world_size):
            if peer != self.rank:
                self.hub.queues[(self.rank, peer)].put((_CLOSED, None, None))


def on_threads(n: int, fn, timeout: float = 60.0) -> list:
    """Run ``fn(rank)`` on one thread per rank; return each rank's result, or the exception it
    raised, in rank order. TimeoutError if any thread is still running after ``timeout``."""
    results: list = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - returned to the caller
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for th in threads:
        th.start()
    end = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, end - time.monotonic()))
    if any(th.is_alive() for th in threads):
        raise TimeoutError(f"threads still running after {timeout}s")
    return results


def run_threads(world_size: int, fn, timeout: float = 60.0):
    """Run ``fn(transport)`` on one thread per rank of an in-process job; return the results in
    rank order, with the exception object where a rank raised (its transport aborted first)."""
    hub = LocalHub(world_size)

    def body(rank: int):
        t = hub.transport(rank)
        try:
            return fn(t)
        except BaseException as exc:
            t.abort(exc)
            raise
        finally:
            t.close()

    return on_threads(world_size, body, timeout)
