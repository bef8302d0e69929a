"""DistributedDataParallel: no_sync accumulation, unused parameters, options, forward pass-through."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from thread_harness import raise_first, run_comms
from ringtrain.ddp import DistributedDataParallel
from test_ddp_support import global_batch, make_model, perturbed, rank_batch

FAST = dict(alpha=2e-5, beta=1e-9, warmup_iterations=0, profile_iterations=1)
MICRO = 3  # micro-batches per step


def accumulate_train(model, batches, steps, ddp=None):
    """Per step: MICRO micro-batches, the first MICRO - 1 under no_sync (when ddp is given);
    each micro-batch loss is divided by MICRO so the step's gradient is the mean over them."""
    net = ddp if ddp is not None else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for m in range(MICRO):
            x, y = batches(step, m)
            ctx = ddp.no_sync() if ddp is not None and m < MICRO - 1 else _null()
            with ctx:
                loss = nn.functional.mse_loss(net(x), y) / MICRO
                loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def micro_batch(step, m, world_size, rank):
    return rank_batch("mlp", step * MICRO + m, world_size, rank)


def run_no_sync(world_size, same_data):
    base = make_model("mlp")

    def body(comm):
        model = perturbed(base, comm.rank)
        ddp = DistributedDataParallel(model, comm, schedule="wfbp", algorithm="ring", **FAST)
        src = 0 if same_data else comm.rank
        try:
            return accumulate_train(model, lambda s, m: micro_batch(s, m, world_size, src), 6, ddp)
        finally:
            ddp.close()

    return raise_first(run_comms(world_size, body, thread_timeout=60.0))


@pytest.mark.timeout(60)
def test_no_sync_accumulation_equals_big_batch():
    world_size = 2
    results = run_no_sync(world_size, same_data=False)
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)

    def big(step, _m):  # all micro-batches of all ranks at once: one batch of MICRO * 2 * PER_RANK
        xs, ys = zip(*(global_batch("mlp", step * MICRO + m, world_size) for m in range(MICRO)))
        return torch.cat(xs), torch.cat(ys)

    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(6):
        x, y = big(step, 0)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for got, want in zip(results[0], model.parameters()):
        # Not bitwise: the big batch sums all rows in one matmul; DDP sums micro-batches in
        # .grad, then averages over ranks (another reduction order).
        torch.testing.assert_close(got, want.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(60)
def test_no_sync_with_equal_data_is_bitwise_local_accumulation():
    results = run_no_sync(2, same_data=True)
    expected = accumulate_train(make_model("mlp"), lambda s, m: micro_batch(s, m, 2, 0), 6)
    for got, want in zip(results[0], expected):
        assert torch.equal(got, want)


def test_no_sync_sends_nothing():
    def body(comm):
        ddp = DistributedDataParallel(make_model("mlp"), comm, **FAST)
        x, y = rank_batch("mlp", 0, 2, comm.rank)
        with ddp.no_sync():
            nn.functional.mse_loss(ddp(x), y).backward()
        local = [p.grad.clone() for p in ddp.module.parameters()]
        seq = comm._seq
        ddp.close()
        return local, seq

    results = raise_first(run_comms(2, body))
    # Different data, no communication: the local gradients differ between ranks.
    assert not all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0]))
    assert results[0][1] == results[1][1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["backward without a step", "second backward"])
def test_a_rank_that_steps_otherwise_fails_with_the_others_at_the_next_check(fault):
    """Rank 1 runs a backward without an optimizer step (or a second backward of one forward) at
    step 1: its allreduces pair with rank 0's next iteration's, nothing mismatches, and its
    parameters would stay apart for the rest of the run. The check every 4 iterations is a
    MismatchError on both ranks, naming rank 1; before the fault the checks pass."""
    from ringtrain import MismatchError

    def body(comm):
        ddp = DistributedDataParallel(make_model("mlp"), comm, schedule="wfbp", parameter_check_interval=4, **FAST)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        done = 0
        try:
            for step in range(12):
                x, y = rank_batch("mlp", step, 2, comm.rank)
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward(retain_graph=True)
                done += 1
                if comm.rank == 1 and step == 5:
                    if fault == "second backward":
                        loss.backward()
                        done += 1
                    else:
                        continue  # no step
                opt.step()
                opt.zero_grad()
        except MismatchError as exc:
            return done, str(exc)
        finally:
            ddp.close()
        return done, None

    (done0, message0), (done1, message1) = raise_first(run_comms(2, body, timeout=10.0, thread_timeout=50.0))
    for message in (message0, message1):
        assert message is not None and "the parameters differ between the ranks at iteration 8" in message, message
        assert "(rank 1 against rank 0's)" in message and "parameter_check_interval=0" in message, message
    assert done0 == 7  # the check at 4 passed; the one at 8 failed: the 8th backward raised


@pytest.mark.timeout(60)
def test_after_an_uneven_join_the_check_names_the_optimizer_state():
    """Epoch 0 inside join() with 2 and 3 batches, epoch 1 outside it: join() leaves the
    parameters equal, but rank 0 took one SGD step fewer, so its momentum differs and the
    parameters part again. The check says so, naming join() before the other causes."""
    import contextlib

    from ringtrain import MismatchError

    def body(comm):
        ddp = DistributedDataParallel(make_model("mlp"), comm, parameter_check_interval=4, verify_iterations=0,
                                      **FAST)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        try:
            for epoch in range(2):
                with ddp.join() if epoch == 0 else contextlib.nullcontext():
                    _sgd_steps(ddp, opt, comm, (2 + comm.rank) if epoch == 0 else 8)
        except MismatchError as exc:
            return str(exc)
        finally:
            ddp.close()
        return None

    for message in raise_first(run_comms(2, body, timeout=10.0, thread_timeout=50.0)):
        assert message is not None and "after a join() with uneven inputs" in message, message


@pytest.mark.timeout(120)
def test_with_a_comm_hook_the_check_runs_only_when_asked():
    """torch's noop_hook leaves each rank its own gradient, by design: the ranks train apart. By
    default a wrapper with a comm hook does not check (51 iterations pass); asked to, it raises."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    from ringtrain import MismatchError

    def body(comm, every, steps):
        ddp = DistributedDataParallel(make_model("mlp"), comm, schedule="single", parameter_check_interval=every,
                                      **FAST)
        ddp.register_comm_hook(ddp.process_group, noop_hook)
        try:
            _sgd_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), comm, steps)
        except MismatchError as exc:
            return str(exc)
        finally:
            ddp.close()
        return None

    assert raise_first(run_comms(2, lambda comm: body(comm, None, 51), timeout=10.0, thread_timeout=100.0)) == [None] * 2
    for message in raise_first(run_comms(2, lambda comm: body(comm, 4, 8), timeout=10.0, thread_timeout=50.0)):
        assert message is not None and "at iteration 4" in message, message


def _sgd_steps(ddp, opt, comm, steps: int) -> None:
    """``steps`` training steps of ``ddp`` with ``opt`` on this rank's MLP batches."""
    for step in range(steps):
        x, y = rank_batch("mlp", step, 2, comm.rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def test_options_compare_by_value_not_by_spelling():
    import numpy as np

    from ringtrain.ddp.wrapper import _option_text
    from ringtrain.plan import LinearCost

    assert _option_text(25) == _option_text(25.0) and _option_text(np.float64(1e-5)) == _option_text(1e-5)
    assert _option_text(LinearCost(1e-5, 1e-9)) == _option_text(LinearCost(np.float64(1e-5), 1e-9))
    assert _option_text(lambda b: b) == _option_text(lambda b: 2 * b)  # (a function: by its name only)
    assert _option_text("optimal") != _option_text("single") and _option_text(True) != _option_text(1)


def test_equal_parameters_digest_alike_and_swapped_ones_do_not():
    from ringtrain.ddp import consistency

    a, b = torch.randn(3, 4), torch.randn(5, dtype=torch.float64)
    half = torch.randn(7).to(torch.bfloat16)
    assert consistency.digest([a, b, half]) == consistency.digest([a.clone(), b.clone(), half.clone()])
    assert consistency.digest([a, b]) != consistency.digest([b, a])
    nudged = a.clone()
    nudged[1, 2] = torch.nextafter(nudged[1, 2], torch.tensor(1e9))
    assert consistency.digest([nudged, b]) != consistency.digest([a, b])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [1, 2])
def test_unused_parameter_error_names_it(world_size):
    def body(comm):
        ddp = DistributedDataParallel(make_model("unused"), comm, **FAST)
        x, y = rank_batch("unused", 0, world_size, comm.rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        try:
            ddp(x)
        except RuntimeError as exc:
            return str(exc)
        finally:
            ddp.close()
        return None

    for message in raise_first(run_comms(world_size, body)):
        assert message is not None, "the forward after an incomplete backward must raise"
        assert "'unused.weight'" in message and "'unused.bias'" in message
        assert "'used.weight'" not in message
        assert "find_unused_parameters=True" in message


@pytest.mark.timeout(30)
def test_find_unused_parameters_trains_the_used_ones():
    world_size = 2
    base = make_model("unused")

    def body(comm):
        model = perturbed(base, comm.rank)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, schedule="wfbp", **FAST)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(8):
            x, y = rank_batch("unused", step, world_size, comm.rank)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        ddp.close()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, model.unused.weight.grad

    results = raise_first(run_comms(world_size, body))
    ref = make_model("unused")
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(8):
        x, y = global_batch("unused", step, world_size)
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    for name, p in ref.named_parameters():
        assert torch.equal(results[0][0][name], results[1][0][name]), name
        # Reduction order differs (see test_ddp_correctness); unused ones are exactly unchanged.
        torch.testing.assert_close(results[0][0][name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert results[0][1] is None and results[1][1] is None  # unused on every rank: no gradient, as in torch DDP


@pytest.mark.timeout(30)
def test_parameter_unused_on_one_rank_gets_the_mean():
    """Rank 1 uses the branch, rank 0 does not: the mean is rank 1's gradient / 2 on both."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Linear(4, 4)
            self.branch = nn.Linear(4, 4)

        def forward(self, x, use_branch):
            h = self.trunk(x)
            return self.branch(h) if use_branch else h

    torch.manual_seed(3)
    base = Branchy()
    x = torch.arange(8.0).reshape(2, 4) / 8

    def body(comm):
        import copy

        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, **FAST)
        for _ in range(3):  # through profiling into the planned layout
            ddp.zero_grad()
            ddp(x, comm.rank == 1).sum().backward()
        ddp.close()
        return model.branch.weight.grad.clone()

    grads = raise_first(run_comms(2, body))
    alone = __import__("copy").deepcopy(base)
    alone(x, True).sum().backward()
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[0], alone.branch.weight.grad / 2)  # (g + 0) / 2 is exact


def test_forward_passes_through_and_module_is_reachable():
    def body(comm):
        model = make_model("mlp")
        ddp = DistributedDataParallel(model, comm, **FAST)
        x = torch.ones(2, 12)
        same = torch.equal(ddp(x), model(x))
        keys = list(ddp.state_dict())[:1]
        ddp.close()
        return same, ddp.module is model, keys

    (same, is_module, keys), = raise_first(run_comms(1, body))
    assert same and is_module and keys == ["module.layers.0.weight"]


def test_buffers_are_broadcast_from_rank_0():
    class WithBuffer(nn.Module):
        def __init__(self, value):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("count", torch.tensor([value], dtype=torch.int64))
            self.register_buffer("flag", torch.tensor([value % 2 == 1]))

        def forward(self, x):
            return self.lin(x)

    def body(comm):
        model = WithBuffer(7 + comm.rank)
        ddp = DistributedDataParallel(model, comm, **FAST)
        model.count += comm.rank  # diverge again; the next forward re-broadcasts
        ddp(torch.ones(1, 3))
        ddp.close()
        return int(model.count), bool(model.flag), model.lin.weight.detach().clone()

    results = raise_first(run_comms(3, body))
    assert [r[:2] for r in results] == [(7, True)] * 3
    assert all(torch.equal(results[0][2], r[2]) for r in results)


def test_a_parameter_counted_unused_that_gets_a_gradient_is_named():
    """find_unused_parameters walks the graph from the outputs; a loss term taken from the module's
    parameters directly reaches a parameter it counted unused: a clear error, then training goes on."""
    def body(comm):
        torch.manual_seed(0)
        model = nn.ModuleDict({"lin": nn.Linear(3, 2), "extra": nn.Linear(2, 2)})

        class Wrapped(nn.Module):
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, x):
                return self.m["lin"](x)

        ddp = DistributedDataParallel(Wrapped(), comm, find_unused_parameters=True, **FAST)
        x = torch.ones(4, 3)
        with pytest.raises(RuntimeError, match=r"'m.extra.weight' got a gradient, but the forward's outputs"):
            (ddp(x).sum() + model["extra"].weight.sum()).backward()
        for p in model.parameters():
            p.grad = None
        ddp(x).sum().backward()  # the next iteration is whole again
        grads = [p.grad.clone() for p in model["lin"].parameters()]
        ddp.close()
        return grads

    results = raise_first(run_comms(2, body))
    assert all(torch.equal(a, b) for a, b in zip(*results))


class ReturnsAParameter(nn.Module):
    """A forward that returns one of its parameters as it is, beside a layer's output."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.spare = nn.Linear(4, 3)  # never used

    def forward(self, x):
        return self.lin(x), self.scale


@pytest.mark.parametrize("uses_it", [True, False])
def test_a_parameter_the_forward_returns_as_it_is_is_used_exactly_when_the_loss_uses_it(uses_it):
    # Was: only outputs with a graph were walked, so the returned parameter counted as unused and
    # its gradient was an error ("got a gradient, but the forward's outputs ... do not reach it").
    torch.manual_seed(0)
    base = ReturnsAParameter()
    x = torch.arange(8.0).reshape(2, 4) / 8

    def loss_of(out, scale):
        return (out * scale).sum() if uses_it else out.sum()

    def body(comm):
        import copy

        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, **FAST)
        for _ in range(3):  # through profiling into the planned layout
            ddp.zero_grad()
            out, scale = ddp(x)
            loss_of(out, scale).backward()
        ddp.close()
        return model.scale.grad, model.lin.weight.grad.clone(), model.spare.weight.grad

    results = raise_first(run_comms(2, body))
    alone = __import__("copy").deepcopy(base)
    loss_of(*alone(x)).backward()
    for scale, weight, spare in results:
        assert spare is None and torch.equal(weight, alone.lin.weight.grad)
        assert torch.equal(scale, alone.scale.grad) if uses_it else scale is None


def test_a_backward_the_wrappers_forward_did_not_begin_stays_local():
    """As with torch's DDP: after an averaged iteration, a backward through the module itself (one
    rank's diagnostic, say) launches nothing, so the ranks stay in step."""
    def body(comm):
        model = make_model("mlp")
        ddp = DistributedDataParallel(model, comm, **FAST)
        x, y = rank_batch("mlp", 0, 2, comm.rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        if comm.rank == 0:
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()  # local only
        model.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        ddp.close()
        return grads

    results = raise_first(run_comms(2, body, timeout=5.0))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_closed_wrapper_refuses_forward_and_a_failed_one_leaves_nothing_behind():
    import threading

    def body(comm):
        model = make_model("mlp")
        ddp = DistributedDataParallel(model, comm, **FAST)
        ddp.close()
        with pytest.raises(RuntimeError, match="was closed"):
            ddp(torch.ones(2, 12))
        other = nn.Linear(3, 3 + comm.rank)  # the ranks' models differ: the construction fails
        with pytest.raises(RuntimeError, match="every rank must wrap the same module"):  # on every rank
            DistributedDataParallel(other, comm, **FAST)
        return [p._post_accumulate_grad_hooks for p in other.parameters()]

    for hooks in raise_first(run_comms(2, body, timeout=5.0)):
        assert all(not h for h in hooks)
    assert not [t for t in threading.enumerate() if t.name.startswith("ringtrain-ddp-comm") and t.is_alive()]


@pytest.mark.timeout(30)
def test_an_option_that_differs_between_ranks_is_named_at_construction():
    # It failed later, as a MismatchError of two allreduces' sizes naming no option.
    def body(comm):
        options = dict(FAST, schedule="single") if comm.rank == 1 else dict(FAST)
        with pytest.raises(RuntimeError, match="with the same options") as caught:
            DistributedDataParallel(make_model("mlp"), comm, **options)
        return str(caught.value)

    mine, theirs = raise_first(run_comms(2, body, timeout=5.0))
    assert "ranks [1] have a module or options that differ from rank 0's" in mine, mine
    assert "rank 0 has schedule='optimal' where rank 1 has schedule='single'" in theirs, theirs


def test_tensors_of_mixed_sizes_broadcast_whatever_their_offsets():
    """Byte offsets that are not a multiple of the next tensor's element size (an int64 after 3
    float32s, a float64 after a bool) still come back as that dtype."""
    class Mixed(nn.Module):
        def __init__(self, value):
            super().__init__()
            self.lin = nn.Linear(4, 3)  # 15 float32s: the next tensor starts at byte 60
            self.bn = nn.BatchNorm1d(3)
            for i, (name, dtype) in enumerate([("f", torch.float32), ("i", torch.int64), ("b", torch.bool),
                                               ("h", torch.float16), ("d", torch.float64)]):
                self.register_buffer(name, torch.full((3 if name == "f" else 1,), value + i).to(dtype))

        def forward(self, x):
            return self.bn(self.lin(x))

    def body(comm):
        model = Mixed(5 * comm.rank + 1)
        ddp = DistributedDataParallel(model, comm, **FAST)
        ddp(torch.ones(2, 4))
        ddp.close()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    results = raise_first(run_comms(3, body))
    for k, v in results[0].items():
        assert all(torch.equal(v, r[k]) for r in results), k
    assert results[2]["i"].dtype == torch.int64 and int(results[2]["i"]) == 2
    assert float(results[2]["d"]) == 5.0 and bool(results[2]["b"])


@pytest.mark.parametrize("kw, word", [
    (dict(schedule="greedy"), "schedule"), (dict(algorithm="tree"), "algorithm"),
    (dict(bucket_cap_mb=0), "bucket_cap_mb"), (dict(alpha=1e-5), "alpha"),
    (dict(profile_iterations=0), "profile_iterations"), (dict(drift_threshold=-1), "drift_threshold"),
    (dict(find_unused_parameter=True), "unknown option 'find_unused_parameter' .did you mean 'find_unused_parameters'"),
])
def test_bad_options_raise_value_error_naming_them(kw, word):
    def body(comm):
        with pytest.raises(ValueError, match=word) as info:
            DistributedDataParallel(nn.Linear(2, 2), comm, **kw)
        return str(info.value)

    message, = raise_first(run_comms(1, body))
    if word in ("schedule", "algorithm"):
        assert "optimal" in message or "ring" in message  # the accepted values are listed


def test_a_module_off_the_cpu_is_refused_naming_its_tensor():
    # "meta" stands for any device but the CPU (CI has no GPU): the buckets and the transports
    # are CPU memory, so the wrapper says so before it broadcasts anything.
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2, device="meta")

    def body(comm):
        with pytest.raises(ValueError, match=r"'b.weight' is on meta.*CPU") as info:
            DistributedDataParallel(Mixed(), comm, **FAST)
        return str(info.value)

    message, = raise_first(run_comms(1, body))
    assert "torch.nn.parallel.DistributedDataParallel" in message

    class OffBuffer(nn.Module):  # the parameters on the CPU, a buffer (running statistics) not
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.register_buffer("stats", torch.zeros(2, device="meta"))

    def buffer_body(comm):
        with pytest.raises(ValueError, match=r"'stats' is on meta.*CPU"):
            DistributedDataParallel(OffBuffer(), comm, **FAST)

    raise_first(run_comms(1, buffer_body))


@pytest.mark.timeout(60)
def test_a_failed_peer_surfaces_from_backward_within_the_deadline():
    """Rank 1 fails after two steps (the harness aborts its transport): rank 0's next backward
    raises a CommError from the bucket allreduce instead of hanging, and the wrapper is left
    ready for a clear error rather than a bogus unused-parameter one."""
    from ringtrain import CommError

    class Boom(Exception):
        pass

    def body(comm):
        ddp = DistributedDataParallel(make_model("mlp"), comm, schedule="wfbp", **FAST)
        for step in range(2):
            x, y = rank_batch("mlp", step, 2, comm.rank)
            nn.functional.mse_loss(ddp(x), y).backward()
        if comm.rank == 1:
            ddp.close()
            raise Boom("rank 1 stops")
        x, y = rank_batch("mlp", 2, 2, 0)
        try:
            nn.functional.mse_loss(ddp(x), y).backward()
        except CommError as exc:
            return "comm error", str(exc), ddp._s.active
        finally:
            ddp.close()
        return "no error", "", None

    results = run_comms(2, body, timeout=5.0, thread_timeout=50.0)
    assert isinstance(results[1], Boom)
    outcome, message, active = results[0]
    assert outcome == "comm error", "rank 0 must see its peer's failure"
    assert active is False


def _fail_then_forward_again(fail_rank_1, step_before_failure):
    """Two ranks train the mlp; rank 1 runs ``fail_rank_1(ddp)`` after ``step_before_failure``
    steps and then raises (the harness aborts its transport). Rank 0 returns what its failing
    backward raised and what its next forward raises, as (type name, text) pairs."""
    class Boom(Exception):
        pass

    def body(comm):
        ddp = DistributedDataParallel(make_model("mlp"), comm, schedule="wfbp", **FAST)
        try:
            for step in range(step_before_failure):
                x, y = rank_batch("mlp", step, 2, comm.rank)
                nn.functional.mse_loss(ddp(x), y).backward()
            if comm.rank == 1:
                fail_rank_1(ddp, Boom)
            x, y = rank_batch("mlp", step_before_failure, 2, comm.rank)
            outcomes = []
            for _ in range(2):  # the failing step, then the next forward
                try:
                    nn.functional.mse_loss(ddp(x), y).backward()
                    outcomes.append(("no error", ""))
                except Boom:
                    raise
                except Exception as exc:  # noqa: BLE001 - judged below
                    outcomes.append((type(exc).__name__, str(exc), exc))
            return outcomes
        finally:
            ddp.close()

    results = run_comms(2, body, timeout=5.0, thread_timeout=50.0)
    assert isinstance(results[1], Boom), results[1]
    return results[0]


def _judge_next_forward(outcomes):
    from ringtrain import CommError

    (kind, first, first_exc), (again_kind, again, again_exc) = outcomes
    assert isinstance(first_exc, CommError), f"the failing backward raised {kind}: {first}"
    assert isinstance(again_exc, CommError), f"the next forward raised {again_kind}: {again}"
    assert "previous backward" in again and "communication failed" in again, again
    assert first in again, "the next forward's error must carry the original one"
    assert again_exc.__cause__ is first_exc
    assert "without a gradient" not in again


@pytest.mark.timeout(60)
def test_after_a_failed_bucket_allreduce_the_next_forward_names_the_comm_error():
    def stop(ddp, boom):
        raise boom("rank 1 stops before the third step")

    _judge_next_forward(_fail_then_forward_again(stop, 2))


@pytest.mark.timeout(60)
def test_after_a_failed_profile_exchange_the_next_forward_names_the_comm_error():
    """The profile exchange at the end of the first planned backward fails (rank 1 dies just
    before it): rank 0's backward raises the CommError and its next forward says so, instead
    of "the previous backward pass ended without a gradient for 0 of N parameters: []"."""
    def die_before_profile_exchange(ddp, boom):
        def profile():
            raise boom("rank 1 dies before the profile exchange")

        ddp._profile = profile  # only this rank's wrapper; its bucket allreduces still run

    _judge_next_forward(_fail_then_forward_again(die_before_profile_exchange, 0))


def test_find_unused_walks_dataclass_outputs():
    import dataclasses

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        note: str

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 3)
            self.unused = nn.Linear(3, 3)

        def forward(self, x):
            return Out(self.used(x), "hi")

    def body(comm):
        ddp = DistributedDataParallel(Wrapped(), comm, find_unused_parameters=True, **FAST)
        for _ in range(3):
            ddp.zero_grad()
            ddp(torch.ones(2, 3)).logits.sum().backward()
        grads = ddp.module.used.weight.grad.clone(), ddp.module.unused.weight.grad
        ddp.close()
        return grads

    for used, unused in raise_first(run_comms(2, body)):
        assert torch.equal(used, torch.full((3, 3), 2.0)) and unused is None  # (unused on every rank)


def test_mixed_dtype_parameters_get_one_bucket_per_dtype():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3).double()

        def forward(self, x):
            return self.b(self.a(x).double())

    def body(comm):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Mixed(), comm, schedule="single", **FAST)
        x = torch.full((2, 3), float(comm.rank + 1))
        for _ in range(2):
            ddp.zero_grad()
            ddp(x).sum().backward()
        dtypes = [b.dtype for b in ddp.buckets]
        grads = [p.grad.clone() for p in ddp.module.parameters()]
        ddp.close()
        return dtypes, grads

    results = raise_first(run_comms(2, body))
    assert results[0][0] == [torch.float64, torch.float32]  # b's gradients are ready first
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b) and a.dtype in (torch.float32, torch.float64)


@pytest.mark.timeout(60)
def test_gradients_are_bucket_views_and_in_place_zeroing_trains_alike():
    """gradient_as_bucket_view=True: after backward each .grad is a view of its bucket (no copy back); optimizers that zero
    gradients in place (set_to_none=False) then accumulate into the buckets themselves, and
    no_sync accumulation on top of that still equals the set_to_none=True run bitwise."""

    init = make_model("mlp").state_dict()  # (ranks are threads: they must not race on the global RNG)

    def train(comm, set_to_none):
        model = make_model("mlp")
        model.load_state_dict(init)
        ddp = DistributedDataParallel(model, comm, schedule="wfbp", gradient_as_bucket_view=True, **FAST)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        views = []
        for step in range(6):
            opt.zero_grad(set_to_none=set_to_none)
            for m in range(MICRO):
                x, y = micro_batch(step, m, 2, comm.rank)
                with (ddp.no_sync() if m < MICRO - 1 else _null()):
                    (nn.functional.mse_loss(ddp(x), y) / MICRO).backward()
            bufs = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in ddp._bufs]
            if step >= 1:  # (the first iteration's buckets are replaced once the plan is made)
                views.append(all(any(lo <= p.grad.data_ptr() < hi for lo, hi in bufs) for p in model.parameters()))
            opt.step()
        ddp.close()
        return [p.detach().clone() for p in model.parameters()], all(views)

    fresh = raise_first(run_comms(2, lambda comm: train(comm, True)))
    in_place = raise_first(run_comms(2, lambda comm: train(comm, False)))
    for (a, a_views), (b, b_views) in zip(fresh, in_place):
        assert a_views and b_views
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def _wfbp_mlp(comm, init, **options):
    """The MLP from ``init`` wrapped with one bucket per parameter (wfbp)."""
    model = make_model("mlp")
    model.load_state_dict(init)
    return model, DistributedDataParallel(model, comm, schedule="wfbp", **options, **FAST)


@pytest.mark.timeout(60)
def test_by_default_a_gradient_kept_across_backward_passes_is_not_overwritten():
    """Gradient surgery (PCGrad) keeps each task's .grad, zero_grad(set_to_none=True) between:
    with bucket views (the default before) the second backward wrote into the first's tensors,
    silently. The default is torch's (False) now; each kept gradient is its own task's mean."""
    init = make_model("mlp").state_dict()

    def tasks(comm, **options):
        model, ddp = _wfbp_mlp(comm, init, **options)
        for _ in range(2):  # (past the first plan, which lays the buckets out anew)
            ddp(micro_batch(0, 0, 2, comm.rank)[0]).sum().backward()
        kept = []
        for task in range(2):
            model.zero_grad(set_to_none=True)
            x, y = micro_batch(0, task, 2, comm.rank)
            nn.functional.mse_loss(ddp(x), y).backward()
            kept.append([p.grad for p in model.parameters()])  # references, not copies
        ddp.close()
        return [[g.clone() for g in grads] for grads in kept]

    def reference(task):  # the mean of the two ranks' gradients of one task, in one process
        model = make_model("mlp")
        model.load_state_dict(init)
        grads = []
        for rank in range(2):
            model.zero_grad(set_to_none=True)
            x, y = micro_batch(0, task, 2, rank)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        return [(a + b) / 2 for a, b in zip(*grads)]

    for kept in raise_first(run_comms(2, tasks)):
        for task in range(2):
            for got, want in zip(kept[task], reference(task)):
                torch.testing.assert_close(got, want)  # (tolerance: the ring sums in another order)
        assert not all(torch.equal(a, b) for a, b in zip(kept[0], kept[1]))
    as_views = raise_first(run_comms(2, lambda comm: tasks(comm, gradient_as_bucket_view=True)))
    assert all(torch.equal(a, b) for a, b in zip(as_views[0][0], as_views[0][1]))  # (the opt-in's known cost)


@pytest.mark.timeout(60)
def test_gradient_as_bucket_view_false_keeps_own_gradients():
    init = make_model("mlp").state_dict()

    def train(comm):
        model, ddp = _wfbp_mlp(comm, init, gradient_as_bucket_view=False)
        for step in range(3):
            x, y = micro_batch(step, 0, 2, comm.rank)
            model.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
        bufs = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in ddp._bufs]
        inside = [any(lo <= p.grad.data_ptr() < hi for lo, hi in bufs) for p in model.parameters()]
        grads = [p.grad.clone() for p in model.parameters()]
        ddp.close()
        return inside, grads

    results = raise_first(run_comms(2, train))
    for inside, _ in results:
        assert not any(inside)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)  # the mean, the same on both ranks


@pytest.mark.timeout(60)
def test_replaced_gradients_live_until_the_next_forward():
    # With bucket views, the tensors autograd made are freed at the next forward, as plain torch
    # frees its gradients at zero_grad (freed mid-backward, glibc returned the memory that forward
    # then faulted in again); never held past it.
    init = make_model("mlp").state_dict()

    def train(comm):
        model, ddp = _wfbp_mlp(comm, init, gradient_as_bucket_view=True)
        counts = []
        for step in range(3):
            x, y = micro_batch(step, 0, 2, comm.rank)
            model.zero_grad(set_to_none=True)
            out = ddp(x)
            counts.append(len(ddp._s.retired))  # the previous backward's were freed here
            nn.functional.mse_loss(out, y).backward()
            kept = [weakref.ref(t) for t in ddp._s.retired]
            counts.append(sum(r() is not None for r in kept))
        ddp(micro_batch(3, 0, 2, comm.rank)[0])
        counts.append(sum(r() is not None for r in kept))
        ddp.close()
        return counts

    n = len(list(make_model("mlp").parameters()))
    for counts in raise_first(run_comms(2, train)):
        assert counts == [0, n, 0, n, 0, n, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["tiny", "mlp"])
def test_one_rank_overhead_tool_pairs_equal_training(name):
    # python -m ringtrain.ddp.overhead: plain and wrapped steps from the same weights on the same
    # batch end bit for bit alike (one rank: the wrapper only stamps and counts), and both are timed.
    from ringtrain.ddp import overhead

    result = overhead.measure(name, steps=2, rounds=1)
    assert result["same_parameters"] and result["model"] == name
    assert result["plain_step_ms"] > 0 and result["ddp_step_ms"] > 0
    with pytest.raises(ValueError, match="model must be one of"):
        overhead.measure("conv")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", [["--steps", "0"], ["--rounds", "0"], ["--steps", "-3"], ["--rounds", "-1"]])
def test_overhead_tool_refuses_counts_below_one_naming_the_option(argv, capsys):
    # Before: python -m ringtrain.ddp.overhead --steps 0 (or --rounds 0) built the model, timed
    # nothing and ended in a traceback, "statistics.StatisticsError: no median for empty data".
    from ringtrain.ddp import overhead

    with pytest.raises(SystemExit) as exc:
        overhead.main(["--models", "tiny", "--out", "", *argv])
    assert exc.value.code == 2
    assert f"{argv[0]} must be >= 1" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("as_view", [False, True])
def test_a_gradient_laid_out_unlike_its_slot_gets_the_mean_in_its_own_layout(as_view):
    # A channels_last convolution's gradient is channels_last (autograd matches the parameter's
    # strides); its bucket slot is contiguous. Under gradient_as_bucket_view it stays its own
    # tensor and gets the mean copied back, as every gradient does without it; the linear
    # layer's gradients become views of their bucket.
    torch.manual_seed(0)
    init = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 2)).state_dict()
    xs = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def model():
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 2))
        m.load_state_dict(init)
        return m.to(memory_format=torch.channels_last)

    def train(comm):
        m = model()
        ddp = DistributedDataParallel(m, comm, schedule="single", gradient_as_bucket_view=as_view, **FAST)
        for _ in range(3):  # (past the first plan, which lays the buckets out anew)
            m.zero_grad(set_to_none=True)
            ddp(xs[comm.rank]).square().sum().backward()
        bufs = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in ddp._bufs]
        inside = [any(lo <= p.grad.data_ptr() < hi for lo, hi in bufs) for p in m.parameters()]
        grads = [p.grad.clone(memory_format=torch.preserve_format) for p in m.parameters()]
        ddp.close()
        return inside, grads

    ref = model()
    for x in xs:
        ref(x).square().sum().backward()  # (the sum of both ranks' gradients)
    for inside, grads in raise_first(run_comms(2, train)):
        assert inside == ([False, True, True, True] if as_view else [False] * 4)
        assert grads[0].is_contiguous(memory_format=torch.channels_last) and not grads[0].is_contiguous()
        for got, p in zip(grads, ref.parameters()):
            torch.testing.assert_close(got, p.grad / 2)  # (tolerance: the ring sums in another order)
