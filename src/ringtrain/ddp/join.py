"""join(): training on uneven inputs, as torch's ``DistributedDataParallel.join``.

Every rank must run the same collectives in the same order, so a rank that runs out of
batches before the others would leave them waiting (``PeerLost`` or ``CommTimeout``). Inside
``with ddp.join():`` a rank whose loop has ended *joins*: until every rank has, it *shadows*
the collectives the ranks still training (the *active* ones) run, contributing zeros to their
gradients. Words (those of :mod:`.wrapper` and :mod:`.planning`):

- *announcement*: one small allreduce (max) that the active ranks run before each group of
  collectives of theirs, saying which group follows: ``BUFFERS`` (the forward's broadcast of
  the buffers) or ``BACKWARD`` (the backward's used bitmap and buckets, then the planning's
  collectives after it). A joined rank announces ``JOINED`` (0); so every rank learns which
  ranks are active, and a joined rank what to shadow. When no rank is active, all have joined.
  The announcement names groups, not forwards: a forward that broadcasts nothing needs none,
  and two forwards before one backward (a siamese loss) announce one backward.
- *shadowing a backward*: the used bitmap (zeros) and each bucket's allreduce (zeros; or the
  comm hook on a bucket of zeros, as torch's DDP runs it on a joined rank), in the
  order of the plan in force, then the planning's step for that iteration: the profile
  exchange, the trial's agreements and its new layouts come at the same iterations as on the
  active ranks, so the joined rank follows every plan change. It times nothing: it hands the
  planning its last profiled backward (an exchange needs a profile from every rank) and zero
  times to the trial, which the trial's agreement (the slowest rank's, a max) leaves out.
- *divisor*: the bucket's sum is divided by the world size (``divide_by_initial_world_size``,
  the mean with joined ranks counted as zeros), or by the number of active ranks in that
  iteration (read from the announcement, on the communication thread, before the buckets).
- *buffers* are broadcast from the highest active rank (a joined rank's are stale), as torch's
  DDP does under join; *at the end* the parameters (and buffers, with ``broadcast_buffers``) of
  the highest rank among those that joined last are broadcast to all, as torch's DDP does, so
  every rank leaves the block with the same model.

With ``throw_on_early_termination`` the active ranks announce at every forward that
synchronizes or broadcasts (``FORWARD``, or ``BUFFERS``), and the first announcement heard
after a rank joined raises a RuntimeError on every rank, the joined one included: nothing is
shadowed. A joined rank waits for each announcement within the communicator's deadline: a rank
that dies is a CommError on the others, and so is one that trains alone for longer than the
timeout between two announcements.

Under torch's own context manager (``torch.distributed.algorithms.join.Join([model, ...])``,
the wrapper being one of its *joinables*) the same announcements run inside torch's protocol:
an active rank first tells torch's ``Join`` that it is still training
(``Join.notify_join_context``: an allreduce on torch.distributed's default group, which a
joined rank's ``Join`` pairs with its count of the ranks still training), then announces, once per
iteration and at its forward, as torch's DDP does: the buffers and the backward a
synchronizing forward arms (``BUFFERS | BACKWARD``). A joined rank's *main hook* shadows one
iteration (the other joinables' hooks shadow their part of it after it), and the *post hook*
takes the final model as above. Where the forwards broadcast buffers, a second forward into the
same backward (a siamese loss, an evaluation before the backward) broadcasts them again, so
there the first forward announces ``BUFFERS | ARMED`` (a backward follows), each later one its
``BUFFERS``, and the backward itself ``BACKWARD`` at its start, as in ``join()``: the main hook
shadows them all, one iteration of torch's ``Join``. torch's ``throw_on_early_termination``
raises from that notification.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import numpy as np
import torch
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import JoinHook

from .comm_thread import settle_all
from .timeline import IterationStats

#: What a rank announces comes next (module docstring), flags: BUFFERS | BACKWARD or BUFFERS | ARMED
#: under torch's Join; FORWARD: throw_on_early_termination only.
JOINED, BUFFERS, BACKWARD, FORWARD, ARMED = 0, 1, 2, 4, 8
_NAN = float("nan")
#: What a joined rank hands the trial for an iteration it shadowed: nothing timed.
_UNTIMED = {f.name: 0.0 for f in dataclasses.fields(IterationStats)}


class Join:
    """One ``with ddp.join(...)`` block of one wrapper (module docstring). The wrapper calls
    :meth:`before_forward` and :meth:`before_backward` while its rank is active, divides its
    buckets' sums by :attr:`divisor`, and calls :meth:`shadow` once its rank has joined."""

    __slots__ = ("ddp", "comm", "per_rank", "throw", "torch", "apart", "said_backward", "divisor", "last_active",
                 "uneven")

    def __init__(self, ddp, divide_by_initial_world_size: bool, throw_on_early_termination: bool,
                 torch_join: bool = False):
        self.ddp = ddp
        self.comm = ddp.comm
        self.per_rank = not divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.torch = torch_join  # under torch's Join: its notification, then one announcement a forward
        # (under torch's Join) the forwards broadcast buffers: the backward is announced at its start
        self.apart = bool(torch_join and ddp.options.broadcast_buffers and ddp._module_buffers)
        # (under torch's Join) a forward announced the backward it armed, which has not begun yet
        self.said_backward = False
        self.divisor = ddp.world_size
        # The ranks active at the last announcement that had any (all, before the first): the
        # highest of them holds the final model.
        self.last_active = list(range(ddp.world_size))
        self.uneven = False  # some rank joined while others trained (their optimizers stepped more)

    # --- an active rank --------------------------------------------------------------------------

    def before_forward(self, broadcasts: bool, synchronizes: bool) -> int:
        """The forward is about to broadcast the buffers (``broadcasts``) and/or arm a
        synchronizing backward (``synchronizes``): announce what needs it; returns the rank to
        broadcast the buffers from, the highest active one."""
        if self.torch:
            return self._before_forward_torch(broadcasts, synchronizes)
        if broadcasts or (self.throw and synchronizes):
            return max(self._announce(BUFFERS if broadcasts else FORWARD)[1])
        return 0

    def _before_forward_torch(self, broadcasts: bool, synchronizes: bool) -> int:
        """:meth:`before_forward` under torch's Join (module docstring): the first forward of an
        iteration tells torch's Join, and announces; a later forward into the backward it armed
        announces its buffers only. Whether a backward was announced and has not begun is this
        block's count, not the wrapper's armed state, which a forward whose backward never came
        (an exception that left an earlier block, on every rank) leaves set."""
        if self.said_backward:  # (broadcasts only where the backward is announced apart)
            return max(self._announce(BUFFERS)[1]) if broadcasts else 0
        kind = (BUFFERS if broadcasts else 0) | ((ARMED if self.apart else BACKWARD) if synchronizes else 0)
        if not kind:
            return 0
        self._notify_torch()
        root = max(self._announce(kind)[1])
        self.said_backward = synchronizes
        return root

    def before_backward(self) -> None:
        """The backward's collectives are about to be queued: queue the announcement ahead of
        them (without waiting: the buckets' jobs, behind it on the same thread, read the divisor
        it sets). With ``throw_on_early_termination``, or under torch's Join where the forwards
        broadcast no buffers, the forward has announced already."""
        if self.torch:
            self.said_backward = False  # (the next synchronizing forward arms, and announces, another)
        if (not self.throw and not self.torch) or self.apart:
            self.ddp._thread.submit("join: announce", partial(self._say, BACKWARD))

    # --- a joined rank ---------------------------------------------------------------------------

    def shadow(self) -> None:
        """This rank has joined: shadow the active ranks until every rank has joined, then
        take the final model from the highest rank of those that joined last."""
        while self.shadow_once():
            pass
        self.finish()

    def shadow_once(self) -> bool:
        """Shadow the active ranks' next announced collectives, and after a forward that armed
        a backward announced apart (``ARMED``) the later forwards' and that backward's; False
        once no rank is active."""
        kind = self._shadow_next()
        if kind is None:
            return False
        armed = bool(kind & ARMED)
        while armed:
            kind = self._shadow_next()
            armed = kind is not None and not kind & BACKWARD
        return True

    def _shadow_next(self) -> Optional[int]:
        """Shadow the active ranks' next announced collectives; what they announced, or None
        once no rank is active."""
        ddp = self.ddp
        said, active = self._announce(JOINED)
        if not active:
            return None
        kinds = {int(said[r]) for r in active}
        if len(kinds) != 1:
            raise RuntimeError(f"ringtrain.DistributedDataParallel.join: the active ranks {active} announced "
                               f"different steps ({sorted(kinds)}): they no longer run the same program")
        kind = kinds.pop()
        if kind & BUFFERS:
            ddp._broadcast_tensors(ddp._module_buffers, "broadcast buffers", max(active))
        if kind & BACKWARD:
            self._shadow_backward()
        return kind

    def finish(self) -> None:
        """Every rank has joined: take the final model from the highest rank of those that joined last."""
        ddp = self.ddp
        params = ddp._states  # (not those torch's DDP was told to ignore: each rank's own)
        buffers = ddp._module_buffers if ddp.options.broadcast_buffers else []
        ddp._broadcast_tensors(params + buffers, "join: final model", max(self.last_active))
        # The next forward broadcasts the buffers where the one before it synchronized, and that
        # differs from rank to rank now (a rank's last forward may have been an evaluation, a
        # finished rank's a training one long ago): the same on every rank, none (they are equal).
        ddp._s.sync_buffers = False

    def _shadow_backward(self) -> None:
        """The active ranks' backward: the used bitmap and the buckets with zeros (fresh
        tensors: a ``.grad`` may be a view of the wrapper's buckets), then the planning's step."""
        ddp = self.ddp
        thread, timeout = ddp._thread, ddp._timeout
        jobs = []
        if ddp.options.find_unused_parameters:
            used = np.zeros(len(ddp._params), dtype=np.uint8)
            jobs.append(thread.submit("join: used parameters", partial(self.comm.allreduce, used, "max", "auto")))
        for k, spec in enumerate(ddp._specs):
            zeros = torch.zeros(spec.numel, dtype=spec.dtype)
            jobs.append(thread.submit(f"join: {ddp._reduction_label(k)}", partial(self._shadow_bucket, spec, zeros)))
        settle_all(jobs, timeout)
        for job in jobs:  # (re-raises the first error)
            job.wait(timeout)
        st, planning = ddp._s, ddp._planning
        # (its last profiled backward; none yet: NaN stamps, which the profile counts as zero time)
        stamps, start = planning.profile_rows[-1] if planning.profile_rows else ([_NAN] * len(ddp._params), None)
        planning.after_iteration(st.iteration, stamps, start, IterationStats(**{**_UNTIMED, "iteration": st.iteration}))
        st.iteration += 1
        ddp._reset_iteration()  # (the buckets' counts of a new layout)

    def _shadow_bucket(self, spec, zeros: torch.Tensor) -> None:
        """A bucket's reduction as the active ranks run it: the allreduce with their divisor
        (read on the thread, after the announcement before it set it), or the comm hook on the
        zeros (it divides by its group's size: join() refuses a hook with a divisor per rank),
        as torch's DDP runs the hook on a joined rank."""
        self.ddp._reduction(spec, zeros, self.divisor)()

    # --- both --------------------------------------------------------------------------------------

    def _notify_torch(self) -> None:
        """Tell torch's Join that this rank still trains (``Join.notify_join_context``: an
        allreduce on torch.distributed's default group), and wait for it (that group may be one
        over this communicator: the ``ringtrain`` backend). Under torch's
        ``throw_on_early_termination`` it raises torch's RuntimeError once some rank has joined."""
        work = TorchJoin.notify_join_context(self.ddp)
        if work is not None:
            work.wait()

    def _announce(self, kind: int) -> tuple[np.ndarray, list[int]]:
        """Announce ``kind`` and wait: every rank's announcement, and the active ranks."""
        ddp = self.ddp
        return ddp._thread.run("join: announce", partial(self._say, kind), ddp._timeout)

    def _say(self, kind: int) -> tuple[np.ndarray, list[int]]:
        """The announcement's allreduce, run on the communication thread (in order with every
        other collective of the wrapper), and what it tells (:meth:`_heard`)."""
        said = np.zeros(self.comm.world_size, dtype=np.int64)
        said[self.comm.rank] = kind
        self.comm.allreduce(said, "max", "auto")
        return said, self._heard(said)

    def _heard(self, said: np.ndarray) -> list[int]:
        """The active ranks in an announcement; sets the divisor, and with
        ``throw_on_early_termination`` raises where some rank has joined while others train."""
        active = [int(r) for r in np.flatnonzero(said)]
        if not active:
            return active
        self.last_active = active
        self.uneven = self.uneven or len(active) < self.comm.world_size
        if self.per_rank:
            self.divisor = len(active)
        if self.throw and len(active) < self.comm.world_size:
            joined = sorted(set(range(self.comm.world_size)) - set(active))
            raise RuntimeError(
                f"ringtrain.DistributedDataParallel.join(throw_on_early_termination=True): rank(s) {joined} ran out "
                f"of inputs while rank(s) {active} still train; raising on every rank (rank {self.comm.rank} here)")
        return active


class TorchJoinHook(JoinHook):
    """The wrapper's part of torch's ``Join([model, ...])`` on a rank that has joined (module
    docstring): each main hook shadows one announcement, the post hook takes the final model."""

    def __init__(self, ddp):
        self.ddp = ddp

    def main_hook(self) -> None:
        join = self.ddp._joining()
        if join is not None:
            self.ddp._raise_if_failed()
            join.shadow_once()

    def post_hook(self, is_last_joiner: bool) -> None:
        # (the final model's rank comes from the announcements, alike on every rank, not from
        # is_last_joiner, which is true on every rank of those that joined last)
        join = self.ddp._joining()
        if join is not None:
            try:
                self.ddp._raise_if_failed()
                join.finish()
            finally:
                self.ddp._leave_join()
