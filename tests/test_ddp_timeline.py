"""Timeline: per-rank Chrome trace files, the PNG drawing, and per-iteration stats."""

from __future__ import annotations

import json
import math
import os
import threading
import warnings

import pytest
import torch
from torch import nn

from thread_harness import raise_first, run_comms
from ringtrain.ddp import DDPOptions, DistributedDataParallel, draw_timeline, trace_path
from ringtrain.ddp.timeline import TraceRecorder, hidden_fraction, overlap, timeline_rows
from test_ddp_support import make_model, rank_batch


def test_trace_path_inserts_the_rank():
    assert str(trace_path("out/trace.json", 3)) == "out/trace.rank3.json"
    assert str(trace_path("trace", 0)) == "trace.rank0.json"


def test_overlap_and_hidden_fraction():
    spans = [(0.0, 2.0), (3.0, 5.0)]
    assert overlap(spans, 1.0, 4.0) == 2.0
    assert hidden_fraction(spans, 1.0, 4.0) == 0.5
    assert hidden_fraction([], 0.0, 1.0) == 1.0
    assert hidden_fraction(spans, 0.0, 10.0) == 1.0


def test_recorder_stops_after_its_iterations(tmp_path):
    rec = TraceRecorder(tmp_path / "t.json", 0, 2, origin=0.0)
    for i in range(4):
        rec.span("forward", "forward", "compute", i, i + 0.5, iteration=i)
        rec.end_iteration()
    doc = json.loads((tmp_path / "t.rank0.json").read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["ts"] for e in spans] == [0.0, 1e6] and spans[0]["dur"] == 5e5
    with pytest.raises(ValueError):
        TraceRecorder(tmp_path / "t.json", 0, 0)


def test_the_file_is_written_at_every_power_of_two_so_a_kill_keeps_half(tmp_path):
    """Written only at the last recorded iteration or at close() before: a run SIGKILLed, or
    SIGTERMed by torchrun after a peer died, had no trace at all."""
    rec = TraceRecorder(tmp_path / "t.json", 0, 10, origin=0.0)
    seen = []
    for i in range(10):
        rec.span("forward", "forward", "compute", i, i + 0.5, iteration=i)
        rec.end_iteration()
        path = tmp_path / "t.rank0.json"
        doc = json.loads(path.read_text()) if path.exists() else {"traceEvents": []}
        seen.append(sum(e["ph"] == "X" for e in doc["traceEvents"]))
    assert seen == [1, 2, 2, 4, 4, 4, 4, 8, 8, 10]
    rec.close()


@pytest.mark.parametrize("name", ["folder", "folder/", "", "."])
def test_a_folder_for_a_timeline_is_refused_naming_a_file_to_give(tmp_path, monkeypatch, name):
    """It was taken for a file's stem: 'runs' wrote runs.rank0.json beside the folder, '' and '.'
    raised pathlib's "PosixPath('.') has an empty name"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="is a folder, not a trace file name; give a file such as"):
        trace_path(name, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def test_two_recorders_of_one_file_warn_and_a_closed_one_frees_it(tmp_path):
    first = TraceRecorder(tmp_path / "t.json", 0, 3)
    with pytest.warns(RuntimeWarning, match="already writes .*t.rank0.json; this one's trace will replace it"):
        second = TraceRecorder(tmp_path / "t.json", 0, 3)
    for rec in (first, second):
        rec.span("forward", "forward", "compute", 0.0, 1.0)
        rec.end_iteration()
    first.close()
    with pytest.warns(RuntimeWarning, match="already writes"):  # (the second still does)
        TraceRecorder(tmp_path / "t.json", 0, 3).release()  # (release: what a failed wrapper does)
    second.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = TraceRecorder(tmp_path / "t.json", 0, 3)  # free again: no warning
    third.span("forward", "forward", "compute", 0.0, 1.0)
    third.end_iteration()
    third.close()


def test_a_run_that_traced_no_iteration_says_so_at_close(tmp_path):
    """The docs' example on a short run: no file (or calibration alone), then draw_timeline's
    FileNotFoundError, with no word of why."""
    rec = TraceRecorder(tmp_path / "t.json", 0, 3)
    rec.span("profile exchange", "calibration", "communication", 0.0, 1.0)
    with pytest.warns(RuntimeWarning, match="no iteration was traced into .*t.rank0.json: recording starts"):
        rec.close()


def test_draw_timeline_draws_files_of_both_id_schemes(tmp_path):
    """pid rank + 1 and tids 1, 2 now; files written before (pid rank, tids 0, 1, e.g. in
    benchmarks/) draw as before, their lanes known by tid."""
    pytest.importorskip("matplotlib")
    old = {"traceEvents": [
        {"name": "forward", "cat": "forward", "ph": "X", "ts": 0.0, "dur": 5.0, "pid": 0, "tid": 0,
         "args": {"iteration": 1}},
        {"name": "allreduce bucket 0", "cat": "allreduce", "ph": "X", "ts": 1.0, "dur": 5.0, "pid": 0, "tid": 1,
         "args": {"iteration": 1}}]}
    (tmp_path / "old.rank0.json").write_text(json.dumps(old))
    rec = TraceRecorder(tmp_path / "new.json", 1, 1, origin=0.0)
    rec.span("forward", "forward", "compute", 0.0, 1e-5, iteration=1)
    rec.span("allreduce bucket 0", "allreduce", "communication", 0.0, 1e-5, iteration=1)
    rec.end_iteration()
    files = [tmp_path / "old.rank0.json", tmp_path / "new.rank1.json"]
    rows = timeline_rows(files)
    assert [label for label, _ in rows] == ["rank 0 compute", "rank 0 communication",
                                            "rank 1 compute", "rank 1 communication"]
    assert [[e["name"] for e in spans] for _, spans in rows] == [["forward"], ["allreduce bucket 0"]] * 2
    assert draw_timeline(files, tmp_path / "t.png").stat().st_size > 0
    rec.close()


@pytest.mark.timeout(60)
def test_draw_timeline_of_the_last_0_iterations_is_refused(tmp_path):
    """iterations=0 drew every iteration (its[-0:] is the whole list), as None does."""
    rec = TraceRecorder(tmp_path / "t.json", 0, 3, origin=0.0)
    for i in range(3):
        rec.span("forward", "forward", "compute", i, i + 0.5, iteration=i)
        rec.end_iteration()
    files = [tmp_path / "t.rank0.json"]
    assert [len(spans) for _, spans in timeline_rows(files, 2)] == [2, 0]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"iterations must be a positive integer or None \\(all\\), got {bad}"):
            timeline_rows(files, bad)
    rec.close()


def _comm_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("ringtrain-ddp-comm")}


@pytest.mark.parametrize("parent", ["file", "file/sub"])
def test_a_timeline_under_a_regular_file_is_refused_at_construction(tmp_path, parent):
    """Not at the first flush, from inside a backward pass ten iterations later; no thread left."""
    (tmp_path / "file").write_text("")
    target = tmp_path / parent / "t.json"
    before = _comm_threads()

    def body(comm):
        with pytest.raises(ValueError) as caught:
            DistributedDataParallel(nn.Linear(4, 2), comm, timeline=target)
        return str(caught.value)

    why, = raise_first(run_comms(1, body))
    assert f"{tmp_path / parent / 't.rank0.json'}" in why and "is a regular file" in why, why
    assert _comm_threads() == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a folder without write permission")
def test_a_timeline_in_a_folder_without_write_permission_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    with pytest.raises(ValueError, match=r"ro/t\.rank0\.json: Permission denied"):
        TraceRecorder(folder / "t.json", 0, 3)


def test_a_timeline_folder_is_made(tmp_path):
    rec = TraceRecorder(tmp_path / "a" / "b" / "t.json", 2, 3)
    assert rec.path.parent.is_dir() and list(rec.path.parent.iterdir()) == []


@pytest.mark.parametrize("cap", [True, math.inf, math.nan, -1.0, 0, "25"])
def test_bucket_cap_mb_must_be_a_finite_positive_number(cap):
    with pytest.raises(ValueError, match=r"bucket_cap_mb=.*finite number of MiB > 0"):
        DDPOptions(bucket_cap_mb=cap)
    assert DDPOptions(bucket_cap_mb=1).bucket_cap_mb == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("as_view", [True, False])
def test_trace_files_per_rank_and_png(tmp_path, as_view):
    target = tmp_path / "trace.json"

    def body(comm):
        ddp = DistributedDataParallel(make_model("mlp"), comm, schedule="wfbp", timeline=target,
                                      timeline_iterations=3, alpha=2e-5, beta=1e-9, warmup_iterations=0,
                                      profile_iterations=1, gradient_as_bucket_view=as_view)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for step in range(6):
            x, y = rank_batch("mlp", step, 2, comm.rank)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        path = ddp.timeline_path
        stats = list(ddp.stats)
        ddp.close()
        return path, stats

    results = raise_first(run_comms(2, body))
    names = [str(p) for p, _ in results]
    assert names == [str(tmp_path / "trace.rank0.json"), str(tmp_path / "trace.rank1.json")]
    for rank, (path, stats) in enumerate(results):
        events = json.loads(path.read_text())["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == {rank + 1}  # (not 0: Perfetto's idle task)
        names = {(e["name"], e.get("tid")): e["args"] for e in events if e["ph"] == "M"}
        assert names[("process_name", None)] == {"name": f"rank {rank}"}
        assert names[("thread_name", 1)] == {"name": "compute"} and names[("thread_name", 2)] == {"name": "communication"}
        iterations = sorted({e["args"]["iteration"] for e in spans if e["cat"] != "calibration"})
        assert iterations == [1, 2, 3]  # the first planned iteration and the two after it
        exchange = [e for e in spans if e["cat"] == "calibration"]
        assert [e["args"]["iteration"] for e in exchange] == [0] and exchange[0]["tid"] == 2
        cats = {e["cat"] for e in spans}
        assert {"forward", "backward", "allreduce", "wait"} <= cats
        comm_spans = [e for e in spans if e["cat"] == "allreduce"]
        assert all(e["tid"] == 2 for e in comm_spans) and len(comm_spans) == 3 * 12  # wfbp: one per parameter
        # Gradients that are views of their buckets need no copy back: one wait for the last
        # allreduce per iteration; else a copy per bucket, each after its allreduce.
        copies = [e for e in spans if e["cat"] == "copy"]
        assert len(copies) == (0 if as_view else 3 * 12)
        for it in (1, 2, 3):
            last_end = max(e["ts"] + e["dur"] for e in comm_spans if e["args"]["iteration"] == it)
            waits = [e for e in spans if e["cat"] == "wait" and e["args"]["iteration"] == it]
            if as_view:
                assert len(waits) == 1 and waits[0]["ts"] + waits[0]["dur"] >= last_end
            for k in range(12):
                done = next(e for e in comm_spans if e["args"]["iteration"] == it and e["name"] == f"allreduce bucket {k}")
                for c in copies:
                    if c["args"]["iteration"] == it and c["name"] == f"copy back bucket {k}":
                        assert c["ts"] >= done["ts"] + done["dur"]
        assert all(e["args"]["bytes"] > 0 for e in comm_spans)
        back = [e for e in spans if e["cat"] == "backward" and e["args"]["iteration"] == 2]
        assert len(back) == 12 and all(e["tid"] == 1 for e in back)
        assert len(stats) == 6
        for s in stats:
            assert 0.0 <= s.hidden_fraction <= 1.0 and s.comm_s > 0 and s.backward_s > 0
            assert 0.0 <= s.first_ready_s <= s.backward_s < s.forward_backward_s
            assert 0.0 < s.hooks_s < s.forward_backward_s and 0.0 <= s.broadcast_s <= s.forward_s
            assert s.overlap_bound_s == s.forward_s + max(s.backward_s, s.first_ready_s + s.comm_s)
            assert s.to_dict()["overlap_bound_s"] == s.overlap_bound_s
            assert s.buckets == (1 if s.iteration == 0 else 12)
    png = draw_timeline([p for p, _ in results], tmp_path / "timeline.png")
    assert png.stat().st_size > 10_000
    titled = draw_timeline([p for p, _ in results], tmp_path / "titled.png", title="mlp, wfbp schedule, 2 ranks")
    assert titled.read_bytes() != png.read_bytes()


def test_world_size_one_stats_have_no_communication():
    def body(comm):
        ddp = DistributedDataParallel(make_model("mlp"), comm)
        for step in range(3):
            x, y = rank_batch("mlp", step, 1, 0)
            nn.functional.mse_loss(ddp(x), y).backward()
        ddp.close()
        return list(ddp.stats)

    stats, = raise_first(run_comms(1, body))
    assert [s.buckets for s in stats] == [0, 0, 0]
    assert all(s.comm_s == 0 and s.hidden_fraction == 1.0 and s.forward_s > 0 for s in stats)


class _Sleep(torch.autograd.Function):
    """Identity whose backward sleeps: a slow layer between two fast ones."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        import time

        time.sleep(0.3)  # (300 ms: the peer has that long to reach the bucket too; 50 ms was thin on a loaded machine)
        return g


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(_Sleep.apply(self.a(x)))


@pytest.mark.timeout(60)
def test_allreduce_of_early_gradients_runs_during_backward(tmp_path):
    """WFBP: layer b's gradients are ready 300 ms before a's; b's bucket must be reduced inside
    that window, i.e. end before the training thread starts waiting at the end of backward."""

    def body(comm):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(_TwoLayers(), comm, schedule="wfbp", timeline=tmp_path / "t.json",
                                      timeline_iterations=2, alpha=1e-5, beta=1e-9, warmup_iterations=0,
                                      profile_iterations=1)
        for _ in range(3):
            ddp(torch.ones(2, 4)).sum().backward()
        ddp.close()
        return ddp.timeline_path, list(ddp.stats)

    for path, stats in raise_first(run_comms(2, body)):
        spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
        for it in (1, 2):
            mine = [e for e in spans if e.get("args", {}).get("iteration") == it]
            first = next(e for e in mine if e["name"] == "allreduce bucket 0")
            wait = next(e for e in mine if e["cat"] == "wait")
            assert first["ts"] + first["dur"] <= wait["ts"], "bucket 0 was not reduced during backward"
        assert all(s.buckets == 4 and s.hidden_fraction > 0.0 for s in stats[1:])
