"""One rank of a parameter-server benchmark job: ``python -m ringtrain.ps --servers K ...``.

Started on every rank with torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
RINGTRAIN_SECRET), e.g. by ``ringtrain.bench.procs.run_ranks("ringtrain.ps", args, W + K, timeout=S)``:
ranks [0, W) train a reference model for ``--steps`` steps on their slice of every global
batch, the last K ranks serve. Rank 0 prints one line ``RESULT {json}``: its step times and
losses, median step time and samples/s (after 2 warm-up steps), its bytes per server, and
what every server reported when rank 0 said BYE (bytes per worker, staleness histogram).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from ..errors import check_number
from ..train import USUAL_LR
from .launch import check_servers, is_server_rank, run_server_role, train_steps, worker_from_env
from .server_config import STRATEGIES, staleness_flag
from .server_optimizer import OPTIMIZERS

RESULT_PREFIX = "RESULT "


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ringtrain.ps", description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, default=1, help="K, the number of server ranks (the last K ranks)")
    p.add_argument("--strategy", choices=STRATEGIES, default="sync")
    p.add_argument("--model", default="mlp", help="reference model (ringtrain.models.names())")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=0, help="per-worker batch; 0 = the model's default")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="what the servers apply")
    p.add_argument("--lr", type=float, default=0.0,
                   help="0 = the optimizer's usual one (ringtrain train's: 0.05 for sgd, 0.001 for adam and adamw)")
    p.add_argument("--momentum", type=float, default=0.9, help="sgd only")
    p.add_argument("--max-staleness", type=int, default=0, help="async only; -1 = unbounded")
    p.add_argument("--schedule", default="optimal", help="push merging (ringtrain.plan.METHODS)")
    p.add_argument("--partition-mb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may last once the ranks have met")
    p.add_argument("--join-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds to start and meet (the job's store, the servers); default: --timeout, but at least 60")
    args = p.parse_args(argv)
    for flag, value in (("--timeout", args.timeout), ("--join-timeout", args.join_timeout)):
        try:
            if value is not None:
                check_number(flag, value, unit=" of seconds")
        except ValueError as exc:
            p.error(str(exc))
    if not (math.isfinite(args.lr) and args.lr >= 0):
        p.error(f"--lr must be a finite number >= 0 (0: the optimizer's usual one), got {args.lr}")
    args.lr = args.lr or USUAL_LR[args.optimizer]
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.servers < 1:
        p.error(f"--servers must be >= 1, got {args.servers}")
    try:  # (the servers' max_staleness: None for -1)
        args.staleness_bound = staleness_flag(args.max_staleness, args.strategy, "async")
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from ..lifecycle import die_with_parent

    die_with_parent()
    import numpy as np
    import torch

    from .. import data, models, rendezvous

    try:  # (the job's shape, before any rank starts: a one-line error, as the flags above)
        if args.model not in models.names():
            raise ValueError(f"--model: unknown model {args.model!r}; choose from {', '.join(models.names())}")
        info = rendezvous.job_info()
        check_servers(args.servers, info.world_size, name="--servers")
        server = is_server_rank(args.servers, info.rank, info.world_size)
    except ValueError as exc:
        print(f"python -m ringtrain.ps: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    if server:
        run_server_role(args.servers, strategy=args.strategy, max_staleness=args.staleness_bound,
                        timeout=args.timeout, join_timeout=args.join_timeout)
        return 0
    workers = info.world_size - args.servers
    spec = models.spec(args.model)
    batch = args.batch_size or spec.batch_size
    model = models.build(args.model, seed=args.seed)
    dataset = data.dataset(spec.dataset, seed=args.seed, **spec.batch_kwargs)
    loader = data.ShardedLoader(dataset, batch, rank=info.rank, world_size=workers, seed=args.seed)
    pst = worker_from_env(model, args.servers, strategy=args.strategy, optimizer=args.optimizer, lr=args.lr,
                          momentum=args.momentum,
                          schedule=args.schedule, partition_mb=args.partition_mb, timeout=args.timeout,
                          join_timeout=args.join_timeout)
    out = train_steps(pst, model, loader, args.steps)
    steady = out["step_s"][2:] if args.steps > 4 else out["step_s"]
    median = float(np.median(steady))
    if info.rank == 0:
        result = {"strategy": args.strategy, "servers": args.servers, "workers": workers, "model": args.model,
                  "batch_size": batch, "median_step_s": median, "samples_per_s": workers * batch / median, **out}
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
