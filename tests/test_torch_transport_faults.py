"""The torch transport turns gloo's failures into ringtrain's errors, also those gloo raises
when a send or receive is posted on a pair that broke already (no process group needed)."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.errors import PeerLost
from ringtrain.transport.base import CallHeader, Recv, Send
from ringtrain.transport.torchdist import TorchTransport

RESET = ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:48819: Connection reset by peer. "
         "This is typically caused by a remote worker hanging or bugs in the application.")


class BrokenGroup:
    """A process group whose pair with every peer broke: posting raises, as gloo's does."""

    def send(self, tensors, peer, tag):
        raise RuntimeError(RESET)

    def recv(self, tensors, peer, tag):
        raise RuntimeError(RESET)


@pytest.mark.parametrize("direction", ["send", "recv"])
def test_a_broken_pair_at_posting_is_peer_lost(direction):
    transport = TorchTransport(0, 3, BrokenGroup(), timeout=5.0)
    buf = np.arange(5, dtype=np.float32)
    sends = [Send(1, buf)] if direction == "send" else []
    recvs = [Recv(2, np.empty_like(buf))] if direction == "recv" else []
    with pytest.raises(PeerLost, match=r"rank 0: .* rank [12] failed during .*Connection reset by peer"):
        transport.exchange(sends, recvs, CallHeader(7, "allreduce", numel=5), deadline=1e18)


def test_abort_over_a_broken_group_is_quiet():
    transport = TorchTransport(0, 3, BrokenGroup(), timeout=5.0)
    transport.abort(PeerLost("rank 1 is gone"))  # best effort: raises nothing
