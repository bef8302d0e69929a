"""The soak (ringtrain.bench.soak), short: 500 random allreduces on real processes, all exact,
with file descriptors flat and memory bounded; and the soak's own check shown able to fail."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.bench import soak
from ringtrain.bench.soak import SoakConfig


def test_plans_are_deterministic_and_cover_the_space():
    cfg = SoakConfig(ops=2000, world_size=4)
    plans = [soak.plan(cfg, i) for i in range(cfg.ops)]
    assert plans == [soak.plan(cfg, i) for i in range(cfg.ops)]
    assert {p.dtype for p in plans} == set(soak.DTYPES)
    assert {p.op for p in plans} == {"sum", "mean", "min", "max", "prod"}
    assert {p.algorithm for p in plans} == set(soak.ALGORITHMS)
    assert {p.torch_buffer for p in plans} == {True, False}
    sizes = [p.numel for p in plans]
    assert min(sizes) == 0 and max(sizes) > cfg.max_elems // 4
    assert all(p.op != "mean" for p in (soak.plan(SoakConfig(world_size=3), i) for i in range(500)))


def test_expected_is_the_reduction_of_every_ranks_input():
    cfg = SoakConfig(world_size=3)
    for i in range(200):
        p = soak.plan(cfg, i)
        inputs = [soak.rank_input(p, i, r) for r in range(3)]
        want = {"sum": sum(inputs), "prod": inputs[0] * inputs[1] * inputs[2],
                "min": np.minimum.reduce(inputs), "max": np.maximum.reduce(inputs)}[p.op]
        np.testing.assert_array_equal(soak.expected(p, i, 3), want)
        # exact in the op's dtype: the buffer holds exactly these values
        assert np.array_equal(soak.as_float64(soak.make_buffer(p, inputs[0])), inputs[0].astype(np.float64))


class _Broken:
    """A communicator whose allreduce leaves the buffer alone: the soak must count errors."""

    rank, world_size = 0, 2

    def allreduce(self, buf, op, algorithm):
        return buf


def test_the_check_catches_a_wrong_result():
    report = soak.soak_rank(_Broken(), SoakConfig(ops=50, world_size=2, every=10))
    assert report["errors"] > 0 and report["first_error"].startswith("op ")


@pytest.mark.parametrize("value", [{"ops": 0}, {"world_size": 1}, {"transport": "udp"}, {"algorithms": ("fast",)},
                                   {"timeout": 0}, {"every": -1}, {"max_elems": 1.5}])
def test_bad_config(value):
    with pytest.raises(ValueError, match=next(iter(value))):
        SoakConfig(**value)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport, world", [("tcp", 4), ("shm", 3)])
def test_short_soak_is_exact_with_flat_fds(transport, world):
    doc = soak.run(SoakConfig(ops=500, world_size=world, transport=transport, every=100, seed=11), deadline_s=80)
    print(soak.describe(doc))
    assert doc["errors"] == 0, doc["first_error"]
    assert doc["ops"] == 500
    assert doc["fds_first"] == doc["fds_last"], "file descriptors leak"
    growth = max(b - a for a, b in zip(doc["rss_mb_first"], doc["rss_mb_last"]))
    assert growth < 64, f"resident memory grew by {growth} MB from op 100 to op 500"
