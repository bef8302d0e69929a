"""A rank's uncaught exception, written to the error file torch's launcher reads.

torchrun (and so ``ringtrain launch``) hands each rank a file for its exception
(TORCHELASTIC_ERROR_FILE), but a rank writes it only through torch's ``@record`` decorator on its
main, which user scripts rarely have. Without it a failed rank was only "rank 1 failed (exit code
1)", and its exception was somewhere in the ranks' interleaved tracebacks above. ``ringtrain.init()``
calls :func:`record_uncaught`: an uncaught exception of the main thread is then written there in
@record's format (``launch.describe_failure`` prints its type, text and the frame that raised it)
and then printed as before. Only an ``Exception``, as @record: Ctrl-C and ``sys.exit`` are not a
rank's error.

The file also holds the time to the microsecond (``ringtrain_time``): torch's own timestamp is in
whole seconds, so a rank's ValueError and the PeerLost its peers raise a moment later fell in one
second and the lower rank was named first (``launch._failure_order`` reads it).

``ringtrain launch`` starts the script through this file (``python .../errorfile.py SCRIPT ARGS``,
:func:`run_script`): the recorder is installed before the script's first line, so an exception
raised before ``ringtrain.init()`` (a missing file, a bad value) is named too; argparse's refusal
of an argument is a SystemExit(2), not an exception: the launcher says "exit code 2" and the
script's own usage line says why. The file imports the standard library only, so the script starts
no later than it did.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib.machinery
import json
import os
import sys
import time
import traceback
from typing import Any, Callable

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Where torchrun tells each rank to write its exception (set by torchrun for every worker)."""


def record_uncaught() -> bool:
    """Write the main thread's uncaught exception to this rank's error file before it is printed;
    True where the launcher gave one (under torchrun), False elsewhere (nothing changes then).
    Calling it again (a second ``init()``) installs nothing more."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    previous = sys.excepthook
    if getattr(previous, "_ringtrain_error_file", None) == path:
        return True

    def hook(kind, value, tb):
        if isinstance(value, Exception):
            _write_quietly(path, value, tb)
        previous(kind, value, tb)

    hook._ringtrain_error_file = path  # type: ignore[attr-defined]
    sys.excepthook = hook
    return True


def write(path: str, error: BaseException, tb=None) -> None:
    """``error`` in the file at ``path``, as torch's ErrorHandler.record_exception writes it, but
    whole or not at all (a temporary file, then a rename): torchrun stops the other ranks once one
    failed, and a rank stopped while torch's own write was under way left an empty file, whose
    parse then failed in the launcher ("torchrun failed: JSONDecodeError" in place of the ranks'
    errors; seen once under Python 3.13)."""
    now = time.time()
    data = {"message": {"message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": "".join(traceback.format_exception(type(error), error, tb)),
                                      "timestamp": str(int(now)), "ringtrain_time": repr(now)}}}
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_quietly(path: str, error: Exception, tb) -> None:
    """:func:`write`, whose own failure (a full disk, a removed directory) is not the rank's error:
    the exception itself still goes up and is printed."""
    try:
        write(path, error, tb)
    except Exception:  # noqa: BLE001
        pass


def recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose exception is written to this rank's error file (under torchrun) and raised
    again: torch's ``@record``, with :func:`write`'s whole-or-nothing file."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            faulthandler.enable(all_threads=True)  # (as @record: a crash's stacks on stderr)
        except Exception:  # noqa: BLE001 - (no usable stderr): not worth failing the rank for
            pass
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if path := os.environ.get(ERROR_FILE_ENV):
                _write_quietly(path, exc, exc.__traceback__)
            raise

    return call


def recorded_time(message) -> float | None:
    """The time (seconds since the epoch, to the microsecond) a rank recorded its error file,
    from a torchrun failure's ``message``; None where it was written otherwise (by @record)."""
    if not isinstance(message, dict):
        return None
    try:
        return float(message["extraInfo"]["ringtrain_time"])
    except (KeyError, TypeError, ValueError):
        return None


def run_script(argv: list[str]) -> None:
    """Run ``argv[0]`` (a script's path) with arguments ``argv[1:]`` as ``python SCRIPT ARGS`` does,
    but with :func:`record_uncaught` installed first: as a module ``__main__`` that stays in
    ``sys.modules`` (what the script's atexit handlers and threads pickle is found there), whose
    ``__file__`` is the absolute path, with that ``sys.argv`` and the folder of the script's real
    path (symlinks resolved) first on ``sys.path``. Its uncaught exception is printed without this
    file's frame, as Python would print it, and the exit status is 1, as Python's."""
    path = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(path))  # (this file's folder, ringtrain's, otherwise)
    main = type(sys)("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    record_uncaught()
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec")  # (a SyntaxError is printed as Python prints it)
        exec(code, main.__dict__)
    except Exception as exc:  # (SystemExit, KeyboardInterrupt: as Python handles them)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code is run_script.__code__:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # (Python prints the exception's own)
        sys.exit(1)


if __name__ == "__main__":
    run_script(sys.argv[1:])
