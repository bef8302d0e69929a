"""A worker's process that ends without close() (its script raised) exits with the script's
status: its link threads are stopped before Python finalizes.

Before, the daemon sender and receiver threads were still running then, and one inside torch
(the receiver writing pulled values into a parameter) was cut off there by the interpreter: the
process aborted after printing the script's traceback ("terminate called without an active
exception", SIGABRT; under ``ringtrain launch`` "rank 1 failed (killed by SIGABRT)", exit 134).
The server runs on a thread of this process; each worker is a process of its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ps_harness import start_server

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]
SECRET = "exit-secret"
RUNS = 6

# Asynchronous: the server answers the pull with the whole shard in one message, so the receiver
# writes a thousand partitions already in its socket, each through torch, while the script raises
# (it waits for the first one only). Before the fix about half of such runs aborted. A finalizer
# made before the worker runs after the worker's at exit (weakref.finalize: newest first; atexit
# callbacks: last registered first) and says which link threads are still alive by then: none.
SCRIPT = textwrap.dedent("""
    import sys
    import threading
    import time
    import weakref

    import torch
    from torch import nn

    from ringtrain.ps import ParameterServerTraining

    class Probe:
        pass

    def report():
        alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("ps-w"))
        print(f"link threads alive at exit: {alive}", file=sys.stderr, flush=True)

    probe = Probe()
    weakref.finalize(probe, report)
    host, port, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
    model = nn.ParameterList([nn.Parameter(torch.randn(256)) for _ in range(1000)])
    pst = ParameterServerTraining(model, servers=[(host, port)], worker=0, workers=1, secret=secret,
                                  strategy="async", lr=0.01, timeout=10.0)
    sum(p.sum() for p in model).backward()
    pst.step()
    while max(pst._arrived) < pst.step_count:  # (until the answer is coming in)
        time.sleep(0.0005)
    raise ValueError("the worker gives up")
""")


def test_a_worker_that_raises_without_close_exits_1_not_aborted(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    for run in range(RUNS):
        server, thread, _ = start_server(SECRET.encode(), strategy="async", timeout=10.0)
        host, port = server.endpoint
        done = subprocess.run([sys.executable, str(script), host, str(port), SECRET], capture_output=True, text=True,
                              timeout=60)
        thread.join(15)
        assert not thread.is_alive(), "the server did not finish"
        err = done.stderr
        assert "terminate called" not in err and done.returncode == 1, f"run {run}: exit {done.returncode}\n{err[-3000:]}"
        assert "ValueError: the worker gives up" in err, err[-3000:]
        assert "link threads alive at exit: []" in err, f"run {run}:\n{err[-3000:]}"


@pytest.mark.timeout(60)
def test_a_worker_dropped_without_close_lets_go_of_its_threads_connection_and_hooks():
    """A worker the script lets go unclosed (a notebook cell run again) is collected: its link
    threads end, its connection closes (the server ends, its worker gone) and its hooks leave the
    module. Before, the threads held the worker: each dropped worker kept its 2 threads and a
    socket per server for ever, and its hooks on a module still in use."""
    import gc
    import threading
    import time

    import torch
    from torch import nn

    from ringtrain.ps import ParameterServerTraining

    server, thread, _ = start_server(SECRET.encode(), timeout=10.0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    pst = ParameterServerTraining(model, servers=[server.endpoint], worker=0, workers=1, secret=SECRET.encode(),
                                  lr=0.05, timeout=10.0)
    for _ in range(2):
        pst(torch.randn(16, 4)).pow(2).mean().backward()
        pst.step()
    del pst
    deadline = time.monotonic() + 10.0
    # (collected again while waiting: a link thread may hold the worker for the message it is on
    # when the first collection runs, and an idle process may not collect again by itself)
    while time.monotonic() < deadline and any(t.name.startswith("ps-w") for t in threading.enumerate()):
        gc.collect()
        time.sleep(0.02)
    assert [t.name for t in threading.enumerate() if t.name.startswith("ps-w")] == []
    thread.join(15)
    assert not thread.is_alive(), "the server still waits for the dropped worker"
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())



@pytest.mark.timeout(60)
def test_a_worker_collected_on_its_own_receiver_thread_lets_go_quietly(monkeypatch):
    """A worker let go unclosed is collected where the garbage collector happens to run: often on
    its receiver thread, which allocates for every message. Its finalizer then runs there. Before:
    it joined every link thread, that one too ('Exception ignored in: <finalize object ...>
    RuntimeError: cannot join current thread'; the threads listed after it not waited for)."""
    import gc
    import threading
    import time
    import weakref

    import torch
    from torch import nn

    from ringtrain.ps import ParameterServerTraining
    from ringtrain.ps import worker as worker_module

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    armed, dropped, collected = threading.Event(), threading.Event(), threading.Event()
    next_header = worker_module._next_header

    def collecting_next_header(link):  # (the receiver, between messages: a collection there)
        if armed.is_set():
            dropped.wait(10)
            gc.collect()
            collected.set()
        return next_header(link)

    monkeypatch.setattr(worker_module, "_next_header", collecting_next_header)
    server, thread, _ = start_server(SECRET.encode(), timeout=10.0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    pst = ParameterServerTraining(model, servers=[server.endpoint], worker=0, workers=1, secret=SECRET.encode(),
                                  lr=0.05, timeout=10.0)
    me = weakref.ref(pst)
    gc.disable()  # (collections on the receiver thread only)
    try:
        for step in range(2):
            if step:
                armed.set()
            pst(torch.randn(16, 4)).pow(2).mean().backward()
            pst.step()
            pst.wait()
        del pst
        dropped.set()
        assert collected.wait(10)
    finally:
        gc.enable()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(t.name.startswith("ps-w") for t in threading.enumerate()):
        time.sleep(0.02)
    assert me() is None and [t.name for t in threading.enumerate() if t.name.startswith("ps-w")] == []
    assert unraisable == []
    thread.join(15)
    assert not thread.is_alive(), "the server still waits for the dropped worker"
