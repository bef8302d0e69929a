"""Calibration: the sweep's alpha and beta, the backward profile, its exchange, drift and re-planning."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import pytest
import torch
from torch import nn

from thread_harness import raise_first, run_comms
from ringtrain.ddp import DistributedDataParallel
from ringtrain.ddp import calibration as cal
from ringtrain.comm import AUTO_SMALL_BYTES
from ringtrain.ddp import trial as plan_trial
from ringtrain.plan import LinearCost, SplitCost


def test_gaps_follow_the_observed_order():
    stamps = np.array([3.0, 1.0, np.nan, 2.0])
    assert list(cal.observed_order(stamps)) == [1, 3, 0, 2]
    assert list(cal.gaps(stamps, 0.5)) == [1.0, 0.5, 0.0, 1.0]
    # No backward start: the first gradient's own time opens the count.
    assert list(cal.gaps(stamps, float("nan"))) == [1.0, 0.0, 0.0, 1.0]
    # A backward start stamped after the first gradient (another thread's clock read): that
    # gradient took 0, never a negative time, which the planner would refuse.
    assert list(cal.gaps(np.array([1.0, 2.0]), 1.5)) == [0.0, 1.0]


def test_local_profile_is_the_median_per_parameter():
    rows = [np.array([1.0, 5.0]), np.array([3.0, 1.0]), np.array([2.0, 100.0])]
    assert list(cal.local_profile(rows)) == [2.0, 5.0]
    with pytest.raises(ValueError):
        cal.local_profile([])


def test_drift_is_the_largest_move_of_the_ready_curve():
    assert cal.drift([1, 1, 2], [1, 1, 2]) == 0.0
    assert cal.drift([1, 1, 2], [2, 1, 1]) == 0.25  # ready [1,2,4] -> [2,3,4]: moved 1 of 4
    assert cal.drift([1, 1, 2], [1, 1, 4]) == 0.5
    assert cal.drift([0, 0], [0, 0]) == 0.0 and math.isinf(cal.drift([0, 0], [1, 0]))
    with pytest.raises(ValueError):
        cal.drift([1], [1, 2])


def test_exchange_gives_every_rank_the_mean_and_rank_0_order():
    def body(comm):
        gaps = np.array([1.0, 2.0, 3.0]) * (comm.rank + 1)
        order = np.array([2, 0, 1]) if comm.rank == 0 else np.array([0, 1, 2])
        return cal.exchange_profile(comm, gaps, order)

    results = raise_first(run_comms(3, body))
    for times, order in results:
        assert list(times) == [2.0, 4.0, 6.0]  # (1 + 2 + 3) / 3 * [1, 2, 3], exact
        assert list(order) == [2, 0, 1] and order.dtype == np.int64


@pytest.mark.timeout(30)
@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_sweep_fits_the_same_cost_on_every_rank(algorithm):
    results = raise_first(run_comms(2, lambda comm: cal.sweep_cost(comm, algorithm, repeats=2)))
    assert results[0] == results[1]
    cost = results[0]
    if algorithm == "auto":  # naive under AUTO_SMALL_BYTES, ring from there: a line each
        assert isinstance(cost, SplitCost) and cost.split_bytes == AUTO_SMALL_BYTES
        lines = [cost.small, cost.large]
    else:
        assert isinstance(cost, LinearCost)
        lines = [cost]
    for line in lines:
        assert line.alpha >= 0 and line.beta >= 0 and line.alpha + line.beta > 0
    assert cal.sweep_cost(type("One", (), {"world_size": 1})(), "ring") == LinearCost(0.0, 0.0)


class _LinkComm:
    """Rank 0 of two whose allreduce advances a fake clock by a known line's time: the sweep's
    fit must give that line back."""

    world_size, rank = 2, 0

    def __init__(self, small: LinearCost, large: LinearCost):
        self.small, self.large, self.now = small, large, 0.0

    def allreduce(self, buf, op, algorithm):
        line = self.small if algorithm == "auto" and buf.nbytes < AUTO_SMALL_BYTES else self.large
        self.now += line(buf.nbytes)

    def broadcast(self, buf, root):
        assert root == 0  # (rank 0's fit stays as it is)


def test_sweep_gives_back_the_line_of_a_known_link(monkeypatch):
    """Times per allreduce (a burst's time divided by its length), sizes in bytes, and under
    "auto" each line on its own side of AUTO_SMALL_BYTES; with one size above it, one line."""
    small, large = LinearCost(2e-4, 3e-9), LinearCost(5e-4, 1e-9)
    comm = _LinkComm(small, large)
    monkeypatch.setattr(time, "perf_counter", lambda: comm.now)
    ring = cal.sweep_cost(comm, "ring", repeats=2)
    assert isinstance(ring, LinearCost)
    assert (ring.alpha, ring.beta) == pytest.approx((large.alpha, large.beta), rel=1e-6)
    auto = cal.sweep_cost(comm, "auto", repeats=2)
    assert isinstance(auto, SplitCost) and auto.split_bytes == AUTO_SMALL_BYTES
    assert (auto.small.alpha, auto.small.beta) == pytest.approx((small.alpha, small.beta), rel=1e-6)
    assert (auto.large.alpha, auto.large.beta) == pytest.approx((large.alpha, large.beta), rel=1e-6)
    # One size above the split cannot give the large side a slope: one line through every size.
    sizes = (4096, 32768, 1 << 20)
    one = cal.sweep_cost(comm, "auto", sizes, repeats=2)
    expect = cal.fit_start_up_first(np.array(sizes, dtype=np.float64),
                                    np.array([small(4096), small(32768), large(1 << 20)]))
    assert isinstance(one, LinearCost) and (one.alpha, one.beta) == pytest.approx(expect, rel=1e-6)


def test_sweep_sizes_add_the_models_gradient_bytes_when_they_are_much_larger():
    last = cal.SWEEP_BYTES[-1]
    assert cal.sweep_sizes(0.0) == cal.SWEEP_BYTES
    assert cal.sweep_sizes(1.5 * last) == cal.SWEEP_BYTES  # (not over 1.5x: the sweep's own sizes)
    assert cal.sweep_sizes(1.5 * last + 4) == cal.SWEEP_BYTES + (int(1.5 * last) + 4,)
    assert cal.sweep_sizes(84_000_003.0) == cal.SWEEP_BYTES + (84_000_000,)  # float32 buffers: whole floats
    assert cal.sweep_sizes(1e12) == cal.SWEEP_BYTES + (cal.SWEEP_MAX_BYTES,)


def test_split_cost_takes_each_line_on_its_side():
    cost = SplitCost(LinearCost(1e-4, 1e-9), LinearCost(5e-4, 2e-10), 65536.0)
    assert cost(65535.0) == 1e-4 + 1e-9 * 65535.0 and cost(65536.0) == 5e-4 + 2e-10 * 65536.0
    sizes = np.array([0.0, 4096.0, 65536.0, 1e9])
    assert list(cost(sizes)) == [cost(float(n)) for n in sizes]
    assert (cost.alpha, cost.beta) == (5e-4, 2e-10) and "65536 B" in cost.describe()
    with pytest.raises(ValueError):
        SplitCost(LinearCost(0.0, 0.0), LinearCost(0.0, 0.0), 0.0)


def test_construction_sweep_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="ringtrain.ddp")

    def body(comm):
        ddp = DistributedDataParallel(nn.Linear(4, 4), comm)
        ddp.close()
        return ddp.alpha, ddp.beta

    results = raise_first(run_comms(2, body))
    assert results[0] == results[1]
    assert any("allreduce sweep" in r.getMessage() and "alpha=" in r.getMessage() for r in caplog.records)


def test_alpha_and_beta_read_the_same_from_every_kind_of_cost():
    # beta is the seconds per byte of one allreduce: a LinearCost keeps the reduction's apart (gamma),
    # a SplitCost's beta has its larger line's in; the wrapper reported a LinearCost's without it.
    line = LinearCost(1e-4, 1e-9, 2e-9)

    def body(comm):
        out = []
        for cost in (line, SplitCost(LinearCost(0.0, 5e-9), line, 65536.0)):
            ddp = DistributedDataParallel(nn.Linear(4, 4), comm, cost=cost)
            ddp.close()
            out.append((ddp.alpha, ddp.beta))
        return out

    for got in raise_first(run_comms(2, body)):
        assert got == [(1e-4, pytest.approx(3e-9, rel=1e-12))] * 2, got


class Swapped(nn.Module):
    """Registered first-then-second, used second-then-first: the backward order is
    first's gradients before second's, the reverse of what registration suggests."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.second = nn.Linear(6, 6)

    def forward(self, x):
        return self.first(torch.tanh(self.second(x)))


def test_backward_order_is_discovered_and_plan_logged(caplog):
    caplog.set_level(logging.INFO, logger="ringtrain.ddp")

    def body(comm):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Swapped(), comm, alpha=1e-5, beta=1e-9, warmup_iterations=1,
                                      profile_iterations=2, verify_iterations=0)  # the plan itself, no trial
        assert ddp.plan.method == "single"
        names = [n for n, p in ddp.module.named_parameters()]
        before = [names[i] for i in ddp.order]
        for _ in range(3):
            ddp(torch.ones(2, 6)).sum().backward()
        after = [names[i] for i in ddp.order]
        ddp.close()
        return before, after, ddp.plan.method

    for before, after, method in raise_first(run_comms(2, body)):
        assert before[:2] == ["second.bias", "second.weight"]
        assert set(after[:2]) == {"first.weight", "first.bias"}
        assert method == "optimal"
    assert any("plan (optimal" in r.getMessage() and "groups" in r.getMessage() for r in caplog.records)


class SlowBackward(torch.autograd.Function):
    delay = 0.0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(SlowBackward.delay)
        return g


class Slowable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(SlowBackward.apply(self.a(x)))


@pytest.mark.timeout(30)
def test_plan_is_remade_when_backward_times_drift(caplog):
    caplog.set_level(logging.INFO, logger="ringtrain.ddp")
    SlowBackward.delay = 0.0

    def body(comm):
        ddp = DistributedDataParallel(Slowable(), comm, alpha=1e-5, beta=1e-9, warmup_iterations=0,
                                      profile_iterations=1, replan_interval=2)
        x = torch.ones(2, 4)
        ddp(x).sum().backward()  # plan made here
        planned = ddp.plan.backward_time
        if comm.rank == 0:
            SlowBackward.delay = 0.03  # one rank's slowdown moves the mean over ranks
        for _ in range(2):
            ddp(x).sum().backward()
        ddp.close()
        return planned, ddp.plan.backward_time

    try:
        results = raise_first(run_comms(1, body))
    finally:
        SlowBackward.delay = 0.0
    planned, replanned = results[0]
    assert replanned > planned + 0.02
    assert any("drifted" in r.getMessage() for r in caplog.records)


def test_start_up_first_fit_keeps_the_small_message_latency():
    # Large messages with noise whose least-squares line would cross zero: the line must pass
    # through the measured small-message time, with the slope of the rest above it.
    sizes = np.array([4096, 65536, 524288, 2097152, 8388608], dtype=np.float64)
    times = np.array([5e-4, 1.0e-3, 4.6e-3, 1.7e-2, 6.6e-2])
    alpha, beta = cal.fit_start_up_first(sizes, times)
    expect = np.dot(sizes[1:] - 4096, times[1:] - 5e-4) / np.dot(sizes[1:] - 4096, sizes[1:] - 4096)
    assert beta == pytest.approx(expect, rel=1e-12)
    assert alpha + beta * 4096 == pytest.approx(5e-4, rel=1e-12) and alpha > 0
    assert cal.fit_start_up_first(np.array([4096.0, 8192.0]), np.array([1e-3, 1e-3])) == (1e-3, 0.0)
    assert cal.fit_start_up_first(np.array([4096.0]), np.array([1e-3])) == (1e-3, 0.0)
    # A slope that would make the intercept negative: alpha clamps at 0.
    assert cal.fit_start_up_first(np.array([1e6, 2e6]), np.array([1e-4, 1e-3]))[0] == 0.0
    # The sizes in any order: the line still passes through the smallest one's time.
    shuffled = [3, 0, 4, 1, 2]
    assert cal.fit_start_up_first(sizes[shuffled], times[shuffled]) == (alpha, beta)


def longest_trial(verify_iterations: int, probes: int, warmup: int = 1, profile: int = 2) -> int:
    """Steps to the end of the longest trial (the options' defaults for ``warmup`` and
    ``profile``): a cap for train_until_settled that no count of candidates or rounds the trial
    may take reaches."""
    return warmup + profile + plan_trial.longest(verify_iterations, probes)


def train_until_settled(ddp, x, limit: int) -> int:
    """Synchronizing steps on ``x`` until the wrapper's trial is over (at most ``limit``); the count."""
    steps = 0
    while not ddp.settled and steps < limit:
        ddp(x).sum().backward()
        steps += 1
    return steps


@pytest.mark.parametrize("slow_overlap", [False, True])
def test_optimal_plan_is_verified_against_one_allreduce(caplog, slow_overlap, monkeypatch):
    """After the first plan, schedule="optimal" times it against a single allreduce after
    backward and keeps the faster, the same choice on every rank. ``slow_overlap`` makes every
    iteration with several buckets measurably slower, as communication that competes with
    the computation for the CPU does: then the single allreduce must win; otherwise the single
    allreduce is made the slow one and the plan must stay."""
    from ringtrain.ddp import wrapper

    caplog.set_level(logging.INFO, logger="ringtrain.ddp")
    real_mark = wrapper.DistributedDataParallel._mark_ready

    def mark_ready(self, bucket):
        if slow_overlap and len(self._specs) > 1:
            time.sleep(0.004)  # per ready bucket, during backward
        if not slow_overlap and len(self._specs) == 1:
            time.sleep(0.03)  # the single allreduce is the slow one
        return real_mark(self, bucket)

    monkeypatch.setattr(wrapper.DistributedDataParallel, "_mark_ready", mark_ready)

    def body(comm):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        # alpha and beta given: a plan of several buckets, whatever this machine measures
        ddp = DistributedDataParallel(model, comm, schedule="optimal", alpha=1e-6, beta=1e-7, verify_iterations=2)
        # warm-up, profile, two probes, single, then the candidates in turn (1 to 3 rounds)
        train_until_settled(ddp, torch.randn(8, 64), longest_trial(2, probes=2))
        groups = len(ddp.plan.groups)
        ddp.close()
        return groups, ddp._trial is None

    results = raise_first(run_comms(2, body))
    assert results[0] == results[1] and results[0][1], results
    messages = [r.getMessage() for r in caplog.records
                if "candidates verified" in r.getMessage() or "alike; keeping it" in r.getMessage()]
    assert messages, "no verification logged"
    if slow_overlap:
        # the probes see the slowdown (the plan made with it is one allreduce), or the
        # verification does (it keeps the single allreduce)
        assert results[0][0] == 1
        # (a plan of one group is the single allreduce: kept under the plan's name)
        assert any(f"keeping {what}" in messages[0] for what in ("one allreduce after backward", "the plan", "it"))
    else:
        assert results[0][0] > 1 and "keeping the plan" in messages[0]


def test_the_plan_of_free_overlap_is_a_candidate_and_kept_as_planned(caplog):
    """A per-message interference so large that the plan made with it is one allreduce: the
    plan made without it (several buckets) is the other candidate. Whichever wins, every rank
    keeps the same, ``planned_with`` says how it was planned, and re-plans plan that way."""
    from ringtrain.plan import Interference

    caplog.set_level(logging.INFO, logger="ringtrain.ddp")
    given = Interference(0.05, 0.0)

    def body(comm):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        ddp = DistributedDataParallel(model, comm, schedule="optimal", alpha=1e-6, beta=1e-7, verify_iterations=2,
                                      interference=given, replan_interval=1, drift_threshold=1e-9)
        x = torch.randn(8, 64)
        train_until_settled(ddp, x, longest_trial(2, probes=0))  # warm-up, profile, single, the candidates (1-3 rounds)
        for _ in range(3):  # then re-plans
            ddp(x).sum().backward()
        out = len(ddp.plan.groups), ddp.planned_with, ddp.settled, ddp.trial
        ddp.close()
        return out

    results = raise_first(run_comms(2, body))
    assert results[0] == results[1] and results[0][2], results
    messages = [r.getMessage() for r in caplog.records if "candidates verified" in r.getMessage()]
    assert messages and "the plan of free overlap (" in messages[0] and "one allreduce after backward" not in messages[0]
    groups, planned_with, _, trial = results[0]
    if "keeping the plan of free overlap" in messages[0]:
        assert planned_with == Interference() and groups > 1
    elif "keeping the plan" in messages[0]:
        assert planned_with == given and groups == 1
    else:  # another schedule's grouping, measured faster (on a loaded machine, now and then)
        assert planned_with == given
    # The trial's record: the candidates as timed (the slowest rank's medians, so equal on every
    # rank; the other schedules' groupings where they differ, as the measured backward times
    # make them), the kept one the fastest, and its group count the plan's after the trial.
    labels = [c["label"] for c in trial]
    assert labels[:2] == ["plan", "free"] and set(labels) <= {"plan", "free", "mgwfbp", "wfbp"}, trial
    assert trial[0]["groups"] == 1 < trial[1]["groups"] <= 12, trial
    kept, = [c for c in trial if c["kept"]]
    assert kept["median_s"] == min(c["median_s"] for c in trial) > 0
    assert kept["label"] not in ("plan", "free") or ("free" if planned_with == Interference() else "plan") == kept["label"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slow_buckets", [False, True])
def test_near_equal_candidates_are_timed_for_more_rounds(monkeypatch, slow_buckets):
    """A fixed 200 ms in every forward makes the candidates' forward+backward equal within
    VERIFY_MARGIN (at 50 ms, a machine under a load of 60 put them 4% apart in half the runs): the
    trial times them another round, up to VERIFY_ROUNDS, and still settles alike on every rank.
    With 10 ms more per bucket of a plan of several, one round decides. (The rules alone, without
    timing: tests/test_ddp_trial.py.)"""
    from ringtrain.ddp import wrapper
    from ringtrain.plan import Interference

    real_mark = wrapper.DistributedDataParallel._mark_ready

    def mark_ready(self, bucket):
        if slow_buckets and len(self._specs) > 1:
            time.sleep(0.01)
        return real_mark(self, bucket)

    monkeypatch.setattr(wrapper.DistributedDataParallel, "_mark_ready", mark_ready)

    def body(comm):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        model.register_forward_pre_hook(lambda *_: time.sleep(0.2))
        # (medians of 5: with three candidates, of 3 put two of them 3% apart once in a full run)
        ddp = DistributedDataParallel(model, comm, schedule="optimal", alpha=1e-6, beta=1e-7, verify_iterations=5,
                                      interference=Interference(0.05, 0.0))
        # warm-up, profile, single, then two to four candidates for up to three rounds
        train_until_settled(ddp, torch.randn(8, 64), longest_trial(5, probes=0))
        out = ddp.settled, ddp.trial
        ddp.close()
        return out

    results = raise_first(run_comms(2, body))
    assert results[0] == results[1], results
    settled, trial = results[0]
    labels = [c["label"] for c in trial]
    assert settled and labels[:2] == ["plan", "free"] and set(labels) <= {"plan", "free", "mgwfbp", "wfbp"}, trial
    if slow_buckets:
        assert all(c["rounds"] == 1 for c in trial) and trial[0]["kept"], trial
    else:
        assert all(c["rounds"] == plan_trial.VERIFY_ROUNDS for c in trial), trial


def test_probe_groups_cover_the_layers_evenly():
    assert cal.probe_groups(6, 3) == [(0, 1), (2, 3), (4, 5)]
    assert cal.probe_groups(2, 24) == [(0, 0), (1, 1)]
    assert cal.probe_groups(1, 3) == [(0, 0)]
    assert cal.probe_groups(0, 3) == []
    groups = cal.probe_groups(54, 24)
    counts = [b - a + 1 for a, b in groups]
    assert len(groups) == 24 and groups[0][0] == 0 and groups[-1][1] == 53 and max(counts) - min(counts) <= 1


def test_fit_interference_recovers_both_costs():
    launches, nbytes = [23, 2], [3.4e6, 2.4e6]
    per_message, per_byte = 4e-4, 3e-9
    extra = [per_message * k + per_byte * b for k, b in zip(launches, nbytes)]
    fit = cal.fit_interference(launches, nbytes, extra)
    assert fit.per_message == pytest.approx(per_message) and fit.per_byte == pytest.approx(per_byte)


def test_fit_interference_never_negative():
    # no slowdown (or a speed-up, noise): none
    assert cal.fit_interference([23, 2], [3.4e6, 2.4e6], [-2e-3, -1e-3]).is_zero
    # a slowdown the two-parameter line explains only with a negative per-byte cost: per message alone
    fit = cal.fit_interference([23, 2], [3.4e6, 2.4e6], [2e-2, 1e-3])
    assert fit.per_byte == 0.0 and fit.per_message == pytest.approx(float(np.dot([23, 2], [2e-2, 1e-3]) / (23**2 + 4)))
    # NaN measurements (a probe that never ran): none
    assert cal.fit_interference([1, 1], [1.0, 2.0], [float("nan"), 1.0]).is_zero
    # An infinite one (a probe that timed out), or bytes not finite: none, not an infinite cost
    assert cal.fit_interference([1, 2, 3], [10.0, 20.0, 35.0], [float("inf"), 1.0, 2.0]).is_zero
    assert cal.fit_interference([1, 2, 3], [10.0, float("inf"), 35.0], [1.0, 1.0, 2.0]).is_zero


def test_probes_measure_a_per_launch_slowdown(monkeypatch, caplog):
    """Each launch made during backward costs the main thread 20 ms here (a sleep in the hook):
    the trial's probes must attribute the slowdown mostly to launches, not bytes, every rank
    must end with the same interference and plan, and that plan must merge the 12 parameters
    into a few groups."""
    from ringtrain.ddp import wrapper

    caplog.set_level(logging.INFO, logger="ringtrain.ddp")
    real_mark = wrapper.DistributedDataParallel._mark_ready

    def mark_ready(self, bucket):
        before = self._s.launched
        real_mark(self, bucket)
        if self._s.launched > before and self._s.ready < self._s.expected:  # launched during backward
            time.sleep(0.02 * (self._s.launched - before))  # (8 ms was near a loaded machine's noise)

    monkeypatch.setattr(wrapper.DistributedDataParallel, "_mark_ready", mark_ready)

    def body(comm):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        ddp = DistributedDataParallel(model, comm, schedule="optimal", alpha=1e-6, beta=1e-7, verify_iterations=3)
        train_until_settled(ddp, torch.randn(8, 64), longest_trial(3, probes=2))
        ddp.close()
        return ddp.settled, ddp.interference, ddp.plan.groups

    results = raise_first(run_comms(2, body))
    assert results[0] == results[1], results  # same bits on every rank
    settled, slow, groups = results[0]
    assert settled and len(groups) <= 3
    fine_bytes = 11 * (64 * 64 + 64) * 4 / 2  # roughly: 11 of 12 parameters, half of them weights
    assert 0.01 < slow.per_message < 0.04, slow
    assert slow.per_byte * fine_bytes < 0.5 * slow.per_message * 11, slow  # bytes explain less than launches
    assert any("interference measured by probes" in r.getMessage() for r in caplog.records)


def test_without_interference_takes_out_the_modelled_delays():
    from ringtrain.plan import Interference, evaluate

    times, sizes = [1.0, 1.0, 1.0, 1.0], [4.0, 4.0, 4.0, 4.0]
    slow = Interference(0.5, 0.25)
    plan = evaluate(times, sizes, [(0, 1), (2, 2), (3, 3)], 1.0, 0.25, interference=slow)
    # what hook stamps show under this plan: the first layer of groups 1 and 2 waited longer
    observed = np.diff(np.concatenate(([0.0], plan.ready)))
    assert list(observed) == [1.0, 1.0, 3.5, 2.5]
    assert list(cal.without_interference(observed, plan, slow)) == times
    assert list(cal.without_interference(observed, plan, Interference())) == list(observed)


def test_fit_comm_slowdown_recovers_the_factor():
    from ringtrain.plan import Interference, LinearCost, end_times, evaluate

    times, sizes = [1e-3] * 12, [4e5] * 12
    slow = Interference(2e-4, 1e-9)
    probes = [cal.probe_groups(12, 24), cal.probe_groups(12, 3)]
    calls = []

    def model_ends(grid, groups):
        calls.append(len(grid))
        return end_times(times, sizes, groups, grid, cost=LinearCost(1e-4, 1e-8), interference=slow)

    def model_end(s, groups):
        return evaluate(times, sizes, groups, 1e-4, 1e-8, interference=Interference(2e-4, 1e-9, s)).end_time

    measured = [model_end(0.8, g) for g in probes]
    fit = cal.fit_comm_slowdown(model_ends, probes, measured, slow)
    assert fit.comm_slowdown == pytest.approx(0.8) and fit.per_message == 2e-4 and fit.per_byte == 1e-9
    # The whole grid in one call per probe (one evaluation per slowdown and probe took 1 s on
    # 3,000 parameters: 903 of them).
    assert calls == [len(cal.COMM_SLOWDOWN_GRID)] * len(probes)
    # no slowdown measured: none fitted; a probe without a measurement: left as it was
    assert cal.fit_comm_slowdown(model_ends, probes, [model_end(0.0, g) for g in probes], slow).comm_slowdown == 0.0
    assert cal.fit_comm_slowdown(model_ends, probes, [float("nan"), 1.0], slow) is slow


def test_end_times_are_evaluates_end_time_for_every_slowdown_bit_for_bit():
    from ringtrain.plan import Interference, LinearCost, SplitCost, end_times, evaluate

    rng = np.random.default_rng(5)
    times, sizes = rng.uniform(1e-5, 1e-3, 300), rng.uniform(1e2, 1e6, 300)
    cost = SplitCost(LinearCost(7e-5, 2e-10), LinearCost(4e-5, 1.8e-10), 65536)
    for groups in (cal.probe_groups(300, 96), cal.probe_groups(300, 3), [(0, 299)], [(k, k) for k in range(300)]):
        for slow in (Interference(), Interference(1e-4, 3e-9, 7.0)):
            got = end_times(times, sizes, groups, cal.COMM_SLOWDOWN_GRID, cost=cost, interference=slow)
            want = [evaluate(times, sizes, groups, cost=cost, interference=Interference(slow.per_message, slow.per_byte,
                                                                                        float(s))).end_time
                    for s in cal.COMM_SLOWDOWN_GRID]
            assert got.tolist() == want


def test_a_model_of_many_layers_gets_a_third_probe(caplog):
    caplog.set_level(logging.INFO, logger="ringtrain.ddp")

    def body(comm):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(15)])  # 30 parameters
        ddp = DistributedDataParallel(model, comm, schedule="optimal", alpha=1e-6, beta=1e-9, verify_iterations=1)
        steps = train_until_settled(ddp, torch.randn(2, 4), longest_trial(1, probes=3))
        ddp.close()
        return ddp.settled, steps, ddp.interference, ddp.trial

    results = raise_first(run_comms(2, body))
    assert results[0] == results[1] and results[0][0]
    # warm-up, profile, then finest, fine, coarse, single and (unless every candidate is one
    # allreduce) the candidates in turn, one iteration each, for one to three rounds
    _, steps, _, trial = results[0]
    rounds = trial[0]["rounds"] if trial else 0
    assert steps == 1 + 2 + 4 + rounds * len(trial), (steps, trial)
    assert any("probes of 30, 24, 3 groups" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(30)
def test_a_given_cost_is_planned_with_and_skips_the_sweep():
    cost = SplitCost(LinearCost(1e-5, 1e-9), LinearCost(1e-3, 1e-10), 65536.0)

    def body(comm):
        ddp = DistributedDataParallel(nn.Linear(300, 300), comm, schedule="wfbp", cost=cost, warmup_iterations=0,
                                      profile_iterations=1)
        for _ in range(2):
            ddp(torch.ones(2, 300)).sum().backward()
        ddp.close()
        return ddp.cost, ddp.alpha, ddp.beta, ddp.plan

    for got, alpha, beta, plan in raise_first(run_comms(2, body)):
        assert got is cost and (alpha, beta) == (1e-3, 1e-10)
        # wfbp: the bias (1,200 B) on the small line, the weight (360,000 B) on the large one
        assert sorted(plan.group_bytes) == [1200.0, 360000.0]
        for start, end, nbytes in zip(plan.starts, plan.ends, plan.group_bytes):
            assert end - start == pytest.approx(cost(nbytes), rel=1e-12)


def trial_with_one_fast_candidate(monkeypatch, caplog, fast, layers: int, width: int, **options) -> tuple:
    """2 ranks train ``layers`` Linear(width, width) under schedule="optimal" with ``options`` until
    the trial is over, then 3 steps more (re-plans: any drift re-plans); every layout but those
    ``fast(wrapper)`` accepts is made slow (10 ms per ready bucket). Returns, alike on every rank:
    settled, kept, the plan's method and groups after the re-plans, the groups when settled, the
    trial's record; and rank 0's "candidates verified" and plan log lines."""
    from ringtrain.ddp import wrapper

    caplog.set_level(logging.INFO, logger="ringtrain.ddp")
    real_mark = wrapper.DistributedDataParallel._mark_ready

    def mark_ready(self, bucket):
        if not fast(self):
            time.sleep(0.01)
        return real_mark(self, bucket)

    monkeypatch.setattr(wrapper.DistributedDataParallel, "_mark_ready", mark_ready)

    def body(comm):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        ddp = DistributedDataParallel(model, comm, schedule="optimal", verify_iterations=2, replan_interval=1,
                                      drift_threshold=1e-9, **options)
        x = torch.randn(8, width)
        train_until_settled(ddp, x, longest_trial(2, probes=3))
        settled_groups = ddp.plan.groups
        for _ in range(3):
            ddp(x).sum().backward()
        out = ddp.settled, ddp.kept, ddp.plan.method, ddp.plan.groups, settled_groups, ddp.trial
        ddp.close()
        return out

    results = raise_first(run_comms(2, body))
    assert results[0] == results[1], results
    messages = [r.getMessage() for r in caplog.records]
    return (*results[0], [m for m in messages if "candidates verified" in m], [m for m in messages if "plan (" in m])


def test_torch_ddps_default_buckets_are_a_candidate_and_kept_when_fastest(monkeypatch, caplog):
    """Every plan but one of two buckets (torch DDP's default caps: the first closed at 1 MiB,
    then 25 MiB) made slow: the trial times DDP's buckets beside its own candidates and keeps
    them, on every rank; re-plans leave them alone (the profile does not change them)."""
    # (263 KB a layer: 4 in DDP's first bucket)
    settled, kept, _, groups, _, trial, verified, _ = trial_with_one_fast_candidate(
        monkeypatch, caplog, lambda ddp: len(ddp._specs) == 2, 8, 256, alpha=1e-6, beta=1e-7)
    assert settled and "buckets" in [c["label"] for c in trial], trial
    assert kept == "buckets" and groups == [(0, 7), (8, 15)], (kept, groups, trial)
    assert verified and "keeping torch DDP's default buckets" in verified[0], verified


def test_mgwfbps_merge_is_a_candidate_and_kept_when_fastest_and_replans_keep_its_rule(monkeypatch, caplog):
    """MG-WFBP's merge (made to group the 9 layers in threes here) beside the trial's other
    candidates; every other layout made slow: the trial keeps it on every rank, and re-plans
    after a drift plan by MG-WFBP's rule again, not by the schedule asked for."""
    from ringtrain import plan as planner

    threes = [(0, 5), (6, 11), (12, 17)]  # 9 layers, weight and bias each: 18 parameters
    monkeypatch.setattr(planner, "_mgwfbp_groups", lambda ready, sizes, cost: list(threes))
    settled, kept, method, groups, _, trial, verified, plans = trial_with_one_fast_candidate(
        monkeypatch, caplog, lambda ddp: ddp.plan.groups == threes, 9, 64, alpha=1e-6, beta=1e-7)
    labels = [c["label"] for c in trial]
    assert settled and "mgwfbp" in labels and labels.index("mgwfbp") > labels.index("plan"), trial
    assert kept == "mgwfbp" and method == "mgwfbp" and groups == threes, (kept, method, groups, trial)
    assert verified and "keeping the MG-WFBP merge" in verified[0], verified
    assert len(plans) >= 2 and "plan (mgwfbp" in plans[-1], plans


def test_wfbp_is_a_candidate_and_kept_when_fastest_and_replans_keep_its_rule(monkeypatch, caplog):
    """One allreduce per layer beside the trial's other candidates (whose start-up cost, 1 ms
    here, makes them merge); every other layout made slow in the trial (not in the profile, which
    would then plan per layer): the trial keeps WFBP on every rank, and re-plans after a drift
    plan by WFBP's rule again."""
    per_layer = [(i, i) for i in range(8)]  # 4 layers, weight and bias each
    settled, kept, method, groups, _, trial, verified, plans = trial_with_one_fast_candidate(
        monkeypatch, caplog, lambda ddp: ddp._planning.trial is None or ddp.plan.groups == per_layer, 4, 64,
        alpha=1e-3, beta=1e-9)
    assert settled and "wfbp" in [c["label"] for c in trial], trial
    assert kept == "wfbp" and method == "wfbp" and groups == per_layer, (kept, method, groups, trial)
    assert verified and "keeping one allreduce per layer (WFBP)" in verified[0], verified
    assert len(plans) >= 2 and "plan (wfbp" in plans[-1], plans


def test_bucket_cap_mb_buckets_are_a_candidate_kept_when_fastest_and_not_replanned(monkeypatch, caplog):
    """Buckets of ``bucket_cap_mb`` (the ``fixed`` schedule's) beside the trial's other candidates;
    every other layout made slow in the trial (torch DDP's default buckets, two here, too): the
    trial keeps them on every rank, and re-plans after a drift leave them as they are (by size, as
    the ``fixed`` schedule lays them out; re-planned by the optimal rule they would change)."""
    settled, kept, method, groups, when_settled, trial, verified, _ = trial_with_one_fast_candidate(
        monkeypatch, caplog,
        lambda ddp: ddp._planning.trial is None or (ddp.plan.method == "fixed" and len(ddp.plan.groups) > 2),
        8, 256, alpha=1e-6, beta=1e-7, bucket_cap_mb=0.6)  # (263 KB a layer)
    assert settled and kept == "fixed" and method == "fixed" and len(groups) > 2, (kept, method, groups, trial)
    assert groups == when_settled, (when_settled, groups)
    assert verified and "keeping buckets of bucket_cap_mb" in verified[0], verified
