"""The bench commands' front end, without starting ranks (``_launch`` stands in for them):
what --json prints, what is refused before anything runs, what is said about what is left out."""

from __future__ import annotations

import json

import pytest

from ringtrain import cli
from ringtrain.bench import allreduce as bench_allreduce
from ringtrain.bench import train as bench_train

ALLREDUCE = ["bench", "allreduce", "--world-sizes", "2", "--sizes", "4K", "--algorithms", "ring",
             "--transports", "tcp", "--repeats", "1", "--no-mpi"]
TRAIN = ["bench", "train", "--models", "mlp", "--schedules", "single", "--world-size", "2", "--steps", "1",
         "--rounds", "1", "--no-torch-ddp"]
ALONE_ROW = {"model": "mlp", "impl": "alone", "schedule": "no communication", "batch_size": 4,
             "median_iter_s": 0.1, "samples_per_s": 80.0, "world_size": 2, "net": "none"}


@pytest.fixture
def no_ranks(monkeypatch):
    """Both benchmarks' launches answer at once; each call's world size is recorded."""
    calls = []

    def allreduce_launch(p, cfg, args):
        calls.append(p)
        return [{"impl": "gloo", "transport": "gloo", "algorithm": "torch.distributed", "world_size": p,
                 "nbytes": cfg["sizes"][0], "median_s": 1e-4, "busbw_GBps": 0.04, "net": args.net}]

    def train_launch(module, module_args, nprocs, args):
        calls.append(nprocs)
        return [{"rows": [dict(ALONE_ROW)]}]

    monkeypatch.setattr(bench_allreduce, "_launch", allreduce_launch)
    monkeypatch.setattr(bench_train, "_launch", train_launch)
    return calls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [ALLREDUCE, TRAIN], ids=["allreduce", "train"])
def test_json_on_stdout_is_the_saved_document(argv, no_ranks, tmp_path, capsys):
    # stdout lacked benchmark, when, command, commit and machine (only the file had them), so with
    # --out '' the machine was recorded nowhere.
    assert cli.main(argv + ["--out", "", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    for key in ("benchmark", "when", "command", "commit", "machine"):
        assert key in printed, key
    assert printed["machine"]["cores"] >= 1 and printed["rows"]
    assert cli.main(argv + ["--out", str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(open(printed.pop("saved_to")).read())
    printed.pop("charts", None)
    assert printed == saved
