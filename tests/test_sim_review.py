"""Review of `ringtrain simulate` / `ringtrain plan` inputs: files and options a user gets wrong."""

from __future__ import annotations

import json

import pytest

from ringtrain.cli import main
from ringtrain.sim import clusters
from ringtrain.sim.traces import load

pytestmark = pytest.mark.timeout(60)

CSV = "# model: m\n# batch_size: 4\nname,forward_s,backward_s,grad_bytes,params\na,0.1,0.2,100,25\nb,0.1,0.3,40,10\n"
DOC = {"model": "m", "batch_size": 4, "layers": [
    {"name": "a", "forward_s": 0.1, "backward_s": 0.2, "grad_bytes": 100, "params": 25},
    {"name": "b", "forward_s": 0.1, "backward_s": 0.3, "grad_bytes": 40, "params": 10}]}


def test_a_trace_file_with_a_byte_order_mark_loads(tmp_path):
    # Excel's "CSV UTF-8" (and Notepad) start the file with a BOM, often with Windows line endings:
    # the BOM made the first '# model:' line not a comment ("trace is missing the field 'model'"),
    # and a JSON file with a BOM was "Unexpected UTF-8 BOM".
    plain = load(_write(tmp_path / "plain.csv", CSV.encode()))
    excel = load(_write(tmp_path / "excel.csv", b"\xef\xbb\xbf" + CSV.replace("\n", "\r\n").encode()))
    assert excel == plain
    as_json = load(_write(tmp_path / "bom.json", b"\xef\xbb\xbf" + json.dumps(DOC).encode()))
    assert as_json == plain


def test_a_csv_row_with_more_values_than_columns_is_refused(tmp_path):
    # A row with a value too many (a stray comma in a name, a shifted row) was read with the extra
    # value silently dropped; a row short of values is refused already.
    long = CSV.replace("a,0.1,0.2,100,25", "a,0.1,0.2,100,25,7")
    with pytest.raises(ValueError, match=r"layers\[0\] has 6 values for the 5 columns"):
        load(_write(tmp_path / "long.csv", long.encode()))
    # (a stray comma in a name shifted every value: "conv,1" read as name "conv", forward_s 1)
    shifted = CSV.replace("a,0.1,0.2,100,25", "conv,1,0.1,0.2,100,25")
    with pytest.raises(ValueError, match=r"layers\[0\] has 6 values"):
        load(_write(tmp_path / "shifted.csv", shifted.encode()))
    # a trailing comma (an empty value past the last column) is not a value
    assert load(_write(tmp_path / "trailing.csv", CSV.replace("25\n", "25,\n").encode())) == load(
        _write(tmp_path / "plain.csv", CSV.encode()))


@pytest.mark.parametrize("option, value, message", [
    ("--gpus", "4,8,4", "--gpus: 4 given twice"),
    ("--schedules", "wfbp,optimal,wfbp", "--schedules: wfbp given twice"),
    ("--algorithms", "ring,ring", "--algorithms: ring given twice"),
])
def test_simulate_refuses_a_value_given_twice(option, value, message, capsys):
    # Each was accepted: --json and --csv then held every row twice (--gpus 4,4 --algorithms ring,ring
    # --schedules optimal,optimal: 8 identical rows), the table a column twice.
    argv = ["simulate", "--model", "lstm-ptb", "--cluster", "10GbE", "--gpus", "4", "--json", option, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"ringtrain simulate: {message}" in err


def test_plan_refuses_a_method_given_twice(capsys):
    assert main(["plan", "--model", "lstm-ptb", "--gpus", "4", "--methods", "optimal,optimal"]) == 2
    assert "ringtrain plan: --methods: optimal given twice" in capsys.readouterr().err


def test_plan_refuses_all_models_written_with_a_space(capsys):
    # --model ' all' (a shell variable with a space) passed plan's "exactly one model" check and
    # planned resnet50, the first of all the zoo models, without a word.
    assert main(["plan", "--model", " all", "--gpus", "4"]) == 2
    assert "ringtrain plan: --model: give exactly one" in capsys.readouterr().err


def test_a_cluster_key_given_twice_is_refused():
    # 'alpha=1e-5,beta=1e-9,alpha=2' ran with alpha=2 (the last one), silently.
    with pytest.raises(ValueError, match="alpha given twice"):
        clusters.custom("alpha=1e-5,beta=1e-9,alpha=2")


def test_a_csv_header_with_spaces_after_the_commas_loads(tmp_path):
    # 'name, forward_s, backward_s, ...' (as people type it) was 'layers[0] is missing the field
    # 'forward_s'' with the column there, while values with the same spaces were read.
    spaced = CSV.replace("name,forward_s,backward_s,grad_bytes,params", "name, forward_s, backward_s, grad_bytes, params")
    spaced = spaced.replace("a,0.1,0.2,100,25", "a, 0.1, 0.2, 100, 25")
    assert load(_write(tmp_path / "spaced.csv", spaced.encode())) == load(_write(tmp_path / "plain.csv", CSV.encode()))


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_layer_times_that_add_up_past_a_float_are_refused(tmp_path):
    # Each time was checked finite, their sum was not: two layers of 1e308 s made every total
    # inf, the predictions NaN, and --json wrote Infinity and NaN, which is not JSON.
    huge = CSV.replace("a,0.1,0.2,100,25", "a,1e308,1e308,100,25")
    with pytest.raises(ValueError, match="add up past what a float holds"):
        load(_write(tmp_path / "huge.csv", huge.encode()))
