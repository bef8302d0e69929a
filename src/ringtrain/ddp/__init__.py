"""Data-parallel training with gradient allreduce overlapped with backprop (WFBP) and merged
into buckets by the planner (MG-WFBP; by default the exact optimum of ``ringtrain.plan``).

Modules: ``wrapper`` (DistributedDataParallel: hooks, launch, wait, planning), ``buckets``
(pure layout of gradients in flat buffers), ``comm_thread`` (the one thread that runs the
collectives), ``calibration`` (allreduce sweep, backward profile, drift), ``timeline``
(Chrome trace, PNG drawing, per-iteration stats).
"""

from .timeline import IterationStats, draw_timeline, trace_path
from .wrapper import SCHEDULES, DDPOptions, DistributedDataParallel

__all__ = ["DDPOptions", "DistributedDataParallel", "IterationStats", "SCHEDULES", "draw_timeline", "trace_path"]
