"""Responses cut by the token budget (`finish_reason == "length"`): kept as they are, masked out of the loss,
or given DAPO's soft overlong penalty (`algorithm.overlong`; Yu et al. 2025, "DAPO", section 3.4).

    keep     nothing changes (the default)
    mask     a cut response trains no token (its reward still counts in its group's statistics)
    penalty  every response's reward gets  min(0, -(|y| - (L - B)) / B) x f  added, with |y| its length in
             tokens, L = agent.max_response_tokens, B = algorithm.overlong_buffer_tokens and
             f = algorithm.overlong_penalty: 0 up to L - B tokens, falling linearly to -f at L (verl's DAPO
             reward manager, `overlong_buffer`)

Pure functions; the learner applies them before the advantages (asyncrl/learner/worker.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CUT = "length"  # the finish_reason of a response the token budget cut


def soft_penalty(length: int, max_tokens: int, buffer_tokens: int, factor: float) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens (module docstring)."""
    expected = max_tokens - buffer_tokens
    return min(0.0, -(length - expected) / buffer_tokens * factor)


@dataclass(frozen=True)
class Shaped:
    rewards: list[float]  # the rewards the advantages are computed from
    masked: list[bool]  # trajectories that train no token
    metrics: dict[str, float]


def shape(trajs: Sequence[Any], mode: str, max_tokens: int, buffer_tokens: int, factor: float) -> Shaped:
    """The rewards and masks of a batch under `algorithm.overlong=mode`; metrics learner/overlong_frac (the
    share of responses the budget cut) and, with the penalty, learner/overlong_penalty_mean."""
    cut = [t.finish_reason == CUT for t in trajs]
    rewards = [float(t.reward) for t in trajs]
    metrics = {"learner/overlong_frac": sum(cut) / max(len(trajs), 1)}
    if mode == "penalty":
        pens = [soft_penalty(len(t.response_ids), max_tokens, buffer_tokens, factor) for t in trajs]
        rewards = [r + p for r, p in zip(rewards, pens)]
        metrics["learner/overlong_penalty_mean"] = sum(pens) / max(len(pens), 1)
    masked = cut if mode == "mask" else [False] * len(trajs)
    return Shaped(rewards, masked, metrics)
