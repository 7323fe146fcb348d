"""tool `gsm8k_reward`: verl's GSM8K answer-checking tool (`verl.tools.gsm8k_tool.Gsm8kTool`), in asyncrl.

The model submits its answer; the tool scores it against the row's ground truth and says so. As verl's:
- its schema's default name is `calc_gsm8k_reward`, one parameter `answer` (a string);
- the ground truth comes from the row: `extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`
  (what verl's `gsm8k_multiturn_w_tool.py` preprocessing writes);
- the answer is scored as "#### <answer>" by the gsm8k env's flexible rule (the last number: 1.0 or 0.0);
- the reply is `Current parsed answer='<answer>' reward=<r>`, and the call's tool reward is 0.0 when the
  answer scores higher than the episode's previous one, else -0.05 (a penalty for resubmitting).
A verl tool YAML naming `verl.tools.gsm8k_tool.Gsm8kTool` gets this class (asyncrl/tools/loader.py). Unlike
verl, a row without a ground truth is an error the model reads and the run counts, not a silent 0.
"""

from __future__ import annotations

from typing import Any

from asyncrl.envs.gsm8k import compute_score
from asyncrl.registry import register
from asyncrl.tools.base import Tool, ToolError

RESUBMIT_PENALTY = -0.05


@register("tool", "gsm8k_reward")
class Gsm8kRewardTool(Tool):
    name = "calc_gsm8k_reward"
    description = ("A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed "
                   "answer is incorrect or not correctly parsed)")
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "The model's answer to the GSM8K math problem"}},
        "required": ["answer"],
    }

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self._episodes: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str, ground_truth: Any = None, **create_kwargs: Any) -> str:
        self._episodes[instance_id] = {"ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def execute(self, instance_id: str, params: dict[str, Any]) -> tuple[str, float, dict[str, Any]]:
        state = self._episodes.setdefault(instance_id, {"ground_truth": None, "reward": 0.0})
        if state["ground_truth"] is None:
            raise ToolError(f"{self.name} has no ground truth for this row (extra_info.tools_kwargs.{self.name}"
                            ".create_kwargs.ground_truth)")
        answer = str(params.get("answer", ""))
        reward = compute_score(answer if answer.startswith("#### ") else "#### " + answer, state["ground_truth"],
                               "flexible")
        tool_reward = 0.0 if reward > state["reward"] else RESUBMIT_PENALTY
        state["reward"] = reward
        return f"Current parsed {answer=} {reward=}", tool_reward, {"answer_reward": reward}

    async def release(self, instance_id: str) -> None:
        self._episodes.pop(instance_id, None)
