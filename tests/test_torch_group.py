"""ringtrain's TorchProcessGroup over threads: torch.distributed's calls on it, their results,
their errors. (torch's DDP over it, in real processes: test_torch_group_ddp.py.)"""

from __future__ import annotations

import inspect
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringtrain import CommError, MismatchError
from ringtrain.torch_group import TorchProcessGroup

from thread_harness import raise_first, run_comms

pytestmark = pytest.mark.timeout(60)
SIZES = [1, 2, 3, 4]


def data(rank: int, n: int, j: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Distinct per (rank, element), integer valued so every sum is exact."""
    return (torch.arange(n) + rank * n + j * 1000).to(dtype)


# group_src=/group_dst= (torch 2.6 on): a group passed as group= is not registered with torch, so its
# functions cannot translate a global src=; before 2.6 the group's own call is the way (docs/comm.md).
HAS_GROUP_SRC = "group_src" in inspect.signature(dist.broadcast).parameters


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn there).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def broadcast(t: torch.Tensor, root: int, pg) -> None:
    if HAS_GROUP_SRC:
        dist.broadcast(t, group_src=root, group=pg)
    else:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        pg.broadcast([t], opts).wait()


def on_group(p: int, fn, timeout: float = 10.0):
    """``fn(pg)`` on ``p`` threads, each with a TorchProcessGroup over its own communicator."""
    def body(comm):
        pg = TorchProcessGroup(comm)
        try:
            return fn(pg)
        finally:
            pg.close()

    return raise_first(run_comms(p, body, timeout=timeout))


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("op, reduce", [
    (dist.ReduceOp.SUM, lambda s: s.sum(0)),
    (dist.ReduceOp.AVG, lambda s: s.mean(0)),
    (dist.ReduceOp.MAX, lambda s: s.max(0).values),
    (dist.ReduceOp.MIN, lambda s: s.min(0).values),
    (dist.ReduceOp.PRODUCT, lambda s: s.prod(0)),
])
def test_all_reduce(p, op, reduce):
    def fn(pg):
        t = data(pg.rank(), 7, dtype=torch.float64).reshape(7, 1)
        dist.all_reduce(t, op=op, group=pg)
        return t

    expect = reduce(torch.stack([data(r, 7, dtype=torch.float64).reshape(7, 1) for r in range(p)]))
    for got in on_group(p, fn):
        assert torch.equal(got, expect)


@pytest.mark.parametrize("p", SIZES)
def test_broadcast_all_gather_reduce_scatter_barrier(p):
    n = 5

    def fn(pg):
        r = pg.rank()
        b = data(r, n)
        broadcast(b, p - 1, pg)
        outs = [torch.empty(n) for _ in range(p)]
        dist.all_gather(outs, data(r, n), group=pg)
        into = torch.empty(p, n)
        all_gather_single(into, data(r, n), group=pg)
        y = torch.empty(n, dtype=torch.int64)
        dist.reduce_scatter(y, [data(r, n, j, torch.int64) for j in range(p)], group=pg)
        z = torch.empty(n, dtype=torch.int64)
        whole = torch.cat([data(r, n, j, torch.int64) for j in range(p)])
        reduce_scatter_single(z, whole, group=pg)
        dist.barrier(group=pg)
        return b, outs, into, y, z, whole

    for rank, (b, outs, into, y, z, whole) in enumerate(on_group(p, fn)):
        assert torch.equal(b, data(p - 1, n))
        for i, o in enumerate(outs):
            assert torch.equal(o, data(i, n)), f"rank {rank}: all_gather's output {i}"
        assert torch.equal(into, torch.stack([data(i, n) for i in range(p)]))
        mine = sum(data(i, n, rank, torch.int64) for i in range(p))
        assert torch.equal(y, mine)
        assert torch.equal(z, mine)
        assert torch.equal(whole, torch.cat([data(rank, n, j, torch.int64) for j in range(p)])), "input kept"


def test_all_reduce_in_torchs_other_forms():
    # One tensor and a ReduceOp, as ProcessGroup.allreduce's overloads take them: torch's DDP
    # under join() with find_unused_parameters shadows the used-parameter map as
    # process_group.allreduce(tensor) (before: "takes one tensor per rank, got 8").
    p, n = 3, 8

    def fn(pg):
        a, b = data(pg.rank(), n), data(pg.rank(), n, 1)
        pg.allreduce(a).wait()
        pg.allreduce([b], dist.ReduceOp.MAX).wait()
        return a, b

    for a, b in on_group(p, fn):
        assert torch.equal(a, sum(data(r, n) for r in range(p)))
        assert torch.equal(b, data(p - 1, n, 1))


def test_all_reduce_coalesced_and_in_place_gather():
    p, n = 3, 4

    def fn(pg):
        r = pg.rank()
        ts = [data(r, n), data(r, 1).reshape(()), data(r, 6).reshape(2, 3)]
        pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
        out = torch.zeros(p * n)
        out[r * n:(r + 1) * n] = data(r, n)
        all_gather_single(out, out[r * n:(r + 1) * n], group=pg)  # the input a chunk of the output
        return ts, out

    for ts, out in on_group(p, fn):
        assert torch.equal(ts[0], sum(data(r, n) for r in range(p)))
        assert torch.equal(ts[1], sum(data(r, 1) for r in range(p)).reshape(()))
        assert torch.equal(ts[2], sum(data(r, 6) for r in range(p)).reshape(2, 3))
        assert torch.equal(out, torch.cat([data(r, n) for r in range(p)]))


def test_parameters_as_inputs_and_outputs():
    # A leaf that requires grad (a parameter) is read and written as gloo does: before, the group
    # copied an input parameter into a buffer autograd recorded, and all_gather, all_gather_single,
    # reduce_scatter (both forms) and allreduce_coalesced refused it as "the result of an
    # operation autograd recorded"; a parameter output failed in the worker's copy.
    p, n = 3, 4

    def param(t):
        return torch.nn.Parameter(t.clone())

    def fn(pg):
        r = pg.rank()
        outs = [param(torch.zeros(n)) for _ in range(p)]
        dist.all_gather(outs, param(data(r, n)), group=pg)
        into = param(torch.zeros(p * n))
        all_gather_single(into, param(data(r, n)), group=pg)
        y = param(torch.zeros(n))
        dist.reduce_scatter(y, [param(data(r, n, j)) for j in range(p)], group=pg)
        z = param(torch.zeros(n))
        reduce_scatter_single(z, param(torch.cat([data(r, n, j) for j in range(p)])), group=pg)
        ts = [param(data(r, n)), param(data(r, 2))]
        pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
        return outs, into, y, z, ts

    for rank, (outs, into, y, z, ts) in enumerate(on_group(p, fn)):
        for i, o in enumerate(outs):
            assert torch.equal(o.detach(), data(i, n)), f"rank {rank}: all_gather's output {i}"
            assert o.is_leaf and o.requires_grad
        assert torch.equal(into.detach(), torch.cat([data(i, n) for i in range(p)]))
        mine = sum(data(i, n, rank) for i in range(p))
        assert torch.equal(y.detach(), mine)
        assert torch.equal(z.detach(), mine)
        assert torch.equal(ts[0].detach(), sum(data(i, n) for i in range(p)))
        assert torch.equal(ts[1].detach(), sum(data(i, 2) for i in range(p)))


def test_an_output_autograd_recorded_is_refused_naming_the_call():
    # As the communicator refuses one (docs/comm.md: gloo writes it, changing what backward computes).
    def fn(pg):
        x = torch.ones(2, requires_grad=True)
        with pytest.raises(ValueError, match="all_gather_single.*autograd recorded"):
            all_gather_single(torch.ones(2 * pg.size(), requires_grad=True) * 2, torch.ones(2), group=pg)
        with pytest.raises(ValueError, match="broadcast.*autograd recorded"):
            dist.broadcast(x * 2, group_src=0, group=pg) if HAS_GROUP_SRC else pg.broadcast([x * 2])
        with pytest.raises(ValueError, match="allreduce_coalesced.*autograd recorded"):
            pg.allreduce_coalesced([x * 2], dist.AllreduceCoalescedOptions())
        with pytest.raises(ValueError, match="reduce_scatter_single.*autograd recorded"):
            reduce_scatter_single(x * 2, torch.ones(2 * pg.size()), group=pg)
        dist.barrier(group=pg)  # (nothing was queued: the ranks' sequences still agree)

    on_group(2, fn)


def test_the_group_keeps_the_name_torch_gives_it():
    # torch names the groups it registers and reads the name back (destroy_process_group(group));
    # before, a group of Python's answered "ProcessGroup name not set" (test_torch_group_ddp.py).
    def fn(pg):
        with pytest.raises(RuntimeError, match="name not set"):
            pg.group_name
        pg._set_group_name("g0")
        pg._set_group_desc("sub")
        return pg.group_name, pg.group_desc

    assert on_group(2, fn) == [("g0", "sub")] * 2


def test_gather_and_scatter_single_coalesced():
    # torch's coalescing manager and its functional all_gather_tensor / reduce_scatter_tensor (one
    # pair) call these; before, each was a NotImplementedError naming "several tensors at once".
    p, n = 3, 4

    def fn(pg):
        r = pg.rank()
        one = [torch.empty(p * n)]
        pg.allgather_into_tensor_coalesced(one, [data(r, n)]).wait()
        two = [torch.empty(p * n, dtype=torch.int64), torch.empty(p, 2)]
        pg.allgather_into_tensor_coalesced(two, [data(r, n, 1, torch.int64), data(r, 2)]).wait()
        ys = [torch.empty(n), torch.empty(1, dtype=torch.int64)]
        xs = [torch.cat([data(r, n, j) for j in range(p)]), data(r, p, 2, torch.int64)]
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        pg.reduce_scatter_tensor_coalesced(ys, xs, opts).wait()
        with pytest.raises(ValueError, match="all_gather_single_coalesced: 1 output tensors for 2"):
            pg.allgather_into_tensor_coalesced([torch.empty(p)], [torch.empty(1), torch.empty(1)])
        return one, two, ys

    for rank, (one, two, ys) in enumerate(on_group(p, fn)):
        assert torch.equal(one[0], torch.cat([data(i, n) for i in range(p)]))
        assert torch.equal(two[0], torch.cat([data(i, n, 1, torch.int64) for i in range(p)]))
        assert torch.equal(two[1], torch.stack([data(i, 2) for i in range(p)]))
        assert torch.equal(ys[0], data(p - 1, n, rank)), f"rank {rank}"
        assert torch.equal(ys[1], data(p - 1, p, 2, torch.int64)[rank:rank + 1]), f"rank {rank}"


def test_async_work_and_future():
    def fn(pg):
        t = data(pg.rank(), 3)
        work = dist.all_reduce(t, group=pg, async_op=True)
        chained = dist.all_reduce(torch.ones(2), group=pg, async_op=True).get_future().then(lambda f: f.value()[0] * 10)
        assert work.wait() is True
        assert work.is_completed() and work.is_success() and work.exception() is None
        return t, chained.wait(), work.get_future().wait()

    for t, chained, value in on_group(2, fn):
        assert torch.equal(t, data(0, 3) + data(1, 3))
        assert torch.equal(chained, torch.full((2,), 20.0))
        assert value[0] is not None and torch.equal(value[0], t)


def test_collectives_run_in_call_order():
    """Many calls issued before any is waited for: the worker runs them in order on every rank."""
    def fn(pg):
        ts = [data(pg.rank(), 9, j) for j in range(20)]
        works = [dist.all_reduce(t, group=pg, async_op=True) for t in ts]
        for w in works:
            w.wait()
        return ts

    for ts in on_group(3, fn):
        for j, t in enumerate(ts):
            assert torch.equal(t, sum(data(r, 9, j) for r in range(3)))


def test_a_callback_may_wait_for_the_collective_it_issues():
    """A future's callbacks run on the group's worker: one that issues a collective and waits for
    it (PowerSGD's hook does) has it run there, after the calls queued before it, in call order
    on every rank; wait_idle then says every call has ended."""
    def fn(pg):
        queued = data(pg.rank(), 4, 1)
        second = data(pg.rank(), 4, 2)

        def callback(fut):
            dist.all_reduce(queued, group=pg, async_op=True)  # (issued before the callback's: runs first)
            return dist.all_reduce(second, group=pg, async_op=True).get_future().wait()[0] * 10

        first = data(pg.rank(), 4)
        chained = dist.all_reduce(first, group=pg, async_op=True).get_future().then(callback)
        value = chained.wait()
        assert pg.wait_idle(5.0)
        return first, queued, value

    for first, queued, value in on_group(3, fn):
        assert torch.equal(first, sum(data(r, 4) for r in range(3)))
        assert torch.equal(queued, sum(data(r, 4, 1) for r in range(3)))
        assert torch.equal(value, 10 * sum(data(r, 4, 2) for r in range(3)))


def test_a_callback_may_wait_for_a_call_made_before_it():
    """A callback on the group's worker that waits for a call made before it, still queued behind
    the callback, runs the queued calls there (waiting, the thread would wait for itself)."""
    def fn(pg):
        if pg.rank() == 0:  # (the others' first call waits for rank 0's: their callbacks attach first)
            time.sleep(0.3)
        first, second = data(pg.rank(), 4), data(pg.rank(), 4, 1)
        work = dist.all_reduce(first, group=pg, async_op=True)
        queued = dist.all_reduce(second, group=pg, async_op=True)
        chained = work.get_future().then(lambda fut: (queued.wait(), second * 10)[1])
        value = chained.wait()
        assert pg.wait_idle(5.0)
        return value

    for value in on_group(3, fn):
        assert torch.equal(value, 10 * sum(data(r, 4, 1) for r in range(3)))


def test_a_callback_may_wait_for_the_work_whose_future_called_it():
    """A callback of a work's own future (or of collect_all over several) may wait for that work,
    as with gloo: the job has run, though the worker is still in its callbacks; the group goes
    on with the next call. wait() takes seconds as well as a timedelta, as torch's does."""
    def fn(pg):
        t, u = data(pg.rank(), 3), data(pg.rank(), 2, 1)
        work = dist.all_reduce(t, group=pg, async_op=True)
        own = work.get_future().then(lambda f: (work.wait(timedelta(seconds=3)), f.value()[0] * 10)[1]).wait()
        works = [dist.all_reduce(u, group=pg, async_op=True), dist.all_reduce(torch.ones(1), group=pg, async_op=True)]
        both = torch.futures.collect_all([w.get_future() for w in works]).then(lambda _: [w.wait(2.0) for w in works])
        assert both.wait() == [True, True]
        later = torch.ones(2)
        dist.all_reduce(later, group=pg)
        with pytest.raises(TypeError, match="timedelta or seconds"):
            works[0].wait("3 s")
        return t, own, u, later

    for t, own, u, later in on_group(2, fn):
        assert torch.equal(own, 10 * t) and torch.equal(t, data(0, 3) + data(1, 3))
        assert torch.equal(u, data(0, 2, 1) + data(1, 2, 1)) and torch.equal(later, torch.full((2,), 2.0))


def test_mismatch_surfaces_at_wait_and_in_the_future():
    """A ringtrain error in the worker reaches the caller: work.wait() raises it as it was; the
    future (what DDP and then() chains see) fails with a RuntimeError naming it; every later call
    fails at once (the communicator is broken), never hangs."""
    def fn(pg):
        t = torch.zeros(3 + pg.rank())
        work = dist.all_reduce(t, group=pg, async_op=True)
        with pytest.raises(MismatchError):
            work.wait()
        with pytest.raises(RuntimeError, match="MismatchError"):
            work.get_future().wait()
        # torch's deprecated status calls say it too (they said success, no exception)
        assert not work.is_success() and isinstance(work.exception(), MismatchError)
        with pytest.raises(CommError, match="broken"):
            dist.all_reduce(torch.zeros(3), group=pg)
        return True

    assert on_group(2, fn) == [True, True]


def test_bad_calls_are_refused_at_once_naming_the_call():
    def fn(pg):
        with pytest.raises(ValueError, match="all_gather_single: output must be 6 elements"):
            pg.all_gather_single(torch.empty(5), torch.empty(3))
        with pytest.raises(ValueError, match="allreduce: .* one tensor per rank, got 2"):
            pg.allreduce([torch.ones(1), torch.ones(1)], dist.AllreduceOptions())
        with pytest.raises(ValueError, match="not .*BAND"):
            dist.all_reduce(torch.ones(1, dtype=torch.int32), op=dist.ReduceOp.BAND, group=pg)
        with pytest.raises(ValueError, match="broadcast: .* CPU tensors, got one on meta"):
            broadcast(torch.empty(2, device="meta"), 0, pg)
        with pytest.raises(ValueError, match="allreduce: op='mean' needs a floating dtype, got int32"):
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG, group=pg)
        with pytest.raises(ValueError, match="reduce_scatter_single: op='max' needs ordered values, got complex64"):
            reduce_scatter_single(torch.empty(1, dtype=torch.complex64), torch.ones(2, dtype=torch.complex64),
                                  op=dist.ReduceOp.MAX, group=pg)
        with pytest.raises(ValueError, match="reduce_scatter: 1 input tensors for 2 ranks"):
            dist.reduce_scatter(torch.empty(1), [torch.ones(1)], group=pg)
        opts = dist.BroadcastOptions()
        opts.rootRank = 5  # (before: refused in the job, at wait, not naming the call)
        with pytest.raises(ValueError, match=r"broadcast: root must be a rank in \[0, 2\), got 5"):
            pg.broadcast([torch.ones(1)], opts)
        # Unsupported collectives: a NotImplementedError naming the call, before anything moves.
        with pytest.raises(NotImplementedError, match="does not implement gather"):
            if HAS_GROUP_SRC:
                dist.gather(torch.ones(1), [torch.empty(1)] * 2 if pg.rank() == 0 else None, group_dst=0, group=pg)
            else:
                pg.gather([[torch.empty(1)] * 2] if pg.rank() == 0 else [], [torch.ones(1)], dist.GatherOptions())
        with pytest.raises(NotImplementedError, match="does not implement send"):
            pg.send([torch.ones(1)], 1 - pg.rank(), 0)
        with pytest.raises(NotImplementedError, match="does not implement all_to_all_single"):
            dist.all_to_all_single(torch.empty(2), torch.ones(2), group=pg)
        # ... and the group still works.
        t = torch.ones(2)
        dist.all_reduce(t, group=pg)
        return t

    for t in on_group(2, fn):
        assert torch.equal(t, torch.full((2,), 2.0))


def test_a_call_racing_close_is_run_or_refused_never_left_waiting():
    """close() on one thread while another submits: each call either ran (wait() returns) or was
    refused as closed, never queued behind the end of the worker (a wait() with nothing to end it)."""
    import threading

    def fn(pg):
        works, refused, go = [], [], threading.Event()

        def submit():
            go.wait()
            for _ in range(200):
                try:
                    works.append(pg.barrier())
                except RuntimeError as exc:
                    refused.append(str(exc))
                    return

        t = threading.Thread(target=submit)
        t.start()
        go.set()
        pg.close()
        t.join(10)
        outcomes = []
        for work in works:
            try:
                outcomes.append(work.wait())  # (a barrier the peer also ran, or one it never joined)
            except Exception as exc:  # noqa: BLE001 - any error, as long as the wait ends
                outcomes.append(type(exc).__name__)
        return len(works), refused[:1], outcomes

    for count, refused, outcomes in on_group(1, fn):
        assert len(outcomes) == count and all(r.endswith("is closed") for r in refused)


def test_closed_group_refuses_calls():
    def fn(pg):
        assert pg.name() == "ringtrain" and pg.size() == 2
        pg.close()
        pg.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            dist.all_reduce(torch.ones(1), group=pg)
        return True

    assert on_group(2, fn) == [True, True]


def test_a_group_dropped_unclosed_ends_its_worker_thread():
    """A group let go without close() (a notebook cell that makes one again) ends its worker
    when collected: each left a thread waiting for ever on its queue (20 groups, 20 threads)."""
    import gc

    def fn(comm):
        for _ in range(20):
            pg = TorchProcessGroup(comm)
            dist.all_reduce(torch.ones(2), group=pg)
            del pg
        gc.collect()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and _pg_threads(comm.rank):
            time.sleep(0.01)
        return _pg_threads(comm.rank)

    assert raise_first(run_comms(2, fn)) == [0, 0]


def test_a_group_dropped_after_a_failed_call_is_collected_and_its_worker_ends():
    """A script that starts again after a peer's failure (a new communicator and group, the old
    ones dropped) leaves nothing behind. The failed call's error reached the group through its
    frames (the job's closure; the caller's, where wait() raised it) and was kept where the
    garbage collector does not look (torch's future, and the error its callback raised, whose
    context it was) and by the worker as its latest work: the group was never collected."""
    import gc
    import weakref

    from ringtrain.comm import Communicator
    from ringtrain.transport.local import run_threads

    def body(transport):
        comm = Communicator(transport, timeout=10.0)
        pg = TorchProcessGroup(comm)
        error = None
        if comm.rank == 1:
            comm.abort(ValueError("rank 1 gives up"))
        else:
            try:
                dist.all_reduce(torch.ones(3), group=pg)
            except CommError as exc:
                error = f"{type(exc).__name__}: {exc}"
        ref = weakref.ref(pg)
        del pg, comm
        gc.collect()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and _pg_threads(transport.rank):
            time.sleep(0.01)
        return error, ref() is None, _pg_threads(transport.rank)

    assert raise_first(run_threads(2, body, timeout=60.0)) == [("CommError: rank 1 aborted: ValueError: rank 1 gives up", True, 0),
                                                                   (None, True, 0)]


def test_a_group_dropped_with_failed_async_works_never_asked_for_is_collected():
    """Async calls that failed (a mismatch, then a later call refused by the broken communicator)
    whose works were dropped without wait() or get_future(): the worker holds the latest works
    left unasked, and their errors' tracebacks held the group (the job's frames): the group was
    never collected, nor its thread ended."""
    import gc
    import weakref

    from ringtrain.comm import Communicator
    from ringtrain.transport.local import run_threads

    def body(transport):
        pg = TorchProcessGroup(Communicator(transport, timeout=10.0))
        dist.all_reduce(torch.ones(3 + transport.rank), group=pg, async_op=True)  # a mismatch
        dist.all_reduce(torch.ones(3), group=pg, async_op=True)  # refused: broken
        assert pg.wait_idle(10.0)
        ref = weakref.ref(pg)
        del pg
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and (ref() is not None or _pg_threads(transport.rank)):
            gc.collect()
            time.sleep(0.01)
        return ref() is None, _pg_threads(transport.rank)

    assert raise_first(run_threads(2, body, timeout=60.0)) == [(True, 0), (True, 0)]


def _pg_threads(rank: int) -> int:
    import threading

    return sum(t.name == f"ringtrain-pg-rank{rank}" for t in threading.enumerate())


def test_the_group_holds_a_work_until_it_has_run_and_been_asked_for(monkeypatch):
    """torch before 2.13 (seen with 2.4.1) reaches a Python work's get_future only while the Python
    object lives (C++'s reference does not keep it): there the group holds each work until it has
    run and been asked for (get_future or wait), then lets it go; nothing accumulates."""
    import ringtrain.torch_group as tg

    monkeypatch.setattr(tg, "HOLD_WORKS", True)

    def fn(pg):
        live = pg._worker._live
        dropped = id(dist.all_reduce(torch.ones(3), group=pg, async_op=True))  # not asked for yet
        assert pg.wait_idle(10.0)
        held_unasked = dropped in live
        live[dropped].get_future()  # (what torch's C++ would do through the trampoline)
        works = [dist.all_reduce(torch.ones(3), group=pg, async_op=True) for _ in range(5)]
        for f in [w.get_future() for w in works[:3]]:
            f.wait()
        for w in works[3:]:
            w.wait()
        dist.all_reduce(torch.ones(3), group=pg)  # (a synchronous call: waited for inside)
        assert pg.wait_idle(10.0)  # (the worker lets a work go just after completing its future)
        return held_unasked, len(live)

    for held_unasked, held_end in on_group(2, fn):
        assert held_unasked and held_end == 0
