"""scripts/bench_summary.py reads the saved benchmark results into the README's figures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("bench_summary", ROOT / "scripts" / "bench_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(model, impl, schedule, ms, **extra):
    return {"model": model, "impl": impl, "schedule": schedule, "median_iter_s": ms / 1e3, **extra}


def test_cells_mark_the_fastest_schedule_and_speed_up_over_ddp():
    rows = [_row("lm", "alone", "no communication", 100),
            _row("lm", "torch-ddp", "torch defaults", 150),
            _row("lm", "ringtrain", "optimal", 120, groups=3, hidden_fraction=0.9, sim_error=-0.04, vs_bound=1.2),
            _row("lm", "ringtrain", "single", 125, groups=1, hidden_fraction=0.0, sim_error=0.02, vs_bound=1.25)]
    cells = _script().ring_cells(rows)["lm"]
    assert cells["alone"] == "100" and cells["torch-ddp"] == "150"
    assert cells["optimal"] == "**120** (3 groups; 1.25×; 90%; -4%; 1.20)"
    assert cells["single"] == "125 (1.20×; 0%; +2%; 1.25)"
    stats = _script().ring_stats(rows)
    assert stats["configs"] == 1 and stats["near_fastest"] == 1 and stats["below_ddp"] == []


def test_optimal_below_ddp_and_far_from_the_fastest_is_counted():
    rows = [_row("lm", "torch-ddp", "torch defaults", 100),
            _row("lm", "ringtrain", "optimal", 110, groups=2),
            _row("lm", "ringtrain", "fixed", 100, groups=1)]
    stats = _script().ring_stats(rows)
    assert stats["near_fastest"] == 0
    assert stats["below_ddp"] == [("lm", pytest.approx(0.1))]
    assert stats["misses"] == [("lm", "fixed", pytest.approx(0.1), False)]  # 2 groups against 1: not the same plan


def test_a_faster_schedule_of_the_same_one_allreduce_is_named_as_noise(tmp_path, capsys):
    rows = [_row("lm", "torch-ddp", "torch defaults", 100),
            _row("lm", "ringtrain", "optimal", 99, groups=1),
            _row("lm", "ringtrain", "single", 95, groups=1)]
    assert _script().ring_stats(rows)["misses"] == [("lm", "single", pytest.approx(99 / 95 - 1), True)]
    path = tmp_path / "train-10gbit-2r-x.json"
    path.write_text(json.dumps({"benchmark": "train-10gbit-2r", "net": "10gbit", "world_size": 2, "rows": rows}))
    assert _script().main([str(path)]) == 0
    assert "in 0/1 (lm: single 4.2% faster with the same one allreduce: noise)" in capsys.readouterr().out


def test_compressed_rows_against_torchs_ddp_with_and_without_its_hook():
    rows = [_row("mlp", "torch-ddp", "torch defaults (25 MiB)", 930),
            _row("mlp", "ringtrain-compressed", "optimal+fp16", 620, groups=4, hidden_fraction=0.02),
            _row("mlp", "torch-ddp-compressed", "torch defaults + fp16_compress_hook", 651)]
    assert _script().compression_lines(rows) == [
        "- mlp: optimal+fp16 620 ms (1.50x torch DDP, 1.05x torch DDP with the hook; 4 groups, 2% hidden)", ""]
    assert _script().compression_lines(rows[:1]) == []


def test_torch_ddp_over_ringtrains_group_against_torch_ddp_over_gloo():
    rows = [_row("mlp", "torch-ddp", "torch defaults (25 MiB)", 900),
            _row("mlp", "torch-ddp-ringtrain", "torch defaults (25 MiB)", 750)]
    assert _script().group_lines(rows) == [
        "- mlp: torch DDP over ringtrain's process group 750 ms, over gloo 900 ms (1.20x)", ""]
    assert _script().group_lines(rows[1:]) == []


def test_parameter_server_ratios_round_by_round():
    rows = [_row("mlp", "ringtrain", "optimal", 1000, samples_per_s=100.0),
            _row("mlp", "ps", "ps-sync:1", 3000, samples_per_s=40.0, round_medians=[3.0, 3.2], sim_error=-0.05),
            _row("mlp", "ps", "ps-sharded:2", 2000, samples_per_s=68.0, round_medians=[1.5, 2.0])]
    text = "\n".join(_script().ps_lines(rows))
    assert "ps-sync:1 40 (sim -5%)" in text
    assert "2 sharded servers / 1: 1.70× (rounds 2.00/1.60)" in text
    assert "ps-sharded:2 0.68×" in text


def test_the_saved_results_read(capsys):
    files = sorted((ROOT / "benchmarks").glob("train-*.json"))
    if not files:
        pytest.skip("no saved training results")
    assert _script().main([str(f) for f in files]) == 0
    out = capsys.readouterr().out
    assert out.count("## train-") == len(files)
    assert "| charlm |" in out


def test_a_file_that_is_no_result_is_one_line(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": [{"model": "m"}]}))
    assert _script().main([str(bad)]) == 2
    assert "not a saved bench train, bench allreduce or overhead result" in capsys.readouterr().err
    for other in ([], 3):  # JSON that is no object was a traceback (TypeError: list indices must be integers)
        bad.write_text(json.dumps(other))
        assert _script().main([str(bad)]) == 2
        err = capsys.readouterr().err
        assert "not a saved bench train, bench allreduce or overhead result" in err and err.count("\n") == 1, err


def test_an_allreduce_result_gives_the_best_configuration_against_the_anchors(capsys):
    def row(impl, transport, algorithm, p, n, s, bw):
        return {"impl": impl, "transport": transport, "algorithm": algorithm, "world_size": p, "nbytes": n,
                "median_s": s, "busbw_GBps": bw}

    doc = {"benchmark": "allreduce-none", "commit": "abc1234", "command": "ringtrain bench allreduce",
           "rows": [row("gloo", "gloo", "torch.distributed", 2, 64 << 20, 0.0755, 0.89),
                    row("mpi", "mpi", "mpi4py", 2, 64 << 20, 0.0748, 0.90),
                    row("ringtrain", "shm", "ring", 2, 64 << 20, 0.031, 2.1),
                    row("ringtrain", "shm", "halving_doubling", 2, 64 << 20, 0.0291, 2.31),
                    row("gloo", "gloo", "torch.distributed", 2, 4096, 0.00174, 0.0),
                    row("ringtrain", "tcp", "auto", 2, 4096, 62e-6, 0.07)]}
    lines = _script().allreduce_lines(doc)
    assert lines[2] == "| 2 | 4 KiB | 1.74 ms (0.00) |  | 62 µs (0.07) | tcp/auto | 28.06× |", lines
    assert lines[3] == ("| 2 | 64 MiB | 75.5 ms (0.89) | 74.8 ms (0.90) | 29.1 ms (2.31) | shm/halving_doubling "
                        "| 2.59× |"), lines


def test_a_run_that_timed_horovod_has_its_column_and_one_that_did_not_has_none():
    def row(impl, s, bw):
        return {"impl": impl, "transport": impl, "algorithm": impl, "world_size": 2, "nbytes": 1 << 20,
                "median_s": s, "busbw_GBps": bw}

    rows = [row("gloo", 0.00291, 0.36), row("horovod", 0.0031, 0.34), row("ringtrain", 0.000525, 2.0)]
    lines = _script().allreduce_lines({"rows": rows})
    assert lines[:2] == ["| ranks | size | gloo | Open MPI | Horovod | ringtrain best | configuration | vs gloo |",
                         "|---|---|---|---|---|---|---|---|"], lines
    assert lines[2] == "| 2 | 1 MiB | 2.91 ms (0.36) |  | 3.1 ms (0.34) | 525 µs (2.00) | ringtrain/ringtrain | 5.54× |"
    assert "Horovod" not in _script().allreduce_lines({"rows": [rows[0], rows[2]]})[0]


def test_durations_read_in_the_unit_that_fits():
    duration = _script()._duration
    assert [duration(s) for s in (62e-6, 999.6e-6, 0.0755, 0.99996, 2.25)] == ["62 µs", "1 ms", "75.5 ms", "1 s",
                                                                                  "2.25 s"]


def test_the_saved_allreduce_and_overhead_results_read(capsys):
    files = sorted((ROOT / "benchmarks").glob("allreduce-*.json")) + sorted((ROOT / "benchmarks").glob("overhead-*.json"))
    if not files:
        pytest.skip("no saved allreduce or overhead results")
    assert _script().main([str(f) for f in files]) == 0
    out = capsys.readouterr().out
    assert out.count("## ") == len(files)
    assert ("| ringtrain best |" in out) == any(f.name.startswith("allreduce-") for f in files)
    assert ("| wrapped step |" in out) == any(f.name.startswith("overhead-") for f in files)


def test_ps_projection_reads_a_saved_parameter_server_run(capsys):
    files = [f for f in sorted((ROOT / "benchmarks").glob("train-*.json"))
             if any(r["impl"] == "ps" for r in json.loads(f.read_text())["rows"])]
    if not files:
        pytest.skip("no saved parameter-server result")
    spec = importlib.util.spec_from_file_location("ps_projection", ROOT / "scripts" / "ps_projection.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([str(files[-1]), "--servers", "1,4"]) == 0
    out = capsys.readouterr().out
    assert "1 server" in out and "4 servers" in out and "× the ring" in out
