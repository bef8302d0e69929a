"""Gradient-merge planners: which consecutive layers share one allreduce.

Words used here:

- *layer*: one unit whose gradient becomes ready at once (a parameter, or a module's
  parameters). Layers are numbered in **backward order**: layer 0 is the one whose gradient is
  ready first (the output layer), layer n-1 the one ready last.
- *backward time* ``backward_times[i]``: the compute time of layer i's backward pass. Its
  *ready time* is ``ready[i] = backward_times[0] + ... + backward_times[i]``, counted from the
  start of backward.
- *group*: a contiguous run of layers ``(first, last)`` whose gradients travel in one
  allreduce. A *plan* is a list of groups in backward order that covers every layer once.
- *cost*: the time of one allreduce of b bytes, ``alpha + (beta + gamma) * b`` by default
  (start-up alpha seconds, beta seconds per byte moved, gamma seconds per byte reduced; a beta
  fitted from measurements already includes the reduction, so gamma is then 0), or any
  ``cost(nbytes) -> seconds`` given by the caller, e.g. a ring cost for a world size taken
  from :mod:`ringtrain.sim.costs`.
- *timing model*: communication is one stream. Group g starts at
  ``max(ready[last of g], end of group g-1)`` and ends ``cost(bytes of g)`` later. The
  plan's ``end_time`` is the end of its last allreduce. :func:`evaluate` is the only place
  this model is written down (its walk of the groups, ``_stream``, also gives
  :func:`end_times` for many slowdowns at once); every method builds a grouping and asks
  evaluate for its timing.
- *drain* (optional, ``drain(nbytes) -> seconds``): what an exchange takes after it leaves the
  stream, overlapping the next one: a parameter server's pull of the last partitions of a push
  (``ringtrain.sim.costs``, ``AllreduceCost.drain``; ``cost`` is then its occupancy of the
  stream). The drains run on a second stream (the links back to the workers): group g's starts
  once its push has ended and group g-1's drain is done, and ``ends`` holds each group's drain
  end, so the plan ends when the last drain does. A plan of a prefix then has two ends, its
  stream's and its drains'; the prefix program keeps, per prefix, every plan that no other
  beats in both (the whole plan's end is non-decreasing in each) and stays exact (with a
  per-message interference up to ``_DRAINED_COUNT_LIMIT`` layers; beyond, it plans without that
  term, which the timing still charges). ``comm_time`` counts overlapping exchanges once. Charging the
  last drain alone let a tiny last group hide a big one's pull: ``ringtrain simulate``'s
  servers came out up to 16% too fast with one server, 61% with four.
- *interference* (optional, :class:`Interference`): compute time that each allreduce launched
  while backward still runs takes from the rest of backward, ``per_message + per_byte * b``
  seconds. Where the transport shares cores with the computation (CPU training on a few cores),
  every launch costs a wake-up, copies and protocol work, and the layers after it become ready
  later: group g's layers are ready at ``ready + delay[g]``, ``delay[g]`` the sum of the
  interference of groups 0..g-1. The last group is launched when backward has ended and slows
  nothing. The other way round, ``comm_slowdown``: while backward runs an allreduce progresses
  ``1 + comm_slowdown`` times slower (its thread competes for the cores), after it at full
  speed. Backward's end here is the one known when the allreduce is launched: the last
  layer's ready time from compute alone, ``ready[-1]``, delayed by the launches up to and
  including this one (the last group, launched once backward is over, is not slowed). Later
  launches delay backward further, but they are not known yet, and leaving them out keeps the
  end a function of the group itself (its first and last layer, its count): an allreduce of
  cost c started at t ends at ``t + c + comm_slowdown * w``, ``w = min(c, max(0, B - t) /
  (1 + comm_slowdown))`` the part of its work done while backward runs (:func:`_end`), B that
  end. With B at ``ready[-1]`` for every group, wfbp on the CNN at 4 ranks / 10 Gbit/s (107
  allreduces, backward 35 ms longer from their launches) ran at full speed in the model while
  backward still ran, and was under-predicted by 14-20% in every set. The end is
  non-decreasing in t and c, which keeps the prefix program below exact. Without interference
  (the default) overlapped communication is free, as on a GPU with its own copy engines.

Methods (``METHODS``):

- ``optimal``: the exact optimum over all contiguous groupings, by the prefix dynamic program
  F[0] = 0, F[j] = min over i < j of max(ready[j-1], F[i]) + cost(bytes of layers i..j-1).
  It is exact because a group's end is non-decreasing in the previous group's end, so the best
  plan of a prefix extends to the best plan of the whole (DESIGN.md). Floating-point rounding
  is monotone too, so the optimum is exact in floats as well, not only in real numbers.
  O(n^2) arithmetic, vectorized over i with numpy: about 10 ms for 1,000 layers.
  With interference the delay of a group depends on the bytes before it (a function of i, so
  the same program stays exact) and on how many groups precede it; with a per-message cost the
  program runs once per group count g, F_g[j] = min over i < j of max(ready[j-1] + delay, F_{g-1}[i])
  + cost(bytes of layers i..j-1) (slowed while backward runs), delay = per_message *
  (g-1) + per_byte * bytes before i, and stops at the first g whose lower bounds (the last
  group after backward's delayed end; g allreduces on the stream) cannot beat the best plan
  found: exact, O(G n^2) time and O(n^2) memory. Beyond ~2,000 layers (``_COST_TABLE_LIMIT``
  candidate groups) it falls back to the one-pass program, which then charges per_message in
  the plan's timing but does not plan around it; the plan kept is then the best of that
  program's and the other methods' groupings (with a drain too, beyond its limit), so optimal
  is never behind them (the one-pass plan alone took 840 ms where single took 252, at 2,100
  layers and 1 ms per launch).
- ``mgwfbp``: the greedy rule of Shi, Chu and Li (MG-WFBP, IEEE TPDS 32(8), 2021), as in the
  authors' published code (HKBU-HPML/MG-WFBP, ``_generate_groups_mgwfbp``): walking layers in
  backward order, the open group (ending at layer k) is merged with layer k+1 when layer k+1
  is ready before the open group's allreduce would end, and either the allreduce could not
  have started before layer k+1 is ready anyway, or it would have started less than one
  start-up time (alpha) earlier. For a custom cost the start-up saving is
  cost(a) + cost(b) - cost(a + b), which is alpha for the linear cost.
- ``wfbp``: every layer alone (wait-free backpropagation).
- ``fixed``: a size threshold as torch DDP and Horovod use: layers are added to a bucket in
  backward order and the bucket closes once it holds at least ``bucket_cap_mb`` MiB.
  ``first_bucket_mb`` gives the first bucket its own cap (DDP's default is 1 MiB).
- ``single``: one allreduce of everything after the whole backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

METHODS = ("optimal", "mgwfbp", "wfbp", "fixed", "single")
MIB = 1024 * 1024
_COST_TABLE_LIMIT = 1 << 21  # candidate groups costed in one call (up to ~2,000 layers)
_COST_TABLE_LIMIT_LINEAR = 1 << 17  # the same for the linear cost (up to ~500 layers)
#: Layers up to which the program with a drain plans around a per-message cost (one pass per
#: group count, each a loop over the layers: 0.7 s at 200 layers, 37 s at 700).
_DRAINED_COUNT_LIMIT = 200
#: A new front is sorted out of more plans than 4 times this only after those that a sample
#: of them (this many, with every prefix's first and last) beats have been left out, bucket by
#: bucket of push ends (``_FRONT_BUCKETS``); a test sets it to 1 to take that path on few layers.
_FRONT_SAMPLE = 256
_FRONT_BUCKETS = 1024
#: Plans a prefix (on average) from which :func:`_candidates` looks for each prefix's run; with
#: fewer it extends them all (a zoo model's fronts hold a plan or two: the look-ups cost more).
_RUNS_FROM = 4

#: ``cost(nbytes) -> seconds``. Called with a float64 numpy array where it can take one
#: (the element-wise result is used), else once per element with a Python float.
CostFn = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class LinearCost:
    """The α–β(–γ) cost of one allreduce: ``alpha + (beta + gamma) * nbytes`` seconds."""

    alpha: float
    """Start-up time of one allreduce, seconds."""
    beta: float
    """Transfer time, seconds per byte."""
    gamma: float = 0.0
    """Reduction time, seconds per byte reduced."""

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            _check_scalar(name, getattr(self, name))

    @property
    def per_byte(self) -> float:
        """Seconds per byte of one allreduce, its transfer and its reduction: beta + gamma."""
        return self.beta + self.gamma

    def __call__(self, nbytes: Any) -> Any:
        return self.alpha + self.per_byte * nbytes

    def describe(self) -> str:
        return f"alpha={self.alpha:.3e} s, beta={self.per_byte:.3e} s/B"


@dataclass(frozen=True, slots=True)
class SplitCost:
    """Two linear costs split at a size: messages under ``split_bytes`` take ``small``, the rest
    ``large``. The cost of an allreduce whose algorithm changes with the size, as the
    communicator's ``auto`` does (``halving_doubling`` or ``naive`` under 64 KiB, ``ring`` from
    there): with one line through both, the LM's 54 gradients allreduced back to back at 4
    ranks / 10 Gbit/s took 50 ms against 35 ms predicted."""

    small: LinearCost
    large: LinearCost
    split_bytes: float

    def __post_init__(self) -> None:
        _check_positive("split_bytes", self.split_bytes)

    def __call__(self, nbytes: Any) -> Any:
        n = np.asarray(nbytes, dtype=np.float64)
        out = np.where(n < self.split_bytes, self.small(n), self.large(n))
        return float(out) if out.ndim == 0 else out

    @property
    def alpha(self) -> float:
        """The larger messages' start-up (what a log line calls alpha)."""
        return self.large.alpha

    @property
    def beta(self) -> float:
        """The larger messages' seconds per byte (their :attr:`LinearCost.per_byte`)."""
        return self.large.per_byte

    per_byte = beta

    def describe(self) -> str:
        return f"{self.small.describe()} under {self.split_bytes:.0f} B; {self.large.describe()} from there"


@dataclass(frozen=True, slots=True)
class Interference:
    """What overlapping costs where communication shares the computation's cores: an
    allreduce launched during backward takes ``per_message + per_byte * nbytes`` seconds from
    the rest of backward and itself runs ``1 + comm_slowdown`` times slower while backward
    runs (module docstring)."""

    per_message: float = 0.0
    """Seconds of backward lost per overlapped allreduce (wake-ups, hooks, protocol)."""
    per_byte: float = 0.0
    """Seconds of backward lost per overlapped byte (copies, kernel network work)."""
    comm_slowdown: float = 0.0
    """The other way round: while backward runs an allreduce progresses ``1 + comm_slowdown``
    times slower (its thread shares the cores with backward); after it, at full speed."""

    def __post_init__(self) -> None:
        for name in ("per_message", "per_byte", "comm_slowdown"):
            _check_scalar(name, getattr(self, name))

    @property
    def is_zero(self) -> bool:
        return self.per_message == 0.0 and self.per_byte == 0.0 and self.comm_slowdown == 0.0

    def to_dict(self) -> dict[str, float]:
        return {"per_message": self.per_message, "per_byte": self.per_byte, "comm_slowdown": self.comm_slowdown}


@dataclass(frozen=True, slots=True)
class Plan:
    """A grouping of layers and its predicted timing (all times from the start of backward)."""

    method: str
    """The method that made the grouping ("custom" for a grouping given to evaluate)."""
    groups: list[tuple[int, int]]
    """(first, last) layer indices of each group, contiguous, in backward order."""
    starts: list[float]
    """Start time of each group's allreduce, seconds."""
    ends: list[float]
    """End time of each group's allreduce, seconds (with a drain: the end of its drain)."""
    group_bytes: list[float]
    """Bytes of each group's allreduce."""
    ready: list[float]
    """Ready time of each layer's gradient, seconds (delayed by interference, if any)."""
    end_time: float
    """End of the last allreduce (0 for a model without layers), seconds."""
    tail: float = 0.0
    """Backward's compute after the last gradient is ready (layers without parameters nearest
    the input, which the grouping never waits for), seconds: backward ends that much later."""

    def __post_init__(self) -> None:
        if self.method not in METHODS + ("custom",):
            raise ValueError(f"method={self.method!r}: accepted values are {METHODS + ('custom',)}")
        count = len(self.groups)
        for name in ("starts", "ends", "group_bytes"):
            if len(getattr(self, name)) != count:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {count} groups")
        _check_groups(self.groups, len(self.ready))
        expected = self.ends[-1] if self.ends else 0.0
        if self.end_time != expected:
            raise ValueError(f"end_time={self.end_time} is not the last group's end {expected}")
        if not (math.isfinite(self.tail) and self.tail >= 0.0):
            raise ValueError(f"tail={self.tail!r} must be a finite number of seconds >= 0")


    @property
    def num_layers(self) -> int:
        return len(self.ready)

    @property
    def backward_time(self) -> float:
        """When backward ends: the ready time of the last layer (0 without layers), plus ``tail``."""
        return (self.ready[-1] if self.ready else 0.0) + self.tail

    @property
    def comm_time(self) -> float:
        """How long some group's allreduce is in progress: the sum of their times on one stream;
        with a drain, where a group's push overlaps the drains before it, that time once."""
        total, covered = 0.0, -math.inf
        for s, e in zip(self.starts, self.ends):
            total += max(0.0, e - max(s, covered))
            covered = max(covered, e)
        return float(total)

    @property
    def exposed_time(self) -> float:
        """Communication time left after backward ends (end_time - backward_time, or 0)."""
        return max(0.0, self.end_time - self.backward_time)

    @property
    def hidden_fraction(self) -> float:
        """Share of communication time that overlaps backward (1.0 when there is none)."""
        total = self.comm_time
        return 1.0 if total <= 0.0 else max(0.0, 1.0 - self.exposed_time / total)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (for ``--json`` output and logs)."""
        return {
            "method": self.method,
            "groups": [list(g) for g in self.groups],
            "starts": list(self.starts),
            "ends": list(self.ends),
            "group_bytes": [_whole(b) for b in self.group_bytes],
            "end_time": self.end_time,
            "tail": self.tail,
            "backward_time": self.backward_time,
            "comm_time": self.comm_time,
            "exposed_time": self.exposed_time,
            "hidden_fraction": self.hidden_fraction,
        }

    def describe(self, max_rows: int = 20) -> str:
        """A human-readable summary: totals, then one row per group (at most ``max_rows``)."""
        head = (
            f"{self.method} plan: {self.num_layers} layers in {len(self.groups)} groups; "
            f"backward ends {_ms(self.backward_time)}, last allreduce ends {_ms(self.end_time)} "
            f"(communication {_ms(self.comm_time)}, exposed {_ms(self.exposed_time)}, "
            f"{100.0 * self.hidden_fraction:.0f}% hidden)"
        )
        lines = [head]
        if self.groups:
            lines.append(f"  {'group':>5}  {'layers':>11}  {'MB':>10}  {'start ms':>10}  {'end ms':>10}")
        for g, ((first, last), nbytes, start, end) in enumerate(
            zip(self.groups, self.group_bytes, self.starts, self.ends)
        ):
            if g == max_rows:
                lines.append(f"  ... {len(self.groups) - max_rows} more groups")
                break
            lines.append(
                f"  {g:>5}  {f'{first}-{last}':>11}  {nbytes / 1e6:>10.3f}  "
                f"{start * 1e3:>10.3f}  {end * 1e3:>10.3f}"
            )
        return "\n".join(lines)


def evaluate(
    backward_times: Sequence[float],
    sizes_bytes: Sequence[float],
    groups: Sequence[tuple[int, int]],
    alpha: float | None = None,
    beta: float | None = None,
    gamma: float = 0.0,
    *,
    cost: CostFn | None = None,
    method: str = "custom",
    interference: Interference | None = None,
    drain: CostFn | None = None,
) -> Plan:
    """The timing of any grouping under the one-stream model (see the module docstring),
    with ``interference`` and the groups' ``drain`` charged if given.

    Give either ``alpha`` and ``beta`` (and optionally ``gamma``) or ``cost``.
    """
    times, sizes = _check_layers(backward_times, sizes_bytes)
    cost_fn = _resolve_cost(alpha, beta, gamma, cost)
    pairs = _group_pairs(groups)
    _check_groups(pairs, len(times))
    return _evaluate(times, sizes, pairs, cost_fn, method, _check_interference(interference), _check_drain(drain))


def merge(
    backward_times: Sequence[float],
    sizes_bytes: Sequence[float],
    alpha: float | None = None,
    beta: float | None = None,
    method: str = "optimal",
    bucket_cap_mb: float = 25.0,
    gamma: float = 0.0,
    *,
    cost: CostFn | None = None,
    first_bucket_mb: float | None = None,
    interference: Interference | None = None,
    planned_with: Interference | None = None,
    drain: CostFn | None = None,
    tail: float = 0.0,
) -> Plan:
    """Group the layers' gradients into allreduces with ``method`` (one of ``METHODS``).

    ``bucket_cap_mb`` and ``first_bucket_mb`` (MiB) are used by ``fixed`` only.
    ``interference`` is charged by every method's timing; only ``optimal`` plans around it
    (the other methods' rules are as their authors wrote them), or around ``planned_with``
    where that is given (e.g. ``Interference()``: the optimum of free overlap, timed with
    what overlapping really costs). ``drain``: see the module docstring (every method's timing
    and the optimum count it). ``tail``: backward's compute after the last gradient is ready
    (``Plan.tail``); ``optimal`` then minimizes the later of backward's end and the last
    allreduce's, which differ in what they favour where interference delays backward.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: accepted values are {', '.join(METHODS)}")
    _check_positive("bucket_cap_mb", bucket_cap_mb)
    if first_bucket_mb is not None:
        _check_positive("first_bucket_mb", first_bucket_mb)
    times, sizes = _check_layers(backward_times, sizes_bytes)
    cost_fn = _resolve_cost(alpha, beta, gamma, cost)
    slow = _check_interference(interference)
    planning = slow if planned_with is None else _check_interference(planned_with)
    _check_drain(drain)
    _check_scalar("tail", tail)
    n = len(times)
    ready = np.cumsum(times)
    if method == "optimal":
        counted = planning.per_message > 0.0 and n * (n + 1) // 2 <= _COST_TABLE_LIMIT
        if drain is not None:
            counted = planning.per_message > 0.0 and n <= _DRAINED_COUNT_LIMIT
            groups = _optimal_groups_drained(ready, sizes, cost_fn, planning, drain, counted, tail)
        elif counted:
            groups = _optimal_groups_counted(ready, sizes, cost_fn, planning, tail)
        else:
            groups = _optimal_groups(ready, sizes, cost_fn, planning, tail)
        if planning.per_message > 0.0 and not counted:  # (planned without the per-message cost)
            groups = _best_grouping(times, sizes, cost_fn, planning, drain, tail, [
                groups, _mgwfbp_groups(ready, sizes, cost_fn), [(k, k) for k in range(n)],
                _fixed_groups(sizes, bucket_cap_mb, first_bucket_mb), [(0, n - 1)] if n else []])
    elif method == "mgwfbp":
        groups = _mgwfbp_groups(ready, sizes, cost_fn)
    elif method == "wfbp":
        groups = [(k, k) for k in range(n)]
    elif method == "fixed":
        groups = _fixed_groups(sizes, bucket_cap_mb, first_bucket_mb)
    else:  # single
        groups = [(0, n - 1)] if n else []
    return _evaluate(times, sizes, groups, cost_fn, method, slow, drain, tail)


# --- the methods -------------------------------------------------------------------------


def _optimal_groups(ready: np.ndarray, sizes: np.ndarray, cost: CostFn,
                    slow: Interference | None = None, tail: float = 0.0) -> list[tuple[int, int]]:
    """Prefix DP: best[j] = earliest end of an allreduce plan for layers 0..j-1 (a per-byte
    interference delays a group's layers by per_byte * the bytes before it: a function of i;
    comm_slowdown makes the end a non-decreasing function of the start, :func:`_end`).
    A per-message interference is not planned for here. The last group is picked by
    :func:`_last_group` (backward's ``tail``)."""
    slow = slow or NO_INTERFERENCE
    n = len(sizes)
    prefix = _prefix(sizes)
    delay = slow.per_byte * prefix  # the same expression as _evaluate's
    end0 = float(ready[-1]) if n else 0.0
    best = np.zeros(n + 1)
    split = np.zeros(n + 1, dtype=np.int64)  # the last group of best[j] is split[j]..j-1
    # The cost of every candidate group, row j holding the groups i..j-1 for i < j, in one call
    # of the cost function when the triangle is small enough (a user cost may be slow per
    # call; the linear cost is cheap per call, and building the table costs time too).
    limit = _COST_TABLE_LIMIT_LINEAR if isinstance(cost, LinearCost) else _COST_TABLE_LIMIT
    table = None
    if n * (n + 1) // 2 <= limit:
        rows, cols = np.tril_indices(n + 1, -1)
        table = _cost_array(cost, prefix[rows] - prefix[cols])
    for j in range(1, n + 1):
        if table is None:
            costs = _cost_array(cost, prefix[j] - prefix[:j])
        else:
            costs = table[j * (j - 1) // 2 : j * (j + 1) // 2]
        # Same operations, in the same order, as _evaluate, so the plan's end is best[n] exactly.
        # Slowed until backward's end as known at the launch (module docstring): the delays of
        # the launches up to this one's, or, for the last group, up to the one before it.
        until = end0 + delay[j] if j < n else end0 + delay[:j]
        ends = _end(np.maximum(ready[j - 1] + delay[:j], best[:j]), costs, until, slow.comm_slowdown)
        i = int(np.argmin(ends)) if j < n else _last_group(ends, end0 + delay[:j], tail)
        best[j] = ends[i]
        split[j] = i
    groups = []
    j = n
    while j > 0:
        groups.append((int(split[j]), j - 1))
        j = int(split[j])
    return groups[::-1]


def _optimal_groups_counted(ready: np.ndarray, sizes: np.ndarray, cost: CostFn,
                            slow: Interference, tail: float = 0.0) -> list[tuple[int, int]]:
    """The prefix DP once per group count (a per-message interference; module docstring); the
    whole plan's by :func:`_last_group`."""
    n = len(sizes)
    if n == 0:
        return []
    prefix = _prefix(sizes)
    rows, cols = np.tril_indices(n + 1, -1)  # candidate group cols..rows-1, row-major: row j is contiguous
    costs = _cost_array(cost, prefix[rows] - prefix[cols])
    cheapest = float(costs.min())
    js = np.arange(1, n + 1)
    row_start = js * (js - 1) // 2  # offset of row j's first candidate, j = 1..n
    ready_rows = ready[rows - 1]
    bytes_delay = slow.per_byte * prefix[cols]
    bytes_after = slow.per_byte * prefix[rows]  # the bytes up to the end of the candidate group
    end0 = float(ready[-1])
    last_row = slice(int(row_start[-1]), len(rows))  # the candidates i..n-1 for the last group
    prev = np.full(n + 1, np.inf)
    prev[0] = 0.0  # zero groups cover the empty prefix
    splits: list[np.ndarray] = []
    best_end, best_count = np.inf, 0
    g = 1
    while g <= n:
        # Same expression as _evaluate: ready + (per_message * groups before + per_byte * bytes before).
        delay = slow.per_message * (g - 1) + bytes_delay
        # Slowed until backward's end as known at the launch (_evaluate's expressions).
        until = np.where(rows < n, end0 + (slow.per_message * g + bytes_after), end0 + delay)
        ends = _end(np.maximum(ready_rows + delay, prev[cols]), costs, until, slow.comm_slowdown)
        cur = np.full(n + 1, np.inf)
        cur[1:] = np.minimum.reduceat(ends, row_start)
        # The first i reaching the row's minimum (as the 1-D program's argmin).
        first_hit = np.full(n + 1, -1, dtype=np.int64)
        first_hit[1:] = np.minimum.reduceat(np.where(ends == cur[rows], cols, n + 1), row_start)
        if tail:  # (the whole plan: the later of its end and backward's)
            k = _last_group(ends[last_row], end0 + delay[last_row], tail)
            cur[n], first_hit[n] = max(ends[last_row][k], end0 + delay[last_row][k] + tail), cols[last_row][k]
        splits.append(first_hit)
        if cur[n] < best_end:
            best_end, best_count = float(cur[n]), g
        prev = cur
        g += 1
        # Lower bounds on the end of any plan with g or more groups (they grow with g). Its last
        # group, layers i..n-1, starts no earlier than backward's end delayed by g-1 launches and
        # the bytes before i: the DP's own float expression without the max, so no larger than
        # any such plan's end in floats too (it starts after ready[n-1]: nothing slows it). And
        # the stream carries g allreduces (in exact arithmetic; a margin of 1e-9 covers the
        # rounding of the sum).
        last = np.min(ready[-1] + (slow.per_message * (g - 1) + bytes_delay[last_row]) + costs[last_row])
        chain = g * cost.alpha + cost.per_byte * prefix[n] if isinstance(cost, LinearCost) else g * cheapest
        if max(last, chain * (1.0 - 1e-9)) >= best_end:
            break
    groups = []
    j = n
    for g in range(best_count, 0, -1):
        i = int(splits[g - 1][j])
        groups.append((i, j - 1))
        j = i
    return groups[::-1]


def _optimal_groups_drained(ready: np.ndarray, sizes: np.ndarray, cost: CostFn, slow: Interference,
                            drain: CostFn, counted: bool, tail: float = 0.0) -> list[tuple[int, int]]:
    """The prefix program with a drain (module docstring): a plan of a prefix has two ends, its
    last push's and its last pull's, and the whole plan's end is non-decreasing in both, so a
    prefix keeps every plan that no other of it beats in both (a Pareto front): exact. The front
    holds one plan per prefix or a few with the simulator's server costs (10-20 where pulls are
    slower than pushes), but can grow with the layers where a drain's start-up dominates (290
    per prefix at 300 equal layers, the program then about cubic). So a group extends only the
    plans of a prefix that can make a new front's plan (:func:`_candidates`), and the new front
    is sorted out of those the others do not plainly beat (:func:`_front`): the same fronts,
    kept plans and groups (1,000 like layers on 256 GPUs and 2 servers: ~3 s, 12-17 s when every
    plan was extended). Interference as in the other
    programs: ``counted`` (a per-message cost, up to ``_DRAINED_COUNT_LIMIT`` layers), one pass per group
    count (a plan of g groups extends the fronts of g - 1) until the lower bounds of
    :func:`_optimal_groups_counted`, the last group's drain added, cannot beat the best; else one
    pass that plans without the per-message cost (charged by the timing). The whole plan's by
    :func:`_last_group`."""
    n = len(sizes)
    if n == 0:
        return []
    prefix = _prefix(sizes)
    bytes_delay = slow.per_byte * prefix  # the same expressions as _evaluate's
    end0 = float(ready[-1])
    table = drain_table = None
    if counted:  # every candidate group's cost and drain, once for every pass (row j: the groups i..j-1)
        rows, cols = np.tril_indices(n + 1, -1)
        nbytes = prefix[rows] - prefix[cols]
        table, drain_table = _cost_array(cost, nbytes), _cost_array(drain, nbytes)
        cheapest = float(table.min())
    # The plans kept by one pass, all prefixes together in order of prefix: push end, pull end,
    # the prefix covered, the first layer of the last group, the plan extended (an index into
    # the pass before; a pass without counts extends its own plans).
    root = dict(push=np.zeros(1), pull=np.zeros(1), covers=np.zeros(1, dtype=np.int64),
                first=np.zeros(1, dtype=np.int64), parent=np.full(1, -1, dtype=np.int64))
    passes = [_Columns(root, keep=True)]
    best_end, best_pass, best_index = np.inf, 0, 0
    g = 1  # the count of groups of the plans this pass makes (every count at once without per_message)
    while True:
        before = passes[-1]
        made = _Columns(root, keep=not counted)
        delay_messages = slow.per_message * (g - 1)
        for j in range(1, n + 1):
            # The plans extended: of g - 1 groups (counted), else every plan kept so far.
            plans = before if counted else made
            nbytes = prefix[j] - prefix[:j]
            if table is None:
                costs, drains = _cost_array(cost, nbytes), _cost_array(drain, nbytes)
            else:
                row = slice(j * (j - 1) // 2, j * (j + 1) // 2)
                costs, drains = table[row], drain_table[row]
            delay = delay_messages + bytes_delay[:j]
            # Slowed until backward's end as known at the launch (_evaluate's expressions).
            until = end0 + (slow.per_message * g + bytes_delay[j]) if j < n else end0 + delay
            index, i, start, until = _candidates(plans, ready[j - 1] + delay, costs, drains, until, slow.comm_slowdown,
                                                    across=not (j == n and tail))
            if not len(index):
                continue
            e = _end(np.maximum(start, plans["push"][index]), costs[i], until, slow.comm_slowdown)
            q = np.maximum(plans["pull"][index], e) + drains[i]
            if j == n and tail:  # plans of the whole: the best by the later of its end and backward's
                kept = np.array([_last_group(q, end0 + delay[i], tail)])
            else:
                kept = _front(e, q, i)
            e, q = e[kept], q[kept]
            made.append(push=e, pull=q, covers=np.full(len(kept), j), first=i[kept], parent=index[kept])
        this = made
        passes.append(this)
        whole = np.flatnonzero(this["covers"] == n)
        if len(whole):
            backward = end0 + (delay_messages + bytes_delay[this["first"][whole]])  # (its last group's delay)
            pick = _last_group(this["pull"][whole], backward, tail)
            k = int(whole[pick])
            end = max(float(this["pull"][k]), float(backward[pick]) + tail)
            if end < best_end:
                best_end, best_pass, best_index = end, len(passes) - 1, k
        if not counted or g == n:
            break
        g += 1
        # Lower bounds on the end of any plan of g or more groups (they grow with g): its last
        # group's push and pull, after backward's end delayed by g - 1 launches and the bytes
        # before it; the g pushes on their stream (a margin of 1e-9 for the rounding of the sum).
        row = slice(n * (n - 1) // 2, n * (n + 1) // 2)  # the groups i..n-1
        last = np.min(ready[-1] + (slow.per_message * (g - 1) + bytes_delay[:n]) + table[row] + drain_table[row])
        chain = g * cost.alpha + cost.per_byte * prefix[n] if isinstance(cost, LinearCost) else g * cheapest
        if max(last, chain * (1.0 - 1e-9)) >= best_end:
            break
    # Back from the best plan of the whole, pass by pass (or within the one pass).
    groups = []
    p, index = best_pass, best_index
    while passes[p]["covers"][index] > 0:
        plan = passes[p]
        groups.append((int(plan["first"][index]), int(plan["covers"][index]) - 1))
        index = int(plan["parent"][index])
        if counted:
            p -= 1
    return groups[::-1]


def _front(push: np.ndarray, pull: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """The indices of the plans no other beats in both ends, in order of push end: by push end,
    then pull end (the first of equals), kept where the pull end is a new low. Many plans, few
    kept: first left out, unsorted, those that a sample's plan beats (its push no later, its pull
    earlier; the sample: every run's first and last plans and a stride), each plan compared with
    the sample's plans that push by the lower edge of its bucket of push ends."""
    if len(push) <= 4 * _FRONT_SAMPLE:
        return _new_lows(np.lexsort((pull, push)), pull)
    alive = np.arange(len(push))
    top = float(push.max())
    if math.isfinite(top):
        sampled = np.zeros(len(push), dtype=bool)
        sampled[::len(push) // _FRONT_SAMPLE] = True
        sampled[1:] |= runs[1:] != runs[:-1]  # (every run's first)
        sampled[:-1] |= runs[1:] != runs[:-1]  # (and last)
        sampled[-1] = True
        sample = np.flatnonzero(sampled)
        order = np.argsort(push[sample], kind="stable")
        sample_push, sample_low = push[sample][order], np.minimum.accumulate(pull[sample][order])
        low, width = float(sample_push[0]), (top - float(sample_push[0])) / _FRONT_BUCKETS
        if width > 0.0:
            edge = low + width * np.arange(_FRONT_BUCKETS + 1)
            bucket = np.clip((push - low) * (1.0 / width), 0.0, _FRONT_BUCKETS).astype(np.int64)
            bucket -= edge[bucket] > push  # (-1: below the first edge)
            at = np.searchsorted(sample_push, edge, "right") - 1
            lows = np.full(_FRONT_BUCKETS + 2, np.inf)  # (the last: for -1)
            lows[:-1] = np.where(at >= 0, sample_low[np.maximum(at, 0)], np.inf)
            alive = np.flatnonzero((edge[bucket] > push) | ~(lows[bucket] < pull))
    return _new_lows(alive[np.lexsort((pull[alive], push[alive]))], pull)


def _new_lows(order: np.ndarray, pull: np.ndarray) -> np.ndarray:
    """The plans of ``order`` (by push end, then pull end) whose pull end is a new low."""
    pulls = pull[order]
    new_low = np.ones(len(order), dtype=bool)
    new_low[1:] = pulls[1:] < np.minimum.accumulate(pulls)[:-1]
    return order[new_low]


def _candidates(plans: _Columns, starts: np.ndarray, costs: np.ndarray, drains: np.ndarray, until: Any,
                comm_slowdown: float, across: bool):
    """The plans of :func:`_optimal_groups_drained` that can make a new front's plan when a group
    i..j-1 extends them, for every i < j at once (``starts``, ``costs``: the group's earliest start
    and its cost, by i; ``until``: backward's end, a float or by i). ``plans`` holds each prefix's
    front in a run of its own (in order of prefix), push ends rising and pull ends falling. Of a
    prefix's plans whose push has ended by the start, the group's push ends at the same time
    whichever it extends: only the last of them (the earliest pull end) is kept. Past it, once a
    plan's pull has ended by the group's push end, the plans after it push later and pull no
    earlier than it: the run stops there (found by the gap between the two ends, a margin of 1e-9
    for the rounding, and checked with the program's own expressions; not with a
    ``comm_slowdown``, whose push end is non-decreasing in the push before it in real numbers
    only). Every plan left out is beaten or equalled in both ends by one kept, and an equal one
    is kept where it comes first: the same fronts and plans. Returns the plans' indices, each
    one's prefix, and the group's start and ``until`` for each."""
    covers = plans["covers"]
    if len(covers) <= _RUNS_FROM * len(starts):  # few plans a prefix: every one (fewer calls)
        upto = int(np.searchsorted(covers, len(starts)))
        i = covers[:upto]
        return np.arange(upto), i, starts[i], until[i] if isinstance(until, np.ndarray) else until
    prefixes = np.arange(len(starts))
    lo, hi = np.searchsorted(covers, prefixes, "left"), np.searchsorted(covers, prefixes, "right")
    has = lo < hi
    prefixes, lo, hi, starts, costs, drains = prefixes[has], lo[has], hi[has], starts[has], costs[has], drains[has]
    if isinstance(until, np.ndarray):
        until = until[has]
    first = np.maximum(np.searchsorted(plans["by_push"], prefixes + 1j * starts, "right") - 1, lo)
    # (of those, the first whose pull has ended by then: the same plan where several are)
    pushed = _end(starts, costs, until, comm_slowdown)
    first = np.maximum(np.minimum(np.searchsorted(plans["by_pull"], prefixes - 1j * pushed, "left"), first), lo)
    if comm_slowdown:  # (in floats its push end can fall by an ulp as the push before it ends later)
        return _runs(first, hi, prefixes, starts, until)
    guess = np.searchsorted(plans["by_gap"], prefixes - 1j * (costs * (1.0 - 1e-9)), "left")
    stop = np.minimum(np.maximum(guess, first), hi - 1)  # the last plan extended, found below

    def done(k: np.ndarray, where: np.ndarray) -> np.ndarray:  # the pull ends by the new push's end
        pushed = _end(np.maximum(starts[where], plans["push"][k]), costs[where],
                      until[where] if isinstance(until, np.ndarray) else until, comm_slowdown)
        return plans["pull"][k] <= pushed

    ahead = np.arange(len(stop))
    while len(ahead):  # forward to a plan whose pull has ended (else the run's last)
        ahead = ahead[(stop[ahead] < hi[ahead] - 1) & ~done(stop[ahead], ahead)]
        stop[ahead] += 1
    back = np.arange(len(stop))
    while len(back):  # back to the first such plan (the margin may have passed it)
        back = back[stop[back] > first[back]]
        back = back[done(stop[back] - 1, back)]
        stop[back] -= 1
    stop += 1
    # A prefix's run, extended, pushes later and pulls earlier plan by plan up to its last but
    # one (the last, whose pull has ended, may pull later): where another's first or last plan,
    # extended, pushes no later than the run's first and pulls earlier than its last two, it
    # beats every plan of the run. Left out (``across``: not where backward's tail picks the
    # whole plan); a run left out is beaten by a plan of a run kept (follow the beating plans:
    # their pulls fall).
    m, twice = len(first), np.arange(2 * len(first)) % len(first)
    ends = np.concatenate((first, stop - 1))

    def extended(k: np.ndarray, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # push and pull ends
        pushed = _end(np.maximum(starts[at], plans["push"][k]), costs[at],
                      until[at] if isinstance(until, np.ndarray) else until, comm_slowdown)
        return pushed, np.maximum(plans["pull"][k], pushed) + drains[at]

    pushes, pulls = extended(ends, twice)
    order = np.argsort(pushes, kind="stable")
    lows = np.minimum.accumulate(pulls[order])
    at = np.searchsorted(pushes[order], pushes[:m], "right") - 1  # (its own first plan at least)
    beaten = lows[at] < np.minimum(pulls[m:], extended(np.maximum(stop - 2, first), twice[:m])[1])
    keep = ~beaten if across else np.ones(m, dtype=bool)
    return _runs(first[keep], stop[keep], prefixes[keep], starts[keep],
                 until[keep] if isinstance(until, np.ndarray) else until)


def _runs(first: np.ndarray, stop: np.ndarray, prefixes: np.ndarray, starts: np.ndarray, until: Any):
    """:func:`_candidates`' answer: the plans first..stop-1 of each run, and by plan its prefix,
    start and ``until``."""
    counts = stop - first
    which = np.repeat(np.arange(len(first)), counts)
    index = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(len(which))
    return index, prefixes[which], starts[which], until[which] if isinstance(until, np.ndarray) else until


class _Columns:
    """The plans one pass of :func:`_optimal_groups_drained` keeps, column by column, appended in
    place (capacity doubled as needed), so that the plans kept so far are a view, not a
    concatenation of every prefix's arrays at every prefix: that made the pass without counts
    quadratic in Python calls (3,000 layers: 2.2 s of 3.9 s in ``np.concatenate``)."""

    __slots__ = ("cols", "size", "keys", "keyed")

    def __init__(self, root: dict, keep: bool):
        self.size = len(root["push"]) if keep else 0
        self.cols = {key: np.concatenate((value[:self.size], np.empty(16, dtype=value.dtype)))
                     for key, value in root.items()}
        self.keys: dict[str, np.ndarray] = {}  # the lookup keys of _KEYS, of the first `keyed` plans
        self.keyed = 0

    def append(self, **values: np.ndarray) -> None:
        n, end = len(values["push"]), self.size + len(values["push"])
        for key, value in values.items():
            col = self.cols[key]
            if end > len(col):
                col = self.cols[key] = np.concatenate((col[:self.size], np.empty(2 * end, dtype=col.dtype)))
            col[self.size:end] = value
        self.size += n

    def view(self, key: str) -> np.ndarray:
        return self.cols[key][:self.size]

    def __getitem__(self, key: str) -> np.ndarray:
        """A column, or one of ``_KEYS``: made for the plans appended since it was last asked for
        (only large fronts are looked up by them, :func:`_candidates`)."""
        if key in self.cols:
            return self.view(key)
        if self.keyed < self.size:
            done, rows = self.keyed, slice(self.keyed, self.size)
            covers, push, pull = self.cols["covers"][rows], self.cols["push"][rows], self.cols["pull"][rows]
            for name, make in _KEYS.items():
                col = self.keys.get(name)
                if col is None or len(col) < self.size:
                    grown = np.empty(2 * self.size, dtype=complex)
                    if col is not None:
                        grown[:done] = col[:done]
                    col = self.keys[name] = grown
                col[rows] = make(covers, push, pull)
            self.keyed = self.size
        return self.keys[key][:self.size]


#: The columns :func:`_candidates` searches, each prefix's run in order (numpy orders complex
#: numbers by real part, then imaginary): by push end (rising), by pull end (falling), by the
#: push end less the pull end (rising).
_KEYS: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {
    "by_push": lambda covers, push, pull: covers + 1j * push,
    "by_pull": lambda covers, push, pull: covers - 1j * pull,
    "by_gap": lambda covers, push, pull: covers + 1j * (push - pull),
}


def _last_group(ends: np.ndarray, backward: np.ndarray, tail: float) -> int:
    """The index of the best candidate for a plan's last group, given each candidate's plan end
    and backward's end before ``tail`` (its launches' delays): the earliest end without a tail;
    with one, the earliest of the later of the two, ties to the earliest end. (Without a
    tail backward ends before the last group starts; with one, backward's compute after the
    last gradient can outlast the allreduces, and a plan that delays it less is faster.)"""
    if not tail:
        return int(np.argmin(ends))
    whole = np.maximum(ends, backward + tail)
    ties = np.flatnonzero(whole == whole.min())
    return int(ties[np.argmin(ends[ties])])


def _best_grouping(times: np.ndarray, sizes: np.ndarray, cost: CostFn, slow: Interference, drain: CostFn | None,
                   tail: float, candidates: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """The candidate grouping whose plan ends first (the later of its last exchange and
    backward's end), the first of equals: where a program plans without the per-message cost,
    its plan against the other methods' (each timed with every cost), so that ``optimal``
    is never behind one of them."""
    def whole(groups: list[tuple[int, int]]) -> float:
        plan = _evaluate(times, sizes, groups, cost, "custom", slow, drain, tail)
        return max(plan.end_time, plan.backward_time)

    return min(candidates, key=whole)


def _mgwfbp_groups(ready: np.ndarray, sizes: np.ndarray, cost: CostFn) -> list[tuple[int, int]]:
    """MG-WFBP's greedy pass (see the module docstring for the rule and its source)."""
    n = len(sizes)
    groups: list[tuple[int, int]] = []
    prefix = _prefix(sizes)
    first = 0
    prev_end = 0.0  # end of the last closed group's allreduce
    for k in range(n - 1):
        # costs of the open group (layers first..k), of layer k+1 alone, and of both together
        open_bytes, together = prefix[k + 1] - prefix[first], prefix[k + 2] - prefix[first]
        c_open, c_next, c_both = _cost_array(cost, np.array([open_bytes, sizes[k + 1], together]))
        saving = cost.alpha if isinstance(cost, LinearCost) else float(c_open + c_next - c_both)
        start = max(float(ready[k]), prev_end)
        end = start + float(c_open)
        next_ready = float(ready[k + 1])
        merged = next_ready < end and (start > next_ready or next_ready - start < saving)
        if not merged:
            groups.append((first, k))
            prev_end = end
            first = k + 1
    if n:
        groups.append((first, n - 1))
    return groups


def _fixed_groups(
    sizes: np.ndarray, bucket_cap_mb: float, first_bucket_mb: float | None
) -> list[tuple[int, int]]:
    """Close a bucket once it holds at least the cap (torch DDP's and Horovod's rule)."""
    cap = bucket_cap_mb * MIB
    limit = cap if first_bucket_mb is None else first_bucket_mb * MIB
    groups: list[tuple[int, int]] = []
    first, held = 0, 0.0
    for k, size in enumerate(sizes):
        held += float(size)
        if held >= limit:
            groups.append((first, k))
            first, held, limit = k + 1, 0.0, cap
    if first < len(sizes):
        groups.append((first, len(sizes) - 1))
    return groups


# --- the timing model --------------------------------------------------------------------


def _evaluate(
    times: np.ndarray, sizes: np.ndarray, groups: list[tuple[int, int]], cost: CostFn, method: str,
    slow: Interference | None = None, drain: CostFn | None = None, tail: float = 0.0,
) -> Plan:
    slow = slow or NO_INTERFERENCE
    ready = np.cumsum(times)
    prefix = _prefix(sizes)
    firsts = np.array([g[0] for g in groups], dtype=np.int64)
    lasts = np.array([g[1] for g in groups], dtype=np.int64)
    nbytes = prefix[lasts + 1] - prefix[firsts]
    costs = _cost_array(cost, nbytes)
    drains = None if drain is None else _cost_array(drain, nbytes)
    starts, ends = [], []
    pull_end = 0.0
    for g, start, push_end in _stream(ready, prefix, firsts, lasts, costs, slow, slow.comm_slowdown):
        end = push_end
        if drains is not None:  # the pulls' stream (the drained program's expressions)
            pull_end = end = max(pull_end, push_end) + drains[g]
        starts.append(float(start))
        ends.append(float(end))
    return Plan(
        method=method,
        groups=[(int(a), int(b)) for a, b in groups],
        starts=starts,
        ends=ends,
        group_bytes=[float(b) for b in nbytes],
        ready=[float(r) for r in ready],
        end_time=ends[-1] if ends else 0.0,
        tail=float(tail),
    )


def _stream(ready: np.ndarray, prefix: np.ndarray, firsts: np.ndarray, lasts: np.ndarray, costs: np.ndarray,
            slow: Interference, comm_slowdown):
    """Each group's ``(g, start, end)`` on the one stream (the module docstring's model), with
    ``slow``'s launch delays added to ``ready`` in place and ``comm_slowdown`` (a float, or an
    array: then starts and ends are arrays, one value per slowdown, with the same float
    operations element by element)."""
    prev_end = 0.0
    end0 = float(ready[-1]) if len(ready) else 0.0  # backward's end from compute alone
    last_group = len(firsts) - 1
    later = np.maximum if isinstance(comm_slowdown, np.ndarray) else max  # (the builtin: faster on scalars)
    for g, (first, last) in enumerate(zip(firsts, lasts)):
        if not slow.is_zero:  # the interference of groups 0..g-1 (module docstring)
            ready[first:last + 1] += slow.per_message * g + slow.per_byte * prefix[first]
        start = later(ready[last], prev_end)
        # Backward's end as known at this launch: delayed by the launches up to this one (the
        # last group, launched after backward, by those before it: it is not slowed).
        if g < last_group:
            until = end0 + (slow.per_message * (g + 1) + slow.per_byte * prefix[last + 1])
        else:
            until = end0 + (slow.per_message * g + slow.per_byte * prefix[first])
        prev_end = _end(start, costs[g], until, comm_slowdown)
        yield g, start, prev_end


def end_times(backward_times: Sequence[float], sizes_bytes: Sequence[float], groups: Sequence[tuple[int, int]],
              comm_slowdowns: Sequence[float], *, cost: CostFn, interference: Interference | None = None) -> np.ndarray:
    """``evaluate(...).end_time`` of ``groups`` for every ``comm_slowdown`` in
    ``comm_slowdowns`` (``interference``'s own ignored), bit for bit, in one walk of the groups
    (a fit over a grid of slowdowns: :func:`ringtrain.ddp.calibration.fit_comm_slowdown`)."""
    times, sizes = _check_layers(backward_times, sizes_bytes)
    pairs = _group_pairs(groups)
    _check_groups(pairs, len(times))
    slowdowns = np.array([_float_or_inf(s) for s in comm_slowdowns], dtype=np.float64)
    if not (np.all(np.isfinite(slowdowns)) and np.all(slowdowns >= 0.0)):
        raise ValueError(f"comm_slowdowns must be finite and >= 0, got {list(comm_slowdowns)!r}")
    given = _check_interference(interference)
    slow = Interference(given.per_message, given.per_byte)  # (the slowdowns are the array's)
    ready, prefix = np.cumsum(times), _prefix(sizes)
    firsts = np.array([g[0] for g in pairs], dtype=np.int64)
    lasts = np.array([g[1] for g in pairs], dtype=np.int64)
    costs = _cost_array(cost, prefix[lasts + 1] - prefix[firsts])
    end = np.zeros(len(slowdowns))
    for _, _, end in _stream(ready, prefix, firsts, lasts, costs, slow, slowdowns):
        pass
    return np.broadcast_to(end, slowdowns.shape).astype(np.float64)


def _end(start, cost, backward_end, comm_slowdown: float):
    """End of an allreduce of ``cost`` started at ``start``: ``comm_slowdown`` times slower until
    ``backward_end``, full speed after (module docstring). Scalars or arrays, the same float
    operations either way (the planner's program and _evaluate must agree to the bit)."""
    if not isinstance(comm_slowdown, np.ndarray) and not comm_slowdown:
        return start + cost
    during = np.minimum(cost, np.maximum(backward_end - start, 0.0) / (1.0 + comm_slowdown))
    return start + cost + comm_slowdown * during


def _prefix(sizes: np.ndarray) -> np.ndarray:
    """prefix[j] = bytes of layers 0..j-1 (one definition, shared by every method)."""
    return np.concatenate(([0.0], np.cumsum(sizes)))


def _cost_array(cost: CostFn, nbytes: np.ndarray) -> np.ndarray:
    """cost applied element-wise to a float64 array; checked to be finite and non-negative."""
    try:
        raw = np.asarray(cost(nbytes))
        out = raw.astype(np.float64) if raw.dtype.kind in "iuf" else None  # ('1', True, None: per element)
    except (TypeError, ValueError):
        out = None
    if out is None or out.shape != nbytes.shape:
        out = np.array([_seconds_of(cost, float(b)) for b in nbytes], dtype=np.float64)
    if out.size and not (np.all(np.isfinite(out)) and np.all(out >= 0.0)):
        bad = int(np.flatnonzero(~(np.isfinite(out) & (out >= 0.0)))[0])
        raise ValueError(f"the cost of an allreduce of {float(nbytes[bad]):.0f} bytes came out {float(out[bad])!r} "
                         f"seconds ({cost!r}); it must be finite and >= 0: are the cost's numbers (alpha, beta, "
                         "gamma) or the sizes out of any real range?")
    return out


def _seconds_of(cost: CostFn, nbytes: float) -> float:
    """``cost(nbytes)`` as a float, or a ValueError naming the size and what came out (None, a
    list, a string: a TypeError from float() before, or the string's number)."""
    value = cost(nbytes)
    if not isinstance(value, (str, bytes, bool, np.bool_)):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"the cost of an allreduce of {nbytes:.0f} bytes came out {value!r} ({cost!r}); it must be a "
                     "number of seconds")


# --- validation --------------------------------------------------------------------------


def _resolve_cost(alpha: float | None, beta: float | None, gamma: float, cost: CostFn | None) -> CostFn:
    if cost is not None:
        if alpha is not None or beta is not None:
            raise ValueError("give either alpha and beta or cost=, not both")
        if not callable(cost):
            raise ValueError(f"cost must be a callable nbytes -> seconds, got {cost!r}")
        return cost
    if alpha is None or beta is None:
        raise ValueError("alpha and beta are required (or give cost=)")
    return LinearCost(alpha, beta, gamma)


def _check_drain(drain: CostFn | None) -> CostFn | None:
    if drain is not None and not callable(drain):
        raise ValueError(f"drain must be a callable nbytes -> seconds or None, got {drain!r}")
    return drain


def _check_interference(value: Interference | None) -> Interference:
    if value is None:
        return NO_INTERFERENCE
    if not isinstance(value, Interference):
        raise ValueError(f"interference must be a ringtrain.plan.Interference or None, got {value!r}")
    return value


def _check_layers(backward_times: Sequence[float], sizes_bytes: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    times = check_vector("backward_times", backward_times)
    sizes = check_vector("sizes_bytes", sizes_bytes)
    if len(times) != len(sizes):
        raise ValueError(
            f"backward_times has {len(times)} entries and sizes_bytes {len(sizes)}; they must be equal"
        )
    return times, sizes


def check_vector(name: str, values: Sequence[float]) -> np.ndarray:
    """``values`` as a 1-D float64 array, or a ValueError naming ``name`` and the bad entry.

    The entries must be integers or floats: bools, strings and other objects are refused
    rather than converted (``"1e3"`` or ``True`` in a list of sizes is a caller's mistake).
    """
    try:
        raw = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a sequence of numbers: {exc}") from None
    if raw.ndim == 0:  # a number, a generator, a dict: not a sequence numpy can read
        raise ValueError(f"{name} must be a sequence of numbers (a list, tuple or 1-D array), "
                         f"got {type(values).__name__}")
    if raw.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {raw.shape}")
    numeric = raw.dtype.kind in "iuf"
    if not numeric or isinstance(values, (list, tuple)):  # numpy turns [1.5, True] into floats
        entries = values if isinstance(values, (list, tuple)) else raw.tolist()
        for i, v in enumerate(entries):
            if isinstance(v, (bool, np.bool_)) or not (numeric or isinstance(v, (int, float, np.integer, np.floating))):
                raise ValueError(f"{name}[{i}] = {v!r}; every entry must be an integer or a float")
    try:
        array = raw.astype(np.float64)
    except OverflowError:  # an int beyond float64 (10**400): reported below as inf
        array = np.array([_float_or_inf(v) for v in raw.tolist()])
    bad = np.flatnonzero(~(np.isfinite(array) & (array >= 0.0)))
    if bad.size:
        raise ValueError(f"{name}[{bad[0]}] = {float(array[bad[0]])!r}; every entry must be finite and >= 0")
    return array


def _float_or_inf(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _finite(value: Any) -> bool:
    """math.isfinite, False (not an OverflowError) for an integer past what a float holds."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_scalar(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not _finite(value) or value < 0:
        raise ValueError(f"{name}={value!r}; it must be finite and >= 0")


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (_finite(value) and value > 0):  # (a negative value was told ">= 0", then 0 "> 0")
        raise ValueError(f"{name}={value!r}; it must be finite and > 0")


def _group_pairs(groups: object) -> list[tuple]:
    """``groups`` as a list of tuples; anything but a sequence of (first, last) pairs is a ValueError."""
    pairs = []
    try:
        if isinstance(groups, (str, bytes)):
            raise TypeError
        for g, pair in enumerate(groups):  # (TypeError where groups is no sequence: None, 3, a 0-d array)
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Iterable):
                raise ValueError(f"groups[{g}] = {pair!r}; each group must be a (first, last) pair of ints")
            pairs.append(tuple(pair))
    except TypeError:
        raise ValueError(f"groups must be a sequence of (first, last) pairs of ints, got {groups!r}") from None
    return pairs


def _check_groups(groups: Sequence[tuple[int, int]], n: int) -> None:
    expected_first = 0
    for g, pair in enumerate(groups):
        if len(pair) != 2 or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in pair):
            raise ValueError(f"groups[{g}] = {pair!r}; each group must be a (first, last) pair of ints")
        first, last = pair
        if first != expected_first or last < first or last >= n:
            raise ValueError(
                f"groups[{g}] = {pair!r}; groups must be contiguous, in backward order and cover "
                f"layers 0..{n - 1} (expected first = {expected_first})"
            )
        expected_first = last + 1
    if expected_first != n:
        raise ValueError(f"groups cover layers 0..{expected_first - 1} of 0..{n - 1}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


NO_INTERFERENCE = Interference()


def _whole(value: float) -> float | int:
    """A byte count as an int where it is whole (sizes arrive as floats; JSON should not say 4.0)."""
    return int(value) if float(value).is_integer() else float(value)
