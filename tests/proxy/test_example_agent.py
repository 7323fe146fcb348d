"""examples/openai_agent: agent.py (loaded as a plugin the way `plugins=[...]` loads it, and as a command)
solves a scripted episode through the proxy: a calculator call, its result, the answer; search_r1_agent.py
searches the search_r1 env's real retrieval server. The env's reward scores them."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from asyncrl.agents.base import AgentContext, run_episode
from asyncrl.agents.openai_agent import stop_proxy
from asyncrl.config import EnvConfig, OpenAIAgentConfig, ToolSpec
from asyncrl.envs.base import Sample, resolve_env, resolve_reward_fn
from asyncrl.envs.search_r1.env import SearchR1Env
from tests.agents.scripted_engine import ScriptedEngine

from .conftest import agent_cfg

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai_agent" / "agent.py"
SEARCH_R1 = EXAMPLE.with_name("search_r1_agent.py")
LANGGRAPH = EXAMPLE.with_name("langgraph_agent.py")


def arithmetic_sample() -> Sample:
    return Sample(uid="g0-0", group_id="g0", group_size=1, sample_index=0, data_index=0,
                  messages=[{"role": "user", "content": "What is 3*4+5? Finish with a line \"Answer: N\"."}],
                  ground_truth="17")


def scripted(tok) -> ScriptedEngine:
    return ScriptedEngine(tok, ['<tool_call>{"name": "calculator", "arguments": {"expression": "3*4+5"}}</tool_call>',
                                "3*4+5 = 17.\nAnswer: 17"])


def arithmetic_ctx(engine: ScriptedEngine, tokenizer, **openai_kw) -> AgentContext:
    """The arithmetic env's context for `agent=openai_agent` with the agent `openai_kw` names."""
    return AgentContext(engine=engine, tokenizer=tokenizer, tool_specs=[], env_name="arithmetic",
                        cfg=agent_cfg(max_turn_tokens=64, openai=OpenAIAgentConfig(**openai_kw)),
                        reward_fn=resolve_env("arithmetic").reward)


async def run_with(ctx: AgentContext, sample: Sample | None = None):
    try:
        return await run_episode(sample or arithmetic_sample(), ctx, "openai_agent")
    finally:
        await stop_proxy(ctx)


async def test_example_function_agent_calls_the_calculator_and_is_rewarded(plugin_registry, proxy_tokenizer):
    plugin_registry.load_source(str(EXAMPLE))
    engine = scripted(proxy_tokenizer)
    ctx = arithmetic_ctx(engine, proxy_tokenizer, function="arithmetic_calculator")
    traj = await run_with(ctx)
    assert traj.reward == 1.0 and traj.metrics["proxy/tool_calls"] == 1 and traj.metrics["proxy/chains"] == 1
    tool_turn = proxy_tokenizer.decode(engine.calls[1][0][len(engine.calls[0][0]):])
    assert "<|im_start|>tool\n17<|im_end|>" in tool_turn  # the example's calculator answered the model's call


async def test_langgraph_react_agent_trains_through_the_proxy_unchanged(plugin_registry, proxy_tokenizer):
    plugin_registry.load_source(str(LANGGRAPH))
    engine = scripted(proxy_tokenizer)
    ctx = arithmetic_ctx(engine, proxy_tokenizer, function="arithmetic_langgraph")
    traj = await run_with(ctx)
    # LangGraph sent its history back as received: one trajectory, two calls merged, the tool ran
    assert traj.reward == 1.0 and traj.metrics["proxy/tool_calls"] == 1 and traj.metrics["proxy/chains"] == 1
    assert traj.metrics["proxy/calls"] == 2 and traj.metrics["proxy/calls_merged"] == 1
    tool_turn = proxy_tokenizer.decode(engine.calls[1][0][len(engine.calls[0][0]):])
    assert "<|im_start|>tool\n17<|im_end|>" in tool_turn  # LangGraph's calculator tool answered the model's call


async def test_example_as_external_command(proxy_tokenizer):
    engine = scripted(proxy_tokenizer)
    ctx = arithmetic_ctx(engine, proxy_tokenizer, command=[sys.executable, str(EXAMPLE)])
    traj = await run_with(ctx)
    assert traj.reward == 1.0 and traj.metrics["proxy/calls"] == 2


async def test_search_r1_example_searches_the_envs_retrieval_server(proxy_tokenizer):
    env, cfg = SearchR1Env(), replace(EnvConfig(), name="search_r1", num_train=16, num_val=4, seed=11,
                                      tools=[ToolSpec(class_name="search")])
    row = env.build(cfg, "val")[0]
    first, bridge = row["extra_info"]["hops"]
    answer = row["reward_model"]["ground_truth"]["target"][0]
    call = "<tool_call>" + json.dumps({"name": "search", "arguments": {"query": first}}) + "</tool_call>"
    engine = ScriptedEngine(proxy_tokenizer, [call, f"<answer> {answer} </answer>"])
    with env.services(cfg) as overrides:
        ctx = AgentContext(engine=engine, tokenizer=proxy_tokenizer, tool_specs=[], env_name="search_r1",
                           cfg=agent_cfg(max_turn_tokens=64, max_response_tokens=700, max_prompt_tokens=1024,
                                         openai=OpenAIAgentConfig(command=[sys.executable, str(SEARCH_R1)])),
                           reward_fn=resolve_reward_fn(cfg), tool_overrides=overrides)
        traj = await run_with(ctx, Sample.from_row(row, data_index=0, group_id="g0", sample_index=0, group_size=1))
    assert traj.reward == 1.0 and traj.metrics["proxy/tool_calls"] == 1 and traj.metrics["proxy/chains"] == 1
    tool_turn = proxy_tokenizer.decode(engine.calls[1][0][len(engine.calls[0][0]):])
    assert tool_turn.count("Doc 1:") == 1 and bridge in tool_turn  # the retrieval server's passages came back
