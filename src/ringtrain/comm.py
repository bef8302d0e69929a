"""The Communicator: one job's ranks, one transport, and the collectives on top of them.

A communicator owns a transport (how bytes move) and dispatches each collective to an
algorithm module in ``ringtrain.collectives`` (how the steps are arranged). It turns user
buffers into flat views, checks arguments, stamps each call with a CallHeader (so ranks that
disagree raise MismatchError), gives each call a deadline, and after any CommError marks
itself broken and tells the peers, so that no rank is left waiting.

Algorithm ``auto`` picks, identically on every rank (it depends only on arguments that the
call header makes equal everywhere):
- one rank: nothing to do;
- ranks on more than one host, with several ranks on some host: ``hierarchical`` for
  messages of at least 1 MiB;
- messages under 64 KiB: on 2 ranks ``naive`` (one exchange instead of two), else
  ``halving_doubling`` (2·log2 p start-ups instead of 2(p−1));
- otherwise ``ring`` (bandwidth-optimal).
The thresholds come from ``ringtrain bench allreduce`` on the development machine
(benchmarks/README.md); ``AUTO_SMALL_BYTES`` and ``AUTO_HIER_BYTES`` hold them.
"""

from __future__ import annotations

import importlib
import numbers
import threading
import time
from typing import Any, Callable, Optional, Sequence

from .collectives.ops import (NATIVE_DTYPES, FlatView, as_bfloat16, check_op_dtype, finish_mean, flat_view,
                              mark_written, op_name, reducer, staged)
from .errors import CommError, check_seconds, without_frames
from .transport.base import CallHeader, Transport, shape_digest
from .transport.ctrl_c import Breaker

ALGORITHMS = ("ring", "naive", "central", "halving_doubling", "hierarchical", "native", "auto")
AUTO_SMALL_BYTES = 64 * 1024
AUTO_HIER_BYTES = 1 << 20


def check_timeout(timeout: Any) -> float:
    """``timeout``: seconds each call may wait, a finite number > 0, or a str that is one (as
    rank, world_size and master_port may be: from the environment); never a bool."""
    return check_seconds("timeout", timeout)


def check_host_ids(host_ids: Optional[Sequence[str]], world_size: int) -> list[str]:
    """``host_ids``: each rank's host identity (str), one per rank; None: all on one host."""
    if host_ids is None:
        return ["local"] * world_size
    if isinstance(host_ids, str):
        raise ValueError(f"host_ids must be a sequence of {world_size} str (one per rank), not one str {host_ids!r}")
    ids = list(host_ids)
    if len(ids) != world_size or not all(isinstance(h, str) for h in ids):
        raise ValueError(f"host_ids must be {world_size} str, one per rank (world_size={world_size}), got {ids!r}")
    return ids


class Communicator:
    """Collectives among ``world_size`` ranks. Not thread-safe: one call at a time."""

    def __init__(
        self,
        transport: Transport,
        *,
        timeout: float = 60.0,
        host_ids: Optional[Sequence[str]] = None,
        store: Any = None,
        native_group_factory: Optional[Callable[[], Any]] = None,
    ):
        if not isinstance(transport, Transport):
            raise ValueError(f"transport must be a ringtrain Transport (tcp, shm, torch or local), got {transport!r}")
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.timeout = check_timeout(timeout)
        self.host_ids = check_host_ids(host_ids, self.world_size)
        self.store = store
        self._native_factory = native_group_factory
        self._native_group = None
        self._seq = 0
        self._broken: Optional[BaseException] = None
        self._closed = False
        self._lock = threading.Lock()

    # --- public collectives ---------------------------------------------------------------

    def allreduce(self, buf, op: str = "sum", algorithm: str = "auto"):
        """Reduce ``buf`` over all ranks, in place; every rank ends with the same result. ``op``:
        sum, mean, min, max, prod (or torch.distributed's ReduceOp.SUM, AVG, MAX, MIN, PRODUCT)."""
        work, back = staged(buf)  # (a buffer not laid out row-major: a row-major copy, written back)
        view, op = flat_view(work), op_name(op)
        check_op_dtype(op, view.dtype)
        alg = self._resolve(algorithm, view)
        if alg == "native" and (view.dtype not in NATIVE_DTYPES or (view.dtype == "complex64" and op == "prod")):
            raise ValueError(f"algorithm='native' (torch.distributed's gloo) cannot reduce {view.dtype} with op={op!r}: "
                             "use another algorithm (auto)")
        call = self._call_fields("allreduce", view, op, alg)
        acc = _accumulator(view, op)
        if self.world_size > 1:
            red = reducer(op, acc.dtype)
            if alg == "native":
                fn = lambda h, d: self._native_allreduce(acc, op, h, d)  # noqa: E731
            else:
                module = importlib.import_module(f"ringtrain.collectives.{alg}")
                kwargs = {"hosts": self.host_ids} if alg == "hierarchical" else {}
                fn = lambda h, d: module.allreduce(self.transport, acc.array, red, h, d, **kwargs)  # noqa: E731
            self._call(fn, call)
        else:
            self._call(None, call)
        if op == "mean":
            finish_mean(acc, self.world_size)
        _written(work, view, acc, back)
        return buf

    def reduce_scatter(self, buf, op: str = "sum"):
        """In place: afterwards chunk ``rank`` of ``buf`` (see collectives.schedule.chunk_bounds)
        holds the reduction of that chunk over all ranks; the other chunks are scratch."""
        from .collectives import ring, schedule

        work, back = staged(buf)  # (a buffer not laid out row-major: a row-major copy, written back)
        view, op = flat_view(work), op_name(op)
        check_op_dtype(op, view.dtype)
        call = self._call_fields("reduce_scatter", view, op, "ring")
        acc = _accumulator(view, op)
        red = reducer(op, acc.dtype)
        if self.world_size > 1:
            self._call(lambda h, d: ring.reduce_scatter(self.transport, acc.array, red, h, d), call)
        else:
            self._call(None, call)
        if op == "mean":
            lo, hi = schedule.chunk_bounds(acc.array.size, self.world_size)[self.rank]
            finish_mean(FlatView(acc.array[lo:hi], acc.dtype, (hi - lo,)), self.world_size)
        _written(work, view, acc, back)
        return buf

    def allgather(self, buf):
        """In place: rank r's input is chunk r of ``buf``; afterwards every chunk is filled."""
        from .collectives import ring

        work, back = staged(buf)
        view = flat_view(work)
        call = self._call_fields("allgather", view, "none", "ring")
        if self.world_size > 1:
            self._call(lambda h, d: ring.allgather(self.transport, view.array, h, d), call)
        else:
            self._call(None, call)
        _written(work, view, view, back)
        return buf

    def broadcast(self, buf, root: int = 0):
        """Copy root's ``buf`` into every rank's ``buf``, in place."""
        from .collectives import ring

        if isinstance(root, bool) or not isinstance(root, numbers.Integral) or not 0 <= root < self.world_size:
            raise ValueError(f"root must be a rank in [0, {self.world_size}), got {root!r}")
        root = int(root)  # a numpy integer too (the call header packs an int)
        work, back = staged(buf)
        view = flat_view(work)
        call = self._call_fields("broadcast", view, "none", "ring", root=root)

        def run(h: CallHeader, deadline: float) -> None:
            # The root only sends: the ranks check each other's calls first (ring.agree), so
            # that ranks naming different roots raise MismatchError, not a timeout or silence.
            ring.agree(self.transport, h, deadline)
            ring.broadcast(self.transport, view.array, root, h, deadline)

        self._call(run if self.world_size > 1 else None, call)
        _written(work, view, view, back)
        return buf

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        from .collectives import ring

        if self.world_size > 1:
            self._call(lambda h, d: ring.barrier(self.transport, h, d), ("barrier",))
        else:
            self._call(None, ("barrier",))

    @property
    def broken(self) -> Optional[BaseException]:
        """The error that broke this communicator (a failed call, or :meth:`abort`), else None: a copy
        of it without its traceback (which would keep the failed call's frames, and the caller's
        tensors in them, alive as long as the communicator); the failed call raised the original."""
        return self._broken

    def abort(self, error: BaseException) -> None:
        """Break this communicator by ``error`` (a failure of the caller's, outside any call: a
        communication hook that raised, say) and tell every peer, so that a peer's call in
        progress or next fails at once instead of waiting out its deadline: with ``error``'s type
        where it is a CommError (CommTimeout, PeerLost, ...), else a CommError, and its text
        ("rank 1 aborted: ValueError: bad"). Later calls here are refused naming it. Safe from another thread than a call
        in progress, which then fails. Nothing to do once broken (the peers were told) or closed."""
        if self._broken is not None or self._closed:
            return
        self._broken = without_frames(error)
        try:
            self.transport.abort(error)
        except Exception:  # noqa: BLE001 - best effort, as after a failed call; the error is kept
            pass

    def close(self) -> None:
        """Release every socket, segment and thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.transport.close()
        finally:
            self._native_group = None
            release = getattr(self._native_factory, "close", None)
            if release is not None:  # the gloo group of "native" and of transport="torch"
                release()
            self.store = None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, "
            f"transport={self.transport.name!r}, timeout={self.timeout})"
        )

    # --- internals ------------------------------------------------------------------------

    def _resolve(self, algorithm: str, view: FlatView) -> str:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if algorithm == "native" and self._native_factory is None:
            raise ValueError("algorithm='native' needs torch.distributed (create the communicator with ringtrain.init)")

        if algorithm != "auto":
            return algorithm
        nbytes = view.array.nbytes
        hosts = set(self.host_ids)
        if 1 < len(hosts) < self.world_size and nbytes >= AUTO_HIER_BYTES:
            return "hierarchical"
        if nbytes < AUTO_SMALL_BYTES:
            return "naive" if self.world_size == 2 else "halving_doubling"
        return "ring"

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    @staticmethod
    def _call_fields(kind: str, view: FlatView, op: str, alg: str, root: int = -1) -> tuple:
        """The call's CallHeader fields after its sequence number, which _call takes."""
        return kind, op, alg, view.dtype, int(view.array.size), shape_digest(view.shape), root, tuple(view.shape)

    def _call(self, fn, call: tuple) -> None:
        """Run ``fn(header, deadline)``, ``header`` the CallHeader of the next sequence number and
        the fields ``call``. The number is taken only once the call holds the lock: a call refused
        here (closed, broken, another thread's call in progress) must not put this rank a call
        ahead of the others."""
        if self._closed:
            raise CommError(f"rank {self.rank}: communicator is closed")
        if self._broken is not None:
            # the breaking error's class where it is one of ours (a peer's timeout stays a CommTimeout
            # for the call the user makes next, e.g. join()'s after a bucket's on the comm thread)
            message = f"rank {self.rank}: communicator is broken by an earlier error ({self._broken}); create a new one"
            try:
                refusal = type(self._broken)(message) if isinstance(self._broken, CommError) else CommError(message)
            except Exception:  # noqa: BLE001 - a subclass of the caller's that takes other arguments
                refusal = CommError(message)
            raise refusal from self._broken  # (shown above it, without the frames it was raised through)
        if fn is None:
            return
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("Communicator is not thread-safe: another collective is in progress")
        header = CallHeader(self._next_seq(), *call)
        try:
            fn(header, time.monotonic() + self.timeout)
        except BaseException as exc:
            error = exc
            if self._closed and isinstance(exc, Exception):  # close() from another thread, under the call
                error = CommError(f"rank {self.rank}: the communicator was closed during {header.describe()} (by "
                                  f"close() in another thread; the call then failed with {type(exc).__name__}: {exc})")
            self._broken = without_frames(error)
            try:
                self.transport.abort(error)
            except Exception:  # noqa: BLE001 - best effort; the original error matters
                pass
            if error is exc:
                raise
            raise error from exc
        finally:
            self._lock.release()

    def _native_allreduce(self, acc: FlatView, op: str, header: CallHeader, deadline: float) -> None:
        """torch.distributed's gloo allreduce of ``acc``, after the ranks have checked each
        other's calls (gloo does not: a size mismatch aborts the process, an op mismatch mixes
        results) and every rank knows that all of them passed; gloo's errors become CommErrors."""
        import numpy as np
        import torch
        import torch.distributed as dist

        from .collectives import ring

        ring.agree(self.transport, header, deadline)
        # agree() fails only the ranks whose predecessor differs; from 3 ranks on, a rank whose
        # predecessor agreed would go on into gloo, where the others' abort never reaches it. No
        # rank leaves the barrier before every rank has entered it, i.e. passed agree(). (On 2
        # ranks each is the other's predecessor: both have seen every header.)
        if self.world_size > 2:
            ring.barrier(self.transport, header, deadline)
        if not acc.array.size:
            return
        if self._native_group is None:
            self._native_group = self._native_factory()
        if acc.dtype == "bfloat16":  # held as uint16 in numpy
            tensor = torch.from_numpy(acc.array.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(acc.array)
        red = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN,
               "max": dist.ReduceOp.MAX, "prod": dist.ReduceOp.PRODUCT}[op]
        opts = dist.AllreduceOptions()
        opts.reduceOp = red
        breaker = getattr(self._native_factory, "breaker", None) or Breaker()  # Ctrl-C ends the wait
        try:
            with breaker.waiting():
                self._native_group.allreduce([tensor], opts).wait()
        except RuntimeError as exc:  # gloo's and the store's errors (DistError is one)
            raise breaker.failure(exc, self.rank, "waiting in gloo's allreduce", header.describe()) from exc


def _accumulator(view: FlatView, op: str) -> FlatView:
    """Where a reduction runs: ``view`` itself, or for a mean of a half-precision dtype a wider
    copy whose sum cannot overflow where the mean does not: float32 for float16 (whose sum
    overflows at 65504), float64 for bfloat16 (whose range is float32's, so a float32 sum of
    values near 3e38 overflows too; float64 also holds the sum of bfloat16 values exactly)."""
    import numpy as np

    if op == "mean" and view.dtype == "float16":
        return FlatView(view.array.astype(np.float32), "float32", view.shape)
    if op == "mean" and view.dtype == "bfloat16":  # (held as uint16)
        import torch

        return FlatView(as_bfloat16(view.array).to(torch.float64).numpy(), "float64", view.shape)
    return view


def _written(buf, view: FlatView, acc: FlatView, back: Optional[Callable[[], None]] = None) -> None:
    """Finish a collective's in-place write: copy a wider accumulator back to its float16 or
    bfloat16 buffer (rounded to nearest), tell autograd that a tensor it tracks has changed
    (ringtrain writes through numpy, which autograd does not see; torch's own in-place ops count
    the same way), and copy a staged buffer back into the caller's (``back``, from ``staged``)."""
    import numpy as np

    if acc is not view and view.dtype == "bfloat16":
        import torch

        as_bfloat16(view.array).copy_(torch.from_numpy(acc.array))  # (rounded to nearest)
    elif acc is not view:
        np.copyto(view.array, acc.array, casting="same_kind")
    mark_written(buf)
    if back is not None:
        back()
