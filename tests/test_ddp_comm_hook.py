"""DistributedDataParallel.register_comm_hook: torch DDP's communication hooks on ringtrain's wrapper.

Against torch's own DDP with the same hook over gloo, in the same processes on the same data:
the stock hooks (allreduce, fp16, bf16) under several schedules, PowerSGD (and torch's DDP over
ringtrain's process group with it), and join(). Then, over threads: what a hook is called with
and when, the timeline, one rank, and the refusals and failures (each names the hook; none
hangs). The harnesses kill every rank or thread at their deadline.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from mp_harness import run_ranks
from test_ddp_support import make_model, rank_batch, train
from thread_harness import raise_first, run_comms
from ringtrain.ddp import DistributedDataParallel
from ringtrain.ddp import trial as plan_trial
from ringtrain.errors import CommError, CommTimeout

pytestmark = pytest.mark.timeout(120)
# Given alpha and beta: no calibration sweep. The first plan after one iteration, a trial of one
# iteration per phase (schedule="optimal"), and small fixed buckets: several per backward.
FAST = dict(alpha=1e-7, beta=1e-10, warmup_iterations=0, profile_iterations=1, verify_iterations=1,
            bucket_cap_mb=0.004)
STEPS = 6
#: Steps for the longest trial under FAST on the MLP (12 parameters: probes fine and coarse): the
#: first plan (step 0), then plan_trial.longest (14 steps, written for fewer candidates, could end
#: a trial of near-equal ones unsettled).
LONGEST_TRIAL = 1 + plan_trial.longest(1, probes=2)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread in this process while a test runs: the thread tests compare two
    trainings bitwise, and with a thread pool shared by two rank threads a matmul's reduction can
    be split differently from one run to the next (last-bit differences seen under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _mlp():
    return make_model("mlp")  # (seeded and drawn under a lock: the thread tests' ranks share the generator)


def bf16_compress(state, bucket):
    """torch's bf16_compress_hook itself, under another name: torch's DDP refuses the hook by its
    name off CUDA with NCCL (ringtrain's wrapper does not)."""
    return default_hooks.bf16_compress_hook(state, bucket)


def _batches(world_size, rank):
    return lambda step: rank_batch("mlp", step, world_size, rank)


@contextlib.contextmanager
def _session(rank, world_size, port):
    """ringtrain's communicator and torch's default group (gloo), in one rank's process, both
    ended when the block does."""
    import ringtrain

    torch.set_num_threads(1)
    # (one store for both, at one port: a second free port could be taken before its use)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport="tcp", timeout=20.0)
    try:
        yield comm
    finally:
        comm.close()  # (before the store it reaches: rank 0's is the default group's)
        dist.destroy_process_group()


def _torch_ddp(hook, state=None, group=None, module=None):
    ddp = torch.nn.parallel.DistributedDataParallel(module or _mlp(), process_group=group)
    ddp.register_comm_hook(state, hook)
    return ddp


def _saved(out) -> bytes:
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _loaded(results) -> list:
    for r in results:
        if isinstance(r, BaseException):
            raise AssertionError(f"{r}\n{getattr(r, 'tb', '')}")
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


def _bitwise(ours, theirs, *label) -> None:
    """Two lists of parameters equal bit for bit (the label and the largest gap if not)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), (*label, i, (a - b).abs().max())


def _same_on_every_rank(results) -> None:
    for key in results[0]:
        for rank, res in enumerate(results):
            for i, (a, b) in enumerate(zip(res[key], results[0][key])):
                assert torch.equal(a, b), f"{key}: parameter {i} differs between rank 0 and rank {rank}"


# --- the stock hooks against torch's DDP -------------------------------------------------------

HOOKS = {"allreduce_hook": default_hooks.allreduce_hook, "fp16_compress_hook": default_hooks.fp16_compress_hook,
         "bf16_compress_hook": default_hooks.bf16_compress_hook}
THEIRS = {"allreduce_hook": default_hooks.allreduce_hook, "fp16_compress_hook": default_hooks.fp16_compress_hook,
          "bf16_compress_hook": bf16_compress}
SCHEDULES = ("fixed", "wfbp", "optimal")


def _stock_hooks(rank, world_size, port):
    batches = _batches(world_size, rank)
    out = {}
    with _session(rank, world_size, port) as comm:
        for name in HOOKS:
            out[name, "torch"] = train(_torch_ddp(THEIRS[name]), batches, STEPS)
            for schedule in SCHEDULES:
                ddp = DistributedDataParallel(_mlp(), comm, schedule=schedule, **FAST)
                ddp.register_comm_hook(ddp.process_group, HOOKS[name])
                out[name, schedule] = train(ddp, batches, STEPS)
                assert len(ddp.buckets) > 1 or schedule == "optimal", (schedule, ddp.buckets)
                ddp.close()
    return _saved(out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_stock_hooks_give_torch_ddps_parameters(world_size):
    results = _loaded(run_ranks(_stock_hooks, world_size, timeout=110.0))
    _same_on_every_rank(results)
    for name in HOOKS:
        theirs = results[0][name, "torch"]
        for schedule in SCHEDULES:
            ours = results[0][name, schedule]
            for i, (a, b) in enumerate(zip(ours, theirs)):
                if world_size == 2:
                    # The hook's steps are torch's, and the sum of two values (in float32, or one
                    # half-precision rounding of it) is the same in any order: the same bits.
                    assert torch.equal(a, b), (name, schedule, i, (a - b).abs().max())
                else:
                    # Three values: gloo and ringtrain add them in other orders ((a+b)+c against
                    # a+(b+c)): float32 sums differ in their last bit, half-precision ones by one
                    # rounding of a gradient (2^-11 relative for fp16, 2^-8 for bf16), which moves a
                    # parameter by up to lr times that each step.
                    tol = {"allreduce_hook": 1e-6, "fp16_compress_hook": 2e-3, "bf16_compress_hook": 2e-2}[name]
                    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{name} {schedule} parameter {i}")
    for name in ("fp16_compress_hook", "bf16_compress_hook"):  # (the hook did run: it rounded)
        ours, uncompressed = results[0][name, "fixed"], results[0]["allreduce_hook", "fixed"]
        assert any(not torch.equal(a, b) for a, b in zip(ours, uncompressed)), name


def _complex_hooks(rank, world_size, port):
    from test_ddp_patterns import Spectral  # (a complex128 weight between float64 layers)

    def batches(step):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)

    out = {}
    with _session(rank, world_size, port) as comm:
        for name in ("allreduce_hook", "fp16_compress_hook"):
            torch.manual_seed(0)
            out[name, "torch"] = train(_torch_ddp(HOOKS[name], None, None, Spectral()), batches, STEPS)
            for schedule in ("fixed", "optimal"):
                torch.manual_seed(0)
                ddp = DistributedDataParallel(Spectral(), comm, schedule=schedule, **FAST)
                ddp.register_comm_hook(ddp.process_group, HOOKS[name])
                try:
                    out[name, schedule] = train(ddp, batches, STEPS)
                finally:
                    ddp.close()
    return _saved(out)


@pytest.mark.multiprocess
def test_a_complex_bucket_reaches_the_hook_as_its_real_view_as_torch_ddp():
    """torch's DDP gives a hook a complex bucket as its real view (float64 here). This wrapper gave
    the complex128 buffer itself: allreduce_hook's value (the group reduces the real view) was
    refused as "a torch.float64 tensor of shape (9, 2)", and fp16_compress_hook's cast to float16
    dropped the imaginary parts of the gradients, silently."""
    results = _loaded(run_ranks(_complex_hooks, 2, timeout=110.0))
    _same_on_every_rank(results)
    for name in ("allreduce_hook", "fp16_compress_hook"):
        for schedule in ("fixed", "optimal"):
            _bitwise(results[0][name, schedule], results[0][name, "torch"], name, schedule)


# --- PowerSGD ------------------------------------------------------------------------------------

def _power_sgd_state(group):
    return PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2)


def _power_sgd(rank, world_size, port):
    import ringtrain

    batches = _batches(world_size, rank)
    out = {}
    with _session(rank, world_size, port) as comm:
        # schedule="fixed" at torch's bucket size, planned after one iteration: the buckets of
        # torch's DDP, which rebuilds its buckets after the first iteration in the order the
        # gradients came (this model's fit in one bucket). PowerSGD compresses each tensor of a
        # bucket with random vectors drawn for the bucket: the same buckets, the same draws.
        ddp = DistributedDataParallel(_mlp(), comm, schedule="fixed", **{**FAST, "bucket_cap_mb": 25})
        ddp.register_comm_hook(_power_sgd_state(ddp.process_group), powerSGD_hook)
        out["ours"] = train(ddp, batches, 8)
        ddp.close()
        # The first plan after PowerSGD began (the default warm-up and profile), laying the buckets
        # out anew alike: its error feedback stays (it was dropped once: not torch's parameters).
        ddp = DistributedDataParallel(_mlp(), comm, schedule="fixed", alpha=1e-7, beta=1e-10, bucket_cap_mb=25)
        ddp.register_comm_hook(_power_sgd_state(ddp.process_group), powerSGD_hook)
        out["ours, planned after PowerSGD began"] = train(ddp, batches, 8)
        assert ddp.options.warmup_iterations + ddp.options.profile_iterations > 2, ddp.options
        ddp.close()
        ddp = DistributedDataParallel(_mlp(), comm, schedule="fixed", **{**FAST, "bucket_cap_mb": 25})
        ddp.register_comm_hook(ddp.process_group, default_hooks.allreduce_hook)
        out["uncompressed"] = train(ddp, batches, 8)
        ddp.close()
        out["torch"] = train(_torch_ddp(powerSGD_hook, _power_sgd_state(None)), batches, 8)
        # Several buckets (torch's DDP with PowerSGD over gloo aborts there, its ranks' collectives
        # coming in different orders: docs/comm.md): the hook runs one bucket at a time.
        ddp = DistributedDataParallel(_mlp(), comm, schedule="fixed", **FAST)
        ddp.register_comm_hook(_power_sgd_state(ddp.process_group), powerSGD_hook)
        out["ours, several buckets"] = train(ddp, batches, 8)
        assert len(ddp.buckets) > 1, ddp.buckets
        ddp.close()
        # The same state on a new wrapper (a module wrapped again, or a state loaded): its buckets
        # were the old layout's, forgotten at the first bucket (kept, bucket 0's error feedback
        # is of another size: every rank's first backward failed). Calls made on the group
        # between a backward and the next forward end before that forward's collectives.
        state = ddp._comm_hook.state
        again = DistributedDataParallel(_mlp(), comm, schedule="fixed", **{**FAST, "bucket_cap_mb": 25})
        state.process_group = again.process_group
        again.register_comm_hook(state, powerSGD_hook)
        extra = torch.ones(1 << 16)
        train(again, batches, 2)
        work = dist.all_reduce(extra, group=again.process_group, async_op=True)
        out["again"] = train(again, batches, 3)
        assert work.wait() and torch.equal(extra, torch.full((1 << 16,), 2.0))
        again.close()
        # schedule="optimal" with PowerSGD from its earliest iteration (2): the buckets are laid out anew at
        # the first plan and for the trial's candidates, and the state by bucket index is emptied
        # each time (kept, one bucket's error feedback would be added to another's gradients).
        ddp = DistributedDataParallel(_mlp(), comm, schedule="optimal", **FAST)
        ddp.register_comm_hook(PowerSGDState(process_group=ddp.process_group, matrix_approximation_rank=1,
                                             start_powerSGD_iter=2), powerSGD_hook)
        out["optimal, from the start"] = train(ddp, batches, LONGEST_TRIAL)
        assert ddp.settled and len(ddp.trial) > 1, ddp.trial
        ddp.close()
        # torch's DDP over ringtrain's group: PowerSGD's callbacks issue collectives from the
        # group's worker thread and wait for them there.
        pg = ringtrain.TorchProcessGroup(comm)
        out["torch over ringtrain"] = train(_torch_ddp(powerSGD_hook, _power_sgd_state(pg), pg), batches, 8)
        pg.close()
    return _saved(out)


@pytest.mark.multiprocess
def test_power_sgd_gives_torch_ddps_parameters():
    results = _loaded(run_ranks(_power_sgd, 2, timeout=110.0))
    _same_on_every_rank(results)
    ours = results[0]["ours"]
    for other in ("torch", "torch over ringtrain", "ours, planned after PowerSGD began"):
        _bitwise(ours, results[0][other], other)  # (2 ranks: sums in any order, the same bits)
    # ... and PowerSGD did compress (rank-1 approximations of the weights' gradients from step 2 on).
    assert any(not torch.equal(a, b) for a, b in zip(ours, results[0]["uncompressed"]))


def _power_sgd_moved(rank, world_size, port):
    """8 steps on one wrapper, and 4 + 4 with PowerSGD's state (a copy: tensors, iteration,
    generator) taken to a new wrapper of the same module, with and without ``comm_hook_layout``;
    one optimizer throughout. And its refusals: no hook; after the first backward."""
    one_bucket = dict(schedule="fixed", **{**FAST, "bucket_cap_mb": 25})

    def steps(ddp, opt, which):
        for step in which:
            x, y = rank_batch("mlp", step, world_size, rank)
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()

    out = {}
    with _session(rank, world_size, port) as comm:
        for how in ("at once", "moved with its layout", "moved without"):
            module = _mlp()
            opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
            ddp = DistributedDataParallel(module, comm, **one_bucket)
            state = _power_sgd_state(ddp.process_group)
            ddp.register_comm_hook(state, powerSGD_hook)
            steps(ddp, opt, range(4 if how != "at once" else 8))
            if how != "at once":
                layout = ddp.comm_hook_layout
                assert len(layout) == 1, layout  # (one bucket: 25 MB holds the MLP)
                ddp.close()
                ddp = DistributedDataParallel(module, comm, **one_bucket)
                fresh = _power_sgd_state(ddp.process_group)
                for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
                    setattr(fresh, name, {k: v.clone() for k, v in getattr(state, name).items()})
                fresh.iter = state.iter
                fresh.rng.set_state(state.rng.get_state())
                with pytest.raises(RuntimeError, match="no comm hook is registered"):
                    ddp.comm_hook_layout = layout
                ddp.register_comm_hook(fresh, powerSGD_hook)
                if how == "moved with its layout":
                    ddp.comm_hook_layout = layout
                steps(ddp, opt, range(4, 8))
                with pytest.raises(RuntimeError, match="before the first synchronizing backward"):
                    ddp.comm_hook_layout = layout
            out[how] = [p.detach().clone() for p in module.parameters()]
            ddp.close()
    return _saved(out)


@pytest.mark.multiprocess
def test_a_power_sgd_state_taken_to_a_new_wrapper_with_its_layout_goes_on_bitwise():
    """One bucket: with ``comm_hook_layout`` set, the new wrapper keeps the state (error feedback
    and warm-start matrices) from its first backward and ends bitwise where one wrapper does (2
    ranks: sums in any order, the same bits); without it, the state's buckets are forgotten."""
    results = _loaded(run_ranks(_power_sgd_moved, 2, timeout=110.0))
    _same_on_every_rank(results)
    out = results[0]
    _bitwise(out["moved with its layout"], out["at once"], "moved with its layout")
    assert any(not torch.equal(a, b) for a, b in zip(out["moved without"], out["at once"]))


# --- join() --------------------------------------------------------------------------------------

COUNTS = [7, 3]  # batches per rank: rank 1 joins after 3 iterations, during the first plan


def _join_with_hook(rank, world_size, port):
    out = {}

    def run(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        with ddp.join():
            for step in range(COUNTS[rank]):
                x, y = rank_batch("mlp", step, world_size, rank)
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()
        return [p.detach().clone() for p in ddp.parameters()]

    with _session(rank, world_size, port) as comm:
        out["torch"] = run(_torch_ddp(default_hooks.fp16_compress_hook))
        for schedule in ("fixed", "optimal"):
            ddp = DistributedDataParallel(_mlp(), comm, schedule=schedule, **FAST)
            ddp.register_comm_hook(ddp.process_group, default_hooks.fp16_compress_hook)
            out[schedule] = run(ddp)
            ddp.close()
    return _saved(out)


@pytest.mark.multiprocess
def test_join_runs_the_hook_on_zeros_as_torch_ddp():
    """The joined rank runs the hook on buckets of zeros, as torch's DDP does."""
    results = _loaded(run_ranks(_join_with_hook, 2, timeout=110.0))
    _same_on_every_rank(results)
    for schedule in ("fixed", "optimal"):
        _bitwise(results[0][schedule], results[0]["torch"], schedule)


# --- what a hook gets, and when (threads) --------------------------------------------------------

class Recorder:
    """A user's hook: doubles the bucket, sums it over the group, divides by twice the group's
    size (the mean, exactly: scaling by 2 and 4 is exact); records each call."""

    def __init__(self, group):
        self.group = group
        self.calls: list[tuple] = []
        self.threads: set[str] = set()

    def __call__(self, state, bucket):
        assert state is self
        self.calls.append((bucket.index(), bucket.is_last(), [id(p) for p in bucket.parameters()],
                           [g.shape for g in bucket.gradients()], bucket.buffer().numel()))
        self.threads.add(threading.current_thread().name)
        buf = bucket.buffer().mul_(2)
        size = self.group.size()
        fut = dist.all_reduce(buf, group=self.group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(2 * size))


@pytest.mark.parametrize("as_view", [False, True])
def test_a_users_hook_is_called_once_per_bucket_and_not_under_no_sync(as_view, tmp_path):
    def body(comm):
        # (no torch.manual_seed here: one rank's seeding, outside make_model's lock, could land in
        # the middle of the other rank drawing its model, and the two models it compares then differ)
        plain = DistributedDataParallel(_mlp(), comm, schedule="fixed", **FAST)
        want = train(plain, _batches(2, comm.rank), 4)
        plain.close()
        ddp = DistributedDataParallel(_mlp(), comm, schedule="fixed", gradient_as_bucket_view=as_view,
                                      timeline=tmp_path / "trace.json", timeline_iterations=2, **FAST)
        hook = Recorder(ddp.process_group)
        ddp.register_comm_hook(hook, hook)
        per_iteration = []
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)  # (train's settings)
        for step in range(4):
            x, y = rank_batch("mlp", step, 2, comm.rank)
            opt.zero_grad()
            if step == 2:  # accumulate a local gradient first: no hook call
                with ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
                assert len(hook.calls) == sum(per_iteration)
                opt.zero_grad()
            before, specs = len(hook.calls), ddp.buckets  # (the layout in force: a new plan comes after backward)
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            per_iteration.append(len(hook.calls) - before)
            assert per_iteration[-1] == len(specs)
            for (index, last, params, shapes, numel), spec in zip(hook.calls[before:], specs):
                assert index == spec.index and last == (index == len(specs) - 1) and numel == spec.numel
                assert params == [id(ddp._params[pid]) for pid in spec.pids]
                assert shapes == [ddp._params[pid].shape for pid in spec.pids]
        got = [p.detach().clone() for p in ddp.parameters()]
        path = ddp.timeline_path
        ddp.close()
        return want, got, per_iteration, hook.threads, path, [len(s.pids) for s in specs]

    for rank, (want, got, per_iteration, threads, path, sizes) in enumerate(raise_first(run_comms(2, body))):
        assert per_iteration[0] == 1 and all(n > 1 for n in per_iteration[1:]), per_iteration
        assert threads == {f"ringtrain-ddp-comm-{rank}"}  # the wrapper's communication thread
        for a, b in zip(want, got):
            assert torch.equal(a, b)  # the mean, as the wrapper's own allreduce gives it
        import json

        spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X" and e["cat"] == "allreduce"]
        names = {e["name"] for e in spans}
        assert names == {f"Recorder bucket {k}" for k in range(len(sizes))}, names


def test_unused_parameters_contribute_zeros_to_the_hook():
    """find_unused_parameters: the parameter the forward leaves out is in a bucket as zeros; its
    .grad stays None (no rank has one), as without a hook."""
    def body(comm):
        out = []
        for hooked in (False, True):
            module = make_model("unused")
            ddp = DistributedDataParallel(module, comm, schedule="fixed", find_unused_parameters=True, **FAST)
            if hooked:
                ddp.register_comm_hook(ddp.process_group, default_hooks.allreduce_hook)
            for step in range(3):
                x, y = rank_batch("unused", step, 2, comm.rank)
                ddp.zero_grad()
                F.mse_loss(ddp(x), y).backward()
            out.append([p.grad for p in module.parameters()])
            ddp.close()
        return out

    for plain, hooked in raise_first(run_comms(2, body)):
        assert [g is None for g in hooked] == [False, False, True, True]
        assert all(torch.equal(a, b) for a, b in zip(plain[:2], hooked[:2]))


def test_one_rank_calls_no_hook():
    """One rank communicates nothing, with or without a hook (as the wrapper without one)."""
    def body(comm):
        ddp = DistributedDataParallel(_mlp(), comm, schedule="fixed", **FAST)
        hook = Recorder(ddp.process_group)
        ddp.register_comm_hook(hook, hook)
        assert ddp.process_group.size() == 1
        got = train(ddp, _batches(1, 0), 3)
        ddp.close()
        return got, hook.calls

    got, calls = raise_first(run_comms(1, body))[0]
    assert calls == []
    want = train(_mlp(), _batches(1, 0), 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# --- refusals ------------------------------------------------------------------------------------

def _two_ranks(body, timeout: float = 10.0):
    return raise_first(run_comms(2, body, timeout=timeout))


def test_refusals_at_registration():
    assert not dist.is_initialized()  # (torch's default group: none in this process)

    def body(comm):
        ddp = DistributedDataParallel(_mlp(), comm, schedule="fixed", **FAST)
        pg = ddp.process_group
        with pytest.raises(TypeError, match="must be callable"):
            ddp.register_comm_hook(pg, "fp16_compress_hook")

        def annotated(state, b: int) -> torch.futures.Future[torch.Tensor]:
            return default_hooks.allreduce_hook(state, b)

        with pytest.raises(ValueError, match="annotated.*bucket annotation should be dist.GradBucket"):
            ddp.register_comm_hook(pg, annotated)
        with pytest.raises(ValueError, match=r"state=None means torch.distributed's default group.*model\.process_"):
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        with pytest.raises(ValueError, match=r"PowerSGDState\(process_group=None\).*model.process_group"):
            ddp.register_comm_hook(_power_sgd_state(None), powerSGD_hook)
        import ringtrain

        alone = ringtrain.TorchProcessGroup(ringtrain.Communicator(_local_transport(), timeout=5.0))
        with pytest.raises(ValueError, match="rank 0 of 1, but this wrapper is rank"):
            ddp.register_comm_hook(alone, default_hooks.allreduce_hook)
        alone.close()
        ddp.register_comm_hook(pg, default_hooks.allreduce_hook)
        with pytest.raises(RuntimeError, match="only be called once"):
            ddp.register_comm_hook(pg, default_hooks.fp16_compress_hook)
        with pytest.raises(ValueError, match="divide_by_initial_world_size=False"):
            with ddp.join(divide_by_initial_world_size=False):
                pass
        ddp.close()
        with pytest.raises(RuntimeError, match="closed"):
            dist.all_reduce(torch.ones(1), group=pg)

        squeezed = DistributedDataParallel(_mlp(), comm, schedule="fixed", compression="fp16", **FAST)
        with pytest.raises(ValueError, match="compression='fp16'.*fp16_compress_hook"):
            squeezed.register_comm_hook(squeezed.process_group, default_hooks.fp16_compress_hook)
        squeezed.close()

        late = DistributedDataParallel(_mlp(), comm, schedule="fixed", **FAST)
        train(late, _batches(2, comm.rank), 1)
        with pytest.raises(RuntimeError, match="before the first synchronizing backward"):
            late.register_comm_hook(late.process_group, default_hooks.allreduce_hook)
        late.close()
        return True

    assert _two_ranks(body) == [True, True]


def _local_transport():
    from ringtrain.transport.local import LocalHub

    return LocalHub(1).transport(0)


# --- failures: each a CommError naming the hook, from backward, on every rank --------------------

def _step(ddp, rank, step=0):
    x, y = rank_batch("mlp", step, 2, rank)
    F.mse_loss(ddp(x), y).backward()


def _failing(hook_for, steps: int = 3, timeout: float = 10.0, deadline: float | None = None, hold: float = 0.0):
    """Train with ``hook_for(ddp)`` on 2 ranks; each rank's (step, error) where backward raised,
    and the error of a forward after it. ``deadline``: the wrapper's own (else the communicator's
    timeout + 10 s), set after construction, whose collectives keep ``timeout``. ``hold``: how
    long a rank whose backward raised keeps its communicator open before closing it (a process
    that goes on to save a checkpoint, say)."""
    def body(comm):
        ddp = DistributedDataParallel(_mlp(), comm, schedule="fixed", **FAST)
        if deadline is not None:
            ddp._timeout = deadline
        ddp.register_comm_hook(ddp.process_group, hook_for(ddp, comm.rank))
        try:
            for step in range(steps):
                start = time.monotonic()
                try:
                    _step(ddp, comm.rank, step)
                except CommError as exc:
                    seconds = time.monotonic() - start
                    with pytest.raises(CommError, match="previous backward pass's communication failed") as later:
                        _step(ddp, comm.rank, step + 1)
                    time.sleep(hold)
                    return step, exc, seconds, later.value
            return None
        finally:
            ddp.close()
            comm.close()  # (as a process that ends: the peers learn of it at once)

    return _two_ranks(body, timeout)


def test_a_hook_that_raises_on_every_rank():
    def hook_for(ddp, rank):
        def broken(state, bucket):
            if bucket.index() == 1:
                raise ValueError("no luck")
            return default_hooks.allreduce_hook(state, bucket)
        return broken

    for step, error, _, later in _failing(hook_for):
        assert step == 1  # (the first iteration has one bucket)
        assert "comm hook test_a_hook_that_raises_on_every_rank.<locals>.hook_for.<locals>.broken on bucket 1 " \
               "failed: ValueError: no luck" in str(error)
        assert isinstance(error.__cause__, ValueError)
        assert "no luck" in str(later)


def test_a_hook_that_raises_on_one_rank_ends_the_others_backward_at_once():
    def hook_for(ddp, rank):
        def broken(state, bucket):
            if rank == 1 and bucket.index() == 0 and bucket.is_last() is False:
                raise ValueError("rank 1 only")
            return default_hooks.allreduce_hook(state, bucket)
        return broken

    # Rank 1 keeps its communicator open for 8 s after the failure: rank 0 learns of it from rank
    # 1's abort at once, not from the communicator closing, nor at its 30 s deadline.
    (step0, error0, seconds0, _), (step1, error1, _, _) = _failing(hook_for, timeout=30.0, hold=8.0)
    assert step1 == 1 and "failed: ValueError: rank 1 only" in str(error1)
    # Rank 0's allreduce for bucket 0 waited for rank 1, which then broke its communicator: the
    # failure reached rank 0's backward, naming its hook and rank 1's error, as a CommError of
    # its own (not torch's RuntimeErrors around it, one per then()).
    assert step0 == 1 and "comm hook" in str(error0) and "broken on bucket 0 failed: CommError" in str(error0)
    assert "rank 1 only" in str(error0) and "Got the following error" not in str(error0), error0
    assert seconds0 < 6.0


def test_a_collective_that_fails_under_a_hook_keeps_its_error_type():
    def hook_for(ddp, rank):
        def late(state, bucket):
            if rank == 1 and bucket.index() == 0 and bucket.is_last() is False:
                time.sleep(6.0)  # past rank 0's 3 s deadline for the allreduce inside its hook
            return default_hooks.allreduce_hook(state, bucket)
        return late

    (step0, error0, seconds0, _), _ = _failing(hook_for, timeout=3.0)
    # (torch's futures hand the communicator's CommTimeout on inside RuntimeErrors of their own)
    assert step0 == 1 and isinstance(error0, CommTimeout), repr(error0)
    assert "late on bucket 0" in str(error0) and "Got the following error" not in str(error0), error0
    assert seconds0 < 6.0


def test_a_future_with_the_wrong_shape_or_no_future():
    def hook_for(ddp, rank):
        def halves(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer()[: bucket.buffer().numel() // 2])
            return fut
        return halves

    for step, error, _, _ in _failing(hook_for):
        assert step == 0
        assert "comm hook" in str(error) and "halves on bucket 0 failed: ValueError: its future's value is a " \
               "torch.float32 tensor of shape" in str(error) and "bucket's buffer reduced" in str(error)

    def not_a_future(ddp, rank):
        return lambda state, bucket: bucket.buffer()

    for step, error, _, _ in _failing(not_a_future):
        assert step == 0 and "it returned Tensor, not a torch.futures.Future" in str(error)


def test_a_failed_future_reaches_backward():
    def hook_for(ddp, rank):
        def failing(state, bucket):
            return default_hooks.allreduce_hook(state, bucket).then(lambda f: 1 / 0)
        return failing

    for step, error, _, _ in _failing(hook_for):
        assert step == 0 and "failing on bucket 0 failed" in str(error) and "division by zero" in str(error)


def test_a_future_that_never_completes_is_a_timeout_naming_the_hook():
    def hook_for(ddp, rank):
        def never(state, bucket):
            return torch.futures.Future()
        return never

    # (the wrapper's deadline as a communicator's timeout of 0.5 s makes it, plus 10 s; not that
    # timeout itself: the construction's collectives would then fail if a loaded rank came 0.5 s late)
    for step, error, seconds, _ in _failing(hook_for, deadline=10.5):
        assert step == 0 and isinstance(error, CommTimeout) and "never" in str(error), error
        assert seconds < 20.0


# --- a state kept by bucket, when the buckets are laid out anew -------------------------------------

def test_error_feedback_moves_with_each_parameter_to_the_new_buckets():
    """PowerSGD's residuals are kept by bucket index; laid out anew (the first plan, the trial's
    candidates), each parameter's residual moves to its new slot (they were dropped: the trial's
    switches lost every compressed step's residual), the warm-start vectors are emptied, and a
    state with no known old layout keeps nothing."""
    from types import SimpleNamespace

    from ringtrain.ddp import buckets as bucketing
    from ringtrain.ddp.comm_hook import forget_buckets

    numels = [3, 5, 2, 4, 6]
    dtypes, sizes = [torch.float32] * 5, [4] * 5
    old = bucketing.layout([4, 3, 2, 1, 0], [(0, 1), (2, 4)], numels, dtypes, sizes)
    new = bucketing.layout([4, 3, 2, 1, 0], [(0, 0), (1, 3), (4, 4)], numels, dtypes, sizes)

    def residual(pid):  # (a value per element that names its parameter and place)
        return torch.arange(numels[pid], dtype=torch.float32) + 100 * pid

    errors = {}
    for spec in old:
        errors[spec.index] = torch.cat([residual(pid) for pid in spec.pids])
    state = SimpleNamespace(error_dict=dict(errors), p_memory_dict={0: torch.ones(2)}, q_memory_dict={0: torch.ones(2)})
    forget_buckets(state, old, new)
    assert sorted(state.error_dict) == [0, 1, 2] and state.p_memory_dict == {} and state.q_memory_dict == {}
    for spec in new:
        assert torch.equal(state.error_dict[spec.index], torch.cat([residual(pid) for pid in spec.pids])), spec
    # An old bucket with no residual yet (not compressed): zeros for its parameters; a new bucket
    # of those alone gets none.
    state = SimpleNamespace(error_dict={1: errors[1]})  # old bucket 1: parameters 2, 1, 0
    forget_buckets(state, old, new)
    assert sorted(state.error_dict) == [1, 2]  # new bucket 0 (parameter 4) had nothing
    assert torch.equal(state.error_dict[1], torch.cat([torch.zeros(numels[3]), residual(2), residual(1)]))
    # A layout not known (a state of another wrapper, or loaded): nothing kept.
    state = SimpleNamespace(error_dict=dict(errors))
    forget_buckets(state, None, new)
    assert state.error_dict == {}
    # Complex parameters: the hook's buffer is the bucket's real view, two residuals an element.
    old = bucketing.layout([4, 3, 2, 1, 0], [(0, 1), (2, 4)], numels, [torch.complex64] * 5, [8] * 5)
    new = bucketing.layout([4, 3, 2, 1, 0], [(0, 0), (1, 3), (4, 4)], numels, [torch.complex64] * 5, [8] * 5)

    def doubled(spec):
        return torch.cat([residual(pid).repeat_interleave(2) for pid in spec.pids])

    state = SimpleNamespace(error_dict={spec.index: doubled(spec) for spec in old})
    forget_buckets(state, old, new)
    for spec in new:
        assert torch.equal(state.error_dict[spec.index], doubled(spec)), spec
