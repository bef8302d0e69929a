"""Predict iteration time, throughput and scaling of data-parallel training from 4 to 2048 GPUs.

Every model x cluster x algorithm x GPU count x schedule of the sweep is one prediction:
iteration = forward + max(backward, end of the last allreduce) + optimizer step, with the
allreduces grouped by ringtrain.plan (the trainer's own planner) and timed by
ringtrain.sim.costs. Examples:

  ringtrain simulate                                  # 9 reference models, 1GbE/10GbE/100Gb-IB
  ringtrain simulate --model resnet50,bert-large --cluster 10GbE --gpus 16,64,256
  ringtrain simulate --model my_trace.json --cluster alpha=2e-5,beta=8e-10 --json
  ringtrain simulate --cluster bench_allreduce.json --plot plots/   # alpha/beta from a bench run
  ringtrain simulate --model profile:resnet --cluster 1GbE --gpus 2,4  # trace profiled on this CPU
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import math
import os
import sys
import unicodedata
from pathlib import Path
from typing import Any, Sequence

from ..cli import REFUSED
from ..outputs import check_file, check_folder
from ..paths import user_path, user_paths
from . import clusters as clusters_mod
from . import costs
from .devices import DEVICES, DeviceProfile, get_device
from .models_zoo import MODELS, build_trace
from .simulator import DEFAULT_GPUS, SCHEDULES, Prediction, sweep
from .traces import Trace, load, profile_reference

DEFAULT_CLUSTERS = "1GbE,10GbE,100Gb-IB"


def add_common(parser: argparse.ArgumentParser, one_cluster: str | None = None) -> None:
    """Options shared by ``simulate`` and ``plan``: model, device, cluster.

    ``one_cluster``: None for ``simulate`` (lists of models and clusters, 'all'); for ``plan`` the
    cluster it uses by default: its --model and --cluster then take exactly one each (no default model).
    """
    if one_cluster is None:
        parser.add_argument("--model", default="all", type=user_paths,
                            help=f"comma-separated zoo models ({', '.join(MODELS)}), 'all' (every zoo model), trace files "
                                 "(.json/.csv), or profile:NAME to profile a ringtrain.models model on this CPU")
    else:
        parser.add_argument("--model", default=None, type=user_paths,
                            help=f"exactly one (required): a zoo model ({', '.join(MODELS)}), a trace file "
                                 "(.json/.csv), or profile:NAME to profile a ringtrain.models model on this CPU")
    parser.add_argument("--device", default="v100", help=f"GPU profile for zoo models: {', '.join(DEVICES)} (default v100)")
    clusters = ("'alpha=S,beta=S_PER_BYTE[,gamma=..,gpus_per_node=..,nics_per_node=..,intra_alpha=..,intra_beta=..,"
                "servers=..,name=..]', or a 'bench allreduce --json' file")
    if one_cluster is None:
        parser.add_argument("--cluster", action="append", default=None, type=user_paths,
                            help=f"network name ({', '.join(costs.NETWORKS)}; comma-separated for several), "
                                 f"{clusters}; repeatable (default {DEFAULT_CLUSTERS})")
    else:
        parser.add_argument("--cluster", action="append", default=None, type=user_paths,
                            help=f"exactly one: a network name ({', '.join(costs.NETWORKS)}), {clusters} "
                                 f"(default {one_cluster}; or --alpha/--beta instead)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node for hierarchical (default 8)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap of the fixed schedule, MiB (default 25)")


#: The line under a table with 1-GPU rows (``what``: schedule or method).
ONE_GPU = "nothing is communicated on 1 GPU: every {what}'s iteration is compute alone"

#: The most GPUs a prediction is made for (no cluster has more; beyond, the numbers mean nothing).
MAX_GPUS = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    gpus = ",".join(map(str, DEFAULT_GPUS))
    parser.add_argument("--gpus", default=gpus, help=f"comma-separated GPU counts, each 1 to {MAX_GPUS} (default {gpus})")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma-separated: {', '.join(SCHEDULES)}")
    parser.add_argument("--algorithms", default="ring", help=f"comma-separated: {', '.join(costs.ALGORITHMS)}")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--csv", metavar="FILE", type=user_path, help="also write every prediction as a CSV row")
    parser.add_argument("--plot", metavar="DIR", type=user_path, help="also write PNG scaling curves and Gantt charts to DIR")


def split(value: str, option: str, accepted: Sequence[str] | None = None) -> list[str]:
    """``value``'s comma-separated items; with ``accepted``, each one of those (:func:`choice`),
    at most once (a schedule or algorithm given twice would repeat every row of --json and --csv)."""
    items = [v.strip() for v in value.split(",")]
    if not any(items):
        raise ValueError(f"{option}: needs at least one value")
    if not all(items):
        raise ValueError(f"{option}: {value!r} has an empty value (two commas in a row, or one at an end)")
    if accepted is not None:
        items = [choice(v, option, accepted) for v in items]
        _refuse_repeats(items, option)
    return items


def choice(value: str, option: str, accepted: Sequence[str], what: str = "value") -> str:
    """The one of ``accepted`` that ``value`` names, in any case, as the models, devices and
    networks are taken ('Ring' is ring); ValueError naming ``option`` (and ``what`` it is) else."""
    found = {a.lower(): a for a in accepted}.get(value.strip().lower())
    if found is None:
        raise ValueError(f"{option}: unknown {what} {value!r}; choose from {', '.join(accepted)}")
    return found


def _refuse_repeats(items: Sequence[Any], option: str) -> None:
    seen: set[Any] = set()
    for v in items:
        if v in seen:
            raise ValueError(f"{option}: {v} given twice")
        seen.add(v)


def parse_gpus(value: str) -> list[int]:
    out = []
    for v in split(value, "--gpus"):
        try:
            p = int(v)
        except ValueError:
            raise ValueError(f"--gpus: {v!r} is not an integer") from None
        if not 1 <= p <= MAX_GPUS:
            raise ValueError(f"--gpus: GPU counts must be from 1 to {MAX_GPUS}, got {p}")
        out.append(p)
    _refuse_repeats(out, "--gpus")  # (each GPU count's rows would come twice)
    return out


def check_gpus_per_node(value: int) -> int:
    """``--gpus-per-node``: an integer >= 1 (and at most ``costs.MAX_COUNT``)."""
    if not 1 <= value <= costs.MAX_COUNT:
        raise ValueError(f"--gpus-per-node: must be an integer >= 1 and at most {costs.MAX_COUNT:.0e}, got {value}")
    return value


def check_bucket_mb(value: float) -> float:
    """``--bucket-mb``, the fixed schedule's bucket cap in MiB: a finite number > 0."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"--bucket-mb: {value!r} must be a finite number of MiB > 0")
    return value


def resolve_device(name: str) -> DeviceProfile:
    """``--device``'s GPU profile (any case, spaces around it taken); ValueError naming the option."""
    try:
        return get_device(name)
    except ValueError as e:
        raise ValueError(f"--device: {e}") from None


def load_traces(value: str, device: DeviceProfile) -> list[Trace]:
    """Zoo models on ``device`` (:func:`resolve_device`), trace files, or ``profile:NAME`` (a
    ringtrain.models model profiled on this machine's CPU)."""
    out: list[Trace] = []
    for n in model_names(value):
        if n.lower().endswith((".json", ".csv")):
            trace = load(n)
            tag = Path(n).stem
        elif n.startswith("profile:"):
            from .. import models  # (torch: only where a model is profiled)

            if n[len("profile:"):] not in models.names():  # (was the models registry's message, naming no option)
                raise ValueError(f"--model {n}: unknown ringtrain.models model; choose profile: followed by one "
                                 f"of {', '.join(models.names())}")
            trace = profile_reference(n[len("profile:"):])
            tag = "profiled"
        else:
            if n.strip().lower() not in MODELS:  # (the zoo's message names neither the option nor profile:)
                raise ValueError(f"--model: unknown model {n!r}; choose from {', '.join(MODELS)}, a trace file "
                                 "(.json/.csv) or profile:NAME (a ringtrain.models model profiled on this CPU)")
            try:
                trace = build_trace(n, device)
            except ValueError as e:
                raise ValueError(f"--model: {e}") from None
            tag = device.name  # (as the zoo names it, not as given)
        taken = {t.model for t in out}  # rows are keyed by model name
        if trace.model in taken:
            name, k = f"{trace.model}@{tag}", 2
            while name in taken:
                name, k = f"{trace.model}@{tag}#{k}", k + 1
            trace = dataclasses.replace(trace, model=name)
        out.append(trace)
    return out


def model_names(value: str) -> list[str]:
    """``--model``'s items; 'all', alone or in the list, stands for every zoo model not named beside it."""
    items = split(value, "--model")
    if not any(v.lower() == "all" for v in items):
        return items
    named = {v.lower() for v in items if v.lower() != "all"}  # (zoo names are taken in any case)
    out: list[str] = []
    for v in items:
        out.extend([m for m in MODELS if m not in named and m not in out] if v.lower() == "all" else [v])
    return out


def zoo_device(value: str, device: str) -> str | None:
    """``device`` where ``--model`` names a zoo model (the others bring their own times), else None."""
    zoo = [n for n in model_names(value) if not n.lower().endswith((".json", ".csv")) and not n.startswith("profile:")]
    return device if zoo else None


def run(args: argparse.Namespace) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before a sweep that may take minutes
        print("ringtrain simulate: --plot needs matplotlib, which is not installed here; "
              "install it (pip install matplotlib) or leave out --plot", file=sys.stderr)
        return REFUSED
    try:
        if args.csv:
            check_file(args.csv, "--csv")  # (before the sweep, not after it)
            check_not_an_input(args.csv, "--csv", model_names(args.model) + list(args.cluster or []))
        if args.plot:
            check_folder(args.plot, "--plot")  # (made by the plots, after the sweep)
        profile = resolve_device(args.device)
        traces = load_traces(args.model, profile)
        device = zoo_device(args.model, profile.name)  # (as the zoo names it: ' H100' is h100)
        clusters = clusters_mod.resolve_many(args.cluster or [DEFAULT_CLUSTERS], check_gpus_per_node(args.gpus_per_node))
        gpus = parse_gpus(args.gpus)
        schedules = split(args.schedules, "--schedules", SCHEDULES)
        algorithms = split(args.algorithms, "--algorithms", costs.ALGORITHMS)
        bucket_mb = check_bucket_mb(args.bucket_mb)
        predictions = sweep(traces, clusters, gpus, schedules, algorithms, bucket_mb)
    except ValueError as e:
        print(f"ringtrain simulate: {e}", file=sys.stderr)
        return REFUSED
    try:
        if args.csv:
            write_csv(predictions, args.csv)
        if args.plot:
            from . import plot

            for path in plot.write_all(predictions, traces, clusters, args.plot):
                print(f"wrote {path}", file=sys.stderr)
    except OSError as e:
        print(f"ringtrain simulate: cannot write {e.filename or 'the output'}: {e.strerror or e}", file=sys.stderr)
        return 1  # (the sweep ran: a run that failed, not a refused command line)
    if args.json:
        return emit(json.dumps(document(predictions, traces, clusters, device), indent=1), "ringtrain simulate")
    return emit(format_table(predictions, schedules, device), "ringtrain simulate")


def emit(text: str, prog: str) -> int:
    """Print ``text``; the exit status: 0, also where a reader stops early (``| head``), or 1 with
    one line naming the cause where stdout cannot be written (a full disk)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        status = 0
    except OSError as e:
        print(f"{prog}: cannot write the output: {e.strerror or e}", file=sys.stderr)
        status = 1
    else:
        return 0
    # Point stdout at /dev/null so the interpreter's final flush does not fail again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return status


def document(predictions: list[Prediction], traces: list[Trace], clusters: list[Any],
             device: str | None) -> dict[str, Any]:
    """The --json document; ``device``: the GPU profile of the zoo models (None without any)."""
    return {
        "device": device,
        "models": [
            {"model": t.model, "batch_size": t.batch_size, "sample_unit": t.sample_unit, "layers": len(t.layers),
             "params": t.params, "grad_bytes": t.grad_bytes, "forward_s": t.forward_s, "backward_s": t.backward_s,
             "optimizer_s": t.optimizer_s, "source": t.source}
            for t in traces
        ],
        "clusters": [
            {k: getattr(c, k) for k in c.__slots__} for c in clusters
        ],
        "rows": [p.to_dict() for p in predictions],
    }


def check_not_an_input(path: str, option: str, inputs: list[str]) -> None:
    """ValueError naming ``option`` where ``path`` is one of the files ``inputs`` names (a
    trace file of --model, a bench file of --cluster): the output would replace it."""
    target = Path(path)
    if not target.exists():
        return
    for item in inputs:
        source = Path(item.strip())
        try:
            same = source.exists() and source.samefile(target)
        except OSError:
            continue
        if same:
            raise ValueError(f"{option} {path}: that is the input file {item.strip()!r}, which the output would "
                             "replace; name another file")


def write_csv(predictions: list[Prediction], path: str | Path) -> None:
    rows = [p.to_dict() for p in predictions]
    with open(path, "w", newline="", encoding="utf-8") as f:  # (not the locale's: a model named 'модель')
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def format_table(predictions: list[Prediction], schedules: Sequence[str], device: str | None) -> str:
    """One line per model x cluster x algorithm x GPU count; a column per schedule (``device``:
    the zoo models' GPU profile, None without zoo models)."""
    cells: dict[tuple, dict[str, Prediction]] = {}
    for p in predictions:
        cells.setdefault((p.model, p.cluster, p.algorithm, p.world_size), {})[p.schedule] = p
    mw = max([12] + [width(p.model) for p in predictions])
    cw = max([16] + [width(p.cluster) for p in predictions])
    aw = max([10] + [len(p.algorithm) for p in predictions])  # (hierarchical, halving_doubling...)
    # (a cell keeps a space before it however long its number: 2048 GPUs on 1GbE run to 1e8 ms)
    nw = max([10] + [len(f"{p.iteration_s * 1e3:.1f}") + 1 for p in predictions])
    head = (f"{'model':<{mw}} {'cluster':<{cw}} {'algorithm':<{aw}} {'gpus':>5}"
            + "".join(f"{s:>{nw + 7}}" for s in schedules))
    lines = [
        "iteration time in ms (scaling efficiency) per schedule" + (f"; zoo models timed on {device}" if device else ""),
        head + f"  {'best':<8} {'samples/s':>10}",
    ]
    for (model, cluster, algorithm, p), by_schedule in cells.items():
        row = f"{pad(model, mw)} {pad(cluster, cw)} {algorithm:<{aw}} {p:>5}"
        for s in schedules:
            pr = by_schedule[s]
            row += f"{pr.iteration_s * 1e3:>{nw}.1f} ({pr.efficiency:>4.0%})"
        fastest = min(pr.iteration_s for pr in by_schedule.values())
        tied = [pr for pr in by_schedule.values() if pr.iteration_s <= fastest * (1 + 1e-9)]
        # (an exact tie, e.g. every schedule one group at few GPUs, names the default planner)
        best = next((pr for pr in tied if pr.schedule == "optimal"), tied[0])
        lines.append(row + f"  {best.schedule:<8} {best.samples_per_s:>10.0f}")
    if any(p.world_size == 1 for p in predictions):
        lines.append(ONE_GPU.format(what="schedule"))
    return "\n".join(lines)


def width(text: str) -> int:
    """The columns ``text`` takes on a terminal: 2 for a wide character (CJK: '模型'), 0 for a
    combining mark, else 1 (str.ljust counts characters, and a table of such names lost its columns)."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def pad(text: str, columns: int) -> str:
    """``text`` with spaces after it to fill ``columns`` terminal columns (:func:`width`)."""
    return text + " " * max(0, columns - width(text))
