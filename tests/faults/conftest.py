"""Fault-injection tests: every fault is counted, and the session ends with one summary line

    faults: N injected, N survived (...), 0 hung, 0 processes left behind

which docs/hardening.md quotes. A fault is *survived* when every survivor raised a CommError
within timeout + 2 s and no process of the job was left behind (see harness.py).
"""

from __future__ import annotations

import pytest

_LOG: list[dict] = []


@pytest.fixture
def fault_log():
    """``fault_log(name, survived, hung=False, left=0, detail="")`` records one injected fault."""

    def record(name: str, survived: bool, hung: bool = False, left: int = 0, detail: str = "") -> None:
        _LOG.append({"name": name, "survived": survived, "hung": hung, "left": left, "detail": detail})

    return record


def pytest_terminal_summary(terminalreporter):
    if not _LOG:
        return
    n = len(_LOG)
    ok = sum(e["survived"] for e in _LOG)
    hung = sum(e["hung"] for e in _LOG)
    left = sum(e["left"] for e in _LOG)
    terminalreporter.write_line(
        f"faults: {n} injected, {ok} survived (every survivor raised PeerLost/CommTimeout within timeout + 2 s), "
        f"{hung} hung, {left} processes left behind"
    )
    for e in _LOG:
        if not e["survived"]:
            terminalreporter.write_line(f"  not survived: {e['name']}: {e['detail']}")
