"""`ringtrain launch`: which failure is named first, how long nodes wait for each other, what the
command prints around torchrun."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from cli_harness import refusal
from mp_harness import answer_like_http
from torch_version import OLDER_TORCH
from ringtrain import cli, launch
from ringtrain import errors as ringtrain_errors

pytestmark = pytest.mark.timeout(120)


def run_cli(argv: list[str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for name in ("RINGTRAIN_SECRET", "OMP_NUM_THREADS"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "ringtrain.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def network_address() -> str:
    """This machine's address on its network (not loopback); skip where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # (TEST-NET: nothing is sent; it picks the outgoing interface)
            address = s.getsockname()[0]
        except OSError:
            address = ""
    if not address or address.startswith("127.") or address == "0.0.0.0":
        pytest.skip("no network address besides loopback")
    return address


class Failure:
    """What torchrun's ProcessFailure carries that run_torchrun reads."""

    def __init__(self, exitcode: int, timestamp: int, message=""):
        self.exitcode, self.timestamp, self.message = exitcode, timestamp, message
        self.error_file = "<N/A>"

    def signal_name(self) -> str:
        return signal.Signals(-self.exitcode).name


def test_a_rank_torchrun_stopped_is_named_after_the_one_that_failed_in_the_same_second():
    same = 1_700_000_000
    failures = {0: Failure(-signal.SIGTERM, same), 1: Failure(1, same), 2: Failure(-signal.SIGTERM, same)}
    order = sorted(failures.items(), key=lambda item: launch._failure_order(*item))
    assert [rank for rank, _ in order] == [1, 0, 2]
    # A rank killed by SIGTERM that recorded an exception (its own handler raised) failed by itself.
    recorded = {0: Failure(-signal.SIGTERM, same, {"message": "CommError: x"}), 1: Failure(1, same + 1)}
    assert sorted(recorded.items(), key=lambda item: launch._failure_order(*item))[0][0] == 0
    # A script's sys.exit(3), which records nothing, before the PeerLost its peer recorded on seeing
    # it go (both in one second; the PeerLost's rank was then stopped by torchrun's SIGTERM).
    lost = {"message": "PeerLost: rank 1: rank 0 (pid 9) died during call #1 barrier",
            "extraInfo": {"ringtrain_time": str(same + 0.5)}}
    exited = {0: Failure(3, same), 1: Failure(-signal.SIGTERM, same, lost)}
    assert [r for r, _ in sorted(exited.items(), key=lambda item: launch._failure_order(*item))] == [0, 1]
    # Otherwise the earlier second first, then the lower rank.
    later = {0: Failure(1, same + 1), 1: Failure(2, same)}
    assert [r for r, _ in sorted(later.items(), key=lambda item: launch._failure_order(*item))] == [1, 0]


def test_a_rank_stopped_while_raising_exits_1_not_143():
    """A rank that recorded its exception and was then ended by torchrun's SIGTERM (another rank
    failed in the same moment) made the command exit 143, which reads as the job's preemption."""
    assert launch._exit_status(-signal.SIGTERM, recorded=True) == 1
    assert launch._exit_status(-signal.SIGTERM) == 143 and launch._exit_status(-signal.SIGKILL, recorded=True) == 137
    assert launch._exit_status(3) == 3 and launch._exit_status(0) == 1


def test_a_rank_killed_from_outside_is_named_before_the_ranks_that_lost_it_in_the_same_second():
    """kill -9 of rank 2 (a parameter server) of `ringtrain train`: ranks 0 and 1 recorded PeerLost
    before torchrun stopped them, all in one second; rank 0 was named first and the status was 143."""
    same = 1_700_000_000
    lost = {"message": "PeerLost: parameter server 0 at 127.0.0.1:46427 closed the connection"}
    failures = {0: Failure(-signal.SIGTERM, same, lost), 1: Failure(-signal.SIGTERM, same, lost),
                2: Failure(-signal.SIGKILL, same)}
    order = sorted(failures.items(), key=lambda item: launch._failure_order(*item))
    assert [rank for rank, _ in order] == [2, 0, 1]
    assert launch._exit_status(order[0][1].exitcode) == 137
    # A stopped (SIGSTOP) rank that torchrun kills 30 s after the others timed out stays last.
    later = {0: Failure(1, same, {"message": "CommTimeout: x"}), 1: Failure(-signal.SIGKILL, same + 30)}
    assert [r for r, _ in sorted(later.items(), key=lambda item: launch._failure_order(*item))] == [0, 1]


@pytest.mark.multiprocess
def test_the_rank_that_failed_is_named_first_and_its_exit_code_returned(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    sys.exit(7)\n"
                      "time.sleep(60)  # rank 0: stopped by torchrun once rank 1 failed\n")
    proc = run_cli(["launch", "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ringtrain launch: ")]
    assert proc.returncode == 7, proc.stderr
    both = ["ringtrain launch: rank 1 failed (exit code 7)", "ringtrain launch: rank 0 failed (killed by SIGTERM)"]
    # (torch 2.4's agent lists only the ranks failed when it noticed: not rank 0, which it then stopped)
    assert lines == both or (OLDER_TORCH and lines == both[:1]), proc.stderr
    # Neither torchrun's banner nor its own log line of the failure: the lines above say it.
    assert "OMP_NUM_THREADS" not in proc.stderr and "failed (exitcode" not in proc.stderr, proc.stderr


_FLAKY = {  # rank 0 of the first attempt exits 3, then an allreduce of ones
    "init": ("import os, sys, numpy as np, ringtrain\n"
             "comm = ringtrain.init(timeout=30, join_timeout=30)\n"
             "rank = comm.rank\n"
             "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and rank == 0:\n"
             "    sys.exit(3)\n"
             "x = np.ones(2, dtype=np.float32)\n"
             "comm.allreduce(x)\n"),
    "named backend": ("import os, sys, torch, torch.distributed as dist, ringtrain.torch_group\n"
                      "from datetime import timedelta\n"
                      "dist.init_process_group('ringtrain', timeout=timedelta(seconds=30))\n"
                      "rank = dist.get_rank()\n"
                      "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and rank == 0:\n"
                      "    sys.exit(3)\n"
                      "x = torch.ones(2)\n"
                      "dist.all_reduce(x)\n"
                      "dist.destroy_process_group()\n"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("made_by", sorted(_FLAKY))
def test_a_job_torchrun_restarts_meets_afresh(tmp_path, made_by):
    """torchrun --max-restarts (ringtrain launch --help's way to restart): the agent's store outlives
    the first attempt, whose rank 0 exits 3; the second attempt's ranks read that attempt's job
    identity and refused each other (AuthError, the same secret on both). The named backend's
    group of the second attempt has the first's prefix in that store (torch's): it was refused as
    a second process of each rank."""
    script = tmp_path / "flaky.py"
    script.write_text(_FLAKY[made_by] + "with open(f'rank{rank}.txt', 'w') as f:\n"
                      "    f.write(f\"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} sum {float(x[0])}\")\n")
    env = dict(os.environ, RINGTRAIN_SECRET="a-secret-of-the-jobs")
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                           "1", "--master-port", str(free_port()), str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "attempt 1 sum 2.0"
    assert "AuthError" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.multiprocess
def test_a_scripts_exception_is_named_in_its_line_without_record(tmp_path):
    """A script that raised ValueError('bad') on rank 1 after ringtrain.init() was only "rank 1 failed
    (exit code 1)": torchrun's error file is written by @record alone, which user scripts lack. init()
    now writes it; and rank 0's PeerLost, raised a moment later in the same second, is named after it."""
    script = tmp_path / "bad.py"
    script.write_text("import ringtrain\n"
                      "comm = ringtrain.init(timeout=30)\n"
                      "comm.barrier()\n"
                      "def helper():\n"
                      "    raise ValueError('bad')\n"
                      "if comm.rank == 1:\n"
                      "    helper()\n"
                      "comm.barrier()\n")
    proc = run_cli(["launch", "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ringtrain launch: ")]
    assert proc.returncode == 1, proc.stderr
    assert lines[0] == "ringtrain launch: rank 1 failed (exit code 1): ValueError: bad [bad.py:5 in helper]", proc.stderr
    # (as above: torch 2.4 names the first failure alone)
    assert (len(lines) == 2 and lines[1].startswith("ringtrain launch: rank 0 failed (")) or (
        OLDER_TORCH and len(lines) == 1), proc.stderr
    assert "ValueError: bad" in proc.stderr.split("ringtrain launch: ")[0], proc.stderr  # its traceback as before


@pytest.mark.multiprocess
def test_a_scripts_exception_before_init_is_named_and_the_script_runs_as_python_runs_it(tmp_path):
    """An exception raised before ringtrain.init() was only "rank 1 failed (exit code 1)": init() installs
    the recorder. The launcher now starts the script through errorfile.run_script, which installs it first."""
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")  # (found beside the script, as python finds it)
    script = tmp_path / "early.py"
    script.write_text("import json, os, sys\n"
                      "import helper_mod\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    raise ValueError(f'early {sys.argv[1:]}')\n"
                      "json.dump([__name__, __file__, sys.argv, sys.path[0], helper_mod.VALUE], open('seen.json', 'w'))\n")
    proc = run_cli(["launch", "--nproc-per-node", "2", "--master-port", str(free_port()), str(script), "--lr", "1"],
                   tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ringtrain launch: ")]
    assert proc.returncode == 1, proc.stderr
    assert lines == ["ringtrain launch: rank 1 failed (exit code 1): ValueError: early ['--lr', '1'] [early.py:4 in "
                     "<module>]"], proc.stderr
    traceback = proc.stderr.split("ringtrain launch: ")[0]
    assert 'early.py", line 4, in <module>' in traceback and "runpy" not in traceback, traceback
    assert "errorfile" not in traceback, traceback
    assert json.loads((tmp_path / "seen.json").read_text()) == [
        "__main__", str(script), [str(script), "--lr", "1"], str(tmp_path), 7]


@pytest.mark.timeout(30)
def test_ranks_that_never_arrived_are_named_with_a_hint_across_nodes():
    """Node 1 died before its rank registered: node 0's rank waited its join timeout and said
    "CommTimeout ... keys: /ringtrain/1//host/1", torch's name of the key it waited for."""
    from datetime import timedelta

    import torch.distributed as dist

    from ringtrain import rendezvous, session

    for nnodes, hint in [(2, " (its node's launcher may have failed: see its output)"), (0, "")]:
        store = dist.PrefixStore("ringtrain/1/", dist.HashStore())
        store.set_timeout(timedelta(seconds=0.3))
        store.set("host/2", "other")  # (rank 2 arrived; 1 and 3 did not)
        info = rendezvous.JobInfo(0, 4, "10.0.0.1", 29811, "here", b"s", nnodes)
        with pytest.raises(ringtrain_errors.CommTimeout) as caught:
            session.communicator_on_store(store, info, "tcp", 1.0, 0.3)
        assert str(caught.value) == ("rank 0: ranks 1, 3 of 4 never arrived at the rendezvous at 10.0.0.1:29811 within "
                                     f"0.3s (join_timeout){hint}")


def test_a_rank_another_process_joined_as_already_is_a_mismatch_naming_it():
    """Two launch commands given the same --node-rank joined one job with the same ranks: one of each
    pair trained, the other waited out its timeout, then failed on "rank 0 did not publish its
    endpoint" and stopped every node ("node 1 failed: ...") however far the job had come."""
    import torch.distributed as dist

    from ringtrain import rendezvous, session

    store = dist.PrefixStore("ringtrain/1/", dist.HashStore())
    store.set_timeout(timedelta(seconds=0.3))
    store.set("rank/1", "pid 4242 on vm/node1")  # (the first node given --node-rank 1)
    info = rendezvous.JobInfo(1, 2, "10.0.0.1", 29811, "vm/node1", b"s", 2)
    with pytest.raises(ringtrain_errors.MismatchError) as caught:
        session.communicator_on_store(store, info, "tcp", 1.0, 0.3)
    assert str(caught.value) == (
        "rank 1: another process (pid 4242 on vm/node1) has already joined this job as rank 1: were two nodes given "
        "the same --node-rank? give each node's launcher a --node-rank of its own in [0, nnodes)")
    assert not store.check(["host/1"])  # (refused before it wrote any key of the first one's)


def test_the_missing_ranks_are_those_of_the_stage_this_rank_waited_at():
    """A rank that timed out at the "host" stage, after a late rank wrote its host key: the "member"
    stage, which this rank never reached, named this rank itself as never arrived."""
    import torch.distributed as dist

    from ringtrain import session

    store = dist.HashStore()
    for r in range(3):
        store.set(f"host/{r}", "h")  # (rank 2's came after rank 0's timeout)
    store.set("member/1", "p")
    assert session._missing_ranks(store, 3, 0) == []  # (torch's own text then)
    store.set("member/0", "p")
    assert session._missing_ranks(store, 3, 0) == [2]


def test_nodes_with_different_numbers_of_ranks_are_said_once_on_rank_0(caplog):
    """Two launch commands given --nproc-per-node 2 and 1 formed one job of 3 ranks without a word."""
    from ringtrain import rendezvous, session

    uneven = ["a/0", "a/0", "b/1"]
    with caplog.at_level("WARNING", logger="ringtrain"):
        session.warn_if_uneven_nodes(rendezvous.JobInfo(1, 3, "10.0.0.1", 29811, "a/0", b"s", 2), uneven)
        session.warn_if_uneven_nodes(rendezvous.JobInfo(0, 4, "10.0.0.1", 29811, "a/0", b"s", 2), uneven + ["b/1"])
        assert not caplog.records  # (rank 1 says nothing; even nodes are fine)
        session.warn_if_uneven_nodes(rendezvous.JobInfo(0, 3, "10.0.0.1", 29811, "a/0", b"s", 2), uneven)
    assert [r.getMessage() for r in caplog.records] == [
        "the nodes run different numbers of ranks (2 on a/0, 1 on b/1; 3 in all): is --nproc-per-node the same in "
        "every node's launch command?"]


def test_the_shim_runs_a_script_as_python_does(tmp_path):
    """errorfile.run_script (how ringtrain launch starts a script): runpy put the shim back as
    __main__ once the script's body ended, so a class pickled at exit was not found; __file__ was
    the path as typed; a symlinked script did not find the files beside the real one."""
    import subprocess
    import sys

    from ringtrain import errorfile

    real = tmp_path / "real"
    real.mkdir()
    (real / "beside.py").write_text("VALUE = 7\n")
    (real / "job.py").write_text(
        "import atexit, json, os, pickle, sys\n"
        "import beside\n"
        "class Point:\n"
        "    pass\n"
        "here = os.getcwd()\n"
        "def at_exit():\n"
        "    seen = [len(pickle.dumps(Point())) > 0, os.path.isabs(__file__), __name__, beside.VALUE, sys.argv]\n"
        "    json.dump(seen, open(os.path.join(here, 'seen.json'), 'w'))\n"
        "atexit.register(at_exit)\n"
        "os.chdir('/')\n")
    (tmp_path / "job.py").symlink_to(real / "job.py")
    proc = subprocess.run([sys.executable, errorfile.__file__, "job.py", "--x", "1"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "seen.json").read_text()) == [True, True, "__main__", 7, ["job.py", "--x", "1"]]


def test_error_files_written_by_init_order_ranks_within_a_second():
    same = 1_700_000_000
    first = {"message": "ValueError: bad", "extraInfo": {"timestamp": str(same), "ringtrain_time": f"{same}.25"}}
    later = {"message": "PeerLost: rank 0: rank 1 died", "extraInfo": {"timestamp": str(same), "ringtrain_time": f"{same}.5"}}
    failures = {0: Failure(1, same, later), 1: Failure(1, same, first)}
    assert [r for r, _ in sorted(failures.items(), key=lambda item: launch._failure_order(*item))] == [1, 0]
    # written by @record (no ringtrain_time): by rank, as before
    failures = {0: Failure(1, same, {"message": "x"}), 1: Failure(1, same, {"message": "y"})}
    assert [r for r, _ in sorted(failures.items(), key=lambda item: launch._failure_order(*item))] == [0, 1]


@pytest.mark.parametrize("value", ["0", "nan", "-5"])
def test_a_join_timeout_that_is_not_a_number_of_seconds_is_refused(value, tmp_path, capsys):
    said = refusal(["launch", "--join-timeout", value, str(tmp_path / "x.py")], capsys)
    assert said == f"ringtrain launch: --join-timeout must be a number of seconds >= 1, got {float(value)}"


def test_the_join_timeout_reaches_torchruns_rendezvous():
    p = argparse.ArgumentParser()
    launch.configure(p)
    assert "--rdzv-conf=timeout=3" in launch.torchrun_argv(p.parse_args(["--join-timeout", "2.5", "x.py"]))
    assert "--rdzv-conf=timeout=600" in launch.torchrun_argv(p.parse_args(["x.py"]))  # torchrun's own default


@pytest.mark.multiprocess
def test_a_node_that_never_joins_is_one_line_on_the_node_that_waited(tmp_path):
    address = network_address()
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    t0 = time.monotonic()
    proc = run_cli(["launch", "--nnodes", "2", "--node-rank", "0", "--master-addr", address, "--master-port",
                    str(free_port()), "--join-timeout", "2", "--secret-file", str(secret), str(script)], tmp_path)
    took = time.monotonic() - t0
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert lines[0].startswith(f"ringtrain launch: node 0 of 2: joining the job at {address}:"), proc.stderr
    assert lines[0].endswith("(waiting up to 2 s for every node)"), proc.stderr
    assert lines[-1].startswith("ringtrain launch: torchrun failed: ") and "1/2 clients joined" in lines[-1], lines
    assert "start `ringtrain launch` on every other node" in lines[-1], lines
    assert "Traceback" not in proc.stderr and took < 60, (took, proc.stderr)


def start_nodes(tmp_path: Path, script: Path, nnodes: int = 2, join_timeout: int = 30,
                told: list[int] | None = None) -> list[subprocess.Popen]:
    """``ringtrain launch`` for nodes 0..nnodes-1 of one job, all on this machine at its network address
    (each a process group of its own, for kill_nodes); ``told``: the --nnodes each node is given
    (default: nnodes)."""
    address, port = network_address(), free_port()
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    env = dict(os.environ)
    env.pop("RINGTRAIN_SECRET", None)
    return [subprocess.Popen([sys.executable, "-m", "ringtrain.cli", "launch", "--nnodes", str((told or [nnodes] * nnodes)[node]), "--node-rank",
                              str(node), "--master-addr", address, "--master-port", str(port), "--join-timeout",
                              str(join_timeout), "--secret-file", str(secret), str(script)],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
            for node in range(nnodes)]


def after_a_barrier(tmp_path: Path, name: str, then: str = "") -> Path:
    """A script for start_nodes: every rank calls ringtrain.init() and meets the others in a barrier,
    then runs ``then`` (os, sys and time imported)."""
    script = tmp_path / name
    script.write_text("import os, sys, time\n"
                      "import ringtrain\n"
                      "comm = ringtrain.init(timeout=30)\n"
                      "comm.barrier()\n"
                      "comm.close()\n" + then)
    return script


def kill_nodes(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()


@pytest.mark.multiprocess
def test_a_node_whose_ranks_finished_does_not_wait_for_a_node_whose_ranks_failed(tmp_path):
    """torchrun's agent whose ranks succeeded waits at exit for every other node's agent (300 s); one
    whose ranks failed used not to check in, so node 0 sat there 5 minutes after node 1 had failed."""
    script = after_a_barrier(tmp_path, "node1_fails.py",
                             "if os.environ['GROUP_RANK'] == '1':\n"
                             "    time.sleep(2)  # (node 0 is at the exit barrier by now, not stopped by node 1's failure)\n"
                             "    sys.exit(3)\n")
    procs = start_nodes(tmp_path, script)
    try:
        _, err1 = procs[1].communicate(timeout=90)
        assert procs[1].returncode == 3, err1
        assert "ringtrain launch: rank 1 failed (exit code 3)" in err1, err1
        _, err0 = procs[0].communicate(timeout=60)  # (torchrun's exit barrier would hold it 300 s)
        assert procs[0].returncode == 0, err0
        assert "Traceback" not in err0 and "exit barrier" not in err0, err0
    finally:
        kill_nodes(procs)


@pytest.mark.multiprocess
def test_a_node_whose_ranks_finished_is_not_a_traceback_when_node_0_failed(tmp_path):
    """Node 0 serves the rendezvous store: when its ranks failed and it left, a node waiting at torchrun's
    exit barrier used to log 'Error waiting on exit barrier' with a traceback from the closed store."""
    script = after_a_barrier(tmp_path, "node0_fails.py",
                             "if os.environ['GROUP_RANK'] == '0':\n"
                             "    time.sleep(2)  # (node 1 is at the exit barrier by now)\n"
                             "    sys.exit(3)\n")
    procs = start_nodes(tmp_path, script)
    try:
        _, err0 = procs[0].communicate(timeout=90)
        assert procs[0].returncode == 3, err0
        _, err1 = procs[1].communicate(timeout=60)
        assert procs[1].returncode == 0, err1
        assert "Traceback" not in err1 and "exit barrier" not in err1, err1
    finally:
        kill_nodes(procs)


@pytest.mark.multiprocess
def test_with_three_nodes_a_node_stopped_for_another_checks_in_at_the_exit_barrier(tmp_path):
    """Node 0's ranks finish and its launcher waits at torchrun's exit barrier; node 1's rank fails;
    node 2's, still running, is stopped for it. Node 2 left without checking in at that barrier, so
    node 0 waited its 300 s there (and logged an error)."""
    script = after_a_barrier(tmp_path, "three.py",
                             "node = os.environ['GROUP_RANK']\n"
                             "if node == '1':\n"
                             "    time.sleep(3)\n"
                             "    sys.exit(3)\n"
                             "if node == '2':\n"
                             "    time.sleep(120)\n")
    procs = start_nodes(tmp_path, script, nnodes=3)
    try:
        _, err1 = procs[1].communicate(timeout=90)
        assert procs[1].returncode == 3, err1
        _, err2 = procs[2].communicate(timeout=30)
        assert procs[2].returncode == 1 and "node 1 failed: rank 1 failed (exit code 3)" in err2, err2
        _, err0 = procs[0].communicate(timeout=30)  # (torchrun's exit barrier would hold it 300 s)
        assert procs[0].returncode == 0, err0
        assert "exit barrier" not in err0, err0
    finally:
        kill_nodes(procs)


def wait_until_every_node_ran(tmp_path: Path, procs: list[subprocess.Popen]) -> None:
    """Until every node's rank has written its ran-<node> file (after_a_barrier's scripts), within 60 s."""
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ran-{node}").exists() for node in range(len(procs))):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.1)


def failure_line(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.endswith("; stopping this node's ranks")]


@pytest.mark.multiprocess
def test_a_node_whose_rank_is_stuck_ends_once_node_0s_ranks_failed(tmp_path):
    """Node 1's rank stopped (SIGSTOP: as one stuck in the script) mid-run: node 0's rank timed out
    waiting for it and node 0's command ended, while node 1's waited forever (torchrun's agent watches
    its own node's ranks only, and node 1's rank was alive)."""
    script = tmp_path / "stuck.py"
    script.write_text("import os, signal\n"
                      "import ringtrain\n"
                      "comm = ringtrain.init(timeout=3)\n"
                      "comm.barrier()\n"
                      "if os.environ['GROUP_RANK'] == '1':\n"
                      "    os.kill(os.getpid(), signal.SIGSTOP)\n"
                      "comm.barrier()\n")
    procs = start_nodes(tmp_path, script)
    try:
        _, err0 = procs[0].communicate(timeout=90)
        assert procs[0].returncode == 1, err0
        assert "ringtrain launch: rank 0 failed (exit code 1): CommTimeout: " in err0, err0
        t0 = time.monotonic()
        _, err1 = procs[1].communicate(timeout=30)
        took = time.monotonic() - t0
        assert procs[1].returncode == 1, err1
        assert failure_line(err1) and failure_line(err1)[0].startswith(
            "ringtrain launch: node 0 failed: rank 0 failed (exit code 1): CommTimeout: "), err1
        assert "Traceback" not in err1 and took < 10, (took, err1)  # (the stopped rank ends at the SIGTERM)
    finally:
        kill_nodes(procs)


@pytest.mark.multiprocess
def test_node_0_ends_once_another_nodes_ranks_failed(tmp_path):
    """The other way round: node 0's rank busy in the script (not talking to its peers, so no timeout of
    its own), node 1's rank exits 3. Node 1's launcher leaves its line in node 0's store; node 0 reads it."""
    script = after_a_barrier(tmp_path, "node1_fails_node0_busy.py",
                             "if os.environ['GROUP_RANK'] == '1':\n"
                             "    sys.exit(3)\n"
                             "time.sleep(120)\n")
    procs = start_nodes(tmp_path, script)
    try:
        _, err1 = procs[1].communicate(timeout=90)
        assert procs[1].returncode == 3, err1
        t0 = time.monotonic()
        _, err0 = procs[0].communicate(timeout=30)
        assert procs[0].returncode == 1, err0
        assert failure_line(err0) == ["ringtrain launch: node 1 failed: rank 1 failed (exit code 3); stopping this "
                                      "node's ranks"], err0
        assert "Traceback" not in err0 and time.monotonic() - t0 < 10, err0
    finally:
        kill_nodes(procs)


@pytest.mark.multiprocess
@pytest.mark.parametrize("node", [1, 0])
def test_a_node_ends_once_another_nodes_command_is_interrupted(tmp_path, node):
    """Ctrl-C of node 1's command (its ranks busy in the script, not talking to node 0's): node 1
    ended, 130, and node 0's command ran on, its rank never told. Node 0's: its store ended with
    it before node 1 had read its line, which said node 0's launcher had ended. (The ranks end at
    once at the signal: the node's store is then gone within milliseconds of its line, unless node
    0 waits for the others to read it.)"""
    script = after_a_barrier(tmp_path, "busy_until_ctrl_c.py", "import signal\n"
                                                              "signal.signal(signal.SIGINT, lambda *_: os._exit(130))\n"
                                                              "open(f'ran-{os.environ[\"GROUP_RANK\"]}', 'w').close()\n"
                                                              "time.sleep(120)\n")
    procs = start_nodes(tmp_path, script)
    try:
        wait_until_every_node_ran(tmp_path, procs)
        procs[node].send_signal(signal.SIGINT)
        _, err = procs[node].communicate(timeout=30)
        assert procs[node].returncode == 130, err
        t0 = time.monotonic()
        other = procs[1 - node]
        _, err = other.communicate(timeout=30)
        assert other.returncode == 1, err
        assert failure_line(err) == [f"ringtrain launch: node {node} was interrupted (SIGINT); stopping this node's "
                                     "ranks"], err
        assert "Traceback" not in err and time.monotonic() - t0 < 10, err
    finally:
        kill_nodes(procs)


@pytest.mark.multiprocess
def test_a_node_ends_when_node_0s_launcher_is_killed(tmp_path):
    """kill -9 of node 0's launcher (its ranks go with it, lifecycle.py): no node writes a line, but the
    store node 0 served closes, and node 1, whose rank is busy in the script, ends."""
    script = after_a_barrier(tmp_path, "busy.py", "open(f'ran-{os.environ[\"GROUP_RANK\"]}', 'w').close()\n"
                                                  "time.sleep(120)\n")
    procs = start_nodes(tmp_path, script)
    try:
        wait_until_every_node_ran(tmp_path, procs)
        os.killpg(procs[0].pid, signal.SIGKILL)
        _, err1 = procs[1].communicate(timeout=30)
        assert procs[1].returncode == 1, err1
        assert len(failure_line(err1)) == 1 and failure_line(err1)[0].startswith(
            "ringtrain launch: node 0's launcher ended (its rendezvous store at "), err1
        assert "Traceback" not in err1, err1
    finally:
        kill_nodes(procs)


@pytest.mark.parametrize("text, hint", [
    # node 1, node 0's address wrong or down (torch's texts, from two emulated machines)
    ("The client socket has failed to connect to any network address of (10.77.0.9, 29611). The client socket has "
     "failed to connect to 10.77.0.9:39035 (errno: 113 - No route to host).", "start node 0 (--node-rank 0)"),
    ("Connection reset by peer", "start node 0 (--node-rank 0)"),
    # every node reached a store, but they disagree: two nodes given --node-rank 0, or other --nnodes
    ("wait timeout after 10000ms, keys: /none/torchelastic/role_info/0, /none/torchelastic/role_info/1",
     "the same --nnodes and a --node-rank of its own"),
    ("wait timeout after 10000ms, keys: /none/torchelastic/assigned_ranks/1",
     "the same --nnodes and a --node-rank of its own"),
])
def test_torchruns_errors_between_nodes_say_what_to_check(text, hint):
    assert hint in launch.agent_error(RuntimeError(text))


@pytest.mark.multiprocess
def test_a_node_whose_node_0_never_answers_is_one_line_without_torchs_cpp_log(tmp_path):
    """c10d's store client logs every failed try to reach node 0 with a C++ stack of some 40 frames."""
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    proc = run_cli(["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", network_address(), "--master-port",
                    str(free_port()), "--join-timeout", "1", "--secret-file", str(secret), str(script)], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 2 and lines[1].startswith("ringtrain launch: node 0's rendezvous store at "), proc.stderr
    assert "nothing accepted a connection" in lines[1] and "start node 0 (--node-rank 0)" in lines[1], proc.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("service", ["silent", "http"])
def test_a_node_whose_master_port_is_another_service_ends_within_the_join_timeout(service, tmp_path):
    """A service at --master-addr:--master-port that accepts and never answers held node 1 in torchrun's
    store client past 120 s with --join-timeout 5 (it has no deadline once connected); one that answered
    as HTTP failed it after 8.4 s with torch's "Ping failed, invalid value returned from server"."""
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    address = network_address()
    start = _command_start(tmp_path)
    with socket.socket() as listener:
        listener.bind((address, 0))
        listener.listen(8)
        if service == "http":
            answer_like_http(listener)
        t0 = time.monotonic()
        proc = run_cli(["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", address, "--master-port",
                        str(listener.getsockname()[1]), "--join-timeout", "2", "--secret-file", str(secret),
                        str(script)], tmp_path, timeout=30)
        took = time.monotonic() - t0
        listener.shutdown(socket.SHUT_RDWR)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 2 and lines[1].startswith("ringtrain launch: node 0's rendezvous store at "), proc.stderr
    if service == "silent":
        assert "does not answer as a store" in lines[1] and "--join-timeout 2 s" in lines[1], proc.stderr
        assert 2.0 <= took < 2.0 + start + 1.0, (took, start)
    else:
        assert "something else answers there (b'HTTP/1.1')" in lines[1] and "--master-port" in lines[1], proc.stderr
        assert took < start + 1.0, (took, start)


def _command_start(cwd: Path) -> float:
    """Seconds ``ringtrain launch --help`` takes here now: the command's own start (an interpreter,
    its imports), which a loaded machine stretches past any fixed allowance (it was 1.5 s)."""
    t0 = time.monotonic()
    proc = run_cli(["launch", "--help"], cwd)
    assert proc.returncode == 0, proc.stderr
    return time.monotonic() - t0


@pytest.mark.multiprocess
def test_a_node_cut_off_from_node_0_ends_once_its_ranks_have_failed(tmp_path):
    """Two emulated machines (network namespaces; root only); node 1's link is cut mid-run. Its ranks
    time out, and its launcher must then end: it tries to tell node 0's store it is done, which
    never answers, and that must not hold it (the kernel retransmits for some 15 minutes)."""
    from ringtrain.bench import netem

    reason = netem.unavailable_reason(shaping=False)
    if reason:
        pytest.skip(f"netem unavailable: {reason}")
    script = tmp_path / "loop.py"
    script.write_text("import os, pathlib, time\n"
                      "import numpy as np\n"
                      "import ringtrain\n"
                      "comm = ringtrain.init(timeout=3)\n"
                      "buf = np.ones(1000)\n"
                      "comm.allreduce(buf)\n"
                      "pathlib.Path(f'started-{comm.rank}').touch()\n"
                      "while True:\n"
                      "    comm.allreduce(buf)\n"
                      "    time.sleep(0.01)\n")
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    env = {k: v for k, v in os.environ.items() if k != "RINGTRAIN_SECRET"}
    env.pop("RINGTRAIN_HOST_ID", None)
    with netem.EmulatedNetwork(2, prefix="rtlaunch" + os.urandom(3).hex()) as net:
        port = free_port()
        procs = [net.popen(node, [sys.executable, "-m", "ringtrain.cli", "launch", "--nnodes", "2", "--node-rank",
                                  str(node), "--master-addr", net.addr(0), "--master-port", str(port), "--join-timeout",
                                  "30", "--secret-file", str(secret), str(script)],
                           env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for node in range(2)]
        while not all((tmp_path / f"started-{rank}").exists() for rank in range(2)):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.1)
        subprocess.run(["ip", "-n", net.switch_namespace, "link", "set", "p1", "down"], check=True, timeout=10)
        _, err1 = procs[1].communicate(timeout=60)
        assert procs[1].returncode == 1, err1
        assert "ringtrain launch: rank 1 failed (exit code 1)" in err1, err1
        _, err0 = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 1, err0


@pytest.mark.multiprocess
def test_a_stopped_rank_ends_at_torchruns_sigterm_not_30_s_later(tmp_path):
    # torchrun gives its SIGTERM 30 s before SIGKILL, and a rank stopped by SIGSTOP acts on no signal
    # but SIGKILL: the command ended ~38 s after a 3 s timeout, naming the rank "killed by SIGKILL".
    script = tmp_path / "stop.py"
    script.write_text("import os, signal\n"
                      "import ringtrain\n"
                      "comm = ringtrain.init(timeout=3)\n"
                      "if comm.rank == 1:\n"
                      "    os.kill(os.getpid(), signal.SIGSTOP)\n"
                      "comm.barrier()\n")
    t0 = time.monotonic()
    proc = run_cli(["launch", "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)], tmp_path)
    took = time.monotonic() - t0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("ringtrain launch: ")]
    assert proc.returncode == 1, proc.stderr
    assert lines[0].startswith("ringtrain launch: rank 0 failed (exit code 1): CommTimeout: "), proc.stderr
    # (torch 2.4 names the first failure alone)
    assert lines[1:] == ["ringtrain launch: rank 1 failed (killed by SIGTERM)"] or (OLDER_TORCH and len(lines) == 1), \
        proc.stderr
    assert took < 25, f"{took:.1f} s"  # (8 s here: start-up and the 3 s timeout)


def test_launch_without_a_script_says_to_give_one(capsys):
    # argparse said "the following arguments are required: script, script_args" (its arguments are optional)
    said = refusal(["launch", "--nproc-per-node", "2"], capsys)
    assert said == "ringtrain launch: give the training script to start: ringtrain launch [options] SCRIPT [its arguments]"


def test_one_node_takes_a_free_rendezvous_port_and_several_nodes_torchruns(tmp_path, monkeypatch):
    # One node took 29500 as torchrun does, so two jobs side by side on one machine collided.
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    ports = []
    monkeypatch.setattr(launch, "run_torchrun", lambda argv, prog, **_: ports.append(
        next(int(a.split("=")[1]) for a in argv if a.startswith("--master-port="))) or 0)
    monkeypatch.setattr(launch, "reach_node_0", lambda args: args)
    for name in ("RINGTRAIN_SECRET", "OMP_NUM_THREADS"):  # (set by run(): restored after the test)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with socket.socket() as taken:  # (29500 in use, as by another job: one node does not need it)
        taken.bind(("127.0.0.1", 0))
        monkeypatch.setattr(launch, "MULTI_NODE_PORT", taken.getsockname()[1])
        assert cli.main(["launch", str(script)]) == 0 and cli.main(["launch", "--nproc-per-node", "2", str(script)]) == 0
    assert all(0 < port < 65536 and port != launch.MULTI_NODE_PORT for port in ports), ports
    assert cli.main(["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", "192.0.2.1", "--secret-file",
                     str(secret), str(script)]) == 0
    assert cli.main(["launch", "--master-port", "29611", str(script)]) == 0
    assert ports[2:] == [launch.MULTI_NODE_PORT, 29611]


def test_launcher_options_after_the_script_are_warned_of_in_one_line(tmp_path, monkeypatch, capsys):
    """`ringtrain launch train.py --nproc-per-node 2` passed --nproc-per-node 2 to the script and ran 1 rank
    without a word."""
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    monkeypatch.setattr(launch, "run_torchrun", lambda argv, prog, **_: 0)
    for name in ("RINGTRAIN_SECRET", "OMP_NUM_THREADS"):  # (set by run(): restored after the test)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    assert cli.main(["launch", str(script), "--nproc-per-node", "2", "--lr", "1", "--master-port=29811"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"ringtrain launch: warning: --nproc-per-node --master-port after {script} went to the script, not to the "
        "launcher: give the launcher's options before the script"]
    assert cli.main(["launch", "--nproc-per-node", "2", str(script), "--lr", "1"]) == 0
    assert capsys.readouterr().err == ""
    p = argparse.ArgumentParser()
    launch.configure(p)  # (the list names every option the launcher has)
    assert sorted(launch.OPTIONS) == sorted(o for a in p._actions for o in a.option_strings if o not in ("-h", "--help"))


def test_a_script_that_is_missing_or_a_directory_is_refused_saying_which(tmp_path, capsys):
    # (a directory was "no such file")
    said = refusal(["launch", str(tmp_path / "x.py")], capsys)
    assert said == f"ringtrain launch: {tmp_path / 'x.py'}: no such file (the training script to start)"
    said = refusal(["launch", str(tmp_path)], capsys)
    assert said == f"ringtrain launch: {tmp_path}: a directory, not a file (the training script to start)"


def test_loopback_with_several_nodes_says_how_to_try_them_on_one_machine(tmp_path, capsys):
    said = refusal(["launch", "--nnodes", "2", str(tmp_path / "x.py")], capsys)
    assert "(to try several nodes on one machine, give each this machine's own address: `hostname -I`)" in said, said


def test_node_0_is_warned_when_its_master_addr_is_not_its_own(tmp_path, monkeypatch, capsys):
    """Node 0 serves the rendezvous store and its own agent and ranks reach it at --master-addr: given
    another machine's address it waited out --join-timeout, told to 'start node 0 (--node-rank 0)'."""
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    monkeypatch.setattr(launch, "run_torchrun", lambda argv, prog, **_: 0)
    monkeypatch.setattr(launch, "reach_node_0", lambda args: args)  # (no node 0 at 192.0.2.1 to ask)
    monkeypatch.setenv("RINGTRAIN_SECRET", "")  # (set by run(): restored after the test)
    monkeypatch.delenv("RINGTRAIN_SECRET")

    def warnings(node_rank: int, address: str) -> list[str]:
        assert cli.main(["launch", "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", address,
                         "--secret-file", str(secret), str(script)]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if "warning" in line]

    other = "192.0.2.1"  # (TEST-NET-1: no machine's own address)
    assert warnings(0, other) == [
        f"ringtrain launch: warning: --master-addr {other} is not an address of this machine, but node 0 (this "
        "one) serves the job's rendezvous there: give node 0 its own address, or this node the --node-rank it has"]
    assert warnings(1, other) == []  # (another node's: node 0 is elsewhere)
    assert warnings(0, network_address()) == []


def test_node_0_given_a_master_addr_that_does_not_resolve_is_refused_at_once(tmp_path, monkeypatch, capsys):
    """`ringtrain launch --master-addr no.such.host train.py` (one node, or node 0 of several) sat the
    whole --join-timeout, 600 s, printing nothing: torchrun's agent retried the name until then, and
    then told node 0 to 'start node 0 (--node-rank 0)'. A --master-addr that is not its own on one
    node was not warned of either."""
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    launches = []
    monkeypatch.setattr(launch, "run_torchrun", lambda argv, prog, **_: launches.append(argv) or 0)
    monkeypatch.setattr(launch, "reach_node_0", lambda args: args)  # (no node 0 to ask)
    for name in ("RINGTRAIN_SECRET", "OMP_NUM_THREADS"):  # (set by run(): restored after the test)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    nowhere = "no-such-host.invalid"  # (RFC 2606: never resolves)
    said = refusal(["launch", "--master-addr", nowhere, str(script)], capsys)
    assert said == (f"ringtrain launch: --master-addr {nowhere} does not resolve on this machine, but node 0 (this "
                    "one) serves the job's rendezvous there: give an address of this machine, or leave --master-addr "
                    "out (127.0.0.1)")
    said = refusal(["launch", "--nnodes", "2", "--master-addr", nowhere, "--secret-file", str(secret), str(script)],
                   capsys)
    assert said.endswith("give node 0 its own address, or this node the --node-rank it has"), said
    assert not launches
    # another node's: node 0 is elsewhere (reach_node_0 says when it never answers)
    assert cli.main(["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", nowhere, "--secret-file",
                     str(secret), str(script)]) == 0
    capsys.readouterr()
    assert cli.main(["launch", "--master-addr", "192.0.2.1", str(script)]) == 0  # (TEST-NET-1: not this machine's)
    assert capsys.readouterr().err.splitlines() == [
        "ringtrain launch: warning: --master-addr 192.0.2.1 is not an address of this machine, but node 0 (this one) "
        "serves the job's rendezvous there: give an address of this machine, or leave --master-addr out (127.0.0.1)"]


def test_node_0_that_cannot_reach_its_own_store_is_not_told_to_start_node_0():
    """Node 0 whose --master-addr is another machine's fails after --join-timeout reaching its own
    store there: its line said 'start node 0 (--node-rank 0)', the node it is."""
    text = ("The client socket has timed out after 3000ms while trying to connect to (192.0.2.99, 29500).")
    said = launch.agent_error(RuntimeError(text), node_rank=0)
    assert "start node 0" not in said and said.endswith(
        "node 0 (this one) serves the rendezvous store and reaches it at --master-addr: give node 0 an address of "
        "this machine"), said
    assert "start node 0 (--node-rank 0)" in launch.agent_error(RuntimeError(text), node_rank=1)
    assert launch._node_rank(["--nnodes=2", "--node-rank=0"]) == 0 and launch._node_rank([]) is None


def test_a_torch_whose_agent_has_no_invoke_run_launches_as_before(monkeypatch):
    # The exit-barrier check-in wraps a private method of torch's agent: where a torch (>= 2.4,
    # not the pinned one) builds its agent otherwise, the launch goes on without it.
    from torch.distributed.elastic.agent.server import api

    monkeypatch.delattr(api.SimpleElasticAgent, "_invoke_run")
    ran = []
    with launch._nodes_end_together("ringtrain launch"):
        ran.append(True)
    assert ran == [True]
    assert not hasattr(api.SimpleElasticAgent, "_invoke_run")


@pytest.mark.multiprocess
def test_nodes_started_with_different_nnodes_end_with_a_mismatch_naming_the_option(tmp_path):
    """Node 0 told --nnodes 2 and node 1 told 3 formed a job of 2 all the same; the script ran, and then
    both launchers waited at torchrun's exit barrier (up to 300 s), each for its own count of nodes."""
    script = after_a_barrier(tmp_path, "init.py")
    procs = start_nodes(tmp_path, script, told=[2, 3])
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=90)  # (the exit barrier would hold both 300 s)
            assert proc.returncode == 1, err
            assert "MismatchError" in err and "different --nnodes (rank 0: 2; rank 1: 3)" in err, err
    finally:
        kill_nodes(procs)


def test_an_error_file_is_whole_or_absent_and_recorded_writes_it(tmp_path, monkeypatch):
    """torch's @record writes the file in place: a rank stopped by torchrun mid-write (its peer had
    failed) left an empty file, and the launcher's parse of it failed ("torchrun failed:
    JSONDecodeError", seen once under Python 3.13) in place of the ranks' errors."""
    from ringtrain import errorfile

    path = tmp_path / "error.json"

    def cut_short(data, f):  # the write stopped part way (SIGTERM)
        f.write('{"message": ')
        raise KeyboardInterrupt

    monkeypatch.setattr(errorfile.json, "dump", cut_short)
    with pytest.raises(KeyboardInterrupt):
        errorfile.write(str(path), ValueError("bad"))
    assert list(tmp_path.iterdir()) == []  # no file at all: torchrun then reports the exit code alone
    monkeypatch.undo()
    monkeypatch.setenv(errorfile.ERROR_FILE_ENV, str(path))

    def fails():
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        errorfile.recorded(fails)()
    assert json.loads(path.read_text())["message"]["message"] == "ValueError: bad"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"]


def test_init_records_an_uncaught_exception_once_and_prints_it_as_before(tmp_path, monkeypatch):
    from ringtrain import errorfile

    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: printed.append(info[1]))
    monkeypatch.delenv(errorfile.ERROR_FILE_ENV, raising=False)
    assert errorfile.record_uncaught() is False  # not under a launcher: nothing installed
    path = tmp_path / "error.json"
    monkeypatch.setenv(errorfile.ERROR_FILE_ENV, str(path))
    assert errorfile.record_uncaught() and errorfile.record_uncaught()  # (a second init(): one hook)
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert not path.exists()  # Ctrl-C is not the rank's error (as with @record)
    try:
        raise ValueError("bad")
    except ValueError as exc:
        error = exc
    sys.excepthook(ValueError, error, error.__traceback__)
    assert printed == [printed[0], error] and len(printed) == 2
    failure = Failure(1, 0, json.loads(path.read_text())["message"])
    assert launch.describe_failure(1, failure).startswith("rank 1 failed (exit code 1): ValueError: bad [test_launch.py:")
