"""Reference models: registry, sizes, deterministic init, determinism, data-parallel equivalence."""

from __future__ import annotations

import pytest
import torch

from ringtrain import data, models

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the machine's cores are shared, and OpenMP threads spinning
    against other processes make small models many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

# Exact sizes of the defaults, as documented in the modules (a change must update the docs).
DOCUMENTED = {
    "charlm-transformer": (891_904, 54, 28),
    "charlm-lstm": (938_240, 11, 3),
    "resnet": (4_375_770, 107, 71),
    "mlp": (21_020_682, 6, 3),
}

# Small variants keep the gradient tests fast.
SMALL = {
    "charlm-transformer": dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=16),
    "charlm-lstm": dict(embed_dim=16, hidden_size=32),
    "resnet": dict(widths=(4, 8), blocks_per_stage=1, image_size=8, norm="group"),
    "mlp": dict(in_features=16, hidden=(32, 32)),
}


def small_batch(name, model, n, seed):
    if name.startswith("charlm"):
        return model.make_batch(n, seed=seed, seq_len=12)
    return model.make_batch(n, seed=seed)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_documented_sizes(name):
    d = models.describe(name)
    assert (d["num_params"], d["num_param_tensors"], d["num_layers"]) == DOCUMENTED[name]
    assert d["gradient_bytes"] == 4 * d["num_params"]
    assert d["dataset"] in data.KINDS


def test_names_and_alias():
    assert models.names() == ["charlm", "charlm-lstm", "charlm-transformer", "mlp", "resnet"]
    assert type(models.build("charlm")) is models.CharTransformer


def test_bad_arguments_name_the_choices():
    with pytest.raises(ValueError, match="model must be one of .*resnet"):
        models.build("vgg")
    with pytest.raises(ValueError, match="bad argument for model 'mlp'"):
        models.build("mlp", width=3)
    with pytest.raises(ValueError, match=r"norm must be one of \('batch', 'group', 'none'\)"):
        models.build("resnet", norm="layer")
    with pytest.raises(ValueError, match="d_model .* divisible by n_heads"):
        models.build("charlm", d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        models.build("charlm-lstm", hidden_size=0)
    with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
        models.build("charlm", **SMALL["charlm-transformer"])(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_seeded_init_is_reproducible_and_private(name):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = models.build(name, seed=5, **SMALL[name])
    assert torch.equal(torch.rand(3), expected_next), "build() must not consume the caller's random numbers"
    b = models.build(name, seed=5, **SMALL[name])
    c = models.build(name, seed=6, **SMALL[name])
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_forward_backward_shapes_and_determinism(name):
    grads = []
    for _ in range(2):
        model = models.build(name, seed=1, **SMALL[name])
        x, y = small_batch(name, model, 4, seed=2)
        loss = model.loss(model(x), y)
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        grads.append([p.grad.clone() for p in model.parameters()])
    # Same inputs, same weights, same process: backward is bitwise repeatable on the CPU.
    assert all(torch.equal(g1, g2) for g1, g2 in zip(*grads))


@pytest.mark.parametrize("name", sorted(SMALL))
def test_mean_of_shard_gradients_is_the_full_batch_gradient(name):
    """What data parallelism relies on: the loss is a per-sample mean with no batch statistics
    (resnet with norm="group"), so averaging the gradients of p shards of a batch gives the
    gradient of the whole batch."""
    p, b = 3, 2
    model = models.build(name, seed=3, **SMALL[name])
    x, y = small_batch(name, model, p * b, seed=4)
    model.zero_grad()
    model.loss(model(x), y).backward()
    full = [q.grad.clone() for q in model.parameters()]
    shard_sum = [torch.zeros_like(q) for q in model.parameters()]
    for r in range(p):
        model.zero_grad()
        model.loss(model(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b]).backward()
        for acc, q in zip(shard_sum, model.parameters()):
            acc += q.grad
    for f, s in zip(full, shard_sum):
        # Tolerance: the two sides sum the same terms in a different order (float32).
        torch.testing.assert_close(s / p, f, rtol=1e-4, atol=1e-6)


def test_batchnorm_resnet_is_not_shard_equivalent_but_group_norm_is():
    """Documents why correctness tests use norm="group": BatchNorm's batch statistics differ per shard."""
    kw = dict(SMALL["resnet"], norm="batch")
    model = models.build("resnet", seed=3, **kw)
    x, y = model.make_batch(4, seed=4)
    whole = model(x)
    halves = torch.cat([model(x[:2]), model(x[2:])])
    assert not torch.allclose(whole, halves, atol=1e-4)
    model.eval()  # running statistics: per-sample again
    torch.testing.assert_close(model(x), torch.cat([model(x[:2]), model(x[2:])]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_make_batch_defaults_fit_the_model(name):
    x, y = models.make_batch(name, seed=0)
    s = models.spec(name)
    assert x.shape[0] == y.shape[0] == s.batch_size
    model = models.build(name)
    x2, y2 = models.make_batch(model, batch_size=2, seed=0)
    assert x2.shape[0] == 2
    with torch.no_grad():
        out = model(x2)
    assert model.loss(out, y2).dim() == 0
    if name.startswith("charlm"):
        assert x.shape == (32, 64) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("name, x, words", [
    ("charlm-transformer", torch.zeros(12, dtype=torch.long), ["(batch, seq_len) int64", "(12,)", "unsqueeze(0)"]),
    ("charlm-transformer", torch.zeros(2, 3, 8, dtype=torch.long), ["(batch, seq_len) int64", "(2, 3, 8)"]),
    ("charlm-transformer", torch.zeros(2, 8), ["(batch, seq_len) int64", "torch.float32"]),
    ("charlm-lstm", torch.zeros(12, dtype=torch.long), ["(batch, seq_len) int64", "(12,)", "unsqueeze(0)"]),
    ("resnet", torch.zeros(2, 1, 8, 8), ["(batch, 3, height, width)", "(2, 1, 8, 8)"]),
    ("resnet", torch.zeros(3, 8, 8), ["(batch, 3, height, width)", "(3, 8, 8)", "unsqueeze(0)"]),
    ("mlp", torch.zeros(2, 100), ["(batch, 16) float", "(2, 100)"]),
    ("mlp", torch.zeros(16), ["(batch, 16) float", "(16,)", "unsqueeze(0)"]),
])
def test_an_input_of_the_wrong_shape_is_a_value_error_naming_the_expected_one(name, x, words):
    model = models.build(name, **SMALL[name])
    with pytest.raises(ValueError) as caught:
        model(x)
    assert all(w in str(caught.value) for w in words), (str(caught.value), words)


def test_make_batch_and_describe_respect_a_shorter_max_seq_len():
    model = models.build("charlm", max_seq_len=32)
    x, y = models.make_batch(model)
    assert x.shape == y.shape == (32, 32)
    assert model.loss(model(x), y).dim() == 0
    assert models.make_batch("charlm", max_seq_len=16)[0].shape == (32, 16)
    assert models.describe("charlm", max_seq_len=16)["seq_len"] == 16
    assert models.describe("charlm")["seq_len"] == 64
    with pytest.raises(ValueError, match="seq_len=64 exceeds this model's max_seq_len=32"):
        model.make_batch(2, seq_len=64)


@pytest.mark.timeout(90)
def test_charlm_learns_the_stdlib_text():
    """The reference workload trains: a tiny LM's loss drops well below uniform (ln 256 = 5.55)."""
    torch.manual_seed(0)
    model = models.build("charlm", seed=0, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)
    loader = data.ShardedLoader(data.dataset("text", seq_len=32), batch_size=16, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        x, y = loader.next_batch()
        loss = model.loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0
    assert sum(losses[-10:]) / 10 < 3.6, losses[-10:]


def test_measuring_command_reports_sizes_and_times(capsys):
    import json

    from ringtrain.models.__main__ import main

    assert main(["charlm-lstm", "--steps", "1", "--warmup", "0", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["models"]
    assert row["num_params"] == DOCUMENTED["charlm-lstm"][0] and row["step_ms_median"] > 0
    with pytest.raises(SystemExit):
        main(["--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(SMALL))
def test_dataset_for_matches_the_model(name):
    model = models.build(name, **SMALL[name])
    ds = models.dataset_for(model, **({"max_bytes": 10_000} if name.startswith("charlm") else {"num_samples": 8}))
    x, y = ds.batch([0, 1])
    loss = model.loss(model(x), y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    if name == "charlm-transformer":
        assert x.shape == (2, 16)  # capped at the model's max_seq_len


def test_buffers_are_few_and_of_wire_friendly_dtypes():
    """DDP broadcasts buffers from rank 0: only BatchNorm's statistics, float32 and int64."""
    for name in ("charlm-transformer", "charlm-lstm", "mlp"):
        assert list(models.build(name, **SMALL[name]).buffers()) == []
    dtypes = {b.dtype for b in models.build("resnet", norm="batch", widths=(4,), blocks_per_stage=1).buffers()}
    assert dtypes == {torch.float32, torch.int64}


@pytest.mark.parametrize("widths, groups", [((12, 20), (6, 5)), ((6, 16), (6, 8)), ((9,), (3,))])
def test_group_norm_resnet_takes_widths_that_are_not_multiples_of_8(widths, groups):
    """GroupNorm took min(8, width) groups, which do not divide a width of 12, 20 or 9: the model
    failed to build with torch's 'num_channels (12) must be divisible by num_groups (8)'."""
    model = models.build("resnet", widths=widths, blocks_per_stage=1, image_size=8, norm="group")
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert sorted({(m.num_channels, m.num_groups) for m in norms}) == sorted(zip(widths, groups))
    x, y = models.make_batch(model, batch_size=2)
    model.loss(model(x), y).backward()


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_make_batch_of_size_0_is_refused_not_the_default(name):
    """batch_size=0 (a computed size that came out 0) gave the default batch of 32 samples."""
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        models.make_batch(models.build(name, **SMALL[name]), batch_size=0)


@pytest.mark.parametrize("seed, words", [
    (2**70, r"seed must be an integer in \[-2\*\*63, 2\*\*64\) .*got 1180591620717411303424"),
    (2**64, r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
    (1.5, "seed must be an integer, got 1.5"),  # (torch took it as 1: another seed's weights)
    (True, "seed must be an integer, got True"),
])
def test_a_seed_torch_cannot_take_is_a_value_error_naming_the_seed(seed, words):
    """torch's own error was "Overflow when unpacking long long", naming neither the seed nor the range."""
    with pytest.raises(ValueError, match=words):
        models.build("mlp", seed=seed)
    with pytest.raises(ValueError, match=words):
        models.make_batch("mlp", batch_size=2, seed=seed)
    for fits in (2**64 - 1, -(2**63)):
        models.build("mlp", seed=fits)
