"""DistributedDataParallel(compression="fp16" | "bf16"): gradients cross the network in half
precision, as with torch's DDP and its fp16_compress_hook / bf16_compress_hook.

Against torch's DDP with the hook (gloo), in the same processes on the same data: at 2 ranks
bitwise (each element's result is one rounding of the half-precision sum of two values, in any
order). At 3 ranks: every rank bitwise equal, and within half precision of the float32 mean.
Then what the plan is sized by, the refusals, one rank.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mp_harness import run_ranks
from thread_harness import raise_first, run_comms
from ringtrain.ddp import DistributedDataParallel

pytestmark = pytest.mark.timeout(120)
FAST = dict(alpha=1e-7, beta=1e-10, warmup_iterations=0, profile_iterations=1, verify_iterations=1,
            replan_interval=4, bucket_cap_mb=0.0001)
STEPS = 8


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g) * 3, torch.randint(0, 3, (8,), generator=g)


def _train(ddp, m, rank) -> dict:
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(ddp(batch(rank, step)[0]), batch(rank, step)[1]).backward()
        opt.step()
    return {k: v.clone() for k, v in m.state_dict().items()}


def _ours_and_torchs(rank, world_size, port, configs):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import ringtrain
    from ringtrain.bench.train import bf16_hook

    torch.set_num_threads(1)
    # (one store for both, at one port: a second free port could be taken before its use)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    comm = ringtrain.init(rank, world_size, "127.0.0.1", port, timeout=20.0)
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": bf16_hook}  # (the hook's steps: torch refuses its own)
    out = {}
    try:
        for compression, schedule in configs:
            m = model()
            ddp = nn.parallel.DistributedDataParallel(m)
            ddp.register_comm_hook(None, hooks[compression])
            out[compression, schedule, "torch"] = _train(ddp, m, rank)
            m = model()
            ddp = DistributedDataParallel(m, comm, schedule=schedule, compression=compression, **FAST)
            out[compression, schedule, "ours"] = _train(ddp, m, rank)
            ddp.close()
            m = model()  # the float32 mean, for the size of the rounding
            ddp = DistributedDataParallel(m, comm, schedule=schedule, **FAST)
            out[compression, schedule, "float32"] = _train(ddp, m, rank)
            ddp.close()
    finally:
        comm.close()  # (before the store it reaches: rank 0's is the default group's)
        dist.destroy_process_group()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


CONFIGS = [(c, s) for c in ("fp16", "bf16") for s in ("optimal", "fixed")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_compressed_gradients_as_torch_ddp_with_its_compression_hook(world_size):
    results = run_ranks(_ours_and_torchs, world_size, CONFIGS, timeout=110)
    for r in results:
        if isinstance(r, BaseException):
            raise AssertionError(f"{r}\n{getattr(r, 'tb', '')}")
    results = [torch.load(io.BytesIO(r), weights_only=False) for r in results]
    for key in results[0]:
        for rank, res in enumerate(results):
            for name in res[key]:
                assert torch.equal(res[key][name], results[0][key][name]), (key, rank, name)
    for compression, schedule in CONFIGS:
        ours, torchs, exact = (results[0][compression, schedule, k] for k in ("ours", "torch", "float32"))
        for name in ours:
            if world_size == 2:
                # One rounding of a sum of two half-precision values, whatever the order: the same bits.
                assert torch.equal(ours[name], torchs[name]), (compression, schedule, name)
            else:
                # Three values: gloo and the ring add them in other orders (one half-precision
                # rounding each: 2^-11 relative for fp16, 2^-8 for bf16, over 8 steps).
                tol = 2e-3 if compression == "fp16" else 2e-2
                torch.testing.assert_close(ours[name], torchs[name], rtol=tol, atol=tol)
            # ... and the compression did round: close to the float32 mean, not equal to it.
            torch.testing.assert_close(ours[name], exact[name], rtol=5e-2, atol=5e-2)
        assert any(not torch.equal(ours[n], exact[n]) for n in ours), (compression, schedule)


def test_the_plan_is_sized_by_the_bytes_on_the_wire_and_odd_dtypes_go_as_they_are():
    def fn(comm):
        m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2).double(), nn.Linear(2, 2).half())
        ddp = DistributedDataParallel(m, comm, compression="bf16", alpha=1e-5, beta=1e-9)
        sizes = list(ddp._sizes)
        wires = [ddp._wire_dtype(p.dtype) for p in m.parameters()]
        ddp.close()
        return sizes, wires

    for sizes, wires in raise_first(run_comms(2, fn)):
        # float32 and float64 as bfloat16 (2 bytes each); the float16 layer as it is
        assert sizes == [64.0, 16.0, 32.0, 4.0, 8.0, 4.0]
        assert wires == [torch.bfloat16] * 4 + [torch.float16] * 2


def test_compression_must_be_one_it_knows():
    with pytest.raises(ValueError, match=r"compression='int8': accepted values are None, 'fp16', 'bf16'"):
        raise_first(run_comms(1, lambda comm: DistributedDataParallel(model(), comm, compression="int8")))


def test_one_rank_rounds_nothing():
    def fn(comm):
        m = model()
        ddp = DistributedDataParallel(m, comm, compression="fp16", alpha=1e-5, beta=1e-9)
        got = _train(ddp, m, 0)
        ddp.close()
        return got

    got = raise_first(run_comms(1, fn))[0]
    m = model()
    want = _train(m, m, 0)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_fp16_gradients_are_divided_before_the_sum_so_the_sum_does_not_overflow():
    # 40000 on each of 2 ranks: summed first, 80000 is past float16's 65504 (inf); divided first,
    # 20000 + 20000 is exact.
    def fn(comm):
        ddp = DistributedDataParallel(model(), comm, compression="fp16", alpha=1e-5, beta=1e-9)
        buf = torch.full((5,), 40000.0 + comm.rank)
        ddp._allreduce_bucket(buf)
        ddp.close()
        return buf

    for buf in raise_first(run_comms(2, fn)):
        assert torch.equal(buf, torch.full((5,), 40000.0))  # (40000.5 rounds to float16's 40000)
