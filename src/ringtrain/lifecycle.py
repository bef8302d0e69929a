"""Process lifetimes: workers end with the process that started them; is a pid alive.

torch's launcher starts each worker in a session of its own, so killing the launcher's
process group (Ctrl-C in a terminal, a scheduler's kill) would leave the workers training
and writing checkpoints. On Linux a worker asks the kernel for SIGKILL when its parent
dies (prctl PR_SET_PDEATHSIG); elsewhere this is a no-op. A worker still importing torch when
the launcher died has been re-parented before it could ask, so ringtrain's launchers name
themselves in the environment (``mark_launcher``) and such a worker ends at once. A user's
script under ``ringtrain launch`` asks when it calls ``ringtrain.init()`` (``die_with_launcher``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
LAUNCHER_ENV = "RINGTRAIN_LAUNCHER_PID"
"""The pid of the ringtrain process that started the job (``ringtrain train``, ``launch``, a bench)."""


def mark_launcher() -> None:
    """Name this process, in the environment its workers inherit, as the one that started them."""
    os.environ[LAUNCHER_ENV] = str(os.getpid())


def _launcher_gone() -> bool:
    value = os.environ.get(LAUNCHER_ENV, "")
    return value.isdigit() and not pid_alive(int(value))


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie counts; one of another user does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def die_with_launcher() -> bool:
    """``die_with_parent()`` in a process that a ringtrain launcher started (it named itself in the
    environment: a rank of ``ringtrain launch``, which runs the user's script); elsewhere nothing."""
    if not os.environ.get(LAUNCHER_ENV):
        return False
    return die_with_parent()


def tie_to_launcher() -> None:
    """What a rank of a launched job does first (``ringtrain.init()``, and the parameter servers'
    rank entry points, which do not call it): under ``ringtrain launch`` it ends with its launcher
    (``die_with_launcher``; a kill -9 of the launcher left the ranks running), and under torchrun its
    uncaught exception is written for the launcher's one-line report (``errorfile.record_uncaught``)."""
    from .errorfile import record_uncaught

    die_with_launcher()
    record_uncaught()


def die_with_parent() -> bool:
    """Arrange SIGKILL for this process when its parent exits; True if arranged. Where the parent
    or the launcher that named itself (``mark_launcher``) is gone already, SIGKILL now."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    # The parent died before the request took effect, or the launcher before this process got
    # here (it was re-parented while it imported torch, and its new parent may live on).
    if os.getppid() != parent or _launcher_gone():
        os.kill(os.getpid(), signal.SIGKILL)
    return True
