"""Starting parameter servers: beside local workers, or as ranks of a torchrun job.

Two ways to run a parameter-server job:

- *local servers* (:func:`launch_local`): the calling process starts K server processes
  (multiprocessing, spawn) on this host and gets their endpoints; the workers are whatever
  processes the caller runs, each given those endpoints. ``LocalServers.join()`` returns
  every server's counters; leaving the ``with`` block kills servers still running.
- *roles in one torchrun job* (:func:`is_server_rank`, :func:`run_server_role`,
  :func:`worker_from_env`): the job has W + K ranks; ranks [0, W) are workers (worker index =
  rank, so rank 0 is worker 0: the one that prints, checkpoints and reports, as in every other
  ringtrain job), ranks [W, W+K) are servers (server index = rank - W). Each server publishes
  its endpoint in the job's c10d TCPStore under ``ringtrain-ps/<job>/server/<k>``; workers read
  them from there. ``ringtrain launch`` / torch.distributed.run (or ``bench.procs``) starts all
  of them with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and RINGTRAIN_SECRET.

:func:`benchmark` runs N steps of a reference model with local servers and workers and
returns step times and byte counts (for ``ringtrain bench train``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import fields, replace
from typing import Any, Optional

from .. import rendezvous
from ..errors import CommError, CommTimeout, check_keywords
from ..lifecycle import tie_to_launcher
from ..session import warn_if_unauthenticated
from .server import run_server
from .server_config import ServerConfig
from .worker import ParameterServerTraining, PSOptions

_STORE_KEY = "ringtrain-ps/{job}/server/{k}"


# --- local servers ------------------------------------------------------------------------------


def _server_child(cfg: ServerConfig, results) -> None:
    results.put((cfg.index, "started", None))  # past the spawn bootstrap (see LocalServers._died)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        stats = run_server(cfg, ready=lambda ep: results.put((cfg.index, "ready", list(ep))))
        results.put((cfg.index, "done", stats))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((cfg.index, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class LocalServers:
    """K server processes on this host; use as a context manager so none outlives the caller."""

    def __init__(self, configs: list[ServerConfig], timeout: float):
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self.procs = [ctx.Process(target=_server_child, args=(c, self._results), daemon=True) for c in configs]
        for p in self.procs:
            p.start()
        self.endpoints: list[Optional[tuple[str, int]]] = [None] * len(configs)
        self.stats: list[Optional[dict]] = [None] * len(configs)
        self.errors: dict[int, str] = {}
        self.started = [False] * len(configs)
        deadline = time.monotonic() + timeout
        try:
            while any(e is None for e in self.endpoints):
                self._collect(deadline, "start")
        except BaseException:
            self.kill()
            raise

    def _collect(self, deadline: float, what: str) -> None:
        try:
            k, kind, value = self._results.get(timeout=max(0.01, min(0.2, deadline - time.monotonic())))
        except queue.Empty:
            dead = [k for k, p in enumerate(self.procs) if p.exitcode is not None and self.stats[k] is None
                    and k not in self.errors]
            if dead:
                time.sleep(0.2)
                if self._results.empty():
                    raise CommError(self._died(dead, what))
            if time.monotonic() > deadline:
                raise CommTimeout(f"parameter servers did not {what} in time")
            return
        if kind == "started":
            self.started[k] = True
        elif kind == "ready":
            self.endpoints[k] = (value[0], int(value[1]))
        elif kind == "done":
            self.stats[k] = value
        else:
            self.errors[k] = value
            if self.endpoints[k] is None:  # it will never listen: say why now, not at the deadline
                code = self.procs[k].exitcode
                raise CommError(f"parameter server {k} failed to start"
                                f"{'' if code is None else f' (exit code {code})'}: {_tail(value)}")

    def _died(self, dead: list[int], what: str) -> str:
        """Why servers ``dead`` exited without a word. One that never sent "started" died in the spawn
        bootstrap, which imports the caller's main module again: with code 1, that import raised,
        most often because the script starts servers at its top level, so the import starts them
        again and multiprocessing refuses (the child's stderr says "bootstrapping phase")."""
        codes = [self.procs[k].exitcode for k in dead]
        text = f"parameter server(s) {dead} exited (code {codes}) before they could {what}"
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        if main and any(not self.started[k] and self.procs[k].exitcode == 1 for k in dead):
            text += (f": they died starting up, before any server code ran. The spawn start method imports the main "
                     f"module {main} again in each server process (the traceback is on stderr); if that script calls "
                     "ps.launch_local() at its top level, put the call under `if __name__ == \"__main__\":`")
        return text

    def join(self, timeout: float = 60.0) -> list[Optional[dict]]:
        """Wait for every server to finish; return their counters (None for a failed one)."""
        deadline = time.monotonic() + timeout
        while any(self.stats[k] is None and k not in self.errors for k in range(len(self.procs))):
            self._collect(deadline, "finish")
        for p in self.procs:
            p.join(5)
        return self.stats

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def __enter__(self) -> "LocalServers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def _tail(report: str, lines: int = 12) -> str:
    """The error line and the last ``lines`` lines of a child's traceback report."""
    first, _, rest = report.partition("\n")
    tail = rest.strip().splitlines()[-lines:]
    return first + ("\n" + "\n".join(tail) if tail else "")


def launch_local(servers: int, workers: int, *, strategy: str = "sync", max_staleness: Optional[int] = 0,
                 timeout: float = 60.0, join_timeout: Optional[float] = None, job: str = "ps",
                 secret: Optional[bytes] = None, checkpoint_dir: str = "", resume: bool = False,
                 host: str = "127.0.0.1") -> LocalServers:
    """Start ``servers`` parameter-server processes for ``workers`` workers; return when all listen
    (within ``join_timeout``: ServerConfig's)."""
    base = ServerConfig(index=0, servers=servers, workers=workers, strategy=strategy, max_staleness=max_staleness,
                        host=host, job=job, secret=secret, timeout=timeout, join_timeout=join_timeout,
                        checkpoint_dir=checkpoint_dir, resume=resume)
    return LocalServers([replace(base, index=k) for k in range(servers)], base.join_s)


# --- roles in a torchrun job --------------------------------------------------------------------


def _store(info: rendezvous.JobInfo, timeout: float):
    # The job's own store, so that servers and workers agree on keys whatever else each has opened.
    return rendezvous.job_store(info, timeout)


def check_servers(servers: int, world_size: int, name: str = "servers") -> None:
    """ValueError unless a job of ``world_size`` ranks can have ``servers`` server ranks: at least
    one, and at least one worker left. ``name``: what the message calls the count (a flag)."""
    if not 1 <= servers < world_size:
        raise ValueError(f"{name} must be in [1, world_size={world_size}), got {servers}")


def is_server_rank(servers: int, rank: Optional[int] = None, world_size: Optional[int] = None) -> bool:
    """Whether torchrun rank ``rank`` (default: RANK) is one of the job's ``servers`` last ranks."""
    if rank is None or world_size is None:
        info = rendezvous.job_info(rank, world_size)
        rank, world_size = info.rank, info.world_size
    check_servers(servers, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank >= world_size - servers


def run_server_role(servers: int, *, strategy: str = "sync", max_staleness: Optional[int] = 0, timeout: float = 60.0,
                    join_timeout: Optional[float] = None, job: str = "ps", checkpoint_dir: str = "",
                    resume: bool = False) -> dict:
    """Be server RANK - W of a torchrun job whose last ``servers`` ranks serve; return its counters."""
    tie_to_launcher()  # (as ringtrain.init() does: these ranks do not call it)
    info = rendezvous.job_info()
    if not is_server_rank(servers, info.rank, info.world_size):
        raise ValueError(f"rank {info.rank} is a worker rank (the last {servers} of {info.world_size} ranks serve)")
    workers = info.world_size - servers
    index = info.rank - workers
    host = rendezvous.local_address_towards(info.master_addr)
    cfg = ServerConfig(index=index, servers=servers, workers=workers, strategy=strategy,
                       max_staleness=max_staleness, host=host, job=job, secret=info.secret, timeout=timeout,
                       join_timeout=join_timeout, checkpoint_dir=checkpoint_dir, resume=resume)
    store = _store(info, cfg.join_s)  # (rank 0, a worker, serves it: its start-up counts)
    return run_server(cfg, ready=lambda ep: store.set(_STORE_KEY.format(job=job, k=index), json.dumps(list(ep))))


def worker_from_env(module, servers: int, **settings: Any) -> ParameterServerTraining:
    """Wrap ``module`` as worker RANK of a torchrun job whose last ``servers`` ranks serve."""
    tie_to_launcher()
    info = rendezvous.job_info()
    warn_if_unauthenticated(info)  # (rank 0 is worker 0)
    if is_server_rank(servers, info.rank, info.world_size):
        raise ValueError(f"rank {info.rank} is a server rank (the last {servers} of {info.world_size} ranks serve)")
    check_keywords("ringtrain.ps.worker_from_env", settings,
                   (f.name for f in fields(PSOptions) if f.name != "secret"))  # (the job's: RINGTRAIN_SECRET)
    opts = PSOptions(secret=info.secret, **settings)
    join = opts.join_s
    store = _store(info, join)
    endpoints = []
    for k in range(servers):
        try:
            endpoints.append(json.loads(store.get(_STORE_KEY.format(job=opts.job, k=k)).decode()))
        except RuntimeError as exc:  # torch's store wait ran out (DistStoreError)
            raise CommTimeout(
                f"worker {info.rank}: parameter server {k} (rank {info.world_size - servers + k}) did not publish its "
                f"endpoint in the job's store within {join:g} s (join_timeout): it is not running, failed before it "
                f"listened, or serves another job name than {opts.job!r} ({rendezvous._torch_text(exc)})") from None
    return ParameterServerTraining(module, servers=endpoints, worker=info.rank,
                                   workers=info.world_size - servers, options=opts)


# --- benchmark ------------------------------------------------------------------------------------


def train_steps(ps: ParameterServerTraining, model, loader, steps: int) -> dict:
    """Run ``steps`` steps of a reference model's loop, close ``ps``; step times, losses, stats.

    ``bytes_per_step`` counts from the end of the first step, once its pushes are out and the
    next parameters in (the first pull and worker 0's INIT, each the whole model, come before
    it), to the last pull: ``steps - 1`` steps.
    """
    times, losses = [], []
    after_first = None
    for k in range(steps):
        t0 = time.perf_counter()
        x, y = loader.next_batch()
        loss = model.loss(ps(x), y)
        loss.backward()
        ps.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if k == 0:
            ps.wait()  # (the first step is a warm-up in every benchmark)
            after_first = _bytes(ps)
    ps.wait()
    end = _bytes(ps)
    stats = ps.close()
    per_step = None
    if steps > 1:
        per_step = {"sent": (end[0] - after_first[0]) / (steps - 1), "received": (end[1] - after_first[1]) / (steps - 1)}
    return {"step_s": times, "losses": losses, "stats": stats, "bytes_per_step": per_step}


def _bytes(ps: ParameterServerTraining) -> tuple[int, int]:
    s = ps.stats()
    return s["bytes_sent"], s["bytes_received"]


def _bench_worker(w: int, workers: int, endpoints, model_name: str, steps: int, batch_size: int,
                  seed: int, opts: PSOptions, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        from .. import data, models

        torch.set_num_threads(1)
        spec = models.spec(model_name)
        model = models.build(model_name, seed=seed)
        dataset = data.dataset(spec.dataset, seed=seed, **spec.batch_kwargs)
        loader = data.ShardedLoader(dataset, batch_size or spec.batch_size, rank=w, world_size=workers, seed=seed)
        ps = ParameterServerTraining(model, servers=endpoints, worker=w, workers=workers, options=opts)
        results.put((w, "ok", train_steps(ps, model, loader, steps)))
    except BaseException as exc:  # noqa: BLE001
        results.put((w, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def benchmark(model: str = "mlp", strategy: str = "sync", servers: int = 1, workers: int = 2, steps: int = 10,
              *, batch_size: int = 0, seed: int = 0, max_staleness: Optional[int] = 0, timeout: float = 120.0,
              **settings: Any) -> dict:
    """Train ``model`` for ``steps`` steps with local servers and worker processes; timings and bytes.

    Returns median step time (after 2 warm-up steps when ``steps`` > 4; with 4 or fewer every step
    is timed, so that at least 3 are), per-worker step times and losses, bytes per worker and per
    server, and the staleness histogram (async).
    """
    import numpy as np

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    opts = PSOptions(strategy=strategy, timeout=timeout, **settings)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with launch_local(servers, workers, strategy=strategy, max_staleness=max_staleness, timeout=timeout,
                      join_timeout=opts.join_timeout, secret=opts.secret, job=opts.job) as srv:
        procs = [ctx.Process(target=_bench_worker, daemon=True,
                             args=(w, workers, srv.endpoints, model, steps, batch_size, seed, opts, results))
                 for w in range(workers)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < workers:
                try:
                    w, kind, value = results.get(timeout=0.5)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise CommTimeout(f"benchmark workers {sorted(set(range(workers)) - set(out))} did not finish")
                    continue
                if kind != "ok":
                    raise CommError(f"benchmark worker {w} failed: {value}")
                out[w] = value
            server_stats = srv.join(timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
    rows = [out[w]["step_s"] for w in range(workers)]
    steady = np.max(np.array(rows)[:, 2:] if steps > 4 else np.array(rows), axis=0)  # the slowest worker
    bs = batch_size or _default_batch(model)
    median = float(np.median(steady))
    return {
        "model": model, "strategy": strategy, "servers": servers, "workers": workers, "steps": steps,
        "median_step_s": median, "samples_per_s": workers * bs / median,
        "worker_step_s": rows, "losses": [out[w]["losses"] for w in range(workers)],
        "bytes_per_worker": [{"sent": out[w]["stats"]["bytes_sent"], "received": out[w]["stats"]["bytes_received"]}
                             for w in range(workers)],
        "bytes_per_server": [{"sent": s["bytes_sent"], "received": s["bytes_received"]} if s else None
                             for s in server_stats],
        "staleness_histogram": _merge_hist(server_stats),
        "notices": sorted({n for s in server_stats if s for n in s["notices"]}),
    }


def _default_batch(model: str) -> int:
    from .. import models

    return models.spec(model).batch_size


def _merge_hist(stats) -> dict[str, int]:
    total: dict[int, int] = {}
    for s in stats:
        for k, v in ((s or {}).get("staleness_histogram") or {}).items():
            total[int(k)] = total.get(int(k), 0) + v
    return {str(k): v for k, v in sorted(total.items())}
