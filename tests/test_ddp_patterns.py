"""DistributedDataParallel on the model patterns real training scripts use: each one gives the
result torch's DDP gives, or a clear error where torch's DDP gives one.

Each pattern runs 3 steps on 2 ranks (some on 3) over threads and is checked against a
simulation of data-parallel training in one thread (``_simulated``): a copy of the model per
rank, each computing its own batch's gradients, averaged, then the same optimizer step; rank
0's buffers copied to the others at each forward after the first, as torch's DDP broadcasts
them. Gradients after the first backward and parameters after the last step must be equal on
every rank (bitwise) and to the simulation's. ``test_as_torch_ddp`` runs the same patterns under
torch's own DDP (gloo) and this wrapper in the same two processes and compares them bitwise.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import io
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mp_harness import run_ranks
from torch_version import OLDER_TORCH
from thread_harness import raise_first, run_comms
from ringtrain.ddp import DistributedDataParallel

FAST = dict(alpha=2e-5, beta=1e-9, warmup_iterations=0, profile_iterations=1)
pytestmark = pytest.mark.timeout(60)
STEPS = 3


# --- models ----------------------------------------------------------------------------------------

class Tied(nn.Module):
    """A language model's embedding and output projection sharing one Parameter."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mid(self.emb(idx))))


class Twice(nn.Module):
    """One layer applied twice in one forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))


class Checkpointed(nn.Module):
    """A block under torch.utils.checkpoint; ``twice``: the same block checkpointed twice."""

    def __init__(self, reentrant: bool, twice: bool = False):
        super().__init__()
        self.reentrant, self.twice = reentrant, twice
        self.a = nn.Linear(5, 7)
        self.blk = nn.Sequential(nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 7))
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        h = checkpoint(self.blk, torch.tanh(self.a(x)), use_reentrant=self.reentrant)
        if self.twice:
            h = checkpoint(self.blk, torch.tanh(h), use_reentrant=self.reentrant)
        return self.b(h)


class MLP(nn.Module):
    def __init__(self, dtype=torch.float64, head_dtype=None):
        super().__init__()
        self.a = nn.Linear(5, 7, dtype=dtype)
        self.b = nn.Linear(7, 3, dtype=head_dtype or dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).to(self.b.weight.dtype))


class Spectral(nn.Module):
    """Complex weights, as a Fourier layer's, between real layers: a complex128 parameter and
    buffer after a float64 weight of 15 elements (120 bytes, not a multiple of 16)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 3, bias=False, dtype=torch.float64)
        self.w = nn.Parameter(torch.randn(3, 3, dtype=torch.complex128))
        self.register_buffer("phase", torch.polar(torch.ones(3, dtype=torch.float64), torch.arange(3.0).double()))
        self.b = nn.Linear(3, 3, dtype=torch.float64)

    def forward(self, x):
        return self.b(((self.a(x).to(torch.complex128) @ self.w) * self.phase).abs())


class Heads(nn.Module):
    """A forward returning a nested structure: a dict holding a tuple holding a list and a dict."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7, dtype=torch.float64)
        self.h1 = nn.Linear(7, 3, dtype=torch.float64)
        self.h2 = nn.Linear(7, 2, dtype=torch.float64)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return {"logits": self.h1(h), "aux": (self.h2(h), [h.sum(), {"z": h}]), "n": 3}


@dataclasses.dataclass(frozen=True)
class Out:
    logits: torch.Tensor
    aux: torch.Tensor
    note: str = "not a tensor"


Pair = collections.namedtuple("Pair", "logits aux")


class Outputs(collections.OrderedDict):
    """As transformers' ModelOutput: an OrderedDict subclass."""


class Structured(nn.Module):
    """A forward returning a frozen dataclass, a namedtuple or an OrderedDict subclass."""

    def __init__(self, kind: type):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(5, 7, dtype=torch.float64)
        self.h1 = nn.Linear(7, 3, dtype=torch.float64)
        self.h2 = nn.Linear(7, 2, dtype=torch.float64)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        logits, aux = self.h1(h), self.h2(h)
        return self.kind(logits=logits, aux=aux)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7, dtype=torch.float64)
        self.bn = nn.BatchNorm1d(7, dtype=torch.float64)
        self.b = nn.Linear(7, 3, dtype=torch.float64)

    def forward(self, x):
        return self.b(torch.tanh(self.bn(self.a(x))))


# --- data and losses: loss(model, rank, step) --------------------------------------------------------

def _batch(rank: int, step: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g).to(dtype), torch.randint(0, 3, (4,), generator=g)


def ce(model, rank, step, dtype=torch.float64):
    x, y = _batch(rank, step, dtype)
    return F.cross_entropy(model(x), y)


def tied_loss(model, rank, step):
    idx = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(1000 * step + rank))
    return F.cross_entropy(model(idx).reshape(-1, 11), idx.roll(1, 1).reshape(-1))


def autocast_loss(model, rank, step):
    x, y = _batch(rank, step, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    return F.cross_entropy(out.float(), y)


def siamese_loss(model, rank, step):
    x, y = _batch(rank, step)
    a, b = model(x), model(x.flip(0))  # two forwards, one backward
    return F.cross_entropy(a, y) + (a - b).pow(2).mean()


def evaluated_between_loss(model, rank, step):
    """An evaluation forward (no_grad, eval mode) between a forward and its backward."""
    x, y = _batch(rank, step)
    out = model(x)
    model.eval()
    with torch.no_grad():
        model(x.flip(0))
    model.train()
    return F.cross_entropy(out, y)


def nested_loss(model, rank, step):
    x, y = _batch(rank, step)
    out = model(x)
    return F.cross_entropy(out["logits"], y) + out["aux"][0].pow(2).mean() + out["aux"][1][1]["z"].mean()


def logits_only_loss(model, rank, step):
    """Uses one output of several: h2 gets no gradient (it is in the graph of an output)."""
    x, y = _batch(rank, step)
    return F.cross_entropy(model(x)["logits"], y)


def rank_dependent_loss(model, rank, step):
    """The aux head is used on some ranks at some steps, on none at step 1 (3 ranks: 0/2/1)."""
    x, y = _batch(rank, step)
    out = model(x)
    loss = F.cross_entropy(out["logits"], y)
    return loss + out["aux"][0].pow(2).mean() if (rank + step) % 2 and step != 1 else loss


class WithInput(nn.Module):
    """Returns, beside its logits, an output computed from the input alone (no parameter)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 3, dtype=torch.float64)

    def forward(self, x):
        return {"logits": self.a(x), "scaled": x * 2}


def no_parameter_loss(model, rank, step):
    """Rank 1's loss at step 1 uses only the output that reaches no parameter."""
    x, y = _batch(rank, step)
    out = model(x.requires_grad_())
    return out["scaled"].pow(2).mean() if (rank, step) == (1, 1) else F.cross_entropy(out["logits"], y)


def structured_loss(model, rank, step):
    x, y = _batch(rank, step)
    out = model(x)
    assert type(out) is getattr(model, "module", model).kind  # (the wrapper, or the module alone)
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return F.cross_entropy(logits, y)


def inplace_loss(model, rank, step):
    """Modifies an output in place (it is the sink's clone under find_unused_parameters)."""
    x, y = _batch(rank, step)
    out = model(x)
    out["logits"].mul_(2)
    return F.cross_entropy(out["logits"], y)


class ZeroedInPlace(torch.optim.SGD):
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=False)  # gradients accumulate into the bucket views


class NeverZeroed(torch.optim.SGD):
    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # each step's gradient adds to the last step's mean


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def groups(model):
    return torch.optim.SGD([{"params": model.a.parameters(), "lr": 0.2},
                            {"params": model.b.parameters(), "lr": 0.05, "momentum": 0.9}], lr=0.1)


def two_optimizers(model):
    return [torch.optim.Adam(model.a.parameters(), lr=0.01), torch.optim.SGD(model.b.parameters(), lr=0.1)]


def with_scheduler(model):
    opt = sgd(model)
    return [opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]


def clip(model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # right after backward: on the mean


# --- the two sides ---------------------------------------------------------------------------------

def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _steps(opts) -> None:
    for o in opts if isinstance(opts, list) else [opts]:
        o.step()  # (a scheduler's step after its optimizer's)


def _zero(opts) -> None:
    for o in opts if isinstance(opts, list) else [opts]:
        if isinstance(o, torch.optim.Optimizer):
            o.zero_grad()


def _trained(ddp, model, rank, loss, opt, after):
    """``STEPS`` steps of ``loss`` through ``ddp`` (the wrapper, or the module alone)."""
    first = None
    for step in range(STEPS):
        _zero(opt)
        loss(ddp, rank, step).backward()
        if after is not None:
            after(model)
        first = first if first is not None else _grads(model)
        _steps(opt)
    return first, _state(model)


def _ours(base, world, loss, opt=sgd, after=None, **options):
    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST, **options)
        try:
            return _trained(ddp, model, comm.rank, loss, opt(model), after)
        finally:
            ddp.close()

    return raise_first(run_comms(world, body))


def _simulated(base, world, loss, opt=sgd, after=None):
    """Data-parallel training simulated in one thread: per-rank copies, gradients averaged."""
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [opt(m) for m in models]
    first = None
    for step in range(STEPS):
        for m, o in zip(models, opts):
            if step:  # rank 0's buffers at each forward after a synchronizing one
                for b, b0 in zip(m.buffers(), models[0].buffers()):
                    b.copy_(b0)
            _zero(o)
        for rank, m in enumerate(models):
            loss(m, rank, step).backward()
        params = [dict(m.named_parameters()) for m in models]
        for name in params[0]:
            got = [p[name].grad for p in params]
            if all(g is None for g in got):
                continue  # no rank has one: stays None (find_unused_parameters)
            mean = sum(torch.zeros_like(p[name]) if g is None else g for p, g in zip(params, got)) / world
            for p in params:
                p[name].grad = mean.clone()
        for m in models:
            if after is not None:
                after(m)
        first = first if first is not None else _grads(models[0])
        for o in opts:
            _steps(o)
    return first, _state(models[0])


def _same(got, want, what, tol) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        if want[k] is None:
            assert got[k] is None, f"{what} {k}: expected None, got {got[k]}"
        elif tol is None:
            assert torch.equal(got[k], want[k]), f"{what} {k}: {got[k]} != {want[k]}"
        else:
            torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m: f"{what} {k}: {m}")


# float64: the simulation's local gradients come from another thread than the rank's (torch may
# split a reduction otherwise) and it sums 3 ranks in another order than the ring: ~1 ulp.
F64 = dict(rtol=1e-12, atol=1e-15)
# float32 parameters: the same reasons, at float32's precision.
F32 = dict(rtol=1e-5, atol=1e-7)


def _check(make, world, loss, opt=sgd, after=None, tol=F64, **options):
    torch.manual_seed(0)
    base = make()
    results = _ours(base, world, loss, opt, after, **options)
    for rank, (grads, state) in enumerate(results):  # every rank holds the same, bitwise
        _same(grads, results[0][0], f"rank {rank} gradient", None)
        _same({k: v for k, v in state.items() if "running" not in k and "num_batches" not in k},
              {k: v for k, v in results[0][1].items() if "running" not in k and "num_batches" not in k},
              f"rank {rank} parameter", None)
    grads, state = _simulated(base, world, loss, opt, after)
    _same(results[0][0], grads, "gradient", tol)
    _same(results[0][1], state, "state", tol)
    return results


# --- patterns that work ----------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_weights_tied_between_embedding_and_output_projection(world):
    results = _check(lambda: Tied().double(), world, tied_loss)
    assert "out.weight" not in results[0][0]  # one Parameter, one name (named_parameters dedups)


def test_a_layer_applied_twice_in_one_forward():
    _check(lambda: Twice().double(), 2, ce)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    _check(lambda: Checkpointed(reentrant).double(), 2, ce)


def test_a_block_checkpointed_twice_without_reentrance_with_find_unused_parameters():
    _check(lambda: Checkpointed(False, twice=True).double(), 2, ce, find_unused_parameters=True)


@pytest.mark.parametrize("find_unused", [False, True])
def test_a_block_checkpointed_twice_with_reentrance_is_an_error_naming_the_way_out(find_unused):
    """Each reentrant recomputation runs a backward of its own: blk's parameters get two gradients
    in one backward. The second was reported as "the previous backward pass ended without a
    gradient for ['a.weight', 'a.bias'] ... Pass find_unused_parameters=True" (which refuses a
    reentrant checkpoint). torch's DDP raises "Expected to mark a variable ready only once"
    (static_graph=True makes it work there)."""
    torch.manual_seed(0)
    base = Checkpointed(True, twice=True).double()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        with pytest.raises(RuntimeError, match="got a second gradient in one synchronizing backward") as info:
            ce(ddp, comm.rank, 0).backward()
        model.zero_grad()
        ddp.close()
        # find_unused_parameters=True: refused at the forward, as for any reentrant checkpoint.
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, **FAST)
        with pytest.raises(RuntimeError, match="reentrant torch.utils.checkpoint.*use_reentrant=False"):
            ddp(_batch(comm.rank, 0)[0])
        ddp.close()
        return str(info.value)

    for message in raise_first(run_comms(2, body)):
        assert "'blk.2." in message and "['a.weight', 'a.bias']" in message, message
        assert "use_reentrant=False" in message and "static_graph" in message, message


class FirstCheckpointed(MLP):
    """The first layer under a reentrant checkpoint: its input (the batch) requires no gradient."""

    def forward(self, x):
        return self.b(torch.tanh(checkpoint(self.a, x, use_reentrant=True)))


def test_a_reentrant_checkpoint_of_the_first_layer_names_its_parameters_missing():
    """torch's checkpoint gives the layer no gradient (with a warning), alone as under either DDP;
    torch's DDP fails at the next forward ("Expected to have finished reduction ..."), so does
    this one, naming them."""
    torch.manual_seed(0)
    base = FirstCheckpointed()

    def body(comm):
        ddp = DistributedDataParallel(copy.deepcopy(base), comm, **FAST)
        ce(ddp, comm.rank, 0).backward()  # (torch warns "None of the inputs have requires_grad=True")
        with pytest.raises(RuntimeError, match=r"without a gradient for 2 of the 4 .*\['a.weight', 'a.bias'\]"):
            ddp(_batch(comm.rank, 1)[0])
        ddp.close()

    # The ranks are threads of this process, and warnings.catch_warnings (pytest.warns) is not
    # thread-safe: one rank's exit restored the filters inside the other's, which then missed
    # torch's warning now and then. Torch's warning is not what is tested: it is silenced here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True")
        raise_first(run_comms(2, body))


def test_autocast_to_bfloat16_in_forward():
    # bfloat16 forward; float32 gradients, averaged with the float32 tolerance.
    _check(lambda: MLP(torch.float32), 2, autocast_loss, tol=F32)


@pytest.mark.parametrize("world", [2, 3])
def test_float64_parameters(world):
    _check(MLP, world, ce)


def test_complex128_parameters_and_buffers():
    """The broadcast at construction put the complex128 weight at byte 120 of its buffer and
    failed ("self.storage_offset() must be divisible by 16 to view Byte as ComplexDouble");
    the collectives take no complex128 ("unsupported dtype torch.complex128"), nor did the
    parameter check. As torch's DDP: the mean of the real and imaginary parts."""
    _check(Spectral, 2, ce, parameter_check_interval=1)


def test_float32_and_float64_parameters_in_one_module():
    _check(lambda: MLP(torch.float32, torch.float64), 2, lambda m, r, s: ce(m, r, s, torch.float32), tol=F32)


def test_gradient_clipping_right_after_backward_clips_the_mean():
    _check(MLP, 2, ce, after=clip)


@pytest.mark.parametrize("opt", [groups, two_optimizers, with_scheduler])
def test_param_groups_several_optimizers_and_a_scheduler(opt):
    _check(MLP, 2, ce, opt=opt)


@pytest.mark.parametrize("kind", [ZeroedInPlace, NeverZeroed])
def test_gradients_zeroed_in_place_or_accumulated_over_steps(kind):
    _check(MLP, 2, ce, opt=lambda m: kind(m.parameters(), lr=0.1))


@pytest.mark.parametrize("find_unused", [False, True])
def test_two_forwards_before_one_backward(find_unused):
    _check(MLP, 2, siamese_loss, find_unused_parameters=find_unused)


@pytest.mark.parametrize("find_unused", [False, True])
def test_a_forward_returning_a_nested_dict_tuple_list(find_unused):
    _check(Heads, 2, nested_loss, find_unused_parameters=find_unused)


@pytest.mark.parametrize("loss", [siamese_loss, evaluated_between_loss], ids=["siamese", "evaluated between"])
def test_batchnorm_buffers_broadcast_by_a_second_forward_before_the_backward(loss):
    # The broadcast of the buffers before the second forward bumped their autograd version:
    # "one of the variables needed for gradient computation has been modified by an inplace
    # operation" (BatchNorm saves its running statistics for backward). torch's DDP does not bump it.
    _check(Normed, 2, loss)


def test_batchnorm_buffers_as_torch_ddp_broadcasts_them():
    results = _check(Normed, 2, ce)
    # As torch's DDP: the last forward's own statistics stay until the next forward broadcasts rank 0's.
    assert not torch.equal(results[0][1]["bn.running_mean"], results[1][1]["bn.running_mean"])


def test_eval_and_train_switching_and_a_state_dict_round_trip():
    torch.manual_seed(0)
    base = Normed()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        opt = sgd(model)
        outs = []
        for step in range(STEPS):
            opt.zero_grad()
            ce(ddp, comm.rank, step).backward()
            opt.step()
            ddp.eval()
            assert not model.training
            with torch.no_grad():
                outs.append(ddp(_batch(0, 9)[0]))  # rank 0's buffers (broadcast at this forward)
            outs.append(ddp(_batch(0, 9)[0]).detach())  # tracks gradients, no backward: changes nothing
            ddp.train()
        state = ddp.state_dict()
        again = DistributedDataParallel(copy.deepcopy(base), comm, **FAST)
        again.load_state_dict(state)
        loaded = _state(again.module)
        again.close()
        ddp.close()
        return outs, state, loaded, _state(model)

    results = raise_first(run_comms(2, body))
    for outs, state, loaded, own in results:
        assert list(state) == ["module." + k for k in base.state_dict()]  # torch DDP's key layout
        _same(loaded, own, "loaded", None)
        for got, want in zip(outs, results[0][0]):
            assert torch.equal(got, want)  # the same evaluation on every rank
    # The same evaluation as the simulation's rank 0 after the same steps, at the same buffers.
    sim = copy.deepcopy(base)
    sim.load_state_dict(results[0][3])
    sim.eval()
    torch.testing.assert_close(sim(_batch(0, 9)[0]), results[0][0][-1], **F64)


# --- only part of the outputs in the loss ----------------------------------------------------------

def test_a_loss_on_part_of_the_outputs_is_an_error_naming_the_rest_without_find_unused():
    """As torch's DDP: "Expected to have finished reduction in the prior iteration..." at the
    next forward."""
    torch.manual_seed(0)
    base = Heads()

    def body(comm):
        ddp = DistributedDataParallel(copy.deepcopy(base), comm, **FAST)
        logits_only_loss(ddp, comm.rank, 0).backward()
        with pytest.raises(RuntimeError, match=r"without a gradient.*'h2.weight', 'h2.bias'.*find_unused_parameters=True"):
            ddp(_batch(comm.rank, 1)[0])
        ddp.close()

    raise_first(run_comms(2, body))


@pytest.mark.parametrize("world", [2, 3])
def test_a_loss_on_part_of_the_outputs_with_find_unused_parameters(world):
    """The output the loss ignores reaches h2: the walk from every output expected a gradient for
    it, so the backward never ended (the next forward raised "ended without a gradient for
    ['h2.weight', 'h2.bias']"). Now the outputs pass through one node whose backward sees which
    the loss used, as torch's _DDPSink: h2 is unused, its .grad stays None."""
    results = _check(Heads, world, logits_only_loss, find_unused_parameters=True)
    assert results[0][0]["h2.weight"] is None


@pytest.mark.parametrize("kind", [Out, Pair, Outputs])
def test_a_dataclass_namedtuple_or_ordereddict_subclass_output_with_find_unused_parameters(kind):
    """Rebuilt around the sink's clones with its own type. (torch's DDP does not look into a
    dataclass or an OrderedDict subclass: there the ignored head fails its next forward.)"""
    results = _check(lambda: Structured(kind), 2, structured_loss, find_unused_parameters=True)
    assert results[0][0]["h2.weight"] is None


def test_an_output_modified_in_place_with_find_unused_parameters():
    _check(Heads, 2, inplace_loss, find_unused_parameters=True)


def test_a_head_used_on_some_ranks_with_find_unused_parameters():
    """A rank whose loss ignored the aux output waited for h2's gradient and returned from backward
    without averaging; its peers waited in the allreduce until the communicator's timeout (20 s),
    then both failed. As torch's DDP, h2 now gets the mean of the ranks that used it."""
    t0 = time.monotonic()
    results = _check(Heads, 3, rank_dependent_loss, find_unused_parameters=True)
    assert results[0][0]["h2.weight"] is not None
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_whose_loss_reaches_no_parameter_with_find_unused_parameters(world):
    """Rank 1's backward at step 1 got no gradient: nothing began or ended it, so it returned
    without taking part, and its next backward's allreduces paired with the other ranks' of
    this one (rank 0's step-1 gradients came back averaged with rank 1's step-2 ones), then the
    ranks failed apart. It now takes part with zeros: every rank gets the mean, as torch's DDP."""
    t0 = time.monotonic()
    _check(WithInput, world, no_parameter_loss, find_unused_parameters=True)
    assert time.monotonic() - t0 < 10


def test_a_penalty_on_a_head_the_loss_ignores_is_still_an_error_naming_it():
    """A parameter counted unused (only an output the loss ignores reaches it) that gets a gradient
    from a term taken from the parameters directly: named, as for a parameter no output reaches."""
    torch.manual_seed(0)
    base = Heads()

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, **FAST)
        with pytest.raises(RuntimeError, match="'h2.weight' got a gradient, but the forward's outputs that the loss"):
            (logits_only_loss(ddp, comm.rank, 0) + model.h2.weight.pow(2).sum()).backward()
        ddp.close()

    raise_first(run_comms(2, body))


def test_no_sync_then_a_loss_on_part_of_the_outputs():
    """A head used only under no_sync() contributes what it accumulated."""
    def loss(model, rank, step):
        sync = getattr(model, "no_sync", None)
        if step == 1 and sync is not None:
            with sync():
                nested_loss(model, rank, 10).backward()
        elif step == 1:
            nested_loss(model, rank, 10).backward()
        return logits_only_loss(model, rank, step)

    results = _check(Heads, 2, loss, find_unused_parameters=True)
    assert results[0][0]["h2.weight"] is None  # (step 0)


class AuxFirst(Heads):
    """Heads whose aux head is computed before the logits: autograd reaches h1 first in backward."""

    def forward(self, x):
        h = torch.tanh(self.a(x))
        aux = self.h2(h)
        return {"logits": self.h1(h), "aux": aux}


def aux_at_first_loss(model, rank, step):
    """Uses the aux head at step 0 only: from step 1 h2 has a .grad the loss does not add to."""
    x, y = _batch(rank, step)
    out = model(x)
    loss = F.cross_entropy(out["logits"], y)
    return loss + out["aux"].pow(2).mean() if step == 0 else loss


@pytest.mark.parametrize("kind", [ZeroedInPlace, NeverZeroed])
def test_a_head_the_loss_ignores_whose_grad_shares_a_bucket_with_used_ones(kind):
    """h2 ignored at steps 1 and 2 but with a .grad (a view of the one bucket, zeroed in place or
    kept): h1's gradient, accumulated in place into its own view of that bucket, moved the
    bucket's version counter, which h2's .grad shares, so autograd's accumulation of h2 with no
    gradient was taken for a new one: "'h2.bias' got a gradient, but the forward's outputs that
    the loss uses do not reach it" on every rank."""
    _check(AuxFirst, 2, aux_at_first_loss, opt=lambda m: kind(m.parameters(), lr=0.1),
           find_unused_parameters=True, schedule="fixed")



def aux_gradient_norm_then_logits_loss(model, rank, step):
    """torch.autograd.grad of the aux output for h2's parameters (a gradient norm, say: their .grad
    untouched), then a loss that ignores the aux head."""
    x, y = _batch(rank, step)
    h2 = [p for name, p in model.named_parameters() if "h2" in name]
    torch.autograd.grad(model.module(x)["aux"].pow(2).sum() if hasattr(model, "module")
                        else model(x)["aux"].pow(2).sum(), h2)
    return F.cross_entropy(model(x)["logits"], y)


def test_torch_autograd_grad_for_a_head_the_loss_then_ignores():
    """autograd.grad calls a parameter's gradient hook but not its post-accumulate hook: the mark
    of a gradient it left must not make the next backward's accumulation of h2 with none an error."""
    results = _check(AuxFirst, 2, aux_gradient_norm_then_logits_loss, find_unused_parameters=True)
    assert results[0][0]["h2.weight"] is None


# --- against torch's own DDP (gloo), in real processes -------------------------------------------

# name: (model, loss, optimizer, after backward, find_unused_parameters). Those that fail under
# both DDPs come last: each raises a RuntimeError (after one, the next pattern starts afresh).
TORCH_PATTERNS = {
    "tied": (lambda: Tied().double(), tied_loss, sgd, None, False),
    "twice": (lambda: Twice().double(), ce, sgd, None, False),
    "checkpoint": (lambda: Checkpointed(False).double(), ce, sgd, None, False),
    "reentrant checkpoint": (lambda: Checkpointed(True).double(), ce, sgd, None, False),
    "autocast": (lambda: MLP(torch.float32), autocast_loss, sgd, None, False),
    "float64": (MLP, ce, sgd, None, False),
    "complex128": (Spectral, ce, sgd, None, False),
    "mixed": (lambda: MLP(torch.float32, torch.float64), lambda m, r, s: ce(m, r, s, torch.float32), sgd, None, False),
    "clip": (MLP, ce, sgd, clip, False),
    "groups": (MLP, ce, groups, None, False),
    "two optimizers": (MLP, ce, two_optimizers, None, False),
    "scheduler": (MLP, ce, with_scheduler, None, False),
    "siamese": (MLP, siamese_loss, sgd, None, False),
    "siamese, find_unused": (MLP, siamese_loss, sgd, None, True),
    "nested": (Heads, nested_loss, sgd, None, False),
    "part of the outputs, find_unused": (Heads, logits_only_loss, sgd, None, True),
    "head on some ranks, find_unused": (Heads, rank_dependent_loss, sgd, None, True),
    "batchnorm": (Normed, ce, sgd, None, False),
    "batchnorm, siamese": (Normed, siamese_loss, sgd, None, False),
    "batchnorm, evaluated between": (Normed, evaluated_between_loss, sgd, None, False),
    "zeroed in place": (MLP, ce, lambda m: ZeroedInPlace(m.parameters(), lr=0.1), None, False),
    "never zeroed": (MLP, ce, lambda m: NeverZeroed(m.parameters(), lr=0.1), None, False),
    "output modified in place, find_unused": (Heads, inplace_loss, sgd, None, True),
    "namedtuple output, find_unused": (lambda: Structured(Pair), structured_loss, sgd, None, True),
    "a rank's loss reaches no parameter, find_unused": (WithInput, no_parameter_loss, sgd, None, True),
    "part of the outputs": (Heads, logits_only_loss, sgd, None, False),
    "reentrant checkpoint twice": (lambda: Checkpointed(True, twice=True).double(), ce, sgd, None, False),
}
FAILING = {"part of the outputs", "reentrant checkpoint twice"}  # under torch's DDP too
# torch's own DDP of torch 2.4 (not of 2.13) bumps the buffers' version when it broadcasts them at
# a forward: with a second forward before backward (or an evaluation between), "modified by an
# inplace operation" in backward. Ours copies through .data (docs/ddp.md) and trains.
FAILING_IN_OLDER_TORCH = {"batchnorm, siamese", "batchnorm, evaluated between"}
COMPILED = {"compiled module": "inner", "compiled wrapper": "outer"}


def _both_ddps(rank, world_size, port, names):
    """Each pattern of ``names`` under torch's DDP, then under this one; torch.save'd results."""
    import torch.distributed as dist

    import ringtrain

    torch.set_num_threads(1)
    # (one store for both, at one port: a second free port could be taken before its use)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, timeout=20.0)
    out = {}
    try:
        for name in names:
            make, loss, opt, after, find_unused = TORCH_PATTERNS.get(name, TORCH_PATTERNS["float64"])
            for kind in ("torch", "ours"):
                torch.manual_seed(0)
                model = make()
                t0 = time.monotonic()
                if COMPILED.get(name) == "inner":
                    model = torch.compile(model)
                if kind == "torch":
                    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
                else:
                    ddp = DistributedDataParallel(model, comm, find_unused_parameters=find_unused, **FAST)
                if COMPILED.get(name) == "outer":
                    ddp = torch.compile(ddp)
                try:
                    out[name, kind] = _trained(ddp, model, rank, loss, opt(model), after)
                except Exception as exc:  # noqa: BLE001 - compared with the other DDP's
                    out[name, kind] = (type(exc).__name__, str(exc))
                    dist.barrier()
                out[name, kind, "s"] = time.monotonic() - t0
                if kind == "ours":
                    ddp.close() if isinstance(ddp, DistributedDataParallel) else ddp._orig_mod.close()
    finally:
        comm.close()  # (before the store it reaches: rank 0's is the default group's)
        dist.destroy_process_group()
    buf = io.BytesIO()
    torch.save(out, buf)  # (tensors through the queue would need their sender alive)
    return buf.getvalue()


def _run_both(names, world=2):
    results = run_ranks(_both_ddps, world, names, timeout=50)
    for r in results:
        if isinstance(r, BaseException):
            raise AssertionError(f"{r}\n{getattr(r, 'tb', '')}")
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


def _as_torch(results, name) -> None:
    torch_side, ours = results[0][name, "torch"], results[0][name, "ours"]
    if name in FAILING:
        assert torch_side[0] == ours[0] == "RuntimeError", (name, torch_side, ours)
        return
    if name in FAILING_IN_OLDER_TORCH and torch_side[0] == "RuntimeError" and OLDER_TORCH:
        assert isinstance(ours[0], dict), (name, ours)  # ours trains where that torch's DDP cannot
        return
    assert isinstance(torch_side[0], dict), (name, torch_side)
    assert isinstance(ours[0], dict), (name, ours)
    for rank, res in enumerate(results):
        # Bitwise: at 2 ranks the mean of two gradients is one rounding, whatever the order.
        _same(res[name, "ours"][0], res[name, "torch"][0], f"{name}: rank {rank} gradient", None)
        _same(res[name, "ours"][1], res[name, "torch"][1], f"{name}: rank {rank} state", None)


@pytest.mark.multiprocess
def test_as_torch_ddp():
    results = _run_both(list(TORCH_PATTERNS))
    for name in TORCH_PATTERNS:
        _as_torch(results, name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(COMPILED))
def test_torch_compile_as_torch_ddp(name):
    """torch.compile'd module in the wrapper, and the wrapper in torch.compile (graph breaks at its
    hooks and communication: torch runs those eagerly)."""
    try:
        results = _run_both([name])
    except TimeoutError:
        pytest.skip("torch.compile took over 50 s here (the ranks were killed)")
    except AssertionError as exc:
        if "BackendCompilerFailed" in str(exc) or "InvalidCxxCompiler" in str(exc):
            pytest.skip(f"torch.compile is not usable here: {str(exc)[:200]}")
        raise
    if max(results[0][name, kind, "s"] for kind in ("torch", "ours")) > 60:
        pytest.skip("torch.compile took over 60 s here")
    _as_torch(results, name)


@pytest.mark.timeout(180)
def _plain_and_compiled_with_find_unused(rank, world_size, port):
    """The training of the test below, plain then through torch.compile(wrapper), in a process of
    its own (torch.compile and set_num_threads change this process for the tests after them)."""
    import ringtrain

    torch.set_num_threads(1)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, timeout=20.0)
    results = []
    try:
        for compiled in (False, True):
            torch.manual_seed(0)
            model = Heads()
            ddp = DistributedDataParallel(model, comm, find_unused_parameters=True, **FAST)
            try:
                wrapped = torch.compile(ddp) if compiled else ddp
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in range(STEPS):
                    opt.zero_grad()
                    x, y = _batch(comm.rank, step)
                    out = wrapped(x)
                    loss = F.cross_entropy(out["logits"], y)
                    if step == 0:  # (the aux head used once, by every rank)
                        loss = loss + out["aux"][0].pow(2).mean()
                    loss.backward()
                    opt.step()
                results.append(_state(model))
            except Exception as exc:
                if compiled and ("BackendCompilerFailed" in str(exc) or "InvalidCxxCompiler" in str(exc)):
                    return f"skip: torch.compile is not usable here: {str(exc)[:200]}"
                raise
            finally:
                ddp.close()
    finally:
        comm.close()
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


@pytest.mark.multiprocess
def test_the_wrapper_in_torch_compile_with_find_unused_parameters():
    """torch.compile(wrapper) with find_unused_parameters=True and a loss on part of the outputs:
    dynamo traced the weak reference that the sink's hook holds to the wrapper, so the hook got
    the wrapper itself and the sink's backward called its forward with no input ("Heads.forward()
    missing 1 required positional argument: 'x'"). Now the same training as without compile (the
    compiled forward may round otherwise: float64 tolerance)."""
    try:
        (result,) = run_ranks(_plain_and_compiled_with_find_unused, 1, timeout=50)
    except TimeoutError:
        pytest.skip("torch.compile took over 50 s here (the rank was killed)")
    if isinstance(result, BaseException):
        raise AssertionError(f"{result}\n{getattr(result, 'tb', '')}")
    if isinstance(result, str):
        pytest.skip(result)
    plain, compiled = torch.load(io.BytesIO(result), weights_only=False)
    _same(compiled, plain, "state", F64)
