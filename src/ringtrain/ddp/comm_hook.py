"""Communication hooks: torch DDP's ``register_comm_hook`` on ringtrain's wrapper.

A *hook* is ``hook(state, bucket) -> torch.futures.Future[Tensor]``, as torch's DDP takes it
(``torch.distributed.algorithms.ddp_comm_hooks``: ``allreduce_hook``, ``fp16_compress_hook``,
``bf16_compress_hook``, ``powerSGD_hook``, or one of the user's). Words:

- *bucket*: the :class:`GradBucket` a hook gets for one of the wrapper's buckets: torch's
  ``dist.GradBucket`` methods over its flat buffer, which holds this rank's gradients, not
  divided by anything (torch's hooks divide by their group's size, as with torch's DDP).
- *group*: the ProcessGroup the stock hooks send through, taken from ``state`` as they take it:
  ``state`` itself, or ``state.process_group`` (PowerSGD's state); None is torch.distributed's
  default group. The wrapper's ``process_group``, a ``ringtrain.TorchProcessGroup`` over its
  own communicator, needs no ``torch.distributed.init_process_group``.
- *result*: the value of the hook's future, the bucket reduced; written into the bucket's
  buffer, unless it is that buffer (torch's hooks reduce it in place and return it).

Why a hook runs the way it does:

- on the wrapper's communication thread, in place of the bucket's allreduce, one bucket at a
  time: the next bucket's hook starts once this one's future has completed and, where the group
  is one over the wrapper's own communicator, once the group has run every call made so far.
  So every rank issues the same collectives in the same order (PowerSGD issues some from its
  future's callbacks, whose timing differs from rank to rank: two buckets in flight would
  interleave them differently), and the communicator, which runs one call at a time, is never
  used by the group and the wrapper's own collectives at once;
- every wait has the wrapper's deadline: torch's ``Future.wait`` has none, so the thread waits
  on an event that the future's done-callback sets, and a future that never completes is a
  ``CommTimeout`` naming the hook;
- a hook that raises, a future that fails and a result that does not fit the bucket are a
  ``CommError`` naming the hook and the bucket, and the hook is not called again (the later
  buckets of that backward are skipped): this rank may have issued fewer collectives than its
  peers, and the next ones would pair with theirs. The wrapper is then broken, as after a
  failed allreduce.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import Communicator
from ..errors import CommError, CommTimeout, without_frames
from .buckets import bucket_of


class GradBucket:
    """One bucket as a hook sees it: the methods of torch's ``dist.GradBucket``."""

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_last")

    def __init__(self, index: int, buffer: torch.Tensor, gradients: Sequence[torch.Tensor],
                 parameters: Sequence[torch.Tensor], last: bool):
        self._index = index
        self._buffer = buffer
        self._gradients = list(gradients)
        self._parameters = list(parameters)
        self._last = last

    def index(self) -> int:
        """The bucket's position in launch order (0: the first gradients of backward)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat (1-D) buffer of the bucket's gradients, or what ``set_buffer`` put instead."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, in the order of :meth:`parameters`: views of the buffer
        (of the bucket's own buffer, whatever ``set_buffer`` did since, as torch's)."""
        return list(self._gradients)

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in backward order."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward (PowerSGD counts iterations by it)."""
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace what :meth:`buffer` returns (``fp16_compress_wrapper`` puts a float16 copy)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"GradBucket.set_buffer takes a tensor, got {type(tensor).__name__}")
        self._buffer = tensor

    def __repr__(self) -> str:
        return (f"GradBucket(index={self._index}, {self._buffer.numel()} {self._buffer.dtype} elements, "
                f"{len(self._parameters)} parameters{', last' if self._last else ''})")


def bucket_views(buffer: torch.Tensor, offsets: Sequence[int], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buffer`` shaped as ``params``, at ``offsets`` (a joined rank's zero buckets)."""
    return [buffer[off:off + p.numel()].view(p.shape) for off, p in zip(offsets, params)]


def hook_name(hook: Callable) -> str:
    """The hook's name for messages and the timeline (a partial's function's)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or type(hook).__name__


def check_hook(hook: Any) -> None:
    """torch's checks: a callable (TypeError), and where it is annotated, a bucket annotated as a
    ``dist.GradBucket`` and a return annotated as a ``torch.futures.Future[torch.Tensor]``
    (ValueError). torch looks the bucket up by the name ``bucket``; here it is the second
    parameter, whatever its name."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook: the communication hook must be callable, got {hook!r}")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):  # (a builtin without a signature: nothing to check)
        return
    params = list(sig.parameters.values())
    bucket = params[1].annotation if len(params) > 1 else inspect.Parameter.empty
    if bucket not in (inspect.Parameter.empty, dist.GradBucket, GradBucket) and not _names(bucket, "GradBucket"):
        raise ValueError(f"register_comm_hook: {hook_name(hook)}'s bucket annotation should be dist.GradBucket, "
                         f"got {bucket!r}")
    ret = sig.return_annotation
    if ret not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor], torch.futures.Future) \
            and not _names(ret, "Future"):
        raise ValueError(f"register_comm_hook: {hook_name(hook)}'s return annotation should be "
                         f"torch.futures.Future[torch.Tensor], got {ret!r}")


def _names(annotation: Any, name: str) -> bool:
    """A string annotation (``from __future__ import annotations``) naming ``name``."""
    return isinstance(annotation, str) and name in annotation


_NO_GROUP = object()


def hook_group(state: Any, world_size: int, rank: int) -> Optional[dist.ProcessGroup]:
    """The group the stock hooks send through for ``state`` (module docstring), checked to be
    this wrapper's ranks; None where the state names none (a state of the user's own)."""
    if isinstance(state, dist.ProcessGroup):
        group = state
    else:
        group = None if state is None else getattr(state, "process_group", _NO_GROUP)
        if group is _NO_GROUP or (group is not None and not isinstance(group, dist.ProcessGroup)):
            return None
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            where = "state=None" if state is None else f"{type(state).__name__}(process_group=None)"
            raise ValueError(
                f"register_comm_hook: {where} means torch.distributed's default group (dist.group.WORLD), as with "
                "torch's DDP, and torch.distributed is not initialized, so the hook would fail at the first backward. "
                "Pass the wrapper's own group, which needs no init_process_group: "
                "model.register_comm_hook(model.process_group, hook) (PowerSGD: "
                "PowerSGDState(process_group=model.process_group, ...)), or call "
                "torch.distributed.init_process_group first.")
        group = dist.group.WORLD
    if group.size() != world_size or group.rank() != rank:
        raise ValueError(f"register_comm_hook: the hook's process group is rank {group.rank()} of {group.size()}, but "
                         f"this wrapper is rank {rank} of {world_size}: the hook would reduce over other ranks than "
                         "the wrapper's. Pass model.process_group (a group over the wrapper's communicator).")
    return group


#: The attributes in which a hook's state keeps something per bucket index (PowerSGD's error
#: feedback and warm-start vectors): moved or emptied when the buckets are laid out otherwise.
BUCKET_STATE = ("error_dict", "p_memory_dict", "q_memory_dict")


def forget_buckets(state: Any, old: Optional[Sequence[Any]] = None, new: Optional[Sequence[Any]] = None) -> None:
    """The buckets were laid out anew, so index k now holds other gradients (or another number of
    them): empty what ``state`` keeps per bucket index (``BUCKET_STATE``). PowerSGD then goes on as
    if it compressed those buckets for the first time: fresh warm-start vectors, drawn from its
    generator (alike on every rank). Its error feedback (``error_dict``: per bucket, one residual
    per element of the bucket's buffer) is moved parameter by parameter from the ``old`` layout's
    buckets to the ``new`` one's (lists of ``buckets.BucketSpec``), so no gradient's residual is
    lost; without both layouts (a state used by an earlier wrapper, or loaded), dropped."""
    errors = getattr(state, "error_dict", None)
    moved = _moved_errors(errors, old, new) if isinstance(errors, dict) and errors and old and new else {}
    for name in BUCKET_STATE:
        kept = getattr(state, name, None)
        if isinstance(kept, dict):
            kept.clear()
    if moved:
        errors.update(moved)


def _moved_errors(errors: dict, old: Sequence[Any], new: Sequence[Any]) -> dict:
    """``errors`` (bucket index of ``old`` -> its buffer's residuals) by bucket index of ``new``:
    each parameter's slice copied from its old slot to its new one, zeros where its old bucket
    had none (not compressed yet); a new bucket that receives nothing gets no entry."""
    where = bucket_of(old, sum(len(spec.pids) for spec in old))  # (a spec's index is its place)
    moved = {}
    for spec in new:
        k = 2 if spec.dtype.is_complex else 1  # (a complex bucket's buffer is its real view: 2 floats an element)
        ends = list(spec.offsets[1:]) + [spec.numel]
        into = None
        for pid, off, end in zip(spec.pids, spec.offsets, ends):
            src, src_off = where[pid]
            residual = errors.get(src)
            if not isinstance(residual, torch.Tensor) or residual.numel() != old[src].numel * k:
                continue  # (none kept for that bucket, or not one of its buffer's size)
            if into is None:
                into = residual.new_zeros(spec.numel * k)
            into[k * off:k * end] = residual[k * src_off:k * (src_off + end - off)]
        if into is not None:
            moved[spec.index] = into
    return moved


class CommHook:
    """A registered hook (module docstring): :meth:`run` reduces one bucket with it, on the
    wrapper's communication thread. ``shared``: the ``ringtrain.TorchProcessGroup``s over the
    wrapper's communicator, which each run waits for until they have run every call made so far:
    the wrapper's list of its own ``process_group`` (empty until made; the hook may reach it
    through a state of the user's own), and the state's group where it is another one over that
    communicator. ``timeout``: the wrapper's deadline for each wait. ``comm``: the wrapper's
    communicator, which a failed run breaks, telling the peers (their hooks' calls end at once)."""

    __slots__ = ("hook", "state", "comm", "name", "own", "extra", "timeout", "failed", "layout")

    def __init__(self, hook: Callable, state: Any, comm: Communicator, own: list, extra: Sequence, timeout: float):
        self.hook, self.state, self.comm = hook, state, comm
        self.name = hook_name(hook)
        self.own, self.extra = own, tuple(extra)
        self.timeout = timeout
        self.failed: Optional[BaseException] = None  # the error of the run that failed (none runs after it)
        # the bucket layout the hook last reduced: the wrapper's list of specs, which it replaces, never changes
        self.layout: Any = None

    def run(self, bucket: GradBucket, layout: Any = None) -> None:
        """Reduce ``bucket`` with the hook: call it, wait for its future, write the result into
        the bucket's buffer. ``layout``: the wrapper's bucket layout in force (its list of
        specs); under another one than the hook last reduced (or the first: a state used by an
        earlier wrapper, or loaded, holds buckets of another layout), the state's buckets are
        forgotten first, its error feedback moved to the new ones (:func:`forget_buckets`; every
        rank changes layout at the same iteration).
        A layout laid out anew alike (the first plan grouping as the buckets before it) is the same:
        its buckets hold the same gradients, and PowerSGD's error feedback stays."""
        index = bucket.index()
        if layout is not self.layout:  # (the same list: the same layout; another: compared spec by spec)
            if self.layout is None or layout != self.layout:
                forget_buckets(self.state, self.layout, layout)
            self.layout = layout
        if self.failed is not None:
            raise CommError(f"comm hook {self.name} was not called on bucket {index}: it failed on an earlier bucket "
                            f"({type(self.failed).__name__}: {self.failed})")
        target = bucket.buffer()
        error: Optional[BaseException] = None
        try:
            future = self.hook(self.state, bucket)
            if not isinstance(future, torch._C.Future):
                raise TypeError(f"it returned {type(future).__name__}, not a torch.futures.Future (torch's hooks "
                                "return dist.all_reduce(..., async_op=True).get_future().then(...))")
            value = self._wait(future, index)
            write_result(value, target, index)
        except BaseException as exc:
            error = exc
        try:
            self._settle(index)  # (also after a failure: what the hook left running ends first)
        except BaseException as exc:
            error = error or exc  # (the hook's own error is the news, not the wait after it)
        if error is not None:
            self.failed = without_frames(error)  # (type and text: its frames held the bucket and the hook's state)
            failure = self._failure(error, index)
            self.comm.abort(failure)  # (as a failed allreduce would: no peer waits out its deadline)
            raise failure from error

    def _wait(self, future: torch.futures.Future, index: int) -> Any:
        """The future's value, once it completed (raises its error), within the deadline."""
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if not done.wait(self.timeout):
            raise CommTimeout(f"its future for bucket {index} did not complete within {self.timeout:.1f} s")
        return future.value()

    def _settle(self, index: int) -> None:
        """Until the groups over the wrapper's communicator have run every call made so far (a
        hook may leave calls behind its future), within the deadline."""
        for group in (*self.own, *self.extra):
            if not group.wait_idle(self.timeout):
                raise CommTimeout(f"the calls it made on {group!r} for bucket {index} did not end within "
                                  f"{self.timeout:.1f} s")

    def _failure(self, exc: BaseException, index: int) -> CommError:
        """The CommError a failed run raises: what failed, naming the hook and the bucket. Where a
        call over the communicator failed under the hook (a peer lost, a deadline, a mismatch),
        that error is the news, with its type: torch's futures hand it on wrapped in RuntimeErrors
        of their own, one per ``then``."""
        where = f"comm hook {self.name} on bucket {index}"
        if not isinstance(exc, CommError) and isinstance(self.comm.broken, CommError):
            exc = self.comm.broken
        if isinstance(exc, CommTimeout):
            return CommTimeout(f"{where}: {exc}")
        error = type(exc) if isinstance(exc, CommError) else CommError
        return error(f"{where} failed: {type(exc).__name__}: {exc}.")


def write_result(value: Any, target: torch.Tensor, index: int) -> None:
    """Write the future's ``value`` into the bucket's buffer ``target`` (nothing to do where it
    is that buffer). It must have the buffer's shape; another floating dtype is cast, as torch's
    DDP casts it (``fp16_compress_wrapper`` returns a float16 buffer). A list of one tensor (the
    value of a work's own future) counts as that tensor."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"its future's value is {type(value).__name__}, not a tensor: it must be the bucket's buffer "
                        "reduced (torch's hooks return bucket.buffer())")
    fits = value.dtype == target.dtype or (value.is_floating_point() and target.is_floating_point())
    if tuple(value.shape) != tuple(target.shape) or not fits:
        raise ValueError(f"its future's value is a {value.dtype} tensor of shape {tuple(value.shape)}, but bucket "
                         f"{index} is a buffer of shape {tuple(target.shape)}, {target.dtype}: the value must be the "
                         "bucket's buffer reduced (a tensor of the buffer's shape, and its dtype or another floating "
                         "one)")
    if value.dtype == target.dtype and value.data_ptr() == target.data_ptr() and value.stride() == target.stride():
        return  # the hook reduced the buffer in place and returned it
    with torch.no_grad():
        target.copy_(value)
