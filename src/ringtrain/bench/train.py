"""`ringtrain bench train`: training step time of every schedule against torch's DDP.

In one run, on the same data and the same weights, each rank times, taking turns step by
step: ringtrain's DistributedDataParallel under every schedule (optimal, mgwfbp, wfbp,
fixed 25 MB, single) and torch's own DistributedDataParallel with its defaults (gloo,
25 MiB buckets); every timed step starts on all ranks at once (a barrier before it), and each
turn goes in an order drawn from a generator seeded alike on every rank (none always comes
first or after the same one).
Per configuration: median iteration time (the slowest rank's), samples/s, the medians of
forward, backward() and the SGD step, scaling efficiency (against forward+backward+step
alone, timed on every rank at once so that the CPU is as loaded as in training), the share
of communication hidden behind backward, the planner's predicted iteration (compute alone
plus the communication its plan leaves exposed after backward), the overlap bound
(forward + max(backward, ready time of the first gradient + one allreduce of every byte) +
step, from compute alone), and the simulator's prediction (``ringtrain.sim``) from: the
profiled layer trace scaled phase by phase to the "alone" run, plus the wrapper's own compute
as the single-allreduce wrapper measured it (its gradient hooks, spread over the layers by
bytes, and its buffer broadcasts); the allreduce cost from one sweep per model that every wrapper
plans with (the overlap bound's allreduce too); the interference the optimal wrapper's probes
measured. The layer trace is cut into one layer per parameter tensor, the wrapper's unit.
With ``--compression fp16`` (or bf16) two more configurations take their turns: the optimal
schedule with gradients in that precision on the wire (``compression=``), and torch's DDP with
its defaults and the matching compression hook. With ``--compression powersgd``: the optimal
schedule with torch's ``powerSGD_hook`` (rank 1, from iteration 2, through ``register_comm_hook``
over the wrapper's own ``process_group``); not torch's DDP with it (``POWER_SGD_NOTE``).

Horovod (an interpreter that imports ``horovod.torch``: this one or --horovod-python's) cannot
take turns in that launch: it runs under its own interpreter, and its background thread (a
1 ms cycle) would run through every other configuration's steps. It gets a launch of its own
right after the ring job, on an emulated network of the same rate, the same world size, models,
data, seed, batch and SGD: its ranks take turns step by step, as above, between
``hvd.DistributedOptimizer`` (Horovod's defaults; parameters broadcast from rank 0 first) and
torch's DDP over gloo (a process group of its own beside Horovod), and check that Horovod kept
its copies equal across ranks and within rounding of DDP's. Rows "horovod" and "torch-ddp
(horovod launch)"; the ratio Horovod / DDP measured side by side there is the figure to set
against optimal / DDP of the main launch (DDP's two rows differ by what Horovod's thread costs
it, among others).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import glob
import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from ..paths import user_path
from ..train import COMPRESSION, check_batch_fits, use_power_sgd
from .horovod import anchor_python
from .horovod import launch as launch_horovod
from .machine import check_out_dir, check_ranks, plural, reserve_stamp, run_stamp, utc_now
from .netem import NetemUnavailable
from .procs import (RankFailed, check_hosts, emit, emulated, interrupted, interruption, network, progress, run_ranks,
                    signals_held)

SCHEDULES = ("optimal", "mgwfbp", "wfbp", "fixed", "single")
WARMUP_STEPS = 5
#: Enough for the optimal wrapper's whole trial: warm-up and profile (3), three probes and one
#: allreduce of 5 iterations each, then up to VERIFY_ROUNDS rounds of 5 per candidate (128 with
#: all seven candidates).
MAX_WARMUP_STEPS = 140
SWEEP_REPEATS = 7
TIMELINE_STEPS = 3
#: Steps each parameter-server job takes before its timed ones (the first pushes every
#: parameter alone to time backward; the second is the first with the planned groups).
PS_WARMUP_STEPS = 2
NETS = ("none", "1gbit", "10gbit")
#: The rows of the optimal schedule with ``--compression``, and every ringtrain wrapper's.
COMPRESSED = "ringtrain-compressed"
#: Why torch's DDP with powerSGD_hook has no row (its reducer calls the hook of a bucket while
#: the hooks of the buckets before it still send from their futures' callbacks).
POWER_SGD_NOTE = ("torch's DDP with powerSGD_hook is not timed: its hook sends from its futures' callbacks while "
                  "the next bucket's hook sends from backward, so with more than one bucket the ranks issue them "
                  "in different orders and gloo aborts the process on the mismatch (a 12-layer MLP of 3 MB: "
                  "2 runs in 3); ringtrain's wrapper runs the hook one bucket at a time")
WRAPPERS = ("ringtrain", COMPRESSED)
TORCH_DDP_RINGTRAIN = "torch-ddp-ringtrain"
"""torch's DDP over ringtrain.TorchProcessGroup: torch's buckets and reducer, ringtrain's collectives."""
#: Seeds the order of each turn of the timed steps (the same on every rank).
TURN_ORDER_SEED = 20261129
#: The rows of the Horovod launch: Horovod's DistributedOptimizer, and torch's DDP beside it.
HOROVOD = "horovod"
HOROVOD_DDP = "torch-ddp-horovod-launch"
#: How far (a share of the distance training moved DDP's copy from the initial weights) Horovod's
#: copy may end from DDP's after the same steps on the same batches: rounding takes ~1e-6 of it,
#: a gradient summed instead of averaged or left out the whole distance.
HOROVOD_TOLERANCE = 1e-2


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="charlm,resnet,mlp", help="reference models (ringtrain.models; default %(default)s)")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="ringtrain schedules to time (default %(default)s)")
    p.add_argument("--strategies", default="ring", help="ring (every --schedules entry), ring-SCHEDULE (the ring "
                   "with that schedule, e.g. ring-optimal) and parameter servers: "
                   "ps-sync, ps-async, ps-sharded, each with :K for K servers (K defaults to 1, and to 2 for "
                   "ps-sharded), e.g. ring,ps-sync,ps-sharded:2,ps-async (default %(default)s)")
    p.add_argument("--no-torch-ddp", action="store_true", help="leave out torch's DDP anchor (of the main launch; "
                   "the Horovod launch keeps its own)")
    p.add_argument("--no-horovod", action="store_true", help="skip the Horovod anchor")
    p.add_argument("--horovod-python", default=None, metavar="PYTHON", type=user_path,
                   help="the interpreter that runs the Horovod anchor, one that imports horovod.torch (default: "
                        "this one; scripts/horovod/install.sh builds Horovod into .venv-horovod/): a launch of its "
                        "own after the ring job, Horovod and torch DDP taking turns")
    p.add_argument("--compression", default="none", choices=COMPRESSION, help="also time the optimal "
                   "schedule with gradients in this half precision on the wire, and torch's DDP with the "
                   "matching compression hook; powersgd: the optimal schedule with torch's powerSGD_hook, "
                   "rank 1 (default %(default)s)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default %(default)s)")
    p.add_argument("--net", default="none", choices=NETS, help="emulate a network: one namespace per rank, tc tbf "
                   "(default %(default)s)")
    p.add_argument("--transport", default="auto", help="ringtrain transport (default %(default)s)")
    p.add_argument("--algorithm", default="auto", help="ringtrain allreduce algorithm (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=0, help="per-rank batch (default 0: each model's own)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration per round, the "
                   "configurations taking turns step by step (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of --steps turns over all configurations "
                   "(parameter-server jobs: one job per configuration per round) (default %(default)s)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are killed (default %(default)g)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--out", default="benchmarks", type=user_path, help="directory for results and charts (default %(default)s; '' to skip)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--horovod-worker", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(json.loads(args.worker))
    if args.horovod_worker:
        return _horovod_worker(json.loads(args.horovod_worker))
    try:
        names, schedules, strategies = _settings(args)
        # the most processes one job starts: the ring's ranks, or the workers and servers of a ps job
        nprocs = args.world_size + max([servers for _, servers in strategies.get("ps", [])], default=0)
        check_hosts("--world-size", nprocs, args.net)
        warning = check_ranks("--world-size", nprocs)
        out_dir = check_out_dir(args.out) if args.out else None
    except ValueError as exc:
        raise SystemExit(f"ringtrain bench train: {exc}")
    if warning:
        print(f"ringtrain bench train: warning: {warning}", file=sys.stderr)
    kind = f"train-{args.net}-{args.world_size}r"
    # The stamp names the result, its charts and its timelines; held until the run ends, so that a
    # run started in the same second takes another (the timelines are written long before the result).
    started = utc_now()  # (the result's "started" and "when")
    with reserve_stamp(out_dir, kind, run_stamp(started)) as stamp:
        return _run(args, names, schedules, strategies, out_dir, kind, started, stamp)


def _run(args: argparse.Namespace, names: list[str], schedules: list[str], strategies: dict, out_dir: Path | None,
         kind: str, started: datetime.datetime, stamp: str) -> int:
    """The run (``run``'s checked settings) begun at ``started``: its jobs, then its result saved
    as ``<kind>-<stamp>.json`` and printed; the exit status."""
    cfg = {
        "models": names, "schedules": schedules, "torch_ddp": not args.no_torch_ddp,
        "compression": None if args.compression == "none" else args.compression,
        "transport": "tcp" if (args.net != "none" and args.transport == "shm") else args.transport,
        "algorithm": args.algorithm, "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds,
        "timeline_dir": str(out_dir / "timelines") if out_dir else "", "timeline_stem": f"{kind}-{stamp}",
    }
    notes = []
    # the interpreter that runs the Horovod anchor, None when it is skipped (and the note why)
    horovod, note = anchor_python(args.no_horovod, args.horovod_python)
    if note:
        notes.append(note)
        if args.horovod_python:  # (asked for by name: said now, while the run can still be stopped, and in the notes)
            print(f"ringtrain bench train: {note}", file=sys.stderr)
    if cfg["compression"] == "powersgd" and cfg["torch_ddp"]:
        notes.append(POWER_SGD_NOTE)
    if cfg["transport"] != args.transport:
        notes.append(f"--transport shm: under --net {args.net} each rank is a host of its own and shared memory "
                     "cannot cross them; tcp timed instead")
    timelines = Path(cfg["timeline_dir"]) if out_dir else None
    rows: list[dict] = []
    ps_runs: dict[tuple, list[dict]] = {}
    stopped, failure = None, None  # why the run ended before its last job, if it did
    try:
        _measure(cfg, names, strategies, args, rows, ps_runs, horovod, notes)
    except KeyboardInterrupt:  # the ranks and namespaces are gone with the with-blocks that made them
        stopped = f"interrupted ({interruption()})"
    except (RankFailed, NetemUnavailable) as exc:  # (a rank that failed, --timeout, or a later job's
        # network that could not be made: its first line says which)
        stopped, failure = f"stopped ({str(exc).splitlines()[0].rstrip(':')})", exc  # (the log tail left out)
    finally:
        if timelines is not None:
            with contextlib.suppress(OSError):
                timelines.rmdir()  # only when empty: the wrappers make it before any timeline is written
    from .machine import print_result, result_document, save_result

    with signals_held() as came:  # (a Ctrl-C now waits until the rows are saved)
        rows += [_ps_row(docs, args) for docs in ps_runs.values()]
        _predict_ps(rows)
        # the timelines of the models the run stopped in: kept, as said (the error comes last)
        partial = partial_timelines(timelines, cfg["timeline_stem"], names, rows) if stopped else []
        if stopped and not rows:
            kept = "nothing saved" + (f" but {_partial_note(partial)}" if partial else "")
            if failure is not None:
                if partial:
                    print(f"ringtrain bench train: {kept}", file=sys.stderr)
                raise failure
            return interrupted("ringtrain bench train", kept)
        if stopped:
            notes.append(f"{stopped} before the run ended: the rows finished by then, of "
                         f"{', '.join(dict.fromkeys(r['model'] for r in rows))}")
        if partial:
            notes.append(_partial_note(partial))
        # One document, saved and printed: --json's stdout records the machine too (with --out '' only it does).
        doc = result_document(kind, {"net": args.net, "network": network(args.net), "world_size": args.world_size,
                                     "rows": rows, "notes": notes}, started=started)
        kept = "the rows finished so far printed"
        if out_dir:
            path = save_result(kind, doc, out_dir, stamp=stamp)
            doc["saved_to"] = str(path)
            kept = f"the rows finished so far saved to {path}"
    if came and not stopped:
        print_result(doc, format_table(rows), args.json)
        return interrupted("ringtrain bench train", f"after the run; {kept}")
    if out_dir:
        try:
            doc["charts"] = _charts(rows, path.with_suffix(""))
        except KeyboardInterrupt:
            print_result(doc, format_table(rows), args.json)
            return interrupted("ringtrain bench train", f"while drawing the charts; the results saved to {path}")
    print_result(doc, format_table(rows), args.json)
    if failure is not None:
        print(f"ringtrain bench train: {failure}", file=sys.stderr)
        return 1
    return interrupted("ringtrain bench train", kept) if stopped else 0


def partial_timelines(timelines: Path | None, stem: str, models: list[str], rows: list[dict]) -> list[Path]:
    """The run's timeline files (``<stem>-<model>.rank<r>.json`` in ``timelines``, for each of its
    ``models``: not those of a run started in the same second, ``<stem>-<pid>-...``) of the models
    it stopped in, those with no row naming their timeline: partial where the ranks were stopped
    while they wrote them (some iterations, or some ranks, missing), in the model's warm-up. A
    finished model's are whole."""
    if timelines is None:
        return []
    whole = {Path(r["timeline"]).name.partition(".rank")[0] for r in rows if r.get("timeline")}
    return [f for m in models if f"{stem}-{m}" not in whole for f in rank_files(timelines / f"{stem}-{m}.rank0.json")]


def rank_files(rank0: Path) -> list[Path]:
    """The trace files of every rank beside ``rank0`` (``<name>.rank0.json``), by rank: rank 2's
    before rank 10's, as the timeline picture stacks their lanes."""
    head = rank0.name.removesuffix("rank0.json")

    def rank(path: Path) -> int:
        middle = path.name[len(head):].removeprefix("rank").removesuffix(".json")
        return int(middle) if middle.isdigit() else -1

    return sorted((f for f in rank0.parent.glob(f"{glob.escape(head)}rank*.json") if rank(f) >= 0), key=rank)


def _partial_note(files: list[Path]) -> str:
    """What is said of ``files`` (:func:`partial_timelines`), kept where they are."""
    return (f"timelines of the models the run stopped in (partial where it stopped while they were written) "
            f"kept in {files[0].parent}: {', '.join(f.name for f in files)}")


def _measure(cfg: dict, names: list[str], strategies: dict, args: argparse.Namespace, rows: list[dict],
             ps_runs: dict[tuple, list[dict]], horovod: str | None = None, notes: list[str] | None = None) -> None:
    """Measure into ``rows`` the ring job's rows (every schedule, alone, torch DDP), model by model
    as its rank 0 sends them, then the Horovod launch's (when ``horovod`` names its interpreter;
    what went wrong with it goes to ``notes``), and into ``ps_runs`` each parameter-server job's
    documents, job by job: a run stopped early keeps in them what it finished."""
    def arrived(doc: dict) -> None:
        rows.extend(dict(r, net=args.net, world_size=args.world_size) for r in doc["rows"])

    if cfg["schedules"]:  # the ring job (ring, ring-SCHEDULE): its schedules, alone and torch DDP
        _launch("ringtrain.cli", ["bench", "train", "--worker", json.dumps(cfg)], args.world_size, args,
                on_result=arrived)
    if horovod:
        note = _launch_horovod(names, args, horovod, arrived)
        if note and notes is not None:
            notes.append(note)
    # Parameter-server jobs take turns round by round, as the ring's schedules do step by
    # step, so that 1 and 2 servers meet the same load; each job warms up for PS_WARMUP_STEPS.
    for r in range(args.rounds if strategies.get("ps") else 0):
        for strategy, servers in strategies["ps"]:
            for name in names:
                print(f"# {name}, ps-{strategy}:{servers}: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                ps_args = ["--servers", str(servers), "--strategy", strategy, "--model", name,
                           "--steps", str(args.steps + PS_WARMUP_STEPS)]
                if args.batch_size:
                    ps_args += ["--batch-size", str(args.batch_size)]
                docs = _launch("ringtrain.ps", ps_args, args.world_size + servers, args)
                ps_runs.setdefault((name, strategy, servers), []).extend(docs)


def _settings(args: argparse.Namespace) -> tuple[list[str], list[str], dict]:
    """The checked models, schedules and strategies; the other flags checked (ValueError naming the flag)."""
    from .. import models
    from ..comm import ALGORITHMS
    from ..transport import TRANSPORTS
    from .allreduce import csv_choices, unique

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if not names:
        raise ValueError(f"--models: give at least one reference model, got {args.models!r}")
    try:
        resolved = [models.spec(m).name for m in names]
    except ValueError as exc:
        raise ValueError(f"--models: {exc}") from None
    unique(resolved, "--models")  # (an alias and its model are one model)
    schedules = csv_choices(args.schedules, SCHEDULES, "--schedules")
    if args.world_size < 2:
        raise ValueError(f"--world-size must be >= 2, got {args.world_size}")
    if args.transport not in TRANSPORTS:
        raise ValueError(f"--transport must be one of {TRANSPORTS}, got {args.transport!r}")
    if args.algorithm not in ALGORITHMS:
        raise ValueError(f"--algorithm must be one of {ALGORITHMS}, got {args.algorithm!r}")
    for opt in ("steps", "rounds"):
        if getattr(args, opt) < 1:
            raise ValueError(f"--{opt} must be >= 1")
    if args.batch_size < 0:
        raise ValueError("--batch-size must be >= 0")
    for name in names:  # (too big: each rank's loader refused it, a traceback once they had started)
        check_batch_fits(name, args.batch_size, args.world_size, workers_flag="--world-size")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout: seconds before the ranks are killed must be finite and > 0, got {args.timeout}")
    strategies = parse_strategies(args.strategies)
    if strategies.get("ring_schedules") and not strategies.get("ring") and args.schedules != ",".join(SCHEDULES):
        raise ValueError(f"--schedules {args.schedules} is for --strategies ring; the ring-SCHEDULE strategies "
                         "name the ring's schedules themselves (add ring, or name them as ring-SCHEDULE)")
    ring = ring_schedules(strategies, schedules)
    if not ring:  # (only parameter servers: no ring job, which alone reads these)
        given = [flag for flag, changed in (
            ("--schedules", args.schedules != ",".join(SCHEDULES)), ("--compression", args.compression != "none"),
            ("--algorithm", args.algorithm != "auto"), ("--transport", args.transport != "auto"),
            ("--no-torch-ddp", args.no_torch_ddp)) if changed]
        if given:
            verb = "is" if len(given) == 1 else "are"
            raise ValueError(f"{', '.join(given)} {verb} for the ring's job, and --strategies {args.strategies} runs "
                             "none (parameter servers only): add ring or ring-SCHEDULE, or leave them out")
    return names, ring, strategies


def parse_strategies(text: str) -> dict:
    """'ring,ps-sync,ps-sharded:2' -> {'ring': True, 'ps': [('sync', 1), ('sharded', 2)]}.

    ``ring`` times every --schedules entry; ``ring-S`` the ring with schedule S (``ring-optimal``),
    listed under 'ring_schedules' (see :func:`ring_schedules`).
    """
    out: dict = {}
    known = "ring, ring-SCHEDULE, ps-sync, ps-async, ps-sharded:K"
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, k = item.partition(":")
        if name == "ring" and not k:
            out["ring"] = True
            continue
        if name.startswith("ring-") and not k:
            schedule = name.removeprefix("ring-")
            if schedule not in SCHEDULES:
                raise ValueError(f"--strategies: {item!r}: the ring's schedule must be one of {', '.join(SCHEDULES)}")
            if schedule in out.get("ring_schedules", []):
                raise ValueError(f"--strategies: {item!r} given twice")
            out.setdefault("ring_schedules", []).append(schedule)
            continue
        if name not in ("ps-sync", "ps-async", "ps-sharded"):
            raise ValueError(f"--strategies: {item!r} is not one of {known}")
        try:
            servers = int(k) if k else (2 if name == "ps-sharded" else 1)
        except ValueError:
            raise ValueError(f"--strategies: the server count in {item!r} must be an integer") from None
        if servers < 1:
            raise ValueError(f"--strategies: {item!r} needs at least one server")
        job = (name.removeprefix("ps-"), servers)
        if job in out.get("ps", []):
            raise ValueError(f"--strategies: {item!r} given twice (as {name}:{servers})")
        out.setdefault("ps", []).append(job)
    if not out:
        raise ValueError(f"--strategies: give at least one of {known}")
    return out


def ring_schedules(strategies: dict, schedules: list[str]) -> list[str]:
    """The ring job's schedules, in the order given: every --schedules entry (``schedules``) for
    ``ring``, then each ``ring-S``'s S not among them; none without a ring strategy."""
    chosen = list(schedules) if strategies.get("ring") else []
    return chosen + [s for s in strategies.get("ring_schedules", []) if s not in chosen]


def _launch(module: str, module_args: list[str], nprocs: int, args, on_result=None) -> list[dict]:
    with emulated(args.net, nprocs) as net:
        return run_ranks(module, module_args, nprocs, timeout=args.timeout, net=net, on_result=on_result)


def _launch_horovod(names: list[str], args, python: str, on_result) -> str | None:
    """The Horovod launch (see the module docstring) under ``python``: its rows to ``on_result``
    model by model; None, or the note saying why it failed (``bench.horovod.launch``)."""
    hcfg = {"models": names, "batch_size": args.batch_size, "steps": args.steps, "rounds": args.rounds}
    print(f"# the Horovod anchor: {plural(len(names), 'model')}, Horovod and torch DDP taking turns",
          file=sys.stderr, flush=True)
    return launch_horovod(python, ["bench", "train", "--horovod-worker", json.dumps(hcfg)], args.world_size,
                          rate=args.net, timeout=args.timeout, on_result=on_result)


def _ps_row(docs: list[dict], args) -> dict:
    """The rounds of one parameter-server configuration as a row of the table.

    Each round's first PS_WARMUP_STEPS steps are left out; the median is over the other steps of
    every round (rank 0's: a synchronous step ends on every worker at once). Bytes and waits are
    rank 0's, summed over rounds with every step counted; losses are the first round's.
    """
    stats = [d.get("stats") or {} for d in docs]
    timed = [d["step_s"][PS_WARMUP_STEPS:] for d in docs]
    steady = [t for ts in timed for t in ts]
    med = float(np.median(steady))
    total_steps = sum(len(d["step_s"]) for d in docs)

    def summed(key):
        values = [s.get(key) for s in stats]
        return None if any(v is None for v in values) else sum(values)

    per_server: dict[str, dict] = {}
    hist: dict[int, int] = {}
    for s in stats:
        for k, v in (s.get("bytes_per_server") or {}).items():
            into = per_server.setdefault(k, {"sent": 0, "received": 0})
            into["sent"] += v["sent"]
            into["received"] += v["received"]
        for k, v in (s.get("staleness_histogram") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + v
    d = docs[0]
    pull_wait = summed("pull_wait_s")
    per_step = [x["bytes_per_step"] for x in docs if x.get("bytes_per_step")]
    return {
        "model": d["model"], "impl": "ps", "schedule": f"ps-{d['strategy']}:{d['servers']}",
        "batch_size": d["batch_size"], "median_iter_s": med, "iter_s": steady,
        "round_medians": [float(np.median(t)) for t in timed], "steps_total": total_steps,
        "samples_per_s": d["workers"] * d["batch_size"] / med, "net": args.net, "world_size": d["workers"],
        "servers": d["servers"], "worker_bytes_sent": summed("bytes_sent"),
        "worker_bytes_received": summed("bytes_received"), "bytes_per_server": per_server or None,
        # rank 0's bytes each way per step, without the first step's whole-model INIT and pull
        "worker_bytes_per_step": {k: float(np.mean([x[k] for x in per_step])) for k in ("sent", "received")}
        if per_step else None,
        "staleness_histogram": {str(k): v for k, v in sorted(hist.items())},
        "losses": d.get("losses"),
        # forward's waits for pulled parameters, per step (rank 0; the counter spans every step)
        "pull_wait_s": None if pull_wait is None else pull_wait / total_steps,
    }


def _predict_ps(rows: list[dict]) -> None:
    """Add the simulator's prediction to each synchronous parameter-server row: the model's trace
    from the ring job of the same run (compute alone, per parameter tensor), the link from that
    job's allreduce sweep (``sim.costs.link_from_fit`` on its larger messages), the servers'
    cost ``sim.costs`` "ps" and the workers' own plan (optimal). Rows stay without one when the
    run has no ring job for the model; asynchronous rows are not modelled."""
    from ..sim import costs
    from ..sim.simulator import predict_with_cost

    for r in rows:
        if r["impl"] != "ps" or r["schedule"].startswith("ps-async"):
            continue
        measured = ring_link(rows, r["model"])
        if measured is None or measured[1] != r["world_size"]:
            continue
        trace, p, alpha, beta = measured
        cost = costs.allreduce_cost(p, "ps", alpha=alpha, beta=beta, servers=r["servers"])
        pred = predict_with_cost(trace, cost, p, "optimal", algorithm="ps")
        r["sim_iter_s"] = pred.iteration_s
        r["sim_error"] = (pred.iteration_s - r["median_iter_s"]) / r["median_iter_s"]


def ring_link(rows: list[dict], model: str):
    """What a run measured of ``model`` for the simulator: its compute-alone layer trace, the ring
    job's world size and the link (alpha, beta) of that job's allreduce sweep
    (``sim.costs.link_from_fit`` on its larger messages); None where the run has no ring job or
    no trace for it."""
    from ..sim.costs import link_from_fit
    from ..sim.traces import Trace

    alone = next((a for a in rows if a["model"] == model and a["impl"] == "alone" and "trace" in a), None)
    ring = next((a for a in rows if a["model"] == model and a["impl"] == "ringtrain" and a.get("cost")), None)
    if alone is None or ring is None:
        return None
    fit = ring["cost"].get("large", ring["cost"])
    p = ring["world_size"]
    return (Trace.from_dict(alone["trace"]), p, *link_from_fit(fit["alpha"], fit["beta"], p))


# --- worker ------------------------------------------------------------------------------------


def _worker(cfg: dict) -> int:
    from ..lifecycle import die_with_parent

    die_with_parent()
    import datetime

    import torch
    import torch.distributed as dist

    import ringtrain

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, p = dist.get_rank(), dist.get_world_size()
    comm = ringtrain.init(transport=cfg["transport"], timeout=300)
    for name in cfg["models"]:
        # this model's rows, sent to the parent as soon as they are known (a run cut short keeps them)
        rows = _model_rows(cfg, name, comm, rank, p)
        if rank == 0:
            emit({"rows": rows})
    comm.close()
    dist.destroy_process_group()
    return 0


def _model_rows(cfg: dict, name: str, comm, rank: int, p: int) -> list[dict]:
    """Model ``name``'s rows: every configuration built, warmed up and timed taking turns step by
    step, then described (with the simulator's and the planner's predictions); its wrappers closed."""
    from ..sim.traces import profile_module

    batch, base, batches = _workload(cfg, name, rank, p)
    # Layer proportions from a profile; the absolute compute time comes from the "alone"
    # configuration timed in the same interleaved rounds as training (same CPU load).
    twin = copy.deepcopy(base)
    profiled = profile_module(twin, lambda: batches[0], twin.loss, name=name, repeats=3,
                              optimizer=_sgd(twin.parameters()),
                              batch_size=batch)
    cost = _sweep_cost(comm, cfg["algorithm"], base)
    configs = _configurations(cfg, name, base, comm, cost)
    if rank == 0:
        progress(f"# {name}: warming up {len(configs)} configurations (calibration, plans, trials)")
    _warm_up(configs, batches)
    optimal = next((c["wrapped"] for c in configs if c["schedule"] == "optimal"), None)
    # The interference the optimal wrapper's probes measured, for every schedule's prediction.
    slow = optimal.interference if optimal is not None else None
    _time_rounds(cfg, name, configs, batches, rank)
    medians = _gather_times(configs, p)
    compute_only = medians["alone", "no communication"]
    trace, sim_trace = _traces(configs, profiled, compute_only, base)
    params = int(sum(q.numel() for q in base.parameters()))
    rows = []
    for c in configs:
        row = _row(c, name, batch, p, params, compute_only, trace)
        if c["impl"] == "ringtrain":
            row.update(_ring_fields(c, row["median_iter_s"], p, trace, sim_trace, cost, cfg["algorithm"], slow))
        elif c["impl"] == COMPRESSED:
            row.update(_compressed_fields(c))
        elif c["impl"] == "alone":  # the simulator's input for the parameter-server rows
            row["trace"] = trace.to_dict()
        rows.append(row)
    for c in configs:
        if c["impl"] in WRAPPERS:
            c["wrapped"].close()
        if "group" in c:
            c["group"].close()
    return rows


def _workload(cfg: dict, name: str, rank: int, p: int):
    """Model ``name``'s batch size, its model (seed 0) and this rank's 4 batches of its data."""
    from .. import data, models

    spec = models.spec(name)
    batch = cfg["batch_size"] or spec.batch_size
    base = models.build(name, seed=0)
    ds = data.dataset(spec.dataset, seed=0, **spec.batch_kwargs)
    loader = data.ShardedLoader(ds, batch, rank=rank, world_size=p, seed=0)
    return batch, base, [loader.next_batch() for _ in range(4)]


def _sweep_cost(comm, algorithm: str, base):
    """One cost sweep (7 repeats per size) for every wrapper: all schedules plan with the
    same measurement, the optimal one fits its interference against it, and the simulator
    predicts with it (a wrapper's own 3-repeat sweep can be off by 2x in alpha, 25% in beta)."""
    from ..ddp import calibration

    grad_bytes = float(sum(q.numel() * q.element_size() for q in base.parameters() if q.requires_grad))
    return calibration.sweep_cost(comm, algorithm, calibration.sweep_sizes(grad_bytes), repeats=SWEEP_REPEATS)


def _configurations(cfg: dict, name: str, base, comm, cost) -> list[dict]:
    """The timed configurations, each on its own copy of ``base`` with its own SGD: ringtrain's
    wrapper under every schedule (the optimal one records a timeline if asked), the model alone,
    and torch's DDP unless left out, over gloo and over ringtrain's TorchProcessGroup."""
    import torch

    import ringtrain

    configs = []
    for sched in cfg["schedules"]:
        model = copy.deepcopy(base)
        timeline = ""
        if sched == "optimal" and cfg["timeline_dir"]:
            timeline = str(Path(cfg["timeline_dir"]) / f"{cfg['timeline_stem']}-{name}.json")
        ddp = ringtrain.DistributedDataParallel(model, comm=comm, schedule=sched, algorithm=cfg["algorithm"],
                                                timeline=timeline or None, timeline_iterations=TIMELINE_STEPS,
                                                cost=cost)
        configs.append(_config("ringtrain", sched, model, ddp))
    alone = copy.deepcopy(base)
    configs.append(_config("alone", "no communication", alone, alone))
    if cfg["torch_ddp"]:
        model = copy.deepcopy(base)
        configs.append(_config("torch-ddp", "torch defaults (25 MiB)", model,
                               torch.nn.parallel.DistributedDataParallel(model)))
        # torch's DDP again, its collectives ringtrain's (the group runs them on comm between the
        # other configurations' steps, which leave it idle).
        model, group = copy.deepcopy(base), ringtrain.TorchProcessGroup(comm, algorithm=cfg["algorithm"])
        configs.append(_config(TORCH_DDP_RINGTRAIN, "torch defaults (25 MiB)", model,
                               torch.nn.parallel.DistributedDataParallel(model, process_group=group), group=group))
    if cfg.get("compression"):
        configs += _compressed_configurations(cfg["compression"], base, comm, cost, cfg["algorithm"], cfg["torch_ddp"])
    return configs


def _compressed_configurations(compression: str, base, comm, cost, algorithm: str, torch_ddp: bool) -> list[dict]:
    """The optimal schedule with gradients in half precision on the wire, and (``torch_ddp``)
    torch's DDP with its defaults and the matching compression hook (bf16: the hook's steps;
    torch refuses its own off CUDA with NCCL); ``powersgd``: the optimal schedule with torch's
    ``powerSGD_hook`` (``ringtrain.train.POWER_SGD``), alone (``POWER_SGD_NOTE``)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import ringtrain

    model = copy.deepcopy(base)
    if compression == "powersgd":
        ddp = ringtrain.DistributedDataParallel(model, comm=comm, algorithm=algorithm, cost=cost)
        use_power_sgd(ddp)
        return [_config(COMPRESSED, f"optimal+{compression}", model, ddp)]
    ddp = ringtrain.DistributedDataParallel(model, comm=comm, algorithm=algorithm, cost=cost, compression=compression)
    configs = [_config(COMPRESSED, f"optimal+{compression}", model, ddp)]
    if not torch_ddp:
        return configs
    model = copy.deepcopy(base)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook if compression == "fp16" else bf16_hook)
    configs.append(_config("torch-ddp-compressed", f"torch defaults + {compression}_compress_hook", model, wrapped))
    return configs


def _config(impl: str, schedule: str, model, wrapped, **more) -> dict:
    """One timed configuration: ``wrapped`` over ``model`` (its own copy of the base model), with
    its own _sgd."""
    return {"impl": impl, "schedule": schedule, "model": model, "wrapped": wrapped, "opt": _sgd(model.parameters()),
            **more}


def _sgd(params):
    """The optimizer of every configuration and of the profile (the same settings, or their steps
    would differ)."""
    import torch

    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def bf16_hook(state, bucket):
    """torch's ``bf16_compress_hook``, step for step, for gloo on the CPU (torch's own refuses
    anything but NCCL on CUDA): round to bfloat16, divide by the world size, sum, copy back."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    half = buf.to(torch.bfloat16).div_(dist.get_world_size())

    def decompress(fut):
        buf.copy_(fut.value()[0])
        return buf

    return dist.all_reduce(half, async_op=True).get_future().then(decompress)


def _median(stats: list, name: str):
    """The median of field ``name`` of a wrapper's IterationStats (None without any)."""
    return float(np.median([getattr(s, name) for s in stats])) if stats else None


def _compressed_fields(c: dict) -> dict:
    """A compressed wrapper's plan and its own account of the timed iterations (the simulator's
    and the bound's figures are for full-precision bytes: none here)."""
    stats = c["stats"]
    return dict(groups=len(c["wrapped"].plan.groups), kept=c["wrapped"].kept,
                hidden_fraction=_median(stats, "hidden_fraction"),
                comm_s=_median(stats, "comm_s"))


def _step(c: dict, batches: list, k: int) -> None:
    """One training step of configuration ``c`` on batch ``k`` (cycling through ``batches``); its
    forward, backward() and SGD step times appended to ``c["parts"]``."""
    x, y = batches[k % len(batches)]
    t0 = time.perf_counter()
    c["opt"].zero_grad()  # (gradients set to None, torch's default; Horovod's optimizer takes no argument)
    loss = c["model"].loss(c["wrapped"](x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    c["opt"].step()
    c.setdefault("parts", []).append((t1 - t0, t2 - t1, time.perf_counter() - t2))


def _warm_up(configs: list[dict], batches: list) -> None:
    """Warm-up: calibration, profiling, the plan and its trial (probes, verification)."""
    for c in configs:
        for k in range(WARMUP_STEPS):
            _step(c, batches, k)
        k = WARMUP_STEPS
        while c["impl"] in WRAPPERS and not c["wrapped"].settled and k < MAX_WARMUP_STEPS:
            _step(c, batches, k)  # every rank takes the same number of steps: settled agrees across ranks
            k += 1
        if c["impl"] in WRAPPERS and c["wrapped"].timeline_path is not None:
            for j in range(TIMELINE_STEPS):  # the timeline is recorded here, not in timed steps
                _step(c, batches, k + j)


def _time_rounds(cfg: dict, name: str, configs: list[dict], batches: list, rank: int) -> None:
    """The timed steps, ``cfg["rounds"]`` rounds of ``cfg["steps"]`` each, the configurations
    taking turns (``turns``): each step's time into ``c["times"]``, its parts into ``c["parts"]``."""
    import torch.distributed as dist

    for c in configs:  # one untimed step each: the first timed round then finds every
        _step(c, batches, 0)  # configuration as the later rounds do (optimal came long before)
        c["times"], c["parts"] = [], []
    for r in range(cfg["rounds"]):
        for k, i in turns(len(configs), cfg["steps"], r):
            c = configs[i]
            # Every step starts on all ranks at once, as after a training step's allreduce:
            # "alone" then runs its memory-bound phases (the SGD step) side by side as training
            # does, on the cores and memory the ranks share (ranks left to drift apart
            # overlap one's step with another's matrix products, and are faster for it).
            dist.barrier()
            t0 = time.perf_counter()
            _step(c, batches, k)
            c["times"].append(time.perf_counter() - t0)
        if rank == 0:
            progress(f"# {name}: round {r + 1}/{cfg['rounds']} done")


# --- the Horovod launch's worker (under the Horovod interpreter) ------------------------------


def _horovod_worker(cfg: dict) -> int:
    """One rank of the Horovod launch: Horovod over gloo (its variables from ``bench.horovod``)
    and torch's gloo process group beside it (torchrun's variables, another port), model by
    model; rank 0 sends each model's two rows as soon as they are known."""
    from ..lifecycle import die_with_parent

    die_with_parent()
    import datetime

    import horovod.torch as hvd
    import torch
    import torch.distributed as dist

    hvd.init()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, p = dist.get_rank(), dist.get_world_size()
    if (hvd.rank(), hvd.size()) != (rank, p):
        raise RuntimeError(f"Horovod's rank {hvd.rank()} of {hvd.size()} is not torch's {rank} of {p}: "
                           "the launch gave them different places")
    for name in cfg["models"]:
        rows = _horovod_model_rows(cfg, name, rank, p)
        if rank == 0:
            emit({"rows": rows})
    dist.destroy_process_group()
    hvd.shutdown()
    return 0


def _horovod_model_rows(cfg: dict, name: str, rank: int, p: int) -> list[dict]:
    """Model ``name`` trained by Horovod's DistributedOptimizer and by torch's DDP, each on its own
    copy of the same model and the same batches as in the main launch, warmed up, then timed taking
    turns step by step (``_time_rounds``), both checked; their rows."""
    import horovod
    import horovod.torch as hvd
    import torch

    batch, base, batches = _workload(cfg, name, rank, p)
    model = copy.deepcopy(base)
    # Horovod's defaults (fusion buffer, cycle time, averaging), as its examples set it up: each
    # gradient named after its parameter (here under the model's name: the names of one model's
    # tensors must not meet another's in Horovod's response cache), rank 0's state broadcast first.
    opt = hvd.DistributedOptimizer(_sgd(model.parameters()),
                                   named_parameters=[(f"{name}.{n}", q) for n, q in model.named_parameters()])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    horovod_ = dict(_config(HOROVOD, f"hvd.DistributedOptimizer (Horovod {horovod.__version__} defaults)", model,
                            model), opt=opt)
    model = copy.deepcopy(base)
    ddp = _config(HOROVOD_DDP, "torch defaults (25 MiB)", model, torch.nn.parallel.DistributedDataParallel(model))
    configs = [horovod_, ddp]
    if rank == 0:
        progress(f"# {name} (Horovod launch): warming up Horovod and torch DDP")
    _warm_up(configs, batches)
    check_horovod(name, base, horovod_["model"], ddp["model"])  # before the timing, and after it
    _time_rounds(cfg, f"{name} (Horovod launch)", configs, batches, rank)
    check_horovod(name, base, horovod_["model"], ddp["model"])
    medians = _gather_times(configs, p)
    rows = [_launch_row(c, name, batch, p) for c in configs]
    rows[0]["horovod_over_ddp"] = medians[HOROVOD, horovod_["schedule"]] / medians[HOROVOD_DDP, ddp["schedule"]]
    return rows


def check_horovod(name: str, base, horovod_model, ddp_model, tolerance: float = HOROVOD_TOLERANCE) -> None:
    """Raise (on every rank alike) unless Horovod's copy of ``base`` is the same on every rank and
    ends within ``tolerance`` of DDP's, as a share of the distance DDP's moved from ``base``: both
    took the same steps on the same batches, so only rounding may part them."""
    import torch
    import torch.distributed as dist

    def flat(module) -> torch.Tensor:
        return torch.cat([q.detach().reshape(-1).double() for q in module.parameters()])

    mine, theirs, start = flat(horovod_model), flat(ddp_model), flat(base)
    root = mine.clone()
    dist.broadcast(root, 0)
    apart = torch.tensor([float((mine - root).abs().max())], dtype=torch.float64)
    dist.all_reduce(apart, op=dist.ReduceOp.MAX)
    if apart.item() > 0:
        raise RuntimeError(f"Horovod's copies of {name} differ across ranks (by up to {apart.item():.3g}): its "
                           "DistributedOptimizer did not apply the same averaged gradients everywhere")
    moved = float((theirs - start).norm())
    gap = float((mine - theirs).norm())
    if gap > tolerance * moved:
        raise RuntimeError(f"Horovod's copy of {name} ended {gap:.3g} from torch DDP's after the same steps, "
                           f"{gap / moved if moved else float('inf'):.3g} of the {moved:.3g} training moved DDP's "
                           f"(more than {tolerance:g}): they did not apply the same averaged gradients")


def _launch_row(c: dict, name: str, batch: int, p: int) -> dict:
    """A row of the Horovod launch: its times (the slowest rank's) and where they went."""
    t = c["times_max"]
    med = float(np.median(t.numpy()))
    return {"model": name, "impl": c["impl"], "schedule": c["schedule"], "launch": "horovod", "batch_size": batch,
            "median_iter_s": med, "iter_s": t.tolist(), "samples_per_s": p * batch / med,
            "measured_forward_s": c["parts_s"][0], "measured_backward_call_s": c["parts_s"][1],
            "measured_step_s": c["parts_s"][2]}


def _gather_times(configs: list[dict], p: int) -> dict[tuple[str, str], float]:
    """Each configuration's times across ranks: ``parts_s``, ``times_max`` and (for ringtrain)
    ``stats`` set on it; returns the median iteration by (impl, schedule)."""
    import torch
    import torch.distributed as dist

    medians = {}
    for c in configs:
        # This rank's forward, backward() and step medians, averaged over ranks: where the time goes.
        parts = torch.tensor(np.median(np.asarray(c["parts"]), axis=0), dtype=torch.float64)
        dist.all_reduce(parts)
        c["parts_s"] = (parts / p).tolist()
        t = torch.tensor(c["times"], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # an iteration lasts as long as its slowest rank
        c["times_max"] = t
        medians[c["impl"], c["schedule"]] = float(np.median(t.numpy()))  # torch's median is the lower one
        if c["impl"] in WRAPPERS:  # the wrapper's own account of the timed iterations
            c["stats"] = list(c["wrapped"].stats)[-len(c["times"]):]
    return medians


def _traces(configs: list[dict], profiled, compute_only: float, base):
    """The layer trace of compute alone (``profiled`` scaled to the "alone" run, one layer per
    parameter tensor) and the simulator's trace (that one plus the wrapper's own compute)."""
    alone_parts = next(c["parts_s"] for c in configs if c["impl"] == "alone")
    trace = _per_parameter(_scaled(profiled, compute_only, alone_parts), base)
    # What the wrapper adds to compute whatever the schedule (gradient copies into the buckets
    # in its hooks, buffer broadcasts in forward), as measured with nothing overlapping them:
    # by the single allreduce's wrapper (else the optimal one's).
    ring = {c["schedule"]: c for c in configs if c["impl"] == "ringtrain"}
    measuring = ring.get("single", ring.get("optimal"))
    sim_trace = trace  # the bound and the planner's figure stay those of compute alone
    if measuring is not None:
        timed = measuring["stats"]
        sim_trace = _with_wrapper_costs(trace, float(np.median([s.hooks_s for s in timed])),
                                        float(np.median([s.broadcast_s for s in timed])))
    return trace, sim_trace


def _row(c: dict, name: str, batch: int, p: int, params: int, compute_only: float, trace) -> dict:
    """The row every configuration has: its times (the slowest rank's) and compute alone's."""
    t = c["times_max"]
    med = float(np.median(t.numpy()))
    return {"model": name, "impl": c["impl"], "schedule": c["schedule"], "batch_size": batch,
            "median_iter_s": med, "iter_s": t.tolist(), "samples_per_s": p * batch / med,
            "scaling_efficiency": compute_only / med, "compute_only_s": compute_only,
            "params": params,
            "trace_forward_s": trace.forward_s, "trace_backward_s": trace.backward_s,
            "trace_optimizer_s": trace.optimizer_s, "measured_forward_s": c["parts_s"][0],
            "measured_backward_call_s": c["parts_s"][1], "measured_step_s": c["parts_s"][2]}


def _ring_fields(c: dict, med: float, p: int, trace, sim_trace, cost, algorithm: str, slow) -> dict:
    """A ringtrain configuration's fields besides ``_row``'s: its plan, the wrapper's stats of the
    timed iterations, and the planner's, the simulator's and the overlap bound's predictions."""
    from ..ddp.trial import DDP_BUCKETS
    from ..sim.simulator import predict_with_cost

    ddp = c["wrapped"]
    stats = c["stats"]
    plan = ddp.plan
    # The plan in force: "optimal" may have measured that a single allreduce is faster here.
    # (as the wrapper planned it: its trial may have kept the plan of free overlap)
    # (its trial may also have kept torch DDP's default buckets, the first one smaller, or
    # another schedule's grouping: plan.method then says mgwfbp, wfbp or fixed)
    buckets = ddp.kept == "buckets"  # (DDP_BUCKETS[1] is the 25 MiB every fixed plan here has)
    pred = predict_with_cost(sim_trace, cost, p, plan.method, algorithm=algorithm, cluster="measured",
                             interference=slow,
                             planned_with=ddp.planned_with if c["schedule"] == "optimal" else None,
                             first_bucket_mb=DDP_BUCKETS[0] if buckets else None)
    first_ready = plan.ready[0] if len(plan.ready) else 0.0
    one_allreduce = float(cost(float(sum(plan.group_bytes))))
    bound = trace.forward_s + max(trace.backward_s, first_ready + one_allreduce) + trace.optimizer_s
    return dict(
        hooks_s=_median(stats, "hooks_s"),
        broadcast_s=_median(stats, "broadcast_s"),
        alpha=ddp.alpha, beta=ddp.beta, cost=dataclasses.asdict(cost), groups=len(plan.groups),
        plan_in_force=plan.method,
        interference=slow.to_dict() if slow is not None else None, fell_back=ddp.fell_back,
        planned_with=ddp.planned_with.to_dict(), trial=ddp.trial,
        planner_iter_s=planner_iteration_s(trace, plan),
        sim_iter_s=pred.iteration_s, sim_error=(pred.iteration_s - med) / med,
        overlap_bound_s=bound, vs_bound=med / bound,
        hidden_fraction=_median(stats, "hidden_fraction"),
        comm_s=_median(stats, "comm_s"),
        backward_s=_median(stats, "backward_s"),
        exposed_s=_median(stats, "exposed_s"),
        timeline=str(ddp.timeline_path) if ddp.timeline_path else None,
    )


def turns(n: int, steps: int, round_no: int):
    """Round ``round_no`` of the timed steps: (step, configuration) pairs, ``n`` configurations
    taking turns step by step, each turn in an order drawn from a generator seeded with the round
    (the same on every rank).

    Step by step, so that a machine whose speed drifts within seconds (a shared VM's swings up
    to 40%) slows every configuration alike; in a drawn order, so that none always comes first
    (after torch DDP's gloo threads) or after the same one.
    """
    order = np.random.default_rng([TURN_ORDER_SEED, round_no])
    for k in range(steps):
        for i in order.permutation(n):
            yield k, int(i)


def planner_iteration_s(trace, plan) -> float:
    """The planner's predicted iteration: ``trace``'s forward, backward and step (compute alone)
    plus what ``plan`` leaves exposed, the end of its last allreduce after the end of backward.

    The exposure is measured on the plan's own clock (its ready times, the wrapper's backward)
    and only then added to the trace's backward: one source of backward time. (Taking the max of
    the trace's backward and the plan's end mixed the two; where the wrapper timed a shorter
    backward than the trace, a single allreduce after backward was predicted to cost nothing.)
    """
    return trace.forward_s + trace.backward_s + plan.exposed_time + trace.optimizer_s


def _scaled(trace, total_s: float, parts: Sequence[float]):
    """``trace`` with its forward, backward and step scaled to ``total_s`` split as ``parts``
    (the measured forward, backward and step of the same model alone): the profile gives the
    layers' proportions within each, the run under the same CPU load gives the times."""
    from dataclasses import replace

    k = total_s / sum(parts)
    kf, kb = k * parts[0] / trace.forward_s, k * parts[1] / trace.backward_s
    layers = [replace(l, forward_s=l.forward_s * kf, backward_s=l.backward_s * kb) for l in trace.layers]
    return replace(trace, layers=layers, optimizer_s=k * parts[2])


def _per_parameter(trace, module):
    """``trace`` with each layer of several parameter tensors cut into one layer per tensor, the
    unit the wrapper plans and wfbp sends (a CNN block's conv and norm give 3 tensors, one
    layer each otherwise). The layer's backward time goes to the tensor first ready in backward
    (the last in forward order), its forward time to the first; the rest follow at no cost."""
    from dataclasses import replace

    from ..sim.traces import Layer

    modules = dict(module.named_modules())
    layers = []
    for layer in trace.layers:
        mod = modules.get(layer.name)
        tensors = [q for q in mod.parameters(recurse=False) if q.requires_grad] if mod is not None else []
        nbytes = [q.numel() * q.element_size() for q in tensors]
        if len(tensors) < 2 or sum(nbytes) != layer.grad_bytes:
            layers.append(layer)
            continue
        last = len(tensors) - 1
        layers += [Layer(f"{layer.name}[{k}]", layer.forward_s if k == 0 else 0.0,
                         layer.backward_s if k == last else 0.0, nb, q.numel())
                   for k, (q, nb) in enumerate(zip(tensors, nbytes))]
    return replace(trace, layers=layers)


def _with_wrapper_costs(trace, hooks_s: float, broadcast_s: float):
    """``trace`` with the wrapper's own compute: ``hooks_s`` spread over the gradient layers by
    bytes (the hooks' cost is mostly the copy into the bucket) and ``broadcast_s`` on forward."""
    from dataclasses import replace

    total = trace.grad_bytes
    layers = [replace(l, backward_s=l.backward_s + hooks_s * l.grad_bytes / total) for l in trace.layers]
    layers[0] = replace(layers[0], forward_s=layers[0].forward_s + broadcast_s)
    return replace(trace, layers=layers)


# --- output ------------------------------------------------------------------------------------


def _label(r: dict) -> str:
    if r["impl"] == "torch-ddp-compressed":
        return f"DDP+{r['schedule'].split(' + ')[-1].split('_')[0]}"
    return {"ringtrain": r["schedule"], COMPRESSED: r["schedule"], "ps": r["schedule"],
            "alone": "alone", TORCH_DDP_RINGTRAIN: "DDP/ringtrn", HOROVOD: "horovod",
            HOROVOD_DDP: "torch-ddp (horovod launch)"}.get(r["impl"], "torch DDP")


#: The table's columns after the config's name, with their widths; a row without a value shows '-'.
COLUMNS = (("iter ms", 9), ("samples/s", 11), ("scaling", 9), ("vs DDP", 8), ("hidden", 8), ("planner", 9),
           ("sim", 9), ("sim err", 9), ("bound", 8), ("/bound", 8))


def _cells(r: dict, torch_ddp: dict | None) -> dict[str, str]:
    """Row ``r``'s text in each column ('-' where it has no value)."""
    def fmt(key: str, spec: str, scale: float = 1.0, suffix: str = "") -> str:
        value = r.get(key)
        return "-" if value is None else f"{value * scale:{spec}}{suffix}"

    return {"iter ms": fmt("median_iter_s", ".1f", 1e3), "samples/s": fmt("samples_per_s", ".0f"),
            "scaling": fmt("scaling_efficiency", ".0f", 100, "%"),
            "vs DDP": f"{torch_ddp['median_iter_s'] / r['median_iter_s']:.2f}x" if torch_ddp else "-",
            "hidden": fmt("hidden_fraction", ".0f", 100, "%"), "planner": fmt("planner_iter_s", ".1f", 1e3),
            "sim": fmt("sim_iter_s", ".1f", 1e3), "sim err": fmt("sim_error", "+.0f", 100, "%"),
            "bound": fmt("overlap_bound_s", ".1f", 1e3), "/bound": fmt("vs_bound", ".2f")}


def _extras(r: dict) -> str:
    """What follows the columns: a server row's bytes per step, the rounds' medians."""
    line = ""
    if r["impl"] == "ps" and r.get("worker_bytes_per_step"):
        b = r["worker_bytes_per_step"]
        line += f"   worker sends {b['sent'] / 1e6:.1f} MB/step, receives {b['received'] / 1e6:.1f} MB/step"
    if r.get("round_medians"):
        line += "   rounds " + "/".join(f"{m * 1e3:.0f}" for m in r["round_medians"]) + " ms"
    return line


def horovod_line(mrows: list[dict]) -> str | None:
    """One model's Horovod against optimal, each as a share of the torch DDP timed beside it:
    optimal / DDP of the main launch, Horovod / DDP of Horovod's own launch; None without a
    Horovod row."""
    hvd = next((r for r in mrows if r["impl"] == HOROVOD and r.get("horovod_over_ddp")), None)
    if hvd is None:
        return None
    ddp = next((r for r in mrows if r["impl"] == "torch-ddp"), None)
    optimal = next((r for r in mrows if r["impl"] == "ringtrain" and r["schedule"] == "optimal"), None)
    ours = f"optimal {optimal['median_iter_s'] / ddp['median_iter_s']:.2f} (main launch), " if optimal and ddp else ""
    return f"iteration / torch DDP beside it: {ours}horovod {hvd['horovod_over_ddp']:.2f} (its own launch)"


def format_table(rows: list[dict]) -> str:
    out = []
    width = max([12] + [len(_label(r)) + 1 for r in rows])
    for model in dict.fromkeys(r["model"] for r in rows):
        mrows = [r for r in rows if r["model"] == model]
        # each row against the torch DDP of its own launch (the Horovod launch has one of its own)
        torch_ddp = next((r for r in mrows if r["impl"] == "torch-ddp"), None)
        horovod_ddp = next((r for r in mrows if r["impl"] == HOROVOD_DDP), None)
        r0 = next((r for r in mrows if "params" in r), None)
        if r0 is not None:
            out.append(f"\n{model} ({r0['params'] / 1e6:.2f}M params, batch {r0['batch_size']}/rank, "
                       f"{plural(r0['world_size'], 'rank')}, net {r0['net']}): "
                       f"compute alone {r0['compute_only_s'] * 1e3:.1f} ms")
        else:
            out.append(f"\n{model} ({plural(mrows[0]['world_size'], 'worker')}, net {mrows[0]['net']})")
        out.append(f"{'config':<{width}}" + "".join(f"{name:>{w}}" for name, w in COLUMNS))
        for r in mrows:
            cells = _cells(r, horovod_ddp if r.get("launch") == "horovod" else torch_ddp)
            out.append(f"{_label(r):<{width}}" + "".join(f"{cells[name]:>{w}}" for name, w in COLUMNS) + _extras(r))
        if line := horovod_line(mrows):
            out.append(line)
    return "\n".join(out)


def _charts(rows: list[dict], stem: Path) -> list[str]:
    """A bar chart of iteration times, and each optimal run's timeline picture."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    charts = []
    models_ = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models_), figsize=(4.5 * len(models_), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models_):
        mrows = [r for r in rows if r["model"] == model]
        labels = [_label(r) for r in mrows]
        vals = [r["median_iter_s"] * 1e3 for r in mrows]
        colors = [{"ringtrain": "tab:blue", COMPRESSED: "tab:cyan", "ps": "tab:green", HOROVOD: "tab:orange"}.get(
                      r["impl"], "tab:gray")
                  for r in mrows]
        ax.bar(labels, vals, color=colors)
        bound = next((r["overlap_bound_s"] for r in mrows if r["impl"] == "ringtrain"), None)
        if bound:
            ax.axhline(bound * 1e3, color="tab:red", linestyle="--", label="overlap bound")
            ax.legend(fontsize=7)
        ax.set_title(f"{model}, {mrows[0]['world_size']} ranks, net {mrows[0]['net']}", fontsize=9)
        ax.set_ylabel("median iteration (ms)")
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    fig.tight_layout()
    path = stem.with_name(stem.name + "-iterations.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    charts.append(str(path))
    from ..ddp.timeline import draw_timeline

    for r in rows:
        if r.get("timeline"):
            files = rank_files(Path(r["timeline"]))
            png = stem.with_name(f"{stem.name}-{r['model']}-timeline.png")
            try:
                title = f"{r['model']}, {r['schedule']} schedule, {r['world_size']} ranks, net {r['net']}"
                draw_timeline([str(f) for f in files], png, iterations=2, title=title)  # consecutive (rounds interleave)
                charts.append(str(png))
            except Exception as exc:  # a picture must never lose the numbers
                print(f"timeline picture for {r['model']} failed: {exc}", file=sys.stderr)
    return charts
