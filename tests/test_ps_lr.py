"""Learning-rate schedules with parameter servers: ``pst.optimizer`` (a torch Optimizer over the
servers' SGD) under torch's own schedulers, the learning rate each push carries, and what is
refused (workers that disagree, settings fixed for the run, a value that is not a rate).

Servers run in threads of this process (ps_harness), workers in threads too (on_threads).
"""

from __future__ import annotations

import math
import re
import struct
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from ringtrain.errors import CommError, MismatchError, ProtocolError
from ringtrain.ps import ParameterServerTraining, ServerOptimizer, protocol as P
from ringtrain.ps.sharding import make_layout
from ringtrain.transport.local import on_threads
import ps_harness

pytestmark = pytest.mark.timeout(60)
SECRET = b"lr-schedule-secret"
STEPS = 8
FACTORS = [0.0, 0.25, 1.0, 1.0, 0.5, 0.5, 0.125, 2.0]  # a warm-up from 0, decays, one rise
#: The servers' optimizers and their settings (Adam's not torch's defaults: they must travel).
SETTINGS = {"sgd": dict(lr=0.1, momentum=0.9),
            "adam": dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05),
            "adamw": dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)}
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def batch(w: int, step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + w))


def loss_of(m, x: torch.Tensor) -> torch.Tensor:
    return (m(x) - 1).pow(2).mean()


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: FACTORS[min(s, len(FACTORS) - 1)])


def reference(workers: int, steps: int = STEPS, lrs=None, optimizer: str = "sgd") -> list[torch.Tensor]:
    """One process: each worker's gradient summed in worker order, / W, torch's ``optimizer`` and
    scheduler (or the learning rates ``lrs``, one per step)."""
    m = model()
    opt = TORCH[optimizer](m.parameters(), **SETTINGS[optimizer])
    sched = schedule(opt) if lrs is None else None
    for s in range(steps):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[s]
        total = None
        for w in range(workers):
            m.zero_grad()
            loss_of(m, batch(w, s)).backward()
            grads = [p.grad.clone() for p in m.parameters()]
            total = grads if total is None else [a.add_(b) for a, b in zip(total, grads)]
        for p, g in zip(m.parameters(), total):
            p.grad = g.div_(workers)
        opt.step()
        if sched is not None:
            sched.step()
    return [p.detach().clone() for p in m.parameters()]


def servers(n: int, workers: int, **kw):
    started = [ps_harness.start_server(SECRET, index=k, servers=n, workers=workers, **kw) for k in range(n)]
    return started, [s.endpoint for s, _, _ in started]


def wrap(m: nn.Module, endpoints, w: int, workers: int, optimizer: str = "sgd", **kw) -> ParameterServerTraining:
    return ParameterServerTraining(m, servers=endpoints, worker=w, workers=workers, secret=SECRET, timeout=10.0,
                                   partition_mb=16 / (1 << 20), optimizer=optimizer, **SETTINGS[optimizer], **kw)


@pytest.mark.parametrize("n_servers,strategy,optimizer", [(1, "sync", "sgd"), (2, "sharded", "sgd"),
                                                           (1, "sync", "adamw"), (2, "sharded", "adamw"),
                                                           (2, "sharded", "adam")])
def test_a_torch_scheduler_on_the_optimizer_trains_as_the_optimizer_with_it_in_one_process(n_servers, strategy,
                                                                                            optimizer):
    workers = 2
    started, endpoints = servers(n_servers, workers, strategy=strategy)
    models = [model() for _ in range(workers)]

    def work(w: int):
        pst = wrap(models[w], endpoints, w, workers, optimizer, strategy=strategy)
        opt = pst.optimizer
        sched = schedule(opt)
        lrs = []
        for s in range(STEPS):
            opt.zero_grad()
            lrs.append(pst.lr)
            loss_of(pst, batch(w, s)).backward()
            opt.step()  # = pst.step()
            sched.step()
        pst.wait()
        out = [p.detach().clone() for p in models[w].parameters()]
        pst.close()
        return out, lrs

    results = on_threads(workers, work, timeout=50)
    for _, thread, _ in started:
        thread.join(10)
    want = reference(workers, optimizer=optimizer)
    for w, (got, lrs) in enumerate(results):
        assert lrs == pytest.approx([SETTINGS[optimizer]["lr"] * f for f in FACTORS])
        for i, (a, b) in enumerate(zip(got, want)):
            # Bitwise: the servers sum in worker order, divide by W and step torch's optimizer at
            # the learning rate each step's pushes carry, partition by partition (elementwise: the
            # same bits as one step over every parameter), as the reference steps with its scheduler.
            assert torch.equal(a, b), f"worker {w} parameter {i}: {(a - b).abs().max()}"


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_asynchronous_servers_apply_each_push_at_its_workers_learning_rate(optimizer):
    # One asynchronous worker: every push is applied on arrival, before the pull after it.
    started, endpoints = servers(1, 1, strategy="async")
    m = model()
    pst = wrap(m, endpoints, 0, 1, optimizer, strategy="async")
    lrs = [0.1, 0.0, 0.05, 0.2, 0.01, 0.1]
    for s, lr in enumerate(lrs):
        pst.lr = lr
        loss_of(pst, batch(0, s)).backward()
        pst.step()
    pst.wait()
    got = [p.detach().clone() for p in m.parameters()]
    pst.close()
    started[0][1].join(10)
    for a, b in zip(got, reference(1, len(lrs), lrs, optimizer)):
        assert torch.equal(a, b)


def test_workers_that_disagree_on_a_steps_learning_rate_fail_it_naming_both():
    workers = 2
    started, endpoints = servers(1, workers)
    models = [model() for _ in range(workers)]

    def work(w: int):
        pst = wrap(models[w], endpoints, w, workers)
        try:
            for s in range(4):
                if s == 2 and w == 1:
                    pst.lr = 0.05
                loss_of(pst, batch(w, s)).backward()
                pst.step()
            pst.wait()
            return "finished"
        except CommError as exc:
            return exc
        finally:
            pst._release()

    results = on_threads(workers, work, timeout=50)
    started[0][1].join(10)
    said = [str(r) for r in results]
    assert all(isinstance(r, CommError) for r in results), said
    assert any(isinstance(r, MismatchError) for r in results), said
    for text in said:  # the worker that came second is refused; the other hears why the job ended
        assert re.search(r"worker (0|1) pushed step 2 with learning rate (0.05|0.1), worker (0|1) with (0.1|0.05)",
                         text), text


def test_a_learning_rate_that_is_not_a_rate_is_refused_before_anything_is_pushed():
    started, endpoints = servers(1, 1)
    m = model()
    pst = wrap(m, endpoints, 0, 1)
    for bad in (-0.1, math.nan, math.inf, True, "0.1"):
        with pytest.raises(ValueError, match="learning rate must be a finite number >= 0"):
            pst.lr = bad
        assert pst.lr == 0.1  # kept
    pst.optimizer.param_groups[0]["lr"] = -1.0  # (as a scheduler would write it)
    with pytest.raises(ValueError, match="got -1.0"):
        pst(batch(0, 0))
    assert all(p.grad is None for p in m.parameters()) and not any(pst._pushed)
    pst.lr = torch.tensor(0.05)  # a tensor of one value is a rate (torch's optimizers take it)
    loss_of(pst, batch(0, 0)).backward()
    pst.step()
    pst.close()
    started[0][1].join(10)


def test_settings_fixed_for_the_run_are_refused_when_changed_naming_onecycles_momentum():
    started, endpoints = servers(1, 1)
    pst = wrap(model(), endpoints, 0, 1)
    opt = pst.optimizer
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)  # cycles momentum by default
    with pytest.raises(ValueError, match=r"momentum is 0.95, but the servers took 0.9 .*cycle_momentum=False"):
        pst(batch(0, 0))
    opt.param_groups[0]["momentum"] = 0.9
    opt.param_groups[0]["weight_decay"] = 1e-4
    with pytest.raises(ValueError, match="weight_decay is 0.0001, but the servers took 0.0"):
        pst(batch(0, 0))
    opt.param_groups[0]["weight_decay"] = 0.0
    with pytest.raises(ValueError, match="one param group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    loss_of(pst, batch(0, 0)).backward()
    with pytest.raises(ValueError, match="takes no closure"):
        opt.step(lambda: 0.0)
    opt.step()
    assert pst.step_count == 1
    pst.close()
    started[0][1].join(10)


def test_a_learning_rate_set_between_backward_and_step_applies_from_the_next_step_and_warns():
    started, endpoints = servers(1, 1)
    m = model()
    pst = wrap(m, endpoints, 0, 1)
    loss_of(pst, batch(0, 0)).backward()  # pushed with 0.1
    pst.lr = 0.02
    with pytest.warns(UserWarning, match=r"changed to 0.02 after step 0's forward, whose gradients go .* with 0.1") \
            as said:
        pst.step()
    assert said[0].filename == __file__  # (the line that called step(), not one inside ringtrain or torch)
    loss_of(pst, batch(0, 1)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pst.step()
    pst.wait()
    got = [p.detach().clone() for p in m.parameters()]
    pst.close()
    started[0][1].join(10)
    for a, b in zip(got, reference(1, 2, [0.1, 0.02])):
        assert torch.equal(a, b)


def test_a_server_refuses_a_push_whose_learning_rate_is_not_a_rate():
    assert P.lr_of(P.Header(P.PUSH, 0, 1, 3, 0, P.lr_bits(0.0), 0, P.LR_FLAG), "worker 0") == 0.0
    assert struct.unpack("<d", struct.pack("<Q", P.lr_bits(0.25)))[0] == 0.25
    # A PUSH of a worker from before the rate travelled (extra 0, no flag) is refused, not read as 0.
    with pytest.raises(ProtocolError, match="pushed step 3 without a learning rate"):
        P.lr_of(P.unpack_header(P.pack_header(P.PUSH, step=3), P.HEADER_SIZE), "worker 0")
    with pytest.raises(ProtocolError, match="flags 1"):  # (a flag on another kind is garbage)
        P.unpack_header(P.pack_header(P.PULL, flags=P.LR_FLAG), P.HEADER_SIZE)
    layout = make_layout([12, 3], 1, 16)
    server, thread, _ = ps_harness.start_server(SECRET)
    ch = P.Channel(P.dial(server.endpoint, P.ps_identity(1, 2, "ps", SECRET), 0, 5.0), "parameter server 0", 5.0)
    ch.send(P.HELLO, body=P.encode_json({"worker": 0, "numels": [12, 3], "shapes": [[12], [3]],
                                          "partition_bytes": 16, "digest": layout.digest(), "strategy": "sync",
                                          "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}))
    head = ch.recv_header(5.0)
    assert head.kind == P.WELCOME and ch.recv_json(head)["needs_init"]
    ids = np.array([p.id for p in layout.shard(0)], dtype=np.int64)
    ch.send(P.INIT, ids=ids, values=[np.zeros(15, dtype=np.float32)])
    ch.send(P.PUSH, step=0, lr=math.nan, ids=ids, values=[np.ones(15, dtype=np.float32)])
    with pytest.raises(ProtocolError, match="worker 0 pushed step 0 with learning rate nan, not a finite number"):
        ch.recv_header(5.0)
    ch.close()
    thread.join(10)
    assert server.updates == 0 and torch.equal(server.params, torch.zeros(15))


class HalfUsed(nn.Module):
    """``b`` is used only where ``use_b``: a step without it pushes b's zeros from step()."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, use_b=True):
        return self.a(x) + (self.b(x) if use_b else 0)


def test_a_steps_pushes_from_step_carry_the_rate_its_first_push_took():
    # Step 1 leaves b unused: its zeros go out from step(), after the rate was changed between
    # backward and step(): they must carry step 1's rate (0.1), as a.weight's pushes during
    # backward did, or the synchronous server takes the step as two rates (MismatchError).
    started, endpoints = servers(1, 1)
    m = HalfUsed()
    pst = wrap(m, endpoints, 0, 1)
    for s, use_b in enumerate((True, False, True)):
        loss_of(lambda x: pst(x, use_b=use_b), batch(0, s)).backward()
        if s == 1:
            pst.lr = 0.02
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pst.step()
    pst.wait()
    got = [p.detach().clone() for p in m.parameters()]
    pst.close()
    started[0][1].join(10)
    ref = HalfUsed()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s, (use_b, lr) in enumerate(((True, 0.1), (False, 0.1), (True, 0.02))):
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad(set_to_none=False)  # (b's zeros: momentum moves it, as the servers do)
        for p in ref.parameters():
            p.grad = torch.zeros_like(p)
        loss_of(lambda x: ref(x, use_b=use_b), batch(0, s)).backward()
        opt.step()
    for a, b in zip(got, ref.parameters()):
        assert torch.equal(a, b.detach())


def test_ps_step_counts_as_the_optimizers_step_for_torchs_schedulers():
    # (torch warns "lr_scheduler.step() before optimizer.step()" where the optimizer's step was not called)
    started, endpoints = servers(1, 1)
    pst = wrap(model(), endpoints, 0, 1)
    sched = torch.optim.lr_scheduler.StepLR(pst.optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in range(2):
            loss_of(pst, batch(0, s)).backward()
            pst.step()
            with torch.no_grad():  # an evaluation before the scheduler's step: it takes no rate
                pst(batch(0, 99))
            sched.step()
            assert pst._step_lr is None
    assert pst.lr == pytest.approx(0.025)
    pst.close()
    started[0][1].join(10)


def test_optimizer_state_loaded_on_a_worker_is_refused_a_learning_rate_loads():
    # A torch optimizer's state_dict (its momentum buffers: a loop moved from one process, or its
    # usual resume) was taken and kept here unused, and the servers went on with their own state.
    m = model()
    local = torch.optim.SGD(m.parameters(), **SETTINGS["sgd"])
    loss_of(m, batch(0, 0)).backward()
    local.step()
    opt = ServerOptimizer(list(m.parameters()), lambda: None, 0, weight_decay=0.0, **SETTINGS["sgd"])
    with pytest.raises(ValueError, match=r"momentum_buffer of 4 parameters.*save_checkpoint\(\)"):
        opt.load_state_dict(local.state_dict())
    assert not opt.state
    saved = opt.state_dict()  # (the group's settings only: what a scheduler's resume needs)
    saved["param_groups"][0]["lr"] = 0.025
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.025
