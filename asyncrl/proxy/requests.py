"""Validation of the OpenAI request bodies the proxy serves, into typed requests.

Every malformed field is an `OpenAIError` 400 naming it (`param`): wrong types, non-finite numbers
(Python's json reads NaN and Infinity), out-of-range values, unknown roles, `n` other than 1,
`top_logprobs` > 0 (the engine returns only the sampled token's logprob) and unknown keys (OpenAI
answers "Unrecognized request argument supplied"). Keys that do not change what is generated
(`user`, `metadata`, `store`, `parallel_tool_calls`, ...) are accepted and ignored; penalties are
accepted only at 0, since the engine applies none.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import bad

ROLES = ("system", "developer", "user", "assistant", "tool")
IGNORED = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier", "logit_bias",
                     "reasoning_effort", "prediction", "modalities", "audio", "safety_identifier",
                     "prompt_cache_key", "verbosity", "web_search_options", "function_call", "functions"})
CHAT_KEYS = frozenset({"model", "messages", "tools", "tool_choice", "n", "temperature", "top_p", "max_tokens",
                       "max_completion_tokens", "stop", "logprobs", "top_logprobs", "stream", "stream_options",
                       "seed", "presence_penalty", "frequency_penalty", "response_format"}) | IGNORED
COMPLETION_KEYS = frozenset({"model", "prompt", "n", "temperature", "top_p", "max_tokens", "stop", "logprobs",
                             "stream", "stream_options", "seed", "presence_penalty", "frequency_penalty", "echo",
                             "suffix", "best_of", "user", "logit_bias"})


@dataclass
class Sampling:
    temperature: Optional[float] = None  # None: the run's agent.sampling
    top_p: Optional[float] = None
    max_tokens: Optional[int] = None  # None: agent.max_turn_tokens (bounded by the context)
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None


@dataclass
class ToolCallIn:
    id: str
    name: str
    arguments: str  # the JSON text, as OpenAI carries it


@dataclass
class Message:
    role: str
    content: str
    tool_calls: list[ToolCallIn] = field(default_factory=list)
    name: Optional[str] = None
    tool_call_id: Optional[str] = None


@dataclass
class ChatRequest:
    messages: list[Message]
    tools: list[dict[str, Any]]
    tool_choice: Any
    sampling: Sampling
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    model: str = ""


@dataclass
class CompletionRequest:
    prompt: Any  # str or list[int]
    sampling: Sampling
    logprobs: Optional[int] = None
    stream: bool = False
    include_usage: bool = False
    model: str = ""


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad("body", f"malformed JSON: {e}", "invalid_json") from None
    except RecursionError:
        raise bad("body", "JSON nested too deeply", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("body", f"must be a JSON object, got {type(body).__name__}", "invalid_type")
    return body


def _number(body: dict, key: str, lo: float, hi: float, *, lo_open: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(key, f"must be a number, got {v!r:.60}", "invalid_type")
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise bad(key, f"must be a finite number, got {v!r:.40}")
    if x < lo or x > hi or (lo_open and x == lo):
        raise bad(key, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return x


def _int(body: dict, key: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(key, f"must be an integer, got {v!r:.60}", "invalid_type")
    if v < lo or (hi is not None and v > hi):
        raise bad(key, f"must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(key, f"must be a boolean, got {v!r:.60}", "invalid_type")
    return v


def _common(body: dict, known: frozenset) -> tuple[Sampling, bool, bool, str]:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}", "unknown_parameter")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise bad("model", f"must be a string, got {model!r:.60}", "invalid_type")
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise bad("n", f"only n=1 is served (one trajectory per call), got {n}", "unsupported_value")
    if _int(body, "best_of", 1) not in (None, 1):
        raise bad("best_of", "only best_of=1 is served", "unsupported_value")
    for pen in ("presence_penalty", "frequency_penalty"):
        if _number(body, pen, -2.0, 2.0) not in (None, 0.0):
            raise bad(pen, "the engine applies no penalties; only 0 is served", "unsupported_value")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("stop", f"must be a string or a list of strings, got {stop!r:.60}", "invalid_type")
    if len(stops) > 4 or any(not s for s in stops):
        raise bad("stop", f"at most 4 non-empty strings, got {stops!r:.80}")
    seed = _int(body, "seed", -(2**63), 2**63 - 1)
    sampling = Sampling(temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True),
                        stop=stops, seed=seed)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}):
        raise bad("stream_options", f"must be an object with include_usage, got {opts!r:.60}", "invalid_type")
    include_usage = _bool(opts or {}, "include_usage")
    return sampling, stream, include_usage, model


def _text(content: Any, where: str) -> str:
    """A message's content: a string, null, or a list of text parts (anything else is refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{k}]", f"only text parts are served, got {part!r:.80}", "invalid_type")
            out.append(part["text"])
        return "".join(out)
    raise bad(f"{where}.content", f"must be a string, null or a list of text parts, got {content!r:.60}", "invalid_type")


def _tool_calls(raw: Any, where: str) -> list[ToolCallIn]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad(f"{where}.tool_calls", f"must be a list, got {raw!r:.60}", "invalid_type")
    out = []
    for k, c in enumerate(raw):
        w = f"{where}.tool_calls[{k}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments", ""), str):
            raise bad(w, f"must be {{id, type: function, function: {{name, arguments: str}}}}, got {c!r:.80}",
                      "invalid_type")
        cid = c.get("id", "")
        if not isinstance(cid, str):
            raise bad(f"{w}.id", f"must be a string, got {cid!r:.60}", "invalid_type")
        out.append(ToolCallIn(cid, fn["name"], fn.get("arguments", "")))
    return out


def _messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise bad("messages", f"must be a non-empty list, got {raw!r:.60}", "invalid_type")
    out = []
    for i, m in enumerate(raw):
        w = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(w, f"must be an object, got {m!r:.60}", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{w}.role", f"must be one of {', '.join(ROLES)}, got {role!r:.40}")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{w}.name", f"must be a string, got {name!r:.40}", "invalid_type")
        calls = _tool_calls(m.get("tool_calls"), w) if role == "assistant" else []
        if role != "assistant" and m.get("tool_calls") is not None:
            raise bad(f"{w}.tool_calls", f"only assistant messages carry tool_calls (role {role})")
        tcid = m.get("tool_call_id")
        if role == "tool" and not isinstance(tcid, str):
            raise bad(f"{w}.tool_call_id", f"a tool message needs a string tool_call_id, got {tcid!r:.40}", "invalid_type")
        if m.get("content") is None and role != "assistant":
            raise bad(f"{w}.content", f"a {role} message needs content", "invalid_type")
        out.append(Message("system" if role == "developer" else role, _text(m.get("content"), w), calls, name,
                           tcid if role == "tool" else None))
    return out


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad("tools", f"must be a list, got {raw!r:.60}", "invalid_type")
    for k, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]
                or not isinstance(fn.get("parameters", {}), dict)):
            raise bad(f"tools[{k}]", f"must be {{type: function, function: {{name, description, parameters}}}}, "
                      f"got {t!r:.80}", "invalid_type")
    return [dict(t, type="function") for t in raw]


def _tool_choice(raw: Any, tools: list[dict[str, Any]]) -> Any:
    if raw is None or raw in ("none", "auto", "required"):
        return raw or "auto"
    fn = raw.get("function") if isinstance(raw, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        if fn["name"] not in {t["function"]["name"] for t in tools}:
            raise bad("tool_choice", f"names function {fn['name']!r}, which is not in tools")
        return raw
    raise bad("tool_choice", f"must be none, auto, required or {{type: function, function: {{name}}}}, got {raw!r:.60}")


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    sampling, stream, include_usage, model = _common(body, CHAT_KEYS)
    mt, mct = _int(body, "max_tokens", 1), _int(body, "max_completion_tokens", 1)
    sampling.max_tokens = mct if mct is not None else mt
    top = _int(body, "top_logprobs", 0, 20)
    if top:
        raise bad("top_logprobs", "the engine returns only the sampled token's logprob; only 0 is served",
                  "unsupported_value")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise bad("response_format", "only {type: text} is served (no constrained decoding)", "unsupported_value")
    tools = _tools(body.get("tools"))
    return ChatRequest(messages=_messages(body.get("messages")), tools=tools,
                       tool_choice=_tool_choice(body.get("tool_choice"), tools), sampling=sampling,
                       logprobs=_bool(body, "logprobs"), stream=stream, include_usage=include_usage, model=model)


def parse_completion(body: dict[str, Any], vocab_size: int) -> CompletionRequest:
    sampling, stream, include_usage, model = _common(body, COMPLETION_KEYS)
    sampling.max_tokens = _int(body, "max_tokens", 1)
    if sampling.max_tokens is None:
        sampling.max_tokens = 16  # OpenAI's default for /v1/completions
    if _bool(body, "echo"):
        raise bad("echo", "echo is not served", "unsupported_value")
    if body.get("suffix") is not None:
        raise bad("suffix", "suffix is not served", "unsupported_value")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt):
            raise bad("prompt", f"a token-id prompt must be a non-empty list of ids below {vocab_size}", "invalid_type")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("prompt", f"must be a non-empty string or list of token ids, got {prompt!r:.60}", "invalid_type")
    return CompletionRequest(prompt=prompt, sampling=sampling, logprobs=_int(body, "logprobs", 0, 5), stream=stream,
                             include_usage=include_usage, model=model)
