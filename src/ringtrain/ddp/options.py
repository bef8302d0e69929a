"""The wrapper's settings: :class:`DDPOptions`, the keywords of ``DistributedDataParallel``.

This module owns what a user may set and its validation (a ``ValueError`` naming the keyword,
at construction, before any thread, hook or collective), and ``SCHEDULES``, the accepted
``schedule`` values. It reads nothing from the environment and runs nothing.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from .. import plan as planner
from ..comm import ALGORITHMS
from ..paths import user_path

SCHEDULES = planner.METHODS
#: ``compression`` values: the dtype gradients cross the network in.
COMPRESSIONS = {"fp16": "float16", "bf16": "bfloat16"}

#: Keywords of torch's DistributedDataParallel the wrapper takes at the value that means the
#: same here (torch's default: a CPU module, one process per rank, dense full-precision
#: allreduces), so a script ported from torch's DDP runs unchanged; any other value is a
#: ValueError saying why. ``device_ids`` also takes [].
TORCH_DEFAULTS = {"device_ids": None, "output_device": None, "dim": 0, "process_group": None,
                  "delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None, "mixed_precision": None,
                  "device_mesh": None, "skip_all_reduce_unused_params": False, "bucket_cap_mb_list": None,
                  "batched_grad_copy": False}
#: How often the ranks compare their parameters by default (``parameter_check_interval``).
PARAMETER_CHECK_INTERVAL = 50
#: torch's hints, taken at any True/False: ``static_graph`` (the wrapper handles a graph that
#: changes or not) and ``check_reduction`` (ignored by torch too).
TORCH_HINTS = ("static_graph", "check_reduction")


def take_torch_keywords(options: dict) -> dict:
    """Remove torch DDP's keywords (``TORCH_DEFAULTS``, ``TORCH_HINTS``) from ``options`` (the
    wrapper's ``**options``), checking each, and return ``options``. ``forward_sync_buffers``
    (newer torch's name for ``broadcast_buffers``) becomes ``broadcast_buffers``."""
    value = options.pop("forward_sync_buffers", None)
    if value is not None:
        if options.get("broadcast_buffers", value) != value:
            raise ValueError(f"forward_sync_buffers={value!r} and broadcast_buffers={options['broadcast_buffers']!r} "
                             "name one setting: give one of them")
        options["broadcast_buffers"] = value
    for name in TORCH_HINTS:
        value = options.pop(name, False)
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: it must be True or False")
    for name, default in TORCH_DEFAULTS.items():
        if name not in options:
            continue
        value = options.pop(name)
        if value is default or (isinstance(value, int) and value == default) or (name == "device_ids" and value == []):
            continue
        if name in ("device_ids", "output_device"):
            why = "it trains modules on the CPU, in one process per rank: leave it out (or None)"
        elif name == "process_group":
            why = "it communicates through a ringtrain.Communicator: pass comm= (None: the one ringtrain.init() made)"
        else:
            why = f"it has no such feature; leave it at torch's default, {default!r}"
        raise ValueError(f"ringtrain.DistributedDataParallel: {name}={value!r} is not supported: {why}")
    return options


@dataclass(kw_only=True)  # (no slots: torch.compile before 2.5 takes weak references to what forward reads)
class DDPOptions:
    """The wrapper's settings (validated here; the constructor's keywords)."""

    schedule: str = "optimal"
    """How gradients are merged into allreduces: one of ``ringtrain.plan.METHODS``."""
    bucket_cap_mb: float = 25.0
    """Bucket size threshold in MiB for ``schedule="fixed"`` (None: 25, as torch's DDP)."""
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
    """Copy rank 0's module buffers to every rank at each forward that follows a synchronizing
    forward tracking gradients (torch DDP's default and rule: the first forward inside
    ``no_sync()`` or under ``torch.no_grad()`` broadcasts, the ones after it do not; None: True,
    as torch's)."""
    init_sync: bool = True
    """At construction, check that every rank wraps the same module and copy rank 0's parameters
    and buffers to every rank (torch's keyword; False: the caller made them equal)."""
    warmup_iterations: int = 1
    """Synchronizing iterations before profiling starts (first-iteration costs excluded)."""
    profile_iterations: int = 2
    """Synchronizing iterations timed for the first plan (per-parameter median)."""
    replan_interval: int = 50
    """Re-check the profile every so many iterations after the first plan (0: never)."""
    drift_threshold: float = 0.2
    """Re-plan when the ready curve moved by more than this share of the backward time."""
    parameter_check_interval: Optional[int] = None
    """Every so many synchronizing iterations, check that the ranks' parameters are equal (a sum
    of their bits, one allreduce of world_size numbers): a rank that stepped its optimizer
    otherwise than the others (:mod:`.consistency`) is a MismatchError on every rank instead of
    training on apart. None: every ``PARAMETER_CHECK_INTERVAL`` (50) iterations, never with a
    comm hook (one may leave the ranks apart by design: local SGD, ``noop_hook``); 0: never.
    Not inside ``join()``, where the ranks that ran out of data take no steps."""
    verify_iterations: int = 5
    """schedule="optimal" only: iterations per phase of the trial (:mod:`.planning`, item 2):
    the probe plans and one allreduce after backward measure the interference, then the
    candidates (the plan made with it, the plan made without it, every other schedule's plan
    and torch DDP's buckets: :mod:`.trial`) alternate, as many iterations each, and the fastest
    median forward+backward stays (0: no trial; trust the model)."""
    gradient_as_bucket_view: bool = False
    """False (torch's default): every ``.grad`` keeps its own tensor and gets the mean copied
    back from its bucket. True (torch's option of the same name): after backward each ``.grad``
    is a view of its bucket, with no copy back; the bucket is reused by the next synchronizing
    backward, so a reference to a ``.grad`` kept across iterations sees it change (also after
    ``zero_grad(set_to_none=True)``), and a post-accumulate-grad hook of the user's registered
    after the wrapper's sees a gradient whose bucket may already be in flight."""
    compression: Optional[str] = None
    """Gradients cross the network in half precision: "fp16" or "bf16" (None: as they are). Each
    float32 or float64 bucket is rounded to that dtype, divided by the world size, summed over the
    ranks in it and copied back, as torch's ``fp16_compress_hook`` / ``bf16_compress_hook`` and
    Horovod's ``Compression.fp16`` do: half the bytes (a quarter from float64), for a rounding of
    each gradient and of each partial sum (fp16: values under 6e-8 after the division flush to
    zero, sums over 65504 overflow; bf16 keeps float32's range at 8 bits of precision). Buckets
    of other dtypes go as they are; one rank sends and rounds nothing."""
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
        if self.bucket_cap_mb is None:  # (torch's DDP takes None for its default)
            self.bucket_cap_mb = 25.0
        if self.broadcast_buffers is None:
            self.broadcast_buffers = True
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: accepted values are {', '.join(SCHEDULES)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r}: accepted values are {', '.join(ALGORITHMS)}")
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"bucket_cap_mb={cap!r}: it must be a finite number of MiB > 0 (e.g. 25)")
        for name, low in (("timeline_iterations", 1), ("warmup_iterations", 0), ("profile_iterations", 1),
                          ("replan_interval", 0), ("verify_iterations", 0), ("parameter_check_interval", 0)):
            value = getattr(self, name)
            if name == "parameter_check_interval" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r}: it must be an integer >= {low}")
        if not isinstance(self.drift_threshold, (int, float)) or not self.drift_threshold > 0:
            raise ValueError(f"drift_threshold={self.drift_threshold!r}: it must be a number > 0")
        if self.timeline is not None and not isinstance(self.timeline, (str, os.PathLike)):
            raise ValueError(f"timeline={self.timeline!r}: it must be a file name (str or os.PathLike) or None")
        if self.timeline is not None:
            self.timeline = user_path(self.timeline)
        for name in ("find_unused_parameters", "broadcast_buffers", "gradient_as_bucket_view", "init_sync"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: it must be True or False")
        if self.compression is not None and self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r}: accepted values are None, "
                             f"{', '.join(map(repr, COMPRESSIONS))}")
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
