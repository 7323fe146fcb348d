"""Functions run inside spawned learner ranks (module level so that `spawn` can import them)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.learner.helpers import make_batch, make_cfg

FSDP_ALGO = dict(minibatches=2, micro_batch_tokens=24, lr=1e-3, warmup_steps=1, lr_schedule="cosine")
FSDP_BATCH = dict(seed=3, groups=2, per_group=3)


def train_and_dump(rank: int, world_size: int, model_dir: str, out_dir: str) -> None:
    """One train_step on the shared batch; rank 0 dumps metrics and the full updated parameters. The
    checkpoint and HF export are written only by the sharded run (world_size > 1): the test loads those."""
    from asyncrl.learner.worker import LearnerWorker

    out = Path(out_dir)
    worker = LearnerWorker(make_cfg(model_dir, **FSDP_ALGO), rank=rank, world_size=world_size)
    metrics = worker.train_step(make_batch(**FSDP_BATCH))
    params = {name: t.clone() for bucket in worker.iter_full_params(1 << 18) for name, t in bucket}
    if world_size > 1:
        worker.save_checkpoint(str(out / f"ckpt_w{world_size}"), {"world": world_size})
        worker.export_hf(str(out / f"hf_w{world_size}"))
    if rank == 0:
        torch.save({"metrics": metrics, "params": params}, out / f"result_w{world_size}.pt")


def critic_train_and_dump(rank: int, world_size: int, model_dir: str, out_dir: str) -> None:
    """One PPO (adv_estimator=gae) train_step; rank 0 dumps the metrics and the critic's full parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from asyncrl.config import CriticConfig
    from asyncrl.learner.worker import LearnerWorker

    cfg = make_cfg(model_dir, **{**FSDP_ALGO, "adv_estimator": "gae", "critic": CriticConfig(lr=1e-3)})
    worker = LearnerWorker(cfg, rank=rank, world_size=world_size)
    metrics = worker.train_step(make_batch(**FSDP_BATCH))
    critic = get_model_state_dict(worker.critic.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"metrics": metrics, "critic": critic}, Path(out_dir) / f"critic_w{world_size}.pt")


def lora_train_and_dump(rank: int, world_size: int, model_dir: str, out_dir: str) -> None:
    """One train_step with LoRA adapters (FSDP2 shards them with the frozen base); rank 0 dumps the merged
    parameters as they would be synced to the engines."""
    from dataclasses import replace

    from asyncrl.config import LoraConfig
    from asyncrl.learner.worker import LearnerWorker

    cfg = make_cfg(model_dir, **{**FSDP_ALGO, "lr": 1e-2})
    cfg = replace(cfg, model=replace(cfg.model, lora=LoraConfig(rank=4, alpha=8.0)))
    worker = LearnerWorker(cfg, rank=rank, world_size=world_size)
    metrics = worker.train_step(make_batch(**FSDP_BATCH))
    params = {name: t.clone() for bucket in worker.iter_full_params(1 << 18) for name, t in bucket}
    if rank == 0:
        torch.save({"metrics": metrics, "params": params}, Path(out_dir) / f"lora_w{world_size}.pt")
