"""DistributedDataParallel as a drop-in for torch's DDP: the findings of a walk through a
ported training script, each pinned by a test that failed before its fix (on threads over the
local transport).

The expected gradients are the mean over ranks of what each rank's model computes alone (one
process, no wrapper).
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import nn

from thread_harness import raise_first, run_comms
from ringtrain.ddp import DistributedDataParallel
from test_ddp_review import Branchy, _rank_x

FAST = dict(alpha=2e-5, beta=1e-9, warmup_iterations=0, profile_iterations=1)
pytestmark = pytest.mark.timeout(60)


class Pair(Branchy):
    """Branchy's two layers side by side, sharing nothing; ``use_branch`` picks one."""

    def forward(self, x, use_branch=True):
        return self.branch(x) if use_branch else self.trunk(x)


def _made(kind: type = Branchy) -> nn.Module:
    """A model with seeded weights, made on the test's thread (the rank threads share torch's RNG):
    each rank and each reference takes a deep copy."""
    torch.manual_seed(0)
    return kind()


def _grads(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_mean(got: dict, per_rank: list[dict]) -> None:
    for k in per_rank[0]:
        if per_rank[0][k] is None:
            assert got[k] is None, f"{k}: expected no gradient"
            continue
        want = sum(g[k] for g in per_rank) / len(per_rank)
        # Not bitwise: the reference's local gradients come from another thread, where torch
        # may split its reductions otherwise (the mean itself is exact at 2 ranks).
        torch.testing.assert_close(got[k], want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")



def _alone(base: nn.Module, loss) -> list[dict]:
    """Each rank's gradients of ``loss(model, rank)`` on a copy of ``base`` of its own, no wrapper."""
    per_rank = []
    for rank in range(2):
        alone = copy.deepcopy(base)
        loss(alone, rank).backward()
        per_rank.append(_grads(alone))
    return per_rank


def _averaged_as_alone(base: nn.Module, loss, steps: int = 3, **options) -> None:
    """``steps`` iterations of ``loss(forward, rank, step)`` through the wrapper on 2 ranks: each
    one's gradients, on every rank, are the mean of each rank's own (``_alone``, same loss)."""
    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **options, **FAST)
        grads = []
        for step in range(steps):
            model.zero_grad()
            loss(ddp, comm.rank, step).backward()
            grads.append(_grads(model))
        ddp.close()
        return grads

    results = raise_first(run_comms(2, body))
    for step in range(steps):
        per_rank = _alone(base, lambda m, rank: loss(m, rank, step))
        for r in range(2):
            _assert_mean(results[r][step], per_rank)

def _frozen_trunk_loss(model: nn.Module, rank: int) -> torch.Tensor:
    model.trunk.weight.requires_grad_(False)
    return model(_rank_x(rank, 1)).sum()

# --- 1. find_unused_parameters and a loss over the outputs of two forwards ------------------------

@pytest.mark.parametrize("kind", [Branchy, Pair])
def test_a_backward_through_two_forwards_that_reach_other_parameters_is_an_error_naming_them(kind):
    """Each forward searches its own outputs' graph and the last one decides what is unused: a
    loss over an earlier forward's outputs too gave the parameters only that forward reached a
    local, unaveraged gradient, silently (Pair: the last forward's gradients all came first, so
    the averaged pass had ended), or an error that blamed a loss term taken from the parameters
    (Branchy). torch's DDP hangs there."""
    base = _made(kind)

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, **FAST)
        x = _rank_x(comm.rank)
        with pytest.raises(RuntimeError, match="outputs of an earlier forward") as info:
            (ddp(x, use_branch=True).sum() + ddp(x, use_branch=False).sum()).backward()
        model.zero_grad()
        ddp(x, use_branch=True).sum().backward()  # the next iteration is whole again
        grads = _grads(model)
        ddp.close()
        return str(info.value), grads

    results = raise_first(run_comms(2, body))
    for message, _ in results:
        assert "'branch.weight'" in message and "'branch.bias'" in message, message
        assert "'trunk." not in message, message
    per_rank = _alone(base, lambda m, rank: m(_rank_x(rank), use_branch=True).sum())
    for _, grads in results:
        _assert_mean(grads, per_rank)


def test_two_forwards_over_the_same_parameters_into_one_loss_are_averaged():
    """A siamese loss (two forwards, one backward) reaching the same parameters stays allowed."""
    _averaged_as_alone(_made(), lambda f, rank, step: (f(_rank_x(rank, step)) * f(_rank_x(rank, step + 10))).sum(),
                       find_unused_parameters=True)


def test_an_earlier_forward_left_without_backward_changes_nothing():
    """A forward that tracks gradients and is dropped (an evaluation) before the training forward:
    the training forward alone decides what is unused, as before."""
    base = _made()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, **FAST)
        ddp(_rank_x(comm.rank, 5), use_branch=True)  # dropped
        ddp(_rank_x(comm.rank), use_branch=False).sum().backward()
        grads = _grads(model)
        ddp.close()
        return grads

    results = raise_first(run_comms(2, body))
    per_rank = _alone(base, lambda m, rank: m(_rank_x(rank), use_branch=False).sum())
    for grads in results:
        _assert_mean(grads, per_rank)
        assert grads["branch.weight"] is None


# --- 2. requires_grad changed after wrapping ---------------------------------------------------------

def test_a_parameter_frozen_after_wrapping_is_named_as_frozen():
    """The wrapper expects a gradient for every parameter that required one at construction: a
    parameter frozen later gets none, which the next forward reports. The report said to pass
    find_unused_parameters=True and nothing of requires_grad."""
    base = _made()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        ddp(_rank_x(comm.rank)).sum().backward()
        model.trunk.weight.requires_grad_(False)
        ddp(_rank_x(comm.rank, 1)).sum().backward()
        with pytest.raises(RuntimeError, match="without a gradient") as info:
            ddp(_rank_x(comm.rank, 2))
        ddp.close()
        return str(info.value)

    for message in raise_first(run_comms(2, body)):
        assert "['trunk.weight']" in message, message
        assert "requires_grad=False since the wrapper was made: ['trunk.weight']" in message, message


def test_a_parameter_frozen_after_wrapping_is_averaged_as_unused_with_find_unused_parameters():
    base = _made()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, **FAST)
        ddp(_rank_x(comm.rank)).sum().backward()
        model.trunk.weight.requires_grad_(False)
        model.zero_grad()
        ddp(_rank_x(comm.rank, 1)).sum().backward()
        grads = _grads(model)
        ddp.close()
        return grads

    results = raise_first(run_comms(2, body))
    per_rank = _alone(base, _frozen_trunk_loss)
    for grads in results:
        _assert_mean(grads, per_rank)


def test_a_parameter_frozen_at_wrapping_that_requires_grad_later_is_refused_naming_it():
    """A parameter that did not require a gradient at construction has no hook: unfrozen later,
    its gradient stayed local on every rank, silently, and the ranks' copies drifted apart."""
    base = _made()

    def body(comm):
        model = copy.deepcopy(base)
        model.trunk.weight.requires_grad_(False)
        ddp = DistributedDataParallel(model, comm, **FAST)
        ddp(_rank_x(comm.rank)).sum().backward()
        model.trunk.weight.requires_grad_(True)
        with torch.no_grad():
            ddp(_rank_x(comm.rank))  # an evaluation: no gradient, nothing to refuse
        with pytest.raises(RuntimeError, match=r"\['trunk.weight'\] did not require a gradient when") as info:
            ddp(_rank_x(comm.rank, 1))
        model.trunk.weight.requires_grad_(False)
        model.zero_grad()
        ddp(_rank_x(comm.rank, 1)).sum().backward()  # frozen again: training goes on
        grads = _grads(model)
        ddp.close()
        return str(info.value), grads

    results = raise_first(run_comms(2, body))
    per_rank = _alone(base, _frozen_trunk_loss)
    for message, grads in results:
        assert "wrap the module again" in message, message
        _assert_mean(grads, per_rank)



# --- 4. find_unused_parameters and torch.utils.checkpoint -------------------------------------------

class Checkpointed(nn.Module):
    """Branchy's trunk under torch.utils.checkpoint."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.inner = Branchy()
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.inner.trunk, x, use_reentrant=self.reentrant)
        return self.inner.branch(torch.tanh(h))


def test_find_unused_parameters_refuses_a_reentrant_checkpoint_naming_the_way_out():
    """A reentrant checkpoint's backward node does not lead to the parameters inside it, so the walk
    counted them unused: the averaged pass ended with the others' gradients and theirs, computed
    after it by the checkpoint's own backward, stayed local, silently."""
    torch.manual_seed(0)
    base = Checkpointed(reentrant=True)

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, **FAST)
        x = _rank_x(comm.rank).requires_grad_()
        with pytest.raises(RuntimeError, match="use_reentrant=False") as info:
            ddp(x)
        ddp.close()
        return str(info.value)

    for message in raise_first(run_comms(2, body)):
        assert "torch.utils.checkpoint" in message, message


@pytest.mark.parametrize("find_unused", [False, True])
def test_a_non_reentrant_checkpoint_is_averaged(find_unused):
    torch.manual_seed(0)
    _averaged_as_alone(Checkpointed(reentrant=False), lambda f, rank, step: f(_rank_x(rank, step)).sum(),
                       find_unused_parameters=find_unused)

# --- 3. one process, no launcher (a notebook) -----------------------------------------------------

def test_without_init_the_error_says_how_to_run_in_one_process(monkeypatch):
    import ringtrain

    monkeypatch.setattr(ringtrain, "_default", None)
    with pytest.raises(RuntimeError, match=r"not been called in this process.*ringtrain.init\(rank=0, world_size=1\)"):
        ringtrain.DistributedDataParallel(_made())


def test_in_one_process_the_wrapper_trains_as_the_module_alone(monkeypatch):
    import ringtrain

    monkeypatch.setattr(ringtrain, "_default", None)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    base = _made()
    model, alone = copy.deepcopy(base), copy.deepcopy(base)
    comm = ringtrain.init(rank=0, world_size=1)  # what the error above says
    try:
        ddp = ringtrain.DistributedDataParallel(model)
        for step in range(6):
            model.zero_grad()
            alone.zero_grad()
            ddp(_rank_x(0, step)).sum().backward()
            alone(_rank_x(0, step)).sum().backward()
            for a, b in zip(model.parameters(), alone.parameters()):
                assert torch.equal(a.grad, b.grad)
        ddp.close()
    finally:
        comm.close()

# --- 4. torch's keywords, attributes and copies (a second walkthrough) ----------------------------

TORCH_AS_HERE = dict(device_ids=None, output_device=None, dim=0, broadcast_buffers=None, init_sync=True,
                     process_group=None, bucket_cap_mb=None, check_reduction=False, static_graph=True,
                     delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None,
                     device_mesh=None, skip_all_reduce_unused_params=False, bucket_cap_mb_list=None,
                     batched_grad_copy=False, forward_sync_buffers=None)


def test_torch_ddp_keywords_at_the_values_that_mean_the_same_here_are_taken():
    """A script ported from torch's DDP passed them and got 'unknown option'."""
    import inspect

    torchs = set(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters) - {"self", "module"}
    assert torchs - {"find_unused_parameters", "gradient_as_bucket_view"} <= set(TORCH_AS_HERE), \
        "this torch has a DDP keyword the wrapper does not know"
    _averaged_as_alone(_made(), lambda f, rank, step: f(_rank_x(rank, step)).sum(), device_ids=[],
                       **{k: v for k, v in TORCH_AS_HERE.items() if k != "device_ids"})


@pytest.mark.parametrize("given, says", [
    (dict(device_ids=[0]), r"device_ids=\[0\] is not supported: it trains modules on the CPU"),
    (dict(output_device=0), "output_device=0 is not supported: it trains modules on the CPU"),
    (dict(process_group="WORLD"), "process_group='WORLD' is not supported: .*pass comm="),
    (dict(mixed_precision="bf16"), "mixed_precision='bf16' is not supported: it has no such feature; leave it at "
                                   "torch's default, None"),
    (dict(static_graph="yes"), "static_graph='yes': it must be True or False"),
    (dict(init_sync=1), "init_sync=1: it must be True or False"),
])
def test_torch_ddp_keywords_at_other_values_are_refused_saying_why(given, says):
    with pytest.raises(ValueError, match=says):
        DistributedDataParallel(_made(), None, **given)


def test_a_device_list_given_second_as_torchs_ddp_takes_it_says_so():
    with pytest.raises(ValueError, match=r"got \[0\] \(torch's DDP takes device_ids second"):
        DistributedDataParallel(_made(), [0])


def test_init_sync_false_leaves_each_ranks_parameters_as_they_are():
    def body(comm):
        model = nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.fill_(comm.rank)
        ddp = DistributedDataParallel(model, comm, init_sync=False, **FAST)
        weight = model.weight.detach().clone()
        ddp.close()
        return weight

    weights = raise_first(run_comms(2, body))
    assert [float(w.mean()) for w in weights] == [0.0, 1.0]


def test_require_backward_grad_sync_false_accumulates_locally_as_no_sync():
    """Frameworks set torch's attribute instead of entering no_sync(): it was a no-op attribute."""
    base = _made()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        assert ddp.require_backward_grad_sync
        ddp.require_backward_grad_sync = False
        ddp(_rank_x(comm.rank)).sum().backward()  # local
        local = _grads(model)
        ddp.require_backward_grad_sync = True
        with ddp.no_sync():
            assert not ddp.require_backward_grad_sync
        ddp.close()
        return local

    results = raise_first(run_comms(2, body))
    per_rank = _alone(base, lambda m, rank: m(_rank_x(rank)).sum())
    for rank in range(2):
        for k, g in results[rank].items():
            torch.testing.assert_close(g, per_rank[rank][k])  # this rank's own, not the mean


def test_torchs_attributes_of_the_settings_read_as_torchs_ddp_gives_them():
    """Code written for torch's DDP reads its settings back (``model.find_unused_parameters``,
    ``model.device_ids``...) and calls ``model._set_static_graph()``, which torch's own errors
    recommend: each was an AttributeError."""
    def body(comm):
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["1.running_var"])
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, gradient_as_bucket_view=True,
                                      broadcast_buffers=False, **FAST)
        plain = DistributedDataParallel(nn.Linear(3, 4), comm, static_graph=True, **FAST)
        try:
            got = (ddp.find_unused_parameters, ddp.gradient_as_bucket_view, ddp.broadcast_buffers,
                   ddp.forward_sync_buffers, ddp.static_graph, ddp.device_ids, ddp.output_device, ddp.dim,
                   ddp.parameters_to_ignore, plain.static_graph, plain.find_unused_parameters)
            ddp._set_static_graph()  # (a hint, as the keyword: nothing changes)
            assert ddp.static_graph
            ddp(torch.ones(2, 3)).sum().backward()
            return got
        finally:
            ddp.close()
            plain.close()

    for got in raise_first(run_comms(2, body)):
        assert got == (True, True, False, False, False, None, None, 0, {"1.running_var"}, True, False)


def test_copying_or_pickling_the_wrapper_says_to_copy_the_module():
    """It was "cannot pickle 'mmap.mmap' object" (the shared-memory transport, deep inside)."""
    import pickle

    def body(comm):
        model = _made()
        ddp = DistributedDataParallel(model, comm, **FAST)
        try:
            for attempt in (copy.deepcopy, pickle.dumps, lambda m: torch.save(m, __import__("io").BytesIO())):
                with pytest.raises(TypeError, match=r"cannot be copied or pickled.*copy.deepcopy\(model.module\)"):
                    attempt(ddp)
            ema = copy.deepcopy(ddp.module)  # what it says works
            assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), model.parameters()))
        finally:
            ddp.close()

    raise_first(run_comms(2, body))


@pytest.mark.parametrize("sync", [True, False])
def test_forward_sync_buffers_is_broadcast_buffers_and_false_leaves_them_at_construction_too(sync):
    """torch 2.13 asks for forward_sync_buffers in place of broadcast_buffers (refused before); with
    False, torch's DDP leaves the buffers out of the construction's broadcast as well."""
    def body(comm):
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        with torch.no_grad():
            model[1].running_mean.fill_(comm.rank)
        ddp = DistributedDataParallel(model, comm, forward_sync_buffers=sync, **FAST)
        assert ddp.options.broadcast_buffers is sync
        mean = float(model[1].running_mean.mean())
        ddp.close()
        return mean

    assert raise_first(run_comms(2, body)) == ([0.0, 0.0] if sync else [0.0, 1.0])
    with pytest.raises(ValueError, match="name one setting"):
        DistributedDataParallel(_made(), None, forward_sync_buffers=True, broadcast_buffers=False)


class _WithLocal(nn.Module):
    """A shared layer, a rank-local layer (an expert of this rank's own) and a rank-local count."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(3, 4)
        self.local = nn.Linear(4, 2)
        self.register_buffer("count", torch.zeros(1))
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        self.count += 1
        return self.local(self.shared(x)) * self.scale


def test_parameters_and_buffers_torch_is_told_to_ignore_stay_each_ranks_own():
    """torch's DDP._set_params_and_buffers_to_ignore_for_model(module, names) leaves those out of
    the broadcasts and the averaging (rank-local experts, counters). They were taken as any other:
    rank 0's values overwrote the others' at construction and the gradients were averaged. The
    parameter check (here at every iteration) leaves them out too: they are apart by design."""
    def body(comm):
        torch.manual_seed(0)  # (the same layers on every rank, then each rank's own local ones)
        model = _WithLocal()
        with torch.no_grad():
            model.local.weight.fill_(comm.rank)
            model.local.bias.fill_(comm.rank)
            model.scale.fill_(1 + comm.rank)
            model.shared.bias.add_(comm.rank)  # (not ignored: rank 0's is broadcast)
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ["local.weight", "local.bias", "count"])
        local = [model.local.weight.detach().clone(), model.local.bias.detach().clone()]
        ddp = DistributedDataParallel(model, comm, parameter_check_interval=1, **FAST)
        try:
            assert all(torch.equal(a, b) for a, b in zip(local, [model.local.weight, model.local.bias]))
            model.count.fill_(10 * comm.rank)
            for step in range(3):
                model.zero_grad()
                ddp(_rank_x(comm.rank, step)[:, :3]).sum().backward()
            return ({n: p.grad.clone() for n, p in model.named_parameters()}, float(model.count),
                    float(model.scale), model.shared.bias.detach().clone())
        finally:
            ddp.close()

    (g0, count0, scale0, bias0), (g1, count1, scale1, bias1) = raise_first(run_comms(2, body))
    assert (count0, count1) == (3.0, 13.0)  # each rank's own
    assert (scale0, scale1) == (1.0, 1.0)  # rank 0's, broadcast at each forward
    assert torch.equal(bias0, bias1)
    for name in ("shared.weight", "shared.bias"):
        assert torch.equal(g0[name], g1[name]), name  # averaged
    assert not torch.equal(g0["local.weight"], g1["local.weight"])  # each rank's own


def _compiled(rank, world_size, port):
    """torch.compile'd module, wrapped: 6 SGD steps of this rank's batches; the parameters."""
    import ringtrain

    torch.set_num_threads(1)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, timeout=60.0)
    model = _made(Branchy)
    ddp = DistributedDataParallel(torch.compile(model), comm, **FAST)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        opt.zero_grad()
        ddp(_rank_x(rank, step)).square().mean().backward()
        opt.step()
    ddp.close()
    comm.close()
    return [p.detach().numpy().copy() for p in model.parameters()]  # (numpy: a tensor would cross by fd)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="torch.compile on the CPU needs a C++ compiler")
def test_a_torch_compiled_module_trains_as_the_mean_of_the_ranks():
    from mp_harness import run_ranks

    results = run_ranks(_compiled, 2, timeout=220)
    for r in results:
        if isinstance(r, BaseException):
            raise AssertionError(f"{r}\n{getattr(r, 'tb', '')}")
    model = _made(Branchy)  # the reference: each step's gradient the mean of the ranks' own
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        per_rank = []
        for rank in range(2):
            model.zero_grad()
            model(_rank_x(rank, step)).square().mean().backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for p, *grads in zip(model.parameters(), *per_rank):
            p.grad = sum(grads) / 2
        opt.step()
    for rank, got in enumerate(results):
        assert all((a == b).all() for a, b in zip(got, results[0])), f"rank {rank} against rank 0"
    # Not bitwise: the compiled kernels sum in another order than eager autograd.
    for a, b in zip(results[0], model.parameters()):
        torch.testing.assert_close(torch.from_numpy(a), b.detach(), rtol=1e-5, atol=1e-6)


def test_a_module_with_nothing_to_train_is_refused_on_every_rank_as_torch_does():
    """Before: accepted, with an empty plan and a calibration sweep, and nothing ever averaged
    (torch's DDP raises "DistributedDataParallel is not needed when a module doesn't have any
    parameter that requires a gradient"). The parameter servers refuse it too."""
    base = _made()
    base.requires_grad_(False)

    def body(comm):
        with pytest.raises(ValueError, match="Branchy has no parameter that requires a gradient") as info:
            DistributedDataParallel(copy.deepcopy(base), comm, **FAST)
        return str(info.value)

    raise_first(run_comms(2, body))
