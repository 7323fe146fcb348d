"""The tool-call parser contract (parsers are plugins of kind "tool_parser"; the built-ins are in
asyncrl/agents/parsers.py), what a parser returns, the safe reading and writing of call JSON, and the choice
of a parser for `agent.tool_parser=auto`.

A parser plugin (`@register("tool_parser", NAME)` on a class made without arguments, or an object) has:
- `parse(text) -> Parsed`: an assistant turn's text as the model wrote it -> its content and its calls. A
  call that cannot be understood is still a `ToolCall`, with `error` set ("invalid_json"), so the loop can
  tell the model and count it; model text never raises.
- `render(content, calls) -> str`: the text of an assistant turn with that content and those calls (each
  with `.name` and `.arguments`, a JSON object: `ToolCall`, `asyncrl.envs.base.DemoCall`), as the model
  writes it in this format, so that `parse(render(content, calls))` gives back the calls' names and
  arguments, in order, and `content.strip()` where the format has room for content beside calls. Call JSON
  is written with `dumps_call_json`. What the format cannot write is a `ToolFormatError` naming the parser
  (content that holds the format's markers, a name its syntax cannot hold, more calls than a turn takes);
  a call is never left out. SFT (`asyncrl sft`), demonstrations (`asyncrl data --demos`) and the warm start
  write every assistant turn with it, and the proxy writes an agent's calls back with it for a chat template
  that cannot render `tool_calls`: the format has this one owner. A parser without `render` is refused
  where a turn must be written (`renderer`: a ToolFormatError naming it; the preflight checks it before a
  warm start).
- optionally `keeps_special_tokens = True`: the agent loop decodes the generation with special tokens kept
  for it (its markers are special tokens);
- optionally `template_markers` (strings) and, for a parser `auto` may choose, a place in AUTO_PARSERS.

`resolve_parser(name, tokenizer)`: for "auto", the tokenizer's own transformers `response_template`
when it declares one (parsed by transformers' `parse_response`; it cannot render), else the markers of its
chat template (`parser_for_template`: each parser's `template_markers`, in the order of AUTO_PARSERS); a
template with none of them is an error naming the markers looked for and the parsers to set instead.
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


class ToolFormatError(ValueError):
    """An assistant turn a tool-call format cannot write (see `render` in the module docstring), or a parser
    that cannot write at all (no `render`)."""


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


def dumps_call_json(value: Any, parser: str) -> str:
    """Call JSON as a model writes it (the chat templates' `tojson`: `, ` and `: ` separators, non-ASCII
    kept); NaN or Infinity, which JSON has no spelling for, is a ToolFormatError naming `parser`."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError) as e:
        raise ToolFormatError(f"tool_parser {parser!r} cannot write {str(value)[:200]} as call JSON: {e}") from None


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


# the parsers `auto` may choose, in the order they are tried (the first match wins): each one's
# `template_markers` are looked for in the chat template, "all" of them or "any" one
AUTO_PARSERS: tuple[tuple[str, str], ...] = (
    ("mistral", "any"), ("deepseek_v3", "any"), ("llama3_json", "any"), ("qwen3", "all"), ("hermes", "all"),
)


def template_markers() -> list[tuple[str, str, tuple[str, ...]]]:
    """(parser, "all" | "any", its template_markers) for each of AUTO_PARSERS, in order."""
    return [(name, rule, tuple(getattr(registry.get("tool_parser", name), "template_markers", ())))
            for name, rule in AUTO_PARSERS]


def parser_for_template(template: Optional[str]) -> Optional[str]:
    """The parser name a chat template's markers select, or None."""
    if not template:
        return None
    for name, rule, markers in template_markers():
        if markers and (all if rule == "all" else any)(m in template for m in markers):
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
        looked = "; ".join(f"{n}: {(' + ' if rule == 'all' else ' or ').join(m)}"
                           for n, rule, m in template_markers())
        raise UnknownToolFormat(
            "agent.tool_parser=auto: the tokenizer declares no response_template and its chat template holds "
            f"none of the tool-call markers looked for ({looked}); set agent.tool_parser to one of "
            f"{', '.join(sorted(registry.names('tool_parser')))}")
    return _instance(chosen)


def renderer(name: str, tokenizer: Any = None) -> Any:
    """The parser `agent.tool_parser=name` names (resolved as `resolve_parser` does), for writing assistant
    turns: a ToolFormatError naming it when it has no `render` (a plugin written before parsers rendered, or
    the tokenizer's response_template that auto chose)."""
    parser = resolve_parser(name, tokenizer)
    if callable(getattr(parser, "render", None)):
        return parser
    can = [n for n in registry.names("tool_parser") if callable(getattr(registry.get("tool_parser", n), "render", None))]
    origin = next((p.origin for p in registry.all_plugins() if p.kind == "tool_parser" and p.name == name), "")
    what = ("chose the tokenizer's own response_template parser, which" if isinstance(parser, TransformersResponseParser)
            else f"is the tool_parser plugin {type(parser).__qualname__}{f' ({origin})' if origin else ''}, which")
    raise ToolFormatError(
        f"agent.tool_parser={name} {what} has no render(content, calls): SFT, demonstrations and the warm start "
        "write assistant turns in the configured tool-call format, so its parser must render as well as parse "
        f"(asyncrl/agents/tool_calls.py); add render to it, or set agent.tool_parser to one that has it: "
        f"{', '.join(can)}")


def _instance(name: str) -> Any:
    obj = registry.get("tool_parser", name)
    return obj() if isinstance(obj, type) else obj
