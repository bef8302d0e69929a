"""The training benchmark: the trace arithmetic the simulator is given, and how parameter-server
rounds become a row."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from cli_harness import refusal
from ringtrain.bench.train import (PS_WARMUP_STEPS, _predict_ps, _ps_row, _scaled, _with_wrapper_costs, parse_strategies,
                                   ring_schedules, turns)
from ringtrain.sim import costs
from ringtrain.sim.simulator import predict_with_cost
from ringtrain.sim.traces import Layer, Trace


def profile() -> Trace:
    return Trace("toy", (Layer("embed", 0.004, 0.001, 400, 100), Layer("relu", 0.001, 0.002, 0, 0),
                         Layer("head", 0.005, 0.007, 1200, 300)), batch_size=8, optimizer_s=0.002)


def test_scaled_takes_each_phase_from_the_measured_split():
    # Alone measured forward 20, backward 30, step 10 (sum 60) in an iteration of 66 ms
    # (the slowest rank's): each part is stretched by 66/60 and split as measured.
    t = _scaled(profile(), 0.066, (0.020, 0.030, 0.010))
    assert t.forward_s == pytest.approx(0.022)
    assert t.backward_s == pytest.approx(0.033)
    assert t.optimizer_s == pytest.approx(0.011)
    # Within a phase the profile's proportions stay.
    assert [l.forward_s / t.forward_s for l in t.layers] == pytest.approx([0.4, 0.1, 0.5])
    assert [l.backward_s / t.backward_s for l in t.layers] == pytest.approx([0.1, 0.2, 0.7])
    assert [l.grad_bytes for l in t.layers] == [400, 0, 1200]


def test_wrapper_costs_spread_the_hooks_over_gradient_bytes_and_broadcasts_on_forward():
    base = profile()
    t = _with_wrapper_costs(base, hooks_s=0.004, broadcast_s=0.0015)
    # 400 and 1200 of 1600 bytes: 1 ms and 3 ms of hook time; nothing on a layer without gradient.
    assert [l.backward_s - b.backward_s for l, b in zip(t.layers, base.layers)] == pytest.approx([0.001, 0, 0.003])
    assert t.forward_s == pytest.approx(base.forward_s + 0.0015)
    assert t.optimizer_s == base.optimizer_s
    # Backward order (what the planner sees): the head's gradient first, with its share.
    _, times, sizes = t.gradient_layers()
    assert sizes == [1200, 400] and times == pytest.approx([0.007 + 0.003, 0.001 + 0.002 + 0.001])


def test_per_parameter_cuts_layers_into_the_wrappers_tensors():
    from torch import nn

    from ringtrain.bench.train import _per_parameter

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2, bias=False))
    trace = Trace("seq", (Layer("0", 0.004, 0.001, 64, 16), Layer("1", 0.001, 0.002, 0, 0),
                          Layer("2", 0.005, 0.007, 32, 8)), batch_size=2)
    t = _per_parameter(trace, model)
    assert [l.name for l in t.layers] == ["0[0]", "0[1]", "1", "2"]
    assert [l.grad_bytes for l in t.layers] == [48, 16, 0, 32] and [l.params for l in t.layers] == [12, 4, 0, 8]
    assert t.forward_s == trace.forward_s and t.backward_s == trace.backward_s
    # Backward order: "2", then the bias (first ready, with the layer's and the ReLU's time), then the weight at no cost.
    _, times, sizes = t.gradient_layers()
    assert sizes == [32, 16, 48] and times == pytest.approx([0.007, 0.003, 0.0])


def ps_doc(steps, sent, hist=None, wait=1.0):
    return {"model": "mlp", "strategy": "sync", "servers": 2, "workers": 4, "batch_size": 8, "step_s": steps,
            "losses": [3.0] * len(steps), "bytes_per_step": {"sent": sent / 10, "received": sent / 5},
            "stats": {"bytes_sent": sent, "bytes_received": 2 * sent, "pull_wait_s": wait,
                      "bytes_per_server": {"0": {"sent": sent, "received": sent}},
                      "staleness_histogram": hist or {}}}


def test_configurations_take_turns_step_by_step_in_orders_that_vary_alike_on_every_rank():
    n, steps, rounds = 7, 6, 3
    timed = [list(turns(n, steps, r)) for r in range(rounds)]
    # The orders come from the seed and the round alone (no process id, no hash): pinned, so
    # that every rank, in any process, draws these.
    assert [i for _, i in timed[0][:n]] == [0, 6, 4, 3, 2, 5, 1]
    assert [i for _, i in timed[1][:n]] == [1, 0, 4, 3, 2, 5, 6]
    for one in timed:  # each turn of every round: step k, every configuration once
        for k in range(steps):
            turn = one[k * n:(k + 1) * n]
            assert {kk for kk, _ in turn} == {k} and sorted(i for _, i in turn) == list(range(n))
    order = [i for one in timed for _, i in one]
    assert len(order) == n * steps * rounds
    firsts = {order[t * n] for t in range(steps * rounds)}
    follows = {i: {order[j - 1] for j in range(1, len(order)) if order[j] == i} for i in range(n)}
    assert len(firsts) > 1 and all(len(f) > 1 for f in follows.values())
    assert [i for _, i in turns(1, 3, 0)] == [0, 0, 0]


@pytest.mark.parametrize("text, schedules", [
    ("ring", ["optimal", "wfbp", "single"]),  # every --schedules entry
    ("ring-optimal,ps-sync,ps-sharded:2,ps-async", ["optimal"]),
    ("ring-single,ring-optimal", ["single", "optimal"]),  # in the order given
    ("ring,ring-fixed", ["optimal", "wfbp", "single", "fixed"]),
    ("ps-sync", []),
])
def test_the_ring_runs_every_schedule_or_those_named_as_ring_schedule(text, schedules):
    # --strategies ring-optimal (issue 4's spelling) was refused: "not one of ring, ps-sync, ...".
    assert ring_schedules(parse_strategies(text), ["optimal", "wfbp", "single"]) == schedules


@pytest.mark.parametrize("text, message", [
    ("ring-bogus", "the ring's schedule must be one of optimal, mgwfbp, wfbp, fixed, single"),
    ("ring-optimal,ring-optimal", "'ring-optimal' given twice"),
    ("ring-optimal:2", "is not one of ring, ring-SCHEDULE, ps-sync"),
])
def test_a_bad_ring_schedule_is_refused_naming_the_choices(text, message):
    with pytest.raises(ValueError, match=message):
        parse_strategies(text)


def test_ps_rounds_merge_into_one_row_without_their_warm_up_steps():
    args = argparse.Namespace(net="1gbit")
    docs = [ps_doc([9.0, 9.0, 2.0, 4.0], 100, {"0": 3}), ps_doc([9.0, 9.0, 3.0, 5.0], 50, {"0": 1, "1": 2})]
    row = _ps_row(docs, args)
    assert row["iter_s"] == [2.0, 4.0, 3.0, 5.0]
    assert row["median_iter_s"] == 3.5 and row["round_medians"] == [3.0, 4.0]
    assert row["samples_per_s"] == 4 * 8 / 3.5
    assert row["steps_total"] == 8 and row["worker_bytes_sent"] == 150 and row["worker_bytes_received"] == 300
    assert row["bytes_per_server"] == {"0": {"sent": 150, "received": 150}}
    assert row["staleness_histogram"] == {"0": 4, "1": 2}
    assert row["pull_wait_s"] == 2.0 / 8
    assert row["worker_bytes_per_step"] == {"sent": 7.5, "received": 15.0}
    assert row["schedule"] == "ps-sync:2" and row["net"] == "1gbit"


def test_synchronous_server_rows_get_the_simulators_prediction_from_the_ring_jobs_trace_and_link():
    ring_fit = {"small": {"alpha": 1e-3, "beta": 1e-8, "gamma": 0.0},
                "large": {"alpha": 2e-4, "beta": 8e-9, "gamma": 0.0}, "split_bytes": 65536.0}
    rows = [{"model": "toy", "impl": "alone", "world_size": 2, "trace": profile().to_dict()},
            {"model": "toy", "impl": "ringtrain", "schedule": "optimal", "world_size": 2, "cost": ring_fit},
            {"model": "toy", "impl": "ps", "schedule": "ps-sync:1", "servers": 1, "world_size": 2, "median_iter_s": 0.5},
            {"model": "toy", "impl": "ps", "schedule": "ps-sharded:2", "servers": 2, "world_size": 2,
             "median_iter_s": 0.25},
            {"model": "toy", "impl": "ps", "schedule": "ps-async:1", "servers": 1, "world_size": 2, "median_iter_s": 0.5},
            {"model": "other", "impl": "ps", "schedule": "ps-sync:1", "servers": 1, "world_size": 2, "median_iter_s": 1.0}]
    _predict_ps(rows)
    for row in rows[2:4]:
        # A 2-rank ring moves 2(p-1) = 2 messages and 2(p-1)/p = 1 times the bytes per link: alpha / 2, beta.
        cost = costs.allreduce_cost(2, "ps", alpha=1e-4, beta=8e-9, servers=row["servers"])
        expected = predict_with_cost(profile(), cost, 2, "optimal", algorithm="ps").iteration_s
        assert row["sim_iter_s"] == pytest.approx(expected, rel=1e-12)
        assert row["sim_error"] == pytest.approx((expected - row["median_iter_s"]) / row["median_iter_s"], rel=1e-12)
    # Not modelled: asynchronous servers, and a model without a ring job in the run.
    assert "sim_iter_s" not in rows[4] and "sim_iter_s" not in rows[5]


@pytest.mark.timeout(180)
def test_bench_train_times_parameter_servers_round_by_round(capsys, tmp_path):
    from pathlib import Path

    import numpy as np

    from ringtrain import cli

    # (the ring with the optimal schedule alone, as issue 4 spells it: ring-optimal)
    rc = cli.main(["bench", "train", "--strategies", "ring-optimal,ps-sync", "--models", "charlm",
                   "--world-size", "2", "--batch-size", "4", "--steps", "1", "--rounds", "2", "--no-torch-ddp",
                   "--out", str(tmp_path), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    ring, alone, row = doc["rows"]
    assert (ring["impl"], alone["impl"]) == ("ringtrain", "alone")
    # Every row's median is numpy's (torch's median of an even count is the lower middle value).
    for r in doc["rows"]:
        assert r["median_iter_s"] == pytest.approx(float(np.median(r["iter_s"])), rel=1e-12)
    # The timelines are named after the run's result file (they were per model only: overwritten).
    stem = Path(doc["saved_to"]).stem
    assert Path(ring["timeline"]).name.startswith(f"{stem}-charlm"), (ring["timeline"], stem)
    # The ring job's compute-alone trace is the simulator's input for the server row.
    assert Trace.from_dict(alone["trace"]).grad_bytes == 4 * 891904
    assert row["sim_iter_s"] > 0 and row["sim_error"] == pytest.approx(
        (row["sim_iter_s"] - row["median_iter_s"]) / row["median_iter_s"])
    assert row["impl"] == "ps" and row["schedule"] == "ps-sync:1" and row["world_size"] == 2
    assert len(row["iter_s"]) == 2 and len(row["round_medians"]) == 2
    assert row["steps_total"] == 2 * (1 + PS_WARMUP_STEPS)
    # every step moves the whole model each way (rank 0's count, all rounds), framing aside
    per_step = row["worker_bytes_per_step"]
    assert row["worker_bytes_sent"] >= row["steps_total"] * 4 * 891904
    for way in ("sent", "received"):
        assert 4 * 891904 <= per_step[way] < 1.01 * 4 * 891904


@pytest.mark.parametrize("compression, hook", [("bf16", "bf16_compress_hook"), ("powersgd", None)])
def test_bench_train_times_compression_beside_torchs_ddp_with_its_hook(capsys, compression, hook):
    """bf16: beside torch's DDP with the matching hook. PowerSGD: ringtrain's wrapper with torch's
    hook, and a note why torch's DDP with it has no row (it aborts on gloo: POWER_SGD_NOTE)."""
    from ringtrain import cli

    rc = cli.main(["bench", "train", "--schedules", "single", "--models", "charlm", "--compression", compression,
                   "--world-size", "2", "--batch-size", "4", "--steps", "1", "--rounds", "1", "--out", "", "--json",
                   "--no-horovod"])
    assert rc == 0
    out = capsys.readouterr().out
    doc = json.loads(out)
    rows = {(r["impl"], r["schedule"]): r for r in doc["rows"]}
    assert set(rows) == {("ringtrain", "single"), ("alone", "no communication"), ("torch-ddp", "torch defaults (25 MiB)"),
                         ("torch-ddp-ringtrain", "torch defaults (25 MiB)"),
                         ("ringtrain-compressed", f"optimal+{compression}")} | (
                         {("torch-ddp-compressed", f"torch defaults + {hook}")} if hook else set())
    assert any("powerSGD_hook is not timed" in n for n in doc["notes"]) == (hook is None)
    mine = rows["ringtrain-compressed", f"optimal+{compression}"]
    assert mine["median_iter_s"] > 0 and mine["groups"] >= 1 and mine["hidden_fraction"] is not None
    assert mine.get("sim_iter_s") is None  # (the simulator's figures are for full-precision bytes)


@pytest.mark.parametrize("argv, match", [
    (["bench", "train", "--models", ""], "--models: give at least one"),
    (["bench", "train", "--out", "/proc/version/x"], "--out /proc/version/x"),
    (["bench", "allreduce", "--out", "/proc/version/x"], "--out /proc/version/x"),
    (["bench", "allreduce", "--sizes", "inf"], "--sizes: cannot read"),
])
def test_bench_arguments_are_checked_before_anything_runs(argv, match, capsys):
    # An unwritable --out was found only when the finished run was saved (its results lost).
    assert re.search(match, refusal(argv, capsys))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("wrapper_speed", [0.5, 1.0, 2.0])
def test_the_planners_single_allreduce_costs_its_communication_after_compute_alone(wrapper_speed):
    # The planner's figure took max(trace backward, the plan's end) with the plan timed on the
    # wrapper's own backward: where that was shorter than the trace's (wrapper_speed 2), `single`,
    # whose one allreduce starts after backward, was predicted to cost compute alone.
    from ringtrain import plan as plan_mod
    from ringtrain.bench.train import planner_iteration_s

    trace = profile()
    _, times, sizes = trace.gradient_layers()
    cost = plan_mod.LinearCost(alpha=1e-3, beta=1e-6)
    single = plan_mod.evaluate([t / wrapper_speed for t in times], sizes, [(0, len(times) - 1)], cost=cost)
    communication = cost(float(sum(sizes)))
    compute_alone = trace.forward_s + trace.backward_s + trace.optimizer_s
    predicted = planner_iteration_s(trace, single)
    assert predicted == pytest.approx(compute_alone + communication, rel=1e-12)
    assert predicted > compute_alone


def test_a_rank_failing_after_a_model_keeps_that_models_rows_and_names_the_failure(monkeypatch, tmp_path, capsys):
    # The ranks sent every model's rows only at the end, so a run stopped in its last model (a
    # rank that died, the --timeout) lost all of them.
    from pathlib import Path

    from ringtrain import cli
    from ringtrain.bench import train
    from ringtrain.bench.procs import RankFailed

    def launch(module, module_args, nprocs, args, on_result=None):
        assert module == "ringtrain.cli" and on_result is not None  # the ring job
        on_result({"rows": [{"model": "charlm", "impl": "alone", "schedule": "no communication",
                             "median_iter_s": 0.1, "iter_s": [0.1], "world_size": 2}]})
        raise RankFailed("rank 1 exited with status 1:\nboom")

    monkeypatch.setattr(train, "_launch", launch)
    rc = cli.main(["bench", "train", "--models", "charlm,mlp", "--world-size", "2", "--no-horovod", "--out", str(tmp_path),
                   "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 1 and err.strip().endswith("ringtrain bench train: rank 1 exited with status 1:\nboom"), err
    assert [r["model"] for r in doc["rows"]] == ["charlm"]
    # (the note says what stopped it, as bench allreduce's: a rank's status, or the --timeout)
    assert doc["notes"] == ["Horovod anchor skipped: --no-horovod", "stopped (rank 1 exited with status 1) before the "
                            "run ended: the rows finished by then, of charlm"]
    assert json.loads(Path(doc["saved_to"]).read_text())["rows"] == doc["rows"]


def test_a_network_not_made_for_a_parameter_server_job_keeps_the_ring_jobs_rows(monkeypatch, tmp_path, capsys):
    # Each job has an emulated network of its own; one that could not be made (after the ring
    # job's minutes) lost every row before: the error alone, exit 2.
    from ringtrain import cli
    from ringtrain.bench import train
    from ringtrain.bench.netem import NetemUnavailable

    failed = "`ip netns add ringtrain-7-1-sw` failed (exit 2): RTNETLINK answers: Cannot allocate memory"

    def launch(module, module_args, nprocs, args, on_result=None):
        if module != "ringtrain.cli":  # a parameter-server job
            raise NetemUnavailable(failed)
        on_result({"rows": [{"model": "mlp", "impl": "alone", "schedule": "no communication",
                             "median_iter_s": 0.1, "iter_s": [0.1], "world_size": 2}]})
        return []

    monkeypatch.setattr(train, "_launch", launch)
    rc = cli.main(["bench", "train", "--models", "mlp", "--world-size", "2", "--no-horovod", "--strategies",
                   "ring,ps-sync", "--out", str(tmp_path), "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 1 and err.strip().endswith(f"ringtrain bench train: {failed}"), err
    assert [r["model"] for r in doc["rows"]] == ["mlp"]
    assert doc["notes"][-1] == f"stopped ({failed}) before the run ended: the rows finished by then, of mlp"


def test_a_rank_failing_before_any_row_is_the_one_line_error_it_was(monkeypatch, tmp_path, capsys):
    from ringtrain import cli
    from ringtrain.bench import train
    from ringtrain.bench.procs import RankFailed

    def launch(*args, **kwargs):
        raise RankFailed("ranks [0, 1] still running after 1s:\n")

    monkeypatch.setattr(train, "_launch", launch)
    rc = cli.main(["bench", "train", "--models", "mlp", "--world-size", "2", "--out", str(tmp_path)])
    assert rc == 1 and "ringtrain bench train: ranks [0, 1] still running after 1s" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_warm_up_cap_covers_the_longest_trial_of_plans():
    """bench train steps each ringtrain wrapper (the options' defaults) until its trial is over,
    at most MAX_WARMUP_STEPS; a trial still under way then would be timed as if it were the plan
    kept, silently. The cap must cover the longest trial: warm-up and profile, every probe and the
    single allreduce, then every candidate for VERIFY_ROUNDS rounds (the candidates grew from 5
    to 7 once: the cap is checked against the trial's own constants, not a count written down)."""
    from ringtrain.bench.train import MAX_WARMUP_STEPS
    from ringtrain.ddp.calibration import PROBE_GROUPS
    from ringtrain.ddp import trial as plan_trial
    from ringtrain.ddp.options import DDPOptions

    opts = DDPOptions()
    longest = (opts.warmup_iterations + opts.profile_iterations
               + plan_trial.longest(opts.verify_iterations, len(PROBE_GROUPS)))
    assert MAX_WARMUP_STEPS >= longest, (MAX_WARMUP_STEPS, longest)
