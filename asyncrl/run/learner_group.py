"""LearnerGroup: the learner ranks as one object on the driver (slime's RayTrainGroup, for asyncrl).

Every learner operation but fetching a batch is collective (FSDP gathers, DCP checkpoints, the
weight broadcast), so a call must reach every rank once, and the ranks answer alike or only rank 0
holds the answer. `_all` is the one place that fans a call out and returns rank 0's result; the
methods below only name the call. `fetch_batch` goes to rank 0 alone (it owns the buffer consumer).

A lost rank stops the run: the ranks' process group has a timeout (`trainer.learner_timeout_s`, so a
rank blocked in a collective with a dead peer gives up), and `_gather` raises `LearnerRankLost`
("learner rank 1 died (...): resume with trainer.resume=auto") as soon as any rank's actor is gone,
without waiting for the ranks still blocked. A rank's own exception is re-raised as itself (its
cause, not Ray's wrapper), unless another rank died meanwhile (then that is the cause reported).

A rank that is alive but does not answer (SIGSTOPped by an operator or a debugger, wedged in a driver
call) stops the run too: every call but the set-up waits at most `trainer.learner_timeout_s` beyond its
own timeout, then raises `LearnerRankStalled` naming the ranks that did not answer, the call and the
setting. Without that deadline the run waited forever ("waiting for a batch: 4/4 complete"), since the
watchdog looks between steps.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import ray
from ray.exceptions import RayActorError, RayTaskError

from asyncrl.buffer.keys import BufferEndpoint
from asyncrl.config import Config
from asyncrl.data.job_state import JobState, StepResult
from asyncrl.run.critic_actor import CriticActor
from asyncrl.run.learner_actor import LearnerActor
from asyncrl.run.placement import actor_options
from asyncrl.util.net import free_port

DEATH_GRACE_S = 30.0  # after one rank fails, how long to look for a rank that died (the root cause)


class LearnerRankLost(RuntimeError):
    """A learner rank's process is gone: the group cannot go on (its collectives need every rank)."""


class LearnerRankStalled(LearnerRankLost):
    """A learner rank's process is there but did not answer a call within its deadline."""


class RankGroup:
    """Ranks of one role (Ray actors in one process group) as one object: `_all` fans a call out once to
    every rank and returns rank 0's result; `_gather` waits, naming a lost rank by role (module docstring)."""

    role = "learner"
    actors: list[Any]
    _setup: list[Any]
    deadline_s: Optional[float] = None  # trainer.learner_timeout_s: how long past its own timeout a call may take
    broken: Optional[str] = None  # why the group cannot go on (a rank lost or stalled): shutdown asks it nothing

    def wait_ready(self) -> None:
        """Return once every rank has set up (its model loaded, its process group formed); a rank that
        failed or died raises here."""
        if self._setup:
            refs, self._setup = self._setup, []
            self._gather(refs, deadline=False)  # loading a model has no bound worth guessing

    def _all(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        """Call `method(*args)` on every rank once; rank 0's result."""
        return self._gather([getattr(a, method).remote(*args) for a in self.actors], timeout_s, method)[0]

    def _gather(self, refs: list[Any], timeout_s: Optional[float] = None, method: str = "set-up",
                deadline: bool = True, runs_s: float = 0.0) -> list[Any]:
        """Every rank's result (refs[r] is rank r's call); the first failure ends the wait (see the
        module docstring). A `timeout_s` is a hard cap: past it, ray's GetTimeoutError. Without one, the
        call may take its own expected time `runs_s` plus `deadline_s`, then `LearnerRankStalled` names
        the ranks that did not answer (`deadline=False`: no bound)."""
        pending = list(refs)
        if timeout_s is not None:
            wait_s: Optional[float] = timeout_s
        elif deadline and self.deadline_s is not None:
            wait_s = runs_s + self.deadline_s
        else:
            wait_s = None
        ends = None if wait_s is None else time.monotonic() + wait_s
        while pending:
            left = None if ends is None else max(0.0, ends - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                if timeout_s is not None:
                    raise ray.exceptions.GetTimeoutError(f"{self.role} ranks did not answer within {timeout_s}s")
                silent = [refs.index(r) for r in pending]
                self.broken = "stalled"
                raise LearnerRankStalled(
                    f"{self.role} rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer "
                    f"{method} within {wait_s:g} s (trainer.learner_timeout_s={self.deadline_s:g}): its process is "
                    f"stopped or wedged; the run stops (resume with trainer.resume=auto)")
            try:
                ray.get(done[0])
            except RayActorError as e:
                self.broken = "lost"
                raise _lost(self.role, refs.index(done[0]), e) from None
            except RayTaskError as e:
                died = _dead_rank(self.role, refs, pending)
                if died is not None:
                    self.broken = "lost"
                    raise died from None
                raise (e.cause if isinstance(e.cause, Exception) else e) from None
        return ray.get(list(refs))

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass


def _start_ranks(actor_class: Any, cfg: Config, n: int, nodes: int) -> list[Any]:
    """n rank actors placed by ray.placement.learner, told where their group meets: 127.0.0.1 on one node,
    else rank 0's node IP and a port free there (asyncrl/run/placement.py)."""
    opts = actor_options(cfg.ray.placement.learner)
    if nodes < 2:
        port = free_port()
        return [actor_class.options(**opts).remote(cfg, r, n, "127.0.0.1", port) for r in range(n)]
    actors = [actor_class.options(**opts).remote(cfg, r, n, "127.0.0.1", 0) for r in range(n)]
    host, port = ray.get(actors[0].rendezvous.remote())
    for a in actors:
        a.set_master.remote(host, port)  # an actor's calls run in order: before its setup
    return actors


class LearnerGroup(RankGroup):
    def __init__(self, cfg: Config, buffer: BufferEndpoint, threads: Optional[int] = None, nodes: int = 1):
        """`buffer`: the consumer's endpoint (its CURVE key pair, if any), handed to rank 0 alone; `nodes`: the
        cluster's alive nodes (several: the ranks' group meets at rank 0's node)."""
        self.deadline_s = cfg.trainer.learner_timeout_s
        self.actors = _start_ranks(LearnerActor, cfg, cfg.trainer.learner_ranks, nodes)
        # set-up runs while the caller starts other parts (the engines); wait_ready() waits for it
        self._setup = [a.setup.remote(buffer if r == 0 else None, threads) for r, a in enumerate(self.actors)]

    def fetch_batch(self, timeout_s: float) -> Any:
        """Rank 0: the next batch for the learner's current version, or None after `timeout_s`."""
        return self._gather([self.actors[0].fetch_batch.remote(timeout_s)], None, "fetch_batch", runs_s=timeout_s)[0]

    def train_step(self, batch: Any, critic_values: Any = None, critic_steps: int = 0) -> StepResult:
        """Train on `batch`; with a critic on its own ranks, its values of the batch and its step count."""
        return self._all("train_step", batch, critic_values, critic_steps)

    def sync_weights(self) -> dict[str, float]:
        """Send the learner's weights, as its own version, to the connected engines."""
        return self._all("sync_weights")

    def connect_engines(self, engine_urls: list[str]) -> None:
        self._all("connect_engines", engine_urls)

    def close_sender(self, timeout_s: Optional[float] = None) -> None:
        """Leave the weight-sync group (before its engines go); a broken group is not asked (its ranks are
        killed instead)."""
        if self.broken is None:
            self._all("close_sender", timeout_s=timeout_s)

    def save_checkpoint(self, path: str, job: JobState) -> list[int]:
        return self._all("save_checkpoint", path, job)

    def load_checkpoint(self, path: str, highest_published: int = 0) -> tuple[JobState, int]:
        """The checkpoint's job state and the learner's restored policy version (new weights are numbered
        above `highest_published`, the highest version the run ever published)."""
        return self._all("load_checkpoint", path, highest_published)

    def export(self, out_dir: str) -> None:
        self._all("export", out_dir)

    def version(self) -> int:
        """The policy version the learner holds now (its owner's answer, not a copy)."""
        return self._gather([self.actors[0].version.remote()], None, "version")[0]


def _dead_rank(role: str, refs: list[Any], pending: list[Any]) -> Optional[LearnerRankLost]:
    """Within DEATH_GRACE_S: the LearnerRankLost of a rank (its index in `refs`) among the `pending`
    calls whose actor died, if one did."""
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=DEATH_GRACE_S)
        if not done:
            return None
        try:
            ray.get(done[0])
        except RayActorError as e:
            return _lost(role, refs.index(done[0]), e)
        except RayTaskError:
            pass
    return None


def _lost(role: str, rank: int, e: BaseException) -> LearnerRankLost:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return LearnerRankLost(f"{role} rank {rank} died ({type(e).__name__}: {first}): the run stops; resume from "
                           "the last checkpoint with trainer.resume=auto")


class CriticGroup(RankGroup):
    """The critic's own ranks (algorithm.critic.placement=separate; asyncrl/run/critic_actor.py). A step is
    `values(batch)` before the learner's step, then `start_update(...)` with the learner's GAE targets, which
    runs while the learner syncs weights and waits for the next batch; `finish_update()` collects its metrics
    (the next `values` waits for it anyway: one actor's calls run in order)."""

    role = "critic"

    def __init__(self, cfg: Config, threads: Optional[int] = None, nodes: int = 1):
        self.deadline_s = cfg.trainer.learner_timeout_s
        self.actors = _start_ranks(CriticActor, cfg, cfg.algorithm.critic.ranks, nodes)
        self._setup = [a.setup.remote(threads) for a in self.actors]
        self._update: list[Any] = []
        self._finished: dict[str, float] = {}  # metrics of an update waited for but not yet taken

    def values(self, batch: Any) -> tuple[list[Any], int]:
        """(the critic's values of every trajectory of `batch`, its update count)."""
        return self._all("values", batch)

    def start_update(self, batch: Any, returns: list[Any], old_values: list[Any]) -> None:
        self._update = [a.update.remote(batch, returns, old_values) for a in self.actors]

    def finish_update(self) -> None:
        """Wait for the update in flight, if any (its metrics are kept for `take_metrics`)."""
        if self._update:
            refs, self._update = self._update, []
            self._finished = self._gather(refs, None, "update")[0]

    def take_metrics(self) -> dict[str, float]:
        """The metrics of the last update (waiting for it if it is still running); {} after the first time."""
        self.finish_update()
        out, self._finished = self._finished, {}
        return out

    def save_checkpoint(self, path: str) -> None:
        self.finish_update()
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> int:
        return self._all("load_checkpoint", path)
