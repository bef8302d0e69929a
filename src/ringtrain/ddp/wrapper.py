"""DistributedDataParallel: gradients averaged over ranks while backward is still running.

How one synchronizing iteration goes (words of :mod:`.buckets`, :mod:`.calibration`,
:mod:`.timeline`):

1. ``forward`` runs the wrapped module (after broadcasting its buffers from rank 0 where the
   forward before it synchronized and tracked gradients, as torch's DDP does), puts a hook on the output's gradient to stamp the *backward start*, and, with
   ``find_unused_parameters=True``, walks the autograd graph from the output and passes the
   output's tensors through an :class:`.unused.OutputSink`, whose backward runs first and learns
   which parameters the outputs the loss used reach (the *expected* ones). Then, at the first gradient, one small
   allreduce (max) of which parameters have a gradient on each rank is queued ahead of every
   bucket: the others contribute zeros (or what ``no_sync()`` accumulated), and one that no
   rank has keeps ``.grad`` None, as with torch's DDP (``find_unused_parameters`` only).
2. Each parameter's ``Tensor.register_post_accumulate_grad_hook`` (public API) fires when its
   ``.grad`` is final for this backward: the hook stamps the time, copies ``.grad`` into the
   parameter's slot of its bucket (with ``gradient_as_bucket_view=True`` it makes the slot the
   ``.grad``, a view of the bucket, as torch's option of that name; the tensor autograd made is
   freed at the next forward, where plain torch frees its gradients; a gradient laid out with
   other strides keeps its own tensor and is copied back, as every one is by default), and,
   once a bucket's last slot is filled and every earlier bucket has been launched, *launches*
   it: queues its allreduce (op ``mean``) on the wrapper's one communication thread. Buckets launch in plan order on every rank, whatever
   order the hooks fire in, so the collectives match across ranks. With a comm hook
   (``register_comm_hook``, :mod:`.comm_hook`) the hook reduces the bucket there instead.
3. The end of backward is the hook of the last expected gradient (a public mechanism, unlike
   autograd's internal ``queue_callback``): it waits for every launched allreduce (with a
   deadline) and copies each bucket's mean back into the ``.grad`` tensors that are not views of
   it, bucket by bucket while the later ones are reduced. So when
   ``loss.backward()`` returns, every ``.grad`` holds the mean over ranks. A backward that ends without some expected
   gradient (an unused parameter, ``find_unused_parameters=False``) is reported by the next
   ``forward`` with the names of the parameters that got none, as torch's DDP does; a gradient
   for a parameter that ``find_unused_parameters`` counted unused (a loss term taken from the
   module's parameters, not from the outputs) is an error naming it, and so is a backward through
   the outputs of a forward that a later one superseded (each forward finds what its own outputs
   reach, the one the backward reaches first, normally the last, decides) where that reaches parameters the last one does not. A backward whose
   communication failed raises that CommError, and every later ``forward`` raises a
   CommError that names it (the communicator is broken; nothing more can be averaged). Only a
   backward begun by the wrapper's ``forward`` is averaged: one through the module itself
   afterwards stays local, as with torch's DDP. A forward under ``torch.no_grad()`` between a
   synchronizing forward and its backward (an evaluation) changes nothing; a forward that
   tracks gradients under ``no_sync()`` starts a local pass: the backward after it accumulates
   without communicating.
4. *Planning*: the first iterations use one bucket and profile backward; then the buckets are
   laid out by a plan from ``ringtrain.plan.merge``, re-made when the profile drifts
   (:mod:`.planning` owns this and says how).
5. *Trial* (``schedule="optimal"``, ``verify_iterations`` > 0): after the first plan, candidate
   plans are timed and the fastest stays (:mod:`.planning`, :mod:`.trial`). ``planned_with``,
   ``fell_back``, ``kept`` and ``trial`` say what it measured and kept; ``settled`` is True
   once the trial is over.

Inside :meth:`DistributedDataParallel.join` (uneven inputs) each rank announces the forward's
broadcast and the backward's collectives before running them, and a rank that has run out of
batches shadows what is announced (:mod:`.join`).

The wrapper owns the hooks, the buckets' memory and the iteration's state; :mod:`.options` its
settings, :mod:`.unused` the ``find_unused_parameters`` analysis and the errors about missing or
unexpected gradients, :mod:`.planning` the plan in force, :mod:`.join` the uneven inputs,
:mod:`.comm_hook` torch's communication hooks and the bucket they get.

With one rank the mean is the gradient itself: hooks only stamp and count (for stats and for
the unused-parameter check) and nothing is copied or sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import numbers
import threading
import time
import weakref
from collections import deque
from functools import partial
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable

from .. import plan as planner
from ..collectives.ops import check_cpu_module, finish_mean, flat_view
from ..comm import Communicator
from ..errors import CommError, CommTimeout, check_keywords
from . import buckets as bucketing
from . import calibration
from . import comm_hook
from . import consistency
from .comm_thread import CommThread, settle_all
from .join import Join, TorchJoinHook
from .options import COMPRESSIONS, PARAMETER_CHECK_INTERVAL, DDPOptions, take_torch_keywords
from .planning import Planning, cost_text, weakly
from .timeline import IterationStats, TraceRecorder, hidden_fraction
from .unused import (OutputSink, earlier_forward_error, missing_gradients_error, output_tensors, reachable_params,
                     second_gradient_error, unused_everywhere, unused_got_gradient_error, used_bitmap, with_tensors)

logger = logging.getLogger("ringtrain.ddp")
_NAN = float("nan")
_NOT_COPIED = ("a ringtrain.DistributedDataParallel cannot be copied or pickled: it holds a communication thread "
               "and its communicator's connections. Copy or save the module it wraps: copy.deepcopy(model.module) "
               "(an EMA or teacher copy), torch.save(model.module) or torch.save(model.state_dict()).")

#: The options every rank must give alike: they decide the collectives each iteration makes.
_SAME_OPTIONS = ("schedule", "bucket_cap_mb", "algorithm", "find_unused_parameters", "broadcast_buffers",
                 "warmup_iterations", "profile_iterations", "replan_interval", "drift_threshold",
                 "verify_iterations", "parameter_check_interval", "compression", "interference", "alpha", "beta",
                 "cost")


def _option_text(value: Any) -> str:
    """An option's value as the ranks compare it: numbers as floats (25 and 25.0, a numpy float
    and a float, are one value), a dataclass (a cost, the interference) field by field, a function
    by its name (its repr holds an address that differs between processes)."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={_option_text(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    if callable(value):
        return f"<{getattr(value, '__qualname__', type(value).__qualname__)}>"
    return repr(value)


class DistributedDataParallel(nn.Module, Joinable):
    """Data-parallel wrapper: ``ddp(x)`` runs ``module(x)``; after ``loss.backward()`` every
    parameter's ``.grad`` is the mean over ranks. See the module docstring for how.

    ``comm``: a ``ringtrain.Communicator`` (default: the one made by ``ringtrain.init``). While
    a backward pass is in flight the wrapper's thread owns it; use it freely otherwise.
    Other keywords: :class:`DDPOptions`, and torch's DDP keywords at the values that mean the
    same here (:data:`.options.TORCH_DEFAULTS`, ``static_graph``, ``check_reduction``).
    """

    def __init__(self, module: nn.Module, comm=None, schedule: str = "optimal", bucket_cap_mb: float = 25.0,
                 algorithm: str = "auto", timeline=None, find_unused_parameters: bool = False, **options: Any):
        super().__init__()
        Joinable.__init__(self)  # (torch's Join([model]): join_hook)
        static_graph = options.get("static_graph", False)
        take_torch_keywords(options)
        self.static_graph = static_graph  # (torch's hint, read back as torch's attribute; changes nothing)
        check_keywords("ringtrain.DistributedDataParallel", options, (f.name for f in dataclasses.fields(DDPOptions)))
        opts = DDPOptions(schedule=schedule, bucket_cap_mb=bucket_cap_mb, algorithm=algorithm, timeline=timeline,
                          find_unused_parameters=find_unused_parameters, **options)
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        check_cpu_module(module, "ringtrain.DistributedDataParallel")
        if comm is None:
            from .. import get_communicator

            comm = get_communicator()
        if not isinstance(comm, Communicator):
            torchs = (" (torch's DDP takes device_ids second; this wrapper trains CPU modules: leave them out)"
                      if isinstance(comm, (int, list, tuple, torch.device)) else "")
            raise ValueError(f"comm must be a ringtrain.Communicator (or None: the one made by ringtrain.init), "
                             f"got {comm!r}{torchs}")
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
        self._join: Optional[Join] = None  # inside join(), or torch's Join([model]): the uneven-inputs block
        self._torch_join: Optional[Join] = None  # torch's Join([model]) made, in force from its first forward
        self._joined_unevenly = False  # a join() block saw some rank out of data while others trained
        self._hooks: list = []
        self._closed = False
        self._comm_hook: Optional[comm_hook.CommHook] = None  # register_comm_hook's
        self._groups: list = []  # the process_group, once made (closed with the wrapper)
        self._group_lock = threading.Lock()
        try:
            # What torch's DDP._set_params_and_buffers_to_ignore_for_model named (rank-local ones)
            # is each rank's own, as with torch: never broadcast, averaged, checked or compared.
            self._ignored = _ignored_names(module)
            named = _kept(module.named_parameters(remove_duplicate=False), self._ignored)
            names: dict[int, str] = {}
            for n, p in named:
                names.setdefault(id(p), n)  # (a tied weight's first name, as named_parameters gives it)
            self._states = [p.data for p in module.parameters() if id(p) in names]  # (broadcast)
            self._params = [p for p in module.parameters() if id(p) in names and p.requires_grad]
            self._names = [names[id(p)] for p in self._params]
            # Frozen at construction: no hook, no slot. One that requires a gradient later is refused.
            self._frozen = [(names[id(p)], p) for p in module.parameters() if id(p) in names and not p.requires_grad]
            self._pid_of = {id(p): i for i, p in enumerate(self._params)}
            # Bytes on the wire per gradient (what the plan and the sweep size by): half precision
            # for float32 and float64 ones under compression.
            self._wire = getattr(torch, COMPRESSIONS[opts.compression]) if opts.compression else None
            self._scratch: Optional[torch.Tensor] = None  # the half-precision copy of a bucket on the wire
            self._sizes = np.array([p.numel() * self._wire_dtype(p.dtype).itemsize for p in self._params],
                                   dtype=np.float64)
            kept = {id(b) for _, b in _kept(module.named_buffers(remove_duplicate=False), self._ignored)}
            self._module_buffers = [b for b in module.buffers() if b.numel() and id(b) in kept]

            if opts.init_sync:  # (the buffers too unless broadcast_buffers=False, as torch's DDP)
                self._check_same_model(module)
                self._broadcast_tensors(self._states + (self._module_buffers if opts.broadcast_buffers else []),
                                        "broadcast parameters")
            if not self._params:  # (after the check: with init_sync, every rank refuses together)
                raise ValueError(
                    f"{type(module).__name__} has no parameter that requires a gradient, so there is nothing for "
                    f"DistributedDataParallel to average (torch's DDP refuses it too): wrap a module with trainable "
                    f"parameters, or run this one without the wrapper")
            if opts.cost is not None:
                self.cost = opts.cost
            elif opts.alpha is not None:
                self.cost = planner.LinearCost(float(opts.alpha), float(opts.beta))
            else:
                self.cost = self._thread.run(
                    "calibration sweep", partial(calibration.sweep_cost, comm, opts.algorithm,
                                                 calibration.sweep_sizes(float(self._sizes.sum()))), self._timeout * 8)
            self.alpha = float(getattr(self.cost, "alpha", self.cost(0.0)))  # start-up of the larger messages
            self.beta = float(getattr(self.cost, "per_byte", float("nan")))  # (the reduction's seconds too)
            given = "allreduce sweep" if opts.cost is None and opts.alpha is None else "given"
            self._log(f"allreduce cost {cost_text(self.cost)} ({given}), world_size={self.world_size}")

            n = len(self._params)
            self._planning = Planning(
                opts, self._sizes, self.cost, comm, self._recorder, run=weakly(self._run_collective),
                install=weakly(self._install), in_force=weakly(self._in_force), layout=weakly(self._layout),
                use=weakly(self._use_layout), log=weakly(self._log))
            self._planning.start()

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
            if opts.find_unused_parameters:  # (see _State.incoming)
                self._hooks += [p.register_hook(partial(_incoming_hook, me, pid)) for pid, p in enumerate(self._params)]
        except BaseException:  # a failed broadcast or sweep (ranks disagree, a peer lost): leave nothing behind
            for h in self._hooks:
                h.remove()
            self._thread.close()
            if self._recorder is not None:  # (a retry with the same timeline= is not another writer)
                self._recorder.release()
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._thread, self._recorder, self._hooks, self._groups)

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
    def _trial(self):
        """The trial of plans under way (a :class:`.trial.PlanTrial`), or None."""
        return self._planning.trial

    @property
    def fell_back(self) -> bool:
        """True when the trial measured one allreduce after backward to be the fastest candidate."""
        return self._planning.kept == "single"

    @property
    def kept(self) -> str:
        """The trial's candidate in force (a key of ``ringtrain.ddp.trial.CANDIDATES``; "plan"
        before or without a trial)."""
        return self._planning.kept

    @property
    def trial(self) -> list[dict]:
        """The trial's candidates as it timed them (empty before it ends, or where it had one
        candidate): per candidate ``label`` (a key of ``ringtrain.ddp.trial.CANDIDATES``),
        ``groups``, the slowest rank's median forward+backward ``median_s`` over the ``rounds`` it
        ran; ``kept`` marks the one in force."""
        return [dict(c) for c in self._planning.record]

    @property
    def planned_with(self) -> planner.Interference:
        """The interference the plan in force was made with: the measured one, or none where
        the trial measured the plan of free overlap to be the fastest."""
        return self._planning.planned_with

    @property
    def interference(self) -> planner.Interference:
        """The interference measured by the trial's probes (or given, or none)."""
        return self._planning.interference

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

    # torch's DDP's attributes of its settings, for code that reads them back: this wrapper's,
    # and torch's values for a CPU module in one process per rank.
    find_unused_parameters = property(lambda self: self.options.find_unused_parameters)
    gradient_as_bucket_view = property(lambda self: self.options.gradient_as_bucket_view)
    broadcast_buffers = property(lambda self: self.options.broadcast_buffers)
    forward_sync_buffers = broadcast_buffers  # (newer torch's name)
    parameters_to_ignore = property(lambda self: set(self._ignored))
    device_ids = output_device = property(lambda self: None)
    dim = property(lambda self: 0)

    def _set_static_graph(self) -> None:
        """torch's DDP's way of saying ``static_graph=True`` after construction (its errors
        recommend it): a hint here, as the keyword is; the wrapper handles either graph."""
        self.static_graph = True

    @property
    def process_group(self):
        """A ``ringtrain.TorchProcessGroup`` over this wrapper's communicator, made at the first
        use and closed with the wrapper: the group for a comm hook's collectives
        (``model.register_comm_hook(model.process_group, fp16_compress_hook)``,
        ``PowerSGDState(process_group=model.process_group, ...)``), with no
        ``torch.distributed.init_process_group``. It shares the communicator with the wrapper,
        which waits for its calls to end after each hook and at each forward: use it in hooks,
        or between a backward and the next forward, not from another thread while they run."""
        with self._group_lock:
            if self._closed:
                raise RuntimeError("ringtrain.DistributedDataParallel: this wrapper was closed, and its "
                                   "process_group with it.")
            if not self._groups:
                from ..torch_group import TorchProcessGroup

                self._groups.append(TorchProcessGroup(self.comm, algorithm=self.options.algorithm))
            return self._groups[0]

    def register_comm_hook(self, state: Any, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> torch.futures.Future[Tensor]``
        instead of the allreduce, as torch's DDP's method of that name does: the stock hooks of
        ``torch.distributed.algorithms.ddp_comm_hooks`` (``fp16_compress_hook``,
        ``powerSGD_hook``, ...) and the user's. ``bucket`` offers ``dist.GradBucket``'s methods
        (:class:`.comm_hook.GradBucket`) over this rank's gradients, not divided by anything
        (the stock hooks divide by their group's size); the future's value, the bucket reduced,
        becomes the gradients. ``state`` is what the hook gets: the stock hooks send through
        ``state`` (a ProcessGroup) or ``state.process_group``, None meaning torch.distributed's
        default group, as with torch; :attr:`process_group` needs no ``init_process_group``.

        The hook runs on the wrapper's communication thread, one bucket at a time
        (:mod:`.comm_hook` says why). A hook that raises, or whose future fails, never
        completes (the wrapper's deadline) or holds no tensor of the bucket's shape, is a
        CommError naming it from ``backward()``, and the wrapper is then broken as after a
        failed allreduce. Not called under ``no_sync()``, nor with one rank (nothing is
        communicated, as without a hook). What a hook's state keeps by bucket index (PowerSGD's
        error feedback and warm-start vectors, :data:`.comm_hook.BUCKET_STATE`) is emptied
        whenever the buckets are laid out otherwise (the first plan, the trial's candidates), and
        with a hook they are not re-planned once ``settled``, so from then on it stays.

        Refused, as by torch: a hook that is not callable (TypeError), a second hook. And here:
        a hook registered after the first synchronizing backward (every rank must switch at the
        same iteration, and the plan is measured with it), a hook with ``compression=`` (both
        decide how a bucket crosses the network: ``compression="fp16"`` is
        ``fp16_compress_hook``), a hook inside ``join(divide_by_initial_world_size=False)``
        (the stock hooks divide by their group's size) (ValueError or RuntimeError, saying what
        to do)."""
        comm_hook.check_hook(hook)
        st, opts = self._s, self.options
        if self._comm_hook is not None:
            raise RuntimeError(f"register_comm_hook can only be called once (this wrapper has "
                               f"{self._comm_hook.name} already), as with torch's DDP")
        if st.iteration or st.active:
            raise RuntimeError("register_comm_hook: register the hook before the first synchronizing backward, on "
                               "every rank (torch's DDP asks the same): the ranks must switch to it at the same "
                               "iteration, and the plan of the buckets is measured with it. Register it right after "
                               "wrapping the module.")
        if opts.compression is not None:
            raise ValueError(f"register_comm_hook: this wrapper was made with compression={opts.compression!r}, and "
                             "a comm hook decides as well how each bucket crosses the network "
                             f"(compression={opts.compression!r} does what torch's {opts.compression}_compress_hook "
                             "does). Use one of them: wrap the module without compression= to register a hook.")
        join = self._join if self._join is not None else self._torch_join  # (torch's Join made, before a forward)
        if join is not None and join.per_rank:
            raise ValueError(_JOIN_PER_RANK)
        group = comm_hook.hook_group(state, self.world_size, self.rank)
        # (another TorchProcessGroup over this communicator than process_group: waited for as well)
        extra = [group] if getattr(group, "comm", None) is self.comm and group not in self._groups else []
        self._comm_hook = comm_hook.CommHook(hook, state, self.comm, self._groups, extra, self._timeout)
        self._planning.replans = False  # (a hook's state by bucket index stays valid once settled)
        self._log(f"comm hook {self._comm_hook.name} registered")

    @property
    def comm_hook_layout(self) -> Optional[list]:
        """The buckets (a list of ``buckets.BucketSpec``) by whose index the registered hook's
        state keeps what it keeps (PowerSGD's error feedback and warm-start vectors): those of
        the last bucket it reduced; None before that, or without a hook. Saved with such a state
        and set on a new wrapper with the state loaded (after ``register_comm_hook``, before the
        first synchronizing backward), it lets the hook go on with that state: all of it kept
        where this wrapper lays its buckets out alike, otherwise as at any new layout (the error
        feedback moved parameter by parameter, the rest emptied: :func:`.comm_hook.forget_buckets`).
        A layout of one bucket holding every parameter becomes this wrapper's first one (that of
        its profiling iterations, which needs one bucket in some order), so that a job of one
        bucket (``schedule="single"``, or ``"fixed"`` with every gradient in one) keeps all of its
        state from the first iteration on. Unset, a loaded state has all it kept by bucket emptied
        at the first bucket."""
        return None if self._comm_hook is None else self._comm_hook.layout

    @comm_hook_layout.setter
    def comm_hook_layout(self, layout: Optional[list]) -> None:
        if self._comm_hook is None:
            raise RuntimeError("comm_hook_layout: no comm hook is registered (register_comm_hook first)")
        if self._s.iteration or self._s.active:
            raise RuntimeError("comm_hook_layout: set it before the first synchronizing backward, with the hook's "
                               "state loaded (afterwards the hook's state is keyed by this wrapper's own buckets)")
        if layout is not None and not all(isinstance(spec, bucketing.BucketSpec) for spec in layout):
            raise TypeError("comm_hook_layout: a list of ringtrain.ddp.buckets.BucketSpec, or None")
        if layout is not None and len(layout) == 1 and sorted(layout[0].pids) == list(range(len(self._params))):
            self._planning.start(list(layout[0].pids))
        self._comm_hook.layout = None if layout is None else list(layout)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("ringtrain.DistributedDataParallel: this wrapper was closed; its gradients would no "
                               "longer be averaged. Wrap the module again (or call the module itself for local work).")
        st = self._s
        st.retired.clear()
        if st.failed is not None:
            raise self._failed_backward_error()
        self._wait_for_group()
        if st.active:
            raise self._missing_gradients_error()
        if self._frozen and torch.is_grad_enabled():
            self._check_still_frozen()
        t0 = time.perf_counter()
        opts = self.options
        broadcasts = bool(opts.broadcast_buffers and self.world_size > 1 and self._module_buffers and st.sync_buffers)
        join = self._joining()
        root = 0 if join is None else join.before_forward(broadcasts, torch.is_grad_enabled() and st.sync)
        if broadcasts:
            self._broadcast_tensors(self._module_buffers, "broadcast buffers", root)
        broadcast_s = time.perf_counter() - t0
        out = self.module(*inputs, **kwargs)
        # As torch's DDP (require_forward_param_sync): the next forward broadcasts the buffers only
        # after a synchronizing forward that tracks gradients, not after a no_sync() or evaluation one.
        st.sync_buffers = torch.is_grad_enabled() and st.sync
        if torch.is_grad_enabled():
            if st.sync:
                out = self._arm(out)
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

    def _arm(self, out: Any) -> Any:
        """Make the backward of a synchronizing forward's outputs average the gradients; returns
        the outputs (with ``find_unused_parameters``, passed through an :class:`OutputSink`). Only
        such a forward arms: one under ``torch.no_grad()`` between it and its backward (an
        evaluation, say) leaves that backward armed."""
        st = self._s
        found = output_tensors(out)
        outputs = [t for t in found if t.grad_fn is not None]
        st.generation += 1
        if not st.armed:  # (else this one supersedes an armed forward whose backward has not begun)
            st.first_armed = st.generation
        st.armed = True
        if not self.options.find_unused_parameters:
            me = weakref.ref(self)
            for t in outputs:
                t.register_hook(partial(_backward_start_hook, me))
            return out
        # A parameter returned as it is goes through the sink as well: whether the loss used it is
        # known there (a graph's outputs only, it counted as unused, and its gradient was an error).
        outputs = [t for t in found if t.grad_fn is not None or (t.requires_grad and id(t) in self._pid_of)]
        if not outputs:  # no output with a graph or a parameter: nothing to walk, all are expected
            st.expected, st.unused, st.decided = len(self._params), set(), st.generation
            return out
        return self._arm_sink(out, found, outputs)

    # Run as is under torch.compile: traced, the module's forward lost its inputs, and the weak
    # reference to the wrapper that the sink's hook holds became the wrapper itself (the sink's
    # backward called its forward).
    @torch.compiler.disable
    def _arm_sink(self, out: Any, found: list[torch.Tensor], outputs: list[torch.Tensor]) -> Any:
        """find_unused_parameters: ``out`` (whose tensors are ``found``) with its ``outputs`` (those
        of them with a graph, and parameters returned as they are) passed through an OutputSink."""
        st = self._s
        # What the outputs reach (a reentrant checkpoint is refused here, at the forward). The
        # backward decides, at the sink, what is unused: what the outputs the loss used reach.
        # Until then every parameter counts as unused: a gradient before it is one the outputs
        # cannot have given (a loss term taken from the parameters).
        reached = frozenset(reachable_params(outputs, self._pid_of))
        st.expected, st.unused, st.decided = len(self._params), set(range(len(self._params))), None
        return _through_sink(out, found, outputs, partial(_sink_hook, weakref.ref(self), st.generation, reached))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward passes inside accumulate local gradients without communicating;
        the first synchronizing backward after it averages the accumulated gradients."""
        old, self._s.sync = self._s.sync, False
        try:
            yield
        finally:
            self._s.sync = old

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """Train on uneven inputs, as torch's ``DistributedDataParallel.join``: wrap each rank's
        training loop; a rank whose loop ends first shadows the others' collectives, with zero
        gradients, until every rank's has (:mod:`.join` says how). Gradients are divided by the
        world size (``divide_by_initial_world_size``) or by the ranks still training in that
        iteration. On leaving, every rank takes the parameters (and buffers, with
        ``broadcast_buffers``) of the highest rank among those that trained longest.
        ``throw_on_early_termination``: instead, a RuntimeError on every rank as soon as one rank
        runs out. ``enable=False`` (or one rank): nothing changes. An exception inside the block
        leaves it at once, shadowing nothing."""
        for name, value in (("divide_by_initial_world_size", divide_by_initial_world_size), ("enable", enable),
                            ("throw_on_early_termination", throw_on_early_termination)):
            if not isinstance(value, bool):
                raise ValueError(f"join: {name}={value!r}: it must be True or False")
        if not enable or self.world_size == 1:
            yield
            return
        if self._join is not None and not self._join.torch:
            raise RuntimeError("ringtrain.DistributedDataParallel.join: this wrapper is already inside join()")
        if self._comm_hook is not None and not divide_by_initial_world_size:
            raise ValueError(_JOIN_PER_RANK)
        # (a torch Join([model]) left by an exception, which torch does not tell its joinables, is over)
        self._torch_join = None
        self._join = Join(self, divide_by_initial_world_size, throw_on_early_termination)
        try:
            yield
            self._raise_if_failed()
            self._join.shadow()
        finally:
            self._leave_join()

    def join_hook(self, **kwargs: Any) -> TorchJoinHook:
        """The wrapper under torch's own ``torch.distributed.algorithms.join.Join([model, ...])``
        (first in the list, as torch's DDP), which calls this: the same uneven-inputs training as
        :meth:`join` (its ``divide_by_initial_world_size`` is Join's keyword of that name; its
        ``enable`` and ``throw_on_early_termination`` are Join's own), through torch's protocol
        (:mod:`.join`), so that other joinables (torch's ``ZeroRedundancyOptimizer``) shadow
        their collectives beside it."""
        divide = kwargs.get("divide_by_initial_world_size", True)
        if not isinstance(divide, bool):
            raise ValueError(f"Join: divide_by_initial_world_size={divide!r}: it must be True or False")
        if self._join is not None and not self._join.torch:
            raise RuntimeError("ringtrain.DistributedDataParallel: torch's Join([model]) inside model.join(): use one")
        if self._comm_hook is not None and not divide:
            raise ValueError(_JOIN_PER_RANK)
        # (refused here, before this Join is in force: torch asks join_process_group only after
        # setting every joinable's config, and the wrapper would tell a Join that never began at
        # each later forward)
        self._join_group()
        self._join = None  # (one left by an exception: this Join starts anew)
        self._torch_join = Join(self, divide, False, torch_join=True) if self.world_size > 1 else None
        return TorchJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """torch's Join counts the ranks still training in CPU tensors (this wrapper's device)."""
        return torch.device("cpu")

    @property
    def join_process_group(self):
        """torch's Join counts the ranks still training on torch.distributed's default group (its
        rank lookups need that group; ``ZeroRedundancyOptimizer``'s joins count there too): its
        ranks must be this wrapper's."""
        return self._join_group()

    def _join_group(self):
        """:attr:`join_process_group`, or the error that says why there is none."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch's Join([model]) counts the ranks still training on torch.distributed's default "
                               "group: call torch.distributed.init_process_group first (backend 'gloo', or "
                               "'ringtrain' after import ringtrain.torch_group), or use `with model.join():`, which "
                               "needs none")
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
            raise ValueError(f"torch's Join([model]): torch.distributed's default group has this process as rank "
                             f"{dist.get_rank()} of {dist.get_world_size()}, the wrapper's communicator as rank "
                             f"{self.rank} of {self.world_size}: they must be the same ranks")
        return dist.group.WORLD

    def _joining(self) -> Optional[Join]:
        """The uneven-inputs block in force: :meth:`join`'s, or torch's ``Join([model])`` once
        entered (enabled: torch sets ``_join_config`` after :meth:`join_hook`)."""
        if self._join is None and self._torch_join is not None and self._join_config.enable:
            if not self._join_config.is_first_joinable:
                raise ValueError("torch's Join: put the ringtrain.DistributedDataParallel first in Join([...]) (as "
                                 "with torch's DDP): its forward is where each iteration tells Join that a rank "
                                 "still trains, before the other joinables' collectives")
            self._join = self._torch_join
        return self._join

    def _leave_join(self) -> None:
        """The end of a join() block or of torch's Join([model]): the wrapper trains on alone."""
        if self._join is not None:
            self._joined_unevenly = self._joined_unevenly or self._join.uneven
        self._join = self._torch_join = None

    def _raise_if_failed(self) -> None:
        """A backward that failed (:meth:`_failed_backward_error`) before a join block's end."""
        if self._s.failed is not None:
            raise self._failed_backward_error()

    @property
    def require_backward_grad_sync(self) -> bool:
        """False inside :meth:`no_sync` (torch's attribute: frameworks set it to accumulate)."""
        return self._s.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._s.sync = bool(value)

    def __deepcopy__(self, memo):
        raise TypeError(_NOT_COPIED)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_COPIED)

    def close(self) -> None:
        """Write the trace file, remove the hooks, stop the communication thread (idempotent).
        The communicator stays open: it belongs to the caller."""
        self._closed = True
        self._s.retired.clear()
        self._finalizer()  # (removes the hooks)

    # --- hooks -------------------------------------------------------------------------------

    def _on_backward_start(self) -> None:
        st = self._s
        if st.armed and st.bwd_start is None:
            st.bwd_start = time.perf_counter()

    def _on_sink(self, generation: int, reached: frozenset, roots: Optional[list]) -> None:
        """find_unused_parameters: the backward reached the outputs of forward ``generation``,
        which reach ``reached``; ``roots``: the graph nodes of the outputs it used (None: all).
        The first forward a backward reaches (normally the last one) decides what is unused:
        what the outputs it used do not reach, torch's DDP's rule."""
        st = self._s
        if generation < st.first_armed:  # a forward before the armed ones: its backward stays local
            return
        if roots is not None:
            reached = frozenset(reachable_params([], self._pid_of, roots))
        if st.armed and st.decided is None:
            st.decided = generation
            st.incoming = bytearray(len(self._params))  # (torch.autograd.grad runs the gradient hooks only)
            st.expected = len(reached)
            st.unused = {pid for pid in range(len(self._params)) if pid not in reached}
            self._on_backward_start()
            if not st.expected:
                self._without_gradients()
        elif st.decided is not None and generation != st.decided:
            # This backward goes through the outputs of another forward than the one that decided.
            late = reached & st.unused
            if late:
                raise self._earlier_forward_error(late)

    def _without_gradients(self) -> None:
        """find_unused_parameters: the outputs the loss used reach no parameter, so no gradient
        will begin or end this backward; the other ranks' allreduces wait for this rank's (and,
        left out, would pair with its next backward's). It takes part now, with zeros (or what
        ``no_sync()`` accumulated), and its backward ends here."""
        st = self._s
        now = time.perf_counter()
        with self._lock:
            try:
                self._begin_backward(now)
                st.last = now
                self._end_backward()
            except BaseException:
                if st.active:
                    self._abandon_iteration()
                raise

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
        if pid in st.unused and not st.incoming[pid]:
            # find_unused_parameters: only outputs the loss ignored reach it; autograd ran its
            # accumulation (through the sink) with no gradient.
            return
        if not st.active:
            self._begin_backward(now)
        if pid in st.unused:
            raise self._unused_got_gradient_error(pid)
        if st.got[pid]:  # (a reentrant checkpoint's module called twice, or a backward that lacked some)
            missing = [self._names[i] for i in range(len(self._params)) if not st.got[i] and i not in st.unused]
            raise self._abandoning(second_gradient_error(self._names[pid], missing))
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
        """Queue ``grad`` to be copied into the parameter's bucket slot when its bucket is launched
        (:meth:`_fill`: one ``torch._foreach_copy_`` a bucket, not a copy a parameter)."""
        if grad.is_sparse:
            raise ValueError(f"parameter {self._names[pid]!r} has a sparse gradient; "
                             "ringtrain.DistributedDataParallel reduces dense gradients only")
        slot = self._slots[pid]
        if grad.data_ptr() == slot.data_ptr():  # accumulated in place into the slot: nothing to copy
            return
        if grad.dtype != slot.dtype or grad.shape != slot.shape:  # (copy_ would cast or broadcast, silently)
            raise RuntimeError(
                f"ringtrain.DistributedDataParallel: parameter {self._names[pid]!r} has a {grad.dtype} gradient of "
                f"shape {tuple(grad.shape)}, but was {slot.dtype} of shape {tuple(slot.shape)} when the wrapper was "
                "made, and its bucket was laid out so. Convert or resize the module before wrapping it (or close "
                "this wrapper and wrap the module again).")
        self._s.inbox[self._bucket_index[pid]].append((param, grad, slot))

    def _fill(self, bucket: int) -> None:
        """Copy the gradients queued for ``bucket`` into their slots, before its reduction is
        launched. A slot laid out as its gradient becomes the ``.grad`` under
        ``gradient_as_bucket_view`` (when the bucket's allreduce ends, ``.grad`` holds the mean,
        with no copy back); the other gradients are copied back at the end of backward."""
        st = self._s
        queued = st.inbox[bucket]
        if not queued:
            return
        grads = [g for _, g, _ in queued]
        slots = [s for _, _, s in queued]
        torch._foreach_copy_(slots, grads)
        if not self.options.gradient_as_bucket_view:
            return
        kept = []
        for param, grad, slot in queued:
            if grad.stride() == slot.stride():
                param.grad = slot
                st.retired.append(grad)  # freed at the next forward (see _State.retired)
            else:
                kept.append((param, grad, slot))
        st.inbox[bucket] = kept

    def _begin_backward(self, now: float) -> None:
        st = self._s
        st.active = True
        st.first = now
        if self.world_size == 1:
            return
        if self._join is not None:
            self._join.before_backward()  # before every collective of the backward
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
        st.used = used_bitmap(self._params, st.unused)
        st.used_job = self._thread.submit("allreduce used parameters",
                                          partial(self.comm.allreduce, st.used, "max", "auto"), st.used.nbytes)

    def _unused_everywhere(self) -> set[int]:
        """Ids of the parameters no rank has a gradient for (after :meth:`_launch_used_bitmap`)."""
        st = self._s
        if st.used_job is None:
            return set()
        st.used_job.wait(self._timeout)  # queued before every bucket: normally over already
        return unused_everywhere(st.used, st.unused)

    def _mark_ready(self, bucket: int) -> None:
        st = self._s
        st.pending[bucket] -= 1
        while st.launched < len(self._specs) and st.pending[st.launched] == 0:
            k = st.launched
            spec = self._specs[k]
            self._fill(k)
            job = self._thread.submit(self._reduction_label(k), self._reduction(spec, self._bufs[k]),
                                      spec.numel * self._wire_dtype(spec.dtype).itemsize)
            st.jobs.append(job)
            st.launched += 1

    def _wait_for_group(self) -> None:
        """Until the calls made on :attr:`process_group` between two iterations have ended (the
        wrapper's own collectives of this forward and backward share its communicator)."""
        for group in self._groups:
            if not group.wait_idle(self._timeout):
                raise CommTimeout(f"ringtrain.DistributedDataParallel: the calls made on model.process_group did "
                                  f"not end within {self._timeout:.1f} s of this forward, which needs its "
                                  "communicator")

    def _reduction_label(self, k: int) -> str:
        """The job's label of bucket ``k``'s reduction (and its span's name in the timeline)."""
        return f"allreduce bucket {k}" if self._comm_hook is None else f"{self._comm_hook.name} bucket {k}"

    def _reduction(self, spec: bucketing.BucketSpec, buf: torch.Tensor, divisor: Optional[int] = None):
        """What reduces bucket ``spec``, held in ``buf``, on the communication thread: the
        allreduce (``divisor``: see :meth:`_allreduce_bucket`), or the comm hook, whose bucket's
        gradients are the parameters' slots where ``buf`` is the bucket's own buffer, and views
        of ``buf`` laid out alike where it is not (a joined rank's zeros)."""
        if self._comm_hook is None:
            return partial(self._allreduce_bucket, buf, divisor)
        params = [self._params[pid] for pid in spec.pids]
        views = ([self._slots[pid] for pid in spec.pids] if buf is self._bufs[spec.index]
                 else comm_hook.bucket_views(buf, spec.offsets, params))
        if buf.is_complex():  # its real view, as torch's DDP gives it (a cast to float16 drops imaginary parts)
            buf, views = torch.view_as_real(buf).view(-1), [torch.view_as_real(v) for v in views]
        bucket = comm_hook.GradBucket(spec.index, buf, views, params, spec.index == len(self._specs) - 1)
        return partial(self._comm_hook.run, bucket, self._specs)

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` crosses the network in (``compression``)."""
        return self._wire if self._wire is not None and dtype in (torch.float32, torch.float64) else dtype

    def _allreduce_bucket(self, buf: torch.Tensor, divisor: Optional[int] = None) -> None:
        """A bucket's mean over the ranks, on the communication thread: the sum divided by the
        world size, or inside join() by its divisor (the ranks still training, read here: the
        announcement queued ahead of this job set it) or ``divisor``; under ``compression`` the
        sum of the half-precision gradients divided first, as torch's compression hooks."""
        if divisor is None:
            divisor = self.world_size if self._join is None else self._join.divisor
        algorithm = self.options.algorithm
        if buf.is_complex():
            # Its real and imaginary parts, as floats, as torch's DDP reduces it (the collectives
            # take no complex128); never compressed (the plan counts its bytes as they are).
            buf = torch.view_as_real(buf)
            wire = buf.dtype
        else:
            wire = self._wire_dtype(buf.dtype)
        if wire != buf.dtype:
            # Into memory kept for it (a fresh tensor's page faults took as long as the rounding:
            # 32 ms against 11 for 21M values): one bucket at a time, on this thread.
            if self._scratch is None or self._scratch.numel() < buf.numel():
                self._scratch = torch.empty(buf.numel(), dtype=wire)
            half = self._scratch[: buf.numel()].view(buf.shape)
            half.copy_(buf).div_(divisor)
            self.comm.allreduce(half, "sum", algorithm)
            buf.copy_(half)
        elif divisor == self.world_size:
            self.comm.allreduce(buf, "mean", algorithm)
        else:  # (float16 is then summed in float16, not float32: join's divisor only)
            self.comm.allreduce(buf, "sum", algorithm)
            finish_mean(flat_view(buf), divisor)

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
            settle_all(st.jobs, self._timeout)
            for job in st.jobs:  # (all ended: re-raises the first error, not the later ones' "communicator is broken")
                job.wait(self._timeout)
            t1 = time.perf_counter()
            copies.append(("the last allreduce", t1, t1))  # a wait, nothing to copy
        t_done = time.perf_counter()
        traced = self._record(t_last, copies, t_done)
        self._profile()
        every = self.options.parameter_check_interval
        if every is None:  # (a comm hook may leave the ranks apart by design: local SGD, noop_hook)
            every = PARAMETER_CHECK_INTERVAL if self._comm_hook is None else 0
        if self.world_size > 1 and every and self._join is None and (st.iteration + 1) % every == 0:
            consistency.check_equal(self._run_collective, self.comm.allreduce, self._params, self.rank,
                                    self.world_size, st.iteration + 1, after_uneven_join=self._joined_unevenly)
        st.iteration += 1
        self._reset_iteration()
        if traced:  # last, once the iteration is accounted for: this may write the trace file
            self._recorder.end_iteration()

    def _needs_copy(self, spec: bucketing.BucketSpec, unused: set[int]) -> bool:
        """Whether some parameter of the bucket needs ``_copy_back``: a ``.grad`` that is not its
        slot, or none where some rank has a gradient (``unused``: the parameters no rank has a
        gradient for, left alone)."""
        return bool(self._s.inbox[spec.index] or self._without_grad(spec, unused))

    def _copy_back(self, spec: bucketing.BucketSpec, unused: set[int]) -> None:
        """Every parameter of the bucket gets the mean over ranks as its ``.grad``, but those
        in ``unused`` (no rank has a gradient for them: their ``.grad`` stays None)."""
        queued = self._s.inbox[spec.index]
        with torch.no_grad():
            if queued:
                torch._foreach_copy_([g for _, g, _ in queued], [s for _, _, s in queued])
            for pid in self._without_grad(spec, unused):
                slot = self._slots[pid]
                self._params[pid].grad = slot if self.options.gradient_as_bucket_view else slot.clone()

    def _without_grad(self, spec: bucketing.BucketSpec, unused: set[int]) -> list[int]:
        """find_unused_parameters: the bucket's parameters unused here and without a ``.grad``
        that some rank has a gradient for (``unused``: those no rank has): they take the slot."""
        return [pid for pid in self._s.unused if self._bucket_index[pid] == spec.index
                and self._params[pid].grad is None and pid not in unused]

    # --- bookkeeping ---------------------------------------------------------------------------

    def _reset_iteration(self) -> None:
        st = self._s
        n = len(self._params)
        st.active = False
        st.armed = False  # a backward not begun by this wrapper's forward stays local, as with torch's DDP
        st.pending = list(self._counts)
        st.inbox = [[] for _ in self._counts]
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
        return self._abandoning(unused_got_gradient_error(self._names[pid]))

    def _earlier_forward_error(self, late: frozenset) -> RuntimeError:
        return self._abandoning(earlier_forward_error([self._names[pid] for pid in sorted(late)]))

    def _missing_gradients_error(self) -> RuntimeError:
        st = self._s  # (the message reads what the iteration got before abandoning resets it)
        return self._abandoning(missing_gradients_error(self._names, self._params, st.got, st.unused,
                                                        self.options.find_unused_parameters))

    def _abandoning(self, error: RuntimeError) -> RuntimeError:
        """``error``, once the iteration is abandoned; its cause is the error a job ended with, if any."""
        error.__cause__ = self._abandon_iteration()
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
            rec.span(job.label, "allreduce", "communication", job.started, job.ended, iteration=it,
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
        """The iteration is over: hand it to the planning (:meth:`.planning.Planning.after_iteration`)."""
        st = self._s
        self._planning.after_iteration(st.iteration, st.stamps, st.bwd_start, self.stats[-1])

    def _run_collective(self, label: str, call) -> Any:
        """Run ``call`` on the communication thread, within the wrapper's deadline (the planning's ``run``)."""
        return self._thread.run(label, call, self._timeout)

    def _install(self, order: list[int], plan: planner.Plan) -> list[bucketing.BucketSpec]:
        """Lay out buckets for ``plan`` over ``order``, allocate their buffers and put them in
        force (the planning's ``install``); returns their specs."""
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
            return specs
        self._bufs = [torch.zeros(s.numel, dtype=s.dtype) for s in specs]
        for s, buf in zip(specs, self._bufs):
            for pid, off in zip(s.pids, s.offsets):
                p = params[pid]
                self._bucket_index[pid] = s.index
                self._slots[pid] = buf[off:off + p.numel()].view(p.shape)
        return specs

    def _in_force(self) -> tuple[list[int], planner.Plan]:
        """The order and plan of the buckets in force (the planning's ``in_force``)."""
        return self._order, self._plan

    def _layout(self) -> tuple:
        """The buckets in force, as :meth:`_install` laid them out (for :meth:`_use_layout`)."""
        return self._order, self._plan, self._specs, self._counts, self._bucket_index, self._slots, self._bufs

    def _use_layout(self, layout: tuple) -> None:
        """Put buckets laid out earlier back in force (between iterations: none in flight).
        Gradients still views of the other buckets are copied in by the hooks as usual."""
        self._order, self._plan, self._specs, self._counts, self._bucket_index, self._slots, self._bufs = layout

    def _check_same_model(self, module: nn.Module) -> None:
        """A RuntimeError on every rank, naming the first difference, where some rank's parameters
        and buffers differ from rank 0's in name, shape, dtype or requires_grad (torch's DDP checks
        shapes so): the broadcast that follows copies bytes, so models of the same total size
        would take rank 0's values in other shapes, silently, and their buckets would not match.
        The options that decide the ranks' collectives (``_SAME_OPTIONS``) are compared too: one
        rank's other schedule or compression failed later as a MismatchError of two allreduces'
        sizes, which named no option."""
        if self.world_size == 1:
            return
        mine = [["parameter", n, list(t.shape), str(t.dtype), t.requires_grad] for n, t in module.named_parameters()
                if n not in self._ignored]
        mine += [["buffer", n, list(t.shape), str(t.dtype), False] for n, t in module.named_buffers()
                 if n not in self._ignored]
        mine += [["option", name, _option_text(getattr(self.options, name)), "", False] for name in _SAME_OPTIONS]
        text = json.dumps(mine).encode()
        digest = np.frombuffer(hashlib.sha256(text).digest(), dtype=np.uint8).copy()
        rank0 = digest.copy()
        self._thread.run("compare models", partial(self.comm.broadcast, rank0, 0), self._timeout)
        differs = np.zeros(self.world_size)
        differs[self.rank] = not np.array_equal(rank0, digest)
        self._thread.run("compare models", partial(self.comm.allreduce, differs, "max", "auto"), self._timeout)
        if not differs.any():
            return
        size = np.array([len(text)], dtype=np.int64)
        self._thread.run("compare models", partial(self.comm.broadcast, size, 0), self._timeout)
        theirs = np.frombuffer(text, dtype=np.uint8).copy() if self.rank == 0 else np.zeros(int(size[0]), np.uint8)
        self._thread.run("compare models", partial(self.comm.broadcast, theirs, 0), self._timeout)
        ranks = [int(r) for r in np.flatnonzero(differs)]
        detail = f"ranks {ranks} have a module or options that differ from rank 0's (their errors name the difference)"
        if differs[self.rank]:
            theirs = json.loads(theirs.tobytes())

            def what(entry) -> str:
                kind, name, shape, dtype, grad = entry
                if kind == "option":
                    return f"{name}={shape}"
                return f"{kind} {name!r} of shape {tuple(shape)}, {dtype}" + (", requires_grad" if grad else "")

            first = next((k for k, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine)))
            detail = (f"rank 0 has {what(theirs[first]) if first < len(theirs) else 'nothing more'} where rank "
                      f"{self.rank} has {what(mine[first]) if first < len(mine) else 'nothing more'} "
                      f"(entry {first} of the parameters, buffers, then options)")
        raise RuntimeError("ringtrain.DistributedDataParallel: every rank must wrap the same module with the same "
                           f"options, but {detail}.")

    def _broadcast_tensors(self, tensors: list[torch.Tensor], label: str, root: int = 0) -> None:
        """Copy rank ``root``'s values of ``tensors`` to every rank: one broadcast of their bytes."""
        tensors = [t for t in tensors if t.numel()]
        if self.world_size == 1 or not tensors:
            return
        # Each tensor starts on a 16-byte boundary of the byte buffer: torch views bytes as a
        # wider dtype only at an offset that is a multiple of its size (an int64 counter after
        # 27 float32s would not be, nor a complex128 after one float64).
        spans, end = [], 0
        for t in tensors:
            start = -(-end // 16) * 16
            end = start + t.numel() * t.element_size()
            spans.append((start, end))
        with torch.no_grad():
            flat = torch.zeros(end, dtype=torch.uint8)
            for t, (a, b) in zip(tensors, spans):
                flat[a:b] = t.detach().contiguous().reshape(-1).view(torch.uint8)
            self._thread.run(label, partial(self.comm.broadcast, flat.numpy(), root), self._timeout)
            for t, (a, b) in zip(tensors, spans):
                # Through .data: the tensor's autograd version is not bumped, as torch's DDP does not
                # bump it. A buffer saved for a backward still to come (BatchNorm's running
                # statistics, when a second forward broadcasts before it) would fail it otherwise.
                t.data.copy_(flat[a:b].view(t.dtype).view(t.shape))

    def _log(self, message: str) -> None:
        logger.log(logging.INFO if self.rank == 0 else logging.DEBUG, "rank %d: %s", self.rank, message)


_JOIN_PER_RANK = ("ringtrain.DistributedDataParallel: a comm hook and join(divide_by_initial_world_size=False) do not "
                  "go together: the stock hooks divide each bucket by their group's size, the initial world size, "
                  "whatever join() asks. Use join() (divide_by_initial_world_size=True) with a hook.")


class _State:
    """The wrapper's mutable run-time state (see the module docstring for the words)."""

    __slots__ = ("sync", "sync_buffers", "armed", "generation", "first_armed", "decided", "incoming", "expected", "unused", "forward_span", "iteration",
                 "failed", "active", "pending", "launched", "jobs", "used", "used_job", "ready", "got", "stamps",
                 "bwd_start", "first", "last", "broadcast_s", "hooks_s", "retired", "inbox")

    def __init__(self, n: int):
        self.sync = True  # False inside no_sync()
        self.sync_buffers = True  # the next forward broadcasts the buffers (the last one synchronized)
        self.armed = False  # the last forward asked for a synchronizing backward
        self.generation = 0  # synchronizing forwards so far (the last one's number)
        self.first_armed = 0  # the first of those since the last disarming (a backward's end, a no_sync() forward)
        self.decided: Optional[int] = None  # find_unused_parameters: the forward whose outputs decided `unused`
        # find_unused_parameters: 1 where autograd accumulated a gradient into the parameter since
        # the sink decided (its gradient hook saw one), 0 where it ran the accumulation with none
        # (only outputs the loss ignored reach it, through the sink); read for the unused
        # parameters only, cleared where the sink decides. (Not .grad's version: a .grad that is
        # a bucket view shares its counter with the whole bucket, which another parameter's
        # in-place accumulation moves.) Without the flag nothing sets or reads it.
        self.incoming = bytearray(n)
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
        # By bucket, (parameter, gradient, slot) of each gradient to copy into its slot when the
        # bucket is launched (``_fill``), then of those to copy back at the end of backward.
        self.inbox: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []


def _ignored_names(module: nn.Module) -> frozenset:
    """The names torch's ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    set on ``module`` (its attribute ``_ddp_params_and_buffers_to_ignore``): none by default."""
    return frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", None) or ())


def _kept(named, ignored: frozenset) -> list:
    """``named``'s (name, tensor) pairs of the tensors not ignored: a tensor under several names
    (tied weights) is kept where one of its names is not ignored, as torch's DDP keeps it."""
    named = list(named)
    kept = {id(t) for n, t in named if n not in ignored}
    return [(n, t) for n, t in named if id(t) in kept]


def _shutdown(thread: CommThread, recorder: Optional[TraceRecorder], hooks: list, groups: list) -> None:
    """Remove the hooks, write the trace file, stop the communication thread, then close the
    ``process_group`` (a comm hook on that thread may still use it) (``close``, or the wrapper
    collected)."""
    for h in hooks:
        h.remove()
    hooks.clear()
    try:
        if recorder is not None:
            recorder.close()
    finally:
        try:
            thread.close()
        finally:
            for group in groups:
                group.close()


def _grad_hook(ddp: weakref.ref, pid: int, param: torch.Tensor) -> None:
    """Parameter ``pid``'s post-accumulate-grad hook; it holds the wrapper weakly."""
    wrapper = ddp()
    if wrapper is not None:
        wrapper._on_grad_ready(pid, param)


def _incoming_hook(ddp: weakref.ref, pid: int, grad: Optional[torch.Tensor]) -> None:
    """find_unused_parameters: parameter ``pid``'s gradient hook, called before its accumulation
    (``grad`` None: autograd runs it with no gradient); it holds the wrapper weakly."""
    wrapper = ddp()
    if wrapper is not None and grad is not None:
        wrapper._s.incoming[pid] = 1


def _backward_start_hook(ddp: weakref.ref, grad: torch.Tensor) -> None:
    """An output's gradient hook (the backward start); it holds the wrapper weakly."""
    wrapper = ddp()
    if wrapper is not None:
        wrapper._on_backward_start()


def _through_sink(out: Any, found: list[torch.Tensor], outputs: list[torch.Tensor], on_backward) -> Any:
    """``out`` (whose tensors are ``found``, in output_tensors' order) with its ``outputs`` (those of
    them with a graph, and parameters returned as they are) passed through an OutputSink."""
    sunk, through = iter(OutputSink.apply(on_backward, *outputs)), {id(t) for t in outputs}
    return with_tensors(out, (next(sunk) if id(t) in through else t for t in found))


def _sink_hook(ddp: weakref.ref, generation: int, reached: frozenset, roots: Optional[list]) -> None:
    """find_unused_parameters: the :class:`OutputSink`'s backward (see ``_on_sink``); it holds the
    wrapper weakly."""
    wrapper = ddp()
    if wrapper is not None:
        wrapper._on_sink(generation, reached, roots)
