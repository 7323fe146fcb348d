"""Tool-call parsers (plugins of kind "tool_parser"): model text -> content + tool calls, and back.

A parser is a class with `parse(text) -> Parsed` and `render(content, calls) -> str` (the contract:
asyncrl/agents/tool_calls.py). A call that cannot be understood is still returned, with `error` set
("invalid_json"), so the loop can tell the model and count it. Call JSON is read with `loads_call_json`
(asyncrl/agents/tool_calls.py): NaN/Infinity, nesting past the recursion limit and calls over 1 MiB are
invalid calls, never exceptions. `render` writes an assistant turn in the same format (SFT, demonstrations
and the warm start teach it; the proxy writes an agent's calls back with it), so that parsing it gives the
calls back; this module is the only place that spells a format's markers (tests/agents/test_tool_formats.py
checks the source). The formats (docs/design.md "Tool-call formats"), each with what `render` writes:

- `hermes` (Qwen2.5, NousResearch Hermes, SmolLM): every `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` block (arguments may also be a JSON-encoded string); an unclosed `<tool_call>`
  (generation cut) is an invalid call. Rendered: the content, then each call as `<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>`, one a line (Qwen2.5's template).
- `qwen3`: hermes outside `<think>...</think>`: a block written while thinking is not a call, and the
  thinking is not content. Rendered as hermes, with no thinking.
- `llama3_json` (Llama 3.1/3.2/3.3): the message is one or more `{"name": ..., "parameters": {...}}`
  objects (separated by `;` or whitespace), optionally after `<|python_tag|>`; text that does not start
  with `{` is content. Rendered: the calls as `{"name": ..., "parameters": {...}}` joined by `; ` and
  nothing else (the format has no room for content beside calls; Llama 3.1's template drops it too).
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (v3 tokenizers) or one or more
  `NAME[ARGS]{json}` (v11+ tokenizers); text before the first `[TOOL_CALLS]` is content. Its markers are
  special tokens, so the agent loop gives this parser the text decoded with special tokens kept
  (`keeps_special_tokens`). Rendered in the v11+ form, the content first.
- `deepseek_v3`: `<｜tool▁calls▁begin｜>` then calls `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n
  ```json\\n{...}\\n```<｜tool▁call▁end｜>` (V3/R1) or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>` (V3.1); text before the first marker is content. Rendered in the V3/R1 (fenced) form,
  the content first, the calls between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`.
- `react`: the text ReAct format. "Final Answer: X" ends the episode; otherwise the first
  "Action: NAME" followed by "Action Input: ARGS" (up to an "Observation:" line or the end) is a
  call; ARGS is a JSON object, or a bare string kept in `raw` for single-parameter tools. Rendered: the
  content, then `Action: NAME` and `Action Input: {...}`: one call a turn, the format's limit.

What a format cannot write is a ToolFormatError naming the parser, never a call left out: content holding
the format's own markers (it would read back as calls), a call name its syntax cannot hold, react's second
call.

Each class's `template_markers` are what `agent.tool_parser=auto` looks for in a chat template
(`asyncrl.agents.tool_calls.resolve_parser`, in the order of its AUTO_PARSERS). `HermesParser.tools_text` is
the hermes tool instructions asyncrl.agents.chat puts in the system message for a template that cannot
render tools.
"""

from __future__ import annotations

import json
import re
from typing import Any

from asyncrl import registry
from asyncrl.agents.tool_calls import (
    BadCallJSON,
    Parsed,
    ToolCall,
    ToolFormatError,
    call_from_object,
    dumps_call_json,
    loads_call_json,
    raw_decode_call_json,
)
from asyncrl.registry import register


def _refuse(parser: str, content: str, markers: tuple[str, ...], why: str = "it would read back as calls") -> None:
    """Content that holds one of the format's markers cannot be written: `why`."""
    found = [m for m in markers if m.lower() in content.lower()]
    if found:
        raise ToolFormatError(f"tool_parser {parser!r} cannot write an assistant turn whose content holds "
                              f"{found[0]!r} ({why}): {content[:200]!r}")


def _name(parser: str, call: Any, pattern: str = r".+") -> str:
    name = call.name
    if not isinstance(name, str) or not re.fullmatch(pattern, name, re.DOTALL):
        raise ToolFormatError(f"tool_parser {parser!r} cannot write a call named {name!r} (a name must match "
                              f"{pattern})")
    return name


def _json_call(body: str, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    raw = body.strip()
    try:
        return call_from_object(loads_call_json(raw), raw, keys)
    except BadCallJSON:
        return ToolCall("", None, "invalid_json", raw)


@register("tool_parser", "hermes")
class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    name = "hermes"
    template_markers: tuple[str, ...] = (OPEN,)
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def render(self, content: str, calls: Any) -> str:
        _refuse(self.name, content, (self.OPEN, self.CLOSE))
        blocks = [content] if content else []
        for c in calls:
            call = {"name": _name(self.name, c), "arguments": c.arguments}
            blocks.append(f"{self.OPEN}\n{dumps_call_json(call, self.name)}\n{self.CLOSE}")
        return "\n".join(blocks)

    @classmethod
    def tools_text(cls, schemas: list[dict[str, Any]]) -> str:
        """The tool instructions of hermes-style templates (as in Qwen2.5's), which asyncrl.agents.chat appends to
        the system message for a chat template that cannot render tools."""
        lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and "
                f"arguments within {cls.OPEN}{cls.CLOSE} XML tags:\n{cls.OPEN}\n"
                f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{cls.CLOSE}')

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
    name = "qwen3"
    THINK, THINK_END = "<think>", "</think>"
    template_markers = (HermesParser.OPEN, THINK)
    _think = re.compile(r"<think>.*?(</think>|\Z)", re.DOTALL)

    def render(self, content: str, calls: Any) -> str:
        _refuse(self.name, content, (self.THINK, self.THINK_END), "thinking is neither content nor calls")
        return super().render(content, calls)

    def parse(self, text: str) -> Parsed:
        # a template that opens <think> in the prompt leaves only "...</think>" in the response
        head, sep, tail = text.partition("</think>")
        visible = tail if sep and "<think>" not in head else text
        return super().parse(self._think.sub("", visible))


@register("tool_parser", "llama3_json")
class Llama3JsonParser:
    PYTHON_TAG = "<|python_tag|>"
    name = "llama3_json"
    template_markers = (PYTHON_TAG, "ipython")

    def render(self, content: str, calls: Any) -> str:
        if not calls:
            if content.strip().startswith(("{", self.PYTHON_TAG)):
                raise ToolFormatError(f"tool_parser {self.name!r} reads a turn that starts with '{{' or "
                                      f"{self.PYTHON_TAG!r} as tool calls; it cannot write the content "
                                      f"{content[:200]!r}")
            return content
        # content beside calls has no place in this format: left out, as Llama 3.1's chat template leaves it out
        return "; ".join(dumps_call_json({"name": _name(self.name, c), "parameters": c.arguments}, self.name)
                         for c in calls)

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
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    name = "mistral"
    template_markers = (MARK,)
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token: decode must keep it
    NAME = r"[A-Za-z0-9_.\-]+"  # a v11 call's name
    _v11 = re.compile(r"\s*(" + NAME + r")\[ARGS\]")

    def render(self, content: str, calls: Any) -> str:
        _refuse(self.name, content, (self.MARK, "<s>", "</s>"))
        return content + "".join(f"{self.MARK}{_name(self.name, c, self.NAME)}{self.ARGS}"
                                 f"{dumps_call_json(c.arguments, self.name)}" for c in calls)

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
    name = "deepseek_v3"
    template_markers = ("tool▁calls▁begin", "tool▁call▁begin")
    NAME = r"[^\s<>｜]+"  # what render can write before the newline of the fenced form
    _fenced = re.compile(r"^\s*function\s*$")

    def render(self, content: str, calls: Any) -> str:
        _refuse(self.name, content, (self.CALLS_BEGIN, self.CALL_BEGIN))
        if not calls:
            return content
        body = "".join(f"{self.CALL_BEGIN}function{self.SEP}{_name(self.name, c, self.NAME)}\n```json\n"
                       f"{dumps_call_json(c.arguments, self.name)}\n```{self.CALL_END}" for c in calls)
        return f"{content}{self.CALLS_BEGIN}{body}{self.CALLS_END}"

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
    name = "react"
    NAME = r"[^`\s]([^\n]*[^`\s])?"  # parse strips spaces and backticks from the name's line
    _final = re.compile(r"Final Answer\s*:\s*(.*)", re.DOTALL | re.IGNORECASE)
    _action = re.compile(r"Action\s*:\s*(.*?)\s*\n\s*Action Input\s*:\s*(.*?)(?=\n\s*Observation\s*:|\Z)",
                         re.DOTALL | re.IGNORECASE)
    _action_only = re.compile(r"Action\s*:\s*([^\n]*)", re.IGNORECASE)
    _observation = re.compile(r"Observation\s*:", re.IGNORECASE)

    def render(self, content: str, calls: Any) -> str:
        if len(calls) > 1:
            raise ToolFormatError(f"tool_parser {self.name!r} writes one call a turn (Action / Action Input); this "
                                  f"turn has {len(calls)}: {', '.join(str(c.name) for c in calls)}")
        if not calls:
            return content
        if self._action_only.search(content) or self._final.search(content) or self._observation.search(content):
            raise ToolFormatError(f"tool_parser {self.name!r} cannot write a call after content that holds an "
                                  f"'Action:', 'Final Answer:' or 'Observation:' line (it would read back as another "
                                  f"action or the final answer): {content[:200]!r}")
        c = calls[0]
        head = f"{content}\n" if content else ""
        return f"{head}Action: {_name(self.name, c, self.NAME)}\nAction Input: {dumps_call_json(c.arguments, self.name)}"

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
