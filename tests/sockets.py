"""What the kernel says of a test's sockets, for the tests of the transports and servers.

Import from here, not from another test module (see thread_harness.py).
"""

from __future__ import annotations

import socket


def congestion(sock: socket.socket) -> str:
    """The TCP congestion control ``sock`` uses ('cubic', 'bbr', ...; Linux's TCP_CONGESTION)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
