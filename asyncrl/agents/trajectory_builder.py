"""Accumulates a trajectory's per-token arrays, token in and token out.

Invariants (checked on every append):
  - generated tokens: ids exactly as the engine returned them, loss_mask 1, the engine's logprob
    and the policy version that produced each token;
  - inserted tokens (tool results, user turns, template scaffolding): loss_mask 0, logprob 0.0,
    version -1;
  - len(response_ids) never exceeds the response budget (`max_response_tokens`).
"""

from __future__ import annotations

from typing import Any

from asyncrl.data.schema import Trajectory, make_trajectory


class EngineContractError(RuntimeError):
    """The engine's reply breaks the Generator contract (misaligned ids/logprobs/versions)."""


class TrajectoryBuilder:
    def __init__(self, prompt_ids: list[int], budget: int):
        self.prompt_ids = list(prompt_ids)
        self.budget = int(budget)
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    @property
    def remaining(self) -> int:
        """Response tokens still allowed: max_response_tokens - len(response_ids)."""
        return self.budget - len(self.response_ids)

    def context(self) -> list[int]:
        """The ids the next generation conditions on: prompt + everything so far."""
        return self.prompt_ids + self.response_ids

    def add_generated(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not (len(ids) == len(logprobs) == len(versions)):
            raise EngineContractError(f"engine returned {len(ids)} ids, {len(logprobs)} logprobs and "
                                      f"{len(versions)} versions; they must be aligned")
        if len(ids) > self.remaining:
            raise EngineContractError(f"engine returned {len(ids)} tokens, more than the {self.remaining} asked for")
        self.response_ids += [int(i) for i in ids]
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]

    def add_inserted(self, ids: list[int]) -> None:
        if len(ids) > self.remaining:
            raise ValueError(f"inserting {len(ids)} tokens exceeds the remaining budget of {self.remaining}")
        self.response_ids += [int(i) for i in ids]
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def last_generated_index(self) -> int:
        """The response index of the last generated token (-1 before any)."""
        for i in range(len(self.loss_mask) - 1, -1, -1):
            if self.loss_mask[i]:
                return i
        return -1

    def build(self, **fields: Any) -> Trajectory:
        return make_trajectory(prompt_ids=self.prompt_ids, response_ids=self.response_ids, loss_mask=self.loss_mask,
                               behavior_logprobs=self.logprobs, versions=self.versions, **fields)
