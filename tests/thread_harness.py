"""Communicators over threads (fast): test bodies written once for any world size.

Import from here, not from conftest: several conftest modules exist (tests/faults/ has one),
and "import conftest" picks whichever came first on sys.path.
"""

from __future__ import annotations

from ringtrain.comm import Communicator
from ringtrain.transport.local import run_threads


def run_comms(world_size: int, fn, timeout: float = 10.0, thread_timeout: float = 60.0):
    """Run ``fn(comm)`` on one thread per rank, each with its own Communicator; results by rank."""

    def body(t):
        comm = Communicator(t, timeout=timeout)
        return fn(comm)

    return run_threads(world_size, body, timeout=thread_timeout)


def raise_first(results):
    """Re-raise the first rank's exception, if any; else return the results."""
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
