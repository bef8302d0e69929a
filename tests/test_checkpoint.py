"""Checkpoints: exact round trip, corruption skipped, retention, RNG, exact resume, kill -9 mid-write."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from thread_harness import run_comms

import ringtrain
from ringtrain import checkpoint, data, models
from ringtrain.checkpoint import CheckpointError

pytestmark = pytest.mark.timeout(30)

SMALL_LM = dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_same(a, b, where="payload"):
    """Exact structural equality: same types, same keys, bitwise-equal tensors."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def trainer(seed=0):
    """A small LM, Adam and a sharded text loader: the objects a training state holds."""
    model = models.build("charlm", seed=seed, **SMALL_LM)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = data.ShardedLoader(data.dataset("text", seq_len=12, max_bytes=30_000), batch_size=4,
                                rank=1, world_size=2, seed=3)
    return model, opt, loader


def train(model, opt, loader, steps):
    for _ in range(steps):
        x, y = loader.next_batch()
        # Random numbers consumed every step, as dropout or augmentation would: resume must restore them.
        noise = torch.rand(()).item() + np.random.rand() + random.random()
        loss = model.loss(model(x), y) * (1.0 + 1e-3 * noise)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_round_trip_is_exact(tmp_path):
    model, opt, loader = trainer()
    train(model, opt, loader, 2)
    payload = checkpoint.training_state(2, model, opt, loader, note="hello", lr=1e-2)
    path = checkpoint.save(tmp_path, 2, payload)
    assert path.name == "ckpt-000000002.pt"
    got = checkpoint.load(path)
    assert got.step == 2 and got.path == path
    assert_same(payload, got.payload)
    # A plain torch.load (no ringtrain, no code execution) opens it too.
    raw = torch.load(path, weights_only=True)
    assert raw["step"] == 2 and raw["digest"] == checkpoint.digest(payload)


def test_rng_restore_repeats_the_same_random_numbers(tmp_path):
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    torch.randn(3), np.random.randn(1), random.gauss(0, 1)  # leave a cached gaussian around
    checkpoint.save(tmp_path, 0, {"rng": checkpoint.capture_rng()})

    def draw():
        return (torch.rand(5).tolist(), torch.randn(2).tolist(), np.random.rand(5).tolist(),
                np.random.randn(3).tolist(), [random.random() for _ in range(5)], random.gauss(0, 1))

    first = draw()
    checkpoint.restore_rng(checkpoint.latest(tmp_path).payload["rng"])
    assert draw() == first
    assert draw() != first


def test_resume_from_checkpoint_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    model, opt, loader = trainer()
    train(model, opt, loader, 3)
    checkpoint.save(tmp_path, 3, checkpoint.training_state(3, model, opt, loader))
    train(model, opt, loader, 4)
    uninterrupted = model.state_dict()

    torch.manual_seed(99), np.random.seed(99), random.seed(99)  # a fresh process would differ
    model2, opt2, loader2 = trainer(seed=42)
    step = checkpoint.restore_training_state(checkpoint.latest(tmp_path).payload, model2, opt2, loader2)
    assert step == 3
    train(model2, opt2, loader2, 4)
    assert_same(uninterrupted, model2.state_dict(), "model")


def test_restoring_into_an_optimizer_or_loader_the_checkpoint_lacks_is_refused(tmp_path):
    """A checkpoint saved without optimizer state or data position cannot resume a run that has
    them: restoring must say so, not leave a fresh optimizer (Adam's moments at 0) or a loader at
    the first batch to train on silently."""
    model = torch.nn.Linear(3, 2)
    checkpoint.save(tmp_path, 5, checkpoint.training_state(5, model))
    payload = checkpoint.latest(tmp_path).payload
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="no optimizer state"):
        checkpoint.restore_training_state(payload, model, opt)
    with pytest.raises(ValueError, match="no data position"):
        checkpoint.restore_training_state(payload, model, loader=data.ShardedSampler(10, 2))
    assert checkpoint.restore_training_state(payload, model) == 5


def test_keep_only_the_newest(tmp_path):
    for step in (1, 3, 5, 7, 10):
        checkpoint.save(tmp_path, step, {"x": torch.tensor([step])}, keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [7, 10]
    assert checkpoint.latest(tmp_path).payload["x"].item() == 10
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_steps_past_nine_digits_sort_by_number_not_by_name(tmp_path):
    """ckpt-1000000000.pt sorts before ckpt-999999999.pt by name: sorted so, latest() would resume
    from the older step and keep=1 would delete the file just written."""
    checkpoint.save(tmp_path, 999_999_999, {"x": torch.tensor([1])}, keep=1)
    checkpoint.save(tmp_path, 1_000_000_000, {"x": torch.tensor([2])}, keep=1)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [1_000_000_000]
    found = checkpoint.latest(tmp_path)
    assert found.step == 1_000_000_000 and found.payload["x"].item() == 2


def test_a_save_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    """Without the file's fsync a crash can leave the new name on an empty or partial file; without
    the directory's, the rename itself may be lost. Neither shows in a test that does not crash the
    machine, so the order of the calls is checked."""
    import stat

    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        calls.append(f"replace -> {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    checkpoint.save(tmp_path, 3, {"x": torch.tensor([3])})
    assert calls == ["fsync file", "replace -> ckpt-000000003.pt", "fsync dir"]


def test_the_digest_covers_shapes_dtypes_and_containers_not_only_bytes():
    """The same bytes under another shape, dtype or container are another payload."""
    t = torch.arange(6, dtype=torch.int32)
    digests = {checkpoint.digest(p) for p in (
        {"w": t}, {"w": t.reshape(2, 3)}, {"w": t.reshape(3, 2)}, {"w": t.view(torch.float32)},
        {"w": [1, 2]}, {"w": (1, 2)}, {"w": 1}, {"w": 1.0}, {"w": True}, {"v": t},
    )}
    assert len(digests) == 10


def corrupt(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(raw[:len(raw) // 2]))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbage":
        path.write_bytes(os.urandom(len(raw)))
    elif how == "bitflip":  # inside the tensor data: torch.load alone would not notice
        i = raw.find(np.arange(1000, dtype=np.float32)[500:502].tobytes())
        assert i > 0
        raw[i + 1] ^= 0x10
        path.write_bytes(bytes(raw))
    elif how == "foreign":
        torch.save({"model": torch.zeros(3)}, path)


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "bitflip", "foreign"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, how):
    for step in (1, 2):
        checkpoint.save(tmp_path, step, {"w": torch.arange(1000, dtype=torch.float32) + step})
    newest = tmp_path / checkpoint.checkpoint_name(2)
    if how == "bitflip":
        checkpoint.save(tmp_path, 2, {"w": torch.arange(1000, dtype=torch.float32)})
    corrupt(newest, how)
    with pytest.raises(CheckpointError):
        checkpoint.load(newest)
    with pytest.warns(RuntimeWarning, match="skipping checkpoint of step 2"):
        got = checkpoint.latest(tmp_path)
    assert got.step == 1 and torch.equal(got.payload["w"], torch.arange(1000, dtype=torch.float32) + 1)


def test_a_file_under_another_steps_name_is_skipped(tmp_path):
    """Step 4's file copied (or renamed) to step 8's name: taken as the newest, it would set the run
    back to step 4 at every restart until step 8 was saved again; the step beside the payload is
    not in the digest either, so a flipped bit there looks the same."""
    for step in (4, 6):
        checkpoint.save(tmp_path, step, {"s": torch.tensor(step)})
    shutil.copy(tmp_path / checkpoint.checkpoint_name(4), tmp_path / checkpoint.checkpoint_name(8))
    with pytest.raises(CheckpointError, match="holds step 4, not the step 8 its name says"):
        checkpoint.load(tmp_path / checkpoint.checkpoint_name(8))
    with pytest.warns(RuntimeWarning, match="skipping checkpoint of step 8"):
        assert checkpoint.latest(tmp_path).step == 6
    # Under a name of its own (not a checkpoint name) the file loads as what it holds.
    shutil.copy(tmp_path / checkpoint.checkpoint_name(4), tmp_path / "best.pt")
    assert checkpoint.load(tmp_path / "best.pt").step == 4


def test_a_skipped_checkpoint_is_said_once_in_a_script_without_logging_set_up(tmp_path):
    """latest() warns and logs; with logging not configured, its last-resort handler printed the
    log record too: every damaged file was named twice, on every rank."""
    checkpoint.save(tmp_path, 1, {"w": torch.ones(3)})
    (tmp_path / checkpoint.checkpoint_name(2)).write_bytes(b"torn")
    env = dict(os.environ, PYTHONPATH=str(Path(checkpoint.__file__).parents[1]))
    script = f"from ringtrain import checkpoint; print(checkpoint.latest({str(tmp_path)!r}).step)"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.strip() == "1", proc.stderr
    said = [line for line in proc.stderr.splitlines() if "skipping checkpoint of step 2" in line]
    assert len(said) == 1, proc.stderr


def test_an_unreadable_file_is_named_in_one_short_line_without_torchs_advice(tmp_path):
    """torch's own text for a file its safe unpickler refuses is pages long and recommends
    weights_only=False, which would run code from the file: only its type is kept."""
    path = tmp_path / checkpoint.checkpoint_name(99)
    path.write_text("garbage\n")
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    assert str(info.value) == (f"{path}: not a readable checkpoint: truncated, or not written by ringtrain "
                               "(UnpicklingError)")


def test_no_valid_checkpoint_gives_none(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    assert checkpoint.latest(tmp_path / "missing") is None
    (tmp_path / checkpoint.checkpoint_name(4)).write_bytes(b"not a checkpoint")
    (tmp_path / "ckpt-notes.pt").write_bytes(b"ignored: not a checkpoint name")
    with pytest.warns(RuntimeWarning):
        assert checkpoint.latest(tmp_path) is None


@pytest.mark.parametrize("version", [None, 2, True, 1.0])  # (True == 1 == 1.0 in Python: not our int 1)
def test_a_record_of_another_format_is_not_a_checkpoint(tmp_path, version):
    """A whole record with a valid digest but no format key, or another format's number (a
    later ringtrain's file, whose fields may mean something else), is refused, not read as ours."""
    payload = {"w": torch.arange(3.0)}
    record = {"step": 4, "digest": checkpoint.digest(payload), "payload": payload}
    if version is not None:
        record[checkpoint.FORMAT_KEY] = version
    path = tmp_path / checkpoint.checkpoint_name(4)
    torch.save(record, path)
    with pytest.raises(CheckpointError, match="not a ringtrain checkpoint of format 1"):
        checkpoint.load(path)
    record[checkpoint.FORMAT_KEY] = checkpoint.FORMAT_VERSION
    torch.save(record, path)
    assert checkpoint.load(path).step == 4


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        checkpoint.save(tmp_path, -1, {})
    with pytest.raises(ValueError, match="keep must be a positive integer"):
        checkpoint.save(tmp_path, 1, {}, keep=0)
    with pytest.raises(ValueError, match="payload must be a dict"):
        checkpoint.save(tmp_path, 1, [1])
    with pytest.raises(TypeError, match="got ndarray"):
        checkpoint.save(tmp_path, 1, {"a": np.zeros(2)})
    assert checkpoint.list_checkpoints(tmp_path) == []
    assert not list(tmp_path.iterdir())


# --- kill -9 in the middle of a write, in a real child process ------------------------------

_WRITER = textwrap.dedent("""
    import sys, torch
    from ringtrain import checkpoint
    directory, megabytes = sys.argv[1], int(sys.argv[2])
    checkpoint.save(directory, 1, {"w": torch.arange(1000, dtype=torch.float32)})
    print("saved 1", flush=True)
    big = {"w": torch.ones(megabytes * 2**18, dtype=torch.float32)}
    while True:  # keep writing until killed; every completed write is a valid checkpoint
        checkpoint.save(directory, 2, big, keep=5)
""")


def _partial_temporaries(directory: Path) -> list[Path]:
    found = []
    for p in directory.iterdir():
        try:
            if p.name.endswith(".tmp") and p.stat().st_size > 0:
                found.append(p)
        except FileNotFoundError:  # renamed between listing and stat
            pass
    return found


def _kill_writer_mid_write(directory: Path) -> None:
    """Start the writer, wait for its second checkpoint's temporary file to fill, kill -9 it."""
    env = dict(os.environ, PYTHONPATH=str(Path(checkpoint.__file__).parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), "64"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saved 1", proc.stderr.read()
        deadline = time.monotonic() + 20
        while not _partial_temporaries(directory):
            assert time.monotonic() < deadline, "the writer never started its second checkpoint"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_kill_9_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path):
    for attempt in range(3):
        directory = tmp_path / f"attempt{attempt}"
        directory.mkdir()
        _kill_writer_mid_write(directory)
        if [p for p in directory.iterdir() if p.name.endswith(".tmp")]:
            break  # the kill landed before the rename: a half-written file is left behind
    else:
        pytest.fail("three kills in a row landed between two writes; could not test a kill mid-write")
    got = checkpoint.latest(directory)
    # The killed write never produced a file under a checkpoint name. An earlier loop iteration
    # may have completed step 2; then that one is whole. Either way, the result is valid.
    assert got is not None
    if got.step == 1:
        assert torch.equal(got.payload["w"], torch.arange(1000, dtype=torch.float32))
    else:
        assert got.step == 2 and bool((got.payload["w"] == 1).all())
    # The next save on this host removes the dead writer's temporary file.
    checkpoint.save(directory, 3, {"w": torch.zeros(1)})
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_a_save_removes_only_the_temporaries_of_dead_writers_on_this_host(tmp_path):
    """A temporary file is a write in progress while its writer lives (another process saving
    into the same directory, or this one's background writer), and another host's pid says
    nothing here: a save removes neither, only those of this host's dead writers."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = checkpoint._host()
    names = {
        "dead here": f".ckpt-000000002.pt.{host}.{dead.pid}.abc.tmp",
        "alive here": f".ckpt-000000002.pt.{host}.{os.getpid()}.abc.tmp",
        "elsewhere": f".ckpt-000000002.pt.other-{host}.{dead.pid}.abc.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    checkpoint.save(tmp_path, 3, {"w": torch.zeros(1)})
    left = {p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")}
    assert left == {names["alive here"], names["elsewhere"]}


def test_saving_an_earlier_step_never_deletes_what_it_wrote(tmp_path):
    """A run resumed from step 5 (because 7 and 10 are damaged) keeps its new checkpoints."""
    for step in (5, 7, 10):
        checkpoint.save(tmp_path, step, {"s": torch.tensor(step)}, keep=3)
    for step in (7, 10):
        corrupt(tmp_path / checkpoint.checkpoint_name(step), "truncated")
    with pytest.warns(RuntimeWarning, match=r"later steps \[7, 10\]") as caught:
        checkpoint.save(tmp_path, 6, {"s": torch.tensor(6)}, keep=2)
    assert [w.filename for w in caught] == [__file__]  # the caller's line
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [5, 6, 7, 10]
    with pytest.warns(RuntimeWarning, match="skipping"):
        assert checkpoint.latest(tmp_path).step == 6
    # A caller that has named the damaged files already (ringtrain train's parent) asks for no warnings.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.save(tmp_path, 8, {"s": torch.tensor(8)}, keep=3, warn_later=False)
        assert checkpoint.latest(tmp_path, warn=False).step == 8


def test_supersede_moves_every_checkpoint_and_the_named_entries_aside(tmp_path):
    """A fresh run in an old directory: nothing is overwritten, and latest() no longer finds the old run."""
    for step in (20, 40):
        checkpoint.save(tmp_path, step, {"s": torch.tensor(step)})
    checkpoint.save(tmp_path / "servers" / "server-0", 40, {"s": torch.tensor(40)})
    (tmp_path / "notes.txt").write_text("kept")
    target, steps = checkpoint.supersede(tmp_path, also=("servers", "absent"))
    assert steps == [20, 40] and target.parent == tmp_path and target.name.startswith("superseded-")
    assert checkpoint.latest(tmp_path) is None and checkpoint.latest(target).step == 40
    assert checkpoint.latest(target / "servers" / "server-0").step == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["notes.txt", target.name])
    checkpoint.save(tmp_path, 20, {"s": torch.tensor(-1)})
    assert checkpoint.load(target / checkpoint.checkpoint_name(20)).payload["s"] == 20


def test_supersede_twice_in_one_second_makes_two_subdirectories(tmp_path):
    checkpoint.save(tmp_path, 1, {"s": torch.tensor(1)})
    first, _ = checkpoint.supersede(tmp_path)
    checkpoint.save(tmp_path, 1, {"s": torch.tensor(2)})
    second, _ = checkpoint.supersede(tmp_path)
    assert first != second and checkpoint.latest(first).payload["s"] == 1 and checkpoint.latest(second).payload["s"] == 2
    assert checkpoint.supersede(tmp_path) is None  # nothing left to move
    assert checkpoint.supersede(tmp_path / "absent") is None


# --- exact resume across real processes ------------------------------------------------------

_TRAINER = textwrap.dedent("""
    import random, sys
    import numpy as np, torch
    from ringtrain import checkpoint, data, models
    directory, total = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    model = models.build("charlm", seed=0, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = data.ShardedLoader(data.dataset("text", seq_len=12, max_bytes=30_000), batch_size=4, seed=3)
    step = 0
    found = checkpoint.latest(directory)
    if found is not None:
        step = checkpoint.restore_training_state(found.payload, model, opt, loader)
    print("start", step, flush=True)
    while step < total:
        x, y = loader.next_batch()
        noise = torch.rand(()).item() + np.random.rand() + random.random()
        loss = model.loss(model(x), y) * (1.0 + 1e-3 * noise)
        opt.zero_grad(); loss.backward(); opt.step()
        step += 1
        checkpoint.save(directory, step, checkpoint.training_state(step, model, opt, loader), keep=2)
        print("step", step, flush=True)
    print("final", checkpoint.digest(model.state_dict()), flush=True)
""")


def _run_trainer(directory: Path, total: int, kill_after: int | None = None) -> list[str]:
    """Run the trainer script; with ``kill_after``, kill -9 it once it reports that step."""
    env = dict(os.environ, PYTHONPATH=str(Path(checkpoint.__file__).parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, str(directory), str(total)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if kill_after is not None and line.strip() == f"step {kill_after}":
                os.kill(proc.pid, signal.SIGKILL)  # lands somewhere in the next step or its save
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    if kill_after is None:
        assert proc.returncode == 0, err
    return lines


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_process_killed_and_restarted_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    total = 12
    straight = _run_trainer(tmp_path / "straight", total)
    assert straight[0] == "start 0" and straight[-1].startswith("final ")
    resumed_dir = tmp_path / "resumed"
    _run_trainer(resumed_dir, total, kill_after=5)
    lines = _run_trainer(resumed_dir, total)
    restarted_at = int(lines[0].split()[1])
    assert 5 <= restarted_at < total, lines[0]
    assert lines[-1] == straight[-1]


class _FillsUp:
    """A file that takes ``room`` bytes, then fails every write as a full disk does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(28, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_full_disk_is_a_checkpoint_write_error_and_the_older_checkpoint_stays(tmp_path, monkeypatch):
    """torch's writer reports a full disk as a RuntimeError about its zip container; save() says
    what the OSError behind it says, leaves no temporary file and keeps the checkpoint before."""
    payload = {"w": torch.arange(100_000, dtype=torch.float32)}
    checkpoint.save(tmp_path, 1, payload)
    real_fdopen = os.fdopen
    monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, mode: _FillsUp(real_fdopen(fd, mode), 50_000))
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.save(tmp_path, 2, payload)
    monkeypatch.undo()
    error = info.value
    assert isinstance(error, OSError) and error.errno == 28
    assert str(error) == (f"could not write the checkpoint {tmp_path / 'ckpt-000000002.pt'}: No space left on "
                          "device (errno 28); the checkpoints saved before it are untouched")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001.pt"]  # no temporary file
    found = checkpoint.latest(tmp_path)
    assert found.step == 1 and torch.equal(found.payload["w"], payload["w"])


def test_a_read_only_file_system_is_a_checkpoint_write_error(tmp_path, monkeypatch):
    """The temporary file cannot be made (a file system remounted read-only during training): that
    was a bare OSError, a traceback from every training script that catches CheckpointWriteError."""
    checkpoint.save(tmp_path, 1, {"w": torch.ones(3)})

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system", str(tmp_path / ".ckpt-000000002.pt.tmp"))

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", read_only)
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.save(tmp_path, 2, {"w": torch.ones(3)})
    monkeypatch.undo()
    assert info.value.errno == 30 and str(info.value) == (
        f"could not write the checkpoint {tmp_path / 'ckpt-000000002.pt'}: Read-only file system (errno 30); "
        "the checkpoints saved before it are untouched")
    assert checkpoint.latest(tmp_path).step == 1


def test_a_directory_that_is_a_file_is_a_checkpoint_write_error_naming_it(tmp_path):
    (tmp_path / "runs").write_text("not a directory")
    with pytest.raises(checkpoint.CheckpointWriteError, match=f"{tmp_path / 'runs'} is not a directory"):
        checkpoint.save(tmp_path / "runs", 1, {"w": torch.ones(3)})
    assert (tmp_path / "runs").read_text() == "not a directory"


class _Interrupted(_FillsUp):
    """A file whose write is interrupted by Ctrl-C once ``room`` bytes are in."""

    def write(self, data) -> int:
        if len(data) > self.room:
            raise KeyboardInterrupt
        return super().write(data)


def test_ctrl_c_during_a_save_is_a_keyboard_interrupt(tmp_path, monkeypatch):
    """torch's writer turns the KeyboardInterrupt into 'RuntimeError: [enforce fail at
    inline_container.cc:672] . unexpected pos 896 vs 790': a script stopped with Ctrl-C
    while saving ended with that instead of KeyboardInterrupt."""
    payload = {"w": torch.arange(100_000, dtype=torch.float32)}
    checkpoint.save(tmp_path, 1, payload)
    real_fdopen = os.fdopen
    monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, mode: _Interrupted(real_fdopen(fd, mode), 50_000))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, payload)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001.pt"]
    assert torch.equal(checkpoint.latest(tmp_path).payload["w"], payload["w"])


def test_other_failures_of_a_save_are_raised_as_they_are(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("not a disk problem")

    monkeypatch.setattr(checkpoint.torch, "save", broken)
    with pytest.raises(ValueError, match="not a disk problem"):
        checkpoint.save(tmp_path, 1, {"w": torch.zeros(3)})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_checkpoint_has_the_mode_the_umask_gives_a_new_file(tmp_path, umask):
    """As torch.save's own files: 0644 under the usual umask (the temporary file's 0600 was kept,
    so another user, or a job under another uid, could not read the checkpoints)."""
    before = os.umask(umask)
    try:
        path = checkpoint.save(tmp_path, 3, {"w": torch.zeros(2)})
    finally:
        os.umask(before)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def _found_by_every_rank(dirs: list[Path]):
    """``latest(dirs[rank], comm=...)`` on one thread per rank: per rank its step, or the exception."""

    def body(comm):
        try:
            found = checkpoint.latest(dirs[comm.rank], comm=comm)
        except Exception as exc:
            return exc
        return None if found is None else found.step

    return run_comms(len(dirs), body)


def test_ranks_that_find_the_same_checkpoint_resume_from_it(tmp_path):
    shared = tmp_path / "shared"
    checkpoint.save(shared, 20, {"w": torch.arange(3)})
    assert _found_by_every_rank([shared] * 3) == [20, 20, 20]
    assert _found_by_every_rank([tmp_path / "empty"] * 3) == [None, None, None]
    # A file per rank (ranks that draw different random numbers save one each): the same step, other contents
    for rank in range(3):
        checkpoint.save(tmp_path / f"rank{rank}", 20, {"w": torch.arange(3) + rank})
    assert _found_by_every_rank([tmp_path / f"rank{rank}" for rank in range(3)]) == [20, 20, 20]


@pytest.mark.parametrize("other", ["none", "older"])
def test_ranks_that_find_different_checkpoints_all_raise_naming_who_found_what(tmp_path, other):
    # Several nodes, each its own disk: rank 0's node has its checkpoints, the others' nodes not (or
    # an older one). Without comm= the ranks would resume at different steps, silently.
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    checkpoint.save(node0, 20, {"w": torch.arange(3)})
    if other == "older":
        checkpoint.save(node1, 10, {"w": torch.arange(3)})
    results = _found_by_every_rank([node0, node1, node1])
    assert all(isinstance(r, ringtrain.MismatchError) for r in results), results
    said = {"none": "ranks 1, 2: none", "older": "ranks 1, 2: step 10"}[other]
    for text in map(str, results):  # (each names its own directory: the same path on every node in a real job)
        assert "rank 0: step 20" in text and said in text, text
        assert "file system every node shares" in text


def test_a_saved_tensor_can_still_be_resized(tmp_path):
    # Before: the checkpoint's digest hashed each tensor through Tensor.numpy(), which marks its
    # storage non-resizable for good: a saved buffer's resize_ raised "Trying to resize storage
    # that is not resizable".
    buffer = torch.arange(6.0)
    path = checkpoint.save(tmp_path, 1, {"buffer": buffer})
    buffer.resize_(4, 3)
    assert buffer.shape == (4, 3)
    assert checkpoint.load(path).payload["buffer"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_powersgd_state_of_every_rank_is_gathered_saved_and_restored_bitwise_to_its_own_rank(tmp_path, world_size):
    """powersgd_state on threads: each rank's error feedback distinct (value = j*stride + rank*n + i,
    in float32 and float64 buckets: gathered as bytes), its warm-start matrices, PowerSGD's iteration
    and generator. Rank 0's entry, saved and loaded as a checkpoint, gives each rank of a fresh
    state its own tensors back exactly, the generator's next draw the same, and the layout to the
    wrapper; another world size or step is refused with the reason."""
    from types import SimpleNamespace

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from ringtrain import powersgd_state
    from ringtrain.ddp.buckets import BucketSpec

    settings = dict(matrix_approximation_rank=1, start_powerSGD_iter=2)
    layout = [BucketSpec(index=0, pids=(1, 0), offsets=(0, 3), numel=5, dtype=torch.float32, itemsize=4),
              BucketSpec(index=1, pids=(2,), offsets=(0,), numel=4, dtype=torch.float64, itemsize=8)]

    def state_of(rank: int) -> PowerSGDState:
        state = PowerSGDState(process_group=None, **settings)
        state.error_dict = {0: torch.arange(5, dtype=torch.float32) + rank * 5,
                            1: torch.arange(4, dtype=torch.float64) + 100 + rank * 4}
        state.p_memory_dict = {0: torch.full((2,), 7.0)}
        state.q_memory_dict = {0: torch.full((2,), 9.0)}  # (20 + 8 + 8 bytes: bucket 1's float64 at no multiple of 8)
        state.iter = 11
        state.rng.randint(1000, size=rank + 3)  # (its position: alike on every rank in a real job, any here)
        return state

    def body(comm):
        state = state_of(comm.rank)
        every = powersgd_state.gather(comm, state)
        if comm.rank != 0:  # (only rank 0 writes the entry: the others keep none of the states)
            return every
        return powersgd_state.entry(11, state, layout, every, settings), state.rng.randint(1 << 30)

    results = run_comms(world_size, body)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    assert results[1:] == [None] * (world_size - 1)
    entry, next_draw = results[0]
    path = checkpoint.save(tmp_path, 11, {"step": 11, powersgd_state.KEY: entry})
    payload = checkpoint.load(path).payload
    for rank in range(world_size):
        mine, fresh, ddp = state_of(rank), PowerSGDState(process_group=None, **settings), SimpleNamespace()
        said = powersgd_state.restore(payload, 11, rank, world_size, settings, fresh, ddp)
        assert said.startswith("resumed PowerSGD's state of step 11 (iteration 11;"), said
        for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
            want, got = getattr(mine, name), getattr(fresh, name)
            assert want.keys() == got.keys(), (rank, name)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (rank, name, k)
        assert fresh.iter == 11 and fresh.rng.randint(1 << 30) == next_draw
        assert ddp.comm_hook_layout == layout
    fresh = PowerSGDState(process_group=None, **settings)
    said = powersgd_state.restore(payload, 11, 0, world_size + 1, settings, fresh, SimpleNamespace())
    assert f"of {world_size} worker" in said and f"this run has {world_size + 1}" in said and fresh.iter == 0
    assert "not of its step 12" in powersgd_state.restore(payload, 12, 0, world_size, settings, fresh, None)
    assert "holds no PowerSGD state" in powersgd_state.restore({}, 11, 0, world_size, settings, fresh, None)
