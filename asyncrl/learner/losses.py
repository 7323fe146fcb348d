"""The decoupled, importance-corrected PPO policy loss, its KL and entropy terms, and loss aggregation.

Per token (A: the trajectory's advantage broadcast to its tokens, m: loss mask):

  decoupled (prox_logp given):  r = pi_theta / pi_prox = exp(logp - prox_logp)
                                w = min(pi_prox / pi_behav, threshold)     (importance.importance_weights)
  not decoupled:                r = pi_theta / pi_behav = exp(logp - behav_logp),  w = 1
  pg = w * max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))          (asymmetric clip bounds)

When the loss is decoupled the behavior weight w is ALWAYS applied: it is computed inside
`policy_loss` from prox_logp and behav_logp and cannot be switched off by any other option. Optional
rejection (reject_low/high) zeroes the pg term of rejected tokens/sequences; it does not change the
normalizers. The log ratio is clamped to [-20, 20] before exp (finite loss for extreme ratios).

  KL to a reference policy (kl_coef > 0), samples from pi_theta, with x = ref_logp - logp:
      k1 = -x = logp - ref_logp,        k3 = exp(x) - 1 - x   (non-negative, unbiased for KL(theta||ref))
  loss = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

Aggregation of a per-token tensor v over mask m (`aggregate`); the normalizers may be given for the
whole minibatch so that summing the micro-batch losses (over ranks too) gives the minibatch loss exactly:
  token_mean (default):      sum(v * m) / N_tokens
  seq_mean_token_mean:       sum_b [ sum_t(v * m)_b / n_b ] / N_seqs
  seq_sum_norm (Dr. GRPO):   sum(v * m) / (N_seqs * max_response_tokens)
token_mean is the default because every generated token weighs the same whatever the length of its
sequence: seq_mean_token_mean down-weights the tokens of long responses (the length bias Dr. GRPO and
DAPO point out), and seq_sum_norm, unbiased as well, rescales the gradient with the configured
max_response_tokens, which then couples the learning rate to the generation budget.
"""

from __future__ import annotations

import torch

from asyncrl.learner.importance import importance_weights

PPO_LOG_RATIO_CLAMP = 20.0
AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_sum_norm")


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_response_tokens: int | None = None,
) -> torch.Tensor:
    """Aggregate per-token `values` [B, T] over `mask` [B, T] (see the module docstring for formulas).

    num_tokens / num_seqs default to this tensor's own counts (masked tokens; sequences with >= 1 masked
    token). Masked-out entries are excluded with `where`, so a NaN or inf there never leaks in.
    """
    m = mask.bool()
    v = torch.where(m, values, torch.zeros_like(values))
    if mode == "token_mean":
        n = float(m.sum()) if num_tokens is None else float(num_tokens)
        return v.sum() / max(n, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq_n = m.sum(-1)
        per_seq = v.sum(-1) / per_seq_n.clamp(min=1)
        n = float((per_seq_n > 0).sum()) if num_seqs is None else float(num_seqs)
        return per_seq.sum() / max(n, 1.0)
    if mode == "seq_sum_norm":
        if max_response_tokens is None or max_response_tokens < 1:
            raise ValueError(f"loss_agg=seq_sum_norm needs max_response_tokens >= 1, got {max_response_tokens}")
        n = float(m.any(-1).sum()) if num_seqs is None else float(num_seqs)
        return v.sum() / (max(n, 1.0) * max_response_tokens)
    raise ValueError(f"algorithm.loss_agg={mode!r} is not one of {', '.join(AGG_MODES)}")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate from samples of pi_theta: k1 = logp - ref, k3 = e^x - 1 - x."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        x = (ref_logp - logp).clamp(-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP)
        return torch.exp(x) - 1 - x
    raise ValueError(f"algorithm.kl_estimator={estimator!r} is not one of k1, k3")


def ppo_clip_terms(logp, anchor_logp, advantages, clip_low: float, clip_high: float):
    """(per-token clipped surrogate loss max(-A r, -A clip(r)), ratio r, clipped flag) with r = exp(logp - anchor)."""
    log_r = (logp - anchor_logp.detach()).clamp(-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP)
    r = torch.exp(log_r)
    unclipped = -advantages * r
    clipped = -advantages * torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), r, clipped > unclipped


def policy_loss(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    prox_logp: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_level: str = "token",
    is_threshold: float = 2.0,
    is_reject_low: float | None = None,
    is_reject_high: float | None = None,
    is_seq_mode: str = "sum",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    agg: str = "token_mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_response_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss and its metrics. All tensors [B, T] (advantages may be [B] or [B, 1]).

    Decoupled iff `prox_logp` is given (algorithm.decoupled); then the truncated behavior weight is
    always applied. Metrics: pg_loss, kl, entropy, clip_frac, ratio_mean, ratio_max and, when
    decoupled, the is_* diagnostics of `importance_weights`.
    """
    _check = [t for t in (behav_logp, mask) if t.shape != logp.shape]
    if _check:
        raise ValueError(f"policy_loss: logp {tuple(logp.shape)}, behav_logp {tuple(behav_logp.shape)} and "
                         f"mask {tuple(mask.shape)} must have the same shape")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logp.dtype).detach().expand_as(logp)
    m = mask.bool()
    counts = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_response_tokens=max_response_tokens)
    metrics: dict[str, float] = {}
    if prox_logp is not None:
        w, keep, diag = importance_weights(
            prox_logp, behav_logp, mask, level=is_level, threshold=is_threshold,
            reject_low=is_reject_low, reject_high=is_reject_high, seq_mode=is_seq_mode,
        )
        metrics.update(diag)
        anchor = prox_logp
    else:
        w, keep, anchor = torch.ones_like(logp), m.float(), behav_logp
    pg_tok, ratio, clipped = ppo_clip_terms(logp, anchor, advantages, clip_low, clip_high)
    pg_tok = torch.where(keep.bool(), w.to(pg_tok.dtype) * pg_tok, torch.zeros_like(pg_tok))
    pg = aggregate(pg_tok, m, agg, **_fill_counts(m, agg, counts))
    loss = pg
    metrics["pg_loss"] = float(pg.detach())
    if kl_coef and ref_logp is not None:
        kl = aggregate(kl_penalty(logp, ref_logp.detach(), kl_estimator), m, agg, **_fill_counts(m, agg, counts))
        loss = loss + kl_coef * kl
        metrics["kl"] = float(kl.detach())
    elif kl_coef:
        raise ValueError("algorithm.kl_coef > 0 needs reference logprobs (ref_logp), none were given")
    if entropy is not None:
        ent = aggregate(entropy, m, agg, **_fill_counts(m, agg, counts))
        if entropy_coef:
            loss = loss - entropy_coef * ent
        metrics["entropy"] = float(ent.detach())
    with torch.no_grad():
        n = max(int(m.sum()), 1)
        metrics["clip_frac"] = float((clipped & m).sum()) / n
        metrics["ratio_mean"] = float(torch.where(m, ratio, torch.zeros_like(ratio)).sum()) / n
        metrics["ratio_max"] = float(torch.where(m, ratio, torch.zeros_like(ratio)).max()) if m.any() else 1.0
    return loss, metrics


def _fill_counts(m: torch.Tensor, agg: str, counts: dict) -> dict:
    """The given minibatch normalizers, or this tensor's own when not given."""
    out = dict(counts)
    if out["num_tokens"] is None:
        out["num_tokens"] = float(m.sum())
    if out["num_seqs"] is None:
        out["num_seqs"] = float(m.any(-1).sum())
    return out
