"""Planning: which plan the wrapper's buckets are laid out by, and when it changes.

This module owns the plan's lifecycle for one ``DistributedDataParallel``: the first layout,
the backward profile, the first plan, the trial of plans and the re-plans. The wrapper owns
the buckets' memory and the hooks that fill it; it lends :class:`Planning` what it needs as
callables and calls :meth:`Planning.after_iteration` once per synchronizing backward.

1. *Profiling*: the first ``warmup_iterations + profile_iterations`` iterations use one bucket
   (reduced after backward, so the hooks time backward undisturbed), laid out in reverse
   registration order. Then the profile (per-parameter backward times, mean over ranks, rank
   0's observed order: :mod:`.calibration`) and the sweep's allreduce cost go to
   ``ringtrain.plan.merge`` with the chosen schedule, and the buckets are laid out again. Every
   ``replan_interval`` iterations the profile is exchanged again and the plan re-made if the
   ready curve drifted by more than ``drift_threshold`` of the backward time (or the order
   changed); not with a comm hook (``replans``: a hook's state by bucket index must stay valid).
   Plans are logged on the ``ringtrain.ddp`` logger (INFO on rank 0).
2. *Trial* (``schedule="optimal"``, ``verify_iterations`` > 0; :mod:`.trial` has its words and
   steps): after the first plan, the wrapper measures what the model cannot know. Probe plans
   and one allreduce after backward give the *interference* (backward time lost per overlapped
   allreduce and per overlapped byte, and how much slower allreduces run while backward does:
   ``ringtrain.plan.Interference``); the optimal plan is made again with it. Then *candidates*
   take turns, one iteration each (every bucket layout kept, so all meet the same machine load):
   that plan, the optimal plan of free overlap (as on a GPU: where the fitted interference
   over-charges overlap it merges less), the MG-WFBP authors' greedy merge (on 4 ranks sharing
   2 cores it was measured faster than both in some runs: the model's interference is a fit
   of three probes), the single allreduce, torch DDP's default buckets, one allreduce per
   layer (WFBP) and buckets of ``bucket_cap_mb``: every other schedule's plan, so that the one
   kept is never slower than another schedule or DDP's own grouping beyond the trial's noise
   (at 10 Gbit/s on 2 cores WFBP once ran an MLP 7.8% faster than the plan kept among the
   others). The fastest median forward+backward (the slowest rank's) stays, with more rounds
   where the two fastest are close; the earlier of equals (a margin towards fewer allreduces
   was tried in two benchmark sets and dropped: among near-equals it keeps the plan that hides
   less, down to one allreduce after backward). ``planned_with`` is the interference it was
   planned with, ``kept`` which candidate stays (``fell_back``, the wrapper's property: the
   single allreduce), ``record`` what was timed. The one kept is laid out afresh and re-plans
   keep its way of planning (``method``; the single allreduce and the buckets by size, which
   the profile does not change, are not re-planned).

Every collective here (the profile exchange, the trial's agreements) runs on the wrapper's
communication thread, between iterations, in the same order on every rank.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from functools import partial
from typing import Callable, Optional

import numpy as np

from .. import plan as planner
from . import buckets as bucketing
from . import calibration
from .options import DDPOptions
from .timeline import IterationStats, TraceRecorder
from .trial import FIXED_CANDIDATES, METHOD_CANDIDATES, PlanTrial

_NAN = float("nan")


class Planning:
    """The plan lifecycle of one wrapper (module docstring). The wrapper lends:

    ``run(label, call)``: run ``call`` on its communication thread and return the result (with
    its deadline); ``install(order, plan) -> specs``: lay out buckets for ``plan`` over
    ``order``, put them in force and return their ``BucketSpec``s; ``in_force() -> (order,
    plan)``: what is in force; ``layout()`` and ``use(layout)``: a handle to the buckets in
    force, and put such buckets back in force (for the trial); ``log(message)``: its log.

    ``sizes``: the parameters' gradient bytes by parameter id; ``recorder``: the wrapper's
    trace, or None.
    """

    __slots__ = ("options", "sizes", "cost", "comm", "recorder", "interference", "profile_rows", "plan_times",
                 "trial", "kept", "record", "replans", "_run", "_install", "_in_force", "_layout", "_use", "_log",
                 "__weakref__")

    def __init__(self, options: DDPOptions, sizes: np.ndarray, cost: planner.CostFn, comm,
                 recorder: Optional[TraceRecorder], *, run: Callable, install: Callable, in_force: Callable,
                 layout: Callable, use: Callable, log: Callable[[str], None]):
        self.options, self.sizes, self.cost, self.comm, self.recorder = options, sizes, cost, comm, recorder
        self._run, self._install, self._in_force = run, install, in_force
        self._layout, self._use, self._log = layout, use, log
        self.profile_rows: deque = deque(maxlen=options.profile_iterations)
        self.plan_times = np.zeros(len(sizes))
        self.trial: Optional[PlanTrial] = None  # under way: the trial of plans (verify_iterations)
        self.kept = "plan"  # the trial's candidate in force (trial.CANDIDATES)
        self.record: list[dict] = []  # what the trial measured (the wrapper's ``trial`` property)
        # False: no re-plan after the first plan and its trial (a comm hook may keep state by
        # bucket index, as PowerSGD does, which a new layout would make wrong).
        self.replans = True
        self.interference = options.interference or planner.NO_INTERFERENCE

    @property
    def planned_with(self) -> planner.Interference:
        """The interference the plan in force was made with: the measured one, or none where
        the trial measured the plan of free overlap to be the fastest."""
        return planner.Interference() if self.kept == "free" else self.interference

    @property
    def method(self) -> str:
        """The planner's method re-plans use: the schedule asked for, or ``mgwfbp`` / ``wfbp`` where
        the trial measured that schedule's plan to be the fastest. (A kept single allreduce or
        buckets by size are not re-planned: ``plan.method`` says how those were made.)"""
        return self.kept if self.kept in METHOD_CANDIDATES else self.options.schedule

    def start(self, order: Optional[list[int]] = None) -> None:
        """Put the first layout in force: one bucket, in reverse registration order as torch's
        DDP starts, or in ``order`` (a resumed comm hook's state keyed by one bucket so ordered)."""
        n = len(self.sizes)
        first = list(range(n - 1, -1, -1)) if order is None else list(order)
        self._install(first, planner.merge([0.0] * n, self.sizes[first], cost=self.cost, method="single"))

    def after_iteration(self, it: int, stamps: list[float], bwd_start: Optional[float], last: IterationStats) -> None:
        """Synchronizing iteration ``it`` is over (``stamps``, ``bwd_start``: its gradients'
        stamps and backward start; ``last``: its stats): profile it, and plan, step the trial or
        re-plan when it is time."""
        opts = self.options
        if it < opts.warmup_iterations:
            return
        # Raw stamps are kept; gaps are computed only when a plan is (re-)made.
        self.profile_rows.append((stamps, bwd_start))
        planned_at = opts.warmup_iterations + opts.profile_iterations - 1
        if it == planned_at:
            self._replan(True, stamps, it)
            if opts.verify_iterations and opts.schedule == "optimal" and self.comm.world_size > 1:
                self._start_trial()
        elif self.trial is not None:
            self._verify_step(last)
        elif (self.replans and opts.replan_interval and it > planned_at
              and (it - planned_at) % opts.replan_interval == 0):
            self._replan(False, stamps, it)

    def _start_trial(self) -> None:
        """Start the trial of plans (module docstring, item 2; :mod:`.trial`)."""
        order, _ = self._in_force()
        self.trial = trial = PlanTrial(
            self.plan_times, self.sizes[order], self.cost, self.interference, self.options.verify_iterations,
            probe=self.options.interference is None, install=weakly(self._install_in_order),
            use=self._use, agree=weakly(self._agree), log=self._log, bucket_cap_mb=self.options.bucket_cap_mb)
        trial.start()
        self._trial_over_if(trial.over)

    def _verify_step(self, last: IterationStats) -> None:
        """One trial iteration done (the slowest rank's medians decide: :class:`.trial.PlanTrial`)."""
        over = self.trial.step((last.backward_s, last.forward_backward_s, last.measured_end_s))
        self._trial_over_if(over)

    def _trial_over_if(self, over: bool) -> None:
        trial = self.trial
        self.interference = trial.interference
        if over:
            self.trial = None
            self.kept = trial.kept
            self.record = trial.record

    def _install_in_order(self, plan: planner.Plan) -> tuple:
        """The trial's ``install``: buckets for ``plan`` over the profiled order, in force."""
        specs = self._install(self._in_force()[0], plan)
        return self._layout(), specs

    def _agree(self, label: str, values: np.ndarray, op: str) -> None:
        """The trial's ``agree``: ``values`` reduced in place over the ranks (``op`` "max"), or
        rank 0's copied to all (``op`` "broadcast"), on the communication thread."""
        if op == "broadcast":
            call = partial(self.comm.broadcast, values, 0)
        else:
            call = partial(self.comm.allreduce, values, op, "auto")
        self._run(label, call)

    def _replan(self, first: bool, stamps: list[float], it: int) -> None:
        """Exchange the profile and plan (``first``), or re-plan if it drifted (``stamps``: the
        last iteration's, for this rank's observed order; ``it``: its number)."""
        local = calibration.local_profile([calibration.gaps(np.array(row), _NAN if start is None else start)
                                           for row, start in self.profile_rows])
        mine = calibration.observed_order(np.array(stamps))
        t0 = time.perf_counter()
        exchange = partial(calibration.exchange_profile, self.comm, local, mine)
        times, order = self._run("profile exchange", exchange)
        if self.recorder is not None:
            self.recorder.span("profile exchange", "calibration", "communication", t0, time.perf_counter(),
                               iteration=it)
        order = bucketing.check_order(order, len(self.sizes))
        if not first and self.kept in FIXED_CANDIDATES:  # measured faster here; the profile does not move them
            return
        if not first:
            # Profiled under the plan in force: take out the delays it put into the gaps, as
            # modelled, so that neither the drift nor the next plan counts them twice.
            order_in_force, plan_in_force = self._in_force()
            in_plan_order = calibration.without_interference(times[order_in_force], plan_in_force, self.interference)
            times = times.copy()
            times[order_in_force] = in_plan_order
            moved = calibration.drift(self.plan_times, in_plan_order)
            if moved <= self.options.drift_threshold and order == order_in_force:
                return
            self._log(f"backward profile drifted by {100 * moved:.0f}% of the backward time; re-planning")
        ordered = times[order]
        plan = planner.merge(ordered, self.sizes[order], cost=self.cost, method=self.method,
                             bucket_cap_mb=self.options.bucket_cap_mb, interference=self.interference,
                             planned_with=self.planned_with)
        self.plan_times = ordered
        self._install(order, plan)
        self._log(f"plan ({plan.method}, {cost_text(self.cost)}): "
                  f"{len(plan.groups)} groups {plan.groups}, predicted end {plan.end_time * 1e3:.3f} ms "
                  f"(backward {plan.backward_time * 1e3:.3f} ms, communication {plan.comm_time * 1e3:.3f} ms, "
                  f"{100 * plan.hidden_fraction:.0f}% hidden)")


def cost_text(cost: planner.CostFn) -> str:
    """The allreduce cost in the log's words."""
    describe = getattr(cost, "describe", None)  # LinearCost, SplitCost
    return describe() if callable(describe) else repr(cost)


def weakly(method):
    """``method`` called through a weak reference: what the wrapper lends its planning, and the
    planning its trial, must not keep the wrapper alive (nor, through it, its communication
    thread)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)
