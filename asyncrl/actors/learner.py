"""LearnerActor: one rank of the learner group; rank 0 also consumes the buffer and sends weights.

The controller drives a step as: rank 0 `fetch_batch` (blocking on the buffer, with a timeout),
every rank `train_step(batch)` on the same object (Ray passes it by reference, the driver never
holds it), then every rank `sync_weights(version)` (the FSDP gather is collective; rank 0
broadcasts to the engines). Checkpoints commit the trained batch ids to the buffer only after
the checkpoint is durably written, and the ids go into the checkpoint itself, so a crash between
the two is repaired on resume by committing them again.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import ray

from asyncrl.config import Config

log = logging.getLogger(__name__)


@ray.remote
class LearnerActor:
    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int):
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.worker = None
        self.consumer = None
        self.sender = None
        self.uncommitted: list[int] = []

    def setup(self, buffer_address: Optional[str], threads: Optional[int] = None) -> int:
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)  # Ray leaves an actor one thread (OMP_NUM_THREADS=1)

        from asyncrl import registry
        from asyncrl.learner.worker import LearnerWorker

        registry.load_all(self.cfg.plugins)
        if self.world_size > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)
        self.worker = LearnerWorker(self.cfg, rank=self.rank, world_size=self.world_size)
        if self.rank == 0 and buffer_address:
            from asyncrl.buffer.client import BufferConsumer

            self.consumer = BufferConsumer(buffer_address)
        return self.worker.version

    # ------------------------------------------------------------------ data

    def fetch_batch(self, version: int, timeout_s: float) -> Any:
        """Rank 0: the next batch of complete, fresh-enough groups, or None on timeout."""
        return self.consumer.get_batch(self.cfg.trainer.batch_groups, version, timeout_s=timeout_s)

    def train_step(self, batch: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = dict(self.worker.train_step(batch))
        if self.rank == 0:
            self.uncommitted.append(batch.batch_id)
            metrics.update(batch_metrics(batch, self.worker.version - 1))
            metrics["learner/step_seconds"] = time.perf_counter() - t0
            metrics["_uids"] = trained_uids(batch)
        return metrics

    # ------------------------------------------------------------------ weights

    def connect_engines(self, engine_urls: list[str]) -> None:
        from asyncrl.weight_sync import make_sender

        self.close_sender()  # a reconnect (an engine was restarted) replaces the old group/connections
        self.sender = make_sender(self.cfg.trainer.weight_sync, rank=self.rank, engine_urls=engine_urls)

    def close_sender(self) -> None:
        if self.sender is None:
            return
        sender, self.sender = self.sender, None
        try:
            sender.close()
        except Exception as e:  # an engine that died took its end of the group with it
            log.warning("closing the previous weight sender failed (%s: %s); continuing", type(e).__name__, e)

    def sync_weights(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        report = self.sender.sync_blocking(self.worker, version) if self.sender is not None else {}
        return {"sync/seconds": time.perf_counter() - t0, **(report or {})}

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str, extra: dict) -> list[int]:
        """Write the checkpoint (all ranks), then commit the trained batches (rank 0). Returns them."""
        ids = list(self.uncommitted)
        self.worker.save_checkpoint(path, {**extra, "trained_batch_ids": ids})
        if self.rank == 0 and self.consumer is not None:
            self.consumer.commit(ids, step=extra.get("step", self.worker.version))
            self.uncommitted.clear()
        return ids

    def load_checkpoint(self, path: str) -> dict:
        extra = self.worker.load_checkpoint(path)
        if self.rank == 0 and self.consumer is not None and extra.get("trained_batch_ids"):
            self.consumer.commit(list(extra["trained_batch_ids"]), step=extra.get("step", 0))
        return extra

    def version(self) -> int:
        return self.worker.version

    def export(self, out_dir: str) -> None:
        self.worker.export_hf(out_dir)


def batch_metrics(batch: Any, version: int) -> dict[str, float]:
    """Reward, staleness and size of a trained batch (computed where the batch already is)."""
    trajs = batch.trajectories()
    rewards = [t.reward for t in trajs]
    stale = [version - t.min_version() for t in trajs]
    n_tok = sum(int(t.loss_mask.numpy().sum()) for t in trajs)
    parts: dict[str, list[float]] = {}  # the reward function's extra outputs (reward/correct, ...)
    for t in trajs:
        for k, v in t.metrics.items():
            if k.startswith("reward/"):
                parts.setdefault(k, []).append(v)
    return {
        **{f"train/{k}": sum(v) / len(v) for k, v in parts.items()},
        "train/reward_mean": sum(rewards) / max(len(rewards), 1),
        "train/num_trajectories": len(trajs),
        "train/staleness_mean": sum(stale) / max(len(stale), 1),
        "train/staleness_max": max(stale, default=0),
        "train/generated_tokens": n_tok,
        "train/num_turns_mean": sum(t.num_turns for t in trajs) / max(len(trajs), 1),
        "train/batch_id": batch.batch_id,
    }


def trained_uids(batch: Any) -> list[str]:
    return [t.uid for t in batch.trajectories()]
