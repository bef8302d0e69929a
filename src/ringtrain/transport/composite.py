"""A transport that sends to some peers through one transport and to the rest through another.

``auto`` uses it on clusters: shared memory between ranks of one host, tcp between hosts.
The two halves of an exchange run at the same time (the second on a worker thread), because a
ring step may send over tcp while it receives over shared memory: done one after the other,
two ranks that both send first would wait on each other forever.
"""

from __future__ import annotations

import threading
from typing import Mapping, Sequence

from .base import CallHeader, Recv, Send, Transport


class CompositeTransport(Transport):
    name = "auto"

    def __init__(self, rank: int, world_size: int, near: Mapping[int, Transport], far: Transport):
        self.rank = rank
        self.world_size = world_size
        self.near = dict(near)
        self.near_transport = next(iter(self.near.values())) if self.near else None
        self.far = far
        self._closed = False

    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], header: CallHeader, deadline: float) -> None:
        near_s = [s for s in sends if s.peer in self.near]
        near_r = [r for r in recvs if r.peer in self.near]
        far_s = [s for s in sends if s.peer not in self.near]
        far_r = [r for r in recvs if r.peer not in self.near]
        if not (near_s or near_r):
            return self._alone(self.far, self.near_transport, far_s, far_r, header, deadline)
        if not (far_s or far_r):
            return self._alone(self.near_transport, self.far, near_s, near_r, header, deadline)
        errors: list[BaseException] = []

        def far_part() -> None:
            try:
                self.far.exchange(far_s, far_r, header, deadline)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(exc)
                self.near_transport.abort(exc)

        worker = threading.Thread(target=far_part, name="ringtrain-far", daemon=True)
        worker.start()
        try:
            self.near_transport.exchange(near_s, near_r, header, deadline)
        except BaseException as exc:
            self.far.abort(exc)
            worker.join()
            raise
        worker.join()
        if errors:
            raise errors[0]

    @staticmethod
    def _alone(used: Transport, idle: Transport | None, sends: Sequence[Send], recvs: Sequence[Recv],
               header: CallHeader, deadline: float) -> None:
        """An exchange over one half: while it waits it also watches the idle half's peers
        (transport.base, *watching*), which no other thread uses meanwhile; without that, ranks
        that disagree about a call's peers (different algorithms) could wait on each other with
        the proof unread on the other half until the deadline."""
        if idle is None:
            return used.exchange(sends, recvs, header, deadline)
        used.also_watch = idle.watch
        try:
            used.exchange(sends, recvs, header, deadline)
        finally:
            used.also_watch = None

    def abort(self, error: BaseException) -> None:
        for t in (self.near_transport, self.far):
            if t is not None:
                t.abort(error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in (self.near_transport, self.far):
            if t is not None:
                t.close()
