"""Parameter-server training in real processes (spawn): exactness, staleness, faults, resume.

Servers start with ``launch_local`` (processes); workers run through ``mp_harness.run_ranks``,
which kills every process on failure or timeout. Each worker returns its final parameters
and stats, or the error it raised with how long it took to raise it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from ringtrain.ps import ParameterServerTraining, launch_local

from mp_harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]
SECRET = b"ps-test-secret"
W = 2
PARTITION_MB = 40 * 4 / (1 << 20)  # 40-element partitions: the 6x16 and 16x3 weights are cut


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def loss_of(m: nn.Module, x, y) -> torch.Tensor:
    return nn.functional.cross_entropy(m(x), y)


def _worker(rank, world_size, port, endpoints, strategy, steps, die_at=None, started=None, step_sleep=0.0,
            save_at=None, timeout=10.0, max_steps=None):
    torch.set_num_threads(1)
    m = model()
    t0 = time.monotonic()
    try:
        ps = ParameterServerTraining(m, servers=endpoints, worker=rank, workers=world_size, strategy=strategy,
                                     lr=0.1, momentum=0.9, partition_mb=PARTITION_MB, secret=SECRET,
                                     timeout=timeout)
        first = ps.step_count
        for step in range(first, steps):
            x, y = batch(rank, step)
            loss_of(ps, x, y).backward()
            if die_at is not None and rank == 1 and step == die_at:
                time.sleep(0.05)  # some pushes are on the wire, maybe not all
                os._exit(3)
            ps.step()
            if started is not None and step == first + 1 and rank == 0:
                started.set()
            if step_sleep:
                time.sleep(step_sleep)
            if save_at is not None and rank == 0 and ps.step_count == save_at:
                ps.save_checkpoint()
        ps.wait()
        params = [p.detach().clone().numpy() for p in m.parameters()]
        stats = ps.close()
        return {"params": params, "stats": stats, "first": first}
    except Exception as exc:  # returned, with how long it took to surface
        return {"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - t0}


def reference(steps: int, start: int = 0, m: nn.Module | None = None, concatenated: bool = False):
    """Single-process SGD: per-worker gradients summed in worker order / W (or one big batch)."""
    m = m or model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(start, steps):
        opt.zero_grad()
        if concatenated:
            xs, ys = zip(*(batch(w, step) for w in range(W)))
            loss_of(m, torch.cat(xs), torch.cat(ys)).backward()
        else:
            total = None
            for w in range(W):
                m.zero_grad()
                loss_of(m, *batch(w, step)).backward()
                grads = [p.grad.clone() for p in m.parameters()]
                total = grads if total is None else [a.add_(b) for a, b in zip(total, grads)]
            for p, g in zip(m.parameters(), total):
                p.grad = g.div_(W)
        opt.step()
    return [p.detach().numpy() for p in m.parameters()]


def ok(results):
    for r in results:
        assert isinstance(r, dict) and "error" not in r, r
    return results


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_equals_single_process_sgd_after_20_steps(servers):
    steps = 20
    with launch_local(servers, W, strategy="sync" if servers == 1 else "sharded", secret=SECRET, timeout=30) as srv:
        results = ok(run_ranks(_worker, W, srv.endpoints, "sync" if servers == 1 else "sharded", steps, timeout=80))
        server_stats = srv.join(20)
    exact = reference(steps)
    for w, r in enumerate(results):
        for i, (got, want) in enumerate(zip(r["params"], exact)):
            # Bitwise: the servers sum in worker order and divide by W, as the reference does,
            # and apply the same elementwise SGD; sharding and partitions do not reorder anything.
            assert np.array_equal(got, want), f"worker {w} param {i}: max diff {np.abs(got - want).max()}"
    # Against one process on the concatenated batch only the reduction order differs (float32).
    for got, want in zip(results[0]["params"], reference(steps, concatenated=True)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # Bytes: each worker sends every gradient once per step (+ INIT for worker 0) and receives
    # every parameter once per pull; the servers' counts are the mirror image.
    n = sum(p.numel() for p in model().parameters()) * 4
    for w, r in enumerate(results):
        s = r["stats"]
        assert s["bytes_sent"] >= (steps + (w == 0)) * n and s["bytes_received"] >= (steps + 1) * n
    assert sum(s["bytes_received"] for s in server_stats) == sum(r["stats"]["bytes_sent"] for r in results)
    assert sum(s["bytes_sent"] for s in server_stats) == sum(r["stats"]["bytes_received"] for r in results)
    assert [s["version"] for s in server_stats] == [steps] * servers


def test_async_runs_and_reports_staleness():
    steps = 12
    with launch_local(2, W, strategy="async", max_staleness=1, secret=SECRET, timeout=30) as srv:
        results = ok(run_ranks(_worker, W, srv.endpoints, "async", steps, timeout=80))
        server_stats = srv.join(20)
    for s in server_stats:
        hist = {int(k): v for k, v in s["staleness_histogram"].items()}
        assert sum(hist.values()) == W * steps  # one update per worker per step
        # Worker w pulls at its clock c only while the other's clock is <= c + 1; until w's push
        # lands the other can push at clocks c-1, c, c+1 only: at most 3 updates in between,
        # i.e. staleness <= max_staleness + 2 with two workers.
        assert max(hist) <= 3, hist
        assert s["version"] == W * steps
    assert results[0]["stats"]["staleness_histogram"]  # reported to workers at BYE too


def test_killed_worker_ends_a_sync_job_with_an_error_naming_it():
    with launch_local(1, W, strategy="sync", secret=SECRET, timeout=10) as srv:
        results = run_ranks(_worker, W, srv.endpoints, "sync", 10, 3, timeout=60, allow_missing=(1,))
        assert srv.join(10) == [None]
        errors = srv.errors
    r0 = results[0]
    assert "error" in r0, r0
    # Worker 1 died after its step-3 backward: its step-3 push may or may not have been whole,
    # so the job stops at step 3 or 4 -- never in between (see test_ps_server for a half push).
    assert "PeerLost" in r0["error"] and re.search(r"worker 1 was lost at step [34] ", r0["error"]), r0
    assert r0["after_s"] < 30
    assert re.search(r"worker 1 was lost at step [34] ", errors[0])


def test_killed_worker_in_async_job_the_rest_go_on_and_say_so():
    # max_staleness=1: worker 0 cannot finish before worker 1 dies, so it sees the loss.
    with launch_local(1, W, strategy="async", max_staleness=1, secret=SECRET, timeout=10) as srv:
        results = run_ranks(_worker, W, srv.endpoints, "async", 8, 3, timeout=60, allow_missing=(1,))
        server_stats = srv.join(20)
    r0 = results[0]
    assert "error" not in r0, r0
    assert any("1 of 2 workers left" in n for n in r0["stats"]["notices"]), r0["stats"]["notices"]
    assert any("worker 1 was lost" in n for n in server_stats[0]["notices"])
    # worker 0's 8 updates and worker 1's complete ones: 3, or 4 if its step-3 push was whole
    assert server_stats[0]["version"] in (8 + 3, 8 + 4)


def test_killed_server_is_a_clear_error_on_every_worker():
    started = mp.get_context("spawn").Event()
    with launch_local(2, W, strategy="sharded", secret=SECRET, timeout=10) as srv:
        def killer():
            if started.wait(60):
                srv.procs[1].kill()

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        results = run_ranks(_worker, W, srv.endpoints, "sharded", 10_000, None, started, 0.01, timeout=60)
        t.join(5)
    for w, r in enumerate(results):
        assert "error" in r, (w, r)
        assert "parameter server" in r["error"] and r["after_s"] < 40, (w, r)
    assert any("parameter server 1" in r["error"] for r in results), results


def test_server_shards_checkpoint_and_resume_exactly(tmp_path):
    ckpt = str(tmp_path / "ps")
    with launch_local(2, W, strategy="sharded", secret=SECRET, timeout=30, checkpoint_dir=ckpt) as srv:
        ok(run_ranks(_worker, W, srv.endpoints, "sharded", 5, None, None, 0.0, 5, timeout=80))
        srv.join(20)
    assert sorted(os.listdir(ckpt)) == ["server-0", "server-1"]
    with launch_local(2, W, strategy="sharded", secret=SECRET, timeout=30, checkpoint_dir=ckpt, resume=True) as srv:
        results = ok(run_ranks(_worker, W, srv.endpoints, "sharded", 9, timeout=80))
        srv.join(20)
    assert [r["first"] for r in results] == [5, 5]
    for got, want in zip(results[0]["params"], reference(9)):
        assert np.array_equal(got, want)


def _role(rank, world_size, port, servers, steps):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RINGTRAIN_SECRET="role-secret")
    from ringtrain import ps

    torch.set_num_threads(1)
    if ps.is_server_rank(servers):
        return {"server": ps.run_server_role(servers, strategy="sharded", timeout=30)}
    m = model()
    pst = ps.worker_from_env(m, servers, strategy="sharded", lr=0.1, momentum=0.9, partition_mb=PARTITION_MB)
    for step in range(steps):
        loss_of(pst, *batch(pst.worker, step)).backward()
        pst.step()
    pst.wait()
    params = [p.detach().clone().numpy() for p in m.parameters()]
    return {"params": params, "stats": pst.close(), "worker": pst.worker}


def test_roles_in_one_job_workers_first_then_servers():
    """Ranks [0, W) train, ranks [W, W+K) serve, endpoints through the job's TCPStore."""
    servers, steps = 2, 4
    results = ok(run_ranks(_role, W + servers, servers, steps, timeout=80))
    assert [r["worker"] for r in results[:W]] == list(range(W))
    assert [r["server"]["version"] for r in results[W:]] == [steps] * servers
    for r in results[:W]:
        for got, want in zip(r["params"], reference(steps)):
            assert np.array_equal(got, want)


def _role_without_a_server(rank, world_size, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RINGTRAIN_SECRET="role-secret")
    from ringtrain import ps

    if ps.is_server_rank(1):
        return {"server": None}  # never serves: its endpoint never reaches the store
    return {"worker": ps.worker_from_env(model(), 1, timeout=2.0, join_timeout=2.0)}


def test_a_server_rank_that_never_publishes_its_endpoint_is_a_comm_timeout_naming_it():
    """worker_from_env raised torch's DistStoreError ("wait timeout after 2000ms, keys: ..."), not
    a CommError, and did not say which server was missing."""
    results = run_ranks(_role_without_a_server, 2, timeout=60)
    error = results[0]
    assert getattr(error, "type_name", None) == "CommTimeout", error
    assert "parameter server 0 (rank 1) did not publish its endpoint in the job's store within 2 s (join_timeout)" \
        in error.message, error.message


def test_a_module_off_the_cpu_is_refused_before_connecting():
    # Servers and workers move CPU memory; "meta" stands for a GPU (CI has none). The error comes
    # before any connection is tried, so the endpoint need not exist.
    module = nn.Linear(3, 2, device="meta")
    with pytest.raises(ValueError, match=r"'weight' is on meta.*CPU"):
        ParameterServerTraining(module, servers=[("127.0.0.1", 9)], worker=0, workers=1)


def test_benchmark_refuses_fewer_than_one_step():
    from ringtrain.ps.launch import benchmark

    with pytest.raises(ValueError, match="steps"):
        benchmark("mlp", steps=0)  # once a nan median and no error


@pytest.mark.timeout(120)
@pytest.mark.parametrize("steps, timed", [(4, 4), (5, 3)])
def test_benchmark_times_the_steps_its_docstring_says(steps, timed):
    from ringtrain.ps.launch import benchmark

    r = benchmark("mlp", "sync", servers=1, workers=2, steps=steps, timeout=60)
    rows = np.array(r["worker_step_s"])
    assert rows.shape == (2, steps)
    # 2 warm-up steps are dropped only when more than 4 were run, so that at least 3 are timed
    assert r["median_step_s"] == float(np.median(np.max(rows[:, steps - timed:], axis=0)))


def test_servers_resumed_at_different_steps_say_which_checkpoints_to_remove():
    """Servers on several machines see only their own machine's shard folders: a save cut short on one
    machine resumed the others a step later, and the workers' error named the steps and nothing else."""
    from types import SimpleNamespace

    from ringtrain.errors import ProtocolError

    links = [SimpleNamespace(clock=20, ch=SimpleNamespace(peer="parameter server 0 at 10.77.0.1:41000")),
             SimpleNamespace(clock=10, ch=SimpleNamespace(peer="parameter server 1 at 10.77.0.2:41001")),
             SimpleNamespace(clock=10, ch=SimpleNamespace(peer="parameter server 2 at 10.77.0.2:41002"))]
    with pytest.raises(ProtocolError) as info:
        ParameterServerTraining._agreed_clock(SimpleNamespace(_links=links))
    text = str(info.value)
    assert "[10, 20]" in text and "parameter server 0 at 10.77.0.1:41000 resumed at step 20" in text, text
    assert "checkpoints after step 10" in text and "every machine shares" in text, text


def test_the_async_notice_of_a_lost_worker_is_said_once_on_the_logger_and_kept(caplog, recwarn):
    """Once as a WARNING on the ringtrain.ps.worker logger (stderr where logging is not set up)
    with no warnings.warn beside it (which printed it a second time, pointing at the receiver
    thread), once in ``notices``; told again only when fewer workers are left."""
    import logging
    from types import SimpleNamespace

    from ringtrain.ps.worker import ParameterServerTraining

    caplog.set_level(logging.WARNING, logger="ringtrain.ps.worker")
    me = SimpleNamespace(worker=0, workers=3, _live=3, notices=[])
    link = SimpleNamespace(ch=SimpleNamespace(peer="parameter server 0"))
    for live in (2, 2, 1):
        ParameterServerTraining._note_live(me, live, link)
    expected = [f"worker 0: parameter server 0 reports {n} of 3 workers left; asynchronous training goes on with them"
                for n in (2, 1)]
    assert me.notices == expected
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ringtrain.ps.worker", "WARNING", text) for text in expected]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]
