"""Shared fixtures: communicators over threads (fast) for tests written once for any world size."""

from __future__ import annotations

import faulthandler
import sys

import pytest

from ringtrain.comm import Communicator
from ringtrain.transport.local import run_threads

faulthandler.enable(file=sys.stderr)


def run_comms(world_size: int, fn, timeout: float = 10.0, thread_timeout: float = 60.0):
    """Run ``fn(comm)`` on one thread per rank, each with its own Communicator; results by rank."""

    def body(t):
        comm = Communicator(t, timeout=timeout)
        return fn(comm)

    return run_threads(world_size, body, timeout=thread_timeout)


def raise_first(results):
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture
def comms():
    return run_comms
