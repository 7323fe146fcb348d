"""Token-level GAE over the generated tokens of one trajectory, and the clipped value loss (pure functions).

The steps of the MDP are the generated tokens (loss mask 1), in order; inserted tokens (tool output,
user turns, template scaffolding) are the environment's part of a transition and are not steps. With
the generated positions t_1 < ... < t_n, rewards r placed at the tokens where they arise (a turn or
tool reward at the last generated token of the turn that earned it, the final reward at t_n) and the
critic's values V (V at position t: the value of the context before token t):

    delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}          (V_{t_{n+1}} = 0: the episode ends)
    A_{t_k} = delta_k + gamma * lam * A_{t_{k+1}}               (A_{t_{n+1}} = 0)
    R_{t_k} = A_{t_k} + V_{t_k}                                  (the value target)

Inserted tokens get A = R = 0 and carry no value loss (their mask is 0).
(Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation".)

Clipped value loss (as PPO2 and verl), over the masked tokens with the step's old values V_old:
    V_clip = V_old + clip(V - V_old, -c, c)
    L_V = 0.5 * mean_t max((V - R)^2, (V_clip - R)^2)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def place_rewards(length: int, mask: torch.Tensor, final_reward: float,
                  placed: Sequence[tuple[int, float]]) -> torch.Tensor:
    """Per-token rewards float64 [length]: `placed` (position, reward) pairs at their positions (-1: the last
    generated token) and the final reward at the last generated token."""
    r = torch.zeros(length, dtype=torch.float64)
    gen = mask.bool().nonzero().flatten()
    if gen.numel() == 0:
        return r
    last = int(gen[-1])
    r[last] += float(final_reward)
    for p, x in placed:
        at = last if p < 0 else p
        if not (0 <= at < length and bool(mask[at])):
            raise ValueError(f"reward position {p} is not a generated token of the response (length {length})")
        r[at] += float(x)
    return r


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) float32 [T] of one trajectory (module docstring); zero where mask is 0."""
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 1:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
                         f"{tuple(mask.shape)} must be the same 1-D shape")
    r, v = rewards.double(), values.detach().double()
    adv = torch.zeros_like(r)
    next_v = next_a = 0.0
    for t in reversed(mask.bool().nonzero().flatten().tolist()):
        delta = float(r[t]) + gamma * next_v - float(v[t])
        next_a = delta + gamma * lam * next_a
        next_v = float(v[t])
        adv[t] = next_a
    returns = torch.where(mask.bool(), adv + v, torch.zeros_like(adv))
    return adv.float(), returns.float()


def whiten(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """The tensors shifted and scaled to mean 0 and std 1 over all their masked entries together (zero elsewhere)."""
    flat = torch.cat([v[m.bool()].double() for v, m in zip(values, masks)]) if values else torch.zeros(0)
    if flat.numel() < 2:
        return [torch.zeros_like(v) for v in values]
    mean, std = flat.mean(), flat.std()
    return [torch.where(m.bool(), ((v.double() - mean) / (std + eps)).to(v.dtype), torch.zeros_like(v))
            for v, m in zip(values, masks)]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange: float, num_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped value loss (module docstring) of [B, T] tensors, normalised by `num_tokens` (default: this
    tensor's masked tokens); metrics vf_clip_frac (tokens where the clipped term was the larger)."""
    m = mask.bool()
    old = old_values.detach()
    clipped = old + torch.clamp(values - old, -cliprange, cliprange)
    l1, l2 = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = torch.where(m, 0.5 * torch.maximum(l1, l2), torch.zeros_like(l1))
    n = float(m.sum()) if num_tokens is None else float(num_tokens)
    loss = per_token.sum() / max(n, 1.0)
    with torch.no_grad():
        frac = float(((l2 > l1) & m).sum()) / max(int(m.sum()), 1)
    return loss, {"vf_clip_frac": frac}
