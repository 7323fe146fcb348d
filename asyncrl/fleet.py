"""The running parts of one training job and the few operations the controller performs on them.

`Fleet` owns the Ray actors (buffer, engines, learner ranks, rollout workers, evaluator), keeps
the step and version counters, restarts what dies, and writes/reads the job state that goes into
a checkpoint (learner state plus rollout positions plus the trained batch ids).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from asyncrl.config import Config

log = logging.getLogger("asyncrl")
_CKPT = re.compile(r"^step_(\d+)$")


def load_rows(cfg: Config, env: Any, split: str) -> list[dict[str, Any]]:
    """Rows from the configured parquet/jsonl file if one is named, else built by the env."""
    path = cfg.env.train_file if split == "train" else cfg.env.val_file
    if path:
        from asyncrl.data import read_rows

        return read_rows(path, skip_bad=cfg.env.skip_bad_rows)
    return env.build(cfg.env, split)


def latest_checkpoint(out: Path) -> Optional[Path]:
    ckpts = sorted((int(m.group(1)), p) for p in (out / "checkpoints").glob("step_*") if (m := _CKPT.match(p.name)))
    return ckpts[-1][1] if ckpts else None


def prune_checkpoints(ckpt_dir: Path, keep: int) -> None:
    ckpts = sorted((int(m.group(1)), p) for p in ckpt_dir.glob("step_*") if (m := _CKPT.match(p.name)))
    for _, p in ckpts[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)


class Fleet:
    HEALTH_TIMEOUT_S = 30.0

    def __init__(self, cfg: Config, out: Path, rows: list[dict[str, Any]]):
        self.cfg, self.out, self.rows = cfg, out, rows
        self.step = self.version = self.last_checkpoint_step = 0
        self.buffer = None
        self.engines: list[Any] = []
        self.learners: list[Any] = []
        self.workers: list[Any] = []
        self.worker_states: list[dict] = []
        self.evaluator = None
        self._evals: list[tuple[int, Any]] = []
        self.faults = {"faults/worker_restarts": 0, "faults/engine_restarts": 0}
        self._last_poll = (time.perf_counter(), 0)

    # ------------------------------------------------------------------ start / stop

    def start(self, tool_overrides: dict, resume_from: Optional[Path] = None) -> None:
        from asyncrl.actors.engine import EngineActor
        from asyncrl.actors.learner import LearnerActor
        from asyncrl.buffer.actor import BufferActor
        from asyncrl.models import resolve_model_dir
        from asyncrl.net import free_port

        cfg = self.cfg
        self.tool_overrides = tool_overrides
        self.model_dir = str(resolve_model_dir(cfg.model))  # converts the default model once, here
        wal_dir = cfg.buffer.wal_dir or str(self.out / "buffer")
        self.buffer = BufferActor.remote(cfg.buffer, wal_dir, cfg.algorithm.max_staleness)
        self.buffer_address = ray.get(self.buffer.address.remote())
        engine_threads, learner_threads = cpu_threads(cfg.trainer.mode, available_cpus(), cfg.engine.num_engines,
                                                      cfg.trainer.learner_ranks)
        self.engines = [EngineActor.remote(cfg, self.model_dir, i, threads=engine_threads)
                        for i in range(cfg.engine.num_engines)]
        self.engine_urls = list(cfg.engine.urls) or ray.get([e.start.remote() for e in self.engines])
        port, n = free_port(), cfg.trainer.learner_ranks
        self.learners = [LearnerActor.remote(cfg, r, n, "127.0.0.1", port) for r in range(n)]
        ray.get([lrn.setup.remote(self.buffer_address if r == 0 else None, learner_threads)
                 for r, lrn in enumerate(self.learners)])
        self.worker_states = [{} for _ in range(cfg.trainer.rollout_workers)]
        if resume_from is not None:
            extra = ray.get([lrn.load_checkpoint.remote(str(resume_from)) for lrn in self.learners])[0]
            self.step = self.last_checkpoint_step = int(extra["step"])
            self.version = int(extra["version"])
            self.worker_states = list(extra.get("rollout") or self.worker_states)
            log.info("resumed from %s: step %d, version %d", resume_from, self.step, self.version)
        self._connect_engines()
        if self.version > 0:  # engines start from the base weights: bring them to the resumed version
            self.sync_weights()
        ray.get(self.buffer.set_version.remote(self.version))
        self.workers = [self._spawn_worker(r) for r in range(cfg.trainer.rollout_workers)]

    def _connect_engines(self) -> None:
        ray.get([lrn.connect_engines.remote(self.engine_urls) for lrn in self.learners])

    def _spawn_worker(self, r: int) -> Any:
        from asyncrl.actors.rollout import RolloutActor

        w = RolloutActor.remote(self.cfg, r, self.cfg.trainer.rollout_workers, self.engine_urls,
                                self.buffer_address, str(self.out), self.tool_overrides, self.rows,
                                resume_state=self.worker_states[r], version=self.version)
        ray.get(w.start.remote())
        return w

    def shutdown(self) -> None:
        for w in self.workers:
            _quietly(lambda: ray.get(w.stop.remote(), timeout=30))
        for lrn in self.learners:  # leave the weight-sync group before its engines go
            _quietly(lambda: ray.get(lrn.close_sender.remote(), timeout=30))
        for e in self.engines:
            _quietly(lambda: ray.get(e.stop.remote(), timeout=30))
        if self.buffer is not None:
            _quietly(lambda: ray.get(self.buffer.stop.remote(), timeout=30))
        for a in [*self.workers, *self.engines, *self.learners, self.buffer, self.evaluator]:
            if a is not None:
                _quietly(lambda: ray.kill(a))

    # ------------------------------------------------------------------ the step

    def next_batch(self) -> tuple[Any, float]:
        """Wait for the next batch from the buffer, keeping workers and engines alive meanwhile."""
        t0 = time.perf_counter()
        while True:
            got = ray.get(self.learners[0].fetch_batch.remote(self.version, 5.0))
            if got is not None:
                return got, time.perf_counter() - t0
            self.check_health()

    def train(self, batch: Any) -> dict[str, Any]:
        stats = ray.get([lrn.train_step.remote(batch) for lrn in self.learners])[0]
        self.step += 1
        self.version += 1
        return stats

    def sync_weights(self) -> dict[str, float]:
        stats = ray.get([lrn.sync_weights.remote(self.version) for lrn in self.learners])[0]
        ray.get(self.buffer.set_version.remote(self.version))
        refs = [w.set_version.remote(self.version) for w in self.workers]
        if _quietly(lambda: ray.get(refs, timeout=self.HEALTH_TIMEOUT_S)) is None:
            self.check_health()  # a worker is gone: its replacement starts at self.version
        return stats

    # ------------------------------------------------------------------ health

    def check_health(self) -> None:
        for r, w in enumerate(self.workers):
            try:
                self.worker_states[r] = ray.get(w.state.remote(), timeout=self.HEALTH_TIMEOUT_S)
            except (RayActorError, GetTimeoutError, Exception) as e:
                log.warning("rollout worker %d is gone (%r): restarting it, re-issuing %d in-flight prompts",
                            r, e, len(self.worker_states[r].get("inflight_positions", [])))
                _quietly(lambda: ray.kill(w))
                self.faults["faults/worker_restarts"] += 1
                self.workers[r] = self._spawn_worker(r)
        dead = [i for i, e in enumerate(self.engines) if not _quietly(lambda: ray.get(e.alive.remote(), timeout=30))]
        if not dead:
            return
        # Restart from the current weights at the current version. Restarting from the base weights
        # and syncing afterwards lets waiting episodes generate with version-0 weights first; those
        # trajectories are then too stale to train on, and their admission budget is never returned.
        weights = self.model_dir
        if self.version > 0:
            weights = str(self.out / "engine_restart_weights")
            ray.get([lrn.export.remote(weights) for lrn in self.learners])
        for i in dead:
            log.warning("engine %d is down: restarting it on its port with the weights of version %d", i,
                        self.version)
            self.faults["faults/engine_restarts"] += 1
            self.engine_urls[i] = ray.get(self.engines[i].restart.remote(model_dir=weights,
                                                                         weight_version=self.version))
        self._connect_engines()

    def rollout_metrics(self) -> dict[str, float]:
        self.check_health()
        states = self.worker_states
        now, tokens = time.perf_counter(), sum(s.get("engine_tokens_out", 0) for s in states)
        t_prev, tok_prev = self._last_poll
        self._last_poll = (now, tokens)
        episodes = sum(s.get("episodes", 0) for s in states)
        out = {
            "rollout/episodes": episodes,
            "rollout/episode_errors": sum(s.get("episode_errors", 0) for s in states),
            "rollout/episodes_failed": sum(s.get("episodes_failed", 0) for s in states),
            "rollout/reward_mean_all": sum(s.get("reward_sum", 0.0) for s in states) / max(episodes, 1),
            "rollout/engine_tokens_per_s": (tokens - tok_prev) / max(now - t_prev, 1e-6),
            **self.faults,
        }
        stats = _quietly(lambda: ray.get(self.buffer.stats.remote(), timeout=30)) or {}
        out.update({f"buffer/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
        return out

    # ------------------------------------------------------------------ evaluation (runs beside training)

    def start_eval(self) -> None:
        from asyncrl.rollout.evaluate import EvalActor

        if self.evaluator is None:
            from asyncrl.env_api import resolve_env

            val = load_rows(self.cfg, resolve_env(self.cfg.env.name), "val")[: self.cfg.trainer.eval_samples]
            self.evaluator = EvalActor.remote(self.cfg, self.engine_urls, self.tool_overrides, val)
        self._evals.append((self.step, self.evaluator.evaluate.remote(self.version)))

    def finished_evals(self, wait: bool = False) -> list[tuple[int, dict]]:
        done, keep = [], []
        for step, ref in self._evals:
            ready, _ = ray.wait([ref], timeout=None if wait else 0)
            (done if ready else keep).append((step, ref))
        self._evals = keep
        return [(step, ray.get(ref)) for step, ref in done]

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self, ckpt_dir: Path) -> Path:
        self.check_health()
        path = ckpt_dir / f"step_{self.step:06d}"
        extra = {"step": self.step, "version": self.version, "rollout": self.worker_states, "time": time.time()}
        ray.get([lrn.save_checkpoint.remote(str(path), extra) for lrn in self.learners])
        self.last_checkpoint_step = self.step
        log.info("checkpoint written: %s", path)
        return path

    def export(self, out_dir: Path) -> None:
        ray.get([lrn.export.remote(str(out_dir)) for lrn in self.learners])  # the gather is collective


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(mode: str, cpus: int, engines: int, learner_ranks: int) -> tuple[int, int]:
    """Torch CPU threads for each engine and each learner rank sharing one machine's `cpus` cores.

    async: engines and learner run at the same time, so they split the cores (half each, the learner
    half getting the odd one); sync: they take turns, so each may use every core. Ray would
    otherwise give each actor one thread, which starves the synchronous baseline of half a 2-core
    machine and skews any async/sync comparison.
    """
    if mode == "sync":
        return max(1, cpus // engines), max(1, cpus // learner_ranks)
    engine_share = cpus // 2
    return max(1, engine_share // engines), max(1, (cpus - engine_share) // learner_ranks)


def _quietly(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None
