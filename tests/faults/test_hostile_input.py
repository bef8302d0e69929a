"""Hostile wire input in CI, through ringtrain.bench.fuzz: the parameter server's port (whose
own tests have no fuzz run) gets 500 cases, the tcp listener and frames a short run beside
the tcp engineer's 500-case hypothesis tests (tests/test_tcp_transport.py).

Every target runs in its own process: it must not die, must close every hostile connection
(no hang), must log a refusal for every stranger, must still serve a genuine peer, and its
peak memory must not move by more than a few MiB whatever the frames claim (up to 2^64 - 1).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ringtrain.bench import fuzz
from ringtrain.lifecycle import pid_alive

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def check(report: dict) -> None:
    assert report["crashes"] == 0, report["crash_reasons"]
    assert report["hangs"] == 0
    assert report["still_serving"]
    grew = report["memory_after_mb"]["VmHWM"] - report["memory_before_mb"]["VmHWM"]
    assert grew < 16, f"peak memory grew by {grew} MiB"


def test_parameter_server_port_500_cases():
    report = fuzz.fuzz_target("ps", 500, seed=6)
    print(report["families"], report["target_report"]["logged"])
    check(report)
    strangers = report["cases"] - report["authenticated_cases"]
    stats = report["target_report"]["stats"]
    assert stats["refused_connections"] == strangers  # every stranger refused in the handshake ...
    assert sum(report["target_report"]["logged"].values()) >= strangers  # ... and logged
    assert report["target_report"]["notices"] == report["authenticated_cases"]  # each bad worker dropped


@pytest.mark.parametrize("target", ["listener", "frames"])
def test_tcp_listener_and_frames_short_run(target):
    report = fuzz.fuzz_target(target, 300, seed=6)
    check(report)
    rep = report["target_report"]
    if target == "listener":
        assert rep["refused"] == report["cases"] and rep["admitted"] == [1]
    else:  # every frame ended in data (a frame that happens to be valid) or a CommError, never a hang
        assert sum(rep["outcomes"].values()) == report["cases"] + 1  # + the genuine stop frame
        assert rep["outcomes"].get("ProtocolError", 0) > 0


def test_cases_are_reproducible_and_cover_every_family():
    a = [fuzz.frame_case(random.Random(f"1/{i}")) for i in range(400)]
    b = [fuzz.frame_case(random.Random(f"1/{i}")) for i in range(400)]
    assert a == b
    assert {f for f, _ in a} == {"random", "magic", "fields", "truncated", "claims", "abort", "flip", "oversized"}
    hs = {fuzz.handshake_case(random.Random(i))[0] for i in range(400)}
    assert hs == {"random", "magic", "fields", "truncated", "mac", "flip", "oversized"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cases", [1, 3, 10])
def test_few_ps_cases_still_give_the_server_a_worker(cases):
    # int(cases * 0.3) == 0 once asked for a server with no workers, which never started
    report = fuzz.fuzz_target("ps", cases, seed=6)
    assert report["authenticated_cases"] >= 1
    check(report)


@pytest.mark.timeout(30)
def test_a_target_that_dies_before_it_starts_fails_fast():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with status"):
        fuzz._start(fuzz.serve_ps, 0)  # a server for no workers refuses to start
    assert time.monotonic() - t0 < 20  # not the 60 s start-up deadline


ORPHAN = textwrap.dedent("""
    import time
    from ringtrain.bench import fuzz
    proc, pipe, endpoint = fuzz._start(fuzz.serve_listener)
    print(proc.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.timeout(40)
def test_the_target_dies_with_the_fuzzer():
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while pid_alive(child) and not _zombie(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(child) or _zombie(child), "the target outlived the fuzzer"
    finally:
        parent.kill()
        parent.wait(timeout=5)
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
