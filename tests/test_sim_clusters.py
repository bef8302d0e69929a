"""Clusters: named profiles, user alpha/beta, alpha/beta fitted from a bench allreduce file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringtrain.sim import costs
from ringtrain.sim.clusters import Cluster, custom, from_bench, named, resolve, resolve_many
from ringtrain.sim.costs import link_from_fit

pytestmark = pytest.mark.timeout(30)

SIZES = np.array([1e3, 1e5, 1e6, 1e7, 1e8])


def test_named_link_profiles_are_costs_table_entries():
    c = named("10gbe")
    prof = costs.NETWORKS["10GbE"]
    assert (c.name, c.alpha, c.beta) == ("10GbE", prof.alpha, prof.beta)
    assert np.array_equal(c.cost(64, "ring")(SIZES), costs.allreduce_time(SIZES, 64, "ring", prof.alpha, prof.beta))


def test_a_fitted_profile_reproduces_its_allreduce_at_its_own_world_size_and_scales_as_a_ring():
    c = named("mgwfbp-10GbE-16")
    assert c.cost(16, "ring")(SIZES) == pytest.approx(9.08e-4 + 7.40e-10 * SIZES, rel=1e-12)
    assert c.cost(16, "ring")(SIZES) == pytest.approx(costs.NETWORKS["mgwfbp-10GbE-16"].cost(16)(SIZES), rel=1e-12)
    # ring: start-up grows as 2(p-1), bandwidth term as 2(p-1)/p
    assert c.cost(64, "ring")(0.0 + 1e-300) == pytest.approx(9.08e-4 * 63 / 15, rel=1e-12)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "binomial_tree", "naive", "central"])
def test_link_from_fit_inverts_every_formula(algorithm):
    alpha, beta = link_from_fit(3e-3, 2e-9, 12, algorithm)
    got = costs.allreduce_time(SIZES, 12, algorithm, alpha, beta)
    assert got == pytest.approx(3e-3 + 2e-9 * SIZES, rel=1e-12)


def test_custom_spec():
    c = custom("alpha=2e-5,beta=8e-10,gpus_per_node=4,servers=2")
    assert (c.alpha, c.beta, c.gpus_per_node, c.servers) == (2e-5, 8e-10, 4, 2)
    assert c.options("hierarchical")["gpus_per_node"] == 4 and c.options("ps") == {"servers": 2}
    assert c.options("ring") == {}
    assert c.options("hierarchical")["nics_per_node"] == 1
    wide = custom("alpha=0,beta=1e-9,intra_beta=1e-10,gpus_per_node=8,nics_per_node=8")
    # one card per GPU: the 8 inter-node rings do not share a card
    assert wide.cost(16, "hierarchical")(1e6) < custom("alpha=0,beta=1e-9,intra_beta=1e-10").cost(16, "hierarchical")(1e6)
    for bad, match in [("alpha=1", "beta"), ("alpha=x,beta=1", "not a number"), ("alpha=1,beta=1,speed=3", "keys"),
                       ("alpha=-1,beta=1", "alpha")]:
        with pytest.raises(ValueError, match=match):
            custom(bad)


def test_resolve_many_splits_names_but_not_key_value_specs():
    got = resolve_many(["1GbE,100Gb-IB", "alpha=1e-5,beta=1e-9,name=mine"])
    assert [c.name for c in got] == ["1GbE", "100Gb-IB", "mine"]
    with pytest.raises(ValueError, match="--cluster.*10GbE"):
        resolve("token-ring")


def test_hierarchical_needs_full_nodes():
    c = named("10GbE", gpus_per_node=8)
    assert c.cost(4, "hierarchical")(1e6) > 0  # one node: a ring on NVLink
    with pytest.raises(ValueError, match="--gpus"):
        c.cost(12, "hierarchical")
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):  # (no flag: plan says --algorithm)
        c.cost(8, "butterfly")


def _bench_file(tmp_path, a=4e-4, b=2.5e-9, p=4):
    rows = [
        # ours, exactly linear; extra keys as the real bench writes them
        {"impl": "ringtrain", "transport": "tcp", "algorithm": "ring", "world_size": p, "nbytes": int(n),
         "median_s": a + b * n, "iters": 3, "busbw_GBps": 1.0, "net": None}
        for n in SIZES
    ] + [
        {"impl": "gloo", "transport": "gloo", "algorithm": "torch.distributed", "world_size": p, "nbytes": int(n),
         "median_s": 1.0}
        for n in SIZES
    ] + [
        {"impl": "ringtrain", "transport": "tcp", "algorithm": "ring", "world_size": 2, "nbytes": int(n), "median_s": 9.0}
        for n in SIZES
    ] + [
        {"impl": "ringtrain", "transport": "shm", "algorithm": "ring", "world_size": p, "nbytes": int(n), "median_s": 1e-6}
        for n in SIZES  # same host: not the network, so not used while tcp rows exist
    ] + [{"note": "a row without the keys is skipped"}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"world_sizes": [2, p], "net": None, "rows": rows, "notes": []}))
    return path


def test_from_bench_fits_the_largest_world_size_and_converts_to_link_constants(tmp_path):
    path = _bench_file(tmp_path)
    c = resolve(str(path))
    assert c.name == "bench:bench"
    # the fitted cluster reproduces the measured allreduce at the measured world size
    assert c.cost(4, "ring")(SIZES) == pytest.approx(4e-4 + 2.5e-9 * SIZES, rel=1e-9)
    two = from_bench(path, world_size=2)
    assert two.cost(2, "ring")(SIZES) == pytest.approx(np.full(len(SIZES), 9.0), rel=1e-9)
    shm = from_bench(path, transport="shm")
    assert shm.cost(4, "ring")(SIZES) == pytest.approx(np.full(len(SIZES), 1e-6), rel=1e-9)


def test_from_bench_errors(tmp_path):
    path = _bench_file(tmp_path)
    with pytest.raises(ValueError, match="algorithm='naive'"):
        from_bench(path, algorithm="naive")
    with pytest.raises(ValueError, match="world_size=3"):
        from_bench(path, world_size=3)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"rows": [{"x": 1}]}))
    with pytest.raises(ValueError, match="no row has all"):
        resolve(str(empty))
    with pytest.raises(ValueError, match="cannot read"):
        resolve(str(tmp_path / "missing.json"))



def _rows_file(tmp_path, rows):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"rows": [dict(algorithm="ring", **r) for r in rows]}))
    return str(path)


def test_from_bench_errors_say_what_is_wrong_with_the_rows(tmp_path):
    # One rank: was "a fitted allreduce needs world_size >= 2, got 1", naming no file.
    one = _rows_file(tmp_path, [dict(world_size=1, nbytes=n, median_s=1e-4 * (k + 1)) for k, n in enumerate((4096, 8192))])
    with pytest.raises(ValueError, match=r"--cluster .*b.json: its ring rows are at 1 rank; .* 2 or more ranks"):
        resolve(one)
    # A world size that is not a number: was int()'s "invalid literal for int() with base 10: 'two'".
    two = _rows_file(tmp_path, [dict(world_size="two", nbytes=4096, median_s=1e-4)])
    with pytest.raises(ValueError, match=r"--cluster .*b.json: a row's world_size is not an integer"):
        resolve(two)
    # A negative time: was told to "run bench allreduce with at least two --sizes" (it had two).
    neg = _rows_file(tmp_path, [dict(world_size=2, nbytes=4096, median_s=-1.0), dict(world_size=2, nbytes=8192, median_s=1e-4)])
    with pytest.raises(ValueError) as info:
        resolve(neg)
    assert "times[0] = -1.0" in str(info.value) and "--sizes" not in str(info.value)
    same = _rows_file(tmp_path, [dict(world_size=2, nbytes=4096, median_s=1e-4)] * 2)
    with pytest.raises(ValueError, match="at least two --sizes"):
        resolve(same)

def test_from_bench_refuses_counts_it_used_to_truncate_or_crash_on(tmp_path):
    # world_size 2.5 and true were taken as 2 and 1 ranks; an int of 400 digits (JSON reads it)
    # as world_size, nbytes or median_s stopped on "OverflowError: int too large to convert to float".
    good = [dict(world_size=2, nbytes=n, median_s=1e-4 * (k + 1)) for k, n in enumerate((4096, 8192))]
    for bad in (2.5, True, 10**400):
        path = _rows_file(tmp_path, [dict(good[0], world_size=bad), good[1]])
        with pytest.raises(ValueError, match=r"--cluster .*b.json: a row's world_size is not an integer"):
            resolve(path)
    for key in ("nbytes", "median_s"):
        path = _rows_file(tmp_path, [dict(good[0], **{key: 10**400}), good[1]])
        with pytest.raises(ValueError, match=r"--cluster .*b.json: a row's nbytes or median_s is not a number"):
            resolve(path)
    path = _rows_file(tmp_path, [dict(good[0], world_size="2"), dict(good[1], world_size=2.0)])
    assert resolve(path).source.endswith("(ring, 2 ranks): a=0 s, b=2.44e-08 s/B")


def test_cluster_validation():
    with pytest.raises(ValueError, match="both be 0"):
        Cluster("x", 0.0, 0.0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Cluster("x", 1e-5, 1e-9, gpus_per_node=0)


def test_cluster_takes_numpy_numbers_as_python_numbers():
    # np.float32 and np.int64 were refused: "beta=np.float32(1e-09); it must be a finite number >= 0".
    c = Cluster("x", np.float64(1e-5), np.float32(1e-9), gpus_per_node=np.int64(4), servers=np.int32(2))
    assert (type(c.beta), type(c.gpus_per_node), type(c.servers)) == (float, int, int)
    assert c.cost(8, "hierarchical")(1e6) == Cluster("x", 1e-5, float(np.float32(1e-9)), gpus_per_node=4).cost(
        8, "hierarchical")(1e6)
    json.dumps({k: getattr(c, k) for k in c.__slots__})  # (the --json document's clusters)
    for bad in (True, "1e-9", np.float32("nan"), -1e-9):
        with pytest.raises(ValueError, match="beta=.*finite number >= 0"):
            Cluster("x", 1e-5, bad)
    with pytest.raises(ValueError, match="servers must be an integer >= 1 and at most 1e\\+15, got 2.0"):
        Cluster("x", 1e-5, 1e-9, servers=2.0)
