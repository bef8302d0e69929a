"""Sizes and single-process step times of the reference models.

    python -m ringtrain.models                 # every model, one table
    python -m ringtrain.models resnet --json   # one model, JSON
    python -m ringtrain.models --threads 2 --steps 20

*Step time* is one forward and backward pass (zero_grad, forward, loss, backward; no
optimizer step) at the model's default batch, median over ``--steps`` timed steps after
``--warmup`` untimed ones, with ``torch.set_num_threads(--threads)`` (default 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from . import build, describe, make_batch, names, spec


def step_times(name: str, steps: int, warmup: int, seed: int = 0) -> list[float]:
    """Seconds per forward+backward of model ``name`` at its default batch."""
    model = build(name, seed=seed)
    x, y = make_batch(model, seed=seed + 1)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model.loss(model(x), y).backward()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.models", description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help=f"model names (default: all of {sorted(set(map(lambda n: spec(n).name, names())))})")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    for option in ("steps", "threads"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be >= 1, got {getattr(args, option)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    chosen = args.models or sorted({spec(n).name for n in names()})
    for name in chosen:
        if name not in names():
            parser.error(f"model must be one of {', '.join(names())}, got {name!r}")
    torch.set_num_threads(args.threads)
    rows = []
    for name in chosen:
        row = describe(name)
        times = step_times(name, args.steps, args.warmup)
        row["step_ms_median"] = round(1e3 * statistics.median(times), 1)
        row["step_ms_min"] = round(1e3 * min(times), 1)
        row["threads"] = args.threads
        rows.append(row)
    if args.json:
        print(json.dumps({"models": rows}, indent=2))
        return 0
    print(f"{'model':<20}{'params':>12}{'tensors':>9}{'layers':>8}{'batch':>7}{'median ms':>11}{'min ms':>9}")
    for r in rows:
        print(f"{r['name']:<20}{r['num_params']:>12,}{r['num_param_tensors']:>9}{r['num_layers']:>8}"
              f"{r['batch_size']:>7}{r['step_ms_median']:>11}{r['step_ms_min']:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
