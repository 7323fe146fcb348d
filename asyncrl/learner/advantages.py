"""Outcome advantages: one scalar per trajectory, computed from rewards and group ids.

Inputs: `rewards` float [N] (one per trajectory), `group_ids` int [N] (trajectories of one prompt share
an id; groups may have any real size, including 1). Output: float32 [N]; the caller broadcasts it to
the trajectory's tokens. Everything is computed in float64 and returned as float32.

- GRPO:   A_i = (r_i - mean_g) / (std_g + eps)   std_g: the unbiased (n-1) sample std of group g
          (as torch.std, which verl also uses); `norm_by_std=False` gives Dr. GRPO: A_i = r_i - mean_g.
- RLOO:   A_i = r_i - mean_{j in g, j != i} r_j = n_g / (n_g - 1) * (r_i - mean_g).
- REINFORCE++ (outcome-only): A_i = (r_i - mean_B) / (std_B + eps) over the whole batch B (unbiased std),
          optionally after subtracting the group mean first (`group_baseline=True`, "REINFORCE++-baseline").

A group of one, or a group whose rewards are all equal, gets A = 0 exactly (no NaN, no rounding
residue): such a group carries no learning signal. A batch whose rewards are all equal gets 0 from
REINFORCE++ for the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EPS = 1e-6


def _as_inputs(rewards, group_ids) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if group_ids is None:
        g = torch.zeros_like(r, dtype=torch.long)
    elif isinstance(group_ids, torch.Tensor):
        g = group_ids.flatten().long()
    else:
        g = group_index(group_ids)
    if g.shape != r.shape:
        raise ValueError(f"group_ids has {g.numel()} entries, rewards has {r.numel()}")
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    return r, g


def group_index(group_ids: Sequence) -> torch.Tensor:
    """Map arbitrary hashable group ids (e.g. the schema's string group_id) to 0..G-1, in first-seen order."""
    seen: dict = {}
    return torch.tensor([seen.setdefault(x, len(seen)) for x in group_ids], dtype=torch.long)


def _group_stats(r: torch.Tensor, g: torch.Tensor):
    """Per-trajectory (group size n, group mean, unbiased group std, group all-equal flag)."""
    _, inv = torch.unique(g, return_inverse=True)
    k = int(inv.max()) + 1 if inv.numel() else 0
    n = torch.zeros(k, dtype=torch.float64).index_add_(0, inv, torch.ones_like(r))
    s = torch.zeros(k, dtype=torch.float64).index_add_(0, inv, r)
    mean = s / n
    dev2 = torch.zeros(k, dtype=torch.float64).index_add_(0, inv, (r - mean[inv]) ** 2)
    std = torch.sqrt(dev2 / (n - 1).clamp(min=1))
    rmax = torch.full((k,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inv, r, "amax")
    rmin = torch.full((k,), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, r, "amin")
    flat = rmax == rmin
    return n[inv], mean[inv], std[inv], flat[inv]


def grpo_advantages(rewards, group_ids, norm_by_std: bool = True, eps: float = EPS) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps); Dr. GRPO with norm_by_std=False: r - group mean."""
    r, g = _as_inputs(rewards, group_ids)
    if r.numel() == 0:
        return torch.zeros(0)
    n, mean, std, flat = _group_stats(r, g)
    adv = r - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where(flat | (n < 2), torch.zeros_like(adv), adv).float()


def rloo_advantages(rewards, group_ids) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other members of its group = n/(n-1) * (r_i - group mean)."""
    r, g = _as_inputs(rewards, group_ids)
    if r.numel() == 0:
        return torch.zeros(0)
    n, mean, _, flat = _group_stats(r, g)
    adv = n / (n - 1).clamp(min=1) * (r - mean)
    return torch.where(flat | (n < 2), torch.zeros_like(adv), adv).float()


def reinforce_pp_advantages(rewards, group_ids=None, group_baseline: bool = False, eps: float = EPS) -> torch.Tensor:
    """REINFORCE++: batch-whitened rewards (r - batch mean) / (batch std + eps), unbiased std.

    With group_baseline=True the group mean is subtracted first (groups of one then give 0 before whitening).
    """
    r, g = _as_inputs(rewards, group_ids)
    if r.numel() == 0:
        return torch.zeros(0)
    x = r
    if group_baseline:
        n, mean, _, flat = _group_stats(r, g)
        x = torch.where(flat | (n < 2), torch.zeros_like(r), r - mean)
    if r.numel() < 2 or bool((x == x[0]).all()):
        return torch.zeros_like(r).float()
    return ((x - x.mean()) / (x.std() + eps)).float()


def compute_advantages(estimator: str, rewards, group_ids, norm_by_std: bool = True) -> torch.Tensor:
    """Dispatch on `algorithm.adv_estimator`: grpo | drgrpo | rloo | reinforce_pp."""
    if estimator == "grpo":
        return grpo_advantages(rewards, group_ids, norm_by_std=norm_by_std)
    if estimator == "drgrpo":
        return grpo_advantages(rewards, group_ids, norm_by_std=False)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_ids)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, group_ids)
    raise ValueError(f"algorithm.adv_estimator={estimator!r} is not one of grpo, drgrpo, rloo, reinforce_pp")
