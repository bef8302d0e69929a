"""The ``torch`` transport: ringtrain's messages over a torch.distributed process group.

Point-to-point send/recv of gloo (CPU) or nccl (GPU) carry each message as two parts: a
48-byte prologue (the CallHeader and the payload length) and the payload. The receiver
checks the prologue before it posts the payload's receive, so a mismatched call is a
MismatchError, not a hang or a corrupted buffer. Payloads travel as byte tensors; reduces
happen on the receiver from a scratch buffer.

*abort*: process groups cannot carry our reason, so a failing rank sends every peer an ABORT
prologue in place of its next one (its seq field holds ``_ABORT_SEQ``, then the error code and
the number of 48-byte messages of reason text that follow it), then waits a moment
(``_ABORT_GRACE``) for those sends to be taken before the group may go. A peer that reads an
ABORT where it expected a prologue raises the same kind of error ("rank 1 aborted: ranks
disagree ..."), fails in turn and tells its own peers, so every rank raises at once instead of
waiting out the timeout. Before raising, a failing rank takes in what the peers of its current
exchange send it, so that their sends complete and they go on to read its ABORT; and it posts
one prologue receive per peer, so that the peers' own ABORTs are taken. Every message on tag 0
is exactly one prologue long (gloo aborts the process when a message and its receive differ
in size), so a receive posted before knowing what comes is always safe.
"""

from __future__ import annotations

import struct
from datetime import timedelta
from typing import Sequence

import numpy as np
import torch

from ..errors import ERROR_TYPES, CommError, CommTimeout, MismatchError, PeerLost, abort_payload
from .base import CallHeader, Recv, Send, Transport
from .ctrl_c import Breaker

_LEN = struct.Struct("<Q")
_PROLOGUE = CallHeader.SIZE + _LEN.size
_ABORT_SEQ = (1 << 64) - 1  # a prologue whose seq is this is an ABORT (no call ever gets it)
_ABORT = struct.Struct("<QII")  # _ABORT_SEQ, error code, bytes of reason text (in prologue-sized parts)
_MAX_ABORT_TEXT = 16 * _PROLOGUE
_ABORT_GRACE = 1.0  # seconds a failing rank waits for its ABORTs to be taken
_MAX_DRAIN = 256 << 20  # the largest mismatched payload taken in so that its sender can go on


def _bytes_tensor(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(arr.reshape(-1).view(np.uint8))


class TorchTransport(Transport):
    name = "torch"

    def __init__(self, rank: int, world_size: int, group, *, timeout: float, breaker=None):
        self.rank = rank
        self._breaker = breaker if breaker is not None else Breaker()  # Ctrl-C ends a wait (transport.ctrl_c)
        self.world_size = world_size
        self.group = group
        self.timeout = timeout
        self._closed = False
        self._tag = 0
        self._unwaited: list = []  # (work, tensor) of sends and receives posted while failing
        self._failed_peers: set[int] = set()  # peers whose ABORT this rank has read

    def _wait(self, work, peer: int, header: CallHeader, deadline: float, what: str) -> None:
        import time

        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"rank {self.rank}: deadline passed before {what} rank {peer} during {header.describe()}")
        try:
            with self._breaker.waiting():
                ok = work.wait(timedelta(seconds=left))
        except RuntimeError as exc:
            raise self._breaker.failure(exc, self.rank, f"{what} rank {peer}", header.describe()) from exc
        if ok is False:
            raise CommTimeout(f"rank {self.rank}: {what} rank {peer} timed out during {header.describe()}")

    def _post(self, op, tensor: torch.Tensor, peer: int, tag: int, header: CallHeader, what: str):
        """``op([tensor], peer, tag)`` (the group's send or recv): its work. gloo raises at posting,
        not only at the wait, where the pair broke already (a peer killed, "Connection reset by
        peer"): that is a PeerLost too."""
        try:
            return op([tensor], peer, tag)
        except RuntimeError as exc:
            raise PeerLost(f"rank {self.rank}: {what} rank {peer} failed during {header.describe()}: {exc}") from exc

    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], header: CallHeader, deadline: float) -> None:
        if self._closed:
            raise CommError(f"rank {self.rank}: transport is closed")
        works = []
        for s in sends:
            pro = np.frombuffer(header.pack() + _LEN.pack(s.buf.nbytes), dtype=np.uint8).copy()
            works.append((s.peer, self._post(self.group.send, torch.from_numpy(pro), s.peer, 0, header, "sending to")))
            if s.buf.nbytes:
                works.append((s.peer, self._post(self.group.send, _bytes_tensor(s.buf), s.peer, 1, header,
                                                 "sending to")))
        for i, r in enumerate(recvs):
            error = self._receive(r, header, deadline)
            if error is not None:
                self._drain(recvs[i + 1 :], header, deadline)
                raise error
        for peer, work in works:
            self._wait(work, peer, header, deadline, "sending to")

    def _receive(self, r: Recv, header: CallHeader, deadline: float):
        """Receive one message into ``r``; return (not raise) the error its prologue stands for,
        a mismatch or the peer's ABORT, so that the caller can drain the exchange first."""
        pro = torch.empty(_PROLOGUE, dtype=torch.uint8)
        work = self._post(self.group.recv, pro, r.peer, 0, header, "receiving from")
        self._wait(work, r.peer, header, deadline, "receiving from")
        raw = pro.numpy().tobytes()
        if _ABORT.unpack_from(raw)[0] == _ABORT_SEQ:
            return self._abort_error(raw, r.peer, header, deadline)
        (length,) = _LEN.unpack(raw[CallHeader.SIZE :])
        try:
            header.check(CallHeader.unpack(raw[: CallHeader.SIZE]), self.rank, r.peer)
            if length != r.buf.nbytes:
                raise MismatchError(
                    f"rank {self.rank} expected {r.buf.nbytes} bytes from rank {r.peer} but it sent "
                    f"{length} during {header.describe()}"
                )
        except MismatchError as exc:
            self._take_in(r.peer, length)
            return exc
        if length:
            target = r.buf if r.reduce is None else np.empty_like(r.buf)
            work = self._post(self.group.recv, _bytes_tensor(target), r.peer, 1, header, "receiving from")
            self._wait(work, r.peer, header, deadline, "receiving from")
            if r.reduce is not None:
                r.reduce(r.buf, target)
        return None

    def _drain(self, rest: Sequence[Recv], header: CallHeader, deadline: float) -> None:
        """Take in (and drop) what the peers of the rest of a failed exchange send, for a moment:
        their sends then complete, and they go on to read this rank's ABORT."""
        import time

        soon = min(deadline, time.monotonic() + 0.5)
        posted = []
        try:
            for r in rest:
                pro = torch.empty(_PROLOGUE, dtype=torch.uint8)
                posted.append((r.peer, self._post(self.group.recv, pro, r.peer, 0, header, "receiving from"), pro))
                self._unwaited.append(posted[-1][1:])
            for peer, work, pro in posted:
                self._wait(work, peer, header, soon, "receiving from")
                raw = pro.numpy().tobytes()
                if _ABORT.unpack_from(raw)[0] == _ABORT_SEQ:
                    self._text_parts(raw, peer)  # posted, not waited for
                else:
                    self._take_in(peer, _LEN.unpack(raw[CallHeader.SIZE :])[0])
        except CommError:  # best effort: the error being raised is the caller's
            return

    def _take_in(self, peer: int, length: int) -> None:
        """Post the receive of the payload ``peer`` announced (not waited for): its send then
        completes and it goes on to read this rank's ABORT instead of timing out on the send."""
        if 0 < length <= _MAX_DRAIN:
            scratch = torch.empty(length, dtype=torch.uint8)
            try:
                self._unwaited.append((self.group.recv([scratch], peer, 1), scratch))
            except RuntimeError:  # the pair broke: nothing to take in (best effort)
                pass

    def _text_parts(self, raw: bytes, peer: int) -> list:
        """Post the receives of the reason text that follows ABORT prologue ``raw`` from ``peer``."""
        self._failed_peers.add(peer)
        length = min(_ABORT.unpack_from(raw)[2], _MAX_ABORT_TEXT)
        parts = []
        try:
            for _ in range(-(-length // _PROLOGUE)):
                buf = torch.empty(_PROLOGUE, dtype=torch.uint8)
                parts.append((self.group.recv([buf], peer, 0), buf))
        except RuntimeError:  # the pair broke: the text received so far is all there is
            pass
        self._unwaited.extend(parts)
        return parts

    def _abort_error(self, raw: bytes, peer: int, header: CallHeader, deadline: float) -> CommError:
        """The error an ABORT prologue from ``peer`` stands for, with the reason that follows it."""
        import time

        _, code, length = _ABORT.unpack_from(raw)
        text = b""
        soon = min(deadline, time.monotonic() + _ABORT_GRACE)  # sent right behind the prologue
        try:
            for work, buf in self._text_parts(raw, peer):
                self._wait(work, peer, header, soon, "receiving from")
                text += buf.numpy().tobytes()
        except CommError:
            pass
        reason = text[:length].decode("utf-8", "replace") or "(no reason received)"
        return ERROR_TYPES.get(code, CommError)(f"rank {self.rank}: rank {peer} aborted: {reason}")

    def abort(self, error: BaseException) -> None:
        """Tell every peer why this rank failed (best effort, for at most ``_ABORT_GRACE`` s)."""
        import time

        if self._closed or self.group is None:
            return
        self._closed = True
        code, raw = abort_payload(error, _MAX_ABORT_TEXT)
        parts = [_ABORT.pack(_ABORT_SEQ, code, len(raw)).ljust(_PROLOGUE, b"\0")]
        parts += [raw[i : i + _PROLOGUE].ljust(_PROLOGUE, b"\0") for i in range(0, len(raw), _PROLOGUE)]
        sends, recvs = [], []
        try:
            for peer in range(self.world_size):
                if peer == self.rank:
                    continue
                for part in parts:
                    tensor = torch.frombuffer(bytearray(part), dtype=torch.uint8)
                    sends.append((peer, self.group.send([tensor], peer, 0), tensor))
                if peer in self._failed_peers:  # it has said all it will
                    continue
                pro = torch.empty(_PROLOGUE, dtype=torch.uint8)  # takes in the peer's next message
                recvs.append((peer, self.group.recv([pro], peer, 0), pro))
        except RuntimeError:  # the group has failed already: nothing more can be told
            pass
        self._unwaited.extend((work, tensor) for _, work, tensor in sends + recvs)
        soon = time.monotonic() + _ABORT_GRACE
        header = CallHeader(0, "send")
        try:
            for peer, work, pro in recvs:  # a peer that fails too sends its ABORT: take all of it
                while True:
                    self._wait(work, peer, header, soon, "receiving from")
                    raw = pro.numpy().tobytes()
                    if _ABORT.unpack_from(raw)[0] == _ABORT_SEQ:
                        self._text_parts(raw, peer)
                        break
                    # a peer still in the call: take its payload; it then reads our ABORT
                    self._take_in(peer, _LEN.unpack(raw[CallHeader.SIZE :])[0])
                    pro = torch.empty(_PROLOGUE, dtype=torch.uint8)
                    work = self._post(self.group.recv, pro, peer, 0, header, "receiving from")
                    self._unwaited.append((work, pro))
            for peer, work, _ in sends:
                self._wait(work, peer, header, soon, "sending to")
        except CommError:  # the moment has passed, or the peer is gone: best effort only
            pass

    def close(self) -> None:
        self._closed = True
        self.group = None
        self._unwaited = []
