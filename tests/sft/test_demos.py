"""Demonstrations of the built-in envs, played through the real tool_agent with real tools and rewards."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl import cli
from asyncrl.agents.base import AgentContext
from asyncrl.agents.tool_calls import ToolFormatError, parser_for_template, resolve_parser
from asyncrl.config import load_config
from asyncrl.envs.base import DemoCall, DemoTurn, resolve_env
from asyncrl.sft.demos import make_demos, render_turn

pytestmark = pytest.mark.timeout(120)

TEMPLATES = Path(__file__).parents[1] / "agents" / "chat_templates"


def _setup(env_name, tokenizer, **env_kw):
    cfg = load_config([f"env={env_name}", *[f"env.{k}={v}" for k, v in env_kw.items()]])
    return cfg, resolve_env(env_name)


async def test_arithmetic_demos_earn_full_reward_with_the_calculators_real_result(tokenizer):
    cfg, env = _setup("arithmetic", tokenizer, num_train=24, num_val=4)
    rows = env.build(cfg.env, "train")
    ctx = AgentContext.for_config(cfg, None, tokenizer)
    report = await make_demos(ctx, env, list(enumerate(rows)))
    assert not report.rejected and len(report.rows) == 24
    for demo in report.rows:
        row = rows[demo["data_index"]]
        msgs = demo["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
        call = msgs[1]["tool_calls"][0]["function"]
        assert call["name"] == "calculator"
        expr = json.loads(call["arguments"])["expression"]
        assert expr == row["extra_info"]["expression"]
        # checked apart from the code under test: python's own arithmetic and the env's reward
        assert float(msgs[2]["content"]) == eval(expr, {"__builtins__": {}})  # noqa: S307 (our own expression)
        gt = row["reward_model"]["ground_truth"]
        assert env.reward(final_text=msgs[3]["content"], ground_truth=gt, extra_info={}, tool_rewards=[],
                          turn_rewards=[])["score"] == 1.0
        # the agent loop's own record holds the call in the model's format (agent.tool_parser's: hermes here)
        assert demo["agent_messages"][2]["content"] == resolve_parser("hermes").render(
            "I will compute it with the calculator.", [DemoCall("calculator", {"expression": expr})])
        assert demo["tools"][0]["function"]["name"] == "calculator"


async def test_bad_rows_are_named_with_the_reason(tokenizer):
    cfg, env = _setup("arithmetic", tokenizer, num_train=3, num_val=2)
    rows = env.build(cfg.env, "train")
    no_expr = copy.deepcopy(rows[0])
    del no_expr["extra_info"]["expression"]
    wrong_truth = copy.deepcopy(rows[1])
    wrong_truth["reward_model"]["ground_truth"] = "99999"
    ctx = AgentContext.for_config(cfg, None, tokenizer)
    report = await make_demos(ctx, env, [(0, no_expr), (1, wrong_truth), (2, rows[2])])
    reasons = dict(report.rejected)
    assert [d["data_index"] for d in report.rows] == [2]
    assert "no extra_info.expression" in reasons[0]
    assert "calculator returned" in reasons[1] and "99999" in reasons[1]


async def test_a_turn_over_the_agents_budget_is_a_rejection_not_a_cut_demo(tokenizer):
    cfg = load_config(["env=arithmetic", "env.num_train=2", "env.num_val=2", "agent.max_turn_tokens=8"])
    env = resolve_env("arithmetic")
    ctx = AgentContext.for_config(cfg, None, tokenizer)
    report = await make_demos(ctx, env, list(enumerate(env.build(cfg.env, "train"))))
    assert not report.rows and all("over the turn's budget of 8" in why for _, why in report.rejected)


async def test_search_r1_demos_search_each_hop_on_the_real_retriever(tokenizer):
    cfg, env = _setup("search_r1", tokenizer, num_train=12, num_val=4)
    rows = env.build(cfg.env, "train")
    with env.services(cfg.env) as overrides:
        ctx = AgentContext.for_config(cfg, None, tokenizer, overrides)
        report = await make_demos(ctx, env, list(enumerate(rows)))
    assert not report.rejected and len(report.rows) == 12
    for demo in report.rows:
        row = rows[demo["data_index"]]
        hops = row["extra_info"]["hops"]
        calls = [json.loads(m["tool_calls"][0]["function"]["arguments"])["query"]
                 for m in demo["messages"] if m.get("tool_calls")]
        results = [m["content"] for m in demo["messages"] if m["role"] == "tool"]
        assert calls == list(hops) and all(h in r for h, r in zip(hops, results))
        final = demo["messages"][-1]["content"]
        assert final == f"<answer> {row['reward_model']['ground_truth']['target'][0]} </answer>"


def test_render_turn_writes_each_parsers_own_format_and_refuses_what_it_cannot_write():
    turn = DemoTurn("x", [DemoCall("calculator", {"expression": "1+1"})])
    assert render_turn(turn, "hermes") == 'x\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    for name in ("qwen3", "llama3_json", "mistral", "deepseek_v3", "react"):
        text = render_turn(turn, name)
        assert text == resolve_parser(name).render("x", turn.tool_calls)  # the parser's render, not a copy of it
        assert [(c.name, c.arguments) for c in resolve_parser(name).parse(text).calls] == [("calculator", {"expression": "1+1"})]
    assert "<tool_call>" not in render_turn(turn, "mistral")
    with pytest.raises(ToolFormatError, match="'react' writes one call a turn"):
        render_turn(DemoTurn("", turn.tool_calls * 2), "react")


# parser -> the chat template of its family (tests/agents/chat_templates), swapped onto the tests' tokenizer
FAMILY_TEMPLATES = {"qwen3": "qwen3", "llama3_json": "llama3_1", "mistral": "mistral_v11", "deepseek_v3": "deepseek_v3"}


@pytest.mark.parametrize("parser", sorted(FAMILY_TEMPLATES))
async def test_demos_in_a_non_hermes_format_on_its_familys_template_play_and_render_to_the_loops_tokens(tokenizer,
                                                                                                      parser):
    """agent.tool_parser=<non-hermes>: the demonstrations are written in that format (by its parser), the agent
    loop parses and runs them (full reward), and SFT renders each to exactly the tokens the loop produced."""
    from asyncrl.sft.conversations import check_row, render_conversation

    saved = tokenizer.chat_template
    tokenizer.chat_template = (TEMPLATES / f"{FAMILY_TEMPLATES[parser]}.jinja").read_text()
    try:
        assert parser_for_template(tokenizer.chat_template) == parser
        cfg, env = _setup("arithmetic", tokenizer, num_train=4, num_val=2)
        cfg.agent.tool_parser = parser
        rows = env.build(cfg.env, "train")
        report = await make_demos(AgentContext.for_config(cfg, None, tokenizer), env, list(enumerate(rows)))
        assert not report.rejected and len(report.rows) == 4, report.rejected
        for demo in report.rows:
            expr = rows[demo["data_index"]]["extra_info"]["expression"]
            said = demo["agent_messages"][2]["content"]  # the first assistant turn, as the model "wrote" it
            assert said == resolve_parser(parser).render("I will compute it with the calculator.",
                                                         [DemoCall("calculator", {"expression": expr})]), said
            assert "<tool_call>" not in said or parser == "qwen3"
            played = report.trajectories[demo["data_index"]]
            rendered = render_conversation(tokenizer, cfg.agent, check_row(json.loads(json.dumps(demo)), 0))
            for name in ("prompt_ids", "response_ids", "loss_mask"):
                assert getattr(rendered, name).numpy().tolist() == getattr(played, name).numpy().tolist(), name
            ids, mask = rendered.response_ids.numpy().tolist(), rendered.loss_mask.numpy().tolist()
            first = tokenizer.decode([t for t, m in zip(ids, mask) if m][: len(tokenizer.encode(said))])
            assert first == said  # the loss is on the call as the format writes it
    finally:
        tokenizer.chat_template = saved


def test_demos_cli_writes_the_file(tmp_path, capsys):
    r = subprocess.run([sys.executable, "-m", "asyncrl.cli", "data", "arithmetic", "--demos", "--out", str(tmp_path),
                        "--limit", "5", "--num-val", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["demos"] == 5 and summary["rejected"] == 0
    lines = (tmp_path / "demos-train.jsonl").read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(x)["reward"] == 1.0 for x in lines)
    assert cli.main(["data", "arithmetic", "--demos", "--out", str(tmp_path), "--limit", "0"]) == 2
    assert "--limit must be >= 1" in capsys.readouterr().err
