"""The bench commands' front end, without starting ranks (``_launch`` stands in for them):
what --json prints, what is refused before anything runs, what is said about what is left out."""

from __future__ import annotations

import importlib.util
import json
import os
import signal

import pytest

from cli_harness import refusal
from ringtrain import cli
from ringtrain.bench import allreduce as bench_allreduce
from ringtrain.bench import train as bench_train

ALLREDUCE = ["bench", "allreduce", "--world-sizes", "2", "--sizes", "4K", "--algorithms", "ring",
             "--transports", "tcp", "--repeats", "1", "--no-mpi", "--no-horovod"]
TRAIN = ["bench", "train", "--models", "mlp", "--schedules", "single", "--world-size", "2", "--steps", "1",
         "--rounds", "1", "--no-torch-ddp", "--no-horovod"]
ALONE_ROW = {"model": "mlp", "impl": "alone", "schedule": "no communication", "batch_size": 4,
             "median_iter_s": 0.1, "samples_per_s": 80.0, "world_size": 2, "net": "none"}


@pytest.fixture
def no_ranks(monkeypatch):
    """Both benchmarks' launches answer at once; each call's world size is recorded."""
    calls = []

    def allreduce_launch(p, cfg, args, rows):
        calls.append(p)
        rows += [{"impl": "gloo", "transport": "gloo", "algorithm": "torch.distributed", "world_size": p,
                  "nbytes": cfg["sizes"][0], "median_s": 1e-4, "busbw_GBps": 0.04, "net": args.net}]

    def train_launch(module, module_args, nprocs, args, on_result=None):
        calls.append(nprocs)
        docs = [{"rows": [dict(ALONE_ROW)]}]
        for doc in docs if on_result else ():  # as run_ranks: each as it comes, then all
            on_result(doc)
        return docs

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
    monkeypatch.setattr(bench_allreduce, "_launch", lambda p, cfg, args, rows: seen.append(cfg))
    argv = ["bench", "allreduce", "--world-sizes", "2", "--sizes", "4K", "--no-mpi", "--no-horovod", "--out", "",
            "--json"]
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
def test_a_configuration_given_twice_is_refused(argv, message, no_ranks, capsys):
    said = refusal(argv + ["--out", ""], capsys)
    assert said.startswith(f"ringtrain bench {argv[1]}: {message}"), said
    assert no_ranks == []


PS_ONLY = ["bench", "train", "--models", "mlp", "--strategies", "ps-sync", "--world-size", "2", "--steps", "1",
           "--rounds", "1", "--no-horovod"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    # (each was found by a new user's walkthrough: a traceback from the ranks, or ignored without a word)
    (TRAIN + ["--batch-size", "100000"], "--batch-size 100000 x --world-size 2 = 200000 samples per step, but the "
                                         "vectors data set of mlp holds 50000: use --batch-size <= 25000"),
    (TRAIN[:TRAIN.index("--world-size") + 1] + ["60000"] + TRAIN[TRAIN.index("--world-size") + 2:],
     "--batch-size 32 x --world-size 60000 = 1920000 samples per step, but the vectors data set of mlp holds 50000: "
     "not one sample for each of the 60000 ranks: give --world-size <= 50000"),  # (it said "--batch-size <= 0")
    (PS_ONLY + ["--schedules", "single", "--compression", "fp16"], "--schedules, --compression are for the ring's "
                                                                     "job, and --strategies ps-sync runs none"),
    (PS_ONLY + ["--no-torch-ddp"], "--no-torch-ddp is for the ring's job"),
    (ALLREDUCE[:6] + ALLREDUCE[8:] + ["--algorithms", ""], "--algorithms: '' not in"),
])
def test_what_no_job_would_take_is_refused_before_the_ranks_start(argv, message, no_ranks, capsys):
    said = refusal(argv + ["--out", ""], capsys)
    assert said.startswith(f"ringtrain bench {argv[1]}: {message}"), said
    assert no_ranks == []


@pytest.mark.timeout(60)
def test_schedules_given_with_only_ring_schedule_strategies_is_refused(no_ranks, capsys):
    # --strategies ring-optimal --schedules single timed optimal alone, ignoring --schedules.
    said = refusal(TRAIN + ["--strategies", "ring-optimal", "--out", ""], capsys)
    assert said.startswith("ringtrain bench train: --schedules single is for --strategies ring"), said
    assert no_ranks == []


@pytest.fixture
def small_machine(monkeypatch):
    """A machine of 8 GiB and 2 cores, whatever this one is."""
    from ringtrain.bench import machine

    monkeypatch.setattr(machine, "memory_bytes", lambda: 8 << 30)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (ALLREDUCE[:5] + ["", *ALLREDUCE[6:]], "--sizes: give at least one size"),   # ran the whole default sweep
    (ALLREDUCE[:5] + [",", *ALLREDUCE[6:]], "--sizes: give at least one size"),
    (ALLREDUCE[:5] + ["1024G", *ALLREDUCE[6:]], "--sizes: 1T does not fit in this machine's 8.0 GiB of memory "
                                                 "(2 ranks x (4 copies of the message + 300 MiB): 8192.6 GiB)"),
    (ALLREDUCE[:5] + ["1G", *ALLREDUCE[6:]], "--sizes: 1G does not fit in this machine's 8.0 GiB of memory"),
    (ALLREDUCE[:5] + ["1X", *ALLREDUCE[6:]], "--sizes: cannot read '1X' (a number of bytes with suffix K, M, G or T"),
    (ALLREDUCE[:3] + ["2,1000", *ALLREDUCE[4:]], "--world-sizes: 1000 ranks need about 293.0 GiB (300 MiB each), "
                                                 "more than this machine's 8.0 GiB of memory"),
    (TRAIN[:7] + ["500", *TRAIN[8:]], "--world-size: 500 ranks need about 146.5 GiB (300 MiB each), "
                                      "more than this machine's 8.0 GiB of memory"),
    (TRAIN[:7] + ["26", *TRAIN[8:]] + ["--strategies", "ring,ps-sharded:2"], "--world-size: 28 ranks need about"),
])
def test_what_the_machine_cannot_hold_is_refused_before_any_rank_starts(argv, message, small_machine, no_ranks,
                                                                        capsys):
    # --sizes 1024G failed inside rank 0 (numpy); 1000 ranks were started on 2 cores.
    said = refusal(argv + ["--out", ""], capsys)
    assert said.startswith(f"ringtrain bench {argv[1]}: {message}"), said
    assert no_ranks == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (ALLREDUCE[:3] + ["2,251", *ALLREDUCE[4:]], "--world-sizes: under --net 1gbit each rank is a host of its own, "
                                                "at most 250 on the emulated network; a job here needs 251"),
    (TRAIN[:7] + ["249", *TRAIN[8:]] + ["--strategies", "ring,ps-sharded:2"],
     "--world-size: under --net 1gbit each rank is a host of its own, at most 250 on the emulated network; "
     "a job here needs 251"),
])
def test_more_ranks_than_an_emulated_network_has_hosts_are_refused_before_any_rank_starts(
        argv, message, monkeypatch, no_ranks, capsys):
    # Before: a traceback (EmulatedNetwork's ValueError) when the network was made, after the
    # world sizes (jobs) before it had run, on a machine whose memory holds that many ranks.
    from ringtrain.bench import machine

    monkeypatch.setattr(machine, "memory_bytes", lambda: 1 << 40)
    said = refusal(argv + ["--net", "1gbit", "--out", ""], capsys)
    assert said == f"ringtrain bench {argv[1]}: {message}", said
    assert no_ranks == []


@pytest.mark.timeout(60)
def test_sizes_take_a_t_suffix():
    assert bench_allreduce.parse_size("1T") == 1 << 40 and bench_allreduce.parse_size("2TiB") == 2 << 40


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, ranks, warned", [
    (ALLREDUCE[:3] + ["2,9", *ALLREDUCE[4:]], [2, 9], "--world-sizes: 9 ranks on 2 CPU cores (more than 4 per core)"),
    (ALLREDUCE[:3] + ["8", *ALLREDUCE[4:]], [8], None),
    (TRAIN[:7] + ["9", *TRAIN[8:]], [9], "--world-size: 9 ranks on 2 CPU cores (more than 4 per core)"),
    (TRAIN, [2], None),
])
def test_more_ranks_than_four_per_core_get_a_one_line_warning(argv, ranks, warned, small_machine, no_ranks, capsys):
    assert cli.main(argv + ["--out", "", "--json"]) == 0
    assert no_ranks == ranks
    err = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
    if warned is None:
        assert err == []
    else:
        assert len(err) == 1 and err[0].startswith(f"ringtrain bench {argv[1]}: warning: {warned}"), err


def fake_busbw(monkeypatch, busbw_by_size):
    """Ranks that report gloo at the given busbw (GB/s) per size."""
    def launch(p, cfg, args, rows):
        rows += [{"impl": "gloo", "transport": "gloo", "algorithm": "torch.distributed", "world_size": p,
                  "nbytes": n, "median_s": 1e-4, "busbw_GBps": busbw_by_size[n], "net": args.net}
                 for n in cfg["sizes"]]

    monkeypatch.setattr(bench_allreduce, "_launch", launch)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transports, timed, note", [
    ("shm", ["tcp"], "shm not timed: under --net 1gbit each rank is a host of its own and shared memory cannot "
                     "cross them; tcp timed instead"),
    ("shm,torch", ["torch"], "shm not timed: under --net 1gbit"),
])
def test_shm_left_out_under_net_is_said(transports, timed, note, monkeypatch, capsys):
    # --transports shm --net 1gbit timed tcp without a word.
    seen = []
    monkeypatch.setattr(bench_allreduce, "_launch", lambda p, cfg, args, rows: seen.append(cfg))
    argv = ALLREDUCE[:9] + [transports] + ALLREDUCE[10:] + ["--net", "1gbit", "--out", ""]
    assert cli.main(argv + ["--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert seen[0]["transports"] == timed and any(n.startswith(note) for n in notes), notes
    assert cli.main(argv) == 0
    assert f"note: {note}" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_bench_train_says_shm_is_not_timed_under_net(no_ranks, capsys):
    assert cli.main(TRAIN + ["--transport", "shm", "--net", "1gbit", "--out", "", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["notes"] == [
        "Horovod anchor skipped: --no-horovod",
        "--transport shm: under --net 1gbit each rank is a host of its own and shared memory cannot cross them; "
        "tcp timed instead"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra, note", [
    (["--no-mpi"], "Open MPI anchor skipped: --no-mpi"),
    (["--net", "1gbit"], "Open MPI anchor skipped: under --net 1gbit mpirun would not start its ranks on the "
                         "emulated hosts"),
])
def test_the_skipped_mpi_anchor_says_why(extra, note, no_ranks, capsys):
    # the anchor left out under --net or --no-mpi had notes: []
    argv = [a for a in ALLREDUCE if a != "--no-mpi"] + extra + ["--out", "", "--json"]
    assert cli.main(argv) == 0
    assert note in json.loads(capsys.readouterr().out)["notes"]


@pytest.mark.timeout(60)
def test_busbw_above_the_emulated_line_rate_is_marked(monkeypatch, capsys):
    # 10gbit: 1.25 GB/s; 256K at 1.49 GB/s went through within the tbf burst (1.25 MiB) unshaped.
    fake_busbw(monkeypatch, {256 << 10: 1.49, 16 << 20: 1.1})
    argv = ALLREDUCE[:5] + ["256K,16M"] + ALLREDUCE[6:] + ["--net", "10gbit", "--out", ""]
    assert cli.main(argv + ["--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert ("* busbw above the emulated 10gbit line rate (1.25 GB/s) at 256K: messages within the tbf burst "
            "(1.25 MiB) pass unshaped, so these figures are not the link's") in notes, notes
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "(1.49)*" in table and "(1.10)*" not in table and "(1.10)" in table
    fake_busbw(monkeypatch, {256 << 10: 1.49, 16 << 20: 1.1})
    assert cli.main(argv[:-4] + ["--out", "", "--json"]) == 0  # no emulation: no line rate to beat
    assert not any("line rate" in n for n in json.loads(capsys.readouterr().out)["notes"])


@pytest.mark.timeout(60)
def test_allreduce_help_says_small_messages_beat_the_emulated_rate(capsys):
    assert ("the tbf burst (1 ms of line rate: 128 KiB at 1gbit, 1.25 MiB at 10gbit) lets smaller messages through "
            "faster than the line rate") in help_text("allreduce", capsys)


def test_every_train_table_row_has_a_cell_under_every_column():
    # The server rows left out the columns they had no value for: sim and sim err shifted left, and
    # ps-async's bytes began under 'hidden'.
    from ringtrain.bench.train import COLUMNS, format_table

    ring = dict(ALONE_ROW, impl="ringtrain", schedule="single", median_iter_s=0.12, hidden_fraction=None,
                planner_iter_s=0.13, sim_iter_s=0.125, sim_error=0.04, overlap_bound_s=0.1, vs_bound=1.2,
                scaling_efficiency=0.8, params=1000, compute_only_s=0.1)
    ps = {"model": "mlp", "impl": "ps", "schedule": "ps-sync:1", "median_iter_s": 0.4, "samples_per_s": 160.0,
          "world_size": 2, "net": "none", "sim_iter_s": 0.133, "sim_error": -0.66, "round_medians": [0.4],
          "worker_bytes_per_step": {"sent": 84e6, "received": 84e6}}
    rows = [ring, dict(ALONE_ROW), ps, dict(ps, schedule="ps-async:1", sim_iter_s=None, sim_error=None)]
    lines = format_table(rows).splitlines()
    header = lines[2]
    ends = [12]
    for _, width in COLUMNS:
        ends.append(ends[-1] + width)
    assert header.rstrip() == header[:ends[-1]]
    for line in lines[3:]:
        cells = [line[a:b] for a, b in zip(ends, ends[1:])]
        assert all(c.strip() and c[0] == " " and c[-1] != " " for c in cells), (line, cells)
        assert line[ends[-1]:] == "" or line[ends[-1]:].startswith("   "), line
    assert lines[3].split()[5] == "-"  # hidden unknown: '-', not 0%
    assert lines[5].split()[6:9] == ["-", "133.0", "-66%"]
    assert format_table([dict(ps, world_size=1)]).splitlines()[1] == "mlp (1 worker, net none)"


@pytest.mark.timeout(60)
def test_rank_zeros_progress_lines_reach_stderr_as_it_runs(tmp_path, capsys):
    # bench train printed nothing during a run of minutes; the log rank 0 writes must stay whole
    # (it shares its offset with the parent's file object: read with pread, never seek).
    from ringtrain.bench.procs import run_ranks

    (tmp_path / "talker.py").write_text(
        "import os, sys, time\n"
        "from ringtrain.bench.procs import emit, progress\n"
        "if os.environ['RANK'] == '0':\n"
        "    for i in range(3):\n"
        "        progress(f'# step {i}')\n"
        "        print('other output', flush=True)\n"
        "        time.sleep(0.2)\n"
        "    emit({'done': True})\n")
    import os
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    docs = run_ranks("talker", [], 2, timeout=30, extra_env=env)
    assert docs == [{"done": True}]
    err = capsys.readouterr().err
    assert err.splitlines() == ["# step 0", "# step 1", "# step 2"], err


def ranks_that_fail(monkeypatch, finishing: dict[int, int], failure: Exception):
    """run_ranks for bench allreduce: rank 0 sends the rows of the first ``finishing[p]`` sizes,
    one size at a time as the worker does, then the launch of world size p ends in ``failure``
    (a world size not in ``finishing`` finishes every size)."""
    def run_ranks(module, module_args, p, *, timeout, net=None, on_result=None):
        cfg = json.loads(module_args[module_args.index("--worker") + 1])
        sizes = cfg["sizes"][:finishing.get(p, len(cfg["sizes"]))]
        docs = [{"rows": [{"impl": "gloo", "transport": "gloo", "algorithm": "torch.distributed", "world_size": p,
                           "nbytes": n, "median_s": 1e-4, "times_s": [1e-4], "busbw_GBps": 0.04}]} for n in sizes]
        for doc in docs if on_result else ():
            on_result(doc)
        if p in finishing:
            raise failure
        return docs

    monkeypatch.setattr(bench_allreduce, "run_ranks", run_ranks)


@pytest.mark.timeout(60)
def test_a_rank_failing_in_the_last_world_size_keeps_the_sizes_finished_and_names_the_failure(
        monkeypatch, tmp_path, capsys):
    # The ranks sent their rows only at the end and the parent kept them only once every world
    # size was done: a run stopped in its last world size (a rank that died, --timeout) saved nothing.
    from pathlib import Path

    from ringtrain.bench.procs import RankFailed

    ranks_that_fail(monkeypatch, {4: 1}, RankFailed("rank 3 exited with status 1:\nboom"))
    argv = ALLREDUCE[:3] + ["2,4", *ALLREDUCE[4:5], "4K,64K", *ALLREDUCE[6:]]
    rc = cli.main(argv + ["--out", str(tmp_path), "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 1 and err.strip().endswith("ringtrain bench allreduce: rank 3 exited with status 1:\nboom"), err
    assert [(r["world_size"], r["nbytes"], r["net"]) for r in doc["rows"]] == [
        (2, 4 << 10, "none"), (2, 64 << 10, "none"), (4, 4 << 10, "none")]
    assert doc["notes"] == ["Open MPI anchor skipped: --no-mpi", "Horovod anchor skipped: --no-horovod",
                            "stopped (rank 3 exited with status 1) before the run ended: the rows finished by then, "
                            "for world size 2 at 4K, 64K (2 of 2 sizes); world size 4 at 4K (1 of 2 sizes)"]
    saved = json.loads(Path(doc["saved_to"]).read_text())
    assert saved["rows"] == doc["rows"] and saved["notes"] == doc["notes"]


@pytest.mark.timeout(60)
def test_a_network_not_made_for_a_later_world_size_keeps_the_sizes_finished(monkeypatch, tmp_path, capsys):
    # Before: the error alone (exit 2), and world size 2's rows, timed, were lost.
    from ringtrain.bench.netem import NetemUnavailable

    failed = "`ip netns add ringtrain-7-1-sw` failed (exit 2): RTNETLINK answers: Cannot allocate memory"
    ranks_that_fail(monkeypatch, {4: 0}, NetemUnavailable(failed))
    argv = ALLREDUCE[:3] + ["2,4", *ALLREDUCE[4:5], "4K,64K", *ALLREDUCE[6:]]
    rc = cli.main(argv + ["--out", str(tmp_path), "--json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 1 and err.strip().endswith(f"ringtrain bench allreduce: {failed}"), err
    assert [(r["world_size"], r["nbytes"]) for r in doc["rows"]] == [(2, 4 << 10), (2, 64 << 10)]
    assert doc["notes"][-1] == (f"stopped ({failed}) before the run ended: the rows finished by then, "
                                "for world size 2 at 4K, 64K (2 of 2 sizes)")
    assert len(list(tmp_path.glob("allreduce-*.json"))) == 1


@pytest.mark.timeout(60)
def test_a_network_not_made_before_any_size_is_the_refusal_it_was(monkeypatch, tmp_path, capsys):
    from ringtrain.bench.netem import NetemUnavailable

    ranks_that_fail(monkeypatch, {2: 0}, NetemUnavailable("network emulation needs root (running as uid 1000)"))
    rc = cli.main(ALLREDUCE + ["--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and err.strip().endswith("ringtrain bench allreduce: network emulation needs root "
                                            "(running as uid 1000)"), err
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.fixture
def hangup_ignored():
    """SIGHUP ignored, as nohup starts a command."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGHUP, before)


@pytest.mark.timeout(60)
def test_under_nohup_a_hang_up_neither_stops_a_benchmark_nor_marks_it_interrupted(
        monkeypatch, tmp_path, capsys, hangup_ignored):
    # Before: `nohup ringtrain bench ... &` then the terminal closed: "interrupted; nothing saved",
    # exit 129 (the command put its own handler over the ignored SIGHUP); and a hang-up while
    # the result was saved made a finished run's exit 129.
    from ringtrain.bench import machine

    save = machine.save_result

    def save_hung_up(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGHUP)
        return save(*args, **kwargs)

    def run_ranks(module, module_args, p, *, timeout, net=None, on_result=None):
        os.kill(os.getpid(), signal.SIGHUP)  # the terminal closes mid-run
        doc = {"rows": [{"impl": "gloo", "transport": "gloo", "algorithm": "torch.distributed", "world_size": p,
                         "nbytes": 4096, "median_s": 1e-4, "times_s": [1e-4], "busbw_GBps": 0.04}]}
        on_result(doc)
        return [doc]

    monkeypatch.setattr(bench_allreduce, "run_ranks", run_ranks)
    monkeypatch.setattr(machine, "save_result", save_hung_up)
    rc = cli.main(ALLREDUCE + ["--out", str(tmp_path), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and "interrupted" not in err, err
    assert len(json.loads(out)["rows"]) == 1 and len(list(tmp_path.glob("allreduce-*.json"))) == 1
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


@pytest.mark.timeout(60)
def test_a_rank_failing_before_any_size_is_the_one_line_error_it_was(monkeypatch, tmp_path, capsys):
    from ringtrain.bench.procs import RankFailed

    ranks_that_fail(monkeypatch, {2: 0}, RankFailed("ranks [0, 1] still running after 1s:\n"))
    rc = cli.main(ALLREDUCE + ["--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 1 and err.strip().splitlines() == [
        "# world size 2: 1 size x 2 configurations", "ringtrain bench allreduce: ranks [0, 1] still running after 1s:"]
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_ctrl_c_after_a_size_prints_that_sizes_rows_and_exits_130(monkeypatch, capsys):
    ranks_that_fail(monkeypatch, {2: 1}, KeyboardInterrupt())
    argv = ALLREDUCE[:5] + ["4K,64K"] + ALLREDUCE[6:] + ["--out", ""]
    assert cli.main(argv) == 130
    out, err = capsys.readouterr()
    assert err.splitlines()[-1] == "ringtrain bench allreduce: interrupted; the rows finished so far printed", err
    assert "\n4K " in out and "\n64K " not in out, out
    assert ("note: interrupted (Ctrl-C) before the run ended: the rows finished by then, for world size 2 at 4K "
            "(1 of 2 sizes)") in out, out


def test_the_open_mpi_anchor_is_skipped_with_how_to_install_it_when_mpi4py_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    rows, note = bench_allreduce._launch_mpi(2, {}, timeout=5)
    assert rows == [] and "mpi4py is not installed" in note and "pip install mpi4py" in note


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stops", ["ctrl-c", "timeout"])
def test_a_stopped_open_mpi_anchor_gets_sigterm_and_is_waited_for(stops, monkeypatch):
    # mpirun was SIGKILLed (subprocess.run's way), leaving Open MPI's 4 MiB segment in /dev/shm.
    import signal
    import subprocess

    real = importlib.util.find_spec  # (no Open MPI needed: mpirun is the stand-in below)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "mpi4py" else real(name, *a))
    monkeypatch.setattr(bench_allreduce.shutil, "which", lambda name: f"/usr/bin/{name}")
    seen = []

    class Mpirun:
        returncode = None

        def __init__(self, cmd, **kwargs):
            seen.append(("started", kwargs.get("start_new_session")))

        def communicate(self, timeout=None):
            if len(seen) == 1:
                seen.append(("waited", timeout))
                if stops == "ctrl-c":
                    raise KeyboardInterrupt
                raise subprocess.TimeoutExpired("mpirun", timeout)
            seen.append(("waited", timeout))
            return "", ""

        def send_signal(self, sig):
            seen.append(("signal", sig))

        def kill(self):  # pragma: no cover - (only past the grace period)
            seen.append(("killed", None))

    monkeypatch.setattr(bench_allreduce.subprocess, "Popen", Mpirun)
    if stops == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            bench_allreduce._launch_mpi(2, {}, timeout=5)
    else:
        assert bench_allreduce._launch_mpi(2, {}, timeout=5) == ([], "Open MPI anchor timed out after 5s")
    assert seen == [("started", True), ("waited", 5), ("signal", signal.SIGTERM), ("waited", 10.0)]


# --- what a result records to be reproduced (a reviewer's list: the shaping, the MPI library) ------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [ALLREDUCE, TRAIN], ids=["allreduce", "train"])
@pytest.mark.parametrize("net, tc", [("1gbit", "tbf rate 984395319bit burst 131072b latency 5ms"),
                                     ("10gbit", "tbf rate 9843953186bit burst 1310720b latency 5ms"),
                                     ("none", None)])
def test_the_result_records_the_emulated_links_shaping(argv, net, tc, no_ranks, capsys):
    # The result said "net": "1gbit" and nothing of the tbf burst and queue that decide what small
    # messages cost: a reader could not shape a link as the run did.
    from ringtrain.bench.netem import EmulatedNetwork

    assert cli.main(argv + ["--net", net, "--out", "", "--json"]) == 0
    shaping = json.loads(capsys.readouterr().out)["network"]
    if tc is None:
        assert shaping is None
        return
    assert shaping["tc"] == tc and shaping["qdisc"] == "tbf" and shaping["latency_ms"] == 5.0
    assert shaping == EmulatedNetwork(2, rate=net).shape.to_dict()  # (what the launches' networks apply)
    assert EmulatedNetwork(2, rate=net).shape.tbf_command("eth0") == f"qdisc replace dev eth0 root {tc}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("anchor", ["ran", "skipped"])
def test_the_allreduce_result_names_the_mpi_library_its_anchor_ran_on(anchor, no_ranks, monkeypatch, capsys):
    # Open MPI's rows were recorded without its version (Horovod's rows have theirs).
    mpi_row = {"impl": "mpi", "transport": "openmpi", "algorithm": "MPI_Allreduce", "world_size": 2,
               "nbytes": 4096, "median_s": 1e-4, "busbw_GBps": 0.04, "times_s": [1e-4],
               "version": "Open MPI v4.1.4, package: Debian OpenMPI", "mpi4py": "4.1.2"}
    answer = ([mpi_row], None) if anchor == "ran" else ([], "Open MPI anchor skipped: mpi4py is not installed")
    monkeypatch.setattr(bench_allreduce, "_launch_mpi", lambda p, cfg, timeout: answer)
    argv = [a for a in ALLREDUCE if a != "--no-mpi"]
    assert cli.main(argv + ["--out", "", "--json"]) == 0
    machine = json.loads(capsys.readouterr().out)["machine"]
    if anchor == "ran":
        assert machine["mpi"] == "Open MPI v4.1.4, package: Debian OpenMPI" and machine["mpi4py"] == "4.1.2"
    else:  # (no MPI: nothing said of it, and nothing failed)
        assert "mpi" not in machine and "mpi4py" not in machine


@pytest.mark.timeout(120)
def test_the_open_mpi_anchors_rows_carry_the_librarys_version():
    import shutil

    if importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None:
        pytest.skip("needs mpi4py and Open MPI's mpirun")
    import mpi4py

    rows, note = bench_allreduce._launch_mpi(2, {"sizes": [4096], "repeats": 1}, timeout=100)
    assert note is None and rows, note
    version = rows[0]["version"]
    assert version.startswith("Open MPI v") and "\x00" not in version and "\n" not in version, version
    assert rows[0]["mpi4py"] == mpi4py.__version__
    assert bench_allreduce.mpi_library(rows) == {"mpi": version, "mpi4py": mpi4py.__version__}


# --- the names of a run's files (a reviewer's list) -------------------------------------------------------


def write_timeline(cfg: dict, model: str, ranks: range, ms: float) -> dict:
    """``model``'s timeline as ``ranks`` write it where the ring job's configuration ``cfg`` says
    (one span of ``ms``); the optimal row that names it (rank 0's file)."""
    from pathlib import Path

    from ringtrain.ddp.timeline import TraceRecorder, trace_path

    path = Path(cfg["timeline_dir"]) / f"{cfg['timeline_stem']}-{model}.json"
    for rank in ranks:
        recorder = TraceRecorder(path, rank, 1, origin=0.0)
        recorder.span("backward", "backward", "compute", 0.0, 1e-3 * ms, iteration=0)
        recorder.end_iteration()  # (the last recorded iteration: written)
        recorder.release()
    return dict(ALONE_ROW, model=model, impl="ringtrain", schedule="optimal", overlap_bound_s=0.09,
                timeline=str(trace_path(path, 0)))


def ranks_that_write_timelines(monkeypatch, launches: list, finished=("mlp",), partial=(), failure=None):
    """The ring job's launch as its ranks make it: ranks 0 and 1 write each ``finished`` model's
    timeline (the n-th launch's spans last n ms) and rank 0 sends its optimal row naming it; then
    rank 0 alone writes each ``partial`` model's and the launch ends in ``failure`` (if any)."""
    def launch(module, module_args, nprocs, args, on_result=None):
        cfg = json.loads(module_args[module_args.index("--worker") + 1])
        launches.append(cfg)
        docs = [{"rows": [write_timeline(cfg, model, range(2), len(launches))]} for model in finished]
        for doc in docs if on_result else ():
            on_result(doc)
        for model in partial:
            write_timeline(cfg, model, range(1), len(launches))
        if failure is not None:
            raise failure
        return docs

    monkeypatch.setattr(bench_train, "_launch", launch)


@pytest.mark.timeout(60)
def test_train_runs_started_in_one_second_name_their_charts_and_timelines_after_their_own_results(
        monkeypatch, tmp_path, capsys):
    # The second run's result got a name of its own (…Z-<pid>.json) but its timelines took the
    # first run's names, written over them (and its timeline picture drawn from whichever came last).
    from pathlib import Path

    pytest.importorskip("matplotlib")
    monkeypatch.setattr(bench_train, "run_stamp", lambda started=None: "20261207T010326Z")
    launches = []
    ranks_that_write_timelines(monkeypatch, launches)
    argv = [a if a != "single" else "optimal" for a in TRAIN] + ["--out", str(tmp_path), "--json"]
    docs = []
    for _ in range(2):
        assert cli.main(argv) == 0
        docs.append(json.loads(capsys.readouterr().out))
    stems = [Path(d["saved_to"]).stem for d in docs]
    assert stems[0] == "train-none-2r-20261207T010326Z" and stems[1] != stems[0], stems
    for n, (doc, stem) in enumerate(zip(docs, stems), 1):
        assert launches[n - 1]["timeline_stem"] == stem
        timeline = Path(doc["rows"][0]["timeline"])
        assert timeline.name == f"{stem}-mlp.rank0.json", timeline
        assert [Path(c).name for c in doc["charts"]] == [f"{stem}-iterations.png", f"{stem}-mlp-timeline.png"]
        for rank in range(2):  # each run's own timelines, whole
            events = json.loads(timeline.with_name(f"{stem}-mlp.rank{rank}.json").read_text())["traceEvents"]
            assert [e["dur"] for e in events if e["ph"] == "X"] == [1000.0 * n]
    assert not list(tmp_path.glob(".*"))  # (the names held while the runs ran are let go)


def test_a_stamp_held_by_a_running_run_or_taken_by_a_finished_one_is_not_given_again(tmp_path):
    import os

    from ringtrain.bench.machine import reserve_stamp

    stamp = "20261207T010326Z"
    with reserve_stamp(tmp_path, "train-none-2r", stamp) as first:
        assert first == stamp and (tmp_path / f".train-none-2r-{stamp}.running").exists()
        with reserve_stamp(tmp_path, "train-none-2r", stamp) as second:  # (another run, the same second)
            assert second == f"{stamp}-{os.getpid()}"
        with reserve_stamp(tmp_path, "allreduce-none", stamp) as other:  # (another benchmark: its own names)
            assert other == stamp
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "timelines").mkdir()
    (tmp_path / "timelines" / f"train-none-2r-{stamp}-mlp.rank0.json").write_text("{}")  # (a run that saved no result)
    with reserve_stamp(tmp_path, "train-none-2r", stamp) as third:
        assert third == f"{stamp}-{os.getpid()}"
    with reserve_stamp(None, "train-none-2r", stamp) as unsaved:
        assert unsaved == stamp


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [ALLREDUCE, TRAIN], ids=["allreduce", "train"])
def test_a_results_name_when_and_started_are_its_start_and_ended_its_end(argv, no_ranks, monkeypatch, tmp_path,
                                                                         capsys):
    # A train result was named by its start but its "when" was its end (minutes to hours later).
    import datetime as dt
    import itertools
    import types
    from pathlib import Path

    from ringtrain.bench import machine

    start = dt.datetime(2026, 12, 7, 1, 3, 26, tzinfo=dt.timezone.utc)
    ticks = (start + dt.timedelta(seconds=90 * k) for k in itertools.count())  # (each reading 90 s on)

    class Clock(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return next(ticks)

    monkeypatch.setattr(machine, "_dt", types.SimpleNamespace(datetime=Clock, timezone=dt.timezone))
    assert cli.main(argv + ["--out", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert Path(doc["saved_to"]).name == f"{doc['benchmark']}-20261207T010326Z.json"
    assert doc["when"] == doc["started"] == "2026-12-07T01:03:26+00:00"
    assert dt.datetime.fromisoformat(doc["ended"]) > start
    # scripts/bench_summary.py reads it, as it reads the files saved before (tests/test_bench_summary.py)
    spec = importlib.util.spec_from_file_location("bench_summary", Path(__file__).resolve().parents[1] / "scripts" /
                                                  "bench_summary.py")
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    assert summary.main([doc["saved_to"]]) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, status", [("sys.exit(3)", "exited with status 3"),
                                         ("os.kill(os.getpid(), 9)", "was killed by SIGKILL")])
def test_a_failed_rank_0s_log_tail_shows_what_it_said_not_the_protocol(how, status, tmp_path, capsys):
    # The tail shown of a failed rank 0 was mostly its RESULT documents (a row list per line, kilobytes
    # each) and PROGRESS lines already shown: the traceback before them scrolled away.
    import os

    from ringtrain.bench.procs import RankFailed, run_ranks

    (tmp_path / "dier.py").write_text(
        "import os, sys, time\n"
        "from ringtrain.bench.procs import emit, progress\n"
        "if os.environ['RANK'] != '0':\n"
        "    time.sleep(30)\n"
        "progress('# mlp: warming up')\n"
        "print('real output', flush=True)\n"
        "emit({'rows': [{'model': 'mlp'}]})\n"
        "print('the last words', flush=True)\n"
        f"{how}\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    kept = []
    with pytest.raises(RankFailed) as info:
        run_ranks("dier", [], 2, timeout=30, extra_env=env, on_result=kept.append)
    # (a signal named as ringtrain launch names it: it said "exited with status -9")
    assert str(info.value) == f"rank 0 {status}:\nreal output\nthe last words\n"
    assert kept == [{"rows": [{"model": "mlp"}]}]  # (the protocol still reached this process)
    assert capsys.readouterr().err.splitlines() == ["# mlp: warming up"]


PARTIAL_NOTE = ("timelines of the models the run stopped in (partial where it stopped while they were written) "
                "kept in {dir}: {files}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failure", ["rank", "ctrl-c"])
def test_a_run_stopped_in_a_model_names_its_partial_timelines(failure, monkeypatch, tmp_path, capsys):
    # A rank failed in mlp after charlm's rows: mlp's timeline (rank 0's file alone) was left beside
    # charlm's whole ones without a word.
    from pathlib import Path

    from ringtrain.bench.procs import RankFailed

    pytest.importorskip("matplotlib")
    stop = RankFailed("rank 1 was killed by SIGKILL:\nboom") if failure == "rank" else KeyboardInterrupt()
    ranks_that_write_timelines(monkeypatch, [], finished=["charlm"], partial=["mlp"], failure=stop)
    ours = bench_train._launch

    def launch_beside_another_run(module, module_args, *args, **kwargs):
        # A run started in the same second, after this one took the stamp: its files are <stem>-<pid>-...
        cfg = json.loads(module_args[module_args.index("--worker") + 1])
        Path(cfg["timeline_dir"]).mkdir(parents=True, exist_ok=True)
        Path(cfg["timeline_dir"], f"{cfg['timeline_stem']}-999-mlp.rank0.json").write_text("{}")
        return ours(module, module_args, *args, **kwargs)

    monkeypatch.setattr(bench_train, "_launch", launch_beside_another_run)
    argv = TRAIN[:3] + ["charlm,mlp"] + TRAIN[4:] + ["--schedules", "optimal", "--out", str(tmp_path), "--json"]
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    doc = json.loads(out)
    stem = Path(doc["saved_to"]).stem
    assert rc == (1 if failure == "rank" else 130)
    assert doc["notes"][-1] == PARTIAL_NOTE.format(dir=tmp_path / "timelines", files=f"{stem}-mlp.rank0.json")
    assert (tmp_path / "timelines" / f"{stem}-mlp.rank0.json").exists()  # (kept, as said)
    assert [Path(c).name for c in doc["charts"]] == [f"{stem}-iterations.png", f"{stem}-charlm-timeline.png"]
    assert json.loads(Path(doc["saved_to"]).read_text())["notes"] == doc["notes"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failure", ["rank", "ctrl-c"])
def test_a_run_stopped_before_any_row_names_its_partial_timelines(failure, monkeypatch, tmp_path, capsys):
    from ringtrain.bench.procs import RankFailed

    stop = RankFailed("rank 1 was killed by SIGKILL:\nboom") if failure == "rank" else KeyboardInterrupt()
    ranks_that_write_timelines(monkeypatch, [], finished=[], partial=["mlp"], failure=stop)
    monkeypatch.setattr(bench_train, "run_stamp", lambda started=None: "20261207T010326Z")
    argv = [a if a != "single" else "optimal" for a in TRAIN] + ["--out", str(tmp_path)]
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    kept = "nothing saved but " + PARTIAL_NOTE.format(dir=tmp_path / "timelines",
                                                      files="train-none-2r-20261207T010326Z-mlp.rank0.json")
    if failure == "rank":  # what was kept, then the error (as a run with rows: its notes, then the error)
        assert rc == 1 and err.splitlines() == [f"ringtrain bench train: {kept}",
                                                "ringtrain bench train: rank 1 was killed by SIGKILL:", "boom"], err
    else:  # (it said "nothing saved but the timelines in <folder>", every one of them partial)
        assert rc == 130 and err.splitlines() == [f"ringtrain bench train: interrupted; {kept}"], err
    assert out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["timelines"]


def test_a_hold_left_by_a_run_killed_outright_is_removed_by_the_next_run_on_its_host(tmp_path):
    # Before: a SIGKILLed bench's empty ``.<kind>-<stamp>.running`` stayed in benchmarks/ forever.
    import os
    import platform
    import subprocess
    import sys

    from ringtrain.bench.machine import reserve_stamp

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    left = tmp_path / ".train-none-2r-20261207T010326Z.running"
    left.write_text(f"{platform.node()} {dead}\n")
    elsewhere = tmp_path / ".train-none-2r-20261207T010327Z.running"
    elsewhere.write_text(f"another-host-{platform.node()} {dead}\n")  # (its pid means nothing here)
    alive = tmp_path / ".allreduce-none-20261207T010328Z.running"
    alive.write_text(f"{platform.node()} {os.getpid()}\n")
    starting = tmp_path / ".allreduce-none-20261207T010329Z.running"
    starting.touch()  # (made, its holder not yet written)
    with reserve_stamp(tmp_path, "train-none-2r", "20261207T020000Z") as mine:
        held = tmp_path / f".train-none-2r-{mine}.running"
        assert held.read_text() == f"{platform.node()} {os.getpid()}\n"
        assert not left.exists()
        assert elsewhere.exists() and alive.exists() and starting.exists()
    assert not held.exists()


def test_a_runs_trace_files_are_taken_by_rank_number_not_by_name(tmp_path):
    # Before: sorted by name, rank 10's lanes were drawn before rank 2's in the timeline picture.
    from ringtrain.bench.train import rank_files

    for r in (0, 1, 2, 10, 11):
        (tmp_path / f"train-none-12r-20261207T010326Z-mlp.rank{r}.json").write_text("{}")
    (tmp_path / "train-none-12r-20261207T010326Z-123-mlp.rank3.json").write_text("{}")  # (another run's)
    (tmp_path / "train-none-12r-20261207T010326Z-mlp.rank4.json.tmp7").write_text("{}")  # (being written)
    got = rank_files(tmp_path / "train-none-12r-20261207T010326Z-mlp.rank0.json")
    assert [f.name.rpartition(".rank")[2] for f in got] == ["0.json", "1.json", "2.json", "10.json", "11.json"]
