"""Shared builders for agent-loop tests (no doubles here besides the ScriptedEngine they are given)."""

from __future__ import annotations

from typing import Any

from asyncrl.agents.base import AgentContext
from asyncrl.config import AgentConfig
from asyncrl.envs.base import Sample
from asyncrl.tools.loader import load_tool_specs


class RecordingReward:
    """A real reward function (exact match of the number after the last 'Answer:') that also keeps its inputs."""

    def __init__(self):
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *, final_text, ground_truth, extra_info, tool_rewards, turn_rewards):
        self.calls.append(dict(final_text=final_text, ground_truth=ground_truth, extra_info=extra_info,
                               tool_rewards=tool_rewards, turn_rewards=turn_rewards))
        tail = final_text.rsplit("Answer:", 1)
        return {"score": 1.0 if len(tail) == 2 and tail[1].strip() == str(ground_truth) else 0.0, "length": len(final_text)}


def make_sample(question: str = "What is 3*4+5?", ground_truth: Any = "17", extra_info: dict | None = None,
                agent_name: str | None = None) -> Sample:
    return Sample(uid="g0-0", group_id="g0", group_size=4, sample_index=0, data_index=7,
                  messages=[{"role": "user", "content": question}], ground_truth=ground_truth,
                  extra_info=dict(extra_info or {}), agent_name=agent_name)


def make_ctx(tokenizer, engine, tools: list | None = None, tools_config: str | None = None, **agent_kw) -> tuple[AgentContext, RecordingReward]:
    reward = RecordingReward()
    cfg = AgentConfig(**agent_kw)
    specs = load_tool_specs(["calculator"] if tools is None else tools, tools_config)
    return AgentContext(engine=engine, tokenizer=tokenizer, cfg=cfg, tool_specs=specs, reward_fn=reward,
                        env_name="test_env"), reward


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def call(name: str, args: dict | str) -> str:
    import json

    a = args if isinstance(args, str) else json.dumps(args)
    return f'<tool_call>{{"name": "{name}", "arguments": {a}}}</tool_call>'
