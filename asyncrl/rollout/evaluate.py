"""Evaluation on the validation set while training goes on: pass@k and mean reward.

Runs the same agent loops against the same engines (so it sees the weights of the moment), but
its trajectories go nowhere near the buffer. pass@k is the fraction of prompts for which at least
one of k samples earns a reward >= `success_threshold`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from asyncrl import registry
from asyncrl.config import Config
from asyncrl.engine.client import EngineClient
from asyncrl.envs.base import Sample
from asyncrl.models import load_tokenizer
from asyncrl.offline.scores import pass_at_k as estimate


def pass_at_k(rewards_by_prompt: list[list[float]], threshold: float = 1.0) -> float:
    """pass@k with k = each prompt's number of samples (asyncrl/offline/scores.py owns the estimator)."""
    if not rewards_by_prompt:
        return 0.0
    return sum(estimate(len(rs), sum(r >= threshold for r in rs), len(rs))
               for rs in rewards_by_prompt) / len(rewards_by_prompt)


async def evaluate_rows(ctx: Any, rows: list[dict[str, Any]], k: int, agent: str, concurrency: int = 16,
                        tag: str = "eval") -> dict[str, float]:
    # lazy: imports omegaconf, which this module does not load otherwise
    from asyncrl.agents.base import run_episode

    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, row: dict, s: int) -> float:
        sample = Sample.from_row(row, data_index=i, group_id=f"{tag}-{i}", sample_index=s, group_size=k)
        async with sem:
            try:
                return (await run_episode(sample, ctx, agent)).reward
            except Exception:
                return 0.0

    rewards = await asyncio.gather(*(asyncio.gather(*(one(i, row, s) for s in range(k))) for i, row in enumerate(rows)))
    flat = [r for rs in rewards for r in rs]
    return {f"eval/pass@{k}": pass_at_k([list(rs) for rs in rewards]),
            "eval/reward_mean": sum(flat) / max(len(flat), 1), "eval/num_prompts": len(rows)}


@ray.remote
class EvalActor:
    def __init__(self, cfg: Config, engine_urls: list[str], tool_overrides: dict, rows: list[dict[str, Any]]):
        self.cfg, self.urls, self.overrides, self.rows = cfg, engine_urls, tool_overrides, rows
        self.ctx = None
        self.client: EngineClient | None = None

    def set_engine_urls(self, urls: list[str]) -> None:
        """An engine was relaunched elsewhere: evaluations from now on use its new URL."""
        self.urls = list(urls)
        if self.client is not None:
            self.client.set_urls(self.urls)

    async def evaluate(self, version: int) -> dict[str, float]:
        if self.ctx is None:
            # lazy: imports omegaconf, which this module does not load otherwise
            from asyncrl.agents.base import AgentContext

            registry.load_all(self.cfg.plugins, learner=False)  # no loss is looked up here: no torch
            e = self.cfg.engine  # its patience is the run's, as the rollout workers' is
            self.client = EngineClient(self.urls, timeout_s=e.request_timeout_s, max_retries=e.max_retries)
            self.ctx = AgentContext.for_config(self.cfg, self.client, load_tokenizer(self.cfg.model), self.overrides)
        out = await evaluate_rows(self.ctx, self.rows, self.cfg.trainer.eval_pass_k, self.cfg.agent.name)
        return {**out, "eval/version": version}
