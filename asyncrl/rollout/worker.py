"""The rollout worker: draws prompts, runs agent loops concurrently, streams trajectories to the buffer.

One worker is one asyncio loop (inside a Ray actor in a real run). For each admitted prompt it
starts `n_samples` episodes; each finished episode is sent to the replay buffer and acknowledged
there before it counts as done. Three bounds apply:
  - staleness admission (`StalenessGate`): at most (v + eta + 1) * B groups started by version v;
  - concurrent episodes (`trainer.episodes_per_worker`);
  - concurrent *generation requests* (`trainer.max_inflight_generations`, `BoundedGenerator`), so
    an episode that waits on a slow tool holds no engine slot.
An episode that fails (agent bug, bad reply) is retried a few times, then reported to the
buffer as failed so its group completes with its real size. While its engine is unreachable
(the controller is restarting it) the episode waits, up to engine.launch_timeout_s, without
using up those attempts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from pathlib import Path
from typing import Any, Optional

from asyncrl.config import Config
from asyncrl.engine.base import GenerateResult, Generator, SamplingParams
from asyncrl.env_api import Sample
from asyncrl.job_state import RolloutPosition, RolloutState
from asyncrl.rollout.admission import StalenessGate
from asyncrl.rollout.prompts import PromptDraw, PromptSource
from asyncrl.schema import NonFiniteRewardError, Trajectory

log = logging.getLogger(__name__)


def engine_unreachable(e: BaseException) -> bool:
    """An engine that does not answer or answers 5xx (down, restarting), as opposed to a bad request."""
    from asyncrl.engine.client import EngineRequestError

    return isinstance(e, EngineRequestError) and (e.status is None or e.status >= 500)


class BoundedGenerator:
    """A Generator wrapper holding one of `limit` slots only while a generation request is in flight."""

    def __init__(self, inner: Generator, limit: int):
        self.inner, self._sem = inner, asyncio.Semaphore(limit)
        self.in_flight, self.tokens_out = 0, 0

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: Optional[str] = None,
                       session_id: Optional[str] = None) -> GenerateResult:
        async with self._sem:
            self.in_flight += 1
            try:
                out = await self.inner.generate(input_ids, sampling, rid=rid, session_id=session_id)
            finally:
                self.in_flight -= 1
        self.tokens_out += len(out.output_ids)
        return out


class RolloutWorker:
    EPISODE_ATTEMPTS = 3

    def __init__(self, cfg: Config, *, worker_id: int, num_workers: int, rows: list[dict[str, Any]],
                 engine: Generator, tokenizer: Any, buffer_address: str, output_dir: str | Path,
                 tool_overrides: dict | None = None, position: RolloutPosition | None = None,
                 version: int = 0):
        from asyncrl.agent_loop.base import AgentContext
        from asyncrl.buffer.client import AsyncBufferProducer
        from asyncrl.env_api import resolve_reward_fn
        from asyncrl.tooling.loader import load_tool_specs

        self.cfg, self.worker_id = cfg, worker_id
        position = position or RolloutPosition()
        self.gate = StalenessGate(cfg.algorithm.max_staleness, cfg.trainer.batch_groups, num_workers, version=version,
                                  started=position.started_groups)
        self.source = PromptSource(rows, seed=cfg.seed, shard=worker_id, num_shards=num_workers,
                                   start_position=position.next_position)
        self.engine = BoundedGenerator(engine, cfg.trainer.max_inflight_generations)
        self.ctx = AgentContext(
            engine=self.engine, tokenizer=tokenizer, cfg=cfg.agent,
            tool_specs=load_tool_specs(cfg.env.tools, cfg.env.tools_config),
            reward_fn=resolve_reward_fn(cfg.env), env_name=cfg.env.name,
            tool_overrides=dict(tool_overrides or {}), interactions=list(cfg.env.interactions),
        )
        self.producer = AsyncBufferProducer(buffer_address)
        self._episodes = asyncio.Semaphore(cfg.trainer.episodes_per_worker)
        self.inflight: dict[int, PromptDraw] = {}  # position -> draw, for re-issue after a crash
        self.counts = {"episodes": 0, "episode_errors": 0, "episodes_failed": 0, "reward_nonfinite": 0,
                       "groups_started": 0,
                       "groups_done": 0, "reward_sum": 0.0}
        self._stop = asyncio.Event()
        self._dump_path = Path(output_dir) / f"trajectories-w{worker_id}.jsonl"
        self._dump_rng = random.Random(cfg.seed * 1000 + worker_id)

    # ------------------------------------------------------------------ control (called by the actor)

    async def set_version(self, version: int) -> None:
        await self.gate.set_version(version)

    def state(self) -> RolloutState:
        """The position a restarted worker resumes from (next draw, groups started, groups in flight to
        re-issue), and the counters the controller rolls up into metrics."""
        pos = RolloutPosition(next_position=self.source.next_position, started_groups=self.gate.started,
                              inflight_positions=sorted(self.inflight))
        return RolloutState(worker_id=self.worker_id, position=pos, engine_in_flight=self.engine.in_flight,
                            engine_tokens_out=self.engine.tokens_out, **self.counts)

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ the loop

    async def run(self, reissue: list[int] | None = None) -> None:
        """Run until stopped. Positions in `reissue` (in flight when a previous worker died) go first."""
        tasks: set[asyncio.Task] = set()
        pending = [self.source.at(p) for p in (reissue or [])]
        try:
            while not self._stop.is_set():
                if pending:
                    draw = pending.pop(0)  # re-issued: already counted by the gate when first started
                else:
                    acquire = asyncio.ensure_future(self.gate.acquire())
                    stop = asyncio.ensure_future(self._stop.wait())
                    await asyncio.wait({acquire, stop}, return_when=asyncio.FIRST_COMPLETED)
                    if not acquire.done():
                        acquire.cancel()
                        stop.cancel()
                        break
                    stop.cancel()
                    draw = self.source.next()
                self.inflight[draw.position] = draw
                self.counts["groups_started"] += 1
                task = asyncio.create_task(self._run_group(draw))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.producer.close()

    async def _run_group(self, draw: PromptDraw) -> None:
        n = self.cfg.algorithm.n_samples
        samples = [Sample.from_row(draw.row, data_index=draw.data_index, group_id=draw.group_id,
                                   sample_index=k, group_size=n) for k in range(n)]
        await asyncio.gather(*(self._run_episode(s) for s in samples))
        self.inflight.pop(draw.position, None)
        self.counts["groups_done"] += 1

    async def _run_episode(self, sample: Sample) -> None:
        from asyncrl.agent_loop.base import run_episode

        async with self._episodes:
            attempt, outage_s = 0, 0.0
            while attempt < self.EPISODE_ATTEMPTS:
                try:
                    traj = await run_episode(sample, self.ctx, self.cfg.agent.name)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # engine down, agent-loop bug: counted, retried, then reported
                    self.counts["episode_errors"] += 1
                    if isinstance(e, NonFiniteRewardError):  # the reward's verdict: no retry, reported failed
                        self.counts["reward_nonfinite"] += 1
                        log.warning("episode %s failed: %s", sample.uid, e)
                        attempt = self.EPISODE_ATTEMPTS
                        continue
                    if engine_unreachable(e) and outage_s < self.cfg.engine.launch_timeout_s:
                        # the controller is restarting the engine: wait for it without using up attempts
                        log.warning("episode %s: engine unreachable (%s); retrying", sample.uid, e)
                        await asyncio.sleep(2.0)
                        outage_s += 2.0
                        continue
                    attempt += 1
                    log.warning("episode %s attempt %d failed: %r", sample.uid, attempt, e)
                    await asyncio.sleep(min(2.0 * attempt, 10.0))
            else:
                self.counts["episodes_failed"] += 1
                await self.producer.report_failed(sample.group_id, sample.group_size, 1)
                return
        await self.producer.put(traj)
        self.counts["episodes"] += 1
        self.counts["reward_sum"] += traj.reward
        self._dump(traj)

    def _dump(self, traj: Trajectory) -> None:
        frac = self.cfg.trainer.dump_trajectories
        if frac <= 0 or self._dump_rng.random() >= frac:
            return
        rec = {"uid": traj.uid, "group_id": traj.group_id, "reward": traj.reward, "num_turns": traj.num_turns,
               "finish_reason": traj.finish_reason, "min_version": traj.min_version(),
               "response_tokens": len(traj.response_ids), "metrics": traj.metrics,
               "turn_rewards": traj.turn_rewards, "messages": traj.messages, "time": time.time()}
        with open(self._dump_path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
