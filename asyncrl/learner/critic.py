"""The critic of adv_estimator=gae (PPO): a value head on a transformers trunk, trained beside the policy.

Placement: by default the critic lives on the learner's ranks (colocated, as verl's default), sharded by
FSDP2 over the same process group, with its own AdamW; with algorithm.critic.placement=separate the same
`Critic` runs in `CriticWorker`s on ranks of its own (see that class). Its values for a batch come from the critic version that
trains on that batch: `values` runs at the start of the learner's step, GAE (asyncrl/learner/gae.py)
turns them and the placed rewards into advantages and value targets, the policy updates, then `update`
fits the critic to the targets with the clipped value loss against those same old values. Stale
trajectories are valued by today's critic, the same critic that then learns from them, so the critic
needs no importance correction of its own; the policy's staleness is corrected as for every estimator.

The model: the causal LM's trunk (`base_model`, without its lm_head) from `algorithm.critic.path`, or
the policy's model when null, and a linear head hidden -> 1 initialised to zero (every value starts at
0, so the first GAE advantages are the discounted rewards). The value at response position t is read
from the hidden state of the position that predicts token t (the context before it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.learner import checkpoint as ckpt
from asyncrl.learner.distributed import (
    all_gather_dict,
    init_distributed,
    max_over_ranks,
    rank_device,
    shard_fsdp2,
)
from asyncrl.learner.gae import value_loss
from asyncrl.learner.packing import Layout, SeqSpec, mask_argument, scatter_rows, specs_of
from asyncrl.models import (
    compute_context,
    load_model,
    load_tokenizer,
    pad_token_id,
    precision,
    set_gradient_checkpointing,
)
from asyncrl.secrets import shown_config
from asyncrl.util.cpus import native_bf16


class PolicyWorker(Protocol):
    """What the colocated critic reads from the policy's worker (asyncrl/learner/worker.py's
    `LearnerWorker`): its ranks, device, row layout and padding token. A protocol, so this module does not
    import the worker that imports it."""

    algo: Any
    device: Any
    layout: Any
    pad_id: int
    rank: int
    world_size: int

    def _max_over_ranks(self, n: int) -> int: ...


class ValueModel(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.trunk = lm.base_model
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1, dtype=next(lm.parameters()).dtype)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self._no_split_modules = list(getattr(lm, "_no_split_modules", None) or [])

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Any,
                keep: torch.Tensor) -> torch.Tensor:
        """Values [K] of the kept positions (row-major order of `keep`)."""
        h = self.trunk(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                       use_cache=False).last_hidden_state
        return self.value_head(h[keep]).squeeze(-1).float()


class Critic:
    """The critic's model, optimizer and step count on one learner rank (collective methods: every rank)."""

    def __init__(self, worker: PolicyWorker):
        self.w = worker
        self.cfg = worker.algo.critic
        model_cfg = worker.cfg.model if self.cfg.path is None else replace(worker.cfg.model, path=self.cfg.path)
        # the critic's weights and compute: the precision rule's (asyncrl.models.precision; docs/design.md "Precision")
        self.precision = precision("critic", worker.cfg.model.dtype, worker.device, native_bf16=native_bf16(),
                                   cpu_bf16=worker.cfg.model.cpu_bf16, world_size=worker.world_size)
        lm = load_model(model_cfg, device=worker.device, dtype=self.precision.weights)
        self.model = ValueModel(lm).to(worker.device)
        del lm
        if worker.cfg.model.gradient_checkpointing:
            set_gradient_checkpointing(self.model.trunk, True)
        self.model.train()
        worker.shard(self.model, self.precision)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, betas=tuple(worker.algo.betas))
        self.steps = 0  # critic updates taken (its version)

    def _forward(self, specs: list[SeqSpec], idx: list[int]) -> tuple[torch.Tensor, Any]:
        mb = self.w.layout.micro_batch(specs, idx)
        d = self.w.device
        with compute_context(self.precision, d):
            v = self.model(mb.input_ids.to(d), mb.position_ids.to(d), mask_argument(mb, self.model, d), mb.keep.to(d))
        return scatter_rows(v, mb), mb

    def _dummy(self, backward: bool) -> None:
        ids = torch.tensor([[self.w.pad_id]], device=self.w.device)
        keep = torch.ones_like(ids, dtype=torch.bool)
        with compute_context(self.precision, self.w.device):
            v = self.model(ids, torch.zeros_like(ids), None, keep)
        if backward:
            (v.sum() * 0.0).backward()

    @torch.no_grad()
    def values(self, specs: list[SeqSpec], local: list[int]) -> dict[int, torch.Tensor]:
        """Values float32 [R] of the response positions of the sequences `local` (0 where loss_mask is 0)."""
        plan = self.w.layout.plan(specs, local)
        out: dict[int, torch.Tensor] = {}
        for k in range(self.w._max_over_ranks(len(plan))):
            if k >= len(plan):
                self._dummy(backward=False)
                continue
            idx = [local[j] for j in plan[k]]
            vals, mb = self._forward(specs, idx)
            for n, i in enumerate(idx):
                m = specs[i].loss_mask
                out[i] = torch.where(m, vals[n, : m.numel()].float().cpu(), torch.zeros(m.numel()))
        return out

    def update(self, minibatches: list[list[int]], specs: list[SeqSpec], masks: list[torch.Tensor],
               returns: list[torch.Tensor], old_values: list[torch.Tensor]) -> dict[str, float]:
        """One pass of clipped value-loss updates, one optimizer step per minibatch; the critic's metrics."""
        w = self.w
        sums = torch.zeros(4, dtype=torch.float64)  # loss, clip tokens, tokens, grad norm
        for mb_idx in minibatches:
            n_tok = float(sum(int(masks[i].sum()) for i in mb_idx))
            local = mb_idx[w.rank :: w.world_size]
            plan = w.layout.plan(specs, local)
            self.optimizer.zero_grad(set_to_none=True)
            for k in range(w._max_over_ranks(len(plan))):
                if k >= len(plan):
                    self._dummy(backward=True)
                    continue
                idx = [int(local[j]) for j in plan[k]]
                vals, mb = self._forward(specs, idx)

                def stack(xs: list[torch.Tensor], dt=torch.float32) -> torch.Tensor:
                    out = torch.zeros((len(xs), mb.max_response), dtype=dt)
                    for n, x in enumerate(xs):
                        out[n, : x.numel()] = x.to(dt)
                    return out.to(w.device)

                mask = stack([masks[i] for i in idx], torch.bool)
                loss, m = value_loss(vals.float(), stack([old_values[i] for i in idx]), stack([returns[i] for i in idx]),
                                     mask, self.cfg.cliprange_value, num_tokens=n_tok)
                (loss * w.world_size).backward()
                local_n = float(mask.sum())
                sums += torch.tensor([float(loss.detach()), m["vf_clip_frac"] * local_n, local_n, 0.0],
                                     dtype=torch.float64)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                  w.algo.grad_clip if w.algo.grad_clip > 0 else float("inf"))
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            if np.isfinite(norm):
                self.optimizer.step()
                sums[3] += norm
            else:
                self.optimizer.zero_grad(set_to_none=True)
        if w.world_size > 1:
            dist.all_reduce(sums)
        self.steps += 1
        n = len(minibatches)
        return {"critic/value_loss": float(sums[0]) / n, "critic/vf_clip_frac": float(sums[1] / max(sums[2], 1)),
                "critic/grad_norm": float(sums[3]) / (n * (w.world_size if w.world_size > 1 else 1)),
                "critic/version": float(self.steps)}


class CriticWorker:
    """One rank of a critic group of its own (algorithm.critic.placement=separate): the same `Critic`, hosted
    by a process that holds no policy, sharded by FSDP2 over the critic ranks' own process group.

    Per step the controller asks it for `values(batch)` (this critic version's values, before the policy's
    update), hands those to the learner, and gives back the learner's GAE targets with `update(batch, returns,
    old_values)`, which runs while the learner syncs weights and waits for the next batch; Ray runs one actor's
    calls in order, so the next `values` comes from the updated critic. Warm-up counts its `steps`."""

    def __init__(self, cfg: Any, rank: int = 0, world_size: int = 1):
        self.cfg, self.algo, self.rank, self.world_size = cfg, cfg.algorithm, rank, world_size
        self.device = rank_device()
        init_distributed(rank, world_size, self.device, timeout_s=cfg.trainer.learner_timeout_s)
        tok = load_tokenizer(cfg.model)
        self.pad_id = pad_token_id(tok)
        self.critic = Critic(self)
        self.layout = Layout.for_model(self.algo, self.critic.model, self.pad_id)

    def shard(self, model: torch.nn.Module, p: Any) -> None:
        shard_fsdp2(model, self.world_size, p)

    def _max_over_ranks(self, n: int) -> int:
        return max_over_ranks(n, self.world_size, self.device)

    @property
    def steps(self) -> int:
        return self.critic.steps

    def values(self, batch: Any) -> list[torch.Tensor]:
        """Collective: the values of every trajectory of `batch` (each rank computes a share, all get all)."""
        specs, _ = specs_of(batch.trajectories())
        vals = all_gather_dict(self.critic.values(specs, list(range(self.rank, len(specs), self.world_size))),
                               self.world_size)
        return [vals[i] for i in range(len(specs))]

    def update(self, batch: Any, returns: list[torch.Tensor], old_values: list[torch.Tensor]) -> dict[str, float]:
        """Collective: the clipped value-loss updates on the learner's targets; the critic's metrics."""
        specs, masks = specs_of(batch.trajectories())
        n = len(specs)
        minibatches = [list(c) for c in np.array_split(np.arange(n), min(self.algo.minibatches, n))]
        return self.critic.update(minibatches, specs, masks, returns, old_values)

    def save_checkpoint(self, path: str) -> None:
        """Collective: the critic's model, optimizer and step count (DCP, atomic, its own COMPLETE marker)."""
        ckpt.save(path, self.critic.model, self.critic.optimizer, meta={"critic_steps": self.critic.steps},
                  config=shown_config(self.cfg))

    def load_checkpoint(self, path: str) -> None:
        meta = ckpt.load(path, self.critic.model, self.critic.optimizer)
        self.critic.steps = int(meta["critic_steps"])
