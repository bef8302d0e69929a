"""One job at a time in a checkpoint directory.

Two ``ringtrain train`` runs on one ``--checkpoint-dir`` each saved over and pruned the other's
checkpoints without a word (the second resumed from the first's step, both ended "done", and
the folder held a mix). :func:`hold` takes an exclusive ``flock`` on ``<directory>/.ringtrain.lock``
for the run's life: the kernel lets it go when the process ends, however it ends (a SIGKILLed
job leaves no stale lock), and the file holds the holder's pid and host for the refusal. On a
file system without flock (some network mounts) the directory is used unlocked, as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from pathlib import Path
from typing import Iterator

LOCK_NAME = ".ringtrain.lock"


class DirectoryInUse(ValueError):
    """Another process holds the directory's lock."""


@contextlib.contextmanager
def hold(directory: Path, what: str) -> Iterator[None]:
    """Hold ``directory``'s lock until the block ends; :class:`DirectoryInUse` naming ``what``
    (the option that gave it) and the holder if another process holds it. The lock file is
    removed on the way out. A directory where the file cannot be made (read-only) or locked
    (no flock there) is used unlocked."""
    fd = _lock(Path(directory) / LOCK_NAME, directory, what)
    if fd is None:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # (read-only descriptor, a full disk: the text is only for the refusal)
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(Path(directory) / LOCK_NAME)  # still held: one waiting to open it finds it gone
        os.close(fd)


def _lock(path: Path, directory: Path, what: str) -> int | None:
    """The locked file's descriptor; None where locking is not possible."""
    while True:
        # Never through a link put there (it would truncate what it points to); a file another
        # user made is locked read-only (flock takes any descriptor); a FIFO does not block the open.
        # Not inherited by the workers: O_CLOEXEC.
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except PermissionError:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                return None  # (a folder this user cannot write: nobody saves there through it)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise DirectoryInUse(f"{what} {directory}: {path} is a symbolic link, not ringtrain's lock file; "
                                     "remove it") from None
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise DirectoryInUse(f"{what} {directory}: {path} is not a regular file, not ringtrain's lock file; "
                                 "remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 200).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DirectoryInUse(f"{what} {directory} is in use by another run ({holder or 'a process'}); "
                                     f"wait for it to end, or give another {what}") from None
            return None
        try:  # the file locked may be one its last holder removed as we opened it: then again
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
