"""Finding the other ranks: where the job's environment is read, and the c10d TCPStore.

This is the one module that reads the environment (STYLE.md: no variable sprawl):

- RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: as torchrun (torch.distributed.run) sets them;
- TORCHELASTIC_USE_AGENT_STORE: set by torchrun when its agent already serves the TCPStore;
- GROUP_WORLD_SIZE: the number of nodes torchrun was told (--nnodes), compared across ranks;
- RINGTRAIN_HOST_ID: this rank's host identity (default: the hostname, with torchrun's node rank,
  GROUP_RANK, where it started several nodes). The network-emulation harness gives every rank its
  own, because namespaces share the hostname and /dev/shm;
- RINGTRAIN_SECRET: the job's shared secret for peer authentication (hex or text).

Endpoint exchange goes through torch's own TCPStore, under a key prefix unique to each
communicator, so that it never collides with the user's own use of the store.
"""

from __future__ import annotations

import operator
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from . import store_probe
from .errors import CommTimeout, RendezvousError

_HANDSHAKE_GRACE = 0.5  # seconds past the deadline that torch's client may take to give up itself
_generations: dict[tuple[str, int], int] = {}  # communicators this process made per endpoint (equal on every rank)
_stores: dict[tuple[str, int], dist.Store] = {}  # one TCPStore per master endpoint, reused (see _release_idle)
_users: dict[tuple[str, int], list] = {}  # per endpoint: weak references to its communicators' prefixed stores
_pinned: set[tuple[str, int]] = set()  # endpoints whose store job_store handed out (kept for the process's life)
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class JobInfo:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    host_id: str
    secret: Optional[bytes]
    nnodes: int = 0
    """The nodes this rank's launcher was told the job has (torchrun's --nnodes); 0: not under torchrun."""


def _host_id(env) -> str:
    """RINGTRAIN_HOST_ID, else the hostname; under torchrun with several nodes, the hostname and the
    node's rank (GROUP_RANK): machines that share a hostname (cloned VMs, containers) are then not
    taken for one host, whose ranks would look for each other in a shared memory they do not share."""
    if env.get("RINGTRAIN_HOST_ID"):
        return env["RINGTRAIN_HOST_ID"]
    host = socket.gethostname()
    try:
        nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    except ValueError:
        nodes = 1
    return f"{host}/node{env['GROUP_RANK']}" if nodes > 1 and env.get("GROUP_RANK") else host


def job_info(rank=None, world_size=None, master_addr=None, master_port=None) -> JobInfo:
    """Fill what the caller left out from torchrun's environment variables; validate all."""
    env = os.environ
    rank = _int_arg("rank", rank, env.get("RANK"))
    world_size = _int_arg("world_size", world_size, env.get("WORLD_SIZE"))
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if master_addr is None:
        master_addr = env.get("MASTER_ADDR") or "127.0.0.1"
    if not isinstance(master_addr, str) or not master_addr.strip():
        raise ValueError(f"master_addr must be a non-empty host name or IP address (str), got {master_addr!r}")
    port = _int_arg("master_port", master_port, env.get("MASTER_PORT"), default=29500 if world_size == 1 else None)
    if not 0 < port < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {port}")
    host_id = _host_id(env)
    secret = env.get("RINGTRAIN_SECRET")
    nnodes = env.get("GROUP_WORLD_SIZE", "")
    return JobInfo(rank, world_size, master_addr, port, host_id, secret.encode() if secret else None,
                   int(nnodes) if nnodes.isdigit() else 0)


def _int_arg(name: str, value, env_value, default=None) -> int:
    if value is None:
        value = env_value if env_value is not None else default
    if value is None:
        raise ValueError(
            f"{name} was not given and its environment variable ({name.upper()}) is not set; "
            "pass it to ringtrain.init() or start the job with torchrun / ringtrain launch"
        )
    try:
        if isinstance(value, str):  # from the environment
            return int(value)
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # an int or a numpy integer, never a float that would be truncated
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def connect_store(info: JobInfo, timeout: float) -> dist.Store:
    """A store shared by all ranks of the job, prefixed for one new communicator.

    Every rank must call it the same number of times for this endpoint (the prefix counts the
    calls). Counted by endpoint, not in all: a job on a new MASTER_PORT, whose ranks are new
    processes (a peer that died, restarted), starts at 1 on every rank, as they do. The store of
    an endpoint no communicator uses any more is let go once one is made at another
    (_release_idle).
    """
    key = (info.master_addr, info.master_port)
    _generations[key] = generation = _generations.get(key, 0) + 1
    with _lock:
        _release_idle(keep=key)
        users = _users.setdefault(key, [])
        users.append(_opening)  # (a user while the store is made, unlocked: not let go meanwhile)
    store = None
    try:
        store = dist.PrefixStore(f"ringtrain/{generation}/", _endpoint_store(info, timeout))
    finally:
        with _lock:
            users.remove(_opening)
            if store is not None:
                users.append(weakref.ref(store))
    return store


def _opening() -> bool:
    """Stands in a list of weak references for a store being made: a reference that is alive."""
    return True


def _release_idle(keep: tuple[str, int]) -> None:
    """Let go of the stores of the endpoints other than ``keep`` that no communicator uses (their
    prefixed stores are closed or collected) and that job_store did not hand out: rank 0's server
    holds a port and about ten file descriptors, and a process that made communicators on many
    endpoints (a driver or a notebook that starts job after job) kept every one until it ran out
    of descriptors. Not at a communicator's close: a peer that closed first may already be meeting
    the others again at the same endpoint, in the store it still reaches. Called under ``_lock``."""
    for key in list(_stores):
        refs = _users.get(key, [])
        refs[:] = [r for r in refs if r() is not None]
        if key != keep and key not in _pinned and not refs:
            del _stores[key]
            _users.pop(key, None)


def job_store(info: JobInfo, timeout: float) -> dist.Store:
    """The job's own store, without a communicator prefix, kept for the process's life (made once
    per endpoint, then reused). Roles that meet outside a communicator take it here.

    Rank 0 serves a TCPStore at MASTER_ADDR:MASTER_PORT unless someone already does: torchrun's
    agent (TORCHELASTIC_USE_AGENT_STORE) or the user's own init_process_group. Everyone else
    connects as a client. Roles that meet outside a communicator (parameter servers) use it
    with keys of their own. Under a torchrun that restarts the job (``--max-restarts``), each
    attempt's keys are its own, as torch's are (``attempt_<n>/``): the agent's store outlives an
    attempt, and a restarted rank would read the last attempt's job identity (an AuthError).
    """
    with _lock:
        _pinned.add((info.master_addr, info.master_port))
    return _endpoint_store(info, timeout)


def _endpoint_store(info: JobInfo, timeout: float) -> dist.Store:
    """The store at the job's endpoint (job_store's, without pinning it), made or reused."""
    key = (info.master_addr, info.master_port)
    if info.world_size == 1:
        store: dist.Store = _stores.setdefault(key, dist.HashStore())
    elif key in _stores:
        store = _stores[key]
    else:
        serve = (
            info.rank == 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
            and not (dist.is_available() and dist.is_initialized())
        )
        store = _stores[key] = _serve_store(info, timeout) if serve else _reach_store(info, timeout)
    store.set_timeout(timedelta(seconds=timeout))
    return this_attempts(store)


def this_attempts(store: dist.Store) -> dist.Store:
    """``store`` prefixed for this attempt of a torchrun that restarts the job (``--max-restarts``):
    the agent's store outlives an attempt, and torch hands a group of the next one the prefix of
    the group before."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return store if attempt == "0" else dist.PrefixStore(f"attempt_{attempt}/", store)


def _serve_store(info: JobInfo, timeout: float) -> dist.Store:
    """Rank 0's TCPStore server. It fails at once or not at all, so a failure is a
    RendezvousError (a taken port), never a CommTimeout."""
    where = f"{info.master_addr}:{info.master_port}"
    try:
        return dist.TCPStore(info.master_addr, info.master_port, info.world_size, True,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as exc:  # torch's DistNetworkError/RuntimeError with its own text
        text = _torch_text(exc)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise RendezvousError(
                f"rank {info.rank}: cannot serve the rendezvous store at {where}: port {info.master_port} is "
                "already in use (another job or service holds it); choose another MASTER_PORT "
                "(ringtrain launch --master-port)"
            ) from None
        raise RendezvousError(f"rank {info.rank}: cannot serve the rendezvous store at {where}: {text}") from None


def _reach_store(info: JobInfo, timeout: float) -> dist.Store:
    """A TCPStore client of the server at MASTER_ADDR:MASTER_PORT, within ``timeout`` seconds.

    torch's client keeps no deadline against an endpoint that is not a store (it retries past
    it, printing a C++ trace each time, or waits forever on a service that accepts and never
    answers). So ``store_probe`` first asks the endpoint, with our deadline, whether a store
    answers there; only then is torch's client made. It still runs on a daemon thread that
    is abandoned at the deadline, should a store that just answered stop answering.
    """
    deadline = time.monotonic() + timeout
    where = f"{info.master_addr}:{info.master_port}"
    try:
        store_probe.wait_for_store(info.master_addr, info.master_port, deadline)
    except store_probe.NotAStore as exc:  # waiting will not change what holds the port
        raise RendezvousError(
            f"rank {info.rank}: cannot reach the rendezvous store at {where}: "
            f"{store_probe.describe(exc)}; check MASTER_ADDR/MASTER_PORT (rank 0's store listens there)"
        ) from None
    except store_probe.NoStoreYet as exc:
        raise CommTimeout(
            f"rank {info.rank}: could not reach the rendezvous store at {where} within {timeout:g} s: "
            f"{store_probe.describe(exc)}; check that rank 0 is running and MASTER_ADDR/MASTER_PORT"
        ) from None
    made: dict[str, object] = {}

    def make() -> None:
        try:
            made["store"] = dist.TCPStore(
                info.master_addr, info.master_port, None, False,
                timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.1)), wait_for_workers=False,
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            made["error"] = exc

    thread = threading.Thread(target=make, name="ringtrain-store-connect", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0) + _HANDSHAKE_GRACE)
    if "store" in made:
        return made["store"]  # type: ignore[return-value]
    if thread.is_alive():
        raise CommTimeout(
            f"rank {info.rank}: could not reach the rendezvous store at {where} within {timeout:g} s: "
            "it answered once, then stopped answering; check MASTER_ADDR/MASTER_PORT"
        )
    raise CommTimeout(
        f"rank {info.rank}: could not reach the rendezvous store at {where} within {timeout:g} s: "
        f"{_torch_text(made['error'])}"  # type: ignore[arg-type]
    )


def _torch_text(exc: BaseException) -> str:
    """torch's message without the C++ stack trace it may carry."""
    text = str(exc).split("Exception raised from", 1)[0].strip()
    return text.splitlines()[0] if text else type(exc).__name__


def store_endpoint(store: dist.Store) -> tuple[Optional[str], Optional[int]]:
    """The address and port of the TCPStore under ``store`` (through its PrefixStores), where the
    ranks met; (None, None) for another kind of store (job_info then reads MASTER_ADDR/MASTER_PORT)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None, None


def exchange_host_ids(store: dist.Store, info: JobInfo) -> list[str]:
    store.set(f"host/{info.rank}", info.host_id)
    return [store.get(f"host/{r}").decode() for r in range(info.world_size)]


def local_address_towards(master_addr: str) -> str:
    """The address of the interface this host would use to reach ``master_addr``.

    Listeners bind to it rather than to every interface. A UDP connect sends nothing.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(master_addr), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
