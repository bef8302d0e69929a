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


def help_text(words, capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main(["bench", words, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


@pytest.mark.timeout(60)
@pytest.mark.parametrize("words, shown", [
    ("allreduce", ["default ring,naive,central,halving_doubling,auto", "default shm,tcp", "default 7", "default 900",
                   "default benchmarks", "default 2,4", "5 with --quick", "suffixes K, M, G, T"]),
    ("train", ["default charlm,resnet,mlp", "default optimal,mgwfbp,wfbp,fixed,single", "default 8", "default 3",
               "default 1800", "default benchmarks", "default ring", "defaults to 1, and to 2 for ps-sharded"]),
])
def test_help_shows_the_defaults(words, shown, capsys):
    text = help_text(words, capsys)
    missing = [s for s in shown if s not in text]
    assert not missing, (missing, text)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, repeats", [([], 7), (["--quick"], 5), (["--quick", "--repeats", "7"], 7),
                                            (["--repeats", "5"], 5)])
def test_quick_takes_an_explicit_repeats_as_given(extra, repeats, monkeypatch):
    # --quick --repeats 7 ran 5 repeats: 7 was taken as "not given".
    seen = []
    monkeypatch.setattr(bench_allreduce, "_launch", lambda p, cfg, args: seen.append(cfg) or [])
    argv = ["bench", "allreduce", "--world-sizes", "2", "--sizes", "4K", "--no-mpi", "--out", "", "--json"]
    assert cli.main(argv + extra) == 0
    assert seen[0]["repeats"] == repeats
    if "--quick" in extra:
        assert seen[0]["algorithms"] == ["ring", "auto"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (TRAIN[:3] + ["mlp,mlp"] + TRAIN[4:], "--models: mlp given twice"),
    (TRAIN[:3] + ["charlm,charlm-transformer"] + TRAIN[4:], "--models: charlm-transformer given twice"),
    (TRAIN + ["--schedules", "single,single"], "--schedules: single given twice"),
    (TRAIN + ["--strategies", "ps-sync,ps-sync:1"], "--strategies: 'ps-sync:1' given twice"),
    (ALLREDUCE + ["--algorithms", "ring,ring"], "--algorithms: ring given twice"),
    (ALLREDUCE + ["--transports", "tcp,tcp"], "--transports: tcp given twice"),
    (ALLREDUCE + ["--world-sizes", "2,2"], "--world-sizes: 2 given twice"),
    (ALLREDUCE + ["--sizes", "4K,4096"], "--sizes: 4096 given twice"),
])
def test_a_configuration_given_twice_is_refused(argv, message, no_ranks):
    with pytest.raises(SystemExit) as info:
        cli.main(argv + ["--out", ""])
    assert str(info.value.code).startswith(f"ringtrain bench {argv[1]}: {message}"), info.value.code
    assert no_ranks == []
