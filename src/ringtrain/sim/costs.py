"""Analytic time of one collective: n bytes reduced over p ranks.

Words used here (the notation of Thakur, Rabenseifner & Gropp 2005, "Optimization of
collective communication operations in MPICH", IJHPCA 19(1)):

- ``n`` (``nbytes``): the size of the vector every rank contributes, bytes.
- ``p`` (``world_size``): the number of ranks (workers, GPUs) taking part.
- ``alpha``: start-up time of one message, seconds (latency and software overhead).
- ``beta``: time per byte on one link, seconds per byte (1 / bandwidth).
- ``gamma``: time per byte of the reduction arithmetic, seconds per byte reduced.
- a *link* is full duplex: a rank may send and receive one message at the same time, and
  sending two messages from one rank takes twice as long (one port).

Every model gives 0 for p = 1 (there is nothing to exchange; a one-worker job runs no
parameter server either). ``allreduce_time`` and the callables from ``allreduce_cost`` take
``nbytes`` as a number (and return a float) or as a numpy array (and return an array,
element-wise), so the planner and the simulator can cost many message sizes in one call.
``allreduce_cost`` validates its arguments once; its calls then only check the sizes.
Formulas, with their sources:

- ring (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 69(2); DESIGN.md): reduce-scatter in p-1 steps of n/p bytes, then
  allgather in p-1 steps:  2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ.
- naive (seed 001; DESIGN.md): every rank sends its whole vector to every other rank and
  reduces what it receives:  (p-1)(α + nβ + nγ).
- central (seed 001; DESIGN.md): one master receives p-1 vectors, reduces them and sends the
  result to p-1 ranks; its link is the bottleneck:  2(p-1)(α + nβ) + (p-1)nγ.
- halving_doubling (Rabenseifner's algorithm; Thakur et al. 2005 §4.4, MPICH's
  ``MPIR_Allreduce_intra_reduce_scatter_allgather``): reduce-scatter by recursive halving,
  allgather by recursive doubling. For p a power of two:
  2·log2(p)·α + 2(p-1)/p·nβ + (p-1)/p·nγ.
  Otherwise, with p' = 2^floor(log2 p) and r = p - p', MPICH first folds r ranks into
  partners (each sends its whole vector, the partner reduces: α + nβ + nγ), runs the
  algorithm over p' ranks, and sends the result back to the r ranks (α + nβ):
  (2·log2(p') + 2)α + (2(p'-1)/p' + 2)·nβ + ((p'-1)/p' + 1)·nγ.
  (MPICH's comment writes (p-1)/p for (p'-1)/p'; the halving runs over p' ranks.)
- recursive_doubling (Thakur et al. 2005 §4.4, MPICH's short-message allreduce): log2(p)
  steps exchanging the whole vector: log2(p)(α + nβ + nγ) for p a power of two; otherwise the
  same fold and return as above: (log2(p') + 2)α + (log2(p') + 2)nβ + (log2(p') + 1)nγ.
- binomial_tree (Thakur et al. 2005 §4.2 and §4.1): binomial-tree reduce to a root, then
  binomial-tree broadcast, ⌈log2 p⌉ rounds each: ⌈log2 p⌉(2α + 2nβ + nγ).
- hierarchical (DESIGN.md; each phase costed as in Patarasuk & Yuan 2009): g GPUs per node on
  a fast link (intra_alpha, intra_beta), h = p/g nodes on the slower one (alpha, beta). Ring
  reduce-scatter inside each node, then g ring allreduces of n/g bytes between nodes at once
  (GPU i of every node on shard i), then ring allgather inside the node. The g inter-node
  rings share the node's c = nics_per_node network cards (default 1), so each is slowed by
  s = g / min(c, g):
  2(g-1)α_i + 2(g-1)/g·nβ_i + (g-1)/g·nγ + 2(h-1)α + 2(h-1)/h·(n/g)·s·β + (h-1)/h·(n/g)·γ.
  With one card per node the cards carry the same bytes as a flat ring's, so hierarchical
  saves start-ups, not bandwidth; with one card per GPU (c = g) the inter-node bytes fall g-fold.
  p must be a multiple of g, or at most g (one node: a ring on the fast link).
- ps, parameter servers (seed 002; DESIGN.md), synchronous push then pull, K servers each
  holding 1/K of the vector, servers on their own machines. In each direction the busiest link
  is a server's (p messages of n/K) or a worker's (K messages of n/K):
  D(n) = max(p(α + nβ/K), Kα + nβ). Links are full duplex and the servers work partition by
  partition (at most s bytes each, ``partition_bytes``, default 4 MiB as ``ringtrain.ps``): a
  partition is summed, stepped and pulled once every worker's push of it is in, while later
  partitions are still being pushed. So the pushes hold the links for D(n) + (p-1)·nγ/K
  (``AllreduceCost.occupancy``: consecutive exchanges queue behind it) and the pull of the last
  partitions, one per server, follows: D(min(n, Ks)) (``AllreduceCost.drain``; consecutive
  exchanges' drains queue on the links back, ``ringtrain.plan``). One exchange:
  D(n) + D(min(n, Ks)) + (p-1)·nγ/K; for n <= Ks that is push then pull, 2·D(n) + (p-1)·nγ/K
  (one server: 2p(α + nβ) + (p-1)nγ).

``NETWORKS`` holds the constants, with units, in one table.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..plan import LinearCost

ALGORITHMS = (
    "ring",
    "naive",
    "central",
    "halving_doubling",
    "recursive_doubling",
    "binomial_tree",
    "hierarchical",
    "ps",
)

# Options each algorithm takes beyond alpha, beta and gamma.
_OPTIONS: dict[str, tuple[str, ...]] = {
    "hierarchical": ("gpus_per_node", "intra_alpha", "intra_beta", "nics_per_node"),
    "ps": ("servers", "partition_bytes"),
}

#: The servers' partition size, as ringtrain.ps cuts parameters (ps.sharding.DEFAULT_PARTITION_BYTES).
PS_PARTITION_BYTES = 4 << 20
GBIT = 1e9 / 8  # bytes per second in one Gbit/s
GBYTE = 1e9  # bytes per second in one GB/s


# --- validation and helpers ----------------------------------------------------------------


def _floor_pow2(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def _check_sizes(nbytes: Any) -> np.ndarray:
    if isinstance(nbytes, (float, int)) and not isinstance(nbytes, bool):
        if not (0 <= nbytes <= sys.float_info.max):  # (an int of 400 digits: an OverflowError below)
            raise ValueError(f"nbytes={nbytes!r}; every size must be finite and >= 0")
        return np.float64(nbytes)  # the scalar fast path (the planner calls this per layer)
    try:
        raw = np.asarray(nbytes)
        if raw.dtype.kind in "bSU":  # ('1e6' and True were taken as 1e6 and 1 byte)
            raise TypeError
        n = raw.astype(np.float64, copy=False)
    except (TypeError, ValueError):
        raise ValueError(f"nbytes must be a number or an array of numbers, got {nbytes!r}") from None
    except OverflowError:
        raise ValueError(f"nbytes={nbytes!r}; every size must be finite and >= 0") from None
    if not np.all(np.isfinite(n) & (n >= 0)):
        raise ValueError(f"nbytes={nbytes!r}; every size must be finite and >= 0")
    return n


def _result(n: np.ndarray, t: Any) -> Any:
    """A float for a scalar size, else an array shaped like the sizes."""
    if n.ndim == 0:
        return float(t)
    t = np.asarray(t, dtype=np.float64)
    return t if t.shape == n.shape else np.broadcast_to(t, n.shape).copy()


#: The largest world size or count taken: the formulas compute in floats, and an integer of
#: 400 digits was an OverflowError inside them.
MAX_COUNT = 1e15


def _check_world(p: Any) -> int:
    return _check_count("world_size", p)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= MAX_COUNT:
        raise ValueError(f"{name}={value!r}; it must be an integer >= 1 and at most {MAX_COUNT:.0e}")
    return int(value)


def _finite(value: Any) -> bool:
    """math.isfinite, False (not an OverflowError) for an integer past what a float holds."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not _finite(value) or value < 0:
        raise ValueError(f"{name}={value!r}; it must be finite and >= 0")


# --- the constants ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NetworkProfile:
    """α–β constants of one kind of link (or of one fitted allreduce, see fitted_world_size)."""

    name: str
    alpha: float
    """Start-up time of one message, seconds."""
    beta: float
    """Seconds per byte (1 / bandwidth in bytes per second)."""
    source: str
    """Where the numbers come from."""
    gamma: float = 0.0
    """Seconds per byte reduced."""
    fitted_world_size: int | None = None
    """Set when alpha and beta were fitted to whole allreduces on that many workers: then
    ``alpha + beta * n`` is the time of one allreduce (the planner's linear cost), not a link."""

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            _check_number(name, getattr(self, name))
        if self.fitted_world_size is not None and _check_world(self.fitted_world_size) < 2:
            raise ValueError(f"fitted_world_size={self.fitted_world_size!r}; a fitted allreduce needs >= 2 workers")

    @property
    def bandwidth(self) -> float:
        """Bytes per second (inf for beta = 0)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def cost(self, world_size: int, algorithm: str = "ring", **options: Any) -> Callable[[Any], Any]:
        """``cost(nbytes) -> seconds`` of one allreduce on this network, for ``plan.merge``.

        A link profile goes through the ``algorithm``'s model. A fitted profile is the time of
        one allreduce at its own world size only, read as a ring allreduce's (as
        ``sim.clusters`` reads it): for ``ring`` exactly ``alpha + (beta + gamma) * n``; for
        another algorithm, or with ``options``, that algorithm's model on the link constants
        that give the fitted ring time (``link_from_fit``).
        """
        if self.fitted_world_size is None:
            return allreduce_cost(world_size, algorithm, self.alpha, self.beta, self.gamma, **options)
        if world_size != self.fitted_world_size:
            raise ValueError(
                f"network {self.name!r} was fitted on {self.fitted_world_size} workers, not "
                f"world_size={world_size}; use a link profile for other sizes"
            )
        if algorithm == "ring" and not options:
            return LinearCost(self.alpha, self.beta, self.gamma)
        # (gamma, per byte reduced, is a time per byte like beta: converted with beta's coefficient)
        alpha, beta_gamma = link_from_fit(self.alpha, self.beta + self.gamma, world_size)
        return allreduce_cost(world_size, algorithm, alpha, beta_gamma, **options)


def link_from_fit(a: float, b: float, world_size: int, algorithm: str = "ring") -> tuple[float, float]:
    """Link (alpha, beta) whose ``algorithm`` allreduce on ``world_size`` takes ``a + b*n``.

    Every formula here is linear in alpha and in beta, so the coefficients are read off the
    formula itself: ``allreduce_time`` with (alpha=1, beta=0) and (alpha=0, beta=1).
    """
    if world_size < 2:
        raise ValueError(f"a fitted allreduce needs world_size >= 2, got {world_size}")
    n = 1e6
    per_alpha = float(allreduce_time(n, world_size, algorithm, alpha=1.0, beta=0.0))
    per_beta = float(allreduce_time(n, world_size, algorithm, alpha=0.0, beta=1.0)) / n
    if per_alpha <= 0 or per_beta <= 0:
        raise ValueError(f"cannot convert a fit for algorithm {algorithm!r} to link constants")
    return a / per_alpha, b / per_beta


_LINE_RATE = "nominal line rate; alpha an assumed typical per-message latency"
_MGWFBP = "Shi, Chu & Li, MG-WFBP (TPDS 2021), fitted allreduce time a + b*n (DESIGN.md)"

#: The constants, with units: alpha in seconds, beta in seconds per byte.
NETWORKS: dict[str, NetworkProfile] = {
    p.name: p
    for p in (
        NetworkProfile("1GbE", alpha=50e-6, beta=1 / (1 * GBIT), source=f"1 Gbit/s Ethernet, TCP; {_LINE_RATE}"),
        NetworkProfile("10GbE", alpha=25e-6, beta=1 / (10 * GBIT), source=f"10 Gbit/s Ethernet, TCP; {_LINE_RATE}"),
        NetworkProfile("25GbE", alpha=15e-6, beta=1 / (25 * GBIT), source=f"25 Gbit/s Ethernet, TCP; {_LINE_RATE}"),
        NetworkProfile(
            "56Gb-IB", alpha=2e-6, beta=1 / (54.54 * GBIT), source=f"FDR InfiniBand 4x, 54.54 Gbit/s data rate; {_LINE_RATE}"
        ),
        NetworkProfile(
            "100Gb-IB", alpha=1.5e-6, beta=1 / (100 * GBIT), source=f"EDR InfiniBand 4x, 100 Gbit/s data rate; {_LINE_RATE}"
        ),
        NetworkProfile(
            "NVLink", alpha=5e-6, beta=1 / (150 * GBYTE), source=f"NVLink 2 (V100), 6 links x 25 GB/s per direction; {_LINE_RATE}"
        ),
        NetworkProfile("seed000-IB", alpha=0.0, beta=1 / (6 * GBYTE), source="seed 000: InfiniBand at about 6 GB/s, no latency"),
        NetworkProfile("mgwfbp-10GbE-16", alpha=9.08e-4, beta=7.40e-10, source=_MGWFBP, fitted_world_size=16),
        NetworkProfile("mgwfbp-10GbE-8", alpha=5.23e-4, beta=8.57e-10, source=_MGWFBP, fitted_world_size=8),
        NetworkProfile("mgwfbp-56IB-16", alpha=2.36e-4, beta=4.06e-10, source=_MGWFBP, fitted_world_size=16),
        NetworkProfile("mgwfbp-56IB-8", alpha=9.75e-5, beta=3.06e-10, source=_MGWFBP, fitted_world_size=8),
    )
}


def network(name: str) -> NetworkProfile:
    """The profile called ``name`` from NETWORKS, or a ValueError listing the names."""
    try:
        return NETWORKS[name]
    except KeyError:
        raise ValueError(f"network={name!r}: accepted values are {', '.join(NETWORKS)}") from None


# --- the formulas: n a float64 array, everything else already validated -------------------


def _ring(n: np.ndarray, p: int, alpha: float, beta: float, gamma: float) -> Any:
    # Patarasuk & Yuan 2009: 2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ.
    if p == 1:
        return 0.0 * n
    return 2 * (p - 1) * alpha + (2 * (p - 1) / p) * n * beta + ((p - 1) / p) * n * gamma


def _naive(n: np.ndarray, p: int, alpha: float, beta: float, gamma: float) -> Any:
    # seed 001, DESIGN.md: (p-1)(α + nβ + nγ).
    return (p - 1) * (alpha + n * beta + n * gamma)


def _central(n: np.ndarray, p: int, alpha: float, beta: float, gamma: float) -> Any:
    # seed 001, DESIGN.md: 2(p-1)(α + nβ) + (p-1)nγ.
    return 2 * (p - 1) * (alpha + n * beta) + (p - 1) * n * gamma


def _halving_doubling(n: np.ndarray, p: int, alpha: float, beta: float, gamma: float) -> Any:
    # Thakur, Rabenseifner & Gropp 2005 §4.4; MPICH's fold for p not a power of two.
    q = _floor_pow2(p)
    steps = q.bit_length() - 1  # log2(q)
    t = 2 * steps * alpha + (2 * (q - 1) / q) * n * beta + ((q - 1) / q) * n * gamma
    if q != p:  # fold the extra ranks in (α + nβ + nγ) and send them the result (α + nβ)
        t = t + 2 * alpha + 2 * n * beta + n * gamma
    return t


def _recursive_doubling(n: np.ndarray, p: int, alpha: float, beta: float, gamma: float) -> Any:
    # Thakur, Rabenseifner & Gropp 2005 §4.4: log2(p)(α + nβ + nγ), same fold as above.
    q = _floor_pow2(p)
    t = (q.bit_length() - 1) * (alpha + n * beta + n * gamma)
    if q != p:
        t = t + 2 * alpha + 2 * n * beta + n * gamma
    return t


def _binomial_tree(n: np.ndarray, p: int, alpha: float, beta: float, gamma: float) -> Any:
    # Thakur, Rabenseifner & Gropp 2005 §4.1-4.2: ⌈log2 p⌉ rounds of reduce, then of broadcast.
    rounds = (p - 1).bit_length()  # ⌈log2 p⌉
    return rounds * (2 * alpha + 2 * n * beta + n * gamma)


def _hierarchical(
    n: np.ndarray,
    p: int,
    alpha: float,
    beta: float,
    gamma: float,
    *,
    gpus_per_node: int,
    intra_beta: float,
    intra_alpha: float,
    nics_per_node: int,
) -> Any:
    # DESIGN.md, each phase a ring (Patarasuk & Yuan 2009); g rings share the node's cards.
    if p <= gpus_per_node:
        return _ring(n, p, intra_alpha, intra_beta, gamma)
    g, nodes = gpus_per_node, p // gpus_per_node
    sharing = g / min(nics_per_node, g)
    inside = 2 * (g - 1) * intra_alpha + (2 * (g - 1) / g) * n * intra_beta + ((g - 1) / g) * n * gamma
    return inside + _ring(n / g, nodes, alpha, beta * sharing, gamma)


def _ps_direction(n: np.ndarray, p: int, alpha: float, beta: float, k: int) -> Any:
    # seed 002, DESIGN.md: the busiest link in one direction, a server's or a worker's.
    return np.maximum(p * (alpha + n * beta / k), k * alpha + n * beta)


def _ps_occupancy(n: np.ndarray, p: int, alpha: float, beta: float, gamma: float, *, servers: int,
                  partition_bytes: int) -> Any:
    """The pushes of n bytes and the servers' sums: how long the exchange holds the links."""
    if p == 1:
        return 0.0 * n
    return _ps_direction(n, p, alpha, beta, servers) + (p - 1) * n * gamma / servers


def _ps_drain(n: np.ndarray, p: int, alpha: float, beta: float, gamma: float, *, servers: int,
              partition_bytes: int) -> Any:
    """The pull of the last partitions (one per server), after their last push is in."""
    if p == 1:
        return 0.0 * n
    return _ps_direction(np.minimum(n, servers * partition_bytes), p, alpha, beta, servers)


def _ps(n: np.ndarray, p: int, alpha: float, beta: float, gamma: float, **options: int) -> Any:
    return _ps_occupancy(n, p, alpha, beta, gamma, **options) + _ps_drain(n, p, alpha, beta, gamma, **options)


_FORMULAS = {
    "ring": _ring,
    "naive": _naive,
    "central": _central,
    "halving_doubling": _halving_doubling,
    "recursive_doubling": _recursive_doubling,
    "binomial_tree": _binomial_tree,
    "hierarchical": _hierarchical,
    "ps": _ps,
}


def _check_options(algorithm: str, p: int, options: dict[str, Any]) -> dict[str, Any]:
    """The algorithm's options, validated and with defaults filled in."""
    allowed = _OPTIONS.get(algorithm, ())
    for key in options:
        if key not in allowed:
            accepted = ", ".join(allowed) if allowed else "none"
            raise ValueError(f"option {key!r} does not apply to algorithm={algorithm!r} (accepted: {accepted})")
    if algorithm == "ps":
        return {"servers": _check_count("servers", options.get("servers", 1)),
                "partition_bytes": _check_count("partition_bytes", options.get("partition_bytes", PS_PARTITION_BYTES))}
    if algorithm == "hierarchical":
        if options.get("gpus_per_node") is None or options.get("intra_beta") is None:
            raise ValueError(
                "algorithm='hierarchical' needs gpus_per_node and intra_beta (intra_alpha and nics_per_node are optional)"
            )
        g = _check_count("gpus_per_node", options["gpus_per_node"])
        intra_alpha = options.get("intra_alpha", 0.0)
        _check_number("intra_alpha", intra_alpha)
        _check_number("intra_beta", options["intra_beta"])
        if p > g and p % g:
            raise ValueError(f"world_size={p} is not a multiple of gpus_per_node={g}")
        nics = _check_count("nics_per_node", options.get("nics_per_node", 1))
        return {"gpus_per_node": g, "intra_beta": options["intra_beta"], "intra_alpha": intra_alpha, "nics_per_node": nics}
    return {}


# --- the public entry points ---------------------------------------------------------------


def allreduce_time(
    nbytes: Any,
    world_size: int,
    algorithm: str = "ring",
    alpha: float = 0.0,
    beta: float | None = None,
    gamma: float = 0.0,
    **options: Any,
) -> Any:
    """Seconds for one allreduce of ``nbytes`` over ``world_size`` ranks with ``algorithm``.

    ``beta`` is required. ``options``: hierarchical takes gpus_per_node, intra_beta,
    intra_alpha (default 0) and nics_per_node (default 1); ps takes servers (default 1) and
    partition_bytes (default 4 MiB). ``nbytes`` may be a numpy array
    (the result is then one, element-wise).
    """
    return allreduce_cost(world_size, algorithm, alpha, beta, gamma, **options)(nbytes)


@dataclass(frozen=True)
class AllreduceCost:
    """``allreduce_time`` with everything but the size fixed and validated once: a cost for
    ``ringtrain.plan.merge`` (``merge(t, s, cost=allreduce_cost(64, beta=8e-10))``)."""

    world_size: int
    algorithm: str = "ring"
    alpha: float = 0.0
    beta: float | None = None
    gamma: float = 0.0
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.algorithm not in _FORMULAS:
            raise ValueError(f"algorithm={self.algorithm!r}: accepted values are {', '.join(ALGORITHMS)}")
        if self.beta is None:
            raise ValueError("beta (seconds per byte) is required; see ringtrain.sim.costs.NETWORKS")
        for name in ("alpha", "beta", "gamma"):
            _check_number(name, getattr(self, name))
        p = _check_world(self.world_size)
        checked = _check_options(self.algorithm, p, dict(self.options))
        object.__setattr__(self, "world_size", p)
        object.__setattr__(self, "options", tuple(sorted(checked.items())))

    def __call__(self, nbytes: Any) -> Any:
        return self._apply(_FORMULAS[self.algorithm], nbytes)

    def occupancy(self, nbytes: Any) -> Any:
        """How long one exchange of ``nbytes`` holds the network: the next exchange starts after
        it. The whole call for the allreduces; for ``ps`` the pushes and the servers' sums, the
        last partitions' pull (``drain``) then overlapping the next exchange's pushes."""
        return self._apply(_ps_occupancy if self.algorithm == "ps" else _FORMULAS[self.algorithm], nbytes)

    def drain(self, nbytes: Any) -> Any:
        """What an exchange of ``nbytes`` takes after its ``occupancy``: 0 for the allreduces, the
        pull of the last partitions for ``ps``. ``occupancy + drain`` is the call."""
        return self._apply(_ps_drain if self.algorithm == "ps" else _nothing, nbytes)

    def _apply(self, formula: Callable[..., Any], nbytes: Any) -> Any:
        n = _check_sizes(nbytes)
        options = dict(self.options) if self.options else {}
        return _result(n, formula(n, self.world_size, self.alpha, self.beta, self.gamma, **options))


def _nothing(n: np.ndarray, *args: Any, **options: Any) -> Any:
    return 0.0 * n


def allreduce_cost(
    world_size: int,
    algorithm: str = "ring",
    alpha: float = 0.0,
    beta: float | None = None,
    gamma: float = 0.0,
    **options: Any,
) -> AllreduceCost:
    """A ``cost(nbytes) -> seconds`` callable with everything but the size fixed."""
    return AllreduceCost(world_size, algorithm, alpha, beta, gamma, tuple(sorted(options.items())))


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth (nccl-tests): bytes / time, bytes per second."""
    if seconds <= 0:
        raise ValueError(f"seconds={seconds!r}; it must be > 0")
    return nbytes / seconds


def busbw(nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth of an allreduce (nccl-tests): algbw · 2(p-1)/p, bytes per second."""
    world_size = _check_world(world_size)
    return algbw(nbytes, seconds) * 2 * (world_size - 1) / world_size
