"""The rollout worker: draws prompts, runs agent loops concurrently, streams trajectories to the buffer.

One worker is one asyncio loop (inside a Ray actor in a real run). For each admitted prompt it
starts `n_samples` episodes; each finished episode is sent to the replay buffer and acknowledged
there before it counts as done. Three bounds apply:
  - staleness admission (`StalenessGate`): at most (v + eta + 1) * B groups started by version v;
  - concurrent episodes (`trainer.episodes_per_worker`);
  - concurrent *generation requests* (`trainer.max_inflight_generations`, `BoundedGenerator`), so
    an episode that waits on a slow tool holds no engine slot.
Every episode samples with a seed fixed by the run's seed, its prompt's position and issue, and its
index in the group (asyncrl/util/seeds.py), so two runs that draw the same prompts sample alike. An
episode that fails (agent bug, bad reply) is retried a few times, each with a fresh seed, then reported to the
buffer as failed so its group completes with its real size. While its engine is unreachable
(the controller is restarting it) the episode waits, up to engine.launch_timeout_s, without
using up those attempts. Failed episodes are counted by error text (bounded) and kept in a window
of the last `trainer.failed_episode_window` outcomes: what the controller's watchdog judges and quotes.

A group the buffer closes without serving it (every member failed or stale) is reported back by the
controller (`groups_dropped`): its start goes back to the gate and its prompt is issued again, as a
new group (`g<p>r<k>`), at most `trainer.max_prompt_retries` times; then the prompt is skipped and
counted. A group closed by dynamic sampling (its rewards all equal: `filtered`) gives its start back
and its prompt is done: the start draws a fresh prompt, as DAPO refills a batch (counted
`groups_filtered`). A report is applied once: it names the group's retry number, and one that is not the
prompt's current one (already handled) changes nothing. What this changes is in `RolloutPosition`
(returned starts, retry numbers, prompts waiting to be issued again, skipped prompts), so a restarted
or resumed worker keeps it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from asyncrl.buffer.client import AsyncBufferProducer
from asyncrl.config import Config
from asyncrl.data.dataset import Dataset
from asyncrl.data.group_ids import parse_group_id
from asyncrl.data.job_state import EpisodeError, RolloutPosition, RolloutState
from asyncrl.data.rows import DataError
from asyncrl.data.schema import NonFiniteRewardError
from asyncrl.engine.base import GenerateResult, Generator, SamplingParams
from asyncrl.engine.client import EngineRequestError
from asyncrl.envs.base import Sample
from asyncrl.rollout.admission import StalenessGate
from asyncrl.rollout.prompts import PromptDraw, PromptSource
from asyncrl.rollout.reward_model import GenerativeJudge, RewardModel, RewardModelError
from asyncrl.rollout.trajectory_log import TrajectoryLog
from asyncrl.util.memory import rss_gb
from asyncrl.util.seeds import derive_seed

log = logging.getLogger(__name__)


def engine_unreachable(e: BaseException) -> bool:
    """An engine that does not answer or answers 5xx (down, restarting), as opposed to a bad request."""
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


class ErrorTally:
    """Failed episodes' errors by message (at most `MAX_KINDS` distinct ones; later new ones are pooled)."""

    MAX_KINDS = 16
    MAX_CHARS = 300
    OTHER = "(other errors)"

    def __init__(self) -> None:
        self._by_message: dict[str, list[int]] = {}  # message -> [count, first data_index]

    def add(self, error: BaseException, data_index: int) -> None:
        msg = repr(error)
        msg = msg if len(msg) <= self.MAX_CHARS else msg[: self.MAX_CHARS - 3] + "..."
        if msg not in self._by_message and len(self._by_message) >= self.MAX_KINDS - 1:
            msg = self.OTHER
        self._by_message.setdefault(msg, [0, data_index])[0] += 1

    def summary(self) -> list[EpisodeError]:
        out = [EpisodeError(message=m, count=c, data_index=i) for m, (c, i) in self._by_message.items()]
        return sorted(out, key=lambda e: -e.count)


class RolloutWorker:
    EPISODE_ATTEMPTS = 3

    def __init__(self, cfg: Config, *, worker_id: int, num_workers: int, rows: Dataset | list[dict[str, Any]],
                 engine: Generator, tokenizer: Any, buffer_address: str, output_dir: str | Path,
                 run_id: str, tool_overrides: dict | None = None, position: RolloutPosition | None = None,
                 version: int = 0, reward_scorer: Any = None):
        """`reward_scorer`: the discriminative reward model (`async score_conversations(list of messages)
        -> scores`: a SequenceScorer or the client of its actor), when
        reward_model.kind=discriminative; a generative judge is built here on `engine`."""
        # lazy: imports omegaconf, which this module does not load otherwise
        from asyncrl.agents.base import AgentContext

        self.cfg, self.worker_id, self.num_workers = cfg, worker_id, num_workers
        position = position or RolloutPosition()
        self.gate = StalenessGate(cfg.algorithm.max_staleness, cfg.trainer.batch_groups, num_workers, version=version,
                                  started=position.started_groups, returned=position.returned_groups)
        self.retries = dict(position.retries)  # position -> drop reports handled = retry number of its next group
        self.waiting = list(position.waiting_positions)  # returned: issued again (through the gate) first
        self.prompts_skipped = position.prompts_skipped
        self.source = PromptSource(rows, run_id=run_id, seed=cfg.seed, shard=worker_id, num_shards=num_workers,
                                   start_position=position.next_position)
        self.engine = BoundedGenerator(engine, cfg.trainer.max_inflight_generations)
        self.ctx = AgentContext.for_config(cfg, self.engine, tokenizer, tool_overrides)
        self.producer = AsyncBufferProducer(buffer_address)
        self.reward_model = _reward_model(cfg, reward_scorer, self.engine, tokenizer)
        self._episodes = asyncio.Semaphore(cfg.trainer.episodes_per_worker)
        # position -> draw, for re-issue after a crash; a restarted worker's own start here, so that its
        # state() names them even before run() has re-issued them
        self.inflight: dict[int, PromptDraw] = {p: self.source.at(p, self.retries.get(p, 0))
                                                for p in position.inflight_positions}
        self.counts = {"episodes": 0, "episode_errors": 0, "episodes_failed": 0, "reward_nonfinite": 0,
                       "reward_model_failures": 0,
                       "groups_started": 0,
                       "groups_done": 0, "groups_dropped": 0, "groups_filtered": 0, "prompts_reissued": 0,
                       "reward_sum": 0.0}
        self.errors = ErrorTally()
        self.recent_failed: deque[bool] = deque(maxlen=cfg.trainer.failed_episode_window)
        self._stop = asyncio.Event()
        self.trajectory_log = TrajectoryLog(output_dir, worker_id, cfg.trainer.dump_trajectories, cfg.seed)

    # ------------------------------------------------------------------ control (called by the actor)

    async def set_version(self, version: int) -> None:
        await self.gate.set_version(version)

    def state(self) -> RolloutState:
        """The position a restarted worker resumes from (next draw, groups started and returned, groups in
        flight or waiting to be issued again, retry numbers), the counters the controller rolls up into
        metrics, and the recent outcomes and errors its watchdog reads."""
        pos = RolloutPosition(next_position=self.source.next_position, started_groups=self.gate.started,
                              inflight_positions=sorted(self.inflight), returned_groups=self.gate.returned,
                              retries=dict(self.retries), waiting_positions=list(self.waiting),
                              prompts_skipped=self.prompts_skipped)
        return RolloutState(worker_id=self.worker_id, position=pos, engine_in_flight=self.engine.in_flight,
                            rss_gb=round(rss_gb(), 3),
                            engine_tokens_out=self.engine.tokens_out, recent_episodes=len(self.recent_failed),
                            recent_failed=sum(self.recent_failed), errors=self.errors.summary(), **self.counts)

    async def groups_dropped(self, group_ids: list[str], filtered: Sequence[str] = ()) -> RolloutState:
        """The buffer closed these groups without serving them: give their starts back and issue their
        prompts again (at most `trainer.max_prompt_retries` times, then skip them). A report for a group
        that is not its prompt's current one (handled before), not drawn yet, or not this worker's is ignored."""
        for gid in group_ids:
            try:
                run_id, p, k = parse_group_id(gid)
            except ValueError as e:
                log.warning("drop report ignored: %s", e)
                continue
            if (run_id != self.source.run_id or p % self.num_workers != self.worker_id
                    or p >= self.source.next_position or k != self.retries.get(p, 0)):
                log.warning("drop report for %s ignored: not a group this worker (%d of %d, run %s) has started "
                            "and not yet seen dropped", gid, self.worker_id, self.num_workers, self.source.run_id)
                continue
            self.retries[p] = k + 1
            if (draw := self.inflight.get(p)) is not None and draw.retry == k:
                del self.inflight[p]  # the buffer has all of it (its last ack may still be on the way here)
            await self.gate.give_back()
            self.counts["groups_dropped"] += 1
            if gid in filtered:  # rewards all equal: trained nothing; the returned start draws a new prompt
                self.counts["groups_filtered"] += 1
            elif k < self.cfg.trainer.max_prompt_retries:
                self.waiting.append(p)
                self.counts["prompts_reissued"] += 1
            else:
                self.prompts_skipped += 1
                log.warning("prompt %d (row %d) skipped: its group was dropped unserved %d times",
                            p, self.source.at(p).data_index, k + 1)
        return self.state()

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Run until stopped. The position's in-flight groups (started when a previous worker died) go first."""
        tasks: set[asyncio.Task] = set()
        pending = list(self.inflight.values())
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
                    if self.waiting:  # returned by a drop report: the same prompt, as its next retry
                        p = self.waiting.pop(0)
                        draw = self.source.at(p, self.retries.get(p, 0))
                    else:
                        draw = self.source.next()
                self.inflight[draw.position] = draw  # (a re-issued one is there already)
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
        if draw.error:  # a bad row (asyncrl/data/dataset.py validates it when drawn): its episodes fail, not the run
            await self._fail_group(draw, DataError(draw.error), n)
            return
        samples = [replace(Sample.from_row(draw.row, data_index=draw.data_index, group_id=draw.group_id,
                                           sample_index=k, group_size=n),
                           sampling_seed=derive_seed(self.cfg.seed, draw.position, draw.retry, k)) for k in range(n)]
        await asyncio.gather(*(self._run_episode(s) for s in samples))
        if self.inflight.get(draw.position) is draw:  # not already taken out by a drop report
            del self.inflight[draw.position]
        self.counts["groups_done"] += 1

    async def _fail_group(self, draw: PromptDraw, error: Exception, n: int) -> None:
        """Report all `n` episodes of `draw`'s group failed with `error`, without running them."""
        log.warning("group %s failed without running: %s", draw.group_id, error)
        self.counts["episode_errors"] += n
        self.counts["episodes_failed"] += n
        for _ in range(n):
            self.errors.add(error, draw.data_index)
            self.recent_failed.append(True)
        await self.producer.report_failed(draw.group_id, n, n)
        if self.inflight.get(draw.position) is draw:
            del self.inflight[draw.position]
        self.counts["groups_done"] += 1

    async def _run_episode(self, sample: Sample) -> None:
        # lazy: imports omegaconf, which this module does not load otherwise
        from asyncrl.agents.base import run_episode_chains

        async with self._episodes:
            attempt, outage_s, error, first_seed = 0, 0.0, None, sample.sampling_seed
            while attempt < self.EPISODE_ATTEMPTS:
                try:
                    chains = await run_episode_chains(sample, self.ctx, self.cfg.agent.name)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # engine down, agent-loop bug: counted, retried, then reported
                    self.counts["episode_errors"] += 1
                    error = e
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
                    if attempt < self.EPISODE_ATTEMPTS:  # a pause, then a retry that draws afresh (util/seeds.py)
                        await asyncio.sleep(min(2.0 * attempt, 10.0))
                        if first_seed is not None:
                            sample = replace(sample, sampling_seed=derive_seed(first_seed, attempt))
            else:
                await self._episode_failed(sample, error)
                return
            if self.reward_model is not None:
                try:
                    chains = await self.reward_model.apply(_prompt_text(sample), sample.ground_truth, chains)
                except RewardModelError as e:  # on_failure=fail_episode: the episode is not retried
                    await self._episode_failed(sample, e)
                    return
                finally:
                    self.counts["reward_model_failures"] = self.reward_model.failures
        # put together (one coalesced request): the group waits for every chain of a split episode
        verdicts = await asyncio.gather(*(self.producer.put(t) for t in chains))
        self.recent_failed.append(False)
        self.counts["episodes"] += 1
        self.counts["reward_sum"] += chains[0].reward
        for t, verdict in zip(chains, verdicts):
            # the dump holds what the buffer holds: a 'dup' (a prompt re-issued after a worker's restart, whose
            # first attempt the buffer had stored, maybe trained) or 'late' attempt is not the record of that uid
            if verdict == "new":
                self.trajectory_log.write(t)

    async def _episode_failed(self, sample: Sample, error: BaseException) -> None:
        self.counts["episodes_failed"] += 1
        self.errors.add(error, sample.data_index)
        self.recent_failed.append(True)
        await self.producer.report_failed(sample.group_id, sample.group_size, 1)


def _prompt_text(sample: Sample) -> str:
    """The request a judge reads: the row's last user message."""
    return next((str(m.get("content") or "") for m in reversed(sample.messages) if m.get("role") == "user"), "")


def _reward_model(cfg: Config, scorer: Any, engine: Any, tokenizer: Any) -> Any:
    rm = cfg.reward_model
    if rm.kind == "none":
        return None
    if rm.kind == "generative":
        return RewardModel(rm, judge=GenerativeJudge(rm, engine, tokenizer))
    if scorer is None:
        raise ValueError("reward_model.kind=discriminative: the rollout worker was given no reward-model scorer")
    return RewardModel(rm, scorer=scorer)
