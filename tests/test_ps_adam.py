"""Parameter servers applying Adam and AdamW (``PSOptions.optimizer``; bitwise the same as one
process running torch's optimizer under a scheduler: test_ps_lr.py): the whole optimizer state
kept for a step cut short, a checkpoint of step s and a resume; what is refused (another optimizer's checkpoint, workers that disagree,
settings a scheduler would change); SGD's HELLO and an SGD checkpoint from before Adam.

Servers run in threads of this process (ps_harness), workers in threads too (on_threads) or as raw
protocol channels.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from torch import nn

from ringtrain import checkpoint
from ringtrain.errors import CommError, MismatchError, PeerLost
from ringtrain.ps import ParameterServerTraining, ServerOptimizer, protocol as P
from ringtrain.ps.server_config import check_hello
from ringtrain.ps.sharding import make_layout
from ringtrain.transport.local import on_threads
import ps_harness
from ps_harness import both_take_step_0, recv_params, recv_partitions

pytestmark = pytest.mark.timeout(60)
SECRET = b"adam-secret"
ADAM = {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}  # (not torch's defaults: they must travel)
ONE_ELEMENT = 4 / (1 << 20)  # partition_mb of 1-element partitions


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def batch(w: int, step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * step + w))


def loss_of(m, x: torch.Tensor) -> torch.Tensor:
    return (m(x) - 1).pow(2).mean()


def servers(n: int, workers: int, **kw):
    started = [ps_harness.start_server(SECRET, index=k, servers=n, workers=workers, **kw) for k in range(n)]
    return started, [s.endpoint for s, _, _ in started]


def join_all(started) -> None:
    for _, thread, _ in started:
        thread.join(10)
        assert not thread.is_alive(), "a server did not finish"


def wrap(m: nn.Module, endpoints, w: int, workers: int, **kw) -> ParameterServerTraining:
    kw = {"optimizer": "adamw", "lr": 0.01, "timeout": 10.0, "partition_mb": 16 / (1 << 20), **ADAM, **kw}
    return ParameterServerTraining(m, servers=endpoints, worker=w, workers=workers, secret=SECRET, **kw)


def test_the_workers_optimizer_has_torchs_adamw_group_and_refuses_a_scheduler_cycling_betas():
    started, endpoints = servers(1, 1)
    pst = wrap(model(), endpoints, 0, 1)
    group = pst.optimizer.param_groups[0]
    torchs = torch.optim.AdamW(model().parameters(), lr=0.01, **ADAM).param_groups[0]
    assert {k: v for k, v in group.items() if k != "params"} == {k: v for k, v in torchs.items() if k != "params"}
    assert isinstance(pst.optimizer, ServerOptimizer)
    # OneCycleLR cycles Adam's beta1 by default: the servers keep the betas they were given.
    torch.optim.lr_scheduler.OneCycleLR(pst.optimizer, max_lr=0.02, total_steps=10)
    with pytest.raises(ValueError, match=r"betas is \(0.95, 0.99\), but the servers took \(0.8, 0.99\).*"
                                         r"cycle_momentum=False"):
        loss_of(pst, batch(0, 0)).backward()
    pst.close()
    join_all(started)


def test_workers_with_different_optimizers_are_refused_naming_both():
    workers = 2
    started, endpoints = servers(1, workers)
    # A worker closes only once every worker's construction has ended (taken or refused): the one
    # taken then hears the job's failure at its BYE, if not before. Closed at once, it could say
    # BYE after no step and leave cleanly before the other's HELLO was read (a loaded CI machine
    # started the second thread that late: its result was None, not the text).
    constructed = threading.Barrier(workers, timeout=20)

    def work(w: int):
        try:
            try:
                ps = wrap(model(), endpoints, w, workers, optimizer="adamw" if w == 0 else "adam")
            finally:
                constructed.wait()
            ps.close()
        except CommError as exc:  # (the refused worker's MismatchError; the other's PeerLost with its text)
            return str(exc)
        return None

    said = on_threads(workers, work, timeout=30)
    for text in said:  # every worker is told, naming both optimizers (whichever said HELLO first)
        assert isinstance(text, str) and ("its optimizer is 'adam', the first worker's 'adamw'" in text
                                          or "its optimizer is 'adamw', the first worker's 'adam'" in text), said
    join_all(started)


def test_an_sgd_worker_sends_the_hello_it_sent_before_adam(monkeypatch):
    """SGD's HELLO has none of the new keys, so servers from before Adam take it; a HELLO without
    them is SGD's."""
    sent = []

    class Spy(P.Channel):
        def send(self, kind, **kw):
            if kind == P.HELLO:
                sent.append(json.loads(kw["body"]))
            super().send(kind, **kw)

    started, endpoints = servers(1, 1)
    monkeypatch.setattr(P, "Channel", Spy)
    ParameterServerTraining(model(), servers=endpoints, worker=0, workers=1, secret=SECRET, lr=0.1).close()
    join_all(started)
    assert sorted(sent[0]) == ["digest", "lr", "momentum", "numels", "partition_bytes", "shapes", "strategy",
                               "weight_decay", "worker"]
    hello = check_hello(sent[0], "worker 0")
    assert (hello["optimizer"], hello["betas"], hello["eps"]) == ("sgd", [0.9, 0.999], 1e-8)


# --- the optimizer's whole state: a step cut short, a checkpoint of step s, a resume -------------

def raw_worker(server, layout, w: int, workers: int = 2) -> P.Channel:
    """A worker speaking the protocol by hand (AdamW, lr 0.5): handshake and HELLO; WELCOME read."""
    ch = ps_harness.RawWorker(P.dial(server.endpoint, P.ps_identity(1 + w, 1 + workers, "ps", SECRET), 0, 5.0),
                              "server", 5.0)
    hello = {"worker": w, "numels": list(layout.numels), "shapes": [[n] for n in layout.numels],
             "partition_bytes": layout.partition_bytes, "digest": layout.digest(), "strategy": "sync", "lr": 0.5,
             "momentum": 0.0, "weight_decay": 0.1, "optimizer": "adamw", "betas": [0.8, 0.99], "eps": 1e-6}
    ch.send(P.HELLO, worker=w, body=P.encode_json(hello))
    head = ch.recv_header(5.0)
    assert head.kind == P.WELCOME
    assert ch.recv_json(head)["optimizer"] == "adamw"
    return ch


def two_adamw_workers(**kw):
    """A server of 4 tensors (23 values, 0..22) for workers 0 and 1 (AdamW), both connected."""
    server, thread, _ = ps_harness.start_server(SECRET, workers=2, **kw)
    layout = make_layout([12, 3, 6, 2], 1, 16)
    ids = np.arange(len(layout.partitions))
    start = np.arange(23, dtype=np.float32)
    a, b = (raw_worker(server, layout, w) for w in (0, 1))
    a.send(P.INIT, worker=0, ids=ids, values=[start])
    grads = [np.linspace(-1, 1, layout.partitions[i].numel, dtype=np.float32) for i in ids]
    return server, thread, layout, ids, start, grads, a, b


def local_adamw(start: np.ndarray, grads: list, steps: int):
    """torch's AdamW over one tensor of the start values, ``steps`` steps of the concatenated gradients."""
    p = torch.from_numpy(start.copy()).requires_grad_()
    opt = torch.optim.AdamW([p], lr=0.5, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for _ in range(steps):
        p.grad = torch.from_numpy(np.concatenate(grads))
        opt.step()
    return p.detach(), opt.state[p]


def shard_state(server) -> dict:
    """The server's optimizer state, entry by entry over the whole shard, copied."""
    return {k: v.clone() for k, v in server._optimizer_state({})["elements"].items()}


def test_a_step_cut_short_rolls_back_adamws_moments_and_step():
    """Step 0 completes, step 1 is half applied, worker 1 dies: values, exp_avg, exp_avg_sq and
    step are those after step 0 (Adam updates them in place: a record of the tensors themselves
    would hold the half-applied step)."""
    server, thread, layout, ids, start, grads, a, b = two_adamw_workers()
    both_take_step_0(a, b, layout, ids, grads)
    assert server.version == 1
    values, state = local_adamw(start, grads, 1)
    assert torch.equal(server.params, values)
    after_0 = shard_state(server)
    assert torch.equal(after_0["exp_avg"], state["exp_avg"]) and torch.equal(after_0["exp_avg_sq"], state["exp_avg_sq"])
    for w, ch in enumerate((a, b)):
        ch.send(P.PULL, worker=w, step=2)
    a.send(P.PUSH, worker=0, step=1, ids=ids, values=grads)
    b.send(P.PUSH, worker=1, step=1, ids=ids[:2], values=grads[:2])
    for ch in (a, b):
        assert sorted(recv_partitions(ch, layout, [0, 1], step=2)) == [0, 1]
    assert not torch.equal(server.params, values)
    assert server.opt.state[server._views[0]]["step"] == 2
    b.close()
    with pytest.raises(PeerLost, match="worker 1 was lost at step 1"):
        a.recv_header(5.0)
    a.close()
    thread.join(10)
    assert not thread.is_alive() and server.version == 1
    assert torch.equal(server.params, values)
    now = shard_state(server)
    assert now.keys() == after_0.keys() == {"exp_avg", "exp_avg_sq"}
    for key in now:
        assert torch.equal(now[key], after_0[key]), key
    assert all(server.opt.state[v]["step"] == 1 for v in server._views.values())


def test_a_first_step_cut_short_leaves_no_adam_state():
    server, thread, layout, ids, start, grads, a, b = two_adamw_workers()
    for w, ch in enumerate((a, b)):
        ch.send(P.PULL, worker=w, step=0)
        recv_params(ch, layout)
        ch.send(P.PULL, worker=w, step=1)
    a.send(P.PUSH, worker=0, step=0, ids=ids, values=grads)
    b.send(P.PUSH, worker=1, step=0, ids=ids[:2], values=grads[:2])
    for ch in (a, b):
        recv_partitions(ch, layout, [0, 1], step=1)
    b.close()
    with pytest.raises(PeerLost):
        a.recv_header(5.0)
    a.close()
    thread.join(10)
    assert torch.equal(server.params, torch.from_numpy(start))
    assert all(not server.opt.state.get(v) for v in server._views.values())


def test_a_save_while_an_adamw_step_is_half_applied_holds_the_state_before_it(tmp_path):
    server, thread, layout, ids, start, grads, a, b = two_adamw_workers(checkpoint_dir=str(tmp_path))
    both_take_step_0(a, b, layout, ids, grads)
    for w, ch in enumerate((a, b)):
        ch.send(P.PULL, worker=w, step=2)
    b.send(P.PUSH, worker=1, step=1, ids=ids, values=grads)
    a.send(P.PUSH, worker=0, step=1, ids=ids[:2], values=grads[:2])
    recv_partitions(a, layout, [0, 1], step=2)  # stepped: step 1 is half applied
    a.send(P.SAVE, worker=0, step=1)
    head = a.recv_header(5.0)
    assert (head.kind, head.step, head.extra) == (P.SAVED, 1, 0)
    saved = checkpoint.load(tmp_path / "server-0" / checkpoint.checkpoint_name(1)).payload
    values, state = local_adamw(start, grads, 1)
    assert saved["optimizer"] == "adamw" and saved["momentum"] is None
    assert torch.equal(saved["params"], values)
    kept = saved["optimizer_state"]
    assert torch.equal(kept["elements"]["exp_avg"], state["exp_avg"])
    assert torch.equal(kept["elements"]["exp_avg_sq"], state["exp_avg_sq"])
    assert torch.equal(kept["partitions"]["step"], torch.ones(len(ids)))  # one per partition
    for ch in (a, b):
        ch.close()
    thread.join(10)


def train(pst: ParameterServerTraining, steps: int, save_after: tuple[int, ...] = ()) -> None:
    """Steps pst.step_count .. steps-1 on inputs that depend on the step only; save after the listed ones."""
    for s in range(pst.step_count, steps):
        loss_of(pst, batch(0, s)).backward()
        pst.step()
        if s + 1 in save_after:
            pst.save_checkpoint()
    pst.wait()


def assert_resumes_bitwise(tmp_path, n: int, steps: int, saved_at: int, edit=None, **kw) -> None:
    """One worker over ``n`` servers trains ``steps`` steps, saving after ``saved_at``; servers
    resumed from that save and a worker built with other weights (the servers' replace them) train
    to ``steps`` again: parameters bitwise those of the first run. ``kw`` goes to wrap(), and
    ``edit(tmp_path)``, if given, rewrites the save in between."""
    started, endpoints = servers(n, 1, checkpoint_dir=str(tmp_path))
    pst = wrap(model(), endpoints, 0, 1, **kw)
    train(pst, steps, save_after=(saved_at,))
    want = [p.detach().clone() for p in pst.module.parameters()]
    pst.close()
    join_all(started)
    if edit is not None:
        edit(tmp_path)
    started, endpoints = servers(n, 1, checkpoint_dir=str(tmp_path), resume=True)
    pst = wrap(model(seed=7), endpoints, 0, 1, **kw)
    assert pst.step_count == saved_at
    train(pst, steps)
    for got, exact in zip(pst.module.parameters(), want):
        assert torch.equal(got, exact)
    pst.close()
    join_all(started)


@pytest.mark.parametrize("partition_mb", [ONE_ELEMENT, 16 / (1 << 20)], ids=["1-element", "4-element"])
def test_adamw_resumed_mid_run_equals_the_run_uninterrupted(tmp_path, partition_mb):
    assert_resumes_bitwise(tmp_path, 2, 6, 3, partition_mb=partition_mb)


@pytest.mark.parametrize("saved,resumed", [("sgd", "adamw"), ("adamw", "adam")])
def test_a_resume_with_another_optimizer_is_refused_naming_both(tmp_path, saved, resumed):
    started, endpoints = servers(1, 1, checkpoint_dir=str(tmp_path))
    pst = wrap(model(), endpoints, 0, 1, optimizer=saved)
    train(pst, 1, save_after=(1,))
    pst.close()
    join_all(started)
    started, endpoints = servers(1, 1, checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(MismatchError, match=f"made with optimizer '{saved}', this job's optimizer is '{resumed}': "
                                            f"resume with optimizer '{saved}'"):
        wrap(model(), endpoints, 0, 1, optimizer=resumed)
    join_all(started)


def test_an_sgd_checkpoint_written_before_adam_resumes_with_its_momentum(tmp_path):
    """A checkpoint of the old format (no "optimizer", SGD's "momentum" only) resumes as before."""
    def to_the_old_format(root) -> None:
        folder = root / "server-0"
        payload = checkpoint.load(folder / checkpoint.checkpoint_name(2)).payload
        assert payload["momentum"] is not None
        old = {k: v for k, v in payload.items() if k not in ("optimizer", "optimizer_state")}
        (folder / checkpoint.checkpoint_name(2)).unlink()
        checkpoint.save(folder, 2, old)

    assert_resumes_bitwise(tmp_path, 1, 4, 2, edit=to_the_old_format, optimizer="sgd", lr=0.1, momentum=0.9,
                           weight_decay=0.0)
