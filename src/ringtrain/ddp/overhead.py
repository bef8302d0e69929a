"""What the wrapper costs on one rank: plain PyTorch steps against wrapped steps, interleaved.

    python -m ringtrain.ddp.overhead [--steps 40] [--rounds 7] [--json]

A *step* is forward, backward and an SGD update on a fixed synthetic batch. Plain and wrapped
steps alternate one by one (which goes first alternates too), so both see the same load on a
shared machine; the overhead is median(wrapped step) / median(plain step) - 1 over
``steps * rounds`` pairs. The wrapper runs with the default options (the optimal schedule,
profiling and planning included) over a one-rank communicator.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn


def conv_model() -> nn.Module:
    """A many-layer CNN (16 conv layers), the kind the optimal merge is for."""
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, padding=1), nn.ReLU()]
    for _ in range(15):
        layers += [nn.Conv2d(32, 32, 3, padding=1), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)]
    return nn.Sequential(*layers)


def mlp_model() -> nn.Module:
    """A few large layers."""
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


def tiny_model() -> nn.Module:
    """32 tiny layers (64 parameters) that compute almost nothing: the difference in step time
    is the wrapper's own cost per step, in absolute terms."""
    return nn.Sequential(*[nn.Linear(10, 10) for _ in range(32)])


MODELS = {"conv": (conv_model, (16, 3, 32, 32)), "mlp": (mlp_model, (64, 1024)), "tiny": (tiny_model, (4, 10))}


def measure(model_name: str = "conv", steps: int = 40, rounds: int = 7) -> dict:
    from ..comm import Communicator
    from ..transport.local import LocalHub
    from .wrapper import DistributedDataParallel

    build, shape = MODELS[model_name]
    torch.manual_seed(0)
    plain = build()
    wrapped_module = build()
    wrapped_module.load_state_dict(plain.state_dict())
    comm = Communicator(LocalHub(1).transport(0), timeout=30.0)
    ddp = DistributedDataParallel(wrapped_module, comm)
    x = torch.randn(shape)
    y = torch.randint(0, 10, (shape[0],))

    def step(net: nn.Module, opt: torch.optim.Optimizer) -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    opt_plain = torch.optim.SGD(plain.parameters(), lr=1e-3)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for _ in range(10):  # warm-up both (and let the wrapper profile and plan)
        step(plain, opt_plain)
        step(ddp, opt_ddp)
    plain_s, ddp_s = [], []
    for i in range(steps * rounds):  # paired and alternating: both sides see the same machine load
        if i % 2:
            plain_s.append(step(plain, opt_plain))
            ddp_s.append(step(ddp, opt_ddp))
        else:
            ddp_s.append(step(ddp, opt_ddp))
            plain_s.append(step(plain, opt_plain))
    ddp.close()
    comm.close()
    return {
        "model": model_name, "steps": steps, "rounds": rounds, "torch_threads": torch.get_num_threads(),
        "plain_step_ms": 1e3 * statistics.median(plain_s), "ddp_step_ms": 1e3 * statistics.median(ddp_s),
        "overhead_percent": 100.0 * (statistics.median(ddp_s) / statistics.median(plain_s) - 1.0),
        "overhead_us_per_step": 1e6 * (statistics.median(ddp_s) - statistics.median(plain_s)),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.ddp.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="conv")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.model, args.steps, args.rounds)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['model']}: plain {result['plain_step_ms']:.2f} ms/step, wrapped {result['ddp_step_ms']:.2f} "
              f"ms/step, overhead {result['overhead_percent']:+.2f}% ({result['overhead_us_per_step']:+.0f} us/step; "
              f"medians of {result['steps'] * result['rounds']} paired steps)")


if __name__ == "__main__":
    main()
