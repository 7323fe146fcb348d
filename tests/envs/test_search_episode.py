"""A tool_agent episode on search_r1: the env's own services() starts the real retrieval server, the
real `search` tool queries it, the real agent loop builds the trajectory on the tiny model's tokenizer,
and the env's reward scores it.

The policy: a random tiny model does not call tools, so the tool-calling test uses
`ForcedPolicy`, a TEST DOUBLE of the engine that plays the tokens a policy that has learned to search
would produce (two searches, then an answer) and takes their logprobs from a real forward of the tiny
model. A second test runs the real embedded engine (sampling from the tiny model) end to end.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.agents.base import AgentContext, run_episode
from asyncrl.config import AgentConfig, EnvConfig, ToolSpec
from asyncrl.engine.base import GenerateResult, SamplingParams
from asyncrl.engine.client import EngineClient
from asyncrl.engine.launcher import launch_embedded
from asyncrl.envs.base import Sample, resolve_reward_fn
from asyncrl.envs.search_r1.env import SearchR1Env
from asyncrl.tools.loader import load_tool_specs


class ForcedPolicy:
    """TEST DOUBLE of asyncrl.engine.base.Generator: the k-th call returns the k-th scripted text
    (+ <|im_end|>); logprobs are the tiny model's log_softmax at those tokens (real forward)."""

    def __init__(self, tokenizer, model, script: list[str]):
        self.tok, self.model, self.script = tokenizer, model, script
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.inputs: list[list[int]] = []

    async def generate(self, input_ids, sampling: SamplingParams, *, rid=None, session_id=None) -> GenerateResult:
        k = len(self.inputs)
        self.inputs.append(list(input_ids))
        out = (self.tok.encode(self.script[k], add_special_tokens=False) + [self.im_end])[: sampling.max_new_tokens]
        with torch.inference_mode():
            logits = self.model(torch.tensor([list(input_ids) + out])).logits[0, len(input_ids) - 1: -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0].tolist()
        return GenerateResult(output_ids=out, logprobs=lp, versions=[0] * len(out),
                              finish_reason="stop" if out[-1] == self.im_end else "length", weight_version=0)


def _call(query: str) -> str:
    return "<tool_call>" + json.dumps({"name": "search", "arguments": {"query": query}}) + "</tool_call>"


def _env_cfg() -> EnvConfig:
    return dataclasses.replace(EnvConfig(), name="search_r1", num_train=16, num_val=4, seed=11,
                               tools=[ToolSpec(class_name="search")])


def _sample(row: dict) -> Sample:
    return Sample.from_row(row, data_index=0, group_id="g0", sample_index=0, group_size=1)


@pytest.mark.timeout(120)
async def test_tool_agent_searches_twice_and_answers(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    env, cfg = SearchR1Env(), _env_cfg()
    row = env.build(cfg, "val")[0]
    first, bridge = row["extra_info"]["hops"]
    answer = row["reward_model"]["ground_truth"]["target"][0]
    policy = ForcedPolicy(tok, model, [_call(first), _call(bridge), f"<answer> {answer} </answer>"])
    with env.services(cfg) as overrides:
        ctx = AgentContext(engine=policy, tokenizer=tok, cfg=AgentConfig(max_turn_tokens=64, max_response_tokens=700,
                                                                         max_prompt_tokens=1024),
                           tool_specs=load_tool_specs(cfg.tools), reward_fn=resolve_reward_fn(cfg),
                           env_name="search_r1", tool_overrides=overrides)
        traj = await run_episode(_sample(row), ctx, "tool_agent")

    assert traj.finish_reason == "stop" and traj.num_turns == 3
    assert traj.reward == 1.0 and traj.metrics.get("reward/em") == 1.0
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 2
    assert tool_msgs[0].startswith("Doc 1") and f"{first}\n" in tool_msgs[0] and bridge in tool_msgs[0]
    assert answer in tool_msgs[1]  # the second search found the document holding the answer
    # tool output is in the response but masked; generated tokens carry the tiny model's logprobs
    resp, mask = traj.response_ids.numpy().tolist(), traj.loss_mask.numpy().tolist()
    masked_text = tok.decode([t for t, m in zip(resp, mask) if m == 0])
    assert bridge in masked_text and "<tool_call>" not in masked_text
    lp = traj.behavior_logprobs.numpy().tolist()
    assert all(lp[i] < 0 and math.isfinite(lp[i]) for i in range(len(resp)) if mask[i] == 1)
    assert policy.inputs[1][: len(policy.inputs[0])] == policy.inputs[0]  # one growing token sequence


@pytest.mark.timeout(240)
async def test_sampled_episode_on_the_real_engine(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env, cfg = SearchR1Env(), _env_cfg()
    row = env.build(cfg, "train")[3]
    agent_cfg = AgentConfig(max_turn_tokens=24, max_response_tokens=64, max_prompt_tokens=1024)
    with env.services(cfg) as overrides, launch_embedded(tiny_model_dir, max_running_seqs=4, threads=1,
                                                         startup_timeout_s=180) as engine:
        client = EngineClient([engine.url])
        ctx = AgentContext(engine=client, tokenizer=tok, cfg=agent_cfg, tool_specs=load_tool_specs(cfg.tools),
                           reward_fn=resolve_reward_fn(cfg), env_name="search_r1", tool_overrides=overrides)
        try:
            traj = await run_episode(_sample(row), ctx, "tool_agent")
        finally:
            await client.close()
    n = len(traj.response_ids.numpy())
    assert 0 < n <= agent_cfg.max_response_tokens
    final = [m["content"] for m in traj.messages if m["role"] == "assistant"][-1]
    want = env.reward(final_text=final, ground_truth=row["reward_model"]["ground_truth"],
                      extra_info=row["extra_info"], tool_rewards=[], turn_rewards=[])
    assert traj.reward == want["score"] and traj.metrics["reward/substring_em"] == want["substring_em"]
