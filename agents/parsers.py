"""Tool-call parsers (plugins of kind "tool_parser"): model text -> content + tool calls.

A parser is a class with `parse(text) -> Parsed`. A call that cannot be understood is still
returned, with `error` set ("invalid_json"), so the loop can tell the model and count it.

- `hermes`: every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block (arguments may
  also be a JSON-encoded string); an unclosed `<tool_call>` (generation cut) is an invalid call.
- `react`: the text ReAct format. "Final Answer: X" ends the episode; otherwise the first
  "Action: NAME" followed by "Action Input: ARGS" (up to an "Observation:" line or the end) is a
  call; ARGS is a JSON object, or a bare string kept in `raw` for single-parameter tools.
"""

from __future__ import annotations

import json
import re
from typing import Any

from asyncrl import registry
from asyncrl.agent_loop.tool_calls import Parsed, ToolCall
from asyncrl.registry import register


@register("tool_parser", "hermes")
class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        calls = [self._call(m.group(1)) for m in self._block.finditer(text)]
        rest = self._block.sub("", text)
        if self.OPEN in rest:  # an unclosed block: the generation stopped inside a call
            head, _, tail = rest.partition(self.OPEN)
            calls.append(ToolCall("", None, "invalid_json", tail.strip()))
            rest = head
        return Parsed(rest.strip(), calls)

    @staticmethod
    def _call(body: str) -> ToolCall:
        raw = body.strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            return ToolCall("", None, "invalid_json", raw)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", None, "invalid_json", raw)
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return ToolCall(obj["name"], None, "invalid_json", raw)
        if not isinstance(args, dict):
            return ToolCall(obj["name"], None, "invalid_json", raw)
        return ToolCall(obj["name"], args, None, raw)


@register("tool_parser", "react")
class ReactParser:
    _final = re.compile(r"Final Answer\s*:\s*(.*)", re.DOTALL | re.IGNORECASE)
    _action = re.compile(r"Action\s*:\s*(.*?)\s*\n\s*Action Input\s*:\s*(.*?)(?=\n\s*Observation\s*:|\Z)",
                         re.DOTALL | re.IGNORECASE)
    _action_only = re.compile(r"Action\s*:\s*([^\n]*)", re.IGNORECASE)

    def parse(self, text: str) -> Parsed:
        m = self._action.search(text)
        f = self._final.search(text)
        if f and (m is None or f.start() < m.start()):
            return Parsed(text.strip(), [], f.group(1).strip())
        if m:
            name, raw = m.group(1).strip().strip("`"), m.group(2).strip().strip("`")
            if raw.startswith("json"):
                raw = raw[4:].strip()
            try:
                args = json.loads(raw) if raw else {}
            except json.JSONDecodeError:
                return Parsed(text[: m.start()].strip(), [ToolCall(name, None, "invalid_json", raw)])
            if not isinstance(args, dict):
                return Parsed(text[: m.start()].strip(), [ToolCall(name, None, "invalid_json", raw)])
            return Parsed(text[: m.start()].strip(), [ToolCall(name, args, None, raw)])
        a = self._action_only.search(text)
        if a:  # an Action without its Action Input
            return Parsed(text[: a.start()].strip(), [ToolCall(a.group(1).strip(), {}, None, "")])
        return Parsed(text.strip(), [])


def get_parser(name: str) -> Any:
    obj = registry.get("tool_parser", name)
    return obj() if isinstance(obj, type) else obj
