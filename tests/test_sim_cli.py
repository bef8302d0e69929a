"""`ringtrain simulate` and `ringtrain plan` through the real CLI entry point (in process)."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import unicodedata

import pytest

from ringtrain.cli import main
from ringtrain.sim.devices import DEVICES
from ringtrain.sim.models_zoo import build_trace
from ringtrain.sim.traces import save

pytestmark = pytest.mark.timeout(60)


def test_simulate_json_has_one_row_per_case(capsys):
    rc = main(["simulate", "--model", "resnet50,lstm-ptb", "--cluster", "10GbE", "--cluster", "alpha=1e-5,beta=1e-9",
               "--gpus", "4,32", "--algorithms", "ring,halving_doubling", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["rows"]) == 2 * 2 * 2 * 2 * 5
    assert [m["model"] for m in doc["models"]] == ["resnet50", "lstm-ptb"]
    assert [c["name"] for c in doc["clusters"]] == ["10GbE", "alpha=1e-05,beta=1e-09"]
    row = doc["rows"][0]
    for key in ("model", "cluster", "algorithm", "schedule", "world_size", "iteration_s", "samples_per_s",
                "speedup", "efficiency", "groups", "exposed_s"):
        assert key in row


def test_simulate_table_csv_and_trace_file(tmp_path, capsys):
    trace_path = tmp_path / "mine.csv"
    save(build_trace("googlenet", DEVICES["a100"]), trace_path)
    out_csv = tmp_path / "out.csv"
    rc = main(["simulate", "--model", str(trace_path), "--cluster", "25GbE", "--gpus", "8", "--schedules",
               "wfbp,optimal", "--csv", str(out_csv)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "googlenet" in text and "wfbp" in text and "optimal" in text
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["schedule"] for r in rows] == ["wfbp", "optimal"]
    assert float(rows[1]["iteration_s"]) <= float(rows[0]["iteration_s"])


@pytest.mark.timeout(120)
def test_simulate_plots(tmp_path, capsys):
    rc = main(["simulate", "--model", "resnet50", "--cluster", "1GbE,10GbE", "--gpus", "4,16,64",
               "--plot", str(tmp_path), "--json"])
    assert rc == 0
    capsys.readouterr()
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["gantt_resnet50_16gpus_1GbE.png", "scaling_resnet50.png"]
    assert all((tmp_path / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.timeout(120)
def test_simulate_gantt_chart_is_drawn_where_something_is_communicated(tmp_path, capsys):
    # --gpus 1,64 drew one iteration on 1 GPU: no allreduce in the chart of allreduce groups.
    for gpus, expected in (("1,64", 64), ("1,8,64", 8), ("1", 1)):
        out = tmp_path / gpus
        rc = main(["simulate", "--model", "vgg16", "--cluster", "10GbE", "--gpus", gpus, "--schedules", "optimal",
                   "--plot", str(out), "--json"])
        assert rc == 0
        capsys.readouterr()
        assert [p.name for p in out.glob("gantt_*.png")] == [f"gantt_vgg16_{expected}gpus_10GbE.png"]


@pytest.mark.timeout(120)
def test_simulate_plots_every_model_when_names_differ_only_in_unsafe_characters(tmp_path, capsys):
    # "my model" and "my_model" both wrote scaling_my_model.png: the second overwrote the first.
    trace = build_trace("vgg16", DEVICES["v100"])
    for k, name in enumerate(("my model", "my_model")):
        save(dataclasses.replace(trace, model=name), tmp_path / f"t{k}.json")
    out = tmp_path / "plots"
    rc = main(["simulate", "--model", f"{tmp_path / 't0.json'},{tmp_path / 't1.json'}", "--cluster", "10GbE",
               "--gpus", "4", "--schedules", "optimal", "--plot", str(out), "--json"])
    assert rc == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.glob("*.png")) == [
        "gantt_my_model-2_4gpus_10GbE.png", "gantt_my_model_4gpus_10GbE.png", "scaling_my_model-2.png",
        "scaling_my_model.png"]


@pytest.mark.parametrize("argv, match", [
    (["--model", "alexnet"], "--model"),
    (["--cluster", "token-ring"], "--cluster"),
    (["--gpus", "4,x"], "--gpus"),
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "99999999999999999999"], "--gpus: GPU counts must be from 1 to 1048576"),  # (printed runaway rows)
    # (numbers out of any real range: rows of inf, or a message naming no input)
    (["--model", "resnet50", "--gpus", "4", "--cluster", "alpha=0,beta=1e300"],
     "one allreduce of its 102228128 gradient bytes takes 1.53e+308 s"),
    # (an inf cost: one line, the same refusal, not the planner's naming a bound method of the cost)
    (["--model", "resnet50", "--gpus", "4", "--cluster", "alpha=1e308,beta=1e-9"],
     "one allreduce of its 102228128 gradient bytes takes inf s, over 1e+09 s (30 years); are the cost's numbers "
     "(AllreduceCost(world_size=4, algorithm='ring', alpha=1e+308,"),
    (["--model", "resnet50", "--gpus", "16", "--cluster", "alpha=1e-5,beta=1e300", "--algorithms", "ps"],
     "one allreduce of its 102228128 gradient bytes takes inf s"),
    (["--model", "resnet50", "--cluster", "alpha=1e-5,beta=1e-9,name="], "--cluster: the cluster's name must not be"),
    (["--model", "alexnet"], "lm300m, a trace file (.json/.csv) or profile:NAME (a ringtrain.models model"),
    (["--schedules", "greedy"], "--schedules"),
    (["--algorithms", "butterfly"], "--algorithms"),
    (["--device", "p100"], "--device"),
    (["--cluster", ""], "--cluster"),
    (["--cluster", ","], "--cluster"),
    (["--gpus", "4,,8"], "--gpus: '4,,8' has an empty value"),  # (was taken as 4,8)
    (["--model", "resnet50", "--gpus-per-node", "0"], "--gpus-per-node: must be an integer >= 1"),  # (named --cluster)
    (["--model", "resnet50", "--cluster", "10GbE", "--gpus", "4", "--csv", "/nonexistent/dir/x.csv"],
     "--csv /nonexistent/dir/x.csv: no folder /nonexistent/dir"),
    (["--model", "resnet50", "--gpus", "4", "--csv", "/proc/version/x.csv"], "--csv /proc/version/x.csv: no folder"),
    (["--model", "resnet50", "--gpus", "4", "--csv", "/proc/x.csv"], "--csv /proc/x.csv: cannot write in /proc"),
    (["--model", "resnet50", "--gpus", "4", "--csv", "/tmp"], "--csv /tmp: a folder, not a file"),
    (["--model", "nope", "--csv", "/nonexistent/dir/x.csv"], "--csv"),  # (said before the model is read)
    # (said after the sweep, exit 1: "cannot write /proc/version: File exists")
    (["--model", "resnet50", "--gpus", "4", "--plot", "/proc/version"], "--plot /proc/version: a file, not a folder"),
    (["--model", "resnet50", "--gpus", "4", "--plot", "/proc/version/plots"],
     "--plot /proc/version/plots: /proc/version is a file, not a folder"),
    (["--model", "resnet50", "--gpus", "4", "--plot", "/proc/plots"], "--plot /proc/plots: cannot write in /proc"),
    (["--model", "nope", "--plot", "/proc/version"], "--plot"),
    # (an integer of 400 digits: "OverflowError: int too large to convert to float" tracebacks)
    (["--model", "vgg16", "--gpus", "4", "--algorithms", "ps", "--cluster", f"alpha=1e-5,beta=1e-9,servers={10**400}"],
     "--cluster: servers must be an integer >= 1 and at most 1e+15"),
    (["--model", "vgg16", "--gpus", "16", "--cluster", f"alpha=1e-5,beta=1e-9,gpus_per_node={10**400}"],
     "--cluster: gpus_per_node must be an integer >= 1 and at most 1e+15"),
    (["--model", "vgg16", "--gpus", "16", "--gpus-per-node", str(10**400)], "--gpus-per-node: must be an integer >= 1 "
                                                                            "and at most 1e+15"),
])
def test_simulate_bad_options_exit_2_naming_the_option(argv, match, capsys):
    assert main(["simulate", *argv]) == 2
    assert match in capsys.readouterr().err


def test_algorithms_and_schedules_are_taken_in_any_case_as_models_devices_and_networks(capsys):
    # ('Ring' was refused while 'ResNet50', 'V100' and '10gbe' were taken)
    argv = ["--model", "ResNet50", "--device", "V100", "--cluster", "10gbe", "--gpus", "4", "--json"]
    assert main(["simulate", *argv, "--algorithms", "Ring,HIERARCHICAL", "--schedules", "Optimal"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["algorithm"], r["schedule"]) for r in rows] == [("ring", "optimal"), ("hierarchical", "optimal")]
    assert main(["simulate", *argv, "--algorithms", "Ring,ring"]) == 2
    assert "--algorithms: ring given twice" in capsys.readouterr().err
    assert main(["plan", "--model", "resnet50", "--gpus", "4", "--algorithm", "Ring", "--methods", "WFBP", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["algorithm"] == "ring" and [m["schedule"] for m in doc["methods"]] == ["wfbp"]


def test_plan_prints_every_method_with_layer_names(capsys):
    rc = main(["plan", "--model", "densenet121", "--cluster", "10GbE", "--gpus", "64", "--max-groups", "3"])
    assert rc == 0
    out = capsys.readouterr().out
    for method in ("single", "wfbp", "fixed", "mgwfbp", "optimal"):
        assert f"\n{method}: groups" in out
    assert "features.conv0" in out and "more groups" in out


def test_plan_json_with_alpha_beta(capsys):
    rc = main(["plan", "--model", "resnet50", "--alpha", "1e-5", "--beta", "1e-9", "--gpus", "8",
               "--methods", "optimal,wfbp", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["schedule"] for m in doc["methods"]] == ["optimal", "wfbp"]
    assert len(doc["methods"][1]["plan"]["groups"]) == len(doc["layers"])
    assert doc["methods"][0]["iteration_s"] <= doc["methods"][1]["iteration_s"]


@pytest.mark.parametrize("argv, match", [
    ([], "--model"),
    (["--model", "resnet50,vgg16"], "--model"),
    (["--model", "resnet50", "--alpha", "1e-5"], "--alpha"),
    (["--model", "resnet50", "--cluster", "1GbE,10GbE"], "--cluster"),
    (["--model", "resnet50", "--algorithm", "tree"], "--algorithm: unknown algorithm 'tree'"),  # (named --algorithms)
    (["--model", "resnet50", "--gpus-per-node", "0"], "--gpus-per-node: must be"),
    (["--model", "resnet50", "--gpus", "99999999999999999999"], "--gpus: the GPU count must be an integer from 1 to "
                                                                "1048576"),  # (was a 30-years refusal naming no flag)
    (["--model", "resnet50", "--alpha", "1e-5", "--beta", "1e300"], "one allreduce of its 102228128 gradient bytes "
                                                                    "takes inf s"),  # (named a bound method)
])
def test_plan_bad_options(argv, match, capsys):
    assert main(["plan", *argv]) == 2
    assert match in capsys.readouterr().err


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    return " ".join(out[out.index("options:"):].split())  # the options, argparse's line breaks undone


def test_plan_help_says_one_model_and_one_cluster_and_its_own_default(capsys):
    text = _help("plan", capsys)
    model = text[text.index("--model MODEL"): text.index("--device DEVICE")]
    cluster = text[text.index("--cluster CLUSTER"): text.index("--gpus-per-node")]
    assert "exactly one (required)" in model and "trace file" in model
    assert "exactly one" in cluster and "(default 10GbE;" in cluster
    for shared in ("comma-separated", "'all'", "repeatable", "1GbE,10GbE,100Gb-IB"):
        assert shared not in model + cluster, shared
    # simulate keeps the shared wording
    text = _help("simulate", capsys)
    assert "comma-separated zoo models" in text and "repeatable (default 1GbE,10GbE,100Gb-IB)" in text


@pytest.mark.parametrize("models, names", [
    ("resnet50,{p}", ["resnet50", "resnet50@h100"]),
    ("{p},{p},{p}", ["resnet50", "resnet50@h100", "resnet50@h100#2"]),
])
def test_traces_of_the_same_model_stay_apart(models, names, tmp_path, capsys):
    path = tmp_path / "h100.json"
    save(build_trace("resnet50", DEVICES["h100"]), path)
    rc = main(["simulate", "--model", models.format(p=path), "--cluster", "10GbE", "--gpus", "8", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["model"] for m in doc["models"]] == names
    assert len({r["model"] for r in doc["rows"]}) == len(names)


def test_all_stands_for_the_zoo_beside_trace_files(tmp_path, capsys):
    """'all' in a list (it was taken only alone, and refused as an unknown model beside a file)."""
    from ringtrain.sim.models_zoo import MODELS

    path = tmp_path / "mine.json"
    save(build_trace("resnet50", DEVICES["h100"]), path)
    rc = main(["simulate", "--model", f"{path},all", "--cluster", "10GbE", "--gpus", "8", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    names = [m["model"] for m in doc["models"]]
    assert names[0] == "resnet50" and len(names) == len(MODELS) + 1  # the file's trace, then the zoo (its
    assert "resnet50@v100" in names                                  # resnet50 kept apart by its device)
    rc = main(["simulate", "--model", "all,vgg16", "--cluster", "10GbE", "--gpus", "8", "--json"])
    assert rc == 0
    names = [m["model"] for m in json.loads(capsys.readouterr().out)["models"]]
    assert sorted(names) == sorted(MODELS) and names[-1] == "vgg16"  # named once, where the user put it
    from ringtrain.sim.cli import model_names

    assert model_names("all,VGG16") == [m for m in MODELS if m != "vgg16"] + ["VGG16"]  # (any case)


def test_a_trace_with_a_non_finite_time_is_refused(tmp_path, capsys):
    path = tmp_path / "t.json"
    save(build_trace("resnet50", DEVICES["h100"]), path)
    doc = json.loads(path.read_text())
    for key, value in (("optimizer_s", float("nan")), ("optimizer_s", float("inf"))):
        bad = dict(doc, **{key: value})
        path.write_text(json.dumps(bad))
        assert main(["simulate", "--model", str(path), "--cluster", "10GbE", "--gpus", "4"]) == 2
        assert "optimizer_s" in capsys.readouterr().err
    layers = [dict(doc["layers"][0], forward_s=float("inf"))] + doc["layers"][1:]
    path.write_text(json.dumps(dict(doc, layers=layers)))
    assert main(["simulate", "--model", str(path), "--cluster", "10GbE", "--gpus", "4"]) == 2
    assert "forward_s" in capsys.readouterr().err


def test_gpus_per_node_reaches_an_alpha_beta_cluster(capsys):
    rc = main(["simulate", "--model", "resnet50", "--cluster", "alpha=2e-5,beta=8e-10", "--gpus-per-node", "4",
               "--algorithms", "hierarchical", "--gpus", "12", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["clusters"][0]["gpus_per_node"] == 4


def test_a_bench_file_row_without_numbers_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"rows": [{"algorithm": "ring", "world_size": 2, "nbytes": None, "median_s": 0.1}]}))
    assert main(["simulate", "--model", "resnet50", "--cluster", str(path), "--gpus", "4"]) == 2
    assert "not a number" in capsys.readouterr().err


def test_a_trace_without_its_required_fields_names_the_missing_one(tmp_path, capsys):
    # (Trace.__init__'s TypeError "missing 2 required positional arguments" reached the user)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"layers": []}))
    assert main(["simulate", "--model", str(path), "--cluster", "1GbE", "--gpus", "4"]) == 2
    assert "trace is missing the field 'model'" in capsys.readouterr().err


def test_a_bench_file_of_one_size_says_what_the_fit_needs(tmp_path, capsys):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"rows": [{"algorithm": "ring", "world_size": 2, "nbytes": 4096, "median_s": 1e-4}]}))
    assert main(["simulate", "--model", "resnet50", "--cluster", str(path), "--gpus", "4"]) == 2
    err = capsys.readouterr().err
    assert f"--cluster {path}: cannot fit alpha and beta" in err and "at least two --sizes" in err, err


def test_a_sweep_without_zoo_models_names_no_gpu_profile(tmp_path, capsys):
    from ringtrain.sim.models_zoo import build_trace
    from ringtrain.sim.devices import DEVICES
    from ringtrain.sim.traces import save

    path = tmp_path / "mine.json"
    save(build_trace("resnet50", DEVICES["a100"]), path)
    assert main(["simulate", "--model", str(path), "--cluster", "1GbE", "--gpus", "4"]) == 0
    assert "timed on" not in capsys.readouterr().out.splitlines()[0]
    assert main(["simulate", "--model", str(path), "--cluster", "1GbE", "--gpus", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] is None
    assert main(["simulate", "--model", f"{path},vgg16", "--cluster", "1GbE", "--gpus", "4"]) == 0
    assert "zoo models timed on v100" in capsys.readouterr().out.splitlines()[0]


def test_the_gpu_profile_is_named_as_the_zoo_names_it(capsys):
    # --device ' H100' was taken (names are read in any case) but written as given: '"device": " H100"',
    # 'timed on  H100', a second resnet50 called 'resnet50@ H100'.
    assert main(["simulate", "--model", "resnet50,resnet50", "--device", " H100", "--cluster", "1GbE", "--gpus", "4",
                 "--schedules", "optimal", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device"] == "h100"
    assert [m["model"] for m in doc["models"]] == ["resnet50", "resnet50@h100"]
    assert main(["simulate", "--model", "vgg16", "--device", "A100", "--cluster", "1GbE", "--gpus", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("zoo models timed on a100")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--alpha", "nan", "--beta", "1e-9"], "ringtrain plan: --alpha: nan must be a finite number >= 0"),
        (["--alpha", "1e-5", "--beta", "-1"], "ringtrain plan: --beta: -1.0 must be a finite number >= 0"),
        (["--alpha", "0", "--beta", "0"], "ringtrain plan: --alpha and --beta cannot both be 0"),
    ],
)
def test_plan_alpha_beta_errors_name_the_option_given(argv, message, capsys):
    # Was "--cluster: alpha=nan; ..." though no --cluster was given.
    assert main(["plan", "--model", "resnet50", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_cluster_count_that_is_not_whole_says_integer(capsys):
    # servers=2.5 was "servers='2.5' is not a number".
    assert main(["simulate", "--model", "resnet50", "--cluster", "alpha=1e-5,beta=1e-9,servers=2.5",
                 "--algorithms", "ps", "--gpus", "4"]) == 2
    assert "servers='2.5' is not an integer" in capsys.readouterr().err


def test_simulate_table_columns_line_up_with_long_algorithm_names(capsys):
    # halving_doubling, recursive_doubling and hierarchical overflowed the 10-character
    # algorithm column: their rows' numbers stood 2-8 characters right of the header's.
    assert main(["simulate", "--model", "resnet50", "--cluster", "10GbE", "--gpus", "4,16",
                 "--algorithms", "ring,hierarchical,recursive_doubling"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 7 and len({len(line) for line in lines}) == 1, lines


def test_simulate_table_columns_line_up_with_double_width_names(tmp_path, capsys):
    # A model named in Chinese (each character two columns wide on a terminal) pushed its row's
    # numbers one column right per character; a cluster named so did the same.
    save(dataclasses.replace(build_trace("resnet50", DEVICES["v100"]), model="残差网络五十"), tmp_path / "t.json")
    assert main(["simulate", "--model", f"{tmp_path / 't.json'},vgg16", "--gpus", "4",
                 "--cluster", "alpha=1e-5,beta=1e-9,name=集群", "--cluster", "10GbE"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    columns = {sum(2 if unicodedata.east_asian_width(c) == "W" else 1 for c in line) for line in lines}
    assert len(lines) == 5 and len(columns) == 1, lines


def test_the_best_column_names_optimal_where_schedules_tie_exactly(capsys):
    # ResNet-50 at 512 GPUs on 1GbE: one allreduce after backward is the optimum, so single,
    # mgwfbp and optimal predict the same time; "best" said single (the first column).
    assert main(["simulate", "--model", "resnet50", "--cluster", "1GbE", "--gpus", "512"]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    single, wfbp, fixed, mgwfbp, optimal = re.findall(r"([\d.]+) \(\s*\d+%\)", line)
    assert single == mgwfbp == optimal and line.split()[-2] == "optimal", line


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_an_unknown_profile_model_names_the_option(command, capsys):
    # Was "model must be one of ['charlm', ...], got 'foo'" (the registry's own words: which
    # model, and where would profile: go?).
    assert main([command, "--model", "profile:foo", "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert "--model profile:foo: unknown ringtrain.models model; choose profile: followed by one of" in err
    assert "resnet" in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv", [["simulate", "--gpus", "4"], ["simulate", "--gpus", "4", "--json"],
                                  ["plan", "--gpus", "4"], ["plan", "--gpus", "4", "--json"]])
def test_output_that_cannot_be_written_is_one_line_not_a_traceback(argv):
    # (a --json piped to a file on a full disk; a reader that stops early is no error: | head)
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "ringtrain.cli", *argv, "--model", "resnet50"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=50)
    assert proc.returncode == 1  # (the run's output lost: a failure, not a refused command line)
    assert proc.stderr == f"ringtrain {argv[0]}: cannot write the output: No space left on device\n"
    head = subprocess.run(f"{shlex.quote(sys.executable)} -m ringtrain.cli {' '.join(argv)} --model resnet50 | head -1",
                          shell=True, capture_output=True, text=True, timeout=50)
    assert head.stdout.strip() and head.stderr == ""


def test_table_cells_stay_apart_however_long_the_times(capsys):
    # gpt2-xl on 1GbE with one parameter server at 2048 GPUs: iterations of 1e8 ms ran into the
    # GPU count and into each other ("2048102149794.4 (  0%)102178687.8").
    rc = main(["simulate", "--model", "gpt2-xl", "--gpus", "2048", "--cluster", "1GbE", "--algorithms", "ps"])
    assert rc == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert re.fullmatch(r"gpt2-xl +1GbE +ps +2048( +\d+\.\d \( *\d+%\)){5} +optimal +\d+", row), row


def test_plan_on_one_gpu_lists_no_groups(capsys):
    assert main(["plan", "--model", "resnet50", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "nothing is communicated on 1 GPU" in out
    assert "groups in backward order" not in out


def test_one_gpu_rows_say_nothing_is_communicated_as_plan_does(tmp_path, capsys):
    # A 1-GPU row's comm_end_s was backward's end (38.8 ms for resnet50) beside comm_s 0 and
    # groups 0; the table had no word of it where plan says "nothing is communicated on 1 GPU".
    argv = ["simulate", "--model", "resnet50", "--cluster", "10GbE", "--gpus", "1,4", "--csv", str(tmp_path / "r.csv")]
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1] == "nothing is communicated on 1 GPU: every schedule's iteration is compute alone", table
    rows = list(csv.DictReader((tmp_path / "r.csv").read_text(encoding="utf-8").splitlines()))
    assert main(argv[:-2] + ["--json"]) == 0
    for row in rows + json.loads(capsys.readouterr().out)["rows"]:
        one = int(row["world_size"]) == 1
        assert (float(row["comm_end_s"]) == 0.0) == one and (int(row["groups"]) == 0) == one, row
    assert main(["plan", "--model", "resnet50", "--gpus", "1", "--json"]) == 0
    assert {m["comm_end_s"] for m in json.loads(capsys.readouterr().out)["methods"]} == {0.0}
    assert main(["simulate", "--model", "resnet50", "--cluster", "10GbE", "--gpus", "4"]) == 0
    assert "nothing is communicated" not in capsys.readouterr().out


def test_trace_and_csv_files_are_utf8_whatever_the_locale(tmp_path):
    # Under a locale whose encoding is not UTF-8 (POSIX without coercion here; cp1252 on Windows)
    # sim.traces.save and simulate --csv wrote with it: "UnicodeEncodeError: 'ascii' codec can't
    # encode characters" for a model or layer named in Cyrillic, where load() reads UTF-8 only.
    env = dict(os.environ, LC_ALL="POSIX", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0")
    script = (
        "import sys; from ringtrain.cli import main; from ringtrain.sim.traces import Layer, Trace, save\n"
        "save(Trace('\\u043c\\u043e\\u0434\\u0435\\u043b\\u044c', (Layer('\\u0441\\u043b\\u043e\\u0439', 1e-3, 2e-3, "
        "4000, 1000),), batch_size=4), sys.argv[1])\n"  # (model 'модель', layer 'слой', in ASCII)
        "sys.exit(main(['simulate', '--model', sys.argv[1], '--gpus', '4', '--cluster', '10GbE', '--csv', "
        "sys.argv[2], '--json']))\n")
    trace, rows = tmp_path / "t.csv", tmp_path / "rows.csv"
    proc = subprocess.run([sys.executable, "-c", script, str(trace), str(rows)], env=env, capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "# model: модель" in trace.read_text(encoding="utf-8")
    assert next(csv.DictReader(rows.read_text(encoding="utf-8").splitlines()))["model"] == "модель"
    bench = tmp_path / "bench.json"  # (a bench file is read as UTF-8 too, and one that is not is named)
    bench.write_bytes(b'{"rows": [\xff]}')
    proc = subprocess.run([sys.executable, "-m", "ringtrain.cli", "simulate", "--model", "resnet50", "--cluster",
                           str(bench)], env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert proc.stderr == (f"ringtrain simulate: --cluster {bench}: cannot read a bench JSON file: not UTF-8 text "
                           "(invalid start byte at byte 10)\n")


def test_csv_output_never_replaces_an_input_file(tmp_path, capsys):
    # simulate --csv naming the --model trace file wrote the predictions over the user's trace.
    trace_path = tmp_path / "mine.csv"
    save(build_trace("googlenet", DEVICES["a100"]), trace_path)
    before = trace_path.read_bytes()
    for name in (str(trace_path), str(tmp_path / "." / "mine.csv")):
        assert main(["simulate", "--model", f"resnet50,{name}", "--gpus", "4", "--csv", name]) == 2
        assert f"--csv {name}: that is the input file" in capsys.readouterr().err
    assert trace_path.read_bytes() == before
    out = tmp_path / "out.csv"  # (another file: written)
    assert main(["simulate", "--model", str(trace_path), "--gpus", "4", "--csv", str(out)]) == 0
    assert out.exists()
