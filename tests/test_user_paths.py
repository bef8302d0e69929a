"""A path given with a leading ``~`` is under the home folder, wherever it is given: an option in the
``--opt=~/x`` form (which no shell expands), a positional, a path parameter of the Python API.
Before, each made a folder named ``~`` in the working directory (``rm -rf ~`` then took the home)."""

from __future__ import annotations

import argparse
import importlib

import pytest
import torch
from torch import nn

from ringtrain import checkpoint
from ringtrain.cli import main
from ringtrain.ddp import DistributedDataParallel, draw_timeline
from ringtrain.ddp.timeline import TraceRecorder
from ringtrain.sim.devices import DEVICES
from ringtrain.sim.models_zoo import build_trace
from ringtrain.sim.traces import load, save
from ringtrain.train import TrainConfig
from thread_harness import raise_first, run_comms


@pytest.fixture
def home(tmp_path, monkeypatch):
    """$HOME is tmp_path/home; the working directory tmp_path/work, checked at the end to hold no '~'."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    yield home
    assert not (work / "~").exists(), "a folder named '~' was made in the working directory"


#: (the module whose configure() adds the options, the command line, {dest: the path under $HOME})
PARSED = [
    ("ringtrain.launch", ["--secret-file=~/secret", "~/job/script.py", "--out=~/x"],
     {"secret_file": "secret", "script": "job/script.py"}),
    ("ringtrain.bench.allreduce", ["--out=~/bench", "--horovod-python=~/hvd/bin/python"],
     {"out": "bench", "horovod_python": "hvd/bin/python"}),
    ("ringtrain.bench.train", ["--out=~/bench", "--horovod-python=~/hvd/bin/python"],
     {"out": "bench", "horovod_python": "hvd/bin/python"}),
    ("ringtrain.sim.cli", ["--csv=~/rows.csv", "--plot=~/plots", "--model=~/t.json", "--cluster=~/b.json"],
     {"csv": "rows.csv", "plot": "plots", "model": "t.json", "cluster": ["b.json"]}),
    ("ringtrain.sim.plan_cli", ["--model=~/t.csv"], {"model": "t.csv"}),
]


@pytest.mark.parametrize("module, argv, expected", PARSED, ids=[m for m, _, _ in PARSED])
def test_every_path_option_is_taken_under_home(module, argv, expected, home):
    parser = argparse.ArgumentParser()
    importlib.import_module(module).configure(parser)
    args = parser.parse_args(argv)
    for dest, under in expected.items():
        want = [str(home / p) for p in under] if isinstance(under, list) else str(home / under)
        assert getattr(args, dest) == want, dest
    if module == "ringtrain.launch":
        assert args.script_args == ["--out=~/x"]  # (the script's own arguments are its business)


def test_lists_of_models_and_clusters_expand_each_path_item_alone(home):
    parser = argparse.ArgumentParser()
    importlib.import_module("ringtrain.sim.cli").configure(parser)
    args = parser.parse_args(["--model", "resnet50, ~/t.json,all", "--cluster", "alpha=1e-5,beta=1e-9",
                              "--cluster", "10GbE,~/b.json"])
    assert args.model == f"resnet50,{home / 't.json'},all"
    assert args.cluster == ["alpha=1e-5,beta=1e-9", f"10GbE,{home / 'b.json'}"]


def test_simulate_reads_and_writes_under_home(home, capsys):
    save(build_trace("googlenet", DEVICES["a100"]), home / "mine.csv")
    assert main(["simulate", "--model=~/mine.csv", "--cluster", "25GbE", "--gpus", "8", "--csv=~/out.csv"]) == 0
    assert "googlenet" in capsys.readouterr().out
    header, *rows = (home / "out.csv").read_text().splitlines()
    assert header.startswith("model,") and rows


def test_train_checks_its_folders_under_home_and_names_them(home, capsys):
    """--checkpoint-dir=~/ckpt is made under $HOME; --timeline=~/… is refused naming the expanded path."""
    (home / "file").write_text("")
    rc = main(["train", "--checkpoint-dir=~/ckpt", "--timeline=~/file/t.json"])
    assert rc == 2
    message = capsys.readouterr().err
    assert f"--timeline {home / 'file' / 't.json'}: its directory" in message, message
    assert (home / "ckpt").is_dir()


def test_train_config_expands_its_paths(home):
    cfg = TrainConfig(checkpoint_dir="~/ckpt", timeline="~/trace.json")
    assert (cfg.checkpoint_dir, cfg.timeline) == (str(home / "ckpt"), str(home / "trace.json"))
    assert TrainConfig(checkpoint_dir="runs/x").checkpoint_dir == "runs/x"


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:timeline. no iteration was traced")  # (no step run: the folder is the point)
def test_ddp_timeline_is_under_home(home):
    def body(comm):
        ddp = DistributedDataParallel(nn.Linear(4, 2), comm, timeline="~/traces/t.json")
        path = ddp.timeline_path
        ddp.close()
        return path

    path, = raise_first(run_comms(1, body))
    assert path == home / "traces" / "t.rank0.json"
    assert (home / "traces").is_dir()


def test_checkpoint_helpers_take_home(home):
    written = checkpoint.save("~/ckpts", 3, {"w": torch.arange(4)})
    assert written.parent == home / "ckpts"
    assert [step for step, _ in checkpoint.list_checkpoints("~/ckpts")] == [3]
    assert checkpoint.latest("~/ckpts").step == 3
    assert checkpoint.load(f"~/ckpts/{written.name}").step == 3
    moved, steps = checkpoint.supersede("~/ckpts")
    assert moved.parent == home / "ckpts" and steps == [3]


def test_sim_traces_take_home(home):
    trace = build_trace("googlenet", DEVICES["a100"])
    save(trace, "~/t.json")
    assert load("~/t.json") == load(home / "t.json") == trace


@pytest.mark.timeout(60)
def test_draw_timeline_takes_home(home):
    recorder = TraceRecorder(home / "t.json", 0, 1, origin=0.0)
    recorder.span("forward", "forward", "compute", 0.0, 0.5, iteration=0)
    recorder.end_iteration()
    assert draw_timeline("~/t.rank0.json", "~/t.png") == home / "t.png"
    assert (home / "t.png").stat().st_size > 0
