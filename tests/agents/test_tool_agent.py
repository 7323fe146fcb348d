"""tool_agent against scripted model outputs: token-by-token accounting, interactions, budgets."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.agents.base import run_episode

from .helpers import call, enc, make_ctx, make_sample
from .scripted_engine import ScriptedEngine, scripted_logprob

pytestmark = pytest.mark.timeout(60)

TOOL_DELTA = "\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"


async def test_two_call_episode_token_by_token(tokenizer):
    t1 = "Let me compute. " + call("calculator", {"expression": "3*4"})
    t2 = call("calculator", {"expression": "12 + 5"})
    t3 = "The result is 17.\nAnswer: 17"
    engine = ScriptedEngine(tokenizer, [t1, t2, t3], versions_by_turn=[3, 4, 4])
    ctx, reward = make_ctx(tokenizer, engine, max_turn_tokens=64, max_response_tokens=400)
    traj = await run_episode(make_sample(), ctx, "tool_agent")

    # the prompt: system with the hermes tool block (SmolLM2's template has no tools support), then the user turn
    prompt_text = tokenizer.decode(traj.prompt_ids.numpy().tolist())
    assert prompt_text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '"name": "calculator"' in prompt_text and "<tool_call>" in prompt_text
    assert prompt_text.endswith("<|im_end|>\n<|im_start|>user\nWhat is 3*4+5?<|im_end|>\n<|im_start|>assistant\n")
    assert traj.prompt_ids.numpy().tolist() == enc(tokenizer, prompt_text)

    g = [engine.script[k] for k in range(3)]
    d1, d2 = enc(tokenizer, TOOL_DELTA.format("12")), enc(tokenizer, TOOL_DELTA.format("17"))
    expected = g[0] + d1 + g[1] + d2 + g[2]
    assert traj.response_ids.numpy().tolist() == expected
    assert traj.loss_mask.numpy().tolist() == [1] * len(g[0]) + [0] * len(d1) + [1] * len(g[1]) + [0] * len(d2) + [1] * len(g[2])
    lp = [scripted_logprob(0, i) for i in range(len(g[0]))] + [0.0] * len(d1) + \
         [scripted_logprob(1, i) for i in range(len(g[1]))] + [0.0] * len(d2) + [scripted_logprob(2, i) for i in range(len(g[2]))]
    np.testing.assert_array_equal(traj.behavior_logprobs.numpy(), np.asarray(lp, dtype=np.float32))
    assert traj.versions.numpy().tolist() == [3] * len(g[0]) + [-1] * len(d1) + [4] * len(g[1]) + [-1] * len(d2) + [4] * len(g[2])
    assert traj.min_version() == 3
    # each turn's <|im_end|> is generated (mask 1); each tool message's own <|im_end|> is inserted (mask 0)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert [m for i, m in zip(expected, traj.loss_mask.numpy().tolist()) if i == im_end] == [1, 0, 1, 0, 1]

    # token in: each request was exactly prompt + response so far, with max_new_tokens = min(turn, remaining)
    prompt = traj.prompt_ids.numpy().tolist()
    offsets = [0, len(g[0]) + len(d1), len(g[0]) + len(d1) + len(g[1]) + len(d2)]
    for k, (ids, sp) in enumerate(engine.calls):
        assert ids == prompt + expected[: offsets[k]]
        assert sp.max_new_tokens == min(64, 400 - offsets[k])
        assert sp.stop_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        assert sp.temperature == 1.0

    assert traj.finish_reason == "stop" and traj.num_turns == 3 and traj.agent == "tool_agent"
    assert (traj.uid, traj.group_id, traj.group_size, traj.data_index, traj.env) == ("g0-0", "g0", 4, 7, "test_env")
    assert traj.metrics["tool_calls"] == 2 and traj.metrics["assistant_turns"] == 3
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert traj.messages[3]["content"] == "12" and traj.messages[5]["content"] == "17"
    assert reward.calls == [dict(final_text="The result is 17.\nAnswer: 17", ground_truth="17", extra_info={},
                                 tool_rewards=[0.0, 0.0], turn_rewards=[])]
    assert traj.reward == 1.0 and traj.metrics["reward/length"] == len("The result is 17.\nAnswer: 17")
    # each call's reward is placed at the last generated token of the turn that made it (its <|im_end|>)
    assert traj.tool_rewards == [0.0, 0.0]
    assert traj.tool_reward_positions == [len(g[0]) - 1, len(g[0]) + len(d1) + len(g[1]) - 1]
    assert traj.turn_rewards == [] and traj.turn_reward_positions == []


async def test_two_calls_in_one_turn_run_in_order(tokenizer):
    t1 = call("calculator", {"expression": "2**10"}) + "\n" + call("calculator", {"expression": "7 // 2"})
    engine = ScriptedEngine(tokenizer, [t1, "Answer: 1027"])
    ctx, _ = make_ctx(tokenizer, engine)
    traj = await run_episode(make_sample(ground_truth="1027"), ctx, "tool_agent")
    g0 = engine.script[0]
    delta = enc(tokenizer, "\n<|im_start|>tool\n1024<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n")
    assert traj.response_ids.numpy().tolist() == g0 + delta + engine.script[1]
    assert traj.metrics["tool_calls"] == 2 and traj.reward == 1.0


async def test_interaction_retry_then_right(tokenizer):
    engine = ScriptedEngine(tokenizer, ["I think it is 16.\nAnswer: 16", "Sorry: 12 + 5 = 17.\nAnswer: 17"])
    ctx, reward = make_ctx(tokenizer, engine, max_user_turns=2)
    sample = make_sample(extra_info={"interaction_kwargs": {"name": "answer_feedback"}})
    traj = await run_episode(sample, ctx, "tool_agent")
    feedback = 'Your answer 16 is incorrect. Check your work and try again. End with a line "Answer: N".'
    d = enc(tokenizer, f"\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n")
    g = engine.script
    assert traj.response_ids.numpy().tolist() == g[0] + d + g[1]
    assert traj.loss_mask.numpy().tolist() == [1] * len(g[0]) + [0] * len(d) + [1] * len(g[1])
    assert traj.turn_rewards == [0.0, 1.0]
    assert traj.turn_reward_positions == [len(g[0]) - 1, len(g[0]) + len(d) + len(g[1]) - 1]
    assert reward.calls[0]["turn_rewards"] == [0.0, 1.0]
    assert traj.finish_reason == "stop" and traj.num_turns == 3 and traj.metrics["user_turns"] == 1
    assert traj.messages[-2] == {"role": "user", "content": feedback}
    assert traj.reward == 1.0


async def test_interaction_stops_at_user_turn_limit(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Answer: 16"])
    ctx, _ = make_ctx(tokenizer, engine, max_user_turns=0)
    sample = make_sample(extra_info={"interaction_kwargs": {"name": "answer_feedback"}})
    traj = await run_episode(sample, ctx, "tool_agent")
    assert traj.finish_reason == "max_turns" and traj.turn_rewards == [0.0] and traj.reward == 0.0
    assert traj.response_ids.numpy().tolist() == engine.script[0]


async def test_token_budget_is_respected(tokenizer):
    long_call = "Thinking " * 10 + call("calculator", {"expression": "1+1"})
    engine = ScriptedEngine(tokenizer, [long_call, "more words " * 40, "x"])
    budget = len(engine.script[0]) + 12 + 20  # room for the tool turn and 20 tokens of the next reply
    ctx, _ = make_ctx(tokenizer, engine, max_turn_tokens=1000, max_response_tokens=budget)
    traj = await run_episode(make_sample(), ctx, "tool_agent")
    n = len(traj.response_ids)
    assert n == budget, (n, budget)
    assert engine.calls[0][1].max_new_tokens == budget
    delta = len(enc(tokenizer, TOOL_DELTA.format("2")))
    assert engine.calls[1][1].max_new_tokens == budget - len(engine.script[0]) - delta
    assert traj.finish_reason == "length" and len(engine.calls) == 2


async def test_tool_turn_that_does_not_fit_is_not_inserted(tokenizer):
    engine = ScriptedEngine(tokenizer, [call("calculator", {"expression": "1+1"})])
    budget = len(engine.script[0]) + 5  # the tool turn needs 11 tokens
    ctx, _ = make_ctx(tokenizer, engine, max_response_tokens=budget)
    traj = await run_episode(make_sample(), ctx, "tool_agent")
    assert traj.response_ids.numpy().tolist() == engine.script[0]
    assert traj.finish_reason == "length" and traj.metrics["tool_calls"] == 1


async def test_per_turn_limit_cuts_generation(tokenizer):
    engine = ScriptedEngine(tokenizer, ["word " * 50])
    ctx, _ = make_ctx(tokenizer, engine, max_turn_tokens=8, max_response_tokens=100)
    traj = await run_episode(make_sample(), ctx, "tool_agent")
    assert len(traj.response_ids) == 8 and traj.loss_mask.numpy().tolist() == [1] * 8
    assert traj.finish_reason == "length"


async def test_assistant_turn_limit(tokenizer):
    c = call("calculator", {"expression": "1+1"})
    engine = ScriptedEngine(tokenizer, [c, c, c])
    ctx, _ = make_ctx(tokenizer, engine, max_assistant_turns=2)
    traj = await run_episode(make_sample(), ctx, "tool_agent")
    assert traj.finish_reason == "max_turns" and len(engine.calls) == 2 and traj.metrics["tool_calls"] == 2
    # the last turn's calls ran (counted) but their results are not appended after the final generation
    assert traj.response_ids.numpy().tolist()[-len(engine.script[1]):] == engine.script[1]


async def test_agent_name_column_overrides_default(tokenizer):
    engine = ScriptedEngine(tokenizer, ["Answer: 17"])
    ctx, _ = make_ctx(tokenizer, engine)
    traj = await run_episode(make_sample(agent_name="single_turn"), ctx, "tool_agent")
    assert traj.agent == "single_turn" and traj.reward == 1.0 and traj.response_ids.numpy().tolist() == engine.script[0]
    with pytest.raises(LookupError, match="unknown agent 'nope'"):
        await run_episode(make_sample(agent_name="nope"), ctx, "tool_agent")


async def test_prompt_too_long_fails_loudly(tokenizer):
    engine = ScriptedEngine(tokenizer, ["x"])
    ctx, _ = make_ctx(tokenizer, engine, max_prompt_tokens=20)
    with pytest.raises(ValueError, match="max_prompt_tokens=20"):
        await run_episode(make_sample(), ctx, "tool_agent")
