"""Tests of ringtrain.plan (merge planners) and ringtrain.sim.calibrate.fit_alpha_beta.

Hand-computed cases use numbers exact in binary floating point (integers, quarters), so
their expected timings are compared with ==. The optimum is checked against an independent
brute force over every contiguous partition.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from groupings import contiguous_groupings
from ringtrain.plan import METHODS, Interference, LinearCost, Plan, evaluate, merge
from ringtrain.sim.calibrate import fit_alpha_beta

pytestmark = pytest.mark.timeout(60)


# --- an independent reference --------------------------------------------------------------


def brute_force(backward_times, sizes, cost):
    """(best end, best groups) over all 2^(n-1) contiguous partitions, written from scratch."""
    n = len(sizes)
    ready, acc = [], 0.0
    for t in backward_times:
        acc += t
        ready.append(acc)
    best, best_groups = math.inf, None
    for groups in contiguous_groupings(n):
        end = 0.0
        for a, b in groups:
            end = max(ready[b], end) + cost(float(sum(sizes[a : b + 1])))
        if end < best:
            best, best_groups = end, groups
    return best, best_groups


def random_instance(rng, n):
    kind = rng.integers(3)
    if kind == 0:  # integers: exact sums
        times = rng.integers(0, 5, n).astype(float).tolist()
        sizes = (rng.integers(0, 6, n) * 4).astype(float).tolist()
    elif kind == 1:  # realistic magnitudes: ms of backward, MB of gradients
        times = rng.uniform(0, 2e-3, n).tolist()
        sizes = rng.integers(0, 8_000_000, n).astype(float).tolist()
    else:  # heavy-tailed: a few big layers among many small ones
        times = (rng.pareto(1.5, n) * 1e-4).tolist()
        sizes = np.floor(rng.pareto(1.0, n) * 1e5).tolist()
    return times, sizes


# --- the optimum -------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_optimal_equals_brute_force_linear_cost():
    rng = np.random.default_rng(2021)
    for n in range(1, 13):
        for _ in range(40 if n <= 9 else 15):
            times, sizes = random_instance(rng, n)
            alpha = float(rng.choice([0.0, 1e-5, 2.5e-4, 1e-3, 1.0]))
            beta = float(rng.choice([0.0, 1e-10, 8e-10, 8e-9, 0.25]))
            plan = merge(times, sizes, alpha, beta)
            best, _ = brute_force(times, sizes, LinearCost(alpha, beta))
            assert plan.end_time <= best * (1 + 1e-12), (n, times, sizes, alpha, beta)
            assert plan.end_time >= best * (1 - 1e-12), (n, times, sizes, alpha, beta)


@pytest.mark.timeout(120)
def test_optimal_equals_brute_force_custom_cost():
    # A concave cost (start-up plus a square root) and a step cost: the DP is exact for any
    # cost because a group's end is monotone in the previous group's end.
    def concave(b):
        return 1e-4 + 1e-6 * np.sqrt(b)

    def steps(b):
        return 1e-3 * np.ceil(np.asarray(b) / 1e6 + 1)

    rng = np.random.default_rng(7)
    for cost in (concave, steps):
        for n in range(1, 11):
            for _ in range(10):
                times, sizes = random_instance(rng, n)
                plan = merge(times, sizes, cost=cost)
                best, _ = brute_force(times, sizes, lambda b: float(cost(b)))
                assert abs(plan.end_time - best) <= 1e-12 * max(best, 1e-300), (n, times, sizes)


def test_optimal_without_the_cost_table(monkeypatch):
    # Large models cost each row of candidate groups separately instead of in one table.
    import ringtrain.plan as plan_module

    rng = np.random.default_rng(17)
    cases = [random_instance(rng, int(rng.integers(1, 11))) for _ in range(60)]
    with_table = [merge(t, s, 2.5e-4, 8e-10) for t, s in cases]
    monkeypatch.setattr(plan_module, "_COST_TABLE_LIMIT", 0)
    monkeypatch.setattr(plan_module, "_COST_TABLE_LIMIT_LINEAR", 0)
    for (times, sizes), expected in zip(cases, with_table):
        plan = merge(times, sizes, 2.5e-4, 8e-10)
        assert plan.groups == expected.groups and plan.end_time == expected.end_time
        best, _ = brute_force(times, sizes, LinearCost(2.5e-4, 8e-10))
        assert plan.end_time == pytest.approx(best, rel=1e-12, abs=0)


def test_optimal_on_integer_data_is_exactly_the_brute_force_optimum():
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        times = rng.integers(0, 5, n).astype(float).tolist()
        sizes = (rng.integers(0, 6, n) * 4).astype(float).tolist()
        alpha = float(rng.integers(0, 4))
        best, _ = brute_force(times, sizes, LinearCost(alpha, 0.25))
        assert merge(times, sizes, alpha, 0.25).end_time == best


def test_optimal_is_never_worse_than_any_other_method():
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(0, 40))
        times, sizes = random_instance(rng, n)
        alpha = float(rng.choice([0.0, 1e-5, 2.5e-4, 9.08e-4]))
        beta = float(rng.choice([1e-10, 7.4e-10, 8e-9]))
        cap = float(rng.choice([0.5, 1.0, 25.0]))
        best = merge(times, sizes, alpha, beta).end_time
        for method in METHODS:
            other = merge(times, sizes, alpha, beta, method=method, bucket_cap_mb=cap, first_bucket_mb=1.0)
            assert best <= other.end_time, (method, times, sizes, alpha, beta)



@pytest.mark.timeout(120)
def test_optimal_is_never_worse_than_any_other_method_under_every_kind_of_cost():
    # The test above uses the linear cost only; the planner has other programs for a cost
    # table, a split cost, a parameter server's drain and interference (one per group count
    # when per_message > 0), each timed by every method's evaluate. Sizes up to 60 layers
    # (beyond the brute force's reach).
    from ringtrain.plan import SplitCost
    from ringtrain.sim import costs

    rng = np.random.default_rng(2026)
    for k in range(400):
        n = int(rng.integers(0, 61))
        times, sizes = random_instance(rng, n)
        kind = k % 4
        if kind == 0:  # an allreduce formula of sim.costs at some world size
            algorithm = str(rng.choice(["ring", "naive", "halving_doubling", "binomial_tree"]))
            rate = dict(cost=costs.allreduce_cost(int(rng.integers(2, 300)), algorithm,
                                                  alpha=float(rng.uniform(0, 1e-3)), beta=float(rng.uniform(0, 1e-8))))
        elif kind == 1:  # parameter servers: the pushes occupy the stream, the last pull drains
            ps = costs.allreduce_cost(int(rng.integers(2, 64)), "ps", alpha=float(rng.uniform(0, 1e-3)),
                                      beta=float(rng.uniform(0, 1e-8)), servers=int(rng.integers(1, 5)),
                                      partition_bytes=int(rng.integers(1, 10**7)))
            rate = dict(cost=ps.occupancy, drain=ps.drain)
        elif kind == 2:  # two lines split at 64 KiB, as the communicator's auto
            rate = dict(cost=SplitCost(LinearCost(float(rng.uniform(0, 1e-3)), 1e-9),
                                       LinearCost(float(rng.uniform(0, 1e-3)), 5e-10), 65536.0))
        else:  # interference: every combination of its three terms, each zero or not
            slow = Interference(*(float(rng.choice([0.0, hi * rng.uniform()])) for hi in (1e-3, 1e-9, 12.0)))
            rate = dict(alpha=float(rng.uniform(0, 1e-3)), beta=float(rng.uniform(0, 1e-8)), interference=slow)
        best = merge(times, sizes, **rate).end_time
        for method in METHODS:
            other = merge(times, sizes, method=method, bucket_cap_mb=float(rng.choice([0.5, 1.0, 25.0])),
                          first_bucket_mb=float(rng.choice([0.1, 1.0])), **rate)
            assert best <= other.end_time, (k, method, n, rate)

def test_optimal_plan_is_consistent_with_evaluate():
    rng = np.random.default_rng(5)
    times, sizes = random_instance(rng, 30)
    plan = merge(times, sizes, 1e-4, 1e-9)
    again = evaluate(times, sizes, plan.groups, 1e-4, 1e-9)
    assert again.end_time == plan.end_time
    assert again.starts == plan.starts and again.ends == plan.ends


# --- hand-computed cases, one per method -------------------------------------------------
# backward times [1, 1, 1] -> ready [1, 2, 3]; sizes 4 bytes each; alpha 1, beta 0.25:
# cost(4) = 2, cost(8) = 3, cost(12) = 4.
T3, S3, A3, B3 = [1.0, 1.0, 1.0], [4.0, 4.0, 4.0], 1.0, 0.25


def test_wfbp_hand_computed():
    plan = merge(T3, S3, A3, B3, method="wfbp")
    assert plan.groups == [(0, 0), (1, 1), (2, 2)]
    assert plan.starts == [1.0, 3.0, 5.0]
    assert plan.ends == [3.0, 5.0, 7.0]
    assert plan.end_time == 7.0
    assert plan.group_bytes == [4.0, 4.0, 4.0]
    assert plan.ready == [1.0, 2.0, 3.0]


def test_single_hand_computed():
    plan = merge(T3, S3, A3, B3, method="single")
    assert plan.groups == [(0, 2)]
    assert (plan.starts, plan.ends, plan.end_time) == ([3.0], [7.0], 7.0)
    assert plan.comm_time == 4.0 and plan.exposed_time == 4.0 and plan.hidden_fraction == 0.0


def test_optimal_hand_computed():
    # Partitions: wfbp 7, single 7, {0,1}{2}: [2,5] then [5,7] = 7, {0}{1,2}: [1,3] then [3,6] = 6.
    plan = merge(T3, S3, A3, B3)
    assert plan.groups == [(0, 0), (1, 2)]
    assert plan.starts == [1.0, 3.0] and plan.ends == [3.0, 6.0]
    assert plan.end_time == 6.0


def test_mgwfbp_hand_computed_where_greedy_loses():
    # ready [1, 2, 3, 6]; cost(b) = 2 + b/4.
    # k=0: open {0} 12 B: start 1, end 6; layer 1 ready at 2 < 6 and 2 - 1 = 1 < alpha: merge.
    # k=1: open {0,1} 16 B: start 2, end 8; layer 2 ready at 3 < 8 and 3 - 2 < 2: merge.
    # k=2: open {0,1,2} 24 B: start 3, end 11; layer 3 ready at 6 < 11 but 6 - 3 = 3 >= 2: close.
    # last {3} 0 B: start max(6, 11) = 11, end 13.
    # The optimum {0}{1,2,3}: [1, 6] then start max(6, 6), cost 5 -> 11.
    times, sizes = [1.0, 1.0, 1.0, 3.0], [12.0, 4.0, 8.0, 0.0]
    greedy = merge(times, sizes, 2.0, 0.25, method="mgwfbp")
    assert greedy.groups == [(0, 2), (3, 3)]
    assert greedy.ends == [11.0, 13.0]
    best = merge(times, sizes, 2.0, 0.25)
    assert best.groups == [(0, 0), (1, 3)]
    assert best.end_time == 11.0


def test_mgwfbp_merges_when_the_stream_is_busy():
    # ready [1, 2, 3]; cost(16) = 5, cost(4) = 2, cost(8) = 3.
    # k=0: {0} start 1, end 6; layer 1 ready at 2, 2 - 1 = 1 is not < alpha = 1: close.
    # k=1: {1} start max(2, 6) = 6 > ready of layer 2 (3): merge (it could not start earlier).
    plan = merge([1.0, 1.0, 1.0], [16.0, 4.0, 4.0], 1.0, 0.25, method="mgwfbp")
    assert plan.groups == [(0, 0), (1, 2)]
    assert plan.ends == [6.0, 9.0]
    assert merge([1.0, 1.0, 1.0], [16.0, 4.0, 4.0], 1.0, 0.25).end_time == 9.0


def test_mgwfbp_keeps_layers_apart_when_communication_is_hidden():
    # Each allreduce (cost 1.25) ends before the next layer is ready (2 s apart): nothing merges.
    plan = merge([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], 1.0, 0.25, method="mgwfbp")
    assert plan.groups == [(0, 0), (1, 1), (2, 2)]


def test_mgwfbp_does_not_merge_a_layer_ready_exactly_when_the_allreduce_could_start():
    # ready [1, 1]; alpha 0, cost(4) = 4. k=0: start 1, end 5; layer 1 ready at 1 < 5, but the
    # allreduce could start at 1 = its ready time (not later: the authors' taoc[l] > current_taob
    # is strict) and waiting 0 saves nothing (0 < alpha = 0 is false): keep them apart.
    plan = merge([1.0, 0.0], [4.0, 4.0], 0.0, 1.0, method="mgwfbp")
    assert plan.groups == [(0, 0), (1, 1)]
    assert plan.ends == [5.0, 9.0]


def test_mgwfbp_with_a_custom_cost_saves_cost_a_plus_cost_b_minus_cost_both():
    # A callable that is not a LinearCost but has the same line: the saving
    # cost(open) + cost(next) - cost(both) is alpha, so the greedy makes the same groups as with
    # LinearCost (integers and quarters: the subtraction is exact). The hand case first.
    line = lambda b: 2.0 + 0.25 * np.asarray(b, dtype=np.float64)  # noqa: E731
    greedy = merge([1.0, 1.0, 1.0, 3.0], [12.0, 4.0, 8.0, 0.0], cost=line, method="mgwfbp")
    assert greedy.groups == [(0, 2), (3, 3)] and greedy.ends == [11.0, 13.0]  # as the linear case above
    rng = np.random.default_rng(11)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        times = rng.integers(0, 5, n).astype(float).tolist()
        sizes = (rng.integers(0, 9, n) * 4).astype(float).tolist()
        assert (merge(times, sizes, cost=line, method="mgwfbp").groups
                == merge(times, sizes, 2.0, 0.25, method="mgwfbp").groups), (times, sizes)


def test_fixed_threshold_like_ddp():
    mib = 1024 * 1024
    sizes = [0.5 * mib, 0.5 * mib, 0.25 * mib, 1.0 * mib, 0.125 * mib]
    times = [1.0] * 5
    plan = merge(times, sizes, 0.0, 0.0, method="fixed", bucket_cap_mb=1.0)
    assert plan.groups == [(0, 1), (2, 3), (4, 4)]  # a bucket closes once it holds >= the cap
    first = merge(times, sizes, 0.0, 0.0, method="fixed", bucket_cap_mb=1.0, first_bucket_mb=0.5)
    assert first.groups == [(0, 0), (1, 3), (4, 4)]
    whole = merge(times, sizes, 0.0, 0.0, method="fixed", bucket_cap_mb=25.0)
    assert whole.groups == [(0, 4)]


def test_custom_grouping_evaluated():
    plan = evaluate(T3, S3, [(0, 1), (2, 2)], A3, B3)
    assert plan.method == "custom"
    assert plan.starts == [2.0, 5.0] and plan.ends == [5.0, 7.0]


def test_gamma_adds_to_beta():
    plan = merge([0.0], [8.0], 1.0, 0.25, method="single", gamma=0.125)
    assert plan.end_time == 1.0 + 8 * 0.375


def test_cost_that_takes_only_scalars():
    def scalar_only(b):
        if not isinstance(b, float):
            raise TypeError("scalars only")
        return 1.0 + b / 4

    assert merge(T3, S3, cost=scalar_only).end_time == 6.0


# --- edges and errors --------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_zero_layers(method):
    plan = merge([], [], 1e-4, 1e-9, method=method)
    assert plan.groups == [] and plan.end_time == 0.0 and plan.backward_time == 0.0
    assert "0 layers" in plan.describe()
    # No communication is all hidden ("100% hidden"), as are allreduces that take no time.
    free = merge([1.0, 2.0, 1.0], [3.0, 5.0, 7.0], 0.0, 0.0, method=method)
    for p in (plan, free):
        assert p.comm_time == 0.0 and p.exposed_time == 0.0 and p.hidden_fraction == 1.0
    assert "100% hidden" in plan.describe()


@pytest.mark.parametrize("method", METHODS)
def test_one_layer(method):
    plan = merge([2.0], [4.0], 1.0, 0.25, method=method)
    assert plan.groups == [(0, 0)] and plan.end_time == 4.0


@pytest.mark.parametrize(
    "times, sizes, needle",
    [
        ([1.0, 2.0], [1.0], "equal"),
        ([1.0, -1.0], [1.0, 1.0], "backward_times[1]"),
        ([1.0, float("nan")], [1.0, 1.0], "backward_times[1]"),
        ([1.0], [float("inf")], "sizes_bytes[0]"),
        ([1.0], [-4.0], "sizes_bytes[0]"),
        ([[1.0]], [[1.0]], "backward_times"),
        (["a"], [1.0], "backward_times"),
    ],
)
def test_invalid_layers(times, sizes, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        merge(times, sizes, 1.0, 1.0)



@pytest.mark.parametrize(
    "times, sizes, message",
    [
        ([1.0], [10**400], "sizes_bytes[0] = inf; every entry must be finite and >= 0"),  # was OverflowError
        ([1.0, float("nan")], [1.0, 1.0], "backward_times[1] = nan;"),  # was "= np.float64(nan)"
        ([1.0], [-4.0], "sizes_bytes[0] = -4.0;"),
        (0.5, [1.0], "backward_times must be a sequence of numbers (a list, tuple or 1-D array), got float"),
        ((t for t in [1.0]), [1.0], "backward_times must be a sequence of numbers (a list, tuple or 1-D array), got generator"),
    ],
)
def test_invalid_layers_say_what_is_wrong_in_plain_numbers(times, sizes, message):
    # A scalar or a generator was "must be one-dimensional, got shape ()".
    with pytest.raises(ValueError) as info:
        merge(times, sizes, 1.0, 1.0)
    assert message in str(info.value)


@pytest.mark.parametrize("value", [-1.0, 0, 0.0, float("inf")])
def test_bucket_caps_say_greater_than_zero(value):
    # -1 was told "it must be finite and >= 0", and then 0 "it must be > 0".
    for name in ("bucket_cap_mb", "first_bucket_mb"):
        with pytest.raises(ValueError, match=f"{name}=.*; it must be finite and > 0"):
            merge(T3, S3, 1.0, 1.0, method="fixed", **{name: value})

def test_invalid_options():
    with pytest.raises(ValueError, match="method"):
        merge(T3, S3, 1.0, 1.0, method="greedy")
    with pytest.raises(ValueError, match="alpha"):
        merge(T3, S3, -1.0, 1.0)
    with pytest.raises(ValueError, match="beta"):
        merge(T3, S3, 1.0, float("inf"))
    with pytest.raises(ValueError, match="alpha and beta are required"):
        merge(T3, S3)
    with pytest.raises(ValueError, match="not both"):
        merge(T3, S3, 1.0, 1.0, cost=lambda b: b)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        merge(T3, S3, 1.0, 1.0, method="fixed", bucket_cap_mb=0)
    with pytest.raises(ValueError, match="first_bucket_mb"):
        merge(T3, S3, 1.0, 1.0, method="fixed", first_bucket_mb=-1.0)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        merge(T3, S3, 1.0, 1.0, method="optimal", bucket_cap_mb=float("nan"))
    with pytest.raises(ValueError, match="cost"):
        merge(T3, S3, cost=lambda b: -1.0 + 0 * b)
    # (a TypeError from inside the planner before: "'int' object is not callable", "float()
    # argument must be a string or a real number, not 'NoneType'")
    for method in ("optimal", "wfbp"):
        with pytest.raises(ValueError, match="drain must be a callable"):
            merge(T3, S3, 1.0, 1.0, method=method, drain=3)
    with pytest.raises(ValueError, match="drain must be a callable"):
        evaluate(T3, S3, [(0, 2)], 1.0, 1.0, drain="pull")
    for bad in (None, [1.0], "1", {}):
        with pytest.raises(ValueError, match="the cost of an allreduce of .* bytes came out"):
            merge(T3, S3, cost=lambda b, bad=bad: bad)
        with pytest.raises(ValueError, match="the cost of an allreduce of .* bytes came out"):
            merge(T3, S3, 1.0, 1.0, drain=lambda b, bad=bad: bad)


@pytest.mark.parametrize(
    "groups",
    [[(0, 1)], [(1, 2)], [(0, 0), (2, 2)], [(0, 1), (1, 2)], [(0, 3)], [(0, 2), (3, 3)], [(0, 1.0), (2, 2)], None, [0, 1, 2], "012", ["01", (2, 2)], 3, np.array(3)],
)
def test_invalid_groups(groups):
    with pytest.raises(ValueError, match="groups"):
        evaluate(T3, S3, groups, 1.0, 1.0)


def test_plan_is_frozen_and_validated():
    plan = merge(T3, S3, A3, B3)
    with pytest.raises(AttributeError):
        plan.end_time = 0.0
    with pytest.raises(ValueError, match="end_time"):
        Plan("custom", [(0, 0)], [1.0], [2.0], [4.0], [1.0], end_time=3.0)
    for tail in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tail"):
            Plan("custom", [(0, 0)], [1.0], [2.0], [4.0], [1.0], end_time=2.0, tail=tail)
    # Backward's compute after the last gradient (tail) ends backward later, hiding more.
    tailed = Plan("custom", [(0, 0)], [1.0], [3.0], [4.0], [1.0], end_time=3.0, tail=1.5)
    assert (tailed.backward_time, tailed.exposed_time, tailed.hidden_fraction) == (2.5, 0.5, 0.75)
    assert Plan("custom", [(0, 0)], [1.0], [3.0], [4.0], [1.0], end_time=3.0, tail=3.0).exposed_time == 0.0


def test_describe_and_to_dict():
    plan = merge(T3, S3, A3, B3)
    text = plan.describe()
    assert "optimal plan: 3 layers in 2 groups" in text and "1-2" in text
    d = plan.to_dict()
    assert d["groups"] == [[0, 0], [1, 2]] and d["end_time"] == 6.0 and d["backward_time"] == 3.0
    assert d["group_bytes"] == [4, 8] and all(type(b) is int for b in d["group_bytes"])  # whole bytes, not 4.0
    assert merge([1.0], [2.5], A3, B3).to_dict()["group_bytes"] == [2.5]  # a fraction stays as given
    many = merge([1.0] * 50, [1.0] * 50, 0.0, 0.0, method="wfbp").describe(max_rows=5)
    assert "45 more groups" in many
    assert len(many.splitlines()) == 2 + 5 + 1  # totals, column names, max_rows rows, the rest counted


def test_thousand_layers_plan_time_printed():
    # Timing is printed, not asserted (shared, noisy machine). Run with -s to see it.
    rng = np.random.default_rng(0)
    times = rng.uniform(1e-5, 1e-3, 1000)
    sizes = rng.integers(1, 4_000_000, 1000).astype(float)
    merge(times, sizes, 2.4e-4, 4.1e-10)  # warm-up
    t0 = time.perf_counter()
    plan = merge(times, sizes, 2.4e-4, 4.1e-10)
    elapsed = time.perf_counter() - t0
    print(f"\noptimal plan of 1000 layers: {elapsed * 1e3:.1f} ms, {len(plan.groups)} groups")
    assert len(plan.groups) >= 1


# --- calibration -------------------------------------------------------------------------


def test_fit_alpha_beta_exact_line():
    sizes = [2**k for k in range(10, 28, 2)]
    times = [2.5e-4 + 4e-10 * s for s in sizes]
    alpha, beta = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(2.5e-4, rel=1e-9)
    assert beta == pytest.approx(4e-10, rel=1e-9)


def test_fit_alpha_beta_noisy():
    rng = np.random.default_rng(1)
    sizes = np.repeat(2.0 ** np.arange(12, 27), 5)
    times = 1e-4 + 8e-10 * sizes + rng.normal(0, 2e-6, sizes.size)
    alpha, beta = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(1e-4, rel=0.05)
    assert beta == pytest.approx(8e-10, rel=0.01)


def test_fit_alpha_beta_clamps_to_non_negative():
    # The unconstrained line through these points has a negative intercept (-1): the fit
    # through the origin, beta = sum(xy)/sum(x^2) = (1*1 + 2*3 + 3*5)/(1 + 4 + 9) = 22/14, wins.
    alpha, beta = fit_alpha_beta([1.0, 2.0, 3.0], [1.0, 3.0, 5.0])
    assert alpha == 0.0 and beta == pytest.approx(22 / 14)
    # Times falling with size: negative slope; the flat fit (mean time) wins.
    alpha, beta = fit_alpha_beta([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
    assert (alpha, beta) == (2.0, 0.0)


def test_fit_alpha_beta_invalid():
    with pytest.raises(ValueError, match="distinct"):
        fit_alpha_beta([8.0, 8.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="equal"):
        fit_alpha_beta([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=r"times\[1\]"):
        fit_alpha_beta([1.0, 2.0], [1.0, float("nan")])
    with pytest.raises(ValueError, match=r"sizes_bytes\[0\]"):
        fit_alpha_beta([-1.0, 2.0], [1.0, 1.0])


# --- interference: backward slowed by overlapped allreduces ----------------------------------


def slowed_end(start, work, backward_end, comm_slowdown):
    """An allreduce of ``work`` seconds at full speed, started at ``start``, progressing at
    1 / (1 + comm_slowdown) until backward_end and at 1 after it: when is its work done?"""
    rate = 1.0 / (1.0 + comm_slowdown)
    if start < backward_end:
        if (backward_end - start) * rate >= work:  # done while backward still runs
            return start + work / rate
        work -= (backward_end - start) * rate
        start = backward_end
    return start + work


def brute_force_interfered(backward_times, sizes, cost, per_message, per_byte, comm_slowdown=0.0, only=None):
    """The same exhaustive search with the interference model written out from scratch: the
    layers of group g are ready later by the sum, over groups 0..g-1, of
    per_message + per_byte * bytes; an allreduce progresses 1 + comm_slowdown times slower until
    backward's end as known when it is launched: the last layer's ready time from compute alone,
    delayed by the launches up to and including its own (the last group's by those before it).
    ``only``: time that one grouping instead of searching."""
    n = len(sizes)
    best = math.inf
    backward_end = sum(backward_times)
    for groups in ([only] if only is not None else contiguous_groupings(n)):
        end, delay = 0.0, 0.0
        for k, (a, b) in enumerate(groups):
            group_bytes = float(sum(sizes[a : b + 1]))
            start = max(sum(backward_times[: b + 1]) + delay, end)
            own = per_message + per_byte * group_bytes if k < len(groups) - 1 else 0.0
            end = slowed_end(start, cost(group_bytes), backward_end + delay + own, comm_slowdown)
            delay += per_message + per_byte * group_bytes
        best = min(best, end)
    return best


@pytest.mark.timeout(120)
def test_optimal_with_interference_equals_brute_force():
    rng = np.random.default_rng(7)
    for n in range(1, 11):
        for _ in range(25 if n <= 8 else 8):
            times, sizes = random_instance(rng, n)
            alpha = float(rng.choice([0.0, 1e-5, 2.5e-4, 1e-3]))
            beta = float(rng.choice([0.0, 8e-10, 8e-9]))
            per_message = float(rng.choice([0.0, 1e-5, 3e-4, 2e-3]))
            per_byte = float(rng.choice([0.0, 1e-10, 2e-9]))
            comm_slowdown = float(rng.choice([0.0, 0.3, 1.5]))
            slow = Interference(per_message, per_byte, comm_slowdown)
            plan = merge(times, sizes, alpha, beta, interference=slow)
            best = brute_force_interfered(times, sizes, LinearCost(alpha, beta), per_message, per_byte, comm_slowdown)
            assert math.isclose(plan.end_time, best, rel_tol=1e-9, abs_tol=1e-15), (n, times, sizes, slow)
            # and the optimum's own timing is evaluate's, to the bit
            again = evaluate(times, sizes, plan.groups, alpha, beta, interference=slow)
            assert again.end_time == plan.end_time


def brute_force_with_tail(backward_times, sizes, cost, slow, tail, drain=None):
    """The exhaustive search of the later of the plan's end (its last allreduce's, or with
    ``drain`` its last pull's) and backward's end: the last gradient's ready time delayed by the
    launches before the last group, plus ``tail`` (backward's compute after it)."""
    best = math.inf
    for groups in contiguous_groupings(len(sizes)):
        timed = [brute_force_interfered(backward_times, sizes, cost, slow.per_message, slow.per_byte,
                                        slow.comm_slowdown, only=groups)] if drain is None else []
        if drain is not None:
            end, pulled, delay = 0.0, 0.0, 0.0
            for k, (a, b) in enumerate(groups):
                group_bytes = float(sum(sizes[a : b + 1]))
                start = max(sum(backward_times[: b + 1]) + delay, end)
                own = slow.per_message + slow.per_byte * group_bytes if k < len(groups) - 1 else 0.0
                end = slowed_end(start, cost(group_bytes), sum(backward_times) + delay + own, slow.comm_slowdown)
                pulled = max(pulled, end) + drain(group_bytes)
                delay += slow.per_message + slow.per_byte * group_bytes
            timed = [pulled]
        before_last = sum(slow.per_message + slow.per_byte * float(sum(sizes[a : b + 1])) for a, b in groups[:-1])
        best = min(best, max(timed[0], sum(backward_times) + before_last + tail))
    return best


def test_a_tail_that_hides_every_plan_keeps_the_earliest_last_allreduce():
    # ready [1, 2]; alpha 0, beta 0.25: apart the allreduces end at 2 and 3, together at 4.
    # Backward's 10 s tail hides either plan (the later of the two ends is 12 both ways): the
    # tie goes to the plan whose last allreduce ends first.
    plan = merge([1.0, 1.0], [4.0, 4.0], 0.0, 0.25, tail=10.0)
    assert (plan.groups, plan.end_time, plan.backward_time) == ([(0, 0), (1, 1)], 3.0, 12.0)
    # The same in the program with a drain (1 s: pulls end at 3 and 4 apart, at 5 together).
    drained = merge([1.0, 1.0], [4.0, 4.0], 0.0, 0.25, tail=10.0, drain=lambda b: 1.0 + 0.0 * b)
    assert (drained.groups, drained.end_time) == ([(0, 0), (1, 1)], 4.0)


@pytest.mark.timeout(120)
def test_optimal_with_a_tail_of_backward_equals_brute_force():
    """merge(tail=): backward computes ``tail`` after the last gradient (a parameter-free
    input layer), and interference delays it by the launches before the last group: the
    optimum is the least later-of-both, by each program (one pass, counted, drained)."""
    rng = np.random.default_rng(41)

    def drain(b):
        return 5e-4 + 2e-8 * b

    for n in range(1, 9):
        for _ in range(12 if n <= 6 else 4):
            times, sizes = random_instance(rng, n)
            alpha, beta = float(rng.choice([1e-5, 2.5e-4])), float(rng.choice([8e-10, 8e-9]))
            tail = float(rng.choice([1e-4, 2e-3, 5e-2]))
            for slow in (Interference(0.0, float(rng.choice([1e-10, 2e-9])), float(rng.choice([0.0, 1.5]))),
                         Interference(float(rng.choice([1e-5, 2e-3])), 1e-9, 0.5)):
                for with_drain in (False, True):
                    kw = dict(drain=drain) if with_drain else {}
                    plan = merge(times, sizes, alpha, beta, interference=slow, tail=tail, **kw)
                    best = brute_force_with_tail(times, sizes, LinearCost(alpha, beta), slow, tail,
                                                 (lambda b: float(drain(b))) if with_drain else None)
                    got = max(plan.end_time, plan.backward_time)
                    assert math.isclose(got, best, rel_tol=1e-12, abs_tol=1e-15), (n, times, sizes, slow, tail)
                    for method in METHODS:
                        other = merge(times, sizes, alpha, beta, method=method, interference=slow, tail=tail, **kw)
                        assert got <= max(other.end_time, other.backward_time) * (1 + 1e-12), method


def test_interference_hand_computed():
    # T3 = 1,1,1 s; 4 bytes each; cost 1 + 0.25 b. wfbp with 0.5 s per launch:
    # group 0 ready 1, [1,3]; group 1 ready 2 + 0.5, [3,5]; group 2 ready 3 + 1.0, [5,7].
    plan = merge(T3, S3, A3, B3, method="wfbp", interference=Interference(0.5, 0.0))
    assert plan.ready == [1.0, 2.5, 4.0] and plan.backward_time == 4.0
    assert plan.starts == [1.0, 3.0, 5.0] and plan.end_time == 7.0
    # 1 s per launch: group 2 is ready at 5, its allreduce [5,7]; one per byte adds 4 s per group
    plan = merge(T3, S3, A3, B3, method="wfbp", interference=Interference(0.0, 1.0))
    assert plan.ready == [1.0, 6.0, 11.0] and plan.end_time == 13.0
    # allreduces (2 s each) run 1.5x slower until backward's end at 3 s: group 0 starts at 1,
    # does 4/3 s of its work by 3, the rest (2/3 s) after: ends at 11/3; groups 1 and 2 start
    # after 3 and take 2 s each
    plan = merge(T3, S3, A3, B3, method="wfbp", interference=Interference(0.0, 0.0, 0.5))
    assert plan.ends == pytest.approx([11 / 3, 17 / 3, 23 / 3], rel=1e-15)
    # a long backward: everything done while it runs takes 1.5x, [1,4], [4,7], then the last
    plan = merge([1.0, 1.0, 10.0], S3, A3, B3, method="wfbp", interference=Interference(0.0, 0.0, 0.5))
    assert plan.ends == [4.0, 7.0, 14.0]
    # both: 0.5 s per launch, 1.5x slower while backward runs. Group 0 starts at 1, slowed until
    # 3.5 (backward delayed by its own launch): 5/3 s of work by then, ends at 23/6; group 1
    # (ready 2.5) starts at 23/6, slowed until 4 (two launches): ends 23/6 + 2 + 0.5 * 1/9 = 53/9;
    # group 2, ready at 4, starts at 53/9 after backward: not slowed, 71/9
    plan = merge(T3, S3, A3, B3, method="wfbp", interference=Interference(0.5, 0.0, 0.5))
    assert plan.ends == pytest.approx([23 / 6, 53 / 9, 71 / 9], rel=1e-14)
    # a single allreduce launches after backward: nothing to slow down, either way
    plan = merge(T3, S3, A3, B3, method="single", interference=Interference(5.0, 5.0, 5.0))
    assert plan.ready == [1.0, 2.0, 3.0] and plan.end_time == 7.0


def test_interference_makes_optimal_merge_more():
    rng = np.random.default_rng(3)
    times = rng.uniform(1e-3, 3e-3, 60).tolist()
    sizes = rng.uniform(1e4, 2e5, 60).tolist()
    free = merge(times, sizes, 1e-4, 1e-9)
    costly = merge(times, sizes, 1e-4, 1e-9, interference=Interference(1e-3, 0.0))
    assert len(costly.groups) < len(free.groups)
    # each method's timing charges the interference; optimal stays the best of them
    slow = Interference(1e-3, 1e-10)
    ends = {m: merge(times, sizes, 1e-4, 1e-9, method=m, interference=slow).end_time for m in METHODS}
    assert ends["optimal"] == min(ends.values())


def test_interference_validated():
    with pytest.raises(ValueError, match="per_message"):
        Interference(-1.0, 0.0)
    with pytest.raises(ValueError, match="per_byte"):
        Interference(0.0, float("nan"))
    with pytest.raises(ValueError, match="comm_slowdown"):
        Interference(0.0, 0.0, -0.5)
    with pytest.raises(ValueError, match="interference must be"):
        merge([1.0], [4.0], 1.0, 1.0, interference=(0.1, 0.0))


def test_thousand_layers_with_interference_planned():
    rng = np.random.default_rng(11)
    times, sizes = rng.uniform(0, 1e-4, 1000), rng.uniform(0, 1e5, 1000)
    t0 = time.perf_counter()
    plan = merge(times, sizes, 3e-4, 8e-9, interference=Interference(3e-4, 2e-9))
    elapsed = time.perf_counter() - t0
    print(f"1,000 layers with interference: {elapsed * 1e3:.0f} ms, {len(plan.groups)} groups")
    assert plan.end_time <= merge(times, sizes, 3e-4, 8e-9, method="single",
                                  interference=Interference(3e-4, 2e-9)).end_time


def test_optimal_with_interference_and_a_custom_cost_equals_brute_force():
    rng = np.random.default_rng(17)

    def concave(b):
        return 1e-4 + 1e-6 * np.sqrt(b)

    for n in range(1, 9):
        for _ in range(10):
            times, sizes = random_instance(rng, n)
            slow = Interference(float(rng.choice([1e-5, 5e-4])), float(rng.choice([0.0, 1e-9])),
                                float(rng.choice([0.0, 0.5])))
            plan = merge(times, sizes, cost=concave, interference=slow)
            best = brute_force_interfered(times, sizes, lambda b: float(concave(b)), slow.per_message,
                                          slow.per_byte, slow.comm_slowdown)
            assert math.isclose(plan.end_time, best, rel_tol=1e-12, abs_tol=1e-15), (n, times, sizes, slow)


def test_interference_beyond_the_table_limit_plans_without_the_per_message_count(monkeypatch):
    from ringtrain import plan as planner

    rng = np.random.default_rng(5)
    times, sizes = rng.uniform(0, 1e-3, 40), rng.uniform(0, 1e5, 40)
    slow = Interference(2e-4, 1e-9, 0.2)
    exact = merge(times, sizes, 1e-4, 1e-8, interference=slow)
    monkeypatch.setattr(planner, "_COST_TABLE_LIMIT", 100)  # 40 layers: 820 candidates
    fallback = merge(times, sizes, 1e-4, 1e-8, interference=slow)
    # the one-pass program's plan, timed with every cost charged: valid, never better
    assert fallback.end_time >= exact.end_time
    assert fallback.end_time == evaluate(times, sizes, fallback.groups, 1e-4, 1e-8, interference=slow).end_time


def test_beyond_the_limits_optimal_is_still_never_behind_another_method(monkeypatch):
    # Where the program plans without the per-message cost (beyond its table, or beyond the
    # drained count limit), its plan of many small groups paid 1 ms per launch: 14.9 ms where
    # single took 4.8 (2,100 layers unpatched: 840 ms against 252).
    from ringtrain import plan as planner
    from ringtrain.sim import costs

    rng = np.random.default_rng(3)
    times, sizes = rng.exponential(1e-4, 40), rng.exponential(2e4, 40)
    monkeypatch.setattr(planner, "_COST_TABLE_LIMIT", 100)  # 40 layers: 820 candidates
    monkeypatch.setattr(planner, "_DRAINED_COUNT_LIMIT", 30)
    ps = costs.allreduce_cost(16, "ps", alpha=2e-5, beta=1e-9, servers=2)
    for rate, slow in ((dict(alpha=2e-4, beta=1e-9), Interference(1e-3, 0.0, 0.0)),
                       (dict(cost=ps.occupancy, drain=ps.drain), Interference(3e-3, 0.0, 0.0)),
                       (dict(alpha=2e-4, beta=1e-9), Interference(1e-3, 1e-10, 0.5))):
        plans = {m: merge(times, sizes, method=m, interference=slow, tail=1e-4, **rate) for m in METHODS}
        best = plans["optimal"]
        assert best.end_time == evaluate(times, sizes, best.groups, interference=slow, method="optimal",
                                         **rate).end_time
        for m, p in plans.items():
            assert max(best.end_time, best.backward_time) <= max(p.end_time, p.backward_time), (m, slow)


def test_a_plan_made_with_one_interference_is_timed_with_another():
    rng = np.random.default_rng(23)
    times, sizes = rng.uniform(1e-3, 3e-3, 30), rng.uniform(1e4, 2e5, 30)
    slow = Interference(1e-3, 1e-9, 0.5)
    free = merge(times, sizes, 1e-4, 1e-9, interference=slow, planned_with=Interference())
    assert free.groups == merge(times, sizes, 1e-4, 1e-9).groups  # grouped as if overlap were free
    assert free.end_time == evaluate(times, sizes, free.groups, 1e-4, 1e-9, interference=slow).end_time
    assert merge(times, sizes, 1e-4, 1e-9, interference=slow, planned_with=slow) == merge(
        times, sizes, 1e-4, 1e-9, interference=slow)
    assert merge(times, sizes, 1e-4, 1e-9, interference=slow).end_time <= free.end_time


# --- a drain after the stream (parameter servers' last pull) -------------------------------


def brute_force_drained(backward_times, sizes, cost, drain, per_message=0.0, per_byte=0.0, comm_slowdown=0.0):
    """brute_force_interfered's search with every group's drain (a parameter server's pull of its
    last partitions) on a second stream, written out from scratch: a pull starts once its push
    has ended and the pull before it is done; the plan ends with the last pull."""
    n = len(sizes)
    best = math.inf
    backward_end = sum(backward_times)
    for groups in contiguous_groupings(n):
        end, pulled, delay = 0.0, 0.0, 0.0
        for k, (a, b) in enumerate(groups):
            group_bytes = float(sum(sizes[a : b + 1]))
            start = max(sum(backward_times[: b + 1]) + delay, end)
            own = per_message + per_byte * group_bytes if k < len(groups) - 1 else 0.0
            end = slowed_end(start, cost(group_bytes), backward_end + delay + own, comm_slowdown)
            pulled = max(pulled, end) + drain(group_bytes)
            delay += per_message + per_byte * group_bytes
        best = min(best, pulled)
    return best


@pytest.mark.timeout(120)
def test_optimal_with_a_drain_equals_brute_force():
    # The planner grouped by the whole exchange while the simulator overlaps every drain but the
    # last: wfbp beat "optimal" by up to 16% on parameter servers. Then only the last drain was
    # charged, so a tiny last group hid a big one's pull (61% under on 4 servers). Pulls slower
    # than the next push too (they queue); one and many group counts; each term of interference.
    rng = np.random.default_rng(29)

    def partition(b):
        return 2e-4 + 3e-9 * np.minimum(b, 5e5)  # the pull of at most one partition per server

    def slow_pull(b):
        return 5e-4 + 2e-8 * b  # every pull longer than its push

    for n in range(1, 10):
        for _ in range(12 if n <= 7 else 5):
            times, sizes = random_instance(rng, n)
            alpha, beta = float(rng.choice([1e-5, 2.5e-4])), float(rng.choice([8e-10, 8e-9]))
            drain = partition if rng.uniform() < 0.5 else slow_pull
            for slow in (Interference(), Interference(float(rng.choice([1e-5, 5e-4])), 1e-9, 0.5),
                         Interference(0.0, float(rng.choice([1e-10, 1e-9])), float(rng.choice([0.0, 0.7])))):
                plan = merge(times, sizes, alpha, beta, interference=slow, drain=drain)
                best = brute_force_drained(times, sizes, LinearCost(alpha, beta), lambda b: float(drain(b)),
                                           slow.per_message, slow.per_byte, slow.comm_slowdown)
                assert math.isclose(plan.end_time, best, rel_tol=1e-12, abs_tol=1e-15), (n, times, sizes, slow)
                again = evaluate(times, sizes, plan.groups, alpha, beta, interference=slow, drain=drain)
                assert again.end_time == plan.end_time  # to the bit
                for method in METHODS:
                    other = merge(times, sizes, alpha, beta, method=method, interference=slow, drain=drain)
                    assert plan.end_time <= other.end_time, method


@pytest.mark.timeout(300)
def test_the_drained_program_makes_the_plans_of_the_one_that_extends_every_plan(monkeypatch):
    """The program with a drain skips the plans a group cannot make a new front's plan from and
    sorts each front out of the plans no sample plan beats: the same groups as before, to the
    plan, and so the same end, to the bit (drained_reference.py is the program that extended
    every plan). Random small traces with the simulator's server costs: one pass and counted,
    each term of interference (comm_slowdown's path too), backward's tail; runs and the sampled
    sort on every front; and equal layers, where the fronts grow."""
    import ringtrain.plan as planner
    from drained_reference import drained_groups_extending_every_plan
    from ringtrain.sim.costs import network

    monkeypatch.setattr(planner, "_FRONT_SAMPLE", 1)
    monkeypatch.setattr(planner, "_RUNS_FROM", 0)  # (runs looked for from the first plan on)
    rng = np.random.default_rng(61)

    def check(times, sizes, server, slow, tail):
        ready, sizes = np.cumsum(times), np.asarray(sizes, dtype=float)
        counted = slow.per_message > 0.0 and len(sizes) <= planner._DRAINED_COUNT_LIMIT
        args = (ready, sizes, server.occupancy, slow, server.drain, counted, tail)
        groups = planner._optimal_groups_drained(*args)
        assert groups == drained_groups_extending_every_plan(*args), (list(times), list(sizes), slow, tail)
        plan = merge(times, sizes, cost=server.occupancy, drain=server.drain, interference=slow, tail=tail)
        again = evaluate(times, sizes, groups, cost=server.occupancy, drain=server.drain, interference=slow)
        assert plan.groups == groups and plan.end_time == again.end_time

    for _ in range(300):
        n = int(rng.integers(1, 40))
        if rng.uniform() < 0.5:
            times, sizes = random_instance(rng, n)
        else:  # like layers (the fronts grow), as in a long trace
            times, sizes = [float(10 ** rng.uniform(-6, -3))] * n, [float(10 ** rng.uniform(2, 7))] * n
        server = network(str(rng.choice(["1GbE", "10GbE", "100Gb-IB"]))).cost(
            int(rng.choice([2, 8, 256])), "ps", servers=int(rng.choice([1, 4])))
        slow = Interference(float(rng.choice([0.0, 1e-5, 1e-4])), float(rng.choice([0.0, 1e-10])),
                            float(rng.choice([0.0, 0.0, 0.5, 2.0])))
        check(times, sizes, server, slow, float(rng.choice([0.0, 0.0, 1e-4, 1e-2])))
    server = network("10GbE").cost(256, "ps", servers=2)
    for slow in (Interference(), Interference(0.0, 1e-11, 0.5)):  # (fronts of ~60 plans)
        check([1e-5] * 150, [1e4] * 150, server, slow, 0.0)
    monkeypatch.setattr(planner, "_FRONT_SAMPLE", 256)  # the sampled sort and the runs as merge takes them
    monkeypatch.setattr(planner, "_RUNS_FROM", 4)
    check([1e-5] * 150, [1e4] * 150, server, Interference(), 0.0)


def test_a_drain_queues_behind_the_pull_before_it():
    # A 100 MB layer then a 4-byte one (parameter servers, 16 workers): the big group's last pull
    # (54 ms) is still running when the tiny group's push ends, so the tiny pull waits for it.
    from ringtrain.sim import costs

    ps = costs.allreduce_cost(16, "ps", alpha=25e-6, beta=8e-10)
    times, sizes = [1e-3, 1e-3], [1e8, 4.0]
    wfbp = merge(times, sizes, cost=ps.occupancy, method="wfbp", drain=ps.drain)
    big_pull_ends = wfbp.starts[0] + float(ps.occupancy(1e8)) + float(ps.drain(1e8))
    assert wfbp.ends[0] == pytest.approx(big_pull_ends, rel=1e-12)
    assert wfbp.end_time == pytest.approx(big_pull_ends + float(ps.drain(4.0)), rel=1e-12)
    single = merge(times, sizes, cost=ps.occupancy, method="single", drain=ps.drain)
    best = merge(times, sizes, cost=ps.occupancy, drain=ps.drain)
    assert best.end_time == min(wfbp.end_time, single.end_time)


def test_communication_time_counts_overlapping_exchanges_once():
    # Pushes of 0.1 s, pulls of 2 s queued behind each other: four exchanges from 1 to 9.1 s
    # with gaps between the first pushes; summed span by span they came to 14.4 s.
    plan = evaluate([1.0] * 4, [1.0] * 4, [(k, k) for k in range(4)], cost=LinearCost(0.0, 0.1),
                    drain=LinearCost(0.0, 2.0))
    assert plan.ends == pytest.approx([3.1, 5.1, 7.1, 9.1])
    assert plan.comm_time == pytest.approx(9.1 - 1.0)
    assert plan.comm_time <= plan.end_time


def test_a_per_message_cost_with_a_drain_is_planned_around_up_to_a_limit(monkeypatch):
    from ringtrain import plan as planner
    from ringtrain.sim import costs

    rng = np.random.default_rng(37)
    times, sizes = rng.uniform(1e-5, 3e-4, 40), rng.uniform(1e3, 2e6, 40)
    ps = costs.allreduce_cost(4, "ps", alpha=5e-5, beta=8e-10)
    slow = Interference(1e-4, 1e-12, 0.5)
    exact = merge(times, sizes, cost=ps.occupancy, drain=ps.drain, interference=slow)
    monkeypatch.setattr(planner, "_DRAINED_COUNT_LIMIT", 30)  # 40 layers: one pass, the count charged only
    fallback = merge(times, sizes, cost=ps.occupancy, drain=ps.drain, interference=slow)
    assert fallback.end_time >= exact.end_time
    assert fallback.end_time == evaluate(times, sizes, fallback.groups, cost=ps.occupancy, drain=ps.drain,
                                         interference=slow).end_time


@pytest.mark.timeout(60)
def test_a_thousand_layers_with_a_drain_planned_quickly():
    from ringtrain.sim import costs

    rng = np.random.default_rng(31)
    times, sizes = rng.uniform(0, 1e-4, 1000), rng.uniform(0, 1e6, 1000)
    ps = costs.allreduce_cost(64, "ps", alpha=25e-6, beta=8e-10, servers=2)
    t0 = time.perf_counter()
    plan = merge(times, sizes, cost=ps.occupancy, drain=ps.drain)
    elapsed = time.perf_counter() - t0
    print(f"1,000 layers with a drain: {elapsed * 1e3:.0f} ms, {len(plan.groups)} groups")
    for method in METHODS:
        assert plan.end_time <= merge(times, sizes, cost=ps.occupancy, method=method, drain=ps.drain).end_time


def test_a_drain_program_gathers_the_plans_kept_so_far_without_recopying_them(monkeypatch):
    """Before: every prefix concatenated every earlier prefix's arrays of kept plans (three
    np.concatenate of j arrays at prefix j), quadratic in Python calls: 2.2 s of the 3.9 s
    `ringtrain simulate --algorithms ps` took on a 3,000-layer trace. Now the kept plans are
    columns appended in place: a handful of arrays per prefix, and the same plan."""
    from ringtrain.sim import costs

    rng = np.random.default_rng(31)
    times, sizes = rng.uniform(0, 1e-4, 400), rng.uniform(0, 1e6, 400)
    ps = costs.allreduce_cost(64, "ps", alpha=25e-6, beta=8e-10, servers=2)
    real, arrays = np.concatenate, [0]

    def counting(parts, *args, **kwargs):
        arrays[0] += len(parts)
        return real(parts, *args, **kwargs)

    monkeypatch.setattr(np, "concatenate", counting)
    plan = merge(times, sizes, cost=ps.occupancy, drain=ps.drain)
    monkeypatch.setattr(np, "concatenate", real)
    assert arrays[0] <= 4 * len(times), arrays[0]
    assert plan.end_time == evaluate(times, sizes, plan.groups, cost=ps.occupancy, drain=ps.drain).end_time
    assert plan.end_time <= merge(times, sizes, cost=ps.occupancy, method="mgwfbp", drain=ps.drain).end_time


def test_an_integer_past_what_a_float_holds_is_refused_in_words():
    # alpha=10**400 (or bucket_cap_mb, tail; sim.costs' alpha too) was an OverflowError from math.isfinite.
    for kw, match in [(dict(alpha=10**400, beta=1.0), "alpha=1000"), (dict(alpha=1.0, beta=1.0, tail=10**400), "tail="),
                      (dict(alpha=1.0, beta=1.0, method="fixed", bucket_cap_mb=10**400), "bucket_cap_mb=")]:
        with pytest.raises(ValueError, match=f"{match}.*; it must be finite and >"):
            merge([1.0], [1.0], **kw)
