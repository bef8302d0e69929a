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


def interrupt_when(argv: list[str], ready: str, tmp_path: Path, settle: float = 1.0,
                   sig: signal.Signals = signal.SIGINT) -> tuple[int, str, int]:
    """Run ``ringtrain argv``; ``sig`` (SIGINT) to it ``settle`` seconds after ``ready`` is on its
    stderr. (status, stderr, pid)"""
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
        os.kill(proc.pid, sig)
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
@pytest.mark.parametrize("sig, said", [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_ctrl_c_on_bench_allreduce_keeps_the_sizes_it_finished(sig, said, tmp_path):
    # (exit status 130 for Ctrl-C, 143 for SIGTERM, as every command's: it was 130 for both)
    # Ctrl-C lost every row: the ranks sent theirs when the last size was done, and the parent
    # kept them only once every world size was. SIGINT comes at once after 4K (settle=0): 128M
    # is still being checked and timed then, so only 4K is finished. SIGTERM (`timeout` ran out)
    # stops the run as Ctrl-C does; its result's note said "interrupted (Ctrl-C)" all the same.
    argv = ["bench", "allreduce", "--world-sizes", "2", "--sizes", "4K,128M", "--repeats", "5", "--no-mpi",
            "--no-horovod", "--transports", "tcp", "--algorithms", "ring", "--net", "none", "--out", str(tmp_path / "out")]
    status, err, _ = interrupt_when(argv, "# world size 2: 4K done (1 of 2 sizes)", tmp_path, settle=0, sig=sig)
    lines = [l for l in err.splitlines() if not l.startswith("#")]
    saved = sorted((tmp_path / "out").glob("allreduce-none-*.json"))
    assert status == 128 + sig and len(saved) == 1, err
    assert lines == [f"ringtrain bench allreduce: interrupted; the rows finished so far saved to {saved[0]}"], err
    doc = json.loads(saved[0].read_text())
    assert [(r["impl"], r["transport"], r["nbytes"]) for r in doc["rows"]] == [
        ("gloo", "gloo", 4096), ("ringtrain", "tcp", 4096)], doc["rows"]
    assert all(len(r["times_s"]) == 5 and r["world_size"] == 2 and r["net"] == "none" for r in doc["rows"])
    assert doc["notes"] == ["Open MPI anchor skipped: --no-mpi", "Horovod anchor skipped: --no-horovod",
                            f"interrupted ({said}) before the run ended: the rows finished by then, for world size 2 "
                            "at 4K (1 of 2 sizes)"]


# --- signals around the clean-up and the save (a helper's review: Ctrl-C under `timeout`) ------------


def test_a_signal_during_a_networks_clean_up_does_not_cut_it_short(monkeypatch):
    """`timeout` passes the terminal's Ctrl-C on: the benchmark got two or three SIGINTs, and one
    that came before close() masked them raised inside it, leaving the namespaces in 5 runs of 6."""
    from ringtrain.bench import netem

    calls = []
    monkeypatch.setattr(netem, "_PREVIOUS_HANDLERS", {signal.SIGINT: lambda *a: calls.append(a)})
    monkeypatch.setattr(netem, "_OPEN_NETWORKS", [])
    monkeypatch.setattr(netem, "_CLOSING", [object()])  # a close() running
    netem._on_signal(signal.SIGINT, None)
    assert calls == []  # (the signal that began the clean-up acts once it is done)
    monkeypatch.setattr(netem, "_CLOSING", [])
    netem._on_signal(signal.SIGINT, None)
    assert calls == [(signal.SIGINT, None)]


def test_signals_held_while_results_are_saved():
    from ringtrain.bench.procs import signals_held

    before = signal.getsignal(signal.SIGINT)
    with signals_held() as came:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # (delivered to the main thread at its next bytecodes)
    assert came == [signal.SIGINT, signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) is before


def test_two_runs_in_one_second_keep_both_results_whole(tmp_path):
    from ringtrain.bench.machine import save_result

    first = save_result("x", {"rows": [1]}, tmp_path, stamp="20261207T010326Z")
    second = save_result("x", {"rows": [2]}, tmp_path, stamp="20261207T010326Z")
    assert first != second and json.loads(first.read_text())["rows"] == [1]
    assert json.loads(second.read_text())["rows"] == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])  # (no temporary left)


def test_an_out_folder_root_cannot_write_is_refused_before_the_run():
    from ringtrain.bench.machine import check_out_dir

    if os.geteuid() != 0 or not os.path.isdir("/sys/kernel"):
        pytest.skip("needs root and /sys (os.access says yes to root there)")
    with pytest.raises(ValueError, match="--out /sys/kernel: cannot write in /sys/kernel"):
        check_out_dir("/sys/kernel")


def test_an_out_folder_below_a_file_is_refused_naming_the_file(tmp_path):
    # (was "cannot make it (Not a directory)", naming no file; simulate --plot's words now)
    from ringtrain.bench.machine import check_out_dir

    (tmp_path / "afile").touch()
    with pytest.raises(ValueError) as caught:
        check_out_dir(tmp_path / "afile" / "out")
    assert str(caught.value) == f"--out {tmp_path}/afile/out: {tmp_path}/afile is a file, not a folder"
    with pytest.raises(ValueError, match=f"--out {tmp_path}/afile: a file, not a folder"):
        check_out_dir(tmp_path / "afile")
    assert check_out_dir(tmp_path / "new" / "out").is_dir()  # (made now, parents too)


def test_a_ctrl_c_before_the_benchmarks_own_handling_is_one_line(monkeypatch, capsys):
    from ringtrain import cli
    from ringtrain.bench import allreduce

    def stopped(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(allreduce, "run", stopped)
    assert cli.main(["bench", "allreduce", "--quick"]) == 130
    assert capsys.readouterr().err.strip() == "ringtrain bench allreduce: interrupted"
    from ringtrain.bench.procs import as_interrupt

    assert signal.getsignal(signal.SIGTERM) is not as_interrupt  # (restored after the command)
