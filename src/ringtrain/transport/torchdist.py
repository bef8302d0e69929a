"""The ``torch`` transport: ringtrain's messages over a torch.distributed process group.

Point-to-point send/recv of gloo (CPU) or nccl (GPU) carry each message as two parts: a
48-byte prologue (the CallHeader and the payload length) and the payload. The receiver
checks the prologue before it posts the payload's receive, so a mismatched call is a
MismatchError, not a hang or a corrupted buffer. Payloads travel as byte tensors; reduces
happen on the receiver from a scratch buffer.
"""

from __future__ import annotations

import struct
from datetime import timedelta
from typing import Sequence

import numpy as np
import torch

from ..errors import CommError, CommTimeout, MismatchError, PeerLost
from .base import CallHeader, Recv, Send, Transport

_LEN = struct.Struct("<Q")
_PROLOGUE = CallHeader.SIZE + _LEN.size


def _bytes_tensor(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(arr.reshape(-1).view(np.uint8))


class TorchTransport(Transport):
    name = "torch"

    def __init__(self, rank: int, world_size: int, group, *, timeout: float):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.timeout = timeout
        self._closed = False
        self._tag = 0

    def _wait(self, work, peer: int, header: CallHeader, deadline: float, what: str) -> None:
        import time

        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeout(f"rank {self.rank}: deadline passed before {what} rank {peer} during {header.describe()}")
        try:
            ok = work.wait(timedelta(seconds=left))
        except RuntimeError as exc:
            text = str(exc)
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise CommTimeout(f"rank {self.rank}: {what} rank {peer} timed out during {header.describe()}") from exc
            raise PeerLost(f"rank {self.rank}: {what} rank {peer} failed during {header.describe()}: {text}") from exc
        if ok is False:
            raise CommTimeout(f"rank {self.rank}: {what} rank {peer} timed out during {header.describe()}")

    def exchange(self, sends: Sequence[Send], recvs: Sequence[Recv], header: CallHeader, deadline: float) -> None:
        if self._closed:
            raise CommError(f"rank {self.rank}: transport is closed")
        works = []
        for s in sends:
            pro = np.frombuffer(header.pack() + _LEN.pack(s.buf.nbytes), dtype=np.uint8).copy()
            works.append((s.peer, self.group.send([torch.from_numpy(pro)], s.peer, 0)))
            if s.buf.nbytes:
                works.append((s.peer, self.group.send([_bytes_tensor(s.buf)], s.peer, 1)))
        for r in recvs:
            pro = torch.empty(_PROLOGUE, dtype=torch.uint8)
            self._wait(self.group.recv([pro], r.peer, 0), r.peer, header, deadline, "receiving from")
            raw = pro.numpy().tobytes()
            header.check(CallHeader.unpack(raw[: CallHeader.SIZE]), self.rank, r.peer)
            (length,) = _LEN.unpack(raw[CallHeader.SIZE :])
            if length != r.buf.nbytes:
                raise MismatchError(
                    f"rank {self.rank} expected {r.buf.nbytes} bytes from rank {r.peer} but it sent "
                    f"{length} during {header.describe()}"
                )
            if not length:
                continue
            target = r.buf if r.reduce is None else np.empty_like(r.buf)
            self._wait(self.group.recv([_bytes_tensor(target)], r.peer, 1), r.peer, header, deadline, "receiving from")
            if r.reduce is not None:
                r.reduce(r.buf, target)
        for peer, work in works:
            self._wait(work, peer, header, deadline, "sending to")

    def abort(self, error: BaseException) -> None:
        # Process groups have no way to carry our reason; peers time out or see the group fail.
        self._closed = True

    def close(self) -> None:
        self._closed = True
        self.group = None
