"""Demonstrations: solved multi-turn episodes of a built-in env, produced by its own agent loop and checked.

An env that can solve its rows says how (`Env.demo_turns(row) -> list[DemoTurn]`: each assistant turn's
text and tool calls; arithmetic: one calculator call with the problem's expression, then "Answer: N";
search_r1: one search per hop, then `<answer> X </answer>`). `make_demos` does not write those turns out as
they are: it plays them through the real agent loop (tool_agent) with `TeacherEngine` standing in for the
model, so the tools really run (the calculator computes, the retrieval server answers), the conversation has
exactly the shape and tool-call format the agent loop produces and parses at RL time (each turn written by the
configured parser's `render`: agent.tool_parser), and the env's own
reward function scores it. A demonstration is kept only when it earns the full reward (1.0) and ran every
scripted turn; every other row is reported with the reason (`DemoReport`).

Each demonstration row (JSONL, the shape `asyncrl sft` reads): `messages` in OpenAI's chat shape (assistant
`tool_calls` as {"type": "function", "function": {"name", "arguments": JSON text}}, tool replies as
{"role": "tool", "name", "content"}), `tools` (the OpenAI tool schemas the agent offered), `data_source`,
`data_index`, `reward`, and `agent_messages` (the conversation exactly as the agent loop recorded it, tool
calls as text in the model's format, agent.tool_parser's).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from asyncrl.agents.chat import ChatFormat
from asyncrl.agents.tool_calls import renderer
from asyncrl.engine.base import GenerateResult, SamplingParams
from asyncrl.envs.base import DemoError, DemoTurn, Sample
from asyncrl.models import load_tokenizer


def render_turn(turn: DemoTurn, parser: Any, tokenizer: Any = None) -> str:
    """The turn as the model writes it in the tool-call format of `parser`: a parser (`renderer`), or an
    agent.tool_parser name resolved with `tokenizer` (for auto). The parser's own `render` writes it: the format
    has one owner (asyncrl/agents/tool_calls.py); a format that cannot write the turn is a ToolFormatError."""
    if isinstance(parser, str):
        parser = renderer(parser, tokenizer)
    return parser.render(turn.content, turn.tool_calls)


class TeacherEngine:
    """A Generator that answers each episode (by session id) with its scripted turns, in order.

    It stands in for the model while a demonstration is played through the agent loop: every reply is the
    next turn's text tokenized with the run's tokenizer plus the chat's stop token, logprob 0 and version 0.
    A request past the end of a script is an error (the agent wanted more turns than the demonstration has)."""

    def __init__(self, tokenizer: Any, stop_token_id: int):
        self.tok, self.stop = tokenizer, stop_token_id
        self.scripts: dict[str, list[str]] = {}

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: Optional[str] = None,
                       session_id: Optional[str] = None) -> GenerateResult:
        script = self.scripts.get(session_id or "")
        if not script:
            raise DemoError(f"episode {session_id}: the agent asked for a turn past the demonstration's end")
        ids = self.tok.encode(script.pop(0), add_special_tokens=False) + [self.stop]
        if len(ids) > sampling.max_new_tokens:
            raise DemoError(f"episode {session_id}: a demonstration turn of {len(ids)} tokens is over the turn's "
                            f"budget of {sampling.max_new_tokens} (agent.max_turn_tokens / max_response_tokens)")
        return GenerateResult(output_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                              finish_reason="stop", weight_version=0)


def openai_messages(prompt: list[dict[str, Any]], agent_messages: list[dict[str, Any]],
                    turns: list[DemoTurn]) -> list[dict[str, Any]]:
    """The row's prompt messages as given (the agent's system message with its rendered tool block is left to
    whoever renders `tools`), then the agent loop's conversation from its first assistant turn, each assistant
    turn's calls as structured `tool_calls`."""
    first = next((j for j, m in enumerate(agent_messages) if m.get("role") == "assistant"), len(agent_messages))
    out, k = [dict(m) for m in prompt], 0
    for m in agent_messages[first:]:
        if m.get("role") == "assistant" and k < len(turns):
            t = turns[k]
            k += 1
            msg: dict[str, Any] = {"role": "assistant", "content": t.content}
            if t.tool_calls:
                msg["tool_calls"] = [{"type": "function", "function": {"name": c.name,
                                                                       "arguments": json.dumps(c.arguments)}}
                                     for c in t.tool_calls]
            out.append(msg)
        else:
            out.append({k2: v for k2, v in m.items() if k2 in ("role", "content", "name")})
    return out


@dataclass
class DemoReport:
    rows: list[dict[str, Any]] = field(default_factory=list)  # the demonstrations kept
    trajectories: dict[int, Any] = field(default_factory=dict)  # data_index -> the agent loop's Trajectory
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (data_index, why)


async def make_demos(ctx: Any, env: Any, rows: list[tuple[int, dict[str, Any]]], agent: str = "tool_agent",
                     concurrency: int = 8) -> DemoReport:
    """Play each row's demonstration through `agent` over a TeacherEngine (see the module docstring).
    `ctx`: an AgentContext whose tools and reward are the env's; its engine is replaced here."""
    # lazy: imports omegaconf, which this module does not load otherwise
    from asyncrl.agents.base import run_episode

    writer = renderer(ctx.cfg.tool_parser, ctx.tokenizer)  # a parser that cannot render fails here, before any row
    stop = ChatFormat(ctx.tokenizer).stop_token_ids()[0]
    teacher = TeacherEngine(ctx.tokenizer, stop)
    ctx = replace(ctx, engine=teacher)
    sem = asyncio.Semaphore(concurrency)
    report = DemoReport()

    async def one(i: int, row: dict[str, Any]) -> None:
        sample = Sample.from_row(row, data_index=i, group_id=f"demo-{i}", sample_index=0, group_size=1)
        try:
            turns = env.demo_turns(row)
            teacher.scripts[sample.uid] = [render_turn(t, writer) for t in turns]
            async with sem:
                traj = await run_episode(sample, ctx, agent)
        except Exception as e:  # DemoError, a tool that failed, a prompt over budget: the row is named
            report.rejected.append((i, f"{type(e).__name__}: {e}"[:300]))
            return
        finally:
            teacher.scripts.pop(sample.uid, None)
        if traj.metrics.get("assistant_turns", 0) != len(turns):
            report.rejected.append((i, f"the agent ran {traj.metrics.get('assistant_turns', 0):.0f} of the "
                                       f"demonstration's {len(turns)} turns (finish: {traj.finish_reason})"))
            return
        errors = {k: v for k, v in traj.metrics.items() if k in ("invalid_json", "unknown_tool", "bad_arguments",
                                                                 "tool_timeout", "tool_error") and v}
        if errors:
            report.rejected.append((i, f"a tool call failed: {errors}"))
            return
        if traj.reward != 1.0:
            report.rejected.append((i, f"earned reward {traj.reward:g}, not the full 1.0"))
            return
        why = env.check_demo(row, traj.messages)
        if why:
            report.rejected.append((i, why))
            return
        report.trajectories[i] = traj
        report.rows.append({
            "data_index": i, "data_source": row.get("data_source") or "", "reward": traj.reward,
            "messages": openai_messages(sample.messages, traj.messages, turns), "tools": ctx.tool_schemas(),
            "agent_messages": traj.messages,
        })

    await asyncio.gather(*(one(i, row) for i, row in rows))
    report.rows.sort(key=lambda r: r["data_index"])
    report.rejected.sort()
    return report


def demonstrate(cfg: Any, env: Any, rows: list[tuple[int, dict[str, Any]]]) -> DemoReport:
    """`make_demos` for a run's config (asyncrl.config.Config): the env's services running (search_r1's
    retrieval server), the configured agent, tools, reward and the model's tokenizer."""
    # lazy: imports omegaconf, which this module does not load otherwise
    from asyncrl.agents.base import AgentContext

    tokenizer = load_tokenizer(cfg.model)
    with env.services(cfg.env) as tool_overrides:
        ctx = AgentContext.for_config(cfg, engine=None, tokenizer=tokenizer, tool_overrides=tool_overrides)
        return asyncio.run(make_demos(ctx, env, rows, cfg.agent.name))


def write_demos(rows: list[dict[str, Any]], path: Any) -> None:
    """The demonstration rows as JSONL at `path`, atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)
