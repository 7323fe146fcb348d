"""GSM8K conversion from the user's own file, and build() from the converted parquet."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.cli import main
from asyncrl.config import EnvConfig
from asyncrl.data.rows import read_rows, write_rows
from asyncrl.envs.gsm8k import GSM8KEnv, convert, gold_from_solution

RECORDS = [
    {"question": "Tom has 3 apples and buys 5 more. How many?", "answer": "3 + 5 = <<3+5=8>>8\n#### 8"},
    {"question": "A car costs $1,200 and a bike $300. Total?", "answer": "1200 + 300 = 1500\n#### 1,500"},
    {"question": "Half of 9?", "answer": "9 / 2 = 4.5\n#### 4.5"},
]


def test_gold_from_solution():
    assert [gold_from_solution(r["answer"], "t") for r in RECORDS] == ["8", "1500", "4.5"]
    with pytest.raises(ValueError, match="record 7.*####"):
        gold_from_solution("no final line", "record 7")


def test_convert_builds_verl_rows():
    rows = convert(RECORDS, split="test", agent_name="tool_agent",
                   tools_kwargs={"calculator": {"create_kwargs": {"x": 1}}}, interaction_kwargs={"name": "gsm8k"},
                   method="flexible")
    r = rows[1]
    assert r["data_source"] == "openai/gsm8k" and r["agent_name"] == "tool_agent"
    assert r["reward_model"] == {"style": "rule", "ground_truth": "1500"}
    assert r["prompt"][0]["role"] == "user" and r["prompt"][0]["content"].endswith(RECORDS[1]["question"])
    assert "####" in r["prompt"][0]["content"]
    assert r["extra_info"]["split"] == "test" and r["extra_info"]["index"] == 1
    assert r["extra_info"]["tools_kwargs"] == {"calculator": {"create_kwargs": {"x": 1}}}
    assert r["extra_info"]["interaction_kwargs"] == {"name": "gsm8k"}
    assert r["extra_info"]["reward_method"] == "flexible"


@pytest.mark.parametrize("rec,msg", [
    ({"question": "q"}, "record 0: field 'answer'"),
    ({"question": "", "answer": "#### 1"}, "record 0: field 'question'"),
    ({"question": "q", "answer": "just text"}, "record 0: the answer has no '#### n'"),
])
def test_convert_names_the_bad_record(rec, msg):
    with pytest.raises(ValueError, match=msg):
        convert([rec], split="train", source="in.jsonl")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_data_gsm8k_cli_converts_jsonl_and_parquet(tmp_path, fmt):
    src = tmp_path / f"gsm8k.{fmt}"
    if fmt == "jsonl":
        src.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    else:
        pq.write_table(pa.Table.from_pylist(RECORDS), src)
    out = tmp_path / "out"
    rc = main(["data", "gsm8k", "--input", str(src), "--out", str(out), "--split", "train", "--agent-name", "react",
               "--tools-kwargs", '{"calculator": {"create_kwargs": {"k": "v"}}}',
               "--interaction-kwargs", '{"name": "feedback", "max_turns": 2}'])
    assert rc == 0
    rows = read_rows(out / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["8", "1500", "4.5"]
    assert all(r["agent_name"] == "react" for r in rows)
    assert rows[0]["extra_info"]["interaction_kwargs"] == {"name": "feedback", "max_turns": 2}
    assert rows[2]["extra_info"]["tools_kwargs"] == {"calculator": {"create_kwargs": {"k": "v"}}}


def test_data_gsm8k_cli_rejects_bad_json(tmp_path):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps(RECORDS[0]) + "\n")
    with pytest.raises(SystemExit, match="--tools-kwargs is not JSON"):
        main(["data", "gsm8k", "--input", str(src), "--out", str(tmp_path), "--tools-kwargs", "{nope"])


def test_build_reads_train_and_val_files(tmp_path):
    write_rows(convert(RECORDS, split="train"), tmp_path / "train.parquet")
    write_rows(convert(RECORDS[:1], split="val"), tmp_path / "val.parquet")
    cfg = dataclasses.replace(EnvConfig(), name="gsm8k", train_file=str(tmp_path / "train.parquet"),
                              val_file=str(tmp_path / "val.parquet"))
    env = GSM8KEnv()
    assert len(env.build(cfg, "train")) == 3 and len(env.build(cfg, "val")) == 1
    with pytest.raises(ValueError, match="asyncrl data gsm8k"):
        env.build(EnvConfig(name="gsm8k"), "train")
