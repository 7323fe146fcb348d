"""RolloutActor: one rollout worker (an asyncio loop) in its own process."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from asyncrl import registry
from asyncrl.buffer.keys import BufferEndpoint
from asyncrl.config import Config
from asyncrl.data.job_state import RolloutPosition, RolloutState
from asyncrl.engine.client import EngineClient
from asyncrl.models import load_tokenizer
from asyncrl.rollout.reward_model import ActorScorer


@ray.remote
class RolloutActor:
    def __init__(self, cfg: Config, worker_id: int, num_workers: int, engine_urls: list[str],
                 buffer: BufferEndpoint, output_dir: str, tool_overrides: dict, rows: list[dict[str, Any]],
                 position: RolloutPosition, version: int, run_id: str, reward_model: Any = None):
        self.args = (cfg, worker_id, num_workers, engine_urls, buffer, output_dir, tool_overrides, rows)
        self.position, self.version, self.run_id = position, version, run_id
        self.reward_model = reward_model  # the RewardModelActor's handle (reward_model.kind=discriminative)
        self.worker = None
        self.client: EngineClient | None = None
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        # lazy: imports pyarrow, which this module does not load otherwise
        from asyncrl.rollout.worker import RolloutWorker

        cfg, worker_id, num_workers, urls, buffer, output_dir, overrides, rows = self.args
        registry.load_all(cfg.plugins, learner=False)  # no loss is looked up here: no torch
        client = self.client = EngineClient(urls, timeout_s=cfg.engine.request_timeout_s,
                                            max_retries=cfg.engine.max_retries)
        self.worker = RolloutWorker(
            cfg, worker_id=worker_id, num_workers=num_workers, rows=rows, engine=client,
            tokenizer=load_tokenizer(cfg.model), buffer_address=buffer, output_dir=output_dir,
            tool_overrides=overrides, position=self.position, version=self.version, run_id=self.run_id,
            reward_scorer=None if self.reward_model is None else ActorScorer(self.reward_model),
        )
        self.task = asyncio.create_task(self.worker.run())  # re-issues the position's in-flight groups first

    async def set_engine_urls(self, urls: list[str]) -> None:
        """An engine was relaunched elsewhere (its node was lost): its generations go to its new URL."""
        if self.client is not None:
            self.client.set_urls(urls)

    async def set_version(self, version: int) -> None:
        await self.worker.set_version(version)

    async def groups_dropped(self, group_ids: list[str], filtered: list[str] | None = None) -> RolloutState:
        """Groups the buffer closed unserved (routed here by the controller; `filtered`: those closed by dynamic
        sampling); the state after applying them."""
        return await self.worker.groups_dropped(group_ids, filtered or ())

    async def state(self) -> RolloutState:
        if self.task is not None and self.task.done() and self.task.exception() is not None:
            raise self.task.exception()
        return self.worker.state()

    async def stop(self) -> RolloutState:
        self.worker.stop()
        if self.task is not None:
            await asyncio.wait_for(self.task, timeout=30)
        return self.worker.state()
