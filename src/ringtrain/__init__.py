"""ringtrain: data-parallel training whose gradient exchange is fast on slow networks."""

from .errors import AuthError, CommError, CommTimeout, MismatchError, PeerLost, ProtocolError

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "CommError",
    "CommTimeout",
    "MismatchError",
    "PeerLost",
    "ProtocolError",
]
