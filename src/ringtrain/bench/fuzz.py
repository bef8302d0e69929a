"""Hostile wire input: random, malformed, truncated and oversized frames against live listeners.

    python -m ringtrain.bench.fuzz                       # 100,000 cases over the three targets
    python -m ringtrain.bench.fuzz --cases 3000 --json

Words:

- *target*: a process that serves ringtrain's wire on a TCP port, run here as a separate
  process so that a crash, a hang or its memory can be seen from outside:
  ``listener`` — a tcp transport listener (``transport.tcp_setup.Listener``) waiting for rank 1 of a
  2-rank job; every fuzz connection is a stranger that must be refused during the handshake.
  ``frames`` — the same listener, but each fuzz connection completes a genuine handshake
  (the fuzzer holds the job's secret) and then sends one hostile frame where rank 0's
  ``TcpTransport.exchange`` expects a 16-byte DATA frame: the exchange must end with the data
  or a CommError, and the connection is closed.
  ``ps`` — a parameter server (``ps.server``, asynchronous so that a lost worker is dropped
  rather than ending the job): strangers' handshakes, then, as genuine workers (one worker
  slot each), hostile parameter-server messages.
- *case*: one connection, one hostile byte string, then the fuzzer half-closes and reads
  until the target closes. Cases are drawn from a seeded generator, by *family*: random
  bytes, right magic then random, almost-right headers with random fields, valid headers cut
  short, headers that claim huge lengths (up to 2^64 - 1), bit flips of valid messages, and
  oversized junk (up to 1 MiB).
- *crash*: the target process died, an exception other than a CommError escaped its loop,
  or it stopped serving (after all cases a genuine peer must still be admitted).
- *hang*: the target did not close a fuzz connection within ``CASE_TIMEOUT`` seconds.
- *memory*: the target's resident set (VmRSS) and peak (VmHWM) before the first case and
  after the last: a frame that claims 2^40 bytes must not make the target allocate them.

The report counts cases per target and family, refusals and errors as the target logged
them (ProtocolError, AuthError, ...), crashes, hangs and memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import random
import socket
import struct
import sys
import time
from collections import Counter
from typing import Optional

from ..paths import user_path

SECRET = b"fuzz-secret-0123456789abcdef"
JOB = "fuzz"
PS_JOB = f"ringtrain-ps/{JOB}"
"""The handshake job name of a parameter server of job JOB (ps.protocol.ps_identity)."""
CASE_TIMEOUT = 10.0
TARGETS = ("listener", "frames", "ps")
#: Share of the cases each target gets.
WEIGHTS = {"listener": 0.4, "frames": 0.4, "ps": 0.2}
#: Of the ps target's cases, the share sent after a genuine handshake (one worker slot each).
PS_AUTHENTICATED = 0.3


# --- hostile byte strings (pure functions of a random.Random) ------------------------------------

def _junk(rng: random.Random, lo: int = 0, hi: int = 200) -> bytes:
    return rng.randbytes(rng.randint(lo, hi))


def _huge(rng: random.Random) -> int:
    return rng.choice([0, 1, 3, 15, 16, 17, 4095, 1 << 20, 1 << 31, 1 << 39, 1 << 40, (1 << 40) + 1, 1 << 63,
                       (1 << 64) - 1, rng.getrandbits(64)])


def _flip(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        if b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def _cut(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data) + 1)]


def handshake_case(rng: random.Random, job: str = JOB, world: int = 2) -> tuple[str, bytes]:
    """What a stranger sends to a listener of rank 0 of job ``job`` instead of a proper handshake."""
    from ..transport import wire

    hello = wire.Hello(wire.CONNECT, True, rng.randrange(1, world), 0, world, wire.job_digest(job),
                       rng.randbytes(32)).pack()
    family = rng.choice(["random", "magic", "fields", "truncated", "mac", "flip", "oversized"])
    if family == "random":
        data = _junk(rng)
    elif family == "magic":
        data = wire.HELLO_MAGIC + bytes([wire.VERSION]) + _junk(rng, 0, 140)
    elif family == "fields":
        data = struct.pack("<4sBBHIII16s32s", wire.HELLO_MAGIC, wire.VERSION, rng.randrange(4), rng.randrange(4),
                           rng.choice([1, world - 1, rng.getrandbits(32)]), rng.choice([0, rng.getrandbits(32)]),
                           rng.choice([0, 1, world, world + 1, rng.getrandbits(32)]),
                           rng.choice([wire.job_digest(job), rng.randbytes(16)]), rng.randbytes(32))
        data += rng.randbytes(rng.choice([0, 32]))
    elif family == "truncated":
        data = _cut(rng, hello + rng.randbytes(32))
    elif family == "mac":  # a well-formed hello whose MAC is a guess
        data = hello + rng.randbytes(rng.choice([0, 16, 31, 32, 64]))
    elif family == "flip":
        data = _flip(rng, hello)
    else:
        data = rng.randbytes(rng.randint(4096, 1 << 20))
    return family, data


def frame_case(rng: random.Random) -> tuple[str, bytes]:
    """A hostile frame where a 16-byte DATA frame of call ``FUZZ_CALL`` is expected."""
    from ..transport import wire

    good = wire.encode_data_header(FUZZ_CALL, 16) + rng.randbytes(16)
    family = rng.choice(["random", "magic", "fields", "truncated", "claims", "abort", "flip", "oversized"])
    if family == "random":
        data = _junk(rng)
    elif family == "magic":
        data = wire.FRAME_MAGIC + bytes([wire.VERSION]) + _junk(rng, 0, 120)
    elif family == "fields":
        call = rng.choice([FUZZ_CALL.pack(), rng.randbytes(36)])
        data = struct.pack("<4sBBH36sQ", wire.FRAME_MAGIC, rng.choice([wire.VERSION, rng.randrange(256)]),
                           rng.randrange(4), rng.choice([0, rng.getrandbits(16)]), call, _huge(rng))
        data += _junk(rng, 0, 64)
    elif family == "truncated":
        data = _cut(rng, good)
    elif family == "claims":  # the right call, a length that is not what the receiver expects
        data = struct.pack("<4sBBH36sQ", wire.FRAME_MAGIC, wire.VERSION, wire.DATA, 0, FUZZ_CALL.pack(),
                           _huge(rng)) + _junk(rng, 0, 64)
    elif family == "abort":
        length = rng.choice([0, 3, 4, 5, 100, 1028, 1029, _huge(rng)])
        data = struct.pack("<4sBBH36sQ", wire.FRAME_MAGIC, wire.VERSION, wire.ABORT, 0,
                           rng.choice([bytes(36), rng.randbytes(36)]), length)
        data += struct.pack("<I", rng.getrandbits(32)) + _junk(rng, 0, 1100)
    elif family == "flip":
        data = _flip(rng, good)
    else:
        data = struct.pack("<4sBBH36sQ", wire.FRAME_MAGIC, wire.VERSION, wire.DATA, 0, FUZZ_CALL.pack(),
                           rng.choice([1 << 20, 1 << 40])) + rng.randbytes(rng.randint(4096, 1 << 20))
    return family, data


def ps_message_case(rng: random.Random, worker: int) -> tuple[str, bytes]:
    """A hostile parameter-server message from an authenticated worker (as its first message)."""
    from ..ps import protocol as P
    from ..transport import wire
    from ..transport.base import CallHeader

    def framed(body: bytes, claim: Optional[int] = None) -> bytes:
        n = len(body) if claim is None else claim
        return struct.pack("<4sBBH36sQ", wire.FRAME_MAGIC, wire.VERSION, wire.DATA, 0,
                           CallHeader(1, "send", numel=min(n, 1 << 62)).pack(), n) + body

    family = rng.choice(["random", "frame", "header", "json", "claims", "abort", "flip"])
    head = struct.pack("<4sBBHIIqqQ", P.MAGIC, rng.randrange(12), rng.choice([0, 0, rng.randrange(256)]),
                       rng.choice([0, 0, rng.getrandbits(16)]), rng.choice([worker, rng.getrandbits(32)]),
                       rng.choice([0, 1, 2, rng.getrandbits(32)]), rng.getrandbits(63) - (1 << 62),
                       rng.getrandbits(63) - (1 << 62), rng.getrandbits(64))
    if family == "random":
        data = _junk(rng)
    elif family == "frame":
        data = framed(_junk(rng, 0, 100))
    elif family == "header":
        data = framed(head + _junk(rng, 0, 64))
    elif family == "json":
        body = rng.choice([b"{", b"[]", b"null", b'{"worker": -1}', b"\xff\xfe", json.dumps({"layout": [1] * 10}).encode(),
                           b'{"worker": 0, "sizes": [1e308], "digest": 5}'])
        data = framed(P.pack_header(P.HELLO, worker) + body)
    elif family == "claims":
        data = framed(head + _junk(rng, 0, 64), claim=_huge(rng))
    elif family == "abort":
        data = struct.pack("<4sBBH36sQ", wire.FRAME_MAGIC, wire.VERSION, wire.ABORT, 0, bytes(36),
                           rng.choice([4, 50, 1028, 1029, _huge(rng)])) + struct.pack("<I", rng.getrandbits(32)) + _junk(rng)
    else:
        data = _flip(rng, framed(P.pack_header(P.HELLO, worker) + b'{"worker": 0}'))
    return family, data


def _fuzz_call():
    from ..transport.base import CallHeader

    return CallHeader(7, "allreduce", "sum", "ring", "float32", 4)


FUZZ_CALL = _fuzz_call()


# --- the targets (each runs in its own process) ------------------------------------------------

class _Tally(logging.Handler):
    """Counts the target's log records by the error type named in them."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        kind = next((k for k in ("ProtocolError", "AuthError", "MismatchError", "CommTimeout", "PeerLost",
                                 "timed out", "OSError", "ConnectionResetError", "BrokenPipeError") if k in text),
                    "other")
        self.counts[kind] += 1
        self.examples.setdefault(kind, text[:300])


def _quiet_tally() -> _Tally:
    tally = _Tally()
    root = logging.getLogger()
    root.handlers[:] = [tally]
    root.setLevel(logging.WARNING)
    return tally


def _identity(rank: int):
    from ..transport import tcp_setup

    return tcp_setup.Identity(rank, 2, JOB, SECRET)


def serve_listener(pipe) -> None:
    """Refuse strangers until rank 1 proves itself; report the refusals."""
    from ..transport import tcp_setup

    tally = _quiet_tally()
    listener = tcp_setup.Listener(_identity(0), unix=False, tcp=True, handshake_timeout=2.0)
    pipe.send(tuple(listener.endpoints["tcp"]))
    socks = listener.accept({1}, time.monotonic() + 24 * 3600)
    for s in socks.values():
        s.close()
    listener.close()
    pipe.send({"refused": listener.refused, "admitted": sorted(socks), "logged": dict(tally.counts),
               "examples": tally.examples})


def serve_frames(pipe) -> None:
    """Admit rank 1 again and again; each time receive one frame with ``exchange``, then close.

    A DATA frame of the right call whose 16 bytes are four float32 -1.0 ends the loop."""
    import numpy as np

    from ..errors import CommError
    from ..transport import tcp, tcp_setup
    from ..transport.base import Recv

    tally = _quiet_tally()
    listener = tcp_setup.Listener(_identity(0), unix=False, tcp=True, handshake_timeout=2.0)
    pipe.send(tuple(listener.endpoints["tcp"]))
    outcomes: Counter[str] = Counter()
    while True:
        socks = listener.accept({1}, time.monotonic() + 24 * 3600)
        t = tcp.TcpTransport(0, 2, socks)
        buf = np.zeros(4, np.float32)
        try:
            t.exchange([], [Recv(1, buf)], FUZZ_CALL, time.monotonic() + CASE_TIMEOUT / 2)
            outcomes["data"] += 1
        except CommError as exc:
            outcomes[type(exc).__name__] += 1
        finally:
            t.close()
        if (buf == -1).all():
            break
    listener.close()
    pipe.send({"outcomes": dict(outcomes), "refused": listener.refused, "logged": dict(tally.counts),
               "examples": tally.examples})


def serve_ps(pipe, workers: int) -> None:
    """An asynchronous parameter server for ``workers`` workers; report its stats at the end."""
    from ..ps.server import ParameterServer
    from ..ps.server_config import ServerConfig

    tally = _quiet_tally()
    server = ParameterServer(ServerConfig(index=0, servers=1, workers=workers, strategy="async", job=JOB,
                                          secret=SECRET, timeout=3600.0))
    pipe.send(tuple(server.endpoint))
    stats = server.serve()
    pipe.send({"stats": {k: stats[k] for k in ("refused_connections", "failed", "updates")},
               "notices": len(stats["notices"]), "logged": dict(tally.counts),
               "examples": tally.examples})


# --- the fuzzer side -------------------------------------------------------------------------

def memory(pid: int) -> dict:
    """VmRSS and VmHWM of ``pid`` in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def send_case(endpoint, data: bytes, handshake_as: Optional[int] = None, ps_world: int = 2,
              job: str = JOB) -> bool:
    """Connect, (optionally) handshake genuinely, send ``data``, half-close, read until the target
    closes. Returns False if the target kept the connection open past CASE_TIMEOUT (a hang)."""
    from ..transport import tcp_setup

    deadline = time.monotonic() + CASE_TIMEOUT
    s = socket.create_connection(endpoint, timeout=CASE_TIMEOUT)
    try:
        if handshake_as is not None:
            me = tcp_setup.Identity(handshake_as, ps_world, job, SECRET)
            tcp_setup.connect_handshake(s, me, 0, deadline)
            s.setblocking(True)
        s.settimeout(CASE_TIMEOUT)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return True  # the target closed first: refused mid-send
        while time.monotonic() < deadline:
            try:
                if not s.recv(1 << 16):
                    return True
            except socket.timeout:
                return False
            except OSError:
                return True
        return False
    finally:
        s.close()


def _serve(target, pipe, *args) -> None:
    """Run ``target`` in the child, which dies with the fuzzer (daemon children outlive a SIGTERM)."""
    from ..lifecycle import die_with_parent

    die_with_parent()
    target(pipe, *args)


def _start(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(target, child, *args), daemon=True)
    proc.start()
    deadline = time.monotonic() + 60
    while not parent.poll(0.1):
        if not proc.is_alive():
            raise RuntimeError(f"{target.__name__} exited with status {proc.exitcode} before it started")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{target.__name__} did not start")
    return proc, parent, parent.recv()


def _finish(proc, pipe, timeout: float = 30.0) -> Optional[dict]:
    got = pipe.recv() if pipe.poll(timeout) else None
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    return got


def fuzz_target(name: str, cases: int, seed: int, progress: bool = False) -> dict:
    """Run ``cases`` cases against a fresh target ``name``; the report for it."""
    rng = random.Random(f"{seed}/{name}")
    families: Counter[str] = Counter()
    hangs = 0
    if name == "ps":
        authenticated = max(1, int(cases * PS_AUTHENTICATED))  # a server needs at least one worker
        proc, pipe, endpoint = _start(serve_ps, authenticated)
    else:
        authenticated = 0
        proc, pipe, endpoint = _start(serve_listener if name == "listener" else serve_frames)
    time.sleep(0.2)
    before = memory(proc.pid)
    t0 = time.perf_counter()
    after: dict = {}
    for i in range(cases):
        if not proc.is_alive():
            break
        if i == cases - 1:  # the ps target exits after its last worker slot: measure before
            after = memory(proc.pid)
        if name == "listener" or (name == "ps" and i < cases - authenticated):
            family, data = handshake_case(rng) if name == "listener" else handshake_case(rng, PS_JOB, 1 + authenticated)
            ok = send_case(endpoint, data)
        elif name == "frames":
            family, data = frame_case(rng)
            if data[: 4 + 1 + 1] == b"RTF1\x01\x01" and data[52:68] == b"\x00\x00\x80\xbf" * 4:
                data = data[:52] + b"\x00" * 16  # never the stop signal by chance
            ok = send_case(endpoint, data, handshake_as=1)
        else:
            worker = i - (cases - authenticated)
            family, data = ps_message_case(rng, worker)
            ok = send_case(endpoint, data, handshake_as=1 + worker, ps_world=1 + authenticated, job=PS_JOB)
        families[family] += 1
        hangs += not ok
        if progress and (i + 1) % 10_000 == 0:
            print(f"  {name}: {i + 1} cases, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    alive = proc.is_alive()
    if alive and name != "ps":
        after = memory(proc.pid)
    still_serving = False
    if alive and name != "ps":  # a genuine peer must still get in (and, for frames, stop the loop)
        try:
            if name == "listener":
                still_serving = send_case(endpoint, b"", handshake_as=1)
            elif name == "frames":
                import numpy as np

                from ..transport import wire

                stop = wire.encode_data_header(FUZZ_CALL, 16) + np.full(4, -1.0, np.float32).tobytes()
                still_serving = send_case(endpoint, stop, handshake_as=1)
        except Exception as exc:  # noqa: BLE001 - reported as a crash
            still_serving = False
            print(f"  {name}: the genuine peer was not served: {exc!r}", file=sys.stderr)
    result = _finish(proc, pipe)
    if name == "ps":  # it served if it admitted every genuine worker (each lost after its message) and did not fail
        still_serving = result is not None and result["stats"]["failed"] is None and result["notices"] == authenticated
    why = []
    if proc.exitcode not in (0, None):
        why.append(f"the target exited with status {proc.exitcode}")
    if not still_serving:
        why.append("a genuine peer was not served")
    if result is None:
        why.append("no report from the target")
    crashed = bool(why)
    return {"target": name, "cases": sum(families.values()), "families": dict(sorted(families.items())),
            "authenticated_cases": authenticated, "crashes": int(crashed), "crash_reasons": why, "hangs": hangs,
            "exit_code": proc.exitcode, "still_serving": still_serving, "seconds": round(seconds, 1),
            "memory_before_mb": before, "memory_after_mb": after, "target_report": result}


def run(cases: int = 100_000, targets: tuple[str, ...] = TARGETS, seed: int = 0, progress: bool = False) -> dict:
    """Split ``cases`` over ``targets`` (by WEIGHTS) and fuzz each; one summary document."""
    total_weight = sum(WEIGHTS[t] for t in targets)
    split = {t: int(round(cases * WEIGHTS[t] / total_weight)) for t in targets}
    reports = [fuzz_target(t, n, seed, progress) for t, n in split.items() if n]
    return {"cases": sum(r["cases"] for r in reports), "crashes": sum(r["crashes"] for r in reports),
            "hangs": sum(r["hangs"] for r in reports), "seed": seed, "targets": reports}


def describe(doc: dict) -> str:
    lines = [f"fuzz: {doc['cases']} cases, {doc['crashes']} crashes, {doc['hangs']} hangs (seed {doc['seed']})"]
    for r in doc["targets"]:
        rep = r["target_report"] or {}
        logged = rep.get("logged", {})
        lines.append(f"  {r['target']:8s} {r['cases']:6d} cases in {r['seconds']:.0f} s, crashes {r['crashes']}, "
                     f"hangs {r['hangs']}; RSS {r['memory_before_mb'].get('VmRSS')} -> "
                     f"{r['memory_after_mb'].get('VmRSS')} MiB, peak {r['memory_before_mb'].get('VmHWM')} -> "
                     f"{r['memory_after_mb'].get('VmHWM')} MiB; logged {logged}"
                     + (f"; outcomes {rep['outcomes']}" if "outcomes" in rep else ""))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.bench.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100_000, help="cases in total, split over the targets")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {TARGETS}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--out", default="", type=user_path, help="also write the JSON document to this file")
    args = parser.parse_args(argv)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        parser.error(f"--targets must be a comma-separated subset of {TARGETS}, got {args.targets!r}")
    if args.cases < 1:
        parser.error(f"--cases must be >= 1, got {args.cases}")
    doc = run(args.cases, targets, args.seed, progress=not args.json)
    print(json.dumps(doc) if args.json else describe(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if doc["crashes"] == 0 and doc["hangs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
