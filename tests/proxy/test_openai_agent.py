"""agent=openai_agent end to end within one rollout context: the user's agent (a registered function or
an external command) drives the real proxy and the real engine; rewards, failures and isolation."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import openai
import pytest

from asyncrl.agents.base import AgentContext, run_episode, run_episode_chains
from asyncrl.agents.openai_agent import OpenAIAgentError, stop_proxy
from asyncrl.config import OpenAIAgentConfig
from asyncrl.data.schema import NonFiniteRewardError
from asyncrl.envs.base import Sample
from tests.agents.helpers import RecordingReward

from .conftest import agent_cfg

CMD_AGENT = str(Path(__file__).with_name("cmd_agent.py"))


def sample(uid: str = "g0-0", question: str = "What is 3*4+5?") -> Sample:
    return Sample(uid=uid, group_id=uid.split("-")[0], group_size=2, sample_index=int(uid.split("-")[1]), data_index=3,
                  messages=[{"role": "user", "content": question}], ground_truth="17")


@pytest.fixture
async def make_ctx(client_engine, proxy_tokenizer):
    made: list[AgentContext] = []

    def make(**openai_kw) -> AgentContext:
        ctx = AgentContext(engine=client_engine, tokenizer=proxy_tokenizer,
                           cfg=agent_cfg(openai=OpenAIAgentConfig(**openai_kw)), tool_specs=[],
                           reward_fn=RecordingReward(), env_name="test_env")
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        await stop_proxy(ctx)


async def two_turns(client: openai.AsyncOpenAI, s: Sample) -> float:
    msgs = list(s.messages)
    r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    msgs += [r.choices[0].message.model_dump(), {"role": "user", "content": f"Sure? ({s.uid})"}]
    await client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    return 0.5


async def test_returned_reward_and_merged_turns_reach_the_trajectory(plugin_registry, make_ctx):
    plugin_registry.add("openai_agent_fn", "two_turns", two_turns)
    traj = await run_episode(sample(), make_ctx(function="two_turns"), "openai_agent")
    assert traj.reward == 0.5 and traj.agent == "openai_agent" and traj.uid == "g0-0"
    assert traj.metrics["proxy/calls"] == 2 and traj.metrics["proxy/calls_merged"] == 1
    assert traj.metrics["proxy/chains"] == 1 and traj.metrics["proxy/reward_returned"] == 1
    assert traj.metrics["proxy/messages_mapped"] == 1
    assert traj.num_turns == 2 and traj.loss_mask.numpy().sum() == traj.metrics["generated_tokens"] > 0


async def test_set_reward_per_episode_and_per_completion(plugin_registry, make_ctx):
    async def agent(client: openai.AsyncOpenAI, s: Sample) -> None:
        r = await client.chat.completions.create(model="policy", messages=s.messages, max_tokens=4)
        url = str(client.base_url).removesuffix("/").removesuffix("/v1") + "/rl/set_reward"
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {client.api_key}"}) as h:
            assert (await h.post(url, json={"reward": 0.75})).status_code == 200
            assert (await h.post(url, json={"reward": -1.0, "completion_id": r.id})).status_code == 200
            other = await h.post(url, json={"reward": 1.0, "completion_id": "chatcmpl-other"})
            assert other.status_code == 400 and other.json()["error"]["param"] == "completion_id"
            nan = await h.post(url, content=b'{"reward": NaN}')
            assert nan.status_code == 400 and "finite" in nan.json()["error"]["message"]
            for huge in (1e308, -1000000.5):  # beyond env.reward.max_abs (1e6 by default): refused, not kept
                far = await h.post(url, json={"reward": huge})
                assert far.status_code == 400 and far.json()["error"]["param"] == "reward", far.text
                assert "must be in [-1000000.0, 1000000.0]" in far.json()["error"]["message"], far.text
            anon = await h.post(url, json={"reward": 1.0}, headers={"Authorization": "Bearer sk-wrong"})
            assert anon.status_code == 401

    plugin_registry.add("openai_agent_fn", "setter", agent)
    traj = await run_episode(sample(), make_ctx(function="setter"), "openai_agent")
    assert traj.reward == -1.0 and traj.metrics["proxy/reward_set"] == 1  # the completion's reward wins for its chain


async def test_a_returned_reward_beyond_the_bound_fails_the_episode_naming_how_it_came(plugin_registry, make_ctx):
    async def runaway(client: openai.AsyncOpenAI, s: Sample) -> float:
        await client.chat.completions.create(model="policy", messages=s.messages, max_tokens=4)
        return 1.7e308

    plugin_registry.add("openai_agent_fn", "runaway", runaway)
    with pytest.raises(NonFiniteRewardError, match=r"openai_agent: the reward \(returned, for g0-0\) returned "
                                                   r"1.7e\+308, beyond env.reward.max_abs=1e\+06"):
        await run_episode(sample(), make_ctx(function="runaway"), "openai_agent")


async def test_env_reward_scores_the_last_reply_when_the_agent_gives_none(plugin_registry, make_ctx):
    async def agent(client, s):
        await client.chat.completions.create(model="policy", messages=s.messages, max_tokens=4)

    plugin_registry.add("openai_agent_fn", "silent", agent)
    ctx = make_ctx(function="silent")
    traj = await run_episode(sample(), ctx, "openai_agent")
    (call,) = ctx.reward_fn.calls
    assert call["final_text"] == traj.messages[-1]["content"] and call["ground_truth"] == "17"
    assert traj.metrics["proxy/reward_env"] == 1 and traj.reward == 0.0


async def test_external_command_agent_trains_through_openai_base_url(make_ctx):
    ctx = make_ctx(command=[sys.executable, CMD_AGENT, "two_turns"])
    traj = await run_episode(sample(), ctx, "openai_agent")
    assert traj.reward == 0.25 and traj.metrics["proxy/calls"] == 2 and traj.metrics["proxy/chains"] == 1
    with pytest.raises(OpenAIAgentError, match="exited with 1: agent gave up: no answer"):
        await run_episode(sample(), make_ctx(command=[sys.executable, CMD_AGENT, "fail"]), "openai_agent")


async def test_an_agent_with_two_threads_yields_every_chain_in_its_episode_group(plugin_registry, make_ctx):
    async def two_threads(client: openai.AsyncOpenAI, s: Sample) -> float:
        await client.chat.completions.create(model="policy", messages=s.messages, max_tokens=4)
        other = [{"role": "user", "content": "A different question: 2+2?"}]  # not an extension: a new chain
        await client.chat.completions.create(model="policy", messages=other, max_tokens=4)
        return 1.0

    plugin_registry.add("openai_agent_fn", "two_threads", two_threads)
    chains = await run_episode_chains(sample("g0-1"), make_ctx(function="two_threads"), "openai_agent")
    assert [t.uid for t in chains] == ["g0-1", "g0-1-c1"]
    assert {(t.group_id, t.sample_index, t.episode_chains) for t in chains} == {("g0", 1, 2)}
    assert chains[0].messages[0]["content"] == "A different question: 2+2?"  # the chain of the last call first
    assert chains[1].messages[0]["content"] == "What is 3*4+5?"
    assert all(t.reward == 1.0 and t.loss_mask.numpy().sum() > 0 for t in chains)
    assert chains[0].metrics["proxy/chains"] == 2


async def test_command_timeout_kills_its_process_group(make_ctx, tmp_path):
    pidfile = tmp_path / "child.pid"
    ctx = make_ctx(command=["sh", "-c", f"sleep 1000 & echo $! > {pidfile}; wait"], timeout_s=3.0)
    with pytest.raises(OpenAIAgentError, match="did not finish within agent.openai.timeout_s=3.0"):
        await run_episode(sample(), ctx, "openai_agent")
    pid = int(pidfile.read_text())
    for _ in range(500):  # the kill is SIGKILL to the group; reaping by init may lag
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError(f"the agent command's child {pid} outlived the episode's timeout")


async def test_misbehaving_agents_fail_only_their_own_episode_and_concurrent_episodes_never_mix(plugin_registry,
                                                                                                  make_ctx):
    async def raises(client, s):
        await client.chat.completions.create(model="policy", messages=s.messages, max_tokens=2)
        raise ValueError("agent bug")

    async def hangs(client, s):
        await asyncio.Event().wait()

    async def no_calls(client, s):
        return 1.0

    async def garbage(client, s):
        await client.chat.completions.create(model="policy", messages=s.messages, max_tokens=2)
        return "great"

    for name, fn in [("raises", raises), ("hangs", hangs), ("no_calls", no_calls), ("garbage", garbage),
                     ("two_turns", two_turns)]:
        plugin_registry.add("openai_agent_fn", name, fn)
    ctxs = {name: make_ctx(function=name, timeout_s=5.0) for name in ("raises", "hangs", "no_calls", "garbage")}
    good = make_ctx(function="two_turns")
    questions = {f"g{k}-{j}": f"Question {k}.{j}: what is {k}+{j}?" for k in range(2) for j in range(2)}
    results = await asyncio.gather(*(run_episode(sample(name_uid, q), good, "openai_agent")
                                     for name_uid, q in questions.items()),
                                   *(run_episode(sample(f"g9-{k}"), ctx, "openai_agent")
                                     for k, ctx in enumerate(ctxs.values())), return_exceptions=True)
    good_trajs, bad = results[:4], dict(zip(ctxs, results[4:]))
    for (uid, q), t in zip(questions.items(), good_trajs):
        assert not isinstance(t, BaseException), t
        assert t.uid == uid and t.metrics["proxy/chains"] == 1 and t.metrics["proxy/calls"] == 2
        assert t.messages[0]["content"] == q and t.messages[2]["content"] == f"Sure? ({uid})"
    assert isinstance(bad["raises"], OpenAIAgentError) and "agent bug" in str(bad["raises"])
    assert isinstance(bad["hangs"], OpenAIAgentError) and "timeout_s=5.0" in str(bad["hangs"])
    assert isinstance(bad["no_calls"], OpenAIAgentError) and "no call" in str(bad["no_calls"])
    assert isinstance(bad["garbage"], OpenAIAgentError) and "'great'" in str(bad["garbage"])


async def test_config_needs_exactly_one_agent(plugin_registry, make_ctx, proxy_tokenizer):
    from asyncrl.agents.openai_agent import OpenAIAgent

    for kw, msg in [({}, "exactly one"), ({"function": "f", "command": ["x"]}, "exactly one"),
                    ({"function": "nope"}, "unknown openai_agent_fn 'nope'"), ({"command": []}, "non-empty")]:
        ctx = make_ctx(**kw)
        with pytest.raises(Exception, match=msg):
            OpenAIAgent().chat_format(proxy_tokenizer, ctx.cfg, [])
