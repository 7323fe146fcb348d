"""LearnerActor: one rank of the learner group; rank 0 also consumes the buffer and sends weights.

The controller drives a step (through `asyncrl.run.learner_group.LearnerGroup`) as: rank 0
`fetch_batch` (blocking on the buffer, with a timeout), every rank `train_step(batch)` on the same
object (Ray passes it by reference, the driver never holds it), then every rank `sync_weights()`
(the FSDP gather is collective; rank 0 broadcasts to the engines).

The policy version is the learner's own (`LearnerWorker.version`, advanced by each optimizer-updated
step and restored from a checkpoint): this actor reads it where it needs it (the GET's current
version, the weight version it sends, a batch's staleness) and hands it out in `StepResult`; it is
told no version by anyone. Checkpoints commit the trained batch ids to the buffer only after the
checkpoint is durably written, and the ids go into the checkpoint itself, so a crash between the two
is repaired on resume by committing them again.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import msgspec
import ray

from asyncrl import registry
from asyncrl.buffer.client import BufferConsumer
from asyncrl.buffer.keys import BufferEndpoint
from asyncrl.config import Config
from asyncrl.data.job_state import JobState, StepResult
from asyncrl.run.placement import group_env, node_rendezvous

log = logging.getLogger(__name__)


@ray.remote
class LearnerActor:
    def __init__(self, cfg: Config, rank: int, world_size: int, master_addr: str, master_port: int):
        """`master_addr`/`master_port`: where the ranks' process group meets (rank 0's node; a port of 0: rank 0
        has not been asked yet, `rendezvous` then `set_master` before `setup`)."""
        group_env(master_addr, master_port, rank, world_size)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.worker = None
        self.consumer = None
        self.sender = None
        self.uncommitted: list[int] = []

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free port on it (the group's meeting point when ranks span nodes)."""
        return node_rendezvous()

    def set_master(self, master_addr: str, master_port: int) -> None:
        group_env(master_addr, master_port, self.rank, self.world_size)

    def setup(self, buffer: Optional[BufferEndpoint], threads: Optional[int] = None) -> int:
        # lazy: imports torch, which this module does not load otherwise
        import torch

        # lazy: imports torch, which this module does not load otherwise
        from asyncrl.learner.distributed import init_distributed

        if threads:
            torch.set_num_threads(threads)  # Ray leaves an actor one thread (OMP_NUM_THREADS=1)

        # lazy: imports torch, which this module does not load otherwise
        from asyncrl.learner.worker import LearnerWorker

        registry.load_all(self.cfg.plugins)
        init_distributed(self.rank, self.world_size, "cuda" if torch.cuda.is_available() else "cpu",
                         timeout_s=self.cfg.trainer.learner_timeout_s)
        self.worker = LearnerWorker(self.cfg, rank=self.rank, world_size=self.world_size)
        if self.rank == 0 and buffer is not None:
            self.consumer = BufferConsumer(buffer)
        return self.worker.version

    # ------------------------------------------------------------------ data

    def fetch_batch(self, timeout_s: float) -> Any:
        """Rank 0: the next batch of complete groups fresh enough for this learner's version, or None
        on timeout (the staleness bound is the buffer's, set when it was built)."""
        return self.consumer.get_batch(self.cfg.trainer.batch_groups, self.worker.version, timeout_s=timeout_s)

    def train_step(self, batch: Any, critic_values: Any = None, critic_steps: int = 0) -> StepResult:
        """Train on `batch` (every rank); the result carries the new version, the batch's uids and metrics
        (and, with a critic on its own ranks, given its values, the targets of its update)."""
        t0 = time.perf_counter()
        trained_on = batch_metrics(batch, self.worker.version) if self.rank == 0 else {}  # staleness before the step
        metrics = {**self.worker.train_step(batch, critic_values, critic_steps), **trained_on}
        if self.rank == 0:
            self.uncommitted.append(batch.batch_id)
            metrics["learner/step_seconds"] = time.perf_counter() - t0
        return StepResult(version=self.worker.version, batch_id=batch.batch_id,
                          trained_uids=[t.uid for t in batch.trajectories()] if self.rank == 0 else [],
                          metrics=metrics, critic_targets=self.worker.critic_targets if self.rank == 0 else None,
                          token_logprobs=self.worker.token_logprobs if self.rank == 0 else [])

    # ------------------------------------------------------------------ weights

    def connect_engines(self, engine_urls: list[str]) -> None:
        # lazy: imports torch, which this module does not load otherwise
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

    def sync_weights(self) -> dict[str, float]:
        """Send this learner's weights, as its current version, to the engines (collective)."""
        t0 = time.perf_counter()
        report = self.sender.sync_blocking(self.worker, self.worker.version) if self.sender is not None else {}
        return {"sync/seconds": time.perf_counter() - t0, **(report or {})}

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str, job: JobState) -> list[int]:
        """Write the checkpoint (all ranks) with `job` and the batches trained since the last one, then
        commit those batches (rank 0). Returns them."""
        ids = list(self.uncommitted)
        job = msgspec.structs.replace(job, trained_batch_ids=ids)
        self.worker.save_checkpoint(path, job.to_builtins())
        if self.rank == 0 and self.consumer is not None:
            self.consumer.commit(ids, step=job.step)
            self.uncommitted.clear()
        return ids

    def load_checkpoint(self, path: str, highest_published: int = 0) -> tuple[JobState, int]:
        """Restore the checkpoint (all ranks); re-commit its batch ids (rank 0: idempotent, in case the
        crash came between checkpoint and commit). Returns the job state and the restored version; new
        weights are numbered above `highest_published` (the run record's, see LearnerWorker.load_checkpoint)."""
        job = JobState.from_builtins(self.worker.load_checkpoint(path, highest_published))
        if self.rank == 0 and self.consumer is not None and job.trained_batch_ids:
            self.consumer.commit(job.trained_batch_ids, step=job.step)
        return job, self.worker.version

    def version(self) -> int:
        return self.worker.version

    def export(self, out_dir: str) -> None:
        self.worker.export_hf(out_dir)


def batch_metrics(batch: Any, version: int) -> dict[str, float]:
    """Reward, staleness and size of a batch about to be trained by policy `version` (computed where
    the batch already is): a trajectory's staleness is `version` minus its oldest token's version."""
    trajs = batch.trajectories()
    rewards = [t.reward for t in trajs]
    stale = [version - t.min_version() for t in trajs]
    n_tok = sum(int(t.loss_mask.numpy().sum()) for t in trajs)
    parts: dict[str, list[float]] = {}  # the reward function's extra outputs (reward/correct, ...), the proxy's counts
    for t in trajs:
        for k, v in t.metrics.items():
            if k.startswith(("reward/", "proxy/")):
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
