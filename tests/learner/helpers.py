"""Batches and configs for learner tests (real tiny model, real schema structs)."""

from __future__ import annotations

import numpy as np

from asyncrl.config import AgentConfig, AlgorithmConfig, Config, ModelConfig, SamplingConfig, TrainerConfig
from asyncrl.data.schema import Batch, Group, make_trajectory


def make_batch(seed: int = 0, groups: int = 2, per_group: int = 2, prompt=(3, 8), response=(2, 10),
               vocab: int = 2000, batch_id: int = 0, logp_noise: float = 0.3, shared_prompt: bool = False) -> Batch:
    """Random token sequences with a tool-output span masked out and behavior logprobs near -3; with
    `shared_prompt` the samples of a group share one prompt (as GRPO's do)."""
    rng = np.random.default_rng(seed)
    gs = []
    for g in range(groups):
        trajs = []
        group_prompt = rng.integers(10, vocab, int(rng.integers(*prompt))).tolist()
        for k in range(per_group):
            p = int(rng.integers(*prompt))
            r = int(rng.integers(*response))
            mask = np.ones(r, dtype=np.uint8)
            if r >= 4:
                mask[r // 2 : r // 2 + 2] = 0  # an inserted (tool output) span
            behav = np.where(mask == 1, -3.0 + logp_noise * rng.standard_normal(r), 0.0).astype(np.float32)
            trajs.append(make_trajectory(
                uid=f"b{batch_id}-g{g}-{k}", group_id=f"b{batch_id}-g{g}",
                prompt_ids=group_prompt if shared_prompt else rng.integers(10, vocab, p).tolist(), response_ids=rng.integers(10, vocab, r).tolist(),
                loss_mask=mask.tolist(), behavior_logprobs=behav.tolist(),
                versions=np.where(mask == 1, 0, -1).tolist(), reward=float(rng.integers(0, 2) + 0.5 * k),
                group_size=per_group,
            ))
        gs.append(Group(group_id=f"b{batch_id}-g{g}", trajectories=trajs, expected=per_group))
    return Batch(batch_id=batch_id, groups=gs)


def make_cfg(model_dir, **algo) -> Config:
    base = dict(lr=1e-3, micro_batch_tokens=64, grad_clip=1.0)
    base.update(algo)
    return Config(model=ModelConfig(path=str(model_dir)), algorithm=AlgorithmConfig(**base),
                  agent=AgentConfig(max_response_tokens=16, sampling=SamplingConfig(temperature=0.7)),
                  trainer=TrainerConfig(total_steps=4))
