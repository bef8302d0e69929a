"""torch's own DistributedDataParallel over ringtrain's process group, in real processes.

Each rank trains the same model twice on the same batches: with torch's DDP over
``ringtrain.TorchProcessGroup`` and with torch's DDP over gloo (the default group). The parent
checks the first bitwise equal across ranks and equal to the second. The harness (mp_harness)
kills every rank at its deadline.
"""

from __future__ import annotations

import pytest
import torch

from mp_harness import run_ranks
from thread_harness import raise_first
from test_ddp_support import make_model, perturbed, rank_batch, train

pytestmark = pytest.mark.multiprocess


def _groups(rank, world_size, port, made_by):
    """The gloo default group (the reference) and ringtrain's group, meeting in one store: over the
    communicator of ringtrain.init(), or made by torch as a group of the named backend."""
    from datetime import timedelta

    import torch.distributed as dist

    import ringtrain
    from ringtrain.torch_group import BACKEND

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    if made_by == "new_group":
        return dist.new_group(backend=BACKEND, timeout=timedelta(seconds=20))
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=20.0)
    return ringtrain.TorchProcessGroup(comm)


def _ddp(module, group, hook=None, **kwargs):
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(module, process_group=group, **kwargs)
    if hook is not None:
        ddp.register_comm_hook(group, hook)
    return ddp


def _train_both(rank, world_size, port, name, hook_name, kwargs, made_by):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    pg = _groups(rank, world_size, port, made_by)
    hook = getattr(default_hooks, hook_name) if hook_name else None
    try:
        ours = train(_ddp(perturbed(make_model(name), rank), pg, hook, **kwargs),
                     lambda s: rank_batch(name, s, world_size, rank), steps=5)
        theirs = train(_ddp(perturbed(make_model(name), rank), dist.group.WORLD, hook, **kwargs),
                       lambda s: rank_batch(name, s, world_size, rank), steps=5)
        return [p.numpy() for p in ours], [p.numpy() for p in theirs]
    finally:
        pg.close()
        pg.comm.close()
        dist.destroy_process_group()


def _check(results, atol: float):
    raise_first(results)
    first = results[0][0]
    for rank, (ours, theirs) in enumerate(results):
        for i, (a, b) in enumerate(zip(first, ours)):
            assert (a == b).all(), f"parameter {i} differs between rank 0 and rank {rank}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            diff = abs(a - b).max(initial=0.0)
            assert diff <= atol, f"rank {rank} parameter {i}: ringtrain's group and gloo differ by {diff} > {atol}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, world_size, hook, kwargs, atol, made_by", [
    # On 2 ranks every algorithm adds the two ranks' values, a + b, as gloo does: bitwise equal.
    ("mlp", 2, None, {}, 0.0, "init"),
    ("mlp", 2, "fp16_compress_hook", {}, 0.0, "new_group"),
    # On 3 ranks ringtrain and gloo add the three in different orders ((a+b)+c against a+(b+c)):
    # float32 sums differ in their last bit (1.5e-8 seen after 5 steps), float16 ones by a
    # float16 ulp of a gradient (2**-11 of it), which moves a parameter by up to lr times that
    # each step (1.1e-5 seen).
    ("conv", 3, None, {}, 1e-6, "init"),
    ("mlp", 3, "fp16_compress_hook", {"static_graph": True, "gradient_as_bucket_view": True}, 5e-5, "init"),
])
def test_torch_ddp_matches_gloo(name, world_size, hook, kwargs, atol, made_by):
    results = run_ranks(_train_both, world_size, name, hook, kwargs, made_by, timeout=100.0)
    _check(results, atol)


def _die_mid_step(rank, world_size, port, victim, timeout):
    """Torch's DDP over ringtrain's group; rank ``victim`` dies in the backward of step 2."""
    import os
    import time

    from torch.nn.parallel import DistributedDataParallel

    import ringtrain

    torch.set_num_threads(1)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=timeout)
    model = DistributedDataParallel(make_model("mlp"), process_group=ringtrain.TorchProcessGroup(comm))
    step = 0
    first = next(model.module.parameters())  # (its gradient comes last in backward)
    first.register_hook(lambda g: os._exit(3) if rank == victim and step == 2 else g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        x, y = rank_batch("mlp", step, world_size, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        start = time.monotonic()
        try:
            loss.backward()
        except RuntimeError as exc:
            return step, str(exc), time.monotonic() - start
        opt.step()
    return "no error"


@pytest.mark.timeout(120)
def test_peer_dying_mid_step_raises_in_backward():
    timeout = 30.0
    results = run_ranks(_die_mid_step, 3, 1, timeout, timeout=100.0, allow_missing=(1,))
    assert results[1] is None  # (the harness reports nothing of a rank allowed to go missing)
    for rank in (0, 2):
        assert not isinstance(results[rank], BaseException), results[rank]
        step, message, seconds = results[rank]
        assert step == 2
        # The future DDP waits on carries the ringtrain error's name and text (torch's futures
        # keep no exception type); a dead peer's closed sockets tell at once, not at the timeout.
        assert "PeerLost" in message, message
        assert seconds < timeout / 2, f"rank {rank} took {seconds:.1f}s to notice"


def _wait_on_dead_peer(rank, world_size, port):
    """rank 1 leaves after a barrier; rank 0's all_reduce work raises PeerLost itself at wait()."""
    import os

    import torch.distributed as dist

    import ringtrain

    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=30.0)
    pg = ringtrain.TorchProcessGroup(comm)
    dist.barrier(group=pg)
    if rank == 1:
        os._exit(3)
    work = dist.all_reduce(torch.ones(1000), group=pg, async_op=True)
    try:
        work.wait()
    except ringtrain.PeerLost as exc:
        return type(exc).__name__
    return "no error"


@pytest.mark.timeout(60)
def test_work_wait_raises_ringtrains_error_type():
    results = run_ranks(_wait_on_dead_peer, 2, timeout=50.0, allow_missing=(1,))
    assert results[0] == "PeerLost"


def _backend_join(rank, world_size, port, divide_by_initial_world_size):
    """init_process_group("ringtrain") under torch's launcher environment; torch's DDP with
    uneven inputs under join(), over the default group (ringtrain's) and over a gloo group.
    (``divide_by_initial_world_size=False``: DDP's reducer waits from C++ at the backward for the
    forward's Join notification, a work dropped in Python: ``RECENT_WORKS``.)"""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ringtrain.torch_group import BACKEND  # (importing the module registers the backend)

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=30))
    assert dist.get_backend() == "ringtrain"
    gloo = dist.new_group(backend="gloo")
    params = []
    for group in (None, gloo):
        model = DistributedDataParallel(make_model("mlp"), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for step in range(3 + 2 * rank):  # rank 1 has two batches more
                x, y = rank_batch("mlp", step, world_size, rank)
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        params.append([p.detach().numpy() for p in model.parameters()])
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.broadcast(t, src=1)  # (src= needs the group registered with torch, as here)
    dist.destroy_process_group()
    return params, t.item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
def test_named_backend_with_join_matches_gloo(divide_by_initial_world_size):
    results = raise_first(run_ranks(_backend_join, 2, divide_by_initial_world_size, timeout=100.0))
    for rank, ((ours, theirs), value) in enumerate(results):
        assert value == 3.0
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert (a == b).all(), f"rank {rank} parameter {i}: ringtrain's group and gloo differ"
            assert (a == results[0][0][0][i]).all(), f"parameter {i} differs between rank 0 and rank {rank}"


def _destroy_a_subgroup(rank, world_size, port):
    """init_process_group("ringtrain"), a subgroup of it, calls on it, destroy_process_group(subgroup)
    (torch unregisters it by its ``group_name``), then the default group again."""
    from datetime import timedelta

    import torch.distributed as dist

    from ringtrain.torch_group import BACKEND

    torch.set_num_threads(1)
    dist.init_process_group(BACKEND, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    sub = dist.new_group([0, 1])
    names = None
    if rank in (0, 1):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=sub)
        names = (dist.group.WORLD.group_name, sub.group_name)
        dist.destroy_process_group(sub)
    u = torch.tensor([rank + 1.0])
    dist.all_reduce(u)
    dist.destroy_process_group()
    return names, u.item()


@pytest.mark.timeout(90)
def test_named_backend_subgroup_is_destroyed_by_name():
    # Before, a group of Python's had no name ("ProcessGroup name not set"): destroy_process_group
    # of a subgroup raised on its ranks, and the next call on the default group mismatched.
    results = raise_first(run_ranks(_destroy_a_subgroup, 3, timeout=80.0))
    assert [u for _, u in results] == [6.0] * 3
    assert results[0][0] == results[1][0] and results[0][0][0] != results[0][0][1], results
    assert results[2][0] is None


def _made_again_on_one_store(rank, world_size, port):
    """init_process_group("ringtrain") three times over one TCPStore that outlives each group (as
    torchrun's agent's does), an allreduce and destroy_process_group each time."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from ringtrain.torch_group import BACKEND

    torch.set_num_threads(1)
    os.environ["RINGTRAIN_SECRET"] = "a job's secret"  # (the proofs of membership differ by group)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=30))
    sums = []
    for round_ in range(3):
        dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
        t = torch.tensor([float(rank + 1 + 10 * round_)])
        dist.all_reduce(t)
        sums.append(t.item())
        dist.destroy_process_group()
    return sums


@pytest.mark.timeout(120)
def test_named_backend_made_again_over_a_store_that_outlives_it():
    # torch gives the group made again the prefix of the one before ("default_pg/0/"), and the
    # store kept that group's keys: a rank read the last group's job identity (AuthError: 'could
    # not prove they hold this job's secret') or endpoints.
    results = raise_first(run_ranks(_made_again_on_one_store, 3, timeout=110.0))
    assert results == [[6.0, 36.0, 66.0]] * 3, results
