"""Workers end with the launcher that started them, also one that died before they could ask."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ringtrain.lifecycle import LAUNCHER_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

WORKER = "from ringtrain.lifecycle import die_with_parent; print(die_with_parent(), flush=True)"


def _worker(launcher: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != LAUNCHER_ENV}
    if launcher is not None:
        env[LAUNCHER_ENV] = launcher
    return subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=60)


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_a_worker_whose_launcher_is_gone_ends_at_once():
    # (it was re-parented while it imported torch: its parent's death is no signal any more)
    done = _worker(str(_dead_pid()))
    assert done.returncode == -9 and done.stdout == ""


@pytest.mark.parametrize("launcher", [None, "", "not a pid", "self"])
def test_a_worker_with_its_launcher_alive_or_unnamed_goes_on(launcher):
    done = _worker(str(os.getpid()) if launcher == "self" else launcher)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_ringtrain_launch_names_itself_to_its_ranks(tmp_path):
    script = tmp_path / "show.py"
    script.write_text(f"import os\nprint('launcher', os.environ['{LAUNCHER_ENV}'], os.getppid(), flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-m", "ringtrain.cli", "launch", "--nproc-per-node", "1", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    line = next(ln for ln in out.splitlines() if "launcher" in ln)
    assert line.split()[1:] == [str(proc.pid), str(proc.pid)]
