"""The communication thread: jobs run one at a time in submission order; errors and deadlines
reach the waiting thread."""

from __future__ import annotations

import threading
import time

import pytest

from ringtrain import CommTimeout
from ringtrain.ddp.comm_thread import CommThread


def test_jobs_run_in_order_one_at_a_time():
    thread = CommThread()
    seen, running = [], []

    def job(i):
        running.append(i)
        assert len(running) == 1, "two jobs ran at once"
        time.sleep(0.001)
        seen.append(i)
        running.pop()
        return i * i

    jobs = [thread.submit(f"job {i}", lambda i=i: job(i), nbytes=i) for i in range(20)]
    assert [j.wait(5.0) for j in jobs] == [i * i for i in range(20)]
    assert seen == list(range(20))
    assert all(a.ended <= b.started for a, b in zip(jobs, jobs[1:]))
    assert {j.name for j in threading.enumerate()} >= {"ringtrain-ddp-comm"}
    thread.close()
    with pytest.raises(RuntimeError):
        thread.submit("late", lambda: None)


def test_an_error_is_raised_in_the_waiting_thread_and_later_jobs_still_run():
    thread = CommThread()

    def boom():
        raise ValueError("bad bucket")

    failed = thread.submit("boom", boom)
    after = thread.submit("after", lambda: 7)
    with pytest.raises(ValueError, match="bad bucket"):
        failed.wait(5.0)
    assert after.wait(5.0) == 7
    thread.close()


def test_wait_has_a_deadline():
    thread = CommThread()
    gate = threading.Event()
    job = thread.submit("stuck", lambda: gate.wait(5.0))
    with pytest.raises(CommTimeout, match="stuck"):
        job.wait(0.05)
    with pytest.raises(CommTimeout, match="stuck"):
        job.settle(0.05)
    gate.set()
    assert job.wait(5.0) is True
    thread.close()


def test_settle_waits_without_raising_the_jobs_error():
    thread = CommThread()

    def boom():
        raise ValueError("bad bucket")

    failed = thread.submit("boom", boom)
    failed.settle(5.0)
    assert failed.done and isinstance(failed.error, ValueError)
    thread.close()
