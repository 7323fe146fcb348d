"""Custom rewards: env.reward.path=file.py env.reward.name=fn (sync or async; float or dict with score),
and the registered reward names the built-in envs add."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from asyncrl.config import EnvConfig, RewardConfig
from asyncrl.envs.base import resolve_reward_fn, score

REWARDS = textwrap.dedent('''
    import asyncio

    def length_reward(*, final_text, ground_truth, extra_info, tool_rewards, turn_rewards):
        return min(len(final_text), 10) / 10

    async def async_dict_reward(*, final_text, ground_truth, extra_info, tool_rewards, turn_rewards):
        await asyncio.sleep(0)
        hit = float(str(ground_truth) in final_text)
        return {"score": hit + sum(tool_rewards), "hit": hit, "note": "ignored, not numeric"}

    def no_score(**kw):
        return {"value": 1.0}

    def wrong_type(**kw):
        return "1.0"
''')

KW = dict(final_text="the answer is 42", ground_truth="42", extra_info={}, tool_rewards=[0.25, 0.25], turn_rewards=[])


def _cfg(tmp_path, name, path=True) -> EnvConfig:
    f = tmp_path / "my_rewards.py"
    f.write_text(REWARDS)
    return dataclasses.replace(EnvConfig(), reward=RewardConfig(path=str(f) if path else None, name=name))


async def test_sync_float_reward_from_a_file(tmp_path):
    fn = resolve_reward_fn(_cfg(tmp_path, "length_reward"))
    assert await score(fn, **KW) == (1.0, {})
    assert await score(fn, **{**KW, "final_text": "abc"}) == (pytest.approx(0.3), {})


async def test_async_dict_reward_from_a_file(tmp_path):
    fn = resolve_reward_fn(_cfg(tmp_path, "async_dict_reward"))
    assert await score(fn, **KW) == (1.5, {"hit": 1.0})
    assert await score(fn, **{**KW, "ground_truth": "7", "tool_rewards": []}) == (0.0, {"hit": 0.0})


async def test_bad_custom_rewards_fail_loudly(tmp_path):
    with pytest.raises(ValueError, match="without 'score'"):
        await score(resolve_reward_fn(_cfg(tmp_path, "no_score")), **KW)
    with pytest.raises(TypeError, match="wrong_type returned '1.0'"):
        await score(resolve_reward_fn(_cfg(tmp_path, "wrong_type")), **KW)
    with pytest.raises(Exception, match="no attribute 'missing_fn'"):
        resolve_reward_fn(_cfg(tmp_path, "missing_fn"))


async def test_registered_reward_names_replace_the_env_default(tmp_path):
    fn = resolve_reward_fn(_cfg(tmp_path, "gsm8k_flexible", path=False))
    assert await score(fn, **{**KW, "final_text": "so it is 42"}) == (1.0, {})
    fn = resolve_reward_fn(_cfg(tmp_path, "search_r1_substring", path=False))
    assert await score(fn, **{**KW, "final_text": "<answer>about 42</answer>"}) == (1.0, {"em": 0.0, "substring_em": 1.0})
    default = resolve_reward_fn(EnvConfig())  # arithmetic's own reward
    assert await score(default, **{**KW, "final_text": "Answer: 42"}) == (1.0, {"correct": 1.0, "formatted": 1.0})
