"""Importance weights of the proximal policy over the behavior policy (the engine that sampled).

Per token t of sequence b, with the log ratio  d_bt = log p_prox(y_bt) - log p_behav(y_bt):

- token level:     log w_bt = d_bt
- sequence level:  log w_b  = sum_t m_bt * d_bt                     (seq_mode="sum": the exact sequence
                              likelihood ratio; default, it is what importance sampling of a whole
                              trajectory requires)
                   log w_b  = sum_t m_bt * d_bt / sum_t m_bt       (seq_mode="mean": the geometric mean
                              per token, as GSPO; length-independent, lower variance, biased)
                   and every token of b carries w_b.

Truncation: w = exp(min(log w, log threshold)) = min(w, threshold), computed in log space so an
extreme ratio never overflows; threshold None truncates nothing (masking alone, as IcePop: Ling team,
2025, masks tokens whose train/inference ratio leaves [0.5, 5]: is_reject_low=0.5, is_reject_high=5). Rejection (optional): a token (token level) or a whole sequence
(sequence level) whose UNtruncated w is below `reject_low` or above `reject_high` gets keep = 0.

Diagnostics, over the masked tokens (token level) or over the sequences with at least one masked
token (sequence level), before rejection:
  is_mean (of truncated w), is_max (untruncated), is_ess = (sum w)^2 / (n * sum w^2) in (0, 1] (of
  truncated w; 1 when all weights are equal), is_frac_truncated (w > threshold), is_frac_rejected,
  and, over masked tokens, the KL of behavior against proximal estimated from behavior samples with
  r = p_prox / p_behav:  is_kl_k1 = mean(-log r),  is_kl_k3 = mean(r - 1 - log r).

By staleness (`mismatch_by_staleness`): the same KL (k3) and the spread of r (its standard deviation)
over the masked tokens of each staleness level s = the learner's version minus the version that
sampled the token, s = 0 .. max_staleness (older tokens counted in the last level), with each level's
share of the tokens: mismatch_s{s}_kl_k3, mismatch_s{s}_is_std, mismatch_s{s}_token_frac, for the
levels that have tokens. Off-policy drift shows as k3 and spread growing with s; engine/learner
numerics alone, as the level-0 figures.
"""

from __future__ import annotations

import math

import torch

LOG_RATIO_CLAMP = 80.0  # |log w| beyond this is clamped before exp (float32 exp overflows near 88)


def _check_shapes(where: str, **tensors: torch.Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"{where}: shapes differ: {shapes}")


def importance_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    threshold: float | None = 2.0,
    reject_low: float | None = None,
    reject_high: float | None = None,
    seq_mode: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Truncated behavior importance weights. Inputs [B, T]; returns (w [B, T], keep [B, T], diagnostics).

    w is 0 where mask is 0; keep is the float rejection mask (1 kept, 0 rejected or masked). Both are
    detached: the weight is a constant of the loss, never differentiated.
    """
    _check_shapes("importance_weights", prox_logp=prox_logp, behav_logp=behav_logp, mask=mask)
    if threshold is not None and not threshold > 0:
        raise ValueError(f"importance threshold must be > 0 (or None: no truncation), got {threshold}")
    if level not in ("token", "sequence"):
        raise ValueError(f"algorithm.is_level={level!r} is not one of token, sequence")
    if seq_mode not in ("sum", "mean"):
        raise ValueError(f"algorithm.is_seq_mode={seq_mode!r} is not one of sum, mean")
    m = mask.bool()
    mf = m.float()
    d = torch.where(m, prox_logp.detach().float() - behav_logp.detach().float(), torch.zeros_like(mf))
    if level == "token":
        log_w = d
        unit_mask = m  # diagnostics over tokens
    else:
        log_w_seq = d.sum(-1)
        if seq_mode == "mean":
            log_w_seq = log_w_seq / mf.sum(-1).clamp(min=1)
        log_w = log_w_seq.unsqueeze(-1).expand_as(d)
        unit_mask = m.any(-1)
        log_w_units = log_w_seq
    log_w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_thr = math.log(threshold) if threshold is not None else LOG_RATIO_CLAMP
    w = torch.where(m, torch.exp(log_w.clamp(max=log_thr)), torch.zeros_like(mf))
    keep = m.clone()
    if reject_low is not None:
        keep &= log_w >= math.log(reject_low) if reject_low > 0 else torch.ones_like(m)
    if reject_high is not None:
        keep &= log_w <= math.log(reject_high)
    # diagnostics
    if level == "token":
        lw_units = log_w[unit_mask]
        kept_units = keep[unit_mask]
    else:
        lw_units = log_w_units.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[unit_mask]
        kept_units = keep.any(-1)[unit_mask]
    diag = {"is_mean": 1.0, "is_max": 1.0, "is_ess": 1.0, "is_frac_truncated": 0.0, "is_frac_rejected": 0.0,
            "is_kl_k1": 0.0, "is_kl_k3": 0.0}
    if lw_units.numel():
        wu = torch.exp(lw_units.clamp(max=log_thr)).double()
        diag["is_mean"] = float(wu.mean())
        diag["is_max"] = float(torch.exp(lw_units.max().double()))
        diag["is_ess"] = float(wu.sum() ** 2 / (wu.numel() * (wu**2).sum()))
        diag["is_frac_truncated"] = float((lw_units > log_thr).double().mean())
        diag["is_frac_rejected"] = float((~kept_units).double().mean())
        diag.update(mismatch_kl(prox_logp, behav_logp, mask))
    return w, keep.float(), diag


def mismatch_kl(policy_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The engine/learner mismatch over the masked tokens, from the behavior samples, r = p_policy / p_behav:
    is_kl_k1 = mean(-log r), is_kl_k3 = mean(r - 1 - log r) (both estimate KL(behav || policy)); 0 with no token."""
    m = mask.bool()
    dt = (policy_logp.detach().double() - behav_logp.detach().double())[m].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if not dt.numel():
        return {"is_kl_k1": 0.0, "is_kl_k3": 0.0}
    return {"is_kl_k1": float((-dt).mean()), "is_kl_k3": float((torch.exp(dt) - 1 - dt).mean())}


def mismatch_by_staleness(policy_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                          staleness: torch.Tensor, max_level: int) -> dict[str, float]:
    """mismatch_s{s}_kl_k3, mismatch_s{s}_is_std and mismatch_s{s}_token_frac per staleness level with
    masked tokens (see the module doc). Inputs [B, T]; `staleness` holds ints (clamped to [0, max_level])."""
    _check_shapes("mismatch_by_staleness", policy_logp=policy_logp, behav_logp=behav_logp, mask=mask,
                  staleness=staleness)
    if max_level < 0:
        raise ValueError(f"mismatch_by_staleness: max_level must be >= 0, got {max_level}")
    m = mask.bool()
    total = int(m.sum())
    dt = (policy_logp.detach().double() - behav_logp.detach().double()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    level = staleness.long().clamp(0, max_level)
    out: dict[str, float] = {}
    for s in range(max_level + 1):
        d = dt[m & (level == s)]
        if not d.numel():
            continue
        r = torch.exp(d)
        out[f"mismatch_s{s}_kl_k3"] = float((r - 1 - d).mean())
        out[f"mismatch_s{s}_is_std"] = float(r.std(unbiased=False))
        out[f"mismatch_s{s}_token_frac"] = d.numel() / total
    return out
