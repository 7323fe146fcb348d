"""SFT data: chat conversations with tool calls, checked, and rendered to token arrays the way the agent loop does.

A row (JSONL or parquet): `messages`, a list of OpenAI/verl chat messages (system | user | assistant | tool;
an assistant message may carry `tool_calls`: [{"type": "function", "function": {"name", "arguments": JSON
text or object}}]; a tool message has `content` and optionally `name`), and optionally `tools` (OpenAI tool
schemas the model was offered). Either may be JSON text (as parquet writers often store them).
`asyncrl data <env> --demos` writes exactly this shape. `check_rows` names every bad row's index and field.

`render_conversation` produces what tool_agent would have produced had the model written the assistant turns:
the prompt (the messages before the first assistant turn, with the configured system prompt and the tools
block, `ChatFormat.prompt_ids`), then each assistant turn as generated tokens (its text and its calls written
by agent.tool_parser's `render`, `render_turn`, then the stop token: loss mask 1), and the messages between
assistant turns as the chat template's delta after that turn (loss mask 0). So the loss covers exactly the
tokens the policy writes at RL time, in the format the agent loop parses. A parser that cannot render is a
ToolFormatError naming it, before a turn is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.agents.chat import ChatFormat
from asyncrl.agents.tool_calls import renderer
from asyncrl.agents.trajectory_builder import TrajectoryBuilder
from asyncrl.data.rows import DataError, iter_file
from asyncrl.envs.base import DemoCall, DemoTurn
from asyncrl.sft.demos import render_turn

ROLES = ("system", "user", "assistant", "tool")


def _maybe_json(value: Any, index: int, name: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError as e:
            raise DataError(f"not valid JSON text ({e})", index=index, field=name) from None
    return value


def check_row(row: Any, index: int) -> dict[str, Any]:
    """The row with `messages` and `tools` decoded and checked; DataError naming the field at fault."""
    if not isinstance(row, dict):
        raise DataError(f"a row must be a mapping, got {type(row).__name__}", index=index)
    messages = _maybe_json(row.get("messages"), index, "messages")
    if not isinstance(messages, list) or not messages:
        raise DataError("must be a non-empty list of chat messages", index=index, field="messages")
    tools = _maybe_json(row.get("tools") or [], index, "tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError("must be a list of OpenAI tool schemas", index=index, field="tools")
    out = []
    for j, m in enumerate(messages):
        where = f"messages[{j}]"
        if not isinstance(m, dict):
            raise DataError(f"must be a mapping, got {type(m).__name__}", index=index, field=where)
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"role {role!r} is not one of {', '.join(ROLES)}", index=index, field=f"{where}.role")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise DataError(f"content must be text or null, got {type(content).__name__}", index=index,
                            field=f"{where}.content")
        calls = m.get("tool_calls") or []
        if calls and role != "assistant":
            raise DataError("only assistant messages carry tool_calls", index=index, field=f"{where}.tool_calls")
        parsed = []
        for k, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str) or not name:
                raise DataError("a tool call needs function.name", index=index, field=f"{where}.tool_calls[{k}]")
            args = _maybe_json(fn.get("arguments") if fn.get("arguments") is not None else {}, index,
                               f"{where}.tool_calls[{k}].function.arguments")
            if not isinstance(args, dict):
                raise DataError("arguments must be a JSON object", index=index,
                                field=f"{where}.tool_calls[{k}].function.arguments")
            parsed.append({"name": name, "arguments": args})
        msg = {"role": role, "content": content or ""}
        if m.get("name"):
            msg["name"] = str(m["name"])
        if parsed:
            msg["tool_calls"] = parsed
        out.append(msg)
    first = next((j for j, m in enumerate(out) if m["role"] == "assistant"), None)
    if first is None:
        raise DataError("has no assistant message: nothing to learn", index=index, field="messages")
    if first == 0:
        raise DataError("starts with an assistant message: no prompt before it", index=index, field="messages")
    return {"messages": out, "tools": tools}


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a JSONL or parquet file, checked (`check_row`); the first bad one is a DataError."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"no such file: {p}", source=str(p))
    rows = []
    for i, row in enumerate(iter_file(p)):
        try:
            rows.append(check_row(row, i))
        except DataError as e:
            raise DataError(e.message, index=i, field=e.field, source=str(p)) from None
    if not rows:
        raise DataError("holds no rows", source=str(p))
    return rows


def render_conversation(tokenizer: Any, agent_cfg: Any, row: dict[str, Any], uid: str = "sft") -> Any:
    """The checked row as a Trajectory (module docstring): loss mask 1 exactly on the assistant turns' tokens.
    A conversation longer than agent.max_response_tokens (or a turn over agent.max_turn_tokens) is a
    DataError: cut, it would teach the model to stop mid-answer."""
    writer = renderer(agent_cfg.tool_parser, tokenizer)  # ToolFormatError (a ValueError) when it cannot render
    messages, tools = row["messages"], row["tools"]
    first = next(j for j, m in enumerate(messages) if m["role"] == "assistant")
    chat = ChatFormat(tokenizer, tools=tools, system_prompt=agent_cfg.system_prompt)
    prompt = chat.prompt_ids(chat.prompt_messages(messages[:first]))
    builder = TrajectoryBuilder(prompt, agent_cfg.max_response_tokens)
    stop = chat.stop_token_ids()[0]
    last: list[int] = []
    pending: list[dict[str, Any]] = []
    turns = 0
    for m in messages[first:]:
        if m["role"] != "assistant":
            pending.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
            continue
        if pending:
            _add(builder, chat.delta_ids(pending, last), False, uid)
            pending = []
        text = render_turn(DemoTurn(m["content"], [DemoCall(c["name"], c["arguments"])
                                                   for c in m.get("tool_calls", [])]), writer)
        last = chat.encode(text) + [stop]
        if len(last) > agent_cfg.max_turn_tokens:
            raise DataError(f"assistant turn {turns} has {len(last)} tokens, over agent.max_turn_tokens="
                            f"{agent_cfg.max_turn_tokens}", field="messages")
        _add(builder, last, True, uid)
        turns += 1
    return builder.build(uid=uid, group_id=uid, group_size=1, env="sft", agent="sft", reward=1.0,
                         num_turns=turns, finish_reason="stop", messages=messages)


def _add(builder: Any, ids: list[int], generated: bool, uid: str) -> None:
    if len(ids) > builder.remaining:
        raise DataError(f"conversation {uid} is longer than agent.max_response_tokens after its prompt",
                        field="messages")
    if generated:
        builder.add_generated(ids, [0.0] * len(ids), [0] * len(ids))
    else:
        builder.add_inserted(ids)
