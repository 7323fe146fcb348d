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
softmax(z), or argmax when T == 0. The draw is by inverse CDF: one uniform u from the row's own
`torch.Generator` (seeded requests are reproducible), and the first token whose cumulative probability
exceeds u times the row's total (a token of zero probability is never drawn). `sample_tokens` does this
for every row of a step at once, on the logits' own device: drawing row by row (softmax and
torch.multinomial over a 49k vocabulary each) cost 31 ms of a 16-row step on one CPU thread and 180-250 ms
at 128 rows, more than a GPU's forward of those rows (docs/benchmarks.md, "On one GPU").
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


def sample_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    banned: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of logits [R, V] (any device), row i drawn by its own temperature, top-k, top-p,
    banned token ids and generator (None: torch's global one), as the module docstring says."""
    z = logits.float()  # the caller's own tensor when it is float32: never written below
    rows, vocab = z.shape
    out = torch.empty(rows, dtype=torch.long, device=z.device)
    greedy = [i for i, t in enumerate(temperatures) if t == 0]
    sampled = [i for i, t in enumerate(temperatures) if t != 0]
    if greedy:
        at = torch.tensor(greedy, device=z.device)
        out[at] = z[at].argmax(-1)
        for i in greedy:
            if banned[i]:
                row = z[i].clone()
                row[list(banned[i])] = float("-inf")
                out[i] = row.argmax()
    if sampled:
        at = torch.tensor(sampled, device=z.device)
        zs = z if len(sampled) == rows else z[at]  # every row sampled (RL's rollouts): no copy
        temps = [temperatures[i] for i in sampled]
        if any(t != 1.0 for t in temps):
            zs = zs / torch.tensor(temps, device=z.device).unsqueeze(1)
        truncated = [j for j, i in enumerate(sampled) if top_k[i] > 0 or top_p[i] < 1.0]
        if truncated and zs is z:
            zs = zs.clone()
        for j in truncated:  # the ban comes first: the nucleus is that of the tokens that may be drawn
            i = sampled[j]
            if banned[i]:
                zs[j, list(banned[i])] = float("-inf")
            zs[j] = truncate_logits(zs[j], top_k[i], top_p[i])
        probs = torch.softmax(zs, dim=-1)
        done = set(truncated)
        cut = [(j, t) for j, i in enumerate(sampled) if j not in done for t in banned[i]]
        if cut:  # a banned token's mass dropped (one indexed write): the draw below renormalizes
            probs[torch.tensor([j for j, _ in cut], device=z.device), torch.tensor([t for _, t in cut], device=z.device)] = 0.0
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.tensor([float(torch.rand((), generator=generators[i])) for i in sampled], device=z.device)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp_max(vocab - 1)
        # cdf[t] > u * total >= cdf[t - 1]: token t has mass; only a rounding at the very top can pass the
        # last token with mass, and then that token is the draw
        empty = probs.gather(1, tok.unsqueeze(1)).squeeze(1) == 0
        if bool(empty.any()):
            last = (vocab - 1) - torch.flip(probs > 0, dims=[1]).int().argmax(dim=1)
            tok = torch.where(empty, last, tok)
        out[at] = tok
    return out.tolist()


def sample_row(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    banned: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> int:
    """Draw one token from one row of logits [V]: `sample_tokens` of one row."""
    return sample_tokens(logits.unsqueeze(0), [temperature], [top_k], [top_p], [tuple(banned)], [generator])[0]
