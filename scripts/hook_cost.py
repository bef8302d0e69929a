#!/usr/bin/env python3
"""What the wrapper's gradient hooks cost backward, with no communication at all.

Usage:  .venv/bin/python scripts/hook_cost.py [--model charlm] [--iterations 50]

One process, torch on one thread, one fixed batch of a reference model. Backward is timed
(median after 5 warm-ups) in variants that take turns iteration by iteration, in alternating
order, so all meet the same machine:

- ``plain``: no hooks;
- ``empty``: a ``register_post_accumulate_grad_hook`` per parameter that returns at once (the
  cost of autograd calling into Python);
- ``slot``: what ``ringtrain.DistributedDataParallel``'s hook does on 2+ ranks: copy the
  gradient into the parameter's slot of a flat bucket, make the slot the ``.grad`` and keep the
  gradient autograd made until the next forward (``ddp/wrapper.py``, ``_into_slot``);
- ``copy``: the copy alone (``.grad`` stays autograd's);
- ``slot-free``: the copy and the slot as ``.grad``, the old gradient freed at once.

The differences say how much of the wrapper's gap to compute alone, at 2 ranks with nothing
overlapping, is its hooks (stop 27: at most 1-3% of the LM's backward, within this VM's noise).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

VARIANTS = ("plain", "empty", "slot", "copy", "slot-free")
WARMUP = 5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="charlm", help="reference model (ringtrain.models; default %(default)s)")
    p.add_argument("--iterations", type=int, default=50, help="iterations per variant (default %(default)s)")
    args = p.parse_args()
    from ringtrain import models

    torch.set_num_threads(1)
    module = models.build(args.model, seed=0)
    x, y = models.make_batch(module, seed=0)
    params = [q for q in module.parameters() if q.requires_grad]
    flat = torch.zeros(sum(q.numel() for q in params))
    slots, offset = {}, 0
    for q in params:
        slots[q] = flat[offset:offset + q.numel()].view_as(q)
        offset += q.numel()
    variant = ["plain"]
    retired: list[torch.Tensor] = []

    def hook(q: torch.Tensor) -> None:
        v = variant[0]
        if v in ("plain", "empty"):
            return
        slots[q].copy_(q.grad)
        if v == "slot":
            retired.append(q.grad)
        if v in ("slot", "slot-free"):
            q.grad = slots[q]

    handles = [q.register_post_accumulate_grad_hook(hook) for q in params]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for it in range(WARMUP + args.iterations):
        for v in VARIANTS if it % 2 else VARIANTS[::-1]:
            variant[0] = v
            if v == "plain":
                for h in handles:
                    h.remove()
            for q in params:
                q.grad = None
            retired.clear()
            loss = module.loss(module(x), y)
            t0 = time.perf_counter()
            loss.backward()
            if it >= WARMUP:
                times[v].append(time.perf_counter() - t0)
            if v == "plain":
                handles = [q.register_post_accumulate_grad_hook(hook) for q in params]
    base = statistics.median(times["plain"])
    for v in VARIANTS:
        m = statistics.median(times[v])
        print(f"{args.model} {v:9s} backward median {m * 1e3:7.2f} ms ({100 * (m / base - 1):+.1f}% over plain)")


if __name__ == "__main__":
    main()
