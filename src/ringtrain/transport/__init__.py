"""How bytes move between ranks: one module per transport, all speaking transport.base.

- ``tcp``: framed, authenticated sockets (Unix-domain sockets between ranks on one host);
- ``shm``: shared-memory mailboxes between ranks on one host;
- ``torch``: point-to-point over a torch.distributed process group (gloo, or nccl on GPU);
- ``local``: threads of one process (tests);
- ``auto``: shm between ranks on the same host, tcp between hosts (a composite of both);
  tcp everywhere on machines whose memory ordering shm cannot rely on (non-x86-64).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .base import CallHeader, Recv, Send, Transport

TRANSPORTS = ("tcp", "shm", "torch", "auto")

__all__ = ["CallHeader", "Recv", "Send", "Transport", "TRANSPORTS", "make_transport"]


def make_transport(
    kind: str,
    *,
    rank: int,
    world_size: int,
    store: Any,
    host_ids: Sequence[str],
    timeout: float,
    secret: Optional[bytes],
    bind_host: str,
    process_group_factory=None,
    job: str = "",
) -> Transport:
    """Build the transport ``kind`` for this rank (collective: every rank calls it together).

    ``job``: an identifier all ranks of this job share and no other job has; it enters the tcp
    handshake, so that without a secret a peer of another job is still refused.
    """
    if kind not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {kind!r}")
    if kind == "auto":
        from .shm_sync import ORDERING_OK

        same = [r for r in range(world_size) if host_ids[r] == host_ids[rank]]
        if not ORDERING_OK:  # shared memory relies on x86-64 store ordering (see shm_sync)
            kind = "tcp"
        elif len(set(host_ids)) == 1:
            kind = "shm"
        elif len(same) == 1:
            kind = "tcp"
        else:
            from .composite import CompositeTransport
            from .shm import ShmTransport
            from .tcp import TcpTransport

            shm = ShmTransport.connect(rank, world_size, store, timeout=timeout, prefix="shm/", peers=same)
            tcp = TcpTransport.connect(
                rank, world_size, store, secret=secret, timeout=timeout, host_ids=list(host_ids),
                bind_host=bind_host, prefix=f"tcp/{job}/" if job else "tcp/",
            )
            return CompositeTransport(rank, world_size, {r: shm for r in same}, tcp)
    if kind == "shm":
        if len(set(host_ids)) != 1:
            raise ValueError("transport='shm' needs every rank on one host; use 'auto' or 'tcp'")
        from .shm import ShmTransport

        return ShmTransport.connect(rank, world_size, store, timeout=timeout, prefix="shm/")
    if kind == "tcp":
        from .tcp import TcpTransport

        return TcpTransport.connect(
            rank, world_size, store, secret=secret, timeout=timeout, host_ids=list(host_ids),
            bind_host=bind_host, prefix=f"tcp/{job}/" if job else "tcp/",
        )
    from .torchdist import TorchTransport

    group = process_group_factory()
    return TorchTransport(rank, world_size, group, timeout=timeout, breaker=getattr(process_group_factory, "breaker", None))
