"""ParameterServerTraining on user models a walkthrough of docs/ps.md tried: parameters read
outside a call of their module, thousands of small tensors, a worker dropped while it evaluates
alone, a step skipped after backward, sparse gradients. Each test failed on the code before.

Servers run in threads of this process (ps_harness), workers in threads too (on_threads).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ringtrain.errors import PeerLost
from ringtrain.ps import ParameterServerTraining, protocol as P
from ringtrain.transport.local import on_threads
import ps_harness

pytestmark = pytest.mark.timeout(60)
SECRET = b"walkthrough-secret"


class ReadOutside(nn.Module):
    """``a`` is never called (its weights are read by F.linear); ``extra`` is a ParameterList."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 6)
        self.extra = nn.ParameterList([nn.Parameter(torch.randn(6) * 0.1) for _ in range(3)])
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        h = torch.tanh(F.linear(x, self.a.weight, self.a.bias))
        for p in self.extra:
            h = h + p
        return self.b(h)


def _run(make, workers: int, servers: int, steps: int, **settings) -> list[list[torch.Tensor]]:
    """``steps`` synchronous steps of ``workers`` workers on ``servers`` servers: each worker's
    parameters at the end."""
    started = [ps_harness.start_server(SECRET, index=k, servers=servers, workers=workers) for k in range(servers)]
    endpoints = [s.endpoint for s, _, _ in started]
    models = [make() for _ in range(workers)]  # (here: the threads would race on torch's RNG)

    def work(w: int):
        model = models[w]
        pst = ParameterServerTraining(model, servers=endpoints, worker=w, workers=workers, secret=SECRET, lr=0.1,
                                      timeout=10.0, partition_mb=ps_harness_partition_mb(), **settings)
        for s in range(steps):
            g = torch.Generator().manual_seed(100 * s + w)
            pst(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
            pst.step()
        pst.wait()
        out = [p.detach().clone() for p in model.parameters()]
        outside = list(pst._outside)
        pst.close()
        return out, outside

    results = on_threads(workers, work, timeout=50)
    for _, thread, _ in started:
        thread.join(10)
    return results


def ps_harness_partition_mb() -> float:
    return 4 / (1 << 20) * 4  # 4-element partitions: every parameter spread over both servers


def test_parameters_read_outside_their_modules_call_are_waited_for(monkeypatch):
    # The receiver writes slowly (as a loaded link would): a forward reading a.weight through
    # F.linear, or the ParameterList, read them before the step's pulled values were in and the
    # workers trained on old values (0.018 off after 20 steps in the walkthrough).
    real = P.Channel.recv_into

    def slow(self, into):
        time.sleep(0.002)
        return real(self, into)

    monkeypatch.setattr(P.Channel, "recv_into", slow)
    overlapped = _run(ReadOutside, 2, 2, 4)
    waited = _run(ReadOutside, 2, 2, 4, overlap_pull=False)
    names = [n for n, _ in ReadOutside().named_parameters()]
    for (params, outside), (want, _) in zip(overlapped, waited):
        assert [names[i] for i in outside] == ["a.weight", "a.bias", "extra.0", "extra.1", "extra.2"]
        for got, exact in zip(params, want):
            assert torch.equal(got, exact)


def test_a_worker_waits_for_many_small_parameters_in_linear_time(monkeypatch):
    # Every partition's arrival re-checked every parameter waited for (and the server's optimizer
    # walked its whole shard per partition stepped): 4,000 tensors took 5.9 s a step.
    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.ps = nn.ParameterList([nn.Parameter(torch.randn(1)) for _ in range(300)])

        def forward(self, x):
            return x * torch.stack(list(self.ps)).sum()

    real = P.Channel.recv_into

    def slow(self, into):  # (so that the waits block, and each arrival wakes them)
        time.sleep(0.001)
        return real(self, into)

    monkeypatch.setattr(P.Channel, "recv_into", slow)
    checks = []
    real_in = ParameterServerTraining._param_in
    monkeypatch.setattr(ParameterServerTraining, "_param_in", lambda self, i: checks.append(i) or real_in(self, i))
    stepped = []
    real_step = torch.optim.SGD.step
    monkeypatch.setattr(torch.optim.SGD, "step",
                        lambda self, *a: stepped.append(len(self.param_groups[0]["params"])) or real_step(self, *a))
    started = [ps_harness.start_server(SECRET, workers=1)]
    pst = ParameterServerTraining(Many(), servers=[started[0][0].endpoint], worker=0, workers=1, secret=SECRET,
                                  lr=0.1, timeout=10.0, schedule="wfbp")
    for _ in range(3):
        pst(torch.ones(2)).sum().backward()
        pst.step()
    pst.wait()
    pst.close()
    started[0][1].join(10)
    assert len(checks) < 3 * 10 * 300, len(checks)  # (quadratic: up to ~300 x 300 / 2 per step)
    assert stepped and sum(stepped) <= 3 * 300  # each stepped partition once, the shard not walked each time


def test_a_worker_dropped_for_silence_hears_why_not_that_the_server_died():
    # It read the closed connection as "parameter server 0 closed the connection (the server died
    # or was stopped)" while the other worker heard the true reason.
    started = ps_harness.start_server(SECRET, workers=2, timeout=2.0)
    endpoint = started[0].endpoint

    def work(w: int):
        pst = ParameterServerTraining(ps_harness.tiny(), servers=[endpoint], worker=w, workers=2, secret=SECRET,
                                      lr=0.1, timeout=2.0)
        try:
            for s in range(3):
                if w == 0 and s == 2:
                    time.sleep(5)  # an evaluation on worker 0 alone, longer than the timeout
                pst(torch.ones(2, 4)).sum().backward()
                pst.step()
            pst.wait()
        except PeerLost as exc:
            return str(exc)
        finally:
            try:
                pst.close()
            except Exception:  # noqa: BLE001 - the job has failed; close says so again
                pass
        return "trained"

    texts = on_threads(2, work, timeout=40)
    started[1].join(10)
    assert "worker 0 was dropped (it sent nothing for 2 s while holding up the others' pulls)" in texts[0], texts
    assert "died" not in texts[0]
    assert "worker 0 was lost" in texts[1], texts


def test_a_worker_whose_script_raises_during_backward_ends_a_sync_job_at_once_not_after_the_timeout():
    # Its close() (the with block's exit) said BYE after some of the step's gradients had gone out,
    # and the server answered that BYE only once the step was whole, which it never would be without
    # them: the other worker raised CommTimeout after the timeout, and the script's own error came
    # that late too.
    started = ps_harness.start_server(SECRET, workers=2, timeout=10.0)
    endpoint = started[0].endpoint
    models = [ps_harness.tiny() for _ in range(2)]

    def work(w: int):
        t0 = time.monotonic()
        try:
            with ParameterServerTraining(models[w], servers=[endpoint], worker=w, workers=2, secret=SECRET, lr=0.1,
                                         timeout=10.0) as pst:
                if w == 1:  # the first layer's gradient comes last in backward: the others were pushed
                    models[w][0].weight.register_hook(lambda g: (_ for _ in ()).throw(KeyError("the script's bug")))
                for _ in range(2):
                    pst(torch.ones(2, 4)).sum().backward()
                    pst.step()
                pst.wait()
        except Exception as exc:  # noqa: BLE001 - returned with how long it took
            return type(exc).__name__, str(exc), time.monotonic() - t0
        return "trained", "", time.monotonic() - t0

    (kind0, text0, s0), (kind1, text1, s1) = on_threads(2, work, timeout=50)
    started[1].join(10)
    assert kind1 == "KeyError" and s1 < 5.0, (kind1, text1, s1)
    assert kind0 == "PeerLost" and s0 < 5.0, (kind0, text0, s0)
    assert "step 0 cannot complete: worker(s) [1] left the job before pushing it" in text0, text0


def test_clearing_pushed_gradients_to_skip_a_step_is_refused_saying_it_cannot_be_skipped():
    started = ps_harness.start_server(SECRET, workers=1)
    pst = ParameterServerTraining(ps_harness.tiny(), servers=[started[0].endpoint], worker=0, workers=1,
                                  secret=SECRET, lr=0.1, timeout=10.0)
    pst(torch.ones(2, 4)).sum().backward()
    pst.module.zero_grad(set_to_none=True)  # "the loss was not finite: skip this step"
    with pytest.raises(RuntimeError, match=r"cleared \(zero_grad\) after backward had pushed them.*"
                                           r"a step cannot be skipped"):
        pst.step()
    pst.step()  # finishes the step with what was pushed, as it says
    pst.close()
    started[1].join(10)


def test_sparse_gradients_are_refused_when_the_module_is_wrapped():
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"dense gradients only, and \['0'\] make sparse ones"):
        ParameterServerTraining(model, servers=[("127.0.0.1", 1)], worker=0, workers=1)
    model[0].weight.requires_grad_(False)  # a frozen one makes none: not refused for it
    with pytest.raises(Exception) as caught:  # (nothing listens at port 1)
        ParameterServerTraining(model, servers=[("127.0.0.1", 1)], worker=0, workers=1, join_timeout=1.0)
    assert "sparse" not in str(caught.value)


def test_a_sparse_module_wrapped_itself_is_named_by_its_class():
    # It was named by its module path, the empty string: "and [''] make sparse ones".
    with pytest.raises(ValueError, match=r"dense gradients only, and \['Embedding'\] make sparse ones"):
        ParameterServerTraining(nn.Embedding(10, 4, sparse=True), servers=[("127.0.0.1", 1)], worker=0, workers=1)


def test_a_step_that_called_no_module_finds_nothing_read_outside():
    # A worker without data takes part with a zero loss over the parameters (what step()'s refusal
    # advises): every parameter was taken for read outside, and overlap turned off for good.
    started = ps_harness.start_server(SECRET, workers=1)
    pst = ParameterServerTraining(ps_harness.tiny(), servers=[started[0].endpoint], worker=0, workers=1,
                                  secret=SECRET, lr=0.1, timeout=10.0)
    for step in range(3):
        if step == 1:
            (sum(p.sum() for p in pst.module.parameters()) * 0).backward()
        else:
            pst(torch.ones(2, 4)).sum().backward()
        pst.step()
    assert pst._outside == []
    pst.close()
    started[1].join(10)


def test_a_replaced_gradient_is_refused_as_changed_not_as_a_skipped_step():
    started = ps_harness.start_server(SECRET, workers=1)
    pst = ParameterServerTraining(ps_harness.tiny(), servers=[started[0].endpoint], worker=0, workers=1,
                                  secret=SECRET, lr=0.1, timeout=10.0)
    pst(torch.ones(2, 4)).sum().backward()
    weight = pst.module[0].weight
    weight.grad = weight.grad.clamp(-0.1, 0.1)
    with pytest.raises(RuntimeError, match=r"\['0.weight'\] changed after backward had pushed them"):
        pst.step()
    pst.step()
    pst.close()
    started[1].join(10)


def test_a_worker_with_another_learning_rate_is_told_both_values():
    # It said "disagrees with the other workers about ['lr']", without 0.05 or 0.1.
    from ringtrain.errors import MismatchError
    from ringtrain.ps import ParameterServer, ServerConfig
    from ringtrain.ps.server_config import check_hello
    from ringtrain.ps.sharding import make_layout

    layout = make_layout([12, 3], 1, 16)

    def hello(w: int, lr: float) -> dict:
        return check_hello({"worker": w, "numels": [12, 3], "shapes": [[12], [3]], "partition_bytes": 16,
                            "digest": layout.digest(), "strategy": "sync", "lr": lr, "momentum": 0.9,
                            "weight_decay": 0.0}, f"worker {w}")

    server = ParameterServer(ServerConfig(index=0, servers=1, workers=2, secret=SECRET, timeout=5.0))
    try:
        server._configure(hello(0, 0.1))
        with pytest.raises(MismatchError, match=r"about \['lr'\]; its lr is 0.05, the first worker's 0.1$"):
            server._configure(hello(1, 0.05))
    finally:
        server._close_listener()


def test_a_parameter_of_another_dtype_is_named():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2).double())
    with pytest.raises(ValueError, match=r"float32 CPU parameters; '1.weight' is torch.float64 .*module.float\(\)"):
        ParameterServerTraining(model, servers=[("127.0.0.1", 1)], worker=0, workers=1)


def test_a_channels_last_parameter_is_refused_saying_how_to_convert_the_module():
    # (the refusal said ".contiguous()", which a module does not have)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 2)).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"'0.weight' .*contiguous=False.*to\(memory_format=torch.contiguous_format\)"):
        ParameterServerTraining(model, servers=[("127.0.0.1", 1)], worker=0, workers=1)
    model.to(memory_format=torch.contiguous_format)
    assert all(p.is_contiguous() for p in model.parameters())


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_send_refused_by_a_closed_server_raises_what_the_server_said_before_closing():
    """A server that fails the job tells each worker why (an ABORT) and may close the connection
    at once; a worker whose sender then fails (broken pipe) before its receiver has read that
    ABORT must still raise the server's reason, not "broken pipe" (a synchronous job refusing a
    worker of another optimizer: the other worker's close() said "parameter server 0 ... is gone
    (send failed: [Errno 32] Broken pipe)" once in 28 runs on a loaded machine). The receiver is
    started late here, so the sender fails first every time."""
    import socket
    import threading

    import weakref

    from ringtrain.ps.worker import PSOptions, _Link, _link_loop
    from ringtrain.transport import wire

    ours, servers_end = socket.socketpair()
    servers_end.sendall(wire.encode_abort(PeerLost("parameter server 0: worker 1 was lost at step 0 (MismatchError: "
                                                   "its optimizer is 'adam'); synchronous training cannot go on")))
    servers_end.close()
    link = _Link(0, P.Channel(ours, "parameter server 0", timeout=5.0))
    worker = ParameterServerTraining.__new__(ParameterServerTraining)  # (the link threads' state only)
    worker.worker, worker.opts, worker._shards = 0, PSOptions(), [[]]
    worker._cond, worker._error, worker._closed = threading.Condition(), None, False

    def late_receiver(me, link, sending):
        time.sleep(0.3)
        _link_loop(me, link, sending)

    link.jobs.put(("bye",))
    link.jobs.put(None)
    for target, sending in ((_link_loop, True), (late_receiver, False)):  # (started, then listed: as the worker does)
        link.threads.append(threading.Thread(target=target, args=(weakref.ref(worker), link, sending), daemon=True))
        link.threads[-1].start()
    for t in link.threads:
        t.join(10)
    assert isinstance(worker._error, PeerLost), worker._error
    assert "its optimizer is 'adam'" in str(worker._error) and "Broken pipe" not in str(worker._error)
    ours.close()
