"""`ringtrain launch`: start a script on N processes per node, on one or several nodes.

This is torch's own launcher (torch.distributed.run, a.k.a. torchrun) with one addition: the
job's shared secret. Peers authenticate with HMAC over a nonce using RINGTRAIN_SECRET; on one
node the launcher makes a fresh secret, across nodes every node must be given the same one
(``--secret-file`` or the RINGTRAIN_SECRET variable), since nodes cannot agree on one
without an authenticated channel.

    ringtrain launch --nproc-per-node 4 train.py                      # one machine
    ringtrain launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 \\
        --nproc-per-node 8 --secret-file ~/.ringtrain-secret train.py  # on each node (node-rank 0, 1)

Nodes wait ``--join-timeout`` seconds for each other (torchrun's 600 by default); a node that
never comes is then a one-line error on the others. Ranks of one node talk through shared
memory: a node is a hostname and --node-rank (or RINGTRAIN_HOST_ID where set), so machines that
share a hostname are still told apart.
Node 0 (the only node of a job of one) serves the rendezvous at --master-addr and reaches it
there: a --master-addr that does not resolve is refused at once, another machine's is warned of.

A rank that fails ends the command with its exit code and a one-line ``ringtrain launch: rank R
failed (exit code N): ValueError: bad [train.py:12 in step]``, the rank that failed first before
those torchrun stopped after it (the script is started through errorfile.py, which writes the
exception and the line that raised it from the script's first line on; it needs no ``@record``);
torchrun's own errors (a --master-port in use) are one line too (on one node without
--master-port, a port found free that another process takes before torchrun's store listens
there is replaced: the launch is made again on another), and so is Ctrl-C once the
ranks have stopped (torchrun passes SIGINT on to every rank; exit status 130; what the ranks
print on it is the script's own). With several nodes, once one node's ranks have failed the other
nodes stop theirs and end too (exit status 1, one line naming the node and its failure): a rank
stuck on another node does not hold that node's command.
For torchrun's other options (elastic rendezvous, restarts), call ``torchrun`` itself with
RINGTRAIN_SECRET set in the environment (without it the ranks do not authenticate each other).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable
from .paths import user_path

#: The rendezvous port of a job of several nodes unless given (torchrun's default): every node
#: must name the same one. A job of one node takes a free port instead.
MULTI_NODE_PORT = 29500


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node (default 1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index in [0, nnodes) (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None,
                   help=f"port of the rendezvous store on node 0 (default: a free port on one node, so that "
                        f"jobs side by side do not collide; {MULTI_NODE_PORT} with several nodes, which must agree)")
    p.add_argument("--secret-file", default=None, type=user_path, help="file holding the job's shared secret (multi-node)")
    p.add_argument("--join-timeout", type=float, default=600.0,
                   help="seconds the nodes wait for each other at the start (default 600, torchrun's)")
    p.add_argument("script", nargs="?", type=user_path, help="the training script")  # (nargs: else argparse's error names
    # script_args as required too)
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def validate(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if not (math.isfinite(args.join_timeout) and args.join_timeout >= 1):
        raise ValueError(f"--join-timeout must be a number of seconds >= 1, got {args.join_timeout}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ValueError(f"--master-port must be in 1..65535, got {args.master_port}")
    if args.nnodes > 1 and (args.master_addr in ("localhost", "::1") or args.master_addr.startswith("127.")):
        raise ValueError(f"--master-addr {args.master_addr} is this machine's loopback: with --nnodes "
                         f"{args.nnodes} every node must be given node 0's address on the network (to try "
                         "several nodes on one machine, give each this machine's own address: `hostname -I`)")


#: The launcher's own options (configure's): given after the script, they are the script's arguments.
OPTIONS = ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port", "--secret-file",
           "--join-timeout")


def options_after_the_script(script_args: list[str]) -> list[str]:
    """The launcher's options among the script's arguments (``--nnodes 2`` or ``--nnodes=2``)."""
    return [arg.split("=", 1)[0] for arg in script_args if arg.split("=", 1)[0] in OPTIONS]


def job_secret(args: argparse.Namespace) -> str:
    if args.secret_file:
        try:
            text = Path(args.secret_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise ValueError(f"--secret-file {args.secret_file}: cannot read it ({reason}); give a readable "
                             "text file holding the job's secret, or set RINGTRAIN_SECRET") from None
        if not text:
            raise ValueError(f"--secret-file {args.secret_file} is empty")
        return text
    if os.environ.get("RINGTRAIN_SECRET"):
        return os.environ["RINGTRAIN_SECRET"]
    if args.nnodes > 1:
        raise ValueError("several nodes need one shared secret: pass --secret-file or set RINGTRAIN_SECRET on every node")
    return secrets.token_hex(32)


def is_own_address(host: str) -> bool | None:
    """Whether ``host`` is an address of this machine (one a socket can bind); None where it does not resolve."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, _, _, address in found:
        with socket.socket(family, kind) as s:
            try:
                s.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    argv = [
        f"--nnodes={args.nnodes}",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--node-rank={args.node_rank}",
        f"--master-addr={args.master_addr}",
        f"--master-port={MULTI_NODE_PORT if args.master_port is None else args.master_port}",
        f"--rdzv-conf=timeout={math.ceil(args.join_timeout)}",
    ]
    from . import errorfile  # (its file is run as the ranks' first script: errorfile.run_script)

    return argv + [errorfile.__file__, args.script, *args.script_args]


def run(args: argparse.Namespace) -> int:
    try:
        if args.script is None:
            raise ValueError("give the training script to start: ringtrain launch [options] SCRIPT [its arguments]")
        validate(args)
        if args.master_port is None and args.nnodes > 1:  # (one node: a free port, chosen at the launch)
            args.master_port = MULTI_NODE_PORT
        secret = job_secret(args)
        if not Path(args.script).is_file():
            what = "a directory, not a file" if Path(args.script).is_dir() else "no such file"
            raise ValueError(f"{args.script}: {what} (the training script to start)")
        own_address = is_own_address(args.master_addr) if args.node_rank == 0 else True
        if own_address is None:  # (torchrun's agent would retry it for --join-timeout, 600 s, saying nothing)
            raise ValueError(f"--master-addr {args.master_addr} does not resolve on this machine, but node 0 (this "
                             f"one) serves the job's rendezvous there: give {_own_address_hint(args)}")
    except ValueError as exc:
        raise SystemExit(f"ringtrain launch: {exc}")
    if misplaced := options_after_the_script(args.script_args):
        print(f"ringtrain launch: warning: {' '.join(misplaced)} after {args.script} went to the script, not to the "
              f"launcher: give the launcher's options before the script", file=sys.stderr)
    os.environ["RINGTRAIN_SECRET"] = secret  # inherited by the workers, never printed
    if args.nproc_per_node > 1:  # torchrun's default then, set here so that its banner saying so is not printed
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.nnodes > 1:
        print(f"ringtrain launch: node {args.node_rank} of {args.nnodes}: joining the job at {args.master_addr}:"
              f"{args.master_port} (waiting up to {args.join_timeout:g} s for every node)", file=sys.stderr)
    if own_address is False:  # (a warning: behind a forwarding address node 0 may still reach itself)
        print(f"ringtrain launch: warning: --master-addr {args.master_addr} is not an address of this machine, "
              f"but node 0 (this one) serves the job's rendezvous there: give {_own_address_hint(args)}",
              file=sys.stderr)
    if args.node_rank > 0:
        try:
            args = reach_node_0(args)
        except ValueError as exc:
            print(f"ringtrain launch: {exc}", file=sys.stderr)
            return 1
    return run_torchrun_at(lambda port: torchrun_argv(argparse.Namespace(**{**vars(args), "master_port": port})),
                           "ringtrain launch", args.master_port)


def _own_address_hint(args: argparse.Namespace) -> str:
    """What node 0 should be given instead of a --master-addr that is not its own."""
    if args.nnodes == 1:
        return "an address of this machine, or leave --master-addr out (127.0.0.1)"
    return "node 0 its own address, or this node the --node-rank it has"


def reach_node_0(args: argparse.Namespace) -> argparse.Namespace:
    """Wait, within --join-timeout, for node 0's rendezvous store to answer; ``args`` with the
    seconds left as its join timeout (for torchrun's rendezvous), or ValueError saying why not.

    torchrun's store client keeps no deadline against an endpoint that is not a store: a
    service that accepted and never answered held node 1 past 120 s with --join-timeout 5, one
    that answered otherwise (HTTP) failed it after 8.4 s with torch's "Ping failed". Asked
    here first (``store_probe``), with the deadline, torchrun's client only meets a store.
    """
    from . import store_probe

    deadline = time.monotonic() + args.join_timeout
    where = f"{args.master_addr}:{args.master_port}"
    try:
        store_probe.wait_for_store(args.master_addr, args.master_port, deadline)
    except store_probe.NotAStore as exc:
        raise ValueError(f"node 0's rendezvous store at {where}: {store_probe.describe(exc)}; check "
                         "--master-addr and --master-port (node 0's, the same on every node)") from None
    except store_probe.NoStoreYet as exc:
        what = ("check --master-addr and --master-port (node 0's)" if exc.kind == "silent" else
                "start node 0 (--node-rank 0) within --join-timeout, or check this node can reach its "
                "--master-addr and --master-port")
        raise ValueError(f"node 0's rendezvous store at {where} did not answer within --join-timeout "
                         f"{args.join_timeout:g} s: {store_probe.describe(exc)}; {what}") from None
    return argparse.Namespace(**{**vars(args), "join_timeout": max(deadline - time.monotonic(), 1.0)})


#: Launches tried on a port this process found free: another process may bind it in between.
PORT_TRIES = 3


class PortTaken(Exception):
    """torchrun's store could not listen at the port given (EADDRINUSE), before any rank started."""


def run_torchrun_at(argv_at: Callable[[int], list[str]], prog: str, port: int | None, **kwargs) -> int:
    """``run_torchrun(argv_at(port), prog, **kwargs)``. ``port`` None (or 0): a port free a moment
    before; where another process took it first (torchrun's store fails to listen, no rank has
    started), again on another, up to PORT_TRIES launches (the last one's failure is then
    run_torchrun's line). A port given is launched on once, never replaced."""
    if port:
        return run_torchrun(argv_at(port), prog, **kwargs)
    from .bench.procs import free_port

    for tries_left in reversed(range(PORT_TRIES)):
        port = free_port()
        try:
            return run_torchrun(argv_at(port), prog, port_taken_raises=port if tries_left else None, **kwargs)
        except PortTaken:
            print(f"{prog}: port {port}, free a moment before, was taken before torchrun's store could listen "
                  "there; launching on another", file=sys.stderr)
    raise AssertionError("unreachable: the last launch reports its own failure")


def _port_in_use(exc: Exception, port: int) -> bool:
    """torch's error for a store that cannot listen at ``port``: "... port: N, useIpv6: false,
    code: -98, name: EADDRINUSE, ..." (torch.distributed.DistNetworkError)."""
    text = str(exc)
    return "EADDRINUSE" in text and f"port: {port}," in text


def run_torchrun(argv: list[str], prog: str, role: Callable[[int], str] | None = None,
                 interrupted: Callable[[signal.Signals], str] | None = None,
                 failed: Callable[[], str] | None = None, port_taken_raises: int | None = None) -> int:
    """``torchrun.main(argv)``; returns the exit status. A failure is reported on stderr as one line
    ``<prog>: ...`` per failed rank (first failure first; ``role(rank)`` names what the rank was),
    then ``failed()``'s line where given (what is left of the run), or, when torchrun itself
    failed (a port in use), one line with its own error. The status is
    the first failed rank's exit code (128 + N for signal N), 1 for torchrun's own errors.
    Ctrl-C (SIGINT) or SIGTERM of this process: torchrun passes the signal on to the ranks and
    waits for them to end; then one line, ``interrupted(signal)`` or "interrupted", and 128 + N.
    ``port_taken_raises``: that port in use (torch's error names it) is PortTaken instead
    (run_torchrun_at); another in use (a health-check port the user set) is not."""
    with _cpp_log_off_in_this_process():
        from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .lifecycle import mark_launcher

    mark_launcher()  # (a rank that finds this process gone ends: lifecycle.die_with_parent)
    quiet = _QuietShutdown()
    for name in _QuietShutdown.LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    # torchrun turns these into SignalException and leaves its handlers installed: put ours back
    # once the ranks have ended, so that a signal after that is not a traceback from torchrun.
    handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS}
    try:
        try:
            with _nodes_end_together(prog), _stopped_ranks_hear_the_signal():
                torchrun.main(argv)
        finally:
            for s, handler in handlers.items():
                signal.signal(s, handler)
    except ChildFailedError as exc:
        failures = sorted(exc.failures.items(), key=lambda item: _failure_order(*item))
        for rank, failure in failures:
            print(f"{prog}: {describe_failure(rank, failure, role)}", file=sys.stderr)
        if failed is not None:
            with contextlib.suppress(Exception):  # (what is left of the run is a hint: never a traceback instead)
                print(f"{prog}: {failed()}", file=sys.stderr)
        return _exit_status(failures[0][1].exitcode, recorded=isinstance(failures[0][1].message, dict))
    except _NodeFailed:  # (its line is printed: this node's ranks have been stopped since)
        return 1
    except (SignalException, KeyboardInterrupt) as exc:  # (KeyboardInterrupt: before torchrun's handler)
        sig = signal.Signals(exc.sigval if isinstance(exc, SignalException) else signal.SIGINT)
        # The ranks have stopped: a second Ctrl-C waits for the line (it reads the checkpoints).
        before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            print(f"{prog}: {interrupted(sig) if interrupted else f'interrupted ({sig.name})'}", file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, before)
        return 128 + sig
    except Exception as exc:  # the agent's own failure, before or between the workers
        if port_taken_raises is not None and _port_in_use(exc, port_taken_raises):
            raise PortTaken(str(exc)) from None
        print(f"{prog}: {agent_error(exc, _node_rank(argv))}", file=sys.stderr)
        return 1
    finally:
        for name in _QuietShutdown.LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
    return 0


@contextlib.contextmanager
def _cpp_log_off_in_this_process():
    """Imports torch (in the block) with its C++ log off, in the launcher only.

    The launcher's C++ log is c10d's store client: every failed try to reach node 0 is a line with
    a C++ stack of some 40 frames, while run_torchrun says the failure in one line. torch reads
    TORCH_CPP_LOG_LEVEL once, when it loads, so it is set for the import and taken away again: the
    ranks, which inherit the environment, keep their own log. Nothing changes where torch is
    already loaded or the user set the variable."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        yield
    finally:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


#: Seconds a failed agent waits for its check-in at the exit barrier (node 0's store answers in
#: milliseconds; one cut off from this node, never: the kernel retransmits for some 15 minutes).
_CHECK_OUT_TIMEOUT = 2.0

#: The key in node 0's store (outside torchrun's own prefix) where the first node whose ranks failed
#: leaves its line, "node N failed: rank R failed (...)", for the other nodes' launchers.
_FAILED_KEY = "ringtrain/launch/failed"


#: Set in node 0's store once node 0's own ranks succeeded: its store closing later (torchrun's exit
#: barrier timed out while this node's ranks ran on) is then no failure of this job.
_DONE_KEY = "ringtrain/launch/node0-done"

#: Seconds between two looks of a node's launcher at node 0's store for another node's failure.
_WATCH_PERIOD = 0.5


def _read_key(node: int) -> str:
    """Set by node ``node``'s watch once it has read ``_FAILED_KEY``."""
    return f"{_FAILED_KEY}/read/{node}"


class _NodeFailed(Exception):
    """Another node's ranks failed, or node 0's store closed, while this node's ranks still ran."""


@contextlib.contextmanager
def _nodes_end_together(prog: str):
    """With several nodes, every node's launcher ends once one node's ranks have failed.

    torchrun's agent watches only its own node's ranks. Node 0's rank that timed out waiting for a
    rank stuck on node 1 (stopped, or looping in the script) ended node 0's command, while node 1's
    waited forever: its rank was alive. Here, while its ranks run, each agent also watches node 0's
    store (the one torchrun's agents already share) from a thread of its own (:class:`_StoreWatch`):
    when another node's failure line appears there, or the store closes (node 0's launcher ended
    before this node's ranks did), it prints one line and stops its ranks with torchrun's own
    shutdown (SIGTERM to each rank's process group, SIGKILL 30 s later), exit status 1. A node
    whose ranks have ended (failed or succeeded) is not stopped: its own result stands.

    An agent interrupted (Ctrl-C, SIGTERM) leaves "node N was interrupted (SIGINT)" there too, as
    a failed one leaves its line (below): the other nodes' ranks that were not talking to its ranks
    just then ran on, their commands held.
    An agent whose ranks failed leaves that line in the store (node 0's then waits, up to
    ``_CHECK_OUT_TIMEOUT``, until the other nodes have read it: its store ends with it) and enters
    torchrun's exit barrier on its way out. torchrun's agent whose ranks all succeeded waits at exit until every node's agent
    is there (``SimpleElasticAgent._exit_barrier``, up to 300 s: node 0 serves the store the others
    still use); one whose ranks failed returned without checking in, so a node that had finished sat
    5 minutes after another node failed (or, when the failed one was node 0, logged a traceback from
    its closed store). The failed agent adds itself to that barrier's count and leaves (the
    barrier's own non-blocking half: it does not wait for the others)."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.utils import store as store_util

    original = getattr(api.SimpleElasticAgent, "_invoke_run", None)
    if original is None:  # (a torch whose agent is built otherwise: its own exit barrier as it is)
        yield
        return

    def invoke_run(self, role: str = api.DEFAULT_ROLE):
        watch = _StoreWatch()
        monitor = self._monitor_workers

        def check_in() -> None:  # (at torchrun's exit barrier: its non-blocking half, which does not wait)
            store_util._barrier_nonblocking(self._store, self._worker_group.group_world_size,
                                            api._TERMINAL_STATE_SYNC_ID)

        def monitor_and_watch(group):
            result = monitor(group)
            several = (group.group_world_size or 1) > 1
            if result.state == api.WorkerState.HEALTHY and several:
                watch.start(self._store, group.group_rank)
                if watch.failure is not None:
                    print(f"{prog}: {watch.failure}; stopping this node's ranks", file=sys.stderr, flush=True)
                    raise _NodeFailed(watch.failure)  # (torchrun's run() then stops the ranks)
            elif result.state == api.WorkerState.SUCCEEDED and several and group.group_rank == 0:
                # (before torchrun's exit barrier, after which node 0's store may close under a node still running)
                _bounded(lambda: _unprefixed(self._store).set(_DONE_KEY, ""))
            return result

        def check_out(line: str) -> None:  # (the line for the other nodes' watches, then the exit barrier's check-in)
            group = self._worker_group
            if (group.group_world_size or 1) == 1 or self._store is None:
                return

            def leave() -> None:
                store = _unprefixed(self._store)
                with contextlib.suppress(Exception):  # (first line kept: compare_set sets a missing key only)
                    store.compare_set(_FAILED_KEY, "", line)
                if group.group_rank == 0:  # its store ends with it: the others' watches read the line first
                    others = [_read_key(node) for node in range(1, group.group_world_size)]
                    with contextlib.suppress(Exception):  # (a node already gone never reads it; within the join)
                        store.wait(others, timedelta(seconds=_CHECK_OUT_TIMEOUT / 2))
                with contextlib.suppress(Exception):  # (node 0 gone: the others see its store closed, as before)
                    check_in()

            _bounded(leave)

        self._monitor_workers = monitor_and_watch  # (torchrun's loop calls it every --monitor-interval)
        try:
            result = original(self, role)
        except _NodeFailed:  # (stopped for another node's failure: checks in at the exit barrier too, below)
            if self._store is not None:
                _bounded(check_in)
            raise
        except SignalException as exc:  # Ctrl-C or SIGTERM of this node's command: the others end too
            # (not where its ranks have all succeeded, at torchrun's exit barrier: the others' ranks
            # may still be saving, and their results stand)
            if self._worker_group.state != api.WorkerState.SUCCEEDED:
                check_out(f"node {self._worker_group.group_rank} was interrupted ({signal.Signals(exc.sigval).name})")
            raise
        finally:
            del self._monitor_workers
            watch.stop()
        if result.is_failed():
            rank, failure = min(result.failures.items(), key=lambda item: _failure_order(*item))
            check_out(f"node {self._worker_group.group_rank} failed: {describe_failure(rank, failure)}")
        return result

    api.SimpleElasticAgent._invoke_run = invoke_run
    try:
        yield
    finally:
        api.SimpleElasticAgent._invoke_run = original


def _bounded(call: Callable[[], object]) -> None:
    """``call()`` (a call to node 0's store) in a thread of its own, waited for at most
    ``_CHECK_OUT_TIMEOUT``: a store cut off from this node never answers (the store's timeout does
    not bound an add), and this node is not to wait for it. Its errors are dropped: node 0 gone,
    the other nodes see its store closed."""
    def run() -> None:
        with contextlib.suppress(Exception):
            call()

    thread = threading.Thread(target=run, name="ringtrain-check-out", daemon=True)
    thread.start()
    thread.join(_CHECK_OUT_TIMEOUT)


def _unprefixed(store):
    """The store under ``store``'s PrefixStores (torchrun's agent prefixes its keys with the run id)."""
    import torch.distributed as dist

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


class _StoreWatch:
    """A thread that asks node 0's store, every ``_WATCH_PERIOD`` seconds over a connection of its
    own (an agent's store client runs one request at a time), for a node's failure line
    (``_FAILED_KEY``); ``failure``: None until it is there or the store has closed, then the line to
    print. It asks with ``check`` between sleeps of its own rather than in one long ``wait``: a
    thread left in a call into torch when the process exits aborts it ("terminate called without
    an active exception"), so :meth:`stop` ends it before the agent returns."""

    def __init__(self) -> None:
        self.failure: str | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, store, node: int) -> None:
        """Watch ``store`` (the agent's) from now on, as node ``node`` (its --node-rank); once."""
        if self._thread is not None:
            return
        import torch.distributed as dist

        store = _unprefixed(store)
        if not isinstance(store, dist.TCPStore):  # (another rendezvous: not watched)
            self._thread = threading.Thread()  # (never started: stop() has nothing to end)
            return
        where = f"{store.host}:{store.port}"

        def watch() -> None:
            client, misses, node_0_done = None, 0, False
            while not self._stopped.is_set():
                try:  # (each call within a second: stop() joins for _CHECK_OUT_TIMEOUT)
                    if client is None:
                        client = dist.TCPStore(store.host, store.port, None, False, timeout=timedelta(seconds=1),
                                               wait_for_workers=False)
                    if client.check([_FAILED_KEY]):
                        line = client.get(_FAILED_KEY).decode(errors="replace")
                        client.set(_read_key(node), "")  # (node 0, if it failed, waits for this before it ends)
                        self.failure = line
                        return
                    node_0_done = node_0_done or client.check([_DONE_KEY])
                    misses = 0
                except Exception:  # noqa: BLE001 - twice in a row: the store closed, node 0's launcher ended
                    client, misses = None, misses + 1
                    if misses >= 2:
                        if not node_0_done:  # (node 0's ranks succeeded: it left after torchrun's exit barrier)
                            self.failure = (f"node 0's launcher ended (its rendezvous store at {where} closed) "
                                            "while this node's ranks ran")
                        return
                self._stopped.wait(_WATCH_PERIOD)

        self._thread = threading.Thread(target=watch, name="ringtrain-store-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (at once, unless it is in a call to a store that does not answer)."""
        self._stopped.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(_CHECK_OUT_TIMEOUT)


#: The signals torch's launcher handles (it passes them on to the ranks, then raises SignalException).
_AGENT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))


@contextlib.contextmanager
def _stopped_ranks_hear_the_signal():
    """torchrun stops the ranks with SIGTERM and gives them 30 s before SIGKILL. A rank stopped by
    SIGSTOP (or a terminal's Ctrl-Z) acts on no signal but SIGKILL until it is continued, so the
    command ended 30 s after its error was known. Here each signal torchrun sends a rank's process
    group is followed by SIGCONT: a stopped rank then ends at the SIGTERM as the others do (to a
    running one SIGCONT is nothing). A torch whose launcher closes its ranks otherwise is left as it is."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
        original = SubprocessHandler.close
    except (ImportError, AttributeError):
        yield
        return

    def close(self, death_sig=None):
        original(self, death_sig)
        with contextlib.suppress(OSError):  # (gone already)
            os.killpg(self.proc.pid, signal.SIGCONT)

    SubprocessHandler.close = close
    try:
        yield
    finally:
        SubprocessHandler.close = original


class _QuietShutdown(logging.Filter):
    """Drops torchrun's warnings that it is stopping the ranks (after a signal, or a failed rank):
    run_torchrun says what happened in one line. Its warning that a rank would not stop stays."""

    LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api",
               "torch.distributed.elastic.multiprocessing.errors.error_handler")
    NOTES = ("Received %s death signal, shutting down workers", "Sending process %s closing signal %s",
             # (a failed rank: run_torchrun's own line names it, its exit code and its error)
             "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
             "no error file defined for parent, to copy child error file (%s)")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.NOTES


def _failure_order(rank: int, failure) -> tuple:
    """Who failed first: a rank that ended by itself before one torchrun stopped (SIGTERM, nothing
    recorded) after it; then by time (torch's are whole seconds); in the same second a rank killed by
    a signal torchrun does not send (kill -9, the OOM killer, a crash) before the ranks that saw it
    go (their PeerLost, recorded before torchrun's SIGTERM); in the same second a rank that lost a
    peer (a recorded PeerLost) after one that did not (a script's ``sys.exit(3)`` records nothing);
    then, where ringtrain.init() wrote the error files, by their time to the microsecond (a script's
    ValueError before the PeerLost of its peers in the same second); then by rank."""
    from .errorfile import recorded_time

    stopped = failure.exitcode == -signal.SIGTERM and not isinstance(failure.message, dict)
    killed = failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM
    lost_a_peer = isinstance(failure.message, dict) and str(failure.message.get("message", "")).startswith("PeerLost")
    fine = recorded_time(failure.message)
    return stopped, failure.timestamp, not killed, lost_a_peer, math.inf if fine is None else fine, rank


def _exit_status(exitcode: int, recorded: bool = False) -> int:
    """A failed child's exit code as a shell reports it: 128 + N for signal N, never 0; 1 for a
    rank that had recorded an exception (it was raising) when torchrun's SIGTERM, sent once
    another rank failed, ended it: 143 reads as the job's preemption."""
    if exitcode == -signal.SIGTERM and recorded:
        return 1
    if exitcode < 0:
        return 128 - exitcode
    return exitcode or 1


def describe_failure(rank: int, failure, role: Callable[[int], str] | None = None) -> str:
    """One line for a torchrun ProcessFailure: who, how it ended, and the exception it recorded
    (with ``torch.distributed.elastic.multiprocessing.errors.record``), where it was raised."""
    who = f"rank {rank}" + (f" ({role(rank)})" if role else "")
    how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"killed by {failure.signal_name()}"
    message, where = failure.message, ""
    if isinstance(message, dict):  # written by @record: {"message": "Type: text", "extraInfo": {"py_callstack"}}
        message, where = message.get("message", ""), _last_frame(message.get("extraInfo", {}).get("py_callstack", ""))
    elif failure.error_file == "<N/A>":  # no error file: torch's stand-in text, not the rank's
        message = ""
    lines = str(message).strip().splitlines()
    text = lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""
    return f"{who} failed ({how})" + (f": {text}" if text else "") + (f" [{where}]" if where else "")


def _last_frame(callstack: str) -> str:
    """``path:line in function`` of the innermost frame of a formatted traceback ('' if none)."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', callstack)
    if not frames:
        return ""
    path, line, function = frames[-1]
    inside = path.rfind("/ringtrain/")
    return f"{path[inside + 1:] if inside >= 0 else Path(path).name}:{line} in {function}"


#: torch's texts when a node's store client could not reach node 0's store (never answered, no route,
#: or something else holding the port that hung up).
_UNREACHED = ("trying to connect to", "failed to connect to any network address", "Connection reset by peer")


def _node_rank(argv: list[str]) -> int | None:
    """The ``--node-rank=N`` of a torchrun command line (torchrun_argv's), None where not given."""
    given = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--node-rank=")]
    return int(given[0]) if given and given[0].isdigit() else None


def agent_error(exc: Exception, node_rank: int | None = None) -> str:
    """One line for an error torchrun raised itself (its text is the cause); ``node_rank``: this
    node's, where known (node 0 cannot reach its own store: no other node to start)."""
    text = " ".join(str(exc).split()) or "(no message)"
    hint = ""
    if "EADDRINUSE" in text:
        hint = "; choose another --master-port"
    elif "waiting for clients" in text:  # node 0's store: not every node joined within --join-timeout
        hint = ("; start `ringtrain launch` on every other node (--node-rank 1.., the same --nnodes, --master-addr "
                "and --master-port) within --join-timeout, or check they can reach this address and port")
    elif any(words in text for words in _UNREACHED) and node_rank == 0:  # its own store, at --master-addr
        hint = ("; node 0 (this one) serves the rendezvous store and reaches it at --master-addr: give node 0 an "
                "address of this machine")
    elif any(words in text for words in _UNREACHED):  # another node's: node 0 never answered
        hint = ("; start node 0 (--node-rank 0) within --join-timeout, or check this node can reach its "
                "--master-addr and --master-port")
    elif "wait timeout" in text and ("torchelastic/role_info" in text or "torchelastic/assigned_ranks" in text):
        # every node reached a store, but not one job: two nodes each serving one as --node-rank 0, or
        # node 0 waiting for more nodes (its --nnodes) than came
        hint = ("; give every node the same --nnodes and a --node-rank of its own in [0, nnodes) (only the node at "
                "--master-addr is node 0)")
    return f"torchrun failed: {type(exc).__name__}: {text}{hint}"
