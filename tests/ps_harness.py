"""Parameter servers on threads of the test process, for tests of the PS protocol and server.

Import from here, not from another test module (see thread_harness.py).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import torch
from torch import nn

from ringtrain.ps import ParameterServer, ServerConfig
from ringtrain.ps import protocol as P


def tiny(seed: int = 0) -> nn.Module:
    """A two-layer model of 23 parameters (4 tensors): fast to push, pull and step."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def start_server(secret: bytes, **kw) -> tuple[ParameterServer, threading.Thread, dict]:
    """A server (index 0 of 1, one worker, unless ``kw`` says otherwise) serving on a thread;
    its stats land in the dict under "stats" when serve() returns. The workers' first connections
    are waited for as long as anything else (``join_timeout`` = ``timeout``) unless ``kw`` says."""
    kw = {"timeout": 10.0, **kw}
    cfg = ServerConfig(**{"index": 0, "servers": 1, "workers": 1, "secret": secret, "join_timeout": kw["timeout"],
                          **kw})
    server = ParameterServer(cfg)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("stats", server.serve()), daemon=True)
    t.start()
    return server, t, out


class RawWorker(P.Channel):
    """A worker's channel in a test that speaks the protocol by hand: its PUSHes carry the
    learning rate its HELLO gave (as ParameterServerTraining's do) unless ``lr`` says another."""

    lr = 0.0

    def send(self, kind: int, **kw) -> None:
        if kind == P.HELLO:
            try:
                self.lr = float(json.loads(kw["body"])["lr"])
            except (ValueError, KeyError, TypeError, RecursionError):  # (a test's bad HELLO)
                pass
        elif kind == P.PUSH:
            kw.setdefault("lr", self.lr)
        super().send(kind, **kw)


def recv_params(ch: P.Channel, layout) -> tuple[int, dict]:
    """One PARAMS message: its step and {partition id: values}."""
    head = ch.recv_header(5.0)
    assert head.kind == P.PARAMS, head.name
    ids = ch.recv_ids(head, len(layout.partitions)).tolist()
    out = {}
    for i in ids:
        out[i] = np.empty(layout.partitions[i].numel, dtype=np.float32)
        ch.recv_into(out[i])
    return head.step, out


def recv_partitions(ch: P.Channel, layout, ids, step: int | None = None) -> dict:
    """PARAMS messages (of ``step``, where given) until exactly ``ids`` came (one message each, or merged)."""
    out: dict = {}
    while len(out) < len(ids):
        got_step, got = recv_params(ch, layout)
        assert (step is None or got_step == step) and not set(got) & set(out)
        out.update(got)
    assert sorted(out) == sorted(ids)
    return out


def both_take_step_0(a: P.Channel, b: P.Channel, layout, ids, grads) -> None:
    """Workers 0 and 1 (``a``, ``b``) pull step 0, ask for step 1 and push ``grads`` for step 0; then
    each receives the partitions stepped."""
    for w, ch in enumerate((a, b)):
        ch.send(P.PULL, worker=w, step=0)
        recv_params(ch, layout)
        ch.send(P.PULL, worker=w, step=1)
        ch.send(P.PUSH, worker=w, step=0, ids=ids, values=grads)
    for ch in (a, b):
        recv_partitions(ch, layout, ids.tolist(), step=1)


class Met(Exception):
    """Raised by a stand-in for the call a rank meets the others with: the test has its arguments."""


def stub_meeting(monkeypatch, module) -> dict:
    """Stand-ins for ``module``'s ``run_server_role`` (records its keywords as ``calls["server"]``)
    and ``worker_from_env`` (records them as ``calls["worker"]`` and raises :class:`Met`)."""
    calls: dict = {}

    def worker_from_env(model, servers, **kw):
        calls["worker"] = kw
        raise Met

    monkeypatch.setattr(module, "run_server_role", lambda servers, **kw: calls.setdefault("server", kw))
    monkeypatch.setattr(module, "worker_from_env", worker_from_env)
    return calls
