"""Ctrl-C on a benchmark: one line on stderr, exit status 130, its ranks and namespaces gone,
no empty folder left behind. Each test starts the command in a session of its own, sends it
SIGINT once rank 0 is at work, and kills whatever of that session is left at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def session_alive(sid: int) -> list[int]:
    """The processes still in session ``sid``."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid:
                left.append(int(pid))
        except (ProcessLookupError, PermissionError):
            pass
    return left


def interrupt_when(argv: list[str], ready: str, tmp_path: Path, settle: float = 1.0) -> tuple[int, str, int]:
    """Run ``ringtrain argv``; SIGINT it ``settle`` seconds after ``ready`` is on its stderr.
    (status, stderr, pid)"""
    err_path = tmp_path / "stderr"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ringtrain.cli", *argv], stdout=subprocess.DEVNULL,
                                stderr=err, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while ready not in err_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.1)
        time.sleep(settle)  # into the ranks' work
        os.kill(proc.pid, signal.SIGINT)
        status = proc.wait(timeout=60)
        deadline = time.monotonic() + 10  # ranks get SIGKILL; give the kernel a moment to reap
        while session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return status, err_path.read_text(), proc.pid
    finally:
        left = session_alive(proc.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert not left, f"processes left: {left}"


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("net", ["none", "1gbit"])
def test_ctrl_c_on_bench_allreduce_is_one_line(net, tmp_path):
    if net != "none" and os.geteuid() != 0:
        pytest.skip("--net needs root")
    argv = ["bench", "allreduce", "--world-sizes", "2", "--sizes", "16M", "--repeats", "100", "--no-mpi",
            "--no-horovod", "--transports", "tcp", "--algorithms", "ring", "--net", net, "--out", str(tmp_path / "out")]
    status, err, pid = interrupt_when(argv, "# world size 2", tmp_path)
    lines = [l for l in err.splitlines() if not l.startswith("#")]
    assert status == 130 and lines == ["ringtrain bench allreduce: interrupted; nothing saved"], err
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"ringtrain-{pid}-" not in namespaces, namespaces
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_ctrl_c_on_bench_train_is_one_line_and_leaves_no_empty_timelines_folder(tmp_path):
    argv = ["bench", "train", "--models", "mlp", "--schedules", "optimal", "--world-size", "2", "--steps", "50",
            "--rounds", "3", "--no-torch-ddp", "--out", str(tmp_path / "out")]
    status, err, _ = interrupt_when(argv, "# mlp: warming up", tmp_path)
    lines = [l for l in err.splitlines() if not l.startswith("#")]
    assert status == 130 and lines == ["ringtrain bench train: interrupted; nothing saved"], err
    assert not (tmp_path / "out" / "timelines").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ctrl_c_on_bench_train_keeps_the_models_it_finished(tmp_path):
    # A run cut short kept nothing: the ranks sent every model's rows at the end (on the lent
    # 16-core machine three runs, stopped at their deadlines in their last model, saved nothing).
    argv = ["bench", "train", "--models", "charlm,mlp", "--schedules", "single", "--world-size", "2",
            "--batch-size", "4", "--steps", "40", "--rounds", "2", "--no-torch-ddp", "--no-horovod",
            "--out", str(tmp_path / "out")]
    status, err, _ = interrupt_when(argv, "# mlp: warming up", tmp_path)
    lines = [l for l in err.splitlines() if not l.startswith("#")]
    saved = sorted((tmp_path / "out").glob("train-none-2r-*.json"))
    assert status == 130 and len(saved) == 1, err
    assert lines == [f"ringtrain bench train: interrupted; the rows finished so far saved to {saved[0]}"], err
    doc = json.loads(saved[0].read_text())
    assert [(r["model"], r["impl"]) for r in doc["rows"]] == [("charlm", "ringtrain"), ("charlm", "alone")]
    assert len(doc["rows"][0]["iter_s"]) == 80
    assert doc["notes"] == ["Horovod anchor skipped: --no-horovod",
                            "interrupted (Ctrl-C) before the run ended: the rows finished by then, of charlm"]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_ctrl_c_on_bench_allreduce_keeps_the_sizes_it_finished(tmp_path):
    # Ctrl-C lost every row: the ranks sent theirs when the last size was done, and the parent
    # kept them only once every world size was. SIGINT comes at once after 4K (settle=0): 128M
    # is still being checked and timed then, so only 4K is finished.
    argv = ["bench", "allreduce", "--world-sizes", "2", "--sizes", "4K,128M", "--repeats", "5", "--no-mpi",
            "--no-horovod", "--transports", "tcp", "--algorithms", "ring", "--net", "none", "--out", str(tmp_path / "out")]
    status, err, _ = interrupt_when(argv, "# world size 2: 4K done (1 of 2 sizes)", tmp_path, settle=0)
    lines = [l for l in err.splitlines() if not l.startswith("#")]
    saved = sorted((tmp_path / "out").glob("allreduce-none-*.json"))
    assert status == 130 and len(saved) == 1, err
    assert lines == [f"ringtrain bench allreduce: interrupted; the rows finished so far saved to {saved[0]}"], err
    doc = json.loads(saved[0].read_text())
    assert [(r["impl"], r["transport"], r["nbytes"]) for r in doc["rows"]] == [
        ("gloo", "gloo", 4096), ("ringtrain", "tcp", 4096)], doc["rows"]
    assert all(len(r["times_s"]) == 5 and r["world_size"] == 2 and r["net"] == "none" for r in doc["rows"])
    assert doc["notes"] == ["Open MPI anchor skipped: --no-mpi", "Horovod anchor skipped: --no-horovod",
                            "interrupted (Ctrl-C) before the run ended: the rows finished by then, for world size 2 "
                            "at 4K (1 of 2 sizes)"]
