"""LearnerGroup: the learner ranks as one object on the driver (slime's RayTrainGroup, for asyncrl).

Every learner operation but fetching a batch is collective (FSDP gathers, DCP checkpoints, the
weight broadcast), so a call must reach every rank once, and the ranks answer alike or only rank 0
holds the answer. `_all` is the one place that fans a call out and returns rank 0's result; the
methods below only name the call. `fetch_batch` goes to rank 0 alone (it owns the buffer consumer).
"""

from __future__ import annotations

from typing import Any, Optional

import ray

from asyncrl.buffer.keys import BufferEndpoint
from asyncrl.config import Config
from asyncrl.job_state import JobState, StepResult


class LearnerGroup:
    def __init__(self, cfg: Config, buffer: BufferEndpoint, threads: Optional[int] = None):
        """`buffer`: the consumer's endpoint (its CURVE key pair, if any), handed to rank 0 alone."""
        from asyncrl.actors.learner import LearnerActor
        from asyncrl.net import free_port

        port, n = free_port(), cfg.trainer.learner_ranks
        self.actors = [LearnerActor.remote(cfg, r, n, "127.0.0.1", port) for r in range(n)]
        ray.get([a.setup.remote(buffer if r == 0 else None, threads) for r, a in enumerate(self.actors)])

    def _all(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        """Call `method(*args)` on every rank once; rank 0's result."""
        return ray.get([getattr(a, method).remote(*args) for a in self.actors], timeout=timeout_s)[0]

    def fetch_batch(self, timeout_s: float) -> Any:
        """Rank 0: the next batch for the learner's current version, or None after `timeout_s`."""
        return ray.get(self.actors[0].fetch_batch.remote(timeout_s))

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

    def load_checkpoint(self, path: str) -> tuple[JobState, int]:
        """The checkpoint's job state and the learner's restored policy version."""
        return self._all("load_checkpoint", path)

    def export(self, out_dir: str) -> None:
        self._all("export", out_dir)

    def version(self) -> int:
        """The policy version the learner holds now (its owner's answer, not a copy)."""
        return ray.get(self.actors[0].version.remote())

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
