"""The Horovod anchor of `ringtrain bench allreduce`: when it is skipped and what it says, the
launcher's command, reading its output, its failures and deadline (a stand-in interpreter plays
horovodrun), and one real run on 2 ranks where an interpreter imports horovod.torch (this one,
or .venv-horovod/bin/python, which scripts/horovod/install.sh builds); skipped otherwise."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.bench import allreduce as bench_allreduce

ROOT = Path(__file__).resolve().parents[1]
ALLREDUCE = ["bench", "allreduce", "--world-sizes", "2", "--sizes", "4K", "--algorithms", "ring",
             "--transports", "tcp", "--repeats", "1", "--no-mpi"]


def _horovod_python() -> str | None:
    for python in (sys.executable, str(ROOT / ".venv-horovod" / "bin" / "python")):
        if os.path.exists(python) and bench_allreduce.horovod_missing(python) is None:
            return python
    return None


def _stand_in(tmp_path: Path, body: str) -> str:
    """An executable that takes any arguments and runs the shell ``body`` (in place of horovodrun)."""
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.fixture
def ranks_and_horovod(monkeypatch):
    """The gloo/ringtrain launch answers at once; the Horovod launches are recorded, not run."""
    launched = []

    def launch(p, cfg, args, rows):
        rows += [{"impl": "gloo", "transport": "gloo", "algorithm": "torch.distributed", "world_size": p,
                  "nbytes": cfg["sizes"][0], "median_s": 1e-4, "busbw_GBps": 0.04, "net": args.net}]

    def launch_horovod(p, cfg, timeout, python):
        launched.append((p, python))
        return [{"impl": "horovod", "transport": "gloo", "algorithm": "hvd.allreduce_", "world_size": p,
                 "nbytes": cfg["sizes"][0], "median_s": 2e-4, "busbw_GBps": 0.02}], None

    monkeypatch.setattr(bench_allreduce, "_launch", launch)
    monkeypatch.setattr(bench_allreduce, "_launch_horovod", launch_horovod)
    return launched


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, note", [
    (["--no-horovod"], "Horovod anchor skipped: --no-horovod"),
    (["--net", "1gbit"], "Horovod anchor skipped: under --net 1gbit horovodrun would not start its ranks on the "
                         "emulated hosts"),
    (["--horovod-python", "/nonexistent/python"],
     "Horovod anchor skipped: --horovod-python /nonexistent/python: no such interpreter"),
])
def test_the_skipped_horovod_anchor_says_why(extra, note, ranks_and_horovod, capsys):
    assert cli.main(ALLREDUCE + extra + ["--out", "", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert note in doc["notes"] and ranks_and_horovod == []
    assert {r["impl"] for r in doc["rows"]} == {"gloo"}


@pytest.mark.timeout(60)
def test_an_interpreter_without_horovod_is_skipped_with_how_to_build_it(tmp_path, ranks_and_horovod, capsys):
    # this interpreter, but through another path: the child-process probe answers, not find_spec here
    python = _stand_in(tmp_path, f'exec {sys.executable} "$@"')
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('horovod') is not None)"
    if os.system(f"{python} -c \"{probe}\"") != 0:
        pytest.skip("this interpreter imports horovod")
    assert cli.main(ALLREDUCE + ["--horovod-python", python, "--out", "", "--json"]) == 0
    (note,) = [n for n in json.loads(capsys.readouterr().out)["notes"] if n.startswith("Horovod")]
    assert note == (f"Horovod anchor skipped: horovod.torch is not importable from {python} "
                    "(scripts/horovod/install.sh builds Horovod into .venv-horovod/; then "
                    "--horovod-python .venv-horovod/bin/python)")


def test_this_interpreter_without_horovod_is_skipped(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("horovod")
                        else real(name, *a))
    assert "horovod.torch is not importable from " + sys.executable in bench_allreduce.horovod_missing(sys.executable)


@pytest.mark.timeout(60)
def test_an_importable_horovod_is_timed_after_each_world_size(tmp_path, ranks_and_horovod, capsys, monkeypatch):
    monkeypatch.setattr(bench_allreduce, "horovod_missing", lambda python: None)
    python = _stand_in(tmp_path, "exit 0")
    monkeypatch.chdir(tmp_path)  # given relative, run by its absolute path (horovodrun's shell starts elsewhere)
    argv = ALLREDUCE[:3] + ["2,3"] + ALLREDUCE[4:] + ["--horovod-python", "./python", "--out", "", "--json"]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert ranks_and_horovod == [(2, python), (3, python)]
    assert [(r["impl"], r["world_size"]) for r in doc["rows"]] == [("gloo", 2), ("horovod", 2), ("gloo", 3),
                                                                   ("horovod", 3)]
    assert [r["net"] for r in doc["rows"]] == ["none"] * 4
    assert not any(n.startswith("Horovod") for n in doc["notes"]), doc["notes"]


def test_the_command_is_horovodrun_over_gloo_on_this_host_under_the_same_interpreter():
    cfg = {"sizes": [4096], "repeats": 1}
    cmd = bench_allreduce.horovod_command("/v/bin/python", 3, cfg)
    assert cmd[:8] == ["/v/bin/python", "-m", "horovod.runner.launch", "-np", "3", "-H", "localhost:3", "--gloo"]
    assert cmd[8:-1] == ["/v/bin/python", "-m", "ringtrain.cli", "bench", "allreduce", "--horovod-worker"]
    assert json.loads(cmd[-1]) == cfg


def test_result_documents_are_read_from_horovodruns_prefixed_lines():
    out = ('[1]<stderr>:warning\n[0]<stdout>:RESULT {"rows": [1]}\nRESULT {"rows": [2]}\n'
           '[0]<stdout>:PROGRESS x\n')
    assert bench_allreduce.result_docs(out) == [{"rows": [1]}, {"rows": [2]}]
    assert bench_allreduce.result_docs("") == []


@pytest.mark.timeout(60)
def test_the_launch_returns_rank_0s_rows_and_sees_this_ringtrain(tmp_path):
    # the stand-in prints, as horovodrun would, rank 0's line; and where it found ringtrain
    row = {"impl": "horovod", "world_size": 2}
    python = _stand_in(tmp_path, f"echo '[0]<stdout>:RESULT {json.dumps({'rows': [row]})}'\n"
                                 'echo "$PYTHONPATH" > "$(dirname "$0")/path"')
    rows, note = bench_allreduce._launch_horovod(2, {}, 30, python)
    assert (rows, note) == ([row], None)
    src = str(Path(bench_allreduce.__file__).resolve().parents[2])
    assert (tmp_path / "path").read_text().strip().split(os.pathsep)[0] == src


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body, note", [
    ("echo 'gloo: connection refused' >&2; exit 3", "Horovod anchor failed (status 3): gloo: connection refused"),
    ("exit 0", "Horovod anchor failed (status 0): "),
    ("sleep 30", "Horovod anchor timed out after 1s"),
])
def test_a_failing_or_late_launch_is_a_note(tmp_path, body, note):
    rows, got = bench_allreduce._launch_horovod(2, {}, 1, _stand_in(tmp_path, body))
    assert rows == [] and got == note


@pytest.mark.timeout(60)
def test_ctrl_c_during_the_launch_ends_its_session(tmp_path):
    """horovodrun runs in a session of its own, which the terminal's Ctrl-C does not reach: the
    KeyboardInterrupt in this process must end it (a "rank" of the stand-in, in its session)."""
    import signal
    import time

    from faults.harness import alive

    pid_file = tmp_path / "rank.pid"
    python = _stand_in(tmp_path, f'sleep 60 & echo $! > "{pid_file}"; wait')

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(KeyboardInterrupt):
            bench_allreduce._launch_horovod(2, {}, 30, python)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    rank = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while alive(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(rank), "the stand-in's rank outlived the Ctrl-C"


@pytest.mark.timeout(300)
def test_horovod_allreduce_on_two_ranks_is_timed_and_exact():
    python = _horovod_python()
    if python is None:
        pytest.skip("no interpreter here imports horovod.torch (scripts/horovod/install.sh builds one into "
                    ".venv-horovod/)")
    rows, note = bench_allreduce._launch_horovod(2, {"sizes": [4096, 1 << 20], "repeats": 2}, 240, python)
    assert note is None
    # (each worker checked its sum exactly before timing it: a wrong one is a failed launch)
    assert [(r["impl"], r["world_size"], r["nbytes"], len(r["times_s"])) for r in rows] == [
        ("horovod", 2, 4096, 2), ("horovod", 2, 1 << 20, 2)]
    assert all(r["median_s"] > 0 for r in rows)
