"""Workers end with the launcher that started them, also one that died before they could ask."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from ringtrain.lifecycle import LAUNCHER_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

WORKER = "from ringtrain.lifecycle import die_with_parent; print(die_with_parent(), flush=True)"


def _worker(launcher: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_ENV}
    if launcher is not None:
        env[LAUNCHER_ENV] = launcher
    return subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60)


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_worker_whose_launcher_is_gone_ends_at_once():
    # (it was re-parented while it imported torch: its parent's death is no signal any more)
    done = _worker(str(_dead_pid()))
    assert done.returncode == -9 and done.stdout == ""


@pytest.mark.parametrize("launcher", [None, "", "not a pid", "self"])
def test_a_worker_with_its_launcher_alive_or_unnamed_goes_on(launcher):
    done = _worker(str(os.getpid()) if launcher == "self" else launcher)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_ringtrain_launch_names_itself_to_its_ranks(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(f"import os\nprint('launcher', os.environ['{LAUNCHER_ENV}'], os.getppid(), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-m", "ringtrain.cli", "launch", "--nproc-per-node", "1", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    line = next(ln for ln in out.splitlines() if "launcher" in ln)
    assert line.split()[1:] == [str(proc.pid), str(proc.pid)]


RING_RANK = ("import os, pathlib, time\n"
             "import ringtrain\n"
             "comm = ringtrain.init(timeout=30)\n"
             "pathlib.Path(f'rank{comm.rank}.pid').write_text(str(os.getpid()))\n"
             "time.sleep(120)\n")
# A parameter-server script's ranks call no ringtrain.init(): its rank entry points ask instead
# (before, they trained on after kill -9 of their launcher).
PS_RANKS = ("import os, pathlib, time\n"
            "import torch\n"
            "from ringtrain import ps\n"
            "rank = int(os.environ['RANK'])\n"
            "if ps.is_server_rank(1):\n"
            "    pathlib.Path(f'rank{rank}.pid').write_text(str(os.getpid()))\n"
            "    ps.run_server_role(1, timeout=30)\n"
            "else:\n"
            "    worker = ps.worker_from_env(torch.nn.Linear(2, 2), 1, timeout=30)\n"
            "    pathlib.Path(f'rank{rank}.pid').write_text(str(os.getpid()))\n"
            "    time.sleep(120)\n")


@pytest.mark.multiprocess
@pytest.mark.parametrize("body, ranks", [(RING_RANK, 1), (PS_RANKS, 2)], ids=["ring", "parameter-servers"])
def test_a_rank_of_ringtrain_launch_that_joined_ends_with_the_launcher(body, ranks, tmp_path):
    """kill -9 of `ringtrain launch` (a node's launcher) left the user's ranks training, orphaned: only
    ringtrain's own workers asked to die with it. A rank asks when it calls ringtrain.init() (the
    parameter servers' rank entry points, when it calls them)."""
    import signal
    import time

    script = tmp_path / "rank.py"
    script.write_text(body)
    env = {k: v for k, v in os.environ.items() if k not in ("RINGTRAIN_SECRET", LAUNCHER_ENV)}
    out = open(tmp_path / "launch.log", "w")  # (a file: an orphaned rank would hold a pipe open)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ringtrain.cli", "launch", "--nproc-per-node", str(ranks),
                             "--master-port", str(port), str(script)], stdout=out, stderr=subprocess.STDOUT,
                            cwd=tmp_path, env=env)
    pid_files, pids = [tmp_path / f"rank{r}.pid" for r in range(ranks)], []
    try:
        deadline = time.monotonic() + 90
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
            time.sleep(0.1)
        pids = [int(f.read_text()) for f in pid_files]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30  # (the kernel's SIGKILL is immediate; this is for a loaded machine)
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if _alive(pid)], "a rank outlived its launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        out.close()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, reaped by init soon, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_train_worker_whose_launcher_is_gone_ends_before_torch_loads(tmp_path):
    # A `torch` that leaves a mark when it loads: the worker must be gone before. Workers still
    # loading torch (minutes on an overloaded machine) when `ringtrain train` died ran on as orphans.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(f"open({str(tmp_path / 'loaded')!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_ENV}
    env.update({LAUNCHER_ENV: str(_dead_pid()), "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    proc = subprocess.run([sys.executable, "-m", "ringtrain.cli", "train", "--worker", "{}"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])
    assert not (tmp_path / "loaded").exists()
