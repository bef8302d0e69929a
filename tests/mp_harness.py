"""Real multi-process tests: spawn ranks, collect results, and never leave a process behind.

``run_ranks(fn, world_size, *args)`` starts ``fn(rank, world_size, port, *args)`` in fresh
interpreters (spawn), returns the per-rank results (an exception object where a rank failed),
kills every rank when the deadline passes, and writes each rank's faulthandler traceback to
its own file (printed on failure) so that a hang shows where every rank stood.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import threading
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, args, results, dump_path):
    dump = open(dump_path, "w")
    faulthandler.enable(dump)
    faulthandler.dump_traceback_later(60, exit=False, file=dump)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        results.put((rank, "ok", fn(rank, world_size, port, *args)))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        results.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))


class RankError(Exception):
    def __init__(self, type_name: str, message: str, tb: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.tb = tb


def run_ranks(fn, world_size: int, *args, timeout: float = 60.0, allow_missing: tuple[int, ...] = ()):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    dumps = [tempfile.NamedTemporaryFile(prefix=f"rank{r}-", suffix=".txt", delete=False).name for r in range(world_size)]
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, dumps[r]), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    end = time.monotonic() + timeout
    try:
        while len(out) < world_size - len(allow_missing):
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > end:
                    stacks = "\n".join(f"--- rank {r} ---\n{open(d).read()}" for r, d in enumerate(dumps))
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout}s\n{stacks}")
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out and r not in allow_missing]
                if dead:
                    time.sleep(0.3)  # a result may still be in the pipe
                    while not results.empty():
                        rank, status, value = results.get()
                        out[rank] = value if status == "ok" else RankError(*value)
                    for r in dead:
                        out.setdefault(r, RankError("Died", f"exit code {procs[r].exitcode}", ""))
                continue
            out[rank] = value if status == "ok" else RankError(*value)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        for d in dumps:
            try:
                os.unlink(d)
            except OSError:
                pass
    return [out.get(r) for r in range(world_size)]


HTTP_REPLY = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"


def answer_like_http(listener: socket.socket) -> None:
    """Answer every connection to ``listener`` (listening) as an HTTP server answers bytes it
    does not understand, on a daemon thread, until the listener is closed: a service that holds
    the port but is no rendezvous store."""
    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(HTTP_REPLY)

    threading.Thread(target=serve, daemon=True).start()
