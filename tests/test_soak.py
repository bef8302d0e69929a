"""The soak (ringtrain.bench.soak), short: 500 random allreduces on real processes, all exact,
with file descriptors flat and memory bounded; and the soak's own check shown able to fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ringtrain.bench import soak
from ringtrain.bench.soak import SoakConfig
from ringtrain.lifecycle import pid_alive


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
        inputs = [soak.rank_input(p, i, r, 3) for r in range(3)]
        want = {"sum": sum(inputs), "prod": inputs[0] * inputs[1] * inputs[2],
                "min": np.minimum.reduce(inputs), "max": np.maximum.reduce(inputs)}[p.op]
        np.testing.assert_array_equal(soak.expected(p, i, 3), want)
        # exact in the op's dtype: the buffer holds exactly these values
        assert np.array_equal(soak.as_float64(soak.make_buffer(p, inputs[0])), inputs[0].astype(np.float64))


@pytest.mark.parametrize("world", [2, 7, 16, 17, 18, 64])
def test_every_op_stays_exact_in_its_dtype_at_any_world_size(world):
    import torch

    cfg = SoakConfig(world_size=world, max_elems=64)
    folds = {"sum": torch.sum, "mean": torch.sum, "prod": torch.prod,
             "min": lambda t, dim: torch.min(t, dim=dim).values, "max": lambda t, dim: torch.max(t, dim=dim).values}
    checked = set()
    for i in range(600):
        p = soak.plan(cfg, i)
        if p.numel == 0:
            continue
        # what any correct allreduce gives: the reduction folded in the buffer's own dtype
        bufs = [torch.as_tensor(soak.make_buffer(p, soak.rank_input(p, i, r, world))) for r in range(world)]
        got = folds[p.op](torch.stack(bufs), dim=0).to(bufs[0].dtype)
        if p.op == "mean":
            got = got / world
        want = soak.expected(p, i, world)
        assert np.array_equal(soak.as_float64(got), want), (i, p, world)
        checked.add((p.op, p.dtype))
    assert {("prod", "uint8"), ("sum", "uint8"), ("sum", "bfloat16")} <= checked
    if world >= 8:  # every rank gives some element a nonzero value: none is left unchecked
        for op in ("sum", "prod"):
            p = soak.OpPlan(world, "uint8", op, "ring", False)
            assert all((soak.rank_input(p, 0, r, world) > (op == "prod")).any() for r in range(world))


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


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry))
    return kids


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_the_ranks_die_with_an_interrupted_soak():
    harness = subprocess.Popen([sys.executable, "-m", "ringtrain.bench.soak", "--ops", "200000", "--world-size", "2",
                                "--transport", "tcp"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(ranks) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            ranks = _children(harness.pid)
        assert len(ranks) == 2, "the soak did not start its ranks"
        time.sleep(2)  # past the ranks' imports, into their loop
        harness.send_signal(signal.SIGTERM)
        harness.wait(timeout=10)
        deadline = time.monotonic() + 10
        while [r for r in ranks if pid_alive(r)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [r for r in ranks if pid_alive(r)], "ranks outlived the soak"
    finally:
        harness.kill()
        harness.wait(timeout=5)
        for r in ranks:
            if pid_alive(r):
                os.kill(r, signal.SIGKILL)
