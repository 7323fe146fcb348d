"""Runs one turn's tool calls for one episode: validation, bounded parallelism, timeouts, truncation.

Every call produces an `Outcome` whose text goes back to the model; nothing here raises for model or
tool misbehaviour. Counters (added to the trajectory's metrics):
  tool_calls     every call the model made (valid or not)
  invalid_json   the call could not be parsed
  unknown_tool   no tool of that name
  bad_arguments  arguments fail the tool's JSON schema (required keys, basic types, enums)
  tool_error     the tool raised (ToolError or any other exception), also in create()
  tool_timeout   execute() took longer than AgentConfig.tool_timeout_s
  tool_truncated the reply was cut to max_tool_response_tokens
The first three are "invalid" calls (the model's fault) and feed the consecutive-invalid limit.
Tools are created lazily per episode (instance_id = the sample's uid) and released by `close()`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

from asyncrl.tools.base import ToolError, tool_text, validate_arguments

from .tool_calls import ToolCall


@dataclass
class Outcome:
    name: str
    text: str
    reward: float = 0.0
    kind: str = "ok"  # ok | invalid_json | unknown_tool | bad_arguments | tool_error | tool_timeout

    @property
    def invalid(self) -> bool:
        return self.kind in ("invalid_json", "unknown_tool", "bad_arguments")


def truncate_middle(text: str, tokenizer: Any, max_tokens: int) -> tuple[str, int]:
    """Keep the first ceil(max/2) and last floor(max/2) tokens of `text` around a marker
    "\\n...[truncated N tokens]...\\n" (N = tokens removed). Returns (text, N); N = 0 when it fits."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text, 0
    head = (max_tokens + 1) // 2
    tail = max_tokens - head
    cut = len(ids) - max_tokens
    marker = f"\n...[truncated {cut} tokens]...\n"
    return tokenizer.decode(ids[:head]) + marker + (tokenizer.decode(ids[-tail:]) if tail else ""), cut


class ToolRunner:
    def __init__(self, tools: dict[str, Any], instance_id: str, tools_kwargs: dict[str, Any], cfg: Any,
                 tokenizer: Any, metrics: Counter):
        self.tools, self.instance_id, self.tools_kwargs = tools, instance_id, tools_kwargs
        self.cfg, self.tok, self.metrics = cfg, tokenizer, metrics
        self._created: dict[str, str] = {}  # tool name -> the instance id its create() returned
        self.rewards: list[float] = []

    async def _ensure_created(self, name: str) -> str:
        if name not in self._created:
            kwargs = dict((self.tools_kwargs.get(name) or {}).get("create_kwargs") or {})
            got = await asyncio.wait_for(self.tools[name].create(self.instance_id, **kwargs), self.cfg.tool_timeout_s)
            if isinstance(got, tuple):  # verl >= 0.5 returns (instance_id, ToolResponse)
                got = got[0]
            self._created[name] = got if isinstance(got, str) and got else self.instance_id
        return self._created[name]

    async def _one(self, call: ToolCall, sem: asyncio.Semaphore) -> Outcome:
        if call.error == "invalid_json" or call.arguments is None:
            return Outcome(call.name or "?", "Error: the tool call is not valid JSON of the form "
                           '{"name": <tool name>, "arguments": {<arguments>}}: ' + call.raw[:200], kind="invalid_json")
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return Outcome(call.name, f"Error: unknown tool {call.name!r}; available tools: {known}", kind="unknown_tool")
        params = tool.tool_schema.get("function", {}).get("parameters") or {}
        problems = validate_arguments(params, call.arguments)
        if problems:
            return Outcome(call.name, f"Error: bad arguments for {call.name}: " + "; ".join(problems), kind="bad_arguments")
        async with sem:
            try:
                iid = await self._ensure_created(call.name)
                result = await asyncio.wait_for(tool.execute(iid, call.arguments), self.cfg.tool_timeout_s)
            except asyncio.TimeoutError:
                return Outcome(call.name, f"Error: {call.name} timed out after {self.cfg.tool_timeout_s:g} s",
                               kind="tool_timeout")
            except ToolError as e:
                return Outcome(call.name, f"Error: {e}", kind="tool_error")
            except Exception as e:  # a broken tool is the tool's problem, reported to the model
                return Outcome(call.name, f"Error: {call.name} failed: {type(e).__name__}: {e}", kind="tool_error")
        text, reward, extra = result if isinstance(result, tuple) else (result, 0.0, {})
        for k, v in (extra or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.metrics[f"tool/{call.name}/{k}"] += float(v)
        return Outcome(call.name, tool_text(text), float(reward or 0.0))

    async def run(self, calls: list[ToolCall]) -> list[Outcome]:
        """Run the calls concurrently (at most tool_concurrency at once); outcomes in call order."""
        sem = asyncio.Semaphore(max(1, int(self.cfg.tool_concurrency)))
        outcomes = list(await asyncio.gather(*(self._one(c, sem) for c in calls)))
        for o in outcomes:
            self.metrics["tool_calls"] += 1
            if o.kind != "ok":
                self.metrics[o.kind] += 1
            else:
                self.rewards.append(o.reward)
            o.text, cut = truncate_middle(o.text, self.tok, self.cfg.max_tool_response_tokens)
            if cut:
                self.metrics["tool_truncated"] += 1
        return outcomes

    async def close(self) -> None:
        for name, iid in self._created.items():
            try:
                await asyncio.wait_for(self.tools[name].release(iid), self.cfg.tool_timeout_s)
            except Exception:
                self.metrics["tool_release_error"] += 1
        self._created.clear()
