"""The communication thread: the one thread that runs a wrapper's collectives, in order.

A Communicator runs one collective at a time, and every rank must issue the same collectives
in the same order. So each DistributedDataParallel owns one CommThread and sends every
collective through it: the broadcast at construction, the calibration sweep, the profile
exchange, and each bucket's allreduce. Words:

- *job*: one callable run on the thread, with a label, the time it started and ended
  (``time.perf_counter`` seconds, the clock the wrapper's hooks use), and its result or error.
- *submit*: queue a job (first in, first out); *wait*: block until it ends, with a deadline;
  *settle*: block until it ends, whatever its outcome (:func:`settle_all`: every job of a list).

A job that raises keeps its exception, which ``wait`` re-raises in the waiting thread. The
Communicator marks itself broken after an error, so the jobs behind a failed one fail fast.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

from ..errors import CommTimeout


class Job:
    """One queued call; ``wait`` returns its result or re-raises its error."""

    __slots__ = ("label", "fn", "nbytes", "started", "ended", "result", "error", "_done")

    def __init__(self, label: str, fn: Callable[[], Any], nbytes: int = 0):
        self.label = label
        self.fn = fn
        self.nbytes = nbytes
        self.started = 0.0
        self.ended = 0.0
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> Any:
        """The job's result, once it has ended; CommTimeout if that takes over ``timeout`` s."""
        self.settle(timeout)
        if self.error is not None:
            raise self.error
        return self.result

    def settle(self, timeout: float) -> None:
        """Block until the job has ended, whatever its outcome; CommTimeout if that takes over
        ``timeout`` s."""
        if not self._done.wait(timeout):
            raise CommTimeout(f"communication job {self.label!r} did not finish within {timeout:.1f} s")


class CommThread:
    """A daemon thread that runs submitted jobs one at a time, in submission order."""

    def __init__(self, name: str = "ringtrain-ddp-comm"):
        self._queue: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, label: str, fn: Callable[[], Any], nbytes: int = 0) -> Job:
        if self._closed:
            raise RuntimeError("the communication thread is closed")
        job = Job(label, fn, nbytes)
        self._queue.put(job)
        return job

    def run(self, label: str, fn: Callable[[], Any], timeout: float) -> Any:
        """Submit and wait: run ``fn`` on the thread and return its result."""
        return self.submit(label, fn).wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Finish the queued jobs, then stop the thread (waits at most ``timeout`` s)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if threading.current_thread() is not self._thread:  # (a wrapper collected on this thread closes it)
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.started = time.perf_counter()
            try:
                job.result = job.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                job.error = exc
            job.ended = time.perf_counter()
            job.fn = None  # drop references to buffers once done
            job._done.set()
            # Not held while waiting for the next: a failed job's error, raised in the wrapper's
            # frames too, holds the wrapper, which then was never collected, nor this thread ended.
            del job


def settle_all(jobs: Sequence[Job], timeout: float) -> None:
    """Block until every job (of one thread, in submission order) has ended, each within a
    deadline of its own: ``timeout`` from the end of the job before it (or from now, if that one
    ended before). Allreduces that are each slow but within the deadline are no timeout, however
    many there are.

    Jobs run in order, so waiting for the last one waits for all: normally one wake-up. A
    wait per bucket woke this thread once per allreduce on every rank: wfbp on the CNN at 4
    ranks / 10 Gbit/s (107 allreduces) left 3-4 ms per iteration between allreduces on the
    communication thread, 0.6 ms with the one wait."""
    start = time.perf_counter()
    k = 0  # the first job not ended
    while True:
        while k < len(jobs) and jobs[k].done:
            k += 1
        if k == len(jobs):
            return
        since = max(start, jobs[k - 1].ended) if k else start
        left = since + timeout - time.perf_counter()
        if left <= 0:
            raise CommTimeout(f"communication job {jobs[k].label!r} did not finish within {timeout:.1f} s")
        with contextlib.suppress(CommTimeout):  # (then: has the first one not ended moved on?)
            jobs[-1].settle(left)
