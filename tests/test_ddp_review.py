"""DistributedDataParallel: the findings of a code review, each pinned by a test that failed
before its fix (on threads over the local transport).

The expected gradients are the mean over ranks of what each rank's model computes alone (one
process, no wrapper): the wrapper's mean of two ranks is (a + b) / 2 as torch computes it.
"""

from __future__ import annotations

import copy
import gc
import threading
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

from thread_harness import raise_first, run_comms
from ringtrain.ddp import DistributedDataParallel
from ringtrain.errors import CommError
from test_ddp_support import make_model, rank_batch

FAST = dict(alpha=2e-5, beta=1e-9, warmup_iterations=0, profile_iterations=1)
pytestmark = pytest.mark.timeout(60)


def _comm_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ringtrain-ddp-comm") and t.is_alive()]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    before = set(_comm_threads())
    yield
    assert set(_comm_threads()) <= before, "a wrapper's communication thread outlived its test"


class Branchy(nn.Module):
    """A trunk, and a branch taken only when asked."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.trunk(x))
        return self.branch(h) if use_branch else h


def _rank_x(rank: int, salt: int = 0) -> torch.Tensor:
    """A distinct input per rank (and per salt)."""
    return (torch.arange(8.0).reshape(2, 4) + 3 * rank + 7 * salt) / 8


def _mean(per_rank: list[dict]) -> dict:
    return {k: sum(g[k] for g in per_rank) / len(per_rank) for k in per_rank[0]}


def _local_grads(base: nn.Module, kind: str, step: int, world_size: int = 2) -> list[dict]:
    """Each rank's gradients of its batch of ``step`` on a copy of ``base``, without communication."""
    out = []
    for rank in range(world_size):
        alone = copy.deepcopy(base)
        x, y = rank_batch(kind, step, world_size, rank)
        nn.functional.mse_loss(alone(x), y).backward()
        out.append(_grads(alone))
    return out


def _assert_grads(got: dict, want: dict) -> None:
    for k, w in want.items():
        if w is None:
            assert got[k] is None, f"{k}: expected no gradient, got {got[k]}"
        else:
            # Not bitwise: the reference's local gradients come from another thread, where torch
            # may split its reductions otherwise (the mean itself is exact at 2 ranks).
            torch.testing.assert_close(got[k], w, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")


def _grads(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


# --- 1. a forward that does not synchronize leaves the armed backward armed ----------------------

@pytest.mark.parametrize("between", ["no_grad", "inference_mode"])
def test_a_forward_that_does_not_sync_between_forward_and_backward_keeps_it_averaged(between):
    base = make_model("mlp")

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        grads = []
        for step in range(3):  # the one-bucket iteration, then the planned layout
            x, y = rank_batch("mlp", step, 2, comm.rank)
            model.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            with torch.no_grad() if between == "no_grad" else torch.inference_mode():
                ddp(x)  # an evaluation between the training forward and its backward
            loss.backward()
            grads.append(_grads(model))
        ddp.close()
        return grads

    results = raise_first(run_comms(2, body))
    for step in range(3):
        local = _local_grads(base, "mlp", step)
        _assert_grads(results[0][step], _mean(local))
        assert all(torch.equal(results[0][step][k], results[1][step][k]) for k in local[0])


def test_a_no_sync_pass_after_a_synchronizing_forward_without_backward_stays_local():
    """A synchronizing forward whose output is dropped (a validation pass that tracks gradients),
    then a no_sync() forward and backward: that backward accumulates locally, as no_sync() says;
    the next synchronizing backward averages what accumulated."""
    base = make_model("mlp")

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        x, y = rank_batch("mlp", 0, 2, comm.rank)
        ddp(x)  # synchronizing forward, no backward
        with ddp.no_sync():
            nn.functional.mse_loss(ddp(x), y).backward()
        local = _grads(model)
        x1, y1 = rank_batch("mlp", 1, 2, comm.rank)
        nn.functional.mse_loss(ddp(x1), y1).backward()
        ddp.close()
        return local, _grads(model)

    results = raise_first(run_comms(2, body))
    expect_local, expect_sum = [], []
    for rank in range(2):
        alone = copy.deepcopy(base)
        x, y = rank_batch("mlp", 0, 2, rank)
        nn.functional.mse_loss(alone(x), y).backward()
        expect_local.append(_grads(alone))
        x1, y1 = rank_batch("mlp", 1, 2, rank)
        nn.functional.mse_loss(alone(x1), y1).backward()
        expect_sum.append(_grads(alone))
    for rank in range(2):
        _assert_grads(results[rank][0], expect_local[rank])  # not averaged
    _assert_grads(results[0][1], _mean(expect_sum))
    assert all(torch.equal(results[0][1][k], results[1][1][k]) for k in expect_sum[0])


# --- 2. no_sync gradients of a parameter unused in the synchronizing pass ------------------------

@pytest.mark.parametrize("as_view, set_to_none", [(True, True), (True, False), (False, True)])
def test_no_sync_gradients_of_a_parameter_unused_in_the_syncing_pass_are_averaged(as_view, set_to_none):
    """The branch gets gradients under no_sync() only; the synchronizing pass skips it: its
    accumulated gradient must be averaged, not replaced by zeros."""
    torch.manual_seed(3)
    base = Branchy()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, gradient_as_bucket_view=as_view,
                                      **FAST)
        grads = []
        for _ in range(3):  # through profiling into the planned layout
            model.zero_grad(set_to_none=set_to_none)
            with ddp.no_sync():
                ddp(_rank_x(comm.rank), True).sum().backward()
            ddp(_rank_x(comm.rank, 1), False).sum().backward()
            grads.append(_grads(model))
        ddp.close()
        return grads

    results = raise_first(run_comms(2, body))
    local = []
    for rank in range(2):
        alone = copy.deepcopy(base)
        alone(_rank_x(rank), True).sum().backward()
        alone(_rank_x(rank, 1), False).sum().backward()
        local.append(_grads(alone))
    want = _mean(local)
    assert want["branch.weight"].abs().sum() > 0
    for per_step in results:
        for got in per_step:
            _assert_grads(got, want)


# --- 3. a parameter no rank uses keeps no gradient -------------------------------------------------

@pytest.mark.parametrize("schedule", ["single", "wfbp"])
@pytest.mark.parametrize("as_view", [True, False])
def test_a_parameter_unused_on_every_rank_keeps_no_gradient(as_view, schedule):
    """As with torch's DDP: None stays None (not zeros); the used ones get the mean."""
    base = make_model("unused")

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, gradient_as_bucket_view=as_view,
                                      schedule=schedule, **FAST)
        grads = []
        for step in range(3):
            x, y = rank_batch("unused", step, 2, comm.rank)
            model.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
            grads.append(_grads(model))
        ddp.close()
        return grads

    results = raise_first(run_comms(2, body))
    for step in range(3):
        local = _local_grads(base, "unused", step)
        want = {k: None if v is None else sum(g[k] for g in local) / 2 for k, v in local[0].items()}
        assert want["unused.weight"] is None and want["unused.bias"] is None
        for rank in range(2):
            _assert_grads(results[rank][step], want)


# --- 4. a wrapper dropped by its user is collected ------------------------------------------------

def test_a_dropped_wrapper_is_collected_its_thread_ends_and_its_hooks_go():
    def body(comm):
        model = make_model("mlp")
        ddp = DistributedDataParallel(model, comm, **FAST)
        x, y = rank_batch("mlp", 0, 2, comm.rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        ref, thread = weakref.ref(ddp), ddp._thread._thread
        del ddp
        gc.collect()
        collected = ref() is None
        thread.join(5.0)
        hooks = [p._post_accumulate_grad_hooks for p in model.parameters()]
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()  # the module alone trains on
        return collected, thread.is_alive(), hooks

    for collected, alive, hooks in raise_first(run_comms(2, body)):
        assert collected, "the module's hooks kept the wrapper alive"
        assert not alive, "the communication thread of a collected wrapper must end"
        assert all(not h for h in hooks)


def test_a_wrapper_dropped_after_a_failed_backward_is_collected_and_its_thread_ends():
    """A script that starts again after a peer's failure (a new communicator and wrapper; the old
    ones dropped) leaves no thread behind. The communication thread held its last job while it
    waited for the next: the failed job's error, raised through the wrapper's frames, held the
    wrapper, so it was never collected and its thread never ended, one per failure."""
    from ringtrain.comm import Communicator
    from ringtrain.transport.local import run_threads

    def body(transport):
        comm = Communicator(transport, timeout=10.0)
        model = make_model("mlp")
        ddp = DistributedDataParallel(model, comm, **FAST)
        x, y = rank_batch("mlp", 0, 2, comm.rank)
        error = None
        if comm.rank == 1:
            comm.abort(ValueError("rank 1 gives up"))
        else:
            try:
                nn.functional.mse_loss(ddp(x), y).backward()
            except CommError as exc:
                error = type(exc).__name__
        ref, thread = weakref.ref(ddp), ddp._thread._thread
        del ddp, comm
        gc.collect()
        thread.join(5.0)
        return error, ref() is None, thread.is_alive()

    assert raise_first(run_threads(2, body, timeout=60.0)) == [("CommError", True, False), (None, True, False)]


# --- 5. a trace file that cannot be written ---------------------------------------------------------

def test_a_trace_file_that_cannot_be_written_warns_once_and_training_goes_on(tmp_path):
    def body(comm):
        model = make_model("mlp")
        ddp = DistributedDataParallel(model, comm, schedule="wfbp", timeline=tmp_path / "t.json",
                                      timeline_iterations=1, **FAST)
        ddp.timeline_path.mkdir()  # a folder where the file goes: the write after the first traced iteration fails
        try:
            for step in range(4):
                x, y = rank_batch("mlp", step, 2, comm.rank)
                model.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
            return ddp.iteration, len(ddp.stats), _grads(model)
        finally:
            ddp.close()  # (writes nothing either)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = raise_first(run_comms(2, body))
    for iterations, stats, _ in results:
        assert iterations == 4 and stats == 4
    assert all(torch.equal(g, results[1][2][k]) for k, g in results[0][2].items())
    messages = sorted(str(w.message) for w in caught if "trace file" in str(w.message))
    assert len(messages) == 2, messages  # once per rank
    for rank, message in enumerate(messages):
        assert str(tmp_path / f"t.rank{rank}.json") in message and "no longer recorded" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.rank0.json", "t.rank1.json"]  # (no temporary left)


# --- 6. each bucket's allreduce has its own deadline -------------------------------------------------

def test_slow_allreduces_each_within_the_deadline_are_no_timeout():
    delay = 0.5  # per allreduce; the deadline is 2.5 of them, the four buckets take 4 (0.2 left a loaded peer 0.3 s)

    def body(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        ddp = DistributedDataParallel(model, comm, schedule="wfbp", **FAST)
        x = _rank_x(comm.rank)
        ddp(x).sum().backward()  # the one-bucket iteration: then one bucket per parameter
        real = comm.allreduce

        def slow(*args, **kwargs):
            time.sleep(delay)
            return real(*args, **kwargs)

        comm.allreduce = slow
        ddp._timeout = 2.5 * delay
        try:
            model.zero_grad()
            ddp(x).sum().backward()
            return ddp.last_stats.buckets, _grads(model)
        finally:
            ddp.close()

    results = raise_first(run_comms(2, body))
    assert results[0][0] == 4
    assert all(torch.equal(g, results[1][1][k]) for k, g in results[0][1].items())


# --- 7. an error met while abandoning an iteration is kept and chained ------------------------------

def test_a_comm_error_met_while_abandoning_an_iteration_is_chained_and_kept():
    """Rank 0's backward reaches the branch only (launching its buckets); rank 1 is gone, so they
    fail. The next forward's "missing gradients" error names that CommError as its cause, and
    the forward after it reports the failed communication (the communicator is broken)."""
    class Boom(Exception):
        pass

    torch.manual_seed(3)
    base = Branchy()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, schedule="wfbp", **FAST)
        try:
            ddp(_rank_x(comm.rank)).sum().backward()  # the branch's gradients come first: its buckets too
            if comm.rank == 1:
                raise Boom("rank 1 stops")
            ddp(_rank_x(0)).sum().backward(inputs=[model.branch.weight, model.branch.bias])
            with pytest.raises(RuntimeError, match="without a gradient") as missing:
                ddp(_rank_x(0))
            with pytest.raises(CommError, match="communication failed") as failed:
                ddp(_rank_x(0))
            return missing.value, failed.value
        finally:
            ddp.close()

    results = run_comms(2, body, timeout=5.0, thread_timeout=50.0)
    assert isinstance(results[1], Boom), results[1]
    missing, failed = results[0]
    assert isinstance(missing.__cause__, CommError), missing.__cause__
    assert "'trunk.weight'" in str(missing) and "'branch.weight'" not in str(missing)
    assert failed.__cause__ is missing.__cause__


# --- 8. an error raised in the middle of backward ---------------------------------------------------

class _SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 3, sparse=True)
        self.lin = nn.Linear(3, 1)

    def forward(self, idx):
        return self.lin(self.emb(idx)).sum()


def test_an_error_in_the_wrappers_hook_is_what_the_user_sees_and_the_next_iteration_is_clean():
    def body(comm):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(_SparseBag(), comm, **FAST)
        idx = torch.tensor([1, 2 + comm.rank])
        seen = []
        try:
            for _ in range(2):  # the same error each time, never "missing gradients"
                out = ddp(idx)
                with pytest.raises(ValueError, match="'emb.weight' has a sparse gradient"):
                    out.backward()
                seen.append(ddp._s.active)
            return seen
        finally:
            ddp.close()

    for seen in raise_first(run_comms(2, body)):
        assert seen == [False, False]


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises (an autograd error outside the wrapper's hooks)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("backward failed")


def test_after_an_error_outside_the_hooks_the_next_forward_says_it_may_be_the_cause():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def forward(self, x):
            return self.b(_FailingBackward.apply(self.a(x)))

    def body(comm):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Model(), comm, **FAST)
        with pytest.raises(ArithmeticError):
            ddp(torch.ones(1, 2)).sum().backward()
        with pytest.raises(RuntimeError, match="without a gradient") as info:
            ddp(torch.ones(1, 2))
        ddp(torch.ones(1, 2))  # the iteration after it starts clean
        ddp.close()
        return str(info.value)

    for message in raise_first(run_comms(1, body)):
        assert "'a.weight'" in message and "'b.weight'" not in message
        assert "raised an exception" in message


# --- 9. the missing-gradients error names the missing parameters, not the unused ones --------------

def test_missing_gradients_are_named_without_the_parameters_counted_unused():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 2)
            self.b = nn.Linear(3, 2)
            self.unused = nn.Linear(3, 2)

        def forward(self, x):
            return self.a(x), self.b(x)

    def body(comm):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(TwoHeads(), comm, find_unused_parameters=True, **FAST)
        x = _rank_x(comm.rank)[:, :3]
        out_a, _ = ddp(x)
        # a.bias is expected (out_a reaches it) but this backward, limited to a.weight, gives it
        # no gradient. (A loss on out_a alone no longer misses b: b then counts as unused, as with
        # torch's DDP; test_ddp_patterns.py.)
        torch.autograd.backward(out_a.sum(), inputs=[ddp.module.a.weight])
        with pytest.raises(RuntimeError, match="without a gradient") as info:
            ddp(x)
        ddp.zero_grad()
        out_a, out_b = ddp(x)
        (out_a.sum() + out_b.sum()).backward()  # whole again
        grads = _grads(ddp.module)
        ddp.close()
        return str(info.value), grads

    results = raise_first(run_comms(2, body))
    for message, _ in results:
        assert "'a.bias'" in message and "'a.weight'" not in message, message
        assert "'unused." not in message, message
    assert results[0][1]["unused.weight"] is None
    assert all(torch.equal(g, results[1][1][k]) for k, g in results[0][1].items() if g is not None)


# --- 10. buffers are broadcast as torch's DDP does: not at the forwards of no_sync() ---------------

class _Normed(nn.Module):
    """A linear layer and a BatchNorm: buffers (running statistics) to broadcast."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.lin(x))


def _micro_x(rank: int, k: int) -> torch.Tensor:
    return torch.arange(12.0).reshape(4, 3).sin() * (1 + rank) + k / 4


def test_no_sync_passes_with_buffers_send_nothing_so_ranks_may_accumulate_unevenly():
    """torch's DDP broadcasts buffers at a forward only after a synchronizing forward that tracked
    gradients (require_forward_param_sync): inside no_sync() only the first forward does, so ranks
    may run different numbers of micro-batches before the synchronizing one. Broadcasting at every
    forward sent one broadcast per no_sync() micro-batch, and uneven counts mismatched the ranks'
    collectives."""
    torch.manual_seed(0)
    base = _Normed()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        ddp(_micro_x(comm.rank, 0)).pow(2).sum().backward()  # one synchronizing step
        model.zero_grad()
        seqs = []
        with ddp.no_sync():
            for k in range(2 + comm.rank):  # rank 0: 2 micro-batches, rank 1: 3
                ddp(_micro_x(comm.rank, k + 1)).pow(2).sum().backward()
                seqs.append(comm._seq)
        ddp(_micro_x(comm.rank, 9)).pow(2).sum().backward()
        grads = _grads(model)
        ddp.close()
        return seqs, grads

    results = raise_first(run_comms(2, body))
    for seqs, _ in results:
        assert len(set(seqs)) == 1, f"no_sync() forwards after the first communicated: {seqs}"
    per_rank = []
    for rank in range(2):
        alone = copy.deepcopy(base)
        for k in [*range(1, 3 + rank), 9]:
            alone(_micro_x(rank, k)).pow(2).sum().backward()
        per_rank.append(_grads(alone))
    _assert_grads(results[0][1], _mean(per_rank))
    assert all(torch.equal(g, results[1][1][k]) for k, g in results[0][1].items())


# --- 11. a parameter whose dtype changed after wrapping is refused, naming it ---------------------

@pytest.mark.parametrize("as_view", [True, False])
def test_a_parameter_converted_after_wrapping_is_refused_naming_it(as_view):
    """The buckets have the dtypes the parameters had when the wrapper was made. ``ddp.double()``
    afterwards: with gradient_as_bucket_view=False the float64 gradients were averaged in the
    float32 bucket and copied back rounded (1 + 1.5e-12 came back as 1.0, silently); with True,
    torch refused to make the float32 slot the .grad, in words that do not say why."""

    def body(comm):
        torch.manual_seed(0)
        model = nn.Linear(1, 1, bias=False)
        ddp = DistributedDataParallel(model, comm, gradient_as_bucket_view=as_view, **FAST)
        ddp.double()
        x = torch.tensor([[1.0 + 1e-12 * (comm.rank + 1)]], dtype=torch.float64)
        with pytest.raises(RuntimeError) as info:
            ddp(x).sum().backward()
        ddp.close()
        return str(info.value)

    for message in raise_first(run_comms(2, body)):
        assert "'weight'" in message and "torch.float64" in message and "torch.float32" in message, message
        assert "wrap" in message, message


# --- 12. ranks whose models differ are refused at construction, naming the difference -------------

@pytest.mark.parametrize("case", ["same_bytes", "vocabulary"])
def test_models_that_differ_across_ranks_are_refused_naming_the_parameter(case):
    """torch's DDP checks at construction that every rank's parameters have rank 0's shapes. The
    construction broadcast copies bytes: models of the same total size but other shapes were
    accepted silently, rank 0's values poured into rank 1's other shapes ("same_bytes"), and a
    vocabulary that differs per rank failed with "ranks disagree ... broadcast(dtype=uint8,
    numel=200) ... numel=216", naming no parameter."""

    def body(comm):
        torch.manual_seed(0)
        if case == "same_bytes":
            dims = [(4, 2), (2, 2)] if comm.rank == 0 else [(2, 2), (4, 2)]
            model = nn.Sequential(*[nn.Linear(*d) for d in dims])
        else:
            model = nn.Sequential(nn.Embedding(10 + 2 * comm.rank, 4), nn.Linear(4, 2))
        with pytest.raises(RuntimeError) as info:
            DistributedDataParallel(model, comm, **FAST)
        return str(info.value)

    messages = raise_first(run_comms(2, body))
    if case == "same_bytes":
        assert "'0.weight'" in messages[1] and "(2, 4)" in messages[1] and "(2, 2)" in messages[1], messages[1]
    else:
        assert "'0.weight'" in messages[1] and "(10, 4)" in messages[1] and "(12, 4)" in messages[1], messages[1]
    assert "ranks [1]" in messages[0], messages[0]  # rank 0 says which rank differs
