"""The simulator: one training iteration of a traced model on p GPUs, from the trace and a cost.

Words used here:

* **cost** — the time of one allreduce of n bytes on p GPUs with a given algorithm, from
  ``ringtrain.sim.costs`` (through a ``Cluster``) or any ``cost(nbytes) -> seconds``.
* **schedule** — how gradients are grouped into allreduces: ``single``, ``wfbp``,
  ``fixed`` (a MiB bucket cap), ``mgwfbp``, ``optimal``. Groups and their start and end
  times come from ``ringtrain.plan.merge``, the same code the trainer runs.
* **iteration** — forward, then backward with the plan's allreduces overlapping it, then the
  optimizer step once the last allreduce has ended:
  ``iteration = forward + max(backward, end of the last allreduce) + optimizer``
  (the allreduce end is counted from the start of backward). On one GPU nothing is
  communicated: ``forward + backward + optimizer``. With parameter servers (algorithm
  ``ps``) the groups are pushes: each holds the network for the cost's ``occupancy``, its
  ``drain`` (the pull of its last partitions) follows on the links back, after the drain
  before it, and the workers take no optimizer step (the servers step each partition as its
  last push arrives): ``iteration = forward + max(backward, end of the last drain)``.
* **interference** (optional, ``ringtrain.plan.Interference``): backward time lost to each
  allreduce launched while backward runs, as the planner charges it; ``backward`` above is
  then the slowed backward. Measured on the live job by ``ringtrain.DistributedDataParallel``
  (its ``interference``); 0 by default, as for a GPU.
* **throughput** ``p * batch / iteration`` samples/s; **speedup** is throughput over the
  one-GPU throughput; **scaling efficiency** is speedup / p.

Modelled: start-up and per-byte cost of each allreduce (per algorithm and world size),
overlap of communication with backward on one communication stream, the order in which
gradients become ready, the optimizer step, and (when given) compute slowed down by concurrent
communication as a cost per overlapped allreduce and byte. Not modelled: how that slowdown
arises (memory bandwidth, SMs or CPU cores taken by the collective), stragglers and
run-to-run jitter, contention at parameter servers or in the network core beyond what the
cost formula charges, forward-pass prefetching of parameters, and data loading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

from .. import plan as planner
from .traces import Trace

#: The schedules in the order tables show them: from the least to the most overlap-aware.
SCHEDULES = ("single", "wfbp", "fixed", "mgwfbp", "optimal")
DEFAULT_GPUS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)

CostFn = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Prediction:
    model: str
    cluster: str
    algorithm: str
    schedule: str
    world_size: int
    batch_size: int
    """Samples per GPU per iteration."""
    forward_s: float
    backward_s: float
    comm_s: float
    """Sum of the allreduce times (some of it hidden behind backward)."""
    comm_end_s: float
    """End of the last allreduce, counted from the start of backward (0 on one GPU, where there is none)."""
    optimizer_s: float
    """The workers' optimizer step (0 with parameter servers: the servers step)."""
    iteration_s: float
    samples_per_s: float
    speedup: float
    efficiency: float
    groups: int
    """Number of allreduces per iteration (0 on one GPU)."""
    plan: planner.Plan = field(repr=False, compare=False)

    @property
    def exposed_s(self) -> float:
        """Communication not hidden behind backward."""
        return max(0.0, self.comm_end_s - self.backward_s)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__ if k != "plan"}
        d["exposed_s"] = self.exposed_s
        return d


def affine_or_none(cost: CostFn, probe: Sequence[float] = (1.0, 1e3, 1e5, 1e6, 3e7, 1e9, 1e10)) -> tuple[float, float] | None:
    """(a, b) if ``cost(n) == a + b n`` at every probe size (to 1e-9 relative), else None.

    Every cost in ``sim.costs`` is affine in n > 0 for a fixed world size and algorithm;
    handing the planner the affine form lets it use its vectorized path. Any other cost is
    passed to the planner as it is (slower, same answer).
    """
    ys = [float(cost(float(n))) for n in probe]
    b = (ys[-1] - ys[-2]) / (probe[-1] - probe[-2])
    a = ys[-2] - b * probe[-2]
    if a < 0:  # rounding of a + b*n at 1e9 bytes can leave -1e-18 for a cost of pure bandwidth
        a = 0.0 if a > -1e-12 else a
    if a < 0 or b < 0:
        return None
    for n, y in zip(probe, ys):
        if not math.isclose(a + b * n, y, rel_tol=1e-9, abs_tol=1e-15):
            return None
    return a, b


def make_plan(trace: Trace, schedule: str, cost: CostFn, bucket_cap_mb: float = 25.0,
              interference: planner.Interference | None = None) -> planner.Plan:
    """The planner's grouping and timing of ``trace``'s gradients under ``cost``."""
    _, times, sizes = trace.gradient_layers()
    return _plan_layers(times, sizes, schedule, cost, bucket_cap_mb, interference)


def _plan_layers(times: list[float], sizes: list[int], schedule: str, cost: CostFn, bucket_cap_mb: float,
                 interference: planner.Interference | None,
                 planned_with: planner.Interference | None = None, drain: CostFn | None = None,
                 first_bucket_mb: float | None = None, tail: float = 0.0) -> planner.Plan:
    """make_plan on the gradient layers' times and bytes (``Trace.gradient_layers``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not a schedule; choose from {', '.join(SCHEDULES)}")
    ab = affine_or_none(cost)
    rate = dict(alpha=ab[0], beta=ab[1]) if ab is not None else dict(cost=cost)
    return planner.merge(times, sizes, method=schedule, bucket_cap_mb=bucket_cap_mb, interference=interference,
                         planned_with=planned_with, drain=drain, first_bucket_mb=first_bucket_mb, tail=tail, **rate)


#: The longest iteration predicted (30 years): beyond, the inputs are out of any real range (a
#: beta of 1e300 s/byte) and the numbers would print as inf.
MAX_ITERATION_S = 1e9


def single_gpu_iteration(trace: Trace) -> float:
    return trace.forward_s + trace.backward_s + trace.optimizer_s


def predict_with_cost(
    trace: Trace,
    cost: CostFn,
    world_size: int,
    schedule: str = "optimal",
    *,
    algorithm: str = "ring",
    cluster: str = "custom",
    bucket_cap_mb: float = 25.0,
    interference: planner.Interference | None = None,
    planned_with: planner.Interference | None = None,
    first_bucket_mb: float | None = None,
) -> Prediction:
    """Predict one iteration of ``trace`` on ``world_size`` GPUs whose allreduce takes ``cost``
    (and whose overlapped allreduces slow backward down by ``interference``). ``planned_with``:
    the interference the schedule plans with, where it differs from the one that is charged
    (``ringtrain.plan.merge``; the trial of ``DistributedDataParallel`` may keep the plan of
    free overlap). ``first_bucket_mb``: the fixed schedule's first bucket cap (torch DDP's 1 MiB;
    None: ``bucket_cap_mb`` as the others)."""
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        # (4.5 GPUs and True were predicted; np.int64 rows' to_dict() could not be written as JSON)
        raise ValueError(f"--gpus: world size must be an integer >= 1, got {world_size!r}")
    world_size = int(world_size)
    base = single_gpu_iteration(trace)
    if not base > 0:  # throughput and speedup are ratios to the one-GPU iteration
        raise ValueError(
            f"trace {trace.model}: forward, backward and optimizer times are all 0, so throughput and "
            "speedup are undefined; give the layers their compute times"
        )
    _, times, sizes = trace.gradient_layers()
    servers = world_size > 1 and getattr(cost, "algorithm", None) == "ps"
    # A parameter server's pushes queue on the way out, their last pulls on the way back
    # (sim.costs, "ps"; the planner's drain).
    occupancy = getattr(cost, "occupancy", cost) if world_size > 1 else _free
    drain = getattr(cost, "drain", None) if servers else None
    if world_size > 1 and sizes:  # (else the planner's refusal of an inf cost names a bound method)
        with np.errstate(over="ignore", invalid="ignore"):
            whole = float(occupancy(float(sum(sizes))))
        if not whole <= MAX_ITERATION_S:
            raise ValueError(f"{trace.model} at {world_size} GPUs: one allreduce of its {sum(sizes)} gradient bytes "
                             f"takes {whole:.3g} s, over {MAX_ITERATION_S:.0e} s (30 years); are the cost's numbers "
                             f"({cost!r}) or the trace's sizes out of any real range?")
    gradients_s = float(np.cumsum(np.asarray(times, dtype=np.float64))[-1]) if times else 0.0
    # (the plan's backward ends where the trace's does: after its parameter-free tail, if any,
    # which the optimum plans with: interference can make backward, not communication, the end)
    tail = max(0.0, trace.backward_s - gradients_s)
    with np.errstate(over="ignore", invalid="ignore"):  # (an overflow is refused below, in one line)
        plan = _plan_layers(times, sizes, schedule, occupancy, bucket_cap_mb,
                            interference if world_size > 1 else None, planned_with if world_size > 1 else None,
                            drain, first_bucket_mb, tail)
    # Backward slowed by the launches before its last group (0 without interference).
    delay = plan.ready[-1] - gradients_s if times else 0.0
    backward = trace.backward_s + delay
    optimizer = 0.0 if servers else trace.optimizer_s
    iteration = trace.forward_s + max(backward, plan.end_time) + optimizer
    if not iteration <= MAX_ITERATION_S:
        raise ValueError(f"{trace.model} at {world_size} GPUs: the predicted iteration takes {iteration:.3g} s, over "
                         f"{MAX_ITERATION_S:.0e} s (30 years); are the cost's numbers ({cost!r}) or the trace's "
                         "sizes out of any real range?")
    throughput = world_size * float(trace.batch_size) / iteration
    if not math.isfinite(throughput):  # (a one-GPU iteration of 1e-320 s: --json wrote Infinity, not JSON)
        raise ValueError(f"{trace.model} at {world_size} GPUs: {world_size} x {trace.batch_size:.3g} samples in "
                         f"{iteration:.3g} s is past what a float holds; give the layers' times in seconds")
    speedup = base / iteration * world_size
    return Prediction(
        model=trace.model,
        cluster=cluster,
        algorithm=algorithm,
        schedule=schedule,
        world_size=world_size,
        batch_size=trace.batch_size,
        forward_s=trace.forward_s,
        backward_s=backward,
        comm_s=plan.comm_time,
        comm_end_s=plan.end_time if world_size > 1 else 0.0,  # (not backward's end: nothing is sent)
        optimizer_s=optimizer,
        iteration_s=iteration,
        samples_per_s=throughput,
        speedup=speedup,
        efficiency=speedup / world_size,
        groups=len(plan.groups) if world_size > 1 else 0,  # (one GPU sends nothing)
        plan=plan,
    )


def _free(nbytes: Any) -> Any:
    return 0.0 * nbytes


def predict(
    trace: Trace,
    alpha: float,
    beta: float,
    world_size: int,
    schedule: str = "optimal",
    algorithm: str = "ring",
    *,
    gamma: float = 0.0,
    bucket_cap_mb: float = 25.0,
    cluster: str = "custom",
    **cost_options: Any,
) -> Prediction:
    """Predict one iteration from per-link ``alpha`` (s) and ``beta`` (s/byte).

    The allreduce cost is ``sim.costs.allreduce_time(n, world_size, algorithm, alpha, beta,
    gamma, **cost_options)`` (e.g. the intra-node link of ``hierarchical``). This is the
    entry point for checking predictions against measured runs.
    """
    from . import costs

    cost = costs.allreduce_cost(world_size, algorithm, alpha, beta, gamma, **cost_options)
    return predict_with_cost(
        trace, cost, world_size, schedule, algorithm=algorithm, cluster=cluster, bucket_cap_mb=bucket_cap_mb
    )


class ClusterLike(Protocol):
    name: str

    def cost(self, world_size: int, algorithm: str) -> CostFn: ...


def sweep(
    traces: Iterable[Trace],
    clusters: Sequence[ClusterLike],
    gpus: Sequence[int] = DEFAULT_GPUS,
    schedules: Sequence[str] = SCHEDULES,
    algorithms: Sequence[str] = ("ring",),
    bucket_cap_mb: float = 25.0,
) -> list[Prediction]:
    """Every trace x cluster x algorithm x GPU count x schedule, in that nesting order."""
    out: list[Prediction] = []
    for trace in traces:
        for cluster in clusters:
            for algorithm in algorithms:
                for p in gpus:
                    cost = cluster.cost(p, algorithm)
                    for schedule in schedules:
                        out.append(predict_with_cost(
                            trace, cost, p, schedule, algorithm=algorithm, cluster=cluster.name,
                            bucket_cap_mb=bucket_cap_mb,
                        ))
    return out
