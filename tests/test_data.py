"""Data without download: corpus, windows, synthetic sets, sharded sampling and exact resume."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ringtrain import data
from ringtrain.data import ShardedLoader, ShardedSampler, TextWindows, permutation, splitmix64

pytestmark = pytest.mark.timeout(30)


# --- the permutation ---------------------------------------------------------------------

def test_splitmix64_matches_the_reference_outputs():
    # Reference: Vigna's splitmix64 seeded with 0 (state += golden gamma before mixing).
    assert int(splitmix64(np.zeros(1, np.uint64))[0]) == 0xE220A8397B1DCDAF
    assert int(splitmix64(np.array([0x9E3779B97F4A7C15], np.uint64))[0]) == 0x6E789E6AA1B965F4


def test_permutation_is_fixed_across_versions_and_machines():
    # Pinned: a change here would silently change every run's data order.
    assert permutation(10, 0, 0).tolist() == [6, 1, 4, 0, 2, 7, 3, 8, 9, 5]
    for n in (0, 1, 2, 17, 1000):
        assert sorted(permutation(n, 3, 1).tolist()) == list(range(n))
    assert permutation(1000, 0, 0).tolist() != permutation(1000, 0, 1).tolist()
    assert permutation(1000, 0, 0).tolist() != permutation(1000, 1, 0).tolist()
    assert data.mix(1, 2) != data.mix(2, 1)
    assert data.mix(-1) == data.mix(2**64 - 1)  # values are taken modulo 2**64
    with pytest.raises(ValueError, match="integers"):
        data.mix(0.5)


# --- the sampler -------------------------------------------------------------------------

def take(sampler, steps):
    return [sampler.next_indices().tolist() for _ in range(steps)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_rank_slices_concatenate_to_the_single_process_batch(world_size, batch_size, shuffle):
    g = world_size * batch_size
    n = 5 * g + g - 1  # 5 global batches and a remainder (not a multiple of g when g > 1)
    steps = 12  # crosses two epoch boundaries (5 batches per epoch)
    ranks = [ShardedSampler(n, batch_size, rank=r, world_size=world_size, seed=9, shuffle=shuffle)
             for r in range(world_size)]
    single = ShardedSampler(n, world_size * batch_size, seed=9, shuffle=shuffle)
    per_rank = [take(s, steps) for s in ranks]
    expected = take(single, steps)
    for step in range(steps):
        joined = [i for r in range(world_size) for i in per_rank[r][step]]
        assert joined == expected[step], f"step {step}"
        assert len(set(joined)) == len(joined), f"ranks overlap at step {step}"
    # Each epoch visits distinct samples and drops only the remainder.
    for epoch in range(2):
        seen = [i for step in expected[epoch * 5:(epoch + 1) * 5] for i in step]
        assert len(seen) == len(set(seen)) == 5 * world_size * batch_size
    assert ranks[0].epoch == 2 and ranks[0].position == 2
    if not shuffle:
        assert expected[0] == list(range(world_size * batch_size))


def test_each_epoch_follows_its_own_order_and_the_dropped_remainder_changes():
    # 20 samples, global batch 6: 3 batches an epoch, 2 samples dropped. Epoch e visits the first
    # 18 entries of permutation(20, seed, e) in order, split over the ranks; reusing epoch 0's
    # order every epoch would drop the same 2 samples for ever.
    ranks = [ShardedSampler(20, 3, rank=r, world_size=2, seed=5) for r in range(2)]
    per_rank = [take(s, 9) for s in ranks]
    dropped = []
    for epoch in range(3):
        order = permutation(20, 5, epoch).tolist()
        visited = [i for step in range(3 * epoch, 3 * epoch + 3) for r in range(2) for i in per_rank[r][step]]
        assert visited == order[:18], f"epoch {epoch}"
        dropped.append(set(order[18:]))
    assert len({frozenset(d) for d in dropped}) == 3  # (true for seed 5; a different order each epoch)


def test_seek_stands_where_that_many_steps_leave_the_sampler():
    for steps in (0, 1, 11, 12, 13, 40):
        a, b = (ShardedSampler(100, 4, rank=1, world_size=2, seed=1) for _ in range(2))  # 12 batches an epoch
        take(a, steps)
        b.seek(steps)
        assert b.state_dict() == a.state_dict()
        assert np.array_equal(a.next_indices(), b.next_indices())
    with pytest.raises(ValueError, match="steps"):
        ShardedSampler(100, 4).seek(-1)


def test_sampler_resumes_exactly_and_across_world_sizes():
    a = ShardedSampler(100, 4, rank=1, world_size=2, seed=1)
    take(a, 17)  # epoch 1, position 5
    state = a.state_dict()
    assert (state["epoch"], state["position"]) == (1, 5)
    b = ShardedSampler(100, 4, rank=1, world_size=2, seed=1)
    b.load_state_dict(state)
    assert take(b, 20) == take(a, 20)
    # Same global batch split over 4 ranks instead of 2: the run continues with the same samples.
    single = ShardedSampler(100, 8, seed=1)
    single.load_state_dict(a.state_dict())
    quads = [ShardedSampler(100, 2, rank=r, world_size=4, seed=1) for r in range(4)]
    for q in quads:
        q.load_state_dict(a.state_dict())
    expected = take(single, 3)
    got = [take(q, 3) for q in quads]
    assert [[i for r in range(4) for i in got[r][s]] for s in range(3)] == expected


def test_sampler_refuses_a_state_it_cannot_continue():
    a = ShardedSampler(100, 4, seed=1)
    for other, key in ((ShardedSampler(100, 4, seed=2), "seed"), (ShardedSampler(101, 4, seed=1), "num_samples"),
                       (ShardedSampler(100, 5, seed=1), "global_batch_size"),
                       (ShardedSampler(100, 4, seed=1, shuffle=False), "shuffle")):
        with pytest.raises(ValueError, match=f"cannot resume: the saved sampler has {key}="):
            other.load_state_dict(a.state_dict())
    bad = dict(a.state_dict(), position=25)
    with pytest.raises(ValueError, match="outside"):
        ShardedSampler(100, 4, seed=1).load_state_dict(bad)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_samples=10, batch_size=0), "batch_size must be an integer >= 1"),
    (dict(num_samples=10, batch_size=True), "batch_size must be an integer >= 1"),
    (dict(num_samples=10, batch_size=2, rank=2, world_size=2), r"rank must be in \[0, world_size=2\)"),
    (dict(num_samples=10, batch_size=2, world_size=0), "world_size must be an integer >= 1"),
    (dict(num_samples=10, batch_size=6, world_size=2), "smaller than one global batch.*use a smaller batch_size"),
    # (no batch_size helps: it was told to use a smaller one all the same)
    (dict(num_samples=3, batch_size=1, world_size=4), "at most 3 ranks"),
    (dict(num_samples=0, batch_size=1), "the data set is empty"),
    (dict(num_samples=10, batch_size=2, seed=-1), "seed must be an integer >= 0"),
    # (a sampler standing at the end of an epoch would hand out empty batches for ever)
    (dict(num_samples=10, batch_size=2, position=5), "position must be < batches_per_epoch=5, got 5"),
])
def test_sampler_validates_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardedSampler(**kwargs)


# --- text ---------------------------------------------------------------------------------

def test_text_corpus_reads_the_stdlib_deterministically():
    corpus = data.text_corpus(max_bytes=300_000)
    assert len(corpus.data) == 300_000
    assert all(f.endswith(".py") for f in corpus.files)
    assert not any("site-packages" in f or "__pycache__" in f for f in corpus.files)
    data.text_corpus.cache_clear()
    again = data.text_corpus(max_bytes=300_000)
    assert again is not corpus and again.data == corpus.data and again.digest == corpus.digest
    first = (data.stdlib_dir() / corpus.files[0]).read_bytes()
    assert corpus.data.startswith(first[:300_000])


def test_text_corpus_walk_order_cap_and_skips(tmp_path):
    (tmp_path / "b.py").write_bytes(b"BBBB")
    (tmp_path / "a.py").write_bytes(b"AA")
    (tmp_path / "notes.txt").write_bytes(b"xx")
    for skipped in ("site-packages", "__pycache__"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "s.py").write_bytes(b"SS")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "c.py").write_bytes(b"CCC")
    whole = data.text_corpus(max_bytes=100, root=str(tmp_path))
    assert whole.data == b"AABBBBCCC"
    assert whole.files == ("a.py", "b.py", "pkg/c.py")
    cut = data.text_corpus(max_bytes=5, root=str(tmp_path))
    assert cut.data == b"AABBB" and cut.files == ("a.py", "b.py")
    with pytest.raises(ValueError, match="max_bytes must be an integer >= 2"):
        data.text_corpus(max_bytes=0, root=str(tmp_path))
    with pytest.raises(ValueError, match="root must be a directory"):
        data.text_corpus(root=str(tmp_path / "missing"))


def test_text_corpus_reads_a_directory_again_once_it_changed(tmp_path, monkeypatch):
    """Cached by its arguments, text_corpus returned the old text after a file under root was
    edited, added or removed, and a relative root named the directory it named at the first
    call, after a chdir. A read is now returned again only while nothing it walked changed."""
    (tmp_path / "a" / "pkg").mkdir(parents=True)
    (tmp_path / "a" / "m.py").write_bytes(b"x = 1\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "m.py").write_bytes(b"other\n")
    monkeypatch.chdir(tmp_path)
    first = data.text_corpus(root="a")
    assert first.data == b"x = 1\n" and data.text_corpus(root="a") is first  # (unchanged: the same read)
    (tmp_path / "a" / "m.py").write_bytes(b"x = 22\n")
    assert data.text_corpus(root="a").data == b"x = 22\n"
    time.sleep(0.02)  # (a directory's time may tick every few ms: the file is added on a later tick)
    (tmp_path / "a" / "pkg" / "n.py").write_bytes(b"y\n")
    assert data.text_corpus(root="a").data == b"x = 22\ny\n"
    (tmp_path / "a" / "pkg" / "n.py").unlink()
    assert data.text_corpus(root="a").data == b"x = 22\n"
    monkeypatch.chdir(tmp_path / "b")
    (tmp_path / "b" / "a").mkdir()
    (tmp_path / "b" / "a" / "z.py").write_bytes(b"z = 0\n")
    assert data.text_corpus(root="a").data == b"z = 0\n"


def test_text_windows_are_exact_slices_with_shifted_targets():
    text = bytes(range(256)) * 3
    ds = TextWindows(text, seq_len=10)
    assert len(ds) == (len(text) - 1) // 10
    x, y = ds.batch([0, 5, len(ds) - 1])
    for row, i in enumerate([0, 5, len(ds) - 1]):
        assert bytes(x[row].tolist()) == text[i * 10:i * 10 + 10]
        assert bytes(y[row].tolist()) == text[i * 10 + 1:i * 10 + 11]
    assert x.dtype == y.dtype == torch.int64
    with pytest.raises(IndexError):
        ds.batch([len(ds)])
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        TextWindows(text, seq_len=0)


@pytest.mark.parametrize("indices", [[[0, 5], [7, 2]], np.array([[3]]), 4, np.int64(4)])
def test_text_windows_read_indices_of_any_shape_flat_as_the_other_data_sets(indices):
    """A 2-D array of indices was a RuntimeError of torch's ("The size of tensor a (2) must
    match ..."), a (1, 1) one a batch of shape (1, 0, 11), and a single index an IndexError;
    the synthetic data sets read every one of them flat."""
    ds = TextWindows(bytes(range(256)) * 3, seq_len=10)
    flat = np.asarray(indices).reshape(-1).tolist()
    x, y = ds.batch(indices)
    want_x, want_y = ds.batch(flat)
    assert x.shape == y.shape == (len(flat), 10), (x.shape, y.shape)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert data.dataset("vectors", num_samples=10, in_features=3).batch(indices)[0].shape == (len(flat), 3)


def test_text_dataset_splits_do_not_overlap():
    corpus = data.text_corpus(max_bytes=200_000)
    train, val = corpus.split("train"), corpus.split("val")
    assert train + val == corpus.data and len(val) == 10_000
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'val'\)"):
        corpus.split("test")
    with pytest.raises(ValueError, match="dataset kind must be one of"):
        data.dataset("audio")
    with pytest.raises(ValueError, match="dataset 'text' accepts"):
        data.dataset("text", size=3)


# --- synthetic ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["images", "vectors"])
def test_synthetic_samples_do_not_depend_on_the_batch_they_are_in(kind):
    ds = data.dataset(kind, num_samples=50, seed=4)
    x_all, y_all = ds.batch(range(10))
    x_some, y_some = ds.batch([7, 2])
    assert torch.equal(x_some, x_all[[7, 2]]) and torch.equal(y_some, y_all[[7, 2]])
    other = data.dataset(kind, num_samples=50, seed=5)
    assert not torch.equal(other.batch(range(10))[0], x_all)
    val = data.dataset(kind, split="val", num_samples=50, seed=4)
    assert not torch.equal(val.batch(range(10))[0], x_all)
    teacher = "prototypes" if kind == "images" else "teacher"
    assert torch.equal(getattr(val, teacher), getattr(ds, teacher)), "validation must be the same task"
    assert int(y_all.min()) >= 0 and int(y_all.max()) < 10
    with pytest.raises(IndexError):
        ds.batch([50])
    with pytest.raises(ValueError, match=f"bad argument for dataset '{kind}'"):
        data.dataset(kind, colour=True)


def test_synthetic_labels_are_learnable():
    """Labels follow the teacher: nearest class prototype predicts images far above chance."""
    ds = data.SyntheticImages(num_samples=200, noise=1.0, seed=0)
    x, y = ds.batch(range(200))
    dist = ((x[:, None] - ds.prototypes[None]) ** 2).flatten(2).sum(2)
    assert (dist.argmin(1) == y).float().mean() > 0.9


# --- the loader ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["text", "images"])
def test_loader_resumes_with_identical_batches(kind):
    ds = data.dataset(kind, seq_len=16, max_bytes=20_000) if kind == "text" else data.dataset(kind, num_samples=40)
    a = ShardedLoader(ds, batch_size=3, rank=1, world_size=2, seed=7)
    for _ in range(9):
        a.next_batch()
    state = a.state_dict()
    b = ShardedLoader(ds, batch_size=3, rank=1, world_size=2, seed=7)
    b.load_state_dict(state)
    for _ in range(12):  # crosses an epoch boundary for both data sets
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert (a.epoch, a.position) == (b.epoch, b.position)


def test_loader_ranks_together_equal_one_process():
    ds = data.dataset("text", seq_len=8, max_bytes=5_000)
    ranks = [ShardedLoader(ds, batch_size=2, rank=r, world_size=3, seed=0) for r in range(3)]
    single = ShardedLoader(ds, batch_size=6, seed=0)
    for _ in range(4):
        parts = [loader.next_batch() for loader in ranks]
        x, y = single.next_batch()
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


class _Indices:
    """A data set whose batch is its sample indices: what a loader asked for, visibly."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def batch(self, indices):
        t = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return t, t


@pytest.mark.parametrize("shuffle", [True, False])
def test_loader_takes_the_samples_of_a_sampler_with_its_seed_and_shuffle(shuffle):
    """The loader's seed and shuffle reach its sampler (a loader that dropped either would still
    resume itself exactly and agree across ranks, but train on another order than asked)."""
    loader = ShardedLoader(_Indices(30), batch_size=2, rank=1, world_size=3, seed=4, shuffle=shuffle)
    sampler = ShardedSampler(30, 2, rank=1, world_size=3, seed=4, shuffle=shuffle)
    assert [loader.next_batch()[0].tolist() for _ in range(12)] == take(sampler, 12)


def test_loader_seek_stands_where_that_many_steps_leave_it():
    """A parameter-server worker resumes by seek(step): it must yield the batches an
    uninterrupted loader yields after that many steps, across an epoch boundary too."""
    ds = _Indices(30)  # global batch 6: 5 steps an epoch
    for steps in (0, 3, 5, 7, 11):
        ran = ShardedLoader(ds, batch_size=2, rank=2, world_size=3, seed=8)
        for _ in range(steps):
            ran.next_batch()
        sought = ShardedLoader(ds, batch_size=2, rank=2, world_size=3, seed=8)
        sought.seek(steps)
        assert (sought.epoch, sought.position) == (ran.epoch, ran.position) == divmod(steps, 5)
        assert [sought.next_batch()[0].tolist() for _ in range(6)] == [ran.next_batch()[0].tolist() for _ in range(6)]


def test_sampler_state_missing_a_key_is_refused():
    state = ShardedSampler(100, 4).state_dict()
    del state["position"]
    with pytest.raises(ValueError, match=r"lacks \['position'\]"):
        ShardedSampler(100, 4).load_state_dict(state)


def test_rank_0_state_restores_every_rank():
    """Checkpoints are written by rank 0 only: its loader state must resume the other ranks too."""
    ranks = [ShardedSampler(60, 2, rank=r, world_size=3, seed=2) for r in range(3)]
    for s in ranks:
        take(s, 7)
    state = ranks[0].state_dict()
    for r in range(3):
        fresh = ShardedSampler(60, 2, rank=r, world_size=3, seed=2)
        fresh.load_state_dict(state)
        assert take(fresh, 5) == take(ranks[r], 5)


def test_a_sampler_given_numpy_integers_keeps_a_state_a_checkpoint_takes(tmp_path):
    """Arguments of numpy's integer types (a batch size from an array) are accepted, and were kept
    as they came: state_dict() then held numpy.int64 and checkpoint.save refused the payload
    ('got int64'), though state_dict promises plain ints."""
    from ringtrain import checkpoint

    n = np.int64
    sampler = ShardedSampler(n(100), n(4), rank=n(1), world_size=n(2), seed=n(3))
    sampler.seek(n(13))
    loader = ShardedLoader(data.dataset("vectors", num_samples=64, in_features=4), batch_size=np.array([8])[0],
                           seed=n(3))
    loader.next_batch()
    for state in (sampler.state_dict(), loader.state_dict()):
        assert all(type(v) is int for v in state.values()), state
    net = torch.nn.Linear(4, 2)
    checkpoint.save(tmp_path, 1, checkpoint.training_state(1, net, loader=loader))
    assert checkpoint.latest(tmp_path).payload["data"] == loader.state_dict()
