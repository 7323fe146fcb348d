"""The workload of `asyncrl bench e2e`, as ordinary plugins (loaded with `plugins: [asyncrl.bench._e2e_workload]`).

- tool `slow_tool`: sleeps a seeded, long-tailed (log-normal) time, standing for real tools and
  retrieval, then echoes its argument;
- agent `bench_agent`: generates a first turn of a seeded long-tailed length (most short, a few
  8x longer), calls `slow_tool`, then generates a short final turn; token accounting is the same
  as the built-in loops (generated tokens mask 1, the inserted tool turn mask 0);
- env `bench_env`: synthetic prompts; the reward is the fraction of vowels among the letters of
  the final text, a signal a tiny random model can climb within a few steps.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from typing import Any

from asyncrl.data.schema import Trajectory, make_trajectory
from asyncrl.engine.base import SamplingParams
from asyncrl.envs.base import Env, Sample, score
from asyncrl.registry import register


def _rng(*key: Any) -> random.Random:
    return random.Random(int(hashlib.sha256(repr(key).encode()).hexdigest()[:16], 16))


def long_tailed_length(rng: random.Random, short: int, tail_factor: int = 8, tail_prob: float = 0.1) -> int:
    return short * tail_factor if rng.random() < tail_prob else rng.randint(max(1, short // 2), short)


def long_tailed_delay(rng: random.Random, median_s: float, sigma: float = 1.0, cap_s: float = 8.0) -> float:
    return min(cap_s, median_s * math.exp(rng.gauss(0.0, sigma)))


@register("tool", "slow_tool")
class SlowTool:
    name = "slow_tool"
    median_s = 0.5

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        self.config = config or {}

    async def create(self, instance_id: str, **kwargs: Any) -> None:
        pass

    async def execute(self, instance_id: str, params: dict) -> tuple[str, float, dict]:
        delay = long_tailed_delay(_rng("tool", instance_id), float(self.config.get("median_s", self.median_s)))
        await asyncio.sleep(delay)
        return f"result for {params.get('query', '')!s}", 0.0, {"delay_s": delay}

    async def release(self, instance_id: str) -> None:
        pass


def _vowel_fraction(text: str) -> float:
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


@register("env", "bench_env")
class BenchEnv(Env):
    name = "bench_env"

    def build(self, cfg: Any, split: str) -> list[dict[str, Any]]:
        rng = random.Random(f"{cfg.seed}-{split}")
        words = ["alpha", "river", "stone", "cloud", "ember", "maple", "orbit", "quartz", "lumen", "delta"]
        n = cfg.num_train if split == "train" else cfg.num_val
        return [{"data_source": "bench", "prompt": [{"role": "user", "content": " ".join(rng.choices(words, k=8))}],
                 "ability": "bench", "reward_model": {"style": "rule", "ground_truth": ""},
                 "extra_info": {"split": split, "index": i}} for i in range(n)]

    def reward(self, *, final_text: str, **_: Any) -> float:
        return _vowel_fraction(final_text)


@register("agent", "bench_agent")
class BenchAgent:
    """generate (long-tailed length) -> slow tool -> generate (short)."""

    async def run(self, sample: Sample, ctx: Any) -> Trajectory:
        tok, cfg = ctx.tokenizer, ctx.cfg
        rng = _rng("len", sample.uid)
        text = tok.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(text, add_special_tokens=False)
        ids, mask, lps, vers, texts = [], [], [], [], []
        tool = SlowTool()
        tool_reward = 0.0
        for turn, length in enumerate([long_tailed_length(rng, cfg.max_turn_tokens // 8), 4]):
            sp = SamplingParams(temperature=cfg.sampling.temperature, max_new_tokens=length, min_new_tokens=length)
            out = await ctx.engine.generate(prompt + ids, sp, rid=f"{sample.uid}-t{turn}", session_id=sample.uid)
            ids += out.output_ids
            mask += [1] * len(out.output_ids)
            lps += out.logprobs
            vers += out.versions
            texts.append(tok.decode(out.output_ids, skip_special_tokens=True))
            if turn == 0:
                text, r, _ = await tool.execute(sample.uid, {"query": texts[-1][:20]})
                tool_reward += r
                inserted = tok.encode(f"\n<tool_response>{text}</tool_response>\n", add_special_tokens=False)
                ids += inserted
                mask += [0] * len(inserted)
                lps += [0.0] * len(inserted)
                vers += [-1] * len(inserted)
        reward, extra = await score(ctx.reward_fn, final_text=" ".join(texts), ground_truth=sample.ground_truth,
                                    extra_info=sample.extra_info, tool_rewards=[tool_reward], turn_rewards=[])
        return make_trajectory(
            uid=sample.uid, group_id=sample.group_id, group_size=sample.group_size, env=ctx.env_name,
            agent="bench_agent", prompt_ids=prompt, response_ids=ids, loss_mask=mask, behavior_logprobs=lps,
            versions=vers, reward=reward, num_turns=2, finish_reason="stop", metrics=extra,
            data_index=sample.data_index, sample_index=sample.sample_index,
            messages=[*sample.messages, {"role": "assistant", "content": " / ".join(texts)}],
        )
