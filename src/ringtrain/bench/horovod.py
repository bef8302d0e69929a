"""Horovod's gloo workers started without horovodrun: the Horovod anchor of the benchmarks.

horovodrun starts every rank itself, on the machine or over ssh, so it cannot put a rank on an
emulated host (``bench.netem``: a network namespace). This module does what its gloo launcher
(``horovod/runner/gloo_run.py``, Horovod 0.28.1) does, with ringtrain's own machinery:

- the rendezvous: Horovod's own HTTP rendezvous server (``RendezvousHTTPServer`` of
  ``horovod/runner/http/http_server.py``, initialised with the slot plan as horovodrun's
  ``RendezvousServer.init`` does), in a helper process under the Horovod interpreter (this
  one may have no Horovod), bound on host 0's address inside host 0's namespace, where every
  emulated host reaches it; on 127.0.0.1 without --net. It ends with its launcher.
- the slot plan: ``host_assignments``, horovodrun's ``get_host_assignments`` for the hosts
  the ranks run on: each emulated host a host of its own (LOCAL_SIZE 1, CROSS_SIZE p), or
  without --net every rank on this host (LOCAL_SIZE p), as ``horovodrun -H localhost:p``.
- each worker: ``procs.run_ranks`` under the Horovod interpreter, in its rank's namespace, with
  horovodrun's variables (``worker_env``: create_slot_env_vars and create_run_env_vars) on
  top of torchrun's, which a worker may use for a torch process group of its own beside
  Horovod. Horovod's tunables (fusion threshold, cycle time) are left at its defaults, as
  horovodrun leaves them without its flags.

A failed rank or the deadline kills every rank (``run_ranks``), then the helper; Ctrl-C the
same on its way out; the emulated network, when there is one, kills whatever is left in its
namespaces. One path with and without --net: horovodrun is not used at all.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator, Optional, Sequence

from ..lifecycle import LAUNCHER_ENV
from .netem import NetemUnavailable
from .procs import RankFailed, emulated, run_ranks

#: The line the rendezvous helper prints once it listens: ``PORT <number>``.
PORT_PREFIX = "PORT "
#: Seconds the helper gets to import Horovod's runner and listen (it takes ~0.1 s idle).
RENDEZVOUS_START_S = 60.0
#: The slot fields of horovodrun's SlotInfo (horovod/runner/common/util/hosts.py), in its order.
SLOT_FIELDS = ("hostname", "rank", "local_rank", "cross_rank", "size", "local_size", "cross_size")


class RendezvousFailed(RuntimeError):
    """The rendezvous helper did not start (the reason and its output in the message)."""


# --- which interpreter, or why none ----------------------------------------------------------


def horovod_missing(python: str) -> str | None:
    """Why ``python`` cannot run the Horovod anchor (not found, or no ``horovod.torch`` to import),
    None when it can. Another interpreter is asked in a child process (a few ms: torch is not
    imported)."""
    if python == sys.executable:
        found = importlib.util.find_spec("horovod") is not None and importlib.util.find_spec("horovod.torch") is not None
    else:
        if shutil.which(python) is None:  # (a path, or a name on PATH)
            return f"--horovod-python {python}: no such interpreter"
        # (it must say so: /bin/true exits 0 to anything, and /bin/echo prints its arguments)
        probe = ("import importlib.util as u; "
                 "print('horovod.torch:', u.find_spec('horovod') is not None and u.find_spec('horovod.torch') is not None)")
        try:
            said = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60).stdout.strip()
        except subprocess.TimeoutExpired:
            return f"--horovod-python {python}: did not answer within 60 s whether it imports horovod.torch"
        except OSError as exc:
            return f"--horovod-python {python}: cannot run it ({exc.strerror or exc})"
        if said not in ("horovod.torch: True", "horovod.torch: False"):
            return f"--horovod-python {python}: not a Python interpreter (it did not run `python -c`)"
        found = said == "horovod.torch: True"
    if found:
        return None
    return (f"horovod.torch is not importable from {python} (scripts/horovod/install.sh builds Horovod into "
            ".venv-horovod/; then --horovod-python .venv-horovod/bin/python)")


def anchor_python(no_horovod: bool, python: str | None) -> tuple[str | None, str | None]:
    """(the interpreter that runs the Horovod anchor, None) or (None, the note saying why it is
    skipped): --no-horovod, or ``python`` (default: this interpreter) without horovod.torch. The
    interpreter comes back as an absolute path: the ranks start in other directories' shells
    (``ip netns exec``) as well as here."""
    if no_horovod:
        return None, "Horovod anchor skipped: --no-horovod"
    python = python or sys.executable
    if why := horovod_missing(python):
        return None, f"Horovod anchor skipped: {why}"
    return os.path.abspath(shutil.which(python)), None


# --- what horovodrun would give each worker --------------------------------------------------


def host_assignments(hostnames: Sequence[str]) -> list[dict]:
    """One slot per rank (rank ``i`` on ``hostnames[i]``), as horovodrun's ``get_host_assignments``
    makes them for the hosts in order of first appearance, each with as many slots as ranks on it:
    ranks numbered host by host, local ranks within a host, cross ranks among the hosts' slots of
    the same local rank. The ranks of one host must be consecutive (horovodrun numbers them so)."""
    hosts = list(dict.fromkeys(hostnames))
    slots_on = {h: hostnames.count(h) for h in hosts}
    if [h for h in hosts for _ in range(slots_on[h])] != list(hostnames):
        raise ValueError(f"the ranks of one host must be consecutive, got {list(hostnames)}")
    cross: dict[int, list[str]] = {}  # local rank -> the hosts with such a slot, in order
    for h in hosts:
        for local in range(slots_on[h]):
            cross.setdefault(local, []).append(h)
    plan, rank = [], 0
    for h in hosts:
        for local in range(slots_on[h]):
            plan.append({"hostname": h, "rank": rank, "local_rank": local, "cross_rank": cross[local].index(h),
                         "size": len(hostnames), "local_size": slots_on[h], "cross_size": len(cross[local])})
            rank += 1
    return plan


def hostnames(net, p: int) -> list[str]:
    """The host each of ``p`` ranks is on: host ``i``'s identity on an emulated network, this
    host ("localhost", as ``horovodrun -H localhost:p`` names it) for all without one."""
    return [net.host_id(i) for i in range(p)] if net is not None else ["localhost"] * p


def worker_env(slot: dict, addr: str, port: int, iface: str) -> dict[str, str]:
    """The variables horovodrun's gloo launcher gives the worker of ``slot``
    (create_slot_env_vars and create_run_env_vars): its place in the plan, the rendezvous at
    ``addr``:``port``, gloo as controller and CPU operations, gloo's interface ``iface``."""
    return {"HOROVOD_HOSTNAME": slot["hostname"], "HOROVOD_RANK": str(slot["rank"]),
            "HOROVOD_SIZE": str(slot["size"]), "HOROVOD_LOCAL_RANK": str(slot["local_rank"]),
            "HOROVOD_LOCAL_SIZE": str(slot["local_size"]), "HOROVOD_CROSS_RANK": str(slot["cross_rank"]),
            "HOROVOD_CROSS_SIZE": str(slot["cross_size"]),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": iface}


def python_path() -> str:
    """PYTHONPATH for the Horovod interpreter: this copy of ringtrain first (its venv holds only
    torch, numpy and Horovod), then the caller's."""
    import ringtrain

    src = os.path.dirname(os.path.dirname(os.path.abspath(ringtrain.__file__)))
    return os.pathsep.join(x for x in (src, os.environ.get("PYTHONPATH")) if x)


# --- the launch ------------------------------------------------------------------------------


def launch(python: str, module_args: Sequence[str], p: int, *, rate: str, timeout: float,
           on_result: Callable[[dict], None]) -> str | None:
    """Run ``python -m ringtrain.cli <module_args>`` as ``p`` Horovod workers over gloo, on an
    emulated network of ``rate`` ("none": on this host); rank 0's RESULT documents go to
    ``on_result`` as they come. None when every rank ended well, else the note saying what went
    wrong (a failed rank, the deadline, a rendezvous that did not start, an emulated network that
    could not be made): the anchor's failure
    is the run's note, not its end. Ctrl-C ends everything and goes on up."""
    env = {"PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    try:
        with emulated(rate, p) as net:
            slots = host_assignments(hostnames(net, p))
            with rendezvous(python, slots, net, env) as (addr, port):
                iface = "eth0" if net is not None else "lo"
                run_ranks("ringtrain.cli", list(module_args), p, timeout=timeout, net=net, extra_env=env,
                          on_result=on_result, python=python,
                          rank_env=lambda rank: worker_env(slots[rank], addr, port, iface))
    except (RankFailed, RendezvousFailed, NetemUnavailable) as exc:
        return failure_note(exc)
    return None


def failure_note(exc: Exception) -> str:
    """'Horovod anchor failed: rank 1 was killed by SIGKILL: <its last line>' (what went wrong
    and the last line of the rank's output, often the exception)."""
    head, _, tail = str(exc).partition("\n")
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    return f"Horovod anchor failed: {head.rstrip(':')}" + (f": {last[-300:]}" if last else "")


@contextlib.contextmanager
def rendezvous(python: str, slots: list[dict], net, env: dict) -> Iterator[tuple[str, int]]:
    """Horovod's rendezvous server for ``slots``, in a helper under ``python``: in host 0's
    namespace on its address when ``net`` is an emulated network, else on 127.0.0.1. Yields
    (address, port); the helper is killed when the block ends (and dies with this process)."""
    addr = net.addr(0) if net is not None else "127.0.0.1"
    argv = [python, "-m", "ringtrain.bench.horovod", "--rendezvous", json.dumps({"bind": addr, "slots": slots})]
    full_env = dict(os.environ, **env, PYTHONUNBUFFERED="1")
    full_env[LAUNCHER_ENV] = str(os.getpid())  # (the helper ends when it finds this process gone)
    with tempfile.TemporaryFile(mode="w+") as log:
        if net is not None:
            proc = net.popen(0, argv, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        else:
            proc = subprocess.Popen(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield addr, _port(proc, log, RENDEZVOUS_START_S)
        finally:
            _kill_group(proc)


def _port(proc: subprocess.Popen, log, deadline_s: float) -> int:
    """The port the helper printed; RendezvousFailed when it ended first or took ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        log.seek(0)
        text = log.read()
        for line in text.splitlines():
            if line.startswith(PORT_PREFIX):
                return int(line[len(PORT_PREFIX):])
        if proc.poll() is not None:
            raise RendezvousFailed(f"the rendezvous server exited with status {proc.returncode}:\n{text[-2000:]}")
        if time.monotonic() > end:
            raise RendezvousFailed(f"the rendezvous server did not listen within {deadline_s:.0f}s:\n{text[-2000:]}")
        time.sleep(0.05)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the helper's process group (a session of its own) while its leader is unreaped."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


# --- the helper, under the Horovod interpreter -----------------------------------------------


def serve(spec: dict) -> int:
    """Listen as horovodrun's rendezvous does, on ``spec["bind"]`` and a port of the kernel's
    choosing (horovodrun tries random ports), print ``PORT <n>``, and serve until killed."""
    from ..lifecycle import die_with_parent

    die_with_parent()
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    httpd = RendezvousHTTPServer((spec["bind"], 0), RendezvousHandler, 0)
    httpd.init([SlotInfo(**{k: s[k] for k in SLOT_FIELDS}) for s in spec["slots"]])
    print(f"{PORT_PREFIX}{httpd.server_address[1]}", flush=True)
    httpd.serve_forever()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ringtrain.bench.horovod",
                                     description="Horovod's rendezvous server for the benchmarks' Horovod anchor")
    parser.add_argument("--rendezvous", required=True, help="JSON: {'bind': address, 'slots': [slot, ...]}")
    return serve(json.loads(parser.parse_args(argv).rendezvous))


if __name__ == "__main__":
    sys.exit(main())
