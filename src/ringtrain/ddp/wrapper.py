"""DistributedDataParallel: gradients averaged over ranks while backward is still running.

How one synchronizing iteration goes (words of :mod:`.buckets`, :mod:`.calibration`,
:mod:`.timeline`):

1. ``forward`` runs the wrapped module (after broadcasting its buffers from rank 0, as torch's
   DDP does), puts a hook on the output's gradient to stamp the *backward start*, and, with
   ``find_unused_parameters=True``, walks the autograd graph from the output to learn which
   parameters will get a gradient (the *expected* ones). Then, at the first gradient, one small
   allreduce (max) of which parameters have a gradient on each rank is queued ahead of every
   bucket: the others contribute zeros (or what ``no_sync()`` accumulated), and one that no
   rank has keeps ``.grad`` None, as with torch's DDP (``find_unused_parameters`` only).
2. Each parameter's ``Tensor.register_post_accumulate_grad_hook`` (public API) fires when its
   ``.grad`` is final for this backward: the hook stamps the time, copies ``.grad`` into the
   parameter's slot of its bucket and makes the slot the ``.grad`` (a view of the bucket, as
   torch's ``gradient_as_bucket_view``; the tensor autograd made is freed at the next forward,
   where plain torch frees its gradients; a gradient laid out with other strides keeps its own
   tensor and is copied back instead), and, once a bucket's last slot is filled and every earlier
   bucket has been launched, *launches* it: queues its allreduce (op ``mean``) on the
   wrapper's one communication thread. Buckets launch in plan order on every rank, whatever
   order the hooks fire in, so the collectives match across ranks.
3. The end of backward is the hook of the last expected gradient (a public mechanism, unlike
   autograd's internal ``queue_callback``): it waits for every launched allreduce (with a
   deadline); the gradients, views of the buckets, then hold the mean. So when
   ``loss.backward()`` returns, every ``.grad`` holds the mean over ranks. A backward that ends without some expected
   gradient (an unused parameter, ``find_unused_parameters=False``) is reported by the next
   ``forward`` with the names of the parameters that got none, as torch's DDP does; a gradient
   for a parameter that ``find_unused_parameters`` counted unused (a loss term taken from the
   module's parameters, not from the outputs) is an error naming it, and so is a backward through
   the outputs of a forward that a later one superseded (each forward finds what its own outputs
   reach; the last one decides) where that reaches parameters the last one does not. A backward whose
   communication failed raises that CommError, and every later ``forward`` raises a
   CommError that names it (the communicator is broken; nothing more can be averaged). Only a
   backward begun by the wrapper's ``forward`` is averaged: one through the module itself
   afterwards stays local, as with torch's DDP. A forward under ``torch.no_grad()`` between a
   synchronizing forward and its backward (an evaluation) changes nothing; a forward that
   tracks gradients under ``no_sync()`` starts a local pass: the backward after it accumulates
   without communicating.
4. *Planning*: the first ``warmup_iterations + profile_iterations`` iterations use one bucket
   (reduced after backward, so the hooks time backward undisturbed), laid out in reverse
   registration order. Then the profile (per-parameter backward times, mean over ranks, rank
   0's observed order) and the sweep's allreduce cost go to ``ringtrain.plan.merge`` with the
   chosen schedule, and the buckets are laid out again. Every ``replan_interval`` iterations
   the profile is exchanged again and the plan re-made if the ready curve drifted by more than
   ``drift_threshold`` of the backward time (or the order changed). Plans are logged on the
   ``ringtrain.ddp`` logger (INFO on rank 0).
5. *Trial* (``schedule="optimal"``, ``verify_iterations`` > 0; :mod:`.trial` has its words and
   steps): after the first plan, the wrapper measures what the model cannot know. Probe plans
   and one allreduce after backward give the *interference* (backward time lost per overlapped
   allreduce and per overlapped byte, and how much slower allreduces run while backward does:
   ``ringtrain.plan.Interference``); the optimal plan is made again with it. Then *candidates*
   take turns, one iteration each (every bucket layout kept, so all meet the same machine load):
   that plan, the optimal plan of free overlap (as on a GPU: where the fitted interference
   over-charges overlap it merges less), the single allreduce, and torch DDP's default buckets
   (so that the schedule kept is never slower than DDP's own grouping beyond the trial's
   noise). The fastest median forward+backward (the slowest rank's) stays, with more rounds
   where the two fastest are close; the earlier of equals (a margin towards fewer allreduces
   was tried in two benchmark sets and dropped: among near-equals it keeps the plan that hides
   less, down to one allreduce after backward). ``planned_with`` is the interference it was
   planned with, ``fell_back`` says the single allreduce won, ``kept`` which candidate did,
   ``trial`` what was timed. The one kept is laid out afresh and re-plans keep its way of
   planning (the single allreduce and DDP's buckets, which the profile does not change, are
   not re-planned). ``settled`` is True once the trial is over.

With one rank the mean is the gradient itself: hooks only stamp and count (for stats and for
the unused-parameter check) and nothing is copied or sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn

from .. import plan as planner
from ..collectives.ops import check_cpu_module
from ..comm import ALGORITHMS, Communicator
from ..errors import CommError, CommTimeout
from . import buckets as bucketing
from . import calibration
from .comm_thread import CommThread
from .timeline import IterationStats, TraceRecorder, hidden_fraction
from .trial import FIXED_CANDIDATES, PlanTrial

logger = logging.getLogger("ringtrain.ddp")
_NAN = float("nan")

SCHEDULES = planner.METHODS


@dataclass(kw_only=True, slots=True)
class DDPOptions:
    """The wrapper's settings (validated here; the constructor's keywords)."""

    schedule: str = "optimal"
    """How gradients are merged into allreduces: one of ``ringtrain.plan.METHODS``."""
    bucket_cap_mb: float = 25.0
    """Bucket size threshold in MiB for ``schedule="fixed"``."""
    algorithm: str = "auto"
    """Allreduce algorithm (``ringtrain.comm.ALGORITHMS``)."""
    timeline: Optional[str | os.PathLike] = None
    """Trace file name; each rank writes ``<stem>.rank<r><suffix>``. None: no trace."""
    timeline_iterations: int = 10
    """Iterations recorded in the trace (from the first one with the measured plan)."""
    find_unused_parameters: bool = False
    """Find, at each forward, the parameters that will get no gradient; they contribute zeros (or
    what ``no_sync()`` accumulated in their ``.grad``). One that no rank has a gradient for keeps
    its ``.grad`` (None stays None), as with torch's DDP."""
    broadcast_buffers: bool = True
    """Copy rank 0's module buffers to every rank at each forward (torch DDP's default)."""
    warmup_iterations: int = 1
    """Synchronizing iterations before profiling starts (first-iteration costs excluded)."""
    profile_iterations: int = 2
    """Synchronizing iterations timed for the first plan (per-parameter median)."""
    replan_interval: int = 50
    """Re-check the profile every so many iterations after the first plan (0: never)."""
    drift_threshold: float = 0.2
    """Re-plan when the ready curve moved by more than this share of the backward time."""
    verify_iterations: int = 5
    """schedule="optimal" only: iterations per phase of the trial (module docstring, item 5):
    the probe plans and one allreduce after backward measure the interference, then the plan
    made with it, the plan made without it and the single allreduce alternate, as many
    iterations each, and the fastest median forward+backward stays (0: no trial; trust the
    model)."""
    gradient_as_bucket_view: bool = True
    """After backward each ``.grad`` is a view of its bucket (no copy back; torch's option of
    the same name). The bucket is reused by the next synchronizing backward: a reference to a
    ``.grad`` kept across iterations sees it change, and a post-accumulate-grad hook of the
    user's registered after the wrapper's sees a gradient whose bucket may already be in
    flight. False: every ``.grad`` keeps its own tensor and gets the mean copied back."""
    interference: Optional[planner.Interference] = None
    """Backward time lost per overlapped allreduce; None: measured by the trial's probes
    (schedule="optimal" with verify_iterations > 0), else taken as none."""
    alpha: Optional[float] = None
    """Allreduce start-up time in seconds; None: measured by a sweep at construction."""
    beta: Optional[float] = None
    """Allreduce time per byte in seconds; None: measured by a sweep at construction."""
    cost: Optional[planner.CostFn] = None
    """Instead of alpha and beta: the allreduce's cost, ``cost(nbytes) -> seconds`` (e.g. the
    ``ringtrain.plan.SplitCost`` that :func:`.calibration.sweep_cost` measured once for several
    wrappers); None: alpha and beta, or the sweep."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: accepted values are {', '.join(SCHEDULES)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r}: accepted values are {', '.join(ALGORITHMS)}")
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"bucket_cap_mb={cap!r}: it must be a finite number of MiB > 0 (e.g. 25)")
        for name, low in (("timeline_iterations", 1), ("warmup_iterations", 0), ("profile_iterations", 1),
                          ("replan_interval", 0), ("verify_iterations", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r}: it must be an integer >= {low}")
        if not isinstance(self.drift_threshold, (int, float)) or not self.drift_threshold > 0:
            raise ValueError(f"drift_threshold={self.drift_threshold!r}: it must be a number > 0")
        if self.timeline is not None and not isinstance(self.timeline, (str, os.PathLike)):
            raise ValueError(f"timeline={self.timeline!r}: it must be a file name (str or os.PathLike) or None")
        for name in ("find_unused_parameters", "broadcast_buffers", "gradient_as_bucket_view"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: it must be True or False")
        if self.interference is not None and not isinstance(self.interference, planner.Interference):
            raise ValueError(f"interference={self.interference!r}: it must be a ringtrain.plan.Interference or None")
        if (self.alpha is None) != (self.beta is None):
            raise ValueError("give both alpha and beta (to skip the calibration sweep) or neither")
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not value >= 0):
                raise ValueError(f"{name}={value!r}: it must be a number >= 0")
        if self.cost is not None and (self.alpha is not None or not callable(self.cost)):
            raise ValueError(f"cost={self.cost!r}: give a callable nbytes -> seconds, or alpha and beta, not both")


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper: ``ddp(x)`` runs ``module(x)``; after ``loss.backward()`` every
    parameter's ``.grad`` is the mean over ranks. See the module docstring for how.

    ``comm``: a ``ringtrain.Communicator`` (default: the one made by ``ringtrain.init``). While
    a backward pass is in flight the wrapper's thread owns it; use it freely otherwise.
    Other keywords: :class:`DDPOptions`.
    """

    def __init__(self, module: nn.Module, comm=None, schedule: str = "optimal", bucket_cap_mb: float = 25.0,
                 algorithm: str = "auto", timeline=None, find_unused_parameters: bool = False, **options: Any):
        super().__init__()
        opts = DDPOptions(schedule=schedule, bucket_cap_mb=bucket_cap_mb, algorithm=algorithm, timeline=timeline,
                          find_unused_parameters=find_unused_parameters, **options)
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_cpu_module(module, "ringtrain.DistributedDataParallel")
        if comm is None:
            from .. import get_communicator

            comm = get_communicator()
        if not isinstance(comm, Communicator):
            raise ValueError(f"comm must be a ringtrain.Communicator (or None: the one made by ringtrain.init), "
                             f"got {comm!r}")
        self.module = module
        self.options = opts
        self.comm = comm
        self.rank = comm.rank
        self.world_size = comm.world_size
        self._timeout = comm.timeout + 10.0
        self._recorder = None
        if opts.timeline is not None:  # before any thread or hook: an unwritable path fails here (ValueError)
            # Origin 0 of perf_counter (CLOCK_MONOTONIC on Linux, shared by the processes of a
            # host): the ranks of one host line up in Perfetto and in draw_timeline.
            self._recorder = TraceRecorder(opts.timeline, self.rank, opts.timeline_iterations, origin=0.0)
        self._thread = CommThread(f"ringtrain-ddp-comm-{comm.rank}")
        self._hooks: list = []
        self._closed = False
        try:
            names = {id(p): n for n, p in module.named_parameters()}
            self._params = [p for p in module.parameters() if p.requires_grad]
            self._names = [names[id(p)] for p in self._params]
            # Frozen at construction: no hook, no slot. One that requires a gradient later is refused.
            self._frozen = [(names[id(p)], p) for p in module.parameters() if not p.requires_grad]
            self._pid_of = {id(p): i for i, p in enumerate(self._params)}
            self._sizes = np.array([p.numel() * p.element_size() for p in self._params], dtype=np.float64)
            self._module_buffers = [b for b in module.buffers() if b.numel()]

            self._broadcast_tensors([p.data for p in module.parameters()] + self._module_buffers, "broadcast parameters")
            if opts.cost is not None:
                self.cost = opts.cost
            elif opts.alpha is not None:
                self.cost = planner.LinearCost(float(opts.alpha), float(opts.beta))
            else:
                self.cost = self._thread.run(
                    "calibration sweep", partial(calibration.sweep_cost, comm, opts.algorithm,
                                                 calibration.sweep_sizes(float(self._sizes.sum()))), self._timeout * 8)
            self.alpha = float(getattr(self.cost, "alpha", self.cost(0.0)))  # start-up of the larger messages
            self.beta = float(getattr(self.cost, "beta", float("nan")))
            given = "allreduce sweep" if opts.cost is None and opts.alpha is None else "given"
            self._log(f"allreduce cost {_cost_text(self.cost)} ({given}), world_size={self.world_size}")

            n = len(self._params)
            self._profile_rows: deque = deque(maxlen=opts.profile_iterations)
            self._plan_times = np.zeros(n)
            self._trial: Optional[PlanTrial] = None  # under way: the trial of plans (verify_iterations)
            self._kept = "plan"  # the trial's candidate in force (trial.CANDIDATES)
            self._trial_record: list[dict] = []  # what the trial measured (the ``trial`` property)
            self.interference = opts.interference or planner.NO_INTERFERENCE
            first = list(range(n - 1, -1, -1))  # reverse registration order, as torch's DDP starts
            self._install(first, planner.merge([0.0] * n, self._sizes[first], cost=self.cost, method="single"))

            self.stats: deque[IterationStats] = deque(maxlen=1000)
            self._lock = threading.Lock()
            # Mutable state lives in one plain object: nn.Module.__setattr__ is too slow for hooks.
            self._s = _State(n)
            self._reset_iteration()
            # The hooks hold the wrapper weakly: the module outlives it, and a wrapper it kept alive
            # would never be collected (nor its communication thread stopped).
            me = weakref.ref(self)
            self._hooks = [p.register_post_accumulate_grad_hook(partial(_grad_hook, me, pid))
                           for pid, p in enumerate(self._params)]
        except BaseException:  # a failed broadcast or sweep (ranks disagree, a peer lost): leave nothing behind
            for h in self._hooks:
                h.remove()
            self._thread.close()
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._thread, self._recorder, self._hooks)

    # --- public ------------------------------------------------------------------------------

    @property
    def plan(self) -> planner.Plan:
        """The plan the buckets are laid out by (layers = parameters in backward order)."""
        return self._plan

    @property
    def buckets(self) -> list[bucketing.BucketSpec]:
        return list(self._specs)

    @property
    def order(self) -> list[int]:
        """Parameter ids in the backward order the plan uses."""
        return list(self._order)

    @property
    def settled(self) -> bool:
        """True once the first plan is made and its trial (probes, verification) is over."""
        opts = self.options
        return self._trial is None and self._s.iteration >= opts.warmup_iterations + opts.profile_iterations

    @property
    def fell_back(self) -> bool:
        """True when the trial measured one allreduce after backward to be the fastest candidate."""
        return self._kept == "single"

    @property
    def kept(self) -> str:
        """The trial's candidate in force (a key of ``ringtrain.ddp.trial.CANDIDATES``; "plan"
        before or without a trial)."""
        return self._kept

    @property
    def trial(self) -> list[dict]:
        """The trial's candidates as it timed them (empty before it ends, or where it had one
        candidate): per candidate ``label`` (a key of ``ringtrain.ddp.trial.CANDIDATES``),
        ``groups``, the slowest rank's median forward+backward ``median_s`` over the ``rounds`` it
        ran; ``kept`` marks the one in force."""
        return [dict(c) for c in self._trial_record]

    @property
    def planned_with(self) -> planner.Interference:
        """The interference the plan in force was made with: the measured one, or none where
        the trial measured the plan of free overlap to be the fastest."""
        return planner.Interference() if self._kept == "free" else self.interference

    @property
    def iteration(self) -> int:
        """Synchronizing backward passes completed."""
        return self._s.iteration

    @property
    def last_stats(self) -> Optional[IterationStats]:
        return self.stats[-1] if self.stats else None

    @property
    def timeline_path(self):
        return None if self._recorder is None else self._recorder.path

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("ringtrain.DistributedDataParallel: this wrapper was closed; its gradients would no "
                               "longer be averaged. Wrap the module again (or call the module itself for local work).")
        st = self._s
        st.retired.clear()
        if st.failed is not None:
            raise self._failed_backward_error()
        if st.active:
            raise self._missing_gradients_error()
        if self._frozen and torch.is_grad_enabled():
            self._check_still_frozen()
        t0 = time.perf_counter()
        if self.options.broadcast_buffers and self.world_size > 1 and self._module_buffers:
            self._broadcast_tensors(self._module_buffers, "broadcast buffers")
        broadcast_s = time.perf_counter() - t0
        out = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():
            if st.sync:
                self._arm(out)
                st.broadcast_s = broadcast_s
                st.forward_span = (t0, time.perf_counter())
            else:  # a no_sync() pass: the backward that follows accumulates locally
                st.armed = False
        return out

    def _check_still_frozen(self) -> None:
        """Refuse a forward where a parameter frozen at construction now requires a gradient: the
        wrapper has no hook on it, so its gradient would stay local on each rank."""
        thawed = [name for name, p in self._frozen if p.requires_grad]
        if thawed:
            raise RuntimeError(
                f"ringtrain.DistributedDataParallel: parameters {thawed} did not require a gradient when the "
                "wrapper was made and do now, so their gradients would not be averaged. Set requires_grad before "
                "wrapping: to change it during training, close this wrapper and wrap the module again.")

    def _arm(self, out: Any) -> None:
        """Make the backward of a synchronizing forward's outputs average the gradients. Only such
        a forward arms (and sets what it expects): one under ``torch.no_grad()`` between it and
        its backward (an evaluation, say) leaves that backward armed."""
        st = self._s
        outputs = [t for t in _tensors(out) if t.grad_fn is not None]
        reached = None
        if self.options.find_unused_parameters:
            # No tensor with a graph found in the output: nothing to walk, all are expected.
            used = _reachable_params(outputs, self._pid_of) if outputs else range(len(self._params))
            st.expected = len(used)
            st.unused = {pid for pid in range(len(self._params)) if pid not in used}
            reached = frozenset(used)
        st.generation += 1
        if not st.armed:  # (else this one supersedes an armed forward whose backward has not begun)
            st.first_armed = st.generation
        st.armed = True
        me = weakref.ref(self)
        for t in outputs:
            t.register_hook(partial(_backward_start_hook, me, st.generation, reached))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward passes inside accumulate local gradients without communicating;
        the first synchronizing backward after it averages the accumulated gradients."""
        old, self._s.sync = self._s.sync, False
        try:
            yield
        finally:
            self._s.sync = old

    def close(self) -> None:
        """Write the trace file, remove the hooks, stop the communication thread (idempotent).
        The communicator stays open: it belongs to the caller."""
        self._closed = True
        self._s.retired.clear()
        self._finalizer()  # (removes the hooks)

    # --- hooks -------------------------------------------------------------------------------

    def _on_backward_start(self, generation: int, reached: Optional[frozenset], grad: torch.Tensor) -> None:
        st = self._s
        if reached is not None and st.first_armed <= generation < st.generation:
            # find_unused_parameters: this backward goes through the outputs of a forward that a
            # later one superseded before any backward; the later one decided what is unused.
            late = reached & st.unused
            if late:
                raise self._earlier_forward_error(late)
        if st.armed and st.bwd_start is None:
            st.bwd_start = time.perf_counter()

    def _on_grad_ready(self, pid: int, param: torch.Tensor) -> None:
        st = self._s
        if not st.armed:
            return
        now = time.perf_counter()
        with self._lock:
            try:
                self._take_gradient(pid, param, now)
            except BaseException:
                # The backward stops here: abandon the iteration (its own errors already did), so
                # that this error, not "missing gradients" at the next forward, is what is seen.
                if st.active:
                    self._abandon_iteration()
                raise

    def _take_gradient(self, pid: int, param: torch.Tensor, now: float) -> None:
        st = self._s
        if not st.active:
            self._begin_backward(now)
        if pid in st.unused:
            raise self._unused_got_gradient_error(pid)
        if st.got[pid]:
            # A second gradient before the first backward ended: that one lacked some.
            raise self._missing_gradients_error()
        st.got[pid] = 1
        st.stamps[pid] = now
        st.last = now
        st.ready += 1
        if self.world_size > 1:
            self._into_slot(pid, param, param.grad)
            self._mark_ready(self._bucket_index[pid])
        st.hooks_s += time.perf_counter() - now
        if st.ready == st.expected:
            self._end_backward()

    def _into_slot(self, pid: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Copy ``grad`` into the parameter's bucket slot, which becomes its ``.grad`` where the
        layouts agree (``gradient_as_bucket_view``)."""
        if grad.is_sparse:
            raise ValueError(f"parameter {self._names[pid]!r} has a sparse gradient; "
                             "ringtrain.DistributedDataParallel reduces dense gradients only")
        slot = self._slots[pid]
        if grad.data_ptr() == slot.data_ptr():  # accumulated in place into the slot: nothing to copy
            return
        slot.copy_(grad)
        if self.options.gradient_as_bucket_view and grad.stride() == slot.stride():
            # The slot becomes the gradient: when the bucket's allreduce ends, .grad already
            # holds the mean, with no copy back (torch's gradient_as_bucket_view).
            param.grad = slot
            self._s.retired.append(grad)  # freed at the next forward (see _State.retired)

    def _begin_backward(self, now: float) -> None:
        st = self._s
        st.active = True
        st.first = now
        if self.world_size == 1:
            return
        if self.options.find_unused_parameters:
            self._launch_used_bitmap()  # before any bucket: every rank queues it first
        for pid in st.unused:  # find_unused_parameters: no gradient from this backward
            param = self._params[pid]
            if param.grad is None:  # it contributes zeros
                self._slots[pid].zero_()
            else:  # it contributes what no_sync() accumulated
                self._into_slot(pid, param, param.grad)
            self._mark_ready(self._bucket_index[pid])

    def _launch_used_bitmap(self) -> None:
        """Queue the allreduce (max) of which parameters have a gradient on this rank: used in
        this backward, or accumulated under ``no_sync()``. One that no rank has keeps its
        ``.grad`` (None stays None), as torch's DDP does."""
        st = self._s
        st.used = np.ones(len(self._params), dtype=np.uint8)
        for pid in st.unused:
            st.used[pid] = self._params[pid].grad is not None
        st.used_job = self._thread.submit("allreduce used parameters",
                                          partial(self.comm.allreduce, st.used, "max", "auto"), st.used.nbytes)

    def _unused_everywhere(self) -> set[int]:
        """Ids of the parameters no rank has a gradient for (after :meth:`_launch_used_bitmap`)."""
        st = self._s
        if st.used_job is None:
            return set()
        st.used_job.wait(self._timeout)  # queued before every bucket: normally over already
        return {pid for pid in st.unused if not st.used[pid]}

    def _mark_ready(self, bucket: int) -> None:
        st = self._s
        st.pending[bucket] -= 1
        while st.launched < len(self._specs) and st.pending[st.launched] == 0:
            k = st.launched
            job = self._thread.submit(
                f"allreduce bucket {k}",
                partial(self.comm.allreduce, self._bufs[k], "mean", self.options.algorithm),
                self._specs[k].nbytes,
            )
            st.jobs.append(job)
            st.launched += 1

    def _end_backward(self) -> None:
        """Finish the iteration; on any error reset it (the error is the news, not missing
        gradients) and, for a CommError, remember it for the next forward to report."""
        try:
            self._finish_backward()
        except BaseException as exc:
            self._reset_iteration()
            if isinstance(exc, CommError):
                self._s.failed = exc
            raise

    def _finish_backward(self) -> None:
        st = self._s
        t_last = st.last
        copies: list[tuple[str, float, float]] = []  # (what, start, end) of each copy back, if any
        if self.world_size > 1:
            if st.launched != len(self._specs):
                raise RuntimeError(f"internal error: {st.launched} of {len(self._specs)} buckets launched at the "
                                   "end of backward")
            unused = self._unused_everywhere()
            for k, job in enumerate(st.jobs):
                if not self._needs_copy(self._specs[k], unused):
                    continue  # its .grad is a view of the bucket: nothing to wait for here
                # Copy bucket k back while the communication thread reduces the next ones.
                job.wait(self._timeout)
                t0 = time.perf_counter()
                self._copy_back(self._specs[k], unused)
                copies.append((f"bucket {k}", t0, time.perf_counter()))
            self._settle(st.jobs)
            for job in st.jobs:  # (all ended: re-raises the first error, not the later ones' "communicator is broken")
                job.wait(self._timeout)
            t1 = time.perf_counter()
            copies.append(("the last allreduce", t1, t1))  # a wait, nothing to copy
        t_done = time.perf_counter()
        traced = self._record(t_last, copies, t_done)
        self._profile()
        st.iteration += 1
        self._reset_iteration()
        if traced:  # last, once the iteration is accounted for: this may write the trace file
            self._recorder.end_iteration()

    def _settle(self, jobs: list) -> None:
        """Block until every job has ended, each within a deadline of its own: ``self._timeout``
        from the end of the job before it (or from now, if that one ended before). Allreduces that
        are each slow but within the deadline are no timeout, however many there are.

        Jobs run in order, so waiting for the last one waits for all: normally one wake-up. A
        wait per bucket woke this thread once per allreduce on every rank: wfbp on the CNN at 4
        ranks / 10 Gbit/s (107 allreduces) left 3-4 ms per iteration between allreduces on the
        communication thread, 0.6 ms with the one wait."""
        start = time.perf_counter()
        k = 0  # the first job not ended
        while True:
            while k < len(jobs) and jobs[k].done:
                k += 1
            if k == len(jobs):
                return
            since = max(start, jobs[k - 1].ended) if k else start
            left = since + self._timeout - time.perf_counter()
            if left <= 0:
                raise CommTimeout(f"communication job {jobs[k].label!r} did not finish within {self._timeout:.1f} s")
            with contextlib.suppress(CommTimeout):  # (then: has the first one not ended moved on?)
                jobs[-1].settle(left)

    def _needs_copy(self, spec: bucketing.BucketSpec, unused: set[int]) -> bool:
        """Whether some parameter of the bucket needs ``_copy_back`` (a ``.grad`` that is not
        its slot; ``unused``: the parameters no rank has a gradient for, left alone)."""
        for pid in spec.pids:
            grad = self._params[pid].grad
            if grad is None:
                if pid not in unused:
                    return True
            elif grad.data_ptr() != self._slots[pid].data_ptr():
                return True
        return False

    def _copy_back(self, spec: bucketing.BucketSpec, unused: set[int]) -> None:
        """Every parameter of the bucket gets the mean over ranks as its ``.grad``, but those
        in ``unused`` (no rank has a gradient for them: their ``.grad`` stays None)."""
        with torch.no_grad():
            for pid in spec.pids:
                p, slot = self._params[pid], self._slots[pid]
                if p.grad is None:  # find_unused_parameters: unused here, maybe used elsewhere
                    if pid not in unused:
                        p.grad = slot if self.options.gradient_as_bucket_view else slot.clone()
                elif p.grad.data_ptr() != slot.data_ptr():  # a gradient laid out unlike its slot
                    p.grad.copy_(slot)

    # --- bookkeeping ---------------------------------------------------------------------------

    def _reset_iteration(self) -> None:
        st = self._s
        n = len(self._params)
        st.active = False
        st.armed = False  # a backward not begun by this wrapper's forward stays local, as with torch's DDP
        st.pending = list(self._counts)
        st.launched = 0
        st.jobs = []
        st.used_job = None
        st.used = None
        st.ready = 0
        st.got = bytearray(n)
        st.stamps = [_NAN] * n
        st.bwd_start = None
        st.hooks_s = 0.0
        if not self.options.find_unused_parameters:
            st.expected = n

    def _failed_backward_error(self) -> CommError:
        failed = self._s.failed
        error = CommError(
            f"ringtrain.DistributedDataParallel (rank {self.rank}): the previous backward pass's communication "
            f"failed, so its gradients were not averaged and this wrapper cannot go on: "
            f"{type(failed).__name__}: {failed}. The communicator is broken: create a new one (ringtrain.init) "
            "and a new wrapper, or restart from the last checkpoint.")
        error.__cause__ = failed
        return error

    def _unused_got_gradient_error(self, pid: int) -> RuntimeError:
        cause = self._abandon_iteration()
        error = RuntimeError(
            f"ringtrain.DistributedDataParallel: parameter {self._names[pid]!r} got a gradient, but the forward's "
            "outputs do not reach it, so find_unused_parameters=True counted it as unused and its bucket was "
            "already averaged with zeros for it. Compute every term of the loss from the wrapper's outputs "
            "(not from the module's parameters directly), or run that part inside the wrapper's forward.")
        error.__cause__ = cause
        return error

    def _earlier_forward_error(self, late: frozenset) -> RuntimeError:
        cause = self._abandon_iteration()
        names = [self._names[pid] for pid in sorted(late)]
        error = RuntimeError(
            "ringtrain.DistributedDataParallel: this backward pass goes through the outputs of an earlier forward "
            "of the wrapper than the last one before it. With find_unused_parameters=True each forward finds the "
            f"parameters its outputs reach and the last one decides: it counted {names} unused, so their gradients "
            "from this backward would not be averaged. Call the wrapper once for the loss (e.g. on the "
            "concatenated inputs), or backpropagate each forward's loss before the next forward.")
        error.__cause__ = cause
        return error

    def _abandon_iteration(self) -> Optional[BaseException]:
        """Let launched jobs finish before their buffers are reused, and start afresh. The first
        error a job ended with (its communication failed: the communicator is broken) is kept for
        the next forward to report, and returned: the error being raised names it as its cause."""
        st = self._s
        error = None
        for job in ([st.used_job] if st.used_job is not None else []) + st.jobs:
            try:
                job.wait(self._timeout)
            except Exception as exc:  # noqa: BLE001 - kept and chained, not dropped
                error = error or exc
        self._reset_iteration()
        if error is not None and st.failed is None:
            st.failed = error
        return error

    def _missing_gradients_error(self) -> RuntimeError:
        st = self._s
        # (those find_unused_parameters counted unused got none, as expected: not missing)
        missing = [pid for pid in range(len(self._params)) if not st.got[pid] and pid not in st.unused]
        frozen = [self._names[pid] for pid in missing if not self._params[pid].requires_grad]
        missing = [self._names[pid] for pid in missing]
        expected = len(self._params) - len(st.unused)
        cause = self._abandon_iteration()
        hint = ("Some parameters were expected to get a gradient (find_unused_parameters=True found them in the "
                "autograd graph) but did not" if self.options.find_unused_parameters else
                "Pass find_unused_parameters=True to DistributedDataParallel if some parameters legitimately get no "
                "gradient in some iterations (they then contribute zeros; one no rank uses keeps .grad None), or "
                "make every parameter reach the loss")
        if frozen:
            hint = (f"Of these, some have requires_grad=False since the wrapper was made: {frozen}. Set requires_grad "
                    "before wrapping (to change it during training, close this wrapper and wrap the module again), "
                    "or pass find_unused_parameters=True: frozen parameters then count as unused")
        error = RuntimeError(
            f"ringtrain.DistributedDataParallel: the previous backward pass ended without a gradient for "
            f"{len(missing)} of the {expected} parameters expected, so their allreduce never ran: {missing}. "
            f"{hint}. (A backward that raised an exception outside this wrapper's hooks ends so too: "
            "then that exception is the one to fix.)")
        error.__cause__ = cause
        return error

    def _record(self, t_last: float, copies: list[tuple[str, float, float]], t_done: float) -> bool:
        """Append the iteration's stats and record its spans in the trace; True when it did (the
        trace's iteration then still has to be ended)."""
        st = self._s
        start = st.first if st.bwd_start is None else st.bwd_start
        end = t_last
        spans = [(j.started, j.ended) for j in st.jobs]
        last_comm = max((b for _, b in spans), default=end)
        fwd = st.forward_span or (start, start)
        self.stats.append(IterationStats(
            iteration=st.iteration, forward_s=fwd[1] - fwd[0], backward_s=end - start, first_ready_s=st.first - start,
            comm_s=sum(b - a for a, b in spans), exposed_s=max(0.0, last_comm - end), wait_s=t_done - t_last,
            hidden_fraction=hidden_fraction(spans, start, end), buckets=len(spans),
            predicted_end_s=self._plan.end_time, measured_end_s=max(last_comm, end) - start,
            forward_backward_s=t_done - fwd[0], broadcast_s=st.broadcast_s, hooks_s=st.hooks_s))
        rec = self._recorder
        if rec is None or not rec.recording:
            return False
        it = st.iteration
        if not self.settled:  # the plan in force, not the profiling or the trial's probes
            return False
        rec.span("forward", "forward", "compute", fwd[0], fwd[1], iteration=it)
        prev = start
        stamps = np.array(st.stamps)
        for pid in calibration.observed_order(stamps):
            t = stamps[pid]
            if not np.isfinite(t):
                break
            rec.span(f"backward {self._names[pid]}", "backward", "compute", prev, t, iteration=it)
            prev = t
        for k, job in enumerate(st.jobs):
            rec.span(f"allreduce bucket {k}", "allreduce", "communication", job.started, job.ended, iteration=it,
                     bytes=job.nbytes, params=len(self._specs[k].pids))
        prev = t_last
        for what, a, b in copies:
            if a > prev:
                rec.span(f"wait for {what}", "wait", "compute", prev, a, iteration=it)
            if b > a:
                rec.span(f"copy back {what}", "copy", "compute", a, b, iteration=it)
            prev = max(prev, b)
        return True  # (the caller ends the trace's iteration)

    def _profile(self) -> None:
        opts = self.options
        it = self._s.iteration
        if it < opts.warmup_iterations:
            return
        # Raw stamps are kept; gaps are computed only when a plan is (re-)made.
        self._profile_rows.append((self._s.stamps, self._s.bwd_start))
        planned_at = opts.warmup_iterations + opts.profile_iterations - 1
        if it == planned_at:
            self._replan(first=True)
            if opts.verify_iterations and opts.schedule == "optimal" and self.world_size > 1:
                self._start_trial()
        elif self._trial is not None:
            self._verify_step()
        elif opts.replan_interval and it > planned_at and (it - planned_at) % opts.replan_interval == 0:
            self._replan(first=False)

    def _start_trial(self) -> None:
        """Start the trial of plans (module docstring, item 5; :mod:`.trial`)."""
        self._trial = trial = PlanTrial(
            self._plan_times, self._sizes[self._order], self.cost, self.interference, self.options.verify_iterations,
            probe=self.options.interference is None, install=_weakly(self._install_in_order),
            use=_weakly(self._use_layout), agree=_weakly(self._agree), log=_weakly(self._log))
        trial.start()
        self._trial_over_if(trial.over)

    def _verify_step(self) -> None:
        """One trial iteration done (the slowest rank's medians decide: :class:`.trial.PlanTrial`)."""
        last = self.stats[-1]
        over = self._trial.step((last.backward_s, last.forward_backward_s, last.measured_end_s))
        self._trial_over_if(over)

    def _trial_over_if(self, over: bool) -> None:
        trial = self._trial
        self.interference = trial.interference
        if over:
            self._trial = None
            self._kept = trial.kept
            self._trial_record = trial.record

    def _install_in_order(self, plan: planner.Plan) -> tuple:
        """The trial's ``install``: buckets for ``plan`` over the profiled order, in force."""
        self._install(self._order, plan)
        return self._layout(), self._specs

    def _agree(self, label: str, values: np.ndarray, op: str) -> None:
        """The trial's ``agree``: ``values`` reduced in place over the ranks (``op`` "max"), or
        rank 0's copied to all (``op`` "broadcast"), on the communication thread."""
        if op == "broadcast":
            call = partial(self.comm.broadcast, values, 0)
        else:
            call = partial(self.comm.allreduce, values, op, "auto")
        self._thread.run(label, call, self._timeout)

    def _replan(self, first: bool) -> None:
        local = calibration.local_profile([calibration.gaps(np.array(stamps), _NAN if start is None else start)
                                           for stamps, start in self._profile_rows])
        mine = calibration.observed_order(np.array(self._s.stamps))
        t0 = time.perf_counter()
        exchange = partial(calibration.exchange_profile, self.comm, local, mine)
        times, order = self._thread.run("profile exchange", exchange, self._timeout)
        if self._recorder is not None:
            self._recorder.span("profile exchange", "calibration", "communication", t0, time.perf_counter(),
                                iteration=self._s.iteration)
        order = bucketing.check_order(order, len(self._params))
        if not first and self._kept in FIXED_CANDIDATES:  # measured faster here; the profile does not move them
            return
        if not first:
            # Profiled under the plan in force: take out the delays it put into the gaps, as
            # modelled, so that neither the drift nor the next plan counts them twice.
            in_plan_order = calibration.without_interference(times[self._order], self._plan, self.interference)
            times = times.copy()
            times[self._order] = in_plan_order
            moved = calibration.drift(self._plan_times, in_plan_order)
            if moved <= self.options.drift_threshold and order == self._order:
                return
            self._log(f"backward profile drifted by {100 * moved:.0f}% of the backward time; re-planning")
        ordered = times[order]
        plan = planner.merge(ordered, self._sizes[order], cost=self.cost, method=self.options.schedule,
                             bucket_cap_mb=self.options.bucket_cap_mb, interference=self.interference,
                             planned_with=self.planned_with)
        self._plan_times = ordered
        self._install(order, plan)
        self._log(f"plan ({plan.method}, {_cost_text(self.cost)}): "
                  f"{len(plan.groups)} groups {plan.groups}, predicted end {plan.end_time * 1e3:.3f} ms "
                  f"(backward {plan.backward_time * 1e3:.3f} ms, communication {plan.comm_time * 1e3:.3f} ms, "
                  f"{100 * plan.hidden_fraction:.0f}% hidden)")

    def _install(self, order: list[int], plan: planner.Plan) -> None:
        """Lay out buckets for ``plan`` over ``order`` and allocate their buffers."""
        params = self._params
        specs = bucketing.layout(order, plan.groups, [p.numel() for p in params], [p.dtype for p in params],
                                 [p.element_size() for p in params])
        self._order = list(order)
        self._plan = plan
        self._specs = specs
        self._counts = [len(s.pids) for s in specs]
        self._bucket_index = [0] * len(params)
        self._slots: list[torch.Tensor] = [None] * len(params)  # type: ignore[list-item]
        if self.world_size == 1:  # nothing is copied or sent
            self._bufs = []
            return
        self._bufs = [torch.zeros(s.numel, dtype=s.dtype) for s in specs]
        for s, buf in zip(specs, self._bufs):
            for pid, off in zip(s.pids, s.offsets):
                p = params[pid]
                self._bucket_index[pid] = s.index
                self._slots[pid] = buf[off:off + p.numel()].view(p.shape)

    def _layout(self) -> tuple:
        """The buckets in force, as :meth:`_install` laid them out (for :meth:`_use_layout`)."""
        return self._order, self._plan, self._specs, self._counts, self._bucket_index, self._slots, self._bufs

    def _use_layout(self, layout: tuple) -> None:
        """Put buckets laid out earlier back in force (between iterations: none in flight).
        Gradients still views of the other buckets are copied in by the hooks as usual."""
        self._order, self._plan, self._specs, self._counts, self._bucket_index, self._slots, self._bufs = layout

    def _broadcast_tensors(self, tensors: list[torch.Tensor], label: str) -> None:
        """Copy rank 0's values of ``tensors`` to every rank: one broadcast of their bytes."""
        tensors = [t for t in tensors if t.numel()]
        if self.world_size == 1 or not tensors:
            return
        # Each tensor starts on an 8-byte boundary of the byte buffer: torch views bytes as a
        # wider dtype only at an offset that is a multiple of its size (an int64 counter after
        # 27 float32s would not be).
        spans, end = [], 0
        for t in tensors:
            start = -(-end // 8) * 8
            end = start + t.numel() * t.element_size()
            spans.append((start, end))
        with torch.no_grad():
            flat = torch.zeros(end, dtype=torch.uint8)
            for t, (a, b) in zip(tensors, spans):
                flat[a:b] = t.detach().contiguous().reshape(-1).view(torch.uint8)
            self._thread.run(label, partial(self.comm.broadcast, flat.numpy(), 0), self._timeout)
            for t, (a, b) in zip(tensors, spans):
                t.copy_(flat[a:b].view(t.dtype).view(t.shape))

    def _log(self, message: str) -> None:
        logger.log(logging.INFO if self.rank == 0 else logging.DEBUG, "rank %d: %s", self.rank, message)


class _State:
    """The wrapper's mutable run-time state (see the module docstring for the words)."""

    __slots__ = ("sync", "armed", "generation", "first_armed", "expected", "unused", "forward_span", "iteration",
                 "failed", "active", "pending", "launched", "jobs", "used", "used_job", "ready", "got", "stamps",
                 "bwd_start", "first", "last", "broadcast_s", "hooks_s", "retired")

    def __init__(self, n: int):
        self.sync = True  # False inside no_sync()
        self.armed = False  # the last forward asked for a synchronizing backward
        self.generation = 0  # synchronizing forwards so far (the last one's number)
        self.first_armed = 0  # the first of those since the last disarming (a backward's end, a no_sync() forward)
        self.expected = n  # gradients that end the backward pass
        self.unused: set[int] = set()  # find_unused_parameters: ids outside the graph
        self.forward_span: Optional[tuple[float, float]] = None
        self.broadcast_s = 0.0  # of the last forward
        self.iteration = 0
        self.failed: Optional[BaseException] = None  # the CommError a backward pass ended with
        self.used: Optional[np.ndarray] = None  # find_unused_parameters: 1 where some rank has a gradient
        self.used_job = None  # its allreduce (queued before every bucket)
        self.first = self.last = float("nan")  # first and last gradient stamps
        # Gradients autograd made that a bucket slot replaced as .grad, kept until the next forward:
        # plain torch frees its gradients there (zero_grad), and its allocator reuses the memory
        # for the forward's activations. Freed mid-backward instead, glibc handed the memory back
        # to the kernel and forward faulted it in again (the LM at 2 ranks: forward +3 ms, 2%).
        self.retired: list[torch.Tensor] = []


def _cost_text(cost: planner.CostFn) -> str:
    describe = getattr(cost, "describe", None)  # LinearCost, SplitCost
    return describe() if callable(describe) else repr(cost)


def _shutdown(thread: CommThread, recorder: Optional[TraceRecorder], hooks: list) -> None:
    """Remove the hooks, write the trace file, stop the communication thread (``close``, or
    the wrapper collected)."""
    for h in hooks:
        h.remove()
    hooks.clear()
    try:
        if recorder is not None:
            recorder.flush()
    finally:
        thread.close()


def _weakly(method):
    """``method`` called through a weak reference: what the wrapper lends its trial must not keep
    the wrapper alive (nor, through it, its communication thread)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


def _grad_hook(ddp: weakref.ref, pid: int, param: torch.Tensor) -> None:
    """Parameter ``pid``'s post-accumulate-grad hook; it holds the wrapper weakly."""
    wrapper = ddp()
    if wrapper is not None:
        wrapper._on_grad_ready(pid, param)


def _backward_start_hook(ddp: weakref.ref, generation: int, reached: Optional[frozenset],
                         grad: torch.Tensor) -> None:
    """An output's gradient hook (the backward start); it holds the wrapper weakly. ``generation``:
    the number of the forward that made the output; ``reached``: with find_unused_parameters,
    the ids of the parameters that forward's outputs reach (else None)."""
    wrapper = ddp()
    if wrapper is not None:
        wrapper._on_backward_start(generation, reached, grad)


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (nested tuples, lists, dicts and dataclasses)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in _tensors(item)]
    if isinstance(out, dict):
        return [t for item in out.values() for t in _tensors(item)]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [t for f in dataclasses.fields(out) for t in _tensors(getattr(out, f.name))]
    return []


try:
    from torch.utils.checkpoint import CheckpointFunction as _ReentrantCheckpoint
except ImportError:  # (a torch without it has no reentrant checkpoint to look for)
    _ReentrantCheckpoint = None


def _reachable_params(outputs: list[torch.Tensor], pid_of: dict[int, int]) -> set[int]:
    """Ids of the parameters whose gradient-accumulation nodes the outputs' graph reaches."""
    found: set[int] = set()
    seen: set = set()
    stack = [t.grad_fn for t in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf tensor
        if var is not None and id(var) in pid_of:
            found.add(pid_of[id(var)])
        elif _ReentrantCheckpoint is not None and getattr(node, "_forward_cls", None) is _ReentrantCheckpoint:
            # Its backward runs a backward of its own, from a graph made then: the parameters inside
            # are not in this one. They would count as unused, and their gradients come after the
            # averaged pass has ended, so they would stay local.
            raise RuntimeError(
                "ringtrain.DistributedDataParallel: find_unused_parameters=True cannot see the parameters "
                "inside a reentrant torch.utils.checkpoint (their gradients would not be averaged): pass "
                "use_reentrant=False to checkpoint(), or drop find_unused_parameters")
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found
