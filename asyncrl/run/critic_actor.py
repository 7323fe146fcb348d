"""CriticActor: one rank of a critic on ranks of its own (algorithm.critic.placement=separate).

Its ranks form their own process group (their own MASTER_PORT), so the critic's collectives never mix with
the learner's. The controller (asyncrl/run/learner_group.py `CriticGroup`) calls `values(batch)` before the
learner's step and `update(batch, returns, old_values)` after it, on every rank; Ray runs one actor's calls in
the order they were made, so an update still running when the next `values` comes finishes first.
"""

from __future__ import annotations

from typing import Any, Optional

import ray

from asyncrl.config import Config
from asyncrl.run.placement import group_env, node_rendezvous


@ray.remote
class CriticActor:
    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int):
        group_env(master_addr, master_port, rank, world_size)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.worker: Any = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free port on it (see LearnerActor.rendezvous)."""
        return node_rendezvous()

    def set_master(self, master_addr: str, master_port: int) -> None:
        group_env(master_addr, master_port, self.rank, self.world_size)

    def setup(self, threads: Optional[int] = None) -> int:
        # lazy: imports torch, which this module does not load otherwise
        import torch

        # lazy: imports torch, which this module does not load otherwise
        from asyncrl.learner.critic import CriticWorker

        if threads:
            torch.set_num_threads(threads)
        self.worker = CriticWorker(self.cfg, rank=self.rank, world_size=self.world_size)
        return self.worker.steps

    def values(self, batch: Any) -> tuple[list[Any], int]:
        """(this critic version's values of every trajectory, its update count): rank 0's answer is used."""
        return self.worker.values(batch), self.worker.steps

    def update(self, batch: Any, returns: list[Any], old_values: list[Any]) -> dict[str, float]:
        return self.worker.update(batch, returns, old_values)

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> int:
        self.worker.load_checkpoint(path)
        return self.worker.steps
