"""The arithmetic generator: determinism, graded difficulty, correct answers, disjoint splits."""

from __future__ import annotations

import dataclasses
import re

import pytest

from asyncrl.cli import main
from asyncrl.config import EnvConfig
from asyncrl.data.rows import read_rows, validate_row
from asyncrl.envs.arithmetic import ArithmeticEnv, generate
from asyncrl.envs.base import resolve_env


def _cfg(**kw) -> EnvConfig:
    return dataclasses.replace(EnvConfig(), num_train=60, num_val=12, **kw)


def test_registered_as_the_default_env():
    assert EnvConfig().name == "arithmetic"
    assert isinstance(resolve_env("arithmetic"), ArithmeticEnv)


def test_same_seed_same_rows_different_seed_different_rows():
    env = ArithmeticEnv()
    a, b = env.build(_cfg(seed=3), "train"), env.build(_cfg(seed=3), "train")
    c = env.build(_cfg(seed=4), "train")
    assert a == b
    qa = [r["extra_info"]["question"] for r in a]
    qc = [r["extra_info"]["question"] for r in c]
    assert qa != qc and len(set(qa) & set(qc)) < len(qa) // 2


def test_rows_follow_the_schema_and_train_val_are_disjoint():
    env = ArithmeticEnv()
    train, val = env.build(_cfg(), "train"), env.build(_cfg(), "val")
    assert len(train) == 60 and len(val) == 12
    for i, r in enumerate(train + val):
        validate_row(r, i)
        assert r["data_source"] == "arithmetic" and r["reward_model"]["style"] == "rule"
        assert "Answer: N" in r["prompt"][-1]["content"]  # the documented answer format is in the prompt
        assert r["extra_info"]["tools_kwargs"]["calculator"]["create_kwargs"]["ground_truth"] == r["reward_model"]["ground_truth"]
    assert [r["extra_info"]["index"] for r in train] == list(range(60))
    assert {r["extra_info"]["split"] for r in train} == {"train"}
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in val}


@pytest.mark.parametrize("level,operands", [(1, 2), (2, 3), (3, 4), (4, 5)])
def test_difficulty_levels(level, operands):
    problems = generate(seed=0, split="train", n=80, levels=[level])
    for p in problems:
        nums = re.findall(r"\d+", p["expression"])
        assert len(nums) == operands, p
        assert p["answer"] == eval(p["expression"]) and p["answer"] > 0, p  # independent check of the bookkeeping
        assert all(int(n) <= 20 for n in nums), p  # small numbers
        assert str(nums[0]) in p["question"]
        if level >= 3:
            assert "(" in p["expression"], p
        if level <= 2:
            assert "(" not in p["expression"] and "/" not in p["expression"], p
    if level == 4:
        assert any("/" in p["expression"] for p in problems)


def test_levels_cycle_through_cfg_difficulty():
    rows = ArithmeticEnv().build(_cfg(difficulty=[1, 3]), "train")
    assert [r["extra_info"]["difficulty"] for r in rows[:6]] == [1, 3, 1, 3, 1, 3]


def test_reward_of_the_true_answer_is_one():
    env = ArithmeticEnv()
    for r in env.build(_cfg(difficulty=[1, 2, 3, 4]), "val"):
        gt = r["reward_model"]["ground_truth"]
        kw = dict(ground_truth=gt, extra_info=r["extra_info"], tool_rewards=[], turn_rewards=[])
        assert env.reward(final_text=f"steps...\nAnswer: {gt}", **kw)["score"] == 1.0
        assert env.reward(final_text=f"Answer: {int(gt) + 1}", **kw)["score"] == 0.0


@pytest.mark.parametrize("bad", [[0], [5], [], ["2"]])
def test_bad_difficulty_is_named(bad):
    with pytest.raises(ValueError, match="difficulty"):
        ArithmeticEnv().build(_cfg(difficulty=bad), "train")


def test_data_command_writes_train_and_val(tmp_path):
    rc = main(["data", "arithmetic", "--out", str(tmp_path), "--num-train", "30", "--num-val", "5", "--seed", "7"])
    assert rc == 0
    train = read_rows(tmp_path / "train.parquet")
    val = read_rows(tmp_path / "val.parquet")
    assert len(train) == 30 and len(val) == 5
    cfg = dataclasses.replace(EnvConfig(), num_train=30, num_val=5, seed=7)
    assert train == ArithmeticEnv().build(cfg, "train")  # parquet round trip is exact
