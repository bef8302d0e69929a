"""Calibration: the numbers the planner needs, measured on the live job.

Words used here:

- *sweep*: a few allreduces of float32 buffers of growing size on the live communicator,
  each timed (median of ``repeats``; small ones in bursts, :data:`BURST`) after one warm-up.
  The fitted line passes through the smallest message's time (start-up dominated on any
  link), with the least-squares slope of the larger ones above it (``beta``); ``alpha`` is its
  intercept. A plain least-squares line through all points lets the large messages' noise
  decide the intercept: on an emulated 1 Gbit/s link it came out as 0, and the optimal plan
  then paid ~1 ms for each of 55 extra messages it believed free. Under algorithm "auto" the
  messages on either side of ``comm.AUTO_SMALL_BYTES`` get a line each (a
  ``ringtrain.plan.SplitCost``). Rank 0's fit is broadcast, so every rank plans with the same
  cost.
- *stamp*: the ``time.perf_counter()`` at which a parameter's gradient became ready in one
  backward pass (its post-accumulate-grad hook); NaN for a parameter that got no gradient.
- *backward start*: the stamp of the gradient of the module's output (a hook on the output).
- *observed order*: parameter ids sorted by stamp (no gradient last).
- *gap*: a parameter's backward time, its stamp minus the stamp before it in the observed
  order (minus the backward start for the first). Gaps are indexed by parameter id.
- *profile*: the per-parameter median gap over the profiled iterations, then the mean over
  ranks (an allreduce), laid out in rank 0's observed order (a broadcast). Both exchanges make
  the profile, hence the plan, identical on every rank, as the collectives require.
- *probe*: a plan of a fixed number of groups of (nearly) equal layer counts, run for a few
  iterations to see how much overlapped allreduces slow backward down: ``finest`` (96 groups,
  on models of more than 24 layers, nearer to what wfbp sends), ``fine`` (24) and ``coarse``
  (three). The *interference* (``ringtrain.plan.Interference``) is the
  per-message and per-byte cost that explains the probes' extra backward time over a single
  allreduce after backward (:func:`fit_interference`), and the factor by which allreduces
  run slower while backward runs that best explains the probes' communication ends
  (:func:`fit_comm_slowdown`).
- *drift*: how far the ready curve (cumulative gaps in plan order) moved between the profile
  the current plan was made from and a newer one, as a share of the older backward time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # for the annotations; the functions import it when they run
    from ..plan import Interference


#: Sweep sizes in bytes (float32 buffers): start-up dominated to bandwidth dominated. Under
#: algorithm "auto" those below ``comm.AUTO_SMALL_BYTES`` take another algorithm than the rest,
#: and each side gets its own line (:func:`sweep_cost`), so two sizes fall on each side of it.
SWEEP_BYTES = (4 * 1024, 32 * 1024, 64 * 1024, 512 * 1024, 2 * 1024 * 1024, 8 * 1024 * 1024)


#: The largest sweep message when the model's gradients are bigger than SWEEP_BYTES's last.
SWEEP_MAX_BYTES = 256 * 1024 * 1024


def sweep_sizes(model_bytes: float) -> tuple[int, ...]:
    """SWEEP_BYTES, plus one message of the model's gradient bytes (at most SWEEP_MAX_BYTES)
    when they are over 1.5x the largest: beta from messages of a few MiB missed the time of a
    84 MB single allreduce by 17% at 10 Gbit/s (caches, copies), and the planner and the
    simulator need the time of the groups the plan really sends."""
    if model_bytes > 1.5 * SWEEP_BYTES[-1]:
        return SWEEP_BYTES + (int(min(model_bytes, SWEEP_MAX_BYTES)) // 4 * 4,)
    return SWEEP_BYTES


#: Back-to-back allreduces timed together for sizes up to BURST_MAX_BYTES (the time is per
#: allreduce): a plan sends its small groups one after another on the communication thread,
#: and one 4 KiB allreduce timed alone at 4 ranks on 2 cores came out anywhere from 0.53 to
#: 0.94 ms over six sweeps of seven repeats, bursts of eight 0.73 to 0.81 ms.
BURST = 8
BURST_MAX_BYTES = 64 * 1024


def sweep_cost(comm, algorithm: str, sizes: Sequence[int] = SWEEP_BYTES, repeats: int = 3):
    """The measured cost of ``comm.allreduce`` (``ringtrain.plan.LinearCost``, or under
    algorithm "auto" a ``ringtrain.plan.SplitCost`` at ``AUTO_SMALL_BYTES``), fitted on rank 0
    and broadcast. A collective: run it on every rank at once, from the wrapper's
    communication thread. ``LinearCost(0, 0)`` on one rank."""
    import time

    from ..comm import AUTO_SMALL_BYTES
    from ..plan import LinearCost, SplitCost

    if comm.world_size == 1:
        return LinearCost(0.0, 0.0)
    medians = []
    for nbytes in sizes:
        buf = np.ones(max(1, nbytes // 4), dtype=np.float32)
        comm.allreduce(buf, op="sum", algorithm=algorithm)  # warm-up: connections, pages, caches
        burst = BURST if nbytes <= BURST_MAX_BYTES else 1
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(burst):
                comm.allreduce(buf, op="sum", algorithm=algorithm)
            times.append((time.perf_counter() - t0) / burst)
        medians.append(float(np.median(times)))
    nbytes = np.array([4 * max(1, s // 4) for s in sizes], dtype=np.float64)
    seconds = np.array(medians)
    small = nbytes < AUTO_SMALL_BYTES
    fit = np.zeros(5)  # small (alpha, beta), large (alpha, beta), split (0: one line)
    if algorithm == "auto" and small.sum() >= 1 and (~small).sum() >= 2:
        fit[:2] = fit_start_up_first(nbytes[small], seconds[small])
        fit[2:4] = fit_start_up_first(nbytes[~small], seconds[~small])
        fit[4] = AUTO_SMALL_BYTES
    else:
        fit[2:4] = fit_start_up_first(nbytes, seconds)
    comm.broadcast(fit, root=0)
    large = LinearCost(float(fit[2]), float(fit[3]))
    return SplitCost(LinearCost(float(fit[0]), float(fit[1])), large, float(fit[4])) if fit[4] else large


def fit_start_up_first(nbytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(alpha, beta) of the line through the smallest message's time whose slope fits the rest
    (least squares); alpha >= 0, beta >= 0. One message: its time, slope 0."""
    order = np.argsort(nbytes)
    n, t = nbytes[order], seconds[order]
    if len(n) == 1:
        return max(0.0, float(t[0])), 0.0
    extra_n, extra_t = n[1:] - n[0], t[1:] - t[0]
    beta = max(0.0, float(np.dot(extra_n, extra_t) / np.dot(extra_n, extra_n))) if np.any(extra_n) else 0.0
    return max(0.0, float(t[0] - beta * n[0])), beta


#: Groups in each probe plan (capped at the number of layers).
PROBE_GROUPS = {"finest": 96, "fine": 24, "coarse": 3}


def probe_groups(n: int, count: int) -> list[tuple[int, int]]:
    """``min(n, count)`` contiguous groups of layers 0..n-1, layer counts differing by at most one."""
    if n <= 0:
        return []
    count = max(1, min(n, count))
    bounds = np.linspace(0, n, count + 1).round().astype(int)
    return [(int(a), int(b) - 1) for a, b in zip(bounds[:-1], bounds[1:])]


def fit_interference(launches: Sequence[float], overlapped_bytes: Sequence[float],
                     extra_backward: Sequence[float]) -> "Interference":
    """The non-negative (per_message, per_byte) that best explain each probe's extra backward
    time ``extra_backward[k]`` (s) by its ``launches[k]`` allreduces launched during backward
    and their ``overlapped_bytes[k]``: least squares over the probes, one parameter dropped
    (set to 0) when the two-parameter solution has a negative one; all 0 when no probe shows
    any slowdown."""
    from ..plan import Interference

    a = np.column_stack([np.asarray(launches, dtype=np.float64), np.asarray(overlapped_bytes, dtype=np.float64)])
    y = np.asarray(extra_backward, dtype=np.float64)
    if not np.all(np.isfinite(a)) or not np.all(np.isfinite(y)) or not np.any(y > 0):
        return Interference()
    candidates = []
    if np.linalg.matrix_rank(a) == 2:
        both = np.linalg.lstsq(a, y, rcond=None)[0]
        if np.all(both >= 0):
            candidates.append(both)
    for k in (0, 1):  # one parameter alone, through the origin
        col = a[:, k]
        if np.dot(col, col) > 0:
            x = np.zeros(2)
            x[k] = max(0.0, float(np.dot(col, y) / np.dot(col, col)))
            candidates.append(x)
    if not candidates:
        return Interference()
    best = min(candidates, key=lambda x: float(np.sum((a @ x - y) ** 2)))
    return Interference(float(best[0]), float(best[1]))


#: comm_slowdown values tried by fit_comm_slowdown, in steps of 0.04: 0 to 12, allreduces up to
#: 13x slower while backward runs. (Up to 4 while the slowdown was charged for an allreduce's
#: whole length; slowed only while backward runs, the CNN and the MLP at 4 ranks / 10 Gbit/s
#: fitted the cap of 4 in three sets of three and their wfbp rows were under-predicted by 14-20%.)
COMM_SLOWDOWN_GRID = np.linspace(0.0, 12.0, 301)


def fit_comm_slowdown(model_ends, groups_per_probe: Sequence, measured_ends: Sequence[float],
                      slow: "Interference") -> "Interference":
    """``slow`` with the ``comm_slowdown`` (from COMM_SLOWDOWN_GRID) whose predicted
    communication ends come closest, in squares, to each probe's ``measured_ends`` (seconds from
    the start of backward); unchanged when any is not finite. ``model_ends(grid, groups)``: a
    probe's predicted ends for every slowdown of ``grid`` at once (``ringtrain.plan.end_times``;
    one evaluation per slowdown and probe, 903 at three probes, took 1 s on 3,000 parameters)."""
    import dataclasses

    ends = np.asarray(measured_ends, dtype=np.float64)
    if not np.all(np.isfinite(ends)):
        return slow
    errors = np.zeros(len(COMM_SLOWDOWN_GRID))
    for g, e in zip(groups_per_probe, ends):  # (summed probe by probe, in order, as the fit always did)
        errors = errors + (np.asarray(model_ends(COMM_SLOWDOWN_GRID, g), dtype=np.float64) - e) ** 2
    return dataclasses.replace(slow, comm_slowdown=float(COMM_SLOWDOWN_GRID[int(np.argmin(errors))]))


def without_interference(times: np.ndarray, plan, slow) -> np.ndarray:
    """Per-layer backward times (in ``plan``'s layer order) profiled while ``plan`` ran, less
    the delay its launches put into them as ``slow`` models it: the first layer of group g
    waited per_message + per_byte * bytes of group g-1 longer (clamped at 0)."""
    out = np.array(times, dtype=np.float64)
    if slow.per_message == 0.0 and slow.per_byte == 0.0:
        return out
    for (first, _), nbytes in zip(plan.groups[1:], plan.group_bytes[:-1]):
        out[first] = max(0.0, out[first] - (slow.per_message + slow.per_byte * nbytes))
    return out


def observed_order(stamps: np.ndarray) -> np.ndarray:
    """Parameter ids sorted by stamp; those without a stamp (NaN) last, by id."""
    key = np.where(np.isnan(stamps), np.inf, stamps)
    return np.argsort(key, kind="stable")


def gaps(stamps: np.ndarray, start: float) -> np.ndarray:
    """Per-parameter backward time (see the module docstring); 0 where there is no stamp."""
    order = observed_order(stamps)
    out = np.zeros(len(stamps))
    prev = start if np.isfinite(start) else np.nanmin(stamps) if np.any(np.isfinite(stamps)) else 0.0
    for pid in order:
        t = stamps[pid]
        if not np.isfinite(t):
            break
        out[pid] = max(0.0, t - prev)
        prev = t
    return out


def local_profile(gap_rows: Sequence[np.ndarray]) -> np.ndarray:
    """The per-parameter median over profiled iterations (rows of gaps)."""
    if not gap_rows:
        raise ValueError("no profiled iterations")
    return np.median(np.stack(gap_rows), axis=0)


def drift(old_times: Sequence[float], new_times: Sequence[float]) -> float:
    """Largest move of the ready curve, as a share of the old backward time (0 if it was 0).

    Both lists are in the same (plan) order.
    """
    old = np.cumsum(np.asarray(old_times, dtype=np.float64))
    new = np.cumsum(np.asarray(new_times, dtype=np.float64))
    if old.shape != new.shape:
        raise ValueError(f"profiles differ in length: {old.shape} and {new.shape}")
    if not old.size or old[-1] <= 0.0:
        return 0.0 if not new.size or new[-1] <= 0.0 else float("inf")
    return float(np.max(np.abs(new - old)) / old[-1])


def exchange_profile(comm, local_gaps: np.ndarray, local_order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean gaps over ranks, rank 0's order), equal on every rank: a collective, run from the
    communication thread."""
    n = len(local_gaps)
    times = np.ascontiguousarray(local_gaps, dtype=np.float64).copy()
    comm.allreduce(times, op="mean", algorithm="auto")
    # Rank 0's copy of the mean and its order go to everyone: some allreduce algorithms may
    # round differently on different ranks, and plans must agree to the last bit.
    packed = np.concatenate([times, np.asarray(local_order, dtype=np.float64)])
    comm.broadcast(packed, root=0)
    return packed[:n].copy(), packed[n:].astype(np.int64)
