"""env `reasoning_gym` against reasoning-gym 0.1.25's own datasets and verifiers (the optional extra, which
scripts/setup.sh installs): rows, the reward, the config's errors, and the missing package's message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.agents.base import AgentContext, run_episode
from asyncrl.config import load_config
from asyncrl.envs.base import Sample, load_rows, resolve_env
from asyncrl.envs.reasoning_gym import INSTALL, INSTRUCTION, ReasoningGymEnv, extract_answer, score
from asyncrl.run.preflight import check_env
from tests.agents.scripted_engine import ScriptedEngine


def _cfg(*extra: str):
    return load_config(["env=reasoning_gym", "env.num_train=120", "env.num_val=12", *extra])


def test_rows_are_seeded_per_task_disjoint_between_splits_and_scored_by_the_tasks_own_verifier():
    import reasoning_gym

    env, cfg = ReasoningGymEnv(), _cfg()
    train, val = env.build(cfg.env, "train"), env.build(cfg.env, "val")
    assert (len(train), len(val)) == (120, 12)
    assert env.build(cfg.env, "train") == train  # a pure function of the config
    assert env.build(_cfg("env.seed=1").env, "train") != train
    question = lambda r: r["extra_info"]["question"]  # noqa: E731
    assert not {question(r) for r in train} & {question(r) for r in val}
    assert all(r["prompt"] == [{"role": "user", "content": question(r) + INSTRUCTION}] for r in train + val)
    tasks = {r["data_source"] for r in train}
    assert tasks == {"reasoning_gym/chain_sum", "reasoning_gym/letter_counting", "reasoning_gym/spell_backward"}
    for r in train[:30]:
        ref = r["extra_info"]["reasoning_gym"]
        # the row names its entry exactly: reasoning-gym regenerates the same question from it
        entry = reasoning_gym.create_dataset(ref["task"], seed=ref["seed"], size=ref["size"],
                                             **__import__("json").loads(ref["config"]))[ref["index"]]
        assert question(r) == entry["question"] and r["reward_model"]["ground_truth"] == str(entry["answer"])
        gt = r["reward_model"]["ground_truth"]
        assert score(f"Thinking.\n<answer>{gt}</answer>", r["extra_info"]) == {"score": 1.0, "correct": 1.0,
                                                                             "formatted": 1.0}
        assert score(f"{gt}", r["extra_info"]) == {"score": 0.0, "correct": 0.0, "formatted": 0.0}
    # a wrong answer in tags earns the preset's format reward on training rows, never on val rows (chain_sum's
    # verifier gives no partial credit to a non-number; spell_backward's gives some by similarity)
    sums = lambda rows: [r for r in rows if r["data_source"].endswith("chain_sum")]  # noqa: E731
    assert sums(train) and sums(val)
    assert all(score("<answer>none</answer>", r["extra_info"]) == {"score": 0.1, "correct": 0.0, "formatted": 1.0}
               for r in sums(train))
    assert all(score("<answer>none</answer>", r["extra_info"])["score"] == 0.0 for r in sums(val))
    spell = next(r for r in train if r["data_source"].endswith("spell_backward"))
    word = spell["reward_model"]["ground_truth"]
    assert score(f"<answer>{word}</answer> and <answer>x{word}</answer>", spell["extra_info"])["score"] < 1.0  # the last
    # weights: one task only; one task twice, with two configs (each its own seed and entries)
    only = _cfg("env.options.datasets=[{name: leg_counting, weight: 2, config: {min_animals: 1, max_animals: 2}}]")
    assert {r["data_source"] for r in env.build(only.env, "val")} == {"reasoning_gym/leg_counting"}
    twice = _cfg("env.options.datasets=[{name: chain_sum, config: {max_digits: 1}}, "
                 "{name: chain_sum, config: {min_digits: 3, max_digits: 3}}]")
    refs = [r["extra_info"]["reasoning_gym"] for r in env.build(twice.env, "train")]
    assert len({(r["config"], r["seed"]) for r in refs}) == 2
    assert len({(r["config"], r["index"]) for r in refs}) == len(refs)  # no entry drawn twice


def test_extract_answer_takes_the_last_tagged_answer():
    assert extract_answer("<answer> 3 </answer> then <answer>\n4\n</answer>") == "4"
    assert extract_answer("no tags") is None and extract_answer("<answer>open") is None


@pytest.mark.parametrize("datasets,message", [
    ("[chain_summ]", "reasoning-gym has no task 'chain_summ' (did you mean 'chain_sum'?)"),
    ("[{name: chain_sum, weight: 0}]", "weight must be a number > 0, got 0"),
    ("[{name: chain_sum, config: {seed: 3}}]", "config must not set seed or size"),
    ("[{name: chain_sum, config: {max_termz: 3}}]", "task 'chain_sum' refuses config {'max_termz': 3}: TypeError"),
    ("[{name: chain_sum, cfg: {}}]", "unknown keys ['cfg']; valid: name, weight, config"),
    ("[]", "env.options.datasets must be a non-empty list"),
    ("[chain_sum]|env.options.format_reward=1.0", "env.options.format_reward=1.0: expected a number in [0, 1)"),
    ("[chain_sum]|+env.options.formt=1", "reasoning_gym does not know ['formt']"),
])
def test_a_bad_task_list_fails_the_preflight_naming_the_entry(datasets, message):
    from asyncrl.run.preflight import _Problems

    datasets, *more = datasets.split("|")
    cfg = _cfg(f"env.options.datasets={datasets}", *more)
    problems = _Problems()
    problems.attempt("env=reasoning_gym training rows", lambda: load_rows(cfg, resolve_env("reasoning_gym"), "train"))
    assert len(problems) == 1 and message in problems[0], problems


async def test_an_episode_is_scored_by_the_verifier_through_the_agent_loop(tokenizer):
    cfg = _cfg()
    row = resolve_env("reasoning_gym").build(cfg.env, "val")[0]
    sample = Sample.from_row(row, data_index=0, group_id="g0", sample_index=0, group_size=1)
    gt = row["reward_model"]["ground_truth"]
    ctx = AgentContext.for_config(cfg, ScriptedEngine(tokenizer, [f"Let me see. <answer>{gt}</answer>"]), tokenizer)
    assert check_env(cfg)[1] == [] and ctx.tool_specs == []  # the preset has no tools
    traj = await run_episode(sample, ctx, "tool_agent")
    assert traj.reward == 1.0 and traj.metrics["reward/correct"] == 1.0
    assert traj.messages[0] == row["prompt"][0]


def test_without_the_package_the_env_names_the_install_command(tmp_path):
    """A fresh interpreter where `import reasoning_gym` fails (its name blocked in sys.modules, as Python does
    for a package that is not there): building rows, and so the preflight, says what to install."""
    code = ("import sys; sys.modules['reasoning_gym'] = None\n"
            "from asyncrl.config import load_config\n"
            "from asyncrl.envs.reasoning_gym import ReasoningGymEnv\n"
            "ReasoningGymEnv().build(load_config(['env=reasoning_gym']).env, 'train')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "env=reasoning_gym needs the reasoning-gym package, which is not installed" in r.stderr
    assert INSTALL in r.stderr


def test_demonstrations_are_the_tasks_answers_in_tags_and_earn_full_reward():
    from asyncrl.envs.base import DemoError, can_demonstrate

    env, cfg = ReasoningGymEnv(), _cfg()
    assert can_demonstrate(env)
    for r in env.build(cfg.env, "train")[:40]:
        (turn,) = env.demo_turns(r)
        assert turn.tool_calls == [] and score(turn.content, r["extra_info"])["score"] == 1.0
    with pytest.raises(DemoError, match="nothing to demonstrate"):
        env.demo_turns({"reward_model": {"ground_truth": "3"}, "extra_info": {}})


def test_asyncrl_data_writes_rows_that_check_and_demonstrations_that_play(tmp_path):
    """`asyncrl data reasoning_gym` writes parquet that `asyncrl data check` passes and whose rows score from
    the file; `--demos` plays each demonstration through the agent loop and keeps it (full reward)."""
    import json

    from asyncrl.data.dataset import open_dataset

    run = lambda *a: subprocess.run([sys.executable, "-m", "asyncrl.cli", "data", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=300)
    r = run("reasoning_gym", "--out", str(tmp_path), "--num-train", "40", "--num-val", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["train"]["path"] == str(tmp_path / "train.parquet")
    c = run("check", str(tmp_path / "train.parquet"))
    assert c.returncode == 0 and json.loads(c.stdout)["valid"] == 40, c.stdout + c.stderr
    row = open_dataset(tmp_path / "train.parquet")[0]
    assert score(f"<answer>{row['reward_model']['ground_truth']}</answer>", row["extra_info"])["score"] == 1.0
    d = run("reasoning_gym", "--demos", "--out", str(tmp_path), "--num-train", "40", "--limit", "6")
    assert d.returncode == 0, d.stderr[-2000:]
    assert json.loads(d.stdout.strip().splitlines()[-1])["demos"] == 6
