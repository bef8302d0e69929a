"""Ctrl-C for a rank blocked in a torch.distributed gloo wait.

A thread in ``work.wait()`` is inside gloo, not in Python: a SIGINT is handled only when the
wait returns, i.e. when the peer answers or the deadline passes (20 s and more with a stopped
peer). gloo offers no way out of a wait: a timed-out ``wait`` closes every pair, and
``ProcessGroupGloo.abort()`` does not wake it. What does is its sockets: shut down, the
wait fails at once.

So each gloo group ringtrain makes records the sockets it opened (``made_sockets``), and a
``Breaker`` counts the waits in progress on it. One watcher thread per process learns of a
SIGINT through ``signal.set_wakeup_fd`` (written by the C signal handler, while the Python
handler must wait for the main thread) and, where Ctrl-C would raise KeyboardInterrupt (the
default handler is in place), shuts down the connected sockets of every group with a wait in
progress. The wait fails, the KeyboardInterrupt the signal left pending is raised, and the
peers read a closed connection: a PeerLost naming this rank instead of a wait for the deadline.
gloo's listening socket is left alone (gloo aborts the process when its accept fails), and
a group with no wait in progress is not touched: a script that catches KeyboardInterrupt
between calls keeps its communicator.

The watcher is installed by the main thread only, and only where no one else holds the wakeup
fd (asyncio does while it runs signal handlers); otherwise Ctrl-C waits for the wait, as before.
Sockets are found as the ones that appeared in /proc/self/fd while the group was made (Linux;
elsewhere there are none, and nothing changes).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
import weakref
from typing import Callable, TypeVar

from ..errors import CommError, CommTimeout, PeerLost

T = TypeVar("T")


def _socket_ids() -> set[tuple[int, int]]:
    """(descriptor, inode) of this process's open sockets; empty where /proc/self/fd is missing."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    out = set()
    for name in names:
        try:
            st = os.stat(int(name))
        except (OSError, ValueError):
            continue
        if stat.S_ISSOCK(st.st_mode):
            out.add((int(name), st.st_ino))
    return out


def made_sockets(make: Callable[[], T]) -> tuple[T, frozenset[tuple[int, int]]]:
    """``make()`` and the sockets that appeared while it ran, as (descriptor, inode)."""
    before = _socket_ids()
    made = make()
    return made, frozenset(_socket_ids() - before)


class Breaker:
    """The sockets of one gloo group and the waits in progress on them.

    ``with breaker.waiting(): work.wait(...)`` around each wait; ``broken`` says, after a failed
    wait, that it failed because Ctrl-C shut the group down, and ``failure`` words the error."""

    def __init__(self, sockets: frozenset[tuple[int, int]] = frozenset()):
        self._sockets = sockets
        self._waits = 0
        self._lock = threading.Lock()
        self.broken = False

    def waiting(self) -> Breaker:
        """A wait in progress while in the ``with`` block (the breaker counts them itself)."""
        return self

    def __enter__(self) -> None:
        with self._lock:
            self._waits += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._waits -= 1

    def failure(self, exc: RuntimeError, rank: int, doing: str, during: str) -> CommError:
        """What a wait that raised ``exc`` (gloo's or the store's RuntimeError) means, for rank
        ``rank`` ``doing`` something ("receiving from rank 1") ``during`` a call: interrupted by
        Ctrl-C (this breaker shut the group down), a CommTimeout (gloo's deadline), or a PeerLost."""
        if self.broken:
            return CommError(f"rank {rank}: interrupted (Ctrl-C) while {doing} during {during}")
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            return CommTimeout(f"rank {rank}: {doing} timed out during {during}: {text}")
        return PeerLost(f"rank {rank}: {doing} failed during {during}: {text}")

    def break_if_waiting(self) -> bool:
        """Shut down the group's connected sockets if a wait is in progress (the watcher's call)."""
        with self._lock:
            if not self._waits:
                return False
            self.broken = True
        for fd, inode in self._sockets:
            try:
                if os.fstat(fd).st_ino != inode:  # closed, and the number taken by another file
                    continue
                # a duplicate descriptor: shutdown acts on the socket, closing the duplicate does not
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # gone already, or not connected: nothing to wake
                continue
        return True


class _Watcher:
    """The process's SIGINT watcher: a pipe given to set_wakeup_fd and a thread reading it."""

    def __init__(self):
        self.breakers: "weakref.WeakSet[Breaker]" = weakref.WeakSet()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._thread = threading.Thread(target=self._run, name="ringtrain-ctrl-c", daemon=True)

    def install(self) -> bool:
        """Take the wakeup fd (main thread, none set by anyone else) and start; False otherwise."""
        try:
            before = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            before = None
        if before != -1:
            if before is not None:
                signal.set_wakeup_fd(before)  # someone else's: leave it to them
            self._close_pipe()
            return False
        self._thread.start()
        return True

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read, 512)
            except OSError:
                return
            if not data:  # the write end was closed: uninstalled
                os.close(self._read)
                return
            if signal.SIGINT in data and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                for breaker in list(self.breakers):
                    breaker.break_if_waiting()

    def uninstall(self) -> bool:
        """Give the wakeup fd back (main thread); the thread ends at the closed pipe."""
        try:
            held = signal.set_wakeup_fd(-1)
        except ValueError:  # not the main thread
            return False
        if held != self._write:  # another holder replaced ours: theirs stays
            signal.set_wakeup_fd(held)
            return False
        os.close(self._write)
        self._thread.join(1.0)  # it reads the end of the pipe at once: no thread outlives close()
        return True

    def _close_pipe(self) -> None:
        os.close(self._read)
        os.close(self._write)


_watcher: "_Watcher | None" = None
_watcher_lock = threading.Lock()


def watch(breaker: Breaker) -> None:
    """Let Ctrl-C break ``breaker``'s waits (a no-op where the watcher cannot be installed)."""
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            candidate = _Watcher()
            if not candidate.install():
                return
            _watcher = candidate
        _watcher.breakers.add(breaker)


def unwatch(breaker: Breaker) -> None:
    """Stop watching ``breaker``; the last one gives the wakeup fd back (when on the main thread)."""
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            return
        _watcher.breakers.discard(breaker)
        if not _watcher.breakers and _watcher.uninstall():
            _watcher = None
