"""Parameter servers under the faults a review found: bad layouts and HELLOs, servers that close or
fail to start, checkpoints cut short, of the other strategy or taken between backward and step,
saves that cannot be written, threads that must end, a local optimizer's step, and servers
started at a script's top level.

Servers run in threads of this process and workers are ParameterServerTraining objects or raw
protocol channels (as in test_ps_server.py); only the start-up failure uses a real process.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import numpy as np
import pytest
import torch

from ringtrain import checkpoint
from ringtrain.errors import CommError, MismatchError, PeerLost, ProtocolError
from ringtrain.ps import ParameterServer, ParameterServerTraining, ServerConfig, launch_local
from ringtrain.ps import protocol as P
from ringtrain.ps.server_config import check_hello
from ringtrain.ps.sharding import layout_digest, make_layout
from ringtrain.transport import tcp_setup
from ringtrain.transport.local import on_threads
import ps_harness
from ps_harness import both_take_step_0, recv_partitions, tiny

pytestmark = pytest.mark.timeout(60)
SECRET = b"review-secret"
ONE_ELEMENT = 4 / (1 << 20)  # partition_mb of 1-element partitions: every server gets some of tiny()


def start_server(**kw) -> tuple[ParameterServer, threading.Thread, dict]:
    return ps_harness.start_server(SECRET, **kw)


def start_servers(n: int, **kw) -> list[tuple[ParameterServer, threading.Thread, dict]]:
    return [start_server(index=k, servers=n, **kw) for k in range(n)]


def join_all(started, timeout: float = 10.0) -> None:
    for _, thread, _ in started:
        thread.join(timeout)
        assert not thread.is_alive(), "a server did not finish"


def worker(endpoints, w: int = 0, workers: int = 1, **kw) -> ParameterServerTraining:
    kw = {"secret": SECRET, "lr": 0.1, "timeout": 10.0, **kw}
    return ParameterServerTraining(kw.pop("model", None) or tiny(), servers=endpoints, worker=w, workers=workers, **kw)


def train(ps: ParameterServerTraining, steps: int, save_after: tuple[int, ...] = ()) -> None:
    """Steps ps.step_count .. steps-1 on inputs that depend on the step only; save after the listed ones."""
    for s in range(ps.step_count, steps):
        ps.module(torch.full((2, 4), float(s + 1))).pow(2).sum().backward()
        ps.step()
        if s + 1 in save_after:
            ps.save_checkpoint()
    ps.wait()


def hello_of(layout, w: int = 0, strategy: str = "sync", **over) -> dict:
    return {"worker": w, "numels": list(layout.numels), "shapes": [[n] for n in layout.numels],
            "partition_bytes": layout.partition_bytes, "digest": layout.digest(), "strategy": strategy,
            "lr": 0.5, "momentum": 0.9, "weight_decay": 0.0,
            **over}


def dial(server: ParameterServer, w: int, workers: int) -> P.Channel:
    K, k = server.cfg.servers, server.cfg.index
    sock = P.dial(server.endpoint, P.ps_identity(K + w, K + workers, "ps", SECRET), k, 5.0)
    return ps_harness.RawWorker(sock, f"server {k}", 5.0)


def raw_worker(server: ParameterServer, hello: dict, workers: int = 1) -> P.Channel:
    """A worker speaking the protocol by hand: handshake, HELLO, WELCOME read."""
    ch = dial(server, hello["worker"], workers)
    ch.send(P.HELLO, worker=hello["worker"], body=P.encode_json(hello))
    head = ch.recv_header(5.0)
    assert head.kind == P.WELCOME, head.name
    ch.recv_json(head)
    return ch


def wait_for(condition, what: str, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def shard_file(root, k: int, step: int):
    return root / f"server-{k}" / checkpoint.checkpoint_name(step)


# --- 1. more servers than partitions ------------------------------------------------------------

def test_more_servers_than_partitions_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"4 servers but only 2 partitions .*; use at most 2 servers"):
        make_layout([12, 3], 4)
    with pytest.raises(ValueError, match="no parameter elements"):
        make_layout([0, 0], 1)
    with pytest.raises(ValueError, match="use at most 4 servers"):  # before any connection is tried
        ParameterServerTraining(tiny(), servers=[("127.0.0.1", 9)] * 5, worker=0, workers=1)


def test_a_server_left_without_partitions_refuses_the_hello_and_ends():
    """Server 3 of 4 for a model of 2 partitions: the worker hears why, the server does not hang."""
    server, thread, out = start_server(index=3, servers=4)
    pb = 4 << 20
    hello = {"worker": 0, "numels": [12, 3], "shapes": [[3, 4], [3]], "partition_bytes": pb,
             "digest": layout_digest([12, 3], 4, pb),
             "strategy": "sync", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}
    ch = dial(server, 0, 1)
    ch.send(P.HELLO, worker=0, body=P.encode_json(hello))
    with pytest.raises(MismatchError, match="4 servers but only 2 partitions"):
        ch.recv_header(5.0)
    ch.close()
    thread.join(10)
    assert not thread.is_alive() and "use at most 2 servers" in out["stats"]["failed"]


# --- 2. whatever goes wrong in a connection thread ends the job cleanly ---------------------------

NESTED = b'{"worker":0,"numels":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("body, word", [
    (NESTED, "nested too deeply"),
    ({"lr": -0.1}, "'lr' must be finite and > 0"),
    ({"lr": float("inf")}, "'lr' must be finite and > 0"),
    ({"momentum": float("nan")}, "'momentum' must be finite"),
    ({"numels": [1e400, 3]}, "'numels' must be an integer"),
    ({"numels": [12.0, 3]}, "'numels' must be an integer"),
    ({"numels": [12, -3]}, "'numels' must be an integer in \\[0, "),
    ({"partition_bytes": 2}, "'partition_bytes' must be an integer in \\[4, "),
    ({"strategy": ["sync"]}, "'strategy' must be one of"),
    ({"worker": True}, "'worker' must be an integer"),
    ({"numels": [13, 3], "shapes": [[13], [3]]}, "layout digest differs"),  # checked before any layout is built
    ({"shapes": None}, "'shapes' must be a list of 2 shapes"),
    ({"shapes": [[12]]}, "'shapes' must be a list of 2 shapes"),
    ({"shapes": [[3, 4], 3]}, "'shapes' must be a list of 2 shapes"),
    ({"shapes": [[3, 4.0], [3]]}, "'shapes' must hold lists of integers in \\[0, "),
    ({"shapes": [[3, -4], [3]]}, "'shapes' must hold lists of integers in \\[0, "),
    ({"shapes": [[3, True], [3]]}, "'shapes' must hold lists of integers in \\[0, "),
    ({"shapes": [[1] * 65, [3]]}, "'shapes' must hold lists of at most 64 sizes"),
    ({"shapes": [[3, 5], [3]]}, "'shapes' must .* elements as 'numels' says: parameter #0 has shape \\(3, 5\\) "
                                "but 12 elements"),
], ids=["nested", "lr<0", "lr=inf", "momentum=nan", "numel=1e400", "numel=12.0", "numel<0", "partition_bytes",
        "strategy", "worker=true", "digest", "shapes=null", "shapes-short", "shape=3", "dim=4.0", "dim<0",
        "dim=true", "65-dims", "shape!=numel"])
def test_a_bad_hello_is_refused_naming_the_field_and_the_server_ends(body, word):
    server, thread, out = start_server()
    layout = make_layout([12, 3], 1, 16)
    if isinstance(body, dict):
        body = P.encode_json(hello_of(layout, **body))
    ch = dial(server, 0, 1)
    ch.send(P.HELLO, worker=0, body=body)
    with pytest.raises((ProtocolError, MismatchError), match=word):
        ch.recv_header(5.0)
    ch.close()
    thread.join(10)
    assert not thread.is_alive() and "worker 0 was lost" in out["stats"]["failed"]


def test_a_hello_body_over_the_json_limit_is_refused_before_it_is_read():
    """A good HELLO padded with spaces to MAX_JSON + 1 bytes (valid JSON): refused by its length
    alone. The server may close before the 4 MiB are sent, so the verdict is read from its stats."""
    server, thread, out = start_server()
    body = P.encode_json(hello_of(make_layout([12, 3], 1, 16)))
    body += b" " * (P.MAX_JSON + 1 - len(body))
    ch = dial(server, 0, 1)
    try:
        ch.send(P.HELLO, worker=0, body=body)
        ch.recv_header(5.0)
    except CommError:  # the refusal, or the connection it closed under the send
        pass
    ch.close()
    thread.join(10)
    assert not thread.is_alive()
    assert f"{P.MAX_JSON + 1}-byte HELLO body (at most {P.MAX_JSON})" in out["stats"]["failed"]


def test_check_hello_normalizes_a_good_hello():
    hello = check_hello(hello_of(make_layout([12, 3], 1, 16), lr=1, momentum=0), "worker 0")
    assert hello["lr"] == 1.0 and isinstance(hello["lr"], float) and hello["numels"] == [12, 3]
    hello = check_hello(hello_of(make_layout([12, 1, 0], 1, 16), shapes=[[2, 3, 2], [], [4, 0]]), "worker 0")
    assert hello["shapes"] == [[2, 3, 2], [], [4, 0]]  # (a 0-dimensional parameter has 1 element)


def test_an_unexpected_exception_in_a_connection_is_reported_and_every_peer_told(monkeypatch):
    """A bug (any exception) while serving worker 1: worker 1 gets a ProtocolError with the cause,
    worker 0 the job's end, and the server finishes instead of waiting for ever."""
    server, thread, out = start_server(workers=2)
    layout = make_layout([12, 3], 1, 16)
    a, b = (raw_worker(server, hello_of(layout, w), workers=2) for w in (0, 1))

    def broken(w, ch, head):
        raise RuntimeError("boom")

    monkeypatch.setattr(server, "_on_pull", broken)
    b.send(P.PULL, worker=1, step=0)
    with pytest.raises(ProtocolError, match="could not serve worker 1: RuntimeError: boom"):
        b.recv_header(5.0)
    with pytest.raises(PeerLost, match="worker 1 was lost"):
        a.recv_header(5.0)
    for ch in (a, b):
        ch.close()
    thread.join(10)
    assert not thread.is_alive() and "boom" in out["stats"]["failed"]


# --- 3. a server that closes during the handshake -------------------------------------------------

def test_a_server_closing_before_welcome_is_peer_lost_naming_it():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def close_after_handshake():
        sock, _ = listener.accept()
        try:
            tcp_setup.accept_handshake(sock, P.ps_identity(0, 2, "ps", SECRET), {1}, set(), time.monotonic() + 5)
            sock.settimeout(5)
            sock.recv(1 << 16)  # the HELLO (so the worker's send succeeded), never answered
        finally:
            sock.close()

    t = threading.Thread(target=close_after_handshake, daemon=True)
    t.start()
    with pytest.raises(PeerLost, match=f"parameter server 0 at 127.0.0.1:{port} closed the connection"):
        worker([("127.0.0.1", port)])
    t.join(5)
    listener.close()


# --- 4. async checkpoints over several servers ----------------------------------------------------

def test_an_async_checkpoint_over_two_servers_resumes(tmp_path):
    """Worker 1 has pushed step 0 to server 0 but not yet to server 1 when worker 0 saves step 0:
    both servers save every worker at step 0, and a resumed job starts (servers agree)."""
    started = start_servers(2, workers=2, strategy="async", checkpoint_dir=str(tmp_path))
    endpoints = [s.endpoint for s, _, _ in started]
    ps = worker(endpoints, 0, 2, strategy="async", momentum=0.0)
    ps.wait()
    hello = hello_of(ps.layout, 1, "async", lr=0.1, momentum=0.0, weight_decay=0.0,
                     shapes=[list(p.shape) for p in ps.params])
    chans = [raw_worker(s, hello, workers=2) for s, _, _ in started]
    ids = ps._ids[0]
    chans[0].send(P.PUSH, worker=1, step=0, ids=ids,
                  values=[np.ones(sum(ps.layout.partitions[i].numel for i in ids), dtype=np.float32)])
    wait_for(lambda: started[0][0]._clock[1] == 1, "server 0 to take worker 1's push")
    ps.save_checkpoint()
    clocks = [checkpoint.load(shard_file(tmp_path, k, 0)).payload["clocks"] for k in range(2)]
    assert clocks == [[0, 0], [0, 0]]
    ps.close()
    for ch in chans:
        ch.close()
    join_all(started)

    started = start_servers(2, workers=2, strategy="async", checkpoint_dir=str(tmp_path), resume=True)
    endpoints = [s.endpoint for s, _, _ in started]

    def run(w):
        with worker(endpoints, w, 2, strategy="async", momentum=0.0) as p:
            resumed_at = p.step_count
            train(p, 1)
        return resumed_at

    assert on_threads(2, run, timeout=20) == [0, 0]
    join_all(started)


# --- 5. a sync save cut short on some servers -----------------------------------------------------

@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_save_cut_short_on_one_server_resumes_all_at_the_step_before(tmp_path, damage):
    started = start_servers(2, checkpoint_dir=str(tmp_path))
    ps = worker([s.endpoint for s, _, _ in started], momentum=0.9, partition_mb=ONE_ELEMENT)
    train(ps, 3, save_after=(1, 2))
    want = [p.detach().clone() for p in ps.module.parameters()]
    ps.close()
    join_all(started)
    late = shard_file(tmp_path, 1, 2)  # server 0 wrote step 2, server 1 did not (or not whole)
    if damage == "missing":
        late.unlink()
    else:
        late.write_bytes(late.read_bytes()[:100])

    started = start_servers(2, checkpoint_dir=str(tmp_path), resume=True)
    ps = worker([s.endpoint for s, _, _ in started], momentum=0.9, partition_mb=ONE_ELEMENT, model=tiny(seed=7))
    assert ps.step_count == 1
    train(ps, 3)
    for got, exact in zip(ps.module.parameters(), want):
        assert torch.equal(got, exact)
    ps.close()
    join_all(started)


# --- 6. a checkpoint of the other strategy ---------------------------------------------------------

def test_an_async_checkpoint_is_refused_by_a_sync_job_at_the_start(tmp_path):
    server, thread, _ = start_server(strategy="async", checkpoint_dir=str(tmp_path))
    ps = worker([server.endpoint], strategy="async")
    train(ps, 1, save_after=(1,))
    ps.close()
    thread.join(10)
    assert checkpoint.load(shard_file(tmp_path, 0, 1)).payload["strategy"] == "async"
    server, thread, out = start_server(strategy="sync", checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(MismatchError, match=r"made by an asynchronous job \(strategy 'async'\), this job's "
                                            r"strategy is 'sync': resume with strategy 'async'"):
        worker([server.endpoint], strategy="sync")
    thread.join(10)
    assert not thread.is_alive() and "asynchronous" in out["stats"]["failed"]


def test_an_async_checkpoint_of_two_servers_resumed_by_one_says_how_many_servers_made_it(tmp_path):
    # (a synchronous one is cut anew for one server: test_ps_reshard.py)
    started = start_servers(2, strategy="async", checkpoint_dir=str(tmp_path))
    ps = worker([s.endpoint for s, _, _ in started], strategy="async", partition_mb=ONE_ELEMENT)
    train(ps, 1, save_after=(1,))
    ps.close()
    join_all(started)
    server, thread, out = start_server(strategy="async", checkpoint_dir=str(tmp_path), resume=True)
    said = (r"was made by 2 servers, this job has 1: .* resume with 2 servers \(`ringtrain train --servers 2`, or "
            r"servers=2 in")
    with pytest.raises(MismatchError, match=said):
        worker([server.endpoint], strategy="async", partition_mb=ONE_ELEMENT)
    thread.join(10)
    assert not thread.is_alive()


# --- 7. a save between backward and step ----------------------------------------------------------

def test_a_save_between_backward_and_step_holds_the_shard_before_the_step(tmp_path):
    """One worker: its whole step-1 push is applied before the SAVE of step 1 arrives."""
    server, thread, _ = start_server(checkpoint_dir=str(tmp_path))
    ps = worker([server.endpoint], momentum=0.9)
    train(ps, 1)
    before = torch.cat([p.detach().reshape(-1) for p in ps.module.parameters()])
    momentum = torch.cat([server.opt.state[v]["momentum_buffer"] for v in server._views.values()])
    ps.module(torch.ones(2, 4)).sum().backward()
    wait_for(lambda: server.version == 2, "the server to apply step 1")
    ps.save_checkpoint()  # step_count is still 1
    ps.step()
    saved = checkpoint.load(shard_file(tmp_path, 0, 1)).payload
    assert saved["version"] == 1 and saved["clocks"] == [1]
    assert torch.equal(saved["params"], before) and torch.equal(saved["momentum"], momentum)
    ps.close()
    thread.join(10)


def test_a_save_while_a_step_is_half_applied_holds_the_shard_before_the_step(tmp_path):
    """Two workers: partitions 0 and 1 have taken step 1 (values and momentum), the rest not."""
    server, thread, out = start_server(workers=2, checkpoint_dir=str(tmp_path))
    layout = make_layout([12, 3, 6, 2], 1, 16)
    ids = np.arange(len(layout.partitions))
    start = np.arange(23, dtype=np.float32)
    a, b = (raw_worker(server, hello_of(layout, w), workers=2) for w in (0, 1))
    a.send(P.INIT, worker=0, ids=ids, values=[start])
    twos = [np.full(layout.partitions[i].numel, 2.0, dtype=np.float32) for i in ids]
    both_take_step_0(a, b, layout, ids, twos)
    for w, ch in enumerate((a, b)):
        ch.send(P.PULL, worker=w, step=2)
    b.send(P.PUSH, worker=1, step=1, ids=ids, values=twos)
    a.send(P.PUSH, worker=0, step=1, ids=ids[:2], values=twos[:2])
    recv_partitions(a, layout, [0, 1])  # stepped: step 1 is half applied
    a.send(P.SAVE, worker=0, step=1)
    head = a.recv_header(5.0)
    assert (head.kind, head.step, head.extra) == (P.SAVED, 1, 0)
    saved = checkpoint.load(shard_file(tmp_path, 0, 1)).payload
    # after step 0 (lr 0.5, momentum 0.9, gradient 2 everywhere): values start - 1, momentum 2
    assert saved["version"] == 1 and saved["clocks"] == [1, 1]
    assert torch.equal(saved["params"], torch.from_numpy(start - 1))
    assert torch.equal(saved["momentum"], torch.full((23,), 2.0))
    for ch in (a, b):
        ch.close()
    thread.join(10)
    assert not thread.is_alive()


# --- 8. a server that cannot start ----------------------------------------------------------------

@pytest.mark.multiprocess
def test_a_server_that_cannot_start_is_an_error_at_once_not_a_timeout():
    t0 = time.monotonic()
    with pytest.raises(CommError, match=r"parameter server 0 failed to start.*OSError"):
        launch_local(1, 1, host="203.0.113.7", timeout=60)  # TEST-NET-3: not an address of this host
    assert time.monotonic() - t0 < 30


@pytest.mark.multiprocess
def test_servers_started_at_a_scripts_top_level_say_to_guard_the_call(tmp_path):
    """Spawn imports the script again in each server, which starts servers again: multiprocessing
    refuses, the server exits with code 1 before any of its code ran, and the error says why."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from ringtrain import ps\nwith ps.launch_local(1, 1, timeout=30):\n    pass\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode != 0
    assert "bootstrapping phase" in run.stderr  # the server's own traceback
    assert re.search(r"CommError: parameter server\(s\) \[0\] exited \(code \[1\]\) before they could start: they "
                     r"died starting up, .*main module " + re.escape(str(script)) + r".*launch_local\(\) at its top "
                     r"level, put the call under `if __name__ == \"__main__\":`", run.stderr), run.stderr[-2000:]


# --- 9, 10. threads end ---------------------------------------------------------------------------

class _Recorder:
    def __init__(self):
        self.sent = []

    def send(self, kind, **kw):
        self.sent.append((kind, kw["step"], kw["ids"].tolist()))


def test_the_outbox_ends_on_the_shutdown_sentinel_taken_while_merging():
    import queue

    server = ParameterServer(ServerConfig(index=0, servers=1, workers=1, timeout=5.0))
    layout = make_layout([12, 3, 6, 2], 1, 16)
    with server._cond:
        server._configure(check_hello(hello_of(layout), "worker 0"))
    outbox: queue.Queue = queue.Queue()
    for item in (("params", 1, [0]), ("params", 1, [2]), None):
        outbox.put(item)
    ch = _Recorder()
    sender = threading.Thread(target=server._send_loop, args=(0, ch, outbox), daemon=True)
    sender.start()
    sender.join(2)
    alive = sender.is_alive()
    if alive:
        outbox.put(None)  # (release it: no thread left behind)
        sender.join(2)
    server._close_listener()
    assert not alive, "the sender thread swallowed the None sentinel"
    assert ch.sent == [(P.PARAMS, 1, [0, 2])]  # still merged into one message


def test_serve_returning_ends_the_accept_thread():
    before = set(threading.enumerate())
    server, thread, out = start_server(timeout=0.3)  # no worker ever comes
    thread.join(10)
    assert not thread.is_alive() and "no worker connected" in out["stats"]["failed"]
    wait_for(lambda: not [t for t in threading.enumerate() if t not in before and t.name.endswith("-accept")],
             "the accept thread to end", timeout=2)


def test_serve_returns_after_every_connection_thread_ended(monkeypatch):
    """A connection thread still closing its channel when the last worker's BYE is in: serve()
    waits for it, so no thread of the server outlives serve() (the process may exit next, and a
    daemon thread cut off at interpreter exit inside C++ aborts it)."""
    closed = P.Channel.close

    def slow_close(ch):
        if ch.peer.startswith("worker"):  # the server's side of a connection
            time.sleep(1.0)
        closed(ch)

    monkeypatch.setattr(P.Channel, "close", slow_close)
    before = set(threading.enumerate())
    server, thread, out = start_server(workers=2)

    def run(w):
        ps = worker([server.endpoint], w, 2)
        train(ps, 2)
        ps.close()

    assert on_threads(2, run, timeout=20) == [None, None]
    thread.join(20)
    assert not thread.is_alive()
    assert not [t for t in threading.enumerate() if t not in before], "threads outlived serve()"
    assert all(b["sent"] > 0 and b["received"] > 0 for b in out["stats"]["bytes_per_worker"].values())


def test_ctrl_c_on_a_server_waits_for_its_connections_before_the_process_ends():
    """KeyboardInterrupt in serve()'s wait (Ctrl-C of a server rank) went straight out: the
    listener stayed open and the connection threads, one maybe writing a shard, were cut off at
    exit (its temporary file left behind)."""
    server = ParameterServer(ServerConfig(index=0, servers=1, workers=1, secret=SECRET, timeout=10.0))
    wait = server._cond.wait

    def interrupted_wait(timeout=None):
        wait(timeout)
        if server._status[0] == "connected":
            raise KeyboardInterrupt

    server._cond.wait = interrupted_wait
    before = set(threading.enumerate())
    out: dict = {}

    def serve():
        try:
            server.serve()
        except KeyboardInterrupt:
            out["interrupted"] = server._listener.fileno() == -1  # closed before it went out

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ps = worker([server.endpoint])
    train(ps, 2)  # (the connection goes on serving while serve() waits for it)
    ps.close()
    thread.join(10)
    assert out == {"interrupted": True}
    assert not [t for t in threading.enumerate() if t not in before], "a server thread outlived serve()"


# --- 11, 12. a save that cannot be made fails that call only --------------------------------------

@pytest.mark.parametrize("where", ["unwritable", "none"])
def test_a_save_that_cannot_be_made_fails_that_call_only(tmp_path, where):
    if where == "unwritable":
        (tmp_path / "file").write_text("not a directory")
        server, thread, out = start_server(checkpoint_dir=str(tmp_path / "file" / "ckpt"))
        why = f"could not write the checkpoint of step 1 to {tmp_path / 'file' / 'ckpt' / 'server-0'}"
    else:
        server, thread, out = start_server()
        why = "started without a checkpoint directory"
    ps = worker([server.endpoint])
    train(ps, 1)
    for _ in range(2):  # asked again, it fails again (not an answer left over from the first time)
        with pytest.raises(CommError, match=f"step 1 was not saved: parameter server 0 .*{re.escape(why)}"):
            ps.save_checkpoint()
    train(ps, 3)  # the job goes on
    stats = ps.close()
    thread.join(10)
    assert stats["steps"] == 3 and out["stats"]["failed"] is None and out["stats"]["version"] == 3


def test_a_background_save_is_answered_before_the_write_which_may_outlast_the_timeout(tmp_path, monkeypatch):
    """save_checkpoint(background=True): the server copies its shard, answers, and writes it on a
    thread; a write held 1.5 s, longer than the 1 s timeout, holds up neither the save nor the
    training after it (the server used to write in the worker's connection and lose it as silent)."""
    from test_checkpoint_writer import Disk

    disk = Disk(monkeypatch)
    server, thread, out = start_server(checkpoint_dir=str(tmp_path), timeout=1.0)
    ps = worker([server.endpoint], timeout=1.0)
    train(ps, 1)
    t0 = time.monotonic()
    ps.save_checkpoint(background=True)
    train(ps, 3)
    ps.save_checkpoint(background=True)  # queued behind the write of step 1
    assert time.monotonic() - t0 < 1.0  # (answered within the 1 s timeout: the write is held until after this)
    assert disk.entered.wait(5) and disk.started == [1]
    threading.Timer(1.5, disk.open).start()
    train(ps, 5)
    ps.close()
    thread.join(10)
    assert out["stats"]["failed"] is None and server.write_error is None
    assert time.monotonic() - t0 >= 1.5  # serve() ended once the writes were done
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "server-0")] == [1, 3]
    assert checkpoint.latest(tmp_path / "server-0").payload["version"] == 3


def test_a_background_write_that_fails_is_said_by_the_next_save_and_at_the_end(tmp_path, monkeypatch):
    from test_checkpoint_writer import Disk

    disk = Disk(monkeypatch)
    disk.fail = {1, 3}
    disk.open()
    server, thread, out = start_server(checkpoint_dir=str(tmp_path))
    ps = worker([server.endpoint])
    train(ps, 1)
    ps.save_checkpoint(background=True)
    wait_for(lambda: not server._writer.writing, "the write of step 1")
    train(ps, 2)
    why = (f"could not write an earlier checkpoint to {tmp_path / 'server-0'} in the background (could not write "
           f"the checkpoint {tmp_path / 'server-0' / 'ckpt-000000001.pt'}: No space left on device")
    with pytest.raises(CommError, match=f"step 2 was not saved: .*{re.escape(why)}.*step 2 is not saved either"):
        ps.save_checkpoint(background=True)
    train(ps, 3)  # the job goes on
    ps.save_checkpoint(background=True)  # (answered: its write fails after)
    stats = ps.close()
    thread.join(10)
    assert stats["steps"] == 3 and out["stats"]["failed"] is None
    assert "ckpt-000000003.pt: No space left on device" in str(server.write_error)
    assert checkpoint.list_checkpoints(tmp_path / "server-0") == []


# --- 13. a local optimizer's step --------------------------------------------------------------------

@pytest.mark.parametrize("when", ["after backward", "after the next values arrived"])
def test_a_local_optimizer_step_is_refused_naming_the_parameters(when):
    """The pull for step t+1 is written into the parameters while step t's backward and step() run;
    a local step() mixed with it corrupted 1 run in 4 silently. Refused whichever came first."""
    server, thread, out = start_server()
    ps = worker([server.endpoint])
    model = ps.module
    train(ps, 1)
    model(torch.ones(2, 4)).pow(2).sum().backward()
    if when == "after the next values arrived":  # (1 worker: its pushes are all the server waits for)
        wait_for(lambda: min(ps._arrived) == ps.step_count + 1, "the values of step 2")
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(RuntimeError, match=r"parameters 0\.weight, 0\.bias, 2\.weight, 2\.bias were changed in "
                                           r"place on this worker.*do not step a local optimizer"):
        ps.step()
    ps.close()
    thread.join(10)
    assert not thread.is_alive()



# --- 14. a parameter unfrozen after wrapping ----------------------------------------------------------

def test_a_parameter_unfrozen_after_wrapping_is_refused_not_silently_left_untrained():
    """A parameter frozen when the module was wrapped is not served. Unfrozen later (gradual
    unfreezing), it got gradients that nobody applied and that piled up in .grad, silently."""
    server, thread, out = start_server()
    model = tiny()
    model[0].weight.requires_grad_(False)
    ps = worker([server.endpoint], model=model)
    train(ps, 1)  # frozen: served without it
    model[0].weight.requires_grad_(True)
    model(torch.ones(2, 4)).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match=r"0\.weight got a gradient, but it did not require one when .* was made"):
        ps.step()
    ps.close()
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("setting, value", [
    ("lr", float("inf")), ("momentum", float("inf")), ("weight_decay", float("inf")), ("lr", True), ("lr", "0.1"),
    ("timeout", float("inf")), ("partition_mb", float("inf")), ("alpha", float("inf")),
])
def test_worker_settings_no_server_takes_are_refused_before_connecting(setting, value):
    # Before: lr/momentum/weight_decay inf or True were accepted, the server refused the HELLO and
    # ended the job (ProtocolError); timeout or partition_mb inf crashed with a raw OverflowError,
    # lr "0.1" with a raw TypeError.
    with pytest.raises(ValueError, match=setting):
        ParameterServerTraining(tiny(), servers=[("127.0.0.1", 9)], worker=0, workers=1,
                                **{"timeout": 1.0, setting: value})


def test_numpy_scalar_settings_are_taken_as_floats():
    from ringtrain.ps import PSOptions

    opts = PSOptions(lr=np.float32(0.5), momentum=np.float64(0.9), timeout=np.int64(3))
    assert (opts.lr, opts.momentum, opts.timeout) == (0.5, 0.9, 3.0) and type(opts.lr) is float


@pytest.mark.parametrize("setting, value", [
    ("servers", 2.0), ("workers", True), ("index", 0.0), ("max_staleness", 1.5), ("timeout", float("inf")),
    ("servers", "1"),
])
def test_server_settings_of_the_wrong_kind_are_refused_naming_them(setting, value):
    # Before: servers=2.0 made launch_local fail with "TypeError: 'float' object cannot be
    # interpreted as an integer", workers=1.0 a server that failed to start with a TypeError
    # traceback, servers="1" a raw TypeError; max_staleness 1.5 and timeout inf were accepted.
    with pytest.raises(ValueError, match=setting):
        ServerConfig(**{"index": 0, "servers": 1, "workers": 1, setting: value})


def test_launch_local_refuses_a_float_server_count_before_starting_anything():
    with pytest.raises(ValueError, match="servers"):
        launch_local(2.0, 1)


def wrap_two(endpoints, model) -> list:
    """Workers 0 and 1 wrap model(w) against ``endpoints``, then close: what each returned or raised.
    Neither closes before both were answered (a worker 0 that said BYE before worker 1's HELLO came
    would end cleanly, 1 run in 3 here)."""
    both = threading.Barrier(2, timeout=20)

    def run(w: int):
        try:
            ps = worker(endpoints, w, 2, model=model(w), timeout=5.0)
        except BaseException:
            both.abort()
            raise
        try:
            both.wait()
        except threading.BrokenBarrierError:  # (the other was refused: the servers end the job)
            pass
        return ps.close()

    return on_threads(2, run, timeout=30)


@pytest.mark.parametrize("case", ["wider", "frozen"])
def test_workers_whose_models_differ_are_refused_naming_the_first_parameter_that_differs(case):
    # Before: "worker 1 disagrees with the other workers about ['digest', 'numels']", naming no parameter.
    started = start_servers(1, workers=2)
    endpoints = [s.endpoint for s, _, _ in started]

    def model(w: int) -> torch.nn.Module:
        m = tiny()
        if w == 1 and case == "wider":
            m[2] = torch.nn.Linear(3, 5)
        if w == 1 and case == "frozen":
            m[0].weight.requires_grad_(False)
        return m

    results = wrap_two(endpoints, model)
    texts = " | ".join(str(r) for r in results)
    assert all(isinstance(r, CommError) for r in results), texts
    if case == "wider":
        assert re.search(r"parameter #2 .* (15|6) elements, the first worker's (6|15)", texts), texts
    else:
        assert re.search(r"it has [34] parameters that require a gradient, the first worker [34]", texts), texts
    join_all(started)


class _TransposedLinear(torch.nn.Module):
    """Linear(4, 3) with its weight stored transposed: shape (4, 3), torch's is (3, 4)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 3))
        self.bias = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x @ self.weight + self.bias


@pytest.mark.parametrize("case, theirs", [("transposed", "(4, 3)"), ("reshaped", "(2, 6)"), ("flattened", "(12,)")])
def test_workers_whose_parameter_shapes_differ_at_the_same_size_are_refused_naming_both_shapes(case, theirs):
    # Before: both workers were accepted (the HELLO had sizes, not shapes) and trained one
    # another's weights scrambled: worker 1's (4, 3) got worker 0's (3, 4) values, element by element.
    started = start_servers(1, workers=2)
    endpoints = [s.endpoint for s, _, _ in started]

    def model(w: int) -> torch.nn.Module:
        m = tiny()
        if w == 1 and case == "transposed":
            m[0] = _TransposedLinear()
        if w == 1 and case in ("reshaped", "flattened"):
            m[0].weight = torch.nn.Parameter(torch.zeros(2, 6) if case == "reshaped" else torch.zeros(12))
        return m

    results = wrap_two(endpoints, model)
    texts = " | ".join(str(r) for r in results)
    assert all(isinstance(r, CommError) for r in results), texts
    ours = re.escape("(3, 4)")
    pattern = (rf"disagrees with the other workers about \['shapes'\]: its parameter #0 \(counting those of "
               rf"module.parameters\(\) that require a gradient\) has shape ({re.escape(theirs)}|{ours}), the first "
               rf"worker's ({re.escape(theirs)}|{ours})")
    assert re.search(pattern, texts), texts
    join_all(started)


def test_a_module_with_nothing_to_train_is_refused_saying_so():
    # Before: "ValueError: no parameter elements to serve (parameter sizes [])" from the layout.
    model = tiny()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires a gradient"):
        ParameterServerTraining(model, servers=[("127.0.0.1", 9)], worker=0, workers=1, timeout=1.0)


def test_a_worker_count_other_than_the_servers_says_which_counts_to_compare():
    # Before: "rank 0 says world size 2, this rank 1 has 3 (handshake ranks: servers 0..0, worker w
    # is 1 + w)": world sizes and ranks the caller never gave, not the workers= that differs.
    started = start_server(workers=1)
    with pytest.raises(ProtocolError, match=r"world size 3 = 1 server\(s\) \+ workers=2"):
        worker([started[0].endpoint], 0, 2, timeout=2.0)
    worker([started[0].endpoint], 0, 1).close()  # the server still serves its one worker
    join_all([started])


@pytest.mark.parametrize("strategy, staleness", [("sync", 2), ("sharded", None)])
def test_a_staleness_bound_for_a_synchronous_server_is_refused_not_ignored(strategy, staleness):
    # Before: launch_local(strategy="sync", max_staleness=2) was accepted and the bound ignored.
    with pytest.raises(ValueError, match="max_staleness .*async"):
        ServerConfig(index=0, servers=1, workers=1, strategy=strategy, max_staleness=staleness)
    from ringtrain.ps.__main__ import parse

    with pytest.raises(SystemExit):
        parse(["--strategy", strategy, "--max-staleness", "-1" if staleness is None else str(staleness)])


# --- 15. step() without backward ---------------------------------------------------------------------

@pytest.mark.parametrize("when", ["first step", "after a step", "forward only"])
def test_a_step_without_any_gradient_is_refused_and_moves_nothing(when):
    # Before: step() with no gradient at all pushed zeros and the servers' momentum moved every
    # parameter (by 0.9 x the last update after a step); torch's SGD leaves parameters whose .grad
    # is None alone. Now a RuntimeError before anything is pushed, and training goes on as if the
    # call had not been made.
    server, thread, out = start_server()
    model, ref = tiny(), tiny()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ps = worker([server.endpoint], model=model, momentum=0.9)
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)

    def both_step():
        for m, step in ((model, ps.step), (ref, opt.step)):
            m.zero_grad(set_to_none=True)
            m(x).pow(2).sum().backward()
            step()

    if when != "first step":
        both_step()
    model.zero_grad(set_to_none=True)
    if when == "forward only":
        model(x)
    ps.wait()
    before, version = [p.detach().clone() for p in model.parameters()], server.version
    with pytest.raises(RuntimeError, match=r"worker 0: step\(\) was called but no parameter has a gradient.*"
                                           r"call loss\.backward\(\) before ps\.step\(\)"):
        ps.step()
    ps.wait()
    assert server.version == version and all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    both_step()  # and it trains on, as torch does
    ps.wait()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    stats = ps.close()
    thread.join(10)
    assert out["stats"]["failed"] is None and stats["steps"] == server.version


def test_zero_gradients_without_backward_step_as_torch_does():
    """Gradients set to zeros (not None) with no backward: pushed as zeros, momentum moves the
    parameters, as torch's SGD moves them."""
    server, thread, out = start_server()
    model, ref = tiny(), tiny()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ps = worker([server.endpoint], model=model, momentum=0.9)
    x = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    for m, step in ((model, ps.step), (ref, opt.step)):
        m(x).pow(2).sum().backward()
        step()
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        step()
    ps.wait()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert not torch.equal(model[0].weight, tiny()[0].weight)
    ps.close()
    thread.join(10)


# --- docs review: every worker of the loop in docs/ps.md saves -------------------------------------

@pytest.mark.parametrize("background", [False, True])
def test_saves_asked_by_two_workers_at_once_are_both_made(tmp_path, background):
    """docs/ps.md's loop ends with pst.save_checkpoint(); run by W workers, every worker asks at
    the same step. The server's connection threads shared its CheckpointWriter unguarded: one
    joined or popped the write the other had queued ("RuntimeError: cannot join thread before it
    is started" with worker processes, "IndexError: pop from empty list" here: [False] failed 4
    runs in 4), and the server dropped that worker as lost, ending the job."""
    server, thread, out = start_server(workers=2, checkpoint_dir=str(tmp_path))
    workers = [worker([server.endpoint], w, 2) for w in range(2)]
    gate = threading.Barrier(2)

    def body(w):
        for s in range(3):
            train(workers[w], s + 1)
            gate.wait(10)
            workers[w].save_checkpoint(background=background)
        return workers[w].close()

    results = on_threads(2, body, timeout=40)
    thread.join(10)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert out["stats"]["failed"] is None and server.write_error is None
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "server-0")] == [1, 2, 3]
    assert checkpoint.latest(tmp_path / "server-0").payload["version"] == 3


def test_a_workers_parameters_and_gradients_can_still_be_resized_after_training():
    # Before: the worker sent and received through Tensor.numpy() of its parameters' and
    # gradients' slices, which marks their storage non-resizable for good ("Trying to resize
    # storage that is not resizable" at a later resize_, which torch allows after gloo).
    started = start_server(workers=1)
    ps = worker([started[0].endpoint], 0, 1)
    train(ps, 1)
    ps.module(torch.ones(2, 4)).pow(2).sum().backward()
    grads = [p.grad for p in ps.module.parameters()]  # (step() pushes, then lets go of them)
    ps.step()
    ps.wait()
    ps.close()
    join_all([started])
    for p, grad in zip(ps.module.parameters(), grads):
        p.data.resize_(p.numel() + 16)
        grad.resize_(p.numel() + 16)


def _three_steps_as_torch_sgd(ps, model, ref, x) -> None:
    """Three steps of ``ps`` (training ``model``) on x, 2x, 3x, and of torch's SGD (lr 0.1,
    momentum 0.9) on ``ref``, a copy of ``model``: the parameters must end bitwise equal."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(3):
        ref.zero_grad(set_to_none=True)
        ref(x * (s + 1)).pow(2).sum().backward()
        opt.step()
        model(x * (s + 1)).pow(2).sum().backward()
        ps.step()
    ps.wait()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_a_push_reads_its_own_groups_partitions_not_every_shard():
    """Before: each push walked every server's whole shard for its group's partitions, so a step
    of P parameters pushed one group each (the first step; plans of many small groups after it)
    made P x partitions tests: 4.5M a step at 3,000 parameters over 2 servers. Now it takes its
    parameters' own partitions: no shard is walked during a step, and training is torch's SGD's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(20)])
    ref = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(20)])
    ref.load_state_dict(model.state_dict())
    started = start_servers(2, strategy="sharded")
    ps = worker([s.endpoint for s, _, _ in started], model=model, strategy="sharded", momentum=0.9)
    walks = [0]

    class Counting(list):
        def __iter__(self):
            walks[0] += 1
            return super().__iter__()

    ps._shards = [Counting(shard) for shard in ps._shards]
    _three_steps_as_torch_sgd(ps, model, ref, torch.ones(2, 3))
    assert walks[0] == 0, f"the shards were walked {walks[0]} times in 3 steps"
    ps.close()
    join_all(started)


def test_a_push_of_many_small_partitions_is_stepped_in_runs_not_one_by_one(monkeypatch):
    """Before: a synchronous server counted, stepped, copied for undo and streamed back every
    partition of a push alone (one optimizer step and one PARAMS message each: 1,500 a step per
    server at 3,000 small parameters). Now runs of at least STEP_RUN_BYTES: one here, where the
    whole model is smaller; runs of that size where it is set lower. The parameters are torch SGD's."""
    from ringtrain.ps import server as server_module

    for run_bytes, runs in ((None, [40]), (200, [4] * 10)):  # 40 partitions of 64 B
        if run_bytes is not None:
            monkeypatch.setattr(server_module, "STEP_RUN_BYTES", run_bytes, raising=False)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(40)])
        ref = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(40)])
        ref.load_state_dict(model.state_dict())
        server, thread, out = start_server()
        applied = []
        apply = server._apply
        monkeypatch.setattr(server, "_apply", lambda ids, *a: (applied.append(len(ids)), apply(ids, *a))[1])
        ps = worker([server.endpoint], model=model, momentum=0.9, schedule="single")
        _three_steps_as_torch_sgd(ps, model, ref, torch.full((2, 4), 0.1))
        ps.close()
        thread.join(10)
        assert sum(applied) == 3 * 40
        assert applied[-2 * len(runs):] == runs * 2, applied  # the last two steps: one push each, in runs


def test_the_first_step_pushes_once_after_backward_so_the_plan_times_backward_alone(monkeypatch):
    """Before: the first step pushed every parameter alone from its gradient hook, and that work
    went into the backward gaps the plan is made from: 3,000 small parameters were planned into
    ~900-1,300 pushes a step. Now the first step's gradients go out in one push once backward
    has ended (as DistributedDataParallel profiles with one bucket)."""
    server, thread, out = start_server()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(10)])
    ps = worker([server.endpoint], model=model, momentum=0.9)
    pushes = []
    push = ps._push_group

    def counted(g):
        pushes.append((ps.step_count, len(ps._groups[g]), len(ps._stamps)))
        push(g)

    monkeypatch.setattr(ps, "_push_group", counted)
    for s in range(2):
        model(torch.full((2, 4), float(s + 1))).pow(2).sum().backward()
        ps.step()
    ps.wait()
    first = [p for p in pushes if p[0] == 0]
    assert first == [(0, 20, 20)], first  # one push of the 20 parameters, after the last gradient's stamp
    ps.close()
    thread.join(10)
