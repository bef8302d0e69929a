"""Show how a model's gradients would be merged into allreduces, and what each method predicts.

For one model (zoo name or trace file) on one cluster and GPU count, every method of
ringtrain.plan (the trainer's own planner) groups the gradient layers in backward order; for
each the groups, their bytes and allreduce start/end are printed with the predicted
iteration time. Examples:

  ringtrain plan --model resnet50 --cluster 10GbE --gpus 16
  ringtrain plan --model trace.json --alpha 2e-5 --beta 8e-10 --gpus 4 --methods optimal,wfbp
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from ..cli import REFUSED
from . import clusters as clusters_mod
from . import costs
from .cli import (MAX_GPUS, ONE_GPU, add_common, check_bucket_mb, check_gpus_per_node, choice, emit, load_traces,
                  resolve_device, split)
from .simulator import SCHEDULES, Prediction, predict_with_cost
from .traces import Trace


#: The network of a plan without --cluster or --alpha/--beta.
DEFAULT_CLUSTER = "10GbE"


def configure(parser: argparse.ArgumentParser) -> None:
    add_common(parser, one_cluster=DEFAULT_CLUSTER)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--alpha", type=float, help="link start-up time, seconds (instead of --cluster)")
    parser.add_argument("--beta", type=float, help="link time per byte, seconds (with --alpha)")
    parser.add_argument("--gpus", type=int, default=16, help=f"GPU count, 1 to {MAX_GPUS} (default 16)")
    parser.add_argument("--algorithm", default="ring", help=f"one of {', '.join(costs.ALGORITHMS)} (default ring)")
    parser.add_argument("--methods", default=",".join(SCHEDULES), help=f"comma-separated: {', '.join(SCHEDULES)}")
    parser.add_argument("--max-groups", type=int, default=20, help="groups listed per method (default 20)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def run(args: argparse.Namespace) -> int:
    try:
        if not args.model or args.model.strip().lower() == "all" or "," in args.model:  # (load_traces strips)
            raise ValueError("--model: give exactly one zoo model, trace file or profile:NAME")
        if not 1 <= args.gpus <= MAX_GPUS:  # (as simulate's)
            raise ValueError(f"--gpus: the GPU count must be an integer from 1 to {MAX_GPUS}, got {args.gpus}")
        if args.max_groups < 0:
            raise ValueError(f"--max-groups: the groups listed per method must be >= 0, got {args.max_groups}")
        check_bucket_mb(args.bucket_mb)
        check_gpus_per_node(args.gpus_per_node)
        args.algorithm = choice(args.algorithm, "--algorithm", costs.ALGORITHMS, "algorithm")
        trace = load_traces(args.model, resolve_device(args.device))[0]
        cluster = _cluster(args)
        methods = split(args.methods, "--methods", SCHEDULES)
        cost = cluster.cost(args.gpus, args.algorithm)
        preds = [predict_with_cost(trace, cost, args.gpus, m, algorithm=args.algorithm, cluster=cluster.name,
                                   bucket_cap_mb=args.bucket_mb) for m in methods]
    except ValueError as e:
        print(f"ringtrain plan: {e}", file=sys.stderr)
        return REFUSED
    names = trace.gradient_layers()[0]
    if args.json:
        doc = {"model": trace.model, "cluster": cluster.name, "world_size": args.gpus, "algorithm": args.algorithm,
               "layers": names, "methods": [dict(p.to_dict(), plan=p.plan.to_dict()) for p in preds]}
        return emit(json.dumps(doc, indent=1), "ringtrain plan")
    return emit(describe(trace, preds, names, args.max_groups), "ringtrain plan")


def _cluster(args: argparse.Namespace) -> clusters_mod.Cluster:
    if (args.alpha is None) != (args.beta is None):
        raise ValueError("--alpha and --beta go together")
    if args.alpha is not None:
        if args.cluster:
            raise ValueError("give --cluster or --alpha/--beta, not both")
        for option, value in (("--alpha", args.alpha), ("--beta", args.beta)):
            if not (math.isfinite(value) and value >= 0):  # (the cluster's own check says --cluster)
                raise ValueError(f"{option}: {value!r} must be a finite number >= 0")
        if args.alpha == 0 and args.beta == 0:
            raise ValueError("--alpha and --beta cannot both be 0 (communication would cost nothing)")
        return clusters_mod.custom(f"alpha={args.alpha},beta={args.beta},gpus_per_node={args.gpus_per_node}")
    found = clusters_mod.resolve_many(args.cluster or [DEFAULT_CLUSTER], args.gpus_per_node)
    if len(found) != 1:
        raise ValueError("--cluster: give exactly one cluster")
    return found[0]


def describe(trace: Trace, preds: list[Prediction], names: list[str], max_groups: int) -> str:
    first = preds[0]
    lines = [
        f"{trace.model}: {len(names)} gradient layers, {trace.grad_bytes / 1e6:.1f} MB of gradients; "
        f"forward {trace.forward_s * 1e3:.2f} ms, backward {trace.backward_s * 1e3:.2f} ms, "
        f"optimizer {trace.optimizer_s * 1e3:.2f} ms",
        f"{first.world_size} GPU{'s' if first.world_size != 1 else ''} on {first.cluster}, "
        + ("parameter servers" if first.algorithm == "ps" else f"{first.algorithm} allreduce"),
        "",
        f"{'method':<8} {'groups':>6} {'iteration ms':>13} {'comm ms':>9} {'exposed ms':>11} {'samples/s':>10} {'efficiency':>10}",
    ]
    for p in preds:
        lines.append(f"{p.schedule:<8} {p.groups:>6} {p.iteration_s * 1e3:>13.2f} {p.comm_s * 1e3:>9.2f} "
                     f"{p.exposed_s * 1e3:>11.2f} {p.samples_per_s:>10.1f} {p.efficiency:>10.1%}")
    if first.world_size == 1:
        lines += ["", ONE_GPU.format(what="method")]
        return "\n".join(lines)
    for p in preds:
        lines += ["", f"{p.schedule}: groups in backward order (layer 0 is ready first)"]
        lines.append(f"  {'group':>5} {'layers':>9} {'MB':>9} {'start ms':>9} {'end ms':>9}  first .. last layer")
        for g, ((a, b), nbytes, s, e) in enumerate(zip(p.plan.groups, p.plan.group_bytes, p.plan.starts, p.plan.ends)):
            if g == max_groups:
                lines.append(f"  ... {len(p.plan.groups) - max_groups} more groups")
                break
            span = names[a] if a == b else f"{names[a]} .. {names[b]}"
            lines.append(f"  {g:>5} {f'{a}-{b}':>9} {nbytes / 1e6:>9.3f} {s * 1e3:>9.2f} {e * 1e3:>9.2f}  {span}")
    return "\n".join(lines)

