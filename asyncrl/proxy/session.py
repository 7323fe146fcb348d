"""One episode's session: its calls, the exact-token prompt of each request, and calls -> chains.

Exact tokens (docs/design.md "The OpenAI-compatible proxy"). Every call is recorded (`CallRecord`:
prompt ids, output ids, logprobs, per-token versions, finish reason, what the agent was answered).
A request's prompt is assembled from the messages the agent sends:

- an assistant message whose content and tool calls (name, argument text) equal a recorded reply of
  this session is that reply's output ids, as the engine produced them (never re-tokenized);
- everything before the first such message is rendered by the chat template (tools included) and
  tokenized once; everything between two of them, and after the last one, is a template delta after
  the generated ids (`ChatFormat.delta_ids`, the delta tokenization of the built-in loops);
- an assistant message that matches no reply (the agent wrote or edited it) is plain template text.

Chains: in recording order, a call whose prompt ids start with the whole context (prompt + response)
of an existing chain extends the longest such chain: the ids between are inserted (mask 0), its
output generated (mask 1); any other call starts a chain of its own. One chain per episode is the
merged multi-turn trajectory; several mean the agent rewrote its history or ran several threads.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional

from asyncrl.agents.chat import ChatFormat
from asyncrl.agents.tool_calls import ToolCall, ToolFormatError
from asyncrl.agents.trajectory_builder import TrajectoryBuilder
from asyncrl.data.schema import Trajectory

from .errors import bad
from .requests import Message

MatchKey = tuple[str, tuple[tuple[str, str], ...]]


@dataclass
class CallRecord:
    id: str  # the completion id the agent was answered ("chatcmpl-..." or "cmpl-...")
    kind: str  # "chat" | "text"
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # the engine's: stop | length | abort
    text: str  # the decoded output
    content: Optional[str] = None  # chat: the reply's content (text less tool-call blocks)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chat: OpenAI tool_calls answered
    prompt_text: str = ""  # text completions: the prompt as sent
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat: the request's messages (readable)

    def key(self) -> MatchKey:
        return (self.content or "", tuple((c["function"]["name"], c["function"]["arguments"]) for c in self.tool_calls))


def message_key(m: Message) -> MatchKey:
    return (m.content, tuple((c.name, c.arguments) for c in m.tool_calls))


def _arguments(text: str) -> Any:
    try:
        obj = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return text
    return obj


def render_message(m: Message, supports_tools: bool, tool_format: Any) -> dict[str, Any]:
    """A request message as the chat template takes it; tool calls as the template renders them, or, for a
    template without tool support, written into the content by `tool_format` (agent.tool_parser's parser:
    its `render`, asyncrl/agents/tool_calls.py); a parser that cannot write them is a 400 naming it."""
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "tool" and m.name:
        d["name"] = m.name
    if m.tool_calls:
        if supports_tools:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": _arguments(c.arguments)}} for c in m.tool_calls]
        else:
            calls = [ToolCall(c.name, _arguments(c.arguments)) for c in m.tool_calls]
            try:
                if not callable(getattr(tool_format, "render", None)):
                    raise ToolFormatError(f"agent.tool_parser's parser ({type(tool_format).__name__}) has no render, "
                                          "and the chat template does not render tool_calls")
                d["content"] = tool_format.render(m.content or "", calls)
            except ToolFormatError as e:
                raise bad("messages", f"an assistant message's tool_calls cannot be written as text: {e}") from None
    return d


@dataclass
class Chain:
    builder: TrajectoryBuilder
    records: list[int]  # indices into the session's records

    def context(self) -> list[int]:
        return self.builder.context()


def build_chains(records: list[CallRecord]) -> list[Chain]:
    """The rule of the module docstring: each call extends the longest chain whose context its prompt
    starts with, else starts a new chain."""
    chains: list[Chain] = []
    for i, r in enumerate(records):
        best: Optional[Chain] = None
        for c in chains:
            ctx = c.context()
            if len(ctx) <= len(r.prompt_ids) and r.prompt_ids[: len(ctx)] == ctx and (
                    best is None or len(ctx) > len(best.context())):
                best = c
        if best is None:
            best = Chain(TrajectoryBuilder(r.prompt_ids, budget=1 << 62), [])
            chains.append(best)
        else:
            best.builder.add_inserted(r.prompt_ids[len(best.context()):])
        best.builder.add_generated(r.output_ids, r.logprobs, r.versions)
        best.records.append(i)
    return chains


class Session:
    """One episode's API key, calls and rewards."""

    def __init__(self, uid: str, max_calls: int):
        self.uid = uid
        self.key = "sk-asyncrl-" + secrets.token_urlsafe(24)
        self.max_calls = max_calls
        self.records: list[CallRecord] = []
        self.started = 0  # calls admitted (records are appended when they finish)
        self.reward: Optional[float] = None  # POST /rl/set_reward without completion_id
        self.completion_rewards: dict[str, float] = {}
        self.bad_requests = 0
        self.sampling_overridden = 0  # calls whose temperature differs from agent.sampling's
        self.messages_mapped = 0  # assistant messages of requests mapped back to recorded output ids
        self.engine_error: Optional[BaseException] = None
        self.closed = False

    def completion_ids(self) -> set[str]:
        return {r.id for r in self.records}

    def find(self, m: Message) -> Optional[CallRecord]:
        """The latest chat reply of this session that `m` repeats exactly (content and tool calls)."""
        if m.role != "assistant":
            return None
        k = message_key(m)
        for r in reversed(self.records):
            if r.kind == "chat" and r.key() == k:
                return r
        return None

    def chat_prompt(self, chat: ChatFormat, messages: list[Message], tool_format: Any) -> tuple[list[int], int]:
        """The prompt ids of a chat request (module docstring) and how many assistant messages were
        mapped to recorded output ids. `tool_format`: the parser that writes tool calls for a template
        without tool support (`render_message`)."""
        rendered = [render_message(m, chat.supports_tools, tool_format) for m in messages]
        matches = [self.find(m) if i > 0 else None for i, m in enumerate(messages)]
        merged = chat.prompt_messages(rendered)  # may open with a new system message for the tools text
        matches = [None] * (len(merged) - len(rendered)) + matches
        rendered = merged
        ids: Optional[list[int]] = None
        start, last_out, mapped = 0, None, 0
        for i, rec in enumerate(matches):
            if rec is None:
                continue
            if ids is None:
                ids = chat.encode(chat.render(rendered[:i], add_generation_prompt=True))
            else:
                ids += chat.delta_ids(rendered[start:i], last_out)
            ids += rec.output_ids
            last_out, start, mapped = rec.output_ids, i + 1, mapped + 1
        if ids is None:
            return chat.prompt_ids(rendered), 0
        return ids + chat.delta_ids(rendered[start:], last_out), mapped

    def text_prompt(self, encode: Any, prompt: Any) -> list[int]:
        """A text completion's prompt ids: a prompt that starts with an earlier call's prompt + output
        text continues that call's exact ids; the rest is tokenized."""
        if isinstance(prompt, list):
            return list(prompt)
        for r in reversed(self.records):
            head = r.prompt_text + r.text
            if r.kind == "text" and prompt.startswith(head):
                return r.prompt_ids + r.output_ids + (encode(prompt[len(head):]) if len(prompt) > len(head) else [])
        return encode(prompt)

    def trajectories(self, *, uid: str, episode_reward: float, discount: float,
                     **fields: Any) -> list[tuple[Trajectory, Chain]]:
        """One trajectory per chain, the chain holding the last call first (uid `uid`; the others
        `uid-c1`, ...). A chain's reward: the reward set for its last completion, else `episode_reward`;
        times discount ** (calls recorded after it)."""
        chains = build_chains(self.records)
        n = len(self.records)
        chains.sort(key=lambda c: -c.records[-1])
        out = []
        for k, c in enumerate(chains):
            last = self.records[c.records[-1]]
            base = self.completion_rewards.get(last.id, episode_reward)
            reward = float(base) * discount ** (n - 1 - c.records[-1])
            finish = last.finish_reason if last.finish_reason in ("stop", "length", "abort") else "stop"
            msgs = list(last.messages) + [{"role": "assistant", "content": last.text}]
            traj = c.builder.build(uid=uid if k == 0 else f"{uid}-c{k}", reward=reward, num_turns=len(c.records),
                                   finish_reason=finish, messages=msgs, episode_chains=len(chains), **fields)
            out.append((traj, c))
        return out
