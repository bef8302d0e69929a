"""The exceptions ringtrain raises.

Every failure of communication is a :class:`CommError`, so a training loop can catch one
type. A communicator that raised a CommError from a collective is broken: the peers may be
part-way through a different step, so every later call raises too (create a new one).
"""

from __future__ import annotations

import difflib
import math
import numbers


class CommError(RuntimeError):
    """Base class: something went wrong while ranks were communicating."""


class CommTimeout(CommError):
    """A peer did not answer before the deadline (it may be stopped, slow or deadlocked)."""


class PeerLost(CommError):
    """A peer closed its connection or its process died."""


#: Why a peer closes with no error while this rank still calls (the PeerLost messages' words).
CLOSED_EARLY = ("it had no call left to make (the ranks made different numbers of calls: one ran more iterations "
                "or steps than another) or it closed its communicator while this rank still used it")


class MismatchError(CommError):
    """Ranks called different collectives (kind, op, dtype, shape, algorithm or root)."""


class AuthError(CommError):
    """A peer could not prove it holds the job's shared secret."""


class ProtocolError(CommError):
    """A peer sent bytes that are not a valid ringtrain frame."""


class RendezvousError(CommError):
    """The job's rendezvous store cannot be set up, for a reason that waiting will not fix
    (its port is already taken on rank 0, or another service answers at MASTER_ADDR:MASTER_PORT).
    Not a CommTimeout: retrying does not help."""


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


def abort_reason(error: BaseException) -> tuple[int, str]:
    """What an ABORT carries to the peers of a rank that failed with ``error``, on every transport:
    the wire code of its CommError type (0 for any other error) and its text. A CommError's own
    text; another error's type and its text where it has one ("ValueError: bad", "KeyboardInterrupt")."""
    code = next((ERROR_CODES[t] for t in type(error).__mro__ if t in ERROR_CODES), 0)
    text, name = str(error), type(error).__name__
    if isinstance(error, CommError):
        return code, text or name
    return code, f"{name}: {text}" if text else name


def without_frames(error: BaseException) -> BaseException:
    """``error`` as something that may be kept for a long time: a copy of it (its class, args and
    attributes) without its traceback, cause or context, which hold the frames it passed through
    and so every local of the callers' (tensors, batches). Where the class cannot be copied so,
    the CommError a peer would be told (its type and text)."""
    cls = type(error)
    try:
        clone = cls.__new__(cls, *error.args)
        clone.__dict__.update(vars(error))
        if isinstance(error, OSError):  # (kept outside args and __dict__: a file's error lost them)
            for name in ("errno", "strerror", "filename", "filename2"):
                if getattr(error, name) is not None:  # (a filename2 of None set reads "-> None")
                    setattr(clone, name, getattr(error, name))
        if str(clone) == str(error):
            return clone
    except Exception:  # noqa: BLE001 - a class of the caller's with a __new__ or __str__ of its own
        pass
    code, text = abort_reason(error)  # ("ValueError: bad", as the peers are told)
    return ERROR_TYPES[code](text)


def abort_payload(error: BaseException, limit: int) -> tuple[int, bytes]:
    """:func:`abort_reason` with its text as UTF-8 of at most ``limit`` bytes, never cut inside a
    character (what the tcp and torch transports send)."""
    code, text = abort_reason(error)
    raw = text.encode("utf-8", "replace")[:limit]
    return code, raw.decode("utf-8", "ignore").encode("utf-8")


def ranks_by_value(values, label=str) -> str:
    """The ranks grouped by the value each holds, in order of their first rank: ``"ranks 0, 2: a;
    rank 1: b"`` (``label(value)`` words each value). For errors that say which ranks disagree."""
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return "; ".join(f"{_ranks(ranks)}: {label(value)}" for value, ranks in groups.items())


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def check_number(name: str, value, *, positive: bool = True, unit: str = "") -> float:
    """``value`` as a float, where it is a finite real number > 0 (``positive``) or >= 0; never a
    bool (a ``True`` passed for a timeout is a mistake, not 1 s). Else a ValueError naming
    ``name`` (``unit``: " of seconds", say, in the message)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not (value > 0 if positive else value >= 0)):
        raise ValueError(f"{name} must be a finite number{unit} {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def check_seconds(name: str, value) -> float:
    """:func:`check_number` for a duration > 0, which may also come as a str (from the environment)."""
    if isinstance(value, str):
        try:
            return check_number(name, float(value), unit=" of seconds")
        except ValueError:
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}") from None
    return check_number(name, value, unit=" of seconds")


#: The least time ranks are given to meet (``join_timeout=None``): starting a rank (importing
#: torch, loading data) takes seconds on a busy machine that say nothing about a dead peer.
JOIN_TIMEOUT_FLOOR = 60.0


def check_join_timeout(join_timeout, timeout: float) -> float:
    """``join_timeout``: seconds every rank has to reach the rendezvous and meet the others, checked
    as a timeout is; None: ``timeout``, but at least JOIN_TIMEOUT_FLOOR."""
    return max(timeout, JOIN_TIMEOUT_FLOOR) if join_timeout is None else check_seconds("join_timeout", join_timeout)


def check_keywords(owner: str, given, accepted) -> None:
    """A keyword ``owner`` does not take is a ValueError naming it, the accepted name closest to it
    and every accepted one (not the TypeError of an options class the caller never wrote)."""
    accepted = sorted(accepted)
    unknown = sorted(set(given) - set(accepted))
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], accepted, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    names = ", ".join(repr(u) for u in unknown)
    raise ValueError(f"{owner} got unknown option{'s' if len(unknown) > 1 else ''} {names}{hint}; "
                     f"accepted: {', '.join(accepted)}")
