"""ringtrain: data-parallel training whose gradient exchange is fast on slow networks.

    import ringtrain
    comm = ringtrain.init()            # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them
    ringtrain.allreduce(grad, op="mean")
"""

from __future__ import annotations

from typing import Optional

from .comm import ALGORITHMS, Communicator
from .errors import AuthError, CommError, CommTimeout, MismatchError, PeerLost, ProtocolError, RendezvousError
from .transport import TRANSPORTS

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "AuthError",
    "CommError",
    "CommTimeout",
    "Communicator",
    "DistributedDataParallel",
    "MismatchError",
    "PeerLost",
    "ProtocolError",
    "RendezvousError",
    "TRANSPORTS",
    "TorchProcessGroup",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "get_communicator",
    "init",
    "reduce_scatter",
]

_default: Optional[Communicator] = None


def init(
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    master_addr: Optional[str] = None,
    master_port: Optional[int] = None,
    transport: str = "auto",
    timeout: float = 60.0,
    join_timeout: Optional[float] = None,
) -> Communicator:
    """Join the job and return its communicator (also kept as the default for module-level calls).

    Arguments left as None are read from torchrun's environment variables. Works whether or
    not the script has called torch.distributed.init_process_group; ringtrain never replaces
    or destroys the user's default process group.

    ``timeout`` bounds every wait of the communicator: a collective, or the transport's set-up.
    ``join_timeout`` bounds reaching the rendezvous and meeting every rank there, where the
    ranks' start-up (importing torch, loading data) counts; None gives ``timeout``, but at least
    60 s, so that a short ``timeout`` meant for dead peers does not fail a job whose ranks
    started a few seconds apart.

    Every rank must call init() the same number of times (the n-th calls of the ranks meet each
    other): an init() retried after a CommTimeout on one rank waits for the others' next call,
    not for their first, so do not retry it in a loop; give a longer ``join_timeout`` instead.
    """
    global _default
    from .lifecycle import tie_to_launcher
    from .session import create_communicator

    tie_to_launcher()  # ends with `ringtrain launch`; its exception named in the launcher's line (no @record needed)
    comm = create_communicator(rank, world_size, master_addr, master_port, transport, timeout, join_timeout)
    _default = comm
    return comm


def get_communicator() -> Communicator:
    if _default is None:
        raise RuntimeError("ringtrain.init() has not been called in this process: call it first (under torchrun or "
                           "ringtrain launch it reads the job from the environment; in one process without a "
                           "launcher, a notebook say: ringtrain.init(rank=0, world_size=1))")
    return _default


def allreduce(buf, op: str = "sum", algorithm: str = "auto"):
    return get_communicator().allreduce(buf, op=op, algorithm=algorithm)


def broadcast(buf, root: int = 0):
    return get_communicator().broadcast(buf, root=root)


def allgather(buf):
    return get_communicator().allgather(buf)


def reduce_scatter(buf, op: str = "sum"):
    return get_communicator().reduce_scatter(buf, op=op)


def barrier() -> None:
    get_communicator().barrier()


def __getattr__(name: str):
    # The training wrapper pulls in torch.nn, the process group torch.distributed: import them only when asked for.
    if name == "DistributedDataParallel":
        from .ddp import DistributedDataParallel

        return DistributedDataParallel
    if name == "TorchProcessGroup":  # (imports torch.distributed, and registers the "ringtrain" backend)
        from .torch_group import TorchProcessGroup

        return TorchProcessGroup
    raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")
