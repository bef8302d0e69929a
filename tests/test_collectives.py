"""The collective algorithms on the in-process thread transport, checked exactly.

Data is integer valued and distinct per (rank, element) where the op allows, small enough to
be exact in float16 and bfloat16 (modulo for those), so every result is compared with a
numpy reference by exact equality, naming the first mismatching index. Random floats check
that every rank ends with bitwise identical bytes. One thread run per (algorithm, world size)
carries every length x op x dtype combination, so the whole sweep stays fast.
"""

from __future__ import annotations

import importlib
import threading
import time

import numpy as np
import pytest
import torch

from ringtrain.collectives import ops
from ringtrain.errors import CommError, MismatchError
from ringtrain.transport.base import CallHeader, Recv, shape_digest
from ringtrain.transport.local import run_threads

pytestmark = pytest.mark.timeout(60)

ALGORITHMS = ["ring", "naive", "central", "halving_doubling", "hierarchical"]
SEGMENTED = {"ring", "hierarchical"}  # accept max_segment_bytes
WORLD = [1, 2, 3, 4, 5, 6, 7, 8]
DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
OPS = ["sum", "min", "max", "prod"]
TINY_SEGMENT = 8  # bytes: one to four elements per segment
MULTI_SEGMENT_N = 45


def lengths(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p + 1, 1009})


# --- data ----------------------------------------------------------------------------------


def values(op: str, dtype: str, rank: int, n: int, p: int) -> np.ndarray:
    """Exact small integers (float64) for one rank, distinct per (rank, element) where possible."""
    i = np.arange(n, dtype=np.int64)
    if op == "prod":  # at most ceil(p/4) factors of two per element: exact even in float16
        v = np.where((rank + i) % 4 == 0, 2, np.where((rank * 7 + i) % 5 == 0, -1, 1))
    elif op == "sum":
        bound = {"float16": 61, "bfloat16": 17}.get(dtype)  # |partial sums| <= 16 * bound/2
        v = (rank * n + i) - (p * n) // 2 if bound is None else ((rank * n + i) * 7 + rank) % bound - bound // 2
    else:  # min/max: distinct, and which rank holds the extreme varies with the element
        bound = {"float16": 2039, "bfloat16": 251}.get(dtype, 1_000_003)
        v = ((rank * n + i) * 7919) % bound - bound // 2
    return v.astype(np.float64)


def to_storage(v: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
    return v.astype(dtype)


def reference(op: str, dtype: str, n: int, p: int) -> np.ndarray:
    stack = np.stack([values(op, dtype, r, n, p) for r in range(p)]) if n else np.zeros((p, 0))
    red = {"sum": np.sum, "min": np.min, "max": np.max, "prod": np.prod}[op](stack, axis=0)
    return to_storage(red, dtype)


def header(kind: str, op: str, alg: str, dtype: str, n: int, seq: int = 1, root: int = -1) -> CallHeader:
    return CallHeader(seq, kind, op, alg, dtype, n, shape_digest((n,)), root)


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if not np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}")):
        bad = np.flatnonzero(got.view(f"u{got.itemsize}") != want.view(f"u{want.itemsize}"))[0]
        raise AssertionError(f"{what}: first mismatch at index {bad}: got {got[bad]}, want {want[bad]}")


def run(p: int, fn, timeout: float = 50.0) -> list:
    results = run_threads(p, fn, timeout=timeout)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


def call_allreduce(alg: str, t, buf, op: str, dtype: str, hdr: CallHeader, **kw) -> None:
    module = importlib.import_module(f"ringtrain.collectives.{alg}")
    if alg == "hierarchical" and "hosts" not in kw:
        kw["hosts"] = [r // 2 for r in range(t.world_size)]  # pairs; odd p leaves a lone rank
    module.allreduce(t, buf, ops.reducer(op, dtype), hdr, deadline(), **kw)


def cases(p: int, alg: str):
    """(n, op, dtype, kwargs) combinations for one thread run."""
    for n in lengths(p):
        for dtype in DTYPES:
            for op in OPS:
                yield n, op, dtype, {}
    if alg in SEGMENTED:
        for dtype in DTYPES:
            for op in OPS:
                yield MULTI_SEGMENT_N, op, dtype, {"max_segment_bytes": TINY_SEGMENT}


# --- allreduce: every algorithm x world size x length x op x dtype -------------------------


def allreduce_sweep(alg: str, p: int) -> None:
    todo = list(cases(p, alg))

    def body(t):
        out = []
        for seq, (n, op, dtype, kw) in enumerate(todo, 1):
            buf = to_storage(values(op, dtype, t.rank, n, p), dtype)
            call_allreduce(alg, t, buf, op, dtype, header("allreduce", op, alg, dtype, n, seq), **kw)
            out.append(buf)
        return out

    results = run(p, body)
    for k, (n, op, dtype, kw) in enumerate(todo):
        want = reference(op, dtype, n, p)
        for rank in range(p):
            assert_same(results[rank][k], want, f"{alg} p={p} n={n} {op} {dtype} {kw} rank {rank}")


@pytest.mark.parametrize("p", WORLD)
@pytest.mark.parametrize("alg", ALGORITHMS)
def test_allreduce_exact(alg, p):
    allreduce_sweep(alg, p)


def test_ring_allreduce_16_ranks():
    allreduce_sweep("ring", 16)


@pytest.mark.parametrize("alg", ALGORITHMS)
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_allreduce_bitwise_identical_on_random_floats(alg, p):
    rng = np.random.default_rng(p)
    n = 1009
    sums = [rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n) for _ in range(p)]
    prods = [rng.uniform(0.5, 2.0, n) * rng.choice([-1.0, 1.0], n) for _ in range(p)]  # no overflow

    def body(t):
        out = []
        for seq, dtype in enumerate(DTYPES[:4], 1):
            for op, data in (("sum", sums), ("prod", prods)):
                buf = to_storage(data[t.rank], dtype)
                kw = {"max_segment_bytes": 64} if alg in SEGMENTED and dtype == "float32" else {}
                hdr = header("allreduce", op, alg, dtype, n, 2 * seq + (op == "sum"))
                call_allreduce(alg, t, buf, op, dtype, hdr, **kw)
                out.append(buf)
        return out

    results = run(p, body)
    for k in range(len(results[0])):
        for rank in range(1, p):
            assert_same(results[rank][k], results[0][k], f"{alg} p={p} case {k} rank {rank} vs rank 0")
    # and it is a reduction, not a copy: float64 sum close to the reference
    ref = np.sum(np.stack(sums), axis=0)
    np.testing.assert_allclose(results[0][6], ref, rtol=1e-9, atol=1e-6)  # order differs: float rounding


@pytest.mark.parametrize("alg", ["naive", "central"])
@pytest.mark.parametrize("p", [3, 4, 5])
def test_naive_and_central_reduce_in_group_order(alg, p):
    # Their docstrings promise ((x0 op x1) op x2) ...: position 0 first. Random floats so that the
    # order shows in the bits (float addition is not associative); the bitwise-identical test
    # above cannot see an order that is merely the same on every rank.
    rng = np.random.default_rng(100 + p)
    n = 257
    data = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for _ in range(p)]

    def body(t):
        buf = data[t.rank].copy()
        call_allreduce(alg, t, buf, "sum", "float32", header("allreduce", "sum", alg, "float32", n))
        return buf

    want = data[0].copy()
    for x in data[1:]:
        want += x
    for rank, got in enumerate(run(p, body)):
        assert_same(got, want, f"{alg} p={p} rank {rank}")


# --- ring: reduce-scatter, allgather, broadcast, barrier -----------------------------------


@pytest.mark.parametrize("p", WORLD + [16])
def test_ring_reduce_scatter_and_allgather(p):
    from ringtrain.collectives import ring, schedule

    combos = [(n, dt, kw) for n in lengths(p) + [MULTI_SEGMENT_N] for dt in ("bfloat16", "float32", "int64")
              for kw in ({}, {"max_segment_bytes": TINY_SEGMENT})]

    def body(t):
        out = []
        for seq, (n, dtype, kw) in enumerate(combos, 1):
            buf = to_storage(values("sum", dtype, t.rank, n, p), dtype)
            ring.reduce_scatter(t, buf, ops.reducer("sum", dtype), header("reduce_scatter", "sum", "ring", dtype, n, 2 * seq), deadline(), **kw)
            lo, hi = schedule.chunk_bounds(n, p)[t.rank]
            mine = buf[lo:hi].copy()
            gathered = np.zeros_like(buf)
            gathered[lo:hi] = buf[lo:hi]
            ring.allgather(t, gathered, header("allgather", "none", "ring", dtype, n, 2 * seq + 1), deadline(), **kw)
            out.append((mine, gathered))
        return out

    results = run(p, body)
    for k, (n, dtype, kw) in enumerate(combos):
        want = reference("sum", dtype, n, p)
        for rank in range(p):
            lo, hi = schedule.chunk_bounds(n, p)[rank]
            mine, gathered = results[rank][k]
            assert_same(mine, want[lo:hi], f"reduce_scatter p={p} n={n} {dtype} {kw} rank {rank}")
            assert_same(gathered, want, f"allgather p={p} n={n} {dtype} {kw} rank {rank}")


@pytest.mark.parametrize("p", WORLD + [16])
@pytest.mark.parametrize("module", ["ring", "tree"])
def test_broadcast_every_root(module, p):
    mod = importlib.import_module(f"ringtrain.collectives.{module}")
    combos = [(root, n, kw) for root in range(p) for n in (0, 1, p + 1, 1009)
              for kw in ({}, {"max_segment_bytes": 40})]
    if module == "tree":
        combos = [(root, n, {}) for root, n, kw in combos if not kw]

    def body(t):
        out = []
        for seq, (root, n, kw) in enumerate(combos, 1):
            buf = np.arange(n, dtype=np.int64) * 1000 + t.rank
            mod.broadcast(t, buf, root, header("broadcast", "none", "ring", "int64", n, seq, root), deadline(), **kw)
            out.append(buf)
        return out

    results = run(p, body)
    for k, (root, n, kw) in enumerate(combos):
        for rank in range(p):
            assert_same(results[rank][k], np.arange(n, dtype=np.int64) * 1000 + root, f"{module} root={root} n={n} {kw}")


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_barrier_waits_for_everyone(p):
    from ringtrain.collectives import ring

    entered = []
    lock = threading.Lock()

    def body(t):
        seen = []
        for seq in range(1, 4):
            if t.rank == (seq % p):
                time.sleep(0.05)  # the late rank: nobody may leave before it arrives
            with lock:
                entered.append(seq)
            ring.barrier(t, CallHeader(seq, "barrier"), deadline())
            with lock:
                seen.append(entered.count(seq))
        return seen

    for seen in run(p, body):
        assert seen == [p, p, p]


# --- groups, validation and mismatch -------------------------------------------------------


def test_ring_allreduce_on_a_subgroup():
    from ringtrain.collectives import ring

    group = [4, 1, 3]

    def body(t):
        if t.rank not in group:
            return None
        buf = np.arange(10, dtype=np.int64) + 100 * t.rank
        ring.allreduce(t, buf, ops.reducer("sum", "int64"), header("allreduce", "sum", "ring", "int64", 10), deadline(), group=group)
        return buf

    results = run(6, body)
    want = np.arange(10) * 3 + 100 * sum(group)
    for r in group:
        assert_same(results[r], want, f"rank {r}")


def test_bad_arguments_raise_value_error():
    from ringtrain.collectives import ring

    def body(t):
        hdr = header("allreduce", "sum", "ring", "int64", 4)
        red = ops.reducer("sum", "int64")
        with pytest.raises(ValueError, match="not in group"):
            ring.allreduce(t, np.zeros(4, np.int64), red, hdr, deadline(), group=[1 - t.rank])
        with pytest.raises(ValueError, match="1-D"):
            ring.allreduce(t, np.zeros((2, 2), np.int64), red, hdr, deadline())
        with pytest.raises(ValueError, match="max_segment_bytes"):
            ring.allreduce(t, np.zeros(4, np.int64), red, hdr, deadline(), max_segment_bytes=0)
        with pytest.raises(ValueError, match="root"):
            ring.broadcast(t, np.zeros(4, np.int64), 7, hdr, deadline())

    run(2, body)


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_length_mismatch_raises_on_every_rank(alg):
    def body(t):
        n = 5 if t.rank == 1 else 4
        buf = np.zeros(n, np.int64)
        call_allreduce(alg, t, buf, "sum", "int64", header("allreduce", "sum", alg, "int64", n), )

    results = run_threads(3, body, timeout=20)
    assert all(isinstance(r, CommError) for r in results), results
    assert any(isinstance(r, MismatchError) for r in results), results


# --- hierarchical: host layouts ------------------------------------------------------------

LAYOUTS = ["aabb", "aaabb", "abc", "aaaaab", "abbbccc", "abab", "aaaa", "aabbbbcc"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hierarchical_host_layouts(layout):
    hosts = list(layout)
    p = len(hosts)
    rng = np.random.default_rng(len(layout))
    floats = [rng.standard_normal(301) for _ in range(p)]
    todo = [(n, op, dt, kw) for n in (0, 1, p + 1, 301) for op in OPS for dt in ("bfloat16", "float32", "int64")
            for kw in ({}, {"max_segment_bytes": TINY_SEGMENT})]

    def body(t):
        out = []
        for seq, (n, op, dtype, kw) in enumerate(todo, 1):
            buf = to_storage(values(op, dtype, t.rank, n, p), dtype)
            call_allreduce("hierarchical", t, buf, op, dtype, header("allreduce", op, "hierarchical", dtype, n, seq), hosts=hosts, **kw)
            out.append(buf)
        buf = floats[t.rank].copy()
        call_allreduce("hierarchical", t, buf, "sum", "float64", header("allreduce", "sum", "hierarchical", "float64", 301, 0), hosts=hosts)
        out.append(buf)
        return out

    results = run(p, body)
    for k, (n, op, dtype, kw) in enumerate(todo):
        want = reference(op, dtype, n, p)
        for rank in range(p):
            assert_same(results[rank][k], want, f"hierarchical {layout} n={n} {op} {dtype} {kw} rank {rank}")
    for rank in range(1, p):
        assert_same(results[rank][-1], results[0][-1], f"hierarchical {layout} random floats rank {rank}")
    np.testing.assert_allclose(results[0][-1], np.sum(floats, axis=0), rtol=1e-12, atol=1e-12)  # float reordering


def test_hierarchical_rejects_short_hosts_list():
    def body(t):
        with pytest.raises(ValueError, match="hosts"):
            call_allreduce("hierarchical", t, np.zeros(3, np.int64), "sum", "int64",
                           header("allreduce", "sum", "hierarchical", "int64", 3), hosts=["a"])

    run(2, body)


def test_registry():
    from ringtrain import collectives

    for name in collectives.ALGORITHMS:
        assert callable(collectives.get(name).allreduce)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        collectives.get("bogus")


# --- failures end in a CommError on every rank, never a hang --------------------------------


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_empty_buffer_still_detects_mismatch(alg):
    def body(t):
        n = 0 if t.rank == 0 else 3
        call_allreduce(alg, t, np.zeros(n, np.int64), "sum", "int64", header("allreduce", "sum", alg, "int64", n))

    results = run_threads(4, body, timeout=20)
    assert all(isinstance(r, CommError) for r in results), results


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_absent_peer_ends_in_comm_error(alg):
    def body(t):
        if t.rank == 2:
            return "left"  # returns without calling: its transport closes
        buf = np.zeros(100, np.int64)
        module = importlib.import_module(f"ringtrain.collectives.{alg}")
        module.allreduce(t, buf, ops.reducer("sum", "int64"), header("allreduce", "sum", alg, "int64", 100),
                         time.monotonic() + 2.0, **({"hosts": [0, 0, 1, 1]} if alg == "hierarchical" else {}))

    start = time.monotonic()
    results = run_threads(4, body, timeout=20)
    assert results[2] == "left"
    assert all(isinstance(r, CommError) for i, r in enumerate(results) if i != 2), results
    assert time.monotonic() - start < 15


def test_silent_peer_times_out_by_the_deadline():
    from ringtrain.collectives import ring
    from ringtrain.errors import CommTimeout

    def body(t):
        if t.rank == 1:
            time.sleep(1.5)  # alive but silent past everyone's deadline
            return "slept"
        start = time.monotonic()
        try:
            ring.allreduce(t, np.zeros(10, np.int64), ops.reducer("sum", "int64"),
                           header("allreduce", "sum", "ring", "int64", 10), start + 0.3)
        except CommError as exc:  # the silent rank's neighbour times out; the other may see it leave
            return type(exc), time.monotonic() - start
        return None

    results = run_threads(3, body, timeout=20)
    assert results[1] == "slept"
    outcomes = [results[0], results[2]]
    assert all(r is not None and r[1] < 1.4 for r in outcomes), outcomes  # before the peer wakes
    assert CommTimeout in [r[0] for r in outcomes], outcomes


@pytest.mark.parametrize("error, said", [(ValueError("bad"), "ValueError: bad"), (KeyboardInterrupt(), "KeyboardInterrupt")])
def test_the_thread_transport_words_an_abort_as_the_process_transports_do(error, said):
    # It sent str(error) alone: ValueError("bad") reached the others as "rank 0 aborted: bad".
    header = CallHeader(1, "allreduce", op="sum", algorithm="ring", dtype="int64", numel=4)

    def fn(t):
        if t.rank == 0:
            t.abort(error)
            return None
        with pytest.raises(CommError) as info:
            t.exchange([], [Recv(0, np.zeros(4, np.int64))], header, time.monotonic() + 10)
        return str(info.value)

    assert run_threads(2, fn, timeout=20)[1] == f"rank 0 aborted: {said}"


@pytest.mark.parametrize("op", ops.OPS)
def test_the_float16_reducer_gives_numpys_bits_on_every_value(op):
    # Sums and products run through torch (numpy's float16 arithmetic is scalar, ~40x slower):
    # the bits must stay numpy's, on every pair of special values and on magnitudes from
    # subnormal to overflow.
    rng = np.random.default_rng(0)
    special = np.array([0, -0.0, np.inf, -np.inf, 65504, -65504, 6e-8, -6e-8, 1e-4, 2 ** -24, 2 ** -14, 1.0],
                       dtype=np.float16)
    with np.errstate(all="ignore"):  # (overflow to inf is among the cases)
        spread = [(rng.standard_normal(50000) * 10.0 ** rng.uniform(-8, 5, 50000)).astype(np.float16) for _ in "ab"]
        a = np.concatenate([np.repeat(special, len(special)), spread[0]])
        b = np.concatenate([np.tile(special, len(special)), spread[1]])
        want = {"sum": np.add, "mean": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op](a, b)
    got = a.copy()
    ops.reducer(op, "float16")(got, b)
    same = (got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (a[~same][:4], b[~same][:4], got[~same][:4], want[~same][:4])


# --- message sizes and shapes: what the plans promise the transport ------------------------


def recording(t) -> dict:
    """Wrap ``t.exchange``: returns {call seq: [[(peer, nbytes) per send] per transfer]}."""
    log: dict = {}
    inner = t.exchange

    def exchange(sends, recvs, hdr, dl):
        log.setdefault(hdr.seq, []).append([(s.peer, s.buf.nbytes) for s in sends])
        inner(sends, recvs, hdr, dl)

    t.exchange = exchange
    return log


@pytest.mark.parametrize("p", [3, 5])
@pytest.mark.parametrize("dtype", ["float64", "int64", "float32", "bfloat16"])
def test_ring_messages_never_exceed_max_segment_bytes_whatever_the_element_size(dtype, p):
    # A segment is max_segment_bytes // itemsize elements: taken as elements, a float64 buffer
    # travelled in messages eight times the bound (the sweep above is exact either way).
    from ringtrain.collectives import ring, schedule

    n, cap = MULTI_SEGMENT_N, 16
    itemsize = to_storage(np.zeros(1), dtype).itemsize

    def body(t):
        log = recording(t)
        buf = to_storage(values("sum", dtype, t.rank, n, p), dtype)
        ring.allreduce(t, buf, ops.reducer("sum", dtype), header("allreduce", "sum", "ring", dtype, n, 1), deadline(),
                       max_segment_bytes=cap)
        cast = np.arange(n, dtype=np.int64) * 1000 + t.rank
        ring.broadcast(t, cast, 1, header("broadcast", "none", "ring", "int64", n, 2, 1), deadline(), max_segment_bytes=cap)
        return buf, cast, log

    results = run(p, body)
    want = reference("sum", dtype, n, p)
    # Each allreduce step sends the longest chunk in segments as long as the cap allows.
    longest = max(hi - lo for lo, hi in schedule.chunk_bounds(n, p))
    transfers = 2 * (p - 1) * schedule.segment_count(longest, cap // itemsize)
    for rank, (buf, cast, log) in enumerate(results):
        assert_same(buf, want, f"allreduce {dtype} p={p} rank {rank}")
        assert_same(cast, np.arange(n, dtype=np.int64) * 1000 + 1, f"broadcast p={p} rank {rank}")
        assert len(log[1]) == transfers, f"rank {rank}: {len(log[1])} allreduce transfers, want {transfers}"
        for seq, what in ((1, "allreduce"), (2, "broadcast")):
            sizes = [nbytes for sends in log[seq] for _, nbytes in sends]
            assert max(sizes, default=0) <= cap, f"rank {rank}: a {what} message of {max(sizes)} bytes, cap {cap}"


def test_broadcast_goes_by_tree_when_short_and_by_chain_when_long():
    # One segment: a binomial tree (ceil(log2 p) rounds; the root sends to log2 p peers).
    # Many segments: a pipelined chain along the ring (the root sends only to its right
    # neighbour, one segment per message).
    from ringtrain.collectives import ring

    p, root, cap, lengths = 8, 3, 8, (1, 41)

    def body(t):
        log = recording(t)
        out = []
        for seq, n in enumerate(lengths, 1):
            buf = np.arange(n, dtype=np.int64) * 1000 + t.rank
            ring.broadcast(t, buf, root, header("broadcast", "none", "ring", "int64", n, seq, root), deadline(),
                           max_segment_bytes=cap)
            out.append(buf)
        return out, log

    results = run(p, body)
    for k, n in enumerate(lengths):
        for rank in range(p):
            assert_same(results[rank][0][k], np.arange(n, dtype=np.int64) * 1000 + root, f"n={n} rank {rank}")
    log = results[root][1]
    short = sorted(peer for sends in log[1] for peer, _ in sends)
    assert short == sorted((root + d) % p for d in (1, 2, 4)), short
    long = [(peer, nbytes) for sends in log[2] for peer, nbytes in sends]
    assert long == [((root + 1) % p, cap)] * lengths[1], long


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_every_algorithm_refuses_a_buffer_it_cannot_work_in_place(alg):
    # Read-only, strided or 2-D: a ValueError on every rank before any message moves (not
    # numpy's "output array is read-only" from inside a transfer).
    readonly = np.zeros(5, np.int64)
    readonly.flags.writeable = False
    bad = {"read-only": readonly, "strided": np.zeros(10, np.int64)[::2], "2-D": np.zeros((5, 1), np.int64)}

    def body(t):
        log = recording(t)
        for buf in bad.values():
            with pytest.raises(ValueError, match="writable 1-D C-contiguous"):
                call_allreduce(alg, t, buf, "sum", "int64", header("allreduce", "sum", alg, "int64", 5))
        return log

    for log in run(3, body):
        assert log == {}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_finish_mean_divides_the_values_not_their_bits(dtype):
    # (comm's mean sums half precision in a wider copy; the DDP wrapper under join divides a
    # bfloat16 or float16 sum in place with finish_mean, whose bfloat16 view is uint16 bits.)
    p, n = 3, 9
    want = np.arange(n, dtype=np.float64) - n // 2
    buf = to_storage(want * p, dtype)
    ops.finish_mean(ops.FlatView(buf, dtype, (n,)), p)
    assert_same(buf, to_storage(want, dtype), f"{dtype} / {p}")
