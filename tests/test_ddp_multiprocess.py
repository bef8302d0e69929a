"""DistributedDataParallel in real processes (spawned ranks, tcp and shm transports).

Each rank trains 20 steps and returns its parameters; the parent checks them bitwise equal
across ranks and close to single-process training. Skips cleanly where a transport module
has not landed. The harness (mp_harness) kills every rank at the deadline.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from mp_harness import run_ranks
from test_ddp_support import make_model, perturbed, rank_batch, reference, train

pytestmark = pytest.mark.multiprocess


def _need(transport: str) -> None:
    if importlib.util.find_spec(f"ringtrain.transport.{transport}") is None:
        pytest.skip(f"ringtrain.transport.{transport} has not landed yet")


def _rank_main(rank, world_size, port, transport, name, schedule, algorithm, timeline):
    import torch

    import ringtrain

    torch.set_num_threads(1)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport=transport, timeout=30.0)
    try:
        # No comm= argument: the wrapper takes the communicator made by ringtrain.init.
        ddp = ringtrain.DistributedDataParallel(perturbed(make_model(name), rank), schedule=schedule,
                                                algorithm=algorithm, timeline=timeline, timeline_iterations=4)
        params = train(ddp, lambda s: rank_batch(name, s, world_size, rank))
        stats = [s.to_dict() for s in ddp.stats]
        ddp.close()
        return [p.numpy() for p in params], stats, (ddp.alpha, ddp.beta), ddp.plan.groups
    finally:
        comm.close()


def _check(results, name, world_size):
    for r in results:
        if isinstance(r, BaseException):
            raise r
    first = results[0][0]
    for rank, (params, _, ab, groups) in enumerate(results):
        assert ab == results[0][2], "every rank must plan with rank 0's alpha and beta"
        assert groups == results[0][3], "every rank must use the same plan"
        for i, (a, b) in enumerate(zip(first, params)):
            assert (a == b).all(), f"parameter {i} differs between rank 0 and rank {rank}"
    for i, (got, want) in enumerate(zip(first, reference(name, world_size))):
        # Reduction order differs from the single-process batch (see test_ddp_correctness).
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-5, msg=f"parameter {i}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport, name, schedule, algorithm, world_size", [
    ("tcp", "mlp", "optimal", "ring", 2),
    ("tcp", "conv", "mgwfbp", "halving_doubling", 3),
    ("shm", "mlp", "fixed", "auto", 2),
])
def test_processes_match_single_process(transport, name, schedule, algorithm, world_size):
    _need(transport)
    results = run_ranks(_rank_main, world_size, transport, name, schedule, algorithm, None, timeout=100.0)
    _check(results, name, world_size)


@pytest.mark.timeout(120)
def test_processes_write_one_trace_per_rank(tmp_path):
    _need("tcp")
    results = run_ranks(_rank_main, 2, "tcp", "mlp", "wfbp", "ring", str(tmp_path / "trace.json"), timeout=100.0)
    _check(results, "mlp", 2)
    for rank in range(2):
        doc = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        cats = {e.get("cat") for e in doc["traceEvents"] if e["ph"] == "X"}
        assert {"forward", "backward", "allreduce", "wait"} <= cats
        stats = results[rank][1]
        assert len(stats) == 20 and all(0.0 <= s["hidden_fraction"] <= 1.0 for s in stats)
