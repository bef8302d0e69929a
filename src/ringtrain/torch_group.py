"""ringtrain's communicator as a torch.distributed ProcessGroup, for torch's own DDP and its hooks.

    pg = ringtrain.TorchProcessGroup(ringtrain.init())
    model = torch.nn.parallel.DistributedDataParallel(module, process_group=pg)

or, once this module is imported, as a named backend of torch's (the ranks meet through torch's
own store, under torchrun or with init_method):

    import ringtrain.torch_group
    torch.distributed.init_process_group("ringtrain", timeout=timedelta(seconds=60))

Words: a *call* is one of torch's collective methods on the group (``allreduce(tensors, opts)``);
its *job* is what the communicator does for it, and the *work* is what the call returns: a
``torch.distributed.Work`` whose ``wait()`` and ``get_future()`` end when the job has.

Invariants:
- one worker thread per group runs the jobs one at a time, in the order of the calls, so the
  ranks' communicators see the same sequence of collectives (each call's arguments are checked
  on the caller's thread, and a refused call queues nothing); a call made from a callback of a
  future, which runs on that worker, runs at once, there, after the calls queued before it
  (waited for in the callback, as PowerSGD's hook does, it would otherwise never run);
- a job's error is kept, never swallowed: ``work.wait()`` raises it with its type and text
  (PeerLost, CommTimeout, MismatchError; not the worker's frames), ``work.get_future()``
  completes with it as torch's futures carry errors (a RuntimeError naming it, "PeerLost: ..."),
  which is what DDP's backward raises;
- nothing waits without a bound: every job is a communicator call, bounded by its timeout; after
  one fails, the communicator is broken and every later job fails at once.
"""

from __future__ import annotations

import copy
import math
import queue
from collections import deque
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .collectives.ops import OPS, check_op_dtype, flat_view, op_name
from .comm import ALGORITHMS, Communicator
from .errors import CommTimeout, without_frames

BACKEND = "ringtrain"
"""The name under which torch.distributed knows this group (``init_process_group(BACKEND)``)."""


#: Whether works are held until run and asked for (see _Work): torch older than 2.13, the oldest
#: checked without it (2.4.1 needs it; releases between were not checked).
HOLD_WORKS = torch.__version__ < (2, 13)  # (torch's TorchVersion compares with a tuple)

#: How many of the latest works left unasked a group holds (see _Worker.submit): C++ that keeps a
#: work the caller dropped (DDP's reducer keeps the forward's Join notification, under
#: join(divide_by_initial_world_size=False), waits for it at the backward's first gradient and
#: reads its future) reaches the work's methods only while its Python object lives; without, it
#: waited for ever in the base class's wait(). A few calls come between those two; this many
#: leaves room, and bounds what the held works keep alive (their tensors).
RECENT_WORKS = 64


class _Work(dist._Work):
    """One call's work. ``future`` is torch's own, for DDP and ``then`` chains; ``raw`` holds the
    job's result or its exception object, which ``wait()`` raises as it was."""

    def __init__(self, result, worker: threading.Thread, drain: Callable[[], None], live: dict,
                 forget: Callable[["_Work"], None]):
        super().__init__()
        self._result = result
        self._worker = worker
        self._drain = drain  # runs the queued jobs, on the worker thread (see wait)
        self.done = threading.Event()  # set once raw is: a wait on it, unlike torch's, ends on Ctrl-C
        self.raw: torch.futures.Future = torch.futures.Future()
        self.error: Optional[Exception] = None  # the job's, without frames, raised by wait() (raw: a copy)
        # A callback that raises marks the future it returns as failed in torch's C++ sense, which
        # DDP's reducer and then() chains see; raw.set_exception alone would read there as success.
        self.future = self.raw.then(lambda f: f.value())
        # Older torch (seen with 2.4.1; HOLD_WORKS): C++ (DDP's reducer) calls a Python work's get_future
        # through pybind11's trampoline, which finds the method only while the Python object
        # lives, and C++'s reference does not keep it alive: a job that had run by then had
        # dropped its last Python reference, and torch raised "Work::getFuture not implemented".
        # So there the group's worker holds the work (``live``; not a cycle of its own, which the
        # garbage collector would take) until it has run and been asked for (get_future, wait).
        # (Not under the torch versions checked to need none: a work dropped unasked is freed.)
        self._live = live
        self._forget = forget  # (the worker lets go of its latest work once it has run and been asked for)
        if HOLD_WORKS:
            live[id(self)] = self
        self._asked = False

    def _release_if_done(self) -> None:
        if self._asked and self.raw.done():
            self._live.pop(id(self), None)
            self._forget(self)

    def wait(self, timeout: Optional[timedelta | float] = None) -> bool:
        """Until the job has run (each job is bounded by the communicator's timeout, those queued
        before it too), or torch's ``timeout`` (a timedelta or seconds; zero or None: no more
        bound than that) is up. Called on the worker thread (a future's callback) for a job
        still queued, it runs the queued jobs there, up to and past this one, in their order: the
        thread would otherwise wait for itself; there, a job whose future is complete has run,
        also while that future's callbacks run (``done``, which other threads wait for, is set
        after them: a callback waiting for it would wait for itself)."""
        self._asked = True
        on_worker = threading.current_thread() is self._worker
        if on_worker and not self.raw.done():
            self._drain()
        seconds = _seconds(timeout)
        deadline = time.monotonic() + seconds if seconds > 0 else None
        while not (on_worker and self.raw.done()) and not self.done.wait(0.5):
            if not self._worker.is_alive() and not self.done.is_set():
                raise RuntimeError("ringtrain's process group was closed before this call ran")
            if deadline is not None and time.monotonic() > deadline:
                raise CommTimeout(f"ringtrain's process group: the call did not finish within {seconds:g} s "
                                  "(work.wait's timeout)")
        self._release_if_done()
        if self.error is not None:
            raise self.error
        return True

    def get_future(self) -> torch.futures.Future:
        self._asked = True
        self._release_if_done()
        return self.future

    def is_completed(self) -> bool:
        return self.raw.done()

    def exception(self) -> Optional[BaseException]:
        """The job's error once it has run (None: none, or not run yet), as torch's deprecated call."""
        return self.error if self.raw.done() else None

    def is_success(self) -> bool:
        """Whether the job has run without error (torch's deprecated call)."""
        return self.raw.done() and self.exception() is None

    def result(self):
        self.wait()
        return self._result


def _detached(error: Exception) -> Exception:
    """``error`` for torch's future: a copy of the same type and text, without the traceback.
    The future keeps what it is given where the garbage collector does not look, and the error
    itself reaches the group through its frames (the job's closure; the caller's, once wait()
    raised it): a group dropped after a failed call was never collected, nor its thread ended."""
    try:
        return copy.copy(error)  # (args and attributes; not the traceback, cause or context)
    except Exception:  # noqa: BLE001 - an exception type that does not copy: its name and text
        return RuntimeError(f"{type(error).__name__}: {error}")


def _seconds(timeout: Optional[timedelta | float]) -> float:
    """``Work.wait``'s timeout in seconds (torch takes a timedelta, and a float as seconds)."""
    if timeout is None:
        return 0.0
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout):
        return float(timeout)
    raise TypeError(f"Work.wait's timeout must be a datetime.timedelta or seconds, got {timeout!r}")


class _Worker:
    """The thread that runs a group's jobs, one at a time, in the order they were submitted.

    A job submitted on the worker thread itself runs at once, there, after the jobs queued
    before it: only a callback of a finished job's future runs there (torch runs a future's
    callbacks on the thread that completes it), and one that issues a collective and waits for
    it (PowerSGD's hook does, in its ``then`` chain) would otherwise wait for the thread it
    holds, for ever. The order of the jobs stays the order of the calls."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # (no job goes in after the end marker: it would never run)
        self._idle = threading.Condition(self._lock)  # notified when `_pending` reaches 0
        self._pending = 0  # jobs submitted whose futures are not completed yet
        self._live: dict[int, _Work] = {}  # works not yet both run and asked for (_Work.__init__, HOLD_WORKS)
        self._last: Optional[_Work] = None  # the latest work (held)
        self._unasked: deque[_Work] = deque(maxlen=RECENT_WORKS)  # the latest left unasked, held (RECENT_WORKS)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], result, closed: str) -> _Work:
        with self._lock:
            if self._stopped:
                raise RuntimeError(closed)
            work = _Work(result, self._thread, self._run_queued, self._live, self._forget)
            # A work not asked for (wait, get_future) by the next call may be asked later from
            # C++ (RECENT_WORKS): held. One asked at once (a synchronous call, a comm hook's
            # bucket, whose tensors can be large) is not.
            if self._last is not None and not self._last._asked:
                self._unasked.append(self._last)
            self._last = work
            self._pending += 1
            if threading.current_thread() is not self._thread:
                self._jobs.put((job, work))
                return work
        self._run_queued()  # (a call from a callback on this thread: see the class docstring)
        self._run_one(job, work)
        return work

    def _forget(self, work: _Work) -> None:
        """``work`` has run and been asked for: no longer held as the latest (its error, raised in
        the caller's frames, holds them, the group among them)."""
        with self._lock:
            if self._last is work:
                self._last = None

    def wait_idle(self, timeout: float) -> bool:
        """Until every job submitted so far has run and its future completed (callbacks
        included); False if that takes over ``timeout`` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stop(self, timeout: float) -> None:
        """Let the jobs already submitted finish (each is bounded), then end the thread."""
        with self._lock:
            self._stopped = True
            self._jobs.put(None)
        if threading.current_thread() is not self._thread:  # (closed from a callback: it ends after it)
            self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            self._run_one(*item)
            del item  # (the tensors are the caller's again)

    def _run_queued(self) -> None:
        """Run the jobs queued so far, here (on the worker thread, inside a callback)."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is None:  # stopped meanwhile: the end marker stays last
                self._jobs.put(None)
                return
            self._run_one(*item)

    def _run_one(self, job: Callable[[], None], work: _Work) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - kept for the caller's wait()
            # (torch's futures carry an Exception; a job's SystemExit, say, goes as a RuntimeError).
            # Kept without its traceback: the job's frames hold the group (its closure's ``self``),
            # and this thread holds the latest works left unasked (RECENT_WORKS): a group dropped
            # with its failed async call's work never asked for was never collected, nor its
            # thread ended.
            work.error = without_frames(exc) if isinstance(exc, Exception) else RuntimeError(repr(exc))
        # (out of the except block: the future's callbacks run in set_exception, and an error they
        # raised there would hold this one as its context)
        if work.error is None:
            work.raw.set_result(work._result)
        else:
            work.raw.set_exception(_detached(work.error))
        work.done.set()
        work._release_if_done()
        with self._idle:
            self._pending -= 1
            if not self._pending:
                self._idle.notify_all()


class TorchProcessGroup(dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose collectives are ringtrain's, over ``comm`` (None: the
    communicator made by ``ringtrain.init()``). CPU tensors; ``algorithm``: the allreduce algorithm
    (``ringtrain.ALGORITHMS``). While the group is open the communicator is the group's: call it
    through the group (``dist.all_reduce(t, group=pg)``), not directly. ``close()`` (torch's
    ``destroy_process_group`` calls it) ends the worker; it closes ``comm`` only where
    ``owns_comm`` (the named backend's groups, which made their communicator)."""

    def __init__(self, comm: Optional[Communicator] = None, *, algorithm: str = "auto", owns_comm: bool = False):
        if comm is None:
            from . import get_communicator

            comm = get_communicator()
        if not isinstance(comm, Communicator):
            raise ValueError(f"comm must be a ringtrain Communicator (ringtrain.init()), got {comm!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        super().__init__(comm.rank, comm.world_size)
        self.comm = comm
        self.algorithm = algorithm
        self._owns_comm = owns_comm
        self._worker: Optional[_Worker] = _Worker(f"ringtrain-pg-rank{comm.rank}")
        # A group dropped unclosed ends its worker when collected (the worker holds no reference
        # to the group); without, each such group's thread waited for ever on its empty queue.
        self._finalizer = weakref.finalize(self, self._worker.stop, 0.0)
        self._name: Optional[str] = None  # (set by torch for the groups it registers: setGroupName)
        self._desc = ""

    def getBackendName(self) -> str:
        return BACKEND

    # torch names the groups it registers (init_process_group, new_group) and reads the name back
    # (``pg.group_name``: destroy_process_group(group), functional collectives). The base class keeps
    # the name in its registered backends, which a ProcessGroup of Python's has none of; its
    # ``group_name`` was "ProcessGroup name not set". These are the C++ virtuals torch calls.
    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        if self._name is None:
            raise RuntimeError("ProcessGroup name not set: torch names the groups it registers "
                               "(init_process_group, new_group); this one was made directly")
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def __repr__(self) -> str:
        return f"TorchProcessGroup({self.comm!r}, algorithm={self.algorithm!r})"

    # --- collectives ------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        # (also torch's other forms: one tensor, and a ReduceOp for the options; torch's DDP
        # under join() with find_unused_parameters calls process_group.allreduce(tensor))
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        t = _written(_one(tensors, "allreduce"), "allreduce")
        op = _op(opts, "allreduce", t)
        return self._submit(lambda: self.comm.allreduce(t, op=op, algorithm=self.algorithm), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        """Every tensor of ``tensors`` reduced, in one allreduce of their concatenation."""
        tensors = list(tensors)
        for t in tensors:
            _check_cpu(t, "allreduce_coalesced")
        written = [_written(t, "allreduce_coalesced") for t in tensors]
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError(f"allreduce_coalesced: the tensors must share one dtype, got {[t.dtype for t in tensors]}")
        op = _op(opts, "allreduce_coalesced", tensors[0] if tensors else None)

        def job() -> None:
            flat = torch.cat([t.reshape(-1) for t in written]) if written else torch.empty(0)
            self.comm.allreduce(flat, op=op, algorithm=self.algorithm)
            for t, part in zip(written, flat.split([t.numel() for t in written])):
                t.copy_(part.view_as(t))

        return self._submit(job, tensors)

    def broadcast(self, tensors, opts=None):
        t = _written(_one(tensors, "broadcast"), "broadcast")
        root = opts.rootRank if opts is not None else 0
        if opts is not None and opts.rootTensor != 0:
            raise ValueError(f"broadcast: rootTensor must be 0 (one tensor per rank), got {opts.rootTensor}")
        if not 0 <= root < self.size():
            raise ValueError(f"broadcast: root must be a rank in [0, {self.size()}), got {root}")
        return self._submit(lambda: self.comm.broadcast(t, root=root), tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """torch's list form: output_tensors[0][i] receives rank i's input_tensors[0]."""
        x = _one(input_tensors, "allgather")
        outs = list(_one(output_tensors, "allgather", what="list of output tensors"))
        if len(outs) != self.size():
            raise ValueError(f"allgather: {len(outs)} output tensors for {self.size()} ranks")
        for o in outs:
            _check_like(o, x, x.numel(), "allgather", "each output tensor")
        outs = [_written(o, "allgather") for o in outs]
        n, flat = x.numel(), self._gather_buffer(x)

        def job() -> None:
            self.comm.allgather(flat)
            for i, o in enumerate(outs):
                o.copy_(flat[i * n:(i + 1) * n].view_as(o))

        return self._submit(job, output_tensors)

    def all_gather_single(self, output, input, opts=None):
        """all_gather_single (all_gather_into_tensor): ``output`` (size·n elements) receives every
        rank's ``input`` (n), in rank order."""
        return self._submit(self._gather_single_job(output, input, "all_gather_single"), [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """all_gather_single of each pair (outputs[i], inputs[i]), in order, as one work: torch's
        coalescing manager, and its functional all_gather_tensor (one pair), call this."""
        call = "all_gather_single_coalesced"
        jobs = [self._gather_single_job(o, x, call) for o, x in _pairs(outputs, inputs, call)]
        return self._submit(lambda: [job() for job in jobs], list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _gather_single_job(self, output, input, call: str) -> Callable[[], None]:
        _check_cpu(input, call)
        _check_like(output, input, input.numel() * self.size(), call, "output")
        flat, out = self._gather_buffer(input), _written(output, call)

        def job() -> None:
            self.comm.allgather(flat)
            out.copy_(flat.view_as(out))

        return job

    _allgather_base = all_gather_single  # (its older name, which older torch calls)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """torch's list form: output_tensors[0] receives the reduction of every rank's input_tensors[0][rank]."""
        y = _written(_one(output_tensors, "reduce_scatter"), "reduce_scatter")
        xs = list(_one(input_tensors, "reduce_scatter", what="list of input tensors"))
        op = _op(opts, "reduce_scatter", y)
        if len(xs) != self.size():
            raise ValueError(f"reduce_scatter: {len(xs)} input tensors for {self.size()} ranks")
        for x in xs:
            _check_like(x, y, y.numel(), "reduce_scatter", "each input tensor")
        flat = torch.cat([x.detach().reshape(-1) for x in xs])
        return self._submit(self._scatter_job(flat, y, op), output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        """reduce_scatter_single (reduce_scatter_tensor): ``output`` (n elements) receives chunk
        ``rank`` of the reduction of ``input`` (size·n elements) over the ranks."""
        return self._submit(self._scatter_single_job(output, input, opts, "reduce_scatter_single"), [output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """reduce_scatter_single of each pair (outputs[i], inputs[i]), in order, as one work: torch's
        coalescing manager, and its functional reduce_scatter_tensor (one pair), call this."""
        call = "reduce_scatter_single_coalesced"
        jobs = [self._scatter_single_job(o, x, opts, call) for o, x in _pairs(outputs, inputs, call)]
        return self._submit(lambda: [job() for job in jobs], list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _scatter_single_job(self, output, input, opts, call: str) -> Callable[[], None]:
        _check_cpu(output, call)
        _check_like(input, output, output.numel() * self.size(), call, "input")
        op = _op(opts, call, output)
        out = _written(output, call)
        flat = input.detach().reshape(-1).clone()  # (the communicator consumes its buffer; torch's input stays)
        return self._scatter_job(flat, out, op)

    _reduce_scatter_base = reduce_scatter_single

    def barrier(self, opts=None):
        return self._submit(self.comm.barrier, [])

    # --- what is not implemented: each says so, naming the call -----------------------------

    def send(self, *args, **kwargs):
        raise _unsupported("send (isend, batch_isend_irecv)")

    def recv(self, *args, **kwargs):
        raise _unsupported("recv (irecv)")

    def recv_anysource(self, *args, **kwargs):
        raise _unsupported("recv_anysource")

    def reduce(self, *args, **kwargs):
        raise _unsupported("reduce (use all_reduce)")

    def gather(self, *args, **kwargs):
        raise _unsupported("gather (use all_gather)")

    def scatter(self, *args, **kwargs):
        raise _unsupported("scatter (use broadcast)")

    def alltoall(self, *args, **kwargs):
        raise _unsupported("all_to_all")

    def alltoall_base(self, *args, **kwargs):
        raise _unsupported("all_to_all_single")

    all_to_all_single = alltoall_base

    def allgather_coalesced(self, *args, **kwargs):
        raise _unsupported("allgather_coalesced")

    def monitored_barrier(self, *args, **kwargs):
        raise _unsupported("monitored_barrier (use barrier: a silent rank is a CommTimeout)")

    # --- life --------------------------------------------------------------------------------

    def close(self, timeout: Optional[float] = None) -> None:
        """End the worker after the jobs already submitted (each bounded by the communicator's
        timeout; ``timeout`` seconds at most, default that timeout); close the communicator where
        the group owns it. Idempotent."""
        worker, self._worker = self._worker, None
        if worker is not None:
            self._finalizer.detach()
            worker.stop(self.comm.timeout if timeout is None else timeout)
            if self._owns_comm:
                self.comm.close()

    def wait_idle(self, timeout: float) -> bool:
        """Until every call made so far has run and its future completed, callbacks included
        (True), or ``timeout`` seconds (False). ringtrain's DistributedDataParallel waits so after
        a comm hook, before its own thread uses the communicator again."""
        worker = self._worker
        return True if worker is None else worker.wait_idle(timeout)

    def shutdown(self) -> None:
        self.close()

    def abort(self) -> None:
        """Close the communicator at once (its calls in progress fail, the peers learn of it)."""
        self.comm.close()
        self.close(timeout=0.0)

    # --- internals ---------------------------------------------------------------------------

    def _submit(self, job: Callable[[], None], result) -> _Work:
        worker = self._worker
        if worker is None:
            raise RuntimeError(f"{self!r} is closed")
        return worker.submit(job, result, f"{self!r} is closed")

    def _gather_buffer(self, x: torch.Tensor) -> torch.Tensor:
        """A flat buffer of size·n elements with ``x`` (n) in this rank's chunk, taken now."""
        n = x.numel()
        flat = torch.empty(n * self.size(), dtype=x.dtype)
        flat[self.rank() * n:(self.rank() + 1) * n].copy_(x.detach().reshape(-1))
        return flat

    def _scatter_job(self, flat: torch.Tensor, out: torch.Tensor, op: str) -> Callable[[], None]:
        n, r = out.numel(), self.rank()

        def job() -> None:
            self.comm.reduce_scatter(flat, op=op)
            out.copy_(flat[r * n:(r + 1) * n].view_as(out))

        return job


def _unsupported(call: str) -> NotImplementedError:
    return NotImplementedError(f"ringtrain's process group does not implement {call}; it implements "
                               "all_reduce, broadcast, all_gather, all_gather_single (all_gather_into_tensor), "
                               "reduce_scatter, reduce_scatter_single (reduce_scatter_tensor) and barrier "
                               "(docs/comm.md)")


def _check_cpu(t, call: str) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{call}: ringtrain's process group takes CPU tensors, got one on {where}")


def _one(tensors, call: str, what: str = "tensor"):
    """The one entry of a per-device list (torch's form; one CPU device per rank here)."""
    tensors = list(tensors)
    if len(tensors) != 1:
        raise ValueError(f"{call}: ringtrain's process group takes one {what} per rank, got {len(tensors)}")
    if what == "tensor":
        _check_cpu(tensors[0], call)
    return tensors[0]


def _pairs(outputs, inputs, call: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    outputs, inputs = list(outputs), list(inputs)
    if len(outputs) != len(inputs):
        raise ValueError(f"{call}: {len(outputs)} output tensors for {len(inputs)} input tensors")
    return list(zip(outputs, inputs))


def _written(t: torch.Tensor, call: str) -> torch.Tensor:
    """The tensor a call writes, as the communicator takes one: a leaf that requires grad (a
    parameter) through ``detach()``, which shares its memory and version counter (the write counts
    as an in-place op's; gloo's does not), so that the group's own copies into it are not recorded;
    one that is the result of a recorded operation refused now, naming the call."""
    if not t.requires_grad:
        return t
    if not t.is_leaf:
        raise ValueError(f"{call}: tensor requires grad and is the result of an operation autograd recorded: "
                         "writing it in place would change what backward computes; pass t.detach() (a copy: "
                         "t.detach().clone()) or a leaf tensor such as a parameter")
    return t.detach()


def _check_like(t: torch.Tensor, like: torch.Tensor, numel: int, call: str, what: str) -> None:
    _check_cpu(t, call)
    if t.dtype != like.dtype or t.numel() != numel:
        raise ValueError(f"{call}: {what} must be {numel} elements of {like.dtype}, got {t.numel()} of {t.dtype}")


def _op(opts, call: str, like: Optional[torch.Tensor] = None) -> str:
    """The reduction ``opts`` names, checked against the dtype of ``like`` now (AVG of integers,
    MAX of complex numbers: refused on the caller's thread, before anything is queued)."""
    op = op_name(getattr(opts, "reduceOp", opts)) if opts is not None else "sum"  # (options, or a ReduceOp)
    if op not in OPS:
        raise ValueError(f"{call}: ringtrain reduces with SUM, AVG, MAX, MIN or PRODUCT, not {getattr(op, 'name', op)}")
    if like is not None:
        try:
            check_op_dtype(op, flat_view(torch.empty(0, dtype=like.dtype)).dtype)
        except ValueError as exc:
            raise ValueError(f"{call}: {exc}") from None
    return op


def _create_backend(store, rank: int, world_size: int, timeout: timedelta) -> TorchProcessGroup:
    """torch's backend creator (``init_process_group("ringtrain")``, ``new_group(backend="ringtrain")``):
    a communicator of the group's ranks, meeting in the store torch hands over, with torch's timeout."""
    from . import rendezvous
    from .lifecycle import tie_to_launcher
    from .session import claim_rank, communicator_on_store, warn_if_unauthenticated

    tie_to_launcher()  # as ringtrain.init() does
    seconds = timeout.total_seconds()
    addr, port = rendezvous.store_endpoint(store)
    try:
        info = rendezvous.job_info(rank, world_size, addr, port)
    except ValueError as exc:
        if addr is not None:
            raise
        # (a FileStore or HashStore: no address of the job's, which the ranks' listeners are chosen by)
        raise ValueError(f"backend {BACKEND!r} over a {type(store).__name__}: the ranks meet through a TCP store "
                         "(init_method 'env://' or 'tcp://host:port', as torchrun's), or set MASTER_ADDR and "
                         f"MASTER_PORT for the ranks' listeners ({exc})") from None
    warn_if_unauthenticated(info)
    store = rendezvous.this_attempts(dist.PrefixStore("ringtrain/", store))
    store.set_timeout(timeout)
    # torch hands a group made again (destroy_process_group, then init_process_group; or in the
    # next attempt of a restarted job) the prefix of the one before, in a store that may have
    # outlived it (torchrun's agent's, the user's own): its ranks read the last group's job
    # identity and endpoints (an AuthError). Each rank counts the groups it makes there, and the
    # n-th meets the others' n-th under keys of its own. The rank is claimed first, as one
    # process's, here: two processes of one rank would count apart.
    claim_rank(store, info)
    made = store.add(f"made/{info.rank}", 1)
    comm = communicator_on_store(dist.PrefixStore(f"{made}/", store), info, "auto", seconds, seconds)
    return TorchProcessGroup(comm, owns_comm=True)


def register_backend() -> None:
    """Make ``init_process_group("ringtrain")`` build a TorchProcessGroup (importing this module does).
    Idempotent."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create_backend, devices=["cpu"])


register_backend()
