"""`ringtrain train`: the main job — train a reference model on N local workers.

    ringtrain train                              # 2 workers, the character LM, optimal schedule
    ringtrain train --steps 200                  # run again: resumes from the last checkpoint
    ringtrain train --steps 300 --workers 4 --batch-size 16   # resumes on 4 workers, same global batch (64)

A resumed run keeps the global batch (workers x batch size), the seed, the model, the optimizer
and the strategy of the checkpoints it continues; ``--no-resume`` starts afresh and first moves the
directory's checkpoints into a ``superseded-<time>`` subdirectory. One run at a time holds a
checkpoint directory (``ringtrain.dirlock``: a second is refused, naming the first's pid).

With ``--compression powersgd`` the checkpoints hold PowerSGD's state too (``powersgd_state``):
every worker's error feedback, gathered into rank 0's file at the step, the warm-start matrices,
the iteration count and generator, and a resume goes on with it. Bitwise as if the run had never
stopped where the job's gradients form one bucket (``--schedule single``; ``fixed`` where they fit
in ``--bucket-cap-mb``): the resumed wrapper lays that bucket out from its first step. Under a plan
of several buckets the resumed wrapper profiles on one bucket first, as every run does: the error
feedback moves parameter by parameter and the warm-start matrices are drawn anew (as at the run's
own changes of plan). Each checkpoint grows by the error feedback of every worker (a model's worth
of gradients each). A checkpoint of another number of workers, or of a run without powersgd:
PowerSGD begins anew, which the run says in one line.

The parent starts the workers through torch's own launcher (torch.distributed.run). Each
worker joins with ``ringtrain.init``, wraps the model in ``ringtrain.DistributedDataParallel``
and trains on its slice of every global batch. Rank 0 shows a progress bar (loss, samples/s),
writes a checkpoint every K steps (atomic: write, fsync, rename; model, optimizer, data
position and RNG state, copied at the step and written on a background thread while training
goes on, so a slow disk does not hold up the other workers) and ends with a summary:
samples/s, scaling against one worker, and the share of communication hidden behind backward
(over the steps run under the plan in force at the end, not those that profiled backward or
tried candidate plans). Ctrl-C stops every worker and says, in one line, where the same
command resumes (exit status 130).

*Scaling against one worker*: before and after training, every worker times a few training
steps (forward, backward, optimizer step) of the same model without communication, all at
once, so that the one-worker rate is measured under the same load on the CPU (the faster of
the two counts); scaling = measured samples/s / (workers x that rate).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import secrets
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from . import dirlock, resume
from .bench.machine import plural
from .checkpoint import CheckpointWriteError
from .errors import CommError, check_join_timeout, check_number
from .outputs import check_folder

SCHEDULES = ("optimal", "mgwfbp", "wfbp", "fixed", "single")
#: --compression: none, ddp.options.COMPRESSIONS (its import would load torch), torch's PowerSGD hook.
COMPRESSION = ("none", "fp16", "bf16", "powersgd")
#: --compression powersgd: torch's powerSGD_hook with rank-1 approximations from its earliest iteration.
POWER_SGD = dict(matrix_approximation_rank=1, start_powerSGD_iter=2)
OPTIMIZERS = ("sgd", "adam", "adamw")  # (ps.server_optimizer.OPTIMIZERS, which a test keeps equal: torch again)
#: --lr 0's learning rate for each optimizer.
USUAL_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}
STRATEGIES = ("ring", "ps-sync", "ps-async", "ps-sharded")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    model: str = "charlm"
    """Reference model."""
    steps: int = 150
    """Optimizer steps in total (a resumed run continues to this count). 150: enough for the
    optimal schedule's trial of plans to finish on 2 workers (on the LM 23 to 113 steps: its
    distinct candidates take up to three rounds where the two fastest are close; 53 in a run
    here; 128 at most on any model) and the summary to measure the plan it kept, in about 45 s."""
    batch_size: int = 0
    """Per-worker batch; 0 = the model's default."""
    lr: float = 0.0
    """Learning rate; 0 = the optimizer's usual one: 0.05 for sgd, 0.001 for adam and adamw."""
    optimizer: str = "sgd"
    """sgd (momentum 0.9), adam or adamw (torch's defaults: betas (0.9, 0.999), eps 1e-8, no weight decay),
    stepped by every worker (ring) or by the parameter servers. A resumed run keeps its checkpoints' optimizer."""
    seed: int = 0
    """Weights, data order and every random draw derive from it."""
    schedule: str = "optimal"
    """How gradients are merged into allreduces, or into pushes to the parameter servers (ringtrain.plan
    methods)."""
    algorithm: str = "auto"
    """Allreduce algorithm (ringtrain.ALGORITHMS)."""
    transport: str = "auto"
    """How bytes move (ringtrain.TRANSPORTS)."""
    bucket_cap_mb: float = 25.0
    """Bucket (ring) or push (parameter servers) size for schedule='fixed'."""
    compression: str = "none"
    """Gradients on the wire compressed (the ring only): fp16 or bf16 halve the bytes of each allreduce at a
    rounding of every gradient, as torch's compression hooks (docs/ddp.md); powersgd sends rank-1 approximations
    of each bucket's matrices with torch's powerSGD_hook (fewer bytes by far, a slower loss per step; each worker's
    error feedback, the warm-start matrices and the iteration count are saved in the checkpoints and a resume goes
    on with them, bitwise as if never stopped where the gradients form one bucket, as with --schedule single (the
    description above --help's options says more), or begins anew, said in one line, from a checkpoint of another
    number of workers or of a run without powersgd); none sends them as they are."""
    checkpoint_dir: str = ""
    """Where checkpoints go; '' = runs/<canonical model name>, -<strategy> added for parameter servers (ps-sharded
    shares ps-sync's): --model charlm saves to runs/charlm-transformer (runs/charlm-transformer-ps-sync), or to
    runs/charlm where older runs made that one and no runs/charlm-transformer exists."""
    checkpoint_every: int = 20
    """Steps between checkpoints (0 = never)."""
    resume: bool = True
    """Continue from the newest valid checkpoint in checkpoint_dir (--no-resume: start afresh, the
    old checkpoints moved into a superseded-<time> subdirectory)."""
    timeline: str = ""
    """Write a Chrome trace of compute and communication to this path (one file per rank, <stem>.rank<r><suffix>).
    It holds the first 10 steps run under the settled plan: after 3 steps that time backward and, with --schedule
    optimal on several workers, the trial of plans (up to 128 steps); a run that ends sooner writes no step and
    says so."""
    timeout: float = 120.0
    """Seconds any communication may wait before it fails, once the ranks have met (their first meeting is
    --join-timeout's). Rank 0 writes checkpoints on a background thread while training goes on, one at a time: only
    the part of a write that outlasts the next --checkpoint-every steps holds up the others (rank 0 waits for it at
    the next save), and that part must be shorter."""
    join_timeout: float | None = None
    """Seconds every rank has to start and meet the others (the rendezvous store, the parameter servers), where
    their start-up counts; unset: --timeout, but at least 60 (ringtrain.init's join_timeout)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    strategy: str = "ring"
    """ring (allreduce, DistributedDataParallel) or parameter servers: ps-sync (synchronous), ps-async
    (asynchronous), ps-sharded (synchronous, the parameters spread over --servers, 2 unless given: the same
    as ps-sync with --servers 2)."""
    servers: int = 0
    """Parameter-server processes beside the workers; 0 = 2 for ps-sharded, 1 otherwise."""
    max_staleness: int = 0
    """ps-async only: how many steps a worker may run ahead of the slowest (0: none; -1: unbounded;
    docs/ps.md measures what a bound costs in loss)."""

    def __post_init__(self) -> None:
        from . import models
        from .comm import ALGORITHMS
        from .paths import user_path
        from .transport import TRANSPORTS

        self.checkpoint_dir, self.timeline = user_path(self.checkpoint_dir), user_path(self.timeline)
        try:
            models.spec(self.model)
        except ValueError:
            raise ValueError(f"--model must be one of {', '.join(models.names())}, got {self.model!r}") from None
        for name, value, allowed in (("schedule", self.schedule, SCHEDULES), ("algorithm", self.algorithm, ALGORITHMS),
                                     ("compression", self.compression, COMPRESSION),
                                     ("transport", self.transport, TRANSPORTS), ("strategy", self.strategy, STRATEGIES)):
            if value not in allowed:
                raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")
        for name, low in (("steps", 1), ("checkpoint_every", 0), ("batch_size", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"--lr must be a finite number >= 0 (0: the optimizer's usual one), got {self.lr}")
        self.lr = self.lr or USUAL_LR[self.optimizer]
        check_number("--timeout", self.timeout, unit=" of seconds")
        if self.join_timeout is not None:
            check_number("--join-timeout", self.join_timeout, unit=" of seconds")
        if not (math.isfinite(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            raise ValueError(f"--bucket-cap-mb must be a finite number > 0, got {self.bucket_cap_mb}")
        if self.bucket_cap_mb != TrainConfig.__dataclass_fields__["bucket_cap_mb"].default and self.schedule != "fixed":
            raise ValueError(f"--bucket-cap-mb sets the bucket (or push) size of --schedule fixed, and --schedule "
                             f"{self.schedule} would ignore it: give --schedule fixed, or leave --bucket-cap-mb out")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"--seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.servers < 0:
            raise ValueError(f"--servers must be >= 0, got {self.servers}")
        if self.strategy == "ring" and self.servers:
            raise ValueError("--servers is for the parameter-server strategies (--strategy ps-sync|ps-async|ps-sharded)")
        if self.max_staleness:  # (0 is every strategy's: no import of the servers' code for a ring run)
            from .ps.server_config import staleness_flag

            staleness_flag(self.max_staleness, self.strategy, "ps-async")
        if self.strategy != "ring":
            ring_only = [f"--{name.replace('_', '-')}" for name in ("transport", "algorithm", "timeline", "compression")
                         if getattr(self, name) != TrainConfig.__dataclass_fields__[name].default]
            if ring_only:
                verb, them = ("is", "it") if len(ring_only) == 1 else ("are", "them")
                raise ValueError(f"{', '.join(ring_only)} {verb} for the ring's allreduce only; --strategy {self.strategy} "
                                 f"sends gradients to parameter servers and would ignore {them}")
            if not self.servers:
                self.servers = 2 if self.strategy == "ps-sharded" else 1
        if not self.checkpoint_dir:
            self.checkpoint_dir = str(_default_checkpoint_dir(self.model, self.strategy))


def _default_checkpoint_dir(model: str, strategy: str) -> Path:
    """runs/<canonical model name>[-<strategy>], so a model's aliases share one directory, and
    ps-sharded shares ps-sync's (the same synchronous servers: a job moves between them, and so
    between numbers of servers, by its flags alone). A directory made before either (an alias's,
    runs/charlm; ps-sharded's own) is kept while the canonical one is absent."""
    from . import models

    canonical = models.spec(model).name
    suffix = "" if strategy == "ring" else "-ps-sync" if strategy == "ps-sharded" else f"-{strategy}"
    aliases = [n for n in models.names() if n != canonical and models.spec(n).name == canonical]
    older = [f"{name}{suffix}" for name in aliases]
    if strategy == "ps-sharded":
        older += [f"{name}-ps-sharded" for name in [canonical, *aliases]]
    for name in [f"{canonical}{suffix}", *older]:
        if (Path("runs") / name).is_dir():
            return Path("runs") / name
    return Path("runs") / f"{canonical}{suffix}"


def _field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass (STYLE.md), for --help."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="local worker processes (default 2)")
    p.add_argument("--master-port", type=int, default=0, help="rendezvous port (default: a free one)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--interrupt-file", default=None, help=argparse.SUPPRESS)  # (_Interrupted)
    from . import models
    from .comm import ALGORITHMS
    from .transport import TRANSPORTS

    choices = {"model": models.names(), "schedule": SCHEDULES, "algorithm": ALGORITHMS, "transport": TRANSPORTS,
               "compression": COMPRESSION, "optimizer": OPTIMIZERS}
    unset = {"join_timeout": (float, "SECONDS")}  # defaults of None: (type, metavar); the docstring says what None means
    docs = _field_docs(TrainConfig)
    for name, field in TrainConfig.__dataclass_fields__.items():
        value = field.default  # the declared default, before __post_init__ derives anything
        flag = "--" + name.replace("_", "-")
        text = docs.get(name, "") + (f" One of: {', '.join(choices[name])}." if name in choices else "")
        if isinstance(value, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=f"{text} (default %(default)s)")
        elif value is None:
            p.add_argument(flag, type=unset[name][0], default=None, metavar=unset[name][1], help=text)
        else:
            p.add_argument(flag, type=type(value), default=value, help=f"{text} (default {value!r})")


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C during training: the parent's torchrun passes its SIGINT on to every rank. Rank 0
    writes the steps it had done to the parent's --interrupt-file; the parent says it in one line."""

    def __init__(self, step: int, rank: int):
        super().__init__(step, rank)
        self.step, self.rank = step, rank


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker_entry(args)
    try:
        return _launch(args)
    except KeyboardInterrupt:  # before torchrun took over SIGINT (it stops the workers and says so itself)
        print("ringtrain train: interrupted before training started", file=sys.stderr)
        return 130


def _worker_entry(args: argparse.Namespace) -> int:
    try:
        from .errorfile import recorded

        # an exception of any rank goes to torchrun's error file, which the parent reports
        return recorded(_run_worker)(args.worker, args.json)
    except (CheckpointWriteError, CommError):  # (a full disk; a lost or silent peer): recorded, and the
        return 1  # parent's line says it all: no traceback (rank 0's would be shown, some 60 lines)
    except KeyboardInterrupt as exc:  # no traceback: the parent says it in one line (_interrupted)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if isinstance(exc, _Interrupted) and exc.rank == 0 and args.interrupt_file:
            # A new file (never through a link put there); without it the parent's line omits the step.
            with contextlib.suppress(OSError), open(args.interrupt_file, "x") as f:
                f.write(str(exc.step))
        # Out at once, without the interpreter's and C++'s exit handlers: a thread interrupted
        # inside torch (a PS worker's receiver, a wrapper's communication thread) makes a static
        # std::thread destructor abort the process at exit ("terminate called without an active
        # exception"). Checkpoints are whole by now (a save holds Ctrl-C until it is done).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGINT)


def _launch(args: argparse.Namespace) -> int:
    fields = {k: getattr(args, k) for k in TrainConfig.__dataclass_fields__}
    try:
        cfg = TrainConfig(**fields)
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        if not 0 <= args.master_port <= 65535:
            raise ValueError(f"--master-port must be in 1..65535 (0: a free one), got {args.master_port}")
        check_batch_fits(cfg.model, cfg.batch_size, args.workers, cfg.seed)
        _check_servers_fit(cfg)
        # (folders made now: one that cannot hold checkpoints or traces is an error before training,
        # not after the first --checkpoint-every steps)
        if cfg.checkpoint_every:
            check_folder(Path(cfg.checkpoint_dir), "--checkpoint-dir", make=True)
            if cfg.strategy != "ring":
                _check_server_folders(cfg)
        if cfg.timeline:
            check_folder(Path(cfg.timeline).parent, f"--timeline {cfg.timeline}: its directory", make=True)
            _check_trace_files(cfg.timeline, args.workers)
    except ValueError as exc:
        raise SystemExit(f"ringtrain train: {exc}")
    with contextlib.ExitStack() as held:
        try:
            if cfg.checkpoint_every or Path(cfg.checkpoint_dir).is_dir():  # (one run at a time saves or reads there)
                held.enter_context(dirlock.hold(Path(cfg.checkpoint_dir), "--checkpoint-dir"))
            done = resume.prepare_checkpoint_dir(cfg, args.workers)  # (the step it resumes at)
        except ValueError as exc:
            raise SystemExit(f"ringtrain train: {exc}")
        return _run_workers(args, cfg, done)


def _run_workers(args: argparse.Namespace, cfg: TrainConfig, done: int | None) -> int:
    """The job's workers (and servers) under torchrun, from step ``done`` (None: 0)."""
    # Said without starting a rank (that took ~16 s to say the same); --json: the workers' whole summary.
    if done is not None and done >= cfg.steps and not args.json:
        print(f"\n{cfg.model} in {cfg.checkpoint_dir}:\n  nothing to do: the checkpoint is already at step {done} "
              f"(--steps {cfg.steps}); give more --steps to train on")
        return 0
    from .launch import job_secret, run_torchrun_at

    # Each worker runs torch on one thread (worker(), ps_worker()): say so, and torchrun's banner
    # about choosing that for us is not printed on every run.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["RINGTRAIN_SECRET"] = job_secret(argparse.Namespace(secret_file=None, nnodes=1))
    # Only rank 0's output is shown (one progress bar, one summary); a rank that fails records its
    # exception for run_torchrun to print.
    # Made by rank 0 on Ctrl-C only (so a launcher killed outright leaves no file behind)
    interrupt_file = Path(tempfile.gettempdir()) / f"ringtrain-train-{os.getpid()}-{secrets.token_hex(8)}.step"

    def argv_at(port: int) -> list[str]:
        return [f"--nproc-per-node={args.workers + cfg.servers}", "--nnodes=1", "--master-addr=127.0.0.1",
                f"--master-port={port}", "--local-ranks-filter=0", "-m", "ringtrain.cli", "train", "--worker",
                json.dumps(asdict(cfg)), "--interrupt-file", str(interrupt_file), *(["--json"] if args.json else [])]

    try:  # (--master-port 0: a free port, another one if it is taken before torchrun listens there)
        return run_torchrun_at(argv_at, "ringtrain train", args.master_port,
                               role=lambda rank: "worker" if rank < args.workers else "parameter server",
                               interrupted=lambda sig: _interrupted(cfg, sig, interrupt_file),
                               failed=lambda: _where_it_resumes(cfg))
    finally:
        interrupt_file.unlink(missing_ok=True)


def _interrupted(cfg: TrainConfig, sig: signal.Signals, interrupt_file: Path) -> str:
    """The line for a run stopped by a signal (after torchrun stopped the workers): where it was,
    where the same command resumes."""
    done = interrupt_file.read_text().strip() if interrupt_file.is_file() else ""
    what = f"interrupted at step {done}" if done else ("interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}")
    return f"{what}; {_where_it_resumes(cfg)}"


def _where_it_resumes(cfg: TrainConfig) -> str:
    """Where the same command goes on after a run that stopped (interrupted, or a rank failed)."""
    # (--no-resume --checkpoint-every 0 saved nothing, and left the directory's checkpoints of an
    # earlier run where they were: they are not where this run goes on)
    newest = resume.resume_step(cfg) if cfg.resume or cfg.checkpoint_every else None
    if newest is None:
        why = ("checkpoints were off (--checkpoint-every 0)" if not cfg.checkpoint_every else
               f"no checkpoint yet (one every {cfg.checkpoint_every} steps)")
        return f"{why}: the same command starts again from step 0"
    again = "the same command again" if cfg.resume else "it again without --no-resume"
    return f"run {again} to resume from step {newest} (the last checkpoint)"


def _run_worker(config_json: str, json_summary: bool) -> int:
    return worker(TrainConfig(**json.loads(config_json)), json_summary=json_summary)


def _check_server_folders(cfg: TrainConfig) -> None:
    """The parameter servers save under ``<checkpoint dir>/servers/server-<k>``: a file in the
    place of one was each server's failure after training had started (rank 0 saved, they could
    not). Checked, not made (the folders that exist tell resume how many servers saved)."""
    servers = Path(cfg.checkpoint_dir) / "servers"
    for folder in [servers] + [servers / f"server-{k}" for k in range(cfg.servers)]:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir}: {folder} is a file, where the parameter "
                             "servers keep their checkpoints (a folder); move it away")
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"--checkpoint-dir {cfg.checkpoint_dir}: {folder} is not writable, and the parameter "
                             "servers keep their checkpoints there")


def _check_trace_files(timeline: str, workers: int) -> None:
    """Each worker's trace file (``t.json`` -> ``t.rank0.json``, ...) can be written: a name too
    long or a folder in its place was a worker's traceback after it had started."""
    from .ddp.timeline import check_trace_file, trace_path

    for rank in range(workers):
        try:
            check_trace_file(trace_path(timeline, rank))
        except ValueError as exc:
            raise ValueError(f"--timeline {timeline}: {str(exc).removeprefix('timeline: ')}") from None


def _check_servers_fit(cfg: TrainConfig) -> None:
    """Every parameter server must have a partition of the model to serve (``ps.make_layout``):
    checked here, before W + K processes start, rather than by the workers once they all have."""
    if cfg.strategy == "ring":
        return
    from . import models
    from .ps import PSOptions, make_layout

    numels = [p.numel() for p in models.build(cfg.model, seed=cfg.seed).parameters() if p.requires_grad]
    try:
        make_layout(numels, cfg.servers, PSOptions().partition_bytes)
    except ValueError as exc:
        raise ValueError(f"--servers {cfg.servers}: the {cfg.model} model has too few partitions: {exc}") from None


def check_batch_fits(model: str, batch_size: int, workers: int, seed: int = 0, workers_flag: str = "--workers") -> None:
    """One global batch (workers x batch size; 0: the model's own) must fit in the model's data
    set (ValueError naming the flags; ``ringtrain bench train`` names its --world-size)."""
    from . import data, models

    spec = models.spec(model)
    batch = batch_size or spec.batch_size
    num_samples = len(data.dataset(spec.dataset, seed=seed, **spec.batch_kwargs))
    if workers * batch > num_samples:
        fix = (f"use --batch-size <= {num_samples // workers}" if workers <= num_samples else
               f"not one sample for each of the {workers} ranks: give {workers_flag} <= {num_samples}")
        raise ValueError(f"--batch-size {batch} x {workers_flag} {workers} = {workers * batch} samples per step, but "
                         f"the {spec.dataset} data set of {spec.name} holds {num_samples}: {fix}")


def _one_worker_rate(model, loss_fn, batch, make_optimizer, steps: int = 5) -> float:
    """Samples per second of one training step without communication (zero_grad, forward,
    backward, optimizer step: the median of ``steps``), on private copies of the model and its
    optimizer (``make_optimizer(params)``, as the run's)."""
    twin = copy.deepcopy(model)
    opt = make_optimizer(twin.parameters())
    x, y = batch

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(twin(x), y).backward()
        opt.step()

    step()  # warm-up (the optimizer's state is made here)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return len(x) / sorted(times)[len(times) // 2]


def _optimizer(cfg: TrainConfig):
    """The run's optimizer, as a function of the parameters: torch_optimizer with the parameter
    servers' default settings (ps.PSOptions: momentum 0.9, torch's betas and eps, no weight
    decay), which the servers of a ps_worker run apply too."""
    from .ps import PSOptions
    from .ps.server_optimizer import torch_optimizer

    opts = PSOptions(optimizer=cfg.optimizer, lr=cfg.lr)
    settings = {key: getattr(opts, key) for key in ("lr", "momentum", "betas", "eps", "weight_decay")}
    return lambda params: torch_optimizer(cfg.optimizer, params, settings)


def _workload(cfg: TrainConfig, rank: int, p: int):
    """The model (weights from cfg.seed), this rank's loader of each global batch, the batch size."""
    from . import data, models

    spec = models.spec(cfg.model)
    batch_size = cfg.batch_size or spec.batch_size
    model = models.build(cfg.model, seed=cfg.seed)
    dataset = data.dataset(spec.dataset, seed=cfg.seed, **spec.batch_kwargs)
    return model, data.ShardedLoader(dataset, batch_size, rank=rank, world_size=p, seed=cfg.seed), batch_size


def _summary(cfg: TrainConfig, p: int, transport: str, batch_size: int, times, losses, one_rate: float,
             start: int) -> dict:
    """The end-of-run figures (steady state: the first two steps are left out when there are more than 4)."""
    import numpy as np

    steady = times[2:] if len(times) > 4 else times
    median = float(np.median(steady)) if steady else None
    summary = {
        "model": cfg.model, "workers": p, "transport": transport, "schedule": cfg.schedule,
        "compression": cfg.compression, "resumed_at": start, "steps_run": len(times), "final_step": cfg.steps,
        "checkpoint_dir": cfg.checkpoint_dir if cfg.checkpoint_every else None, "resumes": cfg.resume,
        "last_loss": losses[-1] if losses else None,
        "median_step_s": median, "samples_per_s": p * batch_size / median if median else None,
        "one_worker_samples_per_s": one_rate,
    }
    if summary["samples_per_s"]:
        summary["scaling_efficiency"] = summary["samples_per_s"] / (p * one_rate)
    return summary


def _communication(ddp, ran: list[tuple]) -> dict:
    """How the wrapper's communication went, measured on the steps run under the plan in force at
    the end only (``ran``: per step, the plan in force, whether it had settled, its stats), not on
    the steps that timed backward to make a plan or the trial's candidates (ddp.wrapper, items 4-5)."""
    import numpy as np

    measured = [st for plan, settled, st in ran if settled and plan is ddp.plan]
    opts = ddp.options
    profiling = opts.warmup_iterations + opts.profile_iterations
    # (before the plan settled: "profiling" or "trial", not the method of the first plan or a probe's)
    in_force = ddp.plan.method if ddp.settled else ("trial" if ddp.iteration >= profiling else "profiling")
    comm = {"plan_in_force": in_force, "settled": ddp.settled, "fell_back": ddp.fell_back, "kept": ddp.kept,
            "profiling_steps": profiling, "steps_measured": len(measured), "trial": ddp.trial}
    if measured:
        median = lambda field: float(np.median([getattr(st, field) for st in measured]))  # noqa: E731
        comm.update({field: median(field) for field in ("hidden_fraction", "comm_s", "exposed_s", "backward_s",
                                                         "measured_end_s")})
        comm.update(buckets=measured[-1].buckets, predicted_end_s=measured[-1].predicted_end_s)
    return comm


def _training_state(cfg: TrainConfig, step: int, model, opt, loader) -> dict:
    """checkpoint.training_state plus what the parent checks before resuming (resume.prepare_checkpoint_dir)."""
    from . import checkpoint, models

    return checkpoint.training_state(step, model, opt, loader, strategy=cfg.strategy, optimizer_name=cfg.optimizer,
                                     model_name=models.spec(cfg.model).name, lr=cfg.lr,
                                     corpus=getattr(loader.dataset, "digest", None))


def _note_other_corpus(payload: dict, loader, rank: int) -> None:
    """Say (rank 0) when the text the checkpoint was trained on is not this run's: the data
    position resumes, the bytes at it differ (another Python build, or a ringtrain that reads
    other files of the standard library)."""
    saved = (payload.get("extra") or {}).get("corpus")
    mine = getattr(loader.dataset, "digest", None)
    if rank == 0 and saved is not None and mine is not None and saved != mine:
        print(f"note: the checkpoint was trained on another text corpus (sha256 {saved[:12]}...) than this run "
              f"reads ({mine[:12]}...): training goes on from the same data position on this text, so the "
              "resumed run is not the uninterrupted one", file=sys.stderr)


@contextlib.contextmanager
def _interrupts_held():
    """Ctrl-C and SIGTERM wait until the block is done (a checkpoint being saved: torch.save turns a
    KeyboardInterrupt into a RuntimeError of its own, and SIGTERM, which torchrun passes on when
    it is stopped, ended the process mid-write: either way the save was lost), then take effect:
    Ctrl-C raises, SIGTERM goes to the handler it had (by default it ends the process)."""
    held: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if signal.SIGTERM in held:
            signal.raise_signal(signal.SIGTERM)
        if signal.SIGINT in held:
            raise KeyboardInterrupt


class _Checkpoints:
    """Rank 0's checkpoints, written in the background: ``with _Checkpoints(cfg, rank, state_at) as
    ckpt`` around the training and the job's last communication, ``ckpt.save`` for _loop on every
    rank. No writer on the other ranks, or without --checkpoint-every: there a save only takes part
    in ``collect`` (what the ranks gather into rank 0's checkpoint: PowerSGD's state), if any.

    In the background rather than a save in the loop or a barrier with a deadline long enough for
    it: the other ranks wait for rank 0 in the next step's communication, and a write longer than
    --timeout (a big model, a slow or network disk) failed the run as a CommTimeout naming rank 0;
    no deadline fits a write of unknown length, and a barrier would stall every rank for the disk.
    Rank 0 copies the state at the step (model, optimizer, data position, RNG) and trains on.

    The write in flight outlasts the save call; it is waited for here, in one of three ways:

    - the run's end (leaving the block without an exception, after the job's last communication,
      so that no other rank waits for the disk): Ctrl-C and SIGTERM held, as a save held them; its error (a full disk)
      fails the run;
    - Ctrl-C (_loop's _Interrupted leaving the block) or SIGTERM (torchrun stopping the job): the
      process ends next and would cut the write off, losing that checkpoint: it ends first, Ctrl-C
      and SIGTERM held, its error said, not raised (the run is on its way out for another
      reason); then SIGTERM goes to the handler the process had;
    - any other exception: the CheckpointWriter's own exit, which waits and logs the write's
      error rather than hiding the exception with it.

    ``before_save``: called first at every save (a parameter-server job's servers save their shards);
    ``servers_saved``: the servers hold a whole save already (they resumed one).

    Where the servers' save fails once they hold one, rank 0's own file of the step is written all
    the same, then the error raised: Ctrl-C reaches every rank at once, and servers that ended with
    it during the save failed the call (PeerLost) after saving the step, which the run then resumed
    at without rank 0's file of it (its random state and buffers). A rank 0 file of a step the
    servers lack is never read; before their first save it would be refused by the next run, which
    finds worker files and no servers' (resume), so then nothing is written."""

    def __init__(self, cfg: TrainConfig, rank: int, state_at, before_save=None, servers_saved: bool = False,
                 collect=None):
        self.cfg, self.state_at, self.before_save, self.collect = cfg, state_at, before_save, collect
        self._servers_saved = servers_saved
        self.writer = None
        self._said = False
        self._sigterm_before = None
        if rank == 0 and cfg.checkpoint_every:
            from .checkpoint import CheckpointWriter

            # Checkpoints of later steps are damaged ones (a ring run resumes from the newest whole
            # one), named once by the parent: no warning about them at every save.
            self.writer = CheckpointWriter(cfg.checkpoint_dir, warn_later=cfg.strategy != "ring")

    def save(self, step: int, last: bool) -> None:
        """``state_at(step)`` copied now and written in the background, the last one queued behind
        the write in flight. A save that must wait for the write before it (a disk slower than
        --checkpoint-every steps) says so first, once: the other workers wait for rank 0
        meanwhile, and fail the run after --timeout. ``collect(step)``, on every rank first: what
        the ranks gather into rank 0's checkpoint (a collective), added to its state."""
        more = self.collect(step) if self.collect is not None else None
        if self.writer is None:
            return
        servers_failed = None
        if self.before_save is not None:
            try:
                self.before_save()
                self._servers_saved = True
            except Exception as exc:
                if not self._servers_saved:
                    raise
                servers_failed = exc
        behind = self.writer.writing
        if behind and not last and not self._said:
            self._said = True
            cfg = self.cfg
            print(f"note: the checkpoint of step {behind[0]} is still being written at step {step}: rank 0 waits for "
                  f"it before it saves again, and the other workers wait for rank 0 (up to --timeout "
                  f"{cfg.timeout:g} s); the disk is slower than --checkpoint-every {cfg.checkpoint_every} steps: save "
                  "less often, or give a longer --timeout", file=sys.stderr)
        state = self.state_at(step)
        state.update(more or {})
        self.writer.save(step, state, wait=not last)
        if servers_failed is not None:
            raise servers_failed

    def _finish_on_the_way_out(self) -> None:
        """Ctrl-C or SIGTERM: wait for the write in flight, Ctrl-C and SIGTERM held; its error said."""
        with contextlib.suppress(KeyboardInterrupt), _interrupts_held():
            try:
                self.writer.wait()
            except Exception as exc:
                print(f"ringtrain train: a checkpoint was not written: {exc}", file=sys.stderr)

    def _finish_then_terminate(self, signum, frame) -> None:
        signal.signal(signal.SIGTERM, self._sigterm_before)
        self._finish_on_the_way_out()
        signal.raise_signal(signal.SIGTERM)

    def __enter__(self) -> _Checkpoints:
        if self.writer is not None:
            self._sigterm_before = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._finish_then_terminate)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.writer is None:
            return
        try:
            if exc_type is None:  # the run's end: its error fails the run
                with _interrupts_held():
                    self.writer.wait()
            elif issubclass(exc_type, _Interrupted):
                self._finish_on_the_way_out()
            else:
                self.writer.__exit__(exc_type, exc, tb)
        finally:
            signal.signal(signal.SIGTERM, self._sigterm_before)


def _loop(cfg: TrainConfig, rank: int, p: int, start: int, loader, step_fn, save, desc: str):
    """Steps ``start`` .. cfg.steps: ``step_fn(x, y) -> loss`` on each batch, a progress bar and
    ``save(step, last)`` every cfg.checkpoint_every steps and after the last, on every rank (``last``:
    the save of the last step, whose write the caller waits for once the job's last communication
    is done, so that no rank waits for the disk). Returns step times and losses; Ctrl-C raises
    _Interrupted with the steps done (the caller's _Checkpoints then waits for the write in flight)."""
    bar = None
    if rank == 0 and cfg.progress and start < cfg.steps:
        from tqdm import tqdm

        # (into a log rather than a terminal: a line every 30 s, not every step's carriage return)
        bar = tqdm(total=cfg.steps, initial=start, desc=desc, unit="step", file=sys.stderr,
                   mininterval=0.1 if sys.stderr.isatty() else 30.0)
    times, losses = [], []
    done = start
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            x, y = loader.next_batch()
            loss = step_fn(x, y)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            done = step + 1
            if bar is not None:
                bar.set_postfix(loss=f"{losses[-1]:.3f}", samples_s=f"{p * len(x) / times[-1]:.0f}", refresh=False)
                bar.update(1)  # (redraws at most every mininterval)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                with _interrupts_held():
                    save(done, done == cfg.steps)
        if cfg.checkpoint_every and start < cfg.steps and cfg.steps % cfg.checkpoint_every:
            with _interrupts_held():
                save(cfg.steps, True)  # the last step too, so that the same command run again has nothing to do
    except KeyboardInterrupt:
        raise _Interrupted(done, rank) from None
    finally:
        if bar is not None:
            bar.close()
    return times, losses


def worker(cfg: TrainConfig, json_summary: bool = False) -> int:
    from .lifecycle import die_with_parent

    die_with_parent()
    if cfg.strategy != "ring":
        return ps_worker(cfg, json_summary)
    import numpy as np
    import torch

    import ringtrain
    from . import checkpoint, data

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    comm = ringtrain.init(transport=cfg.transport, timeout=cfg.timeout, join_timeout=cfg.join_timeout)
    rank, p = comm.rank, comm.world_size
    model, loader, batch_size = _workload(cfg, rank, p)
    data.check_same_corpus(comm, loader.dataset)  # the stdlib text differs between Python builds
    opt = _optimizer(cfg)(model.parameters())

    start, found = 0, None
    if cfg.resume:
        # (the parent named the damaged ones; comm: every rank must find the same one)
        found = checkpoint.latest(cfg.checkpoint_dir, warn=False, comm=comm)
        if found is not None:
            start = checkpoint.restore_training_state(found.payload, model, opt, loader)
            _note_other_corpus(found.payload, loader, rank)
            saved_lr = {g["lr"] for g in opt.param_groups}
            for g in opt.param_groups:  # the command line's --lr, not the one the checkpoint was made with
                g["lr"] = cfg.lr
            if rank == 0:
                print(f"resumed from {found.path} at step {start}", file=sys.stderr)
                if saved_lr != {cfg.lr}:
                    print(f"learning rate {cfg.lr} (the checkpoint was made with {sorted(saved_lr)})", file=sys.stderr)
    one_worker_rate = partial(_one_worker_rate, model, model.loss, loader.dataset.batch(np.arange(batch_size)),
                              _optimizer(cfg))
    one_rate = one_worker_rate()

    ddp = ringtrain.DistributedDataParallel(
        model, comm=comm, schedule=cfg.schedule, bucket_cap_mb=cfg.bucket_cap_mb, algorithm=cfg.algorithm,
        timeline=cfg.timeline or None, compression=None if cfg.compression in ("none", "powersgd") else cfg.compression,
        gradient_as_bucket_view=True,  # (this loop keeps no .grad across steps: no copy back)
    )
    power_sgd = use_power_sgd(ddp) if cfg.compression == "powersgd" else None
    if found is not None:
        _resume_power_sgd(cfg, found.payload, start, rank, p, power_sgd, ddp)
    # (every rank's error feedback is its own: gathered at each checkpoint, into rank 0's file)
    collect = None if power_sgd is None else partial(_power_sgd_entry, comm, power_sgd, ddp)

    ran = []  # per step: the plan in force, whether it had settled, the step's IterationStats

    def step_fn(x, y):
        plan, settled = ddp.plan, ddp.settled  # (the wrapper changes plans only between steps)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(ddp(x), y)
        loss.backward()
        opt.step()
        ran.append((plan, settled, ddp.last_stats))
        return loss

    with _Checkpoints(cfg, rank, lambda step: _training_state(cfg, step, model, opt, loader), collect=collect) as ckpt:
        times, losses = _loop(cfg, rank, p, start, loader, step_fn, ckpt.save, f"{cfg.model} x{p}")
        if rank == 0 and cfg.timeline and ran and not any(settled for _, settled, _ in ran):
            print(f"warning: --timeline {ddp.timeline_path}: no step traced: the trace starts at the first step run "
                  f"under the settled plan (see --help), and this run's {len(ran)} steps ended before it; run more "
                  "--steps", file=sys.stderr)

        # Timed again after training (warm caches, same load); the faster of the two is the fair
        # one-worker rate, so scaling is never flattered by a cold first measurement.
        one_rate = max(one_rate, one_worker_rate())
        rate_buf = np.array([one_rate], dtype=np.float64)
        comm.allreduce(rate_buf, op="mean")
        summary = _summary(cfg, p, comm.transport.name, batch_size, times, losses, float(rate_buf[0]), start)
        if p > 1 and ran:
            summary["communication"] = _communication(ddp, ran)
        with warnings.catch_warnings():  # (rank 0 said so above, naming --steps)
            warnings.filterwarnings("ignore", message="timeline: no iteration was traced")
            ddp.close()
        comm.close()
    if rank == 0:
        _report(summary, json_summary)
    return 0


def use_power_sgd(ddp):
    """Reduce ``ddp``'s buckets with torch's powerSGD_hook (``POWER_SGD``) over its own process
    group; returns the hook's PowerSGDState."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd

    state = power_sgd.PowerSGDState(process_group=ddp.process_group, **POWER_SGD)
    ddp.register_comm_hook(state, power_sgd.powerSGD_hook)
    return state


def _resume_power_sgd(cfg: TrainConfig, payload: dict, step: int, rank: int, p: int, state, ddp) -> None:
    """Resuming at ``step``: PowerSGD goes on with the checkpoint's state where it is this job's
    (powersgd_state.restore), or begins anew; rank 0 says which. A run without --compression
    powersgd says that it leaves the checkpoint's PowerSGD state unused."""
    from . import powersgd_state

    if state is not None:
        said = powersgd_state.restore(payload, step, rank, p, POWER_SGD, state, ddp)
    elif payload.get(powersgd_state.KEY) is not None:
        said = (f"note: the checkpoint's PowerSGD state goes unused: this run's gradients are sent with "
                f"--compression {cfg.compression}")
    else:
        return
    if rank == 0:
        print(said, file=sys.stderr)


def _power_sgd_entry(comm, state, ddp, step: int) -> dict | None:
    """The checkpoint's PowerSGD entry at ``step``, on rank 0 (which writes it): every rank's state
    gathered there (a collective, between a step and the next forward, when the wrapper's
    communicator is idle). None on the other ranks."""
    from . import powersgd_state

    every = powersgd_state.gather(comm, state)
    if every is None:
        return None
    return {powersgd_state.KEY: powersgd_state.entry(step, state, ddp.comm_hook_layout, every, POWER_SGD)}


def ps_worker(cfg: TrainConfig, json_summary: bool = False) -> int:
    """One rank of a parameter-server job: ranks [0, W) train, the last ``servers`` ranks serve."""
    import numpy as np
    import torch

    from . import ps, rendezvous
    from .ps.server_config import staleness_flag

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    strategy = {"ps-sync": "sync", "ps-async": "async", "ps-sharded": "sharded"}[cfg.strategy]
    if ps.is_server_rank(cfg.servers):
        ps.run_server_role(cfg.servers, strategy=strategy, timeout=cfg.timeout, join_timeout=cfg.join_timeout,
                           max_staleness=staleness_flag(cfg.max_staleness, cfg.strategy, "ps-async"),
                           checkpoint_dir=str(Path(cfg.checkpoint_dir) / "servers"), resume=cfg.resume)
        return 0
    info = rendezvous.job_info()
    rank, p = info.rank, info.world_size - cfg.servers
    model, loader, batch_size = _workload(cfg, rank, p)
    # (the workers share no communicator: they compare the text through the job's store, where
    # they meet, so their start-up counts: join_timeout's rule)
    join = check_join_timeout(cfg.join_timeout, cfg.timeout)
    _same_corpus_on_every_worker(rendezvous.job_store(info, join), rank, p, loader.dataset, join)
    one_worker_rate = partial(_one_worker_rate, model, model.loss, loader.dataset.batch(np.arange(batch_size)),
                              _optimizer(cfg))
    one_rate = one_worker_rate()
    pst = ps.worker_from_env(model, cfg.servers, strategy=strategy, optimizer=cfg.optimizer, lr=cfg.lr,
                             schedule=cfg.schedule, bucket_cap_mb=cfg.bucket_cap_mb, timeout=cfg.timeout,
                             join_timeout=cfg.join_timeout)
    start = pst.step_count  # the servers' step for this worker (0 unless they resumed)
    if cfg.resume:
        _resume_ps_worker(cfg, rank, model, loader, start)

    def step_fn(x, y):
        loss = model.loss(pst(x), y)
        loss.backward()
        pst.step()
        return loss

    # (every server copies its shard at the step and writes it, then rank 0 its own state)
    with _Checkpoints(cfg, rank, lambda step: _training_state(cfg, step, model, None, loader),
                      before_save=partial(pst.save_checkpoint, background=True), servers_saved=start > 0) as ckpt:
        times, losses = _loop(cfg, rank, p, start, loader, step_fn, ckpt.save, f"{cfg.model} {cfg.strategy} x{p}")
        pst.wait()
        stats = pst.close()
    one_rate = max(one_rate, one_worker_rate())
    summary = _summary(cfg, p, f"{cfg.strategy}, {plural(cfg.servers, 'server')}", batch_size, times, losses,
                       one_rate, start)
    summary["parameter_servers"] = stats
    if rank == 0:
        _report(summary, json_summary)
    return 0


def _same_corpus_on_every_worker(store, rank: int, p: int, text, join: float) -> None:
    """data.check_same_corpus_in_store, a worker that does not come in time a CommTimeout naming
    join_timeout (it was torch's own DistStoreError, "wait timeout after 10ms, keys: ...")."""
    from . import data, rendezvous
    from .errors import CommTimeout

    try:
        data.check_same_corpus_in_store(store, rank, p, text)
    except RuntimeError as exc:  # torch's store wait ran out (DistStoreError)
        raise CommTimeout(f"worker {rank}: not every one of the {p} workers put its text corpus in the job's store "
                          f"within {join:g} s (join_timeout): one has not started, or failed before it "
                          f"({rendezvous._torch_text(exc)})") from None


def _resume_ps_worker(cfg: TrainConfig, rank: int, model, loader, step: int) -> None:
    """Stand at ``step``, where the servers resumed this worker: the data position follows from
    the step (one global batch each); the RNG and buffers come from rank 0's checkpoint of that
    very step when there is one. The parameters are the servers' (pulled, never loaded here)."""
    from . import checkpoint

    saved = dict(checkpoint.list_checkpoints(cfg.checkpoint_dir))
    if step == 0:
        if saved and rank == 0:  # the parent refuses this case, unless every file of the servers is damaged
            print(f"the parameter servers hold no valid checkpoint: starting at step 0; the worker checkpoints up to "
                  f"step {max(saved)} in {cfg.checkpoint_dir} are replaced as this run saves", file=sys.stderr)
        return
    loader.seek(step)
    payload = None
    if step in saved:
        with contextlib.suppress(checkpoint.CheckpointError):  # (a damaged one: the parent named it)
            payload = checkpoint.load(saved[step]).payload
    if payload is None:
        if rank == 0:
            print(f"resumed at step {step} from the parameter servers; no whole worker checkpoint of that step, so the "
                  "random state and buffers start afresh", file=sys.stderr)
        return
    params = {name for name, _ in model.named_parameters()}
    model.load_state_dict({k: v for k, v in payload["model"].items() if k not in params}, strict=False)
    checkpoint.restore_rng(payload["rng"])
    _note_other_corpus(payload, loader, rank)
    if rank == 0:
        print(f"resumed at step {step} (parameter servers and {saved[step]})", file=sys.stderr)
        saved_lr = (payload.get("extra") or {}).get("lr")  # (the servers take this run's --lr: docs/ps.md)
        if saved_lr is not None and saved_lr != cfg.lr:
            print(f"learning rate {cfg.lr} (the checkpoint was made with {saved_lr})", file=sys.stderr)


def _report(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary, default=str))
    else:
        _print_summary(summary)


def _print_summary(s: dict) -> None:
    # (one worker sends nothing: no wire to speak of)
    compression = s.get("compression", "none")
    wire = "" if compression == "none" or s["workers"] == 1 else \
        ", gradients by PowerSGD (rank 1)" if compression == "powersgd" else f", gradients in {compression} on the wire"
    print(f"\n{s['model']} on {plural(s['workers'], 'worker')} ({s['transport']}, schedule {s['schedule']}{wire}):")
    if s["steps_run"] == 0:
        print(f"  nothing to do: the checkpoint is already at step {s['resumed_at']} (--steps {s['final_step']})")
        return
    print(f"  steps run          {s['steps_run']} (to step {s['final_step']}), last loss {s['last_loss']:.4f}")
    print(f"  step time          {s['median_step_s'] * 1e3:.1f} ms (median)")
    print(f"  throughput         {s['samples_per_s']:.0f} samples/s")
    print(f"  one worker         {s['one_worker_samples_per_s']:.0f} samples/s (forward, backward and step without "
          "communication, same load)")
    if s["workers"] > 1:  # (one worker: the ratio is only the machine's noise beside the wrapper's overhead)
        print(f"  scaling            {s['samples_per_s'] / s['one_worker_samples_per_s']:.2f}x on "
              f"{plural(s['workers'], 'worker')} ({100 * s['scaling_efficiency']:.0f}% efficiency)")
    if s.get("communication"):
        print(f"  communication      {_communication_text(s)}")
        if s["communication"].get("trial"):
            print(f"  trial of plans     {_trial_text(s['communication']['trial'])}")
    if s.get("parameter_servers"):
        print(f"  parameter servers  {_servers_text(s['parameter_servers'], s['steps_run'], s['resumed_at'])}")
    if s.get("checkpoint_dir"):
        how = "the same command" if s.get("resumes", True) else "the same command without --no-resume"
        print(f"  checkpoints        {s['checkpoint_dir']} ({how} with more --steps continues from "
              f"step {s['final_step']})")


def _communication_text(s: dict) -> str:
    from .ddp.trial import CANDIDATES, FIXED_CANDIDATES, METHOD_CANDIDATES

    comm, n = s["communication"], s["communication"]["steps_measured"]
    if n:
        k = comm["buckets"]
        kept = comm["kept"]
        plan = (f"{CANDIDATES[kept]}, which the trial timed faster than the optimal plan"
                if kept in FIXED_CANDIDATES + METHOD_CANDIDATES else f"the {comm['plan_in_force']} plan")
        return (f"{100 * comm['hidden_fraction']:.0f}% hidden behind backward, {k} allreduce{'s' * (k != 1)} per "
                f"step (median of the last {n} step{'s' * (n != 1)}, those run under the plan in force: {plan})")
    if s["steps_run"] <= comm["profiling_steps"]:
        return (f"not measured: the first {comm['profiling_steps']} steps time backward (one allreduce after it) to "
                f"make the {s['schedule']} plan, and this run had {s['steps_run']}")
    if not comm["settled"]:
        return f"not measured: the trial of plans had not finished ({s['steps_run']} steps); run more --steps"
    return "not measured: no step ran under the plan in force (it was made after the last step)"


def _servers_text(stats: dict, steps_run: int, resumed_at: int = 0) -> str:
    """Worker 0's account of the parameter servers over this run's ``steps_run`` steps: bytes each
    way, and where asynchronous, the staleness bound and the histogram of the staleness the servers
    saw (since step 0: the servers keep it in their checkpoints, so a run resumed at ``resumed_at``
    reports the job's, not this run's alone)."""
    line = (f"{stats['bytes_sent'] / 1e6:.0f} MB pushed, {stats['bytes_received'] / 1e6:.0f} MB pulled by worker 0 "
            f"in {plural(steps_run, 'step')}")
    if stats.get("strategy") == "async":
        bound = stats.get("max_staleness", 0)
        seen = ", ".join(f"{k}: {v}" for k, v in stats.get("staleness_histogram", {}).items()) or "none"
        since = f" since step 0 (this run resumed at step {resumed_at})" if resumed_at else ""
        servers = stats.get("servers", 1)
        each = f", over the {servers} servers: each counts its shard of every gradient" if servers > 1 else ""
        line += (f"; staleness bound {'none' if bound is None else bound}, staleness seen{since} (updates applied "
                 f"since a gradient's parameters: count{each}) {seen}")
    return line


def _trial_text(trial: list[dict]) -> str:
    """What the trial of plans timed (forward+backward medians of the slowest rank), the one kept first."""
    from .ddp.trial import CANDIDATES

    ordered = sorted(trial, key=lambda c: not c["kept"])
    timed = [f"{CANDIDATES[c['label']]} ({plural(c['groups'], 'group')}) {c['median_s'] * 1e3:.1f} ms" for c in ordered]
    return f"kept {timed[0]}; against {', '.join(timed[1:])} (forward+backward, median of the slowest rank)"


if __name__ == "__main__":
    from .cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
