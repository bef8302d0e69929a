"""Layer traces: validation, the planner's backward-order view, JSON/CSV files, profiling a module."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringtrain.sim.traces import Layer, Trace, dumps_csv, dumps_json, load, loads_csv, profile_module, save

pytestmark = pytest.mark.timeout(60)


def _trace(**kw):
    # forward order: input (no grad) -> A -> relu -> B -> pool; integer-valued times
    layers = [
        Layer("input", 1.0, 16.0, 0, 0),
        Layer("A", 2.0, 1.0, 40, 10),
        Layer("relu", 1.0, 2.0, 0, 0),
        Layer("B", 4.0, 4.0, 80, 20),
        Layer("pool", 1.0, 8.0, 0, 0),
    ]
    return Trace(model="toy", layers=tuple(layers), batch_size=kw.get("batch_size", 8), optimizer_s=0.5)


def test_gradient_layers_fold_parameter_free_layers_into_the_next_gradient_layer():
    names, times, sizes = _trace().gradient_layers()
    assert names == ["B", "A"]
    assert times == [8.0 + 4.0, 2.0 + 1.0]  # pool's backward runs before B's; relu's before A's
    assert sizes == [80, 40]
    t = _trace()
    assert t.backward_s - sum(times) == 16.0  # the input layer's tail after the last gradient


def test_totals():
    t = _trace()
    assert (t.forward_s, t.backward_s, t.grad_bytes, t.params) == (9.0, 31.0, 120, 30)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="", forward_s=1, backward_s=1, grad_bytes=0, params=0), "name"),
        (dict(name="x", forward_s=-1, backward_s=1, grad_bytes=0, params=0), "forward_s"),
        (dict(name="x", forward_s=1, backward_s=float("nan"), grad_bytes=0, params=0), "backward_s"),
        (dict(name="x", forward_s=1, backward_s=1, grad_bytes=-4, params=0), "grad_bytes"),
    ],
)
def test_layer_rejects_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layer(**kwargs)


def test_trace_rejects_bad_fields():
    ok = (Layer("a", 1, 1, 4, 1),)
    with pytest.raises(ValueError, match="batch_size"):
        Trace("m", ok, batch_size=0)
    with pytest.raises(ValueError, match="no layer produces a gradient"):
        Trace("m", (Layer("a", 1, 1, 0, 0),), batch_size=1)
    with pytest.raises(ValueError, match="at least one layer"):
        Trace("m", (), batch_size=1)


def test_json_and_csv_round_trip_exactly(tmp_path):
    t = _trace()
    for suffix in ("json", "csv"):
        save(t, tmp_path / f"t.{suffix}")
        assert load(tmp_path / f"t.{suffix}") == t
    assert json.loads(dumps_json(t))["layers"][1] == {"name": "A", "forward_s": 2.0, "backward_s": 1.0,
                                                       "grad_bytes": 40, "params": 10}
    assert dumps_csv(t).splitlines()[:2] == ["# model: toy", "# batch_size: 8"]


_floats = st.floats(min_value=0, max_value=1e3, allow_nan=False, allow_infinity=False)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_floats, _floats, st.integers(1, 10**12)), min_size=1, max_size=6))
def test_csv_round_trip_any_values(rows):
    t = Trace("m", tuple(Layer(f"l{i}", f, b, g, g // 4) for i, (f, b, g) in enumerate(rows)), batch_size=3)
    assert loads_csv(dumps_csv(t)) == t


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="suffix"):
        load(tmp_path / "t.txt")
    with pytest.raises(ValueError, match="cannot read"):
        load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "m", "batch_size": 1, "layers": [{"name": "a"}]}))
    with pytest.raises(ValueError, match="forward_s"):
        load(bad)



_ROW = {"name": "a", "forward_s": 0.1, "backward_s": 0.2, "grad_bytes": 40, "params": 10}


@pytest.mark.parametrize(
    "doc, match",
    [
        ([], r"a trace is an object .* got list"),
        (5, r"a trace is an object .* got int"),
        ({"model": "m", "batch_size": 1, "layers": {"a": 1}}, r"layers must be a list"),
        ({"model": "m", "batch_size": 1, "layers": [_ROW, 7]}, r"layers\[1\] must be an object"),
        ({"model": "m", "batch_size": 1, "layers": [dict(_ROW, forward_s="abc")]}, r"layers\[0\]\.forward_s = 'abc' is not a number"),
        ({"model": "m", "batch_size": 1, "layers": [dict(_ROW, backward_s=None)]}, r"layers\[0\] is missing the field 'backward_s'"),
        ({"model": "m", "batch_size": 1, "layers": [dict(_ROW, grad_bytes=10.7)]}, r"layers\[0\]\.grad_bytes = 10\.7 is not a whole number"),
        ({"model": "m", "batch_size": 1, "layers": [dict(_ROW, grad_bytes=float("inf"))]}, r"grad_bytes = inf is not a whole"),
        ({"model": "m", "batch_size": 1, "layers": [dict(_ROW, params="many")]}, r"layers\[0\]\.params = 'many'"),
        ({"model": "m", "batch_size": 32.5, "layers": [_ROW]}, r"batch_size = 32\.5 is not a whole number"),
        ({"model": "m", "batch_size": True, "layers": [_ROW]}, r"batch_size = True is not a whole number"),
        ({"model": "m", "batch_size": 1, "optimizer_s": None, "layers": [_ROW]}, r"optimizer_s = None is not a number"),
        # (these three were taken as the names 'None', "['a']" and 'True')
        ({"model": None, "batch_size": 1, "layers": [_ROW]}, r"model = None is not text"),
        ({"model": "m", "batch_size": 1, "layers": [dict(_ROW, name=["a"])]}, r"layers\[0\]\.name = \['a'\] is not text"),
        ({"model": "m", "batch_size": 1, "sample_unit": True, "layers": [_ROW]}, r"sample_unit = True is not text"),
    ],
)
def test_trace_file_errors_name_the_field_and_do_not_truncate(tmp_path, doc, match):
    # Was: 10.7 bytes and batch_size 32.5 or true silently truncated to 10, 32 and 1; an infinite
    # size an OverflowError traceback; a wrong type Python's own message naming nothing.
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        load(path)


def test_trace_file_counts_may_be_written_as_whole_floats(tmp_path):
    # 4e6 bytes in a CSV was "invalid literal for int()", though the same value in JSON loaded.
    csv_text = "# model: m\n# batch_size: 4\nname,forward_s,backward_s,grad_bytes,params\na,0.1,0.1,4e6,1e6\n"
    (tmp_path / "t.csv").write_text(csv_text)
    (tmp_path / "t.json").write_text(json.dumps({"model": "m", "batch_size": 4.0, "layers": [
        {"name": "a", "forward_s": 0.1, "backward_s": 0.1, "grad_bytes": 4e6, "params": 1e6}]}))
    for suffix in ("csv", "json"):
        t = load(tmp_path / f"t.{suffix}")
        assert (t.batch_size, t.layers[0].grad_bytes, t.layers[0].params) == (4, 4_000_000, 1_000_000)
        assert isinstance(t.layers[0].grad_bytes, int)


def test_a_short_csv_row_and_a_binary_file_are_named(tmp_path):
    short = tmp_path / "short.csv"
    short.write_text("# model: m\n# batch_size: 4\nname,forward_s,backward_s,grad_bytes,params\na,0.1,0.1\n")
    with pytest.raises(ValueError, match=r"short.csv: not a valid trace: layers\[0\] is missing the field 'grad_bytes'"):
        load(short)
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=r"cannot read trace file .*b.json: not UTF-8 text"):
        load(binary)


def test_a_csv_header_that_names_a_column_twice_is_refused():
    # (the last column of the name was read: grad_bytes 999999999 where the first said 4000, silently)
    text = ("# model: m\n# batch_size: 4\nname,forward_s,backward_s,grad_bytes,params,grad_bytes\n"
            "a,0.1,0.1,4000,1,999999999\n")
    with pytest.raises(ValueError, match="the header names the column 'grad_bytes' twice"):
        loads_csv(text)
    with pytest.raises(ValueError, match="the header names the column 'name' twice"):  # (spaces are stripped)
        loads_csv("# model: m\n# batch_size: 4\nname, name ,forward_s,backward_s,grad_bytes,params\na,b,0.1,0.1,4,1\n")
    # (empty columns, as a spreadsheet's trailing commas, are still taken)
    assert loads_csv("# model: m\n# batch_size: 4\nname,forward_s,backward_s,grad_bytes,params,,\n"
                     "a,0.1,0.1,4,1,,\n").layers[0].grad_bytes == 4

def test_a_csv_whose_metadata_gives_a_key_twice_is_refused_naming_the_key_and_lines(tmp_path):
    # (the last batch_size, 64, was kept silently where the first said 4, as a column named twice was)
    text = "# model: m\n# batch_size: 4\n# source: x\n# batch_size: 64\nname,forward_s,backward_s,grad_bytes,params\n" \
           "a,0.1,0.1,4000,1\n"
    with pytest.raises(ValueError, match="line 4 gives the metadata 'batch_size' again \\(line 2 gave it first\\)"):
        loads_csv(text)
    (tmp_path / "t.csv").write_text(text)
    with pytest.raises(ValueError, match="t.csv: .*line 4 gives the metadata 'batch_size' again"):
        load(tmp_path / "t.csv")
    # (comments that are not metadata keys may still repeat)
    assert loads_csv("# note: a\n# note: b\n# model: m\n# batch_size: 4\n"
                     "name,forward_s,backward_s,grad_bytes,params\na,0.1,0.1,4,1\n").batch_size == 4


class _Net(torch.nn.Module):
    """A conv, a parameter-free ReLU, a linear layer and a functional op outside any leaf."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.act = torch.nn.ReLU()
        self.fc = torch.nn.Linear(4 * 8 * 8, 5)
        self.scale = torch.nn.Parameter(torch.ones(5))  # held directly by the root

    def forward(self, x):
        y = self.act(self.conv(x)).flatten(1)
        return self.fc(y) * self.scale


@pytest.mark.timeout(30)
def test_profile_module_measures_every_layer_and_counts_bytes_exactly():
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    batch = (torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,)))
    t = profile_module(net, lambda: batch, torch.nn.functional.cross_entropy, name="net", optimizer=opt, repeats=2)
    by_name = {layer.name: layer for layer in t.layers}
    assert [n for n in by_name if n != "(other)"][:3] == ["conv", "act", "fc"]  # first-forward-call order
    assert by_name["conv"].grad_bytes == (4 * 3 * 9 + 4) * 4 and by_name["conv"].params == 4 * 3 * 9 + 4
    assert by_name["fc"].grad_bytes == (5 * 256 + 5) * 4
    assert by_name["(root)"].grad_bytes == 5 * 4
    assert by_name["act"].grad_bytes == 0 and by_name["act"].backward_s == 0.0
    assert t.grad_bytes == sum(p.numel() * 4 for p in net.parameters())
    assert t.batch_size == 6 and t.model == "net" and t.optimizer_s > 0
    assert all(layer.forward_s >= 0 and layer.backward_s >= 0 for layer in t.layers)
    assert by_name["conv"].forward_s > 0 and by_name["fc"].backward_s > 0
    # the hooks are gone afterwards
    assert not net.conv._forward_hooks and not net.conv._forward_pre_hooks
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())


@pytest.mark.timeout(30)
def test_hooks_registered_before_a_failing_registration_are_removed():
    # The hooks were registered outside the try that removes them: those made before one failed stayed.
    class Refusing(torch.nn.Tanh):
        def register_forward_hook(self, hook, *args, **kwargs):
            raise RuntimeError("no hooks here")

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), Refusing(), torch.nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match="no hooks here"):
        profile_module(net, lambda: (torch.randn(2, 4), torch.randn(2, 2)), torch.nn.functional.mse_loss, repeats=1)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())


@pytest.mark.timeout(30)
def test_profile_module_counts_a_shared_parameter_once():
    lin = torch.nn.Linear(4, 4, bias=False)
    net = torch.nn.Sequential(lin, torch.nn.Tanh(), lin)
    t = profile_module(net, lambda: (torch.randn(2, 4), torch.randn(2, 4)), torch.nn.functional.mse_loss, repeats=1)
    assert t.grad_bytes == 16 * 4
    assert t.optimizer_s == 0.0


def test_numpy_numbers_make_a_trace_that_saves_and_loads(tmp_path):
    # Layer and Trace kept numpy numbers: save() wrote 'np.float64(0.002)' into a CSV that load()
    # refused, and raised "Object of type float32 is not JSON serializable" for JSON.
    t = Trace("m", (Layer("a", np.float32(0.5), np.float64(2e-3), np.int64(4096), np.int32(1024)),),
              batch_size=np.int64(8), optimizer_s=np.float64(1e-3))
    assert (type(t.layers[0].forward_s), type(t.layers[0].grad_bytes), type(t.batch_size)) == (float, int, int)
    for suffix in ("csv", "json"):
        save(t, tmp_path / f"t.{suffix}")
        assert load(tmp_path / f"t.{suffix}") == t
    # A wrong type is named, not a TypeError from a comparison ('<' not supported ...).
    for bad, match in [(dict(grad_bytes="4"), "grad_bytes = '4' is not a whole number"),
                       (dict(grad_bytes=4.5), "grad_bytes = 4.5 is not a whole number"),
                       (dict(params=float("nan")), "params = nan is not a whole number"),
                       (dict(forward_s="1"), "forward_s = '1' is not a number")]:
        with pytest.raises(ValueError, match=f"layer a: {match}"):
            Layer(**{**dict(name="a", forward_s=1, backward_s=1, grad_bytes=4, params=1), **bad})
    for batch in (None, 2.5, True):
        with pytest.raises(ValueError, match="trace m: batch_size = .* is not a whole number"):
            Trace("m", (Layer("a", 1, 1, 4, 1),), batch_size=batch)


@pytest.mark.parametrize("where", ["grad_bytes", "batch_size"])
def test_a_count_past_what_a_float_holds_is_named(tmp_path, where):
    # JSON reads 10**400 as an int: the sweep then stopped on "OverflowError: int too large to
    # convert to float" (a traceback); 1e400 was already "inf is not a whole number".
    doc = {"model": "m", "batch_size": 1, "layers": [dict(_ROW)]}
    if where == "batch_size":
        doc["batch_size"] = 10**400
    else:
        doc["layers"][0]["grad_bytes"] = 10**400
    (tmp_path / "t.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"trace m: {where} is over 1.8e308, past what a float holds"):
        load(tmp_path / "t.json")


@pytest.mark.parametrize("name", ["#conv", "# model: x", "a\nb", "x\n#y", "a\u2028b", "a\r\nb", "a\rb", "#a\rb",
                                  " sp "])
def test_csv_round_trips_layer_names_that_look_like_comments_or_break_lines(name):
    # '#conv' was written unquoted and read back as a comment: the layer and its gradient bytes
    # were dropped without a word; a quoted name over a line break was cut at the break.
    t = Trace("m", (Layer(name, 1.0, 2.0, 40, 10), Layer("z", 1.0, 1.0, 4, 1)), batch_size=3)
    assert loads_csv(dumps_csv(t)) == t


@pytest.mark.parametrize("text", [" my model ", "a\nb", "a\rb", '"quoted"', '"', "plain: with colon"])
def test_csv_round_trips_trace_names_and_sources_with_spaces_quotes_or_line_breaks(text):
    # Before: a model or source with a line break broke its comment line ("layers[0] has 5 values
    # for the 1 columns of the header (b)"), and spaces at its ends were stripped.
    t = Trace(text, (Layer("a", 1.0, 2.0, 40, 10),), batch_size=3, sample_unit=text, source=text)
    assert loads_csv(dumps_csv(t)) == t


def test_hand_written_csv_meta_values_are_read_as_written():
    text = '# model:  m  \n# batch_size: 2\n# source: "not json\nname,forward_s,backward_s,grad_bytes,params\na,1,1,4,1\n'
    t = loads_csv(text)
    assert (t.model, t.source) == ("m", '"not json')


def test_a_quote_inside_an_unquoted_csv_value_opens_nothing():
    # (csv's rule: a quote opens a value only at its start) the meta line after a hand-written
    # a"b row is still read as one
    text = "# model: m\nname,forward_s,backward_s,grad_bytes,params\na\"b,1,1,4,1\n# batch_size: 2\n"
    t = loads_csv(text)
    assert (t.layers[0].name, t.batch_size) == ('a"b', 2)
