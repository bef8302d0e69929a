"""Whether the ranks still train one model: a check of the parameters every so many iterations.

The collectives pair the ranks' calls by their order, so a rank that steps its optimizer
otherwise than the others goes on unnoticed: a backward without a step on one rank (or a
second ``backward(retain_graph=True)``) makes the same allreduces as the others' next
iteration, and from then on that rank's parameters are not theirs, for the rest of the run.
Every ``parameter_check_interval`` synchronizing iterations the wrapper sums the bits of every
parameter it averages (integers: exact, the same on every rank for equal values), and the
ranks compare the sums in one allreduce of ``world_size`` numbers: where they differ every
rank raises a MismatchError naming the ranks. The parameters are compared at the end of a
backward, before that iteration's step: as the previous step left them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import MismatchError

#: The integer dtype of each element size, to read a parameter's bits as (complex128's: two int64s).
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def digest(params: Sequence[torch.Tensor]) -> int:
    """A number that equal parameters give alike: the sum of each one's bits read as integers,
    weighted by its position (two parameters' values swapped differ). Wraps around in int64."""
    with torch.no_grad():
        sums = torch.stack([p.detach().reshape(-1).view(_BITS[p.element_size()]).sum(dtype=torch.int64)
                            if p.numel() else torch.zeros((), dtype=torch.int64) for p in params])
        weights = torch.arange(1, len(params) + 1, dtype=torch.int64)
        return int((sums * weights).sum()) if len(params) else 0


def check_equal(run: Callable[[str, Callable[[], object]], object], allreduce, params: Sequence[torch.Tensor],
                rank: int, world_size: int, iteration: int, after_uneven_join: bool = False) -> None:
    """Compare ``params`` across the ranks (``run(label, call)`` runs ``call`` on the
    communication thread; ``allreduce(array, op)`` is the communicator's); a MismatchError on
    every rank where some rank's differ from rank 0's. ``after_uneven_join``: a ``join()`` block
    saw ranks out of data (they took fewer steps: the message names that cause first)."""
    sums = np.zeros(world_size, dtype=np.int64)
    sums[rank] = digest(params)
    run("check parameters", lambda: allreduce(sums, "sum"))  # (zeros elsewhere: each rank's own, exactly)
    apart = [r for r in range(world_size) if sums[r] != sums[0]]
    if not apart:
        return
    join = ("after a join() with uneven inputs the ranks that ran out of data took fewer optimizer steps, so "
            "their optimizer state (momentum, Adam's moments) differs although join() made the parameters equal: "
            "copy one rank's optimizer state to every rank after join() (or reset it on every rank); else "
            if after_uneven_join else "")
    raise MismatchError(
        f"ringtrain.DistributedDataParallel: rank {rank}: the parameters differ between the ranks at iteration "
        f"{iteration} (rank{'s' if len(apart) > 1 else ''} {', '.join(map(str, apart))} against rank 0's), so "
        f"they no longer train one model: {join}a rank stepped its optimizer otherwise than the others (a backward "
        "without an optimizer step, or a second backward of one forward, on one rank; a step skipped or made "
        "twice) or changed its parameters alone. parameter_check_interval=0 turns this check off (ranks whose "
        "CPUs round the optimizer's arithmetic differently drift apart in the last bits)")
