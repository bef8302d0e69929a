"""Data-parallel training with gradient allreduce overlapped with backprop (WFBP) and merged
into buckets by the planner (MG-WFBP; by default the exact optimum of ``ringtrain.plan``).

    import ringtrain
    comm = ringtrain.init()                        # torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    model = ringtrain.DistributedDataParallel(net, schedule="optimal", timeline="trace.json")
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()            # .grad = mean over ranks when this returns
        opt.step()
    print(model.last_stats)                        # forward, backward, communication, hidden share
    ringtrain.ddp.draw_timeline(["trace.rank0.json", "trace.rank1.json"], "timeline.png")

Modules: ``wrapper`` (DistributedDataParallel: hooks, bucket memory, launch, wait), ``options``
(DDPOptions: the wrapper's settings), ``unused`` (find_unused_parameters' graph walk and used
bitmap, the errors about missing or unexpected gradients), ``planning`` (the plan in force:
profile, first plan, trial, re-plans), ``trial`` (the trial of candidate plans), ``join``
(uneven inputs: the ranks that ran out shadow the others' collectives), ``comm_hook`` (torch's
communication hooks, ``register_comm_hook``, and the bucket they get), ``buckets``
(pure layout of gradients in flat buffers), ``comm_thread`` (the one thread that runs the
collectives), ``calibration`` (allreduce sweep, backward profile, drift), ``timeline``
(Chrome trace, PNG drawing, per-iteration stats), ``overhead`` (one-rank cost measurement).
"""

from .timeline import IterationStats, draw_timeline, trace_path
from .options import SCHEDULES, DDPOptions
from .wrapper import DistributedDataParallel

__all__ = ["DDPOptions", "DistributedDataParallel", "IterationStats", "SCHEDULES", "draw_timeline", "trace_path"]
