"""Parameter servers on threads of the test process, for tests of the PS protocol and server.

Import from here, not from another test module (see thread_harness.py).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ringtrain.ps import ParameterServer, ServerConfig


def tiny(seed: int = 0) -> nn.Module:
    """A two-layer model of 23 parameters (4 tensors): fast to push, pull and step."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def start_server(secret: bytes, **kw) -> tuple[ParameterServer, threading.Thread, dict]:
    """A server (index 0 of 1, one worker, unless ``kw`` says otherwise) serving on a thread;
    its stats land in the dict under "stats" when serve() returns."""
    cfg = ServerConfig(**{"index": 0, "servers": 1, "workers": 1, "secret": secret, "timeout": 10.0, **kw})
    server = ParameterServer(cfg)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("stats", server.serve()), daemon=True)
    t.start()
    return server, t, out
