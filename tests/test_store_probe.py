"""store_probe: asking MASTER_ADDR:MASTER_PORT whether a rendezvous store answers, with a deadline.

The probe speaks torch's store protocol (VALIDATE, then GETNUMKEYS); checked here against both
of torch's store servers, so that a torch whose protocol changed fails this test, not every job."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch.distributed as dist

from ringtrain import store_probe

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("libuv", [True, False], ids=["libuv", "classic"])
def test_a_torch_store_answers(libuv):
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, use_libuv=libuv)
    t0 = time.monotonic()
    for _ in range(3):
        store_probe.wait_for_store("127.0.0.1", server.port, time.monotonic() + 5)
    assert time.monotonic() - t0 < 1.0
    server.set("k", b"v")  # still serving, after the probes hung up
    assert dist.TCPStore("127.0.0.1", server.port, None, False, wait_for_workers=False).get("k") == b"v"


class Service:
    """A TCP service on a port of its own: ``answer`` is what it does with each connection."""

    def __init__(self, answer):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.kept: list[socket.socket] = []
        self.accepted = 0
        self._answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._answer(self, conn)

    def close(self):
        self.sock.close()
        for c in self.kept:
            c.close()


def _silent(service, conn):
    service.kept.append(conn)


def _http(service, conn):
    conn.recv(100)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    conn.close()


def _hang_up(service, conn):
    conn.close()


def test_a_service_that_never_answers_is_silent_at_the_deadline():
    service = Service(_silent)
    try:
        t0 = time.monotonic()
        with pytest.raises(store_probe.NoStoreYet) as info:
            store_probe.wait_for_store("127.0.0.1", service.port, t0 + 1.0)
        took = time.monotonic() - t0
    finally:
        service.close()
    assert info.value.kind == "silent"
    assert 1.0 <= took < 1.3, took
    assert "does not answer as a store" in store_probe.describe(info.value)


def test_a_service_that_answers_otherwise_is_not_a_store_at_once():
    service = Service(_http)
    try:
        t0 = time.monotonic()
        with pytest.raises(store_probe.NotAStore) as info:
            store_probe.wait_for_store("127.0.0.1", service.port, t0 + 10.0)
        took = time.monotonic() - t0
    finally:
        service.close()
    assert took < 1.0, took
    assert info.value.answer == b"HTTP/1.1"
    assert "not a ringtrain/torch TCPStore" in store_probe.describe(info.value)


def test_a_service_that_hangs_up_is_asked_again_until_the_deadline():
    # (a forwarder whose target is not up yet: rank 0 may still come)
    service = Service(_hang_up)
    try:
        with pytest.raises(store_probe.NoStoreYet) as info:
            store_probe.wait_for_store("127.0.0.1", service.port, time.monotonic() + 1.0)
    finally:
        service.close()
    assert info.value.kind == "closed" and service.accepted > 1


def test_nothing_listening_is_refused_until_the_deadline_and_a_store_that_comes_later_is_found():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(store_probe.NoStoreYet) as info:
        store_probe.wait_for_store("127.0.0.1", port, time.monotonic() + 0.3)
    assert info.value.kind == "refused" and "nothing accepted a connection" in store_probe.describe(info.value)
    later: dict = {}
    timer = threading.Timer(0.5, lambda: later.update(server=dist.TCPStore("127.0.0.1", port, None, True,
                                                                          wait_for_workers=False)))
    timer.start()
    try:
        store_probe.wait_for_store("127.0.0.1", port, time.monotonic() + 10)
    finally:
        timer.join()
    assert "server" in later
