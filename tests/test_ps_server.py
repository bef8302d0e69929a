"""A parameter server in this process (threads): refusing strangers, message checks, options.

The server runs in a thread; workers are ParameterServerTraining objects in threads, so
these tests are fast. Real processes are in test_ps_training.py.
"""

from __future__ import annotations

import re
import select
import socket
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from ringtrain.errors import AuthError, CommError, PeerLost, ProtocolError
from ringtrain.ps import ParameterServer, ParameterServerTraining, PSOptions, ServerConfig
from ringtrain.ps import protocol as P
from ringtrain.transport import wire
from ringtrain.transport.base import CallHeader
from ringtrain.transport.local import on_threads
import ps_harness
from ps_harness import both_take_step_0, recv_params, tiny
from sockets import congestion

pytestmark = pytest.mark.timeout(30)
SECRET = b"test-secret"


def start_server(**kw) -> tuple[ParameterServer, threading.Thread, dict]:
    return ps_harness.start_server(SECRET, **kw)


def as_torchrun_rank_0(monkeypatch, world_size: int) -> None:
    """The variables torchrun gives rank 0 of ``world_size`` ranks (nothing listens at the port)."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", str(world_size)), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", "29999")):
        monkeypatch.setenv(name, value)


def train_one(endpoint, steps: int = 3, **kw) -> dict:
    model = tiny()
    kw = {"workers": 1, **kw}
    ps = ParameterServerTraining(model, servers=[endpoint], worker=0, secret=SECRET, lr=0.1, **kw)
    for s in range(steps):
        x = torch.full((2, 4), float(s + 1))
        model(x).sum().backward()
        ps.step()
    ps.wait()
    return ps.close()


def wait_refused(server: ParameterServer, n: int) -> None:
    end = time.monotonic() + 10
    while server.refused < n:
        assert time.monotonic() < end, f"server refused {server.refused} connections, expected {n}"
        time.sleep(0.02)


def test_header_round_trip_and_garbage_is_a_protocol_error():
    raw = P.pack_header(P.PUSH, worker=3, count=2, step=7, version=5, extra=1)
    head = P.unpack_header(raw, P.HEADER_SIZE + 16)
    assert (head.kind, head.worker, head.count, head.step, head.version, head.extra, head.body) == (
        P.PUSH, 3, 2, 7, 5, 1, 16)
    with pytest.raises(ProtocolError, match="magic"):
        P.unpack_header(b"XXXX" + raw[4:], P.HEADER_SIZE)
    with pytest.raises(ProtocolError, match="kind"):
        P.unpack_header(raw[:4] + bytes([99]) + raw[5:], P.HEADER_SIZE)
    with pytest.raises(ProtocolError, match="reserved 1"):  # (bytes 6-7: kept 0 for a later use)
        P.unpack_header(raw[:6] + b"\x01\x00" + raw[8:], P.HEADER_SIZE)


def test_a_channel_refuses_a_message_whose_lengths_do_not_add_up():
    """The receiver checks what a peer announces before it reads on: more ids than the shard
    has, ids beyond the frame's end, a JSON body that is not an object, a frame shorter than a
    message header. Each is a ProtocolError naming the peer, not a read into the next message
    (a timeout, or values taken from another frame) or an error far from the cause."""
    a, b = socket.socketpair()
    ca, cb = P.Channel(a, "a", 0.5), P.Channel(b, "worker 1", 0.5)
    try:
        def raw(payload: bytes) -> None:
            frame = wire.encode_data_header(CallHeader(1, "send", numel=len(payload)), len(payload))
            a.sendall(frame + payload)

        ca.send(P.PUSH, ids=np.arange(5), values=[np.zeros(5, np.float32)])
        with pytest.raises(ProtocolError, match="worker 1 sent PUSH with 5 ids \\(at most 4 allowed\\)"):
            cb.recv_ids(cb.recv_header(1.0), 4)
        cb.recv_into(np.empty(10, np.float32))  # (the refused ids and the values: the stream goes on)
        ca.send(P.PUSH, ids=np.arange(5), values=[np.zeros(5, np.float32)])
        assert cb.recv_ids(cb.recv_header(1.0), 5).tolist() == [0, 1, 2, 3, 4]
        cb.recv_into(np.empty(5, np.float32))
        raw(P.pack_header(P.PUSH, count=10) + bytes(8))  # 10 ids announced, 2 in the frame
        with pytest.raises(ProtocolError, match="with 10 ids"):
            cb.recv_ids(cb.recv_header(1.0), 100)
        cb.recv_into(np.empty(2, np.float32))  # (the 8 bytes that were there)
        ca.send(P.HELLO, body=b"[1, 2]")
        with pytest.raises(ProtocolError, match="worker 1 sent a HELLO body that is not a JSON object"):
            cb.recv_json(cb.recv_header(1.0))
        raw(bytes(10))
        with pytest.raises(ProtocolError, match="worker 1 sent a 10-byte message, shorter than a header"):
            cb.recv_header(1.0)
    finally:
        ca.close()
        cb.close()


def test_strangers_are_refused_and_the_server_keeps_serving():
    server, thread, out = start_server()
    host, port = server.endpoint
    # 1. garbage bytes instead of a hello
    with socket.create_connection((host, port)) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(100))
        s.settimeout(5)
        try:
            s.recv(1000)
        except OSError:
            pass
    wait_refused(server, 1)
    # 2. a hello that claims an absurd size/rank (malformed), then silence
    with socket.create_connection((host, port)) as s:
        s.sendall(struct.pack("<4sBBH", b"RTHS", 1, 1, 0) + bytes(64))
    wait_refused(server, 2)
    # 3. a correct handshake with the wrong secret
    wrong = P.ps_identity(1, 2, "ps", b"not-the-secret")
    with pytest.raises(AuthError):
        P.dial(server.endpoint, wrong, 0, 5.0)
    wait_refused(server, 3)
    # 4. no secret at all against a server that requires one
    with pytest.raises(AuthError, match=rf"^parameter server 0 at {re.escape(host)}:{port} requires the job's shared "
                                        "secret and this rank has none"):
        P.dial(server.endpoint, P.ps_identity(1, 2, "ps", None), 0, 5.0)
    wait_refused(server, 4)
    # ... and the real worker still trains.
    stats = train_one(server.endpoint)
    thread.join(10)
    assert stats["steps"] == 3
    assert out["stats"]["refused_connections"] >= 4
    assert out["stats"]["version"] == 3


@pytest.mark.parametrize("secret", [b"not-the-secret", None], ids=["wrong", "none"])
def test_a_worker_with_the_wrong_secret_names_the_server_it_could_not_join(secret, caplog):
    """The handshake's text spoke of "rank 0" and "rank 1" (the servers' and workers' handshake
    numbers), which a torchrun user reads as worker 0 and 1; it now names the server and endpoint,
    and the server's log names the worker."""
    server, thread, out = start_server(timeout=3.0)
    host, port = server.endpoint
    with pytest.raises(AuthError, match=rf"^worker 0 could not join parameter server 0 at {host}:{port}: .*secret"):
        ParameterServerTraining(tiny(), servers=[server.endpoint], worker=0, workers=1, secret=secret, timeout=5.0)
    thread.join(10)
    assert out["stats"]["refused_connections"] == 1
    refusal = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusal) == 1 and "rank 1" not in refusal[0], refusal
    if secret is None:
        assert "worker 0 holds no shared secret" in refusal[0], refusal
    else:
        assert "peer claiming worker 0 left before proving it holds the secret" in refusal[0], refusal


def test_a_server_that_cannot_prove_the_secret_is_called_a_parameter_server_not_rank_0():
    # Before: "rank 0 could not prove it holds this job's shared secret": the ring transport's
    # handshake wording, whose "rank 0" a torchrun user reads as worker 0.
    server, thread, out = start_server(timeout=3.0)
    host, port = server.endpoint
    with pytest.raises(AuthError, match=rf"^parameter server 0 at {re.escape(host)}:{port} could not prove it "
                                        r"holds this job's shared secret"):
        P.dial(server.endpoint, P.ps_identity(1, 2, "ps", b"not-the-secret"), 0, 5.0)
    with pytest.raises(AuthError) as caught:  # (the worker's text names the endpoint once, in front)
        ParameterServerTraining(tiny(), servers=[server.endpoint], worker=0, workers=1, secret=b"not-the-secret",
                                timeout=5.0)
    text = str(caught.value)
    assert f"parameter server 0 at {host}:{port}: parameter server 0 could not prove" in text and "rank 0" not in text
    thread.join(10)
    assert out["stats"]["refused_connections"] == 2


def test_the_ring_handshake_still_numbers_the_peer_by_rank():
    # (the parameter server's name for its peer is its own: the ring's wording is unchanged)
    from ringtrain.transport import tcp_setup

    acceptor, connector = socket.socketpair()
    refused = []

    def accept():
        try:
            tcp_setup.accept_handshake(acceptor, tcp_setup.Identity(0, 2, "job", b"a"), {1}, set(),
                                       time.monotonic() + 5)
        except CommError as exc:
            refused.append(exc)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        with pytest.raises(AuthError, match=r"^rank 0 could not prove it holds this job's shared secret"):
            tcp_setup.connect_handshake(connector, tcp_setup.Identity(1, 2, "job", b"b"), 0, time.monotonic() + 5)
    finally:
        connector.close()
        t.join(10)
        acceptor.close()
    assert len(refused) == 1


def test_an_unreachable_server_is_named_with_its_endpoint():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(CommError, match=rf"^worker 0 could not join parameter server 0 at 127\.0\.0\.1:{port}: "):
        ParameterServerTraining(tiny(), servers=[("127.0.0.1", port)], worker=0, workers=1, secret=SECRET, timeout=1.0,
                                join_timeout=1.0)  # (a server still starting is waited for that long)


def test_an_authenticated_worker_sending_garbage_is_dropped_not_obeyed():
    server, thread, out = start_server(strategy="async", workers=2)
    me = P.ps_identity(2, 3, "ps", SECRET)  # worker 1 of 2
    sock = P.dial(server.endpoint, me, 0, 5.0)
    # a frame that claims a 1 TiB message: must be refused without allocating it
    call = wire.CallHeader(1, "send", numel=0)
    sock.sendall(wire.encode_data_header(call, 1 << 40)[:-8] + struct.pack("<Q", (1 << 40) + 1))
    sock.settimeout(5)
    data = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    sock.close()
    end = time.monotonic() + 5
    while server.stats()["notices"] == [] and time.monotonic() < end:
        time.sleep(0.02)
    assert "worker 1 was lost" in server.stats()["notices"][0]
    assert server.version == 0 and server.updates == 0
    server.failed = None  # let the thread end
    with server._cond:
        server._status[0] = "bye"
        server._cond.notify_all()
    thread.join(5)


def test_options_cannot_be_changed_after_they_were_made():
    """The servers get lr, momentum and weight_decay in the first HELLO: setting ps.opts.lr later
    (a learning-rate schedule) changed nothing, silently."""
    import dataclasses

    opts = PSOptions(lr=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.lr = 0.01
    assert opts.lr == 0.1 and dataclasses.replace(opts, lr=0.01).lr == 0.01


def test_options_are_validated_with_the_option_named(monkeypatch):
    with pytest.raises(ValueError, match="strategy"):
        PSOptions(strategy="hogwild")
    with pytest.raises(ValueError, match="schedule"):
        PSOptions(schedule="eager")
    with pytest.raises(ValueError, match="lr"):
        PSOptions(lr=0)
    with pytest.raises(ValueError, match="max_staleness"):
        ServerConfig(index=0, servers=1, workers=1, max_staleness=-1)
    with pytest.raises(ValueError, match="index"):
        ServerConfig(index=2, servers=2, workers=1)
    with pytest.raises(ValueError, match="float32"):
        ParameterServerTraining(nn.Linear(2, 2).double(), servers=[("127.0.0.1", 1)], worker=0, workers=1)
    with pytest.raises(ValueError, match="unknown option 'momentun' .did you mean 'momentum'.*accepted: alpha"):
        ParameterServerTraining(nn.Linear(2, 2), servers=[("127.0.0.1", 1)], worker=0, workers=1, momentun=0.9)
    from ringtrain.ps import worker_from_env

    as_torchrun_rank_0(monkeypatch, world_size=2)
    with pytest.raises(ValueError, match="worker_from_env got unknown option 'momentun' .did you mean 'momentum'"):
        worker_from_env(nn.Linear(2, 2), 1, momentun=0.9)  # (before anything is reached: no store at that port)


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_rank_0_of_a_parameter_server_job_warns_where_the_ranks_do_not_authenticate(secret, monkeypatch, caplog):
    # The ring's rank 0 warned (ringtrain.init()); a parameter-server job without RINGTRAIN_SECRET said nothing.
    import logging

    from ringtrain import session
    from ringtrain.ps import worker_from_env

    as_torchrun_rank_0(monkeypatch, world_size=2)
    monkeypatch.setattr(session, "_WARNED_UNAUTHENTICATED", set())  # (warned once per endpoint in a process)
    if secret is None:
        monkeypatch.delenv("RINGTRAIN_SECRET", raising=False)
    else:
        monkeypatch.setenv("RINGTRAIN_SECRET", secret)
    caplog.set_level(logging.WARNING, logger="ringtrain.session")
    with pytest.raises(ValueError, match="unknown option"):
        worker_from_env(nn.Linear(2, 2), 1, momentun=0.9)  # (refused before a store is reached)
    said = [r.getMessage() for r in caplog.records if r.name == "ringtrain.session"]
    if secret is None:
        assert len(said) == 1 and said[0].startswith("RINGTRAIN_SECRET is not set: the 2 ranks do not"), said
    else:
        assert said == []


@pytest.mark.parametrize("strategy, bound", [("async", 3), ("async", None), ("sync", 0)])
def test_a_workers_stats_carry_the_servers_staleness_bound(strategy, bound):
    server, thread, _ = start_server(strategy=strategy, max_staleness=bound)
    stats = train_one(server.endpoint, steps=2, strategy=strategy)
    thread.join(10)
    assert stats["max_staleness"] == bound and stats["steps"] == 2


def test_gradient_accumulation_is_refused_clearly():
    server, thread, _ = start_server()
    model = tiny()
    ps = ParameterServerTraining(model, servers=[server.endpoint], worker=0, workers=1, secret=SECRET)
    x = torch.ones(2, 4)
    model(x).sum().backward()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="accumulation.*step\\(\\) again finishes the step"):
        ps.step()
    # The refusal does not stick (it did: every later step said "backward ran twice"): step()
    # again finishes the step, and training goes on.
    ps.step()
    model(x).sum().backward()
    ps.step()
    assert ps.step_count == 2
    ps.close()
    thread.join(10)


def test_endpoints_must_be_host_port_pairs():
    model = tiny()
    for servers, word in [(("127.0.0.1", 5000), "entry 0 is '127.0.0.1'"), ([("localhost", "5000")], "entry 0"),
                          ([("h", 70000)], "entry 0"), ("127.0.0.1:5000", "got '127.0.0.1:5000'"), ([], "got \\[\\]")]:
        with pytest.raises(ValueError, match=word):
            ParameterServerTraining(model, servers=servers, worker=0, workers=1)
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())


def test_gradients_changed_after_backward_and_use_after_close_are_refused():
    server, thread, out = start_server()
    model = tiny()
    ps = ParameterServerTraining(model, servers=[server.endpoint], worker=0, workers=1, secret=SECRET, lr=0.1)
    x = torch.ones(2, 4)
    model(x).sum().backward()
    ps.step()
    model(x).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # while the pushes are on their way
    with pytest.raises(RuntimeError, match=r"changed after backward had pushed them.*register_hook"):
        ps.step()
    ps.close()
    thread.join(10)
    for call in (lambda: ps(x), ps.step, ps.wait, ps.save_checkpoint):
        with pytest.raises(RuntimeError, match="was closed"):
            call()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_servers_and_workers_compute_join_s_by_one_definition():
    # Before: PSOptions.join_s and ServerConfig.join_s were two copies of one property.
    assert PSOptions.join_s is ServerConfig.join_s
    for timeout, join in ((5.0, None), (90.0, None), (5.0, 2.5), (90.0, 300.0)):
        server = ServerConfig(index=0, servers=1, workers=1, timeout=timeout, join_timeout=join).join_s
        assert server == PSOptions(timeout=timeout, join_timeout=join).join_s == (max(timeout, 60.0) if join is None
                                                                                  else join)


@pytest.mark.parametrize("strategy", ["sync", "async"])
def test_workers_that_start_later_than_the_timeout_are_waited_for_by_the_join_timeout(strategy):
    # The one timeout bounded the wait for the first connections too: a server given a short one
    # failed ("no worker connected within ...") or lost a worker whose start-up took longer, and
    # the worker held up by it gave up on its pull after twice the timeout.
    timeout = 1.5
    server, thread, out = start_server(workers=2, strategy=strategy, timeout=timeout, join_timeout=None)
    assert server.cfg.join_s == 60.0  # (the default: timeout, but at least 60 s)
    time.sleep(timeout + 0.5)
    first = threading.Thread(target=lambda: out.setdefault("first", train_one(server.endpoint, strategy=strategy,
                                                                                workers=2, timeout=timeout)))
    first.start()
    time.sleep(2 * timeout + 0.5)  # the second worker comes later still: past the first's pull wait of old
    model = tiny()
    ps = ParameterServerTraining(model, servers=[server.endpoint], worker=1, workers=2, secret=SECRET, lr=0.1,
                                 strategy=strategy, timeout=timeout)
    for s in range(3):
        model(torch.full((2, 4), float(s + 1))).sum().backward()
        ps.step()
    ps.wait()
    second = ps.close()
    first.join(20)
    thread.join(20)
    assert not thread.is_alive() and out["stats"]["failed"] is None, out["stats"]
    assert not out["stats"]["notices"], out["stats"]["notices"]
    assert out["first"]["steps"] == second["steps"] == 3


@pytest.mark.parametrize("strategy,staleness,last_joining_step", [("sync", 0, 1), ("async", 0, 1), ("async", 2, 3),
                                                                  ("async", None, 0)])
def test_a_worker_stretches_its_waits_only_while_a_pull_may_wait_for_a_worker_still_connecting(
        strategy, staleness, last_joining_step):
    # An asynchronous worker kept the join window for all its waits (the staleness bound is the
    # servers'), so a server gone silent in the first minute was seen only after it: the WELCOME
    # now gives the bound.
    server, thread, out = start_server(strategy=strategy, max_staleness=staleness, timeout=1.0)
    model = tiny()
    ps = ParameterServerTraining(model, servers=[server.endpoint], worker=0, workers=1, secret=SECRET, lr=0.1,
                                 strategy=strategy, timeout=1.0)
    for s in range(last_joining_step + 2):
        t0 = time.monotonic()
        joining = ps._deadline(t0, 2.0) - t0 > 60.0  # (join_timeout 60 s by default)
        assert joining == (ps.step_count <= last_joining_step), (s, ps.step_count)
        model(torch.full((2, 4), float(s + 1))).sum().backward()
        ps.step()
    ps.close()
    thread.join(10)
    assert not thread.is_alive() and out["stats"]["failed"] is None


@pytest.mark.parametrize("bound", [-1, 1.5, True, "2", [0]])
def test_a_welcome_with_a_bad_staleness_bound_is_a_protocol_error(bound):
    from ringtrain.ps.worker import _staleness_of

    with pytest.raises(ProtocolError, match="'max_staleness' is not an integer >= 0 or null"):
        _staleness_of({"max_staleness": bound}, "parameter server 0")
    assert _staleness_of({}, "parameter server 0") == 0 and _staleness_of({"max_staleness": None}, "s") is None


def test_a_bad_join_timeout_is_refused_by_the_servers_and_the_workers():
    with pytest.raises(ValueError, match="join_timeout must be a finite number of seconds > 0, got 0"):
        ServerConfig(index=0, servers=1, workers=1, join_timeout=0)
    with pytest.raises(ValueError, match="join_timeout must be a finite number of seconds > 0, got nan"):
        PSOptions(join_timeout=float("nan"))


def test_an_async_server_goes_on_without_a_worker_that_never_connects():
    server, thread, out = start_server(workers=2, strategy="async", timeout=1.5)
    t0 = time.monotonic()
    stats = train_one(server.endpoint, steps=3, strategy="async", workers=2, timeout=20.0)
    thread.join(20)
    assert not thread.is_alive() and out["stats"]["failed"] is None
    assert stats["steps"] == 3 and time.monotonic() - t0 < 15
    assert any("worker 1 was lost" in n and "did not connect within 1.5 s" in n for n in out["stats"]["notices"])


@pytest.mark.parametrize("strategy", ["sync", "async"])
def test_a_worker_dropped_for_connecting_late_hears_why_when_it_comes(strategy):
    # Was: "connection reset by peer" during the handshake, the reason only in the server's log.
    from ringtrain.ps.sharding import make_layout

    server, thread, out = start_server(workers=2, strategy=strategy, timeout=1.5)
    layout = make_layout([12, 3, 6, 2], 1, 16)
    first = raw_worker(server, layout, 0, 2, lr=0.5, strategy=strategy)  # connects, then waits
    deadline = time.monotonic() + 10
    while "lost" not in server._status:  # (1.5 s after worker 0: join_timeout = timeout here)
        assert time.monotonic() < deadline, server._status
        time.sleep(0.05)
    late = ps_harness.RawWorker(P.dial(server.endpoint, P.ps_identity(2, 3, "ps", SECRET), 0, 5.0), "server", 5.0)
    with pytest.raises(PeerLost, match="worker 1 was dropped .it did not connect within 1.5 s.*not taken back"):
        late.recv_header(5.0)
    late.close()
    first.close()
    thread.join(10)


def test_the_servers_end_of_a_connection_sends_without_nagles_delay():
    # Was: the accepted socket kept Nagle's algorithm, so the short last segment of each streamed
    # answer waited for the ACK of everything before it (the workers' ends had TCP_NODELAY).
    from ringtrain.ps.sharding import make_layout

    server, thread, out = start_server(workers=1, timeout=1.5)
    layout = make_layout([12, 3], 1, 16)
    worker = raw_worker(server, layout, 0, 1, lr=0.5)
    with server._cond:
        sock = server._channels[0].sock
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    worker.close()
    thread.join(10)


def server_and_silent_worker(strategy: str):
    """A server for 2 workers (timeout 1.5 s) serving on a thread, and worker 1 that says HELLO by
    hand and then nothing: (server, thread, out, worker 1's channel)."""
    from ringtrain.ps.sharding import make_layout

    server, thread, out = start_server(workers=2, strategy=strategy, timeout=1.5)
    layout = make_layout([p.numel() for p in tiny().parameters()], 1, PSOptions().partition_bytes)
    silent = raw_worker(server, layout, 1, 2, lr=0.1, momentum=PSOptions().momentum, strategy=strategy,
                        shapes=[list(p.shape) for p in tiny().parameters()])
    return server, thread, out, silent


def test_an_async_server_drops_a_silent_worker_that_holds_up_the_others():
    server, thread, out, silent = server_and_silent_worker("async")
    stats = train_one(server.endpoint, steps=3, strategy="async", workers=2, timeout=20.0)
    thread.join(20)
    assert not thread.is_alive() and out["stats"]["failed"] is None and stats["steps"] == 3
    assert any("worker 1 was lost" in n and "sent nothing for 1.5 s while holding up" in n
               for n in out["stats"]["notices"])
    silent.close()


def test_an_async_worker_with_the_servers_timeout_outlasts_a_silent_worker():
    """The same with one timeout for servers and workers, as ringtrain train and most scripts give:
    the worker held up gave up at the very moment the server dropped the silent one (both waited
    `timeout`), so the job died instead of going on without it."""
    server, thread, out, silent = server_and_silent_worker("async")
    stats = train_one(server.endpoint, steps=3, strategy="async", workers=2, timeout=1.5)
    thread.join(20)
    assert not thread.is_alive() and out["stats"]["failed"] is None and stats["steps"] == 3
    assert any("reports 1 of 2 workers left" in n for n in stats["notices"]), stats["notices"]
    silent.close()


def test_a_sync_worker_with_the_servers_timeout_names_a_silent_worker():
    """Synchronous, one timeout for servers and workers: the server ends the job naming the worker
    that went silent, and the worker held up reports that (it gave up at the very moment the
    server dropped the silent one, blaming the server for parameters that did not arrive)."""
    server, thread, out, silent = server_and_silent_worker("sync")
    with pytest.raises(CommError, match="worker 1 was lost"):
        train_one(server.endpoint, steps=3, workers=2, timeout=1.5)
    thread.join(20)
    assert not thread.is_alive()
    silent.close()


def test_a_sync_worker_ahead_waits_for_a_module_another_workers_step_still_pushes():
    """Worker 1 pushes its unused module's zeros late (in step()); worker 0, whose next forward
    does not wait for that module, must not push its next step before the server finished this one."""
    server, thread, out = start_server(workers=2)

    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin, self.spare = nn.Linear(4, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x)

    def worker(w):
        model = Partly()
        with ParameterServerTraining(model, servers=[server.endpoint], worker=w, workers=2, secret=SECRET,
                                     lr=0.1, timeout=10.0) as ps:
            for s in range(3):
                model(torch.full((2, 4), float(s + w))).sum().backward()
                if w == 1:
                    time.sleep(0.3)
                ps.step()
            ps.wait()
            return [p.detach().clone() for p in model.parameters()]

    results = on_threads(2, worker, timeout=30)
    thread.join(10)
    assert not isinstance(results[0], BaseException), results[0]
    assert not isinstance(results[1], BaseException), results[1]
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert out["stats"]["failed"] is None


def test_single_worker_sync_equals_torch_sgd_bitwise():
    server, thread, _ = start_server()
    model, ref = tiny(), tiny()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ps = ParameterServerTraining(model, servers=[server.endpoint], worker=0, workers=1, secret=SECRET,
                                 lr=0.1, momentum=0.9, partition_mb=4 / (1 << 20))  # 1-element partitions
    for s in range(5):
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / (s + 1)
        model(x).pow(2).sum().backward()
        ps.step()
        opt.zero_grad()
        ref(x).pow(2).sum().backward()
        opt.step()
    ps.wait()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    ps.close()
    thread.join(10)


def test_a_worker_lost_half_way_through_a_push_leaves_the_shard_untouched():
    """Worker 1 (raw protocol) pushes half its partitions of step 0 and vanishes: nothing applied."""
    server, thread, out = start_server(workers=2)
    model = tiny()
    before = [p.detach().clone() for p in model.parameters()]
    ps = ParameterServerTraining(model, servers=[server.endpoint], worker=0, workers=2, secret=SECRET,
                                 partition_mb=4 / (1 << 20))
    ps.wait()
    ch = ps_harness.RawWorker(P.dial(server.endpoint, P.ps_identity(2, 3, "ps", SECRET), 0, 5.0), "server", 5.0)
    hello = {"worker": 1, "numels": list(ps.layout.numels), "shapes": [list(p.shape) for p in ps.params],
             "partition_bytes": ps.opts.partition_bytes,
             "digest": ps.layout.digest(), "strategy": "sync", "lr": ps.opts.lr, "momentum": ps.opts.momentum,
             "weight_decay": 0.0}
    ch.send(P.HELLO, worker=1, body=P.encode_json(hello))
    assert ch.recv_header(5.0).kind == P.WELCOME
    ids = ps._ids[0]
    half = ids[: len(ids) // 2]
    ch.send(P.PUSH, worker=1, step=0, ids=half, values=[np.ones(len(half), dtype=np.float32)])
    model(torch.ones(2, 4)).sum().backward()
    ps.step()  # worker 0's whole push of step 0 arrives
    time.sleep(0.3)
    ch.close()  # worker 1 is gone mid-step
    with pytest.raises(PeerLost, match="worker 1 was lost at step 0"):
        ps.wait()
    thread.join(10)
    assert server.version == 0 and server.updates == 0
    # one server: its shard is every partition in id order, i.e. the parameters concatenated
    assert torch.equal(server.params, torch.cat([b.reshape(-1) for b in before]))


@pytest.mark.parametrize("schedule,groups,kw", [("single", 1, {}), ("wfbp", 4, {}), ("optimal", None, {}),
                                               ("fixed", 1, {}), ("fixed", 4, {"bucket_cap_mb": 1e-6})])
def test_pushes_follow_the_merge_plan_after_the_first_step(schedule, groups, kw):
    server, thread, out = start_server()
    stats = train_one(server.endpoint, steps=3, schedule=schedule, **kw)
    thread.join(10)
    members = stats["push_groups"]
    if groups is not None:
        assert members == groups
    assert 1 <= members <= 4  # 4 parameter tensors
    # every byte a worker sent, the server received, and the other way round
    assert stats["bytes_sent"] == out["stats"]["bytes_received"]
    assert stats["bytes_received"] == out["stats"]["bytes_sent"]


def test_roles_and_rank_entry_arguments():
    from ringtrain.ps import is_server_rank
    from ringtrain.ps.__main__ import parse

    assert [is_server_rank(2, r, 5) for r in range(5)] == [False, False, False, True, True]
    with pytest.raises(ValueError, match="servers"):
        is_server_rank(5, 0, 5)  # no worker left
    args = parse(["--servers", "2", "--strategy", "async", "--max-staleness", "-1"])
    assert (args.servers, args.strategy, args.max_staleness) == (2, "async", -1)
    with pytest.raises(SystemExit):
        parse(["--strategy", "hogwild"])
    with pytest.raises(SystemExit):
        parse(["--steps", "0"])
    with pytest.raises(SystemExit):  # was taken for -1, unbounded
        parse(["--strategy", "async", "--max-staleness", "-7"])
    with pytest.raises(SystemExit):  # was a traceback on every rank
        parse(["--servers", "0"])


def test_one_rule_says_how_many_servers_a_job_can_have():
    # Before: the rank entry turned is_server_rank's "servers must be ..." into "--servers must
    # be ..." by replacing text in its message; it now asks the same check, naming the flag.
    from ringtrain.ps import is_server_rank
    from ringtrain.ps.launch import check_servers

    for servers, world_size in ((1, 2), (3, 4)):
        check_servers(servers, world_size)
    for servers, world_size in ((0, 2), (2, 2), (5, 4)):
        with pytest.raises(ValueError, match=re.escape(f"--servers must be in [1, world_size={world_size}), "
                                                       f"got {servers}")):
            check_servers(servers, world_size, name="--servers")
        with pytest.raises(ValueError, match=re.escape(f"servers must be in [1, world_size={world_size}), "
                                                       f"got {servers}")):
            is_server_rank(servers, 0, world_size)


@pytest.mark.parametrize("flag", ["--timeout", "--join-timeout"])
@pytest.mark.parametrize("value, says", [("0", "seconds > 0"), ("-1", "seconds > 0"), ("nan", "seconds > 0"),
                                         ("abc", "invalid float value")])
def test_the_rank_entry_refuses_a_bad_timeout_naming_its_flag(flag, value, says, capsys):
    # Before: no --join-timeout; a bad --timeout was a ValueError traceback on every rank.
    from ringtrain.ps.__main__ import parse

    with pytest.raises(SystemExit):
        parse([flag, value])
    err = capsys.readouterr().err
    assert flag in err and says in err, err


@pytest.mark.parametrize("argv, says", [(["--servers", "3"], "--servers must be in [1, world_size=3), got 3"),
                                         (["--model", "nope"], "--model: unknown model 'nope'; choose from charlm")])
def test_the_rank_entry_refuses_a_job_it_cannot_run_in_one_line(argv, says, monkeypatch, capsys):
    # Before: a ValueError traceback on every rank.
    from ringtrain.ps import __main__ as entry

    monkeypatch.setattr(entry, "run_server_role", lambda *a, **k: pytest.fail("a server started"))
    monkeypatch.setattr(entry, "worker_from_env", lambda *a, **k: pytest.fail("a worker started"))
    as_torchrun_rank_0(monkeypatch, world_size=3)
    assert entry.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m ringtrain.ps: {says}") and err.count("\n") == 1, err


@pytest.mark.parametrize("join", [None, 7.5])
def test_the_rank_entry_gives_join_timeout_to_servers_and_workers(join, monkeypatch):
    # Before: run_server_role and worker_from_env were given --timeout only.
    import ringtrain.ps.__main__ as entry
    from ringtrain import lifecycle, rendezvous

    monkeypatch.setattr(lifecycle, "die_with_parent", lambda: True)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    calls = ps_harness.stub_meeting(monkeypatch, entry)
    monkeypatch.setattr(rendezvous, "job_info", lambda: SimpleNamespace(rank=0, world_size=2))
    argv = ["--timeout", "5"] + ([] if join is None else ["--join-timeout", str(join)])
    assert entry.parse(argv).join_timeout == join
    monkeypatch.setattr(entry, "is_server_rank", lambda servers, *job: True)
    assert entry.main(argv) == 0
    monkeypatch.setattr(entry, "is_server_rank", lambda servers, *job: False)
    with pytest.raises(ps_harness.Met):
        entry.main(argv)
    assert (calls["server"]["timeout"], calls["server"]["join_timeout"]) == (5.0, join)
    assert (calls["worker"]["timeout"], calls["worker"]["join_timeout"]) == (5.0, join)


def raw_worker(server: ParameterServer, layout, w: int, workers: int, lr: float, momentum: float = 0.0,
               strategy: str = "sync", shapes=None) -> P.Channel:
    """A worker speaking the protocol by hand: handshake and HELLO; WELCOME read. ``shapes``: the
    parameters' (as a real worker of the same job has them), or one dimension each."""
    ch = ps_harness.RawWorker(P.dial(server.endpoint, P.ps_identity(1 + w, 1 + workers, "ps", SECRET), 0, 5.0), "server", 5.0)
    hello = {"worker": w, "numels": list(layout.numels), "shapes": shapes or [[n] for n in layout.numels],
             "partition_bytes": layout.partition_bytes,
             "digest": layout.digest(), "strategy": strategy, "lr": lr, "momentum": momentum, "weight_decay": 0.0}
    ch.send(P.HELLO, worker=w, body=P.encode_json(hello))
    head = ch.recv_header(5.0)
    assert head.kind == P.WELCOME
    ch.recv_json(head)
    return ch


def recv_partitions(ch: P.Channel, layout, ids) -> dict:
    """PARAMS messages of step 1 until exactly ``ids`` came (one message each, or merged)."""
    return ps_harness.recv_partitions(ch, layout, ids, step=1)


def test_sync_server_streams_each_partition_as_soon_as_it_has_stepped_it():
    """A pull for step 1 is answered partition by partition while the pushes of step 0 go on."""
    from ringtrain.ps.sharding import make_layout

    server, thread, out = start_server()
    layout = make_layout([12, 3, 6, 2], 1, 16)  # 4 floats per partition: 3 + 1 + 2 + 1 partitions
    ids = np.arange(len(layout.partitions))
    start = np.arange(23, dtype=np.float32)
    ch = raw_worker(server, layout, 0, 1, lr=0.5)
    if hasattr(socket, "TCP_CONGESTION"):  # a worker's connection keeps the kernel's (tcp_setup.TCP_CONGESTION)
        with socket.socket() as plain:
            assert congestion(ch.sock) == congestion(plain)
    ch.send(P.INIT, worker=0, ids=ids, values=[start])
    ch.send(P.PULL, worker=0, step=0)
    step, got = recv_params(ch, layout)
    assert step == 0 and sorted(got) == ids.tolist()
    ch.send(P.PULL, worker=0, step=1)  # before any gradient of step 0, as workers do
    last, first = ids[4:], ids[:4]  # backward order: the last layers' partitions are pushed first
    ones = [np.ones(layout.partitions[i].numel, dtype=np.float32) for i in last]
    ch.send(P.PUSH, worker=0, step=0, ids=last, values=ones)
    got = recv_partitions(ch, layout, last)  # comes back before the rest of step 0 is pushed
    for i in last:
        p = layout.partitions[i]
        offset = sum(layout.partitions[j].numel for j in range(i))
        assert np.array_equal(got[i], start[offset: offset + p.numel] - 0.5)
    assert server.version == 0  # the step is not whole yet
    ch.send(P.PUSH, worker=0, step=0, ids=first, values=[np.ones(layout.partitions[i].numel, dtype=np.float32) for i in first])
    recv_partitions(ch, layout, first)
    assert server.version == 1 and server.updates == 1
    assert torch.equal(server.params, torch.from_numpy(start - 0.5))
    ch.send(P.BYE, worker=0)
    assert ch.recv_header(5.0).kind == P.BYE
    ch.close()
    thread.join(10)
    assert out["stats"]["failed"] is None


def two_workers_with_momentum():
    """A server of 4 tensors (23 values, 0..22) for workers 0 and 1 (lr 0.5, momentum 0.9), both
    connected: server, its thread, layout, partition ids, the start values and the two channels."""
    from ringtrain.ps.sharding import make_layout

    server, thread, _ = start_server(workers=2)
    layout = make_layout([12, 3, 6, 2], 1, 16)
    ids = np.arange(len(layout.partitions))
    start = np.arange(23, dtype=np.float32)
    a, b = (raw_worker(server, layout, w, 2, lr=0.5, momentum=0.9) for w in (0, 1))
    a.send(P.INIT, worker=0, ids=ids, values=[start])
    return server, thread, layout, ids, start, a, b


def test_a_step_cut_short_is_rolled_back_values_and_momentum():
    """Two workers; partitions both pushed are stepped (and streamed), then worker 1 dies: all undone."""
    server, thread, layout, ids, start, a, b = two_workers_with_momentum()
    for w, ch in enumerate((a, b)):
        ch.send(P.PULL, worker=w, step=0)
        recv_params(ch, layout)
        ch.send(P.PULL, worker=w, step=1)
    grads = [np.full(layout.partitions[i].numel, 2.0, dtype=np.float32) for i in ids]
    a.send(P.PUSH, worker=0, step=0, ids=ids, values=grads)
    b.send(P.PUSH, worker=1, step=0, ids=ids[:2], values=grads[:2])
    for ch in (a, b):  # stepped and sent to both: both workers' gradients of them were in
        recv_partitions(ch, layout, [0, 1])
    assert not torch.equal(server.params, torch.from_numpy(start))
    b.close()  # worker 1 dies half-way through step 0
    with pytest.raises(PeerLost, match="worker 1 was lost at step 0"):
        a.recv_header(5.0)
    a.close()  # (a failed server ends once no worker is connected)
    thread.join(10)
    assert not thread.is_alive()
    assert server.version == 0 and server.updates == 0
    assert torch.equal(server.params, torch.from_numpy(start))
    assert all(not server.opt.state.get(v) for v in server._views.values())  # no momentum left behind


def test_a_step_cut_short_after_a_whole_one_rolls_momentum_back_to_its_value_before():
    """Step 0 completes (momentum buffers exist), step 1 is half applied, worker 1 dies: values and
    momentum are those after step 0. SGD updates its momentum buffer in place, so an undo record
    that kept the buffer itself rather than a copy would restore the half-applied step's momentum."""
    server, thread, layout, ids, start, a, b = two_workers_with_momentum()
    grads = [np.full(layout.partitions[i].numel, 2.0, dtype=np.float32) for i in ids]
    both_take_step_0(a, b, layout, ids, grads)
    # step 0: momentum buffer = the mean gradient 2, values start - 0.5 * 2 (exact in float32)
    assert server.version == 1
    after_step_0 = torch.from_numpy(start - 1.0)
    assert torch.equal(server.params, after_step_0)
    for w, ch in enumerate((a, b)):
        ch.send(P.PULL, worker=w, step=2)
    a.send(P.PUSH, worker=0, step=1, ids=ids, values=grads)
    b.send(P.PUSH, worker=1, step=1, ids=ids[:2], values=grads[:2])
    for ch in (a, b):  # partitions 0 and 1 take step 1 (momentum 0.9 * 2 + 2) and are streamed
        got: dict = {}
        while len(got) < 2:
            step, part = recv_params(ch, layout)
            assert step == 2
            got.update(part)
        assert sorted(got) == [0, 1]
    assert not torch.equal(server.params, after_step_0)
    b.close()
    with pytest.raises(PeerLost, match="worker 1 was lost at step 1"):
        a.recv_header(5.0)
    a.close()
    thread.join(10)
    assert not thread.is_alive()
    assert server.version == 1 and server.updates == 1
    assert torch.equal(server.params, after_step_0)
    for i, view in server._views.items():
        momentum = server.opt.state[view]["momentum_buffer"]
        assert torch.equal(momentum, torch.full_like(momentum, 2.0)), (i, momentum)


def wait_serving(server: ParameterServer, w: int) -> None:
    """Until worker w's request waits on the server (it holds the lock while answering one at once)."""
    end = time.monotonic() + 10
    while True:
        with server._cond:
            if w in server._serving:
                return
        assert time.monotonic() < end, f"worker {w}'s request never waited on the server"
        time.sleep(0.02)


def test_async_applies_each_gradient_over_the_worker_count_and_holds_a_pull_past_the_bound():
    """Asynchronous, 2 workers, max_staleness 1: every push moves the shard by lr * grad / W on its
    own; worker 0's pull one step ahead of worker 1 is answered, two steps ahead it waits for
    worker 1's push and then carries it."""
    from ringtrain.ps.sharding import make_layout

    server, thread, out = start_server(workers=2, strategy="async", max_staleness=1)
    layout = make_layout([12, 3, 6, 2], 1, 16)
    ids = np.arange(len(layout.partitions))
    start = np.arange(23, dtype=np.float32)
    a, b = (raw_worker(server, layout, w, 2, lr=0.5, strategy="async") for w in (0, 1))
    a.send(P.INIT, worker=0, ids=ids, values=[start])
    grads = [np.full(layout.partitions[i].numel, 2.0, dtype=np.float32) for i in ids]

    def params_of(got: dict) -> np.ndarray:
        return np.concatenate([got[i] for i in ids.tolist()])

    a.send(P.PUSH, worker=0, step=0, version=0, ids=ids, values=grads)
    a.send(P.PULL, worker=0, step=1)  # 1 step ahead of worker 1: within the bound
    step, got = recv_params(a, layout)
    assert step == 1 and np.array_equal(params_of(got), start - 0.5)  # 0.5 * 2 / 2 workers
    a.send(P.PUSH, worker=0, step=1, version=1, ids=ids, values=grads)
    a.send(P.PULL, worker=0, step=2)  # 2 steps ahead: waits for worker 1
    # (worker 0's second push applied first: waiting for its pull alone let worker 1's push go
    # first once, in the suite under torch 2.4 on a loaded machine: staleness {0: 1, 1: 2})
    end = time.monotonic() + 10
    while server.version < 2:
        assert time.monotonic() < end, "worker 0's second push was never applied"
        time.sleep(0.01)
    wait_serving(server, 0)
    b.send(P.PUSH, worker=1, step=0, version=0, ids=ids, values=grads)
    step, got = recv_params(a, layout)
    assert step == 2 and np.array_equal(params_of(got), start - 1.5)  # three pushes, each -0.5
    assert server.version == 3 and dict(server.staleness) == {0: 2, 2: 1}
    for ch in (a, b):
        ch.close()
    thread.join(10)


def readable(ch: P.Channel, within: float) -> bool:
    """Whether bytes from the server come within ``within`` seconds (nothing is read)."""
    return bool(select.select([ch.sock], [], [], within)[0])


@pytest.mark.parametrize("first", [0, 1])
def test_async_answers_pulls_one_at_a_time_in_the_order_they_came(first):
    """Two workers pull a 16 MiB shard together (max_staleness 0: both pulls are answered once
    both pushes are in). The second pull's answer waits until the first is on the wire: while the
    first worker does not read, the second hears nothing; once it reads, the second's answer comes,
    with the same values. (Sent side by side, the second's would come at once.)"""
    from ringtrain.ps.sharding import make_layout

    server, thread, out = start_server(workers=2, strategy="async", max_staleness=0)
    layout = make_layout([1 << 22], 1, 4 << 20)  # 16 MiB: more than the sockets' buffers hold
    ids = np.arange(len(layout.partitions))
    chans = [raw_worker(server, layout, w, 2, lr=0.5, strategy="async") for w in (0, 1)]
    chans[0].send(P.INIT, worker=0, ids=ids, values=[np.zeros(layout.partitions[i].numel, dtype=np.float32)
                                                    for i in ids])
    grads = [np.full(layout.partitions[i].numel, 2.0, dtype=np.float32) for i in ids]
    for w, ch in enumerate(chans):
        ch.send(P.PUSH, worker=w, step=0, version=0, ids=ids, values=grads)
    a, b = chans[first], chans[1 - first]
    a.send(P.PULL, worker=first, step=1)
    assert readable(a, 5.0)  # its answer is on the wire (and stalls: nobody reads it)
    b.send(P.PULL, worker=1 - first, step=1)
    wait_serving(server, 1 - first)
    assert not readable(b, 1.0)  # its turn has not come
    step, got_a = recv_params(a, layout)
    step_b, got_b = recv_params(b, layout)
    assert step == step_b == 1
    for got in (got_a, got_b):  # both pushes in: -0.5 * 2 / 2 workers each
        assert all(np.array_equal(got[i], np.full_like(got[i], -1.0)) for i in ids.tolist())
    for ch in chans:
        ch.send(P.BYE, worker=0 if ch is chans[0] else 1)
        assert ch.recv_header(5.0).kind == P.BYE
        ch.close()
    thread.join(10)
    assert out["stats"]["failed"] is None


def async_pair_with_a_big_shard(timeout: float):
    """An async server (2 workers, no staleness bound) with a 16 MiB shard; worker 0 has sent INIT
    and pulled step 0, and its answer is on the wire: (server, thread, worker 0, worker 1, layout)."""
    from ringtrain.ps.sharding import make_layout

    server, thread, out = start_server(workers=2, strategy="async", max_staleness=None, timeout=timeout)
    layout = make_layout([1 << 22], 1, 4 << 20)
    ids = np.arange(len(layout.partitions))
    a, b = (raw_worker(server, layout, w, 2, lr=0.5, strategy="async") for w in (0, 1))
    a.send(P.INIT, worker=0, ids=ids, values=[np.zeros(layout.partitions[i].numel, dtype=np.float32) for i in ids])
    a.send(P.PULL, worker=0, step=0)
    assert readable(a, 5.0)
    return server, thread, a, b, layout


def test_a_worker_that_never_reads_its_answer_holds_up_the_next_one_at_most_the_timeout():
    server, thread, a, b, layout = async_pair_with_a_big_shard(timeout=2.0)
    t0 = time.monotonic()
    b.send(P.PULL, worker=1, step=0)
    step, got = recv_params(b, layout)  # (its send to worker 0 times out, which loses worker 0)
    assert step == 0 and time.monotonic() - t0 < 2.0 + 3.0
    for ch in (a, b):
        ch.close()
    thread.join(10)


def test_an_answer_whose_turn_does_not_come_within_the_timeout_goes_out_beside_the_slow_one():
    """Worker 0 reads its answer, slowly (its send never times out: it makes progress); the next
    answer goes out beside it once the server's timeout has passed (without the fallback: after
    worker 0's whole 16 MiB at ~0.6 MB/s)."""
    server, thread, a, b, layout = async_pair_with_a_big_shard(timeout=2.0)
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            try:
                a.sock.recv(64 << 10)
            except OSError:
                return
            time.sleep(0.1)

    reader = threading.Thread(target=trickle, daemon=True)
    reader.start()
    t0 = time.monotonic()
    b.send(P.PULL, worker=1, step=0)
    step, got = recv_params(b, layout)
    waited = time.monotonic() - t0
    assert step == 0 and 1.5 < waited < 2.0 + 3.0, waited
    stop.set()
    for ch in (a, b):
        ch.close()
    reader.join(5)
    thread.join(10)


def test_a_pull_waiting_on_a_worker_that_waits_for_its_answers_turn_is_not_dropped():
    """max_staleness 1: worker 2's pull waits for worker 1's push; worker 1's own answer waits for
    its turn behind worker 0's, which stalls (worker 0 does not read) until the server's timeout.
    Worker 2 gets its parameters once worker 1 has pushed. (It was dropped: its wait ran out while
    worker 1, waiting for this server, could not be lost for silence.)"""
    from ringtrain.ps.sharding import make_layout

    timeout = 2.0
    server, thread, out = start_server(workers=3, strategy="async", max_staleness=1, timeout=timeout)
    layout = make_layout([1 << 22], 1, 4 << 20)
    ids = np.arange(len(layout.partitions))
    a, d, h = (raw_worker(server, layout, w, 3, lr=0.5, strategy="async") for w in (0, 1, 2))
    grads = [np.ones(layout.partitions[i].numel, dtype=np.float32) for i in ids]
    a.send(P.INIT, worker=0, ids=ids, values=[np.zeros(layout.partitions[i].numel, dtype=np.float32) for i in ids])
    for ch, w, steps in ((a, 0, 2), (d, 1, 1), (h, 2, 3)):  # clocks 2, 1 and 3
        for s in range(steps):
            ch.send(P.PUSH, worker=w, step=s, version=0, ids=ids, values=grads)
    end = time.monotonic() + 10
    while server._clock != [2, 1, 3]:
        assert time.monotonic() < end, server._clock
        time.sleep(0.02)
    h.send(P.PULL, worker=2, step=3)  # 2 steps ahead of worker 1: waits for its push
    wait_serving(server, 2)
    a.send(P.PULL, worker=0, step=2)  # answered at once, and stalls: worker 0 does not read
    assert readable(a, 5.0)
    d.send(P.PULL, worker=1, step=1)  # waits for its turn behind worker 0's answer
    step, _ = recv_params(d, layout)  # (once worker 0 is lost: its send timed out)
    d.send(P.PUSH, worker=1, step=1, version=0, ids=ids, values=grads)
    step, got = recv_params(h, layout)
    assert step == 3 and server._status[2] == "connected", server.notices
    for ch in (a, d, h):
        ch.close()
    thread.join(10)


def four(n: int) -> np.ndarray:
    return np.full(n, 4.0, dtype=np.float32)


@pytest.mark.parametrize("pushes, words", [
    ([([0, 0], [four(4), four(4)])], "does not own \\(or twice\\)"),  # one partition twice in a message
    ([([7], [four(4)])], "does not own"),  # ids 0..6 only
    ([([0], [four(5)])], "carries 20 value bytes, expected 16"),  # partition 0 holds 4 floats
    ([([0], [four(3)])], "carries 12 value bytes, expected 16"),
    ([([0], [four(4)]), ([0], [four(4)])], "pushed a partition twice for step 0"),  # in two messages
])
def test_a_malformed_push_is_refused_naming_the_fault_and_applies_nothing(pushes, words):
    """One worker, sync: each push is checked before its values count; a refused push ends the job
    and rolls back whatever was stepped (the repeated partition 0 had stepped once already)."""
    from ringtrain.ps.sharding import make_layout

    server, thread, out = start_server()
    layout = make_layout([12, 3, 6, 2], 1, 16)  # 7 partitions of at most 4 floats
    ids = np.arange(len(layout.partitions))
    start = np.arange(23, dtype=np.float32)
    ch = raw_worker(server, layout, 0, 1, lr=0.5)
    ch.send(P.INIT, worker=0, ids=ids, values=[start])
    ch.send(P.PULL, worker=0, step=0)
    recv_params(ch, layout)
    for push_ids, values in pushes:
        ch.send(P.PUSH, worker=0, step=0, ids=np.array(push_ids), values=values)
    with pytest.raises(ProtocolError, match=words):
        ch.recv_header(5.0)
    ch.close()
    thread.join(10)
    assert not thread.is_alive()
    assert server.version == 0 and server.updates == 0
    assert torch.equal(server.params, torch.from_numpy(start))


def test_a_sync_checkpoint_puts_every_worker_at_the_shards_step(tmp_path):
    """Worker 1 has pushed step 1 whole when worker 0 saves at step 1: the shard is at step 1,
    and every worker resumes there (worker 1 pushes step 1 again), not worker 1 at step 2."""
    from ringtrain import checkpoint
    from ringtrain.ps.sharding import make_layout

    server, thread, out = start_server(workers=2, checkpoint_dir=str(tmp_path))
    layout = make_layout([12, 3], 1, 16)
    ids = np.arange(len(layout.partitions))
    a, b = (raw_worker(server, layout, w, 2, lr=0.5) for w in (0, 1))
    a.send(P.INIT, worker=0, ids=ids, values=[np.arange(15, dtype=np.float32)])
    grads = [np.ones(layout.partitions[i].numel, dtype=np.float32) for i in ids]
    both_take_step_0(a, b, layout, ids, grads)
    b.send(P.PUSH, worker=1, step=1, ids=ids, values=grads)  # worker 1 runs ahead
    a.send(P.SAVE, worker=0, step=1)
    head = a.recv_header(5.0)
    assert head.kind == P.SAVED and head.step == 1
    saved = checkpoint.latest(tmp_path / "server-0").payload
    assert saved["version"] == 1 and saved["clocks"] == [1, 1]
    for ch in (a, b):
        ch.close()
    thread.join(10)


def test_resuming_with_another_worker_count_is_refused_and_every_worker_hears_why(tmp_path):
    """A checkpoint of 1 worker, a job of 2: each worker raises the server's reason (no bare EOFError)."""
    server, thread, out = start_server(checkpoint_dir=str(tmp_path))
    model = tiny()
    ps = ParameterServerTraining(model, servers=[server.endpoint], worker=0, workers=1, secret=SECRET)
    model(torch.ones(2, 4)).sum().backward()
    ps.step()
    ps.save_checkpoint()
    ps.close()
    thread.join(10)
    server, thread, out = start_server(workers=2, checkpoint_dir=str(tmp_path), resume=True)
    errors: dict = {}

    def worker(w: int) -> None:
        try:
            ParameterServerTraining(tiny(), servers=[server.endpoint], worker=w, workers=2, secret=SECRET)
        except Exception as exc:
            errors[w] = exc

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(15)
    why = (f"parameter server 0: the checkpoint in {tmp_path / 'server-0'} was made with 1 worker, "
           "this job has 2: resume with 1 worker")
    assert sorted(errors) == [0, 1], errors
    for w, exc in errors.items():
        assert isinstance(exc, CommError) and why in str(exc) and "new checkpoint directory" in str(exc), (w, exc)
    thread.join(15)
    assert not thread.is_alive() and why in out["stats"]["failed"]


def test_a_channel_receives_idle_for_ever_while_it_sends_with_deadlines():
    """Sends and receives share a socket: a send's deadline must not become the idle receive's."""
    a, b = socket.socketpair()
    ca, cb = P.Channel(a, "a", 0.2), P.Channel(b, "b", 0.2)
    got, stop = [], threading.Event()

    def receive():
        for _ in range(21):
            got.append(cb.recv_header(None).step)

    def chatter():  # b keeps sending with its 0.2 s deadline while it waits to receive
        while not stop.is_set():
            cb.send(P.PULL, step=0)
            time.sleep(0.001)

    def drain():
        try:
            while True:
                ca.recv_header(None)
        except (EOFError, CommError, OSError):
            return  # closed at the end

    threads = [threading.Thread(target=f, daemon=True) for f in (receive, chatter, drain)]
    for t in threads:
        t.start()
    for step in range(1, 21):
        ca.send(P.PULL, step=step)
        time.sleep(0.02)
    time.sleep(0.5)  # longer than the channel's timeout: an idle receive must still be waiting
    ca.send(P.PULL, step=99)
    threads[0].join(5)
    stop.set()
    assert got == list(range(1, 21)) + [99]
    assert b.gettimeout() is None and a.gettimeout() is None  # deadlines are poll()'s, not the socket's
    for ch in (ca, cb):
        ch.close()


def test_a_second_worker_with_an_index_already_connected_hears_why():
    # Was: "connection reset by peer" during the handshake (two processes given worker=0), the
    # reason ("not expected to connect") only in the server's log.
    server, thread, out = start_server(workers=2, timeout=5.0)
    first = ParameterServerTraining(tiny(), servers=[server.endpoint], worker=0, workers=2, secret=SECRET, timeout=5.0)
    try:
        with pytest.raises(CommError, match="worker 0 is connected already.*own worker index in .0, 2."):
            ParameterServerTraining(tiny(), servers=[server.endpoint], worker=0, workers=2, secret=SECRET,
                                    timeout=5.0)
        assert server._status[0] == "connected" and server.refused == 1  # the first one is left alone
    finally:
        first._release()
        thread.join(10)
