"""DistributedDataParallel.join(): ranks with different numbers of batches.

Against torch's own DDP under its ``join()`` (gloo), in the same processes on the same data:
the parameters and buffers after the block, on every rank, with the planning (the first plan,
the trial of plans, re-plans) or fixed buckets running while some ranks have joined; the same
through torch's generic ``Join([model])``, and beside ``ZeroRedundancyOptimizer`` in
``Join([model, optimizer])``. Then ``throw_on_early_termination``, a rank that dies inside the
block, one rank and ``enable=False``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join as TorchJoin

from mp_harness import run_ranks
from thread_harness import raise_first, run_comms
from ringtrain.ddp import DistributedDataParallel
from ringtrain.ddp import trial as plan_trial
from ringtrain.errors import CommError

pytestmark = pytest.mark.timeout(120)
# Small alpha and beta: plans of several groups, so the trial has candidates to time. One
# iteration per trial phase: the probes and the candidates' rounds all fall inside the uneven
# part of the runs below.
FAST = dict(alpha=1e-7, beta=1e-10, warmup_iterations=0, profile_iterations=1, verify_iterations=1,
            replan_interval=4, bucket_cap_mb=0.0001)
#: The longest trial, in iterations: the first plan (iteration 0), then plan_trial.longest with
#: the probes fine and coarse (Model's 8 parameters: no finest; near-equal candidates, as this
#: tiny model's are, take every round). (20 iterations, written for 5 candidates, could end a
#: trial of 6 or 7 in its third round.)
LONGEST_TRIAL = 1 + plan_trial.longest(1, probes=2)
#: Batches per rank: the first rank to join does so during the trial (after 2 iterations; the
#: longest runs past the longest trial's end and two re-plans).
LONGEST = LONGEST_TRIAL + 2 * FAST["replan_interval"]
COUNTS = {2: [LONGEST, 3], 3: [2, LONGEST, 6]}


class Model(nn.Module):
    """BatchNorm buffers, and a head ``c`` that a forward may leave out (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7, dtype=torch.float64)
        self.bn = nn.BatchNorm1d(7, dtype=torch.float64)
        self.b = nn.Linear(7, 3, dtype=torch.float64)
        self.c = nn.Linear(7, 3, dtype=torch.float64)

    def forward(self, x, use_c=True):
        h = torch.tanh(self.bn(self.a(x)))
        return self.b(h) + self.c(h) if use_c else self.b(h)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# name: (divide_by_initial_world_size, schedule, find_unused_parameters)
CONFIGS = {f"{'initial' if div else 'active'}, {schedule}{', find_unused' if unused else ''}": (div, schedule, unused)
           for div in (True, False) for schedule in ("optimal", "fixed") for unused in (False, True)}
#: Configs also run through torch's generic Join([model]) (kind "ours, torch Join").
THROUGH_TORCH_JOIN = ("initial, optimal", "active, fixed, find_unused")


@contextlib.contextmanager
def _gloo_and_ringtrain(rank: int, world_size: int, port: int, timeout: float):
    """A rank's torch.distributed default group (gloo) and ringtrain communicator, at one port
    (one store for both: a second free port could be taken before its use); the communicator
    is closed first, before the store it reaches (rank 0's is the default group's)."""
    import torch.distributed as dist

    import ringtrain

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, timeout=timeout)
    try:
        yield comm
    finally:
        comm.close()
        dist.destroy_process_group()


def _saved(out) -> bytes:
    """``out`` torch.save'd (what a rank returns to _run_saved)."""
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _train(ddp, model, rank, count, find_unused):
    """``count`` steps inside ``ddp.join`` (already entered). With find_unused_parameters the head
    ``c`` is left out on alternate steps, differently per rank, and the optimizer is plain SGD:
    torch's joined rank allreduces its last used-parameter map (not zeros), so a parameter no
    active rank used may get a zero gradient there and None here, which plain SGD treats alike
    (momentum would not)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0 if find_unused else 0.9)
    for step in range(count):
        opt.zero_grad()
        x, y = _batch(rank, step)
        F.cross_entropy(ddp(x, use_c=not find_unused or (step + rank) % 2 == 0), y).backward()
        opt.step()


def _both_joins(rank, world_size, port, names):
    """Each config of ``names`` under torch's DDP and join(), then under this one's; torch.save'd
    results: per config and kind the state after the block, and for ours what the planning did."""
    with _gloo_and_ringtrain(rank, world_size, port, timeout=20.0) as comm:
        count = COUNTS[world_size][rank]
        out = {}
        for name in names:
            div, schedule, unused = CONFIGS[name]
            for kind in ("torch", "ours") + (("ours, torch Join",) if name in THROUGH_TORCH_JOIN else ()):
                torch.manual_seed(0)
                model = Model()
                if kind == "torch":
                    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
                else:
                    ddp = DistributedDataParallel(model, comm, schedule=schedule, find_unused_parameters=unused, **FAST)
                block = TorchJoin([ddp], divide_by_initial_world_size=div) if kind == "ours, torch Join" else \
                    ddp.join(divide_by_initial_world_size=div)
                with block:
                    _train(ddp, model, rank, count, unused)
                    settled_at_join = getattr(ddp, "settled", None)
                out[name, kind] = _state(model)
                if kind != "torch":
                    out[name, kind, "planning"] = (settled_at_join, ddp.settled, ddp.iteration, ddp.kept,
                                                   ddp.plan.groups, ddp.trial)
                    assert ddp._join is None, kind  # (the block is over: the next forward announces nothing)
                    ddp.close()
    return _saved(out)


def _run_saved(fn, world_size, *args):
    """``run_ranks`` of a function that returns its results torch.save'd: each rank's, loaded."""
    results = run_ranks(fn, world_size, *args, timeout=110)
    for r in results:
        if isinstance(r, BaseException):
            raise AssertionError(f"{r}\n{getattr(r, 'tb', '')}")
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


def _run_both(world_size, names):
    return _run_saved(_both_joins, world_size, names)


def _same(got, want, what, tol=None):
    assert got.keys() == want.keys(), what
    for k in want:
        if tol is None or not want[k].is_floating_point():
            assert torch.equal(got[k], want[k]), f"{what} {k}: {got[k]} != {want[k]}"
        else:
            torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m: f"{what} {k}: {m}")


def _same_on_every_rank(results, key, what):
    """Every rank's ``results[rank][key]`` bitwise equal to rank 0's: the ranks hold one model."""
    for rank, res in enumerate(results):
        _same(res[key], results[0][key], f"{what}: rank {rank} against rank 0")


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_inputs_as_torch_ddp_join(world_size):
    names = list(CONFIGS)
    results = _run_both(world_size, names)
    counts = COUNTS[world_size]
    first, longest = counts.index(min(counts)), max(counts)
    # Bitwise at 2 ranks: the mean of two gradients (or one gradient and zeros) is one rounding
    # whatever the order. At 3 ranks torch divides each gradient by the divisor before its sum
    # and sums in gloo's order; here the ring's sum is divided: ~1 ulp of float64, compounded
    # over 20 steps.
    tol = None if world_size == 2 else dict(rtol=1e-10, atol=1e-12)
    for name in names:
        ours = ("ours", "ours, torch Join") if name in THROUGH_TORCH_JOIN else ("ours",)
        for kind in ("torch", *ours):
            _same_on_every_rank(results, (name, kind), f"{name}, {kind}")
        for kind in ours:
            _same(results[0][name, kind], results[0][name, "torch"], f"{name}, {kind}: against torch", tol)
            planning = [res[name, kind, "planning"] for res in results]
            for settled_at_join, settled, iteration, kept, groups, trial in planning:
                # Every rank took part in every iteration and ends with the same plan.
                assert settled and iteration == longest, (name, kind, planning)
                assert (kept, groups, trial) == planning[0][3:], (name, kind, planning)
            if CONFIGS[name][1] == "optimal":  # the trial was under way when the first rank joined
                assert not planning[first][0] and len(planning[0][5]) > 1, (name, kind, planning)


# --- torch's generic Join: beside ZeroRedundancyOptimizer, throw_on_early_termination, refusals -------

def _torch_join_cases(rank, world_size, port):
    """Under torch's ``Join``: torch's DDP and this wrapper each with torch's
    ``ZeroRedundancyOptimizer`` (a joinable that shadows its own broadcasts) in
    ``Join([model, optimizer])``; then ``throw_on_early_termination``; then the wrapper second in
    the list; then a comm hook registered in ``Join(divide_by_initial_world_size=False)`` before
    the first forward. Returns what each case left or raised."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer

    with _gloo_and_ringtrain(rank, world_size, port, timeout=20.0) as comm:
        count = COUNTS[world_size][rank]
        out = {}

        def wrapped(kind):
            torch.manual_seed(0)
            model = Model()
            ddp = (nn.parallel.DistributedDataParallel(model) if kind == "torch"
                   else DistributedDataParallel(model, comm, **FAST))
            zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
            return model, ddp, zero

        def steps(ddp, zero, n):
            for step in range(n):
                zero.zero_grad()
                x, y = _batch(rank, step)
                F.cross_entropy(ddp(x), y).backward()
                zero.step()

        for kind in ("torch", "ours"):
            model, ddp, zero = wrapped(kind)
            with TorchJoin([ddp, zero]):
                steps(ddp, zero, count)
            out["zero", kind] = _state(model)
            if kind == "ours":
                ddp.close()
        model, ddp, zero = wrapped("ours")
        try:
            with TorchJoin([ddp, zero], throw_on_early_termination=True):
                steps(ddp, zero, count)
            out["throw"] = "no error"
        except RuntimeError as exc:
            out["throw"] = str(exc)
        ddp.close()
        model, ddp, zero = wrapped("ours")
        try:
            with TorchJoin([zero, ddp]):
                steps(ddp, zero, count)
            out["second"] = "no error"
        except ValueError as exc:
            out["second"] = str(exc)
        ddp.close()
        model, ddp, zero = wrapped("ours")
        try:  # (before its first forward: the hook would divide by the world size, not the ranks training)
            with TorchJoin([ddp, zero], divide_by_initial_world_size=False):
                ddp.register_comm_hook(ddp.process_group, default_hooks.allreduce_hook)
            out["hook"] = "no error"
        except ValueError as exc:
            out["hook"] = str(exc)
        ddp.close()
    return _saved(out)


@pytest.mark.multiprocess
def test_torch_join_beside_zero_redundancy_optimizer_throw_and_the_wrapper_second_as_torch_ddp():
    results = _run_saved(_torch_join_cases, 3)
    for kind in ("torch", "ours"):
        _same_on_every_rank(results, ("zero", kind), f"ZeRO, {kind}")
    # 3 ranks: torch divides each gradient before gloo sums them, the ring sums then divides.
    _same(results[0]["zero", "ours"], results[0]["zero", "torch"], "ZeRO: against torch",
          dict(rtol=1e-10, atol=1e-12))
    first = COUNTS[3].index(min(COUNTS[3]))
    for rank, res in enumerate(results):  # torch's own errors: the joined rank's, the others' at a forward
        assert res["throw"].startswith(f"Rank {first} exhausted all inputs" if rank == first else
                                       "Detected at least one rank that exhausted inputs"), (rank, res["throw"])
        assert "put the ringtrain.DistributedDataParallel first in Join" in res["second"], (rank, res["second"])
        assert "a comm hook and join(divide_by_initial_world_size=False) do not go together" in res["hook"], \
            (rank, res["hook"])


class _Raised(Exception):
    pass


def _after_an_exception_a_block_with_a_rank_out_at_once(rank, world_size, port):
    """Under torch's DDP and this wrapper: a Join block that every rank leaves by an exception
    between a forward and its backward (in its second iteration), then a new block in which rank
    1 has no batch at all. Returns each kind's state after the second block, torch.save'd."""
    with _gloo_and_ringtrain(rank, world_size, port, timeout=5.0) as comm:
        out = {}
        for kind in ("torch", "ours"):
            torch.manual_seed(0)
            model = Model()
            ddp = (nn.parallel.DistributedDataParallel(model) if kind == "torch"
                   else DistributedDataParallel(model, comm, **FAST))
            with pytest.raises(_Raised):
                with TorchJoin([ddp]):
                    _train(ddp, model, rank, 1, False)  # (torch's DDP rebuilds its buckets after one)
                    ddp(_batch(rank, 1)[0])
                    raise _Raised  # (before the backward of that synchronizing forward)
            with TorchJoin([ddp]):
                _train(ddp, model, rank, (3, 0)[rank], False)
            out[kind] = _state(model)
            if kind == "ours":
                ddp.close()
    return _saved(out)


@pytest.mark.multiprocess
def test_torch_join_after_a_block_left_between_a_forward_and_its_backward_as_torch_ddp():
    # The first forward of the second block announces its backward although the wrapper's last
    # forward (in the block the exception left) armed one that never came: before, rank 0 ran that
    # backward unannounced while rank 1, out of batches, waited in torch's Join (a CommTimeout).
    results = _run_saved(_after_an_exception_a_block_with_a_rank_out_at_once, 2)
    for kind in ("torch", "ours"):
        _same_on_every_rank(results, kind, kind)
    _same(results[0]["ours"], results[0]["torch"], "against torch")  # (bitwise: 2 ranks)


def _siamese_with_buffers_under_both_joins(rank, world_size, port):
    """``_siamese_step`` (a no_sync() micro-batch, then one loss over two forwards) on a model
    with buffers, in ``model.join()`` and in torch's ``Join([model])``; each state, torch.save'd."""
    with _gloo_and_ringtrain(rank, world_size, port, timeout=5.0) as comm:
        out = {}
        for kind in ("join()", "torch Join"):
            torch.manual_seed(0)
            model = Model()
            ddp = DistributedDataParallel(model, comm, **FAST)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            with ddp.join() if kind == "join()" else TorchJoin([ddp]):
                for step in range((4, 2)[rank]):
                    opt.zero_grad()
                    _siamese_step(ddp, rank, step)
                    opt.step()
            out[kind] = _state(model)
            ddp.close()
    return _saved(out)


@pytest.mark.multiprocess
def test_torch_join_takes_two_forwards_into_one_backward_with_buffers_as_join():
    # The second forward broadcasts the buffers again: announced at it, with the backward at its
    # start. Before, the forward announced the backward, so a joined rank ran the buckets' shadows
    # against that broadcast's announcement (a CommTimeout).
    results = _run_saved(_siamese_with_buffers_under_both_joins, 2)
    _same_on_every_rank(results, "torch Join", "torch Join")
    _same(results[0]["torch Join"], results[0]["join()"], "torch's Join against join()")  # (the same sums)


def test_torch_join_needs_torch_distributed_default_group():
    def body(comm):
        ddp = DistributedDataParallel(Model(), comm, **FAST)
        with pytest.raises(RuntimeError, match="default group: call torch.distributed.init_process_group first"):
            TorchJoin([ddp])
        x, y = _batch(comm.rank, 0)
        F.cross_entropy(ddp(x), y).backward()  # (the refused Join is not in force: before, this raised as well)
        ddp.close()

    raise_first(run_comms(2, body))


# --- what torch's join does not take: two forwards into one loss, no_sync(), on threads -------------

class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7, dtype=torch.float64)
        self.b = nn.Linear(7, 3, dtype=torch.float64)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _siamese_step(model, rank, step):
    """One step's gradients: a no_sync() micro-batch (``model`` is the wrapper or the module
    alone), then one loss over two forwards."""
    ce = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
    with model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext():
        ce(*_batch(rank, step)).backward()
    (ce(*_batch(rank, step + 100)) + ce(*_batch(rank, step + 200))).backward()


@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
def test_two_forwards_per_backward_and_no_sync_inside_join(divide_by_initial_world_size):
    """The announcements name groups of collectives, not forwards: a loss over two forwards is
    one backward to shadow, and no_sync() passes send nothing to shadow. Against a simulation:
    one model, each iteration's gradients summed over the ranks that still have batches and
    divided by the world size or their number."""
    torch.manual_seed(0)
    base = TwoLayers()
    counts = [2, 5, 3]

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for step in range(counts[comm.rank]):
                opt.zero_grad()
                _siamese_step(ddp, comm.rank, step)
                opt.step()
        ddp.close()
        return _state(model)

    results = raise_first(run_comms(3, body))
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(max(counts)):
        active = [r for r in range(3) if counts[r] > step]
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for rank in active:
            model.zero_grad()
            _siamese_step(model, rank, step)
            for n, p in model.named_parameters():
                total[n] += p.grad
        for n, p in model.named_parameters():
            p.grad = total[n] / (3 if divide_by_initial_world_size else len(active))
        opt.step()
    for rank, state in enumerate(results):
        _same(state, results[0], f"rank {rank} against rank 0")
    # Not bitwise: the ring sums the ranks' gradients in another order than the simulation.
    _same(results[0], _state(model), "against the simulation", dict(rtol=1e-10, atol=1e-12))


# --- throw_on_early_termination, on threads ----------------------------------------------------------

class NoBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 3, dtype=torch.float64)

    def forward(self, x, use_c=True):
        return self.a(x)


@pytest.mark.parametrize("kind", [Model, NoBuffers])
def test_throw_on_early_termination_raises_on_every_rank(kind):
    """The first rank to run out raises as it leaves the block; the others at their next forward
    (with buffers: where they would broadcast them; without: where they arm a backward). The
    wrapper goes on afterwards."""
    torch.manual_seed(0)
    base = kind()
    counts = [2, 5, 5]

    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = None
        with pytest.raises(RuntimeError) as info:
            with ddp.join(throw_on_early_termination=True):
                for step in range(counts[comm.rank]):
                    opt.zero_grad()
                    x, y = _batch(comm.rank, step)
                    F.cross_entropy(ddp(x), y).backward()
                    opt.step()
                step = "left"
        x, y = _batch(comm.rank, 10)
        F.cross_entropy(ddp(x), y).backward()  # all ranks again: an ordinary iteration
        ddp.close()
        return step, str(info.value)

    results = raise_first(run_comms(3, body))
    assert [step for step, _ in results] == ["left", 2, 2]
    for _, message in results:
        assert "throw_on_early_termination=True): rank(s) [0] ran out of inputs while rank(s) [1, 2]" in message


# --- a rank that dies inside the block, in real processes --------------------------------------------

def _dies_inside(rank, world_size, port, who):
    """Rank 0 runs out after 2 batches; ``who`` = "active": rank 1 dies at its 5th batch;
    "joined": rank 0 dies while it shadows. The others report what they raised and when."""
    import ringtrain

    torch.set_num_threads(1)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, timeout=5.0)
    torch.manual_seed(0)
    model = Model()
    ddp = DistributedDataParallel(model, comm, **FAST)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t0 = time.monotonic()
    try:
        with ddp.join():
            for step in range(2 if rank == 0 else 200):
                if rank == 1 and step == 5 and who == "active":
                    os._exit(1)
                opt.zero_grad()
                x, y = _batch(rank, step)
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                time.sleep(0.02)
            if rank == 0 and who == "joined":
                threading.Timer(0.5, os._exit, (1,)).start()
                t0 = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return type(exc).__name__, isinstance(exc, CommError), time.monotonic() - t0, str(exc)
    return "no error", False, time.monotonic() - t0, ""


@pytest.mark.multiprocess
@pytest.mark.parametrize("who", ["active", "joined"])
def test_a_rank_that_dies_inside_join_is_a_comm_error_on_the_others(who):
    dead = 1 if who == "active" else 0
    results = run_ranks(_dies_inside, 3, who, timeout=60, allow_missing=(dead,))
    for rank, result in enumerate(results):
        if rank == dead:
            continue
        assert not isinstance(result, BaseException), f"{result}\n{getattr(result, 'tb', '')}"
        name, is_comm_error, seconds, message = result
        assert is_comm_error, (rank, result)
        assert seconds < 5.0 + 10.0 + 5.0, (rank, result)  # the communicator's timeout and the wrapper's margin


# --- one rank, enable=False ------------------------------------------------------------------------

def _plain(base, world_size, join, counts=None, **join_options):
    """Each rank's state after training ``base`` through the wrapper, inside ``join`` or not."""
    def body(comm):
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, comm, **FAST)
        inside = []
        with ddp.join(**join_options) if join else contextlib.nullcontext():
            inside.append(ddp._join)
            _train(ddp, model, comm.rank, 6 if counts is None else counts[comm.rank], False)
        ddp.close()
        return _state(model), inside[0]

    return raise_first(run_comms(world_size, body))


@pytest.mark.parametrize("world_size, options", [(1, {}), (1, {"throw_on_early_termination": True}),
                                                 (2, {"enable": False})])
def test_one_rank_or_disabled_is_training_without_join(world_size, options):
    torch.manual_seed(0)
    base = Model()
    plain = _plain(base, world_size, False)
    joined = _plain(base, world_size, True, **options)
    for (a, _), (b, inside) in zip(plain, joined):
        assert inside is None  # nothing announced, nothing shadowed
        _same(b, a, "state")


def test_join_refuses_what_is_not_a_bool_and_a_second_block():
    def body(comm):
        ddp = DistributedDataParallel(Model(), comm, **FAST)
        with pytest.raises(ValueError, match="divide_by_initial_world_size=1"):
            with ddp.join(divide_by_initial_world_size=1):
                pass
        with ddp.join():
            with pytest.raises(RuntimeError, match="already inside join"):
                with ddp.join():
                    pass
        ddp.close()

    raise_first(run_comms(2, body))


def test_ranks_agree_on_the_first_forward_after_the_block_whatever_their_last_forward_inside_was():
    # Rank 1 ends the block with an evaluation forward (no buffer broadcast next), rank 0 with a
    # training step long before: the first forward after the block broadcast on one rank and
    # reduced on the other (MismatchError, the communicator broken).
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    counts = [2, 4]

    def body(comm):
        m = copy.deepcopy(base)
        ddp = DistributedDataParallel(m, comm, alpha=1e-7, beta=1e-10, verify_iterations=0, warmup_iterations=0,
                                      profile_iterations=1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(comm.rank)
        with ddp.join():
            for _ in range(counts[comm.rank]):
                opt.zero_grad()
                ddp(torch.randn(4, 8, generator=g)).sum().backward()
                opt.step()
            if comm.rank == 1:
                with torch.no_grad():
                    ddp(torch.randn(4, 8, generator=g))
        for _ in range(2):  # the next epoch, outside the block
            opt.zero_grad()
            ddp(torch.randn(4, 8, generator=g)).sum().backward()
            opt.step()
        ddp.close()
        return [p.detach().clone() for p in m.parameters()]  # (buffers: each rank's last forward's)

    first, second = raise_first(run_comms(2, body, timeout=5.0, thread_timeout=60.0))
    for a, b in zip(first, second):
        assert torch.equal(a, b)
