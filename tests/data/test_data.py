"""verl row validation, parquet/jsonl reading and writing, and the `asyncrl data check` command."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.commands.data import _check_command
from asyncrl.data.rows import DataError, check_rows, iter_file, read_rows, validate_row, write_rows

GOOD = {
    "data_source": "arithmetic",
    "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "2"},
    "extra_info": {"split": "train", "index": 0, "tools_kwargs": {"calculator": {"create_kwargs": {"g": "2"}}},
                   "interaction_kwargs": {"name": "gsm8k", "query": "1+1?"}},
    "agent_name": "tool_agent",
}


def _set(row, path, value):
    keys = path.split(".")
    node = row
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if value is KeyError:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return row


# (mutation path, new value or KeyError to delete, field named in the error)
BAD = [
    ("prompt", KeyError, "prompt"),
    ("prompt", None, "prompt"),
    ("prompt", [], "prompt"),
    ("prompt", "just a string", "prompt"),
    ("prompt.1", "hi", "prompt[1]"),
    ("prompt.1.role", "robot", "prompt[1].role"),
    ("prompt.0.role", KeyError, "prompt[0].role"),
    ("prompt.1.content", KeyError, "prompt[1].content"),
    ("prompt.1.content", 42, "prompt[1].content"),
    ("reward_model", KeyError, "reward_model"),
    ("reward_model", "2", "reward_model"),
    ("reward_model.ground_truth", KeyError, "reward_model.ground_truth"),
    ("reward_model.ground_truth", None, "reward_model.ground_truth"),
    ("reward_model.style", 1, "reward_model.style"),
    ("extra_info", ["split", "train"], "extra_info"),
    ("extra_info.tools_kwargs", ["calculator"], "extra_info.tools_kwargs"),
    ("extra_info.tools_kwargs.calculator", "yes", "extra_info.tools_kwargs.calculator"),
    ("extra_info.interaction_kwargs", "gsm8k", "extra_info.interaction_kwargs"),
    ("extra_info.interaction_kwargs.name", 3, "extra_info.interaction_kwargs.name"),
    ("agent_name", 5, "agent_name"),
    ("data_source", ["a"], "data_source"),
]


def test_good_row_passes():
    validate_row(copy.deepcopy(GOOD), 0)
    minimal = {"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": 0}}
    validate_row(minimal, 0)
    tool_call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
    validate_row({**minimal, "prompt": [minimal["prompt"][0], tool_call], "extra_info": None}, 1)


@pytest.mark.parametrize("path,value,field", BAD)
def test_each_kind_of_bad_row_is_named(path, value, field):
    row = _set(copy.deepcopy(GOOD), path, value)
    with pytest.raises(DataError) as ei:
        validate_row(row, 17)
    assert ei.value.index == 17 and ei.value.field == field
    assert "row 17" in str(ei.value) and repr(field) in str(ei.value)


def test_not_a_mapping():
    with pytest.raises(DataError, match="row 3.*must be a mapping"):
        validate_row(["prompt"], 3)


def test_parquet_round_trip_removes_struct_nulls(tmp_path):
    a = copy.deepcopy(GOOD)
    b = copy.deepcopy(GOOD)
    b["extra_info"]["tools_kwargs"] = {"search": {"create_kwargs": {"q": "x"}}}
    b["extra_info"]["interaction_kwargs"] = {"name": "other"}
    path = write_rows([a, b], tmp_path / "d.parquet")
    rows = read_rows(path)
    # parquet structs would give b a "calculator": None and a "query": None; read_rows drops those
    assert rows == [a, b]


def test_jsonl_round_trip_and_unknown_suffix(tmp_path):
    path = write_rows([GOOD, GOOD], tmp_path / "d.jsonl")
    assert read_rows(path) == [GOOD, GOOD]
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(DataError, match="unknown file type '.csv'"):
        read_rows(tmp_path / "x.csv")
    with pytest.raises(DataError, match="no such file"):
        read_rows(tmp_path / "missing.parquet")


def test_read_rows_fails_on_first_bad_row_unless_skipping(tmp_path):
    rows = [copy.deepcopy(GOOD) for _ in range(4)]
    rows[2]["reward_model"] = {"style": "rule"}
    rows[3]["prompt"] = [{"role": "narrator", "content": "x"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as ei:
        read_rows(path)
    assert ei.value.index == 2 and ei.value.field == "reward_model.ground_truth" and "d.jsonl" in str(ei.value)
    assert len(read_rows(path, skip_bad=True)) == 2
    good, bad = check_rows(rows)
    assert len(good) == 2 and [(e.index, e.field) for e in bad] == [(2, "reward_model.ground_truth"), (3, "prompt[0].role")]


def test_write_rows_validates_and_explains_parquet_limits(tmp_path):
    with pytest.raises(DataError, match="row 0"):
        write_rows([{"prompt": []}], tmp_path / "x.parquet")
    empty = copy.deepcopy(GOOD)
    empty["extra_info"]["tools_kwargs"] = {"calculator": {}}
    with pytest.raises(DataError, match="cannot be stored as parquet"):
        write_rows([empty], tmp_path / "y.parquet")


@pytest.mark.timeout(120)
@pytest.mark.heavy(17)
def test_data_check_cli_real_process(tmp_path):
    rows = [copy.deepcopy(GOOD) for _ in range(5)]
    rows[3]["extra_info"]["tools_kwargs"] = "calculator"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "asyncrl.cli", "data", "check"]
    p = subprocess.run(cmd + [str(bad)], capture_output=True, text=True, timeout=100)
    assert p.returncode == 1, p.stderr
    assert "row 3" in p.stderr and "'extra_info.tools_kwargs'" in p.stderr
    p = subprocess.run(cmd + [str(bad), "--skip-bad"], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"file": str(bad), "rows": 5, "valid": 4, "skipped": 1}
    good = write_rows(rows[:3], tmp_path / "good.parquet")
    p = subprocess.run(cmd + [str(good)], capture_output=True, text=True, timeout=100)
    assert p.returncode == 0 and json.loads(p.stdout)["valid"] == 3


def test_data_check_reads_a_parquet_a_batch_at_a_time_and_names_the_bad_row(tmp_path, capsys):
    rows = [copy.deepcopy(GOOD) for _ in range(10)]
    rows[7]["prompt"] = [{"role": "robot", "content": "hi"}]
    path = tmp_path / "groups.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)  # row 7 is in the third group
    assert list(iter_file(path)) == pq.read_table(path).to_pylist()
    assert _check_command(str(path), skip_bad=False) == 1
    err = capsys.readouterr().err
    assert "row 7, field 'prompt[0].role'" in err and "(1 bad of 10 rows" in err
    assert _check_command(str(path), skip_bad=True) == 0
    assert json.loads(capsys.readouterr().out) == {"file": str(path), "rows": 10, "valid": 9, "skipped": 1}
