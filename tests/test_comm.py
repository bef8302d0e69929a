"""The Communicator over threads: arguments, in-place semantics, mismatches, timeouts."""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
import torch

from ringtrain import CommError, MismatchError
from ringtrain.collectives import schedule
from ringtrain.comm import ALGORITHMS, Communicator
from ringtrain.transport.local import LocalHub

from thread_harness import raise_first, run_comms

pytestmark = pytest.mark.timeout(60)
REAL_ALGORITHMS = [a for a in ALGORITHMS if a not in ("native", "auto")]


def data(rank: int, n: int, dtype=np.float32) -> np.ndarray:
    """Distinct per (rank, element), integer valued so every sum is exact."""
    return (np.arange(n) + rank * n).astype(dtype)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("algorithm", REAL_ALGORITHMS + ["auto"])
def test_allreduce_numpy_in_place(p, algorithm):
    n = 37

    def fn(comm):
        buf = data(comm.rank, n)
        out = comm.allreduce(buf, algorithm=algorithm)
        assert out is buf
        return buf

    expect = sum(data(r, n) for r in range(p))
    for got in raise_first(run_comms(p, fn)):
        np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "mean"])
def test_allreduce_torch_tensor_ops(dtype, op):
    p, n = 3, 11
    if op == "mean" and not dtype.is_floating_point:
        pytest.skip("mean of integers is rejected (tested below)")

    def make(rank):
        base = torch.arange(n, dtype=torch.int64) % 3 + 1 + rank if op != "prod" else (torch.arange(n) + rank) % 2 + 1
        return base.to(dtype).reshape(1, n)

    def fn(comm):
        t = make(comm.rank)
        assert comm.allreduce(t, op=op) is t
        return t

    stack = torch.stack([make(r) for r in range(p)]).to(torch.float64)
    expect = {"sum": stack.sum(0), "max": stack.max(0).values, "min": stack.min(0).values,
              "prod": stack.prod(0), "mean": stack.sum(0) / p}[op].to(dtype)
    for got in raise_first(run_comms(p, fn)):
        assert got.dtype == dtype and got.shape == (1, n)
        assert torch.equal(got, expect), (op, dtype, got, expect)


def test_collectives_in_place():
    p, n = 4, 10  # 10 elements in 4 chunks: 3, 3, 2, 2
    bounds = schedule.chunk_bounds(n, p)

    def fn(comm):
        r = comm.rank
        rs = data(r, n)
        comm.reduce_scatter(rs)
        ag = np.zeros(n, dtype=np.float32)
        lo, hi = bounds[r]
        ag[lo:hi] = r + 1
        comm.allgather(ag)
        bc = data(r, n)
        comm.broadcast(bc, root=2)
        comm.barrier()
        return rs[lo:hi], ag, bc

    total = sum(data(r, n) for r in range(p))
    for r, (rs, ag, bc) in enumerate(raise_first(run_comms(p, fn))):
        lo, hi = bounds[r]
        np.testing.assert_array_equal(rs, total[lo:hi])
        np.testing.assert_array_equal(ag, np.concatenate([np.full(h - l, q + 1) for q, (l, h) in enumerate(bounds)]))
        np.testing.assert_array_equal(bc, data(2, n))


def test_broadcast_root_may_be_a_numpy_integer():
    # root=np.int64(1) (say from np.argmax) was refused: "root must be a rank in [0, 3), got np.int64(1)".
    def fn(comm):
        bc = data(comm.rank, 5)
        comm.broadcast(bc, root=np.int64(1))
        return bc

    for bc in raise_first(run_comms(3, fn)):
        np.testing.assert_array_equal(bc, data(1, 5))


def test_mismatched_op_raises_on_every_rank():
    def fn(comm):
        comm.allreduce(np.ones(100, dtype=np.float32), op="max" if comm.rank == 1 else "sum", algorithm="ring")

    results = run_comms(3, fn)
    assert all(isinstance(r, MismatchError) for r in results), results
    text = " ".join(str(r) for r in results)
    assert "op=max" in text and "op=sum" in text


@pytest.mark.parametrize("which", ["dtype", "shape", "numel", "algorithm"])
def test_mismatched_call_raises_on_every_rank(which):
    def fn(comm):
        odd = comm.rank == 2
        dtype = np.float64 if (which == "dtype" and odd) else np.float32
        shape = (10, 2) if (which == "shape" and odd) else (2, 10)
        if which == "numel" and odd:
            shape = (21,)
        alg = "naive" if (which == "algorithm" and odd) else "ring"
        comm.allreduce(np.ones(shape, dtype=dtype), algorithm=alg)

    results = run_comms(4, fn)
    assert all(isinstance(r, MismatchError) for r in results), results
    if which == "shape":  # each rank names its own shape (the wire carries a digest of it)
        said = " ".join(map(str, results))
        assert "different shape: rank 2's is (10, 2)" in said and "'s is (2, 10)" in said, said


def test_a_scalar_against_one_element_names_the_shape_of_the_scalar():
    def fn(comm):
        comm.allreduce(torch.tensor(1.0) if comm.rank == 0 else torch.tensor([2.0]))

    results = run_comms(2, fn)
    assert "(same number of elements, different shape: rank 0's is ())" in str(results[0]), results
    assert "different shape: rank 1's is (1,)" in str(results[1]), results


def test_broken_by_an_error_class_of_the_callers_own_the_refusal_is_a_comm_error():
    """The refusal keeps the breaking error's class where it can be made from a message alone."""
    class Coded(CommError):
        def __init__(self, code: int, where: str):
            super().__init__(f"code {code} at {where}")

    def fn(comm):
        if comm.rank == 1:
            comm.abort(Coded(3, "x"))
            try:
                comm.allreduce(np.ones(3, dtype=np.float32))
            except CommError as exc:
                return type(exc).__name__, str(exc)
        else:
            with pytest.raises(CommError):
                comm.allreduce(np.ones(3, dtype=np.float32))
        return None

    results = run_comms(2, fn)
    assert results[1][0] == "CommError" and "broken by an earlier error (code 3 at x)" in results[1][1], results


def test_silent_peer_times_out_and_communicator_stays_broken():
    def fn(comm):
        if comm.rank == 1:
            return "absent"
        try:
            comm.allreduce(np.ones(8, dtype=np.float32), algorithm="ring")
        except CommError as exc:  # (rank 1 closes its transport on returning: PeerLost as often)
            try:
                comm.allreduce(np.ones(8, dtype=np.float32))
            except CommError as later:
                return exc, later
        return "returned"

    results = run_comms(3, fn, timeout=0.5)
    assert results[1] == "absent"
    for i in (0, 2):
        first, later = results[i]
        # refused, keeping the class of the error that broke it (the user's next call, join()'s say)
        assert type(later) is type(first) and "broken by an earlier error" in str(later), results


def test_abort_breaks_the_communicator_and_ends_the_peers_calls_at_once():
    """A failure of the caller's own (outside any call) told through abort(): the peers' calls
    fail at once with its type and text, not at their deadline; later calls here are refused
    naming it; a second abort changes nothing."""
    def fn(comm):
        start = time.monotonic()
        if comm.rank == 1:
            comm.abort(MismatchError("my batch had another shape"))
            comm.abort(ValueError("later"))
            assert isinstance(comm.broken, MismatchError)
            with pytest.raises(MismatchError, match="broken by an earlier error .my batch had another shape"):
                comm.allreduce(np.ones(3, dtype=np.float32))
            return None
        with pytest.raises(MismatchError, match="my batch had another shape"):
            comm.allreduce(np.ones(3, dtype=np.float32))
        assert isinstance(comm.broken, MismatchError)
        return time.monotonic() - start

    for p in (2, 3):
        seconds = [s for s in raise_first(run_comms(p, fn, timeout=30.0)) if s is not None]
        assert len(seconds) == p - 1 and max(seconds) < 10.0, seconds


def test_a_broken_communicator_does_not_keep_the_failed_callers_tensors_alive():
    """The error it keeps for later calls is a copy without the traceback: the original's frames
    held the caller's locals (a batch, activations) as long as the communicator lived. Later
    calls still name it, and show it as their cause."""
    kept = []

    def failing_step(comm):  # a training step whose collective fails
        batch = torch.zeros(1000)
        kept.append(weakref.ref(batch))
        comm.allreduce(np.ones(3 + comm.rank, dtype=np.float32), algorithm="ring")

    def fn(comm):
        with pytest.raises(MismatchError):
            failing_step(comm)
        with pytest.raises(MismatchError, match="broken by an earlier error .ranks disagree") as later:
            comm.allreduce(np.ones(3, dtype=np.float32))
        cause = later.value.__cause__
        assert isinstance(cause, MismatchError) and cause.__traceback__ is None, cause
        return comm

    comms = raise_first(run_comms(2, fn))
    alone = Communicator(LocalHub(1).transport(0))

    def step_aborted():  # a failure of the caller's own, told through abort()
        batch = torch.zeros(1000)
        kept.append(weakref.ref(batch))
        try:
            raise ValueError("bad batch")
        except ValueError as exc:
            alone.abort(exc)

    step_aborted()
    gc.collect()
    assert [ref() for ref in kept] == [None] * 3, "a broken communicator keeps the failed call's tensors alive"
    assert type(alone.broken) is ValueError and str(alone.broken) == "bad batch", repr(alone.broken)
    with pytest.raises(CommError, match=r"broken by an earlier error \(bad batch\)"):
        alone.barrier()
    assert all(c.broken is not None for c in comms)  # (alive until here)


def test_a_communicator_aborted_with_a_file_error_keeps_it_as_that_oserror():
    """An OSError that names a file (what open() and a full disk raise) keeps its file name and
    errno outside its args, so the copy without frames lost them, and comm.broken became a
    CommError reading 'OSError: ...': errno gone, and an ``except OSError`` missed it."""
    import errno as errnos

    class SaveFailed(OSError):  # (a subclass whose __init__ takes other arguments)
        def __init__(self, path):
            super().__init__(errnos.ENOSPC, "No space left on device", path)

    for error in (OSError(errnos.ENOSPC, "No space left on device", "/data/ckpt.pt"),
                  FileNotFoundError(errnos.ENOENT, "No such file or directory", "/a", "/b"), SaveFailed("/x")):
        comm = Communicator(LocalHub(1).transport(0))
        comm.abort(error)
        kept = comm.broken
        assert type(kept) is type(error) and str(kept) == str(error), repr(kept)
        assert (kept.errno, kept.strerror, kept.filename, kept.filename2) == (
            error.errno, error.strerror, error.filename, error.filename2), repr(kept)
        with pytest.raises(CommError, match="No space left|No such file") as later:
            comm.barrier()
        assert later.value.__cause__ is kept


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: c.allreduce(np.ones(3, np.float32), op="avg"), "op must be one of"),
        (lambda c: c.allreduce(np.ones(3, np.float32), algorithm="tree"), "algorithm must be one of"),
        (lambda c: c.allreduce(np.ones(3, np.int32), op="mean"), "floating dtype"),
        (lambda c: c.allreduce(np.ones(3, np.complex128)), r"unsupported dtype complex128 \(a numpy array\); use one of \["),
        # a byte-swapped array was refused as ">f4 ...; use one of [..., 'float32', ...]", which it seems to be
        (lambda c: c.allreduce(np.ones(3, ">f4")), r"dtype >f4 \(a numpy array\): float32 in non-native byte order"),
        (lambda c: c.broadcast(np.ones((2, 3), ">i8").T), r"int64 in non-native byte order.*astype\('int64'\)"),
        # a torch tensor's error spoke of "numpy dtype int8" and left bfloat16 out of the list
        (lambda c: c.allreduce(torch.zeros(3, dtype=torch.complex128)),
         r"unsupported dtype torch.complex128 \(a torch tensor\); use one of \['bfloat16', 'bool', 'complex64', "
         r"'float16', 'float32', 'float64', 'int16', 'int32', 'int64', 'int8', 'uint8'\]"),
        (lambda c: c.allreduce(torch.zeros(3).to_sparse()), "sparse tensors are not supported"),  # was "contiguous"
        (lambda c: c.allreduce(torch.ones(3).expand(2, 3)), "share memory .* expanded tensor"),
        (lambda c: c.allreduce(np.broadcast_to(np.ones(3, np.float32), (2, 3))), "read-only"),
        (lambda c: c.allreduce(np.lib.stride_tricks.as_strided(np.ones(3, np.float32), (2, 3), (0, 4))),
         "share memory"),
        (lambda c: c.allreduce([1.0, 2.0]), "numpy array or a CPU torch tensor"),
        (lambda c: c.broadcast(np.ones(3, np.float32), root=5), "root must be a rank"),
        (lambda c: c.broadcast(np.ones(3, np.float32), root=1.0), "root must be a rank"),
        (lambda c: c.broadcast(np.ones(3, np.float32), root=True), "root must be a rank"),
        (lambda c: c.allreduce(np.ones(3, np.float32), algorithm="native"), "native"),
    ],
)
def test_bad_arguments_raise_value_error(call, match):
    comm = Communicator(LocalHub(2).transport(0), timeout=1.0)
    with pytest.raises(ValueError, match=match):
        call(comm)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        Communicator(LocalHub(1).transport(0), timeout=0)


def test_world_size_one_and_empty_buffers_are_noops():
    comm = Communicator(LocalHub(1).transport(0), timeout=1.0)
    buf = np.arange(5, dtype=np.float32)
    comm.allreduce(buf, op="mean")
    np.testing.assert_array_equal(buf, np.arange(5, dtype=np.float32))

    def fn(c):
        return c.allreduce(np.empty(0, dtype=np.float32)).size

    assert raise_first(run_comms(3, fn)) == [0, 0, 0]


def test_closed_communicator_refuses_calls():
    comm = Communicator(LocalHub(1).transport(0), timeout=1.0)
    comm.close()
    comm.close()
    with pytest.raises(CommError, match="closed"):
        comm.barrier()


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("algorithm", REAL_ALGORITHMS)
def test_numpy_array_subclasses_are_reduced_in_place(algorithm, tmp_path):
    # np.matrix stays 2-D under reshape(-1): the algorithms refused its "flat view" from inside
    # the call ("collectives need a writable 1-D C-contiguous buffer (use ops.flat_view)"),
    # which broke the communicator on every rank.
    def fn(comm):
        m = np.matrix(data(comm.rank, 10, np.float64).reshape(2, 5))
        comm.allreduce(m, algorithm=algorithm)
        mm = np.memmap(tmp_path / f"rank{comm.rank}", dtype=np.float32, mode="w+", shape=(2, 7))
        mm[:] = data(comm.rank, 14).reshape(2, 7)
        comm.allreduce(mm, algorithm=algorithm)
        return m, np.array(mm)

    for m, mm in raise_first(run_comms(3, fn)):
        assert type(m) is np.matrix and m.shape == (2, 5)
        np.testing.assert_array_equal(np.asarray(m).ravel(), sum(data(r, 10, np.float64) for r in range(3)))
        np.testing.assert_array_equal(mm.ravel(), sum(data(r, 14) for r in range(3)))


@pytest.mark.parametrize("call", ["allreduce", "reduce_scatter", "allgather", "broadcast", "barrier"])
def test_a_call_refused_while_another_thread_is_in_one_leaves_the_communicator_in_step(call):
    # The refused call took a sequence number all the same: the job's next collective was a
    # MismatchError on every rank ("rank 0 called call #3 ... but rank 1 called call #2").
    import threading

    go = threading.Event()

    def fn(comm):
        buf = data(comm.rank, 1009, np.float64)
        if comm.rank == 0:
            first = threading.Thread(target=comm.allreduce, args=(buf,))
            first.start()  # waits in the call for rank 1, which waits for `go`
            while not comm._lock.locked():
                threading.Event().wait(0.001)
            with pytest.raises(RuntimeError, match="not thread-safe"):
                if call == "barrier":
                    comm.barrier()
                else:
                    getattr(comm, call)(np.ones(4))
            go.set()
            first.join()
        else:
            go.wait()
            comm.allreduce(buf)
        again = data(comm.rank, 7, np.float64)
        comm.allreduce(again)
        return buf, again

    for buf, again in raise_first(run_comms(2, fn)):
        np.testing.assert_array_equal(buf, data(0, 1009, np.float64) + data(1, 1009, np.float64))
        np.testing.assert_array_equal(again, data(0, 7, np.float64) + data(1, 7, np.float64))


@pytest.mark.parametrize("call", ["allreduce", "reduce_scatter", "allgather", "broadcast"])
def test_an_empty_buffer_against_a_full_one_is_a_mismatch_on_every_rank(call):
    # An empty call still sends its header: the others must not wait out the timeout for it.
    def fn(comm):
        getattr(comm, call)(np.ones(0 if comm.rank == 0 else 5, dtype=np.float32))

    results = run_comms(3, fn, timeout=20.0)
    assert all(isinstance(r, MismatchError) for r in results), results


@pytest.mark.parametrize("roots", ["each its own", "each the other"])
def test_ranks_naming_different_broadcast_roots_raise_mismatch_on_every_rank(roots):
    # Each its own root: both only send (they returned with different data before); each the
    # other: both only receive (they waited out the timeout before).
    def fn(comm):
        buf = np.full(4, comm.rank, dtype=np.float32)
        comm.broadcast(buf, root=comm.rank if roots == "each its own" else 1 - comm.rank)

    results = run_comms(2, fn, timeout=20.0)
    assert all(isinstance(r, MismatchError) and "root=" in str(r) for r in results), results


def test_float16_mean_is_summed_in_float32():
    # 40000 + 40000 overflows float16 (max 65504); their mean does not.
    def fn(comm):
        buf = np.full(3, 40000, dtype=np.float16)
        comm.allreduce(buf, op="mean")
        rs = np.full(4, 40000, dtype=np.float16)
        comm.reduce_scatter(rs, op="mean")
        lo, hi = schedule.chunk_bounds(4, 2)[comm.rank]
        return buf, rs[lo:hi]

    for buf, chunk in raise_first(run_comms(2, fn)):
        assert buf.dtype == np.float16
        np.testing.assert_array_equal(buf, np.full(3, 40000, dtype=np.float16))
        np.testing.assert_array_equal(chunk, np.full(2, 40000, dtype=np.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_autograd_tracks(dtype):
    comm = Communicator(LocalHub(1).transport(0), timeout=1.0)
    w = torch.ones(3, dtype=dtype, requires_grad=True)
    # The result of a recorded operation: an in-place write would change what backward computes.
    with pytest.raises(ValueError, match="requires grad"):
        comm.allreduce(w * 2)
    # A leaf (a parameter): written, and autograd counts the write as a torch in-place op would,
    # so a backward that saved its old values raises instead of using the new ones.
    loss = (w * w).sum()
    before = w._version
    comm.allreduce(w)
    assert w._version == before + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_tensor_saved_for_backward_that_needs_no_gradient_counts_the_write_too():
    # An input x of w * x is saved for w's gradient: overwritten by a collective, backward used
    # its new values silently (w.grad 5 instead of 2 on the walkthrough's 2 ranks); a torch
    # in-place op bumps the counter of any tensor. An inference tensor has none.
    comm = Communicator(LocalHub(1).transport(0), timeout=1.0)
    w = torch.ones(3, requires_grad=True)
    x = torch.full((3,), 2.0)
    loss = (w * x).sum()
    for call in (comm.allreduce, comm.broadcast, comm.allgather, comm.reduce_scatter):
        before = x._version
        call(x)
        assert x._version == before + 1, call
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.inference_mode():
        frozen = torch.ones(3)
    comm.allreduce(frozen)
    assert frozen.is_inference()


def test_a_tensor_off_the_cpu_is_refused_without_false_advice():
    comm = Communicator(LocalHub(1).transport(0), timeout=1.0)
    with pytest.raises(ValueError, match="tensor is on meta; ringtrain's collectives move CPU memory") as err:
        comm.allreduce(torch.ones(3, device="meta"))
    assert "algorithm='native'" not in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_mean_does_not_overflow_where_the_mean_fits(dtype):
    # bfloat16 summed in bfloat16: 2 x 3e38 was inf in allreduce and in the reduce_scatter chunk,
    # though the mean fits (float16 was already summed in float32). Ranks hold different values
    # so that the mean is exact: (big + big/2) / 2 is three quarters of big.
    p, n = 2, 5
    big = 3e38 if dtype == torch.bfloat16 else 40000.0
    values = [torch.tensor(big, dtype=dtype), torch.tensor(big, dtype=dtype) / 2]
    expect = ((values[0].double() + values[1].double()) / p).to(dtype)

    def fn(comm):
        a = torch.full((n,), values[comm.rank].item(), dtype=dtype)
        comm.allreduce(a, op="mean")
        b = torch.full((n,), values[comm.rank].item(), dtype=dtype)
        comm.reduce_scatter(b, op="mean")
        lo, hi = schedule.chunk_bounds(n, p)[comm.rank]
        return a, b[lo:hi]

    for a, chunk in raise_first(run_comms(p, fn)):
        assert torch.isfinite(a).all() and torch.equal(a, torch.full((n,), expect.item(), dtype=dtype)), a
        assert torch.equal(chunk, torch.full(chunk.shape, expect.item(), dtype=dtype)), chunk


def test_timeout_may_be_a_numeric_string_as_rank_and_port_may():
    # init(rank="0", master_port="29650") were accepted, timeout="5" refused.
    import ringtrain

    assert Communicator(LocalHub(1).transport(0), timeout="2.5").timeout == 2.5
    comm = ringtrain.init(rank="0", world_size="1", timeout="5")
    assert comm.timeout == 5.0
    comm.close()
    for bad in ("abc", "nan", "0", "-1", True):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
            Communicator(LocalHub(1).transport(0), timeout=bad)


def test_torch_distributed_reduce_ops_are_taken_by_name():
    import torch.distributed as dist

    def fn(comm):
        out = {}
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
            buf = torch.tensor([1.0 + comm.rank, 4.0])
            comm.allreduce(buf, op=op)
            out[op.name] = buf.tolist()
            again = torch.tensor([1.0 + comm.rank, 4.0])
            comm.allreduce(again, op=dist.ReduceOp(op))  # (torch's API takes a ReduceOp made from one too)
            assert again.tolist() == out[op.name]
        with pytest.raises(ValueError, match=r"torch's ReduceOp.BAND has no counterpart here"):
            comm.allreduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
        chunk = torch.tensor([1.0, 2.0])
        comm.reduce_scatter(chunk, op=dist.ReduceOp.AVG)
        return out, chunk.tolist()

    for out, chunk in raise_first(run_comms(2, fn)):
        assert out == {"SUM": [3.0, 8.0], "AVG": [1.5, 4.0], "MAX": [2.0, 4.0], "MIN": [1.0, 4.0],
                       "PRODUCT": [2.0, 16.0]}


def test_infinities_and_nans_reduce_without_numpy_warnings():
    import warnings

    def fn(comm):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            buf = np.array([np.inf, np.nan, 60000, 1], dtype=np.float16)
            comm.allreduce(buf, op="max", algorithm="ring")
            other = np.array([np.inf, -np.inf if comm.rank else np.inf, 1.0], dtype=np.float32)  # inf - inf: NaN
            comm.allreduce(other, algorithm="ring")
        return buf, other

    for buf, other in raise_first(run_comms(2, fn)):
        assert np.isinf(buf[0]) and np.isnan(buf[1]) and np.isnan(other[1]) and other[0] == np.inf


NEW_DTYPES = {"int8": np.int8, "int16": np.int16, "bool": np.bool_, "complex64": np.complex64}


@pytest.mark.parametrize("dtype", sorted(NEW_DTYPES))
def test_int8_int16_bool_and_complex64_reduce_as_numpy_on_every_algorithm(dtype):
    # (a walkthrough's port found them refused where gloo reduces them: "found inf" flags are bool)
    np_dtype = NEW_DTYPES[dtype]
    ops = ["sum", "prod"] + ([] if dtype == "complex64" else ["min", "max"]) + (["mean"] if dtype == "complex64" else [])
    n, p = 1009, 3

    def data(rank: int) -> np.ndarray:
        rng = np.random.default_rng(rank)
        if dtype == "bool":
            return rng.integers(0, 2, n).astype(bool)
        if dtype == "complex64":
            return (rng.integers(-8, 8, n) + 1j * rng.integers(-8, 8, n)).astype(np_dtype)
        return rng.integers(-100, 100, n).astype(np_dtype)  # (int8 products and sums wrap, as numpy's)

    def fn(comm):
        out = {}
        for alg in ("ring", "naive", "central", "halving_doubling", "hierarchical"):
            for op in ops:
                buf = torch.from_numpy(data(comm.rank)) if dtype != "complex64" else data(comm.rank)
                comm.allreduce(buf, op=op, algorithm=alg)
                out[alg, op] = np.asarray(buf).copy()
        with pytest.raises(ValueError, match=r"op='mean' needs a floating dtype|op='max' needs ordered values"):
            comm.allreduce(data(comm.rank), op="max" if dtype == "complex64" else "mean")
        return out

    ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "mean": np.add}
    for out in raise_first(run_comms(p, fn)):
        for (alg, op), got in out.items():
            with np.errstate(all="ignore"):
                want = data(0)
                for r in range(1, p):
                    want = ufunc[op](want, data(r))
                if op == "mean":
                    want = want / np.complex64(p)
            assert got.dtype == np_dtype and np.array_equal(got, want), (alg, op)


def test_native_refuses_a_dtype_gloo_cannot_reduce_before_anything_moves():
    comm = Communicator(LocalHub(1).transport(0), timeout=1.0, native_group_factory=lambda: None)
    with pytest.raises(ValueError, match=r"algorithm='native' \(torch.distributed's gloo\) cannot reduce int16"):
        comm.allreduce(np.ones(3, dtype=np.int16), algorithm="native")
    with pytest.raises(ValueError, match=r"cannot reduce complex64 with op='prod'"):  # (gloo: "does not support")
        comm.allreduce(np.ones(3, dtype=np.complex64), "prod", algorithm="native")


def test_buffers_not_laid_out_row_major_go_through_a_copy_and_come_back():
    # (refused before, "must be contiguous", where gloo reduces a transposed tensor; on torch 2.13
    # gloo sums step slices wrongly)
    def fn(comm):
        base = torch.arange(12.0).reshape(3, 4) + 100 * comm.rank
        t = base.t()  # transposed: a view of base
        comm.allreduce(t)
        chan = (torch.arange(2 * 3 * 2 * 2.0).reshape(2, 3, 2, 2) + comm.rank).to(memory_format=torch.channels_last)
        comm.broadcast(chan, root=1)
        sliced_base = torch.arange(10.0) * (comm.rank + 1)
        comm.allreduce(sliced_base[::2], op="max")
        fortran = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3) * (comm.rank + 1))
        comm.allgather(fortran)
        z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()  # a conjugated view
        comm.allreduce(z)
        w, x = torch.ones(2, 3, requires_grad=True), torch.ones(2, 3)
        loss = (w * x).sum()  # x saved for w's gradient
        comm.allreduce(x.t())  # its transposed view: written through the copy, and the write counted
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        return base, chan, sliced_base, fortran, z, x

    for rank, (base, chan, sliced, fortran, z, x) in enumerate(raise_first(run_comms(2, fn))):
        assert torch.equal(base, 2 * torch.arange(12.0).reshape(3, 4) + 100)
        assert torch.equal(chan, torch.arange(24.0).reshape(2, 3, 2, 2) + 1) and chan.is_contiguous(
            memory_format=torch.channels_last)
        # every other element the max of x and 2x; the ones between untouched
        assert torch.equal(sliced, torch.arange(10.0) * torch.tensor([2.0, rank + 1.0] * 5))
        # chunk r (of the row-major order) from rank r: rank 0's first three elements, rank 1's last three
        assert np.array_equal(fortran, np.array([[0, 1, 2], [6, 8, 10]], dtype=np.float32))
        assert torch.equal(z.resolve_conj(), torch.tensor([2 - 4j, 6 + 2j], dtype=torch.complex64))
        assert torch.equal(x, torch.full((2, 3), 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_tensor_a_collective_wrote_can_still_be_resized_as_after_gloo(dtype):
    # Before: the flat view was Tensor.numpy(), which marks the storage non-resizable for good: a
    # reused buffer's resize_ (a comm hook's bucket, as torch's batched PowerSGD) then raised
    # "Trying to resize storage that is not resizable".
    def fn(comm):
        buf = torch.arange(7, dtype=torch.int64).reshape(7, 1).to(dtype)
        part = torch.zeros(9, dtype=dtype)[1:8]  # (a view at an offset into a larger storage)
        part.copy_(buf.reshape(-1))
        comm.allreduce(buf, op="max")
        comm.broadcast(part, root=1)
        buf.resize_(20, 2)
        part.resize_(30)
        return buf.shape, part.shape

    for shapes in raise_first(run_comms(2, fn)):
        assert shapes == ((20, 2), (30,))


def test_a_flat_view_of_a_tensor_keeps_the_tensor_and_shares_its_memory():
    from ringtrain.collectives.ops import flat_view

    big = torch.arange(10, dtype=torch.float32)
    view = flat_view(big[3:8]).array
    del big  # (the array holds the tensor: its memory stays)
    view[:] += 100
    assert view.tolist() == [103.0, 104.0, 105.0, 106.0, 107.0] and view.base.tensor.tolist() == view.tolist()
    assert flat_view(torch.zeros(0, 3)).array.shape == (0,)


def test_a_flat_view_of_a_conjugated_or_negated_view_is_refused_not_its_raw_memory():
    # (Tensor.numpy() refused them; numpy_of, which replaced it, read the raw memory: z.conj()
    # gave the unconjugated values. The collectives resolve such a buffer before (writable_buffer).)
    from ringtrain.collectives.ops import flat_view

    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for view in (z.conj(), torch.tensor([1.0, 2.0])._neg_view()):
        with pytest.raises(ValueError, match="conjugate or negative bit"):
            flat_view(view)
