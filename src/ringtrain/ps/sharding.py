"""Which server owns which piece of which parameter: pure layout functions, no I/O.

Words:

- *parameter*: one trainable tensor of the model, numbered 0.. in ``module.parameters()``
  order (duplicates removed), which is close to forward order. Only float32 is served.
- *partition*: a contiguous run of one parameter's elements, ``[start, stop)``, at most
  ``partition_bytes`` long. A parameter larger than that is cut into equal-sized partitions
  (the last may be shorter), so that one big tensor never makes one server the hot spot.
  Partitions are numbered 0.. in (parameter, start) order: that number is a partition's *id*
  and is what travels on the wire.
- *shard*: the partitions one server owns. Partitions go to servers by bytes, largest first,
  each to the server that holds the fewest bytes so far (ties: the lower server): the classic
  longest-processing-time rule, within 4/3 of the best possible balance. Every shard holds at
  least one partition: a layout with more servers than partitions is refused.
- *shard order*: a shard's partitions sorted by id, i.e. by parameter and then start. A
  server keeps its shard as one flat float32 array in that order (a partition's *offset* is
  where it begins there) and answers a pull in that order, so the first layers arrive first.

Every worker and every server computes the same layout from the same inputs (the parameter
sizes, the number of servers, partition_bytes); the layout's *digest* is compared at
connection time so that a worker with a different model is refused.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

#: Default partition size: a few MB, as the issue asks (4 MiB).
DEFAULT_PARTITION_BYTES = 4 << 20
ITEMSIZE = 4  # float32


@dataclass(frozen=True, slots=True)
class Partition:
    """Elements ``[start, stop)`` of parameter ``param``, owned by server ``server``."""

    id: int
    param: int
    start: int
    stop: int
    server: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Layout:
    """The partitions of every parameter and the shard of every server."""

    numels: tuple[int, ...]
    servers: int
    partition_bytes: int
    partitions: tuple[Partition, ...]

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"servers must be >= 1, got {self.servers}")

    def shard(self, server: int) -> list[Partition]:
        """Server ``server``'s partitions in shard order."""
        return [p for p in self.partitions if p.server == server]

    def shard_numel(self, server: int) -> int:
        return sum(p.numel for p in self.shard(server))

    def offsets(self, server: int) -> dict[int, int]:
        """Partition id -> its first element in server ``server``'s flat shard."""
        out, at = {}, 0
        for p in self.shard(server):
            out[p.id] = at
            at += p.numel
        return out

    def of_param(self, param: int) -> list[Partition]:
        return [p for p in self.partitions if p.param == param]

    def digest(self) -> str:
        """A short hex digest that differs when any size, count or cut differs."""
        return layout_digest(self.numels, self.servers, self.partition_bytes)

    def bytes_per_server(self) -> list[int]:
        totals = [0] * self.servers
        for p in self.partitions:
            totals[p.server] += p.numel * ITEMSIZE
        return totals


def _piece_count(numel: int, partition_bytes: int) -> int:
    """How many pieces ``cut`` makes of a parameter of ``numel`` > 0 elements."""
    cap = max(1, partition_bytes // ITEMSIZE)
    return -(-numel // cap)


def cut(numel: int, partition_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` pieces of a parameter of ``numel`` elements, each at most partition_bytes."""
    pieces = _piece_count(numel, partition_bytes)
    if pieces <= 1:
        return [(0, numel)]
    size = math.ceil(numel / pieces)  # equal sizes; the last one may be shorter
    return [(s, min(s + size, numel)) for s in range(0, numel, size)]


def layout_digest(numels: Sequence[int], servers: int, partition_bytes: int) -> str:
    """The digest of the layout ``make_layout(numels, servers, partition_bytes)`` would build,
    without building it (a server checks a worker's claim before it spends anything on it)."""
    text = f"{servers};{partition_bytes};{','.join(map(str, numels))}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def partition_count(numels: Sequence[int], partition_bytes: int) -> int:
    """How many partitions ``numels`` are cut into (without cutting them)."""
    return sum(_piece_count(int(n), partition_bytes) for n in numels if int(n) > 0)


def make_layout(numels: Sequence[int], servers: int, partition_bytes: int = DEFAULT_PARTITION_BYTES) -> Layout:
    """Cut every parameter into partitions and deal them to ``servers`` balanced by bytes."""
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers must be a positive integer, got {servers!r}")
    if isinstance(partition_bytes, bool) or not isinstance(partition_bytes, int) or partition_bytes < ITEMSIZE:
        raise ValueError(f"partition_bytes must be an integer >= {ITEMSIZE}, got {partition_bytes!r}")
    numels = tuple(int(n) for n in numels)
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be >= 0, got {numels}")
    pieces = [(param, s, e) for param, n in enumerate(numels) for s, e in cut(n, partition_bytes) if e > s]
    if not pieces:
        raise ValueError(f"no parameter elements to serve (parameter sizes {list(numels)})")
    if len(pieces) < servers:  # a server without a partition would have nothing to serve or step
        n = len(pieces)
        raise ValueError(f"{servers} servers but only {n} partition{'s' * (n != 1)} ({sum(numels)} elements in "
                         f"{len(numels)} parameters, {partition_bytes}-byte partitions); use at most "
                         f"{n} server{'s' * (n != 1)}")
    # Longest first; ties by id so that the result does not depend on the sort's stability.
    order = sorted(range(len(pieces)), key=lambda i: (-(pieces[i][2] - pieces[i][1]), i))
    load = [0] * servers
    owner = [0] * len(pieces)
    for i in order:
        k = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = k
        load[k] += pieces[i][2] - pieces[i][1]
    parts = tuple(Partition(i, param, s, e, owner[i]) for i, (param, s, e) in enumerate(pieces))
    return Layout(numels, servers, partition_bytes, parts)
