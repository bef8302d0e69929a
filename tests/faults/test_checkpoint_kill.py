"""kill -9 the rank that is writing a checkpoint: the previous checkpoint stays whole.

Ranks train a small MLP with DistributedDataParallel; rank 0 saves a checkpoint after every
step. During its save of step ``KILL_SAVE`` it kills itself at one of two moments:

- ``mid-write``: half of the serialized checkpoint is in the temporary file;
- ``before-rename``: the temporary file is complete and being fsynced, not yet renamed.

The survivors must raise PeerLost or CommTimeout within timeout + 2 s; afterwards the newest
valid checkpoint (``checkpoint.latest``) is that of step ``KILL_SAVE - 1`` and its model
tensors are bitwise equal to the parameters a survivor held after that step.
"""

from __future__ import annotations

import pytest

from harness import inject, until_error
from test_kill import judge

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

TIMEOUT = 4.0
KILL_SAVE = 5
"""Rank 0 dies while saving the checkpoint of this step."""


def checkpointing_loop(rank, world_size, port, fault, transport, directory, moment):
    import io
    import os

    import torch

    import ringtrain
    from ringtrain import checkpoint
    from ringtrain.models.mlp import MLP

    torch.set_num_threads(1)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport=transport, timeout=TIMEOUT)
    torch.manual_seed(0)
    model = MLP(in_features=64, hidden=(128, 128), num_classes=10)
    ddp = ringtrain.DistributedDataParallel(model, comm=comm, schedule="single", alpha=1e-4, beta=1e-9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = model.make_batch(8, seed=rank)
    step_no = [0]
    dying = [False]

    real_save, real_fsync = torch.save, os.fsync

    def half_then_die(obj, f, *a, **kw):
        if not dying[0]:
            return real_save(obj, f, *a, **kw)
        whole = io.BytesIO()
        real_save(obj, whole, *a, **kw)
        f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
        f.flush()
        fault.kill_me()

    def fsync_then_die(fd):
        real_fsync(fd)
        if dying[0]:
            fault.kill_me()

    if rank == 0:
        if moment == "mid-write":
            torch.save = half_then_die
        else:
            os.fsync = fsync_then_die

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(ddp(x), y).backward()
        opt.step()
        step_no[0] += 1
        s = step_no[0]
        if rank == 0:
            dying[0] = s == KILL_SAVE
            checkpoint.save(directory, s, checkpoint.training_state(s, model, opt), keep=2)
        elif rank == 1 and s == KILL_SAVE - 1:
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(directory, "..", "reference.pt"))

    out = until_error(step, fault, limit_s=90.0)
    comm.close()
    return out


@pytest.mark.parametrize("transport, moment", [("tcp", "mid-write"), ("shm", "before-rename"), ("torch", "mid-write")])
def test_kill_9_during_checkpoint_write(tmp_path, transport, moment, fault_log):
    import torch

    from ringtrain import checkpoint

    directory = tmp_path / "ckpt"
    directory.mkdir()
    out = inject(checkpointing_loop, 2, 0, None, transport, str(directory), moment, timeout=TIMEOUT)
    assert out.fault_at > 0, "rank 0 never reached its fault point"
    judge(out, fault_log, f"kill -9 rank 0/2 during a checkpoint write ({moment}) on {transport}", timeout=TIMEOUT)
    leftovers = sorted(p.name for p in directory.iterdir())
    found = checkpoint.latest(directory)
    assert found is not None and found.step == KILL_SAVE - 1, leftovers
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    saved = found.payload["model"]
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(saved[name], tensor), name
    print(f"  after the kill: {leftovers}; newest valid = step {found.step}, bitwise equal to the survivor's")
