"""The running parts of one training job and the operations the controller performs on them.

`Fleet` starts and stops the Ray actors (buffer, engines, the learner group, rollout workers,
evaluator) and runs one step's operations on them. It leaves the rest to their owners:
- the learner ranks are driven as one through `LearnerGroup` (asyncrl/run/learner_group.py);
- health checks and restarts are the `Supervisor`'s (asyncrl/run/supervisor.py);
- the run directory's names (checkpoints included) are `asyncrl.run_dir`'s, the CPU split `asyncrl.util.cpus`'s.

The policy version is the learner's. The fleet learns it from each `StepResult` (or from the learner
on resume) and `publish_version` is the one path by which it reaches the readers: the buffer (which
drops what became stale) and the rollout workers (which admit new prompts by it).

Groups the buffer closes unserved (all members failed or stale) go back to the worker that started
them (`route_dropped`: the owner of position p is worker p % R), which gives their admission budget
back and issues the prompt again. A report whose worker does not answer is kept and delivered again
(to its replacement) on the next round; the worker ignores one it has applied, and the state it
answers with is recorded at once as its position, so a crash right after cannot lose the returned budget.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import msgspec
import ray

from asyncrl.buffer.actor import BufferActor
from asyncrl.buffer.keys import BufferKeys, endpoint
from asyncrl.config import Config
from asyncrl.data.group_ids import parse_group_id
from asyncrl.data.job_state import JobState, RolloutPosition, RolloutState, StepResult
from asyncrl.envs.base import load_rows, resolve_env
from asyncrl.learner.checkpoint import MARKER
from asyncrl.models import resolve_model_dir
from asyncrl.rollout.evaluate import EvalActor
from asyncrl.rollout.reward_model import reward_model_actor
from asyncrl.run.engine_actor import EngineActor
from asyncrl.run.learner_group import CriticGroup, LearnerGroup
from asyncrl.run.placement import actor_options, alive_nodes
from asyncrl.run.rollout_actor import RolloutActor
from asyncrl.run.supervisor import Supervisor
from asyncrl.run_dir import RunLayout, critic_dir, step_dir
from asyncrl.util.cpus import available_cpus, cpu_threads
from asyncrl.util.memory import peak_gb

log = logging.getLogger("asyncrl")
STOP_TIMEOUT_S = 30.0
# how long the driver waits for a batch before it checks the run's parts, returns dropped budget and asks the
# watchdog: the latency of noticing a dead worker, a failing run or a stop (a few cheap actor calls each time)
BATCH_WAIT_S = 2.0


class Fleet:
    def __init__(self, cfg: Config, out: Path, rows: list[dict[str, Any]], run_id: str):
        self.cfg, self.out, self.rows, self.run_id = cfg, out, rows, run_id
        self.layout = RunLayout(out)
        self.step = self.last_checkpoint_step = 0
        self.optimizer_steps_skipped = 0  # the learner's count of steps skipped for a non-finite loss/grad norm
        self.memory_peaks: dict[str, float] = {}  # the largest of each memory/* metric logged (the summary's)
        self.version = 0  # the learner's version as last published (set only by publish_version)
        self.buffer = None
        self.engines: list[Any] = []
        self._engine_threads: Optional[int] = None
        self.nodes = 1
        self.learners: Optional[LearnerGroup] = None
        self.critics: Optional[CriticGroup] = None  # algorithm.critic.placement=separate
        self.supervisor: Optional[Supervisor] = None
        self.evaluator = None
        self.reward_model = None  # the RewardModelActor (reward_model.kind=discriminative)
        self._evals: list[tuple[int, Any]] = []
        self._last_poll = (time.perf_counter(), 0)
        self._undelivered: list[tuple[str, str]] = []  # (dropped group id, why) whose worker did not answer yet

    # ------------------------------------------------------------------ start / stop

    def start(self, tool_overrides: dict, resume_from: Optional[Path] = None, highest_published: int = 0,
              status: Callable[[str], None] = lambda text: None) -> None:
        """Start every part; with `resume_from`, from that checkpoint (the learner numbers its new weights above
        `highest_published`, the highest version the run ever published: asyncrl/run_dir.py's record).
        `status` is told what is starting (the progress line)."""
        cfg = self.cfg
        self.tool_overrides = tool_overrides
        status("preparing the model")
        model_dir = str(resolve_model_dir(cfg.model))  # converts the default model once, here
        status("starting the replay buffer")
        wal_dir = cfg.buffer.wal_dir or str(self.layout.buffer)
        keys = BufferKeys.for_run(cfg.buffer)  # None without CURVE; each process gets only its role's pair
        a = cfg.algorithm  # dynamic sampling: groups of equal rewards the buffer may close between two batches
        uniform_limit = a.dynamic_sampling_max_rounds * cfg.trainer.batch_groups if a.dynamic_sampling else None
        self.nodes = len(alive_nodes())  # several: the learner ranks' group meets at rank 0's node
        place = cfg.ray.placement
        self.buffer = BufferActor.options(**actor_options(place.buffer)).remote(
            cfg.buffer, wal_dir, a.max_staleness, keys, uniform_limit)
        address = ray.get(self.buffer.address.remote())
        self.buffer_producer, consumer = (endpoint(keys, address, r) for r in ("producer", "consumer"))
        engine_threads, learner_threads = cpu_threads(cfg.trainer.mode, available_cpus(), cfg.engine.num_engines,
                                                      cfg.trainer.learner_ranks)
        # the learner ranks set up while the engines start: the two are independent and each takes seconds
        n_engines = len(cfg.engine.urls) if cfg.engine.urls else cfg.engine.num_engines
        status(f"starting {cfg.trainer.learner_ranks} learner rank(s) and "
               f"{'attaching' if cfg.engine.urls else 'launching'} {n_engines} engine(s)")
        self.learners = LearnerGroup(cfg, consumer, learner_threads, nodes=self.nodes)
        c = cfg.algorithm.critic
        if cfg.algorithm.adv_estimator == "gae" and c.placement == "separate":  # the critic's own ranks
            status(f"starting {c.ranks} critic rank(s)")
            self.critics = CriticGroup(cfg, learner_threads, nodes=self.nodes)
        if cfg.reward_model.kind == "discriminative":  # its own worker, shared by every rollout worker
            self.reward_model = reward_model_actor().remote(cfg.reward_model)
            ray.get(self.reward_model.ready.remote())
        if cfg.engine.urls:  # attached servers: not ours to launch or restart
            self.engine_urls = list(cfg.engine.urls)
        else:
            self._engine_threads = engine_threads
            self.engines = [self._spawn_engine(i, model_dir) for i in range(cfg.engine.num_engines)]
            self.engine_urls = ray.get([e.start.remote() for e in self.engines])
        self.learners.wait_ready()
        if self.critics is not None:
            self.critics.wait_ready()
        self.supervisor = Supervisor(engines=self.engines, engine_urls=self.engine_urls, learners=self.learners,
                                     base_weights=model_dir, restart_weights=self.layout.engine_restart_weights,
                                     spawn_worker=self._spawn_worker, buffer=self.buffer,
                                     probe_timeout_s=cfg.engine.probe_timeout_s, spawn_engine=self._spawn_engine,
                                     engines_moved=self._engines_moved,
                                     place_timeout_s=cfg.ray.place_timeout_s + cfg.engine.launch_timeout_s)
        positions = [RolloutPosition() for _ in range(cfg.trainer.rollout_workers)]
        version = 0
        if resume_from is not None:
            status(f"loading checkpoint {resume_from}")
            if self.critics is not None:  # its part first: written before the learner's (checkpoint.py)
                critic_part = critic_dir(resume_from)
                if not (critic_part / MARKER).is_file():
                    raise ValueError(f"checkpoint {resume_from} has no complete critic part at {critic_part} "
                                     "(saved without algorithm.critic.placement=separate?)")
                self.critics.load_checkpoint(str(critic_part))
            job, version = self.learners.load_checkpoint(str(resume_from), highest_published)
            if len(job.rollout) != len(positions):
                raise ValueError(f"checkpoint {resume_from} holds {len(job.rollout)} rollout positions, the config "
                                 f"asks for trainer.rollout_workers={len(positions)}")
            self.step = self.last_checkpoint_step = job.step
            positions = list(job.rollout)
            log.info("resumed from %s: step %d, version %d", resume_from, self.step, version)
        self.learners.connect_engines(self.engine_urls)
        if version > 0:  # engines start from the base weights: bring them to the learner's version
            self.learners.sync_weights()
        self.publish_version(version)
        status(f"starting {len(positions)} rollout worker(s)")
        self.supervisor.start_workers(positions, self.version)

    def _spawn_engine(self, i: int, model_dir: str) -> Any:
        """Engine actor i (not started), placed by ray.placement.engine: on a lost node's replacement, Ray
        picks a node that still offers it."""
        return EngineActor.options(**actor_options(self.cfg.ray.placement.engine)).remote(
            self.cfg, model_dir, i, threads=self._engine_threads)

    def _engines_moved(self, urls: list[str]) -> None:
        """An engine now answers at another URL (relaunched on another node): the live rollout workers and
        the evaluator send to it from now on (the learners re-join every engine after any relaunch)."""
        for w in self.supervisor.workers if self.supervisor is not None else []:
            _quietly(lambda: ray.get(w.set_engine_urls.remote(urls), timeout=STOP_TIMEOUT_S))
        if self.evaluator is not None:
            _quietly(lambda: ray.get(self.evaluator.set_engine_urls.remote(urls), timeout=STOP_TIMEOUT_S))

    def _spawn_worker(self, r: int, position: RolloutPosition, version: int) -> Any:
        return RolloutActor.options(**actor_options(self.cfg.ray.placement.rollout)).remote(self.cfg, r, self.cfg.trainer.rollout_workers, self.engine_urls,
                                   self.buffer_producer, str(self.out), self.tool_overrides, self.rows,
                                   position=position, version=version, run_id=self.run_id,
                                   reward_model=self.reward_model)

    def shutdown(self) -> None:
        workers = self.supervisor.workers if self.supervisor is not None else []
        for w in workers:
            _quietly(lambda: ray.get(w.stop.remote(), timeout=STOP_TIMEOUT_S))
        if self.learners is not None:  # leave the weight-sync group before its engines go
            _quietly(lambda: self.learners.close_sender(timeout_s=STOP_TIMEOUT_S))
        for e in self.engines:
            _quietly(lambda: ray.get(e.stop.remote(), timeout=STOP_TIMEOUT_S))
        if self.buffer is not None:
            _quietly(lambda: ray.get(self.buffer.stop.remote(), timeout=STOP_TIMEOUT_S))
        for a in [*workers, *self.engines, self.buffer, self.evaluator, self.reward_model]:
            if a is not None:
                _quietly(lambda: ray.kill(a))
        if self.learners is not None:
            self.learners.kill()
        if self.critics is not None:
            self.critics.kill()

    # ------------------------------------------------------------------ the step

    def next_batch(self, watch: Optional[Callable[[], None]] = None) -> tuple[Any, float]:
        """Wait for the next batch from the buffer, keeping workers and engines alive and returning the
        budget of dropped groups meanwhile; `watch` (the controller's watchdog) is called after each
        empty wait and may raise to stop the run."""
        t0 = time.perf_counter()
        while True:
            got = self.learners.fetch_batch(BATCH_WAIT_S)
            if got is not None:
                return got, time.perf_counter() - t0
            self.supervisor.check(self.version)
            self.route_dropped()
            if watch is not None:
                watch()

    def route_dropped(self) -> None:
        """Deliver the groups the buffer closed unserved to the workers that own them (see the module doc)."""
        taken = _quietly(lambda: ray.get(self.buffer.take_dropped.remote(), timeout=STOP_TIMEOUT_S)) or []
        if taken:  # the viewer's record of why these groups never trained (asyncrl/view/records.py)
            with open(self.layout.dropped_groups, "a") as f:
                f.writelines(json.dumps({"step": self.step, "group_id": gid, "reason": why}) + "\n"
                             for gid, why in taken)
        self._undelivered += list(taken)
        by_worker: dict[int, list[tuple[str, str]]] = {}
        for gid, why in self._undelivered:
            try:
                key = parse_group_id(gid)
            except ValueError as e:
                log.warning("buffer reported a dropped group that no rollout worker owns: %s", e)
                continue
            if key.run_id != self.run_id:
                log.warning("buffer reported dropped group %s of another run (this is run %s): ignored", gid,
                            self.run_id)
                continue
            by_worker.setdefault(key.position % self.cfg.trainer.rollout_workers, []).append((gid, why))
        keep: list[tuple[str, str]] = []
        for r, reports in sorted(by_worker.items()):
            gids = [gid for gid, _ in reports]
            filtered = [gid for gid, why in reports if why == "uniform"]  # dynamic sampling: a fresh prompt instead
            try:
                st = ray.get(self.supervisor.workers[r].groups_dropped.remote(gids, filtered),
                             timeout=Supervisor.HEALTH_TIMEOUT_S)
            except Exception as e:  # gone or hung: the supervisor replaces it; its replacement gets them
                log.warning("rollout worker %d did not take %d dropped groups (%r): delivered again later",
                            r, len(gids), e)
                keep += reports
            else:
                self.supervisor.record(r, st)
        self._undelivered = keep

    def summary(self) -> dict[str, Any]:
        """What this run did, for its final summary. Episodes and groups are the buffer's counts (it outlives
        worker restarts, whose counters start again), skipped prompts the workers' positions (which a
        restart and a resume keep)."""
        if self.supervisor is not None:  # the freshest positions, without restarting anyone
            for r, w in enumerate(self.supervisor.workers):
                st = _quietly(lambda: ray.get(w.state.remote(), timeout=10.0))
                if st is not None:
                    self.supervisor.record(r, st)
        states, stats = self.worker_states(), self.buffer_stats()
        faults = self.supervisor.faults if self.supervisor is not None else {}
        self.record_memory({"memory/driver_peak_gb": peak_gb()})  # also for a run that trained no step

        def buffer_count(key: str) -> int | None:  # None: the buffer did not answer (unknown, not zero)
            return int(stats[key]) if key in stats else None

        return {"steps_trained": self.step, "total_steps": self.cfg.trainer.total_steps,
                "episodes": buffer_count("received"), "episodes_failed": buffer_count("failed_reported"),
                "prompts_skipped": sum(s.position.prompts_skipped for s in states),
                "optimizer_steps_skipped": self.optimizer_steps_skipped,
                "prompts_reissued": sum(s.prompts_reissued for s in states),
                "groups_dropped_stale": buffer_count("groups_dropped_stale"),
                "groups_dropped_failed": buffer_count("groups_dropped_failed"),
                "groups_filtered_uniform": buffer_count("groups_dropped_uniform"),
                "groups_served_uniform": buffer_count("uniform_served"),
                "trajectories_dropped_stale": buffer_count("dropped_stale"),
                "worker_restarts": int(faults.get("faults/worker_restarts", 0)),
                "engine_restarts": int(faults.get("faults/engine_restarts", 0)),
                # of those, engines whose actor was gone too (a node lost): started anew elsewhere
                "engines_replaced": int(faults.get("faults/engines_replaced", 0)),
                # each role's largest resident memory in GiB (the learner's: its largest step's peak)
                "memory": {k.removeprefix("memory/"): round(v, 3) for k, v in sorted(self.memory_peaks.items())}}

    def worker_states(self) -> list[RolloutState]:
        """The rollout workers' last reports (what the watchdog and the summary read)."""
        return [s for s in self.supervisor.states if s is not None] if self.supervisor is not None else []

    def train(self, batch: Any) -> StepResult:
        if self.supervisor is not None:
            self.supervisor.ask_engines()  # the engines' liveness probes run beside the step (Supervisor.ask_engines)
        if self.critics is None:
            result = self.learners.train_step(batch)
        else:  # values from the critic's ranks, the policy's step, then the critic's update in the background
            values, critic_steps = self.critics.values(batch)
            previous = self.critics.take_metrics()  # the last update's (it ran before `values`): logged now
            result = self.learners.train_step(batch, values, critic_steps)
            self.critics.start_update(batch, *result.critic_targets)
            result = msgspec.structs.replace(result, critic_targets=None, metrics={**result.metrics, **previous})
        self.step += 1
        self.optimizer_steps_skipped = int(result.metrics.get("learner/skipped_steps_nonfinite", 0))
        return result

    def sync_weights(self) -> dict[str, float]:
        """The learner's weights (at its version) to the engines."""
        return self.learners.sync_weights()

    def publish_version(self, version: int) -> None:
        """The one path by which the learner's version reaches its readers: the buffer (staleness) and
        the rollout workers (admission). Called after the weights of `version` reached the engines."""
        self.version = version
        ray.get(self.buffer.set_version.remote(version))
        workers = self.supervisor.workers if self.supervisor is not None else []
        refs = [w.set_version.remote(version) for w in workers]
        if _quietly(lambda: ray.get(refs, timeout=Supervisor.HEALTH_TIMEOUT_S)) is None:
            self.supervisor.check(version)  # a worker is gone: its replacement starts at `version`

    # ------------------------------------------------------------------ metrics

    def rollout_metrics(self) -> dict[str, float]:
        self.supervisor.check(self.version)
        self.route_dropped()
        now = time.perf_counter()
        out = roll_up([s for s in self.supervisor.states if s is not None], self._last_poll, now)
        self._last_poll = (now, sum(s.engine_tokens_out for s in self.supervisor.states if s is not None))
        out.update(self.supervisor.faults)
        stats = self.buffer_stats()
        out.update({f"buffer/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
        return out

    def memory_metrics(self) -> dict[str, float]:
        """The driver's and the engine servers' peak resident memory (GiB; the learner's and the rollout
        workers' come with their own metrics). Asked of all engines at once, waited for 1 s at most: an engine
        actor busy restarting its server does not hold the step up, and is left out of this step's figure."""
        refs = [e.peak_gb.remote() for e in self.engines]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0) if refs else ([], [])
        peaks = [_quietly(lambda r=r: ray.get(r, timeout=0.1)) for r in ready]
        return {"memory/driver_peak_gb": peak_gb(),
                "memory/engine_peak_gb": max((p for p in peaks if p), default=0.0)}

    def record_memory(self, stats: dict[str, Any]) -> None:
        """Keep the largest of each memory/* value in `stats` for the summary."""
        for k, v in stats.items():
            if k.startswith("memory/") and isinstance(v, (int, float)):
                self.memory_peaks[k] = max(self.memory_peaks.get(k, 0.0), float(v))

    def buffer_stats(self) -> dict:
        if self.buffer is None:
            return {}
        return _quietly(lambda: ray.get(self.buffer.stats.remote(), timeout=STOP_TIMEOUT_S)) or {}

    # ------------------------------------------------------------------ evaluation (runs beside training)

    def start_eval(self) -> None:
        if self.evaluator is None:
            val = load_rows(self.cfg, resolve_env(self.cfg.env.name), "val")[: self.cfg.trainer.eval_samples]
            self.evaluator = EvalActor.options(**actor_options(self.cfg.ray.placement.rollout)).remote(self.cfg, self.engine_urls, self.tool_overrides, val)
        self._evals.append((self.step, self.evaluator.evaluate.remote(self.version)))

    def finished_evals(self, wait: bool = False) -> list[tuple[int, dict]]:
        done, keep = [], []
        for step, ref in self._evals:
            ready, _ = ray.wait([ref], timeout=None if wait else 0)
            (done if ready else keep).append((step, ref))
        self._evals = keep
        return [(step, ray.get(ref)) for step, ref in done]

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, ckpt_root: Path) -> Path:
        self.supervisor.check(self.version)  # the freshest rollout positions
        path = step_dir(ckpt_root, self.step)
        if self.critics is not None:  # before the learner's part, whose save commits the batches (checkpoint.py)
            self.critics.save_checkpoint(str(critic_dir(path)))
        self.learners.save_checkpoint(str(path), JobState(step=self.step, rollout=list(self.supervisor.positions)))
        self.last_checkpoint_step = self.step
        log.info("checkpoint written: %s", path)
        return path

    def export(self, out_dir: Path) -> None:
        self.learners.export(str(out_dir))


def roll_up(states: list[RolloutState], last_poll: tuple[float, int], now: float) -> dict[str, float]:
    """The rollout workers' counters as one set of metrics; tokens/s since `last_poll` (time, tokens)."""
    t_prev, tok_prev = last_poll
    tokens = sum(s.engine_tokens_out for s in states)
    episodes = sum(s.episodes for s in states)
    return {
        "rollout/episodes": episodes,
        "rollout/episode_errors": sum(s.episode_errors for s in states),
        "rollout/episodes_failed": sum(s.episodes_failed for s in states),
        "rollout/reward_nonfinite": sum(s.reward_nonfinite for s in states),
        "rollout/reward_model_failures": sum(s.reward_model_failures for s in states),
        "rollout/groups_dropped": sum(s.groups_dropped for s in states),
        "rollout/prompts_reissued": sum(s.prompts_reissued for s in states),
        "rollout/prompts_skipped": sum(s.position.prompts_skipped for s in states),
        "rollout/reward_mean_all": sum(s.reward_sum for s in states) / max(episodes, 1),
        "rollout/engine_tokens_per_s": (tokens - tok_prev) / max(now - t_prev, 1e-6),
        "memory/rollout_rss_gb": max((s.rss_gb for s in states), default=0.0),
    }


def _quietly(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None
