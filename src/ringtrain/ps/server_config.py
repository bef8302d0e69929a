"""What a parameter server is told: its ServerConfig (from whoever starts it) and the HELLO
each worker sends (checked here for types and ranges; what the fields must agree with, the
server's layout and its other workers, is ``ParameterServer._configure``'s business).

Kept apart from ``server.py``: the launchers and the worker's API need these names without the
serving machinery.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ProtocolError, check_join_timeout, check_number
from ..paths import user_path
from .server_optimizer import OPTIMIZERS
from .sharding import ITEMSIZE

STRATEGIES = ("sync", "async", "sharded")
#: Sanity bounds on what a HELLO may ask for (larger is a corrupt or hostile HELLO, not a model).
MAX_PARAMETERS = 1 << 20
MAX_NUMEL = 1 << 40
MAX_PARTITIONS = 1 << 20
MAX_DIMS = 64  # (torch allows fewer)
#: The HELLO fields every worker of a job must send alike (the server compares them). "shapes"
#: is not in the layout's digest (the layout depends on sizes only): it is compared on its own.
HELLO_KEYS = ("digest", "numels", "shapes", "partition_bytes", "lr", "momentum", "weight_decay", "strategy",
              "optimizer", "betas", "eps")
#: What a HELLO without the optimizer's keys means: SGD (a worker that sets SGD sends none of them,
#: the HELLO it sent before the servers applied Adam too; betas and eps are then not used).
OPTIMIZER_DEFAULTS = {"optimizer": "sgd", "betas": [0.9, 0.999], "eps": 1e-8}


class JoinTimeout:
    """``join_s`` for a settings class with fields ``timeout`` and ``join_timeout`` (ServerConfig,
    the worker's PSOptions): one rule for both sides of a parameter-server job."""

    __slots__ = ()  # (the settings classes are slotted dataclasses)

    @property
    def join_s(self) -> float:
        """``join_timeout`` in force, seconds."""
        return check_join_timeout(self.join_timeout, self.timeout)


def staleness_flag(max_staleness: int, strategy: str, asynchronous: str) -> Optional[int]:
    """The servers' ``max_staleness`` from a command line's ``--max-staleness`` (-1: unbounded) in a
    job of ``--strategy strategy``, whose asynchronous strategy the command calls ``asynchronous``
    (``ringtrain train`` and ``python -m ringtrain.ps`` name them apart); a ValueError naming the
    flag where the value cannot be one."""
    if max_staleness < -1:
        raise ValueError(f"--max-staleness must be >= 0, or -1 for unbounded; got {max_staleness}")
    if max_staleness and strategy != asynchronous:
        raise ValueError(f"--max-staleness is for --strategy {asynchronous} (synchronous servers wait for every "
                         f"worker); got {max_staleness} with --strategy {strategy}")
    return None if max_staleness == -1 else max_staleness


@dataclass(kw_only=True, slots=True)
class ServerConfig(JoinTimeout):
    index: int
    """This server's number k in [0, servers)."""
    servers: int
    """K, the number of servers of the job."""
    workers: int
    """W, the number of workers of the job."""
    strategy: str = "sync"
    """'sync' (alias 'sharded') or 'async'."""
    max_staleness: Optional[int] = 0
    """async only: how many steps a worker may run ahead of the slowest (None: unbounded).

    0 still applies every gradient on arrival (no aggregation) but no worker pulls for step c+1
    before every live worker has pushed step c. Measured on the character
    LM (40 steps, lr 0.05, momentum 0.9): within 2% of synchronous loss at 0, 12-16% worse at 1-2.
    """
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 0
    """Port to listen on (0: any free one)."""
    job: str = "ps"
    """Job name mixed into the handshake, so that peers of another job are refused."""
    secret: Optional[bytes] = field(default=None, repr=False)
    """The job's shared secret (RINGTRAIN_SECRET); None: no authentication (still framed)."""
    timeout: float = 60.0
    """Seconds any wait may last before CommTimeout, but for the workers' first connections."""
    join_timeout: Optional[float] = None
    """Seconds the first worker has to connect, and every other after it (their start-up counts);
    None: ``timeout``, but at least 60 (``ringtrain.init``'s rule)."""
    checkpoint_dir: str = ""
    """Where this server's shard checkpoints go ('' = no checkpoints); a subfolder per server."""
    resume: bool = False
    """Start from the newest valid shard checkpoint in checkpoint_dir."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("servers", "workers", "index", "max_staleness"):
            value = getattr(self, name)
            if value is None and name == "max_staleness":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an integer{' or None' if name == 'max_staleness' else ''}, "
                                 f"got {value!r}")
        if self.servers < 1 or self.workers < 1:
            raise ValueError(f"servers and workers must be >= 1, got {self.servers} and {self.workers}")
        if not 0 <= self.index < self.servers:
            raise ValueError(f"index must be in [0, {self.servers}), got {self.index}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.synchronous and self.max_staleness != 0:
            raise ValueError(f"max_staleness is for strategy 'async' (a synchronous server keeps every worker at one "
                             f"step); got {self.max_staleness} with strategy {self.strategy!r}")
        check_number("timeout", self.timeout, unit=" of seconds")
        if self.join_timeout is not None:
            self.join_timeout = check_number("join_timeout", self.join_timeout, unit=" of seconds")
        self.checkpoint_dir = user_path(self.checkpoint_dir)

    @property
    def synchronous(self) -> bool:
        return self.strategy != "async"

    @property
    def shard_dir(self) -> Optional[Path]:
        return Path(self.checkpoint_dir) / f"server-{self.index}" if self.checkpoint_dir else None

_UNSET = object()  # (check_hello: no value given, read the field)


def check_hello(hello: dict, who: str) -> dict:
    """A HELLO's fields, checked (types, finite, in range) and normalized; ProtocolError naming the
    first bad one. (What the fields must agree with is _configure's business.)"""
    def bad(key: str, why: str) -> ProtocolError:
        return ProtocolError(f"{who} sent a HELLO whose {key!r} {why}, got {str(hello.get(key))[:80]}")

    def integer(key: str, low: int, high: int, value=_UNSET) -> int:
        value = hello.get(key) if value is _UNSET else value
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise bad(key, f"must be an integer in [{low}, {high}]")
        return value

    def number(key: str, positive: bool, value=_UNSET) -> float:
        value = hello.get(key) if value is _UNSET else value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(key, "must be a number")
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise bad(key, f"must be finite and {'> 0' if positive else '>= 0'}")
        return value

    numels = hello.get("numels")
    if not isinstance(numels, list) or len(numels) > MAX_PARAMETERS:
        raise bad("numels", f"must be a list of at most {MAX_PARAMETERS} parameter sizes")
    out = {"worker": integer("worker", 0, 1 << 31),
           "numels": [integer("numels", 0, MAX_NUMEL, n) for n in numels],
           "shapes": _shapes(hello.get("shapes"), numels, bad),
           "partition_bytes": integer("partition_bytes", ITEMSIZE, MAX_NUMEL),
           "lr": number("lr", positive=True),
           "momentum": number("momentum", positive=False),
           "weight_decay": number("weight_decay", positive=False)}
    for key, allowed in (("strategy", STRATEGIES), ("digest", None)):
        value = hello.get(key)
        if not isinstance(value, str) or (allowed is not None and value not in allowed):
            raise bad(key, f"must be {'one of ' + str(allowed) if allowed else 'a string'}")
        out[key] = value
    hello = {**OPTIMIZER_DEFAULTS, **hello}  # (bad() and number() read the name: they see the defaults too)
    if hello["optimizer"] not in OPTIMIZERS:
        raise bad("optimizer", f"must be one of {OPTIMIZERS}")
    betas = hello["betas"]
    if not isinstance(betas, list) or len(betas) != 2:
        raise bad("betas", "must be a list of two numbers")
    betas = [number("betas", positive=False, value=b) for b in betas]
    if not all(b < 1 for b in betas):
        raise bad("betas", "must be two numbers in [0, 1)")
    out.update(optimizer=hello["optimizer"], betas=betas, eps=number("eps", positive=False))
    return out


def _shapes(shapes, numels: list[int], bad) -> list[list[int]]:
    """HELLO's "shapes": one list of dimension sizes per parameter, each of as many elements as
    "numels" says (checked after "numels")."""
    if not isinstance(shapes, list) or len(shapes) != len(numels) or not all(isinstance(s, list) for s in shapes):
        raise bad("shapes", f"must be a list of {len(numels)} shapes (lists of dimension sizes), one per 'numels'")
    for i, shape in enumerate(shapes):
        if len(shape) > MAX_DIMS:
            raise bad("shapes", f"must hold lists of at most {MAX_DIMS} sizes (parameter #{i} has {len(shape)})")
        if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_NUMEL for d in shape):
            raise bad("shapes", f"must hold lists of integers in [0, {MAX_NUMEL}] (parameter #{i}: {str(shape)[:80]})")
        if math.prod(shape) != numels[i]:
            raise bad("shapes", f"must have as many elements as 'numels' says: parameter #{i} has shape "
                                f"{format_shape(shape)} but {numels[i]} elements")
    return shapes


def format_shape(shape) -> str:
    """A shape as a tuple is written: (3, 4), (12,), ()."""
    return str(tuple(shape))
