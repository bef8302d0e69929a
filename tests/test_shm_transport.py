"""Tests of the shared-memory transport: exact exchanges on threads (each rank a thread with
its own mappings of real shared memory) and in real processes; the failure cases (header and
length mismatch, abort, closed peer, killed peer, timeout); and that nothing is left in
/dev/shm.

Data is integer valued and distinct per (rank, element, message) so that every comparison is
exact. Small slots (4 KiB, 2 or 3 of them) force the multi-slot and ring-wrap paths.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import traceback

import numpy as np
import pytest

from ringtrain.errors import CommError, CommTimeout, MismatchError, PeerLost
from ringtrain.transport.base import CallHeader, Recv, Send
from ringtrain.transport.local import on_threads
from ringtrain.transport.shm import ShmTransport
from ringtrain.transport.shm_sync import NAME_PREFIX, ProcessId, pid_namespace, remove_stale_segments, segment_dir

SLOT = 4096
HEADER = CallHeader(7, "allreduce", op="sum", algorithm="ring", dtype="int64", numel=10)


def _add(out, incoming):
    np.add(out, incoming, out=out)


def _data(rank: int, peer: int, nbytes: int, tag: int = 0) -> np.ndarray:
    """nbytes of data distinct per (sender, receiver, tag, byte)."""
    if nbytes % 8:
        return ((np.arange(nbytes) + 31 * rank + 7 * peer + 13 * tag) % 251).astype(np.uint8)
    n = nbytes // 8
    return np.arange(n, dtype=np.int64) * 1000 + rank * 100 + peer * 10 + tag


def _my_segments() -> list[str]:
    mark = f"{NAME_PREFIX}{pid_namespace()}-{os.getpid()}-"
    return [n for n in os.listdir(segment_dir()) if n.startswith(mark)]


class DirStore:
    """The Store calls the transport uses, over files (picklable, needs no torch)."""

    def __init__(self, path: str):
        self.path = path

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key.replace("/", "%"))

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else value
        tmp = self._file(key) + f".tmp{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, self._file(key))

    def get(self, key: str) -> bytes:
        with open(self._file(key), "rb") as f:
            return f.read()

    def check(self, keys) -> bool:
        return all(os.path.exists(self._file(k)) for k in keys)

    def add(self, key: str, amount: int) -> int:  # only ever called by one rank per key
        value = int(self.get(key)) + amount if self.check([key]) else amount
        self.set(key, str(value))
        return value


# --- threads -------------------------------------------------------------------------------


def run_ranks(world: int, fn, *, timeout: float = 20.0, peers=None, **kw):
    """Connect ``world`` ranks on threads and run ``fn(rank, transport)`` on each.

    Returns the results in rank order (an exception object where a rank raised). Every
    transport is aborted on error and closed, and no segment of ours may be left behind.
    """
    import torch.distributed as dist

    store = dist.HashStore()
    prefix = f"t{time.monotonic_ns()}"

    def body(rank: int):
        t = None
        try:
            t = ShmTransport.connect(rank, world, store, timeout=10, prefix=prefix, peers=None if peers is None else peers(rank), **kw)
            return fn(rank, t)
        except BaseException as exc:
            if t is not None:
                t.abort(exc)
            raise
        finally:
            if t is not None:
                t.close()

    results = on_threads(world, body, timeout)
    assert _my_segments() == []
    return results


def _raise_first(results):
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nbytes", [0, 1, 8, SLOT - 8, SLOT, SLOT + 8, 2 * SLOT, 7 * SLOT + 3, 10 * SLOT])
def test_sendrecv_both_directions(nbytes):
    def fn(rank, t):
        peer = 1 - rank
        got = np.full_like(_data(peer, rank, nbytes), 77)
        t.sendrecv(peer, _data(rank, peer, nbytes), peer, got, HEADER, time.monotonic() + 10)
        return got

    got = _raise_first(run_ranks(2, fn, slot_bytes=SLOT, slots=2))
    for rank in range(2):
        np.testing.assert_array_equal(got[rank], _data(1 - rank, rank, nbytes))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nbytes", [8, SLOT, 5 * SLOT + 24])
def test_receive_with_reduce_adds_from_the_slot(nbytes):
    def fn(rank, t):
        peer = 1 - rank
        acc = _data(rank, rank, nbytes, tag=5)
        t.exchange([Send(peer, _data(rank, peer, nbytes))], [Recv(peer, acc, _add)], HEADER, time.monotonic() + 10)
        return acc

    got = _raise_first(run_ranks(2, fn, slot_bytes=SLOT, slots=2))
    for rank in range(2):
        np.testing.assert_array_equal(got[rank], _data(rank, rank, nbytes, tag=5) + _data(1 - rank, rank, nbytes))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world", [1, 3, 4])
def test_every_rank_exchanges_with_every_other_at_once(world):
    """Several sends and receives with different peers progress from one thread."""
    sizes = [0, 8, 3 * SLOT + 16, SLOT]

    def fn(rank, t):
        got = {}
        for step, size in enumerate(sizes):
            peers = [p for p in range(world) if p != rank]
            sends = [Send(p, _data(rank, p, size, step)) for p in peers]
            got[step] = {p: np.zeros(size // 8, np.int64) for p in peers}
            recvs = [Recv(p, got[step][p]) for p in peers]
            t.exchange(sends, recvs, HEADER, time.monotonic() + 10)
        return got

    got = _raise_first(run_ranks(world, fn, slot_bytes=SLOT, slots=3))
    for rank in range(world):
        for step, size in enumerate(sizes):
            for peer, arr in got[rank][step].items():
                np.testing.assert_array_equal(arr, _data(peer, rank, size, step), err_msg=f"{rank}<-{peer} step {step}")


@pytest.mark.timeout(30)
def test_ring_neighbours_only_and_ring_wraps_many_times():
    world = 4

    def fn(rank, t):
        right, left = (rank + 1) % world, (rank - 1) % world
        out = []
        for step in range(25):
            size = (step % 5) * SLOT + 8 * step
            got = np.zeros(size // 8, np.int64)
            t.sendrecv(right, _data(rank, right, size, step), left, got, HEADER, time.monotonic() + 10)
            out.append(got)
        with pytest.raises(ValueError, match="not connected"):
            t.sendrecv((rank + 2) % world, np.zeros(1), None, None, HEADER, time.monotonic() + 1)
        return out

    peers = lambda r: [(r + 1) % world, (r - 1) % world]  # noqa: E731
    got = _raise_first(run_ranks(world, fn, peers=peers, slot_bytes=SLOT, slots=2))
    for rank in range(world):
        left = (rank - 1) % world
        for step, arr in enumerate(got[rank]):
            np.testing.assert_array_equal(arr, _data(left, rank, (step % 5) * SLOT + 8 * step, step))


@pytest.mark.timeout(30)
def test_message_to_itself():
    def fn(rank, t):
        got = np.zeros(4, np.int64)
        t.exchange([Send(rank, np.arange(4, dtype=np.int64))], [Recv(rank, got, None)], HEADER, time.monotonic() + 5)
        acc = np.ones(4, np.int64)
        t.exchange([Send(rank, np.arange(4, dtype=np.int64))], [Recv(rank, acc, _add)], HEADER, time.monotonic() + 5)
        return got, acc

    (got, acc), = _raise_first(run_ranks(1, fn))
    np.testing.assert_array_equal(got, np.arange(4))
    np.testing.assert_array_equal(acc, np.arange(4) + 1)


@pytest.mark.timeout(30)
def test_random_sequence_of_sizes_directions_and_reductions():
    """One seed drives both ranks: sizes around slot boundaries, one- and two-way, reduce or copy."""
    plan = np.random.default_rng(1234)
    steps = [
        (int(plan.choice([0, 8, SLOT - 8, SLOT, SLOT + 8, 3 * SLOT, int(plan.integers(0, 6 * SLOT // 8)) * 8])),
         int(plan.integers(0, 3)), bool(plan.integers(0, 2)))
        for _ in range(60)
    ]  # (nbytes, who sends: 0, 1 or both=2, reduce?)

    def fn(rank, t):
        peer, out = 1 - rank, []
        for k, (size, who, red) in enumerate(steps):
            sends = [Send(peer, _data(rank, peer, size, k))] if who in (rank, 2) else []
            got = _data(rank, rank, size, k + 100)
            recvs = [Recv(peer, got, _add if red else None)] if who in (peer, 2) else []
            t.exchange(sends, recvs, HEADER, time.monotonic() + 10)
            out.append(got)
        return out

    got = _raise_first(run_ranks(2, fn, slot_bytes=SLOT, slots=3))
    for rank in range(2):
        for k, (size, who, red) in enumerate(steps):
            mine = _data(rank, rank, size, k + 100)
            if who in (1 - rank, 2):
                theirs = _data(1 - rank, rank, size, k)
                mine = mine + theirs if red else theirs
            np.testing.assert_array_equal(got[rank][k], mine, err_msg=f"rank {rank} step {k}")


@pytest.mark.timeout(30)
def test_connect_again_on_the_same_store_and_prefix():
    import torch.distributed as dist

    store = dist.HashStore()
    results: list = [None, None]

    def body(rank):
        try:
            got = []
            for round_ in range(3):
                t = ShmTransport.connect(rank, 2, store, timeout=10, prefix="same")
                try:
                    buf = np.zeros(3, np.int64)
                    t.sendrecv(1 - rank, np.arange(3, dtype=np.int64) + 10 * rank + round_, 1 - rank, buf, HEADER,
                               time.monotonic() + 10)
                    got.append(buf.tolist())
                finally:
                    t.close()
            results[rank] = got
        except BaseException as exc:  # noqa: BLE001
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    for rank in range(2):
        assert results[rank] == [[10 * (1 - rank) + k, 10 * (1 - rank) + k + 1, 10 * (1 - rank) + k + 2] for k in range(3)]
    assert _my_segments() == []


# --- failures on threads -------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_header_mismatch_raises_on_both_ranks():
    def fn(rank, t):
        header = CallHeader(7, "allreduce", op="sum", algorithm="ring", dtype="int64", numel=10 + rank)
        peer = 1 - rank
        t.sendrecv(peer, np.zeros(10, np.int64), peer, np.zeros(10, np.int64), header, time.monotonic() + 10)

    results = run_ranks(2, fn)
    for r in results:
        assert isinstance(r, MismatchError), r
        assert "numel=10" in str(r) and "numel=11" in str(r)


@pytest.mark.timeout(30)
def test_length_mismatch_raises_before_touching_the_buffer():
    def fn(rank, t):
        if rank == 0:
            t.sendrecv(1, np.zeros(3 * SLOT // 8, np.int64), None, None, HEADER, time.monotonic() + 10)
            return None
        buf = np.full(SLOT // 8, 5, np.int64)
        try:
            t.sendrecv(None, None, 0, buf, HEADER, time.monotonic() + 10)
        except MismatchError as exc:
            return exc, buf
        return None

    results = run_ranks(2, fn, slot_bytes=SLOT, slots=4)
    exc, buf = results[1]
    assert "expected 4096 bytes from rank 0 but got 12288" in str(exc)
    assert (buf == 5).all()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field", ["length", "chunk"])
def test_corrupt_slot_table_is_a_protocol_error_and_nothing_is_written(field):
    import struct

    from ringtrain.errors import ProtocolError
    from ringtrain.transport.shm_sync import SLOT_TABLE

    sent = threading.Event()

    def fn(rank, t):
        if rank == 0:
            t.sendrecv(1, np.arange(2 * SLOT // 8, dtype=np.int64), None, None, HEADER, time.monotonic() + 5)
            sent.set()
            return None
        sent.wait(5)
        box = t._in[0]
        if field == "length":  # the second chunk claims another message length
            struct.pack_into("<q", box.mm, SLOT_TABLE + 64 + CallHeader.SIZE, 3 * SLOT)
        else:  # the first chunk claims more bytes than a slot holds
            struct.pack_into("<q", box.mm, SLOT_TABLE + CallHeader.SIZE + 16, SLOT + 8)
        buf = np.full(2 * SLOT // 8, -1, np.int64)
        with pytest.raises(ProtocolError):
            t.sendrecv(None, None, 0, buf, HEADER, time.monotonic() + 5)
        return buf

    buf = _raise_first(run_ranks(2, fn, slot_bytes=SLOT, slots=2))[1]
    if field == "chunk":
        assert (buf == -1).all()
    else:
        np.testing.assert_array_equal(buf[: SLOT // 8], np.arange(SLOT // 8))  # first chunk was fine
        assert (buf[SLOT // 8 :] == -1).all()


@pytest.mark.timeout(30)
def test_one_send_and_one_receive_per_peer():
    def fn(rank, t):
        with pytest.raises(ValueError, match="at most one"):
            t.exchange([Send(1 - rank, np.zeros(1)), Send(1 - rank, np.zeros(1))], [], HEADER, time.monotonic() + 1)
        return "ok"

    assert _raise_first(run_ranks(2, fn)) == ["ok", "ok"]


@pytest.mark.timeout(30)
def test_abort_reaches_the_waiting_peer_with_the_same_type():
    def fn(rank, t):
        if rank == 0:
            time.sleep(0.05)
            t.abort(MismatchError("dtype differs"))
            return None
        t0 = time.monotonic()
        with pytest.raises(MismatchError, match="rank 0 aborted: dtype differs") as info:
            t.sendrecv(None, None, 0, np.zeros(4, np.int64), HEADER, time.monotonic() + 10)
        return time.monotonic() - t0, info.value

    elapsed, _ = _raise_first(run_ranks(2, fn))[1]
    assert elapsed < 5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("error, said", [(KeyboardInterrupt(), "KeyboardInterrupt"),
                                         (ValueError("bad"), "ValueError: bad")])
def test_an_abort_for_an_error_of_another_kind_names_it_as_tcp_and_torch_do(error, said):
    # shm sent str(error) alone: Ctrl-C on one rank was "rank 0 aborted: " on the others.
    def fn(rank, t):
        if rank == 0:
            time.sleep(0.05)
            t.abort(error)
            return None
        with pytest.raises(CommError) as info:
            t.sendrecv(None, None, 0, np.zeros(4, np.int64), HEADER, time.monotonic() + 10)
        return type(info.value), str(info.value)

    assert _raise_first(run_ranks(2, fn))[1] == (CommError, f"rank 0 aborted: {said}")


@pytest.mark.timeout(30)
def test_abort_also_stops_a_sender_waiting_for_room():
    def fn(rank, t):
        if rank == 0:
            time.sleep(0.05)
            t.abort(CommError("disk full"))
            time.sleep(0.5)  # stay open: the peer must see the abort, not the close
            return None
        with pytest.raises(CommError, match="rank 0 aborted: disk full"):
            t.sendrecv(0, np.zeros(10 * SLOT // 8, np.int64), None, None, HEADER, time.monotonic() + 10)
        return "ok"

    assert _raise_first(run_ranks(2, fn, slot_bytes=SLOT, slots=2))[1] == "ok"


@pytest.mark.timeout(30)
def test_data_sent_before_close_is_delivered_then_close_is_peer_lost():
    def fn(rank, t):
        if rank == 0:
            t.sendrecv(1, np.arange(4, dtype=np.int64), None, None, HEADER, time.monotonic() + 5)
            t.close()
            return None
        time.sleep(0.1)
        got = np.zeros(4, np.int64)
        t.sendrecv(None, None, 0, got, HEADER, time.monotonic() + 5)
        with pytest.raises(PeerLost, match="rank 0 closed"):
            t.sendrecv(None, None, 0, got, HEADER, time.monotonic() + 5)
        return got

    np.testing.assert_array_equal(_raise_first(run_ranks(2, fn))[1], np.arange(4))


@pytest.mark.timeout(30)
def test_deadline_gives_comm_timeout_naming_peer_and_call():
    def fn(rank, t):
        if rank == 0:
            time.sleep(0.6)
            return None
        t0 = time.monotonic()
        with pytest.raises(CommTimeout) as info:
            t.sendrecv(None, None, 0, np.zeros(4, np.int64), HEADER, time.monotonic() + 0.2)
        return time.monotonic() - t0, str(info.value)

    elapsed, text = _raise_first(run_ranks(2, fn))[1]
    assert 0.2 <= elapsed < 2
    assert "rank 0" in text and HEADER.describe() in text


@pytest.mark.timeout(30)
def test_closed_transport_refuses_and_close_is_idempotent():
    def fn(rank, t):
        t.close()
        t.close()
        with pytest.raises(CommError, match="closed"):
            t.sendrecv(None, None, None, None, HEADER, time.monotonic() + 1)
        return "ok"

    assert _raise_first(run_ranks(2, fn)) == ["ok", "ok"]


@pytest.mark.timeout(30)
def test_connect_validates_options_and_times_out_without_leftovers():
    import torch.distributed as dist

    store = dist.HashStore()
    with pytest.raises(ValueError, match="slot_bytes"):
        ShmTransport.connect(0, 2, store, timeout=1, prefix="v", slot_bytes=1000)
    with pytest.raises(ValueError, match="slots"):
        ShmTransport.connect(0, 2, store, timeout=1, prefix="v", slots=1)
    with pytest.raises(ValueError, match="rank"):
        ShmTransport.connect(2, 2, store, timeout=1, prefix="v")
    t0 = time.monotonic()
    with pytest.raises(CommTimeout, match="rank 1"):
        ShmTransport.connect(0, 2, store, timeout=0.3, prefix="alone")
    assert time.monotonic() - t0 < 3
    assert _my_segments() == []


def test_refuses_to_start_without_x86_ordering(monkeypatch):
    import torch.distributed as dist

    from ringtrain.transport import shm

    monkeypatch.setattr(shm, "ORDERING_OK", False)
    with pytest.raises(CommError, match="x86.*transport='tcp'"):
        ShmTransport.connect(0, 2, dist.HashStore(), timeout=1, prefix="arm")


@pytest.mark.timeout(30)
def test_full_dev_shm_is_a_clear_error_not_a_sigbus(monkeypatch):
    import errno

    import torch.distributed as dist

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(CommError, match="No space left.*transport='tcp'"):
        ShmTransport.connect(0, 2, dist.HashStore(), timeout=1, prefix="full")
    assert _my_segments() == []


@pytest.mark.timeout(30)
def test_stale_segments_of_dead_processes_are_removed():
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=os.getpid)
    child.start()
    child.join(20)
    dead = child.pid
    directory = segment_dir()
    stale = f"{NAME_PREFIX}{pid_namespace()}-{dead}-abcd1234-0-0-1"
    live = f"{NAME_PREFIX}{pid_namespace()}-{os.getpid()}-abcd1234-999-0-1"
    reused = f"{NAME_PREFIX}{pid_namespace()}-{os.getpid()}-abcd1234-998-0-1"  # made before we started
    for name in (stale, live, reused):
        open(os.path.join(directory, name), "wb").close()
    os.utime(os.path.join(directory, reused), (time.time() - 10**6, time.time() - 10**6))
    try:
        removed = remove_stale_segments()
        assert stale in removed and reused in removed and live not in removed
        assert not os.path.exists(os.path.join(directory, stale))
        assert os.path.exists(os.path.join(directory, live))
    finally:
        for name in (stale, live, reused):
            if os.path.exists(os.path.join(directory, name)):
                os.unlink(os.path.join(directory, name))


def test_process_identity_liveness():
    me = ProcessId.mine()
    assert me.alive()
    assert ProcessId.decode(me.encode()) == me
    assert not ProcessId(me.pid, me.start + 1, me.pidns).alive()  # same pid, another process


@pytest.mark.parametrize(
    "local_ranks, busiest, load, spins",
    [
        (2, 2, 0.3, True),  # a quiet machine
        (2, 2, 3.9, True),  # the load average still counts a job that ended: the CPUs had room all along
        (2, 5, 0.4, True),  # a passing burst, the last minute was quiet
        (2, 5, 3.9, False),  # busy at some look of the last second and over the last minute
        (2, None, 3.9, False),  # no runnable count: the load average decides, as before
        (2, None, 1.0, True),
        (3, 1, 0.0, False),  # more of the job's ranks than CPUs: never
    ],
)
def test_a_waiting_rank_spins_only_while_the_cpus_have_room(monkeypatch, local_ranks, busiest, load, spins):
    from ringtrain.transport import shm_sync

    monkeypatch.setattr(shm_sync.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(shm_sync, "usable_cpus", lambda: 2)
    monkeypatch.setattr(shm_sync.os, "getloadavg", lambda: (load, load, load))
    assert shm_sync.spinning_pays(local_ranks, busiest) is spins


def test_the_runnable_threads_count_at_their_busiest_look_of_the_second(monkeypatch):
    # One look at the runnable threads missed another job's ranks asleep at that instant: with
    # the load at 3.9 on 2 CPUs, a quiet look made every waiting rank spin for a second.
    from ringtrain.transport import shm_sync

    monkeypatch.setattr(shm_sync.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(shm_sync, "usable_cpus", lambda: 2)
    monkeypatch.setattr(shm_sync.os, "getloadavg", lambda: (3.9, 3.9, 3.9))
    looks = iter([1, 4, 1, 1] + [1] * 1000)
    monkeypatch.setattr(shm_sync, "runnable_now", lambda: next(looks))
    clock = [100.0]
    monkeypatch.setattr(shm_sync.time, "monotonic", lambda: clock[0])
    idle = shm_sync.Idle(local_ranks=2)
    idle.next_load = clock[0] + idle.LOAD_EVERY  # the load is next weighed a second from now

    def nap():  # one idle round to the sleep (the slow checks and a look run there), 5 ms apart
        for _ in range(idle.spins + 2):
            idle.step(None, lambda: None, clock[0] + 10)
        clock[0] += idle.CHECK_EVERY

    for _ in range(4):  # looks: 1, 4, 1, 1
        nap()
    clock[0] = idle.next_load
    nap()  # weighed: 4 at one look and the load 3.9 -> no spinning
    assert idle.spins == 0 and idle.busiest is None
    clock[0] = idle.next_load
    nap()  # a second of quiet looks -> spinning pays again
    assert idle.spins == idle.SPINS


def test_the_runnable_count_is_read_from_the_kernel():
    from ringtrain.transport.shm_sync import runnable_in, runnable_now

    assert runnable_in(b"0.52 0.41 0.30 3/456 789\n") == 3
    assert runnable_in(b"") is None and runnable_in(b"0.5 0.4 0.3 x/2 1") is None
    if os.path.exists("/proc/loadavg"):
        assert runnable_now() >= 1  # the reader itself is running


def test_a_transport_counts_the_ranks_on_its_host_for_spinning():
    assert run_ranks(3, lambda rank, t: t._idle.local_ranks) == [3, 3, 3]


def test_a_transport_of_ring_neighbours_counts_the_ranks_it_is_told_are_on_its_host():
    def ring(rank):
        return [(rank - 1) % 4, (rank + 1) % 4]

    assert run_ranks(4, lambda rank, t: t._idle.local_ranks, peers=ring) == [3, 3, 3, 3]
    assert run_ranks(4, lambda rank, t: t._idle.local_ranks, peers=ring, local_ranks=4) == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="local_ranks must be in"):
        ShmTransport.connect(0, 2, None, local_ranks=3)
    with pytest.raises(ValueError, match="local_ranks must count this rank and its 2 peer"):
        ShmTransport.connect(0, 4, None, peers=[1, 3], local_ranks=2)


# --- real processes ------------------------------------------------------------------------


def _proc_main(rank: int, world: int, store, prefix: str, scenario: str, out, logdir: str) -> None:
    import faulthandler

    log = open(os.path.join(logdir, f"rank{rank}.log"), "w")  # noqa: SIM115 - lives as long as the child
    faulthandler.enable(log)
    faulthandler.dump_traceback_later(45, exit=True, file=log)  # a hung child says where it hung
    t = None
    try:
        t = ShmTransport.connect(rank, world, store, timeout=20, prefix=prefix, slot_bytes=SLOT, slots=2)
        out.put((rank, "connected", None))
        out.put((rank, "ok", _SCENARIOS[scenario](rank, world, t)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))
        if t is not None:
            t.abort(exc)
    finally:
        if t is not None:
            t.close()


def _scenario_ring_sums(rank, world, t):
    """Every rank passes a growing message around the ring, adding its own part."""
    right, left = (rank + 1) % world, (rank - 1) % world
    sums = []
    for step, size in enumerate([0, 8, SLOT, 9 * SLOT + 40]):
        mine = _data(rank, 0, size, step)
        acc = mine.copy()
        got = np.zeros_like(mine)
        t.exchange([Send(right, mine)], [Recv(left, got, None)], HEADER, time.monotonic() + 15)
        t.exchange([Send(left, mine)], [Recv(right, acc, _add)], HEADER, time.monotonic() + 15)
        sums.append((got.tolist(), acc.tolist()))
    return sums


def _scenario_wait(rank, world, t, sending: bool):
    """Rank 1 sleeps; rank 0 waits to receive from it, or to send it more than the ring holds."""
    if rank == 1:
        time.sleep(60)
    t0 = time.monotonic()
    try:
        if sending:
            t.sendrecv(1, np.zeros(5 * SLOT // 8, np.int64), None, None, HEADER, time.monotonic() + 30)
        else:
            t.sendrecv(None, None, 1, np.zeros(4, np.int64), HEADER, time.monotonic() + 30)
    except PeerLost as exc:
        return ("PeerLost", str(exc), time.monotonic() - t0)
    return ("nothing", "", time.monotonic() - t0)


_SCENARIOS = {
    "ring": _scenario_ring_sums,
    "wait_recv": lambda *a: _scenario_wait(*a, sending=False),
    "wait_send": lambda *a: _scenario_wait(*a, sending=True),
}


def _start(world: int, scenario: str, store, logdir):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    prefix = f"p{os.getpid()}-{time.monotonic_ns()}"
    procs = [ctx.Process(target=_proc_main, args=(r, world, store, prefix, scenario, out, str(logdir)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return procs, out


def _logs(logdir) -> str:
    return "\n".join(f"--- {n}\n{open(os.path.join(logdir, n)).read()}" for n in sorted(os.listdir(logdir)) if n.endswith(".log"))


def _collect(procs, out, want: int, logdir, timeout: float = 60) -> list:
    got = []
    end = time.monotonic() + timeout
    while len(got) < want:
        try:
            got.append(out.get(timeout=max(0.1, end - time.monotonic())))
        except queue.Empty:
            raise AssertionError(f"children gave {got} before the timeout; their logs:\n{_logs(logdir)}") from None
        if got[-1][1] == "error":
            raise AssertionError(f"rank {got[-1][0]} failed:\n{got[-1][2][2]}")
    return got


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_processes_ring_exchange_exact(world, tmp_path):
    if world == 2:
        import torch.distributed as dist  # one case through a real TCPStore, as in a job

        server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        store = ("tcp", server.port)
    else:
        store = DirStore(str(tmp_path))
    procs, out = _start(world, "ring", _store_arg(store), tmp_path)
    try:
        results = {r: v for r, kind, v in _collect(procs, out, 2 * world, tmp_path) if kind == "ok"}
    finally:
        _stop(procs)
    for rank in range(world):
        left, right = (rank - 1) % world, (rank + 1) % world
        for step, size in enumerate([0, 8, SLOT, 9 * SLOT + 40]):
            got, acc = results[rank][step]
            assert got == _data(left, 0, size, step).tolist()
            assert acc == (_data(rank, 0, size, step) + _data(right, 0, size, step)).tolist()
    assert [n for n in os.listdir(segment_dir()) if any(f"-{p.pid}-" in n for p in procs)] == []


def _store_arg(store):
    return _TcpStoreRef(store[1]) if isinstance(store, tuple) else store


class _TcpStoreRef:
    """A picklable handle that becomes a TCPStore client in the child."""

    def __init__(self, port: int):
        self.port = port
        self._store = None

    def _get(self):
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore("127.0.0.1", self.port, None, False)
        return self._store

    def set(self, key, value):
        self._get().set(key, value)

    def get(self, key):
        return self._get().get(key)

    def check(self, keys):
        return self._get().check(keys)

    def add(self, key, amount):
        return self._get().add(key, amount)

    def __getstate__(self):
        return {"port": self.port, "_store": None}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("scenario", ["wait_recv", "wait_send"])
def test_killed_peer_is_peer_lost_within_seconds(scenario, tmp_path):
    procs, out = _start(2, scenario, DirStore(str(tmp_path)), tmp_path)
    try:
        _collect(procs, out, 2, tmp_path)  # both connected
        time.sleep(0.2)
        procs[1].kill()  # not joined: the child stays a zombie, which must count as dead
        (rank, kind, value), = _collect(procs, out, 1, tmp_path)
    finally:
        _stop(procs)
    assert (rank, kind) == (0, "ok")
    name, text, elapsed = value
    assert name == "PeerLost" and "rank 1" in text and "died" in text
    assert elapsed < 5
