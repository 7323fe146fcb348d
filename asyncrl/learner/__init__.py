"""The learner: decoupled, importance-corrected policy-gradient training (FSDP2), and its math as pure functions.

Public math (torch tensors; masks are float/bool [B, T]; formulas in each function's docstring):

  advantages  grpo_advantages(rewards, group_ids, norm_by_std=True)      GRPO / Dr. GRPO (norm_by_std=False)
              rloo_advantages(rewards, group_ids)                        leave-one-out baseline
              reinforce_pp_advantages(rewards, group_ids=None, group_baseline=False)   batch-whitened
              compute_advantages(estimator, rewards, group_ids, cfg)    the registered "advantage" by name
  importance  importance_weights(prox_logp, behav_logp, mask, level=, threshold=, reject_low=,
                                 reject_high=, seq_mode=) -> (w, keep, diagnostics)
  losses      policy_loss(logp, behav_logp, advantages, mask, prox_logp=None, loss_fn=None, ...) -> (loss, metrics)
              LossInputs, PolicyTerms: a loss plugin's input and answer; ppo_terms, gspo_terms,
              cispo_terms, sapo_terms, reinforce_terms (registered as "loss" ppo|gspo|cispo|sapo|reinforce)
              check_off_policy_correction(algorithm_cfg, loss) -> why stale tokens go uncorrected, or None
              ppo_clip_terms(logp, anchor_logp, advantages, clip_low, clip_high)
              kl_penalty(logp, ref_logp, estimator)                      k1 | k3
              aggregate(values, mask, mode, num_tokens=, num_seqs=, max_response_tokens=)
  gae         place_rewards(length, mask, final_reward, placed), gae(rewards, values, mask, gamma, lam),
              whiten(values, masks), value_loss(values, old_values, returns, mask, cliprange)
              (the critic itself: asyncrl.learner.critic, imported lazily with the worker)
  logprobs    token_logprobs(logits, token_ids, temperature)             the engine's definition
              logprobs_and_entropy(logits, token_ids, temperature)
  packing     plan_micro_batches(lengths, token_budget, packing), build_micro_batch(seqs, index, packing)

Runtime (imported lazily, they pull in transformers): `asyncrl.learner.worker.LearnerWorker`,
`asyncrl.learner.checkpoint` (atomic DCP checkpoints), `asyncrl.learner.export` (`asyncrl export`),
`asyncrl.learner.distributed.spawn` (N local CPU ranks over gloo).
"""

from asyncrl.learner.advantages import (
    compute_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from asyncrl.learner.importance import importance_weights
from asyncrl.learner.logprobs import logprobs_and_entropy, token_logprobs
from asyncrl.learner.losses import aggregate, kl_penalty, policy_loss, ppo_clip_terms
from asyncrl.learner.packing import build_micro_batch, plan_micro_batches

__all__ = [
    "aggregate",
    "build_micro_batch",
    "compute_advantages",
    "grpo_advantages",
    "importance_weights",
    "kl_penalty",
    "logprobs_and_entropy",
    "plan_micro_batches",
    "policy_loss",
    "ppo_clip_terms",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "token_logprobs",
]
