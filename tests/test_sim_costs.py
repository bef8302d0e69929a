"""Tests of ringtrain.sim.costs: the analytic collective times.

Hand-computed cases use n = 64 bytes, alpha = 1, beta = 0.5, gamma = 0.25, so every term is
exact in binary floating point and the expected times are compared with ==.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain import sim
from ringtrain.plan import merge
from ringtrain.sim import costs

pytestmark = pytest.mark.timeout(30)

N, A, B, G = 64.0, 1.0, 0.5, 0.25
HIER = {"gpus_per_node": 2, "intra_beta": 0.125}


def t(algorithm, p, n=N, **kw):
    return sim.allreduce_time(n, p, algorithm, alpha=A, beta=B, gamma=G, **kw)


# --- formulas ------------------------------------------------------------------------------


def test_ring_hand_computed():
    # 2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ at p = 4: 6 + 48 + 12.
    assert t("ring", 4) == 66.0
    assert t("ring", 2) == 2.0 + 32.0 + 8.0


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 8, 16, 40, 1000, 2048])
def test_ring_formula(p):
    n, alpha, beta, gamma = 123_456_789.0, 2.5e-5, 8e-10, 1e-10
    expected = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma
    got = sim.allreduce_time(n, p, "ring", alpha=alpha, beta=beta, gamma=gamma)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_seed_000_arithmetic():
    # 300M fp32 parameters = 1.2e9 bytes, 40 GPUs, 6 GB/s links, no latency:
    # 2·(39/40)·1.2e9 / 6e9 = 0.39 s (seed 000 rounds 2·(p-1)/p up to 2: "about 400 ms").
    assert sim.allreduce_time(1.2e9, 40, "ring", alpha=0.0, beta=1 / 6e9) == pytest.approx(0.39, rel=1e-12)
    profile = sim.network("seed000-IB")
    assert sim.allreduce_time(1.2e9, 40, beta=profile.beta, alpha=profile.alpha) == pytest.approx(0.39, rel=1e-12)
    # Seed 000's cluster is 5 nodes of 8 GPUs with ~10 GB/s inside a node. Hierarchical with
    # one network card per GPU: 2·(7/8)·1.2e9/1e10 + 2·(4/5)·1.5e8/6e9 = 0.21 + 0.04 s.
    kw = {"beta": 1 / 6e9, "gpus_per_node": 8, "intra_beta": 1e-10}
    hier = sim.allreduce_time(1.2e9, 40, "hierarchical", nics_per_node=8, **kw)
    assert hier == pytest.approx(0.25, rel=1e-12)
    # One card per node carries all 8 shards: 0.21 + 2·(4/5)·1.2e9/6e9 = 0.21 + 0.32 s. That is
    # slower than the flat ring (0.39 s): its node cards carry about the same bytes, but its
    # intra-node hops run in the same steps instead of in phases of their own.
    shared = sim.allreduce_time(1.2e9, 40, "hierarchical", **kw)
    assert shared == pytest.approx(0.53, rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8, 16, 64, 1024])
def test_halving_doubling_power_of_two(p):
    n, alpha, beta, gamma = 1e8, 1e-5, 1e-9, 1e-10
    expected = 2 * np.log2(p) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma
    got = sim.allreduce_time(n, p, "halving_doubling", alpha=alpha, beta=beta, gamma=gamma)
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_halving_doubling_hand_computed():
    assert t("halving_doubling", 8) == 6.0 + 56.0 + 14.0
    # p = 6 folds 2 ranks into p' = 4: (2·2 + 2)α + (2·3/4 + 2)·nβ + (3/4 + 1)·nγ.
    assert t("halving_doubling", 6) == 6.0 + 112.0 + 28.0
    assert t("halving_doubling", 3) == (2 + 2) * A + (1 + 2) * N * B + (0.5 + 1) * N * G


def test_recursive_doubling_hand_computed():
    assert t("recursive_doubling", 8) == 3 * (1.0 + 32.0 + 16.0)
    assert t("recursive_doubling", 6) == 2 * 49.0 + (2.0 + 64.0 + 16.0)


def test_naive_and_central_hand_computed():
    assert t("naive", 4) == 3 * (1.0 + 32.0 + 16.0)
    assert t("central", 4) == 2 * 3 * (1.0 + 32.0) + 3 * 16.0


def test_binomial_tree_rounds_up_log2():
    per_round = 2 * A + 2 * N * B + N * G
    assert [t("binomial_tree", p) for p in (2, 3, 4, 5, 8, 9)] == [per_round * r for r in (1, 2, 2, 3, 3, 4)]


def test_hierarchical():
    # p = 8, g = 2: inside 2(1)α_i + 2(1/2)·nβ_i + (1/2)·nγ = 0 + 8 + 8; ring of 32 B over 4 nodes:
    # 6α + 1.5·32·β + 0.75·32·γ = 6 + 24 + 6.
    assert t("hierarchical", 8, nics_per_node=2, **HIER) == 16.0 + 36.0
    # One card shared by the node's 2 rings doubles the inter-node beta term: 6 + 48 + 6.
    assert t("hierarchical", 8, **HIER) == 16.0 + 60.0
    assert t("hierarchical", 8, nics_per_node=4, **HIER) == t("hierarchical", 8, nics_per_node=2, **HIER)
    # One GPU per node: a plain ring between nodes. All ranks in one node: a ring on the fast link.
    assert t("hierarchical", 8, gpus_per_node=1, intra_beta=0.125) == t("ring", 8)
    one_node = t("hierarchical", 2, gpus_per_node=8, intra_beta=0.125, intra_alpha=0.5)
    assert one_node == sim.allreduce_time(N, 2, "ring", alpha=0.5, beta=0.125, gamma=G)


def test_parameter_servers():
    # One server: 2p(α + nβ) + (p-1)nγ.
    assert t("ps", 4) == 2 * 4 * 33.0 + 3 * 16.0
    # K = p = 4: each direction max(4(α + 8), 4α + 32) = 36, reduction (p-1)·16·γ.
    assert t("ps", 4, servers=4) == 72.0 + 12.0
    # More servers than workers: the worker's own link (K messages, n bytes) is the bottleneck.
    assert t("ps", 4, servers=8) == 2 * (8 * A + N * B) + 3 * 8 * G
    assert t("ps", 16, servers=2) < t("ps", 16)


def test_parameter_servers_pipeline_partitions_over_full_duplex_links():
    # n = 64 bytes in partitions of s = 8: the pushes hold the links for D(n) + (p-1)nγ/K, the
    # pull of the last partitions (one per server, Ks bytes) follows. p = 4, one server:
    # D(64) = 4(α + 64β) = 132, D(8) = 4(α + 8β) = 20, sums 3·64·γ = 48.
    cost = costs.allreduce_cost(4, "ps", alpha=A, beta=B, gamma=G, partition_bytes=8)
    assert cost.occupancy(N) == 132.0 + 48.0
    assert cost.drain(N) == 20.0
    assert cost(N) == 132.0 + 48.0 + 20.0 == t("ps", 4, partition_bytes=8)
    # Two servers send their last partitions at once, each 8 bytes to 4 workers: D(16) with K = 2,
    # max(4(α + 16β/2), 2α + 16β) = 20, the same time as one server's one partition.
    assert costs.allreduce_cost(4, "ps", alpha=A, beta=B, gamma=G, servers=2, partition_bytes=8).drain(N) == 20.0
    # Within one round of partitions it is push then pull (the default 4 MiB partitions here).
    assert t("ps", 4) == 2 * 132.0 + 48.0
    # Every allreduce holds the network for the whole call and drains nothing.
    for algorithm in ("ring", "naive", "central", "halving_doubling"):
        c = costs.allreduce_cost(4, algorithm, alpha=A, beta=B, gamma=G)
        assert (c.occupancy(N), c.drain(N)) == (c(N), 0.0)
    sizes = np.array([0.0, 8.0, 64.0, 1e9])
    np.testing.assert_array_equal(cost.occupancy(sizes) + cost.drain(sizes), cost(sizes))
    with pytest.raises(ValueError, match="partition_bytes"):
        costs.allreduce_cost(4, "ps", beta=B, partition_bytes=0)


@pytest.mark.parametrize("algorithm", costs.ALGORITHMS)
def test_world_size_one_costs_nothing(algorithm):
    kw = HIER if algorithm == "hierarchical" else {}
    assert t(algorithm, 1, **kw) == 0.0
    assert t(algorithm, 1, n=0.0, **kw) == 0.0


@pytest.mark.parametrize("algorithm", costs.ALGORITHMS)
def test_arrays_match_scalars(algorithm):
    kw = HIER if algorithm == "hierarchical" else {}
    sizes = np.array([0.0, 1.0, 1e3, 4e6, 1.2e9])
    got = sim.allreduce_time(sizes, 6, algorithm, alpha=1e-5, beta=1e-9, gamma=1e-10, **kw)
    assert isinstance(got, np.ndarray) and got.shape == sizes.shape
    for n, value in zip(sizes, got):
        assert value == sim.allreduce_time(float(n), 6, algorithm, alpha=1e-5, beta=1e-9, gamma=1e-10, **kw)
    assert isinstance(sim.allreduce_time(1e3, 6, algorithm, alpha=1e-5, beta=1e-9, **kw), float)


@pytest.mark.parametrize("algorithm", costs.ALGORITHMS)
def test_time_grows_with_size_and_is_alpha_only_at_zero(algorithm):
    kw = HIER if algorithm == "hierarchical" else {}
    sizes = np.linspace(0, 1e8, 50)
    times = sim.allreduce_time(sizes, 12, algorithm, alpha=1e-5, beta=1e-9, **kw)
    assert np.all(np.diff(times) > 0)
    assert times[0] > 0  # start-up only


def test_ring_beats_naive_and_central_at_scale():
    for p in (4, 16, 256):
        ring = sim.allreduce_time(1e8, p, alpha=1e-5, beta=1e-9)
        assert ring < sim.allreduce_time(1e8, p, "naive", alpha=1e-5, beta=1e-9)
        assert ring < sim.allreduce_time(1e8, p, "central", alpha=1e-5, beta=1e-9)


# --- the planner's cost --------------------------------------------------------------------


def test_allreduce_cost_plugs_into_the_planner():
    cost = sim.allreduce_cost(64, "ring", alpha=25e-6, beta=8e-10)
    times, sizes = [1e-3] * 20, [2e6] * 20
    single = merge(times, sizes, cost=cost, method="single")
    assert single.end_time == 20e-3 + sim.allreduce_time(4e7, 64, alpha=25e-6, beta=8e-10)
    assert merge(times, sizes, cost=cost).end_time <= single.end_time
    hier = sim.allreduce_cost(64, "hierarchical", beta=8e-10, gpus_per_node=8, intra_beta=1e-11)
    assert hier(1e6) == sim.allreduce_time(1e6, 64, "hierarchical", beta=8e-10, gpus_per_node=8, intra_beta=1e-11)
    with pytest.raises(ValueError, match="world_size"):
        sim.allreduce_cost(0, beta=1e-9)


def test_profile_cost():
    ten = sim.network("10GbE")
    assert ten.cost(16)(1e6) == sim.allreduce_time(1e6, 16, alpha=ten.alpha, beta=ten.beta)
    assert ten.cost(16, "ps", servers=2)(1e6) == sim.allreduce_time(
        1e6, 16, "ps", alpha=ten.alpha, beta=ten.beta, servers=2
    )
    fitted = sim.network("mgwfbp-10GbE-16")
    assert fitted.cost(16)(1e6) == 9.08e-4 + 7.40e-10 * 1e6
    with pytest.raises(ValueError, match="fitted on 16 workers"):
        fitted.cost(8)


def test_bandwidth_conventions():
    assert sim.algbw(1e9, 0.5) == 2e9
    assert sim.busbw(1e9, 1.0, 4) == 1.5e9
    # A ring at line rate with no latency has busbw = 1/beta.
    seconds = sim.allreduce_time(1e9, 8, beta=1e-9)
    assert sim.busbw(1e9, seconds, 8) == pytest.approx(1e9, rel=1e-12)
    with pytest.raises(ValueError, match="seconds"):
        sim.algbw(1.0, 0.0)


# --- the constants -------------------------------------------------------------------------


def test_network_table():
    assert sim.NETWORKS["1GbE"].beta == pytest.approx(8e-9, rel=1e-15)
    assert sim.NETWORKS["10GbE"].beta == pytest.approx(8e-10, rel=1e-15)
    assert sim.NETWORKS["100Gb-IB"].bandwidth == pytest.approx(12.5e9, rel=1e-12)
    published = {  # DESIGN.md: MG-WFBP authors' fitted alpha (s), beta (s/byte)
        "mgwfbp-10GbE-16": (9.08e-4, 7.40e-10, 16),
        "mgwfbp-10GbE-8": (5.23e-4, 8.57e-10, 8),
        "mgwfbp-56IB-16": (2.36e-4, 4.06e-10, 16),
        "mgwfbp-56IB-8": (9.75e-5, 3.06e-10, 8),
    }
    for name, (alpha, beta, workers) in published.items():
        profile = sim.network(name)
        assert (profile.alpha, profile.beta, profile.fitted_world_size) == (alpha, beta, workers)
    for name in ("1GbE", "10GbE", "25GbE", "56Gb-IB", "100Gb-IB", "NVLink"):
        assert sim.NETWORKS[name].fitted_world_size is None and sim.NETWORKS[name].source
    # Faster links have smaller beta.
    order = ["1GbE", "10GbE", "25GbE", "56Gb-IB", "100Gb-IB", "NVLink"]
    betas = [sim.NETWORKS[name].beta for name in order]
    assert betas == sorted(betas, reverse=True)
    with pytest.raises(ValueError, match="accepted values"):
        sim.network("2GbE")
    with pytest.raises(ValueError, match="beta"):
        sim.NetworkProfile("bad", alpha=0.0, beta=-1.0, source="test")


def test_a_fitted_profiles_gamma_counts_under_every_algorithm():
    """A fitted profile's gamma is a time per byte like its beta: the ring reads
    alpha + (beta + gamma) n, and another algorithm's link constants come from that whole line
    (not from beta alone, which would drop the reduction time for every algorithm but ring)."""
    with_gamma = sim.NetworkProfile("fit", alpha=2e-4, beta=6e-10, gamma=2e-10, source="test", fitted_world_size=8)
    folded = sim.NetworkProfile("fit", alpha=2e-4, beta=8e-10, source="test", fitted_world_size=8)
    sizes = np.array([0.0, 1e3, 1e6, 1e8])
    assert with_gamma.cost(8)(sizes) == pytest.approx(2e-4 + 8e-10 * sizes, rel=1e-12)
    for algorithm in ("naive", "central", "halving_doubling", "binomial_tree", "ps"):
        got, want = with_gamma.cost(8, algorithm)(sizes), folded.cost(8, algorithm)(sizes)
        assert got == pytest.approx(want, rel=1e-12), algorithm
        assert got[-1] > sim.NetworkProfile("fit", alpha=2e-4, beta=6e-10, source="test",
                                            fitted_world_size=8).cost(8, algorithm)(sizes)[-1], algorithm


# --- invalid input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kw, needle",
    [
        ((-1.0, 4), {}, "nbytes"),
        ((float("nan"), 4), {}, "nbytes"),
        ((np.array([1.0, -2.0]), 4), {}, "nbytes"),
        (("many", 4), {}, "nbytes"),
        # (these were taken as 1e6 bytes, 1 byte and [1, 0] bytes; 10**400 an OverflowError)
        (("1e6", 4), {}, "nbytes must be a number or an array of numbers, got '1e6'"),
        ((True, 4), {}, "nbytes must be a number or an array of numbers, got True"),
        ((np.array([True, False]), 4), {}, "nbytes must be a number or an array of numbers"),
        ((10**400, 4), {}, "every size must be finite and >= 0"),
        (([10**400], 4), {}, "every size must be finite and >= 0"),
        ((1.0, 0), {}, "world_size"),
        ((1.0, 2.5), {}, "world_size"),
        ((1.0, True), {}, "world_size"),
        ((1.0, 4, "butterfly"), {}, "algorithm"),
        ((1.0, 4), {"alpha": -1.0}, "alpha"),
        ((1.0, 4), {"gamma": float("inf")}, "gamma"),
        ((1.0, 4), {"alpha": 10**400}, "alpha=1000.*; it must be finite and >= 0"),  # (was an OverflowError)
        ((1.0, 4, "ring"), {"servers": 2}, "servers"),
        ((1.0, 4, "ps"), {"servers": 0}, "servers"),
        ((1.0, 4, "ps"), {"gpus_per_node": 2}, "gpus_per_node"),
        ((1.0, 4, "hierarchical"), {}, "gpus_per_node"),
        ((1.0, 6, "hierarchical"), {"gpus_per_node": 4, "intra_beta": 1e-10}, "multiple"),
        ((1.0, 8, "hierarchical"), {"gpus_per_node": 0, "intra_beta": 1e-10}, "gpus_per_node"),
        ((1.0, 8, "hierarchical"), {"gpus_per_node": 2, "intra_beta": -1.0}, "intra_beta"),
        ((1.0, 8, "hierarchical"), {"gpus_per_node": 2, "intra_beta": 1e-10, "nics_per_node": 0}, "nics_per_node"),
    ],
)
def test_invalid_input(args, kw, needle):
    kw = {"beta": 1e-9, **kw}
    with pytest.raises(ValueError, match=needle):
        sim.allreduce_time(*args, **kw)


def test_beta_is_required():
    with pytest.raises(ValueError, match="beta"):
        sim.allreduce_time(1.0, 4)


def test_counts_past_what_the_formulas_compute_are_refused():
    # world_size or servers of 400 digits was an "OverflowError: int too large to convert to float"
    # from inside a formula.
    with pytest.raises(ValueError, match=r"world_size=1000.*; it must be an integer >= 1 and at most 1e\+15"):
        costs.allreduce_time(1e6, 10**400, beta=1e-9)
    with pytest.raises(ValueError, match=r"servers=1000.*; it must be an integer >= 1 and at most 1e\+15"):
        costs.allreduce_time(1e6, 4, "ps", beta=1e-9, servers=10**400)
    assert costs.allreduce_time(1e6, 10**15, beta=1e-9) > 0
