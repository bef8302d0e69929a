"""kill -9 one rank in the middle of backward of a DistributedDataParallel training step.

The model's layers are reduced one bucket per layer (schedule "wfbp"), so when the victim
dies — from a gradient hook on a middle layer, at a chosen iteration — the survivors' comm
threads are part-way through the allreduces of the later layers' buckets while their own
backward is still running. Each survivor's ``loss.backward()`` (or the next step) must raise
PeerLost or CommTimeout within timeout + 2 s, and the survivor must exit on its own.
"""

from __future__ import annotations

import pytest

from harness import inject, until_error
from test_kill import judge

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

TIMEOUT = 4.0
KILL_AT = 6
"""The victim dies inside the backward of its 7th step (after the planned buckets are in use)."""


def ddp_loop(rank, world_size, port, fault, transport, victim):
    import torch

    import ringtrain
    from ringtrain.models.mlp import MLP

    torch.set_num_threads(1)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport=transport, timeout=TIMEOUT)
    torch.manual_seed(0)
    model = MLP(in_features=256, hidden=(512, 512, 512), num_classes=10)
    ddp = ringtrain.DistributedDataParallel(model, comm=comm, schedule="wfbp", alpha=1e-4, beta=1e-9,
                                            warmup_iterations=0, profile_iterations=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = model.make_batch(8, seed=rank)
    steps = [0]
    if rank == victim:
        middle = model.net[2].weight  # the second of four linear layers: mid-backward

        def maybe_die(grad):
            if steps[0] == KILL_AT:
                fault.kill_me()
            return grad

        middle.register_hook(maybe_die)

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(ddp(x), y).backward()
        opt.step()
        steps[0] += 1

    out = until_error(step, fault)
    comm.close()
    return out


@pytest.mark.parametrize("transport, world", [("tcp", 2), ("shm", 3), ("torch", 2)])
def test_kill_9_during_backward(transport, world, fault_log):
    victim = world - 1
    out = inject(ddp_loop, world, victim, None, transport, victim, timeout=TIMEOUT)
    assert out.fault_at > 0, "the victim never reached its fault point"
    # The next step must fail too, with a CommError: its forward names the failed backward.
    judge(out, fault_log, f"kill -9 rank {victim}/{world} inside DDP backward on {transport}", timeout=TIMEOUT)
    for r, res in out.results.items():
        print(f"  rank {r}: {res['error']}: {res['message'][:150]}; next step: {res['again'][:100]}")
