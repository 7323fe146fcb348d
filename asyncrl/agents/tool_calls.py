"""What a tool-call parser returns (parsers are plugins of kind "tool_parser"; see asyncrl/agents/parsers.py),
the safe reading of model-written call JSON, and the choice of a parser for `agent.tool_parser=auto`.

A call that cannot be understood is still a `ToolCall`, with `error` set ("invalid_json"), so the
loop can tell the model and count it.

`resolve_parser(name, tokenizer)`: for "auto", the tokenizer's own transformers `response_template`
when it declares one (parsed by transformers' `parse_response`), else the markers of its chat template
(`parser_for_template`, in the order of TEMPLATE_MARKERS); a template with none of them is an error
naming the markers looked for and the parsers to set instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from asyncrl import registry

MAX_CALL_CHARS = 1 << 20  # a call's JSON longer than this is refused unread (an invalid call)


@dataclass
class ToolCall:
    name: str
    arguments: Optional[dict[str, Any]]  # None when they could not be parsed
    error: Optional[str] = None  # "invalid_json" when the call could not be parsed
    raw: str = ""  # the call's text as the model wrote it


@dataclass
class Parsed:
    content: str  # the text without the tool-call blocks
    calls: list[ToolCall] = field(default_factory=list)
    final_answer: Optional[str] = None  # react only


class BadCallJSON(ValueError):
    """Model-written JSON that is not a call's: malformed, NaN or Infinity, nested too deeply, too long."""


def _no_constants(name: str) -> Any:
    raise BadCallJSON(f"{name} is not JSON")


def loads_call_json(text: str) -> Any:
    """json.loads for model-written call JSON: NaN, Infinity and -Infinity (which Python's json accepts)
    are refused, as is nesting deeper than the interpreter's recursion limit and text over MAX_CALL_CHARS.
    Raises BadCallJSON."""
    if len(text) > MAX_CALL_CHARS:
        raise BadCallJSON(f"{len(text)} characters of call JSON (limit {MAX_CALL_CHARS})")
    try:
        return json.loads(text, parse_constant=_no_constants)
    except (json.JSONDecodeError, RecursionError) as e:
        raise BadCallJSON(str(e)[:200] or type(e).__name__) from None


def raw_decode_call_json(text: str, start: int) -> tuple[Any, int]:
    """One JSON value at text[start:] (leading whitespace skipped); (value, end). Raises BadCallJSON."""
    while start < len(text) and text[start].isspace():
        start += 1
    if len(text) - start > MAX_CALL_CHARS:
        text = text[: start + MAX_CALL_CHARS]
    try:
        return json.JSONDecoder(parse_constant=_no_constants).raw_decode(text, start)
    except (json.JSONDecodeError, RecursionError) as e:
        raise BadCallJSON(str(e)[:200] or type(e).__name__) from None


def call_from_object(obj: Any, raw: str, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    """A ToolCall from a decoded {"name": ..., <keys[0]|keys[1]>: {...} or "json"} object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", None, "invalid_json", raw)
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = loads_call_json(args) if args.strip() else {}
        except BadCallJSON:
            return ToolCall(obj["name"], None, "invalid_json", raw)
    if not isinstance(args, dict):
        return ToolCall(obj["name"], None, "invalid_json", raw)
    return ToolCall(obj["name"], args, None, raw)


class TransformersResponseParser:
    """A tokenizer's own response parsing (transformers' `response_template` / `parse_response`)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def parse(self, text: str) -> Parsed:
        try:
            msg = self.tokenizer.parse_response(text, prefix="")
        except Exception as e:  # the template's parser refused the text: one invalid call, as elsewhere
            return Parsed(text.strip(), [ToolCall("", None, "invalid_json", f"{type(e).__name__}: {e}"[:200])])
        calls = []
        for c in msg.get("tool_calls") or []:
            fn = c.get("function", c) if isinstance(c, dict) else {}
            calls.append(call_from_object({"name": fn.get("name"), "arguments": fn.get("arguments", {})}, str(c)[:2000]))
        return Parsed(str(msg.get("content") or "").strip(), calls)


# chat-template markers -> parser, in the order they are tried (the first match wins)
TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("deepseek_v3", ("tool▁calls▁begin", "tool▁call▁begin")),
    ("llama3_json", ("<|python_tag|>", "ipython")),
    ("qwen3", ("<tool_call>", "<think>")),  # every marker must be present
    ("hermes", ("<tool_call>",)),
)


def parser_for_template(template: Optional[str]) -> Optional[str]:
    """The parser name a chat template's markers select, or None."""
    if not template:
        return None
    for name, markers in TEMPLATE_MARKERS:
        if name == "qwen3" or name == "hermes":
            if all(m in template for m in markers):
                return name
        elif any(m in template for m in markers):
            return name
    return None


class UnknownToolFormat(ValueError):
    """agent.tool_parser=auto found no parser for the tokenizer's chat template."""


def resolve_parser(name: str, tokenizer: Any = None) -> Any:
    """The parser `name` names; for "auto", the one the tokenizer declares (response_template) or its chat
    template's markers select. UnknownToolFormat names what was looked for."""
    if name != "auto":
        return _instance(name)
    if tokenizer is not None and getattr(tokenizer, "response_template", None):
        return TransformersResponseParser(tokenizer)
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default") or next(iter(template.values()), None)
    chosen = parser_for_template(template)
    if chosen is None:
        looked = "; ".join(f"{n}: {' + '.join(m) if n in ('qwen3', 'hermes') else ' or '.join(m)}"
                           for n, m in TEMPLATE_MARKERS)
        raise UnknownToolFormat(
            "agent.tool_parser=auto: the tokenizer declares no response_template and its chat template holds "
            f"none of the tool-call markers looked for ({looked}); set agent.tool_parser to one of "
            f"{', '.join(sorted(registry.names('tool_parser')))}")
    return _instance(chosen)



def _instance(name: str) -> Any:
    obj = registry.get("tool_parser", name)
    return obj() if isinstance(obj, type) else obj
