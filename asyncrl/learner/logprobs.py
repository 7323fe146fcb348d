"""Token logprobs and entropies of the rollout distribution, as the learner computes them.

The definition is the engine's (asyncrl/engine/sampling.py), and must stay bit-identical to it:

    logprob(token) = log_softmax(float32(logits) / T)[token],   T = rollout temperature, T == 0 -> 1

taken before any top-k/top-p truncation. The entropy is that of the same distribution:

    H = -sum_v p_v * log p_v,   p = softmax(float32(logits) / T)

`logprobs_and_entropy` computes the log_softmax once and returns both.
"""

from __future__ import annotations

import torch

from asyncrl.engine.sampling import effective_temperature, token_logprobs

__all__ = ["effective_temperature", "logprobs_and_entropy", "token_logprobs"]


def logprobs_and_entropy(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprob [...], entropy [...] or None) for logits [..., V] and token_ids [...], both float32.

    logprob equals `asyncrl.engine.sampling.token_logprobs(logits, token_ids, temperature)` exactly.
    """
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} do not align")
    logp_all = torch.log_softmax(logits.float() / effective_temperature(float(temperature)), dim=-1)
    logp = logp_all.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
