"""Supervisor: health checks and the restart policy for rollout workers and engines; the buffer's health.

The controller calls `check(version)` between waits (while it waits for a batch, when a version
publish fails, before a checkpoint, when it rolls up metrics). `version` is the published policy
version (what the buffer filters by and the workers admit by). Each supervised part is a slot in a
small state machine; one `check` moves every slot through at most one cycle:

Rollout worker r:
  RUNNING --state() answers in HEALTH_TIMEOUT_S--> RUNNING   its RolloutState (position, counters) recorded
  RUNNING --state() raises or times out----------> DEAD      the actor is killed
  DEAD    --same check---------------------------> RUNNING   a new actor at the last recorded position and
                                                             `version`; it re-issues the groups it had in flight;
                                                             placed where ray.placement.rollout allows (its node
                                                             may be gone); not started in place_timeout_s:
                                                             PlacementFailed (the run stops)
Engine i (only engines this job launched; attached ones, `engine.urls`, are not supervised):
  UP   --alive() answers true--------------------> UP        alive(): the process runs and answers a one-token
                                                             /generate within engine.probe_timeout_s, or has
                                                             failed fewer than engine.probe_failures in a row
  UP   --alive() false, raises or times out------> DOWN      a hung engine (probe_failures in a row) was
                                                             SIGKILLed by alive() itself
  DOWN --same check, all DOWN engines together---> UP        relaunched on its port from the learner's current
                                                             weights, told the learner's version; then the
                                                             learner group re-joins every engine (new sync group)
  DOWN --its actor is gone too (node lost)-------> UP        a new actor where ray.placement.engine allows, from
                                                             the same weights and version; a new URL goes to the
                                                             live rollout workers and the evaluator; none placed
                                                             in place_timeout_s: PlacementFailed (run stops)

An engine's alive() may be asked ahead (`ask_engines`, as each training step starts) and its answer read at
the next check; an answer asked of an actor since replaced is not used.

Replay buffer (one, no restart):
  SERVING --health() answers None----------------> SERVING
  SERVING --health() answers an error, or the----> (run stops) BufferFailed with the service's error
           actor is gone or does not answer                  (e.g. its log write failed: path and errno);
                                                             the controller exits non-zero. Its log holds
                                                             every acked record: trainer.resume=auto goes on.

Rules:
- a restarted worker resumes from the last position it reported, never from scratch: prompts it had
  finished stay finished, and groups in flight are re-issued (the buffer stores a uid once);
- a restarted engine gets the weights the learner holds at that moment (exported for the purpose;
  the base model while the version is 0) and the version read from the learner, its owner, in the
  same breath: relaunching from the base weights and syncing later would let waiting episodes
  generate version-0 tokens the buffer then drops as stale;
- every restart is counted (`faults/worker_restarts`, `faults/engine_restarts`);
- the probe never overlaps a weight sync the controller drives (both run on its one thread), and a probe
  that fails while the engine reports itself paused is not counted.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from asyncrl.config import EngineConfig
from asyncrl.data.job_state import RolloutPosition, RolloutState
from asyncrl.run.learner_group import LearnerGroup

log = logging.getLogger("asyncrl")


class WorkerStatus(enum.Enum):
    RUNNING = "running"
    DEAD = "dead"


class EngineStatus(enum.Enum):
    UP = "up"
    DOWN = "down"


class PlacementFailed(RuntimeError):
    """A part whose node was lost has no node left to go to (ray.placement): the run cannot go on."""


class BufferFailed(RuntimeError):
    """The replay buffer's service stopped with an error (or its actor is gone): the run cannot go on."""


SpawnWorker = Callable[[int, RolloutPosition, int], Any]  # (worker id, position, version) -> actor, not started
SpawnEngine = Callable[[int, str], Any]  # (engine index, weights dir) -> actor, not started


class Supervisor:
    HEALTH_TIMEOUT_S = 30.0

    def __init__(self, *, engines: list[Any], engine_urls: list[str], learners: LearnerGroup, base_weights: str,
                 restart_weights: Path, spawn_worker: SpawnWorker, buffer: Any = None,
                 probe_timeout_s: float = EngineConfig.probe_timeout_s, spawn_engine: SpawnEngine | None = None,
                 engines_moved: Callable[[list[str]], None] = lambda urls: None, place_timeout_s: float = 420.0):
        """`spawn_engine(i, weights)`: a new, unstarted actor for engine i (its old one is gone with its node);
        `engines_moved(urls)`: tell the live parts an engine's URL changed; `place_timeout_s`: how long a
        replacement (engine or rollout worker) may take to be placed and started before the run stops."""
        self.engines, self.engine_urls, self.learners, self.buffer = engines, engine_urls, learners, buffer
        # alive() may take a probe, then a /stats read, before it answers
        self.engine_timeout_s = 2 * probe_timeout_s + self.HEALTH_TIMEOUT_S
        self.base_weights, self.restart_weights, self.spawn_worker = base_weights, restart_weights, spawn_worker
        self.spawn_engine, self.engines_moved, self.place_timeout_s = spawn_engine, engines_moved, place_timeout_s
        self.engine_status = [EngineStatus.UP] * len(engines)
        self._asked: list[tuple[Any, Any]] = []  # (engine actor, its alive() ref) asked ahead (ask_engines)
        self.workers: list[Any] = []
        self.worker_status: list[WorkerStatus] = []
        self.positions: list[RolloutPosition] = []
        self.states: list[RolloutState | None] = []  # the last report of each worker (None: none yet)
        self.faults = {"faults/worker_restarts": 0, "faults/engine_restarts": 0, "faults/engines_replaced": 0}

    def start_workers(self, positions: list[RolloutPosition], version: int) -> None:
        self.positions, self.states = list(positions), [None] * len(positions)
        self.workers = [self.spawn_worker(r, p, version) for r, p in enumerate(self.positions)]
        ray.get([w.start.remote() for w in self.workers])  # together: each loads its tokenizer and data
        self.worker_status = [WorkerStatus.RUNNING] * len(self.workers)

    def check(self, version: int) -> None:
        self.check_buffer()
        self.check_workers(version)
        self.check_engines()

    # ------------------------------------------------------------------ the buffer

    def check_buffer(self) -> None:
        """Raise BufferFailed if the buffer's service stopped with an error or its actor is gone."""
        if self.buffer is None:
            return
        try:
            err = ray.get(self.buffer.health.remote(), timeout=self.HEALTH_TIMEOUT_S)
        except Exception as e:  # RayActorError, GetTimeoutError
            raise BufferFailed(f"replay buffer actor is gone or not answering: {e!r}; resume with "
                               "trainer.resume=auto") from None
        if err is not None:
            raise BufferFailed(f"replay buffer stopped: {err}; its log holds every acknowledged record: fix "
                               "the cause and resume with trainer.resume=auto")

    # ------------------------------------------------------------------ rollout workers

    def check_workers(self, version: int) -> None:
        for r, w in enumerate(self.workers):
            try:
                st = ray.get(w.state.remote(), timeout=self.HEALTH_TIMEOUT_S)
            except Exception as e:  # RayActorError, GetTimeoutError, or the worker's own crash
                self.worker_status[r] = WorkerStatus.DEAD
                log.warning("rollout worker %d is gone (%r): restarting it, re-issuing %d in-flight prompts",
                            r, e, len(self.positions[r].inflight_positions))
                _quietly(lambda: ray.kill(w))
            else:
                self.states[r], self.positions[r] = st, st.position
                continue
            self.faults["faults/worker_restarts"] += 1
            self.workers[r] = self.spawn_worker(r, self.positions[r], version)
            try:  # a lost node's worker goes where the placement still allows; none: the run stops saying so
                ray.get(self.workers[r].start.remote(), timeout=self.place_timeout_s)
            except GetTimeoutError:
                raise PlacementFailed(f"rollout worker {r} could not be started again within {self.place_timeout_s:.0f} s: "
                                      "no alive node can host it (ray.placement.rollout; its node was lost?)") from None
            self.worker_status[r] = WorkerStatus.RUNNING

    def record(self, r: int, st: RolloutState) -> None:
        """A report worker r gave outside a check (the answer to a call that changed its position)."""
        self.states[r], self.positions[r] = st, st.position

    # ------------------------------------------------------------------ engines

    def ask_engines(self) -> None:
        """Send every engine its liveness question now; the next check_engines reads these answers. The
        controller asks as each training step starts: the embedded engine's probe is a real one-token
        generate answered at the engine's next step boundary (82 ms a check in `asyncrl bench e2e`'s async
        runs), which then runs beside the learner's step instead of after it."""
        self._asked = [(e, e.alive.remote()) for e in self.engines]

    def check_engines(self) -> None:
        asked, self._asked = self._asked, []
        for i, e in enumerate(self.engines):
            # an answer asked ahead, if it was asked of this very actor (not of one replaced since)
            ref = asked[i][1] if i < len(asked) and asked[i][0] is e else e.alive.remote()
            up = _quietly(lambda: ray.get(ref, timeout=self.engine_timeout_s))
            self.engine_status[i] = EngineStatus.UP if up else EngineStatus.DOWN
        down = [i for i, s in enumerate(self.engine_status) if s is EngineStatus.DOWN]
        if not down:
            return
        version = self.learners.version()
        weights = self.base_weights
        if version > 0:
            weights = str(self.restart_weights)
            self.learners.export(weights)
        moved = False
        for i in down:
            log.warning("engine %d is down: restarting it on its port with the weights of version %d", i, version)
            self.faults["faults/engine_restarts"] += 1
            try:
                self.engine_urls[i] = ray.get(self.engines[i].restart.remote(weights, version))
            except RayActorError:  # the actor itself is gone (its node lost): a new one where placement allows
                if self.spawn_engine is None:
                    raise
                url = self._replace_engine(i, weights, version)
                log.warning("engine %d serves again, at %s (was %s)", i, url, self.engine_urls[i])
                moved = moved or url != self.engine_urls[i]
                self.engine_urls[i] = url
            self.engine_status[i] = EngineStatus.UP
        if moved:
            self.engines_moved(list(self.engine_urls))
        self.learners.connect_engines(self.engine_urls)

    def _replace_engine(self, i: int, weights: str, version: int) -> str:
        log.warning("engine %d's actor is gone (its node was lost?): starting a new one where ray.placement.engine "
                    "allows, from the weights of version %d", i, version)
        _quietly(lambda: ray.kill(self.engines[i]))
        self.faults["faults/engines_replaced"] += 1
        self.engines[i] = self.spawn_engine(i, weights)
        try:
            return ray.get(self.engines[i].start.remote(version), timeout=self.place_timeout_s)
        except GetTimeoutError:
            raise PlacementFailed(f"engine {i} could not be started again within {self.place_timeout_s:.0f} s: no alive "
                                  "node can host it (ray.placement.engine; its node was lost)") from None


def _quietly(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None
