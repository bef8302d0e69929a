"""The Horovod anchor of `ringtrain bench allreduce` and `ringtrain bench train`: when it is
skipped and what it says; the workers started without horovodrun (``bench.horovod``): the slot
plan and variables horovodrun would give them, the launch with its failures, deadline and Ctrl-C
(a stand-in interpreter plays Horovod's); the rows and the table of the train anchor. Then real
runs where .venv-horovod/bin/python (scripts/horovod/install.sh) or this interpreter imports
horovod.torch, under --net 1gbit where this is root; skipped otherwise."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import shutil
import sys
import time
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.bench import allreduce as bench_allreduce
from ringtrain.bench import horovod as bench_horovod
from ringtrain.bench import train as bench_train
from ringtrain.lifecycle import LAUNCHER_ENV

ROOT = Path(__file__).resolve().parents[1]
ALLREDUCE = ["bench", "allreduce", "--world-sizes", "2", "--sizes", "4K", "--algorithms", "ring",
             "--transports", "tcp", "--repeats", "1", "--no-mpi"]


def _horovod_python() -> str | None:
    for python in (sys.executable, str(ROOT / ".venv-horovod" / "bin" / "python")):
        if os.path.exists(python) and bench_horovod.horovod_missing(python) is None:
            return python
    return None


def _needs_horovod(net: str = "none") -> str:
    python = _horovod_python()
    if python is None:
        pytest.skip("no interpreter here imports horovod.torch (scripts/horovod/install.sh builds one into "
                    ".venv-horovod/)")
    if net != "none" and os.geteuid() != 0:
        pytest.skip("--net needs root (network namespaces)")
    return python


def _stand_in(tmp_path: Path, body: str) -> str:
    """An executable that takes any arguments and runs the shell ``body`` (in place of Horovod's
    interpreter); the rendezvous helper's call (``--rendezvous``) answers a port and waits."""
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n"
                      f'case "$*" in *--rendezvous*) echo $$ > "{tmp_path}/helper.pid"; echo "PORT 4321"; '
                      "exec sleep 60;; esac\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def _alive(pid: int) -> bool:
    from faults.harness import alive

    return alive(pid)


def _launched_by(pid: int) -> list[int]:
    """The live processes started for launcher ``pid`` (their environment names it), zombies aside."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{LAUNCHER_ENV}={pid}".encode() in environ and int(entry) != os.getpid() and _alive(int(entry)):
            found.append(int(entry))
    return found


def _assert_all_gone(pid: int) -> None:
    """Nothing this launcher started still runs, and no namespace of its networks is left."""
    deadline = time.monotonic() + 10
    while _launched_by(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _launched_by(pid)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes left: {left}"
    if os.geteuid() == 0:
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"ringtrain-{pid}-" not in namespaces, namespaces


# --- which interpreter, or why none ----------------------------------------------------------


@pytest.fixture
def ranks_and_horovod(monkeypatch):
    """The gloo/ringtrain launch answers at once; the Horovod launches are recorded, not run."""
    launched = []

    def launch(p, cfg, args, rows):
        rows += [{"impl": "gloo", "transport": "gloo", "algorithm": "torch.distributed", "world_size": p,
                  "nbytes": cfg["sizes"][0], "median_s": 1e-4, "busbw_GBps": 0.04, "net": args.net}]

    def launch_horovod(p, cfg, args, python, rows):
        launched.append((p, python, args.net))
        rows += [{"impl": "horovod", "transport": "gloo", "algorithm": "hvd.allreduce_", "world_size": p,
                  "nbytes": cfg["sizes"][0], "median_s": 2e-4, "busbw_GBps": 0.02, "net": args.net}]

    monkeypatch.setattr(bench_allreduce, "_launch", launch)
    monkeypatch.setattr(bench_allreduce, "_launch_horovod", launch_horovod)
    return launched


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, note", [
    (["--no-horovod"], "Horovod anchor skipped: --no-horovod"),
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
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('horovod') is not None)"
    if os.system(f"{python} -c \"{probe}\"") != 0:
        pytest.skip("this interpreter imports horovod")
    assert cli.main(ALLREDUCE + ["--horovod-python", str(python), "--out", "", "--json"]) == 0
    (note,) = [n for n in json.loads(capsys.readouterr().out)["notes"] if n.startswith("Horovod")]
    assert note == (f"Horovod anchor skipped: horovod.torch is not importable from {python} "
                    "(scripts/horovod/install.sh builds Horovod into .venv-horovod/; then "
                    "--horovod-python .venv-horovod/bin/python)")


@pytest.mark.parametrize("program", ["true", "echo"])
def test_a_program_that_is_not_python_is_said_so(program):
    # /bin/true exits 0 to anything: it was taken for a Python that imports horovod.torch, and the
    # anchor then failed after the whole run ("the rendezvous server exited with status 0").
    path = shutil.which(program)
    if path is None:
        pytest.skip(f"no {program} here")
    assert bench_horovod.horovod_missing(path) == f"--horovod-python {path}: not a Python interpreter (it did not " \
                                                  "run `python -c`)"
    assert bench_horovod.horovod_missing(sys.executable.replace("python", "no-such-python")).endswith(
        "no such interpreter")


def test_this_interpreter_without_horovod_is_skipped(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("horovod")
                        else real(name, *a))
    assert "horovod.torch is not importable from " + sys.executable in bench_horovod.horovod_missing(sys.executable)
    assert bench_horovod.anchor_python(False, None) == (None, "Horovod anchor skipped: " +
                                                        bench_horovod.horovod_missing(sys.executable))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("net", ["none", "1gbit"])
def test_an_importable_horovod_is_timed_after_each_world_size(net, tmp_path, ranks_and_horovod, capsys, monkeypatch):
    # under --net too (horovodrun could not start its ranks on the emulated hosts; bench.horovod can)
    monkeypatch.setattr(bench_horovod, "horovod_missing", lambda python: None)
    python = _stand_in(tmp_path, "exit 0")
    monkeypatch.chdir(tmp_path)  # given relative, run by its absolute path (the ranks start elsewhere)
    argv = ALLREDUCE[:3] + ["2,3"] + ALLREDUCE[4:] + ["--horovod-python", "./python", "--net", net, "--out", "",
                                                      "--json"]
    assert cli.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert ranks_and_horovod == [(2, python, net), (3, python, net)]
    assert [(r["impl"], r["world_size"]) for r in doc["rows"]] == [("gloo", 2), ("horovod", 2), ("gloo", 3),
                                                                   ("horovod", 3)]
    assert [r["net"] for r in doc["rows"]] == [net] * 4
    assert not any(n.startswith("Horovod") for n in doc["notes"]), doc["notes"]


# --- what horovodrun would give each worker --------------------------------------------------


def test_each_emulated_host_is_a_host_of_its_own_and_this_host_holds_every_rank_without_one():
    apart = bench_horovod.host_assignments(["h0", "h1", "h2"])
    assert [(s["hostname"], s["rank"], s["local_rank"], s["local_size"], s["cross_rank"], s["cross_size"], s["size"])
            for s in apart] == [("h0", 0, 0, 1, 0, 3, 3), ("h1", 1, 0, 1, 1, 3, 3), ("h2", 2, 0, 1, 2, 3, 3)]
    together = bench_horovod.host_assignments(["localhost"] * 3)
    assert [(s["rank"], s["local_rank"], s["local_size"], s["cross_rank"], s["cross_size"]) for s in together] == [
        (0, 0, 3, 0, 1), (1, 1, 3, 0, 1), (2, 2, 3, 0, 1)]
    with pytest.raises(ValueError, match="consecutive"):
        bench_horovod.host_assignments(["a", "b", "a"])


@pytest.mark.parametrize("hosts", [["h0", "h1"], ["localhost"] * 4, ["a", "a", "b", "c", "c", "c"]])
def test_the_slot_plan_is_horovodruns_own(hosts):
    try:
        from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    except ImportError:
        pytest.skip("horovod is not importable from this interpreter")
    counts = {h: hosts.count(h) for h in dict.fromkeys(hosts)}
    theirs = get_host_assignments([HostInfo(h, n) for h, n in counts.items()], len(hosts))
    assert bench_horovod.host_assignments(hosts) == [
        {k: getattr(s, k) for k in bench_horovod.SLOT_FIELDS} for s in theirs]


def test_the_worker_gets_horovodruns_variables():
    (slot, _) = bench_horovod.host_assignments(["ringtrain-1-0-h0", "ringtrain-1-0-h1"])
    assert bench_horovod.worker_env(slot, "10.213.0.1", 4321, "eth0") == {
        "HOROVOD_HOSTNAME": "ringtrain-1-0-h0", "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.213.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4321",
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "eth0"}


def test_a_failure_is_a_one_line_note_with_the_ranks_last_words():
    from ringtrain.bench.procs import RankFailed

    note = bench_horovod.failure_note(RankFailed("rank 1 exited with status 3:\nTraceback\n  x\nValueError: no\n\n"))
    assert note == "Horovod anchor failed: rank 1 exited with status 3: ValueError: no"
    assert bench_horovod.failure_note(RankFailed("ranks [0, 1] still running after 1s:\n")) == (
        "Horovod anchor failed: ranks [0, 1] still running after 1s")


def test_a_network_not_made_for_the_anchor_is_a_note(monkeypatch):
    # Before: the anchor's network failing (after the main launch's minutes) ended the whole run,
    # its rows lost, where a failing anchor is the run's note.
    from ringtrain.bench.netem import NetemUnavailable

    def emulated(rate, hosts):
        raise NetemUnavailable("`ip netns add ringtrain-7-1-sw` failed (exit 2): RTNETLINK answers: File exists")

    monkeypatch.setattr(bench_horovod, "emulated", emulated)
    note = bench_horovod.launch(sys.executable, ["bench", "allreduce", "--horovod-worker", "{}"], 2, rate="1gbit",
                                timeout=5, on_result=lambda doc: None)
    assert note == ("Horovod anchor failed: `ip netns add ringtrain-7-1-sw` failed (exit 2): RTNETLINK answers: "
                    "File exists")


# --- the launch, a stand-in playing Horovod's interpreter ------------------------------------


def _launch(python: str, timeout: float = 30, on_result=None) -> str | None:
    return bench_horovod.launch(python, ["bench", "allreduce", "--horovod-worker", "{}"], 2, rate="none",
                                timeout=timeout, on_result=on_result or (lambda doc: None))


@pytest.mark.timeout(60)
def test_the_launch_gives_each_rank_its_slot_and_the_rendezvous_then_ends_the_helper(tmp_path):
    row = {"impl": "horovod", "world_size": 2}
    python = _stand_in(tmp_path, f'env > "{tmp_path}/env.$RANK"\n'
                                 f"[ \"$RANK\" = 0 ] && echo 'RESULT {json.dumps({'rows': [row]})}'\nexit 0")
    docs = []
    assert _launch(python, on_result=docs.append) is None
    assert docs == [{"rows": [row]}]
    for rank in (0, 1):
        env = dict(line.split("=", 1) for line in (tmp_path / f"env.{rank}").read_text().splitlines() if "=" in line)
        assert {k: v for k, v in env.items() if k.startswith("HOROVOD_")} == bench_horovod.worker_env(
            bench_horovod.host_assignments(["localhost"] * 2)[rank], "127.0.0.1", 4321, "lo")
        # this copy of ringtrain first: the Horovod venv has none of its own
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(bench_horovod.__file__).resolve().parents[2])
        assert env[LAUNCHER_ENV] == str(os.getpid())
    assert not _alive(int((tmp_path / "helper.pid").read_text()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body, note", [
    ('[ "$RANK" = 1 ] && { echo "gloo: connection refused"; exit 3; }; exec sleep 30',
     "Horovod anchor failed: rank 1 exited with status 3: gloo: connection refused"),
    ("exec sleep 30", "Horovod anchor failed: ranks [0, 1] still running after 1s"),
])
def test_a_failing_or_late_launch_is_a_note_and_ends_everything(tmp_path, body, note):
    assert _launch(_stand_in(tmp_path, body), timeout=1) == note
    assert not _alive(int((tmp_path / "helper.pid").read_text()))
    _assert_all_gone(os.getpid())


@pytest.mark.timeout(60)
def test_a_rendezvous_that_does_not_start_is_a_note(tmp_path):
    script = tmp_path / "python"
    script.write_text('#!/bin/sh\necho "ModuleNotFoundError: No module named horovod.runner"; exit 1\n')
    script.chmod(0o755)
    assert _launch(str(script)) == ("Horovod anchor failed: the rendezvous server exited with status 1: "
                                    "ModuleNotFoundError: No module named horovod.runner")


@pytest.mark.timeout(60)
def test_ctrl_c_during_the_launch_ends_the_ranks_and_the_helper(tmp_path):
    # each rank writes its pid (whole, by a rename); rank 0 answers once both are there
    python = _stand_in(tmp_path, f'echo $$ > "{tmp_path}/pid.$RANK"; mv "{tmp_path}/pid.$RANK" "{tmp_path}/rank.$RANK"\n'
                                 f'if [ "$RANK" = 0 ]; then while [ ! -e "{tmp_path}/rank.1" ]; do sleep 0.05; done; '
                                 'echo "RESULT {}"; fi\nexec sleep 60')

    def interrupt(doc):  # where a Ctrl-C lands: in the launcher's wait, the ranks at work
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _launch(python, on_result=interrupt)
    for name in ("rank.0", "rank.1", "helper.pid"):
        assert not _alive(int((tmp_path / name).read_text())), name
    _assert_all_gone(os.getpid())


# --- bench train's anchor, without Horovod ---------------------------------------------------


def _train_row(impl, schedule, ms, **extra):
    return {"model": "mlp", "impl": impl, "schedule": schedule, "median_iter_s": ms / 1e3, "iter_s": [ms / 1e3],
            "samples_per_s": 64 / (ms / 1e3), "world_size": 2, "net": "1gbit", **extra}


HOROVOD_ROWS = [_train_row("horovod", "hvd.DistributedOptimizer (Horovod 0.28.1 defaults)", 990, launch="horovod",
                           horovod_over_ddp=0.99 / 0.9),
                _train_row("torch-ddp-horovod-launch", "torch defaults (25 MiB)", 900, launch="horovod")]


@pytest.fixture
def train_launches(monkeypatch):
    """The ring job answers one model's rows; the Horovod launch is recorded and answers its two."""
    launched = []

    def launch(module, module_args, nprocs, args, on_result=None):
        on_result({"rows": [_train_row("ringtrain", "optimal", 800), _train_row("torch-ddp", "torch defaults", 920)]})
        return []

    def launch_horovod(python, module_args, p, *, rate, timeout, on_result):
        launched.append((python, module_args[:3], json.loads(module_args[3]), p, rate))
        on_result({"rows": [{k: v for k, v in r.items() if k not in ("net", "world_size")} for r in HOROVOD_ROWS]})
        return None

    monkeypatch.setattr(bench_train, "_launch", launch)
    monkeypatch.setattr(bench_train, "launch_horovod", launch_horovod)
    return launched


TRAIN = ["bench", "train", "--models", "mlp", "--schedules", "optimal", "--world-size", "2", "--steps", "2",
         "--rounds", "1", "--net", "1gbit", "--out", "", "--json"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, note", [
    (["--no-horovod"], "Horovod anchor skipped: --no-horovod"),
    (["--horovod-python", "/nonexistent/python"],
     "Horovod anchor skipped: --horovod-python /nonexistent/python: no such interpreter"),
])
def test_bench_train_says_why_it_skips_horovod(extra, note, train_launches, capsys):
    assert cli.main(TRAIN + extra) == 0
    doc = json.loads(capsys.readouterr().out)
    assert note in doc["notes"] and train_launches == []
    assert [r["impl"] for r in doc["rows"]] == ["ringtrain", "torch-ddp"]


@pytest.mark.timeout(60)
def test_bench_train_runs_horovods_launch_after_the_ring_job_on_the_same_settings(tmp_path, train_launches, capsys,
                                                                                   monkeypatch):
    monkeypatch.setattr(bench_horovod, "horovod_missing", lambda python: None)
    python = _stand_in(tmp_path, "exit 0")
    assert cli.main(TRAIN + ["--horovod-python", python]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert train_launches == [(python, ["bench", "train", "--horovod-worker"],
                               {"models": ["mlp"], "batch_size": 0, "steps": 2, "rounds": 1}, 2, "1gbit")]
    assert [r["impl"] for r in doc["rows"]] == ["ringtrain", "torch-ddp", "horovod", "torch-ddp-horovod-launch"]
    assert all(r["net"] == "1gbit" and r["world_size"] == 2 for r in doc["rows"])
    assert not any(n.startswith("Horovod") for n in doc["notes"]), doc["notes"]


def test_the_table_sets_each_launchs_rows_against_its_own_ddp():
    rows = [_train_row("ringtrain", "optimal", 800), _train_row("torch-ddp", "torch defaults", 920)] + HOROVOD_ROWS
    lines = bench_train.format_table(rows).splitlines()
    hvd = next(line for line in lines if line.startswith("horovod "))
    ddp = next(line for line in lines if line.startswith("torch-ddp (horovod launch) "))
    assert "0.91x" in hvd.split() and "1.00x" in ddp.split()  # (900/990 against its own launch's DDP)
    assert lines[-1] == "iteration / torch DDP beside it: optimal 0.87 (main launch), horovod 1.10 (its own launch)"
    assert bench_train.horovod_line(rows[:2]) is None


def test_the_summary_states_optimal_and_horovod_against_their_ddp():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_summary", ROOT / "scripts" / "bench_summary.py")
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    rows = [_train_row("ringtrain", "optimal", 800), _train_row("torch-ddp", "torch defaults", 920)] + HOROVOD_ROWS
    assert summary.horovod_lines(rows) == [
        "- mlp: Horovod 990 ms, torch DDP 900 ms in Horovod's launch (Horovod / DDP 1.10); optimal 800 ms, "
        "torch DDP 920 ms in the main launch (optimal / DDP 0.87)", ""]
    assert summary.horovod_lines(rows[:2]) == []


@pytest.mark.timeout(60)
def test_horovods_copies_are_checked_against_ddps():
    import torch
    import torch.distributed as dist

    from ringtrain import models

    base = models.build("mlp", seed=0)
    ddp = models.build("mlp", seed=0)
    with torch.no_grad():
        for q in ddp.parameters():
            q.add_(0.01)  # training moved DDP's copy
    close = models.build("mlp", seed=0)
    with torch.no_grad():
        for q, d in zip(close.parameters(), ddp.parameters()):
            q.copy_(d + 1e-7)  # rounding
    summed = models.build("mlp", seed=0)
    with torch.no_grad():
        for q in summed.parameters():
            q.add_(0.02)  # twice the step: a gradient summed instead of averaged
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        bench_train.check_horovod("mlp", base, close, ddp)
        with pytest.raises(RuntimeError, match="Horovod's copy of mlp ended .* from torch DDP's after the same steps"):
            bench_train.check_horovod("mlp", base, summed, ddp)
    finally:
        dist.destroy_process_group()


# --- real runs -------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_horovod_allreduce_on_two_ranks_is_timed_and_exact():
    python = _needs_horovod()
    args = __import__("argparse").Namespace(net="none", timeout=240)
    rows = []
    note = bench_allreduce._launch_horovod(2, {"sizes": [4096, 1 << 20], "repeats": 2}, args, python, rows)
    assert note is None
    # (each worker checked its sum exactly before timing it: a wrong one is a failed launch)
    assert [(r["impl"], r["world_size"], r["nbytes"], len(r["times_s"]), r["net"]) for r in rows] == [
        ("horovod", 2, 4096, 2, "none"), ("horovod", 2, 1 << 20, 2, "none")]
    assert all(r["median_s"] > 0 for r in rows)
    _assert_all_gone(os.getpid())


@pytest.mark.timeout(300)
def test_bench_allreduce_times_horovod_on_the_emulated_network(capsys):
    python = _needs_horovod("1gbit")
    assert cli.main(ALLREDUCE[:5] + ["4K,1M"] + ALLREDUCE[6:] + ["--net", "1gbit", "--horovod-python", python,
                                                                "--out", "", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    horovod = [r for r in doc["rows"] if r["impl"] == "horovod"]
    assert [(r["world_size"], r["nbytes"], r["net"]) for r in horovod] == [(2, 4096, "1gbit"), (2, 1 << 20, "1gbit")]
    assert all(r["median_s"] > 0 and r["busbw_GBps"] > 0 for r in horovod)
    # at 1 Gbit/s 1 MiB cannot go faster than the line allows (the tbf burst is 128 KiB)
    assert next(r for r in horovod if r["nbytes"] == 1 << 20)["busbw_GBps"] < 0.125
    assert not any(n.startswith("Horovod") for n in doc["notes"]), doc["notes"]
    _assert_all_gone(os.getpid())


@pytest.mark.timeout(600)
def test_bench_train_times_horovod_beside_torch_ddp_on_the_emulated_network(capsys):
    python = _needs_horovod("1gbit")
    assert cli.main(["bench", "train", "--net", "1gbit", "--models", "mlp", "--steps", "2", "--rounds", "1",
                     "--schedules", "optimal", "--horovod-python", python, "--out", "", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["impl"]: r for r in doc["rows"]}
    assert {"ringtrain", "torch-ddp", "horovod", "torch-ddp-horovod-launch"} <= set(rows), list(rows)
    for impl in ("horovod", "torch-ddp-horovod-launch"):
        r = rows[impl]
        assert r["launch"] == "horovod" and r["net"] == "1gbit" and r["world_size"] == 2
        assert len(r["iter_s"]) == 2 and r["median_iter_s"] > 0 and r["samples_per_s"] > 0
    assert rows["horovod"]["horovod_over_ddp"] == pytest.approx(
        rows["horovod"]["median_iter_s"] / rows["torch-ddp-horovod-launch"]["median_iter_s"])
    assert not any(n.startswith("Horovod") for n in doc["notes"]), doc["notes"]
    _assert_all_gone(os.getpid())


def _horovod_rank(launcher: int, rank: int) -> int | None:
    for pid in _launched_by(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"HOROVOD_RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["ctrl-c", "kill -9 rank 1"])
def test_ctrl_c_or_a_killed_worker_ends_every_process_and_namespace(how):
    python = _needs_horovod("1gbit")
    cfg = {"sizes": [4096, 64 << 20], "repeats": 50}  # (the second size lasts long after the first is sent)

    def stop(doc):  # once rank 0 has sent its first size: the workers are at work
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(_horovod_rank(os.getpid(), 1), signal.SIGKILL)

    args = ["bench", "allreduce", "--horovod-worker", json.dumps(cfg)]
    if how == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            bench_horovod.launch(python, args, 2, rate="1gbit", timeout=240, on_result=stop)
    else:
        note = bench_horovod.launch(python, args, 2, rate="1gbit", timeout=240, on_result=stop)
        assert note is not None and note.startswith("Horovod anchor failed: rank 1 was killed by SIGKILL"), note
    _assert_all_gone(os.getpid())
