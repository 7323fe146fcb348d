"""Sampling and the one definition of a token's logprob, shared by the engine and the learner.

THE DEFINITION (the learner must compute exactly this):

    logprob(token) = log_softmax(logits / T)[token]

with `logits` the model's next-token logits cast to float32, and `T` the request's temperature,
where a greedy request (T == 0) uses T = 1. It is taken BEFORE any truncation of the distribution:
top-k, top-p and the min_new_tokens ban on stop tokens change which token is drawn, never the
logprob reported for it. `token_logprobs` is that function; everything else here only draws tokens.

SGLang 0.5.23 differs while min_new_tokens bans stop tokens: its penalizer adds -inf to the stop
tokens' logits BEFORE the sampler takes the logprob (srt/sampling/penaltylib/min_new_tokens.py,
applied by SamplingBatchInfo.apply_logits_bias in model_runner._preprocess_logits; the sampler's
log(probs) comes after), so for the first min_new_tokens tokens SGLang reports a logprob
renormalized over the non-stop tokens. The learner cannot see that ban, so
the config (asyncrl/config.py, `Config.__post_init__`) refuses engine=sglang with min_new_tokens > 0.

Drawing a token for one row: z = logits / T; mask z outside the top-k and outside the smallest
set of tokens whose probability mass reaches top_p (the most likely token always stays); draw from
softmax(z) with the row's own `torch.Generator` (seeded requests are reproducible), or argmax when
T == 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def effective_temperature(temperature: float) -> float:
    """The T of the logprob definition: the request's temperature, or 1 for greedy (T == 0)."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float | torch.Tensor
) -> torch.Tensor:
    """log_softmax(float32(logits) / T)[token_ids] over the last dim; T == 0 means T = 1.

    logits: [..., V]; token_ids: [...] (long); temperature: a float, or a tensor broadcastable to
    logits[..., 0] (per-row temperatures). Returns float32 [...].
    """
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(device=x.device, dtype=torch.float32)
        t = torch.where(t == 0, torch.ones_like(t), t)
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            bad = t[~torch.isfinite(t) | (t < 0)][0].item()
            raise ValueError(f"temperature must be a finite number >= 0, got {bad}")
        x = x / t.unsqueeze(-1)
    else:
        x = x / effective_temperature(float(temperature))
    logp = torch.log_softmax(x, dim=-1)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def truncate_logits(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf the entries of one row `z` [V] outside the top-k (k <= 0: all) and the top-p nucleus."""
    if top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, idx = torch.sort(z, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # drop a token when the mass of the tokens strictly before it already reaches top_p
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, idx, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def sample_row(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    banned: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> int:
    """Draw one token from one row of float32 logits [V] (see the module docstring)."""
    z = logits.float()
    if banned:
        z = z.clone()
        z[list(banned)] = float("-inf")
    if temperature == 0:
        return int(torch.argmax(z).item())
    z = truncate_logits(z / temperature, top_k, top_p)
    probs = torch.softmax(z, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
