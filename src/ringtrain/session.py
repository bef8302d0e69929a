"""Putting a communicator together: rendezvous, transport, native process group.

Kept apart from ``comm`` so that the Communicator itself knows nothing of environments or
stores and can be built over any transport (tests build it over threads).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections import Counter
from datetime import timedelta
from functools import partial
from typing import Optional

import torch.distributed as dist

from . import rendezvous
from .comm import Communicator, check_timeout
from .errors import AuthError, CommError, CommTimeout, MismatchError, check_join_timeout, ranks_by_value
from .transport import TRANSPORTS, ctrl_c, make_transport

log = logging.getLogger(__name__)


def _proof(secret: Optional[bytes], job: str, rank: int) -> str:
    if secret is None:
        return "no secret"
    return hmac.new(secret, f"ringtrain-member/{job}/{rank}".encode(), hashlib.sha256).hexdigest()


def authenticate(store, info: rendezvous.JobInfo, job: str) -> None:
    """Every rank proves it holds the job's secret before any transport is set up.

    Rank r publishes HMAC-SHA256(secret, job id, r) and checks every other rank's. The proof is
    bound to this communicator's random job id and to the rank, so it is worth nothing to anyone
    who reads it from the store. This covers the transports without a handshake of their own
    (shared memory, gloo); tcp checks again, per connection, with fresh nonces.
    """
    store.set(f"member/{info.rank}", _proof(info.secret, job, info.rank))
    refused = [
        r for r in range(info.world_size)
        if not hmac.compare_digest(store.get(f"member/{r}").decode(), _proof(info.secret, job, r))
    ]
    if refused:
        raise AuthError(
            f"rank {info.rank}: rank(s) {refused} could not prove they hold this job's secret "
            f"(RINGTRAIN_SECRET differs or is missing{' here' if info.secret is None else ''}); "
            "refusing to communicate with them"
        )


def claim_rank(store, info: rendezvous.JobInfo) -> None:
    """Rank ``info.rank`` is this process's alone in ``store`` (this communicator's keys), or
    MismatchError naming the process that claimed it first. Two launch commands given the same
    --node-rank both join torchrun's job, with the same ranks: one of each pair trained, the other
    waited out its timeout and then failed on "rank 0 did not publish its endpoint", stopping every
    node ("node 1 failed: ...") however far the job had come."""
    mine = f"pid {os.getpid()} on {info.host_id}"
    first = store.compare_set(f"rank/{info.rank}", "", mine).decode(errors="replace")
    if first != mine:
        raise MismatchError(f"rank {info.rank}: another process ({first}) has already joined this job as rank "
                            f"{info.rank}: were two nodes given the same --node-rank? give each node's launcher a "
                            "--node-rank of its own in [0, nnodes)")


def agree_on_setup(store, info: rendezvous.JobInfo, transport: str) -> None:
    """Every rank publishes the transport it was asked for and the number of nodes its launcher
    was told; where they differ all ranks raise MismatchError now. Ranks of different transports
    would each wait out the timeout in a different transport's set-up; nodes started with
    different --nnodes may form a job all the same, and then every
    launcher waited at torchrun's exit barrier for a node count that never came."""
    store.set(f"setup/{info.rank}", f"{transport} {info.nnodes}")
    seen = [store.get(f"setup/{r}").decode().split(" ") for r in range(info.world_size)]
    names = [name for name, _ in seen]
    if len(set(names)) > 1:
        each = ", ".join(f"rank {r} {'uses transport ' if r == 0 else ''}{n}" for r, n in enumerate(names))
        raise MismatchError(f"rank {info.rank}: ranks disagree about the transport: {each}; "
                            "pass the same transport= on every rank")
    nodes = [int(n) for _, n in seen]
    if len(set(nodes)) > 1:
        raise MismatchError(f"rank {info.rank}: the nodes were started with different --nnodes "
                            f"({ranks_by_value(nodes)}); give every node's launcher the same --nnodes")


_WARNED_UNAUTHENTICATED: set[tuple[str, int]] = set()  # the endpoints warned of in this process


def warn_if_unauthenticated(info: rendezvous.JobInfo) -> None:
    """On rank 0 of a job of several ranks without RINGTRAIN_SECRET, one warning saying so: once
    per job endpoint in a process (a loop making communicators there repeated it at each)."""
    endpoint = (info.master_addr, info.master_port)
    if info.secret is None and info.world_size > 1 and info.rank == 0 and endpoint not in _WARNED_UNAUTHENTICATED:
        _WARNED_UNAUTHENTICATED.add(endpoint)
        log.warning("RINGTRAIN_SECRET is not set: the %d ranks do not authenticate each other, so anyone who "
                    "can reach %s:%d and the ranks' ports can join or feed this job (`ringtrain launch` "
                    "sets a secret; under torchrun set the same RINGTRAIN_SECRET on every node)",
                    info.world_size, info.master_addr, info.master_port)


def warn_if_uneven_nodes(info: rendezvous.JobInfo, host_ids: list[str]) -> None:
    """On rank 0, one warning where the nodes run different numbers of ranks: torchrun forms one
    job of them all, so two launch commands given different --nproc-per-node train on, in a job
    of another size than either command says (a mistake more often than a wish)."""
    if info.rank != 0:
        return
    counts = Counter(host_ids)
    if len(set(counts.values())) > 1:
        per_node = ", ".join(f"{n} on {host}" for host, n in counts.items())
        log.warning("the nodes run different numbers of ranks (%s; %d in all): is --nproc-per-node the same in every "
                    "node's launch command?", per_node, info.world_size)


def create_communicator(
    rank: Optional[int],
    world_size: Optional[int],
    master_addr: Optional[str],
    master_port: Optional[int],
    transport: str,
    timeout: float,
    join_timeout: Optional[float] = None,
) -> Communicator:
    """A communicator of the job (``ringtrain.init``'s arguments). ``join_timeout`` bounds reaching
    the store and meeting every rank there; from then on every wait, the transport's set-up
    included, is bounded by ``timeout``."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    timeout = check_timeout(timeout)  # a finite number of seconds > 0, or a str of one (nan refused)
    join_timeout = check_join_timeout(join_timeout, timeout)
    info = rendezvous.job_info(rank, world_size, master_addr, master_port)
    warn_if_unauthenticated(info)
    store = rendezvous.connect_store(info, join_timeout)
    return communicator_on_store(store, info, transport, timeout, join_timeout)


def communicator_on_store(store, info: rendezvous.JobInfo, transport: str, timeout: float,
                          join_timeout: float) -> Communicator:
    """A communicator of the job whose ranks meet in ``store``, a store of their own (prefixed for
    this communicator): ``create_communicator``'s, or the one torch hands a process-group backend."""
    try:
        claim_rank(store, info)
        host_ids = rendezvous.exchange_host_ids(store, info)
        warn_if_uneven_nodes(info, host_ids)
        if info.rank == 0:  # a random job identity, published through this communicator's keys
            store.set("job", secrets.token_hex(8))
        job = store.get("job").decode()
        authenticate(store, info, job)
        agree_on_setup(store, info, transport)
    except CommError:
        raise
    except RuntimeError as exc:  # torch's store wait ran out: some rank never arrived
        where = f"{info.master_addr}:{info.master_port} within {join_timeout:g}s (join_timeout)"
        missing = _missing_ranks(store, info.world_size, info.rank)
        if not missing:  # (not known: torch's text, which names the key it waited for)
            raise CommTimeout(f"rank {info.rank}: not every one of the {info.world_size} ranks reached the "
                              f"rendezvous at {where}: {exc}") from exc
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {', '.join(map(str, missing))}"
        why = " (its node's launcher may have failed: see its output)" if info.nnodes > 1 else ""
        raise CommTimeout(f"rank {info.rank}: {who} of {info.world_size} never arrived at the rendezvous at "
                          f"{where}{why}") from exc
    store.set_timeout(timedelta(seconds=timeout))  # (all met: the store's waits are the job's again)

    native_group = _GlooGroup(store, info.rank, info.world_size, timeout)
    if info.world_size == 1:
        from .transport.local import LocalHub

        t = LocalHub(1).transport(0)
    else:
        try:
            t = make_transport(
                transport,
                rank=info.rank,
                world_size=info.world_size,
                store=store,
                host_ids=host_ids,
                timeout=timeout,
                secret=info.secret,
                bind_host=rendezvous.local_address_towards(info.master_addr),
                process_group_factory=native_group,
                job=job,
            )
        except CommError:
            raise
        except RuntimeError as exc:  # a store wait that ran out: torch's own error type
            raise CommError(f"rank {info.rank}: could not set up transport {transport!r}: {exc}") from exc
    return Communicator(t, timeout=timeout, host_ids=host_ids, store=store, native_group_factory=native_group)


def _missing_ranks(store, world_size: int, me: int) -> list[int]:
    """The ranks whose keys of the rendezvous (``communicator_on_store``'s, in the order written)
    are not all in ``store``, at the stages rank ``me`` had written its own (the stage it waited
    at, not a later one that a rank arriving after the timeout has made look complete); [] where
    all are, or the store does not answer."""
    try:
        for name in ("host", "member", "setup"):
            if not store.check([f"{name}/{me}"]):
                break
            missing = [r for r in range(world_size) if not store.check([f"{name}/{r}"])]
            if missing:
                return missing
    except Exception:  # noqa: BLE001 - the store gone too: torch's own text then
        pass
    return []


class _GlooGroup:
    """A gloo group of our own for algorithm "native" and transport "torch", made on first use
    (the user's default group is neither used nor replaced) and let go by the communicator's
    close(): its threads and sockets go with it."""

    def __init__(self, store, rank: int, world_size: int, timeout: float):
        self._args = (store, rank, world_size, timedelta(seconds=timeout))
        self._group = None
        self.breaker = ctrl_c.Breaker()

    def __call__(self):
        if self._group is None:
            store, rank, world_size, timeout = self._args
            if dist.is_initialized():
                make = partial(dist.new_group, backend="gloo", timeout=timeout)
            else:
                make = partial(dist.ProcessGroupGloo, dist.PrefixStore("gloo/", store), rank, world_size, timeout)
            self._group, sockets = ctrl_c.made_sockets(make)
            self.breaker = ctrl_c.Breaker(sockets)  # Ctrl-C ends a wait in it (see transport.ctrl_c)
            ctrl_c.watch(self.breaker)
        return self._group

    def close(self) -> None:
        group, self._group = self._group, None
        self._args = None
        ctrl_c.unwatch(self.breaker)
        self.breaker = ctrl_c.Breaker()
        if group is not None and dist.is_initialized():
            try:  # a group made by new_group is registered with torch.distributed: unregister it
                dist.destroy_process_group(group)
            except ValueError:  # made directly, not registered: dropping it is enough
                pass
