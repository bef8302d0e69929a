"""The trial of plans (ringtrain.ddp.trial) without communication: what it lays out, when it
times another round, which candidate stays, and that it decides on the numbers the ranks agreed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ringtrain import plan as planner
from ringtrain.ddp.trial import CANDIDATES, DROP_AFTER, DROP_FACTOR, VERIFY_MARGIN, VERIFY_ROUNDS, PlanTrial

pytestmark = pytest.mark.timeout(30)

COST = planner.LinearCost(1e-4, 1e-8)


class FakeWrapper:
    """What a wrapper lends its trial, recorded: every layout installed, the one in force, every
    agreement; ``agreed`` may change what the other ranks would have made of an array."""

    def __init__(self, sizes, agreed=None):
        self.sizes = sizes
        self.installed: list[list[tuple[int, int]]] = []
        self.in_force = None
        self.agreements: list[tuple[str, str]] = []
        self.agreed = agreed or (lambda label, values: None)
        self.logged: list[str] = []

    def install(self, plan):
        layout = len(self.installed)
        self.installed.append(list(plan.groups))
        self.in_force = layout
        specs = [SimpleNamespace(nbytes=float(self.sizes[a:b + 1].sum())) for a, b in plan.groups]
        return layout, specs

    def use(self, layout):
        self.in_force = layout

    def agree(self, label, values, op):
        self.agreements.append((label, op))
        self.agreed(label, values)

    def trial(self, times, probe=True, iterations=3, interference=planner.NO_INTERFERENCE, bucket_cap_mb=25.0):
        return PlanTrial(np.asarray(times, dtype=np.float64), self.sizes, COST, interference, iterations, probe,
                         install=self.install, use=self.use, agree=self.agree, log=self.logged.append,
                         bucket_cap_mb=bucket_cap_mb)


def run_trial(trial: PlanTrial, fake: FakeWrapper, forward_backward: dict, limit: int = 200) -> int:
    """Step ``trial`` until it is over, each iteration taking ``forward_backward[label]`` seconds
    for the candidate in force (phases: 0.1 s); the iterations run."""
    trial.start()
    for n in range(1, limit + 1):
        if trial.over:
            return n - 1
        name = trial.phases[trial.k]
        if name == "verify":
            label = trial.candidates[trial.turn]["label"]
            assert fake.in_force == trial.candidates[trial.turn]["layout"], "the candidate timed is not in force"
            seconds = forward_backward[label]
        else:
            seconds = 0.1
        trial.step((seconds * 0.6, seconds, seconds * 0.7))
    raise AssertionError(f"the trial was not over after {limit} iterations")


def many_layers(n=30):
    return np.full(n, 1e-3), np.full(n, 4e5)


def test_phases_follow_the_model_and_the_options():
    times, sizes = many_layers(30)
    fake = FakeWrapper(sizes)
    assert fake.trial(times).phases == ["finest", "fine", "coarse", "single", "verify"]
    assert fake.trial(times[:5]).phases == ["fine", "coarse", "single", "verify"]
    assert fake.trial(times[:1]).phases == ["single", "verify"]  # one layer: nothing to probe
    assert fake.trial(times, probe=False).phases == ["single", "verify"]  # the interference given


def test_the_clearly_fastest_candidate_stays_after_one_round():
    times, sizes = many_layers()
    fake = FakeWrapper(sizes)
    trial = fake.trial(times)
    trial.start()
    while trial.phases[trial.k] != "verify":  # the probes and the single allreduce
        trial.step((0.06, 0.1, 0.07))
    labels = [c["label"] for c in trial.candidates]
    assert labels[0] == "plan" and set(labels) <= set(CANDIDATES) and len(labels) >= 2, labels
    assert trial.layouts == {}, "the probes' buckets are still held (a copy of the gradients each)"
    # one layout per candidate: the single allreduce's buckets serve the one of one group
    assert len({c["layout"] for c in trial.candidates}) == len(labels)
    one, = [c for c in trial.candidates if len(c["plan"].groups) == 1]
    assert one["layout"] == fake.installed.index([(0, 29)]), "the single phase's buckets laid out again"
    assert labels == [label for label in CANDIDATES if label in labels], "not in CANDIDATES' order (the earlier of equals stays)"
    groupings = [tuple(c["plan"].groups) for c in trial.candidates]
    assert len(set(groupings)) == len(groupings), "two candidates grouped alike"
    slow = {label: 0.2 for label in labels}
    winner = labels[-1]
    slow[winner] = 0.1
    while not trial.over:
        label = trial.candidates[trial.turn]["label"]
        trial.step((0.1, slow[label], 0.1))
    assert trial.kept == winner
    assert [c["kept"] for c in trial.record] == [c == winner for c in labels]
    assert all(c["rounds"] == 1 for c in trial.record), trial.record
    assert trial.record[labels.index(winner)]["median_s"] == pytest.approx(0.1)
    # The winner is laid out afresh, last, and is in force.
    kept_plan = next(c for c in trial.record if c["kept"])
    assert len(fake.installed[-1]) == kept_plan["groups"] and fake.in_force == len(fake.installed) - 1
    assert trial.candidates == [] and trial.layouts == {}  # the trial's layouts dropped (before the winner's)
    assert "keeping " + CANDIDATES[winner] in fake.logged[-1]


def test_near_equal_candidates_run_up_to_the_last_round_and_the_earlier_of_equals_stays():
    times, sizes = many_layers()
    fake = FakeWrapper(sizes)
    trial = fake.trial(times)
    within = 1 + VERIFY_MARGIN / 2
    seconds = {label: 0.1 * within for label in CANDIDATES}
    seconds["plan"] = 0.1
    run_trial(trial, fake, seconds)
    assert trial.kept == "plan"
    assert all(c["rounds"] == VERIFY_ROUNDS for c in trial.record), trial.record
    # All equal: the earlier stays.
    fake = FakeWrapper(sizes)
    trial = fake.trial(times)
    run_trial(trial, fake, {label: 0.1 for label in CANDIDATES})
    assert trial.kept == "plan" and all(c["rounds"] == VERIFY_ROUNDS for c in trial.record)


def test_it_decides_on_the_medians_the_ranks_agreed_not_its_own():
    """Another rank found the plan slow (the allreduce-max of the medians): every rank keeps what
    the agreed numbers say, whatever its own said."""
    times, sizes = many_layers()

    def agreed(label, values):
        if label == "verify plan":
            values[0] = 1.0  # "plan" is first: the slowest rank took a second

    fake = FakeWrapper(sizes, agreed)
    trial = fake.trial(times)
    run_trial(trial, fake, {label: 0.1 for label in CANDIDATES} | {"plan": 0.05})
    assert trial.kept != "plan"
    assert ("verify plan", "max") in fake.agreements


def test_the_interference_is_fitted_then_broadcast_from_rank_0():
    times, sizes = many_layers()
    rank0 = (2e-4, 3e-10, 0.5)

    def agreed(label, values):
        if label == "interference fit":
            values[:] = rank0

    fake = FakeWrapper(sizes, agreed)
    trial = fake.trial(times)
    run_trial(trial, fake, {label: 0.1 for label in CANDIDATES})
    assert trial.interference == planner.Interference(*rank0)
    assert [a for a in fake.agreements if a[0].startswith("interference")] == [
        ("interference probes", "max"), ("interference fit", "broadcast")]
    # The plan candidate was made with it.
    assert trial.record[0]["label"] == "plan"


def test_a_given_interference_is_kept_and_the_probes_skipped():
    times, sizes = many_layers()
    given = planner.Interference(1e-3, 0.0)
    fake = FakeWrapper(sizes)
    trial = fake.trial(times, probe=False, interference=given)
    iterations = run_trial(trial, fake, {label: 0.1 for label in CANDIDATES})
    assert trial.interference == given
    assert not any(a[0].startswith("interference") for a in fake.agreements)
    candidates = len(trial.record)
    assert iterations == 3 + VERIFY_ROUNDS * 3 * candidates  # single phase, then every round of each


def test_one_candidate_left_ends_the_trial_at_once():
    """One layer: every candidate is one group, so the plan stays untimed."""
    fake = FakeWrapper(np.array([8.0]))
    trial = fake.trial([1e-3])
    iterations = run_trial(trial, fake, {})
    assert trial.kept == "plan" and trial.record == [] and iterations == 3
    assert "alike; keeping it" in fake.logged[-1]


def test_every_other_schedule_is_a_candidate_and_wins_where_it_is_fastest():
    """WFBP and buckets of bucket_cap_mb are timed too (every schedule bench train compares), so
    the plan kept is never slower than another schedule beyond the trial's noise."""
    times, sizes = many_layers()  # 30 layers of 0.4 MB: WFBP's 30 groups, 2 MiB buckets' 5
    fake = FakeWrapper(sizes)
    trial = fake.trial(times, probe=False, interference=planner.Interference(1e-3, 0.0), bucket_cap_mb=2.0)
    trial.start()
    while trial.phases[trial.k] != "verify":  # the single allreduce's phase
        trial.step((0.06, 0.1, 0.07))
    by_label = {c["label"]: c["plan"].groups for c in trial.candidates}
    assert by_label["wfbp"] == [(i, i) for i in range(30)], by_label
    assert by_label["fixed"] == planner.merge(times, sizes, cost=COST, method="fixed", bucket_cap_mb=2.0).groups
    assert len(by_label["fixed"]) == 5, by_label
    for winner in ("wfbp", "fixed"):
        fake = FakeWrapper(sizes)
        trial = fake.trial(times, probe=False, interference=planner.Interference(1e-3, 0.0), bucket_cap_mb=2.0)
        run_trial(trial, fake, {label: 0.2 for label in CANDIDATES} | {winner: 0.1})
        assert trial.kept == winner and len(fake.installed[-1]) == len(by_label[winner]), (trial.kept, fake.installed[-1])


def run_counting(trial: PlanTrial, fake: FakeWrapper, forward_backward: dict) -> dict:
    """run_trial, counting the verify iterations each candidate ran."""
    counts: dict[str, int] = {}

    class Counting(dict):
        def __getitem__(self, label):
            counts[label] = counts.get(label, 0) + 1
            return forward_backward[label]

    run_trial(trial, fake, Counting())
    return counts


@pytest.mark.parametrize("iterations", [5, 2])
def test_a_candidate_far_slower_than_the_fastest_is_dropped_and_takes_no_more_turns(iterations):
    """WFBP over thousands of small parameters runs many times slower than the others: after
    DROP_AFTER iterations (or its first round, where that is all) it takes no more turns, while
    the near-equal others run every round."""
    times, sizes = many_layers()
    fake = FakeWrapper(sizes)
    trial = fake.trial(times, iterations=iterations)
    within = 1 + VERIFY_MARGIN / 2
    seconds = {label: 0.1 * within for label in CANDIDATES} | {"plan": 0.1, "wfbp": 0.5}
    counts = run_counting(trial, fake, seconds)
    assert counts.pop("wfbp") == min(DROP_AFTER, iterations), counts
    assert set(counts.values()) == {VERIFY_ROUNDS * iterations}, counts
    assert trial.kept == "plan"
    wfbp, = [c for c in trial.record if c["label"] == "wfbp"]
    assert wfbp["rounds"] == 1 and wfbp["median_s"] == pytest.approx(0.5) and not wfbp["kept"]
    assert any("dropped from the trial" in line for line in fake.logged)
    assert fake.in_force == len(fake.installed) - 1 and len(fake.installed[-1]) == trial.record[0]["groups"]


def test_a_candidate_within_drop_factor_is_timed_to_the_end():
    times, sizes = many_layers()
    fake = FakeWrapper(sizes)
    trial = fake.trial(times, iterations=5)
    within = 1 + VERIFY_MARGIN / 2
    seconds = {label: 0.1 * within for label in CANDIDATES} | {"plan": 0.1, "wfbp": 0.1 * DROP_FACTOR}
    counts = run_counting(trial, fake, seconds)
    assert set(counts.values()) == {VERIFY_ROUNDS * 5}, counts
    assert not any("dropped" in line for line in fake.logged)
