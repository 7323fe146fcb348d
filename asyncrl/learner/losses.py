"""Policy losses (plugins of kind "loss"), their KL and entropy terms, and loss aggregation.

Per token (A: the advantage at that token, m: loss mask), with the anchor pi_old the ratio is taken against:

  decoupled (prox_logp given):  pi_old = pi_prox,   w = min(pi_prox / pi_behav, threshold)  (importance.py)
  not decoupled:                pi_old = pi_behav,  w = 1
  r = pi_theta / pi_old = exp(logp - old_logp)
  pg = w * keep * L(r, A)       L: the configured loss (`algorithm.loss`), below

When the loss is decoupled the behavior weight w is ALWAYS applied, by `policy_loss`, whatever loss is
configured: a loss only defines its surrogate L of the proximal ratio and cannot switch w off. Optional
rejection (is_reject_low/high: IcePop-style masking of out-of-range weights) sets keep = 0 for rejected
tokens/sequences; it does not change the normalizers. The log ratio is clamped to [-20, 20] before exp.

The built-in losses (`algorithm.loss=<name>`), per token, eps_l = clip_low, eps_h = clip_high:

  ppo        L = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))                          (Schulman et al. 2017;
             asymmetric "clip-higher" bounds as DAPO, Yu et al. 2025); for A < 0 then L = min(L, -A c) with
             c = clip_ratio_c (dual clip, Ye et al. 2020: a ratio above c gives a negative-advantage token
             no gradient; 3 as verl; null: off)
  gspo       s = exp(mean_t m_t log r_t) per sequence (the length-normalised sequence ratio); per token
             s_t = sg(s) * pi_theta(y_t) / sg(pi_theta(y_t)) (value s, gradient s * grad log pi_theta(y_t));
             L = max(-A s_t, -A clip(s_t, 1 - eps_l, 1 + eps_h)). A sequence is clipped as a whole. With
             loss_agg=seq_mean_token_mean this is GSPO's objective exactly (Zheng et al. 2025, "Group
             Sequence Policy Optimization"; the paper uses eps_l = 3e-4, eps_h = 4e-4).
  cispo      L = -sg(clip(r, 1 - eps_l, 1 + eps_h)) * A * log pi_theta(y_t): the IS weight is clipped, never
             the gradient, so every token contributes (MiniMax-M1, 2025; it leaves the lower bound open:
             set clip_low=1 for that).
  sapo       L = -A * (4 / tau) * sigmoid(tau * (r - 1)),  tau = tau_pos if A > 0 else tau_neg: a soft
             gate in place of the hard clip; its gradient weight 4 g (1 - g) is 1 at r = 1 and decays
             smoothly off-policy (Gao et al. 2025, "Soft Adaptive Policy Optimization"; tau_pos = 1.0,
             tau_neg = 1.05 there).
  reinforce  L = -A * log pi_theta(y_t): the plain on-policy gradient; it ignores r, so it corrects no
             staleness on its own (see the guardrail in `check_off_policy_correction`).

A user loss is a function `loss(inputs: LossInputs, cfg: AlgorithmConfig) -> PolicyTerms` registered with
`@register("loss", "<name>")`; setting `<fn>.corrects_off_policy = True` declares that it uses the ratio
to the anchor (the guardrail refuses stale data otherwise).

  KL to a reference policy (kl_coef > 0), samples from pi_theta, with x = ref_logp - logp:
      k1 = -x = logp - ref_logp,  k2 = x^2 / 2,  k3 = exp(x) - 1 - x (non-negative, unbiased for
      KL(theta||ref)),  low_var_kl = clamp(k3, -10, 10)                                 (`kl_penalty`)
  loss = agg(pg) + kl_coef * agg(kl) - entropy_coef * agg(entropy)
  With algorithm.kl_in_reward (adv_estimator=gae) the KL is a reward instead: each generated token's
  reward becomes r_t - kl_coef * kl_t before GAE (the reference's logprobs are taken once, before the
  update), and the loss carries no KL term.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from asyncrl import registry
from asyncrl.learner.importance import importance_weights, mismatch_kl

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


KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate from samples of pi_theta, x = ref_logp - logp:
    k1 = -x (unbiased, high variance, can be negative), k2 = x^2 / 2 (biased, low variance),
    k3 = e^x - 1 - x (unbiased, non-negative; Schulman 2020, "Approximating KL Divergence"),
    low_var_kl = k3 clamped to [-10, 10] (verl's name for it)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator in ("k3", "low_var_kl"):
        x = (ref_logp - logp).clamp(-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP)
        k3 = torch.exp(x) - 1 - x
        return k3.clamp(-10.0, 10.0) if estimator == "low_var_kl" else k3
    raise ValueError(f"algorithm.kl_estimator={estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")


@dataclass(frozen=True)
class LossInputs:
    """What a loss gets for one micro-batch, every tensor [B, T] over the response tokens.

    logp: log pi_theta(y_t) (carries the gradient); old_logp: the anchor's (the proximal policy's when
    decoupled, else the behavior policy's), detached; advantages: per token, detached; mask: bool, the
    tokens that count (masked entries may hold anything, NaN included: use `where`, never multiply)."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor

    @property
    def log_ratio(self) -> torch.Tensor:
        """log r = logp - old_logp, clamped to [-20, 20] and zero outside the mask."""
        d = (self.logp - self.old_logp.detach()).clamp(-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP)
        return torch.where(self.mask, d, torch.zeros_like(d))

    def seq_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sequence mean of `x` over the mask, [B, 1] (0 for a sequence with no masked token)."""
        n = self.mask.sum(-1, keepdim=True).clamp(min=1)
        return torch.where(self.mask, x, torch.zeros_like(x)).sum(-1, keepdim=True) / n


class PolicyTerms(NamedTuple):
    """A loss's answer: per-token loss [B, T] (before the behavior weight, rejection and aggregation),
    which tokens it clipped (bool [B, T]; zeros for a loss that never clips), and the ratio it used
    ([B, T], for metrics)."""

    loss: torch.Tensor
    clipped: torch.Tensor
    ratio: torch.Tensor


def _clip_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> PolicyTerms:
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return PolicyTerms(torch.maximum(unclipped, clipped), clipped > unclipped, ratio)


def ppo_terms(inp: LossInputs, clip_low: float, clip_high: float, clip_ratio_c: float | None = None) -> PolicyTerms:
    """PPO's clipped surrogate per token, dual-clipped for A < 0 unless clip_ratio_c is None (module docstring)."""
    t = _clip_surrogate(torch.exp(inp.log_ratio), inp.advantages, clip_low, clip_high)
    if clip_ratio_c is None:
        return t
    cap = -inp.advantages * clip_ratio_c
    capped = (inp.advantages < 0) & (t.loss > cap)
    return PolicyTerms(torch.where(capped, cap, t.loss), t.clipped | capped, t.ratio)


def gspo_terms(inp: LossInputs, clip_low: float, clip_high: float) -> PolicyTerms:
    """GSPO's sequence-ratio clipped surrogate (module docstring, `gspo`)."""
    log_s = inp.seq_mean(inp.log_ratio).detach().expand_as(inp.logp)
    log_s_t = log_s + inp.logp - inp.logp.detach()
    return _clip_surrogate(torch.exp(log_s_t), inp.advantages, clip_low, clip_high)


def cispo_terms(inp: LossInputs, clip_low: float, clip_high: float) -> PolicyTerms:
    """CISPO: the REINFORCE term weighted by the clipped, detached ratio (module docstring, `cispo`)."""
    r = torch.exp(inp.log_ratio).detach()
    weight = torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high)
    return PolicyTerms(-inp.advantages * weight * inp.logp, weight != r, r)


def sapo_terms(inp: LossInputs, tau_pos: float, tau_neg: float) -> PolicyTerms:
    """SAPO's soft-gated surrogate (module docstring, `sapo`)."""
    r = torch.exp(inp.log_ratio)
    tau = torch.where(inp.advantages > 0, torch.full_like(r, tau_pos), torch.full_like(r, tau_neg))
    gate = torch.sigmoid(tau * (r - 1.0)) * 4.0 / tau
    return PolicyTerms(-inp.advantages * gate, torch.zeros_like(inp.mask), r)


def reinforce_terms(inp: LossInputs) -> PolicyTerms:
    """The plain policy gradient -A log pi_theta (module docstring, `reinforce`)."""
    return PolicyTerms(-inp.advantages * inp.logp, torch.zeros_like(inp.mask), torch.exp(inp.log_ratio).detach())


def ppo_clip_terms(logp, anchor_logp, advantages, clip_low: float, clip_high: float):
    """(per-token clipped surrogate loss max(-A r, -A clip(r)), ratio r, clipped flag) with r = exp(logp - anchor)."""
    inp = LossInputs(logp, anchor_logp, advantages, torch.ones_like(logp, dtype=torch.bool))
    t = ppo_terms(inp, clip_low, clip_high)
    return t.loss, t.ratio, t.clipped


# ----------------------------------------------------------------------------- the registered losses


@registry.register("loss", "ppo")
def _ppo(inp: LossInputs, cfg: Any) -> PolicyTerms:
    return ppo_terms(inp, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c)


@registry.register("loss", "gspo")
def _gspo(inp: LossInputs, cfg: Any) -> PolicyTerms:
    return gspo_terms(inp, cfg.clip_low, cfg.clip_high)


@registry.register("loss", "cispo")
def _cispo(inp: LossInputs, cfg: Any) -> PolicyTerms:
    return cispo_terms(inp, cfg.clip_low, cfg.clip_high)


@registry.register("loss", "sapo")
def _sapo(inp: LossInputs, cfg: Any) -> PolicyTerms:
    return sapo_terms(inp, cfg.sapo_tau_pos, cfg.sapo_tau_neg)


@registry.register("loss", "reinforce")
def _reinforce(inp: LossInputs, cfg: Any) -> PolicyTerms:
    return reinforce_terms(inp)


@registry.register("loss", "sft")
def _sft(inp: LossInputs, cfg: Any) -> PolicyTerms:
    """Supervised fine-tuning (asyncrl sft): the negative log-likelihood -log pi_theta of every masked token,
    whatever the advantage. Only for data that is not the policy's own samples (no ratio, no correction)."""
    return PolicyTerms(-inp.logp, torch.zeros_like(inp.mask), torch.exp(inp.log_ratio).detach())


for _fn in (_ppo, _gspo, _cispo, _sapo):
    _fn.corrects_off_policy = True  # type: ignore[attr-defined]
_reinforce.corrects_off_policy = False  # type: ignore[attr-defined]
_sft.corrects_off_policy = False  # type: ignore[attr-defined]

LossFn = Callable[[LossInputs], PolicyTerms]


def resolve_loss(name: str) -> Callable[[LossInputs, Any], PolicyTerms]:
    """The registered loss `name` (built-ins and the config's plugins); PluginError listing the names if none."""
    return registry.get("loss", name)


def check_off_policy_correction(cfg: Any, loss: Callable) -> str | None:
    """The guardrail: why a config (AlgorithmConfig) trains stale tokens uncorrected, or None if it does not.

    Tokens up to max_staleness versions old are trained; without the decoupled behavior weight, only a loss
    that uses the ratio to the behavior policy corrects for that. Such a config is refused unless
    algorithm.allow_uncorrected_off_policy is set."""
    if cfg.max_staleness == 0 or cfg.decoupled or cfg.allow_uncorrected_off_policy:
        return None
    if getattr(loss, "corrects_off_policy", False):
        return None
    return (f"algorithm.loss={cfg.loss!r} with algorithm.decoupled=false corrects nothing for staleness, yet "
            f"algorithm.max_staleness={cfg.max_staleness} trains tokens up to that many versions old: set "
            "algorithm.decoupled=true (the behavior importance weight), algorithm.max_staleness=0, or "
            "algorithm.allow_uncorrected_off_policy=true to train them uncorrected on purpose")


def policy_loss(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    prox_logp: torch.Tensor | None = None,
    loss_fn: LossFn | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_level: str = "token",
    is_threshold: float | None = 2.0,
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
    """The scalar loss and its metrics. All tensors [B, T] (advantages may be [B], [B, 1] or [B, T]).

    `loss_fn` maps LossInputs to PolicyTerms (default: PPO's clip with clip_low/clip_high). Decoupled iff
    `prox_logp` is given (algorithm.decoupled); then the truncated behavior weight is always applied.
    Metrics: pg_loss, kl, entropy, clip_frac, ratio_mean, ratio_max, the engine/learner mismatch is_kl_k1 and
    is_kl_k3 and, when decoupled, the other is_* diagnostics of `importance_weights`.
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
    else:  # not decoupled: the mismatch is measured against the policy being trained (the proximal one on
        # the first minibatch of a step, when the two are the same weights)
        w, keep, anchor = torch.ones_like(logp), m.float(), behav_logp
        metrics.update(mismatch_kl(logp, behav_logp, mask))
    if loss_fn is None:
        def loss_fn(inp: LossInputs) -> PolicyTerms:
            return ppo_terms(inp, clip_low, clip_high)
    terms = loss_fn(LossInputs(logp, anchor.detach(), advantages, m))
    if terms.loss.shape != logp.shape:
        raise ValueError(f"the loss returned a per-token loss of shape {tuple(terms.loss.shape)}, expected "
                         f"{tuple(logp.shape)} (one value per response token)")
    pg_tok = torch.where(keep.bool() & m, w.to(terms.loss.dtype) * terms.loss, torch.zeros_like(terms.loss))
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
        ratio = terms.ratio.detach()
        metrics["clip_frac"] = float((terms.clipped.bool() & m).sum()) / n
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
