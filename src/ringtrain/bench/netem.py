"""Emulated cluster networks for benchmarks: each rank on a host of its own, behind a shaped link.

Words used below:

- **host**: a Linux network namespace standing in for one machine. Host ``i`` has one
  interface, ``eth0``, with address ``10.213.0.(i+1)/24``, and its loopback up. The address
  exists only inside that namespace: traffic goes only between namespaces this harness made.
- **switch**: one more namespace holding a Linux bridge ``br0``. Port ``p{i}`` is the switch
  end of host ``i``'s veth pair. The root namespace is never touched: no link, address,
  route or qdisc of the machine changes.
- **link**: the veth pair between host ``i`` and the switch. Shaping puts a tc ``tbf``
  qdisc on the egress of both ends (``eth0`` in the host, ``p{i}`` in the switch), so a host
  sends at most ``rate`` and receives at most ``rate``, like a switch port. This kernel has
  no netem: bandwidth can be shaped, delay cannot.
- **tag**: ``{prefix}-{pid}-{seq}``, the stem of every namespace one network made. The pid is
  the harness process; while it lives it also holds an flock on ``/run/ringtrain-netem/{tag}.lock``.
  A tag whose lock is free (without a lock file: whose pid is dead) is a leftover of a crashed
  run, even when its pid has since been reused, and :func:`cleanup_stale` removes it. Nothing
  without such a tag is ever touched.
- **host identity**: ``net.host_id(i)``, set as ``RINGTRAIN_HOST_ID`` in every process
  started on host ``i``. Namespaces share the hostname and /dev/shm, so anything that
  decides "same host" from the hostname would silently bypass the shaped link; the
  rendezvous reads this variable instead.
- **hosts file**: ``/etc/netns/{namespace}/hosts``, which ``ip netns exec`` mounts over
  /etc/hosts for processes on that host. It maps the machine's hostname to the host's own
  address and every host identity to its address, as on a real cluster. Without it the
  hostname resolves to 127.0.0.1 and gloo listens on loopback, where peers cannot reach it
  (a rendezvous that hangs); processes also get ``GLOO_SOCKET_IFNAME=eth0`` unless the
  caller sets it.

Shaping: tbf on each end, at the line rate less the 24 bytes a real Ethernet link sends with
each frame (``ETHERNET_OVERHEAD_BYTES``), so a saturated link carries TCP payload at
1448/1538 = 94.1% of its line rate, as real Gigabit Ethernet does: ``scripts/netem_check.py
--quick`` (one TCP stream of plain Python sockets, MTU 1500, medians of 3) measured 0.943
Gbit/s one way and 0.933 both ways at 1gbit, 9.45 one way at 10gbit (the Intel VM, idle,
2026-12-07). The table was measured before the overhead was counted (tbf counting frames
alone, a saturated link 1448/1514 = 95.6%; every goodput there is 1.6% above today's link):

=========  ===========  ==================  ==================
rate       burst        goodput, idle box   goodput, load ~7
=========  ===========  ==================  ==================
1gbit      4 KiB        0.59                0.54
1gbit      32 KiB       0.83 - 0.95         0.76
1gbit      128 KiB *    0.955 - 0.958       0.934
1gbit      512 KiB      0.96                0.958
10gbit     1.25 MiB *   9.6                 8.1 (CPU-bound)
none       -            15 - 22             10 - 12
=========  ===========  ==================  ==================

(* the defaults: one millisecond of line rate, rounded up to 64 KiB, i.e. 1 mbit at
1 Gbit/s and 10 mbit at 10 Gbit/s.) Too small a burst under-delivers; a larger one is more
robust when the CPU is busy, but lets that many bytes through at once after an idle
moment, which makes small messages look cheaper than the line allows, so the default stays
at 1 ms (pass ``burst_bytes`` to change it). The queue (tbf ``latency``, 5 ms) did not change
throughput between 1 and 50 ms. With both directions busy at once a 1 Gbit/s link still
carries 0.948 Gbit/s each way; torch's gloo all_reduce of 25 MiB on 2 ranks reaches a busbw
of 0.936 - 0.955 Gbit/s at 1gbit. At 10gbit this machine is CPU-bound, not link-bound. Round
trips (1-byte TCP ping-pong): 16-18 us over loopback inside a host, 20-22 us host to host;
shaping adds no delay (this kernel cannot emulate latency).

Example: two ranks of a torchrun-style job, each on its own host at 1 Gbit/s::

    import os, sys
    from ringtrain.bench.netem import EmulatedNetwork, NetemUnavailable

    try:
        with EmulatedNetwork(2, rate="1gbit") as net:
            procs = []
            for rank in range(2):
                env = {**os.environ, "MASTER_ADDR": net.addr(0), "MASTER_PORT": "29500",
                       "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
                procs.append(net.popen(rank, [sys.executable, "train.py"], env=env))
            codes = [p.wait(timeout=600) for p in procs]
    except NetemUnavailable as exc:
        print(f"skipped: {exc}")

``net.start_ranks(argv, master_port=29500)`` does the same loop (one rank per host) and
``net.wait_ranks(procs, timeout)`` waits for all of them, killing the others as soon as one
fails. ``popen`` adds ``RINGTRAIN_HOST_ID`` (and ``GLOO_SOCKET_IFNAME``) to the environment.
Leaving the ``with`` block (also by an exception, Ctrl-C, SIGTERM or SIGHUP) kills the processes
started in the namespaces and removes every namespace, and with them every link, that the
network made; so does :func:`cleanup_stale` for a harness that was killed outright.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..lifecycle import pid_alive

__all__ = [
    "EmulatedNetwork",
    "HOST_ID_ENV",
    "LinkShape",
    "NetemUnavailable",
    "cleanup_stale",
    "parse_rate",
    "unavailable_reason",
]

#: The environment variable that carries a rank's host identity to the rendezvous.
HOST_ID_ENV = "RINGTRAIN_HOST_ID"
#: Where the harness keeps its liveness locks (root-only, like /run/netns).
LOCK_DIR = "/run/ringtrain-netem"
#: Per-namespace /etc overrides that `ip netns exec` bind-mounts (iproute2 convention).
ETC_NETNS = "/etc/netns"
#: The first three octets of every host address (a /24 that exists only inside the namespaces).
SUBNET = "10.213.0"
#: The most hosts one network has (host i is SUBNET.(i+1)).
MAX_HOSTS = 250
#: Every host's one interface besides loopback (its end of the link).
HOST_IFNAME = "eth0"
#: Deadline for one `ip`/`tc` command.
COMMAND_TIMEOUT_S = 30.0
#: How long started processes get after SIGTERM before SIGKILL.
KILL_GRACE_S = 2.0

_RATE_UNITS = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_NETWORK_SEQ = itertools.count()
#: Signals after which the network cleans up, then lets the signal do what it did before.
_CLEANUP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Networks open in this process; one process-wide handler cleans them all up on a signal. It is
#: installed when the first opens and the handlers it replaced come back when the last closes.
_OPEN_NETWORKS: list[EmulatedNetwork] = []
#: The networks whose close() is running (a signal then waits: _on_signal).
_CLOSING: list = []
_PREVIOUS_HANDLERS: dict[int, object] = {}


class NetemUnavailable(RuntimeError):
    """Network emulation cannot run here (not root, no `ip`/`tc`, no namespaces); the reason says why."""


def parse_rate(rate: str | None) -> int | None:
    """Bits per second of ``"1gbit"``, ``"10gbit"``, ``"500mbit"``...; ``None`` for no shaping.

    ``None`` and ``"none"`` mean no shaping. Units are decimal (1gbit = 10**9 bit/s).
    """
    if rate is None:
        return None
    text = str(rate).strip().lower()
    if text == "none":
        return None
    match = _RATE_RE.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"rate must be 'none' or a positive number with unit kbit, mbit or gbit "
            f"(e.g. '1gbit', '10gbit'), got {rate!r}"
        )
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


#: What a real Ethernet link sends with each frame beyond the frame the kernel hands it: the
#: preamble and start delimiter (8), the frame check sequence (4) and the gap (12). With it a
#: full 1500-byte-MTU link carries TCP payload at 1448/1538 = 94.1% of its rate, as real Gigabit
#: Ethernet does; tbf counting frames alone carried 1448/1514 = 95.6% (1.6% more than a real
#: link). tbf's own ``overhead`` cannot count it: it adds it once per packet the qdisc sees,
#: and a veth hands it GSO packets of up to 45 frames. So the rate tbf enforces is the line
#: rate scaled by FULL_FRAME_BYTES / (FULL_FRAME_BYTES + overhead): exact for full frames
#: (bulk transfers), a little generous for small ones.
ETHERNET_OVERHEAD_BYTES = 24
#: An Ethernet frame at MTU 1500 as the kernel hands it to the link (header 14, no FCS).
FULL_FRAME_BYTES = 1514


def default_burst_bytes(rate_bps: int) -> int:
    """One millisecond of line rate, rounded up to 64 KiB (128 KiB at 1 Gbit/s, 1.25 MiB at 10 Gbit/s)."""
    one_ms = rate_bps / 8 / 1000
    return max(1, math.ceil(one_ms / 65536)) * 65536


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkShape:
    """How each direction of every host's link is shaped (one tbf qdisc per direction)."""

    rate_bps: int
    """Line rate in bits per second, counted over whole Ethernet frames and their overhead."""
    burst_bytes: int
    """Token bucket depth: how many bytes may leave back to back at more than the rate."""
    queue_ms: float = 5.0
    """How long a frame may wait in the queue (tbf ``latency``); frames beyond it are dropped."""
    overhead_bytes: int = ETHERNET_OVERHEAD_BYTES
    """Bytes a frame costs on the line beyond what the kernel hands the link (ETHERNET_OVERHEAD_BYTES)."""

    def __post_init__(self) -> None:
        if self.rate_bps <= 0:
            raise ValueError(f"rate_bps must be positive, got {self.rate_bps}")
        if self.burst_bytes < 2048:
            raise ValueError(f"burst_bytes must be at least 2048 (one frame), got {self.burst_bytes}")
        if not 0 < self.queue_ms <= 1000:
            raise ValueError(f"queue_ms must be in (0, 1000], got {self.queue_ms}")
        if not 0 <= self.overhead_bytes <= 64:
            raise ValueError(f"overhead_bytes must be in [0, 64], got {self.overhead_bytes}")

    @classmethod
    def for_rate(cls, rate: str | None, *, burst_bytes: int | None = None,
                 queue_ms: float = 5.0) -> LinkShape | None:
        """The shape for ``rate`` (see :func:`parse_rate`) with the default burst; None: no shaping."""
        rate_bps = parse_rate(rate)
        if rate_bps is None:
            return None
        burst = default_burst_bytes(rate_bps) if burst_bytes is None else burst_bytes
        return cls(rate_bps=rate_bps, burst_bytes=burst, queue_ms=queue_ms)

    @property
    def frame_rate_bps(self) -> int:
        """The rate tbf enforces over the frames the kernel hands the link: the line rate less
        the per-frame overhead of full frames (see ETHERNET_OVERHEAD_BYTES)."""
        return round(self.rate_bps * FULL_FRAME_BYTES / (FULL_FRAME_BYTES + self.overhead_bytes))

    def tbf(self) -> str:
        """The qdisc and its settings as tc takes them: 'tbf rate 984395319bit burst 131072b
        latency 5ms' for 1 Gbit/s."""
        return f"tbf rate {self.frame_rate_bps}bit burst {self.burst_bytes}b latency {self.queue_ms:g}ms"

    def tbf_command(self, dev: str) -> str:
        """The tc batch line that puts this shape on the egress of ``dev``."""
        return f"qdisc replace dev {dev} root {self.tbf()}"

    def to_dict(self) -> dict:
        """What a result file records of the shaping, enough to apply it again by hand."""
        return {"qdisc": "tbf", "rate_bps": self.rate_bps, "burst_bytes": self.burst_bytes,
                "latency_ms": self.queue_ms, "overhead_bytes": self.overhead_bytes,
                "frame_rate_bps": self.frame_rate_bps, "tc": self.tbf(),
                "applied_to": "the egress of both ends of every host's link (its eth0 and its switch port)"}


def namespace_names(tag: str, n_hosts: int) -> tuple[str, list[str]]:
    """(switch namespace, [host namespaces]) of the network tagged ``tag``."""
    return f"{tag}-sw", [f"{tag}-h{i}" for i in range(n_hosts)]


def hosts_file(hostname: str, own_addr: str, identities: Mapping[str, str]) -> str:
    """One host's /etc/hosts: the machine's hostname at ``own_addr``, each identity at its address."""
    lines = ["127.0.0.1 localhost", f"{own_addr} {hostname}"]
    lines += [f"{addr} {name}" for name, addr in identities.items()]
    # A dual-stack server (torch's TCPStore) sees peers as ::ffff:a.b.c.d and looks that up; a
    # name of its own keeps forward lookups of the identity on the IPv4 address.
    lines += [f"::ffff:{addr} {name}.v4mapped" for name, addr in identities.items()]
    return "\n".join(lines) + "\n"


def parse_namespace_name(prefix: str, name: str) -> tuple[int, str] | None:
    """(pid, tag) when ``name`` is a namespace a network with ``prefix`` made, else None."""
    match = re.match(rf"^({re.escape(prefix)}-(\d+)-\d+)-(?:sw|h\d+)$", name)
    if match is None:
        return None
    return int(match.group(2)), match.group(1)


def unavailable_reason(*, shaping: bool = True) -> str | None:
    """Why emulation cannot run on this machine, or None when it can (as far as cheap checks tell)."""
    if not sys.platform.startswith("linux"):
        return f"network emulation needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return f"network emulation needs root to create network namespaces (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "network emulation needs the `ip` command (iproute2), which is not on PATH"
    if shaping and shutil.which("tc") is None:
        return "network emulation needs the `tc` command (iproute2) to shape links, which is not on PATH"
    return None


def _command(argv: Sequence[str], *, stdin: str | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run an iproute2 command with a deadline; raise NetemUnavailable naming it when it fails."""
    try:
        done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetemUnavailable(f"`{' '.join(argv)}` failed: {exc}") from exc
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        raise NetemUnavailable(f"`{' '.join(argv)}` failed (exit {done.returncode}): {detail}")
    return done


def _list_namespaces() -> list[str]:
    out = _command(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]



def _lock_path(tag: str) -> str:
    return os.path.join(LOCK_DIR, f"{tag}.lock")


def _lock_is_free(tag: str) -> bool:
    """True when no living process holds the tag's lock (or there is no lock file)."""
    try:
        fd = os.open(_lock_path(tag), os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    finally:
        os.close(fd)


def _harness_gone(tag: str) -> bool:
    """True when the harness that made ``tag``'s network is gone: its lock file is there and free,
    or (no lock file: it died before taking it, or is closing) its pid is dead.

    The lock decides where there is one: pids wrap, and the dead harness's pid may have been
    given to another process since, this one even (whose network of the same tag then could
    not be made: "File exists").
    """
    if os.path.exists(_lock_path(tag)):
        return _lock_is_free(tag)
    return not pid_alive(int(tag.rsplit("-", 2)[1]))


def _make_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, once more when its parent went in between: another
    network's close() removes /etc/netns once it is empty, which it is until this one's host
    directory is made in it (before: this network went on without its hosts files, warning)."""
    for attempt in range(3):
        try:
            os.makedirs(path, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


def _kill_namespace_processes(namespaces: Sequence[str], deadline_s: float = KILL_GRACE_S) -> None:
    """SIGKILL every process still inside ``namespaces`` and wait (bounded) for them to go."""
    pids: set[int] = set()
    for ns in namespaces:
        done = _command(["ip", "netns", "pids", ns], check=False)
        pids.update(int(p) for p in done.stdout.split() if p.isdigit())
    pids.discard(os.getpid())
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + deadline_s
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if pid_alive(p) and not _is_zombie(p)}
        if pids:
            time.sleep(0.01)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)  # started with start_new_session: the group id is the leader's pid
    except (ProcessLookupError, PermissionError):
        pass


def _delete_namespaces(namespaces: Sequence[str]) -> None:
    """Delete the namespaces (their links go with them) and their /etc/netns overrides."""
    if namespaces:
        batch = "".join(f"netns delete {ns}\n" for ns in namespaces)
        _command(["ip", "-force", "-batch", "-"], stdin=batch, check=False)
    for ns in namespaces:
        shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)


def cleanup_stale(prefix: str = "ringtrain") -> list[str]:
    """Remove what crashed networks with this ``prefix`` left behind; return the namespaces removed.

    A network is a leftover when its harness is gone (:func:`_harness_gone`). Processes still
    running inside its namespaces are killed, then the namespaces are deleted (which removes
    their veth pairs and bridge), with their /etc/netns overrides and lock file. Namespaces
    of live harnesses, and namespaces whose names this harness does not make, are left alone.
    """
    reason = unavailable_reason(shaping=False)
    if reason is not None:
        raise NetemUnavailable(reason)
    existing = set(_list_namespaces())
    overrides = set(os.listdir(ETC_NETNS)) if os.path.isdir(ETC_NETNS) else set()
    by_tag: dict[str, list[str]] = {}
    for ns in sorted(existing | overrides):
        parsed = parse_namespace_name(prefix, ns)
        if parsed is not None:
            by_tag.setdefault(parsed[1], []).append(ns)
    removed: list[str] = []
    for tag, names in by_tag.items():
        if not _harness_gone(tag):
            continue
        namespaces = [ns for ns in names if ns in existing]
        _kill_namespace_processes(namespaces)
        _delete_namespaces(namespaces)
        for ns in names:  # overrides whose namespace is already gone
            shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
        try:
            os.unlink(_lock_path(tag))
        except FileNotFoundError:
            pass
        removed.extend(namespaces)
    if removed:
        for directory in (ETC_NETNS, LOCK_DIR):
            try:
                os.rmdir(directory)  # only if now empty: a crashed network may have created it
            except OSError:
                pass
    return removed


class EmulatedNetwork:
    """``n_hosts`` hosts, each in its own network namespace, on one switch; links shaped to ``rate``.

    Use as a context manager (see the module docstring for a full example)::

        with EmulatedNetwork(2, rate="1gbit") as net:
            net.run(1, ["python3", "-c", "print('hello from host 1')"])
            server = net.popen(1, ["python3", "server.py", "--bind", net.addr(1)])

    ``rate`` is ``"1gbit"``, ``"10gbit"`` (any ``<number>kbit|mbit|gbit``), or ``None``/``"none"``
    for namespaces and veth pairs without shaping. ``burst_bytes`` and ``queue_ms`` override
    the tbf defaults (see :class:`LinkShape`). ``prefix`` names the namespaces
    (``{prefix}-{pid}-{seq}-h{i}`` and ``-sw``); :func:`cleanup_stale` takes the same prefix.
    Raises :class:`NetemUnavailable` on entry when the machine cannot do it.
    """

    def __init__(self, n_hosts: int, rate: str | None = None, *, prefix: str = "ringtrain",
                 burst_bytes: int | None = None, queue_ms: float = 5.0) -> None:
        if not isinstance(n_hosts, int) or not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be an integer in [1, {MAX_HOSTS}], got {n_hosts!r}")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,31}", prefix):
            raise ValueError(f"prefix must be a letter then up to 31 letters, digits or '_', got {prefix!r}")
        self.n_hosts = n_hosts
        self.prefix = prefix
        self.shape = LinkShape.for_rate(rate, burst_bytes=burst_bytes, queue_ms=queue_ms)
        self._owner_pid = os.getpid()  # a forked child inherits atexit and handlers, not the network
        self.tag = f"{prefix}-{self._owner_pid}-{next(_NETWORK_SEQ)}"
        self.switch_namespace, self.host_namespaces = namespace_names(self.tag, n_hosts)
        self._processes: list[subprocess.Popen] = []
        self._lock_fd: int | None = None
        self._open = False

    # ---- what callers use -------------------------------------------------------------

    @property
    def rate(self) -> str:
        """The line rate as text: ``"1gbit"``, ``"10gbit"``, ... or ``"none"``."""
        if self.shape is None:
            return "none"
        bps = self.shape.rate_bps
        for unit, scale in (("gbit", 10**9), ("mbit", 10**6)):
            if bps % scale == 0:
                return f"{bps // scale}{unit}"
        return f"{bps}bit"

    def addr(self, i: int) -> str:
        """Host ``i``'s IPv4 address (reachable from every host of this network, and nowhere else)."""
        self._check_host(i)
        return f"{SUBNET}.{i + 1}"

    def namespace(self, i: int) -> str:
        """The name of host ``i``'s network namespace."""
        self._check_host(i)
        return self.host_namespaces[i]

    def host_id(self, i: int) -> str:
        """Host ``i``'s identity, distinct per host and per network; popen sets it as RINGTRAIN_HOST_ID."""
        self._check_host(i)
        return f"{self.tag}-h{i}"

    def popen(self, i: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``i``; the network kills it (and its process group) on exit.

        ``env`` is the whole environment as for subprocess (None: this process's); RINGTRAIN_HOST_ID
        is added, and GLOO_SOCKET_IFNAME=eth0 unless ``env`` sets it. Other keyword arguments go
        to subprocess.Popen (``start_new_session`` is forced on, so the process and its children
        can be killed as one group).
        """
        if not self._open:
            raise RuntimeError("EmulatedNetwork is not open: use it as `with EmulatedNetwork(...) as net:`")
        full_env = dict(os.environ if env is None else env)
        full_env[HOST_ID_ENV] = self.host_id(i)
        full_env.setdefault("GLOO_SOCKET_IFNAME", HOST_IFNAME)
        kwargs["start_new_session"] = True
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *argv], env=full_env, **kwargs)
        self._processes.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float = 60.0, check: bool = True, capture_output: bool = False,
            input: str | bytes | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``i`` to completion within ``timeout`` s, like subprocess.run."""
        if capture_output:
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if input is not None:
            kwargs["stdin"] = subprocess.PIPE
        proc = self.popen(i, argv, env=env, **kwargs)
        try:
            stdout, stderr = proc.communicate(input=input, timeout=timeout)
        except subprocess.TimeoutExpired:
            self._stop([proc])
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        if check:
            done.check_returncode()
        return done

    def start_ranks(self, argv: Sequence[str], *, master_port: int = 29500,
                    env: Mapping[str, str] | None = None, **kwargs) -> list[subprocess.Popen]:
        """Start ``argv`` once per host as rank ``i`` of a torchrun-style job (one rank per host).

        Each gets MASTER_ADDR (host 0), MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK=0,
        LOCAL_WORLD_SIZE=1 on top of ``env`` (None: this process's environment).
        """
        if not 1 <= master_port <= 65535:
            raise ValueError(f"master_port must be in [1, 65535], got {master_port}")
        base = dict(os.environ if env is None else env)
        procs = []
        for rank in range(self.n_hosts):
            rank_env = {**base, "MASTER_ADDR": self.addr(0), "MASTER_PORT": str(master_port),
                        "RANK": str(rank), "WORLD_SIZE": str(self.n_hosts),
                        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
            procs.append(self.popen(rank, argv, env=rank_env, **kwargs))
        return procs

    def wait_ranks(self, procs: Sequence[subprocess.Popen], timeout: float) -> list[int]:
        """Wait for every rank; when one fails (or the deadline passes) stop the others. Exit codes by rank.

        A rank stopped because another failed, or because of the deadline, shows a negative
        code (the signal that ended it).
        """
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]  # poll every rank: any() would stop at the first running one
            if None not in codes:
                break
            if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                self._stop(procs)
                break
            time.sleep(0.02)
        return [p.returncode for p in procs]

    # ---- life cycle -------------------------------------------------------------------

    def __enter__(self) -> EmulatedNetwork:
        reason = unavailable_reason(shaping=self.shape is not None)
        if reason is not None:
            raise NetemUnavailable(reason)
        cleanup_stale(self.prefix)
        self._install_signal_handlers()
        atexit.register(self.close)
        self._open = True
        try:
            self._take_lock()
            self._build()
        except BaseException:
            self.close()
            # (a signal's close() may have run while `ip netns add` was still making its namespace:
            # what it made once close() had looked goes now, as the KeyboardInterrupt leaves)
            self._remove_namespaces()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Kill the processes started here and remove every namespace this network made. Idempotent.

        Does nothing in a forked child of the process that opened the network.
        """
        if not self._open or os.getpid() != self._owner_pid:
            return
        masked = threading.current_thread() is threading.main_thread()
        if masked:  # a second Ctrl-C must not cut the clean-up short; it is delivered afterwards
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _CLEANUP_SIGNALS)
        _CLOSING.append(self)  # (one that came before the mask: _on_signal lets it pass, below)
        try:
            self._open = False
            self._stop(self._processes)
            self._processes.clear()
            self._remove_namespaces()
            try:  # whoever made it: the network that did may have closed while this one used it
                os.rmdir(ETC_NETNS)  # only if empty: another network may be using it
            except OSError:
                pass
            self._release_lock()
            atexit.unregister(self.close)
            self._restore_signal_handlers()
        finally:
            _CLOSING.remove(self)
            if masked:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    # ---- internals --------------------------------------------------------------------

    def _remove_namespaces(self) -> None:
        """Kill what runs in, and delete, every namespace named with this network's tag, with their
        /etc/netns overrides.

        By name, not by a list kept while building: a signal that came as `ip netns add` ended,
        before its namespace was written down, left that namespace behind.
        """
        ours = [ns for ns in _list_namespaces()
                if (parsed := parse_namespace_name(self.prefix, ns)) is not None and parsed[1] == self.tag]
        _kill_namespace_processes(ours)
        _delete_namespaces(ours)
        for ns in (self.switch_namespace, *self.host_namespaces):
            shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)

    def _check_host(self, i: int) -> None:
        if not isinstance(i, int) or not 0 <= i < self.n_hosts:
            raise ValueError(f"host index must be in [0, {self.n_hosts}), got {i!r}")

    def _take_lock(self) -> None:
        try:
            for attempt in range(3):  # another network may remove the empty directory in between
                os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
                try:
                    fd = os.open(_lock_path(self.tag), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
        except OSError as exc:
            raise NetemUnavailable(f"cannot create the liveness lock in {LOCK_DIR}: {exc}") from exc
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is None:
            return
        try:
            os.unlink(_lock_path(self.tag))
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = None
        try:
            os.rmdir(LOCK_DIR)  # only if empty: other networks keep their locks there
        except OSError:
            pass

    def _build(self) -> None:
        for ns in (self.switch_namespace, *self.host_namespaces):
            _command(["ip", "netns", "add", ns])
        self._write_hosts_files()
        switch = ["link add br0 type bridge stp_state 0", "link set br0 addrgenmode none", "link set br0 up"]
        for i, host_ns in enumerate(self.host_namespaces):
            switch += [f"link add p{i} type veth peer name eth0 netns {host_ns}",
                       f"link set p{i} addrgenmode none", f"link set p{i} master br0", f"link set p{i} up"]
        _command(["ip", "-n", self.switch_namespace, "-batch", "-"], stdin="\n".join(switch) + "\n")
        for i, host_ns in enumerate(self.host_namespaces):
            host = ["link set lo up", "link set eth0 addrgenmode none",
                    f"addr add {self.addr(i)}/24 dev eth0", "link set eth0 up"]
            _command(["ip", "-n", host_ns, "-batch", "-"], stdin="\n".join(host) + "\n")
        if self.shape is not None:
            switch_tc = [self.shape.tbf_command(f"p{i}") for i in range(self.n_hosts)]
            _command(["tc", "-n", self.switch_namespace, "-batch", "-"], stdin="\n".join(switch_tc) + "\n")
            for host_ns in self.host_namespaces:
                _command(["tc", "-n", host_ns, "-batch", "-"], stdin=self.shape.tbf_command("eth0") + "\n")

    def _write_hosts_files(self) -> None:
        """Write each host's /etc/hosts override; where /etc is read-only, warn and go on without."""
        identities = {self.host_id(i): self.addr(i) for i in range(self.n_hosts)}
        hostname = socket.gethostname()
        try:
            for i, ns in enumerate(self.host_namespaces):
                _make_dirs(os.path.join(ETC_NETNS, ns))
                with open(os.path.join(ETC_NETNS, ns, "hosts"), "w") as f:
                    f.write(hosts_file(hostname, self.addr(i), identities))
        except OSError as exc:
            warnings.warn(f"no per-host /etc/hosts ({exc}); the hostname resolves as on the machine, "
                          "so set GLOO_SOCKET_IFNAME=eth0 (popen does) or bind to net.addr(i)",
                          RuntimeWarning, stacklevel=3)

    @staticmethod
    def _stop(procs: Sequence[subprocess.Popen]) -> None:
        """SIGTERM the process groups still running, SIGKILL those left after the grace period; reap.

        A group is signalled only while its leader is unreaped (running or a zombie), so its id
        cannot have been reused by an unrelated process. Stragglers that left the group are
        caught later by killing whatever is still inside the namespaces.
        """
        running = [p for p in procs if p.poll() is None]
        for p in running:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
        for p in running:
            try:
                p.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass

    def _install_signal_handlers(self) -> None:
        _OPEN_NETWORKS.append(self)
        if _PREVIOUS_HANDLERS or threading.current_thread() is not threading.main_thread():
            return  # already installed; or off the main thread, where atexit and __exit__ remain
        for sig in _CLEANUP_SIGNALS:
            _PREVIOUS_HANDLERS[sig] = signal.signal(sig, _on_signal)

    def _restore_signal_handlers(self) -> None:
        if self in _OPEN_NETWORKS:
            _OPEN_NETWORKS.remove(self)
        if _OPEN_NETWORKS or threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in _PREVIOUS_HANDLERS.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        _PREVIOUS_HANDLERS.clear()


def _on_signal(signum: int, frame) -> None:
    """Clean up every open network, then do what the signal did before: raise KeyboardInterrupt, die, or chain on.

    Not while a clean-up runs: a second signal that came before close() masked them (``timeout``
    passes the terminal's Ctrl-C on, so the process gets two or three) raised inside it and cut
    it short, leaving the namespaces; the signal that started the clean-up acts once it is done."""
    if _CLOSING:
        return
    previous = _PREVIOUS_HANDLERS.get(signum, signal.SIG_DFL)
    if previous == signal.SIG_IGN:
        return
    for net in list(_OPEN_NETWORKS):
        net.close()  # (a no-op in a forked child, which then just gets the old behaviour)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
