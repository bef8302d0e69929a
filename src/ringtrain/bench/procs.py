"""Starting the ranks of a benchmark: N local processes, or one per emulated host.

Each rank is ``python -m <module> <args>`` with torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) in its environment, so the worker is an ordinary ringtrain job
(``python`` is this interpreter unless the caller names another: Horovod's workers run under an
interpreter of their own, with the variables of ``bench.horovod`` on top).
Rank 0 prints its result as one JSON line prefixed by ``RESULT ``; the other ranks' output
is kept for the error report. If any rank fails or the deadline passes, every rank is killed
and the error names the rank and shows the tail of its output (without rank 0's RESULT and
PROGRESS lines, which were meant for this process).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Callable, Mapping, Optional, Sequence

from ..lifecycle import LAUNCHER_ENV
from .netem import HOST_IFNAME

RESULT_PREFIX = "RESULT "
#: A line rank 0 prints for the user while it runs (see :func:`progress`); shown on stderr at once.
PROGRESS_PREFIX = "PROGRESS "
#: The exit status of a run stopped by Ctrl-C (128 + SIGINT), as the shell gives it.
INTERRUPTED_STATUS = 130


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    pass


def emulated(rate: str, hosts: int) -> AbstractContextManager:
    """The network a benchmark's ranks run on, for ``with ... as net: run_ranks(..., net=net)``:
    none (``net`` is None, the ranks share this host) for rate "none", else an emulated network
    of ``hosts`` hosts at that rate, removed when the block ends."""
    if rate == "none":
        return nullcontext()
    from .netem import EmulatedNetwork

    return EmulatedNetwork(hosts, rate=rate)


def check_hosts(option: str, hosts: int, rate: str) -> None:
    """Refuse (ValueError naming ``option``) a job of ``hosts`` processes that :func:`emulated` at
    ``rate`` cannot give a host each: before, the run failed with a traceback when it came to it,
    after the jobs before it had run."""
    from .netem import MAX_HOSTS

    if rate != "none" and hosts > MAX_HOSTS:
        raise ValueError(f"{option}: under --net {rate} each rank is a host of its own, at most {MAX_HOSTS} "
                         f"on the emulated network; a job here needs {hosts}")


def network(rate: str) -> dict | None:
    """What a result file records of the network :func:`emulated` makes at ``rate``: each link's
    shaping (``netem.LinkShape.to_dict``, the defaults EmulatedNetwork takes), so that the run can be
    reproduced; None for "none" (the ranks share this host's loopback)."""
    from .netem import LinkShape

    shape = LinkShape.for_rate(rate)
    return None if shape is None else shape.to_dict()


def run_ranks(
    module: str,
    args: Sequence[str],
    world_size: int,
    *,
    timeout: float,
    net=None,
    extra_env: Optional[dict] = None,
    on_result: Optional[Callable[[dict], None]] = None,
    python: Optional[str] = None,
    rank_env: Optional[Callable[[int], Mapping[str, str]]] = None,
) -> list[dict]:
    """Run the job; return the list of RESULT documents printed by rank 0.

    ``python`` runs the ranks (default: this interpreter); ``rank_env(rank)``, variables one rank
    gets on top of the others (Horovod's rank, size and host, which no torchrun variable gives).

    ``on_result`` is also given each document as it comes, while the job runs: a caller that
    keeps them has what the job finished when it is then stopped (Ctrl-C, a failed rank, the
    deadline), which the returned list, made at the end, cannot give."""
    with ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(world_size)]
        master = net.addr(0) if net is not None else "127.0.0.1"
        env = dict(os.environ)
        env.update(extra_env or {})
        env.update(
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=master,
            MASTER_PORT=str(free_port() if net is None else 29400 + os.getpid() % 1000),
            RINGTRAIN_SECRET=env.get("RINGTRAIN_SECRET") or secrets.token_hex(16),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        )
        env[LAUNCHER_ENV] = str(os.getpid())  # (a rank that finds this process gone ends: die_with_parent)
        argv = [python or sys.executable, "-m", module, *args]
        echo = _Progress(logs[0], on_result)
        procs = []
        try:
            for rank in range(world_size):
                renv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
                renv.update(rank_env(rank) if rank_env is not None else {})
                if net is not None:
                    renv["RINGTRAIN_HOST_ID"] = net.host_id(rank)
                    # the host's own interface: one this machine's environment names (ens5) is not there
                    renv["GLOO_SOCKET_IFNAME"] = HOST_IFNAME
                    procs.append(net.popen(rank, argv, env=renv, stdout=logs[rank], stderr=subprocess.STDOUT))
                else:
                    procs.append(subprocess.Popen(argv, env=renv, stdout=logs[rank], stderr=subprocess.STDOUT))
            _wait_all(procs, logs, timeout, echo.poll)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        logs[0].seek(0)
        return [json.loads(line[len(RESULT_PREFIX):]) for line in logs[0] if line.startswith(RESULT_PREFIX)]


def _tail(log, n: int = 30) -> str:
    """The last ``n`` lines a rank wrote, without those it wrote for this process (RESULT documents,
    PROGRESS lines already shown): what the rank itself said, for the error report."""
    log.seek(0)
    said = [line for line in log.readlines() if not line.startswith((RESULT_PREFIX, PROGRESS_PREFIX))]
    return "".join(said[-n:])


def _said(log) -> str:
    """``":\n"`` and the rank's last lines (``_tail``) for a RankFailed, or "" where it wrote none:
    a rank killed at once (kill -9) left the command's line ending in a colon, then a blank line."""
    tail = _tail(log)
    return f":\n{tail}" if tail.strip() else ""


class _Progress:
    """Rank 0's PROGRESS lines echoed to stderr as they come, and its RESULT documents handed to
    ``on_result``. The log is read with pread: the rank writes through the same open file, and
    moving its offset would overwrite its output."""

    def __init__(self, log, on_result: Optional[Callable[[dict], None]] = None) -> None:
        self.on_result = on_result
        self.fd = log.fileno()
        self.offset = 0
        self.partial = b""

    def poll(self) -> None:
        while chunk := os.pread(self.fd, 1 << 16, self.offset):
            self.offset += len(chunk)
            self.partial += chunk
        *lines, self.partial = self.partial.split(b"\n")
        for line in lines:
            if line.startswith(PROGRESS_PREFIX.encode()):
                print(line[len(PROGRESS_PREFIX):].decode(errors="replace"), file=sys.stderr, flush=True)
            elif self.on_result is not None and line.startswith(RESULT_PREFIX.encode()):
                self.on_result(json.loads(line[len(RESULT_PREFIX):]))


def exit_text(code: int) -> str:
    """'exited with status 3', or 'was killed by SIGKILL' for a process a signal ended (a
    negative returncode), as ``ringtrain launch`` and ``train`` name it."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _wait_all(procs, logs, timeout: float, poll=lambda: None) -> None:
    end = time.monotonic() + timeout
    while True:
        poll()
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                poll()  # (what rank 0 sent between the last poll and this status)
                raise RankFailed(f"rank {rank} {exit_text(code)}{_said(logs[rank])}")
        if all(c == 0 for c in codes):
            poll()  # (what rank 0 said before it left)
            return
        if time.monotonic() > end:
            running = [r for r, c in enumerate(codes) if c is None]
            raise RankFailed(f"ranks {running} still running after {timeout:g}s{_said(logs[running[0]])}")
        time.sleep(0.05)


def emit(doc: dict) -> None:
    """Print one result document from rank 0 (parsed by run_ranks)."""
    print(RESULT_PREFIX + json.dumps(doc), flush=True)


def progress(text: str) -> None:
    """Tell the user, from rank 0, how far the run is (one short line on the parent's stderr)."""
    print(PROGRESS_PREFIX + text, flush=True)


@contextlib.contextmanager
def signals_held():
    """Until the block ends, Ctrl-C (and SIGTERM, SIGHUP) is noted instead of acted on, so that a
    run's results are saved whole: a Ctrl-C just after the ranks ended lost every row (and the
    file could be left half-written). Yields the list of the signals that came; on the main thread
    only (elsewhere the block runs as it is). An ignored signal stays ignored (SIGHUP under nohup)."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return
    held = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) != signal.SIG_IGN]
    previous = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in held}
    try:
        yield came
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


#: The signals as_interrupt turned into a Ctrl-C since the command began (``cli.main`` clears it).
AS_INTERRUPT: list[int] = []


def as_interrupt(signum: int, frame) -> None:
    """A SIGTERM or SIGHUP handler: stop as Ctrl-C does (a benchmark keeps the rows it finished)."""
    AS_INTERRUPT.append(signum)
    raise KeyboardInterrupt


def interruption() -> str:
    """What a benchmark's KeyboardInterrupt was, for its result's notes: "Ctrl-C", or the signal
    as_interrupt made one of ("SIGTERM": `timeout` ran out, or a scheduler stopped the job)."""
    return signal.Signals(AS_INTERRUPT[0]).name if AS_INTERRUPT else "Ctrl-C"


def interrupted(prog: str, kept: str = "nothing saved") -> int:
    """The one line a benchmark stopped by Ctrl-C leaves (its ranks and namespaces already gone
    with the with-blocks that made them), and the exit status for it (interrupted_status), as every
    command's."""
    print(f"{prog}: interrupted; {kept}", file=sys.stderr)
    return interrupted_status()


def interrupted_status() -> int:
    """130 for Ctrl-C; 128 + N for the signal N that as_interrupt made one of (143: SIGTERM)."""
    return 128 + AS_INTERRUPT[0] if AS_INTERRUPT else INTERRUPTED_STATUS
