"""ringtrain.init in real processes: every transport, torchrun's variables, beside the user's own group."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mp_harness import RankError, answer_like_http, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def _allreduce_job(rank, world_size, port, transport, via_env, user_group):
    import torch
    import torch.distributed as dist

    import ringtrain

    if via_env:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if user_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    if via_env:
        comm = ringtrain.init(transport=transport, timeout=20)
    else:
        comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport=transport, timeout=20)
    n = 1001
    out = {}
    for alg in ("ring", "naive", "central", "halving_doubling", "auto", "native"):
        buf = (np.arange(n) + rank * n).astype(np.float32)
        comm.allreduce(buf, algorithm=alg)
        out[alg] = buf
    t = torch.full((7,), float(rank))
    ringtrain.broadcast(t, root=world_size - 1)
    out["broadcast"] = t.numpy()
    comm.barrier()
    comm.close()
    if user_group:  # the user's group is untouched and still works
        x = torch.ones(3)
        dist.all_reduce(x)
        out["user_group"] = x.numpy()
        dist.destroy_process_group()
    return out


@pytest.mark.parametrize("transport", ["tcp", "shm", "torch", "auto"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_init_every_transport(transport, world_size):
    results = run_ranks(_allreduce_job, world_size, transport, False, False)
    _check(results, world_size)


@pytest.mark.parametrize("user_group", [False, True])
def test_init_from_torchrun_environment(user_group):
    results = run_ranks(_allreduce_job, 2, "auto", True, user_group)
    _check(results, 2, user_group)


def _warnings_of_init(rank, world_size, port, secret):
    import logging

    import ringtrain

    if secret is None:
        os.environ.pop("RINGTRAIN_SECRET", None)
    else:
        os.environ["RINGTRAIN_SECRET"] = secret
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("ringtrain.session").addHandler(handler)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=20)
    comm.close()
    return seen


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_rank_0_warns_once_where_the_ranks_do_not_authenticate_each_other(secret):
    rank0, rank1 = run_ranks(_warnings_of_init, 2, secret)
    if secret is None:
        assert len(rank0) == 1 and rank0[0].startswith("RINGTRAIN_SECRET is not set: the 2 ranks do not "
                                                        "authenticate each other"), rank0
    else:
        assert rank0 == []
    assert rank1 == []


def _check(results, p, user_group=False):
    for r in results:
        if isinstance(r, RankError):
            pytest.fail(f"{r}\n{r.tb}")
    n = 1001
    expect = sum((np.arange(n) + r * n).astype(np.float32) for r in range(p))
    for out in results:
        for alg in ("ring", "naive", "central", "halving_doubling", "auto", "native"):
            np.testing.assert_array_equal(out[alg], expect, err_msg=alg)
        np.testing.assert_array_equal(out["broadcast"], np.full(7, p - 1, dtype=np.float32))
        if user_group:
            np.testing.assert_array_equal(out["user_group"], np.full(3, p, dtype=np.float32))


def _after_a_job_elsewhere_job(rank, world_size, port):
    """Rank 0's process first ran a job at another endpoint (a job whose peer died, say; here one
    of one rank); rank 1 is a fresh process. They meet at ``port``."""
    import ringtrain
    from mp_harness import free_port

    if rank == 0:
        ringtrain.init(0, 1, "127.0.0.1", free_port(), transport="tcp", timeout=5).close()
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=5, join_timeout=5)
    buf = np.full(3, rank + 1.0)
    comm.allreduce(buf)
    comm.close()
    return buf.tolist()


@pytest.mark.timeout(40)
def test_a_job_at_a_new_endpoint_meets_fresh_processes_whatever_this_process_made_before():
    # The communicators were counted in all, not by endpoint: rank 0 keyed its second one "2" and
    # the fresh rank 1 its first "1", and both waited out the join timeout ("rank 1 of 2 never
    # arrived"): a process that outlives its peers (a notebook, a driver) could make no new job.
    assert run_ranks(_after_a_job_elsewhere_job, 2, timeout=30) == [[3.0] * 3] * 2


def _jobs_at_many_endpoints_job(rank, world_size, port):
    """Jobs one after another, each at an endpoint of its own (rank 0 picks them, tells them
    through the first), then one more at the last endpoint; the open descriptors after each."""
    import ringtrain
    from mp_harness import free_port

    def job(at: int) -> None:
        comm = ringtrain.init(rank, world_size, "127.0.0.1", at, transport="tcp", timeout=20)
        buf = np.ones(3)
        comm.allreduce(buf)
        comm.close()
        assert buf.tolist() == [2.0] * 3

    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=20)
    ports = np.array([free_port() for _ in range(6)] if rank == 0 else [0] * 6, dtype=np.int64)
    comm.broadcast(ports)
    comm.close()
    fds = []
    for at in [*ports.tolist(), int(ports[-1])]:
        job(at)
        fds.append(len(os.listdir("/proc/self/fd")))
    return fds


@pytest.mark.timeout(60)
def test_a_process_that_runs_jobs_at_many_endpoints_does_not_keep_a_store_for_each():
    """Each endpoint's store was kept for the process's life: about ten descriptors (and the
    port) on rank 0 per job, so a driver that starts job after job ran out of descriptors. The
    store of an endpoint no communicator uses is now let go once one is made at another; the
    same endpoint again still meets in the store it kept."""
    for rank, fds in enumerate(run_ranks(_jobs_at_many_endpoints_job, 2, timeout=50)):
        assert max(fds) - min(fds) <= 2, f"rank {rank}'s open descriptors grew job after job: {fds}"


@pytest.mark.timeout(30)
def test_a_rank_that_never_arrives_is_a_comm_timeout_after_the_join_timeout():
    import time

    import ringtrain
    from mp_harness import free_port

    t0 = time.monotonic()
    with pytest.raises(ringtrain.CommTimeout, match=r"^rank 0: rank 1 of 2 never arrived at the rendezvous at .* "
                                                    r"within 1.5s \(join_timeout\)$"):  # (not torch's key names)
        ringtrain.init(0, 2, "127.0.0.1", free_port(), transport="tcp", timeout=1.0, join_timeout=1.5)
    assert time.monotonic() - t0 < 1.5 + 5.0  # (not the 60 s a join_timeout of None would give)


def _late_rank_job(rank, world_size, port, late_s):
    """Rank 1 reaches init() ``late_s`` after rank 0, with a 1 s timeout and no join_timeout; then
    both reduce, and rank 0 waits for a reduce rank 1 never starts."""
    import time

    import ringtrain

    if rank == 1:
        time.sleep(late_s)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=1.0)
    buf = np.full(5, rank + 1.0)
    comm.allreduce(buf)
    store_timeout = comm.store.timeout.total_seconds()
    if rank == 1:
        comm.close()
        return buf.tolist(), store_timeout, None
    t0 = time.monotonic()
    try:
        comm.allreduce(buf)
        waited = "returned"
    except ringtrain.CommError as exc:
        waited = (type(exc).__name__, time.monotonic() - t0)
    comm.close()
    return buf.tolist(), store_timeout, waited


def test_ranks_started_further_apart_than_the_timeout_still_meet_and_then_fail_within_the_timeout():
    # The one timeout bounded the rendezvous too: `ringtrain train --timeout 2` failed there, before any
    # step, when its ranks started more than 2 s apart on a busy machine (the ranks' start-up skew).
    results = run_ranks(_late_rank_job, 2, 3.0, timeout=60)
    for r in results:
        assert not isinstance(r, RankError), f"{r}\n{r.tb}"
    assert [r[0] for r in results] == [[3.0] * 5] * 2
    assert [r[1] for r in results] == [1.0, 1.0]  # the store's waits are bounded by timeout again once all met
    name, seconds = results[0][2]
    assert name in ("CommTimeout", "PeerLost"), results[0]  # (PeerLost: rank 1 closed first)
    assert seconds < 1.0 + 4.0, seconds


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "soon", "0"])
def test_a_bad_join_timeout_is_a_value_error_naming_it(bad):
    import ringtrain
    from mp_harness import free_port

    with pytest.raises(ValueError, match="join_timeout must be a finite number of seconds > 0"):
        ringtrain.init(0, 2, "127.0.0.1", free_port(), transport="tcp", timeout=1.0, join_timeout=bad)


def test_join_timeout_defaults_to_the_timeout_but_at_least_60_s():
    from ringtrain.errors import check_join_timeout

    assert check_join_timeout(None, 1.0) == 60.0
    assert check_join_timeout(None, 300.0) == 300.0
    assert check_join_timeout("2.5", 1.0) == 2.5  # (a str, as from the environment)


def _native_mismatch_job(rank, world_size, port, which):
    import ringtrain

    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=10)
    last = rank == world_size - 1  # at 3 ranks, rank 1 agrees with the rank before it
    n = 10 + last if which == "numel" else 10
    op = "max" if (which == "op" and last) else "sum"
    try:
        comm.allreduce(np.ones(n, dtype=np.float32), op=op, algorithm="native")
    except ringtrain.CommError as exc:
        return type(exc).__name__
    finally:
        comm.close()
    return "returned"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("which", ["numel", "op"])
def test_native_allreduce_checks_the_ranks_calls_first(which, world_size):
    # gloo itself does not: a size mismatch aborted a process (SIGABRT) while the other returned
    # half-reduced data; an op mismatch returned half max, half sum on both ranks. At 3 ranks
    # the rank whose predecessor agreed with it went on into gloo, and waited out the timeout
    # there (a DistStoreError, not a CommError) while the others raised MismatchError.
    assert run_ranks(_native_mismatch_job, world_size, which) == ["MismatchError"] * world_size


def _native_close_job(rank, world_size, port):
    import gc

    import ringtrain

    def counts():  # OS threads, open descriptors
        return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))

    def one_communicator(algorithm):
        comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=10)
        comm.allreduce(np.ones(5, dtype=np.float32), algorithm=algorithm)
        comm.close()
        gc.collect()

    one_communicator("ring")  # what stays for the process's life (imports, the store's client)
    before = counts()
    for _ in range(3):
        one_communicator("native")
    return before, counts()


def test_close_lets_go_of_the_gloo_group():
    # algorithm="native" (and transport="torch") run on a gloo group of the communicator's: a
    # closed one left the group's threads and sockets behind while ringtrain's default
    # communicator (the last one made) still held it.
    for before, after in run_ranks(_native_close_job, 2):
        assert after == before, (before, after)


def _close_under_a_call_job(rank, world_size, port, transport, timeout):
    import threading
    from datetime import timedelta

    import ringtrain

    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport=transport, timeout=timeout)
    store = comm.store
    if rank == 1:  # stays out of the call until rank 0 has closed under it
        store.wait(["closed"], timedelta(seconds=40))
        store.set("bye", "1")
        comm.close()
        return None
    raised = []

    def call():
        try:
            comm.allreduce(np.ones(10), algorithm="ring")
        except BaseException as exc:  # noqa: BLE001 - looked at below
            raised.append(exc)

    def asleep(tid):  # the thread waits in the kernel (in the call: for rank 1's data)
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "S"

    caller = threading.Thread(target=call)
    caller.start()
    while not (comm._lock.locked() and asleep(caller.native_id)):
        threading.Event().wait(0.001)
    comm.close()
    caller.join()
    store.set("closed", "1")
    store.wait(["bye"], timedelta(seconds=40))
    return [(isinstance(exc, ringtrain.CommError), str(exc)) for exc in raised]


@pytest.mark.timeout(60)
# tcp and shm with a timeout the test would not outlive: close() must wake the call. gloo's
# wait cannot be woken (torch has no Work.abort in Python): over torch the call ends at its
# deadline, and then says that the communicator was closed.
@pytest.mark.parametrize("transport, timeout", [("tcp", 120), ("shm", 120), ("torch", 3)])
def test_close_from_another_thread_fails_the_call_in_progress_with_a_comm_error(transport, timeout):
    # The call raised what the torn-down transport left: ValueError "operation forbidden on
    # released memoryview object" (shm), AttributeError "'NoneType' object has no attribute
    # 'recv'" (torch), PeerLost "connection to rank 1 failed (Bad file descriptor)" (tcp); and
    # over tcp, a call already inside poll() slept on until its deadline (closing a descriptor
    # does not wake a poll on it).
    raised, _ = run_ranks(_close_under_a_call_job, 2, transport, timeout, timeout=50)
    assert len(raised) == 1 and raised[0][0], raised
    assert "communicator was closed during call #1 allreduce" in raised[0][1], raised


def _naive_mismatch_job(rank, world_size, port, rounds):
    import ringtrain

    out = []
    for _ in range(rounds):
        comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=10)
        try:
            comm.allreduce(np.ones(1001 + (rank == world_size - 1), np.float32), algorithm="naive")
            out.append("returned")
        except ringtrain.CommError as exc:
            out.append(type(exc).__name__)
        comm.close()
    return out


def test_a_mismatch_over_tcp_is_a_mismatch_on_every_rank_not_a_lost_peer():
    # The rank that finds the mismatch aborts and reads until its peers close: closing with
    # their data unread sent a reset that could destroy its ABORT in flight ("rank 0 is gone
    # (Broken pipe)" on a rank in 7 of 10 rounds).
    results = run_ranks(_naive_mismatch_job, 3, 5, timeout=80)
    assert results == [["MismatchError"] * 5] * 3, results


# --- reaching the rendezvous store (fresh interpreters: a client abandoned at its deadline
# must not keep the process from exiting, and stderr is checked for torch's C++ noise) --------


def _init_in_subprocess(rank: int, port: int, timeout: float):
    """(exception line, seconds init took, stderr) of ringtrain.init in a fresh interpreter, with
    ``timeout`` as its join_timeout (reaching the store is part of joining)."""
    import subprocess
    import sys

    code = (
        "import sys, time, ringtrain, ringtrain.session  # torch.distributed imported before the clock starts\n"
        "t0 = time.monotonic()\n"
        f"try:\n    ringtrain.init({rank}, 2, '127.0.0.1', {port}, transport='tcp', timeout=60, join_timeout={timeout})\n"
        "except Exception as exc:\n    print(f'{type(exc).__name__}|{time.monotonic() - t0:.2f}|{exc}')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=40, env=env)
    assert done.returncode == 0, done
    name, seconds, message = done.stdout.strip().split("|", 2)
    return name, float(seconds), message, done.stderr


def _silent_listener():
    """A socket that accepts connections (the kernel does) and never answers: some other service."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


@pytest.mark.timeout(60)
def test_a_port_that_accepts_but_never_answers_is_a_timeout_within_the_timeout():
    # torch's TCPStore client waited for the handshake's answer with no deadline: forever.
    with _silent_listener() as s:
        name, seconds, message, stderr = _init_in_subprocess(1, s.getsockname()[1], 2.0)
    assert name == "CommTimeout", message
    assert "does not answer as a store" in message and "MASTER_PORT" in message, message
    assert seconds < 2.0 + 1.0, seconds


@pytest.mark.timeout(90)
def test_a_port_that_answers_as_something_else_is_a_rendezvous_error_at_once_and_a_clean_exit():
    # torch's client retried its handshake against an HTTP-like service until init()'s deadline
    # (a C++ stack on stderr per try), was abandoned on its thread, and the process then died of
    # SIGABRT at exit in 3 of 6 runs ("terminate called without an active exception").
    import socket

    with _silent_listener() as s:
        answer_like_http(s)
        for _ in range(4):  # (_init_in_subprocess asserts exit status 0 each time)
            name, seconds, message, stderr = _init_in_subprocess(1, s.getsockname()[1], 5.0)
            assert name == "RendezvousError", message  # waiting would not help
            assert "something else answers there (b'HTTP/1.1')" in message and "MASTER_PORT" in message, message
            assert "frame #" not in stderr and "TCPStore" not in stderr, stderr
            assert seconds < 2.5, seconds  # (at once, not at the 5 s deadline)
        s.shutdown(socket.SHUT_RDWR)


@pytest.mark.timeout(60)
def test_an_unreachable_store_is_one_clear_timeout_within_the_timeout():
    # torch retried past its deadline (2 s -> 4.8 s, 5 s -> 13-16 s) and printed ~40 lines of
    # C++ stack trace and retry warnings on stderr.
    from mp_harness import free_port

    name, seconds, message, stderr = _init_in_subprocess(1, free_port(), 2.0)
    assert name == "CommTimeout", message
    assert "frame #" not in stderr and "TCPStore" not in stderr, stderr
    assert seconds < 2.0 + 1.0, seconds
    assert "could not reach the rendezvous store" in message and "nothing accepted a connection" in message


@pytest.mark.timeout(60)
def test_a_taken_port_on_rank_0_is_a_rendezvous_error_not_a_timeout():
    with _silent_listener() as s:
        port = s.getsockname()[1]
        name, seconds, message, stderr = _init_in_subprocess(0, port, 5.0)
    assert name == "RendezvousError", message  # not a CommTimeout: retrying will not help
    assert f"port {port} is already in use" in message and "MASTER_PORT" in message, message
    assert seconds < 2.0, seconds


def _transport_job(rank, world_size, port, transports):
    import time

    import ringtrain

    t0 = time.monotonic()
    try:
        ringtrain.init(rank, world_size, "127.0.0.1", port, transport=transports[rank], timeout=10).close()
        return "returned"
    except ringtrain.CommError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0


@pytest.mark.parametrize("transports", [("tcp", "shm"), ("auto", "torch", "auto")])
def test_ranks_asking_for_different_transports_raise_a_mismatch_at_once(transports):
    # Each rank waited out the whole timeout in its own transport's set-up and raised a
    # transport-specific timeout ("ranks [1] did not connect before the deadline").
    results = run_ranks(_transport_job, len(transports), transports, timeout=60)
    each = ", ".join(f"rank {r} {'uses transport ' if r == 0 else ''}{t}" for r, t in enumerate(transports))
    for rank, result in enumerate(results):
        assert not isinstance(result, RankError), f"{result}\n{result.tb}"
        name, message, seconds = result
        assert name == "MismatchError", (rank, result)
        assert f"ranks disagree about the transport: {each}; pass the same transport= on every rank" in message
        assert seconds < 5, (rank, seconds)  # at once, not after the 10 s timeout


def _torch_mismatch_job(rank, world_size, port, cases):
    import time

    import ringtrain

    out = []
    for alg, kind in cases:
        comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="torch", timeout=10)
        t0 = time.monotonic()
        try:
            if kind == "numel":  # rank 1 passes one element more
                comm.allreduce(np.ones(10 + (rank == 1), np.float32), algorithm=alg)
            else:  # each rank names itself the root
                comm.broadcast(np.ones(10, np.float32), root=rank)
            out.append(("returned", "", 0.0))
        except ringtrain.CommError as exc:
            out.append((type(exc).__name__, str(exc), time.monotonic() - t0))
        comm.close()
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="torch", timeout=10)
    buf = np.full(5, float(rank), np.float32)
    comm.allreduce(buf)  # a new communicator after the failed ones works (and no rank left early)
    comm.close()
    return out, buf


@pytest.mark.timeout(120)
def test_a_mismatch_over_the_torch_transport_is_a_mismatch_on_every_rank():
    # Only the ranks that read the odd rank's messages raised MismatchError; the others waited
    # out the whole timeout and got "sending to rank 1 timed out", which said nothing of it.
    cases = [("ring", "numel"), ("central", "numel"), ("halving_doubling", "numel"), ("naive", "numel"),
             ("ring", "root"), ("auto", "root")]
    results = run_ranks(_torch_mismatch_job, 3, cases, timeout=100)
    for rank, result in enumerate(results):
        assert not isinstance(result, RankError), f"{result}\n{result.tb}"
        out, buf = result
        for case, (name, message, seconds) in zip(cases, out):
            assert name == "MismatchError", (rank, case, name, message)
            assert "ranks disagree about the collective" in message, (rank, case, message)
            assert seconds < 5, (rank, case, seconds)  # at once, not after the 10 s timeout
        np.testing.assert_array_equal(buf, np.full(5, 3.0, np.float32))


@pytest.mark.timeout(10)
def test_the_host_id_is_the_hostname_with_the_node_rank_where_torchrun_started_several_nodes(monkeypatch):
    """Machines that share a hostname (cloned VMs) must not be taken for one host: their ranks
    would wait for shared-memory segments the other machine never sees."""
    import socket

    from ringtrain import rendezvous

    base = {"RANK": "0", "WORLD_SIZE": "1"}

    def host_id(**env):
        monkeypatch.setattr(os, "environ", {**base, **env})
        return rendezvous.job_info().host_id

    host = socket.gethostname()
    assert host_id() == host
    assert host_id(GROUP_RANK="0", GROUP_WORLD_SIZE="1") == host  # one node: the hostname, as before
    assert host_id(GROUP_RANK="1", GROUP_WORLD_SIZE="2") == f"{host}/node1"
    assert host_id(GROUP_RANK="1", GROUP_WORLD_SIZE="2", RINGTRAIN_HOST_ID="rack3-a") == "rack3-a"


def test_the_unauthenticated_warning_is_given_once_per_job_endpoint_in_a_process(monkeypatch, caplog):
    # Before: a loop making communicators without RINGTRAIN_SECRET warned at every init() (150
    # copies in a loop of 150); another endpoint is another job, and is warned of again.
    import logging

    from ringtrain import rendezvous, session

    monkeypatch.setattr(session, "_WARNED_UNAUTHENTICATED", set())
    caplog.set_level(logging.WARNING, logger="ringtrain.session")
    for port in (29611, 29611, 29611, 29612):
        session.warn_if_unauthenticated(rendezvous.JobInfo(0, 2, "127.0.0.1", port, "h", None))
    session.warn_if_unauthenticated(rendezvous.JobInfo(0, 2, "127.0.0.1", 29613, "h", b"secret"))
    said = [r.getMessage() for r in caplog.records if r.name == "ringtrain.session"]
    assert [m.split("reach ")[1].split(" ")[0] for m in said] == ["127.0.0.1:29611", "127.0.0.1:29612"], said
