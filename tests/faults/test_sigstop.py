"""SIGSTOP one rank in the middle of an allreduce loop: the others time out, naming it.

A stopped process keeps its sockets and shared memory open, so nothing tells the others it
is gone: only the deadline can. Every survivor must raise CommTimeout (a survivor may learn
it from a peer's abort, which carries the same type) within timeout + 2 s, and the error
text must lead to the silent rank: name it ("rank V"), or name a survivor whose error does
(a survivor waiting on another survivor times out at the same moment and names that one).
"""

from __future__ import annotations

import re
import signal

import pytest

from harness import inject
from test_kill import allreduce_loop, judge

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

TIMEOUT = 3.0


@pytest.mark.parametrize("transport, world, algorithm", [("tcp", 3, "ring"), ("shm", 3, "ring"), ("torch", 2, "ring"),
                                                           ("torch", 3, "ring")])
def test_sigstop_times_out_naming_the_silent_rank(transport, world, algorithm, fault_log):
    victim = world - 1
    out = inject(allreduce_loop, world, victim, signal.SIGSTOP, transport, algorithm, TIMEOUT,
                 timeout=TIMEOUT, seed=3)
    # gloo cannot carry a peer's error type: a survivor whose neighbour timed out first and
    # closed its connections sees PeerLost naming that neighbour (the chain check below still
    # has to lead to the silent rank). Seen once in CI: rank 1 of 3, rank 0 closing on it.
    allowed = ("CommTimeout", "PeerLost") if transport == "torch" and world > 2 else ("CommTimeout",)
    judge(out, fault_log, f"SIGSTOP rank {victim}/{world} during {algorithm} allreduce on {transport}",
          timeout=TIMEOUT, allowed=allowed)
    for r, res in out.results.items():
        print(f"  rank {r}: {res['message']}")
    named = {r for r, res in out.results.items() if names(res["message"], victim)}
    assert named, f"no survivor's error names the silent rank {victim}"
    # A survivor that waited on another survivor (both deadlines pass together) may name that
    # one instead; the chain of names must still lead to the silent rank.
    for r, res in out.results.items():
        assert leads_to(r, victim, out.results), f"rank {r}'s error leads nowhere near rank {victim}: {res['message']}"
    strict = not (set(out.results) - named)
    print(f"  every survivor names rank {victim}: {strict}")


def names(message: str, rank: int) -> bool:
    return re.search(rf"\brank {rank}\b", message) is not None


def leads_to(r: int, victim: int, results: dict, seen=()) -> bool:
    """True if rank r's error names the victim, or names a survivor whose error leads to it."""
    message = results[r]["message"]
    if names(message, victim):
        return True
    return any(names(message, s) and leads_to(s, victim, results, (*seen, r))
               for s in results if s != r and s not in seen)
