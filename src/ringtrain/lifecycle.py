"""Process lifetimes: workers end with the process that started them; is a pid alive.

torch's launcher starts each worker in a session of its own, so killing the launcher's
process group (Ctrl-C in a terminal, a scheduler's kill) would leave the workers training
and writing checkpoints. On Linux a worker asks the kernel for SIGKILL when its parent
dies (prctl PR_SET_PDEATHSIG); elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie counts; one of another user does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def die_with_parent() -> bool:
    """Arrange SIGKILL for this process when its parent exits; True if arranged."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True
