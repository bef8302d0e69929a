"""What the wrapper costs on one rank: plain PyTorch steps against wrapped steps, interleaved.

    python -m ringtrain.ddp.overhead [--models charlm,resnet,mlp,tiny] [--steps 40] [--rounds 7] [--json] [--out DIR]

A *step* is zero_grad, forward, the loss, backward and an SGD update on one fixed batch.
Plain and wrapped steps alternate one by one (which goes first alternates too), so both see
the same load on a shared machine; the overhead is median(wrapped step) / median(plain step)
- 1 over ``steps * rounds`` pairs. The wrapper runs with the default options (the optimal
schedule, profiling and planning included) over a one-rank communicator. Models: the
reference workloads of ``ringtrain.models`` (a random batch of their default size) and ``tiny``, 32 layers of
10x10 that compute almost nothing, so that its difference is the wrapper's own cost per step
in absolute terms. Both sides start from the same weights and take the same steps, so they
end with the same parameters (the result says whether they do, bit for bit).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Callable

import torch
from torch import nn

from ..paths import user_path

TINY = "tiny"


def tiny_model() -> nn.Module:
    """32 tiny layers (64 parameters) that compute almost nothing: the difference in step time
    is the wrapper's own cost per step, in absolute terms."""
    return nn.Sequential(*[nn.Linear(10, 10) for _ in range(32)])


def model_names() -> list[str]:
    from .. import models

    return sorted({*models.names(), TINY})


def _workload(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Callable]:
    """The module, one batch and the loss (module, output, target) -> scalar."""
    if name == TINY:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            module = tiny_model()
            batch = torch.randn(4, 10), torch.randint(0, 10, (4,))
        return module, batch, lambda m, out, y: nn.functional.cross_entropy(out, y)
    from .. import models

    module = models.build(name, seed=0)
    return module, models.make_batch(module, seed=0), lambda m, out, y: m.loss(out, y)


def measure(model_name: str = "resnet", steps: int = 40, rounds: int = 7) -> dict:
    from ..comm import Communicator
    from ..transport.local import LocalHub
    from .wrapper import DistributedDataParallel

    if model_name not in model_names():
        raise ValueError(f"model must be one of {model_names()}, got {model_name!r}")
    plain, (x, y), loss = _workload(model_name)
    wrapped_module = copy.deepcopy(plain)
    comm = Communicator(LocalHub(1).transport(0), timeout=30.0)
    ddp = DistributedDataParallel(wrapped_module, comm)

    def step(net: nn.Module, module: nn.Module, opt: torch.optim.Optimizer) -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss(module, net(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    opt_plain = torch.optim.SGD(plain.parameters(), lr=1e-3)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for _ in range(10):  # warm-up both (and let the wrapper profile and plan)
        step(plain, plain, opt_plain)
        step(ddp, wrapped_module, opt_ddp)
    plain_s, ddp_s = [], []
    for i in range(steps * rounds):  # paired and alternating: both sides see the same machine load
        if i % 2:
            plain_s.append(step(plain, plain, opt_plain))
            ddp_s.append(step(ddp, wrapped_module, opt_ddp))
        else:
            ddp_s.append(step(ddp, wrapped_module, opt_ddp))
            plain_s.append(step(plain, plain, opt_plain))
    ddp.close()
    comm.close()
    same = all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), wrapped_module.state_dict().values()))
    return {
        "model": model_name, "steps": steps, "rounds": rounds, "torch_threads": torch.get_num_threads(),
        "plain_step_ms": 1e3 * statistics.median(plain_s), "ddp_step_ms": 1e3 * statistics.median(ddp_s),
        "overhead_percent": 100.0 * (statistics.median(ddp_s) / statistics.median(plain_s) - 1.0),
        "overhead_us_per_step": 1e6 * (statistics.median(ddp_s) - statistics.median(plain_s)),
        "same_parameters": same,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.ddp.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="charlm,resnet,mlp,tiny", help=f"comma-separated, of {model_names()}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of lines")
    parser.add_argument("--out", default="benchmarks", type=user_path, help="directory for the result file ('' to skip)")
    args = parser.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in names if m not in model_names()]
    if bad or not names:
        parser.error(f"--models: each must be one of {model_names()}, got {args.models!r}")
    for option, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{option} must be >= 1, got {value}")
    results = []
    for name in names:
        result = measure(name, args.steps, args.rounds)
        results.append(result)
        if not args.json:
            print(f"{result['model']}: plain {result['plain_step_ms']:.2f} ms/step, wrapped {result['ddp_step_ms']:.2f} "
                  f"ms/step, overhead {result['overhead_percent']:+.2f}% ({result['overhead_us_per_step']:+.0f} us/step; "
                  f"medians of {result['steps'] * result['rounds']} paired steps; parameters "
                  f"{'identical' if result['same_parameters'] else 'DIFFER'})", flush=True)
    doc = {"rows": results, "command": "python -m ringtrain.ddp.overhead " + " ".join(argv if argv is not None
                                                                                    else sys.argv[1:])}
    if args.json:
        print(json.dumps(doc))
    if args.out:
        from ..bench.machine import save_result

        path = save_result("overhead-1rank", doc, args.out)
        if not args.json:
            print(f"saved {path}")


if __name__ == "__main__":
    main()
