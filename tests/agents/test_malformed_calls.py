"""Malformed model output never crashes a loop: each case comes back to the model as text and is counted."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.agents.base import run_episode
from asyncrl.agents.tool_runner import truncate_middle
from asyncrl.tools.base import Tool, ToolError

from .helpers import call, enc, make_ctx, make_sample
from .scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(60)


class BoomTool(Tool):
    name = "boom"
    parameters = {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"]}

    async def execute(self, instance_id, params):
        if params["kind"] == "tool_error":
            raise ToolError("the widget is broken")
        raise RuntimeError("unexpected failure")


class SlowTool(Tool):
    name = "slow"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, instance_id, params):
        await asyncio.sleep(30)
        return "never", 0.0, {}


class LongTool(Tool):
    name = "long"
    parameters = {"type": "object", "properties": {}}

    async def execute(self, instance_id, params):
        return " ".join(f"w{i}" for i in range(300)), 0.5, {"words": 300}


@pytest.fixture(autouse=True)
def test_tools(plugin_registry):
    for cls in (BoomTool, SlowTool, LongTool):
        plugin_registry.add("tool", f"test_{cls.name}", cls)


TOOLS = ["calculator", "test_boom", "test_slow", "test_long"]

CASES = [
    ("invalid_json", '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>',
     'Error: the tool call is not valid JSON of the form {"name": <tool name>, "arguments": {<arguments>}}: '
     '{"name": "calculator", "arguments": {"expression": "1+1"'),
    ("unknown_tool", call("weather", {"city": "Paris"}),
     "Error: unknown tool 'weather'; available tools: boom, calculator, long, slow"),
    ("bad_arguments", call("calculator", {"expr": "1+1"}),
     "Error: bad arguments for calculator: missing required argument 'expression'"),
    ("bad_arguments", call("calculator", {"expression": 11}),
     "Error: bad arguments for calculator: argument 'expression' must be of type string, got int 11"),
    ("tool_error", call("boom", {"kind": "tool_error"}), "Error: the widget is broken"),
    ("tool_error", call("boom", {"kind": "other"}), "Error: boom failed: RuntimeError: unexpected failure"),
    ("tool_error", call("calculator", {"expression": "1/0"}), "Error: division by zero"),
    ("tool_timeout", call("slow", {}), "Error: slow timed out after 0.3 s"),
    ("invalid_json", '<tool_call>{"name": "calculator", "arguments": {"expre', None),  # cut mid-call
]


@pytest.mark.parametrize("kind,text,reply", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
async def test_malformed_call_is_reported_and_counted(tokenizer, kind, text, reply):
    engine = ScriptedEngine(tokenizer, [text, "Answer: 17"])
    if reply is None:  # a generation cut inside the call: no <|im_end|>, so the inserted delta closes the turn
        engine.script[0] = engine.script[0][:-1]
    ctx, _ = make_ctx(tokenizer, engine, tools=TOOLS, tool_timeout_s=0.3)
    traj = await run_episode(make_sample(), ctx, "tool_agent")
    assert traj.finish_reason == "stop" and traj.reward == 1.0
    assert traj.metrics["tool_calls"] == 1 and traj.metrics[kind] == 1
    others = {"invalid_json", "unknown_tool", "bad_arguments", "tool_error", "tool_timeout"} - {kind}
    assert all(k not in traj.metrics for k in others)
    tool_msg = traj.messages[3]
    assert tool_msg["role"] == "tool"
    if reply is not None:
        assert tool_msg["content"] == reply
        delta = enc(tokenizer, f"\n<|im_start|>tool\n{reply}<|im_end|>\n<|im_start|>assistant\n")
    else:
        assert tool_msg["content"].startswith("Error: the tool call is not valid JSON")
        delta = enc(tokenizer, f"<|im_end|>\n<|im_start|>tool\n{tool_msg['content']}<|im_end|>\n<|im_start|>assistant\n")
    g0 = engine.script[0]
    assert traj.response_ids.numpy().tolist() == g0 + delta + engine.script[1]
    assert traj.loss_mask.numpy().tolist() == [1] * len(g0) + [0] * len(delta) + [1] * len(engine.script[1])


async def test_consecutive_invalid_calls_end_the_episode(tokenizer):
    bad = call("nope", {})
    engine = ScriptedEngine(tokenizer, [bad, "<tool_call>{oops}</tool_call>", bad, "Answer: 17"])
    ctx, _ = make_ctx(tokenizer, engine, tools=TOOLS, max_consecutive_invalid_calls=3, max_assistant_turns=8)
    traj = await run_episode(make_sample(), ctx, "tool_agent")
    assert traj.finish_reason == "invalid_calls" and len(engine.calls) == 3
    assert traj.metrics["unknown_tool"] == 2 and traj.metrics["invalid_json"] == 1 and traj.reward == 0.0


async def test_a_valid_call_resets_the_invalid_streak(tokenizer):
    bad, good = call("nope", {}), call("calculator", {"expression": "2+2"})
    engine = ScriptedEngine(tokenizer, [bad, good, bad, "Answer: 17"])
    ctx, _ = make_ctx(tokenizer, engine, tools=TOOLS, max_consecutive_invalid_calls=2, max_assistant_turns=8)
    traj = await run_episode(make_sample(), ctx, "tool_agent")
    assert traj.finish_reason == "stop" and traj.metrics["unknown_tool"] == 2 and traj.metrics["tool_calls"] == 3


async def test_long_tool_output_is_truncated_head_and_tail(tokenizer):
    engine = ScriptedEngine(tokenizer, [call("long", {}), "Answer: 17"])
    ctx, reward = make_ctx(tokenizer, engine, tools=TOOLS, max_tool_response_tokens=10)
    traj = await run_episode(make_sample(), ctx, "tool_agent")
    full = " ".join(f"w{i}" for i in range(300))
    n = len(enc(tokenizer, full))
    content = traj.messages[3]["content"]
    assert content.startswith(tokenizer.decode(enc(tokenizer, full)[:5]))
    assert content.endswith(tokenizer.decode(enc(tokenizer, full)[-5:]))
    assert f"\n...[truncated {n - 10} tokens]...\n" in content
    assert traj.metrics["tool_truncated"] == 1 and traj.metrics["tool/long/words"] == 300
    assert reward.calls[0]["tool_rewards"] == [0.5]


def test_truncate_middle_exact(tokenizer):
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    ids = enc(tokenizer, text)
    assert truncate_middle(text, tokenizer, len(ids)) == (text, 0)
    out, cut = truncate_middle(text, tokenizer, 4)
    assert cut == len(ids) - 4
    assert out == tokenizer.decode(ids[:2]) + f"\n...[truncated {cut} tokens]...\n" + tokenizer.decode(ids[-2:])
    out, cut = truncate_middle(text, tokenizer, 3)
    assert out == tokenizer.decode(ids[:2]) + f"\n...[truncated {len(ids) - 3} tokens]...\n" + tokenizer.decode(ids[-1:])
