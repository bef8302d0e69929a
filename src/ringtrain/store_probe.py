"""Is there a rendezvous store at MASTER_ADDR:MASTER_PORT? Asked with a deadline, before torch's client.

torch's TCPStore client keeps no deadline against an endpoint that is not a store: one that
accepts and never answers held it with no end in sight (``ringtrain launch --join-timeout 5`` on node 1:
still waiting after 120 s), and one that answers with other bytes (an HTTP server) made it
retry past its timeout, print a C++ stack per try and, when abandoned on a thread at
``init()``'s deadline, abort the process at exit (SIGABRT in 3 of 6 runs). So the endpoint is
asked first, here, in Python, on one socket with the caller's deadline, and torch's client
is only started once a store has answered.

The question is in torch's store protocol (``TCPStoreBackend.hpp``; checked against both of
torch's servers, libuv and the classic one, by ``tests/test_store_probe.py``): the VALIDATE
query carrying torch's magic number, which every client sends first, then GETNUMKEYS, which a
store answers with its key count, eight bytes (int64). Both have had these numbers in every
torch this package accepts (>= 2.4). The PING that torch's own client sends on connect is not
in every version's list, and a store that does not know a query closes the connection, which
would look like a store not yet up. Eight bytes of a plausible count (below 2**40): a store.
Other bytes: something else holds the port, and waiting will not change that. Nothing by the deadline: something accepts connections but does not
answer as a store. Refused, or closed without an answer (rank 0 not started yet, or a
forwarder whose target is not up): asked again until the deadline.

No torch import here: ``ringtrain launch`` asks before torch is loaded (its C++ log is set at
load time, see ``launch._cpp_log_off_in_this_process``).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Optional

_VALIDATE, _GETNUMKEYS = 0, 7  # torch's c10d QueryType values
_MAGIC = 0x3C85F7CE  # torch's validationMagicNumber
_MAX_KEYS = 1 << 40  # a key count above this is no store's: other bytes read as one
_RETRY_DELAY = (0.05, 0.5)  # first and largest pause between tries (doubling)


class NotAStore(Exception):
    """Something answered at the endpoint, but not as a store (``answer``: its first bytes)."""

    def __init__(self, answer: bytes):
        super().__init__(f"it answered {answer!r}, not as a store")
        self.answer = answer


class NoStoreYet(Exception):
    """The deadline passed without a store's answer. ``kind``, of the last try: "refused"
    (nothing accepted a connection), "closed" (accepted, then closed without an answer) or
    "silent" (accepted, then nothing came back)."""

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.kind = kind


class _Silent(Exception):
    """(One try: connected, and the deadline passed with no answer.)"""


def wait_for_store(host: str, port: int, deadline: float) -> None:
    """Return once a TCPStore answers at ``host:port``; ``deadline`` on ``time.monotonic``.

    Raises NotAStore at once when something else answers, NoStoreYet at the deadline.
    """
    delay, last, kind = _RETRY_DELAY[0], "no try finished", "refused"
    while True:
        if deadline - time.monotonic() <= 0:
            raise NoStoreYet(last, kind)
        try:
            answer = _ask(host, port, deadline)
        except _Silent:
            last, kind = "accepted, then no answer", "silent"
        except OSError as exc:  # refused, unreachable, or connect's own timeout

            last, kind = exc.strerror or str(exc) or type(exc).__name__, "refused"
        else:
            if answer is None:
                return
            if answer != b"":
                raise NotAStore(answer)
            last, kind = "closed without an answer", "closed"
        time.sleep(max(min(delay, deadline - time.monotonic()), 0.0))
        delay = min(2 * delay, _RETRY_DELAY[1])


def _ask(host: str, port: int, deadline: float) -> Optional[bytes]:
    """One try: None if a store answered with its key count, b"" if the connection closed
    without an answer, else the bytes that came instead (up to 8). _Silent at the deadline
    once connected."""
    query = struct.pack("<BI", _VALIDATE, _MAGIC) + struct.pack("<B", _GETNUMKEYS)
    with socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(query)
        got = b""
        while len(got) < 8:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Silent
            sock.settimeout(left)
            try:
                chunk = sock.recv(8 - len(got))
            except socket.timeout:
                raise _Silent from None
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return got  # closed: b"" (no answer) or a short answer, which no store sends
            got += chunk
    return None if 0 <= struct.unpack("<q", got)[0] < _MAX_KEYS else got


def describe(error: Exception) -> str:
    """Why no store was reached, for a message that has already named the endpoint."""
    if isinstance(error, NotAStore):
        return (f"something else answers there ({error.answer!r}), not a ringtrain/torch TCPStore: "
                "another service holds that port")
    kind = getattr(error, "kind", "refused")
    if kind == "silent":
        return "something accepts connections there but does not answer as a store (another service on that port?)"
    if kind == "closed":
        return "connections there were accepted, then closed without an answer (a forwarder whose target is not up?)"
    return f"nothing accepted a connection there ({error})"
