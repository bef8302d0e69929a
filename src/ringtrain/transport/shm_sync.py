"""Shared-memory segments, the mailbox layout inside them, and how a rank waits on a peer.

Words (used by ``shm.py`` too):

- *segment*: a file in /dev/shm (a tmpfs) that two processes map with ``MAP_SHARED``. Its
  name is ``ringtrain-<pidns>-<pid>-<tag>-<serial>-<src>-<dst>`` so that a segment left behind
  by a crashed process can be recognised (its pid is dead in our pid namespace) and removed.
- *mailbox*: the one-way channel from a *sender* rank to a *receiver* rank, living in one
  segment that the sender creates. It is a ring of ``slots`` *slots* of ``slot_bytes`` bytes
  each, preceded by a *control block* (one or more 4 KiB pages) that holds:

  ====== ==================================================================================
  word    meaning (all int64, 8-byte aligned; each counter on its own 64-byte line)
  ====== ==================================================================================
  0-2     magic, slot count, slot size (written once by the sender before anyone maps it)
  8       *head*: number of slots the sender has filled so far (written by the sender only)
  16      *tail*: number of slots the receiver has consumed so far (written by receiver only)
  24      *closed*: 1 once the sender closed its transport (written by the sender)
  32-34   *abort* flag, error code, text length; text (<= ABORT_TEXT bytes) at byte 512
  ====== ==================================================================================

  followed by the *slot table* (from byte 1536): 64 bytes per slot = the packed CallHeader
  of the message the slot belongs to, the message length, this slot's offset in the message
  and the number of payload bytes in the slot. Slot ``k`` of the ring holds filled slot number ``n`` when
  ``n % slots == k``; it is free for the sender while ``head - tail < slots``.

Memory ordering. The sender writes a slot (table entry and payload), then stores ``head``;
the receiver loads ``head``, then reads the slot, then stores ``tail``; the sender loads
``tail`` before it overwrites a slot. Every counter is an aligned 8-byte word written by one
process with a single store, so loads never see a torn value. This relies on x86-64 total
store order (stores become visible in program order; a load is not reordered with an
earlier load, a store not with an earlier load). The stores happen in separate C calls from
the interpreter, so the compiler cannot reorder them either. Weaker machines (ARM, POWER)
would need fences that Python cannot issue; :data:`ORDERING_OK` is False there and the
transport refuses to start.

Waiting. A rank that can make no progress spins a few rounds, then sleeps in the kernel on
its *doorbell* (a FIFO its peers write a byte into after they publish a counter), so that 4
ranks on 2 cores do not burn each other's time and a sleeper wakes as soon as there is work.
Before it sleeps, and every few milliseconds while it sleeps, it checks its deadline, the
peers' abort and closed flags, and whether the peers' processes are still alive.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import select
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .base import usable_cpus

#: x86-64 total store order makes the plain stores above safe (see the module text); 32-bit
#: x86 is left out because an 8-byte store may be split in two there.
ORDERING_OK = platform.machine().lower() in ("x86_64", "amd64")

MAGIC = 0x31304D4853545200  # "\0RTSHM01" little-endian
PAGE = 4096
SLOT_ENTRY = 64  # bytes per slot-table entry
SLOT_TABLE = 1536  # byte offset of the slot table in the control block
ABORT_TEXT_AT = 512
ABORT_TEXT = 1000  # at most this many bytes of error text travel with an abort

# word indices (int64) in the control block
W_MAGIC, W_SLOTS, W_SLOT_BYTES = 0, 1, 2
W_HEAD, W_TAIL, W_CLOSED = 8, 16, 24
W_ABORT, W_ABORT_CODE, W_ABORT_LEN = 32, 33, 34

NAME_PREFIX = "ringtrain-"
_NAME_RE = re.compile(r"^ringtrain-(\d+)-(\d+)-[0-9a-f]+-\d+-\d+-\d+$")


def control_bytes(slots: int) -> int:
    """Size of the control block: a whole number of pages holding the slot table."""
    end = SLOT_TABLE + SLOT_ENTRY * slots
    return -(-end // PAGE) * PAGE


def segment_dir() -> str:
    """/dev/shm when it exists (Linux), else the temporary directory (page-cache backed)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


# --- process identity and liveness ---------------------------------------------------------


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, start time in clock ticks) of ``pid`` from /proc, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    fields = text[text.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


@dataclass(frozen=True, slots=True)
class ProcessId:
    """Who a rank's process is: pid, its start time and its pid namespace.

    The start time guards against pid reuse; liveness is only judged for processes in our
    own pid namespace (elsewhere the pid means nothing to us).
    """

    pid: int
    start: int
    pidns: int

    @classmethod
    def mine(cls) -> "ProcessId":
        pid = os.getpid()
        stat = _proc_stat(pid) if os.path.isdir("/proc") else None
        return cls(pid, stat[1] if stat else 0, pid_namespace())

    def encode(self) -> bytes:
        return f"{self.pid}:{self.start}:{self.pidns}".encode()

    @classmethod
    def decode(cls, data: bytes) -> "ProcessId":
        pid, start, ns = (int(x) for x in data.decode().split(":"))
        return cls(pid, start, ns)

    def alive(self) -> bool:
        """False only when we can tell the process is gone (or a zombie)."""
        if self.pidns != pid_namespace():
            return True
        if os.path.isdir("/proc"):
            stat = _proc_stat(self.pid)
            if stat is None:
                return False
            state, start = stat
            return state not in ("Z", "X", "x") and (self.start == 0 or start == self.start)
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# --- segments ------------------------------------------------------------------------------


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
            if hasattr(os, "posix_fallocate"):  # reserve the pages now: a full /dev/shm is an
                os.posix_fallocate(fd, 0, size)  # error here, not a SIGBUS in mid-exchange
        elif os.fstat(fd).st_size != size:
            raise OSError(f"segment {path} has {os.fstat(fd).st_size} bytes, expected {size}")
        populate = getattr(mmap, "MAP_POPULATE", 0)  # fault every page in now, not mid-exchange
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        if create:
            unlink_quietly(path)
        raise
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _started_after(pid: int, path: str) -> bool:
    """Whether process ``pid`` started after ``path`` was created: then the pid was reused
    and the segment's creator is gone. False when /proc cannot tell."""
    try:
        stat = _proc_stat(pid)
        if stat is None:
            return False
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        started = boot + stat[1] / os.sysconf("SC_CLK_TCK")
        return started > os.stat(path).st_mtime + 1.0  # btime has whole seconds only
    except (OSError, ValueError, StopIteration):
        return False


def remove_stale_segments(directory: Optional[str] = None) -> list[str]:
    """Unlink ringtrain segments whose creating process is dead; return their names.

    A creator is dead when its pid is gone, a zombie, or now belongs to a process that
    started after the segment was made. Best effort: only segments created in our pid
    namespace are judged, and errors are ignored (another process may be removing the same
    files).
    """
    directory = directory or segment_dir()
    ns = pid_namespace()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m is None or int(m.group(1)) != ns:
            continue
        pid = int(m.group(2))
        path = os.path.join(directory, name)
        if ProcessId(pid, 0, ns).alive() and not _started_after(pid, path):
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return removed


class Mailbox:
    """One mapped mailbox segment, seen from the sender or from the receiver.

    ``count`` is this side's own counter (head for the sender, tail for the receiver) and
    ``seen`` the last value read of the other side's counter.
    """

    def __init__(self, mm: mmap.mmap, path: str, owner: bool):
        self.mm = mm
        self.path = path
        self.owner = owner  # True for the sender, which created (and unlinks) the segment
        self.linked = owner
        self.ctl = memoryview(mm).cast("q")  # the whole segment as int64 words; only the start is used
        if self.ctl[W_MAGIC] != MAGIC:
            raise OSError(f"segment {path} is not a ringtrain mailbox")
        self.slots = int(self.ctl[W_SLOTS])
        self.slot_bytes = int(self.ctl[W_SLOT_BYTES])
        base = control_bytes(self.slots)
        whole = np.frombuffer(mm, dtype=np.uint8)
        self.data = [whole[base + k * self.slot_bytes : base + (k + 1) * self.slot_bytes] for k in range(self.slots)]
        self.count = 0
        self.seen = 0

    @classmethod
    def create(cls, path: str, slots: int, slot_bytes: int) -> "Mailbox":
        size = control_bytes(slots) + slots * slot_bytes
        mm = _map(path, size, create=True)
        try:
            ctl = memoryview(mm).cast("q")
            ctl[W_SLOTS] = slots
            ctl[W_SLOT_BYTES] = slot_bytes
            ctl[W_MAGIC] = MAGIC
            ctl.release()
            return cls(mm, path, owner=True)
        except BaseException:
            mm.close()
            unlink_quietly(path)
            raise

    @classmethod
    def open(cls, path: str) -> "Mailbox":
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size < PAGE:
            raise OSError(f"segment {path} is too small ({size} bytes) to be a ringtrain mailbox")
        mm = _map(path, size, create=False)
        try:
            return cls(mm, path, owner=False)
        except BaseException:
            mm.close()
            raise

    # -- flags written by the sender ------------------------------------------------------

    def set_abort(self, code: int, text: str) -> None:
        raw = text.encode("utf-8", "replace")[:ABORT_TEXT]
        self.mm[ABORT_TEXT_AT : ABORT_TEXT_AT + len(raw)] = raw
        self.ctl[W_ABORT_CODE] = code
        self.ctl[W_ABORT_LEN] = len(raw)
        self.ctl[W_ABORT] = 1  # last: the text and code are visible before the flag (TSO)

    def abort_info(self) -> Optional[tuple[int, str]]:
        if not self.ctl[W_ABORT]:
            return None
        n = min(max(int(self.ctl[W_ABORT_LEN]), 0), ABORT_TEXT)
        text = bytes(self.mm[ABORT_TEXT_AT : ABORT_TEXT_AT + n]).decode("utf-8", "ignore")
        return int(self.ctl[W_ABORT_CODE]), text

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            unlink_quietly(self.path)

    def close(self) -> None:
        """Unlink (if ours and still linked) and unmap. Idempotent."""
        self.unlink()
        if self.mm is None:
            return
        self.data = []
        self.ctl.release()
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view; the mapping goes when it does
            pass
        self.mm = None


# --- waiting -------------------------------------------------------------------------------


class Doorbell:
    """A named FIFO that one rank sleeps on and its peers write a byte into to wake it.

    The owner drains it, re-checks its mailboxes, then polls it: a peer that publishes a
    counter rings *after* the store, and the pipe's kernel lock orders the two, so a change
    made before the drain is seen by the re-check and one made after it wakes the poll. No
    wake-up is lost. Both ends are opened O_RDWR | O_NONBLOCK (Linux: never blocks, needs no
    reader); a full pipe (nobody asleep for a long time) just drops the extra rings.
    """

    def __init__(self, path: str, fd: int, owner: bool):
        self.path = path
        self.fd = fd
        self.owner = owner
        self.linked = owner
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def create(cls, path: str) -> "Doorbell":
        os.mkfifo(path, 0o600)
        try:
            return cls(path, os.open(path, os.O_RDWR | os.O_NONBLOCK), owner=True)
        except BaseException:
            unlink_quietly(path)
            raise

    @classmethod
    def open(cls, path: str) -> "Doorbell":
        return cls(path, os.open(path, os.O_RDWR | os.O_NONBLOCK), owner=False)

    def ring(self) -> None:
        try:
            os.write(self.fd, b"\0")
        except (BlockingIOError, OSError):
            pass

    def drain(self) -> None:
        try:
            while len(os.read(self.fd, 4096)) == 4096:
                pass
        except (BlockingIOError, OSError):
            pass

    def wait(self, seconds: float) -> None:
        self._poll.poll(max(0, int(seconds * 1000 + 0.999)))

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            unlink_quietly(self.path)

    def close(self) -> None:
        self.unlink()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def runnable_now() -> Optional[int]:
    """The machine's runnable threads at this instant, the caller included (/proc/loadavg's
    fourth field, "running/total"); None where the kernel does not say."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return runnable_in(f.read())
    except OSError:
        return None


def runnable_in(loadavg: bytes) -> Optional[int]:
    """The running count of a /proc/loadavg text (``b"0.52 0.41 0.30 3/456 789"`` -> 3)."""
    try:
        return int(loadavg.split()[3].split(b"/")[0])
    except (IndexError, ValueError):
        return None


def spinning_pays(local_ranks: int = 1, runnable: Optional[int] = None) -> bool:
    """Whether a waiting rank should spin: its job's ``local_ranks`` fit on the CPUs it may use,
    and the machine's CPUs are not busy with more than they can run, as the runnable threads
    showed all along the last second (``runnable``: the most seen at any of its looks; None: not
    known) or else over the last minute (1-minute load below the CPU count + 1/2).

    Spinning catches a peer that answers within microseconds, but on an oversubscribed
    machine (4 ranks on 2 cores, or other jobs) it takes the CPU from the very peer it waits
    for, so there a waiting rank goes straight to sleep on its doorbell. The load average
    alone still counts a job that ended a minute ago; the runnable threads of a single look
    miss the ranks of another job asleep at that instant, so it is the most of a second's looks
    that counts.
    """
    if local_ranks > usable_cpus():
        return False
    cpus = os.cpu_count() or 1  # (the load and the runnable threads are the whole machine's)
    if runnable is not None and runnable <= cpus:
        return True
    try:
        return os.getloadavg()[0] < cpus + 0.5
    except OSError:
        return True


class Idle:
    """What a rank does when a round of its exchange made no progress.

    It spins ``SPINS`` rounds (a peer on another core usually answers within microseconds;
    none while the machine is oversubscribed, see :func:`spinning_pays`; ``local_ranks``: the
    transport's ranks on this host), then it *arms*: drains its doorbell and runs one more
    round; if that round makes no progress either it sleeps on the doorbell until a peer rings
    or ``CHECK_EVERY`` passes.
    The slow checks (peer flags, peer process alive, deadline) run before such a sleep when
    ``CHECK_EVERY`` has passed since the last ones or the deadline has; one Idle serves all
    the exchanges of a transport, so short waits do not each pay for a look at /proc.
    """

    SPINS = 40
    CHECK_EVERY = 0.005
    LOAD_EVERY = 1.0  # how often the machine's load is looked at again

    __slots__ = ("rounds", "armed", "next_check", "spins", "next_load", "local_ranks", "busiest")

    def __init__(self, local_ranks: int = 1) -> None:
        self.local_ranks = local_ranks
        self.busiest: Optional[int] = None  # the most runnable threads seen since the load was last weighed
        self.rounds = 0
        self.armed = False
        self.next_check = 0.0
        self.spins = self.SPINS
        self.next_load = 0.0

    def progressed(self) -> None:
        self.rounds = 0
        self.armed = False

    def step(self, bell: Optional[Doorbell], checks, deadline: float) -> None:
        """One idle round: spin, arm, or run the checks and sleep."""
        self.rounds += 1
        if self.rounds <= self.spins:
            return
        if not self.armed:
            self.armed = True
            if bell is not None:
                bell.drain()
            return
        self.armed = False
        now = time.monotonic()
        if now >= self.next_check or now >= deadline:
            checks()
            self.next_check = now + self.CHECK_EVERY
            seen = runnable_now()
            if seen is not None:
                self.busiest = seen if self.busiest is None else max(self.busiest, seen)
        if now >= self.next_load:
            self.next_load = now + self.LOAD_EVERY
            self.spins = self.SPINS if spinning_pays(self.local_ranks, self.busiest) else 0
            self.busiest = None
        nap = max(0.0, min(self.next_check, deadline) - now)
        if bell is not None:
            bell.wait(nap)
        else:
            time.sleep(min(nap, 0.001))
