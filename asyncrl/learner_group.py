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
"""

from __future__ import annotations

from typing import Any, Optional

import ray
from ray.exceptions import RayActorError, RayTaskError

from asyncrl.buffer.keys import BufferEndpoint
from asyncrl.config import Config
from asyncrl.job_state import JobState, StepResult

DEATH_GRACE_S = 30.0  # after one rank fails, how long to look for a rank that died (the root cause)


class LearnerRankLost(RuntimeError):
    """A learner rank's process is gone: the group cannot go on (its collectives need every rank)."""


class LearnerGroup:
    def __init__(self, cfg: Config, buffer: BufferEndpoint, threads: Optional[int] = None):
        """`buffer`: the consumer's endpoint (its CURVE key pair, if any), handed to rank 0 alone."""
        from asyncrl.actors.learner import LearnerActor
        from asyncrl.net import free_port

        port, n = free_port(), cfg.trainer.learner_ranks
        self.actors = [LearnerActor.remote(cfg, r, n, "127.0.0.1", port) for r in range(n)]
        # set-up runs while the caller starts other parts (the engines); wait_ready() waits for it
        self._setup = [a.setup.remote(buffer if r == 0 else None, threads) for r, a in enumerate(self.actors)]

    def wait_ready(self) -> None:
        """Return once every rank has set up (its model loaded, its process group formed); a rank that
        failed or died raises here."""
        if self._setup:
            refs, self._setup = self._setup, []
            self._gather(refs)

    def _all(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        """Call `method(*args)` on every rank once; rank 0's result."""
        return self._gather([getattr(a, method).remote(*args) for a in self.actors], timeout_s)[0]

    def _gather(self, refs: list[Any], timeout_s: Optional[float] = None) -> list[Any]:
        """Every rank's result (refs[r] is rank r's call); the first failure ends the wait (see the
        module docstring). A `timeout_s` that passes raises ray's GetTimeoutError."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not done:
                raise ray.exceptions.GetTimeoutError(f"learner ranks did not answer within {timeout_s}s")
            try:
                ray.get(done[0])
            except RayActorError as e:
                raise _lost(refs.index(done[0]), e) from None
            except RayTaskError as e:
                died = _dead_rank(refs, pending)
                if died is not None:
                    raise died from None
                raise (e.cause if isinstance(e.cause, Exception) else e) from None
        return ray.get(list(refs))

    def fetch_batch(self, timeout_s: float) -> Any:
        """Rank 0: the next batch for the learner's current version, or None after `timeout_s`."""
        return self._gather([self.actors[0].fetch_batch.remote(timeout_s)])[0]

    def train_step(self, batch: Any) -> StepResult:
        return self._all("train_step", batch)

    def sync_weights(self) -> dict[str, float]:
        """Send the learner's weights, as its own version, to the connected engines."""
        return self._all("sync_weights")

    def connect_engines(self, engine_urls: list[str]) -> None:
        self._all("connect_engines", engine_urls)

    def close_sender(self, timeout_s: Optional[float] = None) -> None:
        """Leave the weight-sync group (before its engines go)."""
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
        return self._gather([self.actors[0].version.remote()])[0]

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass


def _dead_rank(refs: list[Any], pending: list[Any]) -> Optional[LearnerRankLost]:
    """Within DEATH_GRACE_S: the LearnerRankLost of a rank (its index in `refs`) among the `pending`
    calls whose actor died, if one did."""
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=DEATH_GRACE_S)
        if not done:
            return None
        try:
            ray.get(done[0])
        except RayActorError as e:
            return _lost(refs.index(done[0]), e)
        except RayTaskError:
            pass
    return None


def _lost(rank: int, e: BaseException) -> LearnerRankLost:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return LearnerRankLost(f"learner rank {rank} died ({type(e).__name__}: {first}): the run stops; resume from "
                           "the last checkpoint with trainer.resume=auto")
