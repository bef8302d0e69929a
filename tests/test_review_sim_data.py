"""Regression tests for review findings in the simulator, the planner's input checks and the data."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import numpy as np
import pytest
import torch

from ringtrain import data
from ringtrain.cli import main
from ringtrain.data import mix
from ringtrain.data import text as text_mod
from ringtrain.plan import check_vector
from ringtrain.sim import cli as sim_cli
from ringtrain.sim import costs
from ringtrain.sim.clusters import custom, resolve_many
from ringtrain.sim.simulator import predict
from ringtrain.sim.traces import Layer, Trace, _forward_order, profile_module
from thread_harness import raise_first, run_comms

pytestmark = pytest.mark.timeout(60)


class _AttnNet(torch.nn.Module):
    """A root-level parameter used at the input, then a linear layer, attention and a head."""

    def __init__(self):
        super().__init__()
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, 4, 8))  # held by the root, used first
        self.inp = torch.nn.Linear(8, 8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)  # in_proj_weight: a non-leaf's
        self.head = torch.nn.Linear(8, 3)  # attn.out_proj's forward is never called as a module

    def forward(self, x):
        h = self.inp(x + self.pos_embed)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(1))


def test_profile_module_orders_gradient_layers_by_measured_ready_time():
    torch.manual_seed(0)
    net = _AttnNet()
    batch = (torch.randn(5, 4, 8), torch.randint(0, 3, (5,)))
    t = profile_module(net, lambda: batch, torch.nn.functional.cross_entropy, repeats=1, warmup=0)
    names, times, sizes = t.gradient_layers()
    # backward order: the head's gradient arrives first, the input's parameter last
    assert names == ["head", "attn.out_proj", "attn", "inp", "(root)"]
    assert sizes[names.index("(root)")] == 4 * 8 * 4
    assert sum(sizes) == sum(p.numel() * 4 for p in net.parameters())


def test_forward_order_keeps_parameter_free_leaves_after_their_gradient_leaf():
    order = ["act0", "conv", "relu", "fc", "drop"]
    ready = {"fc": 1.0, "conv": 2.0, "(root)": 3.0}
    got = _forward_order(order, ["(root)", "conv", "fc", "unused"], ready)
    assert got == ["act0", "(root)", "conv", "relu", "fc", "drop", "unused"]


# --- cluster names ------------------------------------------------------------------------

def test_auto_cluster_names_include_every_non_default_field():
    got = resolve_many(["alpha=1e-5,beta=1e-9", "alpha=1e-5,beta=1e-9,gamma=1e-10", "alpha=1e-5,beta=1e-9,servers=4",
                        "alpha=1e-5,beta=1e-9,gpus_per_node=4", "alpha=1e-5,beta=1e-9,gpus_per_node=8"])
    assert [c.name for c in got] == ["alpha=1e-05,beta=1e-09", "alpha=1e-05,beta=1e-09,gamma=1e-10",
                                     "alpha=1e-05,beta=1e-09,servers=4", "alpha=1e-05,beta=1e-09,gpus_per_node=4",
                                     "alpha=1e-05,beta=1e-09#2"]  # the last equals the first: suffixed
    assert custom("alpha=1.0000001e-5,beta=1e-9").name == "alpha=1.0000001e-05,beta=1e-09"  # not cut by %g


def test_clusters_of_one_name_are_told_apart(tmp_path):
    rows = [{"algorithm": "ring", "transport": "tcp", "world_size": 4, "nbytes": n, "median_s": 1e-4 + 1e-9 * n}
            for n in (1e3, 1e5, 1e7)]
    paths = []
    for i, d in enumerate(("x", "y")):
        (tmp_path / d).mkdir()
        path = tmp_path / d / "bench.json"
        path.write_text(json.dumps({"rows": [dict(r, median_s=r["median_s"] * (i + 1)) for r in rows]}))
        paths.append(str(path))
    assert [c.name for c in resolve_many(paths)] == ["bench:bench", "bench:bench#2"]
    assert [c.name for c in resolve_many(["10GbE,10GbE", "alpha=1,beta=1,name=10GbE#2"])] == [
        "10GbE", "10GbE#2", "10GbE#2#2"]


def test_simulate_keeps_a_row_per_cluster_that_differs_only_in_gamma(capsys):
    rc = main(["simulate", "--model", "resnet50", "--cluster", "alpha=1e-5,beta=1e-9",
               "--cluster", "alpha=1e-5,beta=1e-9,gamma=1e-9", "--gpus", "16", "--schedules", "wfbp"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    assert len(lines) == 2 and "gamma=1e-09" in lines[1] and "gamma" not in lines[0]


# --- seeds, zero compute, --plot, planner input -------------------------------------------

@pytest.mark.parametrize("seed", [np.int64(7), np.uint64(7), np.int32(7)])
def test_mix_takes_numpy_integer_seeds(seed):
    assert mix(seed, 3) == mix(7, 3)


def test_mix_wraps_negative_and_large_values_as_64_bit_integers():
    assert mix(-1) == mix(2**64 - 1) == mix(np.int64(-1))
    assert mix(2**64 + 5) == mix(5)
    for bad in (1.5, "3", True):
        with pytest.raises(ValueError, match="integers"):
            mix(bad)


def test_a_trace_without_compute_is_refused_not_divided_by():
    trace = Trace("idle", (Layer("a", 0.0, 0.0, 400, 100),), batch_size=4)
    for p in (1, 4):
        with pytest.raises(ValueError, match="all 0"):
            predict(trace, 1e-5, 1e-9, p)


def test_simulate_plot_without_matplotlib_exits_before_the_sweep(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))

    def no_sweep(*args, **kwargs):
        raise AssertionError("swept before checking for matplotlib")

    monkeypatch.setattr(sim_cli, "sweep", no_sweep)
    rc = main(["simulate", "--model", "resnet50", "--cluster", "10GbE", "--gpus", "4", "--plot", str(tmp_path)])
    assert rc == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("values, bad", [([1.0, True], "[1] = True"), ([1, "2"], "[1] = '2'"),
                                         (np.array([True, False]), "[0] = True"), (np.array(["1"]), "[0] = '1'"),
                                         ([1.0, None], "[1] = None"), ([1 + 1j], "[0] = (1+1j)")])
def test_check_vector_refuses_bools_and_strings(values, bad):
    with pytest.raises(ValueError, match=re.escape(f"sizes{bad}; every entry must be an integer or a float")):
        check_vector("sizes", values)


def test_check_vector_still_takes_numbers_of_any_numeric_type():
    for values in ([1, 2.5], (np.int64(3), np.float32(0.5)), np.arange(3, dtype=np.uint8), [], range(2),
                   torch.tensor([1.0, 2.0])):
        assert check_vector("v", values).dtype == np.float64
    with pytest.raises(ValueError, match="finite"):
        check_vector("v", [1.0, float("inf")])


# --- fitted network profiles --------------------------------------------------------------

def test_a_fitted_profile_applies_the_algorithm_and_its_options():
    fitted = costs.network("mgwfbp-10GbE-16")
    n = np.array([1e3, 1e6, 1e8])
    link = costs.link_from_fit(fitted.alpha, fitted.beta + fitted.gamma, 16)  # the same inversion as sim.clusters'
    assert fitted.cost(16)(n) == pytest.approx(9.08e-4 + 7.40e-10 * n, rel=1e-12)  # ring: the fit itself
    assert costs.allreduce_time(n, 16, "ring", *link) == pytest.approx(fitted.cost(16)(n), rel=1e-12)
    for algorithm, options in [("halving_doubling", {}), ("naive", {}), ("ps", {"servers": 1}), ("ps", {"servers": 4})]:
        want = costs.allreduce_time(n, 16, algorithm, *link, **options)
        assert np.array_equal(fitted.cost(16, algorithm, **options)(n), want)
    assert not np.allclose(fitted.cost(16, "ps", servers=1)(n), fitted.cost(16, "ps", servers=4)(n))
    assert not np.allclose(fitted.cost(16, "naive")(n), fitted.cost(16)(n))
    with pytest.raises(ValueError, match="servers"):
        fitted.cost(16, "ring", servers=2)
    with pytest.raises(ValueError, match="fitted on 16 workers"):
        fitted.cost(8, "naive")
    with pytest.raises(ValueError, match="fitted_world_size"):
        costs.NetworkProfile("one", 1e-4, 1e-9, "test", fitted_world_size=1)


# --- the text corpus ----------------------------------------------------------------------

def test_text_corpus_skips_build_specific_files(tmp_path):
    (tmp_path / "a.py").write_bytes(b"AA")
    for name in ("_sysconfigdata__linux_x86_64-linux-gnu.py", "site.py", "sitecustomize.py", "usercustomize.py",
                 "_distutils_system_mod.py"):
        (tmp_path / name).write_bytes(b"BUILD")
    (tmp_path / "config-3.11-x86_64-linux-gnu").mkdir()
    (tmp_path / "config-3.11-x86_64-linux-gnu" / "python-config.py").write_bytes(b"BUILD")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "b.py").write_bytes(b"BB")
    corpus = data.text_corpus(max_bytes=100, root=str(tmp_path))
    assert corpus.data == b"AABB" and corpus.files == ("a.py", "pkg/b.py")
    stdlib = data.text_corpus()
    assert not any(f.startswith("_sysconfigdata") or f in ("site.py", "sitecustomize.py") for f in stdlib.files)


def _corpus_check(text_of_rank):
    def body(comm):
        try:
            data.check_same_corpus(comm, text_of_rank(comm.rank))
        except ValueError as exc:
            return str(exc)
        return None
    return raise_first(run_comms(3, body))


def test_check_same_corpus_names_the_ranks_that_read_other_text():
    same = _corpus_check(lambda r: data.TextWindows(b"abc" * 50, seq_len=8))
    assert same == [None, None, None]
    msgs = _corpus_check(lambda r: b"abc" * 50 if r != 1 else b"abd" * 50)
    assert len(set(msgs)) == 1 and msgs[0].startswith("rank 1 read a different text corpus from rank 0")
    assert "ranks 0, 2: 150 bytes" in msgs[0] and "same Python build" in msgs[0]
    corpus = data.TextCorpus(b"xyz" * 20, ("a.py",), "/r")
    msgs = _corpus_check(lambda r: corpus if r == 0 else data.TextCorpus(b"xyz" * (20 + r), ("a.py",), "/r"))
    assert msgs[2].startswith("ranks 1, 2 read a different text corpus") and "63 bytes" in msgs[2]


def test_check_same_corpus_does_not_communicate_for_synthetic_data():
    class NoComm:
        rank, world_size = 0, 2

        def allgather(self, buf):
            raise AssertionError("communicated")

    data.check_same_corpus(NoComm(), data.dataset("vectors"))


def test_check_same_corpus_in_store_compares_the_workers_of_a_job():
    """Through a real store (torch's HashStore: get waits for the key): the same text passes;
    rank 1's other text is an error on both ranks, naming rank 1; synthetic data sets nothing."""
    from datetime import timedelta

    import torch.distributed as dist

    from concurrent.futures import ThreadPoolExecutor

    def run(texts):
        store = dist.HashStore()
        store.set_timeout(timedelta(seconds=10))

        def one(rank):
            try:
                data.check_same_corpus_in_store(store, rank, len(texts), texts[rank])
            except ValueError as exc:
                return str(exc)

        with ThreadPoolExecutor(len(texts)) as pool:  # each rank waits for the others' keys
            return list(pool.map(one, range(len(texts)))), store

    assert run([b"abc" * 9, b"abc" * 9])[0] == [None, None]
    msgs, _ = run([b"abc" * 9, b"abd" * 9])
    assert msgs[0] is not None and msgs[1] is not None and msgs[1].startswith("rank 1 read a different text corpus")
    _, store = run([data.dataset("vectors"), data.dataset("vectors")])
    assert store.num_keys() == 0


def test_the_ring_worker_compares_corpora_before_training(monkeypatch):
    """train.worker on two thread ranks whose text corpora differ (rank 1's digest): both raise
    the corpus error before anything trains (wrapping the model would fail the test)."""
    import threading

    import ringtrain
    from ringtrain import lifecycle, train

    local = threading.local()
    monkeypatch.setattr(ringtrain, "init", lambda **kw: local.comm)
    monkeypatch.setattr(lifecycle, "die_with_parent", lambda: None)
    monkeypatch.setattr(text_mod.TextWindows, "digest", property(lambda self: f"{local.comm.rank == 1:064x}"))

    def trained(*args, **kwargs):
        raise AssertionError("training started before the corpora were compared")

    monkeypatch.setattr(ringtrain, "DistributedDataParallel", trained)
    cfg = train.TrainConfig(model="charlm", batch_size=4, steps=2, checkpoint_every=0)

    def body(comm):
        local.comm = comm
        with pytest.raises(ValueError, match="rank 1 read a different text corpus from rank 0") as info:
            train.worker(cfg)
        return str(info.value)

    raise_first(run_comms(2, body))


def _stdlib_error(monkeypatch, base):
    monkeypatch.setattr(text_mod, "stdlib_dir", lambda: base)
    data.text_corpus.cache_clear()
    try:
        with pytest.raises(ValueError) as info:
            data.text_corpus(max_bytes=1234)
    finally:
        data.text_corpus.cache_clear()
    return str(info.value)


def test_missing_or_zipped_stdlib_source_says_what_was_looked_for_and_what_to_do(monkeypatch, tmp_path):
    zipped = tmp_path / "python311.zip"
    zipped.write_bytes(b"PK")
    monkeypatch.setattr(sys, "path", [str(zipped)] + sys.path)
    msg = _stdlib_error(monkeypatch, tmp_path / "lib" / "python3.11")
    assert f"looked for in {str(tmp_path / 'lib' / 'python3.11')!r}" in msg
    assert "does not exist" in msg and str(zipped) in msg
    assert "root=" in msg and "'images' or 'vectors'" in msg
    stripped = tmp_path / "stripped"
    (stripped / "__pycache__").mkdir(parents=True)
    (stripped / "__pycache__" / "os.cpython-311.pyc").write_bytes(b"\0" * 8)
    assert "compiled .pyc files but no .py source" in _stdlib_error(monkeypatch, stripped)


@pytest.mark.timeout(60)
def test_a_second_check_in_the_same_store_meets_the_others_second():
    """Each worker checks its "train" text, then its "val" text, under the default key: rank 0's
    second check read what rank 1 had put for its first (train against val: 'rank 1 read a
    different text corpus'), since both checks used the same keys."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    corpus = data.TextCorpus(b"abcdefgh" * 40, ("a.py",), "/r")

    def one(rank):
        data.check_same_corpus_in_store(store, rank, 2, corpus.split("train"))
        if rank == 1:
            time.sleep(0.3)  # (a slower worker)
        data.check_same_corpus_in_store(store, rank, 2, corpus.split("val"))

    with ThreadPoolExecutor(2) as pool:
        assert [f.result() for f in [pool.submit(one, r) for r in range(2)]] == [None, None]
