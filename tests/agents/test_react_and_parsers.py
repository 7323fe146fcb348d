"""ReAct loop and the tool-call parsers."""

from __future__ import annotations

import pytest

from asyncrl.agents.base import run_episode
from asyncrl.agents.parsers import HermesParser, ReactParser, get_parser

from .helpers import enc, make_ctx, make_sample
from .scripted_engine import ScriptedEngine, scripted_logprob

pytestmark = pytest.mark.timeout(60)


def test_hermes_parser_cases():
    p = get_parser("hermes")
    r = p.parse('Hi <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> mid '
                '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert r.content == "Hi  mid" and [(c.name, c.arguments, c.error) for c in r.calls] == [("a", {"x": 1}, None), ("b", {"y": 2}, None)]
    assert [c.error for c in p.parse("<tool_call>[1, 2]</tool_call>").calls] == ["invalid_json"]
    assert [c.error for c in p.parse('<tool_call>{"name": "a", "arguments": 3}</tool_call>').calls] == ["invalid_json"]
    cut = p.parse('ok <tool_call>{"name": "a", "argu')
    assert cut.content == "ok" and cut.calls[0].error == "invalid_json" and cut.calls[0].raw == '{"name": "a", "argu'
    assert HermesParser().parse("no calls here").calls == []


def test_react_parser_cases():
    p = ReactParser()
    r = p.parse('Thought: add\nAction: calculator\nAction Input: {"expression": "2+3"}\nObservation: 5')
    assert (r.calls[0].name, r.calls[0].arguments, r.final_answer) == ("calculator", {"expression": "2+3"}, None)
    assert r.content == "Thought: add"
    r = p.parse("Thought: I know it.\nFinal Answer: 5")
    assert r.final_answer == "5" and r.calls == []
    r = p.parse("Action: calculator\nAction Input: 2+3")
    assert r.calls[0].error == "invalid_json" and r.calls[0].raw == "2+3"
    assert p.parse("Action: search").calls[0].arguments == {}
    assert p.parse("just chatting").calls == [] and p.parse("just chatting").final_answer is None


async def test_react_episode_trims_hallucinated_observation(tokenizer):
    t1 = 'Thought: I should add.\nAction: calculator\nAction Input: {"expression": "2+3"}\nObservation: 999 fake'
    t2 = "Thought: I know it.\nFinal Answer: 5"
    engine = ScriptedEngine(tokenizer, [t1, t2], versions_by_turn=[0, 1])
    ctx, reward = make_ctx(tokenizer, engine, max_user_turns=0)
    traj = await run_episode(make_sample(question="What is 2+3?", ground_truth="5"), ctx, "react")

    prompt_text = tokenizer.decode(traj.prompt_ids.numpy().tolist())
    assert "Action Input: the tool's arguments as a JSON object" in prompt_text and "- calculator:" in prompt_text
    assert "<tools>" not in prompt_text  # no hermes block for the text format

    g1 = engine.script[0]
    pos = t1.index("Observation:")
    kept = max(k for k in range(len(g1) + 1) if len(tokenizer.decode(g1[:k])) <= pos)
    assert tokenizer.decode(g1[:kept]).endswith('{"expression": "2+3"}\n')
    obs = enc(tokenizer, "Observation: 5\n")
    g2 = engine.script[1]
    assert traj.response_ids.numpy().tolist() == g1[:kept] + obs + g2
    assert traj.loss_mask.numpy().tolist() == [1] * kept + [0] * len(obs) + [1] * len(g2)
    assert traj.behavior_logprobs.numpy().tolist()[:kept] == pytest.approx([scripted_logprob(0, i) for i in range(kept)])
    assert traj.versions.numpy().tolist() == [0] * kept + [-1] * len(obs) + [1] * len(g2)
    assert engine.calls[1][0] == traj.prompt_ids.numpy().tolist() + g1[:kept] + obs
    assert traj.metrics["observation_trimmed"] == 1 and traj.metrics["generated_tokens"] == kept + len(g2)
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    assert reward.calls[0]["final_text"] == t2


async def test_react_closed_message_observes_as_user_turn_and_bare_input(tokenizer):
    t1 = "Thought: multiply.\nAction: calculator\nAction Input: 6*7"
    engine = ScriptedEngine(tokenizer, [t1, "Final Answer: 42"])
    ctx, _ = make_ctx(tokenizer, engine)
    traj = await run_episode(make_sample(question="6*7?", ground_truth="42"), ctx, "react")
    d = enc(tokenizer, "\n<|im_start|>user\nObservation: 42<|im_end|>\n<|im_start|>assistant\n")
    assert traj.response_ids.numpy().tolist() == engine.script[0] + d + engine.script[1]
    assert traj.metrics["tool_calls"] == 1 and "bad_arguments" not in traj.metrics and traj.reward == 1.0


async def test_react_unknown_tool_and_no_action(tokenizer):
    engine = ScriptedEngine(tokenizer, ['Action: weather\nAction Input: {"city": "Oslo"}', "I give up."])
    ctx, _ = make_ctx(tokenizer, engine)
    traj = await run_episode(make_sample(), ctx, "react")
    assert traj.metrics["unknown_tool"] == 1 and traj.finish_reason == "stop" and traj.reward == 0.0
    assert traj.messages[-1]["content"] == "I give up."
