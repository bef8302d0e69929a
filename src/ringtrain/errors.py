"""The exceptions ringtrain raises.

Every failure of communication is a :class:`CommError`, so a training loop can catch one
type. A communicator that raised a CommError from a collective is broken: the peers may be
part-way through a different step, so every later call raises too (create a new one).
"""

from __future__ import annotations


class CommError(RuntimeError):
    """Base class: something went wrong while ranks were communicating."""


class CommTimeout(CommError):
    """A peer did not answer before the deadline (it may be stopped, slow or deadlocked)."""


class PeerLost(CommError):
    """A peer closed its connection or its process died."""


class MismatchError(CommError):
    """Ranks called different collectives (kind, op, dtype, shape, algorithm or root)."""


class AuthError(CommError):
    """A peer could not prove it holds the job's shared secret."""


class ProtocolError(CommError):
    """A peer sent bytes that are not a valid ringtrain frame."""


class RendezvousError(CommError):
    """The job's rendezvous store cannot be set up, for a reason that waiting will not fix
    (its port is already taken on rank 0). Not a CommTimeout: retrying does not help."""


#: Wire codes for carrying an error to peers in an ABORT frame (see transport.base).
ERROR_CODES: dict[type[CommError], int] = {
    CommError: 0,
    CommTimeout: 1,
    PeerLost: 2,
    MismatchError: 3,
    AuthError: 4,
    ProtocolError: 5,
}
ERROR_TYPES: dict[int, type[CommError]] = {v: k for k, v in ERROR_CODES.items()}
