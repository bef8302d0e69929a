"""Fault injection: start a job's ranks, hurt one of them, and watch what the others do.

Words:

- *victim*: the rank that is hurt — killed with SIGKILL or stopped with SIGSTOP by this
  (the parent) process, or killing itself at a precise point (inside backward, inside a
  checkpoint write) through :meth:`Fault.kill_me`.
- *survivor*: every other rank. It must end the collective it is in with a CommError
  (PeerLost or CommTimeout) within the communicator's timeout + ``GRACE`` seconds of the
  fault, and then exit on its own.
- *fault time*: ``time.monotonic()`` when the signal was sent (CLOCK_MONOTONIC is one clock
  for every process of the host, so ranks' own readings compare with it directly).
- *left behind*: a process of the job (a rank, or any process a rank started) still alive
  ``EXIT_GRACE`` seconds after the survivors reported. Every one found is counted, then killed.
- *survived*: a fault after which every survivor raised in time and nothing was left behind.

Ranks run through ``mp_harness._child`` (spawned interpreters, per-rank faulthandler dumps);
this module adds what ``mp_harness.run_ranks`` cannot give: the ranks' pids while they run,
a signal at a chosen moment, and a check that the survivors exit without being killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field

from mp_harness import RankError, _child, free_port

GRACE = 2.0
"""Seconds a survivor may take beyond the communicator's timeout (issue 6's bar)."""
EXIT_GRACE = 10.0
"""Seconds a survivor has, after reporting, to exit on its own."""
WARMUP_CALLS = 3
"""Collectives every rank completes (checked) before the fault is injected."""


class Fault:
    """Handed to every rank as its first extra argument: readiness and the fault's time."""

    def __init__(self, ctx):
        self._ready = ctx.Semaphore(0)
        self._at = ctx.Value("d", 0.0)

    def ready(self) -> None:
        """Say this rank is warmed up (call once)."""
        self._ready.release()

    def kill_me(self) -> None:
        """SIGKILL this process now, recording the fault time first."""
        self._at.value = time.monotonic()
        os.kill(os.getpid(), signal.SIGKILL)

    def wait_ready(self, world_size: int, deadline: float) -> None:
        for _ in range(world_size):
            if not self._ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError("the ranks did not warm up in time")

    @property
    def at(self) -> float:
        return self._at.value


@dataclass
class Outcome:
    """What happened after one fault."""

    victim: int
    signal_name: str
    fault_at: float
    """Fault time (0.0: the victim never reached its fault point)."""
    results: dict[int, object] = field(default_factory=dict)
    """Survivor rank -> its return value (a dict from :func:`until_error`) or a RankError."""
    left_behind: list[int] = field(default_factory=list)
    """Pids still alive after the exit grace (killed since)."""

    def errors(self) -> dict[int, str]:
        return {r: (v.get("error") if isinstance(v, dict) else repr(v)) for r, v in self.results.items()}


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc, no psutil)."""
    parent_of: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            parent_of[int(name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parent_of.items() if p in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie, already dead and only waiting to be reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] != "Z"
    except OSError:
        return False


def inject(fn, world_size: int, victim: int, sig: int | None, *args, timeout: float,
           ready_timeout: float = 90.0, seed: int = 0) -> Outcome:
    """Run ``fn(rank, world_size, port, fault, *args)`` on ``world_size`` spawned ranks.

    Once every rank called ``fault.ready()``, wait a random 0-50 ms and send ``sig`` to
    ``victim`` (``sig=None``: the victim hurts itself through ``fault.kill_me``). Collect
    the survivors' results (waiting at most ``timeout + 30`` s after the fault: a survivor
    that has not reported by then hung), give them ``EXIT_GRACE`` s to exit, then kill
    whatever of the job is left and report it.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fault = Fault(ctx)
    port = free_port()
    dumps = [tempfile.NamedTemporaryFile(prefix=f"fault-rank{r}-", suffix=".txt", delete=False).name
             for r in range(world_size)]
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, (fault, *args), results, dumps[r]), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out = Outcome(victim, signal.Signals(sig).name if sig else "SIGKILL (self)", 0.0)
    family: set[int] = set()
    try:
        try:
            fault.wait_ready(world_size, time.monotonic() + ready_timeout)
        except TimeoutError:
            early = []
            while not results.empty():
                rank, status, value = results.get()
                early.append(f"rank {rank}: {value if status == 'ok' else value[2]}")
            raise TimeoutError("the ranks did not warm up in time\n" + "\n".join(early)) from None
        for p in procs:
            family |= {p.pid} | descendants(p.pid)
        if sig is not None:
            time.sleep(random.Random(seed).uniform(0.0, 0.05))
            out.fault_at = time.monotonic()
            os.kill(procs[victim].pid, sig)
        end = time.monotonic() + timeout + 30.0
        survivors = set(range(world_size)) - {victim}
        while survivors - set(out.results):
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > end:
                    stacks = "\n".join(f"--- rank {r} ---\n{open(dumps[r]).read()}" for r in sorted(survivors - set(out.results)))
                    raise TimeoutError(f"survivors {sorted(survivors - set(out.results))} hung after the fault\n{stacks}")
                for r in survivors - set(out.results):
                    if procs[r].exitcode is not None and results.empty():
                        time.sleep(0.3)
                        if results.empty():
                            out.results[r] = RankError("Died", f"exit code {procs[r].exitcode}", "")
                continue
            if rank in survivors:
                out.results[rank] = value if status == "ok" else RankError(*value)
        if sig is None:
            out.fault_at = fault.at
        for r in survivors:
            procs[r].join(EXIT_GRACE)
        if sig is None:
            procs[victim].join(EXIT_GRACE)
        out.left_behind = sorted(pid for pid in family if pid != procs[victim].pid and alive(pid))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for pid in family:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for d in dumps:
            try:
                os.unlink(d)
            except OSError:
                pass
    return out


def until_error(step, fault: Fault, check=None, limit_s: float = 60.0) -> dict:
    """Call ``step()`` until it raises a CommError; say ready after ``WARMUP_CALLS`` calls.

    ``check(i)`` (optional) verifies call i's result, raising AssertionError on a wrong one.
    Returns the error's type name and text, ``t_error`` (monotonic), the calls completed, and
    what a further call raised, as ``Type: text`` (a broken communicator must refuse it).
    """
    from ringtrain import CommError

    done = 0
    give_up = time.monotonic() + limit_s
    while time.monotonic() < give_up:
        try:
            step()
        except CommError as exc:
            t_error = time.monotonic()
            try:
                step()
                again = None
            except Exception as exc2:  # noqa: BLE001 - the test judges what a broken job raises
                again = f"{type(exc2).__name__}: {exc2}"
            return {"error": type(exc).__name__, "message": str(exc), "t_error": t_error, "done": done,
                    "again": again}
        if check is not None:
            check(done)
        done += 1
        if done == WARMUP_CALLS:
            fault.ready()
    return {"error": None, "message": f"no error in {limit_s} s", "t_error": time.monotonic(), "done": done,
            "again": None}
