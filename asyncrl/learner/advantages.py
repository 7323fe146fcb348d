"""Outcome advantages: one scalar per trajectory, computed from rewards and group ids.

Inputs: `rewards` float [N] (one per trajectory), `group_ids` int [N] (trajectories of one prompt share
an id; groups may have any real size, including 1). Output: float32 [N]; the caller broadcasts it to
the trajectory's tokens. Everything is computed in float64 and returned as float32.

- GRPO:   A_i = (r_i - mean_g) / (std_g + eps)   std_g: the unbiased (n-1) sample std of group g
          (as torch.std, which verl also uses); `norm_by_std=False` gives Dr. GRPO: A_i = r_i - mean_g.
- RLOO:   A_i = r_i - mean_{j in g, j != i} r_j = n_g / (n_g - 1) * (r_i - mean_g).
- REINFORCE++ (outcome-only): A_i = (r_i - mean_B) / (std_B + eps) over the whole batch B (unbiased std),
          optionally after subtracting the group mean first (`group_baseline=True`, "REINFORCE++-baseline").

Estimators are plugins of kind "advantage" (`@register("advantage", "<name>")`, signature below
`compute_advantages`); `algorithm.adv_estimator=<name>` picks one and `compute_advantages` checks its answer.

Per-turn credit (`algorithm.turn_credit`, `turn_credit_advantages`): turn and tool rewards r_k placed at
response positions p_k (the last generated token of the turn that earned them) join the final reward R:
the total return is G = R + sum_k r_k, and token t's return-to-go is G - E_t with E_t = sum_{k: p_k < t} r_k
(rewards earned before the turn of token t, which that token cannot have caused). The estimator runs on
the totals G (its baseline and scale over the group, or the batch); token t then gets
          A_t = A(G) - c * E_t,   c = 1 / (std + eps) for grpo and reinforce_pp, 1 for drgrpo and rloo,
i.e. the estimator's own formula with the token's return-to-go in place of the total: GRPO's
(G - E_t - mean_g G) / (std_g G + eps), RLOO's G - E_t - mean_{j != i} G_j. The baseline does not
depend on the token's action, so the gradient stays unbiased while rewards a token could not affect
drop out of its advantage. A group (a batch, for reinforce_pp) whose totals are all equal gets 0.

A group of one, or a group whose rewards are all equal, gets A = 0 exactly (no NaN, no rounding
residue): such a group carries no learning signal. A batch whose rewards are all equal gets 0 from
REINFORCE++ for the same reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from asyncrl import registry

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


# Beyond this |reward| the squares behind a std overflow float64: the estimators then work on r / max|r|
# (exactly the same math: a std-normalized advantage does not depend on the scale; the others are scaled
# back). Below it the scale is 1.0 and every result is bit-identical to the plain formula.
HUGE_REWARD = 1e150


def _scale(r: torch.Tensor) -> float:
    top = float(r.abs().max()) if r.numel() else 0.0
    return top if top > HUGE_REWARD else 1.0


def _checked(adv: torch.Tensor, r: torch.Tensor, estimator: str) -> torch.Tensor:
    """float32 advantages, refused (never NaN or inf) when rewards are too large for float32 to hold them."""
    out = adv.float()
    if not torch.isfinite(out).all():
        raise ValueError(f"{estimator} advantages of rewards up to {float(r.abs().max()):.3g} do not fit float32; "
                         f"bound the rewards at their source (env.reward.max_abs)")
    return out


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
    s = _scale(r)
    x = r / s
    n, mean, std, flat = _group_stats(x, g)
    adv = x - mean
    adv = adv / (std + eps / s) if norm_by_std else adv * s
    return _checked(torch.where(flat | (n < 2), torch.zeros_like(adv), adv), r, "grpo" if norm_by_std else "drgrpo")


def rloo_advantages(rewards, group_ids) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other members of its group = n/(n-1) * (r_i - group mean)."""
    r, g = _as_inputs(rewards, group_ids)
    if r.numel() == 0:
        return torch.zeros(0)
    s = _scale(r)
    x = r / s
    n, mean, _, flat = _group_stats(x, g)
    adv = n / (n - 1).clamp(min=1) * (x - mean) * s
    return _checked(torch.where(flat | (n < 2), torch.zeros_like(adv), adv), r, "rloo")


def reinforce_pp_advantages(rewards, group_ids=None, group_baseline: bool = False, eps: float = EPS) -> torch.Tensor:
    """REINFORCE++: batch-whitened rewards (r - batch mean) / (batch std + eps), unbiased std.

    With group_baseline=True the group mean is subtracted first (groups of one then give 0 before whitening).
    """
    r, g = _as_inputs(rewards, group_ids)
    if r.numel() == 0:
        return torch.zeros(0)
    s = _scale(r)
    x = r / s
    if group_baseline:
        n, mean, _, flat = _group_stats(x, g)
        x = torch.where(flat | (n < 2), torch.zeros_like(r), x - mean)
    if r.numel() < 2 or bool((x == x[0]).all()):
        return torch.zeros_like(r).float()
    return _checked((x - x.mean()) / (x.std() + eps / s), r, "reinforce_pp")


TURN_CREDIT_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp")


def earned_before(length: int, placed: Sequence[tuple[int, float]]) -> torch.Tensor:
    """E_t for t in 0..length-1: the sum of the rewards placed at positions < t (float64 [length]).
    A position of -1 (unplaced) counts as the last token: nothing comes after it."""
    e = torch.zeros(length + 1, dtype=torch.float64)
    for p, r in placed:
        at = length - 1 if p < 0 else p
        if not 0 <= at < length:
            raise ValueError(f"reward position {p} is outside the response (length {length})")
        e[at + 1] += float(r)
    return torch.cumsum(e, 0)[:length]


def turn_credit_advantages(estimator: str, final_rewards, group_ids, placed: Sequence[Sequence[tuple[int, float]]],
                           lengths: Sequence[int], cfg: Any = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-turn credit (module docstring): (the totals' advantages A(G) float32 [N], and per trajectory
    its per-token advantages float32 [length_i]). `placed[i]`: trajectory i's (position, reward) pairs."""
    if estimator not in TURN_CREDIT_ESTIMATORS:
        raise ValueError(f"algorithm.turn_credit needs adv_estimator in {', '.join(TURN_CREDIT_ESTIMATORS)}, "
                         f"got {estimator!r}")
    r, g = _as_inputs(final_rewards, group_ids)
    if not (len(placed) == len(lengths) == r.numel()):
        raise ValueError(f"turn_credit_advantages: {r.numel()} rewards, {len(placed)} reward lists, "
                         f"{len(lengths)} lengths")
    # Huge rewards (beyond HUGE_REWARD) are worked on as fractions of the largest, as the estimators do: a
    # std-normalized advantage does not depend on the scale, the others are scaled back (s = 1 otherwise:
    # bit-identical to the plain formula). Their sum and its squares then never overflow float64.
    turn = torch.tensor([float(x) for pl in placed for _, x in pl], dtype=torch.float64)
    if not torch.isfinite(turn).all():
        raise ValueError(f"turn rewards must be finite, got {turn[~torch.isfinite(turn)][:4].tolist()}")
    s = max(_scale(r), _scale(turn))
    placed = [[(p, float(x) / s) for p, x in pl] for pl in placed]
    totals = r / s + torch.tensor([sum(x for _, x in pl) for pl in placed], dtype=torch.float64)
    normalized = estimator in ("grpo", "reinforce_pp") and (estimator != "grpo" or getattr(cfg, "norm_adv_by_std", True))
    unit = 1.0 if normalized else s
    adv = compute_advantages(estimator, totals, g, cfg).double()
    if normalized:
        if estimator == "grpo":
            n, _, std, flat = _group_stats(totals, g)
            degenerate = flat | (n < 2)
        else:
            std = totals.std().expand_as(totals) if totals.numel() > 1 else torch.zeros_like(totals)
            degenerate = (totals == totals[0]).all().expand_as(totals) if totals.numel() else totals.bool()
        scale = 1.0 / (std + EPS)  # on the scaled totals, as compute_advantages divided them
    else:
        n, _, _, flat = _group_stats(totals, g)
        degenerate, scale = flat | (n < 2), torch.ones_like(totals)
    per_token = []
    for i, (pl, length) in enumerate(zip(placed, lengths)):
        a = (adv[i] - scale[i] * earned_before(int(length), pl)) * unit
        per_token.append(torch.zeros(int(length)) if bool(degenerate[i]) else _checked(a, r, estimator))
    return _checked(adv * unit, r, estimator), per_token


# ----------------------------------------------------------------------------- the registered estimators
# An estimator is `fn(rewards, group_ids, cfg) -> advantages`: rewards float64 [N] (finite), group_ids
# long [N] (0..G-1), cfg the AlgorithmConfig; it returns one advantage per trajectory, [N].


@registry.register("advantage", "grpo")
def _grpo(rewards: torch.Tensor, group_ids: torch.Tensor, cfg: Any) -> torch.Tensor:
    return grpo_advantages(rewards, group_ids, norm_by_std=getattr(cfg, "norm_adv_by_std", True))


@registry.register("advantage", "drgrpo")
def _drgrpo(rewards: torch.Tensor, group_ids: torch.Tensor, cfg: Any) -> torch.Tensor:
    return grpo_advantages(rewards, group_ids, norm_by_std=False)


@registry.register("advantage", "rloo")
def _rloo(rewards: torch.Tensor, group_ids: torch.Tensor, cfg: Any) -> torch.Tensor:
    return rloo_advantages(rewards, group_ids)


@registry.register("advantage", "reinforce_pp")
def _reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor, cfg: Any) -> torch.Tensor:
    return reinforce_pp_advantages(rewards, group_ids)


def compute_advantages(estimator: str, rewards, group_ids, cfg: Any = None) -> torch.Tensor:
    """The registered estimator `estimator` (algorithm.adv_estimator) on these rewards: float32 [N].

    A plugin's answer is checked: one finite value per trajectory, else a ValueError naming the plugin."""
    r, g = _as_inputs(rewards, group_ids)
    try:
        fn = registry.get("advantage", estimator)
    except registry.PluginError as e:
        raise ValueError(f"algorithm.adv_estimator={estimator!r}: {e}") from None
    out = torch.as_tensor(fn(r, g, cfg)).flatten()
    if out.shape != r.shape:
        raise ValueError(f"advantage estimator {estimator!r} returned {out.numel()} values for {r.numel()} "
                         "trajectories (one advantage per trajectory is the contract)")
    if not torch.isfinite(out).all():
        raise ValueError(f"advantage estimator {estimator!r} returned non-finite advantages: {out.tolist()[:8]}")
    return out.float()
