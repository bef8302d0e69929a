"""The end-of-run summary of `ringtrain train`: its communication line describes the plan in force.

The wrapper times backward for a few steps, then (schedule "optimal", several workers) runs a
trial of candidate plans (probes of 3, 24 or 96 groups, one allreduce after backward, ...) before
one settles. Hidden share and allreduces per step are medians over the steps run under the plan
in force at the end only; a run that ended during the profiling steps or the trial says so
instead of printing the figures of whatever candidate happened to run last. A --timeline run
that ended before the plan settled says, in one line, that it traced no step.

The formatting tests feed the summary functions a stand-in wrapper; the two end-to-end tests run
`ringtrain train` on 2 workers for a few steps.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ringtrain import train

pytestmark = pytest.mark.timeout(120)


def stats(hidden: float, buckets: int) -> SimpleNamespace:
    """An IterationStats of the fields the summary reads."""
    return SimpleNamespace(hidden_fraction=hidden, comm_s=0.01, exposed_s=0.0, backward_s=0.1, measured_end_s=0.1,
                           buckets=buckets, predicted_end_s=0.1)


def wrapper(plan, settled: bool, kept: str = "plan", iteration: int = 40, trial=()) -> SimpleNamespace:
    return SimpleNamespace(plan=plan, settled=settled, fell_back=kept == "single", kept=kept, iteration=iteration,
                           options=SimpleNamespace(warmup_iterations=1, profile_iterations=2), trial=list(trial))


def summary_text(communication: dict, steps_run: int, schedule: str = "optimal") -> str:
    return train._communication_text({"communication": communication, "steps_run": steps_run, "schedule": schedule})


def test_hidden_share_and_allreduces_count_only_the_steps_under_the_plan_in_force():
    trial_plan, single = SimpleNamespace(method="custom"), SimpleNamespace(method="single")
    # 3 profiling steps, 5 trial steps of a 24-group probe that hid 90%, then 4 steps of the single allreduce kept
    ran = ([(single, False, stats(1.0, 1))] * 3 + [(trial_plan, False, stats(0.9, 24))] * 5
           + [(single, False, stats(0.8, 1))] * 2  # the single allreduce as a trial candidate
           + [(single, True, stats(0.0, 1))] * 4)
    comm = train._communication(wrapper(single, settled=True, kept="single"), ran)
    assert comm["steps_measured"] == 4 and comm["hidden_fraction"] == 0.0 and comm["buckets"] == 1, comm
    text = summary_text(comm, steps_run=len(ran))
    assert text.startswith("0% hidden behind backward, 1 allreduce per step (median of the last 4 steps, those run "
                           "under the plan in force: one allreduce after backward"), text
    assert text.endswith("one allreduce after backward, which the trial timed faster than the optimal plan)"), text


def test_a_run_that_kept_torch_ddps_buckets_says_so():
    fixed = SimpleNamespace(method="fixed")
    comm = train._communication(wrapper(fixed, settled=True, kept="buckets"), [(fixed, True, stats(0.3, 2))] * 4)
    assert summary_text(comm, steps_run=40).endswith(
        "under the plan in force: torch DDP's default buckets, which the trial timed faster than the optimal plan)")


def test_the_summary_says_what_the_trial_timed_and_where_the_checkpoints_are(capsys):
    # A run whose plan is one allreduce said "0% hidden" and nothing of why; it now shows the
    # candidates the trial timed, the one kept first, and where the same command continues.
    single = SimpleNamespace(method="single")
    trial = [{"label": "plan", "groups": 3, "median_s": 0.2296, "rounds": 2, "kept": False},
             {"label": "free", "groups": 43, "median_s": 0.2437, "rounds": 2, "kept": False},
             {"label": "single", "groups": 1, "median_s": 0.2272, "rounds": 2, "kept": True}]
    comm = train._communication(wrapper(single, settled=True, kept="single", trial=trial),
                                [(single, True, stats(0.0, 1))] * 4)
    summary = {"model": "charlm", "workers": 2, "transport": "shm", "schedule": "optimal", "resumed_at": 0,
               "steps_run": 40, "final_step": 40, "last_loss": 2.5, "median_step_s": 0.25, "samples_per_s": 256.0,
               "one_worker_samples_per_s": 150.0, "scaling_efficiency": 0.85, "checkpoint_dir": "runs/charlm",
               "communication": comm}
    train._print_summary(summary)
    out = capsys.readouterr().out
    assert ("  trial of plans     kept one allreduce after backward (1 group) 227.2 ms; against the plan (3 groups) "
            "229.6 ms, the plan of free overlap (43 groups) 243.7 ms (forward+backward, median of the slowest rank)"
            ) in out, out
    assert "  checkpoints        runs/charlm (the same command with more --steps continues from step 40)" in out
    train._print_summary(dict(summary, resumes=False))  # (--no-resume: the same command would start afresh)
    assert "runs/charlm (the same command without --no-resume with more --steps continues" in capsys.readouterr().out
    train._print_summary(dict(summary, checkpoint_dir=None, communication=dict(comm, trial=[])))
    out = capsys.readouterr().out
    assert "trial of plans" not in out and "checkpoints" not in out, out
    # Compression names the wire, which one worker has not (its loss is bitwise that of no compression).
    train._print_summary(dict(summary, compression="fp16"))
    assert "charlm on 2 workers (shm, schedule optimal, gradients in fp16 on the wire):" in capsys.readouterr().out
    train._print_summary(dict(summary, compression="fp16", workers=1))
    assert "charlm on 1 worker (shm, schedule optimal):" in capsys.readouterr().out
    train._print_summary(dict(summary, compression="powersgd"))
    assert "charlm on 2 workers (shm, schedule optimal, gradients by PowerSGD (rank 1)):" in capsys.readouterr().out


def test_a_parameter_server_run_reports_its_bytes_and_where_asynchronous_its_staleness():
    stats = {"strategy": "async", "steps": 108, "bytes_sent": 756_750_640, "bytes_received": 756_746_885,
             "max_staleness": 2, "staleness_histogram": {"0": 1, "1": 15}}
    # (steps: the servers' step count, 108 after a resume at 100; the bytes are this run's 8 steps)
    assert train._servers_text(stats, 8) == (
        "757 MB pushed, 757 MB pulled by worker 0 in 8 steps; staleness bound 2, staleness seen (updates applied "
        "since a gradient's parameters: count) 0: 1, 1: 15")
    assert "staleness bound none" in train._servers_text(dict(stats, max_staleness=None), 8)
    # Resumed: the servers' histogram is the job's (they checkpoint it), and says so.
    assert "staleness seen since step 0 (this run resumed at step 100) (updates applied" in train._servers_text(
        stats, 8, resumed_at=100)
    assert train._servers_text(dict(stats, strategy="sync"), 1) == "757 MB pushed, 757 MB pulled by worker 0 in 1 step"
    # Two servers: each counts its shard of a gradient, so every gradient twice (a reviewer misread it).
    assert "(updates applied since a gradient's parameters: count, over the 2 servers: each counts its shard of " \
           "every gradient) 0: 1, 1: 15" in train._servers_text(dict(stats, servers=2), 8)


def test_the_staleness_bound_of_ringtrain_train_reaches_the_servers(monkeypatch):
    # --max-staleness was only python -m ringtrain.ps's: ringtrain train's servers always had bound 0.
    from ringtrain import ps

    given = []
    monkeypatch.setattr(ps, "is_server_rank", lambda servers: True)
    monkeypatch.setattr(ps, "run_server_role", lambda servers, **kw: given.append(kw["max_staleness"]))
    for bound in (2, -1, 0):
        train.ps_worker(train.TrainConfig(strategy="ps-async", max_staleness=bound, checkpoint_dir="unused"))
    assert given == [2, None, 0]


def test_a_run_that_kept_mgwfbps_merge_says_so():
    mgwfbp = SimpleNamespace(method="mgwfbp")
    comm = train._communication(wrapper(mgwfbp, settled=True, kept="mgwfbp"), [(mgwfbp, True, stats(0.6, 5))] * 4)
    assert summary_text(comm, steps_run=40).endswith(
        "under the plan in force: the MG-WFBP merge, which the trial timed faster than the optimal plan)")


def test_a_run_that_ended_during_the_trial_says_so_and_shows_no_share():
    probe = SimpleNamespace(method="custom")
    ran = [(probe, False, stats(0.77, 24))] * 20
    comm = train._communication(wrapper(probe, settled=False, iteration=20), ran)
    assert comm["steps_measured"] == 0 and "hidden_fraction" not in comm and "buckets" not in comm, comm
    assert comm["plan_in_force"] == "trial", comm  # (not the probe's "custom")
    text = summary_text(comm, steps_run=20)
    assert text == "not measured: the trial of plans had not finished (20 steps); run more --steps", text


def test_a_run_that_ended_while_profiling_names_the_profiling_steps():
    single, wfbp = SimpleNamespace(method="single"), SimpleNamespace(method="wfbp")
    comm = train._communication(wrapper(wfbp, settled=True), [(single, False, stats(0.0, 1))] * 3)
    early = train._communication(wrapper(single, settled=False, iteration=2), [(single, False, stats(0.0, 1))] * 2)
    assert early["plan_in_force"] == "profiling", early
    text = summary_text(comm, steps_run=3, schedule="wfbp")
    assert "allreduces per step" not in text and "1 allreduce" not in text, text
    assert text.startswith("not measured: the first 3 steps time backward"), text


def run_train(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RINGTRAIN_SECRET", None)
    proc = subprocess.run([sys.executable, "-m", "ringtrain.cli", "train", "--workers", "2", "--batch-size", "4",
                           "--checkpoint-every", "0", "--no-progress", *argv],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def own_lines(stderr: str) -> list[str]:
    """stderr without torch's log lines (its OMP_NUM_THREADS banner)."""
    return [line for line in stderr.splitlines() if line.strip() and not re.match(r"[IWE]\d{4} ", line)]


@pytest.mark.multiprocess
def test_a_short_optimal_run_with_a_timeline_says_the_trial_had_not_finished_and_nothing_was_traced(tmp_path):
    proc = run_train(tmp_path, "--steps", "8", "--timeline", str(tmp_path / "trace.json"))
    line = next(l for l in proc.stdout.splitlines() if l.strip().startswith("communication"))
    assert line.split(None, 1)[1] == "not measured: the trial of plans had not finished (8 steps); run more --steps"
    warnings = [l for l in own_lines(proc.stderr) if "--timeline" in l]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: --timeline {tmp_path / 'trace.rank0.json'}: "
                                                         "no step traced"), proc.stderr
    assert "run more --steps" in warnings[0], warnings


@pytest.mark.multiprocess
def test_a_wfbp_run_that_ended_while_profiling_reports_no_allreduce_count(tmp_path):
    proc = run_train(tmp_path, "--model", "mlp", "--steps", "3", "--schedule", "wfbp", "--json")
    comm = json.loads(proc.stdout)["communication"]
    assert comm["plan_in_force"] == "wfbp" and comm["steps_measured"] == 0, comm
    assert "hidden_fraction" not in comm and "buckets" not in comm, comm


@pytest.mark.multiprocess
def test_powersgd_trains_resumes_and_reduces_otherwise_than_the_plain_allreduce(tmp_path):
    # The same run without compression and with torch's powerSGD_hook: both train, and the hook's
    # rank-1 approximations change the loss (the hook is really what reduces). A resume takes the
    # checkpoint and goes on with the hook's state saved in it (test_resume: bitwise).
    for name in ("plain", "psgd"):
        (tmp_path / name).mkdir()
    plain = json.loads(run_train(tmp_path / "plain", "--model", "mlp", "--steps", "4", "--json").stdout)
    argv = ("--model", "mlp", "--compression", "powersgd", "--checkpoint-every", "2", "--json")
    first = json.loads(run_train(tmp_path / "psgd", *argv, "--steps", "4").stdout)
    assert first["compression"] == "powersgd" and first["steps_run"] == 4
    assert math.isfinite(first["last_loss"]) and first["last_loss"] != plain["last_loss"], (first, plain)
    proc = run_train(tmp_path / "psgd", *argv, "--steps", "6")
    assert "resumed PowerSGD's state of step 4 (iteration 4;" in proc.stderr, proc.stderr[-3000:]
    again = json.loads(proc.stdout)
    assert again["resumed_at"] == 4 and again["steps_run"] == 2 and math.isfinite(again["last_loss"]), again


def test_the_one_worker_rate_times_whole_training_steps_on_copies():
    """Scaling is measured against forward, backward and the optimizer step (the run's step), not
    forward and backward alone (1 worker reported 0.81-0.85x on the MLP, whose step is large)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    made, steps = [], []

    def make_optimizer(params):
        params = list(params)
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        real_step = opt.step
        opt.step = lambda: (steps.append(1), real_step())[1]
        made.append(params)
        return opt

    batch = (torch.randn(4, 8), torch.randn(4, 2))
    rate = train._one_worker_rate(model, nn.functional.mse_loss, batch, make_optimizer, steps=5)
    assert rate > 0 and len(steps) == 6  # a warm-up and five timed steps
    assert all(p is not q for p in made[0] for q in model.parameters())  # the twin's, not the model's
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
