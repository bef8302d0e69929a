"""The protocol every transport speaks, and the header that travels with each message.

Words used by all transports:

- *message*: one contiguous run of bytes from one rank to another, received into a buffer
  the receiver allocated beforehand (never a buffer sized by what the sender claims).
- *exchange*: a set of sends and receives that a collective step issues at once; the
  transport moves them concurrently (full duplex) and returns when all are done.
- *call header*: a fixed 36-byte description of the collective the sender is in (sequence
  number, kind, op, algorithm, dtype, element count, shape digest, root). It rides on every
  message; the receiver compares it with its own before it reads the payload, so ranks that
  disagree about a call raise MismatchError naming both sides, without an extra round trip.
- *deadline*: an absolute ``time.monotonic()`` instant; every wait ends by then with
  CommTimeout, or earlier with PeerLost when the peer is known to be gone.
- *abort*: when a rank fails it tells every peer why (best effort), so that peers waiting on
  it raise the same kind of error instead of timing out.
- *watching*: while an exchange waits, a transport also looks at the peers it does not wait
  on: one that aborted is its error here, and a message of this call that waits unread with
  another call header is a MismatchError (``check_unread``). Without it, ranks that disagree
  about which peers a call talks to (different algorithms) wait on each other until the
  deadline, and an abort reaches only the ranks that wait on the rank that failed.
"""

from __future__ import annotations

import abc
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import MismatchError


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a cpuset or taskset may allow fewer
    than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


# --- codes that travel on the wire ---------------------------------------------------------

KINDS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "barrier", "send")
OPS = ("sum", "mean", "min", "max", "prod", "none")
ALGORITHMS = ("ring", "naive", "central", "halving_doubling", "hierarchical", "native", "none")
#: Logical dtype names; bfloat16 is stored as uint16 in numpy and reduced through torch. (Their
#: index is their code on the wire: new ones go at the end.)
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "int8", "int16", "bool", "complex64")
_STORAGE = {
    "float16": np.float16,
    "bfloat16": np.uint16,
    "float32": np.float32,
    "float64": np.float64,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "bool": np.bool_,
    "complex64": np.complex64,
}


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that holds a logical dtype's bits."""
    return np.dtype(_STORAGE[dtype])


def shape_digest(shape: Sequence[int]) -> int:
    return zlib.crc32(repr(tuple(int(s) for s in shape)).encode()) & 0xFFFFFFFF


_HEADER = struct.Struct("<QBBBBqIiQ")  # seq kind op algorithm dtype numel shape root spare


@dataclass(frozen=True, slots=True)
class CallHeader:
    """What the sending rank believes the current collective is."""

    seq: int
    kind: str
    op: str = "none"
    algorithm: str = "none"
    dtype: str = "uint8"
    numel: int = 0
    shape: int = 0  # shape_digest of the caller's buffer
    root: int = -1
    dims: tuple = field(default=(), compare=False)  # this rank's shape, for messages (not on the wire)

    SIZE = _HEADER.size

    def pack(self) -> bytes:
        return _HEADER.pack(
            self.seq,
            KINDS.index(self.kind),
            OPS.index(self.op),
            ALGORITHMS.index(self.algorithm),
            DTYPES.index(self.dtype),
            self.numel,
            self.shape,
            self.root,
            0,
        )

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "CallHeader":
        seq, kind, op, alg, dt, numel, shape, root, _ = _HEADER.unpack(data)
        try:
            return cls(seq, KINDS[kind], OPS[op], ALGORITHMS[alg], DTYPES[dt], numel, shape, root)
        except IndexError:
            from ..errors import ProtocolError

            raise ProtocolError(f"call header has unknown codes {(kind, op, alg, dt)}") from None

    def describe(self) -> str:
        parts = [f"op={self.op}"] if self.op != "none" else []
        parts += [f"dtype={self.dtype}", f"numel={self.numel}"]
        if self.algorithm != "none":
            parts.append(f"algorithm={self.algorithm}")
        if self.root >= 0:
            parts.append(f"root={self.root}")
        return f"call #{self.seq} {self.kind}({', '.join(parts)})"

    def check(self, theirs: "CallHeader", me: int, peer: int) -> None:
        """Raise MismatchError naming both ranks and both calls if ``theirs`` differs."""
        if theirs == self:
            return
        detail = ""
        if theirs.shape != self.shape and theirs.numel == self.numel:
            mine = f": rank {me}'s is {self.dims}" if self.dims or self.numel == 1 else ""
            detail = f" (same number of elements, different shape{mine})"
        raise MismatchError(
            f"ranks disagree about the collective: rank {me} called {self.describe()} "
            f"but rank {peer} called {theirs.describe()}{detail}"
        )


def check_unread(header: CallHeader, theirs: CallHeader, me: int, peer: int) -> None:
    """A message from ``peer`` waits unread while this rank's exchange waits on other peers:
    where it is of the same call (sequence number) as ``header`` and differs from it, the ranks
    disagree about the call (each algorithm exchanges with its own peers, so ranks that chose
    different algorithms, or lengths that make ``auto`` choose differently, can wait on each
    other for ever with the proof unread): MismatchError, as header.check words it. A message of
    a later call (a peer ahead) or one equal to ours is left for the exchange that wants it."""
    if theirs.seq == header.seq:
        header.check(theirs, me, peer)


#: out[:] = op(out, incoming), elementwise, in place. Both are numpy arrays of one dtype.
Reducer = Callable[[np.ndarray, np.ndarray], None]


@dataclass(slots=True)
class Send:
    peer: int
    buf: np.ndarray  # contiguous 1-D; must not be modified until the exchange returns


@dataclass(slots=True)
class Recv:
    peer: int
    buf: np.ndarray  # contiguous 1-D, preallocated; the message must have exactly its size
    reduce: Optional[Reducer] = None  # None: copy into buf; else buf = reduce(buf, message)


class Transport(abc.ABC):
    """Moves messages between the ranks of one job.

    Messages between a pair of ranks arrive in the order they were sent. A transport may
    carry any number of exchanges one after another; it is not thread-safe (one collective
    at a time per communicator, as with MPI and gloo).
    """

    name: str = "?"
    rank: int
    world_size: int
    #: Called with the call header while an exchange waits (local: every 10 ms; shm: its idle
    #: checks; tcp: every 10 ms once the exchange has waited WATCH_AFTER): CompositeTransport
    #: sets it to its idle half's :meth:`watch` during an exchange over the other half alone.
    also_watch: Optional[Callable[[CallHeader], None]] = None

    def watch(self, header: CallHeader) -> None:
        """Look at every peer without blocking, outside any exchange of this transport: a peer's
        abort is its error here, a message of this call waiting with another call header a
        MismatchError (*watching*). Only while no exchange of this transport runs."""

    @abc.abstractmethod
    def exchange(
        self,
        sends: Sequence[Send],
        recvs: Sequence[Recv],
        header: CallHeader,
        deadline: float,
    ) -> None:
        """Perform all sends and receives concurrently; return when every one is complete.

        Each incoming message's call header is checked against ``header`` before its payload
        is used (MismatchError on disagreement); a payload whose size differs from the
        receive buffer is a MismatchError too. At most one Send and one Recv per peer.
        """

    @abc.abstractmethod
    def abort(self, error: BaseException) -> None:
        """Tell every peer (best effort, briefly) that this rank failed and why."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every socket, segment and thread. Idempotent."""

    # Convenience wrappers used by the collectives.
    def sendrecv(
        self,
        dst: Optional[int],
        sendbuf: Optional[np.ndarray],
        src: Optional[int],
        recvbuf: Optional[np.ndarray],
        header: CallHeader,
        deadline: float,
        reduce: Optional[Reducer] = None,
    ) -> None:
        sends = [Send(dst, sendbuf)] if dst is not None else []
        recvs = [Recv(src, recvbuf, reduce)] if src is not None else []
        self.exchange(sends, recvs, header, deadline)
