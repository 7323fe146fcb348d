"""Tool-call parsers (plugins of kind "tool_parser"): model text -> content + tool calls.

A parser is a class with `parse(text) -> Parsed`. A call that cannot be understood is still
returned, with `error` set ("invalid_json"), so the loop can tell the model and count it. Call JSON is
read with `loads_call_json` (asyncrl/agents/tool_calls.py): NaN/Infinity, nesting past the recursion
limit and calls over 1 MiB are invalid calls, never exceptions. The formats (docs/design.md "Tool-call
formats"):

- `hermes` (Qwen2.5, NousResearch Hermes, SmolLM): every `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` block (arguments may also be a JSON-encoded string); an unclosed `<tool_call>`
  (generation cut) is an invalid call.
- `qwen3`: hermes outside `<think>...</think>`: a block written while thinking is not a call, and the
  thinking is not content.
- `llama3_json` (Llama 3.1/3.2/3.3): the message is one or more `{"name": ..., "parameters": {...}}`
  objects (separated by `;` or whitespace), optionally after `<|python_tag|>`; text that does not start
  with `{` is content.
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (v3 tokenizers) or one or more
  `NAME[ARGS]{json}` (v11+ tokenizers); text before the first `[TOOL_CALLS]` is content. Its markers are
  special tokens, so the agent loop gives this parser the text decoded with special tokens kept
  (`keeps_special_tokens`).
- `deepseek_v3`: `<｜tool▁calls▁begin｜>` then calls `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n
  ```json\\n{...}\\n```<｜tool▁call▁end｜>` (V3/R1) or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>` (V3.1); text before the first marker is content.
- `react`: the text ReAct format. "Final Answer: X" ends the episode; otherwise the first
  "Action: NAME" followed by "Action Input: ARGS" (up to an "Observation:" line or the end) is a
  call; ARGS is a JSON object, or a bare string kept in `raw` for single-parameter tools.

`agent.tool_parser=auto` is resolved by `asyncrl.agents.tool_calls.resolve_parser` from the tokenizer.
"""

from __future__ import annotations

import re
from typing import Any

from asyncrl import registry
from asyncrl.agents.tool_calls import (
    BadCallJSON,
    Parsed,
    ToolCall,
    call_from_object,
    loads_call_json,
    raw_decode_call_json,
)
from asyncrl.registry import register


def _json_call(body: str, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    raw = body.strip()
    try:
        return call_from_object(loads_call_json(raw), raw, keys)
    except BadCallJSON:
        return ToolCall("", None, "invalid_json", raw)


@register("tool_parser", "hermes")
class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        calls = [_json_call(m.group(1)) for m in self._block.finditer(text)]
        rest = self._block.sub("", text)
        if self.OPEN in rest:  # an unclosed block: the generation stopped inside a call
            head, _, tail = rest.partition(self.OPEN)
            calls.append(ToolCall("", None, "invalid_json", tail.strip()))
            rest = head
        return Parsed(rest.strip(), calls)


@register("tool_parser", "qwen3")
class Qwen3Parser(HermesParser):
    _think = re.compile(r"<think>.*?(</think>|\Z)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        # a template that opens <think> in the prompt leaves only "...</think>" in the response
        head, sep, tail = text.partition("</think>")
        visible = tail if sep and "<think>" not in head else text
        return super().parse(self._think.sub("", visible))


@register("tool_parser", "llama3_json")
class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):].lstrip()
        if not body.startswith("{"):
            return Parsed(text.strip(), [])
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = raw_decode_call_json(body, pos)
            except BadCallJSON:
                calls.append(ToolCall("", None, "invalid_json", body[pos:].strip()))
                break
            calls.append(call_from_object(obj, body[pos:end].strip(), ("parameters", "arguments")))
            pos = end
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
            if body.startswith(("<|eom_id|>", "<|eot_id|>"), pos):
                break
        return Parsed("", calls)


@register("tool_parser", "mistral")
class MistralParser:
    MARK = "[TOOL_CALLS]"
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token: decode must keep it
    _v11 = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")

    def parse(self, text: str) -> Parsed:
        head, sep, rest = text.partition(self.MARK)
        content = head.replace("<s>", "").strip()
        if not sep:
            return Parsed(content.replace("</s>", "").strip(), [])
        calls: list[ToolCall] = []
        for part in rest.split(self.MARK):
            part = part.split("</s>", 1)[0]
            m = self._v11.match(part)
            if m:  # v11+: NAME[ARGS]{json}
                try:
                    args, end = raw_decode_call_json(part, m.end())
                except BadCallJSON:
                    calls.append(ToolCall(m.group(1), None, "invalid_json", part.strip()))
                    continue
                calls.append(call_from_object({"name": m.group(1), "arguments": args}, part[: end].strip()))
                continue
            try:  # v3: a JSON array of calls (or one object)
                obj, end = raw_decode_call_json(part, 0)
            except BadCallJSON:
                calls.append(ToolCall("", None, "invalid_json", part.strip()))
                continue
            raw = part[:end].strip()
            calls.extend(call_from_object(o, raw) for o in (obj if isinstance(obj, list) else [obj]))
            if isinstance(obj, list) and not obj:
                calls.append(ToolCall("", None, "invalid_json", raw))
        return Parsed(content, calls)


@register("tool_parser", "deepseek_v3")
class DeepSeekV3Parser:
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _fenced = re.compile(r"^\s*function\s*$")

    def parse(self, text: str) -> Parsed:
        head, sep, rest = text.partition(self.CALLS_BEGIN)
        if not sep:
            head, sep, rest = text.partition(self.CALL_BEGIN)
            rest = self.CALL_BEGIN + rest if sep else rest
        if not sep:
            return Parsed(text.strip(), [])
        rest = rest.split(self.CALLS_END, 1)[0]
        calls = []
        for chunk in rest.split(self.CALL_BEGIN)[1:]:
            body, closed, _ = chunk.partition(self.CALL_END)
            kind, has_sep, after = body.partition(self.SEP)
            if not closed or not has_sep:
                calls.append(ToolCall("", None, "invalid_json", chunk.strip()))
                continue
            if self._fenced.match(kind):  # V3/R1: function<sep>NAME\n```json\n{...}\n```
                name, _, fenced = after.partition("\n")
                args_text = fenced.strip().removeprefix("```json").removeprefix("```").removesuffix("```")
            else:  # V3.1: NAME<sep>{...}
                name, args_text = kind, after
            calls.append(_json_call_named(name.strip(), args_text, chunk.strip()))
        return Parsed(head.strip(), calls)


def _json_call_named(name: str, args_text: str, raw: str) -> ToolCall:
    if not name:
        return ToolCall("", None, "invalid_json", raw)
    try:
        args = loads_call_json(args_text.strip() or "{}")
    except BadCallJSON:
        return ToolCall(name, None, "invalid_json", raw)
    return call_from_object({"name": name, "arguments": args}, raw)


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
                args = loads_call_json(raw) if raw else {}
            except BadCallJSON:
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
