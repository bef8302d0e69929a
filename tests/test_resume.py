"""Exact resume: `ringtrain train` killed at a random step and run again ends bitwise equal.

Two runs of ``ringtrain train --workers 2 --model charlm --steps 24 --checkpoint-every 4``
start side by side in directories of their own: the *reference* runs to the end; the
*victim* is killed with SIGKILL — its launcher's process group and every worker process —
at a random moment after its second or third checkpoint, then run again with the same
command, which resumes from its newest valid checkpoint. The final checkpoints' model and
optimizer tensors must be bitwise equal: with 2 workers each gradient element is the sum of
two floats, which does not depend on the order, so nothing but a wrong resume (data order,
RNG state, optimizer state) can make them differ. With ``--compression powersgd`` (one bucket)
every worker's PowerSGD state must be bitwise equal too: it is in rank 0's checkpoint, written
with the rest at once, so no kill leaves a checkpoint with another step's or a partial one.

The random draw is printed (and shown on failure) so that a failing moment can be replayed
with ``RINGTRAIN_RESUME_SEED``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

STEPS, EVERY = 24, 4
#: PowerSGD on one bucket, whose layout depends on nothing measured (test_powersgd_run_stopped_...).
POWER_SGD = ("--compression", "powersgd", "--schedule", "single")


def command(directory: Path, steps: int = STEPS, *more: str) -> list[str]:
    return [sys.executable, "-m", "ringtrain.cli", "train", "--workers", "2", "--model", "charlm",
            "--batch-size", "4", "--steps", str(steps), "--checkpoint-every", str(EVERY),
            "--checkpoint-dir", str(directory), "--no-progress", "--timeout", "30", *more]


def start(directory: Path, steps: int = STEPS, *more: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(command(directory, steps, *more), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


def finish(proc: subprocess.Popen, timeout: float = 90.0) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc, job_pids(proc.pid))
        raise
    assert proc.returncode == 0, out[-3000:]
    return out


def job_pids(launcher: int) -> set[int]:
    from faults.harness import descendants

    return {launcher} | descendants(launcher)


def kill_job(proc: subprocess.Popen, pids: set[int]) -> None:
    """SIGKILL the launcher's process group, then any process of the job outside it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=10)


def end_job(proc: subprocess.Popen, pids: set[int]) -> None:
    """A test's last word on its job: kill the launcher's group if it still runs, then every
    process of the job seen earlier that outlived it."""
    from faults.harness import alive

    if proc.poll() is None:
        kill_job(proc, job_pids(proc.pid))
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def checkpoints(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("ckpt-*.pt")) if directory.is_dir() else []


def final_tensors(directory: Path) -> dict:
    from ringtrain import checkpoint

    found = checkpoint.latest(directory)
    assert found is not None and found.step == STEPS, checkpoints(directory)
    return found.payload


# (momentum buffers; Adam's moments and step count; each worker's PowerSGD error feedback and warm start)
@pytest.mark.parametrize("optimizer, more", [("sgd", ()), ("adamw", ()), ("sgd", POWER_SGD)],
                         ids=["sgd", "adamw", "sgd-powersgd"])
def test_killed_and_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(tmp_path, optimizer, more):
    import torch

    seed = int(os.environ.get("RINGTRAIN_RESUME_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    # Kill 0 to 1.5 checkpoint periods after checkpoint 2 or 3 (of 6): somewhere in steps 8..18
    # whatever the machine's speed, since the period is measured on the run itself.
    wait_for, fraction = rng.choice([2, 3]), rng.uniform(0.0, 1.5)
    why = f"RINGTRAIN_RESUME_SEED={seed}: kill {fraction:.2f} checkpoint periods after checkpoint {wait_for}"

    ref_dir, victim_dir = tmp_path / "reference", tmp_path / "victim"
    flags = ("--optimizer", optimizer, *more)
    reference = start(ref_dir, STEPS, *flags)
    victim = start(victim_dir, STEPS, *flags)
    try:
        seen_at = {}
        deadline = time.monotonic() + 60
        while len(checkpoints(victim_dir)) < wait_for:
            assert victim.poll() is None, f"{why}: the run ended before the kill\n{victim.communicate()[0][-3000:]}"
            assert time.monotonic() < deadline, f"{why}: no checkpoint {wait_for} within 60 s"
            seen_at.setdefault(len(checkpoints(victim_dir)), time.monotonic())
            time.sleep(0.01)
        period = time.monotonic() - seen_at.get(wait_for - 1, seen_at.get(0, deadline - 60))
        time.sleep(fraction * period)
        pids = job_pids(victim.pid)
        kill_job(victim, pids)
        killed_at = checkpoints(victim_dir)
        assert f"ckpt-{STEPS:09d}.pt" not in killed_at, f"{why}: the run finished before the kill"
        resumed = start(victim_dir, STEPS, *flags)
        out = finish(resumed)
        assert "resumed from" in out and f"to step {STEPS}" in out, out[-3000:]
        assert not more or "resumed PowerSGD's state of step" in out, out[-3000:]
        finish(reference)
    finally:
        for proc in (reference, victim):
            if proc.poll() is None:
                kill_job(proc, job_pids(proc.pid))

    want, got = final_tensors(ref_dir), final_tensors(victim_dir)
    for part in ("model", "optimizer") + (("power_sgd",) if more else ()):
        a, b = flatten(want[part]), flatten(got[part])
        assert a.keys() == b.keys(), part
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), f"{why}: {part} {key} differs after the resume"
            else:
                assert a[key] == b[key], f"{why}: {part} {key} differs after the resume"
    assert flatten(want["data"]) == flatten(got["data"])
    print(f"{why} ({period:.2f} s): checkpoints at the kill {killed_at}; resumed run bitwise equal "
          f"({len(flatten(want['model']))} model tensors, optimizer state{', PowerSGD state' if more else ''} and data "
          "position)")


def flatten(obj, prefix: str = "") -> dict:
    """Nested dicts and lists as one ``{path: leaf}`` dict."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {prefix: obj}
    out = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}/{k}"))
    return out


def test_killing_the_launchers_process_group_leaves_no_worker_behind(tmp_path):
    """`kill -9 -<pgid>` of `ringtrain train` (what a shell's job control or a scheduler does)
    must not leave workers running: orphans would keep training and writing checkpoints."""
    from faults.harness import alive

    proc = start(tmp_path / "run", steps=400)  # would train for far longer than the 3 s watched
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while not checkpoints(tmp_path / "run"):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint within 60 s"
            time.sleep(0.02)
        pids = job_pids(proc.pid)
        assert len(pids) >= 3, f"expected the launcher and 2 workers, found {sorted(pids)}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        at_kill = checkpoints(tmp_path / "run")
        time.sleep(3.0)
        orphans = sorted(pid for pid in pids if alive(pid))
        after = checkpoints(tmp_path / "run")
    finally:
        end_job(proc, pids)
    assert not orphans and after == at_kill, (
        f"workers {orphans} still running 3 s after their launcher's group was killed; "
        f"checkpoints written since: {sorted(set(after) - set(at_kill))}")
    print(f"launcher's group killed: {len(pids)} processes of the job, none left 3 s later")


def ps_command(directory: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "ringtrain.cli", "train", "--workers", "2", "--strategy", "ps-sync",
            "--model", "charlm", "--batch-size", "4", "--steps", str(steps), "--checkpoint-every", "4",
            "--checkpoint-dir", str(directory), "--no-progress", "--timeout", "30"]


def run_to_end(argv: list[str]) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    return finish(proc, timeout=150)


@pytest.mark.timeout(300)
def test_ps_resume_takes_the_servers_step_when_the_workers_checkpoint_of_it_is_missing(tmp_path):
    """Servers saved step 8, rank 0's own file of step 8 is gone (killed between the two saves):
    the run goes on from step 8 with the data of step 8, and ends where an uninterrupted run does.
    10 steps with checkpoints every 4 also save the last step, so the same command has nothing left."""
    from ringtrain import checkpoint

    ref, victim = tmp_path / "ref", tmp_path / "victim"
    run_to_end(ps_command(ref, 10))
    run_to_end(ps_command(victim, 8))
    (victim / "ckpt-000000008.pt").unlink()
    assert checkpoints(victim) == ["ckpt-000000004.pt"]
    out = run_to_end(ps_command(victim, 10))
    assert "resumed at step 8 from the parameter servers" in out, out[-2000:]
    assert checkpoints(ref)[-1] == checkpoints(victim)[-1] == "ckpt-000000010.pt"
    a, b = (checkpoint.latest(d / "servers" / "server-0").payload for d in (ref, victim))
    assert a["version"] == b["version"] == 10
    assert a["params"].equal(b["params"]) and a["momentum"].equal(b["momentum"])
    again = run_to_end(ps_command(victim, 10))
    assert "nothing to do: the checkpoint is already at step 10" in again, again[-2000:]


@pytest.mark.timeout(300)
def test_ps_resume_with_another_lr_says_so_as_the_ring_does(tmp_path):
    """The servers take the new --lr (docs/ps.md); the ring named the change, the servers' job did not."""
    run_to_end(ps_command(tmp_path, 4))
    out = run_to_end(ps_command(tmp_path, 8) + ["--lr", "0.01"])
    assert "resumed at step 4 (parameter servers and" in out, out[-2000:]
    assert "learning rate 0.01 (the checkpoint was made with 0.05)" in out, out[-2000:]


@pytest.mark.timeout(300)
def test_ps_resume_on_another_number_of_servers_ends_where_an_uninterrupted_run_does(tmp_path):
    """4 steps on one server (ps-sync), then the same directory on two (ps-sharded --servers 2) to
    step 8: the servers cut the saved shard in two, and their shards of step 8, values and momentum,
    are bitwise those of a run on two servers from the start."""
    from ringtrain import checkpoint

    def sharded(directory: Path, steps: int) -> list[str]:
        argv = ps_command(directory, steps)
        argv[argv.index("ps-sync")] = "ps-sharded"
        return argv + ["--servers", "2"]

    ref, victim = tmp_path / "ref", tmp_path / "victim"
    run_to_end(sharded(ref, 8))
    run_to_end(ps_command(victim, 4))
    assert sorted(p.name for p in (victim / "servers").iterdir()) == ["server-0"]
    out = run_to_end(sharded(victim, 8))
    assert "resumed at step 4 (parameter servers and" in out, out[-2000:]
    for k in range(2):
        a, b = (checkpoint.load(d / "servers" / f"server-{k}" / checkpoint.checkpoint_name(8)).payload
                for d in (ref, victim))
        assert a["version"] == b["version"] == 8 and a["servers"] == b["servers"] == 2
        assert a["params"].equal(b["params"]) and a["momentum"].equal(b["momentum"]), f"server {k}'s shard differs"


def one_worker_command(directory: Path, steps: int, *more: str) -> list[str]:
    return [sys.executable, "-m", "ringtrain.cli", "train", "--workers", "1", "--model", "charlm", "--batch-size", "4",
            "--steps", str(steps), "--checkpoint-every", "2", "--checkpoint-dir", str(directory), "--no-progress",
            "--timeout", "30", *more]


@pytest.mark.timeout(300)
def test_a_run_after_no_resume_continues_the_fresh_run_not_the_old_ones_later_steps(tmp_path):
    """--no-resume in a directory of later checkpoints moves them aside: the next plain run resumes
    the fresh run's step 2, not the old run's step 4, and the old files are kept."""
    run_to_end(one_worker_command(tmp_path, 4))
    assert checkpoints(tmp_path) == ["ckpt-000000002.pt", "ckpt-000000004.pt"]
    out = run_to_end(one_worker_command(tmp_path, 2, "--no-resume"))
    (aside,) = tmp_path.glob("superseded-*")
    assert f"moved the checkpoints of steps [2, 4] in {tmp_path} to {aside}" in out, out[-2000:]
    assert checkpoints(aside) == ["ckpt-000000002.pt", "ckpt-000000004.pt"]
    assert checkpoints(tmp_path) == ["ckpt-000000002.pt"]
    out = run_to_end(one_worker_command(tmp_path, 3))
    assert f"resumed from {tmp_path / 'ckpt-000000002.pt'} at step 2" in out, out[-2000:]


@pytest.mark.parametrize("strategy", ["ring", "ps-sync"])
def test_ctrl_c_ends_the_run_in_one_line_with_status_130_and_leaves_no_process(tmp_path, strategy):
    """SIGINT to the launcher's process group (what Ctrl-C in a terminal does; torch's launcher
    passes it on to the ranks, which run in sessions of their own): no traceback, one line that
    says where the run was and where the same command resumes, exit status 130, no rank left."""
    import re

    from faults.harness import alive

    argv = command(tmp_path / "run", steps=100_000) + ["--strategy", strategy]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while not checkpoints(tmp_path / "run"):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 60 s"
            time.sleep(0.05)
        pids = job_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=45)
        left = sorted(pid for pid in pids - {proc.pid} if alive(pid))
    finally:
        end_job(proc, pids)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not re.match(r"[IWE]\d{4} ", line)]
    assert len(lines) == 1, err[-3000:]  # (torch's log lines: its OMP_NUM_THREADS banner)
    said = re.fullmatch(r"ringtrain train: interrupted at step (\d+); run the same command again to resume from "
                        r"step (\d+) \(the last checkpoint\)", lines[0])
    assert said, lines
    newest = int(checkpoints(tmp_path / "run")[-1][5:14])
    assert int(said[2]) == newest <= int(said[1]), (lines, checkpoints(tmp_path / "run"))
    assert "death signal" not in err and "closing signal" not in err, err[-3000:]
    assert proc.returncode == 130, err[-3000:]
    assert not left, f"processes {left} of the job still running after it ended"



@pytest.mark.timeout(200)
def test_powersgd_run_stopped_and_resumed_is_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    """--compression powersgd: 16 steps at once against 8, stopped, then the same command to 16. The
    resumed run goes on with each worker's error feedback, the warm-start matrices, the iteration
    count and PowerSGD's generator as they were at step 8, so parameters, optimizer state and the
    PowerSGD state of step 16 are bitwise equal. --schedule single: its layout (one bucket, rank 0's
    observed backward order) depends on nothing measured, and the resumed wrapper lays it out from
    its first step (comm_hook_layout); the optimal schedule's plan depends on timings, so two of its
    uninterrupted runs differ already (PowerSGD's matrices are drawn per bucket)."""
    import torch

    from ringtrain import checkpoint

    ref, resumed = tmp_path / "reference", tmp_path / "resumed"
    reference = start(ref, 16, *POWER_SGD)
    try:
        finish(start(resumed, 8, *POWER_SGD))
        out = finish(start(resumed, 16, *POWER_SGD))
        finish(reference)
    finally:
        end_job(reference, set())
    assert "resumed from" in out and "resumed PowerSGD's state of step 8 (iteration 8;" in out, out[-3000:]
    want, got = (checkpoint.latest(d).payload for d in (ref, resumed))
    assert want["step"] == got["step"] == 16
    for part in ("model", "optimizer", "power_sgd"):
        a, b = flatten(want[part]), flatten(got[part])
        assert a.keys() == b.keys(), part
        for key in a:
            same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
            assert same, f"{part} {key} differs after the resume"
    assert want["power_sgd"]["world_size"] == 2 and want["power_sgd"]["iter"] == 16
    errors = [want["power_sgd"]["ranks"][r][0]["error"] for r in range(2)]
    assert not torch.equal(errors[0], errors[1])  # (each worker's own: the test would miss a rank's state lost)


@pytest.mark.timeout(200)
def test_powersgd_resume_of_another_job_begins_anew_and_says_why(tmp_path):
    """A checkpoint without PowerSGD state (a run without --compression powersgd), then one of 2
    workers resumed on 1 (the same global batch): each resume trains on, PowerSGD begun anew with
    a line that says why; a run without --compression powersgd says it leaves the state unused."""
    run_to_end(command(tmp_path, 4))
    out = run_to_end(command(tmp_path, 8, *POWER_SGD))
    assert "note: PowerSGD begins anew: the checkpoint holds no PowerSGD state (it was made by a run without " \
           "--compression powersgd" in out, out[-3000:]
    one = command(tmp_path, 12, *POWER_SGD)
    one[one.index("--workers") + 1], one[one.index("--batch-size") + 1] = "1", "8"
    out = run_to_end(one)
    assert "note: PowerSGD begins anew: the checkpoint's PowerSGD state is of 2 workers and this run has 1 " \
           "(each worker's error feedback is its own)" in out, out[-3000:]
    assert "to step 12" in out, out[-3000:]
    out = run_to_end(command(tmp_path, 14))  # (the 1-worker run's state: one worker's, saved all the same)
    assert "note: the checkpoint's PowerSGD state goes unused: this run's gradients are sent with --compression " \
           "none" in out, out[-3000:]
