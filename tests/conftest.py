"""Shared test setup: faulthandler on, so a hung test shows every thread's stack; Ctrl-C
delivered as a terminal delivers it, however the suite was started."""

from __future__ import annotations

import faulthandler
import signal
import sys

faulthandler.enable(file=sys.stderr)

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # Started in the background by a shell without job control (`make test &`, nohup): SIGINT
    # comes ignored, and every process the tests start would inherit that, so the Ctrl-C tests
    # (a SIGINT to the suite itself or to a child) would see nothing. A handler, unlike the
    # ignored disposition, is not inherited across exec: the children start with the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
