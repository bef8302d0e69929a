"""Starting the ranks of a benchmark: N local processes, or one per emulated host.

Each rank is ``python -m <module> <args>`` with torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) in its environment, so the worker is an ordinary ringtrain job.
Rank 0 prints its result as one JSON line prefixed by ``RESULT ``; the other ranks' output
is kept for the error report. If any rank fails or the deadline passes, every rank is killed
and the error names the rank and shows the tail of its output.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Optional, Sequence

RESULT_PREFIX = "RESULT "


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    pass


def run_ranks(
    module: str,
    args: Sequence[str],
    world_size: int,
    *,
    timeout: float,
    net=None,
    extra_env: Optional[dict] = None,
) -> list[dict]:
    """Run the job; return the list of RESULT documents printed by rank 0."""
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
        argv = [sys.executable, "-m", module, *args]
        procs = []
        try:
            for rank in range(world_size):
                renv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
                if net is not None:
                    renv["RINGTRAIN_HOST_ID"] = net.host_id(rank)
                    procs.append(net.popen(rank, argv, env=renv, stdout=logs[rank], stderr=subprocess.STDOUT))
                else:
                    procs.append(subprocess.Popen(argv, env=renv, stdout=logs[rank], stderr=subprocess.STDOUT))
            _wait_all(procs, logs, timeout)
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
    log.seek(0)
    return "".join(log.readlines()[-n:])


def _wait_all(procs, logs, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                raise RankFailed(f"rank {rank} exited with status {code}:\n{_tail(logs[rank])}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > end:
            running = [r for r, c in enumerate(codes) if c is None]
            raise RankFailed(f"ranks {running} still running after {timeout:.0f}s:\n{_tail(logs[running[0]])}")
        time.sleep(0.05)


def emit(doc: dict) -> None:
    """Print one result document from rank 0 (parsed by run_ranks)."""
    print(RESULT_PREFIX + json.dumps(doc), flush=True)
