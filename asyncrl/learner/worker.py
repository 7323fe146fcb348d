"""LearnerWorker: one rank of the learner group (FSDP2 over the default process group when world_size > 1).

A training step (`train_step(batch)`), with every rank given the SAME batch:
  1. advantages from the rewards and group ids of the whole batch (asyncrl.learner.advantages);
  2. the batch is cut into `algorithm.minibatches` contiguous minibatches; rank r trains on members
     r, r + W, r + 2W, ... of each (W = world_size); loss normalizers (tokens, sequences) are those of
     the whole minibatch, so the ranks' gradients average to exactly the one-rank gradient;
  3. if `algorithm.decoupled`: a no-grad proximal forward with the pre-step weights (and a reference
     forward when kl_coef > 0), before any update;
  4. `epochs` x `minibatches` optimizer steps; each accumulates micro-batches cut by the token budget
     `micro_batch_tokens`, packed (one row, position_ids restarting per sequence) or padded;
     ranks with fewer micro-batches run zero-weight dummy ones so FSDP's collectives stay aligned;
  5. grad-norm clipping, AdamW, LR schedule (linear warmup, then constant or cosine to min_lr_ratio);
     if at least one optimizer step was taken, `version` becomes the next number: one above both the
     current version and the highest version the run ever published (`highest_published`, given on
     resume from the run record), so a resumed run never reuses a discarded policy's number.

Numeric guard: an optimizer step whose loss (summed over ranks) or gradient norm (global) is not finite
is skipped: gradients dropped, no optimizer or LR-scheduler step, counted (`learner/skipped_steps_nonfinite`,
cumulative). Both values are the same on every rank, so the ranks skip together.
`algorithm.max_nonfinite_steps` skipped steps in a row raise `NonFiniteTrainingError`, which stops the run.

Logprobs follow the engine's definition (asyncrl.learner.logprobs) with T = agent.sampling.temperature.
Precision: the weights (master weights and optimizer state) and the compute dtype, by autocast or FSDP2's
mixed precision, are `self.precision`, decided by asyncrl.models.precision (docs/design.md "Precision").
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from asyncrl.config import Config
from asyncrl.learner import checkpoint as ckpt
from asyncrl.learner import overlong
from asyncrl.learner.advantages import compute_advantages, group_index, turn_credit_advantages
from asyncrl.learner.critic import Critic
from asyncrl.learner.distributed import (
    all_gather_dict,
    comm_device,
    init_distributed,
    max_over_ranks,
    rank_device,
    shard_fsdp2,
)
from asyncrl.learner.gae import gae, place_rewards, whiten
from asyncrl.learner.head import ChunkedHead
from asyncrl.learner.importance import importance_weights, mismatch_by_staleness
from asyncrl.learner.logprobs import effective_temperature
from asyncrl.learner.lora import apply_lora, lora_scaling, merge_state_dict, merged_named_params
from asyncrl.learner.losses import check_off_policy_correction, kl_penalty, policy_loss, resolve_loss
from asyncrl.learner.memory_estimate import lower_learner_memory
from asyncrl.learner.packing import (
    Layout,
    MicroBatch,
    SeqSpec,
    attn_implementation,
    scatter_rows,
    specs_of,
)
from asyncrl.models import (
    Precision,
    compute_context,
    load_model,
    load_tokenizer,
    pad_token_id,
    precision,
    set_gradient_checkpointing,
)
from asyncrl.secrets import shown_config
from asyncrl.util.cpus import native_bf16
from asyncrl.util.memory import MemoryBudgetExceeded, over_memory_stop, peak_gb, reset_peak
from asyncrl.util.seeds import selected
from asyncrl.weight_sync.bucketing import iter_buckets


class NonFiniteTrainingError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


log = logging.getLogger(__name__)


def lr_lambda(warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float):
    """Multiplier of the base lr at optimizer step s (0-based): (s+1)/warmup during warmup, then 1
    (constant) or min + (1 - min) * 0.5 * (1 + cos(pi * progress)) (cosine) with progress in [0, 1]."""

    def f(s: int) -> float:
        if warmup_steps > 0 and s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(total_steps - warmup_steps, 1)
        progress = min(max(s - warmup_steps, 0) / span, 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _pad_stack(rows: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=dtype)
    for n, r in enumerate(rows):
        out[n, : r.numel()] = r.to(dtype)
    return out


def placed_rewards(t: Any) -> list[tuple[int, float]]:
    """A trajectory's turn and tool rewards with their response positions (-1: unplaced)."""
    out = []
    for rewards, positions in ((t.turn_rewards, t.turn_reward_positions), (t.tool_rewards, t.tool_reward_positions)):
        out += list(zip(positions or [-1] * len(rewards), rewards))
    return out


class LearnerWorker:
    def __init__(self, cfg: Config, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside world_size={world_size}")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.algo = cfg.algorithm
        loss = resolve_loss(self.algo.loss)  # built-ins, and the config's plugins once the caller loaded them
        refused = check_off_policy_correction(self.algo, loss)
        if refused:
            raise ValueError(refused)
        self.loss_fn = lambda inputs: loss(inputs, self.algo)
        self.device = rank_device()
        init_distributed(rank, world_size, self.device, timeout_s=cfg.trainer.learner_timeout_s)
        self.temperature = effective_temperature(cfg.agent.sampling.temperature)
        self.precision = precision("learner", cfg.model.dtype, self.device, native_bf16=native_bf16(),
                                   cpu_bf16=cfg.model.cpu_bf16, world_size=world_size)
        self.cpu_bf16 = self.device == "cpu" and self.precision.via == "autocast"  # model.cpu_bf16 took effect
        if self.device == "cpu" and cfg.model.cpu_bf16 and not self.cpu_bf16 and rank == 0:
            log.warning("model.cpu_bf16=true but this CPU has no native bf16 (avx512_bf16 / amx_bf16): the learner "
                        "computes in fp32")
        tok = load_tokenizer(cfg.model)
        self.pad_id = pad_token_id(tok)
        # the head and log-softmax a chunk of tokens at a time: the peak holds one chunk's logits, not the
        # micro-batch's (asyncrl/learner/head.py); each model is checked by `_build`
        self.head = ChunkedHead(self.algo.logits_chunk_tokens)
        self.model = self._build(self.precision.weights, trainable=True)
        # the samples of one prompt scored as one tree (asyncrl/learner/packing.py) where the attention allows
        self.layout = Layout.for_model(self.algo, self.model, self.pad_id)
        if self.algo.packing and self.algo.share_prompts and not self.layout.share_prompts and rank == 0:
            log.warning("algorithm.share_prompts=true but the model's attention (%s) takes no custom mask: each "
                        "sample is scored with its own copy of the prompt", attn_implementation(self.model))
        self.ref_model = self._build(self.precision.weights, trainable=False) if self.algo.kl_coef > 0 else None
        gae_critic = self.algo.adv_estimator == "gae"
        # placement=separate: the values come with each batch from the critic's own ranks (CriticWorker)
        self.critic = Critic(self) if gae_critic and self.algo.critic.placement == "colocated" else None
        self.separate_critic = gae_critic and self.algo.critic.placement == "separate"
        self.critic_targets: Any = None  # separate critic: (returns, old values) of the last step, for its update
        self.token_logprobs: list[dict] = []  # the last step's, see train_step
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=self.algo.lr,
            betas=tuple(self.algo.betas), weight_decay=self.algo.weight_decay,
        )
        total = cfg.trainer.total_steps * self.algo.epochs * self.algo.minibatches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.algo.warmup_steps, total, self.algo.lr_schedule, self.algo.min_lr_ratio)
        )
        self.version = 0
        self.highest_published = 0  # by an earlier life of this run (resume): new weights are numbered above it
        self.optimizer_steps = 0
        self.skipped_nonfinite = 0  # optimizer steps skipped for a non-finite loss or grad norm, in all
        self.nonfinite_in_row = 0

    # ------------------------------------------------------------------ model

    def _build(self, dtype: str, trainable: bool) -> torch.nn.Module:
        model = load_model(self.cfg.model, device=self.device, dtype=dtype)
        model.config.use_cache = False
        lora = self.cfg.model.lora
        if trainable and lora.rank:  # adapters only; the frozen base is the reference model's too
            apply_lora(model, lora.rank, lora.alpha, list(lora.target_modules), lora.seed)
        if trainable:
            if self.cfg.model.gradient_checkpointing:
                set_gradient_checkpointing(model, True)
            model.train()
        else:
            model.eval()
            model.requires_grad_(False)
        self.head.check(model, self.device, self.pad_id)  # before sharding: a local forward on each rank
        self.shard(model, self.precision)
        return model

    def shard(self, model: torch.nn.Module, p: Precision) -> None:
        """FSDP2 over the learner's ranks with `p`'s mixed precision (asyncrl/learner/distributed.py `shard_fsdp2`)."""
        shard_fsdp2(model, self.world_size, p)

    def _autocast(self):
        return compute_context(self.precision, self.device)

    def _scores(self, model: torch.nn.Module, mb: MicroBatch,
                with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprob [K], entropy [K] or None) of the kept positions of `mb` (row-major order of mb.keep)."""
        with self._autocast():
            return self.head.scores(model, mb, self.device, self.temperature, with_entropy)

    def _dummy_forward(self, model: torch.nn.Module, backward: bool) -> None:
        """A one-token forward (and zero-weight backward) keeping FSDP collectives aligned across ranks."""
        ids = torch.tensor([[self.pad_id]], device=self.device)
        with self._autocast():
            out = model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False, logits_to_keep=1)
        if backward:
            (out.logits.float().sum() * 0.0).backward()

    def _check_memory(self) -> None:
        """Before a micro-batch: MemoryBudgetExceeded on every rank when the machine's memory is past
        trainer.memory_stop_fraction on any (a collective: no rank is left waiting in the next one)."""
        stop = self.cfg.trainer.memory_stop_fraction
        advice = lower_learner_memory(self.algo.micro_batch_tokens, self.cfg.model.gradient_checkpointing)
        over = over_memory_stop(stop, f"learner rank {self.rank}", advice)
        if self._max_over_ranks(int(over is not None)):
            raise over or MemoryBudgetExceeded(f"learner rank {self.rank}: another rank found the machine's memory "
                                               f"over trainer.memory_stop_fraction={stop:g}; {advice}")

    def _max_over_ranks(self, n: int) -> int:
        return max_over_ranks(n, self.world_size, self.device)

    def _comm_device(self) -> str:
        return comm_device(self.device)

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def _score(self, model: torch.nn.Module, specs: list[SeqSpec], local: list[int]) -> dict[int, torch.Tensor]:
        """Logprob of every response token (0 where loss_mask is 0) of the sequences `local`, float32 [R] each."""
        plan = self.layout.plan(specs, local)
        out: dict[int, torch.Tensor] = {}
        for k in range(self._max_over_ranks(len(plan))):
            self._check_memory()
            if k >= len(plan):
                self._dummy_forward(model, backward=False)
                continue
            idx = [local[j] for j in plan[k]]
            mb = self.layout.micro_batch(specs, idx)
            logp, _ = self._scores(model, mb, with_entropy=False)
            rows = scatter_rows(logp.float().cpu(), mb)
            for n, i in enumerate(idx):
                out[i] = rows[n, : specs[i].loss_mask.numel()].clone()
        return out

    def _all_gather_dict(self, d: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return all_gather_dict(d, self.world_size)

    # ------------------------------------------------------------------ training

    def train_step(self, batch: Any, critic_values: Any = None, critic_steps: int = 0) -> dict[str, float]:
        """One policy version: advantages, proximal forward, epochs x minibatches updates. Returns metrics.
        With a critic on its own ranks, `critic_values` are its values of the batch (one float32 [R] per
        trajectory) and `critic_steps` its updates so far (warm-up); the GAE targets are left in
        `critic_targets` for its update."""
        if self.separate_critic and critic_values is None:
            raise ValueError("algorithm.critic.placement=separate: train_step needs the critic's values of the batch")
        t0 = time.perf_counter()
        reset_peak()  # memory/learner_peak_gb is this step's peak
        # per response token, the log-probs the learner gave the dumped trajectories before this step's update
        # (decoupled PPO's proximal policy): `asyncrl view` sets them beside the sampler's (learner_logprobs.jsonl)
        self.token_logprobs = []
        a = self.algo
        trajs = batch.trajectories()
        if not trajs:
            raise ValueError(f"batch {getattr(batch, 'batch_id', '?')} holds no trajectories")
        specs, masks = specs_of(trajs)
        shaped = overlong.shape(trajs, a.overlong, self.cfg.agent.max_response_tokens, a.overlong_buffer_tokens,
                                a.overlong_penalty)
        rewards = shaped.rewards
        masks = [torch.zeros_like(m) if cut else m for m, cut in zip(masks, shaped.masked)]
        behav = [torch.from_numpy(t.behavior_logprobs.numpy().astype(np.float32)) for t in trajs]
        n_traj = len(trajs)
        minibatches = [list(c) for c in np.array_split(np.arange(n_traj), min(a.minibatches, n_traj))]
        local_all = [i for mb in minibatches for i in mb[self.rank :: self.world_size]]
        metrics: dict[str, float] = dict(shaped.metrics)
        prox = self._score(self.model, specs, local_all) if a.decoupled else None
        ref = None
        if self.ref_model is not None:  # on the learner ranks, before any update: one forward, no transfer
            t_ref = time.perf_counter()
            ref = self._score(self.ref_model, specs, local_all)
            metrics["learner/ref_seconds"] = time.perf_counter() - t_ref
        kl_rewards = None
        if a.kl_in_reward:
            full_ref = self._all_gather_dict(ref)
            policy = self._all_gather_dict(prox if prox is not None else self._score(self.model, specs, local_all))
            kl_rewards = [torch.where(masks[i], kl_penalty(policy[i], full_ref[i], a.kl_estimator),
                                      torch.zeros_like(policy[i])) for i in range(n_traj)]
            n_tok = max(sum(int(m.sum()) for m in masks), 1)
            metrics["learner/kl_reward"] = float(sum(float(k.sum()) for k in kl_rewards)) / n_tok
        if self.critic is not None or self.separate_critic:
            adv, adv_tokens, returns, old_values = self._gae(trajs, rewards, specs, masks, local_all, metrics,
                                                             kl_rewards, critic_values)
        elif a.turn_credit:
            adv, adv_tokens = turn_credit_advantages(
                a.adv_estimator, rewards, group_index([t.group_id for t in trajs]),
                [placed_rewards(t) for t in trajs], [len(m) for m in masks], a)
        else:
            adv = compute_advantages(a.adv_estimator, rewards, group_index([t.group_id for t in trajs]), a)
            adv_tokens = None

        if prox is not None:
            full = self._all_gather_dict(prox)
            width = max(m.numel() for m in masks)
            _, _, diag = importance_weights(
                _pad_stack([full[i] for i in range(n_traj)], width, torch.float32),
                _pad_stack(behav, width, torch.float32), _pad_stack(masks, width, torch.bool),
                level=a.is_level, threshold=a.is_threshold, reject_low=a.is_reject_low,
                reject_high=a.is_reject_high, seq_mode=a.is_seq_mode,
            )
            metrics.update({f"learner/{k}": v for k, v in diag.items()})
            staleness = [torch.from_numpy(self.version - t.versions.numpy().astype(np.int64)) for t in trajs]
            by_level = mismatch_by_staleness(
                _pad_stack([full[i] for i in range(n_traj)], width, torch.float32), _pad_stack(behav, width, torch.float32),
                _pad_stack(masks, width, torch.bool), _pad_stack(staleness, width, torch.int64), a.max_staleness)
            metrics.update({f"learner/{k}": v for k, v in by_level.items()})
            fraction = self.cfg.trainer.dump_trajectories  # the rollout workers' dump sample, by the same rule
            self.token_logprobs = [{"uid": t.uid, "proximal_logprobs": [round(x, 4) for x in full[i].tolist()]}
                                   for i, t in enumerate(trajs) if selected(t.uid, fraction, self.cfg.seed)]

        # loss, pg, kl, ent_sum, clip_cnt, ratio_sum, tokens, grad_norm, mismatch k1 and k3 (token sums)
        sums = torch.zeros(10, dtype=torch.float64)
        ratio_max = torch.zeros(1, dtype=torch.float64)
        lrs = []
        compute_tokens = 0
        stepped = 0
        done_critic_steps = self.critic.steps if self.critic is not None else critic_steps
        update_policy = (self.critic is None and not self.separate_critic) or done_critic_steps >= a.critic.warmup_steps
        for _ in range(a.epochs if update_policy else 0):
            for mb_idx in minibatches:
                step_sums, step_max, ct = self._minibatch_update(mb_idx, specs, behav, masks, adv_tokens or adv,
                                                                 prox, ref)
                sums += step_sums
                if prox is None and not lrs:  # the first minibatch, before any update: policy = proximal
                    metrics["learner/is_kl_k1"] = float(step_sums[8] / max(step_sums[6], 1))
                    metrics["learner/is_kl_k3"] = float(step_sums[9] / max(step_sums[6], 1))
                ratio_max = torch.maximum(ratio_max, step_max)
                compute_tokens += ct
                lrs.append(self.optimizer.param_groups[0]["lr"])
                gn = self._clip_and_step(float(step_sums[0]), getattr(batch, "batch_id", "?"))
                if gn is not None:
                    sums[7] += gn
                    stepped += 1
        if stepped:
            self.version = max(self.version, self.highest_published) + 1
        if self.critic is not None:
            metrics.update(self.critic.update(minibatches, specs, masks, returns, old_values))
        if self.separate_critic:
            self.critic_targets = (returns, old_values)
        if self.critic is not None or self.separate_critic:
            metrics["critic/policy_updated"] = float(update_policy)
        n_steps = max(a.epochs * len(minibatches) if update_policy else 0, 1)
        tokens = float(sum(int(m.sum()) for m in masks))
        seconds = time.perf_counter() - t0
        raw = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
        metrics.update({
            "learner/loss": float(sums[0]) / n_steps,
            "learner/pg_loss": float(sums[1]) / n_steps,
            "learner/kl": float(sums[2]) / n_steps,
            "learner/entropy": float(sums[3] / max(sums[6], 1)),
            "learner/clip_frac": float(sums[4] / max(sums[6], 1)),
            "learner/ratio_mean": float(sums[5] / max(sums[6], 1)),
            "learner/ratio_max": float(ratio_max),
            "learner/grad_norm": float(sums[7]) / max(stepped, 1),
            "learner/skipped_steps_nonfinite": float(self.skipped_nonfinite),
            "learner/lr": lrs[-1] if lrs else self.optimizer.param_groups[0]["lr"],
            "learner/adv_mean": float(adv.mean()), "learner/adv_std": float(adv.std()) if n_traj > 1 else 0.0,
            "learner/adv_min": float(adv.min()), "learner/adv_max": float(adv.max()),
            "learner/adv_zero_frac": float((adv == 0).float().mean()),
            "learner/reward_mean": float(raw.mean()),  # as the rollout scored it (before overlong shaping)
            "learner/tokens": tokens,
            "learner/sequence_tokens": float(sum(s.length for s in specs)),
            "learner/compute_tokens_rank": float(compute_tokens),
            "learner/optimizer_steps": float(n_steps),
            "learner/seconds": seconds,
            "learner/tokens_per_s": float(sum(s.length for s in specs)) * a.epochs / max(seconds, 1e-9),
            "learner/version": float(self.version),
            # the largest rank's peak resident memory in this step (a collective: every rank reports)
            "memory/learner_peak_gb": self._max_over_ranks(int(peak_gb() * 1024)) / 1024,
        })
        return metrics

    def _gae(self, trajs, final_rewards, specs, masks, local_all, metrics, kl_rewards=None, critic_values=None):
        """Critic values (this critic version: the colocated critic's, or `critic_values` from the critic's own
        ranks), placed rewards -> GAE advantages and value targets per token.
        Returns (per-trajectory mean advantage [N] for metrics, per-token advantages, returns, old values)."""
        c = self.algo.critic
        t0 = time.perf_counter()
        if critic_values is not None:
            old_values = [torch.as_tensor(v, dtype=torch.float32) for v in critic_values]
        else:
            vals = self._all_gather_dict(self.critic.values(specs, local_all))
            old_values = [vals[i] for i in range(len(trajs))]
        adv_tokens, returns = [], []
        for i, (t, m, v) in enumerate(zip(trajs, masks, old_values)):
            rewards = place_rewards(m.numel(), m, final_rewards[i], placed_rewards(t))
            if kl_rewards is not None:
                rewards = rewards - self.algo.kl_coef * kl_rewards[i].double()
            a_t, r_t = gae(rewards, v, m, c.gamma, c.lam)
            adv_tokens.append(a_t)
            returns.append(r_t)
        if c.whiten_advantages:
            adv_tokens = whiten(adv_tokens, masks)
        flat_r = torch.cat([r[m] for r, m in zip(returns, masks)]).double()
        flat_v = torch.cat([v[m] for v, m in zip(old_values, masks)]).double()
        var_r = float(flat_r.var()) if flat_r.numel() > 1 else 0.0
        metrics.update({
            "critic/values_mean": float(flat_v.mean()) if flat_v.numel() else 0.0,
            "critic/returns_mean": float(flat_r.mean()) if flat_r.numel() else 0.0,
            "critic/explained_var": 1.0 - float((flat_r - flat_v).var()) / var_r if var_r > 0 else 0.0,
            "critic/values_seconds": time.perf_counter() - t0,
        })
        adv = torch.stack([a[m].mean() if m.any() else torch.zeros(()) for a, m in zip(adv_tokens, masks)])
        return adv.float(), adv_tokens, returns, old_values

    def _minibatch_update(self, mb_idx, specs, behav, masks, adv, prox, ref):
        """Forward/backward all micro-batches of this rank's share of one minibatch (gradients accumulate)."""
        a = self.algo
        counts = dict(
            num_tokens=float(sum(int(masks[i].sum()) for i in mb_idx)),
            num_seqs=float(sum(bool(masks[i].any()) for i in mb_idx)),
            max_response_tokens=self.cfg.agent.max_response_tokens,
        )
        local = mb_idx[self.rank :: self.world_size]
        plan = self.layout.plan(specs, local)
        sums = torch.zeros(10, dtype=torch.float64)
        rmax = torch.zeros(1, dtype=torch.float64)
        compute_tokens = 0
        self.optimizer.zero_grad(set_to_none=True)
        for k in range(self._max_over_ranks(len(plan))):
            self._check_memory()
            if k >= len(plan):
                self._dummy_forward(self.model, backward=True)
                continue
            idx = [int(local[j]) for j in plan[k]]
            mb = self.layout.micro_batch(specs, idx)
            compute_tokens += mb.compute_tokens
            logp_k, ent_k = self._scores(self.model, mb)
            if not a.entropy_coef:
                ent_k = ent_k.detach()
            def stack(xs, dt=torch.float32, width=mb.max_response, dev=self.device):
                return _pad_stack(xs, width, dt).to(dev)

            mask = stack([masks[i] for i in idx], torch.bool)
            logp, entropy = scatter_rows(logp_k, mb).float(), scatter_rows(ent_k, mb).float()
            advantages = stack([adv[i] for i in idx]) if isinstance(adv, list) else adv[idx].to(self.device)
            loss, m = policy_loss(
                logp, stack([behav[i] for i in idx]), advantages, mask,
                prox_logp=stack([prox[i] for i in idx]) if prox is not None else None,
                loss_fn=self.loss_fn, is_level=a.is_level, is_threshold=a.is_threshold,
                is_reject_low=a.is_reject_low, is_reject_high=a.is_reject_high, is_seq_mode=a.is_seq_mode,
                ref_logp=stack([ref[i] for i in idx]) if ref is not None and not a.kl_in_reward else None,
                kl_coef=0.0 if a.kl_in_reward else a.kl_coef, kl_estimator=a.kl_estimator, entropy=entropy,
                entropy_coef=a.entropy_coef,
                agg=a.loss_agg, **counts,
            )
            (loss * self.world_size).backward()
            n = float(mask.sum())
            sums += torch.tensor([float(loss.detach()), m["pg_loss"], m.get("kl", 0.0),
                                  float(torch.where(mask, entropy.detach(), 0.0).sum()),
                                  m["clip_frac"] * n, m["ratio_mean"] * n, n, 0.0, m.get("is_kl_k1", 0.0) * n,
                                  m.get("is_kl_k3", 0.0) * n], dtype=torch.float64)
            rmax = torch.maximum(rmax, torch.tensor([m["ratio_max"]], dtype=torch.float64))
        if self.world_size > 1:
            dist.all_reduce(sums)
            dist.all_reduce(rmax, op=dist.ReduceOp.MAX)
        return sums, rmax, compute_tokens

    def _clip_and_step(self, loss: float, batch_id: object) -> float | None:
        """Clip and take the optimizer step; the grad norm. None (step skipped, gradients dropped) if the
        loss or the grad norm is not finite; NonFiniteTrainingError after max_nonfinite_steps in a row."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.algo.grad_clip if self.algo.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm = float(norm)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_nonfinite += 1
            self.nonfinite_in_row += 1
            if self.nonfinite_in_row >= self.algo.max_nonfinite_steps:
                raise NonFiniteTrainingError(
                    f"{self.nonfinite_in_row} optimizer steps in a row had a non-finite loss or gradient norm "
                    f"(last: loss={loss}, grad_norm={norm}, batch {batch_id}; algorithm.max_nonfinite_steps="
                    f"{self.algo.max_nonfinite_steps}): the run stops. Look at that batch's rewards and logprobs, "
                    "or lower algorithm.lr")
            return None
        self.nonfinite_in_row = 0
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        return norm

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str, extra: dict) -> None:
        """Collective. Model, optimizer, scheduler, RNG, step, version and `extra`, written atomically."""
        meta = {"version": self.version, "optimizer_steps": self.optimizer_steps, "world_size": self.world_size,
                "scheduler": self.scheduler.state_dict(), "extra": dict(extra)}
        if self.critic is not None:
            meta["critic_steps"] = self.critic.steps
        ckpt.save(path, self.model, self.optimizer, meta=meta, config=shown_config(self.cfg), modules=self._modules())

    def _modules(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """What a checkpoint holds beside the policy: the critic and its optimizer, when there is one."""
        return {"critic": (self.critic.model, self.critic.optimizer)} if self.critic is not None else {}

    def load_checkpoint(self, path: str, highest_published: int = 0) -> dict:
        """Collective. Restores everything `save_checkpoint` wrote; returns its `extra`. The restored weights keep
        the checkpoint's version (the run published exactly these weights under it); the next trained ones
        are numbered above `highest_published`, the highest version the run ever published."""
        meta = ckpt.load(path, self.model, self.optimizer, modules=self._modules())
        if self.critic is not None:
            self.critic.steps = int(meta.get("critic_steps", 0))
        self.scheduler.load_state_dict(meta["scheduler"])
        self.version = int(meta["version"])
        self.highest_published = int(highest_published)
        self.optimizer_steps = int(meta["optimizer_steps"])
        return dict(meta["extra"])

    # ------------------------------------------------------------------ weights out

    def iter_full_params(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Collective. Full (unsharded) parameters in named_parameters() order, in buckets of at most
        `bucket_bytes` (a single tensor larger than that is yielded alone). Tied weights appear once, under
        the name named_parameters() gives them. Only rank 0's tensors are meant to be used."""
        return iter_buckets(self._full_named_params(), bucket_bytes)

    def _full_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: each parameter gathered to its full tensor (FSDP2 DTensor) as the walk reaches it."""
        if self.cfg.model.lora.rank:  # the adapted weights, merged: engines load a plain model
            yield from merged_named_params(self.model)
            return
        for name, p in self.model.named_parameters():
            t = p.detach()
            yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective. The model's full state dict on CPU (rank 0 holds it; others get an empty dict)."""
        if self.world_size == 1:
            sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        else:
            sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.cfg.model.lora.rank and sd:  # merged: a plain model of the base architecture
            sd = merge_state_dict(sd, lora_scaling(self.cfg.model.lora))
        return sd

    def export_hf(self, out_dir: str) -> None:
        """Collective. A plain HF directory (safetensors, config, tokenizer) written by rank 0, atomically."""
        # lazy: imports huggingface_hub, transformers, which this module does not load otherwise
        from asyncrl.learner.export import save_hf

        sd = self.full_state_dict()
        if self.rank == 0:
            save_hf(sd, self.cfg.model, Path(out_dir))
        if self.world_size > 1:
            dist.barrier()
