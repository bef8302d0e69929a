"""The trial of plans: what the planner's model of the machine cannot know, measured.

After its first plan, a ``DistributedDataParallel`` with ``schedule="optimal"`` runs one trial
(:mod:`.planning`, item 2, says why). Words:

- *phase*: a plan run for ``verify_iterations`` iterations in a row. The *probe* phases
  (``finest``: 96 groups, only on a model of more layers than ``fine``'s; ``fine``: 24;
  ``coarse``: 3) and ``single`` (one allreduce after backward) give the interference: backward
  time lost per overlapped allreduce and per overlapped byte, and how much slower allreduces run
  while backward does (:func:`.calibration.fit_interference`, :func:`.calibration.fit_comm_slowdown`).
  With the interference given (``DDPOptions.interference``) or one layer, there are no probes.
- *candidate*: a plan the ``verify`` phase times: the plan made with the interference
  (``plan``), the optimal plan of free overlap (``free``), the MG-WFBP authors' greedy merge
  (``mgwfbp``), the single allreduce (``single``), torch DDP's default buckets (``buckets``),
  every layer alone (``wfbp``) and buckets of ``bucket_cap_mb`` (``fixed``): every other schedule's
  plan, so that the one kept is never slower than another schedule beyond the trial's noise;
  each only if its grouping differs from those before it. Every candidate's buckets are laid out
  once and kept, so that switching costs nothing (a probe's are let go when its phase ends).
- *round*: the candidates take turns, one iteration each, until each has run
  ``verify_iterations`` more; all meet the same machine load. Where the two fastest medians
  (the slowest rank's forward+backward over every round so far) are within ``VERIFY_MARGIN`` of
  each other, another round (at most ``VERIFY_ROUNDS``): a difference that small is within one
  round's noise. Then the fastest stays, the earlier of equals.
- *dropped*: a candidate whose best iteration is more than ``DROP_FACTOR`` times the fastest
  candidate's median takes no more turns: checked once every candidate has run ``DROP_AFTER``
  iterations of the first round, and at the end of every round that is followed by another
  (each time on the slowest rank's numbers, agreed). A candidate whose best of two iterations
  is over twice another's median is not within the trial's noise of it, and timing it on cost
  its whole rounds: WFBP on a model of 3,000 small parameters (2 ranks, 2 cores) ran 705 ms an
  iteration against 75-88 ms for the others, 3.5 s of the first round and as much again for
  each further one.

Every decision is taken on numbers all ranks agree on (an allreduce-max of the medians; the
interference fitted on rank 0 and broadcast), so every rank lays out the same buckets.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .. import plan as planner
from . import calibration

#: The candidates run another round when the two fastest medians are closer than this share,
#: up to VERIFY_ROUNDS rounds.
VERIFY_MARGIN = 0.03
VERIFY_ROUNDS = 3
#: A candidate is dropped (module docstring) when its best iteration is more than DROP_FACTOR
#: times the fastest candidate's median, first checked after DROP_AFTER iterations of each.
DROP_FACTOR = 2.0
DROP_AFTER = 2
#: torch DDP's default bucket caps, MiB (first bucket, then every other): one of the candidates.
DDP_BUCKETS = (1.0, 25.0)
#: What the log and the summary call each candidate.
CANDIDATES = {"plan": "the plan", "free": "the plan of free overlap", "mgwfbp": "the MG-WFBP merge",
              "single": "one allreduce after backward", "buckets": "torch DDP's default buckets",
              "wfbp": "one allreduce per layer (WFBP)", "fixed": "buckets of bucket_cap_mb"}
#: The candidates that are no plan of the planner's: the backward profile does not change them,
#: so once kept they are not re-planned.
FIXED_CANDIDATES = ("single", "buckets", "fixed")
#: The candidates kept by the planner's method of their name: re-plans use that method.
METHOD_CANDIDATES = ("mgwfbp", "wfbp")

#: A phase's row per iteration: (backward_s, forward_backward_s, measured_end_s) of this rank.
Row = tuple[float, float, float]


class PlanTrial:
    """One trial. The :class:`.planning.Planning` that owns it lends what it needs as callables
    (the wrapper's, through it):

    ``install(plan) -> (layout, specs)`` lays out buckets for ``plan`` over the profiled order,
    puts them in force and returns a handle to them and their ``BucketSpec``s;
    ``use(layout)`` puts buckets laid out earlier back in force; ``agree(label, array, op)``
    reduces ``array`` in place over the ranks (``op`` "max") or copies rank 0's to all
    (``op`` "broadcast"); ``log(message)`` writes the wrapper's log.

    ``times`` and ``sizes`` are the planner's inputs in the profiled order; ``bucket_cap_mb`` the
    wrapper's option (the ``fixed`` candidate's buckets). :meth:`step` is
    called after every iteration with its row until it returns True; then ``kept`` names the
    candidate in force (a key of CANDIDATES), ``record`` what was timed and ``interference``
    the interference measured (or the one given).
    """

    __slots__ = ("times", "sizes", "cost", "interference", "iterations", "bucket_cap_mb", "phases", "k", "rows",
                 "plans", "layouts", "launches", "bytes", "candidates", "turn", "rounds", "kept", "record",
                 "_install", "_use", "_agree", "_log")

    def __init__(self, times: np.ndarray, sizes: np.ndarray, cost: planner.CostFn,
                 interference: planner.Interference, iterations: int, probe: bool,
                 install: Callable, use: Callable, agree: Callable, log: Callable[[str], None],
                 bucket_cap_mb: float):
        self.times, self.sizes, self.cost, self.interference = times, sizes, cost, interference
        self.iterations, self.bucket_cap_mb = iterations, bucket_cap_mb
        self._install, self._use, self._agree, self._log = install, use, agree, log
        self.phases: list[str] = []
        if probe and len(times) > 1:
            if len(times) > calibration.PROBE_GROUPS["fine"]:  # a model of many layers: a probe nearer wfbp too
                self.phases += ["finest"]
            self.phases += ["fine", "coarse"]
        self.phases += ["single", "verify"]
        self.k = 0
        self.rows: dict[str, list[Row]] = {name: [] for name in self.phases}
        self.plans: dict[str, planner.Plan] = {}
        self.layouts: dict[str, object] = {}
        self.launches: dict[str, int] = {}
        self.bytes: dict[str, float] = {}
        self.candidates: list[dict] = []
        self.turn = 0
        self.rounds = 1
        self.kept: Optional[str] = None
        self.record: list[dict] = []

    @property
    def over(self) -> bool:
        return self.kept is not None

    def start(self) -> None:
        """Put the first phase in force."""
        self._enter_phase()

    def step(self, row: Row) -> bool:
        """One iteration done: record it; go to the next phase, or decide, when one is full.
        True once the trial is over."""
        name = self.phases[self.k]
        if name == "verify":
            self._compare(row)
            return self.over
        self.rows[name].append(row)
        if len(self.rows[name]) < self.iterations:
            return False
        if name == "single" and "fine" in self.phases:
            self._fit_interference()
        if name != "single":  # a probe's buckets are not used again (the single allreduce's are: a candidate)
            self.layouts.pop(name, None)
        self.k += 1
        self._enter_phase()
        return self.over

    def plan_for(self, name: str) -> planner.Plan:
        """The plan of a phase (a probe's groups, the single allreduce, or the optimal plan with
        the interference as known now)."""
        times, sizes = self.times, self.sizes
        if name in calibration.PROBE_GROUPS:  # (coarse: fewer groups than fine, also for 2 or 3 layers)
            count = calibration.PROBE_GROUPS[name] if name != "coarse" else min(calibration.PROBE_GROUPS[name], len(times) - 1)
            groups = calibration.probe_groups(len(times), count)
            return planner.evaluate(times, sizes, groups, cost=self.cost, interference=self.interference)
        if name == "single":
            return planner.merge(times, sizes, cost=self.cost, method="single")
        return planner.merge(times, sizes, cost=self.cost, method="optimal", interference=self.interference)

    def _enter_phase(self) -> None:
        name = self.phases[self.k]
        if name == "verify":
            self._start_verify()
            return
        plan = self.plan_for(name)
        self.plans[name] = plan
        self.layouts[name], specs = self._install(plan)
        # What the probe launches during backward: every bucket but the last (a group of mixed
        # dtypes is one bucket per dtype).
        self.launches[name] = len(specs) - 1
        self.bytes[name] = float(sum(spec.nbytes for spec in specs[:-1]))

    def _start_verify(self) -> None:
        """Lay out every candidate and put the first in force; with one candidate left (all
        grouped alike) the trial is over."""
        times, sizes = self.times, self.sizes
        free = planner.merge(times, sizes, cost=self.cost, method="optimal", interference=self.interference,
                             planned_with=planner.Interference())
        mgwfbp = planner.merge(times, sizes, cost=self.cost, method="mgwfbp", interference=self.interference)
        first_mb, cap_mb = DDP_BUCKETS
        buckets = planner.merge(times, sizes, cost=self.cost, method="fixed", bucket_cap_mb=cap_mb,
                                first_bucket_mb=first_mb, interference=self.interference)
        wfbp = planner.merge(times, sizes, cost=self.cost, method="wfbp", interference=self.interference)
        fixed = planner.merge(times, sizes, cost=self.cost, method="fixed", bucket_cap_mb=self.bucket_cap_mb,
                              interference=self.interference)
        candidates: list[dict] = []
        for label, plan in (("plan", self.plan_for("verify")), ("free", free), ("mgwfbp", mgwfbp),
                            ("single", self.plans["single"]), ("buckets", buckets), ("wfbp", wfbp),
                            ("fixed", fixed)):
            if all(plan.groups != c["plan"].groups for c in candidates):
                candidates.append({"label": label, "plan": plan, "rows": [], "dropped": False, "rounds": 0})
        if len(candidates) == 1:
            self._install(candidates[0]["plan"])
            self.kept = candidates[0]["label"]
            self._log(f"with the interference ({describe(self.interference)}) every candidate plan is "
                      f"{len(candidates[0]['plan'].groups)} group(s) alike; keeping it")
            return
        single = self.layouts.pop("single")  # (the buckets in force)
        for c in candidates:
            # the single phase's buckets serve the candidate of one group (single, or one grouped alike)
            c["layout"] = single if c["plan"].groups == self.plans["single"].groups else self._install(c["plan"])[0]
        self.candidates = candidates
        self._use(candidates[0]["layout"])

    def _compare(self, row: Row) -> None:
        """The verify phase: record the candidate's row and hand over to the next one; once each
        has run a round, either another round or the fastest stays (words above)."""
        candidates = self.candidates
        candidates[self.turn]["rows"].append(row)
        rounds = self.rounds
        live = [c for c in candidates if not c["dropped"]]
        if any(len(c["rows"]) < rounds * self.iterations for c in live):
            if rounds == 1 and all(len(c["rows"]) == DROP_AFTER for c in live):
                self._drop_slow(*self._agreed_times(), rounds)
            self._next_candidate()
            return
        # A round timed: agree on the slowest rank's medians, so every rank decides alike.
        medians, best_rows = self._agreed_times()
        times = medians[[not c["dropped"] for c in candidates]]
        first, second = np.sort(times)[:2] if len(times) > 1 else (times[0], np.inf)
        if second - first < VERIFY_MARGIN * first and rounds < VERIFY_ROUNDS:
            self.rounds = rounds + 1
            self._log(f"the two fastest candidates are within {VERIFY_MARGIN:.0%} after {rounds} round(s) "
                      f"({first * 1e3:.1f} and {second * 1e3:.1f} ms): timing another round")
            self._drop_slow(medians, best_rows, rounds)
            self._next_candidate()
            return
        best = candidates[int(np.argmin(np.where([c["dropped"] for c in candidates], np.inf, medians)))]
        # (no margin: the measured fastest stays)
        self.record = [{"label": c["label"], "groups": len(c["plan"].groups), "median_s": float(m),
                        "rounds": c["rounds"] or rounds, "kept": c is best} for c, m in zip(candidates, medians)]
        # The winner's buckets are laid out afresh and the trial's layouts dropped first (in three
        # 4-rank runs on 2 cores a kept layout's allreduce ran 9-13% slower than a fresh one's).
        for c in candidates:
            c.pop("layout", None)
        self.candidates = []
        self._install(best["plan"])
        self.kept = best["label"]
        groups = lambda n: f"{n} group{'s' if n != 1 else ''}"  # noqa: E731
        timed = ", ".join(f"{CANDIDATES[c['label']]} ({groups(len(c['plan'].groups))}) {m * 1e3:.1f} ms"
                          + (" (dropped)" if c["dropped"] else "") for c, m in zip(candidates, medians))
        self._log(f"candidates verified ({rounds} round(s) of {self.iterations}), per "
                  f"forward+backward: {timed}; keeping {CANDIDATES[best['label']]}")

    def _agreed_times(self) -> tuple[np.ndarray, np.ndarray]:
        """Every candidate's median and best forward+backward so far, the slowest rank's (one
        agreement: an allreduce-max)."""
        rows = [[r[1] for r in c["rows"]] for c in self.candidates]
        values = np.array([np.median(r) for r in rows] + [min(r) for r in rows], dtype=np.float64)
        self._agree("verify plan", values, "max")
        n = len(rows)
        return values[:n], values[n:]

    def _drop_slow(self, medians: np.ndarray, best_rows: np.ndarray, rounds: int) -> None:
        """Drop every candidate whose best iteration is more than DROP_FACTOR times the fastest
        live candidate's median (module docstring); its buckets are let go."""
        live = [k for k, c in enumerate(self.candidates) if not c["dropped"]]
        fastest = min(medians[k] for k in live)
        for k in live:
            c = self.candidates[k]
            if best_rows[k] > DROP_FACTOR * fastest:
                c["dropped"], c["rounds"] = True, rounds
                c.pop("layout")
                self._log(f"{CANDIDATES[c['label']]} ({len(c['plan'].groups)} groups) dropped from the trial: its "
                          f"best iteration {best_rows[k] * 1e3:.1f} ms, the fastest median {fastest * 1e3:.1f} ms")

    def _next_candidate(self) -> None:
        n = len(self.candidates)
        self.turn = next(k % n for k in range(self.turn + 1, self.turn + n + 1)
                         if not self.candidates[k % n]["dropped"])
        self._use(self.candidates[self.turn]["layout"])

    def _fit_interference(self) -> None:
        """The interference from the probes' and the single allreduce's backward times and the
        probes' communication ends (the slowest rank's medians), fitted on rank 0 and broadcast:
        every rank must plan with the same bits, whatever its linear algebra library rounds."""
        names = [p for p in self.phases if p in calibration.PROBE_GROUPS]
        k = len(names)
        medians = np.array([np.median([row[0] for row in self.rows[p]]) for p in names + ["single"]]
                           + [np.median([row[2] for row in self.rows[p]]) for p in names], dtype=np.float64)
        self._agree("interference probes", medians, "max")
        probes = [self.plans[p] for p in names]
        slow = calibration.fit_interference([self.launches[p] for p in names], [self.bytes[p] for p in names],
                                            medians[:k] - medians[k])
        times, sizes = self.times, self.sizes
        slow = calibration.fit_comm_slowdown(
            lambda grid, groups: planner.end_times(times, sizes, groups, grid, cost=self.cost, interference=slow),
            [p.groups for p in probes], medians[k + 1:], slow)
        fitted = np.array([slow.per_message, slow.per_byte, slow.comm_slowdown], dtype=np.float64)
        self._agree("interference fit", fitted, "broadcast")
        self.interference = planner.Interference(*(float(x) for x in fitted))
        ms = lambda values: ", ".join(f"{v * 1e3:.1f}" for v in values)  # noqa: E731
        self._log(f"interference measured by probes of {', '.join(str(len(p.groups)) for p in probes)} groups "
                  f"(backward {ms(medians[:k])} ms against {medians[k] * 1e3:.1f} ms with one allreduce after it; "
                  f"communication ends {ms(medians[k + 1:])} ms): {describe(self.interference)}")


def longest(iterations: int, probes: int) -> int:
    """Iterations the longest trial takes after the first plan, ``iterations`` per phase: its
    ``probes`` probe phases and the single allreduce's, then every candidate for VERIFY_ROUNDS
    rounds (near-equal candidates take them all)."""
    return (probes + 1 + VERIFY_ROUNDS * len(CANDIDATES)) * iterations


def describe(interference: planner.Interference) -> str:
    """The interference in the log's words."""
    return (f"{interference.per_message * 1e3:.3f} ms per overlapped allreduce, "
            f"{interference.per_byte * 1e9:.3f} ms per overlapped MB, overlapped allreduces "
            f"{1 + interference.comm_slowdown:.2f}x slower while backward runs")
